//! float32 fast paths for elementwise ops, Erf, IsNaN, MaxPool, GlobalAveragePool, Transpose,
//! Softmax, Where and LayerNormalization (the products are in [`super::linear`]); other dtypes
//! and forms stay on the reference loops. The loops themselves are in [`super::vecmath`]; here
//! are the shapes, broadcasting and the split of large tensors over the pool's threads.

use std::mem::MaybeUninit;

use ferrum_kernels::pool;

use crate::ops::elementwise::broadcast_shape;
use crate::ops::linear::Conv2d;
use crate::ops::vecmath::{self, Bin, Operand, Pick, PoolGeom, Unary};
use crate::ops::Ctx;
use crate::tensor::{DType, Elem, Tensor};
use crate::Result;

/// True when every given tensor is float32.
pub fn all_f32(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.dtype() == DType::F32)
}

/// Elementwise float32 fast paths: Add, Sub, Mul, Div (any broadcast; [`arith`]), Clip
/// ([`clip`]), Relu, Sqrt and Erf ([`unary`]). The four arithmetic ops, Clip, Relu and Sqrt give
/// the same bits as the reference (an f64 result of one such operation on f32 values rounds to
/// the correctly rounded f32 result); Erf comes from [`vecmath::erf_lane`] (within 2 ulp of the
/// f64 reference). Each returns `None` when its inputs are not float32 (or the form is not one
/// it runs): the caller then runs the reference.
pub fn arith(cx: &Ctx, op: Bin) -> Result<Option<Tensor>> {
    let (Some(a), Some(b)) = (cx.opt(0), cx.opt(1)) else {
        return Ok(None);
    };
    // Legacy (opset < 7) broadcasting with `axis` stays on the reference path.
    if !all_f32(&[a, b]) || cx.opset() < 7 {
        return Ok(None);
    }
    Ok(Some(zip_f32(a, b, op)?))
}

/// Clip (opset 11 on: bounds as inputs) on float32; see [`arith`].
pub fn clip(cx: &Ctx) -> Result<Option<Tensor>> {
    let Some(x) = cx.opt(0) else {
        return Ok(None);
    };
    if cx.opset() < 11 || x.dtype() != DType::F32 {
        return Ok(None);
    }
    let bound = |i: usize| -> Result<Option<f32>> {
        match cx.opt(i) {
            Some(t) if t.dtype() == DType::F32 && t.len() == 1 => Ok(Some(t.as_slice::<f32>()?[0])),
            Some(_) => Err(crate::Error::Kernel("Clip bound".into())),
            None => Ok(None),
        }
    };
    let (Ok(lo), Ok(hi)) = (bound(1), bound(2)) else {
        return Ok(None);
    };
    let (lo, hi) = (lo.unwrap_or(f32::NEG_INFINITY), hi.unwrap_or(f32::INFINITY));
    let v = map_f32(x.as_slice::<f32>()?, Unary::Clip(lo, hi));
    Ok(Some(Tensor::from_vec(x.shape().to_vec(), v)?))
}

/// Relu, Sqrt or Erf (`op`) on float32; see [`arith`].
pub fn unary(cx: &Ctx, op: Unary) -> Result<Option<Tensor>> {
    let Some(x) = cx.opt(0) else {
        return Ok(None);
    };
    if x.dtype() != DType::F32 {
        return Ok(None);
    }
    let v = map_f32(x.as_slice::<f32>()?, op);
    Ok(Some(Tensor::from_vec(x.shape().to_vec(), v)?))
}

/// The smallest part (in output elements) worth a pool task for the costly loops (Erf, Softmax,
/// LayerNormalization, MaxPool: about 1 ns an element or more).
const PAR_MIN: usize = 1 << 15;
/// The same for the loops that only move or add (about 0.1 ns an element in cache): waking the
/// pool costs more than they take below this.
const PAR_MIN_CHEAP: usize = 1 << 18;

/// Elements from which a strided move (a transpose's tiles, about half a nanosecond an
/// element) is spread over the pool: a job's start costs a few microseconds.
const PAR_MIN_MOVE: usize = 1 << 14;

/// Runs `f(first, part)` over `out` cut into parts of whole rows of `row` elements (`first`: the
/// index of the part's first row), the parts (at least `min` elements each) spread over the
/// pool's threads when `out` holds two or more of them.
pub fn par_rows<T: Send>(
    out: &mut [T],
    row: usize,
    min: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let row = row.max(1);
    let threads = pool::threads();
    if threads == 1 || out.len() < 2 * min {
        f(0, out);
        return;
    }
    let rows = out.len().div_ceil(row);
    let per = rows.div_ceil(threads * 4).max(min.div_ceil(row)).max(1);
    pool::parallel_chunks_mut(out, per * row, |i, o| f(i * per, o));
}

/// A vector of `n` elements written by `fill`, without zeroing them first (a whole write pass
/// on these memory-bound ops). `fill` must write every element of the slice it gets: the
/// kernels it calls here each write their whole output slice and assert that their inputs
/// cover it.
pub(crate) fn filled<T: Elem>(n: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut v = T::room(n);
    fill(&mut v.spare_capacity_mut()[..n]);
    // SAFETY: the capacity is at least `n`, and `fill` initialised elements 0..n (its contract
    // above; a panic inside it leaves the length 0).
    unsafe { v.set_len(n) };
    v
}

/// `f(offset, stretch, out)` over `v` in stretches of 64 elements, each stretch copied aside
/// first and written back by `f` (which writes every element of `out`, as the vector kernels
/// here do): an op over a vector's own memory with kernels that read one slice and write
/// another. Stretches of 64 keep each element where a whole-slice call would put it (vector
/// body or tail), so the bits are those of that call.
fn in_place(v: &mut [f32], f: impl Fn(usize, &[f32], &mut [MaybeUninit<f32>])) {
    let mut buf = [0f32; 64];
    for (c, stretch) in v.chunks_mut(64).enumerate() {
        let m = stretch.len();
        buf[..m].copy_from_slice(stretch);
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and `f` only writes initialised values
        // (every element), so the stretch holds valid floats afterwards (and, should `f` stop
        // early, the old ones where it did not write).
        let out = unsafe { &mut *(stretch as *mut [f32] as *mut [MaybeUninit<f32>]) };
        f(c * 64, &buf[..m], out);
    }
}

/// [`arith`] into `mine`, operand `at` (0: A, 1: B) handed over with its memory, when it has
/// the output's shape (float32, opset 7 on); the same bits as [`arith`] (each element one IEEE
/// operation, in the same vector code). `Err(mine)` where that does not apply.
pub fn arith_into(
    cx: &Ctx,
    at: usize,
    mine: Tensor,
    op: Bin,
) -> Result<std::result::Result<Tensor, Tensor>> {
    let Some(other) = cx.opt(1 - at) else {
        return Ok(Err(mine));
    };
    if !all_f32(&[&mine, other])
        || cx.opset() < 7
        || broadcast_shape(mine.shape(), other.shape()).ok().as_deref() != Some(mine.shape())
    {
        return Ok(Err(mine));
    }
    let shape = mine.shape().to_vec();
    let ov = other.as_slice::<f32>()?;
    let mut v = crate::ops::fused::into_f32(mine)?;
    let r = shape.len();
    let (cs, st) = coalesce(
        &shape,
        [strides_from(&shape, r), strides_from(other.shape(), r)],
    );
    let lo = st[1][cs.len() - 1];
    for_rows(&cs, &st, &mut v, |[_, oo], row| {
        in_place(row, |off, mv, out| {
            let theirs = if lo == 1 {
                Operand::Row(&ov[oo + off..oo + off + mv.len()])
            } else {
                Operand::Scalar(ov[oo])
            };
            if at == 0 {
                vecmath::bin_row(op, Operand::Row(mv), theirs, out)
            } else {
                vecmath::bin_row(op, theirs, Operand::Row(mv), out)
            }
        })
    });
    Ok(Ok(Tensor::from_vec(shape, v)?))
}

/// [`unary`] into its input's memory, handed over (float32); the same bits. `Err(x)` for other
/// types.
pub fn unary_into(x: Tensor, op: Unary) -> Result<std::result::Result<Tensor, Tensor>> {
    if x.dtype() != DType::F32 {
        return Ok(Err(x));
    }
    let shape = x.shape().to_vec();
    let mut v = crate::ops::fused::into_f32(x)?;
    par_rows(&mut v, 1, unary_min(op), |_, o| {
        in_place(o, |_, x, out| vecmath::unary_slice(op, x, out))
    });
    Ok(Ok(Tensor::from_vec(shape, v)?))
}

/// `op` over every element, in parts over the pool's threads for large tensors.
fn map_f32(x: &[f32], op: Unary) -> Vec<f32> {
    filled(x.len(), |out| {
        par_rows(out, 1, unary_min(op), |i, o| {
            vecmath::unary_slice(op, &x[i..i + o.len()], o)
        })
    })
}

/// The smallest part worth a pool task for `op`.
fn unary_min(op: Unary) -> usize {
    if op.is_costly() {
        PAR_MIN
    } else {
        PAR_MIN_CHEAP
    }
}

/// Inference BatchNormalization of a float32 tensor `[N, C, ...]` (`inner` elements a channel
/// plane): `y = (x - mean) * a + b` per channel, with `a = scale / sqrt(var + eps)` and `b`
/// the bias, as the caller computed them; planes spread over the pool's threads.
pub fn batch_norm_f32(
    x: &[f32],
    c: usize,
    inner: usize,
    mean: &[f32],
    a: &[f32],
    b: &[f32],
) -> Vec<f32> {
    assert!(c > 0 && inner > 0 && x.len().is_multiple_of(c * inner));
    assert!(mean.len() == c && a.len() == c && b.len() == c);
    filled(x.len(), |out| {
        par_rows(out, inner, PAR_MIN_CHEAP, |first, o| {
            for (r, plane) in o.chunks_mut(inner).enumerate() {
                let p = first + r;
                let ch = p % c;
                vecmath::affine_slice(&x[p * inner..][..inner], mean[ch], a[ch], b[ch], plane);
            }
        })
    })
}

/// IsNaN of a float32 tensor.
pub fn isnan_f32(x: &Tensor) -> Result<Tensor> {
    let xv = x.as_slice::<f32>()?;
    let out = filled(xv.len(), |out| {
        par_rows(out, 1, PAR_MIN_CHEAP, |i, o| {
            vecmath::isnan_slice(&xv[i..i + o.len()], o)
        })
    });
    Tensor::from_vec(x.shape().to_vec(), out)
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

/// Merges adjacent output dims that every operand reads the same way (both broadcast, or
/// contiguous across the pair) and drops dims of size 1: the same element mapping with fewer,
/// longer rows.
fn coalesce<const K: usize>(out: &[usize], st: [Vec<usize>; K]) -> (Vec<usize>, [Vec<usize>; K]) {
    let mut shape: Vec<usize> = Vec::with_capacity(out.len());
    let mut ss: [Vec<usize>; K] = std::array::from_fn(|_| Vec::with_capacity(out.len()));
    for (d, &n) in out.iter().enumerate() {
        if n == 1 {
            continue;
        }
        if !shape.is_empty() {
            // Dim d-1 steps over a whole dim d for every operand (or is broadcast like it).
            if (0..K).all(|k| *ss[k].last().unwrap() == st[k][d] * n) {
                let l = shape.len() - 1;
                shape[l] *= n;
                for k in 0..K {
                    ss[k][l] = st[k][d];
                }
                continue;
            }
        }
        shape.push(n);
        for k in 0..K {
            ss[k].push(st[k][d]);
        }
    }
    if shape.is_empty() {
        shape.push(1);
        for s in ss.iter_mut() {
            s.push(0);
        }
    }
    (shape, ss)
}

/// Walks the rows (last dim) of a broadcast output in parts over the pool: `f(offs, row)` gets
/// each operand's offset of the row's first element and the row to fill.
fn for_rows<T: Send, const K: usize>(
    shape: &[usize],
    st: &[Vec<usize>; K],
    out: &mut [T],
    f: impl Fn([usize; K], &mut [T]) + Sync,
) {
    let r = shape.len();
    let last = shape[r - 1];
    if last == 0 || out.is_empty() {
        return;
    }
    par_rows(out, last, PAR_MIN_CHEAP, |first, part| {
        // The odometer of the first row of this part.
        let mut idx = vec![0usize; r - 1];
        let mut rem = first;
        for d in (0..r - 1).rev() {
            idx[d] = rem % shape[d];
            rem /= shape[d];
        }
        let mut offs = [0usize; K];
        for k in 0..K {
            offs[k] = (0..r - 1).map(|d| idx[d] * st[k][d]).sum();
        }
        for row in part.chunks_mut(last) {
            f(offs, row);
            for d in (0..r - 1).rev() {
                idx[d] += 1;
                for k in 0..K {
                    offs[k] += st[k][d];
                }
                if idx[d] < shape[d] {
                    break;
                }
                for k in 0..K {
                    offs[k] -= st[k][d] * shape[d];
                }
                idx[d] = 0;
            }
        }
    });
}

/// `a op b` with numpy broadcasting: dims coalesced, then rows of the last dim at a time (each
/// operand either contiguous or one repeated value along it), rows spread over the pool.
fn zip_f32(a: &Tensor, b: &Tensor, op: Bin) -> Result<Tensor> {
    let out_shape = broadcast_shape(a.shape(), b.shape())?;
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    let n: usize = out_shape.iter().product();
    let r = out_shape.len();
    let (shape, st) = coalesce(
        &out_shape,
        [strides_from(a.shape(), r), strides_from(b.shape(), r)],
    );
    let l = shape.len() - 1;
    let (la, lb) = (st[0][l], st[1][l]);
    let out = filled(n, |out| {
        for_rows(&shape, &st, out, |[oa, ob], row| {
            let n = row.len();
            let pa = if la == 1 {
                Operand::Row(&av[oa..oa + n])
            } else {
                Operand::Scalar(av[oa])
            };
            let pb = if lb == 1 {
                Operand::Row(&bv[ob..ob + n])
            } else {
                Operand::Scalar(bv[ob])
            };
            vecmath::bin_row(op, pa, pb, row);
        })
    });
    Tensor::from_vec(out_shape, out)
}

/// 2-D MaxPool of float32 planes (`planes` x `ih` x `iw`) into `oh` x `ow` with the geometry of
/// `g` (`group` unused): the largest value inside each window (padding never wins), NaN
/// propagating, the same bits as the reference ([`vecmath::maxpool_planes`]).
pub fn maxpool2d(x: &[f32], planes: usize, (ih, iw): (usize, usize), g: &Conv2d) -> Vec<f32> {
    let [oh, ow] = g.out;
    let mut out = crate::arena::full(planes * oh * ow, f32::NEG_INFINITY);
    if oh * ow == 0 || ih * iw == 0 {
        return out;
    }
    let geo = PoolGeom {
        input: [ih, iw],
        k: g.k,
        s: [g.s[0].max(1), g.s[1].max(1)],
        d: [g.d[0].max(1), g.d[1].max(1)],
        pad: g.pad,
        out: g.out,
    };
    par_rows(&mut out, oh * ow, PAR_MIN, |p, o| {
        let src = &x[p * ih * iw..][..(o.len() / (oh * ow)) * ih * iw];
        vecmath::maxpool_planes(src, o, &geo);
    });
    out
}

/// GlobalAveragePool of float32 planes of `plane` elements: each plane's f64 sum (in lanes)
/// divided by its size, rounded once to float32; only the summation order differs from the
/// reference.
pub fn global_avg_pool_f32(x: &[f32], plane: usize) -> Vec<f32> {
    let planes = x.len().checked_div(plane).unwrap_or(0);
    let mut out = crate::arena::take(planes);
    out.extend(
        (0..planes)
            .map(|p| (vecmath::sum_slice_f64(&x[p * plane..][..plane]) / plane as f64) as f32),
    );
    out
}

/// GlobalAveragePool of channels-last float32 images (`[N, pixels, C]`) into `[N, C]`: the same
/// bits as [`global_avg_pool_f32`] on the NCHW planes (each channel summed in the same order,
/// divided and rounded alike). `pixels, c > 0`.
pub fn global_avg_pool_nhwc_f32(x: &[f32], pixels: usize, c: usize) -> Vec<f32> {
    let mut out = crate::arena::take(x.len() / pixels);
    for img in x.chunks_exact(pixels * c) {
        vecmath::channel_means_f32(img, c, &mut out);
    }
    out
}

/// Transpose of a float32 tensor: dims of size 1 dropped and dims that stay adjacent merged,
/// then output rows copied when the input is contiguous along the output's last dim, else
/// 16-row tiles read along the input's contiguous dim. The same elements as the reference,
/// moved rather than computed.
pub fn transpose_f32(x: &Tensor, perm: &[usize]) -> Result<Tensor> {
    let st = crate::ops::shape::strides(x.shape());
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
    let pst: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
    let xv = x.as_slice::<f32>()?;
    let n = xv.len();
    if shape.is_empty() || n == 0 {
        return Tensor::from_vec(shape, xv.to_vec());
    }
    let (cs, csts) = coalesce(&shape, [pst]);
    let cst = &csts[0];
    let r = cs.len();
    if cst[r - 1] <= 1 {
        let out = filled(n, |out| {
            for_rows(&cs, &csts, out, |[o], row| {
                let n = row.len();
                for (d, &v) in row.iter_mut().zip(&xv[o..o + n]) {
                    d.write(v);
                }
            })
        });
        return Tensor::from_vec(shape, out);
    }
    // The output dim along which the input is contiguous (the input's innermost dim).
    let k = (0..r - 1)
        .find(|&d| cst[d] == 1)
        .expect("an input dim of stride 1");
    let ost = crate::ops::shape::strides(&cs);
    let (a_len, b_len, ls, ok) = (cs[k], cs[r - 1], cst[r - 1], ost[k]);
    // Rows a0..a0 + na of one 2-D block: o[(a - a0) * ok + b] = x[off + a + b * ls].
    let block = |off: usize, a0: usize, na: usize, o: &mut [MaybeUninit<f32>]| {
        for t in (0..na).step_by(16) {
            let an = 16.min(na - t);
            for b in 0..b_len {
                let src = &xv[off + a0 + t + b * ls..][..an];
                for (i, &v) in src.iter().enumerate() {
                    o[(t + i) * ok + b].write(v);
                }
            }
        }
    };
    // The other dims: an odometer over them, each step one block.
    let outer: Vec<usize> = (0..r - 1).filter(|&d| d != k).collect();
    let block_offset = |mut rem: usize| {
        let mut off = 0;
        for &d in outer.iter().rev() {
            off += (rem % cs[d]) * cst[d];
            rem /= cs[d];
        }
        off
    };
    // Every element lies in one block, and a block writes all of its elements.
    let out = filled(n, |out| {
        if k == r - 2 {
            // Output rows of `b_len` (row `block * a_len + a`), spread over the pool in runs
            // that may cut a block (an NCHW image of 3 channels turned NHWC is one block).
            par_rows(out, b_len, PAR_MIN_MOVE, |first, part| {
                let (mut row, mut rest) = (first, part);
                while !rest.is_empty() {
                    let (blk, a0) = (row / a_len, row % a_len);
                    let na = (a_len - a0).min(rest.len() / b_len);
                    let (o, tail) = rest.split_at_mut(na * b_len);
                    block(block_offset(blk), a0, na, o);
                    (row, rest) = (row + na, tail);
                }
            });
        } else {
            let blocks: usize = outer.iter().map(|&d| cs[d]).product();
            for bi in 0..blocks {
                let (mut rem, mut off, mut ooff) = (bi, 0, 0);
                for &d in outer.iter().rev() {
                    let i = rem % cs[d];
                    rem /= cs[d];
                    off += i * cst[d];
                    ooff += i * ost[d];
                }
                let end = ooff + (a_len - 1) * ok + b_len;
                block(off, 0, a_len, &mut out[ooff..end]);
            }
        }
    });
    Tensor::from_vec(shape, out)
}

/// Softmax of a float32 tensor along its last axis by [`vecmath::softmax_rows`], rows spread
/// over the pool's threads. Each output is within `10 * 2^-24` relative of the f64 reference
/// (e^x within 2 ulp, an f64 sum, the product with its reciprocal rounded once), apart from
/// values below 1.7e-38 (e^-87), which may come out 0; NaN, +-inf and empty rows as the
/// reference.
pub fn softmax_last_f32(x: &Tensor, d: usize) -> Result<Tensor> {
    let xv = x.as_slice::<f32>()?;
    let d = d.max(1);
    let out = filled(xv.len(), |out| {
        par_rows(out, d, PAR_MIN, |first, o| {
            vecmath::softmax_rows(&xv[first * d..][..o.len()], o, d)
        })
    });
    Tensor::from_vec(x.shape().to_vec(), out)
}

/// Where with float32 branches: numpy broadcasting of the three inputs, dims coalesced, then
/// rows of the output's last dim at a time (as [`zip_f32`]).
pub fn where_f32(c: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let out_shape = broadcast_shape(&broadcast_shape(c.shape(), x.shape())?, y.shape())?;
    let (cv, xv, yv) = (
        c.as_slice::<bool>()?,
        x.as_slice::<f32>()?,
        y.as_slice::<f32>()?,
    );
    let n: usize = out_shape.iter().product();
    let r = out_shape.len();
    let (shape, st) = coalesce(
        &out_shape,
        [c.shape(), x.shape(), y.shape()].map(|sh| strides_from(sh, r)),
    );
    let l = shape.len() - 1;
    let ls = [st[0][l], st[1][l], st[2][l]];
    fn pick<T: Copy>(v: &[T], o: usize, contiguous: bool, n: usize) -> Pick<'_, T> {
        if contiguous {
            Pick::Row(&v[o..o + n])
        } else {
            Pick::Scalar(v[o])
        }
    }
    let out = filled(n, |out| {
        for_rows(&shape, &st, out, |[oc, ox, oy], row| {
            let n = row.len();
            vecmath::where_row(
                pick(cv, oc, ls[0] == 1, n),
                pick(xv, ox, ls[1] == 1, n),
                pick(yv, oy, ls[2] == 1, n),
                row,
            );
        })
    });
    Tensor::from_vec(out_shape, out)
}

/// LayerNormalization of float32 rows of `inner` elements with a scale (and bias) of exactly the
/// normalized shape by [`vecmath::layer_norm_rows`] (the reference's f64 formula, its sums in
/// another order: within 1 ulp of it), rows spread over the pool.
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
    if sv.len() != inner || bv.is_some_and(|b| b.len() != inner) {
        crate::kbail!("LayerNormalization scale/bias do not match {inner} normalized elements");
    }
    let out = filled(xv.len(), |out| {
        par_rows(out, inner, PAR_MIN, |first, o| {
            vecmath::layer_norm_rows(&xv[first * inner..][..o.len()], o, eps, sv, bv)
        })
    });
    Tensor::from_vec(x.shape().to_vec(), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u64) -> impl FnMut() -> f64 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// Random float32 values with some NaN, +-inf and signed zeros among them.
    fn values(r: &mut impl FnMut() -> f64, n: usize, special: bool) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = r();
                if special && u < 0.04 {
                    [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]
                        [(u * 125.0) as usize % 5]
                } else {
                    ((r() * 2.0 - 1.0) * 10.0) as f32
                }
            })
            .collect()
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn channels_last_global_average_pool_gives_the_planes_bits() {
        // Fresh images (with NaN, infinities and signed zeros in some), pixel counts below, at
        // and past whole groups of lanes, channels in one or more blocks: each output against
        // the NCHW planes' pool bit for bit.
        let seed: u64 = rand::random();
        let mut r = rng(seed);
        for case in 0..40 {
            let n = 1 + (r() * 2.0) as usize;
            let pixels = 1 + (r() * 70.0) as usize;
            let c = 1 + (r() * 150.0) as usize;
            // In most cases a fifth of the values +-2^60, which absorb the small ones they meet
            // in a partial sum: a different order gives a different result.
            let mut x = values(&mut r, n * pixels * c, case % 4 == 0);
            if case % 4 != 1 {
                for v in x.iter_mut() {
                    let u = r();
                    if u < 0.2 {
                        *v = if u < 0.1 {
                            2f32.powi(60)
                        } else {
                            -(2f32.powi(60))
                        };
                    }
                }
            }
            // The same values as NCHW planes.
            let mut planes = vec![0f32; x.len()];
            for b in 0..n {
                for p in 0..pixels {
                    for j in 0..c {
                        planes[(b * c + j) * pixels + p] = x[(b * pixels + p) * c + j];
                    }
                }
            }
            let want = global_avg_pool_f32(&planes, pixels);
            let got = global_avg_pool_nhwc_f32(&x, pixels, c);
            assert_eq!(got.len(), n * c);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // Bit for bit; a NaN as any NaN (its payload is the compiler's choice).
                assert!(
                    same(*g, *w),
                    "seed {seed} case {case}: {n}x{pixels}x{c}, output {i}: {g} vs {w}"
                );
            }
        }
    }

    /// The element of `s` (broadcast to `out`) at the output's flat index `i`.
    fn bcast_index(s: &[usize], out: &[usize], mut i: usize) -> usize {
        let r = out.len();
        let mut off = 0;
        let mut acc = 1;
        for d in (0..r).rev() {
            let c = i % out[d];
            i /= out[d];
            if d + s.len() >= r {
                let sd = s[d + s.len() - r];
                if sd != 1 {
                    off += c * acc;
                }
                acc *= sd;
            }
        }
        off
    }

    /// A random output shape and two or three operand shapes that broadcast to it.
    fn bcast_shapes(r: &mut impl FnMut() -> f64, k: usize) -> (Vec<usize>, Vec<Vec<usize>>) {
        let rank = (r() * 5.0) as usize;
        let out: Vec<usize> = (0..rank).map(|_| 1 + (r() * 6.0) as usize).collect();
        let ops = (0..k)
            .map(|_| {
                let drop = (r() * (rank as f64 + 1.0)) as usize;
                out[drop.min(rank)..]
                    .iter()
                    .map(|&d| if r() < 0.4 { 1 } else { d })
                    .collect()
            })
            .collect::<Vec<Vec<usize>>>();
        let rank = ops.iter().map(|s| s.len()).max().unwrap_or(0);
        let out = (0..rank)
            .map(|d| {
                ops.iter()
                    .filter_map(|s| (d + s.len()).checked_sub(rank).map(|j| s[j]))
                    .max()
                    .unwrap_or(1)
            })
            .collect();
        (out, ops)
    }

    #[test]
    fn zip_f32_matches_elementwise_reference() {
        let mut r = rng(11);
        for case in 0..400 {
            let (out, s) = bcast_shapes(&mut r, 2);
            let n = |s: &[usize]| s.iter().product::<usize>();
            let a = Tensor::from_vec(s[0].clone(), values(&mut r, n(&s[0]), true)).unwrap();
            let b = Tensor::from_vec(s[1].clone(), values(&mut r, n(&s[1]), true)).unwrap();
            let op = [Bin::Add, Bin::Sub, Bin::Mul, Bin::Div][case % 4];
            let y = zip_f32(&a, &b, op).unwrap();
            assert_eq!(y.shape(), &out[..]);
            let (av, bv, yv) = (
                a.as_slice::<f32>().unwrap(),
                b.as_slice::<f32>().unwrap(),
                y.as_slice::<f32>().unwrap(),
            );
            for (i, &got) in yv.iter().enumerate() {
                let (x, z) = (
                    av[bcast_index(&s[0], &out, i)] as f64,
                    bv[bcast_index(&s[1], &out, i)] as f64,
                );
                let want = match op {
                    Bin::Add => x + z,
                    Bin::Sub => x - z,
                    Bin::Mul => x * z,
                    Bin::Div => x / z,
                } as f32;
                assert!(
                    same(got, want),
                    "{op:?} {:?} {:?} at {i}: {got} vs {want}",
                    s[0],
                    s[1]
                );
            }
        }
    }

    #[test]
    fn where_f32_matches_reference() {
        let mut r = rng(12);
        for _ in 0..400 {
            let (out, s) = bcast_shapes(&mut r, 3);
            let n = |s: &[usize]| s.iter().product::<usize>();
            let cv: Vec<bool> = (0..n(&s[0])).map(|_| r() < 0.5).collect();
            let c = Tensor::from_vec(s[0].clone(), cv.clone()).unwrap();
            let x = Tensor::from_vec(s[1].clone(), values(&mut r, n(&s[1]), true)).unwrap();
            let y = Tensor::from_vec(s[2].clone(), values(&mut r, n(&s[2]), true)).unwrap();
            let w = where_f32(&c, &x, &y).unwrap();
            assert_eq!(w.shape(), &out[..]);
            let (xv, yv) = (x.as_slice::<f32>().unwrap(), y.as_slice::<f32>().unwrap());
            for (i, &got) in w.as_slice::<f32>().unwrap().iter().enumerate() {
                let want = if cv[bcast_index(&s[0], &out, i)] {
                    xv[bcast_index(&s[1], &out, i)]
                } else {
                    yv[bcast_index(&s[2], &out, i)]
                };
                assert_eq!(got.to_bits(), want.to_bits());
            }
        }
    }

    #[test]
    fn transpose_f32_matches_reference() {
        let mut r = rng(13);
        // Random shapes and permutations, then images of 3 channels turned channels-last and
        // back, large enough that the pool's tasks cut the 2-D blocks.
        let big = [
            (vec![2, 3, 83, 97], vec![0, 2, 3, 1]),
            (vec![2, 83, 97, 3], vec![0, 3, 1, 2]),
        ];
        for case in 0..400 + big.len() {
            let (shape, perm) = if case < 400 {
                let rank = 1 + (r() * 5.0) as usize;
                let shape: Vec<usize> = (0..rank).map(|_| 1 + (r() * 7.0) as usize).collect();
                let mut perm: Vec<usize> = (0..rank).collect();
                for i in (1..rank).rev() {
                    perm.swap(i, (r() * (i as f64 + 1.0)) as usize);
                }
                (shape, perm)
            } else {
                big[case - 400].clone()
            };
            let rank = shape.len();
            let n: usize = shape.iter().product();
            let xv: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let x = Tensor::from_vec(shape.clone(), xv).unwrap();
            let y = transpose_f32(&x, &perm).unwrap();
            let oshape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
            assert_eq!(y.shape(), &oshape[..]);
            let st = crate::ops::shape::strides(&shape);
            for (i, &got) in y.as_slice::<f32>().unwrap().iter().enumerate() {
                let (mut rem, mut off) = (i, 0);
                for d in (0..rank).rev() {
                    off += (rem % oshape[d]) * st[perm[d]];
                    rem /= oshape[d];
                }
                assert_eq!(got, off as f32, "{shape:?} {perm:?} at {i}");
            }
        }
        // A large one through the pool and the tiled path (BERT's key transpose).
        let shape = vec![1, 128, 12, 64];
        let n = 128 * 12 * 64;
        let x = Tensor::from_vec(shape, (0..n).map(|i| i as f32).collect()).unwrap();
        let y = transpose_f32(&x, &[0, 2, 3, 1]).unwrap();
        for (i, &got) in y.as_slice::<f32>().unwrap().iter().enumerate() {
            let (h, d, s) = (i / (64 * 128), (i / 128) % 64, i % 128);
            assert_eq!(got, (s * 768 + h * 64 + d) as f32);
        }
    }

    /// The direct MaxPool: every window element in row-major order.
    fn maxpool_ref(x: &[f32], planes: usize, (ih, iw): (usize, usize), g: &Conv2d) -> Vec<f32> {
        let [oh, ow] = g.out;
        let mut out = vec![f32::NEG_INFINITY; planes * oh * ow];
        for p in 0..planes {
            for oy in 0..oh {
                for ox in 0..ow {
                    let best = &mut out[(p * oh + oy) * ow + ox];
                    for ky in 0..g.k[0] {
                        for kx in 0..g.k[1] {
                            let iy = (oy * g.s[0] + ky * g.d[0]) as isize - g.pad[0] as isize;
                            let ix = (ox * g.s[1] + kx * g.d[1]) as isize - g.pad[1] as isize;
                            if iy < 0 || ix < 0 || iy >= ih as isize || ix >= iw as isize {
                                continue;
                            }
                            let v = x[(p * ih + iy as usize) * iw + ix as usize];
                            if v > *best || (v.is_nan() && !best.is_nan()) {
                                *best = v;
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn maxpool2d_gives_the_reference_bits() {
        let mut r = rng(14);
        let mut pick = |n: usize| (r() * n as f64) as usize;
        for case in 0..300 {
            let (k, s, d) = (
                [1 + pick(4), 1 + pick(4)],
                [1 + pick(3), 1 + pick(3)],
                [1 + pick(2), 1 + pick(2)],
            );
            let pad = [pick(k[0]), pick(k[1])];
            let (ih, iw) = (1 + pick(12), 1 + pick(12));
            let span = |i: usize| (k[i] - 1) * d[i] + 1;
            let mut size = |i: usize, n: usize| {
                let full = (n + 2 * pad[i]).saturating_sub(span(i)) / s[i] + 1;
                full + pick(2)
            };
            let out = [size(0, ih), size(1, iw)];
            let g = Conv2d {
                group: 1,
                k,
                s,
                d,
                pad,
                out,
            };
            let planes = 1 + pick(3);
            // Few distinct values, so ties (0 / -0) and NaN placement matter.
            let x: Vec<f32> = (0..planes * ih * iw)
                .map(|_| [0.0, -0.0, 1.0, -1.0, f32::NAN, f32::NEG_INFINITY, 2.5][pick(7)])
                .collect();
            let x: Vec<f32> = if case % 2 == 0 {
                x.iter()
                    .map(|v| if v.is_nan() { 3.0 } else { *v })
                    .collect()
            } else {
                x
            };
            let got = maxpool2d(&x, planes, (ih, iw), &g);
            let want = maxpool_ref(&x, planes, (ih, iw), &g);
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{k:?} {s:?} {d:?} {pad:?} {out:?} {ih}x{iw}: {a} vs {b}"
                );
            }
        }
        // ResNet-50's pool, through the thread pool.
        let g = Conv2d {
            group: 1,
            k: [3, 3],
            s: [2, 2],
            d: [1, 1],
            pad: [1, 1],
            out: [56, 56],
        };
        let mut r = rng(15);
        let x = values(&mut r, 64 * 112 * 112, true);
        let got = maxpool2d(&x, 64, (112, 112), &g);
        let want = maxpool_ref(&x, 64, (112, 112), &g);
        assert!(got.iter().zip(&want).all(|(a, b)| same(*a, *b)));
    }

    /// Softmax of one row as the reference: f64 throughout, rounded once.
    fn softmax_ref(row: &[f32]) -> Vec<f32> {
        let m = row
            .iter()
            .map(|&v| v as f64)
            .fold(f64::NEG_INFINITY, |m, v| if v > m { v } else { m });
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|&v| (v / s) as f32).collect()
    }

    #[test]
    fn softmax_last_f32_within_bound_of_reference() {
        let mut r = rng(16);
        let tol = 10.0 * (2f64).powi(-24);
        for case in 0..300 {
            let d = 1 + (r() * 300.0) as usize;
            let rows = 1 + (r() * 8.0) as usize;
            let scale = [1.0, 10.0, 60.0][case % 3];
            let mut x: Vec<f32> = (0..rows * d)
                .map(|_| ((r() * 2.0 - 1.0) * scale) as f32)
                .collect();
            if case % 5 == 0 {
                let i = (r() * x.len() as f64) as usize;
                x[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][case % 3];
            }
            if case % 7 == 0 {
                for v in &mut x[..d] {
                    *v = f32::NEG_INFINITY;
                }
            }
            let t = Tensor::from_vec(vec![rows, d], x.clone()).unwrap();
            let y = softmax_last_f32(&t, d).unwrap();
            let yv = y.as_slice::<f32>().unwrap();
            for (row, got) in x.chunks(d).zip(yv.chunks(d)) {
                for (&g, &w) in got.iter().zip(&softmax_ref(row)) {
                    if w.is_nan() {
                        assert!(g.is_nan());
                        continue;
                    }
                    let err = (g as f64 - w as f64).abs();
                    assert!(err <= tol * w as f64 + 1.7e-38, "{g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn layer_norm_f32_within_one_ulp_of_reference() {
        let mut r = rng(17);
        for case in 0..100 {
            let inner = 1 + (r() * 800.0) as usize;
            let rows = 1 + (r() * 6.0) as usize;
            let off = [0.0, 3.0, -50.0][case % 3];
            let x: Vec<f32> = (0..rows * inner)
                .map(|_| (r() * 4.0 - 2.0 + off) as f32)
                .collect();
            let s: Vec<f32> = (0..inner).map(|_| (r() * 2.0 - 1.0) as f32).collect();
            let b: Vec<f32> = (0..inner).map(|_| (r() * 2.0 - 1.0) as f32).collect();
            let xt = Tensor::from_vec(vec![rows, inner], x.clone()).unwrap();
            let st = Tensor::from_vec(vec![inner], s.clone()).unwrap();
            let bt = Tensor::from_vec(vec![inner], b.clone()).unwrap();
            let with_bias = case % 2 == 0;
            let y = layer_norm_f32(&xt, inner, 1e-5, &st, with_bias.then_some(&bt)).unwrap();
            for (row, got) in x
                .chunks(inner)
                .zip(y.as_slice::<f32>().unwrap().chunks(inner))
            {
                let mean = row.iter().map(|&e| e as f64).sum::<f64>() / inner as f64;
                let var =
                    row.iter().map(|&e| (e as f64 - mean).powi(2)).sum::<f64>() / inner as f64;
                let inv = 1.0 / (var + 1e-5).sqrt();
                for j in 0..inner {
                    let mut w = (row[j] as f64 - mean) * inv * s[j] as f64;
                    if with_bias {
                        w += b[j] as f64;
                    }
                    let w = w as f32;
                    let ulp = f32::from_bits(w.abs().to_bits() + 1) - w.abs();
                    // One ulp, or the f64 reordering's 1e-12 relative to the row's mean.
                    let err = (got[j] - w).abs() as f64;
                    assert!(
                        err <= ulp as f64 + 1e-12 * (1.0 + mean.abs()) * inv,
                        "{} vs {w}",
                        got[j]
                    );
                }
            }
        }
    }

    #[test]
    fn global_avg_pool_and_isnan() {
        let mut r = rng(18);
        let x = values(&mut r, 7 * 49, false);
        let y = global_avg_pool_f32(&x, 49);
        for (p, &got) in y.iter().enumerate() {
            let want = (x[p * 49..][..49].iter().map(|&v| v as f64).sum::<f64>() / 49.0) as f32;
            let ulp = f32::from_bits(want.abs().to_bits() + 1) - want.abs();
            assert!((got - want).abs() <= ulp + 1e-12, "{got} vs {want}");
        }
        let x = values(&mut r, 100_003, true);
        let t = isnan_f32(&Tensor::from_vec(vec![x.len()], x.clone()).unwrap()).unwrap();
        let b = t.as_slice::<bool>().unwrap();
        assert!(x.iter().zip(b).all(|(v, &b)| v.is_nan() == b));
    }

    /// Old (row gather) transpose, for the timing below.
    fn transpose_rows(x: &Tensor, perm: &[usize]) -> Vec<f32> {
        let st = crate::ops::shape::strides(x.shape());
        let shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
        let pst: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
        let xv = x.as_slice::<f32>().unwrap();
        let r = shape.len();
        let (last, ls) = (shape[r - 1], pst[r - 1]);
        let mut out = Vec::with_capacity(xv.len());
        let mut idx = vec![0usize; r - 1];
        let mut off = 0usize;
        for _ in 0..xv.len() / last {
            out.extend((0..last).map(|j| xv[off + j * ls]));
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
        out
    }

    #[test]
    #[ignore]
    fn transpose_timings() {
        let x =
            Tensor::from_vec(vec![1, 128, 12, 64], (0..98304).map(|i| i as f32).collect()).unwrap();
        for perm in [[0, 2, 1, 3], [0, 2, 3, 1]] {
            let time = |f: &dyn Fn()| {
                let mut best = f64::MAX;
                for _ in 0..50 {
                    let t = std::time::Instant::now();
                    f();
                    best = best.min(t.elapsed().as_secs_f64());
                }
                best * 1e6
            };
            let new = time(&|| {
                transpose_f32(&x, &perm).unwrap();
            });
            let old = time(&|| {
                transpose_rows(&x, &perm);
            });
            println!("transpose {perm:?}: {new:.1} us (row gather {old:.1} us)");
        }
        // MobileNet's channels-last boundaries: the image in, the last feature map out.
        let image = Tensor::from_vec(vec![1, 3, 224, 224], vec![0.5f32; 3 * 224 * 224]).unwrap();
        let map = Tensor::from_vec(vec![1, 7, 7, 1280], vec![0.5f32; 49 * 1280]).unwrap();
        for threads in [1, 2] {
            pool::set_threads(Some(threads));
            for (x, perm) in [(&image, [0, 2, 3, 1]), (&map, [0, 3, 1, 2])] {
                let mut best = f64::MAX;
                for _ in 0..200 {
                    let t = std::time::Instant::now();
                    std::hint::black_box(transpose_f32(x, &perm).unwrap());
                    best = best.min(t.elapsed().as_secs_f64());
                }
                println!(
                    "transpose {:?} {perm:?}, {threads} threads: {:.1} us",
                    x.shape(),
                    best * 1e6
                );
            }
        }
        pool::set_threads(None);
    }

    /// The fast paths at 1 and 2 threads on BERT / ViT shapes (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn thread_scaling() {
        let mut r = rng(5);
        let x = values(&mut r, 197 * 3072, false);
        let sm = Tensor::from_vec(vec![12, 197, 197], x[..12 * 197 * 197].to_vec()).unwrap();
        let ln = Tensor::from_vec(vec![197, 768], x[..197 * 768].to_vec()).unwrap();
        let sc = Tensor::from_vec(vec![768], x[..768].to_vec()).unwrap();
        let a = Tensor::from_vec(vec![197, 3072], x.clone()).unwrap();
        for t in [1, 2] {
            pool::set_threads(Some(t));
            let time = |f: &dyn Fn()| {
                let mut best = f64::MAX;
                for _ in 0..30 {
                    let t = std::time::Instant::now();
                    f();
                    best = best.min(t.elapsed().as_secs_f64());
                }
                best * 1e6
            };
            let erf = time(&|| {
                map_f32(&x, Unary::Erf);
            });
            let soft = time(&|| {
                softmax_last_f32(&sm, 197).unwrap();
            });
            let norm = time(&|| {
                layer_norm_f32(&ln, 768, 1e-5, &sc, Some(&sc)).unwrap();
            });
            let add = time(&|| {
                zip_f32(&a, &a, Bin::Add).unwrap();
            });
            println!("{t} threads: Erf 197x3072 {erf:.0} us, Softmax 12x197x197 {soft:.0} us, LayerNorm 197x768 {norm:.0} us, Add 197x3072 {add:.0} us");
        }
    }
}
