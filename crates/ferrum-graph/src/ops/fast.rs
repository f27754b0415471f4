//! float32 fast paths for elementwise ops, Erf, MaxPool, Transpose, Softmax, Where and
//! LayerNormalization (the products are in [`super::linear`]); other dtypes and forms stay on
//! the reference loops.

use ferrum_kernels::pool;

use crate::ops::elementwise::broadcast_shape;
use crate::ops::linear::{valid_range, Conv2d};
use crate::ops::Ctx;
use crate::tensor::{DType, Tensor};
use crate::Result;

/// True when every given tensor is float32.
pub fn all_f32(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.dtype() == DType::F32)
}

/// Elementwise float32 fast paths: Add, Sub, Mul, Div (any broadcast), Relu, Sqrt and Erf.
/// The four arithmetic ops and Sqrt give the same bits as the reference (an f64 result of one
/// such operation on f32 values rounds to the correctly rounded f32 result); Erf comes from
/// [`erf_f32`]. `None` when the node is not one of these on float32 inputs.
pub fn elementwise(cx: &Ctx) -> Result<Option<Tensor>> {
    let op = cx.node.op.as_str();
    match op {
        "Add" | "Sub" | "Mul" | "Div" => {
            let (Some(a), Some(b)) = (cx.opt(0), cx.opt(1)) else {
                return Ok(None);
            };
            // Legacy (opset < 7) broadcasting with `axis` stays on the reference path.
            if !all_f32(&[a, b]) || cx.opset() < 7 {
                return Ok(None);
            }
            let t = match op {
                "Add" => zip_f32(a, b, |x, y| x + y)?,
                "Sub" => zip_f32(a, b, |x, y| x - y)?,
                "Mul" => zip_f32(a, b, |x, y| x * y)?,
                _ => zip_f32(a, b, |x, y| x / y)?,
            };
            Ok(Some(t))
        }
        "Clip" if cx.opset() >= 11 => {
            let Some(x) = cx.opt(0) else {
                return Ok(None);
            };
            let bound = |i: usize| -> Result<Option<f32>> {
                match cx.opt(i) {
                    Some(t) if t.dtype() == DType::F32 && t.len() == 1 => {
                        Ok(Some(t.as_slice::<f32>()?[0]))
                    }
                    Some(_) => Err(crate::Error::Kernel("Clip bound".into())),
                    None => Ok(None),
                }
            };
            if x.dtype() != DType::F32 {
                return Ok(None);
            }
            let (Ok(lo), Ok(hi)) = (bound(1), bound(2)) else {
                return Ok(None);
            };
            let (lo, hi) = (lo.unwrap_or(f32::NEG_INFINITY), hi.unwrap_or(f32::INFINITY));
            // As the reference: below lo -> lo, then above hi -> hi; NaN stays.
            let v = map_f32(x.as_slice::<f32>()?, move |v| {
                let y = if v < lo { lo } else { v };
                if y > hi {
                    hi
                } else {
                    y
                }
            });
            Ok(Some(Tensor::from_vec(x.shape().to_vec(), v)?))
        }
        "Relu" | "Sqrt" | "Erf" => {
            let Some(x) = cx.opt(0) else {
                return Ok(None);
            };
            if x.dtype() != DType::F32 {
                return Ok(None);
            }
            let xv = x.as_slice::<f32>()?;
            let v: Vec<f32> = match op {
                "Relu" => map_f32(xv, |v| if v > 0.0 { v } else { 0.0 }),
                "Sqrt" => map_f32(xv, f32::sqrt),
                _ => map_f32(xv, erf_f32),
            };
            Ok(Some(Tensor::from_vec(x.shape().to_vec(), v)?))
        }
        _ => Ok(None),
    }
}

/// `f` over every element, in chunks over the pool's threads for large tensors.
fn map_f32(x: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    const CHUNK: usize = 1 << 15;
    if x.len() <= CHUNK || pool::threads() == 1 {
        out.iter_mut().zip(x).for_each(|(o, &v)| *o = f(v));
    } else {
        pool::parallel_chunks_mut(&mut out, CHUNK, |i, o| {
            o.iter_mut()
                .zip(&x[i * CHUNK..])
                .for_each(|(o, &v)| *o = f(v));
        });
    }
    out
}

/// Strides of an operand of shape `s` seen from a broadcast output of rank `r` (0 along the
/// dims it is broadcast over).
fn strides_from(s: &[usize], r: usize) -> Vec<usize> {
    let mut v = vec![0; r];
    let mut acc = 1;
    for i in (0..s.len()).rev() {
        let o = r - s.len() + i;
        v[o] = if s[i] == 1 { 0 } else { acc };
        acc *= s[i];
    }
    v
}

/// `f(a, b)` with numpy broadcasting: rows of the output's last dim at a time, each operand
/// either contiguous or repeated along it.
fn zip_f32(a: &Tensor, b: &Tensor, f: impl Fn(f32, f32) -> f32) -> Result<Tensor> {
    let out = broadcast_shape(a.shape(), b.shape())?;
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    let n: usize = out.iter().product();
    if a.shape() == b.shape() {
        let v = av.iter().zip(bv).map(|(&x, &y)| f(x, y)).collect();
        return Tensor::from_vec(out, v);
    }
    let r = out.len();
    let (sa, sb) = (strides_from(a.shape(), r), strides_from(b.shape(), r));
    let last = if r == 0 { 1 } else { out[r - 1] };
    let (la, lb) = if r == 0 {
        (0, 0)
    } else {
        (sa[r - 1], sb[r - 1])
    };
    let mut v = Vec::with_capacity(n);
    let mut idx = vec![0usize; r.saturating_sub(1)];
    let (mut oa, mut ob) = (0usize, 0usize);
    let rows = n / last.max(1);
    for _ in 0..rows {
        match (la, lb) {
            (1, 1) => v.extend(
                av[oa..oa + last]
                    .iter()
                    .zip(&bv[ob..ob + last])
                    .map(|(&x, &y)| f(x, y)),
            ),
            (1, _) => {
                let y = bv[ob];
                v.extend(av[oa..oa + last].iter().map(|&x| f(x, y)));
            }
            (_, 1) => {
                let x = av[oa];
                v.extend(bv[ob..ob + last].iter().map(|&y| f(x, y)));
            }
            _ => {
                let (x, y) = (av[oa], bv[ob]);
                v.extend(std::iter::repeat_n(f(x, y), last));
            }
        }
        // Next row: odometer over the outer dims.
        for d in (0..r.saturating_sub(1)).rev() {
            idx[d] += 1;
            oa += sa[d];
            ob += sb[d];
            if idx[d] < out[d] {
                break;
            }
            oa -= sa[d] * out[d];
            ob -= sb[d] * out[d];
            idx[d] = 0;
        }
    }
    Tensor::from_vec(out, v)
}

/// Grid step of the erf table: 1/128 over [0, 6].
const ERF_STEP: f64 = 1.0 / 128.0;
const ERF_MAX: f64 = 6.0;

/// g(x) = erf(x) / x (even, smooth, g(0) = 2/sqrt(pi)) on [0, 6] as one cubic per grid interval,
/// `a0 + s * (a1 + s * (a2 + s * a3))` for `s` in [0, 1): Hermite interpolation of g and g'
/// (from the reference `erf`), whose error is below 1e-11 at this step.
fn erf_table() -> &'static [[f64; 4]] {
    static T: std::sync::OnceLock<Vec<[f64; 4]>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let c = 2.0 / std::f64::consts::PI.sqrt();
        let g_dg = |x: f64| -> (f64, f64) {
            if x < 1.0 {
                // Series: g = c * sum (-1)^n x^2n / (n! (2n + 1)), and its derivative.
                let (mut g, mut dg, mut fact) = (0.0, 0.0, 1.0);
                for n in 0..40 {
                    if n > 0 {
                        fact *= n as f64;
                    }
                    let sign = if n % 2 == 0 { 1.0 } else { -1.0 };
                    let den = fact * (2 * n + 1) as f64;
                    g += sign * x.powi(2 * n) / den;
                    if n > 0 {
                        dg += sign * (2 * n) as f64 * x.powi(2 * n - 1) / den;
                    }
                }
                (c * g, c * dg)
            } else {
                let e = crate::ops::elementwise::erf(x);
                (e / x, (c * (-x * x).exp() * x - e) / (x * x))
            }
        };
        let n = (ERF_MAX / ERF_STEP) as usize;
        (0..=n)
            .map(|i| {
                let (y0, d0) = g_dg(i as f64 * ERF_STEP);
                let (y1, d1) = g_dg((i + 1) as f64 * ERF_STEP);
                let (m0, m1) = (d0 * ERF_STEP, d1 * ERF_STEP);
                [
                    y0,
                    m0,
                    3.0 * (y1 - y0) - 2.0 * m0 - m1,
                    2.0 * (y0 - y1) + m0 + m1,
                ]
            })
            .collect()
    })
}

/// erf for float32: `x * g(|x|)` with g = erf(x)/x from [`erf_table`] (so relative accuracy
/// holds down to 0), and +-1 from |x| = 6 on (erf(6) rounds to 1 in f32). Within f32 rounding
/// of the true value; one table lookup and a cubic, no data-dependent branch below 6.
pub fn erf_f32(x: f32) -> f32 {
    let xd = x as f64;
    let ax = xd.abs();
    if ax >= ERF_MAX {
        return x.signum();
    }
    if x.is_nan() {
        return x;
    }
    let t = erf_table();
    let u = ax * (1.0 / ERF_STEP);
    let i = u as usize;
    let s = u - i as f64;
    let [a0, a1, a2, a3] = t[i];
    (xd * (a0 + s * (a1 + s * (a2 + s * a3)))) as f32
}

/// 2-D MaxPool of float32 planes (`planes` x `ih` x `iw`) into `oh` x `ow` with the geometry of
/// `g` (`group` unused): the largest value inside each window (padding never wins), NaN
/// propagating as in the reference.
pub fn maxpool2d(x: &[f32], planes: usize, (ih, iw): (usize, usize), g: &Conv2d) -> Vec<f32> {
    let [kh, kw] = g.k;
    let [oh, ow] = g.out;
    let mut out = vec![f32::NEG_INFINITY; planes * oh * ow];
    if oh * ow == 0 {
        return out;
    }
    pool::parallel_chunks_mut(&mut out, oh * ow, |p, o| {
        let plane = &x[p * ih * iw..][..ih * iw];
        for oy in 0..oh {
            let row = &mut o[oy * ow..][..ow];
            for ky in 0..kh {
                let iy = (oy * g.s[0] + ky * g.d[0]) as isize - g.pad[0] as isize;
                if iy < 0 || iy >= ih as isize {
                    continue;
                }
                let src = &plane[iy as usize * iw..][..iw];
                for kx in 0..kw {
                    let tx = kx * g.d[1];
                    let (lo, hi) = valid_range(iw, ow, g.s[1], tx, g.pad[1]);
                    for (ox, best) in row.iter_mut().enumerate().take(hi).skip(lo) {
                        let v = src[ox * g.s[1] + tx - g.pad[1]];
                        if v > *best || (v.is_nan() && !best.is_nan()) {
                            *best = v;
                        }
                    }
                }
            }
        }
    });
    out
}

/// Transpose of a float32 tensor: output rows (last output dim) gathered with the input's stride
/// along that dim; the same elements as the reference, moved rather than computed.
pub fn transpose_f32(x: &Tensor, perm: &[usize]) -> Result<Tensor> {
    let st = crate::ops::shape::strides(x.shape());
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
    let pst: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
    let xv = x.as_slice::<f32>()?;
    let n = xv.len();
    let r = shape.len();
    if r == 0 || n == 0 {
        return Tensor::from_vec(shape, xv.to_vec());
    }
    let last = shape[r - 1];
    let ls = pst[r - 1];
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; r - 1];
    let mut off = 0usize;
    for _ in 0..n / last {
        if ls == 1 {
            out.extend_from_slice(&xv[off..off + last]);
        } else {
            out.extend((0..last).map(|j| xv[off + j * ls]));
        }
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            off += pst[d];
            if idx[d] < shape[d] {
                break;
            }
            off -= pst[d] * shape[d];
            idx[d] = 0;
        }
    }
    Tensor::from_vec(shape, out)
}

/// Softmax of a float32 tensor along its last axis, rows spread over the pool's threads; each
/// row as the reference computes it (f64 max, exponentials, in-order sum, quotient rounded to
/// f32), so the same bits.
pub fn softmax_last_f32(x: &Tensor) -> Result<Tensor> {
    let xv = x.as_slice::<f32>()?;
    let d = x.shape().last().copied().unwrap_or(1).max(1);
    let mut out = vec![0f32; xv.len()];
    let rows_per = (1usize << 14).div_ceil(d).max(1);
    pool::parallel_chunks_mut(&mut out, rows_per * d, |ci, o| {
        let mut buf = vec![0f64; d];
        for (r, orow) in o.chunks_mut(d).enumerate() {
            let row = &xv[(ci * rows_per + r) * d..][..d];
            let mut m = f64::NEG_INFINITY;
            for (b, &v) in buf.iter_mut().zip(row) {
                *b = v as f64;
                if *b > m {
                    m = *b;
                }
            }
            buf.iter_mut().for_each(|b| *b = (*b - m).exp());
            let s: f64 = buf.iter().sum();
            for (o, &b) in orow.iter_mut().zip(&buf) {
                *o = (b / s) as f32;
            }
        }
    });
    Tensor::from_vec(x.shape().to_vec(), out)
}

/// Where with float32 branches: numpy broadcasting of the three inputs, rows of the output's
/// last dim at a time (as [`zip_f32`]).
pub fn where_f32(c: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let out = broadcast_shape(&broadcast_shape(c.shape(), x.shape())?, y.shape())?;
    let (cv, xv, yv) = (
        c.as_slice::<bool>()?,
        x.as_slice::<f32>()?,
        y.as_slice::<f32>()?,
    );
    let n: usize = out.iter().product();
    let r = out.len();
    let ss = [c.shape(), x.shape(), y.shape()].map(|sh| strides_from(sh, r));
    let last = if r == 0 { 1 } else { out[r - 1] };
    let ls: Vec<usize> = ss
        .iter()
        .map(|s| if r == 0 { 0 } else { s[r - 1] })
        .collect();
    let mut v = Vec::with_capacity(n);
    let mut idx = vec![0usize; r.saturating_sub(1)];
    let mut o = [0usize; 3];
    if let Some(rows) = n.checked_div(last) {
        for _ in 0..rows {
            v.extend((0..last).map(|j| {
                if cv[o[0] + j * ls[0]] {
                    xv[o[1] + j * ls[1]]
                } else {
                    yv[o[2] + j * ls[2]]
                }
            }));
            for d in (0..r.saturating_sub(1)).rev() {
                idx[d] += 1;
                for k in 0..3 {
                    o[k] += ss[k][d];
                }
                if idx[d] < out[d] {
                    break;
                }
                for k in 0..3 {
                    o[k] -= ss[k][d] * out[d];
                }
                idx[d] = 0;
            }
        }
    }
    Tensor::from_vec(out, v)
}

/// LayerNormalization of float32 rows of `inner` elements with a scale (and bias) of exactly the
/// normalized shape: each row as the reference computes it (f64 mean and variance summed in
/// order, `(x - mean) * inv * scale + bias` rounded once to f32), rows spread over the pool.
pub fn layer_norm_f32(
    x: &Tensor,
    inner: usize,
    eps: f64,
    scale: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let xv = x.as_slice::<f32>()?;
    let sv = scale.as_slice::<f32>()?;
    let bv = bias.map(|b| b.as_slice::<f32>()).transpose()?;
    let inner = inner.max(1);
    let mut out = vec![0f32; xv.len()];
    let rows_per = (1usize << 14).div_ceil(inner).max(1);
    pool::parallel_chunks_mut(&mut out, rows_per * inner, |ci, o| {
        for (r, orow) in o.chunks_mut(inner).enumerate() {
            let s = &xv[(ci * rows_per + r) * inner..][..inner];
            let mean = s.iter().map(|&e| e as f64).sum::<f64>() / inner as f64;
            let var = s
                .iter()
                .map(|&e| (e as f64 - mean) * (e as f64 - mean))
                .sum::<f64>()
                / inner as f64;
            let inv = 1.0 / (var + eps).sqrt();
            for (j, (o, &e)) in orow.iter_mut().zip(s).enumerate() {
                let mut y = (e as f64 - mean) * inv * sv[j] as f64;
                if let Some(b) = bv {
                    y += b[j] as f64;
                }
                *o = y as f32;
            }
        }
    });
    Tensor::from_vec(x.shape().to_vec(), out)
}
