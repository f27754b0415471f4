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
//! size at run time); a Transpose swapping K's last two dims is read through a transposed view.
//! Every absorbed value must have the chain's next node as its only reader (and not be a graph
//! output), so nothing else needs it. The reshapes and transposes around the heads stay.

use std::collections::HashSet;

use crate::infer::{static_shapes, Shapes};
use crate::ir::{Attr, Graph, Model, Node, ValueId};
use crate::passes::{const_f32, const_scalar, constant, is_op, remove_nodes, Uses, DOMAIN};

/// The attention pass (level 2): returns how many chains it fused.
pub fn attention(model: &mut Model, log: &mut Vec<String>) -> usize {
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let g = &model.graph;
    let uses = Uses::of(g);
    let mut dead: HashSet<usize> = HashSet::new();
    let mut fused: Vec<(usize, Node)> = Vec::new();
    for (si, sm) in g.nodes.iter().enumerate() {
        if !is_op(sm, "Softmax") || sm.opset < 13 || attr_int(sm, "axis", -1) != -1 {
            continue;
        }
        let Some(found) = match_chain(g, &uses, &shapes, si) else {
            continue;
        };
        if found.nodes.iter().any(|i| dead.contains(i)) {
            continue;
        }
        let pv = &g.nodes[found.last];
        let mut n = Node {
            name: pv.name.clone(),
            op: "FusedAttention".into(),
            domain: DOMAIN.into(),
            opset: 1,
            inputs: found.inputs.to_vec(),
            outputs: pv.outputs.clone(),
            attrs: Default::default(),
            implicit_inputs: Vec::new(),
        };
        if let Some((c, div)) = found.post {
            n.attrs.insert("post_scale".into(), Attr::Float(c));
            n.attrs.insert("post_div".into(), Attr::Int(div as i64));
        }
        n.attrs
            .insert("nan_to_zero".into(), Attr::Int(found.nan_to_zero as i64));
        n.attrs
            .insert("b_transposed".into(), Attr::Int(found.b_transposed as i64));
        log.push(format!(
            "{} + {} -> FusedAttention",
            g.nodes[found.first].name,
            found.what.join(" + ")
        ));
        dead.extend(found.nodes.iter().copied());
        fused.push((found.last, n));
    }
    let count = fused.len();
    for (last, n) in fused {
        model.graph.nodes[last] = n;
        dead.remove(&last);
    }
    remove_nodes(&mut model.graph, &dead);
    count
}

/// One matched chain.
struct Chain {
    /// Q, K, V, mask, q_scale, k_scale.
    inputs: [Option<ValueId>; 6],
    post: Option<(f32, bool)>,
    nan_to_zero: bool,
    b_transposed: bool,
    /// Every node of the chain; `first` and `last` are its two MatMuls.
    nodes: Vec<usize>,
    first: usize,
    last: usize,
    what: Vec<&'static str>,
}

fn attr_int(n: &Node, name: &str, default: i64) -> i64 {
    match n.attrs.get(name) {
        Some(Attr::Int(v)) => *v,
        _ => default,
    }
}

fn out(n: &Node) -> Option<ValueId> {
    n.outputs.first().copied().flatten()
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
        post,
        nan_to_zero,
        b_transposed,
        nodes,
        first: mm,
        last,
        what,
    })
}
