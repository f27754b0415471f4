//! Folding into weights (level 1) and fusion into producing products (level 2).

use std::collections::HashSet;

use crate::infer::static_shapes;
use crate::ir::{Attr, Graph, Model, Node, ValueId};
use crate::passes::{
    add_initializer, attr_f, attr_i, const_f32, const_scalar, constant, is_op, other_input, out,
    remove_nodes, Uses, DOMAIN,
};
use crate::tensor::{DType, Tensor};

/// The Conv at `i` when its weights (and bias, if any) are float32 constants: (W, B, out
/// channels).
fn const_conv(model: &Model, n: &Node) -> Option<(Tensor, Option<Vec<f32>>, usize)> {
    let g = &model.graph;
    if !is_op(n, "Conv") || n.outputs.len() != 1 {
        return None;
    }
    let w = constant(g, n.inputs.get(1).copied().flatten()?)?;
    if w.dtype() != DType::F32 || w.rank() < 3 {
        return None;
    }
    let m = w.shape()[0];
    let b = match n.inputs.get(2).copied().flatten() {
        None => None,
        Some(b) => {
            let b = const_f32(g, Some(b))?;
            if b.len() != m {
                return None;
            }
            Some(b.to_vec())
        }
    };
    Some((w.clone(), b, m))
}

/// Replaces the Conv's weights by `w * scale[c]` and its bias by `b * scale[c] + shift[c]`
/// (per output channel `c`, computed in f64 and rounded once), reading `out` from now on.
fn rescale_conv(
    model: &mut Model,
    conv: usize,
    (w, b, m): (Tensor, Option<Vec<f32>>, usize),
    scale: &[f64],
    shift: &[f64],
    out: ValueId,
) {
    let per = w.len() / m.max(1);
    let wv = w.as_slice::<f32>().expect("f32 weights");
    let nw: Vec<f32> = wv
        .iter()
        .enumerate()
        .map(|(i, &x)| (x as f64 * scale[i / per]) as f32)
        .collect();
    let nb: Vec<f32> = (0..m)
        .map(|c| (b.as_ref().map_or(0.0, |b| b[c] as f64) * scale[c] + shift[c]) as f32)
        .collect();
    let name = model.graph.nodes[conv].name.clone();
    let wt = Tensor::from_vec(w.shape().to_vec(), nw).expect("same shape");
    let bt = Tensor::from_vec(vec![m], nb).expect("m values");
    let wid = add_initializer(model, &format!("{name}.weight"), wt);
    let bid = add_initializer(model, &format!("{name}.bias"), bt);
    let n = &mut model.graph.nodes[conv];
    n.inputs.resize(3, None);
    n.inputs[1] = Some(wid);
    n.inputs[2] = Some(bid);
    n.outputs[0] = Some(out);
}

/// Conv followed by BatchNormalization (inference form, constant statistics) becomes one Conv
/// with rescaled weights and a shifted bias.
pub fn conv_batchnorm(model: &mut Model, log: &mut Vec<String>) -> usize {
    let uses = Uses::of(&model.graph);
    let mut dead = HashSet::new();
    for bi in 0..model.graph.nodes.len() {
        let g = &model.graph;
        let bn = &g.nodes[bi];
        if !is_op(bn, "BatchNormalization")
            || attr_i(bn, "training_mode", 0) != 0
            || attr_i(bn, "spatial", 1) != 1
            || bn
                .outputs
                .iter()
                .skip(1)
                .flatten()
                .any(|o| uses.pinned.contains(o) || uses.readers.contains_key(o))
        {
            continue;
        }
        let (Some(Some(x)), Some(Some(y))) = (bn.inputs.first(), bn.outputs.first()) else {
            continue;
        };
        let Some(&ci) = uses.producer.get(x) else {
            continue;
        };
        if uses.sole_reader(*x) != Some(bi) || dead.contains(&ci) {
            continue;
        }
        let Some(conv) = const_conv(model, &g.nodes[ci]) else {
            continue;
        };
        let m = conv.2;
        let p: Vec<&[f32]> = (1..5)
            .filter_map(|i| const_f32(g, bn.inputs.get(i).copied().flatten()))
            .collect();
        if p.len() != 4 || p.iter().any(|v| v.len() != m) {
            continue;
        }
        let eps = attr_f(bn, "epsilon", 1e-5) as f64;
        let scale: Vec<f64> = (0..m)
            .map(|c| p[0][c] as f64 / (p[3][c] as f64 + eps).sqrt())
            .collect();
        let shift: Vec<f64> = (0..m)
            .map(|c| p[1][c] as f64 - p[2][c] as f64 * scale[c])
            .collect();
        log.push(format!(
            "{} + {} -> Conv (batch norm folded into the weights)",
            g.nodes[ci].name, bn.name
        ));
        let y = *y;
        rescale_conv(model, ci, conv, &scale, &shift, y);
        dead.insert(bi);
    }
    remove_nodes(&mut model.graph, &dead);
    dead.len()
}

/// Conv followed by an Add or Mul of a per-output-channel constant (shape `[M, 1, ..]` or
/// `[1, M, 1, ..]`, or one value) becomes one Conv with adjusted bias (and weights, for Mul).
pub fn conv_add_bias(model: &mut Model, log: &mut Vec<String>) -> usize {
    let uses = Uses::of(&model.graph);
    let mut dead = HashSet::new();
    for ai in 0..model.graph.nodes.len() {
        let g = &model.graph;
        let op = &g.nodes[ai];
        let mul = is_op(op, "Mul");
        if !(is_op(op, "Add") || mul) || op.opset < 7 || op.inputs.len() != 2 {
            continue;
        }
        let Some(Some(y)) = op.outputs.first() else {
            continue;
        };
        for side in 0..2 {
            let (Some(x), Some(c)) = (op.inputs[side], op.inputs[1 - side]) else {
                continue;
            };
            let Some(&ci) = uses.producer.get(&x) else {
                continue;
            };
            if uses.sole_reader(x) != Some(ai) || dead.contains(&ci) {
                continue;
            }
            let Some(conv) = const_conv(model, &g.nodes[ci]) else {
                continue;
            };
            let (rank, m) = (conv.0.rank(), conv.2);
            let Some(ct) = constant(g, c).filter(|t| t.dtype() == DType::F32) else {
                continue;
            };
            // Broadcast against [N, M, spatial..]: every dim 1 except (optionally) the channel.
            let s = ct.shape();
            let ch = s.len().checked_sub(rank - 1);
            let fits = s.len() <= rank
                && s.iter().enumerate().all(|(i, &d)| {
                    d == 1 || (Some(i) == ch && d == m) || (s.len() == rank && i == 1 && d == m)
                });
            if !fits {
                continue;
            }
            let cv = ct.as_slice::<f32>().expect("f32");
            let per_c = |c: usize| cv[if cv.len() == 1 { 0 } else { c }] as f64;
            let (scale, shift): (Vec<f64>, Vec<f64>) = if mul {
                ((0..m).map(per_c).collect(), vec![0.0; m])
            } else {
                (vec![1.0; m], (0..m).map(per_c).collect())
            };
            log.push(format!(
                "{} + {} -> Conv ({} folded into the {})",
                g.nodes[ci].name,
                op.name,
                if mul { "scale" } else { "constant" },
                if mul { "weights and bias" } else { "bias" }
            ));
            let y = *y;
            rescale_conv(model, ci, conv, &scale, &shift, y);
            dead.insert(ai);
            break;
        }
    }
    remove_nodes(&mut model.graph, &dead);
    dead.len()
}

/// Values of a float32 constant that varies along the last axis only (every other dim 1, rank at
/// most `max_rank`, so broadcasting it against a product's output keeps that output's shape):
/// one value, or `n`.
fn last_axis_const(g: &Graph, v: ValueId, n: usize, max_rank: usize) -> Option<&[f32]> {
    let t = constant(g, v).filter(|t| t.dtype() == DType::F32 && t.rank() <= max_rank)?;
    let s = t.shape();
    let last = s.last().copied().unwrap_or(1);
    if s.iter().rev().skip(1).any(|&d| d != 1) || (last != 1 && last != n) {
        return None;
    }
    t.as_slice::<f32>().ok()
}

/// A bias Add to rewrite: its node, the slot of its bias, the scaled bias.
type NewBias = (usize, usize, Tensor);

/// A MatMul by a float32 constant matrix `W` (`[K, N]`, read by it alone), optionally followed
/// by an Add of a constant bias along the last axis, then a Mul or Div by a nonzero finite
/// constant along the last axis (one value, `[N]`, or `[1, N]` where A's rank is known to be 2 or
/// more, so the output keeps its shape): the scale goes into `W` and the
/// bias (computed in f64, rounded once), and the Mul or Div goes. The pattern of a projection
/// scaled after it (`q_proj(x) * scaling` in many exported decoders, a linear layer then a
/// constant factor).
pub fn matmul_scale(model: &mut Model, log: &mut Vec<String>) -> usize {
    let uses = Uses::of(&model.graph);
    // A product's output has rank 2 or more when its A does (else rank 1): known from the
    // static shapes (propagated only once a match needs them), or from A's declared rank.
    let shapes = std::cell::OnceCell::new();
    let rank = |v: ValueId| {
        let shapes = shapes.get_or_init(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
                .unwrap_or_default()
        });
        shapes
            .shapes
            .get(&v)
            .map(Vec::len)
            .or(match &model.value(v).ty {
                crate::ir::ValueType::Tensor { shape: Some(d), .. } => Some(d.len()),
                _ => None,
            })
    };
    // Nodes matched this round (so no two matches share one), and the scaling nodes that go.
    let mut taken = HashSet::new();
    let mut gone = HashSet::new();
    // (MatMul, its new weight, the bias Add and its new bias, the output they now write).
    let mut rewrites: Vec<(usize, Tensor, Option<NewBias>, ValueId)> = Vec::new();
    for si in 0..model.graph.nodes.len() {
        let g = &model.graph;
        let sc = &g.nodes[si];
        let div = is_op(sc, "Div");
        if !(is_op(sc, "Mul") || div) || sc.opset < 7 || sc.inputs.len() != 2 {
            continue;
        }
        let Some(y) = out(sc) else { continue };
        let found = (0..if div { 1 } else { 2 }).find_map(|side| {
            let (x, c) = (sc.inputs[side]?, sc.inputs[1 - side]?);
            let pi = *uses.producer.get(&x)?;
            if uses.sole_reader(x) != Some(si) || taken.contains(&pi) {
                return None;
            }
            // The bias Add (either operand order), when there is one.
            let p = &g.nodes[pi];
            let (mi, bias) = if is_op(p, "Add") && p.opset >= 7 && p.inputs.len() == 2 {
                let (mm_out, b, slot) = match p.inputs.as_slice() {
                    [Some(a), Some(b)] if constant(g, *b).is_some() => (*a, *b, 1),
                    [Some(a), Some(b)] if constant(g, *a).is_some() => (*b, *a, 0),
                    _ => return None,
                };
                let mi = *uses.producer.get(&mm_out)?;
                if uses.sole_reader(mm_out) != Some(pi) || taken.contains(&mi) {
                    return None;
                }
                (mi, Some((pi, slot, b)))
            } else {
                (pi, None)
            };
            let mm = &g.nodes[mi];
            if !is_op(mm, "MatMul") || mm.inputs.len() != 2 || mm.outputs.len() != 1 {
                return None;
            }
            let wv = mm.inputs[1]?;
            let w = constant(g, wv).filter(|w| w.dtype() == DType::F32 && w.rank() == 2)?;
            if uses.sole_reader(wv) != Some(mi) {
                return None;
            }
            let n = w.shape()[1];
            // Unknown: only constants of rank 0 or 1, which never widen the output.
            let out_rank = match rank(mm.inputs[0]?) {
                Some(r) if r >= 2 => 2,
                _ => 1,
            };
            let cv = last_axis_const(g, c, n, out_rank)?;
            if cv.iter().any(|&v| !v.is_finite() || v == 0.0) {
                return None;
            }
            let f = |j: usize, x: f32| {
                let c = cv[if cv.len() == 1 { 0 } else { j }] as f64;
                (if div { x as f64 / c } else { x as f64 * c }) as f32
            };
            let nw: Vec<f32> = w
                .as_slice::<f32>()
                .ok()?
                .iter()
                .enumerate()
                .map(|(i, &x)| f(i % n, x))
                .collect();
            let nw = Tensor::from_vec(w.shape().to_vec(), nw).ok()?;
            let bias = match bias {
                None => None,
                Some((ai, slot, b)) => {
                    let bv = last_axis_const(g, b, n, out_rank)?;
                    // A single bias value scaled per column becomes a row of them.
                    let nb: Vec<f32> = if bv.len() == 1 && cv.len() > 1 {
                        (0..n).map(|j| f(j, bv[0])).collect()
                    } else {
                        bv.iter().enumerate().map(|(j, &x)| f(j, x)).collect()
                    };
                    let shape = if nb.len() == bv.len() {
                        constant(g, b)?.shape().to_vec()
                    } else {
                        vec![n]
                    };
                    Some((ai, slot, Tensor::from_vec(shape, nb).ok()?))
                }
            };
            Some((mi, nw, bias))
        });
        let Some((mi, nw, bias)) = found else {
            continue;
        };
        log.push(format!(
            "{}{} + {} -> MatMul ({} folded into the weights{})",
            g.nodes[mi].name,
            bias.as_ref().map_or(String::new(), |(ai, ..)| format!(
                " + {}",
                g.nodes[*ai].name
            )),
            sc.name,
            if div { "divisor" } else { "scale" },
            if bias.is_some() { " and bias" } else { "" }
        ));
        gone.insert(si);
        taken.insert(mi);
        if let Some((ai, ..)) = &bias {
            taken.insert(*ai);
        }
        rewrites.push((mi, nw, bias, y));
    }
    let n = rewrites.len();
    for (mi, nw, bias, y) in rewrites {
        let name = model.graph.nodes[mi].name.clone();
        let wid = add_initializer(model, &format!("{name}.weight"), nw);
        model.graph.nodes[mi].inputs[1] = Some(wid);
        match bias {
            Some((ai, slot, nb)) => {
                let bid = add_initializer(model, &format!("{name}.bias"), nb);
                let a = &mut model.graph.nodes[ai];
                a.inputs[slot] = Some(bid);
                a.outputs[0] = Some(y);
            }
            None => model.graph.nodes[mi].outputs[0] = Some(y),
        }
    }
    remove_nodes(&mut model.graph, &gone);
    n
}

fn near(v: Option<f32>, target: f64) -> bool {
    v.is_some_and(|v| ((v as f64) - target).abs() <= 1e-4 * target.abs())
}

/// The erf form of GELU as PyTorch exports it, `x * 0.5 * (1 + erf(x / sqrt 2))` (Div by sqrt 2
/// or Mul by 1/sqrt 2; the halving before or after the product with x), becomes one `Gelu`.
pub fn gelu(model: &mut Model, log: &mut Vec<String>) -> usize {
    let g = &model.graph;
    let uses = Uses::of(g);
    let node = |i: usize| &g.nodes[i];
    let other = |n: &Node, v: ValueId| -> Option<ValueId> {
        match n.inputs.as_slice() {
            [Some(a), Some(b)] if *a == v => Some(*b),
            [Some(a), Some(b)] if *b == v => Some(*a),
            _ => None,
        }
    };
    let mut dead = HashSet::new();
    let mut rewrites: Vec<(usize, ValueId)> = Vec::new();
    for (ei, erf) in g.nodes.iter().enumerate() {
        if !is_op(erf, "Erf") {
            continue;
        }
        let found = (|| {
            let e_in = erf.inputs.first().copied().flatten()?;
            let di = *uses.producer.get(&e_in)?;
            let d = node(di);
            let x = d.inputs.first().copied().flatten()?;
            let c = const_scalar(g, d.inputs.get(1).copied().flatten());
            let scaled = (is_op(d, "Div") && near(c, std::f64::consts::SQRT_2))
                || (is_op(d, "Mul") && near(c, std::f64::consts::FRAC_1_SQRT_2));
            if !scaled || uses.sole_reader(e_in) != Some(ei) {
                return None;
            }
            let e_out = out(erf)?;
            let ai = uses.sole_reader(e_out)?;
            let add = node(ai);
            if !is_op(add, "Add") || !near(const_scalar(g, other(add, e_out)), 1.0) {
                return None;
            }
            let a_out = out(add)?;
            let m1i = uses.sole_reader(a_out)?;
            let m1 = node(m1i);
            if !is_op(m1, "Mul") {
                return None;
            }
            let m1_out = out(m1)?;
            let o = other(m1, a_out)?;
            let mut chain = vec![di, ei, ai, m1i];
            let last = if o == x {
                // (x * (1 + erf)) * 0.5
                let m2i = uses.sole_reader(m1_out)?;
                let m2 = node(m2i);
                if !is_op(m2, "Mul") || !near(const_scalar(g, other(m2, m1_out)), 0.5) {
                    return None;
                }
                chain.push(m2i);
                m2i
            } else if near(const_scalar(g, Some(o)), 0.5) {
                // x * ((1 + erf) * 0.5)
                let m2i = uses.sole_reader(m1_out)?;
                let m2 = node(m2i);
                if !is_op(m2, "Mul") || other(m2, m1_out) != Some(x) {
                    return None;
                }
                chain.push(m2i);
                m2i
            } else {
                // (x * 0.5) * (1 + erf)
                let hi = *uses.producer.get(&o)?;
                let h = node(hi);
                if !is_op(h, "Mul")
                    || uses.sole_reader(o) != Some(m1i)
                    || other(h, x).is_none()
                    || !near(const_scalar(g, other(h, x)), 0.5)
                {
                    return None;
                }
                chain.push(hi);
                m1i
            };
            Some((chain, last, x))
        })();
        let Some((chain, last, x)) = found else {
            continue;
        };
        if chain.iter().any(|i| dead.contains(i)) {
            continue;
        }
        log.push(format!(
            "{} .. {} -> Gelu",
            g.nodes[chain[0]].name, g.nodes[last].name
        ));
        for &i in &chain {
            if i != last {
                dead.insert(i);
            }
        }
        rewrites.push((last, x));
    }
    into_unary(model, rewrites, &dead, "Gelu")
}

/// Turns each node `i` of `rewrites` into the one-input `com.ferrum` op `op` of `x` (the last
/// node of a matched pattern, which keeps its output), removes the pattern's other nodes
/// (`dead`), and returns the number of rewrites.
fn into_unary(
    model: &mut Model,
    rewrites: Vec<(usize, ValueId)>,
    dead: &HashSet<usize>,
    op: &str,
) -> usize {
    let count = rewrites.len();
    for (i, x) in rewrites {
        let n = &mut model.graph.nodes[i];
        n.op = op.into();
        n.domain = DOMAIN.into();
        n.inputs = vec![Some(x)];
        n.attrs.clear();
        n.name = format!("{}/{}", n.name, op.to_ascii_lowercase());
    }
    remove_nodes(&mut model.graph, dead);
    count
}

/// SiLU as exported, `Mul(x, Sigmoid(x))` (either operand order), where only the Mul reads
/// the Sigmoid's output, becomes one `Silu` (which [`activations`] then fuses into a
/// convolution or product that computes `x`).
pub fn silu(model: &mut Model, log: &mut Vec<String>) -> usize {
    let g = &model.graph;
    let uses = Uses::of(g);
    let mut dead = HashSet::new();
    let mut rewrites: Vec<(usize, ValueId)> = Vec::new();
    for (si, sig) in g.nodes.iter().enumerate() {
        if !is_op(sig, "Sigmoid") {
            continue;
        }
        let (Some(x), Some(s)) = (sig.inputs.first().copied().flatten(), out(sig)) else {
            continue;
        };
        let Some(mi) = uses.sole_reader(s) else {
            continue;
        };
        let m = &g.nodes[mi];
        let pair = matches!(m.inputs.as_slice(), [Some(a), Some(b)]
            if (*a == x && *b == s) || (*a == s && *b == x));
        if !is_op(m, "Mul") || !pair || m.outputs.len() != 1 || dead.contains(&mi) {
            continue;
        }
        log.push(format!("{} + {} -> Silu", sig.name, m.name));
        dead.insert(si);
        rewrites.push((mi, x));
    }
    into_unary(model, rewrites, &dead, "Silu")
}

/// An activation node's name and parameters, in the form the fused ops take.
fn activation(model: &Model, n: &Node) -> Option<(&'static str, Vec<f32>)> {
    let g = &model.graph;
    if n.domain == DOMAIN && n.op == "Gelu" {
        return Some(("Gelu", vec![]));
    }
    if n.domain == DOMAIN && n.op == "Silu" {
        return Some(("Silu", vec![]));
    }
    if !(n.domain.is_empty() || n.domain == "ai.onnx") || n.inputs.is_empty() {
        return None;
    }
    match n.op.as_str() {
        "Relu" => Some(("Relu", vec![])),
        "Sigmoid" => Some(("Sigmoid", vec![])),
        "Tanh" => Some(("Tanh", vec![])),
        "HardSwish" => Some(("HardSwish", vec![])),
        "LeakyRelu" => Some(("LeakyRelu", vec![attr_f(n, "alpha", 0.01)])),
        "HardSigmoid" => Some((
            "HardSigmoid",
            vec![attr_f(n, "alpha", 0.2), attr_f(n, "beta", 0.5)],
        )),
        "Gelu" => match n.attrs.get("approximate") {
            Some(Attr::Str(s)) if s.as_slice() == b"tanh" => Some(("GeluTanh", vec![])),
            _ => Some(("Gelu", vec![])),
        },
        "Clip" => {
            let (lo, hi) = if n.opset < 11 {
                (
                    n.attrs.get("min").map(|_| attr_f(n, "min", 0.0)),
                    n.attrs.get("max").map(|_| attr_f(n, "max", 0.0)),
                )
            } else {
                let bound = |i: usize| -> Option<Option<f32>> {
                    match n.inputs.get(i).copied().flatten() {
                        None => Some(None),
                        Some(v) => const_scalar(g, Some(v)).map(Some),
                    }
                };
                (bound(1)?, bound(2)?)
            };
            Some((
                "Clip",
                vec![lo.unwrap_or(f32::NEG_INFINITY), hi.unwrap_or(f32::INFINITY)],
            ))
        }
        _ => None,
    }
}

/// Bias (MatMul), residual Add (Conv, and MatMul after its bias) and an activation fused into
/// the float32 Conv, Gemm or MatMul producing their input: `FusedConv`, `FusedGemm`,
/// `FusedMatMul`; an activation alone into a `MatMulIntegerToFloat` (which took its bias when
/// it was fused). The fused node takes the place of the last node it absorbs (so a residual
/// computed after the product is ready).
pub fn activations(model: &mut Model, log: &mut Vec<String>) -> usize {
    // Shapes only decide whether a residual is worth fusing (the fused kernel broadcasts as
    // Add would when they are wrong); a model whose attributes make the estimate fail gets none.
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let g = &model.graph;
    let uses = Uses::of(g);
    let mut dead = HashSet::new();
    // (producer, last absorbed node, fused node)
    let mut fused: Vec<(usize, usize, Node)> = Vec::new();
    for (pi, p) in g.nodes.iter().enumerate() {
        let kind = if const_conv(model, p).is_some() {
            "FusedConv"
        } else if is_op(p, "Gemm") && const_f32(g, p.inputs.get(1).copied().flatten()).is_some() {
            "FusedGemm"
        } else if is_op(p, "MatMul")
            && constant(
                g,
                p.inputs
                    .get(1)
                    .copied()
                    .flatten()
                    .unwrap_or(ValueId(u32::MAX)),
            )
            .is_some_and(|b| b.dtype() == DType::F32 && b.rank() == 2)
        {
            "FusedMatMul"
        } else if p.domain == DOMAIN
            && p.op == "MatMulIntegerToFloat"
            && !p.attrs.contains_key("activation")
        {
            // Already carries its bias: an activation only.
            "MatMulIntegerToFloat"
        } else {
            continue;
        };
        let Some(mut cur) = out(p) else { continue };
        let mut inputs = p.inputs.clone();
        let mut act: Option<(&str, Vec<f32>)> = None;
        let mut absorbed: Vec<usize> = Vec::new();
        let mut what: Vec<&str> = Vec::new();
        while let Some(ri) = uses.sole_reader(cur) {
            let r = &g.nodes[ri];
            // A MatMul's residual: an Add after its bias (or of the bare product) of a
            // non-constant operand of the product's own static shape, added by the GEMM as
            // each tile is written: `(A B + bias) + z`, the unfused order. Not after a residual
            // (a bias there would change the order of the sums) or an activation.
            if kind == "FusedMatMul"
                && act.is_none()
                && what.iter().all(|&w| w == "bias")
                && is_op(r, "Add")
                && r.opset >= 7
            {
                let residual = other_input(r, cur).filter(|&o| {
                    constant(g, o).is_none()
                        && shapes.get(Some(cur)).is_some_and(|a| {
                            shapes.get(Some(o)) == Some(a) && a.iter().all(|&d| d > 0)
                        })
                });
                if let Some(z) = residual {
                    inputs.resize(3, None);
                    inputs.push(Some(z));
                    what.push("residual add");
                    absorbed.push(ri);
                    let Some(next) = out(r) else { break };
                    cur = next;
                    continue;
                }
            }
            if act.is_none() && absorbed.is_empty() && is_op(r, "Add") && r.opset >= 7 {
                let Some(o) = other_input(r, cur) else {
                    break;
                };
                if kind == "FusedMatMul" {
                    // A bias along the last axis, as long as B's columns.
                    let n = constant(g, inputs[1].expect("B")).expect("const B").shape()[1];
                    let Some(bt) = constant(g, o) else { break };
                    let s = bt.shape();
                    if bt.dtype() != DType::F32
                        || s.last() != Some(&n)
                        || s.iter().rev().skip(1).any(|&d| d != 1)
                        || s.len() > shapes.get(Some(cur)).map_or(2, |v| v.len())
                    {
                        break;
                    }
                    inputs.resize(2, None);
                    inputs.push(Some(o));
                    what.push("bias");
                } else if kind == "FusedConv" {
                    // A residual of the product's own (static) shape.
                    let (Some(a), Some(b)) = (shapes.get(Some(cur)), shapes.get(Some(o))) else {
                        break;
                    };
                    if a != b {
                        break;
                    }
                    inputs.resize(3, None);
                    inputs.push(Some(o));
                    what.push("residual add");
                } else {
                    break;
                }
            } else if act.is_none() {
                let Some(a) = activation(model, r) else { break };
                what.push(a.0);
                act = Some(a);
            } else {
                break;
            }
            absorbed.push(ri);
            let Some(next) = out(r) else { break };
            cur = next;
            if act.is_some() {
                break;
            }
        }
        let Some(&last) = absorbed.last() else {
            continue;
        };
        if absorbed.iter().any(|i| dead.contains(i)) || dead.contains(&pi) {
            continue;
        }
        let mut n = p.clone();
        n.domain = DOMAIN.into();
        n.op = kind.into();
        n.inputs = inputs;
        n.outputs = vec![Some(cur)];
        let (name, params) = act.unwrap_or(("Identity", vec![]));
        n.attrs
            .insert("activation".into(), Attr::Str(name.as_bytes().to_vec()));
        n.attrs
            .insert("activation_params".into(), Attr::Floats(params));
        log.push(format!("{} + {} -> {kind}", p.name, what.join(" + ")));
        dead.insert(pi);
        for &i in &absorbed {
            dead.insert(i);
        }
        fused.push((pi, last, n));
    }
    let count = fused.len();
    for (_, last, n) in fused {
        model.graph.nodes[last] = n;
        dead.remove(&last);
    }
    remove_nodes(&mut model.graph, &dead);
    count
}

/// True when `v` is the scale output of a DynamicQuantizeLinear (one float32 value).
fn dynamic_scale(g: &Graph, uses: &Uses, v: ValueId) -> bool {
    uses.producer.get(&v).is_some_and(|&i| {
        let n = &g.nodes[i];
        is_op(n, "DynamicQuantizeLinear") && n.outputs.get(1).copied().flatten() == Some(v)
    })
}

/// MatMulInteger -> Cast(float) -> Mul by `a_scale * b_scale` (-> Add of a bias), the chain ONNX
/// Runtime's `quantize_dynamic` writes for each MatMul with a constant weight, into one
/// `MatMulIntegerToFloat` (inputs A, B, a_scale, a_zero_point, b_scale, b_zero_point, bias),
/// which finishes the integer product in its epilogue with the chain's own roundings. B must be
/// a 2-D 8-bit constant, b_scale a float32 constant of one value or one per column, a_scale
/// one value (a DynamicQuantizeLinear's scale, or a scalar constant), the bias a float32
/// constant of one value per column.
pub fn int_matmul_to_float(model: &mut Model, log: &mut Vec<String>) -> usize {
    let g = &model.graph;
    let uses = Uses::of(g);
    let mut dead = HashSet::new();
    let mut fused: Vec<(usize, Node)> = Vec::new();
    for (pi, p) in g.nodes.iter().enumerate() {
        if !is_op(p, "MatMulInteger") {
            continue;
        }
        let Some(n) = p
            .inputs
            .get(1)
            .copied()
            .flatten()
            .and_then(|b| constant(g, b))
            .filter(|b| b.rank() == 2 && matches!(b.dtype(), DType::I8 | DType::U8))
            .map(|b| b.shape()[1])
        else {
            continue;
        };
        let Some(ci) = out(p).and_then(|v| uses.sole_reader(v)) else {
            continue;
        };
        let c = &g.nodes[ci];
        if !is_op(c, "Cast") || attr_i(c, "to", 0) != DType::F32.onnx() as i64 {
            continue;
        }
        let Some(cv) = out(c) else { continue };
        let Some(mi) = uses.sole_reader(cv) else {
            continue;
        };
        let mul = &g.nodes[mi];
        let Some(s) = other_input(mul, cv).filter(|_| is_op(mul, "Mul")) else {
            continue;
        };
        let Some(&si) = uses.producer.get(&s) else {
            continue;
        };
        let ms = &g.nodes[si];
        let [Some(x), Some(y)] = ms.inputs.as_slice() else {
            continue;
        };
        if !is_op(ms, "Mul") {
            continue;
        }
        let b_scale = |v: ValueId| {
            constant(g, v).is_some_and(|t| {
                t.dtype() == DType::F32 && t.rank() <= 1 && (t.len() == 1 || t.len() == n)
            })
        };
        let a_scale = |v: ValueId| {
            dynamic_scale(g, &uses, v)
                || constant(g, v).is_some_and(|t| t.dtype() == DType::F32 && t.rank() == 0)
        };
        let (sa, sb) = if a_scale(*x) && b_scale(*y) {
            (*x, *y)
        } else if a_scale(*y) && b_scale(*x) {
            (*y, *x)
        } else {
            continue;
        };
        let mut absorbed = vec![pi, ci, mi];
        if uses.sole_reader(s) == Some(mi) {
            absorbed.push(si);
        }
        let Some(mut result) = out(mul) else { continue };
        let mut bias = None;
        let mut what = "scales";
        if let Some(ai) = uses.sole_reader(result) {
            let add = &g.nodes[ai];
            let o = other_input(add, result).filter(|_| is_op(add, "Add") && add.opset >= 7);
            if let Some(o) = o.filter(|&o| {
                constant(g, o)
                    .is_some_and(|t| t.dtype() == DType::F32 && t.rank() == 1 && t.len() == n)
            }) {
                if let Some(r) = out(add) {
                    bias = Some(o);
                    absorbed.push(ai);
                    result = r;
                    what = "scales + bias";
                }
            }
        }
        if absorbed.iter().any(|i| dead.contains(i)) {
            continue;
        }
        let get = |i: usize| p.inputs.get(i).copied().flatten();
        let mut node = p.clone();
        node.domain = DOMAIN.into();
        node.op = "MatMulIntegerToFloat".into();
        node.inputs = vec![get(0), get(1), Some(sa), get(2), Some(sb), get(3), bias];
        node.outputs = vec![Some(result)];
        node.attrs.clear();
        log.push(format!(
            "{} + Cast + Mul({what}) -> MatMulIntegerToFloat",
            p.name
        ));
        let last = *absorbed.iter().max().unwrap();
        dead.extend(absorbed);
        fused.push((last, node));
    }
    let count = fused.len();
    for (last, node) in fused {
        model.graph.nodes[last] = node;
        dead.remove(&last);
    }
    remove_nodes(&mut model.graph, &dead);
    count
}
