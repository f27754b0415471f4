//! Level 2: the QDQ form of quantized convolutions, residual adds and linear layers into integer
//! operators.
//!
//! A statically quantized model in QDQ form (what `onnxruntime.quantization.quantize_static`
//! writes by default) keeps float operators between DequantizeLinear and QuantizeLinear nodes:
//! `Q(Conv(DQ(x), DQ(w), DQ(b)))`. Run as written, every convolution is a float one on weights
//! dequantized once by constant folding. This pass rewrites each such group into ONNX's
//! `QLinearConv`, which the runtime computes on the integer GEMM, each quantized residual
//! `Q(Add(DQ(a), DQ(b)))` into `com.ferrum.QLinearAdd`, and each `Gemm(DQ(x), DQ(w), DQ(b))`
//! into `com.ferrum.MatMulIntegerToFloat`, as ONNX Runtime's QDQ transformers do.
//! It runs before constant folding, which would otherwise fold the weights' DequantizeLinear
//! away.

use std::collections::HashSet;

use crate::ir::{Attr, Graph, Model, Node, ValueId};
use crate::passes::{add_initializer, attr_i, constant, is_op, remove_nodes, Uses, DOMAIN};
use crate::tensor::{DType, Tensor};

/// A DequantizeLinear's or QuantizeLinear's constant parameters.
struct QParams<'a> {
    node: usize,
    data: ValueId,
    scale: ValueId,
    zero: Option<ValueId>,
    scales: &'a [f32],
    zero_dtype: Option<DType>,
}

/// Node `i` when it is a (De)QuantizeLinear `op` whose scale is a float32 constant of one value
/// (or `per` values along axis 0) and its zero point, if any, a constant of as many values.
fn qparams<'a>(g: &'a Graph, i: usize, op: &str, per: usize) -> Option<QParams<'a>> {
    let n = &g.nodes[i];
    if !is_op(n, op) || attr_i(n, "block_size", 0) != 0 {
        return None;
    }
    let get = |k: usize| n.inputs.get(k).copied().flatten();
    let (data, scale) = (get(0)?, get(1)?);
    let s = constant(g, scale).filter(|t| t.dtype() == DType::F32)?;
    let len = s.len();
    if !(len == 1 && s.rank() <= 1 || per > 1 && len == per && s.rank() == 1) {
        return None;
    }
    if len > 1 && attr_i(n, "axis", 1) != 0 {
        return None;
    }
    let zero = get(2);
    let zero_dtype = match zero {
        None => None,
        Some(z) => {
            let z = constant(g, z).filter(|z| z.len() == len)?;
            Some(z.dtype())
        }
    };
    Some(QParams {
        node: i,
        data,
        scale,
        zero,
        scales: s.as_slice::<f32>().ok()?,
        zero_dtype,
    })
}

/// The weight behind `v` when `v` is a DequantizeLinear of a constant 8-bit tensor of `rank`
/// dimensions, per tensor or per slice along axis 0, its zero point (if any) of the same type:
/// the integer tensor and the DequantizeLinear's parameters.
fn quantized_weight<'a>(
    g: &'a Graph,
    uses: &Uses,
    v: Option<ValueId>,
    rank: usize,
) -> Option<(&'a Tensor, QParams<'a>)> {
    let i = *uses.producer.get(&v?)?;
    let wq = constant(g, g.nodes[i].inputs.first().copied().flatten()?)
        .filter(|t| t.rank() == rank && matches!(t.dtype(), DType::U8 | DType::I8))?;
    let w = qparams(g, i, "DequantizeLinear", wq.shape()[0])?;
    if w.zero_dtype.is_some_and(|d| d != wq.dtype()) {
        return None;
    }
    Some((wq, w))
}

/// The bias behind `v` when `v` is a DequantizeLinear of a constant int32 tensor of `n`
/// values, zero point absent or 0, as quantizers write a bias.
fn int32_bias<'a>(g: &'a Graph, uses: &Uses, v: ValueId, n: usize) -> Option<QParams<'a>> {
    let b = qparams(g, *uses.producer.get(&v)?, "DequantizeLinear", n)?;
    let zero_ok = b.zero.is_none_or(|z| {
        constant(g, z).is_some_and(|z| z.to_i64_vec().is_ok_and(|v| v.iter().all(|&e| e == 0)))
    });
    (zero_ok && constant(g, b.data).is_some_and(|t| t.dtype() == DType::I32 && t.len() == n))
        .then_some(b)
}

/// `DequantizeLinear(x) -> Conv(., DequantizeLinear(w), DequantizeLinear(b)?) ->
/// QuantizeLinear`, 2-D with one group, every quantization parameter constant (X and Y per
/// tensor, 8-bit; W 8-bit per tensor or per output channel; the bias int32 with scale `x_scale *
/// w_scale` and no zero point, as quantizers write it), becomes `QLinearConv`. The Conv's
/// output must have no other reader; the DequantizeLinear of X stays while others read it.
pub fn qdq_conv(model: &mut Model, log: &mut Vec<String>) -> usize {
    let g = &model.graph;
    let uses = Uses::of(g);
    let eight = |d: Option<DType>| matches!(d, Some(DType::U8 | DType::I8));
    let mut dead = HashSet::new();
    let mut fused: Vec<(usize, Node, Option<Tensor>)> = Vec::new();
    for (ci, conv) in g.nodes.iter().enumerate() {
        if !is_op(conv, "Conv") || attr_i(conv, "group", 1) != 1 || conv.outputs.len() != 1 {
            continue;
        }
        let get = |k: usize| conv.inputs.get(k).copied().flatten();
        let producer = |v: Option<ValueId>| v.and_then(|v| uses.producer.get(&v).copied());
        let Some(x) = producer(get(0)).and_then(|i| qparams(g, i, "DequantizeLinear", 1)) else {
            continue;
        };
        let Some((wq, w)) = quantized_weight(g, &uses, get(1), 4) else {
            continue;
        };
        let m = wq.shape()[0];
        if !eight(x.zero_dtype) {
            continue;
        }
        let Some(y) = conv.outputs[0]
            .and_then(|v| uses.sole_reader(v))
            .and_then(|i| qparams(g, i, "QuantizeLinear", 1))
        else {
            continue;
        };
        let qy = &g.nodes[y.node];
        if !eight(y.zero_dtype) || attr_i(qy, "output_dtype", 0) != 0 {
            continue;
        }
        let Some(y_out) = qy.outputs.first().copied().flatten() else {
            continue;
        };
        // The bias: int32 in units of x_scale * w_scale (within float32 rounding), zero point 0.
        let mut bias = None;
        let mut absorbed = vec![ci, y.node, w.node];
        if let Some(bv) = get(2) {
            let Some(b) = int32_bias(g, &uses, bv, m) else {
                continue;
            };
            let scale_ok = (0..m).all(|o| {
                let want =
                    x.scales[0] as f64 * w.scales[if w.scales.len() == 1 { 0 } else { o }] as f64;
                let got = b.scales[if b.scales.len() == 1 { 0 } else { o }] as f64;
                (got - want).abs() <= want.abs() * f32::EPSILON as f64
            });
            if !scale_ok {
                continue;
            }
            bias = Some(b.data);
            if uses.sole_reader(get(2).unwrap()) == Some(ci) {
                absorbed.push(b.node);
            }
        }
        if uses.sole_reader(get(0).unwrap()) == Some(ci) {
            absorbed.push(x.node);
        }
        if uses.sole_reader(get(1).unwrap()) != Some(ci) {
            absorbed.retain(|&i| i != w.node);
        }
        if absorbed.iter().any(|i| dead.contains(i)) {
            continue;
        }
        let zero_w = w.zero;
        let mut node = conv.clone();
        node.op = "QLinearConv".into();
        node.domain = String::new();
        node.inputs = vec![
            Some(x.data),
            Some(x.scale),
            x.zero,
            Some(w.data),
            Some(w.scale),
            zero_w,
            Some(y.scale),
            y.zero,
            bias,
        ];
        node.outputs = vec![Some(y_out)];
        let keep: Vec<(String, Attr)> = [
            "auto_pad",
            "dilations",
            "group",
            "kernel_shape",
            "pads",
            "strides",
        ]
        .iter()
        .filter_map(|k| conv.attrs.get(*k).map(|a| (k.to_string(), a.clone())))
        .collect();
        node.attrs = keep.into_iter().collect();
        // QLinearConv requires W's zero point: a zero of W's type per tensor when DQ had none.
        let zero_t = if zero_w.is_none() {
            Some(match wq.dtype() {
                DType::U8 => Tensor::from_vec(vec![], vec![0u8]).expect("scalar"),
                _ => Tensor::from_vec(vec![], vec![0i8]).expect("scalar"),
            })
        } else {
            None
        };
        log.push(format!(
            "DequantizeLinear + {} + QuantizeLinear -> QLinearConv",
            conv.name
        ));
        dead.extend(absorbed);
        fused.push((y.node, node, zero_t));
    }
    let count = fused.len();
    for (at, mut node, zero_t) in fused {
        if let Some(t) = zero_t {
            let id = add_initializer(model, &format!("{}.w_zero_point", node.name), t);
            node.inputs[5] = Some(id);
        }
        model.graph.nodes[at] = node;
        dead.remove(&at);
    }
    remove_nodes(&mut model.graph, &dead);
    count
}

/// `QuantizeLinear(Add(DequantizeLinear(a), DequantizeLinear(b)))`, every parameter a constant
/// of one value and the zero points 8-bit, becomes `com.ferrum.QLinearAdd` (which computes the
/// chain's own float32 operations: the same bits). The Add's output must have no other reader;
/// the DequantizeLinear nodes stay while others read them.
pub fn qdq_add(model: &mut Model, log: &mut Vec<String>) -> usize {
    let g = &model.graph;
    let uses = Uses::of(g);
    let eight = |d: Option<DType>| matches!(d, Some(DType::U8 | DType::I8));
    let mut dead = HashSet::new();
    let mut fused: Vec<(usize, Node)> = Vec::new();
    for (ai, add) in g.nodes.iter().enumerate() {
        if !is_op(add, "Add") || add.opset < 7 || add.outputs.len() != 1 {
            continue;
        }
        let [Some(va), Some(vb)] = add.inputs.as_slice() else {
            continue;
        };
        let dq = |v: &ValueId| {
            uses.producer
                .get(v)
                .and_then(|&i| qparams(g, i, "DequantizeLinear", 1))
                .filter(|q| eight(q.zero_dtype))
        };
        let (Some(a), Some(b)) = (dq(va), dq(vb)) else {
            continue;
        };
        let Some(y) = add.outputs[0]
            .and_then(|v| uses.sole_reader(v))
            .and_then(|i| qparams(g, i, "QuantizeLinear", 1))
            .filter(|q| eight(q.zero_dtype) && attr_i(&g.nodes[q.node], "output_dtype", 0) == 0)
        else {
            continue;
        };
        let Some(out) = g.nodes[y.node].outputs.first().copied().flatten() else {
            continue;
        };
        let mut absorbed = vec![ai, y.node];
        for (v, q) in [(va, &a), (vb, &b)] {
            if uses.sole_reader(*v) == Some(ai) && !absorbed.contains(&q.node) {
                absorbed.push(q.node);
            }
        }
        if absorbed.iter().any(|i| dead.contains(i)) {
            continue;
        }
        let mut node = add.clone();
        node.domain = DOMAIN.into();
        node.op = "QLinearAdd".into();
        node.inputs = vec![
            Some(a.data),
            Some(a.scale),
            a.zero,
            Some(b.data),
            Some(b.scale),
            b.zero,
            Some(y.scale),
            y.zero,
        ];
        node.outputs = vec![Some(out)];
        node.attrs.clear();
        log.push(format!(
            "DequantizeLinear x2 + {} + QuantizeLinear -> QLinearAdd",
            add.name
        ));
        dead.extend(absorbed);
        fused.push((y.node, node));
    }
    let count = fused.len();
    for (at, node) in fused {
        model.graph.nodes[at] = node;
        dead.remove(&at);
    }
    remove_nodes(&mut model.graph, &dead);
    count
}

/// `Gemm(DequantizeLinear(x), DequantizeLinear(w), DequantizeLinear(b)?)` as PyTorch's Linear
/// exports and `quantize_static` quantizes it: `transB = 1`, no `transA`, `alpha` 1 (and `beta`
/// 1 with a bias); X 8-bit per tensor; W a 2-D 8-bit constant `[n, k]`, per tensor or per
/// output row (axis 0); the bias int32 with a float32 scale and no (or a zero) zero point.
/// It becomes `com.ferrum.MatMulIntegerToFloat` on W transposed (a new `[k, n]` initializer)
/// with the dequantized bias: the integer product times `x_scale * w_scale` plus the bias, what
/// ONNX Runtime's QGemm computes, in place of a float product over weights dequantized to four
/// times their bytes. Readers of the Gemm's output (a QuantizeLinear, usually) stay.
pub fn qdq_gemm(model: &mut Model, log: &mut Vec<String>) -> usize {
    let g = &model.graph;
    let uses = Uses::of(g);
    let eight = |d: Option<DType>| matches!(d, Some(DType::U8 | DType::I8));
    let mut dead = HashSet::new();
    // (Gemm's index, its replacement, W transposed, the bias)
    let mut fused: Vec<(usize, Node, Tensor, Option<Tensor>)> = Vec::new();
    for (gi, gemm) in g.nodes.iter().enumerate() {
        if !is_op(gemm, "Gemm")
            || gemm.outputs.len() != 1
            || attr_i(gemm, "transA", 0) != 0
            || attr_i(gemm, "transB", 0) != 1
            || gemm
                .attrs
                .get("alpha")
                .is_some_and(|a| !matches!(a, Attr::Float(v) if *v == 1.0))
            || gemm
                .attrs
                .get("beta")
                .is_some_and(|a| !matches!(a, Attr::Float(v) if *v == 1.0))
        {
            continue;
        }
        let get = |k: usize| gemm.inputs.get(k).copied().flatten();
        let producer = |v: Option<ValueId>| v.and_then(|v| uses.producer.get(&v).copied());
        let Some(x) = producer(get(0))
            .and_then(|i| qparams(g, i, "DequantizeLinear", 1))
            .filter(|x| eight(x.zero_dtype))
        else {
            continue;
        };
        let Some((wq, w)) = quantized_weight(g, &uses, get(1), 2) else {
            continue;
        };
        let (n, k) = (wq.shape()[0], wq.shape()[1]);
        let mut absorbed = vec![];
        let mut bias = None;
        if let Some(bid) = get(2) {
            let Some(b) = int32_bias(g, &uses, bid, n) else {
                continue;
            };
            let Some(bv) = constant(g, b.data).and_then(|t| t.to_i64_vec().ok()) else {
                continue;
            };
            // DequantizeLinear's value: the product rounded once to float32.
            let deq: Vec<f32> = bv
                .iter()
                .enumerate()
                .map(|(j, &v)| {
                    (v as f64 * b.scales[if b.scales.len() == 1 { 0 } else { j }] as f64) as f32
                })
                .collect();
            bias = Some(Tensor::from_vec(vec![n], deq).expect("bias"));
            if uses.sole_reader(bid) == Some(gi) {
                absorbed.push(b.node);
            }
        }
        // DequantizeLinear nodes that other nodes read too stay.
        if uses.sole_reader(get(1).expect("W")) == Some(gi) {
            absorbed.push(w.node);
        }
        if uses.sole_reader(get(0).expect("X")) == Some(gi) {
            absorbed.push(x.node);
        }
        if absorbed.iter().any(|i| dead.contains(i)) {
            continue;
        }
        let wt: Tensor = match wq.dtype() {
            DType::I8 => {
                let v = wq.as_slice::<i8>().expect("int8");
                Tensor::from_vec(
                    vec![k, n],
                    (0..k * n).map(|e| v[(e % n) * k + e / n]).collect(),
                )
            }
            _ => {
                let v = wq.as_slice::<u8>().expect("uint8");
                Tensor::from_vec(
                    vec![k, n],
                    (0..k * n).map(|e| v[(e % n) * k + e / n]).collect(),
                )
            }
        }
        .expect("transposed weight");
        let mut node = gemm.clone();
        node.domain = DOMAIN.into();
        node.op = "MatMulIntegerToFloat".into();
        node.inputs = vec![
            Some(x.data),
            None, // W transposed, added below
            Some(x.scale),
            x.zero,
            Some(w.scale),
            w.zero,
            None, // the bias, added below
        ];
        node.attrs.clear();
        log.push(format!(
            "DequantizeLinear + {} -> MatMulIntegerToFloat",
            gemm.name
        ));
        dead.extend(absorbed);
        fused.push((gi, node, wt, bias));
    }
    let count = fused.len();
    for (at, mut node, wt, bias) in fused {
        node.inputs[1] = Some(add_initializer(
            model,
            &format!("{}.weight_t", node.name),
            wt,
        ));
        node.inputs[6] = bias.map(|b| add_initializer(model, &format!("{}.bias", node.name), b));
        if node.inputs[6].is_none() {
            node.inputs.pop();
        }
        model.graph.nodes[at] = node;
        dead.remove(&at);
    }
    remove_nodes(&mut model.graph, &dead);
    count
}
