//! LayerNormalization as exporters spell it out before opset 17 (PyTorch's `layer_norm` at
//! opset < 17, TensorFlow converters):
//!
//! ```text
//! mean = ReduceMean(x, axes = [-1])        d = Sub(x, mean)
//! var  = ReduceMean(Pow(d, 2) or Mul(d, d), axes = [-1])
//! y    = Div(d, Sqrt(Add(var, eps))) * gamma (+ beta)
//! ```
//!
//! becomes one `LayerNormalization(x, gamma, beta)` over the last axis with that epsilon, which
//! runs as one float32 pass instead of nine f64 reference loops and eight intermediate tensors.

use std::collections::HashSet;

use crate::infer::static_shapes;
use crate::ir::{Attr, Model, Node, ValueId};
use crate::passes::{
    add_initializer, const_f32, const_scalar, constant, is_op, other_input, out, remove_nodes, Uses,
};
use crate::tensor::Tensor;

/// Whether `n` is a ReduceMean over the last axis of a rank-`rank` input (when known), keeping
/// that axis: `axes` as the attribute (opset < 18) or a constant second input.
fn mean_over_last_axis(model: &Model, n: &Node, rank: Option<usize>) -> bool {
    if !is_op(n, "ReduceMean") {
        return false;
    }
    if matches!(n.attrs.get("keepdims"), Some(Attr::Int(0))) {
        return false;
    }
    let axes = match (n.attrs.get("axes"), n.inputs.get(1).copied().flatten()) {
        (Some(Attr::Ints(a)), None) => a.clone(),
        (None, Some(v)) => match constant(&model.graph, v).map(Tensor::to_i64_vec) {
            Some(Ok(a)) => a,
            _ => return false,
        },
        _ => return false,
    };
    match axes.as_slice() {
        [-1] => true,
        [a] => rank.is_some_and(|r| r > 0 && *a == r as i64 - 1),
        _ => false,
    }
}

/// One matched chain: its nodes (the last one becomes the LayerNormalization), the input, the
/// scale and bias (as found), epsilon.
struct Chain {
    nodes: Vec<usize>,
    x: ValueId,
    gamma: ValueId,
    beta: Option<ValueId>,
    eps: f32,
}

/// Matches the chain whose first ReduceMean is node `ri`.
fn match_chain(
    model: &Model,
    uses: &Uses,
    ranks: &dyn Fn(ValueId) -> Option<usize>,
    ri: usize,
) -> Option<Chain> {
    let g = &model.graph;
    let node = |i: usize| &g.nodes[i];
    let r1 = node(ri);
    let x = r1.inputs.first().copied().flatten()?;
    let rank = ranks(x);
    if !mean_over_last_axis(model, r1, rank) {
        return None;
    }
    let mean = out(r1)?;
    let si = uses.sole_reader(mean)?;
    let sub = node(si);
    if !is_op(sub, "Sub") || sub.inputs != [Some(x), Some(mean)] {
        return None;
    }
    // d is read by the square and by the division only.
    let d = out(sub)?;
    if uses.pinned.contains(&d) {
        return None;
    }
    let readers = uses.readers.get(&d)?;
    let (qi, di) = {
        let mut distinct: Vec<usize> = readers.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let [a, b] = distinct[..] else {
            return None;
        };
        if is_op(node(a), "Div") {
            (b, a)
        } else {
            (a, b)
        }
    };
    let sq = node(qi);
    let squares = (is_op(sq, "Pow")
        && sq.inputs.first() == Some(&Some(d))
        && const_scalar(g, sq.inputs.get(1).copied().flatten()) == Some(2.0)
        && readers.len() == 2)
        || (is_op(sq, "Mul") && sq.inputs == [Some(d), Some(d)] && readers.len() == 3);
    if !squares {
        return None;
    }
    let r2i = uses.sole_reader(out(sq)?)?;
    let r2 = node(r2i);
    if !mean_over_last_axis(model, r2, rank) || r2.inputs.first() != Some(&out(sq)) {
        return None;
    }
    let var = out(r2)?;
    let ai = uses.sole_reader(var)?;
    let add_eps = node(ai);
    if !is_op(add_eps, "Add") {
        return None;
    }
    let eps = const_scalar(g, other_input(add_eps, var))?;
    if eps.is_nan() || eps < 0.0 {
        return None;
    }
    let qi2 = uses.sole_reader(out(add_eps)?)?;
    let sqrt = node(qi2);
    if !is_op(sqrt, "Sqrt") {
        return None;
    }
    let s = out(sqrt)?;
    if uses.sole_reader(s) != Some(di) {
        return None;
    }
    let div = node(di);
    if !is_op(div, "Div") || div.inputs != [Some(d), Some(s)] {
        return None;
    }
    // The scale: a float32 vector along the last axis (its length is checked against the
    // input's last dimension where that is known, and by the kernel at run time otherwise),
    // with leading dims of 1 only where they add no dims to the input's.
    let vector = |v: ValueId| -> Option<usize> {
        let t = constant(g, v)?;
        let c = const_f32(g, Some(v))?.len();
        let fits = t.rank() == 1 || rank.is_some_and(|r| t.rank() <= r);
        (fits && t.shape()[..t.rank() - 1].iter().all(|&d| d == 1) && c >= 2).then_some(c)
    };
    let n = out(div)?;
    let mi = uses.sole_reader(n)?;
    let mul = node(mi);
    if !is_op(mul, "Mul") {
        return None;
    }
    let gamma = other_input(mul, n)?;
    let c = vector(gamma)?;
    let mut nodes = vec![ri, si, qi, r2i, ai, qi2, di, mi];
    let m = out(mul)?;
    let mut beta = None;
    if let Some(bi) = uses.sole_reader(m) {
        let add = node(bi);
        if is_op(add, "Add") {
            if let Some(b) = other_input(add, m).filter(|&b| vector(b) == Some(c)) {
                beta = Some(b);
                nodes.push(bi);
            }
        }
    }
    Some(Chain {
        nodes,
        x,
        gamma,
        beta,
        eps,
    })
}

/// Fuses every matched chain; returns how many.
pub fn layer_norm(model: &mut Model, log: &mut Vec<String>) -> usize {
    let shapes = static_shapes(model);
    let ranks = |v: ValueId| shapes.shapes.get(&v).map(Vec::len);
    let uses = Uses::of(&model.graph);
    let mut dead = HashSet::new();
    let mut found = Vec::new();
    for (i, n) in model.graph.nodes.iter().enumerate() {
        if !is_op(n, "ReduceMean") {
            continue;
        }
        let Some(chain) = match_chain(model, &uses, &ranks, i) else {
            continue;
        };
        // The scale and bias must be as long as the normalized axis where it is known.
        let c = const_f32(&model.graph, Some(chain.gamma)).map_or(0, <[f32]>::len);
        if shapes
            .shapes
            .get(&chain.x)
            .and_then(|s| s.last())
            .is_some_and(|&d| d != c)
        {
            continue;
        }
        if chain.nodes.iter().any(|i| dead.contains(i)) {
            continue;
        }
        dead.extend(chain.nodes[..chain.nodes.len() - 1].iter().copied());
        found.push(chain);
    }
    let count = found.len();
    for chain in found {
        // LayerNormalization takes the scale and bias as the normalized shape, `[C]`.
        let mut flat = |v: ValueId, what: &str| -> ValueId {
            let t = constant(&model.graph, v).expect("matched as a constant");
            if t.rank() == 1 {
                return v;
            }
            let c = t.len();
            let t = t.clone().reshape(vec![c]).expect("same element count");
            add_initializer(model, what, t)
        };
        let gamma = flat(chain.gamma, "layernorm_scale");
        let beta = chain.beta.map(|b| flat(b, "layernorm_bias"));
        let last = *chain.nodes.last().expect("a chain has nodes");
        let first = model.graph.nodes[chain.nodes[0]].name.clone();
        let n = &mut model.graph.nodes[last];
        log.push(format!("{first} .. {} -> LayerNormalization", n.name));
        n.op = "LayerNormalization".into();
        n.domain = String::new();
        n.opset = n.opset.max(17);
        n.inputs = vec![Some(chain.x), Some(gamma)];
        if let Some(b) = beta {
            n.inputs.push(Some(b));
        }
        n.outputs.truncate(1);
        n.attrs.clear();
        n.attrs.insert("axis".into(), Attr::Int(-1));
        n.attrs.insert("epsilon".into(), Attr::Float(chain.eps));
        n.name = format!("{}/layernorm", n.name);
    }
    remove_nodes(&mut model.graph, &dead);
    count
}
