//! Cheap static shape inference (concrete dims only) and FLOP estimates, for `ferrum inspect`.
//!
//! Shapes come from graph inputs, initializers and `Constant`s, and are propagated through the
//! common ops; a value whose shape depends on anything else stays unknown.

use std::collections::HashMap;

use crate::ir::{Attr, Dim, Model, Node, ValueId, ValueType};
use crate::ops::broadcast_shape;
use crate::tensor::{Tensor, Value};

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
}

fn const_ints(t: &Tensor) -> Option<Vec<i64>> {
    if t.len() <= 64 && t.dtype().is_int() {
        t.to_i64_vec().ok()
    } else {
        None
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
        if let Some(c) = const_ints(t) {
            s.consts.insert(*id, c);
        }
    }
    for n in &g.nodes {
        if let Some(shape) = infer_node(n, &mut s) {
            if let Some(Some(o)) = n.outputs.first() {
                s.shapes.insert(*o, shape);
            }
        }
    }
    s
}

fn ai(n: &Node, name: &str, d: i64) -> i64 {
    match n.attrs.get(name) {
        Some(Attr::Int(v)) => *v,
        _ => d,
    }
}

fn ints(n: &Node, name: &str) -> Option<Vec<i64>> {
    match n.attrs.get(name) {
        Some(Attr::Ints(v)) => Some(v.clone()),
        _ => None,
    }
}

/// The standard op a fused `com.ferrum` node computes the shape of.
fn base_op(n: &Node) -> &str {
    match (n.domain.as_str(), n.op.as_str()) {
        (crate::passes::DOMAIN, "FusedConv") => "Conv",
        (crate::passes::DOMAIN, "FusedGemm") => "Gemm",
        (crate::passes::DOMAIN, "FusedMatMul") => "MatMul",
        (_, op) => op,
    }
}

fn infer_node(n: &Node, s: &mut Shapes) -> Option<Vec<usize>> {
    let inp = |i: usize| s.get(n.inputs.get(i).copied().flatten()).cloned();
    let x = inp(0);
    match base_op(n) {
        "ConstantOfShape" => {
            let dims = s.consts.get(&n.inputs.first().copied().flatten()?)?;
            Some(dims.iter().map(|&d| d.max(0) as usize).collect())
        }
        "Shape" => {
            let x = x?;
            if let Some(Some(o)) = n.outputs.first() {
                if ai(n, "start", 0) == 0 && !n.attrs.contains_key("end") {
                    s.consts.insert(*o, x.iter().map(|&d| d as i64).collect());
                }
            }
            Some(vec![x.len()])
        }
        "Constant" => {
            if let Some(Attr::Tensor(t)) = n.attrs.get("value") {
                if let (Some(c), Some(Some(o))) = (const_ints(t), n.outputs.first()) {
                    s.consts.insert(*o, c);
                }
                return Some(t.shape().to_vec());
            }
            None
        }
        "QLinearAdd" if n.domain == crate::passes::DOMAIN => broadcast_shape(&x?, &inp(3)?).ok(),
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Max" | "Min" | "Sum" | "Equal" | "Less"
        | "Greater" | "Where" | "And" | "Or" | "PRelu" => {
            let mut acc = x?;
            for i in 1..n.inputs.len() {
                acc = broadcast_shape(&acc, &inp(i)?).ok()?;
            }
            Some(acc)
        }
        "Relu"
        | "QuantizeLinear"
        | "DequantizeLinear"
        | "Sigmoid"
        | "Tanh"
        | "Exp"
        | "Log"
        | "Sqrt"
        | "Erf"
        | "Neg"
        | "Abs"
        | "Clip"
        | "LeakyRelu"
        | "Elu"
        | "Gelu"
        | "HardSigmoid"
        | "HardSwish"
        | "Softmax"
        | "LogSoftmax"
        | "BatchNormalization"
        | "LayerNormalization"
        | "InstanceNormalization"
        | "Identity"
        | "Dropout"
        | "Cast"
        | "LRN"
        | "Reciprocal"
        | "Softplus"
        | "Mish"
        | "IsNaN"
        | "IsInf"
        | "Not"
        | "Sign"
        | "Floor"
        | "Ceil"
        | "Round" => x,
        "MatMul" => {
            let (a, b) = (x?, inp(1)?);
            if a.len() < 2 || b.len() < 2 {
                return None;
            }
            let mut batch = broadcast_shape(&a[..a.len() - 2], &b[..b.len() - 2]).ok()?;
            batch.push(a[a.len() - 2]);
            batch.push(b[b.len() - 1]);
            Some(batch)
        }
        "FusedAttention" if n.domain == crate::passes::DOMAIN => {
            if let Some(o) = ints(n, "out_shape") {
                return o.iter().map(|&d| usize::try_from(d).ok()).collect();
            }
            // (Q K) V, batch dims broadcast; each operand's shape is that of its view if any.
            let (q, k, v) = (
                attention_operand(n, "q", x)?,
                attention_operand(n, "k", inp(1))?,
                attention_operand(n, "v", inp(2))?,
            );
            if q.len() < 2 || k.len() < 2 || v.len() < 2 {
                return None;
            }
            let mut batch = broadcast_shape(&q[..q.len() - 2], &k[..k.len() - 2]).ok()?;
            batch = broadcast_shape(&batch, &v[..v.len() - 2]).ok()?;
            batch.push(q[q.len() - 2]);
            batch.push(v[v.len() - 1]);
            Some(batch)
        }
        "Gemm" => {
            let (a, b) = (x?, inp(1)?);
            let ([a0, a1], [b0, b1]) = (a.as_slice(), b.as_slice()) else {
                return None;
            };
            let m = if ai(n, "transA", 0) != 0 { a1 } else { a0 };
            let nn = if ai(n, "transB", 0) != 0 { b0 } else { b1 };
            Some(vec![*m, *nn])
        }
        "NhwcConv" | "NhwcExpandDepthwise" | "NhwcQLinearConv" | "NhwcMaxPool"
            if n.domain == crate::passes::DOMAIN =>
        {
            // X `[N, H, W, C]` (an NhwcConv's `[N, C, H, W]` with `nchw_input`) -> `[N, OH,
            // OW, M]`, the window (kh, kw) and M from the filter (`[kh, kw, C/group, M]`;
            // QLinearConv's `[M, C, kh, kw]`) or, for a pool, kernel_shape and C.
            let x = x?;
            // The spatial dims.
            let hw = if n.op == "NhwcConv" && ai(n, "nchw_input", 0) != 0 {
                2
            } else {
                1
            };
            let (kh, kw, m) = match n.op.as_str() {
                "NhwcConv" => {
                    let w = inp(1)?;
                    (*w.first()?, *w.get(1)?, *w.get(3)?)
                }
                // The window is the depthwise filter's (input 3; the expansion's is 1x1).
                "NhwcExpandDepthwise" => {
                    let w = inp(3)?;
                    (*w.first()?, *w.get(1)?, *w.get(3)?)
                }
                "NhwcQLinearConv" => {
                    let w = inp(3)?;
                    (*w.get(2)?, *w.get(3)?, *w.first()?)
                }
                _ => {
                    let k = ints(n, "kernel_shape")?;
                    let dim = |i: usize| usize::try_from(*k.get(i)?).ok();
                    (dim(0)?, dim(1)?, *x.get(3)?)
                }
            };
            if x.len() != 4 || kh == 0 || kw == 0 {
                return None;
            }
            let two = |name: &str, d: i64| ints(n, name).unwrap_or(vec![d; 2]);
            let (st, dl, pads) = (
                two("strides", 1),
                two("dilations", 1),
                ints(n, "pads").unwrap_or(vec![0; 4]),
            );
            if st.len() != 2 || dl.len() != 2 || pads.len() != 4 {
                return None;
            }
            let mut out = vec![x[0]];
            for (i, k) in [kh, kw].into_iter().enumerate() {
                let (s, d) = (usize::try_from(st[i]).ok()?, usize::try_from(dl[i]).ok()?);
                let (p0, p1) = (
                    usize::try_from(pads[i]).ok()?,
                    usize::try_from(pads[i + 2]).ok()?,
                );
                let ek = (k - 1).checked_mul(d)? + 1;
                out.push((x.get(i + hw)?.checked_add(p0 + p1)?).checked_sub(ek)? / s.max(1) + 1);
            }
            out.push(m);
            Some(out)
        }
        "Conv" | "QLinearConv" | "MaxPool" | "AveragePool" => {
            let x = x?;
            let nd = x.len().checked_sub(2)?;
            let conv = matches!(base_op(n), "Conv" | "QLinearConv");
            let filter = if base_op(n) == "QLinearConv" { 3 } else { 1 };
            let k: Vec<usize> = if conv {
                inp(filter)?.get(2..)?.to_vec()
            } else {
                ints(n, "kernel_shape")?
                    .iter()
                    .map(|&v| usize::try_from(v).ok())
                    .collect::<Option<_>>()?
            };
            let pos = |v: Vec<i64>, len: usize, min: i64| -> Option<Vec<usize>> {
                (v.len() == len && v.iter().all(|&x| x >= min))
                    .then(|| v.iter().map(|&x| x as usize).collect())
            };
            let st = pos(ints(n, "strides").unwrap_or(vec![1; nd]), nd, 1)?;
            let dl = pos(ints(n, "dilations").unwrap_or(vec![1; nd]), nd, 1)?;
            let pads = pos(ints(n, "pads").unwrap_or(vec![0; 2 * nd]), 2 * nd, 0)?;
            if k.len() != nd || k.contains(&0) {
                return None;
            }
            let auto =
                matches!(n.attrs.get("auto_pad"), Some(Attr::Str(v)) if v.starts_with(b"SAME"));
            let mut out = vec![x[0], if conv { *inp(filter)?.first()? } else { x[1] }];
            for i in 0..nd {
                let o = if auto {
                    x[i + 2].div_ceil(st[i])
                } else {
                    let ek = (k[i] - 1).checked_mul(dl[i])? + 1;
                    (x[i + 2].checked_add(pads[i])?.checked_add(pads[i + nd])?).checked_sub(ek)?
                        / st[i]
                        + 1
                };
                out.push(o);
            }
            Some(out)
        }
        "NhwcGlobalAveragePool" if n.domain == crate::passes::DOMAIN => {
            let x = x?;
            let [b, _, _, c] = x.as_slice() else {
                return None;
            };
            Some(vec![*b, *c, 1, 1])
        }
        "GlobalAveragePool" | "GlobalMaxPool" => {
            let x = x?;
            let mut o = x.get(..2)?.to_vec();
            o.extend(std::iter::repeat_n(1, x.len() - 2));
            Some(o)
        }
        "Flatten" => {
            let x = x?;
            let a = ai(n, "axis", 1);
            let a = if a < 0 { a + x.len() as i64 } else { a } as usize;
            let all = x.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
            let outer = x[..a.min(x.len())]
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))?;
            Some(vec![outer, all / outer.max(1)])
        }
        "Transpose" => {
            let x = x?;
            let perm: Vec<usize> = ints(n, "perm")
                .map(|p| p.iter().map(|&v| v as usize).collect())
                .unwrap_or((0..x.len()).rev().collect());
            perm.iter().map(|&p| x.get(p).copied()).collect()
        }
        "Reshape" => {
            let x = x?;
            let spec = s.consts.get(&n.inputs.get(1).copied().flatten()?)?.clone();
            let mut out: Vec<usize> = Vec::new();
            let mut infer = None;
            for (i, &d) in spec.iter().enumerate() {
                match d {
                    -1 => {
                        infer = Some(i);
                        out.push(1);
                    }
                    0 => out.push(*x.get(i)?),
                    d => out.push(d as usize),
                }
            }
            if let Some(i) = infer {
                let all = x.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
                let known = out.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
                out[i] = all / known.max(1);
            }
            Some(out)
        }
        "Expand" => {
            let to = s.consts.get(&n.inputs.get(1).copied().flatten()?)?;
            let to: Vec<usize> = to
                .iter()
                .map(|&d| usize::try_from(d).ok())
                .collect::<Option<_>>()?;
            broadcast_shape(&x?, &to).ok()
        }
        "Gather" => {
            // data[.., idx, ..] along `axis`; small constant vectors (shapes) carried through.
            let (x, idx) = (x?, inp(1)?);
            let a = ai(n, "axis", 0);
            let a = if a < 0 { a + x.len() as i64 } else { a } as usize;
            if a >= x.len() {
                return None;
            }
            let konst = |i: usize| s.consts.get(&n.inputs.get(i).copied().flatten()?).cloned();
            if let (Some(data), Some(ix), Some(Some(o)), 1) =
                (konst(0), konst(1), n.outputs.first(), x.len())
            {
                let picked: Option<Vec<i64>> = ix
                    .iter()
                    .map(|&i| {
                        let i = if i < 0 { i + data.len() as i64 } else { i };
                        data.get(usize::try_from(i).ok()?).copied()
                    })
                    .collect();
                if let Some(p) = picked {
                    s.consts.insert(*o, p);
                }
            }
            let mut out = x[..a].to_vec();
            out.extend_from_slice(&idx);
            out.extend_from_slice(&x[a + 1..]);
            Some(out)
        }
        "Unsqueeze" | "Squeeze" => {
            let x = x?;
            let axes = match ints(n, "axes") {
                Some(a) => Some(a),
                None => match n.inputs.get(1).copied().flatten() {
                    Some(v) => Some(s.consts.get(&v)?.clone()),
                    None => None,
                },
            };
            let out = if base_op(n) == "Unsqueeze" {
                let axes = axes?;
                let r = (x.len() + axes.len()) as i64;
                let mut at: Vec<usize> = axes
                    .iter()
                    .map(|&a| if a < 0 { a + r } else { a })
                    .map(|a| usize::try_from(a).ok().filter(|&a| a < r as usize))
                    .collect::<Option<_>>()?;
                at.sort_unstable();
                let mut out = x.clone();
                for a in at {
                    if a > out.len() {
                        return None;
                    }
                    out.insert(a, 1);
                }
                out
            } else {
                let r = x.len() as i64;
                let drop: Vec<usize> = match axes {
                    Some(axes) => axes
                        .iter()
                        .map(|&a| usize::try_from(if a < 0 { a + r } else { a }).ok())
                        .collect::<Option<_>>()?,
                    None => (0..x.len()).filter(|&i| x[i] == 1).collect(),
                };
                if drop.iter().any(|&a| x.get(a) != Some(&1)) {
                    return None;
                }
                (0..x.len())
                    .filter(|i| !drop.contains(i))
                    .map(|i| x[i])
                    .collect()
            };
            if let (Some(c), Some(Some(o))) = (
                s.consts.get(&n.inputs.first().copied().flatten()?).cloned(),
                n.outputs.first(),
            ) {
                s.consts.insert(*o, c);
            }
            Some(out)
        }
        "Slice" if n.opset >= 10 => {
            // Constant starts / ends (axes, steps): the shape, and a constant vector's values.
            let x = x?;
            let konst = |i: usize| s.consts.get(&n.inputs.get(i).copied().flatten()?).cloned();
            let (starts, ends) = (konst(1)?, konst(2)?);
            let axes = match n.inputs.get(3).copied().flatten() {
                Some(_) => konst(3)?,
                None => (0..starts.len() as i64).collect(),
            };
            let steps = match n.inputs.get(4).copied().flatten() {
                Some(_) => konst(4)?,
                None => vec![1; starts.len()],
            };
            if starts.len() != ends.len()
                || axes.len() != starts.len()
                || steps.len() != starts.len()
            {
                return None;
            }
            let mut out = x.clone();
            let mut ranges = vec![None; x.len()];
            for i in 0..starts.len() {
                let a = if axes[i] < 0 {
                    axes[i] + x.len() as i64
                } else {
                    axes[i]
                };
                let a = usize::try_from(a).ok().filter(|&a| a < x.len())?;
                if steps[i] != 1 {
                    return None;
                }
                let dim = x[a] as i64;
                let clamp = |v: i64| (if v < 0 { v + dim } else { v }).clamp(0, dim);
                let (b, e) = (clamp(starts[i]), clamp(ends[i]));
                out[a] = (e - b).max(0) as usize;
                ranges[a] = Some((b as usize, e.max(b) as usize));
            }
            if let (Some(c), Some(Some(o)), 1) = (konst(0), n.outputs.first(), x.len()) {
                let (b, e) = ranges[0].unwrap_or((0, c.len()));
                if let Some(v) = c.get(b..e) {
                    s.consts.insert(*o, v.to_vec());
                }
            }
            Some(out)
        }
        "Concat" => {
            let konst = |i: usize| s.consts.get(&n.inputs.get(i).copied().flatten()?).cloned();
            let joined: Option<Vec<i64>> = (0..n.inputs.len())
                .map(konst)
                .collect::<Option<Vec<_>>>()
                .map(|v| v.concat());
            let mut acc = x?;
            let a = ai(n, "axis", 0);
            let a = if a < 0 { a + acc.len() as i64 } else { a } as usize;
            for i in 1..n.inputs.len() {
                *acc.get_mut(a)? += inp(i)?.get(a)?;
            }
            if let (Some(j), Some(Some(o))) = (joined, n.outputs.first()) {
                if j.len() <= 64 {
                    s.consts.insert(*o, j);
                }
            }
            Some(acc)
        }
        _ => None,
    }
}

/// A `FusedAttention` operand's shape: its view's (`{name}_shape`), else its input's.
fn attention_operand(n: &Node, name: &str, input: Option<Vec<usize>>) -> Option<Vec<usize>> {
    match ints(n, &format!("{name}_shape")) {
        Some(v) => v.iter().map(|&d| usize::try_from(d).ok()).collect(),
        None => input,
    }
}

/// Estimated floating-point operations of one node (multiply-add = 2), when shapes are known.
pub fn node_flops(n: &Node, s: &Shapes) -> Option<f64> {
    let inp = |i: usize| s.get(n.inputs.get(i).copied().flatten());
    let out = s.get(n.outputs.first().copied().flatten());
    let numel = |v: &Vec<usize>| v.iter().map(|&d| d as f64).product::<f64>();
    match base_op(n) {
        "MatMul" => {
            let a = inp(0)?;
            Some(2.0 * numel(out?) * *a.last()? as f64)
        }
        "FusedAttention" => {
            // Both products, per output row: sk * (d + dv) multiply-adds, and the softmax.
            let (q, v, o) = (
                attention_operand(n, "q", inp(0).cloned())?,
                attention_operand(n, "v", inp(2).cloned())?,
                out?,
            );
            let (d, sk, dv) = (
                *q.last()? as f64,
                v[v.len().checked_sub(2)?] as f64,
                *o.last()? as f64,
            );
            Some(numel(o) / dv.max(1.0) * sk * (2.0 * (d + dv) + 5.0))
        }
        "Gemm" => {
            let a = inp(0)?;
            let k = if ai(n, "transA", 0) != 0 {
                a.first()?
            } else {
                a.get(1)?
            };
            Some(2.0 * numel(out?) * *k as f64)
        }
        "Conv" => {
            let w = inp(1)?;
            Some(2.0 * numel(out?) * w.get(1..)?.iter().map(|&d| d as f64).product::<f64>())
        }
        // W `[M, C, kh, kw]` (input 3); 8-bit multiply-adds counted as FLOPs.
        "QLinearConv" | "NhwcQLinearConv" => {
            let w = inp(3)?;
            Some(2.0 * numel(out?) * w.get(1..)?.iter().map(|&d| d as f64).product::<f64>())
        }
        // W `[kh, kw, C/group, M]`.
        "NhwcConv" => {
            let w = inp(1)?;
            Some(2.0 * numel(out?) * w.get(..3)?.iter().map(|&d| d as f64).product::<f64>())
        }
        // The expansion (`[1, 1, C, M]` over every input pixel) and the depthwise filter
        // (`[kh, kw, 1, M]`).
        "NhwcExpandDepthwise" => {
            let (x, w) = (inp(0)?, inp(3)?);
            let pixels = x.get(..3)?.iter().map(|&d| d as f64).product::<f64>();
            let taps = (*w.first()? * *w.get(1)?) as f64;
            Some(
                2.0 * pixels * *inp(1)?.get(2)? as f64 * *w.get(3)? as f64
                    + 2.0 * numel(out?) * taps,
            )
        }
        "MaxPool" | "AveragePool" => {
            let k: usize = ints(n, "kernel_shape")?
                .iter()
                .map(|&v| v as usize)
                .product();
            Some(numel(out?) * k as f64)
        }
        "GlobalAveragePool" | "GlobalMaxPool" | "NhwcGlobalAveragePool" => Some(numel(inp(0)?)),
        "Softmax"
        | "LogSoftmax"
        | "LayerNormalization"
        | "BatchNormalization"
        | "InstanceNormalization" => Some(5.0 * numel(inp(0)?)),
        "Add" | "Sub" | "Mul" | "Div" | "Relu" | "Sigmoid" | "Tanh" | "Exp" | "Sqrt" | "Erf"
        | "Pow" | "Clip" | "LeakyRelu" | "Gelu" | "Max" | "Min" | "Sum" | "Neg" | "Reciprocal" => {
            Some(numel(out?))
        }
        _ => None,
    }
}
