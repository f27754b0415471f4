//! Quantization: QuantizeLinear, DequantizeLinear (per-tensor, per-axis, blocked; integer,
//! float8, float4, int4 and int2 targets), DynamicQuantizeLinear, QLinearMatMul, MatMulInteger.

use crate::ops::elementwise::cast;
use crate::ops::nn::{f64_tensor, matmul_f64, minus_zp};
use crate::ops::shape::strides;
use crate::ops::{axis, Ctx};
use crate::tensor::{DType, Tensor, Value};
use crate::Result;

fn matmul_integer(cx: &Ctx) -> Result<Tensor> {
    let (a, b) = (cx.t(0)?, cx.t(1)?);
    let av = minus_zp(a, cx.opt(2), false)?;
    let bv = minus_zp(b, cx.opt(3), true)?;
    let (shape, v) = matmul_f64(&av, a.shape(), &bv, b.shape())?;
    f64_tensor(shape, v, DType::I32)
}

/// Broadcasts a per-tensor, per-axis or blocked parameter to `x`'s elements.
fn param_index(x: &Tensor, p: &Tensor, ax: i64, block: usize) -> Result<Vec<usize>> {
    if p.len() == 1 {
        return Ok(vec![0; x.len()]);
    }
    let a = axis(ax, x.rank())?;
    let st = strides(x.shape());
    if p.rank() <= 1 {
        return Ok((0..x.len()).map(|i| (i / st[a]) % x.shape()[a]).collect());
    }
    let pst = strides(p.shape());
    let b = block.max(1);
    Ok((0..x.len())
        .map(|i| {
            (0..x.rank())
                .map(|d| {
                    let c = (i / st[d]) % x.shape()[d];
                    (if d == a { c / b } else { c }) * pst[d]
                })
                .sum()
        })
        .collect())
}

fn quantize(cx: &Ctx) -> Result<Tensor> {
    let (x, scale) = (cx.t(0)?, cx.t(1)?);
    let zp = cx.opt(2);
    let to = match (zp, cx.ai("output_dtype", 0)) {
        (Some(z), _) => z.dtype(),
        (None, 0) => DType::U8,
        (None, c) => DType::from_onnx(c as i32)
            .ok_or_else(|| crate::Error::UnsupportedType(DType::onnx_name(c as i32)))?,
    };
    let (lo, hi) = match to {
        DType::U8 => (0.0, 255.0),
        DType::I8 => (-128.0, 127.0),
        DType::U16 => (0.0, 65535.0),
        DType::I16 => (-32768.0, 32767.0),
        DType::I32 => (i32::MIN as f64, i32::MAX as f64),
        DType::U32 => (0.0, u32::MAX as f64),
        DType::I4 => (-8.0, 7.0),
        DType::U4 => (0.0, 15.0),
        DType::I2 => (-2.0, 1.0),
        DType::U2 => (0.0, 3.0),
        t if t.is_small() => (f64::NEG_INFINITY, f64::INFINITY),
        t => return Err(crate::Error::UnsupportedType(t.to_string())),
    };
    let float_target = lo.is_infinite();
    let idx = param_index(x, scale, cx.ai("axis", 1), cx.ai("block_size", 0) as usize)?;
    if float_target {
        // float8/float4: x / scale (+ zero point), rounded by the cast.
        let sv = scale.to_f64_vec()?;
        let zv = zp.map(|z| z.to_f64_vec()).transpose()?;
        let out: Vec<f64> = x
            .to_f64_vec()?
            .iter()
            .zip(&idx)
            .map(|(&v, &i)| (v as f32 / sv[i] as f32) as f64 + zv.as_ref().map_or(0.0, |z| z[i]))
            .collect();
        let t = Tensor::from_vec(x.shape().to_vec(), out)?;
        return crate::ops::elementwise::cast_with(&t, to, cx.ai("saturate", 1) != 0, "up");
    }
    let sv = scale.to_f64_vec()?;
    let zv = zp.map(|z| z.to_f64_vec()).transpose()?;
    // x / scale in the input's precision (f32 unless the input is f64), as the reference does:
    // it decides which way halves round.
    let wide = x.dtype() == DType::F64;
    let div = |a: f64, b: f64| {
        if wide {
            a / b
        } else {
            (a as f32 / b as f32) as f64
        }
    };
    let xv = x.to_f64_vec()?;
    let out = xv
        .iter()
        .zip(&idx)
        .map(|(&v, &i)| {
            let z = zv.as_ref().map_or(0.0, |z| z[i]);
            (div(v, sv[i]).round_ties_even() + z).clamp(lo, hi)
        })
        .collect();
    f64_tensor(x.shape().to_vec(), out, to)
}

fn dequantize(cx: &Ctx) -> Result<Tensor> {
    let (x, scale) = (cx.t(0)?, cx.t(1)?);
    let idx = param_index(x, scale, cx.ai("axis", 1), cx.ai("block_size", 0) as usize)?;
    let sv = scale.to_f64_vec()?;
    let zv = cx.opt(2).map(|z| z.to_f64_vec()).transpose()?;
    let xv = x.to_f64_vec()?;
    let out = xv
        .iter()
        .zip(&idx)
        .map(|(&v, &i)| (v - zv.as_ref().map_or(0.0, |z| z[i])) * sv[i])
        .collect();
    let to = match cx.ai("output_dtype", 0) {
        0 => scale.dtype(),
        c => DType::from_onnx(c as i32)
            .ok_or_else(|| crate::Error::UnsupportedType(DType::onnx_name(c as i32)))?,
    };
    // The product is rounded in the scale's type first, as the reference does.
    let y = f64_tensor(x.shape().to_vec(), out, scale.dtype())?;
    cast(&y, to)
}

fn dynamic_quantize(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let v = x.to_f64_vec()?;
    // In f32, as the reference computes it.
    let (mn, mx) = v.iter().fold((0f32, 0f32), |(a, b), &e| {
        (a.min(e as f32), b.max(e as f32))
    });
    let scale = if mx == mn { 1.0 } else { mx - mn } / 255.0;
    let zp = (0.0 - mn / scale).clamp(0.0, 255.0).round_ties_even();
    let y: Vec<f64> = v
        .iter()
        .map(|&e| ((e as f32 / scale).round_ties_even() + zp).clamp(0.0, 255.0) as f64)
        .collect();
    let (scale, zp) = (scale as f64, zp as f64);
    Ok(vec![
        Value::Tensor(f64_tensor(x.shape().to_vec(), y, DType::U8)?),
        Value::Tensor(Tensor::scalar(scale as f32)),
        Value::Tensor(Tensor::scalar(zp as u8)),
    ])
}

fn qlinear_matmul(cx: &Ctx) -> Result<Tensor> {
    let (a, b) = (cx.t(0)?, cx.t(3)?);
    let deq = |t: &Tensor, s: &Tensor, z: &Tensor, per_col: bool| -> Result<Vec<f64>> {
        let v = minus_zp(t, Some(z), per_col)?;
        let sv = s.to_f64_vec()?;
        if sv.len() == 1 {
            return Ok(v.iter().map(|e| e * sv[0]).collect());
        }
        let n = *t.shape().last().unwrap_or(&1);
        let r = t.rank();
        let m = t.shape()[r - 2];
        Ok(v.iter()
            .enumerate()
            .map(|(i, e)| e * if per_col { sv[i % n] } else { sv[(i / n) % m] })
            .collect())
    };
    let av = deq(a, cx.t(1)?, cx.t(2)?, false)?;
    let bv = deq(b, cx.t(4)?, cx.t(5)?, true)?;
    let (shape, v) = matmul_f64(&av, a.shape(), &bv, b.shape())?;
    let ys = cx.t(6)?.to_f64_vec()?[0];
    let yz = cx.t(7)?;
    let (lo, hi) = if yz.dtype() == DType::I8 {
        (-128.0, 127.0)
    } else {
        (0.0, 255.0)
    };
    let zz = yz.to_f64_vec()?[0];
    let out = v
        .iter()
        .map(|&e| ((e / ys).round_ties_even() + zz).clamp(lo, hi))
        .collect();
    f64_tensor(shape, out, yz.dtype())
}

/// Quantization ops; `None` when `cx`'s op is not one of them.
pub fn run(cx: &Ctx) -> Result<Option<Vec<Value>>> {
    let one = |t: Tensor| Ok(Some(vec![Value::Tensor(t)]));
    match cx.node.op.as_str() {
        "MatMulInteger" => one(matmul_integer(cx)?),
        "QLinearMatMul" => one(qlinear_matmul(cx)?),
        "QuantizeLinear" => one(quantize(cx)?),
        "DequantizeLinear" => one(dequantize(cx)?),
        "DynamicQuantizeLinear" => dynamic_quantize(cx).map(Some),
        _ => Ok(None),
    }
}
