//! Channels-last layout (level 3): chains of depthwise and dense convolutions (MobileNet's
//! stem and inverted residual blocks) run on `[N, H, W, C]` tensors.
//!
//! In NCHW a depthwise convolution walks each channel's plane on its own: short rows, borders
//! on every plane, vectors that run along a row. In NHWC the same convolution is a vector
//! multiply-add over channels per output pixel and tap, reading whole cache lines, and a dense
//! (one group) convolution is one GEMM of the pixels' patches (`[H*W, kh*kw*C]`; the input
//! itself for a 1x1) with the filter. A region of such convolutions linked through their data
//! input or residual becomes `com.ferrum.NhwcConv` nodes (weights stored `[kh, kw, C/group,
//! M]`: a GEMM's B for a dense one, tap-major rows for a depthwise one), with a `Transpose`
//! where a value enters the region (except an image read straight by the direct kernel of a
//! convolution over a few channels, which takes its planes as they are) and one where a value
//! leaves it (read outside, or a graph output). Squeeze-and-excitation blocks (EfficientNet,
//! MobileNetV3) stay inside: a GlobalAveragePool of a region value reads it channels-last
//! (`com.ferrum.NhwcGlobalAveragePool`, whose `[N, C, 1, 1]` output is the same memory in
//! either layout, so the gate's 1x1 convolutions stay as they are), and the `Mul` by the gate
//! `[N, C, 1, 1]` becomes a `Mul` of the NHWC tensor by the gate reshaped to `[N, 1, 1, C]`.
//! A region is changed only when it holds a depthwise convolution and its boundary transposes
//! move at most a quarter of the elements its depthwise convolutions read, so networks without
//! depthwise convolutions (ResNet) are left alone. Needs static shapes. `FERRUM_NO_NHWC=1`
//! turns the pass off. Then a 1x1 expansion too large for the cache and the depthwise
//! convolution that alone reads it become one node that never holds the expanded tensor
//! ([`expand_depthwise`]).

use std::collections::{HashMap, HashSet};

use super::{attr_i, const_f32, constant, is_op, Uses, DOMAIN};
use crate::infer::static_shapes;
use crate::ir::{Attr, Dim, Model, Node, ValueId, ValueInfo, ValueType};
use crate::tensor::{DType, Tensor};

/// What a region member is.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// A convolution the channels-last kernels take.
    Conv { depthwise: bool },
    /// A squeeze-and-excitation gate: `Mul(x, s)` with `s` of shape `[N or 1, C, 1, 1]` (input
    /// `s_slot` of the node), a per-channel scale that broadcasts over `[N, H, W, C]` once
    /// reshaped to `[N or 1, 1, 1, C]`.
    Scale { s: ValueId, s_slot: usize },
    /// A GlobalAveragePool: reads the channels-last tensor in place; its output `[N, C, 1, 1]`
    /// is NCHW as before (one pixel: the same memory either way) and is not a region value.
    Pool,
}

/// A member of a channels-last region: a convolution, or an op that reads or makes
/// channels-last tensors between convolutions (squeeze-and-excitation's pool and gate).
struct Cand {
    node: usize,
    kind: Kind,
    x: ValueId,
    z: Option<ValueId>,
    y: ValueId,
    /// Output shape, NCHW.
    out: Vec<usize>,
    /// Elements of the input, NCHW.
    in_elems: usize,
}

fn ints(n: &Node, name: &str) -> Option<Vec<i64>> {
    match n.attrs.get(name) {
        Some(Attr::Ints(v)) => Some(v.clone()),
        None => None,
        _ => Some(vec![-1]),
    }
}

/// A GlobalAveragePool of a 4-D tensor, or a `Mul` of a 4-D tensor by a per-channel scale
/// `[N or 1, C, 1, 1]` (squeeze-and-excitation blocks: EfficientNet, MobileNetV3). Either joins
/// a region only through its data input; whether that is float32 follows from the convolution
/// making it (the region's members take float32 only).
fn se_member(shapes: &crate::infer::Shapes, i: usize, n: &Node) -> Option<Cand> {
    let y = n.outputs.first().copied().flatten()?;
    let out = shapes.get(Some(y)).filter(|s| s.len() == 4)?.clone();
    if n.outputs.len() != 1 || out.contains(&0) {
        return None;
    }
    if is_op(n, "GlobalAveragePool") && n.inputs.len() == 1 {
        let x = n.inputs[0]?;
        let xs = shapes.get(Some(x)).filter(|s| s.len() == 4)?;
        if xs.contains(&0) || out != [xs[0], xs[1], 1, 1] {
            return None;
        }
        return Some(Cand {
            node: i,
            kind: Kind::Pool,
            x,
            z: None,
            y,
            out,
            in_elems: xs.iter().product(),
        });
    }
    if !is_op(n, "Mul") || n.inputs.len() != 2 {
        return None;
    }
    let [a, b] = [n.inputs[0]?, n.inputs[1]?];
    let gate = |s: ValueId| {
        shapes.get(Some(s)).is_some_and(|ss| {
            ss.len() == 4 && (ss[0] == 1 || ss[0] == out[0]) && ss[1] == out[1] && ss[2..] == [1, 1]
        })
    };
    let (x, s, s_slot) = if shapes.get(Some(a)) == Some(&out) && gate(b) {
        (a, b, 1)
    } else if shapes.get(Some(b)) == Some(&out) && gate(a) {
        (b, a, 0)
    } else {
        return None;
    };
    Some(Cand {
        node: i,
        kind: Kind::Scale { s, s_slot },
        x,
        z: None,
        y,
        in_elems: out.iter().product(),
        out,
    })
}

fn candidate(model: &Model, shapes: &crate::infer::Shapes, i: usize, n: &Node) -> Option<Cand> {
    if is_op(n, "Mul") || is_op(n, "GlobalAveragePool") {
        return se_member(shapes, i, n);
    }
    let g = &model.graph;
    let fused = n.domain == DOMAIN && n.op == "FusedConv";
    if !(is_op(n, "Conv") || fused) || n.outputs.len() != 1 {
        return None;
    }
    let x = n.inputs.first().copied().flatten()?;
    let w = constant(g, n.inputs.get(1).copied().flatten()?)?;
    let y = n.outputs[0]?;
    if w.dtype() != DType::F32 || w.rank() != 4 {
        return None;
    }
    let [m, cg, kh, kw] = [w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]];
    if let Some(b) = n.inputs.get(2).copied().flatten() {
        if const_f32(g, Some(b)).is_none_or(|b| b.len() != m) {
            return None;
        }
    }
    if let Some(Attr::Str(p)) = n.attrs.get("auto_pad") {
        if p.as_slice() != b"NOTSET" {
            return None;
        }
    }
    let xs = shapes.get(Some(x)).filter(|s| s.len() == 4)?;
    let out = shapes.get(Some(y)).filter(|s| s.len() == 4)?.clone();
    if xs.contains(&0) || out.contains(&0) {
        return None;
    }
    // A float32 filter means a float32 input (ONNX's type constraint); a type said otherwise
    // keeps the node as it is.
    if let ValueType::Tensor { dtype: Some(t), .. } = &model.value(x).ty {
        if *t != DType::F32 {
            return None;
        }
    }
    let c = xs[1];
    let group = attr_i(n, "group", 1).max(1) as usize;
    let strides = ints(n, "strides").unwrap_or(vec![1, 1]);
    let pads = ints(n, "pads").unwrap_or(vec![0; 4]);
    let dil = ints(n, "dilations").unwrap_or(vec![1, 1]);
    if strides.len() != 2 || pads.len() != 4 || dil.len() != 2 {
        return None;
    }
    if strides.iter().chain(&dil).any(|&v| v < 1) || pads.iter().any(|&v| v < 0) {
        return None;
    }
    let depthwise = group == c && cg == 1 && m == c;
    let dense = group == 1 && cg == c;
    if !(depthwise || dense) || out[0] != xs[0] || out[1] != m || kh == 0 || kw == 0 {
        return None;
    }
    let z = if fused {
        n.inputs.get(3).copied().flatten()
    } else {
        None
    };
    if let Some(z) = z {
        if shapes.get(Some(z)) != Some(&out) {
            return None;
        }
    }
    Some(Cand {
        node: i,
        kind: Kind::Conv { depthwise },
        x,
        z,
        y,
        out,
        in_elems: xs.iter().product(),
    })
}

/// True when `c`'s output is needed in NCHW: a graph output, or read by a node that `region`
/// does not place (by candidate index) among the region's members, or by a member other than
/// as its data input or residual.
fn leaves(uses: &Uses, cands: &[Cand], c: &Cand, region: impl Fn(usize) -> Option<usize>) -> bool {
    uses.pinned.contains(&c.y)
        || uses.readers.get(&c.y).is_some_and(|rs| {
            rs.iter()
                .any(|&ri| region(ri).is_none_or(|q| cands[q].x != c.y && cands[q].z != Some(c.y)))
        })
}

fn find(p: &mut [usize], mut i: usize) -> usize {
    while p[i] != i {
        p[i] = p[p[i]];
        i = p[i];
    }
    i
}

/// `[a, b, c, d]` permuted by `perm`.
fn permuted(s: &[usize], perm: [usize; 4]) -> Vec<usize> {
    perm.iter().map(|&p| s[p]).collect()
}

const TO_NHWC: [usize; 4] = [0, 2, 3, 1];
const TO_NCHW: [usize; 4] = [0, 3, 1, 2];

fn new_value(model: &mut Model, name: String, shape: &[usize]) -> ValueId {
    new_typed_value(model, name, shape, Some(DType::F32))
}

fn new_typed_value(
    model: &mut Model,
    name: String,
    shape: &[usize],
    dtype: Option<DType>,
) -> ValueId {
    let id = ValueId(model.values.len() as u32);
    model.values.push(ValueInfo {
        name,
        ty: ValueType::Tensor {
            dtype,
            shape: Some(shape.iter().map(|&d| Dim::Known(d)).collect()),
        },
    });
    id
}

fn transpose_node(name: String, from: ValueId, to: ValueId, perm: [usize; 4]) -> Node {
    let mut attrs = std::collections::BTreeMap::new();
    attrs.insert(
        "perm".into(),
        Attr::Ints(perm.iter().map(|&p| p as i64).collect()),
    );
    Node {
        name,
        op: "Transpose".into(),
        domain: String::new(),
        opset: 13,
        inputs: vec![Some(from)],
        outputs: vec![Some(to)],
        attrs,
        implicit_inputs: vec![],
    }
}

/// Where values enter a channels-last region during a rewrite: the nodes written so far, each
/// entering value's NHWC twin, and the count of transposes made.
struct Edge<'a> {
    shapes: &'a crate::infer::Shapes,
    out_nodes: &'a mut Vec<Node>,
    nhwc_of: &'a mut HashMap<ValueId, ValueId>,
    entered: &'a mut usize,
}

impl Edge<'_> {
    /// The channels-last twin of `v` (elements `dtype`): made once, by a transpose appended to
    /// the nodes, then reused.
    fn twin(&mut self, model: &mut Model, v: ValueId, dtype: Option<DType>) -> ValueId {
        if let Some(&t) = self.nhwc_of.get(&v) {
            return t;
        }
        let s = permuted(self.shapes.get(Some(v)).expect("a static shape"), TO_NHWC);
        let name = format!("{}#nhwc", model.value(v).name);
        let t = new_typed_value(model, name.clone(), &s, dtype);
        self.out_nodes.push(transpose_node(name, v, t, TO_NHWC));
        *self.entered += 1;
        self.nhwc_of.insert(v, t);
        t
    }
}

/// Whether the dense convolution `n` takes its NCHW input `x` as it is ([`direct`]'s planes: one
/// group, at most [`direct::MAX_CIN`] channels, a window wider than 1x1, on a CPU where the
/// direct kernel runs).
///
/// [`direct`]: ferrum_kernels::direct
/// [`direct::MAX_CIN`]: ferrum_kernels::direct::MAX_CIN
fn reads_planes(model: &Model, shapes: &crate::infer::Shapes, n: &Node, x: ValueId) -> bool {
    let Some(w) = n
        .inputs
        .get(1)
        .copied()
        .flatten()
        .and_then(|w| constant(&model.graph, w))
    else {
        return false;
    };
    let (ws, xs) = (w.shape(), shapes.get(Some(x)));
    xs.is_some_and(|xs| {
        xs.len() == 4
            && ws.len() == 4
            && ws[1] == xs[1]
            && ws[2] * ws[3] > 1
            && ferrum_kernels::direct::worthwhile(xs[1])
    })
}

/// The filter `[M, C/group, kh, kw]` as `[kh, kw, C/group, M]`.
pub(crate) fn oihw_to_hwio(w: &Tensor) -> Option<Tensor> {
    let s = w.shape();
    let [m, cg, kh, kw] = [s[0], s[1], s[2], s[3]];
    let v = w.as_slice::<f32>().ok()?;
    let mut out = vec![0f32; v.len()];
    for o in 0..m {
        for ci in 0..cg {
            for t in 0..kh * kw {
                out[(t * cg + ci) * m + o] = v[(o * cg + ci) * kh * kw + t];
            }
        }
    }
    Tensor::from_vec(vec![kh, kw, cg, m], out).ok()
}

/// The squeeze-and-excitation gate `s` (`[N or 1, C, 1, 1]`) as `[N or 1, 1, 1, C]`, the same
/// elements: a reshaped initializer for a constant, else a `Reshape` appended to `out_nodes`.
fn nhwc_gate(
    model: &mut Model,
    shapes: &crate::infer::Shapes,
    out_nodes: &mut Vec<Node>,
    s: ValueId,
) -> ValueId {
    let ss = shapes.get(Some(s)).expect("a static shape");
    let to = vec![ss[0], 1, 1, ss[1]];
    let hint = format!("{}#nhwc", model.value(s).name);
    if let Some(t) = constant(&model.graph, s) {
        let t = t.clone().reshape(to).expect("the same element count");
        return super::add_initializer(model, &hint, t);
    }
    let dims: Vec<i64> = to.iter().map(|&d| d as i64).collect();
    let dims = Tensor::from_vec(vec![4], dims).expect("four dims");
    let dims = super::add_initializer(model, &format!("{hint}#shape"), dims);
    let g = new_typed_value(model, hint.clone(), &to, value_dtype(model, s));
    out_nodes.push(Node {
        name: hint,
        op: "Reshape".into(),
        domain: String::new(),
        opset: 14,
        inputs: vec![Some(s), Some(dims)],
        outputs: vec![Some(g)],
        attrs: Default::default(),
        implicit_inputs: vec![],
    });
    g
}

/// The pass: see the module's documentation. Returns the number of nodes (convolutions, pools
/// and gates) moved to channels-last.
pub fn channels_last(model: &mut Model, log: &mut Vec<String>) -> usize {
    if std::env::var("FERRUM_NO_NHWC").is_ok_and(|v| v != "0") {
        return 0;
    }
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let g = &model.graph;
    if g.nodes
        .iter()
        .any(|n| n.domain == DOMAIN && n.op == "NhwcConv")
    {
        return 0;
    }
    let cands: Vec<Cand> = g
        .nodes
        .iter()
        .enumerate()
        .filter_map(|(i, n)| candidate(model, &shapes, i, n))
        .collect();
    if cands.is_empty() {
        return 0;
    }
    let uses = Uses::of(g);
    let by_node: HashMap<usize, usize> =
        cands.iter().enumerate().map(|(k, c)| (c.node, k)).collect();
    // Values a member makes channels-last (a pool's output stays NCHW).
    let by_output: HashMap<ValueId, usize> = cands
        .iter()
        .enumerate()
        .filter(|(_, c)| c.kind != Kind::Pool)
        .map(|(k, c)| (c.y, k))
        .collect();
    // Regions: candidates joined through a value one produces and another reads as its data
    // input or residual.
    let mut parent: Vec<usize> = (0..cands.len()).collect();
    for (k, c) in cands.iter().enumerate() {
        for v in std::iter::once(c.x).chain(c.z) {
            if let Some(&p) = by_output.get(&v) {
                let (a, b) = (find(&mut parent, p), find(&mut parent, k));
                parent[a] = b;
            }
        }
    }
    let roots: Vec<usize> = (0..cands.len()).map(|k| find(&mut parent, k)).collect();
    // Per region: depthwise input elements, and elements moved by its boundary transposes.
    let mut dw_elems: HashMap<usize, usize> = HashMap::new();
    let mut boundary: HashMap<usize, usize> = HashMap::new();
    let mut entries: HashSet<(usize, ValueId)> = HashSet::new();
    for (k, c) in cands.iter().enumerate() {
        let r = roots[k];
        if c.kind == (Kind::Conv { depthwise: true }) {
            *dw_elems.entry(r).or_default() += c.in_elems;
        }
        for v in std::iter::once(c.x).chain(c.z) {
            let inside = by_output.get(&v).is_some_and(|&p| roots[p] == r);
            if !inside && entries.insert((r, v)) {
                *boundary.entry(r).or_default() +=
                    shapes.get(Some(v)).map_or(0, |s| s.iter().product());
            }
        }
        let outside = c.kind != Kind::Pool
            && leaves(&uses, &cands, c, |ri| {
                by_node.get(&ri).copied().filter(|&q| roots[q] == r)
            });
        if outside {
            *boundary.entry(r).or_default() += c.out.iter().product::<usize>();
        }
    }
    let chosen: HashSet<usize> = dw_elems
        .iter()
        .filter(|&(r, &dw)| boundary.get(r).copied().unwrap_or(0) * 4 <= dw)
        .map(|(&r, _)| r)
        .collect();
    if chosen.is_empty() {
        return 0;
    }
    let member = |node: usize| {
        by_node
            .get(&node)
            .filter(|&&k| chosen.contains(&roots[k]))
            .copied()
    };
    // Rewrite, keeping the node order: a transpose into NHWC before a value's first reader in
    // the region, one back to NCHW right after a region output read elsewhere.
    let nodes = std::mem::take(&mut model.graph.nodes);
    let mut out_nodes: Vec<Node> = Vec::with_capacity(nodes.len() + 8);
    let mut nhwc_of: HashMap<ValueId, ValueId> = HashMap::new();
    let mut hwio_of: HashMap<ValueId, ValueId> = HashMap::new();
    let mut moved = 0;
    let mut others = 0;
    let mut entered = 0;
    let mut left = 0;
    for (i, n) in nodes.into_iter().enumerate() {
        let Some(k) = member(i) else {
            out_nodes.push(n);
            continue;
        };
        let c = &cands[k];
        // An image entering the region straight into a convolution of a few input channels
        // that the direct kernel runs is read where it lies, as planes, not turned first.
        let planes = c.kind == (Kind::Conv { depthwise: false })
            && !nhwc_of.contains_key(&c.x)
            && reads_planes(model, &shapes, &n, c.x);
        let mut twin = |model: &mut Model, out_nodes: &mut Vec<Node>, v: ValueId| -> ValueId {
            let mut edge = Edge {
                shapes: &shapes,
                out_nodes,
                nhwc_of: &mut nhwc_of,
                entered: &mut entered,
            };
            edge.twin(model, v, Some(DType::F32))
        };
        let x = if planes {
            c.x
        } else {
            twin(model, &mut out_nodes, c.x)
        };
        let mut node = match c.kind {
            Kind::Pool => {
                // Its output stays as it was: no twin, nothing to turn back.
                log.push(format!("{} -> NhwcGlobalAveragePool", n.name));
                out_nodes.push(Node {
                    op: "NhwcGlobalAveragePool".into(),
                    domain: DOMAIN.into(),
                    opset: 1,
                    inputs: vec![Some(x)],
                    attrs: Default::default(),
                    ..n
                });
                others += 1;
                continue;
            }
            Kind::Scale { s, s_slot } => {
                let mut inputs = vec![Some(x); 2];
                inputs[s_slot] = Some(nhwc_gate(model, &shapes, &mut out_nodes, s));
                log.push(format!(
                    "{} -> Mul on channels-last (per-channel gate)",
                    n.name
                ));
                others += 1;
                Node { inputs, ..n }
            }
            Kind::Conv { depthwise } => {
                let z = c.z.map(|z| twin(model, &mut out_nodes, z));
                let w = n.inputs[1].expect("a filter");
                let hwio = match hwio_of.get(&w) {
                    Some(&h) => h,
                    None => {
                        let t = oihw_to_hwio(constant(&model.graph, w).expect("a constant filter"))
                            .expect("a float32 filter");
                        let name = format!("{}#hwio", model.value(w).name);
                        let h = super::add_initializer(model, &name, t);
                        hwio_of.insert(w, h);
                        h
                    }
                };
                let mut attrs = std::collections::BTreeMap::new();
                for key in [
                    "group",
                    "strides",
                    "pads",
                    "dilations",
                    "activation",
                    "activation_params",
                ] {
                    if let Some(a) = n.attrs.get(key) {
                        attrs.insert(key.to_string(), a.clone());
                    }
                }
                if planes {
                    attrs.insert("nchw_input".into(), Attr::Int(1));
                }
                let bias = n.inputs.get(2).copied().flatten();
                let mut inputs = vec![Some(x), Some(hwio), bias];
                if let Some(z) = z {
                    inputs.push(Some(z));
                }
                log.push(format!(
                    "{} -> NhwcConv ({})",
                    n.name,
                    if depthwise { "depthwise" } else { "dense" }
                ));
                moved += 1;
                Node {
                    name: n.name.clone(),
                    op: "NhwcConv".into(),
                    domain: DOMAIN.into(),
                    opset: 1,
                    inputs,
                    outputs: vec![],
                    attrs,
                    implicit_inputs: vec![],
                }
            }
        };
        // The output's channels-last twin, turned back where it is read outside the region.
        let yname = format!("{}#nhwc", model.value(c.y).name);
        let y = new_value(model, yname, &permuted(&c.out, TO_NHWC));
        nhwc_of.insert(c.y, y);
        node.outputs = vec![Some(y)];
        let back = format!("{}#nchw", node.name);
        out_nodes.push(node);
        if leaves(&uses, &cands, c, member) {
            out_nodes.push(transpose_node(back, y, c.y, TO_NCHW));
            left += 1;
        }
    }
    model.graph.nodes = out_nodes;
    if moved > 0 {
        log.push(format!(
            "channels-last: {moved} convolutions, {entered} transposes in, {left} out, \
             {others} pools and gates"
        ));
    }
    moved + others
}

/// Expanded tensors at least this large (bytes) are not kept: beside the block's input and
/// output such an expansion outgrows a core's L2 cache (1-2 MiB), so writing it and reading it
/// back in the depthwise convolution goes to L3 or memory. (MobileNetV2: faster fused from 28 x
/// 28 x 192, 602 kB, up; no faster at 14 x 14 x 576, 451 kB.)
const EXPAND_MIN_BYTES: usize = 1 << 19;

/// Inverted residual blocks (level 3, after [`channels_last`]): a 1x1 `NhwcConv` (stride 1,
/// no padding, no residual, an activation the kernels apply in registers: any but Tanh and
/// GeluTanh) whose output only a depthwise `NhwcConv`
/// reads, where that output takes at least [`EXPAND_MIN_BYTES`], becomes one
/// `NhwcExpandDepthwise` node that makes the expanded rows as the depthwise convolution needs
/// them ([`crate::ops::nhwc::expand_depthwise`]). Returns the number of pairs fused.
pub fn expand_depthwise(model: &mut Model, log: &mut Vec<String>) -> usize {
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let g = &model.graph;
    let uses = Uses::of(g);
    let nhwc = |n: &Node| n.domain == DOMAIN && n.op == "NhwcConv";
    let filter = |n: &Node| {
        let w = constant(g, n.inputs.get(1).copied().flatten()?)?;
        (w.dtype() == DType::F32 && w.rank() == 4).then(|| w.shape().to_vec())
    };
    let zeros = |n: &Node, name: &str| ints(n, name).is_none_or(|v| v.iter().all(|&x| x == 0));
    let ones = |n: &Node, name: &str| ints(n, name).is_none_or(|v| v.iter().all(|&x| x == 1));
    let vector_act = |n: &Node| crate::ops::act_in_registers(n, "activation");
    // (expansion, depthwise) node pairs.
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    for (j, n) in g.nodes.iter().enumerate() {
        let Some(wd) = filter(n).filter(|_| nhwc(n)) else {
            continue;
        };
        let Some(mid) = n.inputs.first().copied().flatten() else {
            continue;
        };
        let m = wd[3];
        if wd[2] != 1 || attr_i(n, "group", 1) != m as i64 || uses.sole_reader(mid) != Some(j) {
            continue;
        }
        let Some(&i) = uses.producer.get(&mid) else {
            continue;
        };
        let e = &g.nodes[i];
        let Some(we) = filter(e).filter(|_| nhwc(e)) else {
            continue;
        };
        let bytes = shapes
            .get(Some(mid))
            .map_or(0, |s| s.iter().product::<usize>() * 4);
        let fits = we[..2] == [1, 1]
            && we[3] == m
            && attr_i(e, "group", 1) == 1
            && attr_i(e, "nchw_input", 0) == 0
            && ones(e, "strides")
            && zeros(e, "pads")
            && e.inputs.len() <= 3
            && e.outputs.len() == 1
            && vector_act(e)
            && bytes >= EXPAND_MIN_BYTES;
        if fits {
            pairs.push((i, j));
        }
    }
    if pairs.is_empty() {
        return 0;
    }
    let expansions: HashSet<usize> = pairs.iter().map(|&(i, _)| i).collect();
    let by_dw: HashMap<usize, usize> = pairs.iter().map(|&(i, j)| (j, i)).collect();
    let nodes = std::mem::take(&mut model.graph.nodes);
    let mut out_nodes = Vec::with_capacity(nodes.len());
    for (j, n) in nodes.iter().enumerate() {
        if expansions.contains(&j) {
            continue;
        }
        let Some(&i) = by_dw.get(&j) else {
            out_nodes.push(n.clone());
            continue;
        };
        let e = &nodes[i];
        let mut attrs = n.attrs.clone();
        for (from, to) in [
            ("activation", "expand_activation"),
            ("activation_params", "expand_activation_params"),
        ] {
            attrs.remove(to);
            if let Some(a) = e.attrs.get(from) {
                attrs.insert(to.into(), a.clone());
            }
        }
        let at = |n: &Node, k: usize| n.inputs.get(k).copied().flatten();
        let mut inputs = vec![at(e, 0), at(e, 1), at(e, 2), at(n, 1), at(n, 2)];
        if let Some(z) = at(n, 3) {
            inputs.push(Some(z));
        }
        log.push(format!("{} + {} -> NhwcExpandDepthwise", e.name, n.name));
        out_nodes.push(Node {
            name: n.name.clone(),
            op: "NhwcExpandDepthwise".into(),
            domain: DOMAIN.into(),
            opset: 1,
            inputs,
            outputs: n.outputs.clone(),
            attrs,
            implicit_inputs: vec![],
        });
    }
    model.graph.nodes = out_nodes;
    pairs.len()
}

/// A node of an 8-bit channels-last region: a QLinearConv the channels-last kernel takes, or a
/// QLinearAdd of two tensors of one shape.
struct QMember {
    node: usize,
    conv: bool,
    /// A max pool on the quantized values: `QuantizeLinear(MaxPool(DequantizeLinear(q)))` with
    /// one scale and zero point (`node` is the QuantizeLinear), the DequantizeLinear and MaxPool
    /// nodes that it replaces.
    pool: Option<[usize; 2]>,
    /// The data inputs (X; or A and B) and the output, with the output's NCHW shape.
    data: Vec<ValueId>,
    y: ValueId,
    out: Vec<usize>,
    /// Elements the NCHW kernel turns around (a QLinearConv's X and Y).
    turned: usize,
}

/// A constant of `len` values (one of the given lengths) and type `dtype` at input `i`, or no
/// input there when `optional`.
fn q_param(g: &crate::ir::Graph, n: &Node, i: usize, dtypes: &[DType], lens: &[usize]) -> bool {
    match n.inputs.get(i).copied().flatten() {
        None => false,
        Some(v) => constant(g, v).is_some_and(|t| {
            dtypes.contains(&t.dtype())
                && lens.contains(&t.len())
                && (t.dtype() != DType::F32
                    || t.as_slice::<f32>()
                        .is_ok_and(|x| x.iter().all(|v| v.is_finite())))
        }),
    }
}

fn q_member(
    model: &Model,
    shapes: &crate::infer::Shapes,
    uses: &Uses,
    i: usize,
    n: &Node,
) -> Option<QMember> {
    let g = &model.graph;
    let y = n.outputs.first().copied().flatten()?;
    let out = shapes.get(Some(y)).filter(|s| s.len() == 4)?.clone();
    if out.contains(&0) || n.outputs.len() != 1 {
        return None;
    }
    let eight = [DType::U8, DType::I8];
    if is_op(n, "QuantizeLinear") {
        return q_pool(model, shapes, uses, i, n, y, out);
    }
    if n.domain == DOMAIN && n.op == "QLinearAdd" {
        let (a, b) = (
            n.inputs.first().copied().flatten()?,
            n.inputs.get(3).copied().flatten()?,
        );
        if shapes.get(Some(a)) != Some(&out) || shapes.get(Some(b)) != Some(&out) {
            return None;
        }
        return Some(QMember {
            node: i,
            conv: false,
            pool: None,
            data: vec![a, b],
            y,
            out,
            turned: 0,
        });
    }
    if !is_op(n, "QLinearConv") || attr_i(n, "group", 1) != 1 {
        return None;
    }
    if let Some(Attr::Str(p)) = n.attrs.get("auto_pad") {
        if p.as_slice() != b"NOTSET" {
            return None;
        }
    }
    let x = n.inputs.first().copied().flatten()?;
    let xs = shapes.get(Some(x)).filter(|s| s.len() == 4)?;
    let w = constant(g, n.inputs.get(3).copied().flatten()?)?;
    if !eight.contains(&w.dtype()) || w.rank() != 4 || w.shape()[1] != xs[1] || xs.contains(&0) {
        return None;
    }
    let m = w.shape()[0];
    if out[0] != xs[0] || out[1] != m {
        return None;
    }
    // The parameters the channels-last kernel takes (as `qlinear_conv_layout` checks them at
    // run time): per-tensor X and Y, W per tensor or per output channel, an int32 bias.
    let x_zp = n
        .inputs
        .get(2)
        .copied()
        .flatten()
        .and_then(|v| constant(g, v))?;
    let ok = q_param(g, n, 1, &[DType::F32], &[1])
        && x_zp.len() == 1
        && eight.contains(&x_zp.dtype())
        && q_param(g, n, 4, &[DType::F32], &[1, m])
        && (n.inputs.get(5).copied().flatten().is_none()
            || q_param(g, n, 5, &[w.dtype()], &[1, m]))
        && q_param(g, n, 6, &[DType::F32], &[1])
        && q_param(g, n, 7, &eight, &[1])
        && (n.inputs.get(8).copied().flatten().is_none() || q_param(g, n, 8, &[DType::I32], &[m]));
    if !ok {
        return None;
    }
    if let ValueType::Tensor { dtype: Some(t), .. } = &model.value(x).ty {
        if *t != x_zp.dtype() {
            return None;
        }
    }
    Some(QMember {
        node: i,
        conv: true,
        pool: None,
        data: vec![x],
        y,
        turned: xs.iter().product::<usize>() + out.iter().product::<usize>(),
        out,
    })
}

/// `QuantizeLinear(MaxPool(DequantizeLinear(q, s, z)), s, z)` (node `i` the QuantizeLinear,
/// output `y` of NCHW shape `out`): the maximum of the dequantized values requantized with the
/// same constant scale (positive) and zero point is the maximum of the bytes (dequantizing is
/// increasing, and a byte dequantized and quantized again with the same parameters comes back),
/// so the three become one max pool on the bytes. 2-D, no indices output, `ceil_mode` 0; each
/// intermediate value read by the next node only.
fn q_pool(
    model: &Model,
    shapes: &crate::infer::Shapes,
    uses: &Uses,
    i: usize,
    n: &Node,
    y: ValueId,
    out: Vec<usize>,
) -> Option<QMember> {
    let g = &model.graph;
    let input = |n: &Node, k: usize| n.inputs.get(k).copied().flatten();
    let pooled = input(n, 0)?;
    let pi = uses
        .sole_reader(pooled)
        .and(uses.producer.get(&pooled).copied())?;
    let pool = &g.nodes[pi];
    if !is_op(pool, "MaxPool") || pool.outputs.len() != 1 || attr_i(pool, "ceil_mode", 0) != 0 {
        return None;
    }
    if let Some(Attr::Str(p)) = pool.attrs.get("auto_pad") {
        if p.as_slice() != b"NOTSET" {
            return None;
        }
    }
    if ints(pool, "kernel_shape").is_none_or(|k| k.len() != 2 || k.iter().any(|&v| v < 1)) {
        return None;
    }
    let deq = input(pool, 0)?;
    let di = uses
        .sole_reader(deq)
        .and(uses.producer.get(&deq).copied())?;
    let dq = &g.nodes[di];
    if !is_op(dq, "DequantizeLinear") {
        return None;
    }
    let q = input(dq, 0)?;
    // One positive float32 scale and one 8-bit zero point, the same constants on both sides.
    let same = |k: usize| -> Option<Tensor> {
        let (a, b) = (constant(g, input(dq, k)?)?, constant(g, input(n, k)?)?);
        (a == b && a.len() == 1).then(|| a.clone())
    };
    let scale = same(1)?;
    let zero = same(2)?;
    if scale.dtype() != DType::F32
        || !scale
            .as_slice::<f32>()
            .ok()?
            .iter()
            .all(|&v| v > 0.0 && v.is_finite())
        || !matches!(zero.dtype(), DType::U8 | DType::I8)
        || n.attrs.keys().any(|k| k != "axis")
        || dq.attrs.keys().any(|k| k != "axis")
    {
        return None;
    }
    let qs = shapes.get(Some(q)).filter(|s| s.len() == 4)?;
    if qs.contains(&0) || out[..2] != qs[..2] {
        return None;
    }
    Some(QMember {
        node: i,
        conv: false,
        pool: Some([di, pi]),
        data: vec![q],
        y,
        out,
        turned: 0,
    })
}

/// The 8-bit twin of [`channels_last`] (level 3): QLinearConvs (one group) and the QLinearAdds
/// between them (a statically quantized ResNet's blocks) linked through their data inputs run
/// on `[N, H, W, C]` bytes: each QLinearConv becomes `com.ferrum.NhwcQLinearConv` (the same
/// inputs and filter; the kernel already makes its GEMM rows channels-last, so X and Y are no
/// longer turned around at every convolution), QLinearAdd reads and writes the channels-last
/// tensors as they are (elementwise), and a dequantize, max pool, quantize chain with one scale
/// and zero point (ResNet's stem pool) becomes `com.ferrum.NhwcMaxPool` on the bytes.
/// Transposes where a value enters or leaves the region; a
/// region changes only when they move fewer bytes than its convolutions turn now. Needs static
/// shapes; `FERRUM_NO_NHWC=1` turns it off. Returns the number of nodes moved.
pub fn quantized_channels_last(model: &mut Model, log: &mut Vec<String>) -> usize {
    if std::env::var("FERRUM_NO_NHWC").is_ok_and(|v| v != "0") {
        return 0;
    }
    let g = &model.graph;
    if !g.nodes.iter().any(|n| is_op(n, "QLinearConv"))
        || g.nodes
            .iter()
            .any(|n| n.domain == DOMAIN && n.op == "NhwcQLinearConv")
    {
        return 0;
    }
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let g = &model.graph;
    let uses = Uses::of(g);
    let cands: Vec<QMember> = g
        .nodes
        .iter()
        .enumerate()
        .filter_map(|(i, n)| q_member(model, &shapes, &uses, i, n))
        .collect();
    if !cands.iter().any(|c| c.conv) {
        return 0;
    }
    let by_node: HashMap<usize, usize> =
        cands.iter().enumerate().map(|(k, c)| (c.node, k)).collect();
    // The node that reads each member's data inputs: the member's own, or a max pool's
    // DequantizeLinear.
    let by_reader: HashMap<usize, usize> = cands
        .iter()
        .enumerate()
        .map(|(k, c)| (c.pool.map_or(c.node, |[di, _]| di), k))
        .collect();
    let by_output: HashMap<ValueId, usize> =
        cands.iter().enumerate().map(|(k, c)| (c.y, k)).collect();
    let mut parent: Vec<usize> = (0..cands.len()).collect();
    for (k, c) in cands.iter().enumerate() {
        for v in &c.data {
            if let Some(&p) = by_output.get(v) {
                let (a, b) = (find(&mut parent, p), find(&mut parent, k));
                parent[a] = b;
            }
        }
    }
    let roots: Vec<usize> = (0..cands.len()).map(|k| find(&mut parent, k)).collect();
    // True when `c`'s output is read other than as a data input of a member of `region`.
    let leaves_q = |c: &QMember, region: &dyn Fn(usize) -> Option<usize>| {
        uses.pinned.contains(&c.y)
            || uses.readers.get(&c.y).is_some_and(|rs| {
                rs.iter().any(|&ri| {
                    region(ri).is_none_or(|q| !cands[q].data.contains(&c.y))
                        || g.nodes[ri].inputs.iter().enumerate().any(|(slot, v)| {
                            *v == Some(c.y) && !data_slot(&cands[by_reader[&ri]], slot)
                        })
                })
            })
    };
    // Per region: bytes the NCHW kernels turn around, and bytes its boundary transposes move.
    let mut turned: HashMap<usize, usize> = HashMap::new();
    let mut boundary: HashMap<usize, usize> = HashMap::new();
    let mut entries: HashSet<(usize, ValueId)> = HashSet::new();
    for (k, c) in cands.iter().enumerate() {
        let r = roots[k];
        *turned.entry(r).or_default() += c.turned;
        for &v in &c.data {
            let inside = by_output.get(&v).is_some_and(|&p| roots[p] == r);
            if !inside && entries.insert((r, v)) {
                *boundary.entry(r).or_default() += shapes
                    .get(Some(v))
                    .map_or(usize::MAX / 4, |s| s.iter().product());
            }
        }
        let region = |ri: usize| by_reader.get(&ri).copied().filter(|&q| roots[q] == r);
        if leaves_q(c, &region) {
            *boundary.entry(r).or_default() += c.out.iter().product::<usize>();
        }
    }
    let chosen: HashSet<usize> = turned
        .iter()
        .filter(|&(r, &t)| boundary.get(r).copied().unwrap_or(0) < t)
        .map(|(&r, _)| r)
        .collect();
    if chosen.is_empty() {
        return 0;
    }
    let member = |node: usize| {
        by_node
            .get(&node)
            .filter(|&&k| chosen.contains(&roots[k]))
            .copied()
    };
    // Members whose output is also needed in NCHW.
    let reader_member = |node: usize| {
        by_reader
            .get(&node)
            .filter(|&&k| chosen.contains(&roots[k]))
            .copied()
    };
    let exits: Vec<bool> = cands.iter().map(|c| leaves_q(c, &reader_member)).collect();
    // Nodes folded into a max pool member, and that pool's attributes.
    let mut folded: HashSet<usize> = HashSet::new();
    let mut pool_attrs: HashMap<usize, std::collections::BTreeMap<String, Attr>> = HashMap::new();
    for (k, c) in cands.iter().enumerate() {
        if let (Some([di, pi]), true) = (c.pool, chosen.contains(&roots[k])) {
            folded.extend([di, pi]);
            pool_attrs.insert(k, g.nodes[pi].attrs.clone());
        }
    }
    let nodes = std::mem::take(&mut model.graph.nodes);
    let mut out_nodes: Vec<Node> = Vec::with_capacity(nodes.len() + 8);
    let mut nhwc_of: HashMap<ValueId, ValueId> = HashMap::new();
    let (mut moved, mut entered, mut left) = (0, 0, 0);
    for (i, mut n) in nodes.into_iter().enumerate() {
        if folded.contains(&i) {
            continue;
        }
        let Some(k) = member(i) else {
            out_nodes.push(n);
            continue;
        };
        let c = &cands[k];
        if c.pool.is_some() {
            // The QuantizeLinear's place: a max pool on the channels-last bytes.
            n = Node {
                name: n.name.clone(),
                op: "NhwcMaxPool".into(),
                domain: DOMAIN.into(),
                opset: 1,
                inputs: vec![Some(c.data[0])],
                outputs: n.outputs.clone(),
                attrs: pool_attrs.remove(&k).unwrap_or_default(),
                implicit_inputs: vec![],
            };
        }
        for slot in 0..n.inputs.len() {
            let Some(v) = n.inputs[slot] else { continue };
            if !data_slot(c, slot) {
                continue;
            }
            let dtype = value_dtype(model, v);
            let mut edge = Edge {
                shapes: &shapes,
                out_nodes: &mut out_nodes,
                nhwc_of: &mut nhwc_of,
                entered: &mut entered,
            };
            n.inputs[slot] = Some(edge.twin(model, v, dtype));
        }
        let dtype = value_dtype(model, c.y);
        let yname = format!("{}#nhwc", model.value(c.y).name);
        let y = new_typed_value(model, yname, &permuted(&c.out, TO_NHWC), dtype);
        nhwc_of.insert(c.y, y);
        n.outputs = vec![Some(y)];
        if c.conv {
            n.op = "NhwcQLinearConv".into();
            n.domain = DOMAIN.into();
            n.opset = 1;
        }
        log.push(format!("{} -> {} (channels-last)", n.name, n.op));
        let name = n.name.clone();
        out_nodes.push(n);
        moved += 1;
        if exits[k] {
            out_nodes.push(transpose_node(format!("{name}#nchw"), y, c.y, TO_NCHW));
            left += 1;
        }
    }
    model.graph.nodes = out_nodes;
    log.push(format!(
        "8-bit channels-last: {moved} nodes, {entered} transposes in, {left} out"
    ));
    moved
}

/// True when input `slot` of member `c`'s node is a data input (X; A or B).
fn data_slot(c: &QMember, slot: usize) -> bool {
    if c.conv {
        slot == 0
    } else {
        slot == 0 || slot == 3
    }
}

fn value_dtype(model: &Model, v: ValueId) -> Option<DType> {
    match &model.value(v).ty {
        ValueType::Tensor { dtype, .. } => *dtype,
        _ => None,
    }
}

/// A GlobalAveragePool whose input is a channels-last tensor turned back to NCHW (a transpose
/// with `perm = [0, 3, 1, 2]`: a channels-last region's exit, or a model from a channels-last
/// framework) reads the channels-last tensor itself: `com.ferrum.NhwcGlobalAveragePool`, the
/// same bits (each channel summed in the NCHW pool's order). With a per-tensor float32
/// DequantizeLinear between the two (an 8-bit region's exit), the dequantize moves before the
/// transpose (elementwise with one scale and zero point, it commutes with it). The transpose,
/// then read by nothing, goes with dead-code elimination. Returns the pools rewritten.
pub fn channels_last_pool(model: &mut Model, log: &mut Vec<String>) -> usize {
    let g = &model.graph;
    if !g.nodes.iter().any(|n| is_op(n, "GlobalAveragePool")) {
        return 0;
    }
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let uses = Uses::of(g);
    // The node producing `v` when `v` is read by that one reader only.
    let only_for = |v: ValueId| uses.sole_reader(v).and(uses.producer.get(&v).copied());
    let scalar = |v: Option<ValueId>, dtypes: &[DType]| {
        v.and_then(|v| constant(g, v))
            .is_some_and(|t| t.len() == 1 && dtypes.contains(&t.dtype()))
    };
    // (pool, the transpose's channels-last input, the dequantize between them).
    let mut found: Vec<(usize, ValueId, Option<usize>)> = Vec::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if !is_op(n, "GlobalAveragePool") || n.inputs.len() != 1 || n.outputs.len() != 1 {
            continue;
        }
        let Some(pi) = n.inputs[0].and_then(only_for) else {
            continue;
        };
        let p = &g.nodes[pi];
        let (ti, dq) = if is_op(p, "Transpose") {
            (pi, None)
        } else if is_op(p, "DequantizeLinear")
            && p.outputs.len() == 1
            && attr_i(p, "block_size", 0) == 0
            && scalar(p.inputs.get(1).copied().flatten(), &[DType::F32])
            && (p.inputs.get(2).copied().flatten().is_none()
                || scalar(
                    p.inputs.get(2).copied().flatten(),
                    &[DType::U8, DType::I8, DType::I32],
                ))
        {
            match p.inputs[0].and_then(only_for) {
                Some(ti) => (ti, Some(pi)),
                None => continue,
            }
        } else {
            continue;
        };
        let t = &g.nodes[ti];
        if !is_op(t, "Transpose") || ints(t, "perm") != Some(TO_NCHW.map(|p| p as i64).to_vec()) {
            continue;
        }
        let Some(src) = t.inputs.first().copied().flatten() else {
            continue;
        };
        let ok_shape = shapes
            .get(Some(src))
            .is_some_and(|s| s.len() == 4 && !s.contains(&0));
        // Float32 into the pool: the value itself, or what the dequantize makes.
        if ok_shape && (dq.is_some() || value_dtype(model, src) == Some(DType::F32)) {
            found.push((i, src, dq));
        }
    }
    for &(i, src, dq) in &found {
        let mut x = src;
        if let Some(di) = dq {
            let name = format!("{}#nhwc", model.value(src).name);
            let shape = shapes.get(Some(src)).expect("checked above").clone();
            x = new_value(model, name, &shape);
            let d = &mut model.graph.nodes[di];
            d.inputs[0] = Some(src);
            d.outputs[0] = Some(x);
        }
        let n = &mut model.graph.nodes[i];
        n.op = "NhwcGlobalAveragePool".into();
        n.domain = DOMAIN.into();
        n.opset = 1;
        n.inputs = vec![Some(x)];
        log.push(format!(
            "{} -> NhwcGlobalAveragePool (reads the channels-last input{})",
            n.name,
            if dq.is_some() {
                ", dequantized before the transpose"
            } else {
                ""
            }
        ));
    }
    found.len()
}
