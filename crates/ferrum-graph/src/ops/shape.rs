//! Shape and data-movement ops. Most build a list of source offsets and [`take`] them, so one
//! generic copy serves every element type.

use crate::ir::Attr;
use crate::ops::elementwise::{broadcast_offsets, broadcast_shape, broadcast_walk};
use crate::ops::{
    axis, one, same_shape, small_ints, unsupported, Ctx, Infer, Inferred, Kernel, Known, Rules,
    ViewDims,
};
use crate::tensor::{numel, DType, Data, Elem, Num, Tensor, Value};
use crate::{dispatch, kbail, Result};

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// A new tensor of `shape` whose elements are `t`'s at `idx`.
pub fn take(t: &Tensor, idx: &[usize], shape: Vec<usize>) -> Result<Tensor> {
    fn go<T: Elem>(t: &Tensor, idx: &[usize], shape: Vec<usize>) -> Result<Tensor> {
        let v = t.as_slice::<T>()?;
        let mut out = T::room(idx.len());
        out.extend(idx.iter().map(|&i| v[i].clone()));
        Tensor::from_vec(shape, out)
    }
    if let Some(&bad) = idx.iter().find(|&&i| i >= t.len()) {
        kbail!(
            "element {bad} is out of range for a tensor of {:?}",
            t.shape()
        );
    }
    if let crate::tensor::Data::Code(dt, v) = t.data() {
        return Tensor::new(
            shape,
            crate::tensor::Data::Code(*dt, idx.iter().map(|&i| v[i]).collect()),
        );
    }
    dispatch!(t.dtype(), all, go, t, idx, shape)
}

/// Like [`take`], with `None` offsets filled by `fill` (a one-element tensor of the same type,
/// or the type's default when absent).
fn take_or(
    t: &Tensor,
    idx: &[Option<usize>],
    shape: Vec<usize>,
    fill: Option<&Tensor>,
) -> Result<Tensor> {
    fn go<T: Elem>(
        t: &Tensor,
        idx: &[Option<usize>],
        shape: Vec<usize>,
        fill: Option<&Tensor>,
    ) -> Result<Tensor> {
        let v = t.as_slice::<T>()?;
        if idx.iter().flatten().any(|&i| i >= v.len()) {
            kbail!("element out of range for a tensor of {:?}", t.shape());
        }
        let f = match fill {
            Some(f) if !f.is_empty() => f.as_slice::<T>()?[0].clone(),
            _ => T::default(),
        };
        Tensor::from_vec(
            shape,
            idx.iter()
                .map(|i| i.map_or_else(|| f.clone(), |i| v[i].clone()))
                .collect(),
        )
    }
    dispatch!(t.dtype(), all, go, t, idx, shape, fill)
}

/// Offsets `base + Σ idx[d]·st[d]` over every index of `shape` (row-major).
pub fn strided_offsets(shape: &[usize], st: &[isize], base: isize) -> Vec<usize> {
    let n = numel(shape).unwrap_or(0);
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; shape.len()];
    let mut cur = base;
    for _ in 0..n {
        out.push(cur as usize);
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            cur += st[d];
            if idx[d] < shape[d] {
                break;
            }
            cur -= st[d] * shape[d] as isize;
            idx[d] = 0;
        }
    }
    out
}

fn i64_tensor(shape: Vec<usize>, v: Vec<i64>) -> Result<Tensor> {
    Tensor::from_vec(shape, v)
}

fn check_len(n: Option<usize>) -> Result<usize> {
    match n {
        Some(n) if n <= crate::onnx::MAX_ELEMENTS => Ok(n),
        _ => kbail!("output too large"),
    }
}

fn transpose(t: &Tensor, perm: &[usize]) -> Result<Tensor> {
    let st = strides(t.shape());
    if perm.len() != t.rank() {
        kbail!("perm {perm:?} does not match rank {}", t.rank());
    }
    let shape: Vec<usize> = perm.iter().map(|&p| t.shape()[p]).collect();
    let pst: Vec<isize> = perm.iter().map(|&p| st[p] as isize).collect();
    take(t, &strided_offsets(&shape, &pst, 0), shape)
}

pub fn transpose_t(t: &Tensor, perm: &[usize]) -> Result<Tensor> {
    transpose(t, perm)
}

/// Reshape's output dims.
fn reshape_dims(cx: &Ctx) -> Result<Vec<usize>> {
    let x = cx.t(0)?;
    let spec = if cx.opset() < 5 {
        cx.aints("shape").unwrap_or_default()
    } else {
        cx.t(1)?.to_i64_vec()?
    };
    let allowzero = cx.ai("allowzero", 0) != 0;
    let mut shape = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (i, &d) in spec.iter().enumerate() {
        match d {
            -1 => {
                if infer.is_some() {
                    kbail!("more than one -1 in shape {spec:?}");
                }
                infer = Some(i);
                shape.push(1);
            }
            0 if !allowzero => shape.push(
                *x.shape()
                    .get(i)
                    .ok_or_else(|| crate::kerr!("0 in shape {spec:?} has no input dim"))?,
            ),
            d if d < 0 => kbail!("bad dim {d} in shape {spec:?}"),
            d => shape.push(d as usize),
        }
    }
    if let Some(i) = infer {
        let rest = numel(&shape).unwrap_or(0);
        if rest == 0 || x.len() % rest != 0 {
            kbail!("cannot reshape {:?} to {spec:?}", x.shape());
        }
        shape[i] = x.len() / rest;
    }
    Ok(shape)
}

fn axes_of(cx: &Ctx, input: usize, since: i64) -> Result<Option<Vec<i64>>> {
    if cx.opset() < since {
        Ok(cx.aints("axes"))
    } else {
        cx.opt(input).map(|t| t.to_i64_vec()).transpose()
    }
}

fn squeeze_dims(cx: &Ctx) -> Result<Vec<usize>> {
    let x = cx.t(0)?;
    let axes = axes_of(cx, 1, 13)?;
    let r = x.rank();
    let drop: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&a| axis(a, r)).collect::<Result<_>>()?,
        None => (0..r).filter(|&i| x.shape()[i] == 1).collect(),
    };
    for &d in &drop {
        if x.shape()[d] != 1 {
            kbail!("cannot squeeze dim {d} of size {}", x.shape()[d]);
        }
    }
    Ok((0..r)
        .filter(|i| !drop.contains(i))
        .map(|i| x.shape()[i])
        .collect())
}

fn unsqueeze_dims(cx: &Ctx) -> Result<Vec<usize>> {
    let x = cx.t(0)?;
    let axes = axes_of(cx, 1, 13)?.ok_or_else(|| crate::kerr!("Unsqueeze needs axes"))?;
    let r = x.rank() + axes.len();
    let mut ax: Vec<usize> = axes.iter().map(|&a| axis(a, r)).collect::<Result<_>>()?;
    ax.sort();
    let mut shape = Vec::with_capacity(r);
    let mut src = x.shape().iter();
    for i in 0..r {
        if ax.contains(&i) {
            shape.push(1);
        } else {
            shape.push(
                *src.next()
                    .ok_or_else(|| crate::kerr!("bad axes {axes:?}"))?,
            );
        }
    }
    Ok(shape)
}

fn flatten_dims(cx: &Ctx) -> Result<Vec<usize>> {
    let x = cx.t(0)?;
    let a = cx.ai("axis", 1);
    let a = if a < 0 { a + x.rank() as i64 } else { a };
    if a < 0 || a > x.rank() as i64 {
        kbail!("axis {a} out of range");
    }
    let outer: usize = x.shape()[..a as usize].iter().product();
    Ok(vec![outer, x.len().checked_div(outer).unwrap_or(0)])
}

/// The output dims of a view op (Reshape, Flatten, Squeeze, Unsqueeze, and a Transpose that
/// only moves dims of size 1: the same elements in the same order under another shape); `None`
/// for other ops. The executor uses it to reshape a value it can move instead of copying it.
pub fn view(op: &str) -> Option<ViewDims> {
    let dims: ViewDims = match op {
        "Reshape" => |cx| Some(reshape_dims(cx)),
        "Flatten" => |cx| Some(flatten_dims(cx)),
        "Squeeze" => |cx| Some(squeeze_dims(cx)),
        "Unsqueeze" => |cx| Some(unsqueeze_dims(cx)),
        "Transpose" => |cx| order_keeping_transpose(cx).map(Ok),
        _ => return None,
    };
    Some(dims)
}

/// A Transpose's output dims when its permutation keeps the elements' memory order (the dims
/// larger than 1 stay in order: PyTorch's batch-first / sequence-first swaps at batch 1), else
/// `None` (including an invalid permutation, left for the op to report).
fn order_keeping_transpose(cx: &Ctx) -> Option<Vec<usize>> {
    let x = cx.t(0).ok()?;
    let r = x.rank();
    let perm: Vec<usize> = match cx.aints("perm") {
        Some(p) => p.iter().map(|&a| axis(a, r).ok()).collect::<Option<_>>()?,
        None => (0..r).rev().collect(),
    };
    let mut seen = vec![false; r];
    if perm.len() != r || perm.iter().any(|&p| std::mem::replace(&mut seen[p], true)) {
        return None;
    }
    let big: Vec<usize> = perm.iter().copied().filter(|&p| x.shape()[p] > 1).collect();
    big.windows(2)
        .all(|w| w[0] < w[1])
        .then(|| perm.iter().map(|&p| x.shape()[p]).collect())
}

fn concat(ts: &[&Tensor], ax: i64) -> Result<Tensor> {
    let first = ts
        .first()
        .ok_or_else(|| crate::kerr!("nothing to concatenate"))?;
    let r = first.rank();
    let a = axis(ax, r)?;
    let mut shape = first.shape().to_vec();
    shape[a] = 0;
    for t in ts {
        if t.rank() != r || t.dtype() != first.dtype() {
            kbail!(
                "concatenating {:?} {} with {:?} {}",
                first.shape(),
                first.dtype(),
                t.shape(),
                t.dtype()
            );
        }
        for d in 0..r {
            if d != a && t.shape()[d] != first.shape()[d] {
                kbail!(
                    "concatenating {:?} with {:?} on axis {a}",
                    first.shape(),
                    t.shape()
                );
            }
        }
        shape[a] += t.shape()[a];
    }
    fn go<T: Elem>(ts: &[&Tensor], a: usize, shape: Vec<usize>) -> Result<Tensor> {
        let outer: usize = shape[..a].iter().product();
        let mut v = T::room(numel(&shape).unwrap_or(0));
        let parts: Vec<(&[T], usize)> = ts
            .iter()
            .map(|t| Ok((t.as_slice::<T>()?, t.shape()[a..].iter().product::<usize>())))
            .collect::<Result<_>>()?;
        for o in 0..outer {
            for (s, chunk) in &parts {
                v.extend_from_slice(&s[o * chunk..(o + 1) * chunk]);
            }
        }
        Tensor::from_vec(shape, v)
    }
    dispatch!(first.dtype(), all, go, ts, a, shape)
}

pub fn concat_t(ts: &[&Tensor], ax: i64) -> Result<Tensor> {
    concat(ts, ax)
}

/// The sub-tensor `[start, start+len)` along `a`.
pub fn narrow(t: &Tensor, a: usize, start: usize, len: usize) -> Result<Tensor> {
    let mut shape = t.shape().to_vec();
    shape[a] = len;
    let st: Vec<isize> = strides(t.shape()).iter().map(|&s| s as isize).collect();
    let base = start as isize * st[a];
    take(t, &strided_offsets(&shape, &st, base), shape)
}

fn split(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let a = axis(cx.ai("axis", 0), x.rank())?;
    let d = x.shape()[a];
    let n_out = cx.node.outputs.len();
    let sizes: Vec<usize> = match if cx.opset() < 13 {
        cx.aints("split")
    } else {
        None
    }
    .or(if cx.opset() >= 13 || cx.opset() < 2 {
        cx.opt(1).map(|t| t.to_i64_vec()).transpose()?
    } else {
        None
    }) {
        Some(s) => s.iter().map(|&v| v.max(0) as usize).collect(),
        None => {
            let n = if cx.opset() >= 18 {
                cx.ai("num_outputs", n_out as i64) as usize
            } else {
                n_out
            };
            if n == 0 {
                kbail!("split into zero parts");
            }
            let chunk = d.div_ceil(n);
            (0..n)
                .map(|i| chunk.min(d.saturating_sub(i * chunk)))
                .collect()
        }
    };
    if sizes.iter().sum::<usize>() != d {
        kbail!("split sizes {sizes:?} do not add up to {d}");
    }
    let mut start = 0;
    let mut out = Vec::new();
    for s in sizes {
        out.push(Value::Tensor(narrow(x, a, start, s)?));
        start += s;
    }
    Ok(out)
}

fn slice(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let r = x.rank();
    let (starts, ends, axes, steps) = if cx.opset() < 10 {
        (
            cx.aints("starts").unwrap_or_default(),
            cx.aints("ends").unwrap_or_default(),
            cx.aints("axes"),
            None,
        )
    } else {
        (
            cx.t(1)?.to_i64_vec()?,
            cx.t(2)?.to_i64_vec()?,
            cx.opt(3).map(|t| t.to_i64_vec()).transpose()?,
            cx.opt(4).map(|t| t.to_i64_vec()).transpose()?,
        )
    };
    let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        kbail!("starts, ends, axes and steps differ in length");
    }
    let mut shape = x.shape().to_vec();
    let st: Vec<isize> = strides(x.shape()).iter().map(|&s| s as isize).collect();
    let mut ost = st.clone();
    let mut base = 0isize;
    for k in 0..starts.len() {
        let a = axis(axes[k], r)?;
        let d = x.shape()[a] as i64;
        let step = steps[k];
        if step == 0 {
            kbail!("slice step 0");
        }
        let fix = |v: i64| if v < 0 { v + d } else { v };
        let (s, e) = (
            fix(starts[k].clamp(-i64::MAX / 2, i64::MAX / 2)),
            fix(ends[k].clamp(-i64::MAX / 2, i64::MAX / 2)),
        );
        let (s, e) = if step > 0 {
            (s.clamp(0, d), e.clamp(0, d))
        } else {
            (s.clamp(0, d - 1), e.clamp(-1, d - 1))
        };
        let n = if step > 0 {
            (e - s + step - 1).max(0) / step
        } else {
            (s - e - step - 1).max(0) / -step
        };
        shape[a] = n as usize;
        base += s as isize * st[a];
        ost[a] = st[a] * step as isize;
    }
    if numel(&shape) == Some(0) {
        return Tensor::zeros(x.dtype(), shape);
    }
    if let Some(t) = slice_runs(x, &shape, &ost, &st, base) {
        return t;
    }
    take(x, &strided_offsets(&shape, &ost, base), shape)
}

/// A slice whose innermost dims are read in runs of consecutive elements (step 1 on them, and
/// every dim inside a cut one taken whole: a channel split, a crop of rows), copied a run at a
/// time; `None` when the runs would be shorter than 16 elements (or the type is a coded one),
/// for the element-by-element gather. `ost`: the input's stride for each output dim (times its
/// step), `st`: the input's strides, `base`: the first element's offset.
fn slice_runs(
    x: &Tensor,
    shape: &[usize],
    ost: &[isize],
    st: &[isize],
    base: isize,
) -> Option<Result<Tensor>> {
    if matches!(x.data(), crate::tensor::Data::Code(..)) {
        return None;
    }
    // The run: the innermost dims with step 1, through the first one not taken whole.
    let (mut run, mut k) = (1usize, shape.len());
    while k > 0 {
        let d = k - 1;
        if ost[d] != st[d] {
            break;
        }
        run *= shape[d];
        k -= 1;
        if shape[d] != x.shape()[d] {
            break;
        }
    }
    if run < 16 {
        return None;
    }
    fn go<T: Elem>(
        x: &Tensor,
        shape: &[usize],
        ost: &[isize],
        k: usize,
        run: usize,
        base: isize,
    ) -> Result<Tensor> {
        let v = x.as_slice::<T>()?;
        // Each run's first element (in range: `slice` clamped every start and extent).
        let starts = strided_offsets(&shape[..k], &ost[..k], base);
        let mut o = T::room(starts.len() * run);
        for at in starts {
            o.extend_from_slice(&v[at..at + run]);
        }
        Tensor::from_vec(shape.to_vec(), o)
    }
    let copy = || -> Result<Tensor> { dispatch!(x.dtype(), all, go, x, shape, ost, k, run, base) };
    Some(copy())
}

fn expand(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let dims: Vec<usize> = cx
        .t(1)?
        .to_i64_vec()?
        .iter()
        .map(|&d| d.max(0) as usize)
        .collect();
    let out = broadcast_shape(x.shape(), &dims)?;
    check_len(numel(&out))?;
    if matches!(x.data(), crate::tensor::Data::Code(..)) {
        let offs = broadcast_offsets(&[x.shape()], &out);
        return take(x, &offs[0], out);
    }
    fn go<T: Elem>(x: &Tensor, out: Vec<usize>) -> Result<Tensor> {
        let v = x.as_slice::<T>()?;
        let mut o = T::room(numel(&out).unwrap_or(0));
        broadcast_walk([x.shape()], &out, |[i]| {
            o.push(v[i].clone());
            Ok(())
        })?;
        Tensor::from_vec(out, o)
    }
    dispatch!(x.dtype(), all, go, x, out)
}

fn tile(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let reps = cx.t(1)?.to_i64_vec()?;
    if reps.len() != x.rank() {
        kbail!("repeats {reps:?} do not match rank {}", x.rank());
    }
    let shape: Vec<usize> = x
        .shape()
        .iter()
        .zip(&reps)
        .map(|(&d, &r)| d * r.max(0) as usize)
        .collect();
    let n = check_len(numel(&shape))?;
    let xs = strides(x.shape());
    let os = strides(&shape);
    let offs = (0..n)
        .map(|k| {
            (0..shape.len())
                .map(|d| ((k / os[d]) % shape[d]) % x.shape()[d] * xs[d])
                .sum()
        })
        .collect::<Vec<usize>>();
    take(x, &offs, shape)
}

fn pad(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let r = x.rank();
    let mode = cx.astr("mode", "constant");
    let (pads, fill_owned) = if cx.opset() < 11 {
        let p = cx
            .aints("pads")
            .or_else(|| cx.aints("paddings"))
            .unwrap_or_default();
        let v = cx.af("value", 0.0) as f64;
        (
            p,
            Some(crate::ops::elementwise::cast(
                &Tensor::scalar(v),
                x.dtype(),
            )?),
        )
    } else {
        let p = cx.t(1)?.to_i64_vec()?;
        (p, None)
    };
    let fill = fill_owned
        .as_ref()
        .or(if cx.opset() >= 11 { cx.opt(2) } else { None });
    let axes: Vec<usize> = match if cx.opset() >= 18 { cx.opt(3) } else { None } {
        Some(a) => a
            .to_i64_vec()?
            .iter()
            .map(|&a| axis(a, r))
            .collect::<Result<_>>()?,
        None => (0..r).collect(),
    };
    if pads.len() != 2 * axes.len() {
        kbail!("pads {pads:?} do not match {} axes", axes.len());
    }
    let mut before = vec![0i64; r];
    let mut after = vec![0i64; r];
    for (k, &a) in axes.iter().enumerate() {
        before[a] = pads[k];
        after[a] = pads[k + axes.len()];
    }
    let shape: Vec<usize> = (0..r)
        .map(|d| {
            let n = x.shape()[d] as i64 + before[d] + after[d];
            if n < 0 {
                kbail!("negative padded size");
            }
            Ok(n as usize)
        })
        .collect::<Result<_>>()?;
    let n = check_len(numel(&shape))?;
    let xs = strides(x.shape());
    let os = strides(&shape);
    let mut offs = Vec::with_capacity(n);
    for k in 0..n {
        let mut off = Some(0usize);
        for d in 0..r {
            let dim = x.shape()[d] as i64;
            let mut c = ((k / os[d]) % shape[d]) as i64 - before[d];
            if c < 0 || c >= dim {
                c = match mode.as_str() {
                    "constant" => {
                        off = None;
                        break;
                    }
                    "edge" => c.clamp(0, dim - 1),
                    "reflect" => {
                        if dim == 1 {
                            0
                        } else {
                            let p = 2 * (dim - 1);
                            let m = c.rem_euclid(p);
                            if m >= dim {
                                p - m
                            } else {
                                m
                            }
                        }
                    }
                    "wrap" => c.rem_euclid(dim),
                    m => return Err(unsupported(format!("Pad mode '{m}'"))),
                };
            }
            if let Some(o) = off.as_mut() {
                *o += c as usize * xs[d];
            }
        }
        offs.push(off);
    }
    take_or(x, &offs, shape, fill)
}

fn range(cx: &Ctx) -> Result<Tensor> {
    let (s, l, d) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    fn go<T: Num>(s: &Tensor, l: &Tensor, d: &Tensor) -> Result<Tensor> {
        let (s, l, d) = (
            s.as_slice::<T>()?[0],
            l.as_slice::<T>()?[0],
            d.as_slice::<T>()?[0],
        );
        let n = ((l.to_f64() - s.to_f64()) / d.to_f64()).ceil().max(0.0);
        if !n.is_finite() || n > crate::onnx::MAX_ELEMENTS as f64 {
            kbail!("range of {n} elements");
        }
        let n = n as usize;
        let v: Vec<T> = if T::IS_FLOAT {
            // numpy arange: start + i * delta, in the element type
            let mut v = Vec::with_capacity(n);
            let mut acc = s;
            for _ in 0..n {
                v.push(acc);
                acc = acc.add(d);
            }
            v
        } else {
            (0..n)
                .map(|i| T::from_i128(s.to_i128() + i as i128 * d.to_i128()))
                .collect()
        };
        Tensor::from_vec(vec![n], v)
    }
    dispatch!(s.dtype(), num_nobool, go, s, l, d)
}

fn one_hot(cx: &Ctx) -> Result<Tensor> {
    let (ind, depth, vals) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    let depth = depth.scalar_f64()? as i64;
    if depth < 0 || depth as usize > crate::onnx::MAX_ELEMENTS {
        kbail!("bad depth {depth}");
    }
    let r = ind.rank() + 1;
    let a = axis(cx.ai("axis", -1), r)?;
    let idx = ind.to_f64_vec()?;
    let mut shape = ind.shape().to_vec();
    shape.insert(a, depth as usize);
    let n = check_len(numel(&shape))?;
    let inner: usize = ind.shape()[a..].iter().product();
    let mut sel = vec![0usize; n];
    for (k, &i) in idx.iter().enumerate() {
        let mut i = i as i64;
        if i < 0 {
            i += depth;
        }
        if i < 0 || i >= depth {
            continue;
        }
        let (o, inn) = (k / inner, k % inner);
        sel[(o * depth as usize + i as usize) * inner + inn] = 1;
    }
    take(vals, &sel, shape)
}

fn constant_of_shape(cx: &Ctx) -> Result<Tensor> {
    let dims: Vec<usize> = cx
        .t(0)?
        .to_i64_vec()?
        .iter()
        .map(|&d| d.max(0) as usize)
        .collect();
    let n = check_len(numel(&dims))?;
    let v = match cx.attr("value") {
        Some(Attr::Tensor(t)) => t.clone(),
        _ => Tensor::scalar(0f32),
    };
    take(&v, &vec![0; n], dims)
}

fn constant(cx: &Ctx) -> Result<Tensor> {
    let (name, a) = cx
        .node
        .attrs
        .iter()
        .next()
        .ok_or_else(|| crate::kerr!("Constant without a value"))?;
    Ok(match (name.as_str(), a) {
        (_, Attr::Tensor(t)) => t.clone(),
        ("value_float", Attr::Float(f)) => Tensor::scalar(*f),
        ("value_floats", Attr::Floats(f)) => Tensor::from_vec(vec![f.len()], f.clone())?,
        ("value_int", Attr::Int(i)) => Tensor::scalar(*i),
        ("value_ints", Attr::Ints(i)) => Tensor::from_vec(vec![i.len()], i.clone())?,
        ("value_string", Attr::Str(s)) => Tensor::scalar(String::from_utf8_lossy(s).into_owned()),
        ("value_strings", Attr::Strings(s)) => Tensor::from_vec(
            vec![s.len()],
            s.iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect(),
        )?,
        (n, _) => return Err(unsupported(format!("Constant attribute '{n}'"))),
    })
}

fn trilu(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let k = cx.opt(1).map(|t| t.scalar_i64()).transpose()?.unwrap_or(0);
    let upper = cx.ai("upper", 1) != 0;
    let r = x.rank();
    if r < 2 {
        kbail!("Trilu needs rank >= 2");
    }
    let (h, w) = (x.shape()[r - 2], x.shape()[r - 1]);
    let offs: Vec<Option<usize>> = (0..x.len())
        .map(|o| {
            let (i, j) = (((o / w) % h) as i64, (o % w) as i64);
            let keep = if upper { j - i >= k } else { j - i <= k };
            keep.then_some(o)
        })
        .collect();
    take_or(x, &offs, x.shape().to_vec(), None)
}

fn depth_space(cx: &Ctx, to_space: bool) -> Result<Tensor> {
    let x = cx.t(0)?;
    if x.rank() != 4 {
        kbail!("expects a 4-D input");
    }
    let b = cx.ai("blocksize", 0).max(1) as usize;
    let (n, c, h, w) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let crd = cx.astr("mode", "DCR") == "CRD";
    if to_space {
        if c % (b * b) != 0 {
            kbail!("channels {c} not divisible by blocksize² {}", b * b);
        }
        let c2 = c / (b * b);
        let (t, perm) = if crd {
            (
                x.clone().reshape(vec![n, c2, b, b, h, w])?,
                [0, 1, 4, 2, 5, 3],
            )
        } else {
            (
                x.clone().reshape(vec![n, b, b, c2, h, w])?,
                [0, 3, 4, 1, 5, 2],
            )
        };
        transpose(&t, &perm)?.reshape(vec![n, c2, h * b, w * b])
    } else {
        if h % b != 0 || w % b != 0 {
            kbail!("spatial dims not divisible by blocksize");
        }
        let t = x.clone().reshape(vec![n, c, h / b, b, w / b, b])?;
        let perm = if crd {
            [0, 1, 3, 5, 2, 4]
        } else {
            [0, 3, 5, 1, 2, 4]
        };
        transpose(&t, &perm)?.reshape(vec![n, c * b * b, h / b, w / b])
    }
}

fn eye_like(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let dt = match cx.attr("dtype") {
        Some(Attr::Int(c)) => DType::from_onnx(*c as i32)
            .ok_or_else(|| crate::Error::UnsupportedType(DType::onnx_name(*c as i32)))?,
        _ => x.dtype(),
    };
    let k = cx.ai("k", 0);
    if x.rank() != 2 {
        kbail!("EyeLike expects 2-D input");
    }
    let (h, w) = (x.shape()[0], x.shape()[1]);
    let v: Vec<f64> = (0..h * w)
        .map(|o| {
            if (o % w) as i64 - (o / w) as i64 == k {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    crate::ops::elementwise::cast(&Tensor::from_vec(vec![h, w], v)?, dt)
}

fn nonzero(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let nz: Vec<bool> = match x.data() {
        Data::Str(v) => v.iter().map(|s| !s.is_empty()).collect(),
        _ => x.to_f64_vec()?.iter().map(|&v| v != 0.0).collect(),
    };
    let r = x.rank();
    let st = strides(x.shape());
    let hits: Vec<usize> = nz
        .iter()
        .enumerate()
        .filter(|(_, &b)| b)
        .map(|(i, _)| i)
        .collect();
    let mut v = vec![0i64; r * hits.len()];
    for (k, &h) in hits.iter().enumerate() {
        for d in 0..r {
            v[d * hits.len() + k] = ((h / st[d]) % x.shape()[d]) as i64;
        }
    }
    i64_tensor(vec![r, hits.len()], v)
}

fn compress(cx: &Ctx) -> Result<Tensor> {
    let (x, c) = (cx.t(0)?, cx.t(1)?);
    let cond: Vec<bool> = c.to_f64_vec()?.iter().map(|&v| v != 0.0).collect();
    match cx.attr("axis") {
        None => {
            let offs: Vec<usize> = (0..x.len())
                .filter(|&i| cond.get(i).copied().unwrap_or(false))
                .collect();
            let n = offs.len();
            take(x, &offs, vec![n])
        }
        Some(_) => {
            let a = axis(cx.ai("axis", 0), x.rank())?;
            let sel: Vec<usize> = (0..x.shape()[a])
                .filter(|&i| cond.get(i).copied().unwrap_or(false))
                .collect();
            let outer: usize = x.shape()[..a].iter().product();
            let inner: usize = x.shape()[a + 1..].iter().product();
            let d = x.shape()[a];
            let mut offs = Vec::new();
            for o in 0..outer {
                for &i in &sel {
                    let b = (o * d + i) * inner;
                    offs.extend(b..b + inner);
                }
            }
            let mut shape = x.shape().to_vec();
            shape[a] = sel.len();
            take(x, &offs, shape)
        }
    }
}

fn reverse_sequence(cx: &Ctx) -> Result<Tensor> {
    let (x, lens) = (cx.t(0)?, cx.t(1)?.to_i64_vec()?);
    let ta = cx.ai("time_axis", 0) as usize;
    let ba = cx.ai("batch_axis", 1) as usize;
    let st = strides(x.shape());
    let offs: Vec<usize> = (0..x.len())
        .map(|o| {
            let t = (o / st[ta]) % x.shape()[ta];
            let b = (o / st[ba]) % x.shape()[ba];
            let l = lens.get(b).copied().unwrap_or(0) as usize;
            if t < l {
                o - t * st[ta] + (l - 1 - t) * st[ta]
            } else {
                o
            }
        })
        .collect();
    take(x, &offs, x.shape().to_vec())
}

/// The static rules of the shape ops: their output dims and, for the small integer vectors a
/// graph computes its shapes with (Shape, Constant, Gather, Slice, Concat, Squeeze, Unsqueeze of
/// constants), their values. Data movement costs no floating-point operations.
pub fn rules(op: &str, opset: i64) -> Option<Rules> {
    let shape: Infer = match op {
        "Identity" | "Dropout" => same_shape,
        "Constant" => |k| match k.node.attrs.get("value") {
            Some(Attr::Tensor(t)) => Some(Inferred {
                dims: t.shape().to_vec(),
                ints: small_ints(t),
            }),
            _ => k.aints("value_ints").map(|v| Inferred {
                dims: vec![v.len()],
                ints: Some(v.to_vec()),
            }),
        },
        "Shape" => |k| {
            let x = k.dims(0)?;
            let whole = k.ai("start", 0) == 0 && !k.node.attrs.contains_key("end");
            Some(Inferred {
                dims: vec![x.len()],
                ints: whole.then(|| x.iter().map(|&d| d as i64).collect()),
            })
        },
        "ConstantOfShape" => |k| {
            Some(Inferred::dims(
                k.ints(0)?.iter().map(|&d| d.max(0) as usize).collect(),
            ))
        },
        "Flatten" => |k| {
            let x = k.dims(0)?;
            let a = k.ai("axis", 1);
            let a = usize::try_from(if a < 0 { a + x.len() as i64 } else { a }).ok()?;
            let all = x.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
            let outer = x[..a.min(x.len())]
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))?;
            Some(Inferred::dims(vec![outer, all / outer.max(1)]))
        },
        "Transpose" => |k| {
            let x = k.dims(0)?;
            let perm: Vec<usize> = match k.aints("perm") {
                Some(p) => p
                    .iter()
                    .map(|&v| usize::try_from(v).ok())
                    .collect::<Option<_>>()?,
                None => (0..x.len()).rev().collect(),
            };
            if perm.len() != x.len() {
                return None;
            }
            Some(Inferred::dims(
                perm.iter()
                    .map(|&p| x.get(p).copied())
                    .collect::<Option<_>>()?,
            ))
        },
        "Reshape" => |k| {
            let x = k.dims(0)?;
            let spec = k.ints(1)?;
            let allow_zero = k.ai("allowzero", 0) != 0;
            let mut out: Vec<usize> = Vec::with_capacity(spec.len());
            let mut infer = None;
            for (i, &d) in spec.iter().enumerate() {
                match d {
                    -1 if infer.is_none() => {
                        infer = Some(i);
                        out.push(1);
                    }
                    0 if !allow_zero => out.push(*x.get(i)?),
                    d => out.push(usize::try_from(d).ok()?),
                }
            }
            let all = x.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
            let known = out.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
            if let Some(i) = infer {
                out[i] = all / known.max(1);
            }
            Some(Inferred::dims(out))
        },
        "Expand" => |k| {
            let to: Vec<usize> = k
                .ints(1)?
                .iter()
                .map(|&d| usize::try_from(d).ok())
                .collect::<Option<_>>()?;
            Some(Inferred::dims(broadcast_shape(k.dims(0)?, &to).ok()?))
        },
        "Unsqueeze" | "Squeeze" => squeeze_rule,
        "Slice" if opset >= 10 => slice_rule,
        "Concat" => |k| {
            let mut acc = k.dims(0)?.to_vec();
            let a = k.ai("axis", if k.node.opset < 4 { 1 } else { 0 });
            let a = usize::try_from(if a < 0 { a + acc.len() as i64 } else { a }).ok()?;
            for i in 1..k.n_in() {
                let d = k.dims(i)?;
                if d.len() != acc.len() {
                    return None;
                }
                *acc.get_mut(a)? = acc.get(a)?.checked_add(*d.get(a)?)?;
            }
            let joined: Option<Vec<i64>> = (0..k.n_in())
                .map(|i| k.ints(i))
                .collect::<Option<Vec<_>>>()
                .map(|v| v.concat())
                .filter(|j| j.len() <= 64);
            Some(Inferred {
                dims: acc,
                ints: joined,
            })
        },
        _ => return None,
    };
    Some(Rules::shape(shape))
}

/// The shape rule of Squeeze and Unsqueeze (axes as an attribute or a constant input); a
/// constant vector's values carried through.
fn squeeze_rule(k: &Known) -> Option<Inferred> {
    let x = k.dims(0)?;
    let axes: Option<Vec<i64>> = match k.aints("axes") {
        Some(a) => Some(a.to_vec()),
        None if k.given(1) => Some(k.ints(1)?.to_vec()),
        None => None,
    };
    let dims = if k.node.op == "Unsqueeze" {
        let axes = axes?;
        let r = (x.len() + axes.len()) as i64;
        let mut at: Vec<usize> = axes
            .iter()
            .map(|&a| if a < 0 { a + r } else { a })
            .map(|a| usize::try_from(a).ok().filter(|&a| a < r as usize))
            .collect::<Option<_>>()?;
        at.sort_unstable();
        let mut out = x.to_vec();
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
    Some(Inferred {
        dims,
        ints: k.ints(0).map(<[i64]>::to_vec),
    })
}

/// The shape rule of Slice (opset 10 on: constant starts and ends, optional axes, steps of 1);
/// a constant vector's slice carried through.
fn slice_rule(k: &Known) -> Option<Inferred> {
    let x = k.dims(0)?;
    let (starts, ends) = (k.ints(1)?, k.ints(2)?);
    let axes: Vec<i64> = if k.given(3) {
        k.ints(3)?.to_vec()
    } else {
        (0..starts.len() as i64).collect()
    };
    let steps: Vec<i64> = if k.given(4) {
        k.ints(4)?.to_vec()
    } else {
        vec![1; starts.len()]
    };
    if starts.len() != ends.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return None;
    }
    let mut out = x.to_vec();
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
        let dim = i64::try_from(x[a]).ok()?;
        let clamp = |v: i64| (if v < 0 { v.saturating_add(dim) } else { v }).clamp(0, dim);
        let (b, e) = (clamp(starts[i]), clamp(ends[i]));
        out[a] = (e - b).max(0) as usize;
        ranges[a] = Some((b as usize, e.max(b) as usize));
    }
    let ints = match (k.ints(0), x.len()) {
        (Some(c), 1) => {
            let (b, e) = ranges[0].unwrap_or((0, c.len()));
            c.get(b..e).map(<[i64]>::to_vec)
        }
        _ => None,
    };
    Some(Inferred { dims: out, ints })
}

/// Shape and data-movement ops; `None` when `cx`'s op is not one of them.
/// The kernel of a shape op.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "Identity" => |cx| {
            Ok(vec![cx
                .value(0)
                .ok_or_else(|| crate::kerr!("missing input"))?
                .clone()])
        },
        "Constant" => |cx| one(constant(cx)?),
        "Shape" => |cx| {
            let x = cx.t(0)?;
            let r = x.rank() as i64;
            let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let (s, e) = (clampi(cx.ai("start", 0)), clampi(cx.ai("end", r)));
            let dims: Vec<i64> = if s < e {
                x.shape()[s..e].iter().map(|&d| d as i64).collect()
            } else {
                vec![]
            };
            one(i64_tensor(vec![dims.len()], dims)?)
        },
        "Size" => |cx| one(Tensor::scalar(cx.t(0)?.len() as i64)),
        "Reshape" => |cx| one(cx.t(0)?.clone().reshape(reshape_dims(cx)?)?),
        "Flatten" => |cx| one(cx.t(0)?.clone().reshape(flatten_dims(cx)?)?),
        "Squeeze" => |cx| one(cx.t(0)?.clone().reshape(squeeze_dims(cx)?)?),
        "Unsqueeze" => |cx| one(cx.t(0)?.clone().reshape(unsqueeze_dims(cx)?)?),
        "Transpose" => |cx| {
            let x = cx.t(0)?;
            let perm: Vec<usize> = match cx.aints("perm") {
                Some(p) => p
                    .iter()
                    .map(|&a| axis(a, x.rank()))
                    .collect::<Result<_>>()?,
                None => (0..x.rank()).rev().collect(),
            };
            if x.dtype() == DType::F32 && perm.len() == x.rank() {
                return one(crate::ops::fast::transpose_f32(x, &perm)?);
            }
            if let Some(t) = crate::ops::conv::transpose_channels_u8(x, &perm)? {
                return one(t);
            }
            one(transpose(x, &perm)?)
        },
        "Concat" => |cx| {
            let ts: Vec<&Tensor> = (0..cx.n_in()).map(|i| cx.t(i)).collect::<Result<_>>()?;
            one(concat(
                &ts,
                cx.ai("axis", if cx.opset() < 4 { 1 } else { 0 }),
            )?)
        },
        "Split" => split,
        "Slice" => |cx| one(slice(cx)?),
        "Expand" => |cx| one(expand(cx)?),
        "Tile" => |cx| one(tile(cx)?),
        "Pad" => |cx| one(pad(cx)?),
        "Range" => |cx| one(range(cx)?),
        "OneHot" => |cx| one(one_hot(cx)?),
        "ConstantOfShape" => |cx| one(constant_of_shape(cx)?),
        "Trilu" => |cx| one(trilu(cx)?),
        "DepthToSpace" => |cx| one(depth_space(cx, true)?),
        "SpaceToDepth" => |cx| one(depth_space(cx, false)?),
        "EyeLike" => |cx| one(eye_like(cx)?),
        "NonZero" => |cx| one(nonzero(cx)?),
        "Compress" => |cx| one(compress(cx)?),
        "ReverseSequence" => |cx| one(reverse_sequence(cx)?),
        "Dropout" => dropout,
        _ => return None,
    };
    Some(k)
}

/// Dropout: the input and an all-true mask in inference (or at ratio 0); in training, numpy's
/// draws for the given seed.
fn dropout(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let training = cx
        .opt(2)
        .map(|t| t.scalar_f64())
        .transpose()?
        .unwrap_or(0.0)
        != 0.0;
    let ratio = match cx.opt(1) {
        Some(t) => t.scalar_f64()?,
        None if cx.opset() < 12 => cx.af("ratio", 0.5) as f64,
        None => 0.5,
    };
    if !training || ratio == 0.0 {
        let mask = Tensor::from_vec(x.shape().to_vec(), vec![true; x.len()])?;
        return Ok(vec![Value::Tensor(x.clone()), Value::Tensor(mask)]);
    }
    // numpy's legacy RandomState(seed).uniform(0, 1, shape) >= ratio, as the reference draws it.
    let seed = cx
        .attr("seed")
        .map(|_| cx.ai("seed", 0))
        .ok_or_else(|| unsupported("training Dropout without a seed"))?;
    let mut rng = Mt19937::new(seed as u32);
    let mask: Vec<bool> = (0..x.len()).map(|_| rng.next_f64() >= ratio).collect();
    let scale = 1.0 / (1.0 - ratio);
    let y: Vec<f64> = x
        .to_f64_vec()?
        .iter()
        .zip(&mask)
        .map(|(&v, &m)| if m { v * scale } else { 0.0 })
        .collect();
    let y = crate::ops::elementwise::cast(&Tensor::from_vec(x.shape().to_vec(), y)?, x.dtype())?;
    Ok(vec![
        Value::Tensor(y),
        Value::Tensor(Tensor::from_vec(x.shape().to_vec(), mask)?),
    ])
}

/// The Mersenne Twister MT19937 seeded as numpy's legacy `RandomState(seed)` (`init_genrand`).
struct Mt19937 {
    mt: [u32; 624],
    i: usize,
}

impl Mt19937 {
    fn new(seed: u32) -> Mt19937 {
        let mut mt = [0u32; 624];
        mt[0] = seed;
        for i in 1..624 {
            mt[i] = 1_812_433_253u32
                .wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { mt, i: 624 }
    }

    fn next_u32(&mut self) -> u32 {
        if self.i >= 624 {
            for k in 0..624 {
                let y = (self.mt[k] & 0x8000_0000) | (self.mt[(k + 1) % 624] & 0x7fff_ffff);
                let mut v = self.mt[(k + 397) % 624] ^ (y >> 1);
                if y & 1 != 0 {
                    v ^= 0x9908_b0df;
                }
                self.mt[k] = v;
            }
            self.i = 0;
        }
        let mut y = self.mt[self.i];
        self.i += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// A double in [0, 1) from two draws, as numpy's `random_sample`.
    fn next_f64(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) / 9_007_199_254_740_992.0
    }
}
