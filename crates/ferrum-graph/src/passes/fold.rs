//! Level-1 cleanups: constant folding, Identity/Dropout elimination, common-subexpression
//! elimination, dead-code elimination.

use std::collections::{HashMap, HashSet};

use crate::infer::{static_shapes, Shapes};
use crate::ir::{Attr, Model, ValueId};
use crate::passes::{constant, is_op, remove_nodes, Uses};
use crate::tensor::{Tensor, Value};

/// Ops whose result is not a function of their inputs, or that only make sense when run.
const NOT_FOLDED: &[&str] = &[
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "Dropout",
];

/// A folded value larger than this stays computed at run time (it would otherwise live as long
/// as the session).
const MAX_FOLDED_BYTES: usize = 64 << 20;

/// Runs every node whose inputs are all constants (including `Constant` nodes, which have none)
/// once, now, and keeps its outputs as initializers. A `Shape` of a value whose shape is static
/// (fixed input dims propagated by [`static_shapes`]) is a constant too, so the shape arithmetic
/// after it (Slice, Cast, Sqrt of a head size, Concat of a Reshape target) folds as well.
pub fn constant_folding(model: &mut Model, _log: &mut Vec<String>) -> usize {
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let g = &mut model.graph;
    let mut consts: HashSet<ValueId> = g
        .initializers
        .iter()
        .map(|(id, _)| *id)
        .filter(|id| !g.inputs.contains(id))
        .collect();
    let mut folded = HashSet::new();
    let mut new_inits: Vec<(ValueId, Value)> = Vec::new();
    for (i, n) in g.nodes.iter().enumerate() {
        let foldable = (n.domain.is_empty() || n.domain == "ai.onnx")
            && !NOT_FOLDED.contains(&n.op.as_str())
            && n.implicit_inputs.is_empty()
            && !n
                .attrs
                .values()
                .any(|a| matches!(a, Attr::Graph(_) | Attr::Graphs(_)))
            && n.outputs.iter().any(Option::is_some)
            && n.inputs.iter().flatten().all(|v| consts.contains(v));
        if !foldable {
            if let Some(t) = static_shape_of(n, &shapes) {
                if let Some(Some(o)) = n.outputs.first() {
                    consts.insert(*o);
                    new_inits.push((*o, Value::Tensor(t)));
                    folded.insert(i);
                }
            }
            continue;
        }
        let lookup = |v: ValueId| {
            g.initializers
                .iter()
                .chain(&new_inits)
                .find(|(id, _)| *id == v)
                .map(|(_, val)| val)
        };
        let ins: Vec<Option<&Value>> = n.inputs.iter().map(|v| v.and_then(lookup)).collect();
        if ins
            .iter()
            .zip(&n.inputs)
            .any(|(v, id)| id.is_some() && v.is_none())
        {
            continue;
        }
        // A node that fails now (bad attributes, a kernel error) is left to fail at run time.
        let Ok(outs) = crate::exec::eval_node(n, &ins) else {
            continue;
        };
        let ok = n.outputs.iter().zip(&outs).all(|(slot, v)| {
            slot.is_none()
                || matches!(v, Value::Tensor(t) if t.len() * t.dtype().size().max(1) <= MAX_FOLDED_BYTES)
        }) && outs.len() >= n.outputs.len();
        if !ok {
            continue;
        }
        for (slot, v) in n.outputs.iter().zip(outs) {
            if let Some(id) = slot {
                consts.insert(*id);
                new_inits.push((*id, v));
            }
        }
        folded.insert(i);
    }
    let count = folded.len();
    g.initializers.extend(new_inits);
    remove_nodes(g, &folded);
    count
}

/// The output of a `Shape` node whose input's shape is static: int64 dims from `start` to `end`.
fn static_shape_of(n: &crate::ir::Node, shapes: &Shapes) -> Option<Tensor> {
    if !is_op(n, "Shape") || n.outputs.len() != 1 {
        return None;
    }
    let dims = shapes.get(n.inputs.first().copied().flatten())?;
    let r = dims.len() as i64;
    let at = |name: &str, default: i64| {
        let v = match n.attrs.get(name) {
            Some(Attr::Int(v)) => *v,
            _ => default,
        };
        (if v < 0 { v + r } else { v }).clamp(0, r) as usize
    };
    let (start, end) = (at("start", 0), at("end", r));
    let v: Vec<i64> = dims[start..end.max(start)]
        .iter()
        .map(|&d| d as i64)
        .collect();
    Tensor::from_vec(vec![v.len()], v).ok()
}

/// Removes Identity nodes (and Dropout in inference: no `training_mode`, or a constant false
/// one, and its mask unused): their readers read the input instead. A node whose output is a
/// graph output or is read by a subgraph stays.
pub fn eliminate_identity(model: &mut Model, _log: &mut Vec<String>) -> usize {
    let g = &mut model.graph;
    let uses = Uses::of(g);
    let mut dead = HashSet::new();
    let mut renames: Vec<(ValueId, ValueId)> = Vec::new();
    for (i, n) in g.nodes.iter().enumerate() {
        let passthrough = if is_op(n, "Identity") {
            true
        } else if is_op(n, "Dropout") {
            let training = n.inputs.get(2).copied().flatten();
            let inference = match training {
                None => true,
                Some(t) => constant(g, t)
                    .and_then(|t| t.as_slice::<bool>().ok())
                    .is_some_and(|v| v == [false]),
            };
            let mask_unused = match n.outputs.get(1).copied().flatten() {
                None => true,
                Some(m) => !uses.pinned.contains(&m) && !uses.readers.contains_key(&m),
            };
            inference && mask_unused
        } else {
            false
        };
        let (Some(Some(x)), Some(Some(y))) = (n.inputs.first(), n.outputs.first()) else {
            continue;
        };
        if !passthrough || uses.pinned.contains(y) {
            continue;
        }
        renames.push((*y, *x));
        dead.insert(i);
    }
    // Chains (Identity of Identity) resolve to the first input.
    let resolve = |mut v: ValueId| {
        while let Some((_, x)) = renames.iter().find(|(y, _)| *y == v) {
            v = *x;
        }
        v
    };
    for n in &mut g.nodes {
        for v in n.inputs.iter_mut().flatten() {
            *v = resolve(*v);
        }
    }
    remove_nodes(g, &dead);
    dead.len()
}

/// Common-subexpression elimination: a node computing what an earlier node computes (the same
/// domain, op, opset, inputs and attributes) is removed, and its readers read the earlier
/// node's outputs (exporters repeat shape arithmetic and casts per use). Random ops, nodes
/// holding tensors or subgraphs as attributes, and nodes whose outputs are graph outputs or
/// read by subgraphs stay.
pub fn common_subexpressions(model: &mut Model, log: &mut Vec<String>) -> usize {
    let g = &mut model.graph;
    let uses = Uses::of(g);
    let mut first: HashMap<String, usize> = HashMap::new();
    let mut renames: HashMap<ValueId, ValueId> = HashMap::new();
    let mut dead = HashSet::new();
    for i in 0..g.nodes.len() {
        // Read through the removals so far, so that a chain of duplicates goes at once.
        for v in g.nodes[i].inputs.iter_mut().flatten() {
            if let Some(r) = renames.get(v) {
                *v = *r;
            }
        }
        let n = &g.nodes[i];
        let eligible = !NOT_FOLDED.contains(&n.op.as_str())
            && n.implicit_inputs.is_empty()
            && !n.attrs.values().any(|a| {
                matches!(
                    a,
                    Attr::Tensor(_)
                        | Attr::Tensors(_)
                        | Attr::Graph(_)
                        | Attr::Graphs(_)
                        | Attr::Other
                )
            })
            && !n.outputs.iter().flatten().any(|o| uses.pinned.contains(o));
        if !eligible {
            continue;
        }
        // Attributes print exactly (floats round-trip), in name order.
        let key = format!(
            "{}|{}|{}|{:?}|{:?}",
            n.domain, n.op, n.opset, n.inputs, n.attrs
        );
        let Some(&j) = first.get(&key) else {
            first.insert(key, i);
            continue;
        };
        let m = &g.nodes[j];
        // Every output this node gives must be one the earlier node gives too.
        let pairs: Option<Vec<(ValueId, ValueId)>> = n
            .outputs
            .iter()
            .enumerate()
            .filter_map(|(k, o)| o.map(|o| (k, o)))
            .map(|(k, o)| Some((o, m.outputs.get(k).copied().flatten()?)))
            .collect();
        let Some(pairs) = pairs else {
            continue;
        };
        log.push(format!("{} = {} (common subexpression)", n.name, m.name));
        renames.extend(pairs);
        dead.insert(i);
    }
    remove_nodes(g, &dead);
    dead.len()
}

/// Removes nodes no graph output depends on, then initializers nothing reads (an initializer
/// that is also a declared input stays: callers may feed it).
pub fn dead_code(model: &mut Model, _log: &mut Vec<String>) -> usize {
    let g = &mut model.graph;
    let mut needed: HashSet<ValueId> = g.outputs.iter().copied().collect();
    let mut dead = HashSet::new();
    for (i, n) in g.nodes.iter().enumerate().rev() {
        if n.outputs.iter().flatten().any(|o| needed.contains(o)) {
            needed.extend(n.inputs.iter().flatten().copied());
            needed.extend(n.implicit_inputs.iter().copied());
        } else {
            dead.insert(i);
        }
    }
    remove_nodes(g, &dead);
    let inputs: HashSet<ValueId> = g.inputs.iter().copied().collect();
    let before = g.initializers.len();
    g.initializers
        .retain(|(id, _)| needed.contains(id) || inputs.contains(id));
    dead.len() + (before - g.initializers.len())
}
