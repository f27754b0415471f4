//! Element types at import: every node's inputs checked against the type constraints of its
//! op's ONNX schema (the version its opset imports), and its outputs' types inferred from them,
//! so that a model feeding an op a type the standard does not define for it (Sin on int64, Conv
//! on int32) fails when the session is created, naming the node, its op and opset and the
//! type, as ONNX Runtime fails when it finds no kernel for a node's types.
//!
//! Types come from the graph's declared inputs, its initializers and `Constant`s, and flow node
//! by node: an output whose type parameter an input binds has that input's type; an output
//! with one possible type has it; `Cast`, `ConstantOfShape`, the random generators,
//! `QuantizeLinear` and the like take theirs from an attribute or input; anything else falls
//! back to the type the file declares for the value, if any. A value whose type stays unknown
//! is not checked. Ops outside the default and `ai.onnx.ml` domains (ferrum's fused ops,
//! com.microsoft's) are not checked.

mod schemas;

use crate::error::UnsupportedOp;
use crate::ir::{Attr, Graph, Model, Node, ValueId, ValueType};
use crate::tensor::{DType, Value};
use crate::{Error, Result};

/// How a formal input or output takes values.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Opt {
    /// Exactly one value.
    S,
    /// One value, or none.
    O,
    /// Any number of values (at least one), all of one type.
    V,
    /// Any number of values, each of its own type.
    H,
}

/// A formal input or output of a schema.
#[derive(Debug)]
pub(crate) struct Param {
    pub name: &'static str,
    /// The index of its type parameter within the schema (formals with the same one share one
    /// type within a node), or 255 for a formal with a type of its own.
    pub class: u8,
    /// The tensor element types it takes: bit i is ONNX data type i.
    pub types: u32,
    /// Whether it also takes sequences, optionals or maps (which are not checked).
    pub other: bool,
    pub opt: Opt,
}

/// One version of an op's schema.
#[derive(Debug)]
pub(crate) struct Schema {
    pub domain: &'static str,
    pub op: &'static str,
    /// The opset version this version was introduced in.
    pub since: i64,
    pub inputs: &'static [Param],
    pub outputs: &'static [Param],
}

const fn p(name: &'static str, class: u8, types: u32, other: bool, opt: Opt) -> Param {
    Param {
        name,
        class,
        types,
        other,
        opt,
    }
}

const fn s(
    domain: &'static str,
    op: &'static str,
    since: i64,
    inputs: &'static [Param],
    outputs: &'static [Param],
) -> Schema {
    Schema {
        domain,
        op,
        since,
        inputs,
        outputs,
    }
}

/// The schema a node of `domain` (`""` for the default) and `op` follows under `opset`: the
/// newest version introduced at or before it.
pub(crate) fn schema(domain: &str, op: &str, opset: i64) -> Option<&'static Schema> {
    let domain = if domain == "ai.onnx" { "" } else { domain };
    let all = schemas::SCHEMAS;
    let lo = all.partition_point(|s| (s.domain, s.op) < (domain, op));
    let n = all[lo..].partition_point(|s| s.domain == domain && s.op == op);
    all[lo..lo + n].iter().rev().find(|s| s.since <= opset)
}

/// The ONNX names of the types in a bit set, for messages.
fn type_names(types: u32) -> String {
    (0..32)
        .filter(|b| types & (1 << b) != 0)
        .map(DType::onnx_name)
        .collect::<Vec<_>>()
        .join(", ")
}

fn bit(t: DType) -> u32 {
    1u32 << t.onnx()
}

/// Checks every node's input types against its schema, inferring the model's value types as
/// it goes.
pub fn check(m: &Model) -> Result<()> {
    let mut types: Vec<Option<DType>> = vec![None; m.values.len()];
    walk(m, &m.graph, &mut types)
}

fn declared(m: &Model, v: ValueId) -> Option<DType> {
    match &m.values.get(v.0 as usize)?.ty {
        ValueType::Tensor { dtype, .. } => *dtype,
        _ => None,
    }
}

fn walk(m: &Model, g: &Graph, types: &mut [Option<DType>]) -> Result<()> {
    for &v in &g.inputs {
        types[v.0 as usize] = declared(m, v);
    }
    for (v, t) in &g.initializers {
        if let Value::Tensor(t) = t {
            types[v.0 as usize] = Some(t.dtype());
        }
    }
    for n in &g.nodes {
        for a in n.attrs.values() {
            match a {
                Attr::Graph(sub) => walk(m, sub, types)?,
                Attr::Graphs(subs) => {
                    for sub in subs {
                        walk(m, sub, types)?;
                    }
                }
                _ => {}
            }
        }
        let outs = node(n, types)?;
        for (o, t) in n
            .outputs
            .iter()
            .zip(outs.iter().copied().chain(std::iter::repeat(None)))
        {
            if let Some(o) = o {
                types[o.0 as usize] = t.or_else(|| declared(m, *o));
            }
        }
    }
    Ok(())
}

/// The formal parameter that actual input or output `i` takes (a variadic last formal takes
/// all the rest); `None` past the formals.
fn formal(params: &[Param], i: usize) -> Option<&Param> {
    match params.get(i) {
        Some(p) => Some(p),
        None => params.last().filter(|p| matches!(p.opt, Opt::V | Opt::H)),
    }
}

fn unsupported(n: &Node, dtype: Option<DType>, detail: String) -> Error {
    Error::Unsupported(Box::new(UnsupportedOp {
        node: n.name.clone(),
        op: n.op.clone(),
        domain: if n.domain.is_empty() || n.domain == "ai.onnx" {
            String::new()
        } else {
            format!("{}.", n.domain)
        },
        opset: n.opset,
        dtype: dtype.map(|t| t.to_string()),
        detail,
    }))
}

/// Checks one node's inputs; returns its outputs' types where they follow from the schema.
fn node(n: &Node, types: &[Option<DType>]) -> Result<Vec<Option<DType>>> {
    let Some(s) = schema(&n.domain, &n.op, n.opset) else {
        return Ok(Vec::new());
    };
    // The type each type parameter is bound to, and by which input.
    let mut bound: [Option<(DType, usize)>; 32] = [None; 32];
    for (i, v) in n.inputs.iter().enumerate() {
        let (Some(v), Some(f)) = (v, formal(s.inputs, i)) else {
            continue;
        };
        let Some(t) = types[v.0 as usize] else {
            continue;
        };
        if f.types & bit(t) == 0 {
            return Err(unsupported(
                n,
                Some(t),
                format!(
                    "input {i} ('{}') is {t}; {} (since opset {}) takes {}",
                    f.name,
                    s.op,
                    s.since,
                    if f.types == 0 {
                        "no tensors there".to_string()
                    } else {
                        type_names(f.types)
                    }
                ),
            ));
        }
        let Some(slot) = bound.get_mut(f.class as usize).filter(|_| f.opt != Opt::H) else {
            continue;
        };
        match *slot {
            None => *slot = Some((t, i)),
            Some((b, j)) if b != t => {
                return Err(Error::Format(format!(
                    "node '{}' ({}, opset {}): inputs {j} and {i} ('{}') take one type \
                     parameter but are {b} and {t}",
                    n.name, n.op, n.opset, f.name
                )))
            }
            Some(_) => {}
        }
    }
    let mut outs = Vec::with_capacity(n.outputs.len());
    for i in 0..n.outputs.len() {
        let Some(f) = formal(s.outputs, i) else {
            outs.push(None);
            continue;
        };
        let by_param = bound
            .get(f.class as usize)
            .filter(|_| f.opt != Opt::H)
            .copied()
            .flatten()
            .map(|(t, _)| t);
        let single = (!f.other && f.types.count_ones() == 1)
            .then(|| DType::from_onnx(f.types.trailing_zeros() as i32))
            .flatten();
        let t = by_param
            .or(single)
            .or_else(|| from_attrs(n, i, types))
            .filter(|t| f.types & bit(*t) != 0);
        outs.push(t);
    }
    Ok(outs)
}

/// Output `i`'s type for the ops whose output types an attribute or a particular input gives.
fn from_attrs(n: &Node, i: usize, types: &[Option<DType>]) -> Option<DType> {
    let int = |name: &str| match n.attrs.get(name) {
        Some(Attr::Int(v)) if *v != 0 => DType::from_onnx(*v as i32),
        _ => None,
    };
    let input = |k: usize| {
        n.inputs
            .get(k)
            .copied()
            .flatten()
            .and_then(|v| types[v.0 as usize])
    };
    if i != 0 {
        return None;
    }
    match n.op.as_str() {
        "Cast" => int("to"),
        "Constant" => n.attrs.iter().find_map(|(k, a)| match (k.as_str(), a) {
            ("value", Attr::Tensor(t)) => Some(t.dtype()),
            ("value_float" | "value_floats", _) => Some(DType::F32),
            ("value_int" | "value_ints", _) => Some(DType::I64),
            ("value_string" | "value_strings", _) => Some(DType::Str),
            _ => None,
        }),
        "ConstantOfShape" => match n.attrs.get("value") {
            Some(Attr::Tensor(t)) => Some(t.dtype()),
            _ => Some(DType::F32),
        },
        "RandomNormal" | "RandomUniform" => int("dtype").or(Some(DType::F32)),
        "RandomNormalLike" | "RandomUniformLike" | "Bernoulli" | "EyeLike" => {
            int("dtype").or_else(|| input(0))
        }
        "Multinomial" => int("dtype").or(Some(DType::I32)),
        "QuantizeLinear" => input(2).or_else(|| int("output_dtype")).or(Some(DType::U8)),
        "DequantizeLinear" => int("output_dtype").or_else(|| input(1)),
        "HannWindow" | "HammingWindow" | "BlackmanWindow" | "MelWeightMatrix" => {
            int("output_datatype").or(Some(DType::F32))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_sorted_and_finds_the_version_an_opset_imports() {
        let all = schemas::SCHEMAS;
        assert!(all
            .windows(2)
            .all(|w| (w[0].domain, w[0].op, w[0].since) < (w[1].domain, w[1].op, w[1].since)));
        assert_eq!(schema("", "Add", 13).unwrap().since, 13);
        assert_eq!(schema("", "Add", 12).unwrap().since, 7);
        assert_eq!(schema("ai.onnx", "Add", 21).unwrap().since, 14);
        assert!(schema("", "Add", 0).is_none());
        assert!(schema("", "NoSuchOp", 21).is_none());
        assert!(schema("ai.onnx.ml", "TreeEnsembleClassifier", 3).is_some());
        // Add-14 takes int8 and bfloat16; Add-7 neither.
        let t = |o| schema("", "Add", o).unwrap().inputs[0].types;
        assert_ne!(t(14) & bit(DType::I8), 0);
        assert_eq!(t(7) & bit(DType::I8), 0);
        assert_eq!(t(7) & bit(DType::BF16), 0);
    }
}
