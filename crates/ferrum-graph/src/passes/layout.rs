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
//! where a value enters the region and one where a value leaves it (read outside, or a graph
//! output). A region is changed only when it holds a depthwise convolution and its boundary transposes move at most a quarter of
//! the elements its depthwise convolutions read, so networks without depthwise convolutions
//! (ResNet) are left alone. Needs static shapes. `FERRUM_NO_NHWC=1` turns the pass off.

use std::collections::{HashMap, HashSet};

use super::{attr_i, const_f32, constant, is_op, Uses, DOMAIN};
use crate::infer::static_shapes;
use crate::ir::{Attr, Dim, Model, Node, ValueId, ValueInfo, ValueType};
use crate::tensor::{DType, Tensor};

/// A convolution the channels-last kernels take.
struct Cand {
    node: usize,
    depthwise: bool,
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

fn candidate(model: &Model, shapes: &crate::infer::Shapes, i: usize, n: &Node) -> Option<Cand> {
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
        depthwise,
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
    let id = ValueId(model.values.len() as u32);
    model.values.push(ValueInfo {
        name,
        ty: ValueType::Tensor {
            dtype: Some(DType::F32),
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

/// The pass: see the module's documentation. Returns the number of convolutions moved to
/// channels-last.
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
    let by_output: HashMap<ValueId, usize> =
        cands.iter().enumerate().map(|(k, c)| (c.y, k)).collect();
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
        if c.depthwise {
            *dw_elems.entry(r).or_default() += c.in_elems;
        }
        for v in std::iter::once(c.x).chain(c.z) {
            let inside = by_output.get(&v).is_some_and(|&p| roots[p] == r);
            if !inside && entries.insert((r, v)) {
                *boundary.entry(r).or_default() +=
                    shapes.get(Some(v)).map_or(0, |s| s.iter().product());
            }
        }
        let outside = leaves(&uses, &cands, c, |ri| {
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
    let mut entered = 0;
    let mut left = 0;
    for (i, n) in nodes.into_iter().enumerate() {
        let Some(k) = member(i) else {
            out_nodes.push(n);
            continue;
        };
        let c = &cands[k];
        let mut twin = |model: &mut Model, out_nodes: &mut Vec<Node>, v: ValueId| -> ValueId {
            if let Some(&t) = nhwc_of.get(&v) {
                return t;
            }
            let s = permuted(shapes.get(Some(v)).expect("a static shape"), TO_NHWC);
            let name = format!("{}#nhwc", model.value(v).name);
            let t = new_value(model, name.clone(), &s);
            out_nodes.push(transpose_node(name, v, t, TO_NHWC));
            entered += 1;
            nhwc_of.insert(v, t);
            t
        };
        let x = twin(model, &mut out_nodes, c.x);
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
        let yname = format!("{}#nhwc", model.value(c.y).name);
        let y = new_value(model, yname, &permuted(&c.out, TO_NHWC));
        nhwc_of.insert(c.y, y);
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
        let bias = n.inputs.get(2).copied().flatten();
        let mut inputs = vec![Some(x), Some(hwio), bias];
        if let Some(z) = z {
            inputs.push(Some(z));
        }
        log.push(format!(
            "{} -> NhwcConv ({})",
            n.name,
            if c.depthwise { "depthwise" } else { "dense" }
        ));
        out_nodes.push(Node {
            name: n.name.clone(),
            op: "NhwcConv".into(),
            domain: DOMAIN.into(),
            opset: 1,
            inputs,
            outputs: vec![Some(y)],
            attrs,
            implicit_inputs: vec![],
        });
        moved += 1;
        let read_outside = leaves(&uses, &cands, c, member);
        if read_outside {
            out_nodes.push(transpose_node(format!("{}#nchw", n.name), y, c.y, TO_NCHW));
            left += 1;
        }
    }
    model.graph.nodes = out_nodes;
    if moved > 0 {
        log.push(format!(
            "channels-last: {moved} convolutions, {entered} transposes in, {left} out"
        ));
    }
    moved
}
