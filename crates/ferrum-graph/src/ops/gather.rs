//! Indexing ops: Gather, GatherElements, GatherND, ScatterElements (and Scatter-9), ScatterND.

use crate::ops::shape::{strides, take};
use crate::ops::{axis, Ctx};
use crate::ops::{one, Inferred, Kernel, Rules};
use crate::tensor::{DType, Data, Elem, Num, Tensor};
use crate::{dispatch, kbail, Result};

fn norm_index(i: i64, d: usize) -> Result<usize> {
    let j = if i < 0 { i + d as i64 } else { i };
    if j < 0 || j >= d as i64 {
        kbail!("index {i} is out of range for a dimension of {d}");
    }
    Ok(j as usize)
}

fn gather(cx: &Ctx) -> Result<Tensor> {
    let (x, ind) = (cx.t(0)?, cx.t(1)?);
    let a = axis(cx.ai("axis", 0), x.rank())?;
    // int64 indices are read in place (the common case: token ids), others converted.
    let idx: std::borrow::Cow<[i64]> = match ind.as_slice::<i64>() {
        Ok(v) => v.into(),
        Err(_) => ind.to_i64_vec()?.into(),
    };
    let d = x.shape()[a];
    let inner: usize = x.shape()[a + 1..].iter().product();
    let outer: usize = x.shape()[..a].iter().product();
    let mut shape = x.shape()[..a].to_vec();
    shape.extend_from_slice(ind.shape());
    shape.extend_from_slice(&x.shape()[a + 1..]);
    for &i in idx.iter() {
        norm_index(i, d)?;
    }
    // Checked above: negative indices count from the end.
    let at = |i: i64| {
        if i < 0 {
            (i + d as i64) as usize
        } else {
            i as usize
        }
    };
    if !matches!(x.data(), Data::Code(..)) {
        // Whole runs of `inner` elements at a time (a memcpy each for plain types).
        fn go<T: Elem>(
            x: &Tensor,
            idx: &[i64],
            at: &dyn Fn(i64) -> usize,
            (outer, d, inner): (usize, usize, usize),
            shape: Vec<usize>,
        ) -> Result<Tensor> {
            let v = x.as_slice::<T>()?;
            let mut out = T::room(outer * idx.len() * inner);
            for o in 0..outer {
                for &i in idx {
                    out.extend_from_slice(&v[(o * d + at(i)) * inner..][..inner]);
                }
            }
            Tensor::from_vec(shape, out)
        }
        return dispatch!(x.dtype(), all, go, x, &idx, &at, (outer, d, inner), shape);
    }
    let mut offs = Vec::with_capacity(outer * idx.len() * inner);
    for o in 0..outer {
        for &i in idx.iter() {
            let b = (o * d + at(i)) * inner;
            offs.extend(b..b + inner);
        }
    }
    take(x, &offs, shape)
}

/// GatherElements/ScatterElements: indices of the data's rank, no larger off the axis.
fn check_elements(x: &Tensor, ind: &Tensor, a: usize) -> Result<()> {
    if ind.rank() != x.rank() || (0..x.rank()).any(|d| d != a && ind.shape()[d] > x.shape()[d]) {
        kbail!(
            "indices {:?} do not fit data {:?} on axis {a}",
            ind.shape(),
            x.shape()
        );
    }
    Ok(())
}

fn gather_elements(cx: &Ctx) -> Result<Tensor> {
    let (x, ind) = (cx.t(0)?, cx.t(1)?);
    let a = axis(cx.ai("axis", 0), x.rank())?;
    check_elements(x, ind, a)?;
    let idx = ind.to_i64_vec()?;
    let xs = strides(x.shape());
    let shape = ind.shape().to_vec();
    let mut offs = Vec::with_capacity(idx.len());
    let ist = strides(&shape);
    for (k, &i) in idx.iter().enumerate() {
        let mut off = 0;
        for d in 0..shape.len() {
            let c = if d == a {
                norm_index(i, x.shape()[a])?
            } else {
                (k / ist[d]) % shape[d]
            };
            off += c * xs[d];
        }
        offs.push(off);
    }
    take(x, &offs, shape)
}

fn scatter_elements(cx: &Ctx) -> Result<Tensor> {
    let (x, ind, upd) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    let a = axis(cx.ai("axis", 0), x.rank())?;
    check_elements(x, ind, a)?;
    if upd.shape() != ind.shape() {
        kbail!(
            "updates {:?} differ from indices {:?}",
            upd.shape(),
            ind.shape()
        );
    }
    let idx = ind.to_i64_vec()?;
    let xs = strides(x.shape());
    let shape = ind.shape();
    let ist = strides(shape);
    let mut offs = Vec::with_capacity(idx.len());
    for (k, &i) in idx.iter().enumerate() {
        let mut off = 0;
        for d in 0..shape.len() {
            let c = if d == a {
                norm_index(i, x.shape()[a])?
            } else {
                (k / ist[d]) % shape[d]
            };
            off += c * xs[d];
        }
        offs.push(off);
    }
    scatter(x, &offs, upd, 1, &cx.astr("reduction", "none"))
}

/// Writes `chunk` consecutive elements of `upd` at each offset of `offs` into a copy of `x`.
fn scatter(x: &Tensor, offs: &[usize], upd: &Tensor, chunk: usize, red: &str) -> Result<Tensor> {
    fn go<T: Num>(
        x: &Tensor,
        offs: &[usize],
        upd: &Tensor,
        chunk: usize,
        red: &str,
    ) -> Result<Tensor> {
        let mut v = x.as_slice::<T>()?.to_vec();
        let u = upd.as_slice::<T>()?;
        if u.len() < offs.len() * chunk {
            kbail!("updates too short");
        }
        for (k, &o) in offs.iter().enumerate() {
            for j in 0..chunk {
                let (dst, src) = (&mut v[o + j], u[k * chunk + j]);
                *dst = match red {
                    "add" => dst.add(src),
                    "mul" => dst.mul(src),
                    "max" => {
                        if src > *dst {
                            src
                        } else {
                            *dst
                        }
                    }
                    "min" => {
                        if src < *dst {
                            src
                        } else {
                            *dst
                        }
                    }
                    _ => src,
                };
            }
        }
        Tensor::from_vec(x.shape().to_vec(), v)
    }
    if x.dtype() == DType::Str {
        let mut v = x.as_slice::<String>()?.to_vec();
        let u = upd.as_slice::<String>()?;
        for (k, &o) in offs.iter().enumerate() {
            for j in 0..chunk {
                v[o + j] = u[k * chunk + j].clone();
            }
        }
        return Tensor::from_vec(x.shape().to_vec(), v);
    }
    dispatch!(x.dtype(), num, go, x, offs, upd, chunk, red)
}

/// For GatherND/ScatterND: the data offsets selected by the last dim of `ind`, and the chunk size.
fn nd_offsets(x: &Tensor, ind: &Tensor, batch: usize) -> Result<(Vec<usize>, usize, Vec<usize>)> {
    let idx = ind.to_i64_vec()?;
    let q = ind.rank();
    if q == 0 {
        kbail!("indices must have rank >= 1");
    }
    let k = ind.shape()[q - 1];
    if batch >= q || x.shape().get(..batch) != ind.shape().get(..batch) {
        kbail!(
            "batch_dims {batch} does not fit data {:?} and indices {:?}",
            x.shape(),
            ind.shape()
        );
    }
    if batch + k > x.rank() {
        kbail!("index depth {k} too large for rank {}", x.rank());
    }
    let xs = strides(x.shape());
    let chunk: usize = x.shape()[batch + k..].iter().product();
    let batch_size: usize = x.shape()[batch..].iter().product();
    let per_batch: usize = ind.shape()[batch..q - 1].iter().product();
    let tuples: usize = ind.shape()[..q - 1].iter().product();
    let mut offs = Vec::with_capacity(tuples);
    for t in 0..tuples {
        let b = t.checked_div(per_batch).unwrap_or(0);
        let mut off = b * batch_size;
        for j in 0..k {
            off += norm_index(idx[t * k + j], x.shape()[batch + j])? * xs[batch + j];
        }
        offs.push(off);
    }
    let mut shape = ind.shape()[..q - 1].to_vec();
    shape.extend_from_slice(&x.shape()[batch + k..]);
    Ok((offs, chunk, shape))
}

fn gather_nd(cx: &Ctx) -> Result<Tensor> {
    let (x, ind) = (cx.t(0)?, cx.t(1)?);
    let batch =
        usize::try_from(cx.ai("batch_dims", 0)).map_err(|_| crate::kerr!("negative batch_dims"))?;
    let (offs, chunk, shape) = nd_offsets(x, ind, batch)?;
    let all: Vec<usize> = offs.iter().flat_map(|&o| o..o + chunk).collect();
    take(x, &all, shape)
}

fn scatter_nd(cx: &Ctx) -> Result<Tensor> {
    let (x, ind, upd) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    let (offs, chunk, _) = nd_offsets(x, ind, 0)?;
    scatter(x, &offs, upd, chunk, &cx.astr("reduction", "none"))
}

/// The static rules of Gather: `data[.., idx, ..]` along `axis`; a small constant vector's
/// picked values carried through (a shape's dims).
pub fn rules(op: &str) -> Option<Rules> {
    (op == "Gather").then_some(Rules::shape(|k| {
        let (x, idx) = (k.dims(0)?, k.dims(1)?);
        let a = k.ai("axis", 0);
        let a = usize::try_from(if a < 0 { a + x.len() as i64 } else { a }).ok()?;
        if a >= x.len() {
            return None;
        }
        let ints = match (k.ints(0), k.ints(1), x.len()) {
            (Some(data), Some(ix), 1) => ix
                .iter()
                .map(|&i| {
                    let i = if i < 0 { i + data.len() as i64 } else { i };
                    data.get(usize::try_from(i).ok()?).copied()
                })
                .collect(),
            _ => None,
        };
        let mut dims = x[..a].to_vec();
        dims.extend_from_slice(idx);
        dims.extend_from_slice(&x[a + 1..]);
        Some(Inferred { dims, ints })
    }))
}

/// Gather and scatter ops; `None` when `cx`'s op is not one of them.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "Gather" => |cx| one(gather(cx)?),
        "GatherElements" => |cx| one(gather_elements(cx)?),
        "GatherND" => |cx| one(gather_nd(cx)?),
        "ScatterElements" | "Scatter" => |cx| one(scatter_elements(cx)?),
        "ScatterND" => |cx| one(scatter_nd(cx)?),
        _ => return None,
    };
    Some(k)
}
