//! Quantization: QuantizeLinear, DequantizeLinear (per-tensor, per-axis, blocked; integer,
//! float8, float4, int4 and int2 targets), DynamicQuantizeLinear, QLinearMatMul, MatMulInteger,
//! and the fused `com.ferrum` MatMulIntegerToFloat and QLinearAdd.
//!
//! MatMulInteger (and MatMulIntegerToFloat) on 8-bit operands with a 2-D B and zero points per
//! tensor, per row of a 2-D A or per column of B run on the integer GEMM
//! ([`ferrum_kernels::qgemm`], B taken prepacked when the session packed it); other forms, and
//! the reference itself, compute in f64 (exact for these integers). DynamicQuantizeLinear on
//! float32 runs on the kernels' quantizer. Both give the reference's bits.

use std::borrow::Cow;

use ferrum_kernels::pool;
use ferrum_kernels::qgemm::{self, Bytes, PackedI8, QOut, QuantA};

/// Elements per task of the elementwise quantizers.
const CHUNK: usize = 1 << 15;

use crate::ops::elementwise::{broadcast_offsets, broadcast_shape, cast};
use crate::ops::nn::{f64_tensor, matmul_f64, minus_zp};
use crate::ops::shape::strides;
use crate::ops::{axis, Ctx};
use crate::ops::{one, same_shape, Kernel, Rules};
use crate::tensor::{DType, Tensor, Value};
use crate::{kbail, Result};

/// An integer product in the GEMM's terms: A as unsigned bytes (signed ones shifted by 128, as
/// is their zero point), its zero points, B packed, B's zero points, the output's shape.
struct IntProduct<'a> {
    a: Cow<'a, [u8]>,
    a_zero: Vec<i32>,
    m: usize,
    b: Cow<'a, PackedI8>,
    b_zero: Vec<i32>,
    shape: Vec<usize>,
}

impl IntProduct<'_> {
    fn n(&self) -> usize {
        self.b.n()
    }

    fn run(&self, out: QOut) {
        let a = QuantA {
            data: &self.a,
            m: self.m,
            ld: self.b.k(),
            zero: &self.a_zero,
            zero_padded: false,
        };
        qgemm::qgemm(a, &self.b, &self.b_zero, out);
    }
}

/// `cx`'s inputs A (0), B (1) and the zero points at `za`, `zb` in the GEMM's terms, when it
/// takes them (8-bit A of rank >= 1, 8-bit 2-D B, zero points per tensor, per row of a 2-D A,
/// per column of B); `None` for the forms left to the reference.
fn int_product<'a>(cx: &Ctx<'a>, za: usize, zb: usize) -> Result<Option<IntProduct<'a>>> {
    let (a, b) = (cx.t(0)?, cx.t(1)?);
    let eight = |t: &Tensor| matches!(t.dtype(), DType::U8 | DType::I8);
    if !eight(a) || !eight(b) || a.rank() == 0 || b.rank() != 2 {
        return Ok(None);
    }
    let (k, n) = (b.shape()[0], b.shape()[1]);
    if a.shape()[a.rank() - 1] != k || k == 0 || n == 0 || a.is_empty() {
        return Ok(None);
    }
    let m = a.len() / k;
    let shift = if a.dtype() == DType::I8 { 128 } else { 0 };
    let a_zero: Vec<i32> = match cx.opt(za) {
        None => vec![shift],
        Some(z) => z.to_i64_vec()?.iter().map(|&v| v as i32 + shift).collect(),
    };
    if !(a_zero.len() == 1 || (a_zero.len() == m && a.rank() == 2)) {
        return Ok(None);
    }
    let b_zero: Vec<i32> = match cx.opt(zb) {
        None => vec![0],
        Some(z) => zero_points(z)?,
    };
    if !(b_zero.len() == 1 || b_zero.len() == n) {
        return Ok(None);
    }
    let a_bytes: Cow<[u8]> = match a.dtype() {
        DType::U8 => Cow::Borrowed(a.as_slice::<u8>()?),
        _ => Cow::Owned(
            a.as_slice::<i8>()?
                .iter()
                .map(|&v| (v as u8) ^ 0x80)
                .collect(),
        ),
    };
    let packed = match cx.packed_int_b(1) {
        Some(p) if p.k() == k && p.n() == n => Cow::Borrowed(p),
        _ => {
            let src = match b.dtype() {
                DType::U8 => Bytes::U8(b.as_slice::<u8>()?),
                _ => Bytes::I8(b.as_slice::<i8>()?),
            };
            Cow::Owned(PackedI8::new(k, n, src, n, 1))
        }
    };
    let mut shape = a.shape().to_vec();
    *shape.last_mut().unwrap() = n;
    Ok(Some(IntProduct {
        a: a_bytes,
        a_zero,
        m,
        b: packed,
        b_zero,
        shape,
    }))
}

/// A weight's zero points as i32: one value when they are all equal (symmetric weights give
/// zeros), else one each; 8-bit ones read in place rather than widened first.
pub(crate) fn zero_points(z: &Tensor) -> Result<Vec<i32>> {
    fn of<T: Copy + PartialEq>(z: &[T], to: impl Fn(T) -> i32) -> Vec<i32> {
        match z.first() {
            Some(&f) if z.iter().all(|&v| v == f) => vec![to(f)],
            _ => z.iter().map(|&v| to(v)).collect(),
        }
    }
    Ok(match z.dtype() {
        DType::U8 => of(z.as_slice::<u8>()?, |v| v as i32),
        DType::I8 => of(z.as_slice::<i8>()?, |v| v as i32),
        _ => of(&z.to_i64_vec()?, |v| v as i32),
    })
}

fn matmul_integer(cx: &Ctx) -> Result<Tensor> {
    if let Some(p) = int_product(cx, 2, 3)? {
        let mut out = crate::arena::overwritten(p.m * p.n(), 0i32);
        let n = p.n();
        p.run(QOut::I32 {
            out: &mut out,
            ld: n,
        });
        return Tensor::from_vec(p.shape, out);
    }
    let (shape, v) = matmul_integer_ref(cx, 2, 3)?;
    f64_tensor(shape, v, DType::I32)
}

/// The reference integer product `(A - za)(B - zb)` of `cx`'s inputs 0 and 1 with the zero
/// points at `za`, `zb`, in f64 (exact for 8-bit operands): its shape and values.
fn matmul_integer_ref(cx: &Ctx, za: usize, zb: usize) -> Result<(Vec<usize>, Vec<f64>)> {
    let (a, b) = (cx.t(0)?, cx.t(1)?);
    let av = minus_zp(a, cx.opt(za), false)?;
    let bv = minus_zp(b, cx.opt(zb), true)?;
    matmul_f64(&av, a.shape(), &bv, b.shape())
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

/// QuantizeLinear of float32 to 8 bits with one scale and zero point, in float32 as the
/// reference divides (the same bits); `None` for the other forms.
fn quantize_fast(cx: &Ctx) -> Result<Option<Tensor>> {
    let (x, scale) = (cx.t(0)?, cx.t(1)?);
    let zp = cx.opt(2);
    if x.dtype() != DType::F32
        || scale.dtype() != DType::F32
        || scale.len() != 1
        || cx.ai("block_size", 0) != 0
    {
        return Ok(None);
    }
    let to = match zp {
        Some(z) if z.len() == 1 => z.dtype(),
        None if cx.ai("output_dtype", 0) == 0 => DType::U8,
        _ => return Ok(None),
    };
    let z = match zp {
        Some(z) => z.to_i64_vec()?[0] as f32,
        None => 0.0,
    };
    let (xv, s) = (x.as_slice::<f32>()?, scale.as_slice::<f32>()?[0]);
    let shape = x.shape().to_vec();
    match to {
        DType::U8 => {
            let mut out = crate::arena::overwritten(xv.len(), 0u8);
            pool::parallel_chunks_mut(&mut out, CHUNK, |c, o| {
                qgemm::quantize_u8(&xv[c * CHUNK..c * CHUNK + o.len()], s, z, o)
            });
            Ok(Some(Tensor::from_vec(shape, out)?))
        }
        DType::I8 => {
            let mut out = crate::arena::overwritten(xv.len(), 0i8);
            pool::parallel_chunks_mut(&mut out, CHUNK, |c, o| {
                for (d, &v) in o.iter_mut().zip(&xv[c * CHUNK..]) {
                    *d = ((v / s).round_ties_even() + z).clamp(-128.0, 127.0) as i8;
                }
            });
            Ok(Some(Tensor::from_vec(shape, out)?))
        }
        _ => Ok(None),
    }
}

/// DequantizeLinear of 8- or 32-bit integers to float32 with one scale and zero point: `(x -
/// zero_point) * scale` rounded once to float32, as the reference (for 8 bits the float32
/// product is that rounding; 32-bit values go through f64). `None` for the other forms.
fn dequantize_fast(cx: &Ctx) -> Result<Option<Tensor>> {
    let (x, scale) = (cx.t(0)?, cx.t(1)?);
    let out_type = cx.ai("output_dtype", 0);
    if scale.dtype() != DType::F32
        || scale.len() != 1
        || cx.ai("block_size", 0) != 0
        || !(out_type == 0 || out_type == DType::F32.onnx() as i64)
        || cx
            .opt(2)
            .is_some_and(|z| z.len() != 1 || z.dtype() != x.dtype())
    {
        return Ok(None);
    }
    let z = match cx.opt(2) {
        Some(z) => z.to_i64_vec()?[0],
        None => 0,
    };
    let s = scale.as_slice::<f32>()?[0];
    let shape = x.shape().to_vec();
    let mut out = crate::arena::overwritten(x.len(), 0f32);
    match x.dtype() {
        DType::U8 => {
            let (xv, z) = (x.as_slice::<u8>()?, z as f32);
            pool::parallel_chunks_mut(&mut out, CHUNK, |c, o| {
                for (d, &v) in o.iter_mut().zip(&xv[c * CHUNK..]) {
                    *d = (v as f32 - z) * s;
                }
            });
        }
        DType::I8 => {
            let (xv, z) = (x.as_slice::<i8>()?, z as f32);
            pool::parallel_chunks_mut(&mut out, CHUNK, |c, o| {
                for (d, &v) in o.iter_mut().zip(&xv[c * CHUNK..]) {
                    *d = (v as f32 - z) * s;
                }
            });
        }
        DType::I32 => {
            for (d, &v) in out.iter_mut().zip(x.as_slice::<i32>()?) {
                *d = ((v as i64 - z) as f64 * s as f64) as f32;
            }
        }
        _ => return Ok(None),
    }
    Ok(Some(Tensor::from_vec(shape, out)?))
}

fn quantize(cx: &Ctx) -> Result<Tensor> {
    if let Some(t) = quantize_fast(cx)? {
        return Ok(t);
    }
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
    if let Some(t) = dequantize_fast(cx)? {
        return Ok(t);
    }
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

/// `com.ferrum` MatMulIntegerToFloat (inputs A, B, a_scale, a_zero_point, b_scale,
/// b_zero_point, bias): `Cast(MatMulInteger(A, B, za, zb), float) * (a_scale * b_scale) + bias`,
/// what ONNX Runtime's `quantize_dynamic` writes for a MatMul, with the same roundings: the
/// scales' product in f32, then the multiply, then the add. a_scale is one value; b_scale one
/// or one per column, bias one per column (the fusion checks).
pub(crate) fn matmul_integer_to_float(cx: &Ctx) -> Result<Tensor> {
    let a_scale = cx.t(2)?.as_slice::<f32>()?;
    let b_scale = cx.t(4)?.as_slice::<f32>()?;
    if a_scale.len() != 1 {
        kbail!("MatMulIntegerToFloat: a_scale must hold one value");
    }
    // In a buffer this thread recycles (one per column of a per-channel B: kilobytes a call).
    let mut scale = ferrum_core::Buf::overwritten(b_scale.len());
    for (d, &s) in scale.iter_mut().zip(b_scale) {
        *d = a_scale[0] * s;
    }
    let bias = cx.opt(6).map(|b| b.as_slice::<f32>()).transpose()?;
    let fast = int_product(cx, 3, 5)?;
    let n = match &fast {
        Some(p) => p.n(),
        None => *cx.t(1)?.shape().last().unwrap_or(&1),
    };
    if !(scale.len() == 1 || scale.len() == n) || bias.is_some_and(|b| b.len() != n) {
        kbail!("MatMulIntegerToFloat: b_scale and bias must hold 1 or {n} values");
    }
    if let Some(p) = fast {
        let mut out = crate::arena::overwritten(p.m * n, 0f32);
        p.run(QOut::F32 {
            out: &mut out,
            ld: n,
            scale: &scale,
            bias,
        });
        return Tensor::from_vec(p.shape, out);
    }
    // The reference: the integer product, then the same f32 operations element by element.
    let (shape, v) = matmul_integer_ref(cx, 3, 5)?;
    let out = v
        .iter()
        .enumerate()
        .map(|(e, &x)| {
            let j = e % n;
            let mut y = (x as i64 as i32) as f32 * scale[if scale.len() == 1 { 0 } else { j }];
            if let Some(b) = bias {
                y += b[j];
            }
            y
        })
        .collect();
    Tensor::from_vec(shape, out)
}

fn dynamic_quantize(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    if x.dtype() == DType::F32 {
        let xs = x.as_slice::<f32>()?;
        let mut q = crate::arena::overwritten(xs.len(), 0u8);
        let (scale, zp) = qgemm::quantize_dynamic_u8(xs, &mut q);
        return Ok(vec![
            Value::Tensor(Tensor::from_vec(x.shape().to_vec(), q)?),
            Value::Tensor(Tensor::scalar(scale)),
            Value::Tensor(Tensor::scalar(zp)),
        ]);
    }
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

/// The static rules of (de)quantization: input 0's shape.
pub fn rules(op: &str) -> Option<Rules> {
    matches!(
        op,
        "QuantizeLinear" | "DequantizeLinear" | "DynamicQuantizeLinear"
    )
    .then_some(Rules::shape(same_shape))
}

/// Quantization ops; `None` when `cx`'s op is not one of them.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "MatMulInteger" => |cx| one(matmul_integer(cx)?),
        "QLinearMatMul" => |cx| one(qlinear_matmul(cx)?),
        "QuantizeLinear" => |cx| one(quantize(cx)?),
        "DequantizeLinear" => |cx| one(dequantize(cx)?),
        "DynamicQuantizeLinear" => dynamic_quantize,
        _ => return None,
    };
    Some(k)
}

/// An 8-bit tensor's bytes and zero point, for [`qlinear_add`].
enum Q8<'a> {
    U8(&'a [u8]),
    I8(&'a [i8]),
}

impl Q8<'_> {
    /// `(x[i] - zero) * scale` for `i` in `from..from + out.len()` (or at the offsets `at`),
    /// DequantizeLinear's float32 value.
    fn dequantize(
        &self,
        zero: f32,
        scale: f32,
        from: usize,
        at: Option<&[usize]>,
        out: &mut [f32],
    ) {
        macro_rules! go {
            ($v:expr) => {
                match at {
                    None => {
                        for (d, &x) in out.iter_mut().zip(&$v[from..]) {
                            *d = (x as f32 - zero) * scale;
                        }
                    }
                    Some(at) => {
                        for (d, &i) in out.iter_mut().zip(&at[from..]) {
                            *d = ($v[i] as f32 - zero) * scale;
                        }
                    }
                }
            };
        }
        match self {
            Q8::U8(v) => go!(v),
            Q8::I8(v) => go!(v),
        }
    }
}

/// An 8-bit tensor's elements.
fn q8(t: &Tensor) -> Result<Q8<'_>> {
    Ok(match t.dtype() {
        DType::U8 => Q8::U8(t.as_slice::<u8>()?),
        DType::I8 => Q8::I8(t.as_slice::<i8>()?),
        d => kbail!("QLinearAdd on {d} inputs"),
    })
}

/// `com.ferrum` QLinearAdd (A, A_scale, A_zero_point, B, B_scale, B_zero_point, C_scale,
/// C_zero_point; ONNX Runtime's op of that name): `QuantizeLinear(DequantizeLinear(A) +
/// DequantizeLinear(B))` with per-tensor parameters and numpy broadcasting, computed with the
/// unfused chain's float32 operations (each dequantized value rounded once, the float32 sum,
/// the quantizer's division and round half to even), so its bits are the chain's.
pub(crate) fn qlinear_add(cx: &Ctx) -> Result<Tensor> {
    let param = |i: usize| -> Result<(f32, f32)> {
        let s = cx.t(i)?;
        if s.dtype() != DType::F32 || s.len() != 1 {
            kbail!("QLinearAdd: input {i} must be one float32 scale");
        }
        let z = match cx.opt(i + 1) {
            Some(z) if z.len() == 1 => z.to_i64_vec()?[0] as f32,
            Some(_) => kbail!("QLinearAdd: zero point {} must hold one value", i + 1),
            None => 0.0,
        };
        Ok((s.as_slice::<f32>()?[0], z))
    };
    let (a, b) = (cx.t(0)?, cx.t(3)?);
    let ((sa, za), (sb, zb), (sc, zc)) = (param(1)?, param(4)?, param(6)?);
    let to = cx.opt(7).map_or(DType::U8, |z| z.dtype());
    let (qa, qb) = (q8(a)?, q8(b)?);
    let shape = broadcast_shape(a.shape(), b.shape())?;
    let offs = (a.shape() != b.shape()).then(|| broadcast_offsets(&[a.shape(), b.shape()], &shape));
    let len: usize = shape.iter().product();
    // Unsigned bytes of one shape into unsigned bytes (a quantized ResNet's residuals): the
    // same operations in one vector pass.
    if let (Q8::U8(av), Q8::U8(bv), DType::U8, None) = (&qa, &qb, to, &offs) {
        let mut out = crate::arena::overwritten(len, 0u8);
        pool::parallel_chunks_mut(&mut out, CHUNK, |c, o| {
            let r = c * CHUNK..c * CHUNK + o.len();
            qgemm::qadd_u8(&av[r.clone()], (za, sa), &bv[r], (zb, sb), (zc, sc), o)
        });
        return Tensor::from_vec(shape, out);
    }
    // The float32 sums, a block at a time, then quantized as QuantizeLinear does.
    const BLOCK: usize = 1024;
    let sum = |start: usize, t: &mut [f32]| {
        let mut tb = [0f32; BLOCK];
        let tb = &mut tb[..t.len()];
        let (oa, ob) = match &offs {
            Some(o) => (Some(&o[0][..]), Some(&o[1][..])),
            None => (None, None),
        };
        qa.dequantize(za, sa, start, oa, t);
        qb.dequantize(zb, sb, start, ob, tb);
        for (x, &y) in t.iter_mut().zip(tb.iter()) {
            *x += y;
        }
    };
    match to {
        DType::U8 => {
            let mut out = crate::arena::overwritten(len, 0u8);
            pool::parallel_chunks_mut(&mut out, CHUNK, |c, o| {
                let mut t = [0f32; BLOCK];
                for (k, ob) in o.chunks_mut(BLOCK).enumerate() {
                    let t = &mut t[..ob.len()];
                    sum(c * CHUNK + k * BLOCK, t);
                    qgemm::quantize_u8(t, sc, zc, ob);
                }
            });
            Tensor::from_vec(shape, out)
        }
        DType::I8 => {
            let mut out = crate::arena::overwritten(len, 0i8);
            pool::parallel_chunks_mut(&mut out, CHUNK, |c, o| {
                let mut t = [0f32; BLOCK];
                for (k, ob) in o.chunks_mut(BLOCK).enumerate() {
                    let t = &mut t[..ob.len()];
                    sum(c * CHUNK + k * BLOCK, t);
                    for (d, &v) in ob.iter_mut().zip(t.iter()) {
                        *d = ((v / sc).round_ties_even() + zc).clamp(-128.0, 127.0) as i8;
                    }
                }
            });
            Tensor::from_vec(shape, out)
        }
        d => kbail!("QLinearAdd to {d}"),
    }
}
