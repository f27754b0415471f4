//! Static shape inference (concrete dims only) and FLOP estimates, for the passes and
//! `ferrum inspect`.
//!
//! Shapes come from graph inputs, initializers and `Constant`s, and are propagated node by node
//! by each op's rules ([`crate::ops::Rules`], kept beside its kernel); a value whose shape
//! depends on anything else (or whose op has no shape rule) stays unknown.

use std::collections::HashMap;

use crate::ir::{Dim, Model, Node, ValueId, ValueType};
use crate::ops::Known;
use crate::tensor::Value;

/// Known shapes (and small constant integer values, for Reshape targets) by value.
#[derive(Default)]
pub struct Shapes {
    pub shapes: HashMap<ValueId, Vec<usize>>,
    consts: HashMap<ValueId, Vec<i64>>,
}

impl Shapes {
    pub fn get(&self, v: Option<ValueId>) -> Option<&Vec<usize>> {
        self.shapes.get(&v?)
    }

    /// What is known at `n`'s inputs, for its op's rules.
    fn known<'a>(&'a self, n: &'a Node) -> Known<'a> {
        Known {
            node: n,
            dims: n
                .inputs
                .iter()
                .map(|v| v.and_then(|v| self.shapes.get(&v)).map(Vec::as_slice))
                .collect(),
            ints: n
                .inputs
                .iter()
                .map(|v| v.and_then(|v| self.consts.get(&v)).map(Vec::as_slice))
                .collect(),
        }
    }
}

/// Propagates concrete shapes through the main graph.
pub fn static_shapes(m: &Model) -> Shapes {
    let mut s = Shapes {
        shapes: HashMap::new(),
        consts: HashMap::new(),
    };
    let g = &m.graph;
    for id in &g.inputs {
        if let ValueType::Tensor { shape: Some(d), .. } = &m.value(*id).ty {
            if let Some(k) = d
                .iter()
                .map(|d| {
                    if let Dim::Known(k) = d {
                        Some(*k)
                    } else {
                        None
                    }
                })
                .collect::<Option<Vec<_>>>()
            {
                s.shapes.insert(*id, k);
            }
        }
    }
    for (id, t) in &g.initializers {
        let Value::Tensor(t) = t else { continue };
        s.shapes.insert(*id, t.shape().to_vec());
        if let Some(c) = crate::ops::small_ints(t) {
            s.consts.insert(*id, c);
        }
    }
    for n in &g.nodes {
        let Some(rules) = crate::ops::rules(n) else {
            continue;
        };
        let out = (rules.shape)(&s.known(n));
        if let (Some(out), Some(Some(o))) = (out, n.outputs.first()) {
            if let Some(c) = out.ints {
                s.consts.insert(*o, c);
            }
            s.shapes.insert(*o, out.dims);
        }
    }
    s
}

/// Estimated floating-point operations of one node (multiply-add = 2), when its op has a cost
/// rule and the shapes it needs are known.
pub fn node_flops(n: &Node, s: &Shapes) -> Option<f64> {
    let flops = crate::ops::rules(n)?.flops?;
    let out = s.get(n.outputs.first().copied().flatten())?;
    flops(&s.known(n), out)
}
