//! Multi-head attention as PyTorch exports it, fused into one `com.ferrum.FusedAttention` node
//! ([`crate::ops::attention::fused_attention`]):
//!
//! ```text
//! S = MatMul(Mul(Q, q_scale)?, Mul(Transpose(K)?, k_scale)?)   (scaled_dot_product_attention)
//! S = Div(S, c)? or Mul(S, c)?                                 (older exports: scores / sqrt(d))
//! S = Add(S, mask)?                                            (additive mask, either side)
//! P = Softmax(S, axis = -1)
//! P = Where(IsNaN(P), 0, P)?                                   (fully masked rows)
//! O = MatMul(P, V)
//! ```
//!
//! `?` marks an optional step. A scalar Mul is absorbed when its other input is a constant of
//! one element or has a static shape of one element (the scale PyTorch computes from the head
//! size at run time). Every absorbed value must have the chain's next node as its only reader
//! (and not be a graph output), so nothing else needs it.
//!
//! Where shapes are static, the head splits around the chain are read through instead of run:
//! Q, K and V become strided views of the tensor before their Reshape / Transpose / Gather (a
//! constant index) nodes, often the QKV projection's output itself, and the output is written
//! straight into the layout of the Transposes and Reshapes that follow the product (merging the
//! heads back), as long as its last dim stays contiguous. Nodes left without readers go with
//! dead-code elimination. Without static shapes, a Transpose swapping K's last two dims is still
//! read transposed.

use std::collections::HashSet;

use crate::infer::{static_shapes, Shapes};
use crate::ir::{Attr, Graph, Model, Node, ValueId};
use crate::ops::strides as row_major;
use crate::passes::{
    attr_i, const_f32, const_scalar, constant, is_op, out, remove_nodes, Uses, DOMAIN,
};

/// The attention pass (level 2): returns how many chains it fused.
pub fn attention(model: &mut Model, log: &mut Vec<String>) -> usize {
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let g = &model.graph;
    let uses = Uses::of(g);
    let mut dead: HashSet<usize> = HashSet::new();
    let mut fused: Vec<(usize, Node)> = Vec::new();
    for (si, sm) in g.nodes.iter().enumerate() {
        if !is_op(sm, "Softmax") || sm.opset < 13 || attr_i(sm, "axis", -1) != -1 {
            continue;
        }
        let Some(found) = match_chain(g, &uses, &shapes, si) else {
            continue;
        };
        if found.nodes.iter().any(|i| dead.contains(i)) {
            continue;
        }
        let pv = &g.nodes[found.last];
        let mut inputs = found.inputs.to_vec();
        let mut n = Node {
            name: pv.name.clone(),
            op: "FusedAttention".into(),
            domain: DOMAIN.into(),
            opset: 1,
            inputs: Vec::new(),
            outputs: pv.outputs.clone(),
            attrs: Default::default(),
            implicit_inputs: Vec::new(),
        };
        let mut b_transposed = found.b_transposed;
        for (i, name) in ["q", "k", "v"].iter().enumerate() {
            // K's view starts from the product's operand, before any transpose read past.
            let operand = if i == 1 {
                Some(found.k_operand)
            } else {
                inputs[i]
            };
            let Some(view) = operand.and_then(|x| operand_view(g, &uses, &shapes, x)) else {
                continue;
            };
            if i == 1 {
                b_transposed = false;
            }
            inputs[i] = Some(view.src);
            let ints = |v: &[usize]| Attr::Ints(v.iter().map(|&x| x as i64).collect());
            n.attrs
                .insert(format!("{name}_src_shape"), ints(&view.src_shape));
            n.attrs.insert(format!("{name}_shape"), ints(&view.shape));
            n.attrs
                .insert(format!("{name}_strides"), ints(&view.strides));
            n.attrs
                .insert(format!("{name}_offset"), Attr::Int(view.offset as i64));
        }
        let mut absorbed_out = Vec::new();
        if let Some(o) = out(pv) {
            if let Some(ov) = output_view(g, &uses, &shapes, o) {
                let ints = |v: &[usize]| Attr::Ints(v.iter().map(|&x| x as i64).collect());
                n.attrs.insert("out_shape".into(), ints(&ov.shape));
                n.attrs.insert("out_strides".into(), ints(&ov.strides));
                n.outputs = vec![Some(ov.value)];
                absorbed_out = ov.nodes;
            }
        }
        n.inputs = inputs;
        if let Some((c, div)) = found.post {
            n.attrs.insert("post_scale".into(), Attr::Float(c));
            n.attrs.insert("post_div".into(), Attr::Int(div as i64));
        }
        n.attrs
            .insert("nan_to_zero".into(), Attr::Int(found.nan_to_zero as i64));
        n.attrs
            .insert("b_transposed".into(), Attr::Int(b_transposed as i64));
        log.push(format!(
            "{} + {} -> FusedAttention",
            g.nodes[found.first].name,
            found.what.join(" + ")
        ));
        dead.extend(found.nodes.iter().copied());
        // The fused node takes the place of the last node it absorbs, so the readers of its
        // output (after the output's transposes) still come after it.
        let at = absorbed_out.last().copied().unwrap_or(found.last);
        dead.extend(absorbed_out);
        fused.push((at, n));
    }
    let count = fused.len();
    for (at, n) in fused {
        model.graph.nodes[at] = n;
        dead.remove(&at);
    }
    remove_nodes(&mut model.graph, &dead);
    if count > 0 {
        // The head splits the views read past, where nothing else reads them.
        super::fold::dead_code(model, log);
    }
    count
}

/// One matched chain.
struct Chain {
    /// Q, K, V, mask, q_scale, k_scale.
    inputs: [Option<ValueId>; 6],
    /// K as the product (or its scale) reads it, before a transpose was read past.
    k_operand: ValueId,
    post: Option<(f32, bool)>,
    nan_to_zero: bool,
    b_transposed: bool,
    /// Every node of the chain; `first` and `last` are its two MatMuls.
    nodes: Vec<usize>,
    first: usize,
    last: usize,
    what: Vec<&'static str>,
}

fn ins2(n: &Node) -> Option<(ValueId, ValueId)> {
    match n.inputs.as_slice() {
        [Some(a), Some(b)] => Some((*a, *b)),
        _ => None,
    }
}

/// The chain ending in the Softmax at `si`, read backwards to the first MatMul and forwards to
/// the second.
fn match_chain(g: &Graph, uses: &Uses, shapes: &Shapes, si: usize) -> Option<Chain> {
    let node = |i: usize| &g.nodes[i];
    // `v`'s producer, when `v`'s only reader is `reader`.
    let producer_for = |v: ValueId, reader: usize| -> Option<usize> {
        if uses.sole_reader(v)? != reader {
            return None;
        }
        uses.producer.get(&v).copied()
    };
    let is_matmul = |n: &Node| is_op(n, "MatMul") || is_op(n, "Div") || is_op(n, "Mul");
    let mut nodes = vec![si];
    let mut what = Vec::new();
    let mut mask = None;
    let mut post = None;
    let mut reader = si;
    let mut cur = node(si).inputs.first().copied().flatten()?;
    let mm = loop {
        let pi = producer_for(cur, reader)?;
        let p = node(pi);
        if is_op(p, "MatMul") {
            break pi;
        } else if is_op(p, "Add") && mask.is_none() && post.is_none() {
            // The scores come from the MatMul side; the other input is the mask.
            let (a, b) = ins2(p)?;
            let from_scores = |v: ValueId| {
                uses.producer
                    .get(&v)
                    .is_some_and(|&i| is_matmul(node(i)) && uses.sole_reader(v) == Some(pi))
            };
            let (s, m) = if from_scores(a) {
                (a, b)
            } else if from_scores(b) {
                (b, a)
            } else {
                return None;
            };
            if constant(g, m).is_some() && const_f32(g, Some(m)).is_none() {
                return None;
            }
            mask = Some(m);
            what.push("mask add");
            cur = s;
        } else if (is_op(p, "Div") || is_op(p, "Mul")) && post.is_none() {
            let (a, b) = ins2(p)?;
            let div = is_op(p, "Div");
            let (s, c) = match (const_scalar(g, Some(b)), const_scalar(g, Some(a))) {
                (Some(c), _) => (a, c),
                (None, Some(c)) if !div => (b, c),
                _ => return None,
            };
            // The constant must not raise the scores' rank.
            if constant(g, if s == a { b } else { a })?.rank() > 1 {
                return None;
            }
            post = Some((c, div));
            what.push(if div { "scale div" } else { "scale mul" });
            cur = s;
        } else {
            return None;
        }
        nodes.push(pi);
        reader = pi;
    };
    nodes.push(mm);
    let (a, b) = ins2(node(mm))?;
    if constant(g, a).is_some() || constant(g, b).is_some() {
        return None;
    }
    // A scalar Mul in front of Q or K: (its other input, the scale).
    let scaled = |v: ValueId| -> Option<(usize, ValueId, ValueId)> {
        let pi = producer_for(v, mm)?;
        let p = node(pi);
        if !is_op(p, "Mul") {
            return None;
        }
        let (x, y) = ins2(p)?;
        let one = |v: ValueId| {
            const_scalar(g, Some(v)).is_some() && constant(g, v).is_some_and(|t| t.rank() <= 1)
                || shapes
                    .get(Some(v))
                    .is_some_and(|s| s.len() <= 1 && s.iter().product::<usize>() == 1)
        };
        if one(y) {
            Some((pi, x, y))
        } else if one(x) {
            Some((pi, y, x))
        } else {
            None
        }
    };
    let (mut q, mut q_scale) = (a, None);
    if let Some((pi, x, s)) = scaled(a) {
        nodes.push(pi);
        what.push("q scale");
        (q, q_scale) = (x, Some(s));
    }
    let (mut k, mut k_scale, mut k_reader) = (b, None, mm);
    if let Some((pi, x, s)) = scaled(b) {
        nodes.push(pi);
        what.push("k scale");
        (k, k_scale, k_reader) = (x, Some(s), pi);
    }
    let k_operand = k;
    let mut b_transposed = false;
    if let Some(ti) = producer_for(k, k_reader) {
        let t = node(ti);
        if is_op(t, "Transpose") {
            if let (Some(Attr::Ints(perm)), Some(Some(src))) =
                (t.attrs.get("perm"), t.inputs.first())
            {
                let r = perm.len();
                let swaps_last_two = r >= 2
                    && perm[..r - 2]
                        .iter()
                        .enumerate()
                        .all(|(i, &p)| p == i as i64)
                    && perm[r - 2] == r as i64 - 1
                    && perm[r - 1] == r as i64 - 2;
                if swaps_last_two {
                    nodes.push(ti);
                    what.push("k transpose");
                    k = *src;
                    b_transposed = true;
                }
            }
        }
    }
    // Forwards: P to the second MatMul, perhaps through Where(IsNaN(P), 0, P).
    let p_out = out(node(si))?;
    let readers = uses.readers.get(&p_out)?;
    if uses.pinned.contains(&p_out) {
        return None;
    }
    let (pv_in, nan_to_zero) = match readers.as_slice() {
        [_] => (p_out, false),
        [x, y] => {
            let (isnan, wh) = if is_op(node(*x), "IsNaN") {
                (*x, *y)
            } else {
                (*y, *x)
            };
            let (i, w) = (node(isnan), node(wh));
            if !is_op(i, "IsNaN") || !is_op(w, "Where") {
                return None;
            }
            let cond = out(i)?;
            if uses.sole_reader(cond) != Some(wh) {
                return None;
            }
            match w.inputs.as_slice() {
                [Some(c), Some(z), Some(p)] if *c == cond && *p == p_out => {
                    if const_scalar(g, Some(*z)) != Some(0.0)
                        || constant(g, *z).is_none_or(|t| t.rank() > 1)
                    {
                        return None;
                    }
                }
                _ => return None,
            }
            nodes.push(isnan);
            nodes.push(wh);
            what.push("nan to zero");
            (out(w)?, true)
        }
        _ => return None,
    };
    let last = uses.sole_reader(pv_in)?;
    let pv = node(last);
    if !is_op(pv, "MatMul") || pv.inputs.first().copied().flatten() != Some(pv_in) {
        return None;
    }
    let v = pv.inputs.get(1).copied().flatten()?;
    if constant(g, v).is_some() {
        return None;
    }
    if let [r] = readers.as_slice() {
        if *r != last {
            return None;
        }
    }
    nodes.reverse();
    nodes.push(last);
    what.reverse();
    Some(Chain {
        inputs: [Some(q), Some(k), Some(v), mask, q_scale, k_scale],
        k_operand,
        post,
        nan_to_zero,
        b_transposed,
        nodes,
        first: mm,
        last,
        what,
    })
}

/// A Transpose's permutation of a rank-`r` input (reversed dims by default), when valid.
fn transpose_perm(n: &Node, r: usize) -> Option<Vec<usize>> {
    let perm: Vec<usize> = match n.attrs.get("perm") {
        Some(Attr::Ints(p)) => p
            .iter()
            .map(|&d| usize::try_from(d).ok())
            .collect::<Option<_>>()?,
        _ => (0..r).rev().collect(),
    };
    let mut seen = vec![false; r];
    for &d in &perm {
        if d >= r || std::mem::replace(&mut seen[d], true) {
            return None;
        }
    }
    (perm.len() == r).then_some(perm)
}

/// A strided view of `src` (see `FusedAttention`'s `_shape`, `_strides` and `_offset`).
struct View {
    src: ValueId,
    src_shape: Vec<usize>,
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

/// The view `(shape, strides, offset)` over a row-major tensor of shape `sx`, re-expressed over
/// another tensor in which `sx`'s dim `j` steps by `ys[j]` and whose element 0 is at `base`.
/// `None` when a viewed dim spans more than one dim of `sx` (a reshape that merged dims).
fn rebase(
    sx: &[usize],
    (shape, strides, offset): (&[usize], &[usize], usize),
    ys: &[usize],
    base: usize,
) -> Option<(Vec<usize>, usize)> {
    let cx = row_major(sx);
    let mut out = Vec::with_capacity(shape.len());
    for (&n, &t) in shape.iter().zip(strides) {
        if n <= 1 {
            out.push(0);
            continue;
        }
        // The dim of `sx` this one steps within: the largest stride that divides `t` and
        // leaves room for every step.
        let j = (0..sx.len())
            .filter(|&j| sx[j] > 1 && cx[j] <= t && t % cx[j] == 0 && t / cx[j] * (n - 1) < sx[j])
            .max_by_key(|&j| cx[j])?;
        out.push(t / cx[j] * ys[j]);
    }
    let mut rest = offset;
    let mut off = base;
    for j in 0..sx.len() {
        off += rest / cx[j] * ys[j];
        rest %= cx[j];
    }
    Some((out, off))
}

/// `x` as a view of the tensor before the Reshape / Squeeze / Unsqueeze / Flatten / Identity,
/// Transpose and constant-index Gather nodes that made it (static shapes only); `None` when no
/// node could be read past.
fn operand_view(g: &Graph, uses: &Uses, shapes: &Shapes, x: ValueId) -> Option<View> {
    let Some(sx) = shapes.get(Some(x)).cloned() else {
        tracing::debug!(
            value = x.0,
            "attention operand without a static shape: read as it is"
        );
        return None;
    };
    let mut v = View {
        src: x,
        src_shape: sx.clone(),
        offset: 0,
        strides: row_major(&sx),
        shape: sx,
    };
    while let Some(&pi) = uses.producer.get(&v.src) {
        let p = &g.nodes[pi];
        let Some(y) = p.inputs.first().copied().flatten() else {
            break;
        };
        let Some(sy) = shapes.get(Some(y)).cloned() else {
            tracing::debug!(op = %p.op, node = %p.name, "attention operand: input shape unknown");
            break;
        };
        let cy = row_major(&sy);
        let numel = |s: &[usize]| s.iter().product::<usize>();
        let (strides, offset) = match p.op.as_str() {
            _ if !(p.domain.is_empty() || p.domain == "ai.onnx") => break,
            "Reshape" | "Squeeze" | "Unsqueeze" | "Flatten" | "Identity"
                if numel(&sy) == numel(&v.src_shape) =>
            {
                // The same elements in the same order.
                (v.strides.clone(), v.offset)
            }
            "Transpose" => {
                let Some(perm) = transpose_perm(p, sy.len()) else {
                    break;
                };
                let ys: Vec<usize> = perm.iter().map(|&d| cy[d]).collect();
                let view = (&v.shape[..], &v.strides[..], v.offset);
                let Some(r) = rebase(&v.src_shape, view, &ys, 0) else {
                    break;
                };
                r
            }
            "Gather" => {
                // A constant scalar index: one slab of y, its dim `axis` dropped.
                let Some(t) = p
                    .inputs
                    .get(1)
                    .copied()
                    .flatten()
                    .and_then(|i| constant(g, i))
                else {
                    break;
                };
                let r = sy.len() as i64;
                let axis = attr_i(p, "axis", 0);
                let axis = if axis < 0 { axis + r } else { axis };
                let idx = match t.to_i64_vec() {
                    Ok(i) if t.rank() == 0 && i.len() == 1 => i[0],
                    _ => break,
                };
                if !(0..r).contains(&axis) {
                    break;
                }
                let a = axis as usize;
                let idx = if idx < 0 { idx + sy[a] as i64 } else { idx };
                if !(0..sy[a] as i64).contains(&idx) {
                    break;
                }
                let ys: Vec<usize> = (0..sy.len()).filter(|&j| j != a).map(|j| cy[j]).collect();
                let view = (&v.shape[..], &v.strides[..], v.offset);
                let Some(r) = rebase(&v.src_shape, view, &ys, idx as usize * cy[a]) else {
                    break;
                };
                r
            }
            _ => break,
        };
        v.src = y;
        v.src_shape = sy;
        v.strides = strides;
        v.offset = offset;
    }
    (v.src != x).then_some(v)
}

/// Where a product lands after the Reshape-like and Transpose nodes read past: the last value,
/// its shape, the product's dims' strides in it, and the nodes read past.
struct OutView {
    value: ValueId,
    shape: Vec<usize>,
    strides: Vec<usize>,
    nodes: Vec<usize>,
}

/// Where the product `o` can be written straight into the layout of the Reshape-like and
/// Transpose nodes that follow it, each the only reader of its input. `None` when there are
/// none, or when `o`'s last dim would not stay contiguous.
fn output_view(g: &Graph, uses: &Uses, shapes: &Shapes, o: ValueId) -> Option<OutView> {
    let so = shapes.get(Some(o))?.clone();
    let (mut cur, mut cur_shape, mut strides) = (o, so.clone(), row_major(&so));
    let mut nodes = Vec::new();
    let mut best = None;
    while let Some(ri) = uses.sole_reader(cur) {
        let r = &g.nodes[ri];
        if !(r.domain.is_empty() || r.domain == "ai.onnx")
            || r.inputs.first().copied().flatten() != Some(cur)
        {
            break;
        }
        let Some(next) = out(r) else { break };
        let Some(ns) = shapes.get(Some(next)).cloned() else {
            break;
        };
        let numel = |s: &[usize]| s.iter().product::<usize>();
        match r.op.as_str() {
            "Reshape" | "Squeeze" | "Unsqueeze" | "Flatten" | "Identity"
                if numel(&ns) == numel(&cur_shape) => {}
            "Transpose" => {
                let Some(perm) = transpose_perm(r, cur_shape.len()) else {
                    break;
                };
                // `cur`'s dim `perm[q]` becomes dim `q` of the transposed tensor.
                let cn = row_major(&ns);
                let mut ys = vec![0; cur_shape.len()];
                for (q, &j) in perm.iter().enumerate() {
                    ys[j] = cn[q];
                }
                let Some((st, _)) = rebase(&cur_shape, (&so, &strides, 0), &ys, 0) else {
                    break;
                };
                strides = st;
            }
            _ => break,
        }
        nodes.push(ri);
        cur = next;
        cur_shape = ns;
        // Kept only while the product's last dim stays contiguous.
        if so.last().is_none_or(|&n| n <= 1) || strides.last() == Some(&1) {
            best = Some(OutView {
                value: cur,
                shape: cur_shape.clone(),
                strides: strides.clone(),
                nodes: nodes.clone(),
            });
        }
    }
    best
}
