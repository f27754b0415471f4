//! Reductions and ops along one axis: Reduce*, ArgMax/ArgMin, Softmax family, TopK, CumSum.

use crate::ops::shape::{strided_offsets, strides};
use crate::ops::{axis, Ctx};
use crate::ops::{one, per_input_5, same_shape, Kernel, Rules};
use crate::tensor::{DType, Num, Tensor, Value};
use crate::{dispatch, kbail, Result};

#[derive(Clone, Copy, PartialEq)]
enum Red {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    L1,
    L2,
    LogSum,
    LogSumExp,
    SumSquare,
}

/// For each input element, the offset of the output element it reduces into; and the output
/// shape with kept (size-1) reduced dims.
fn reduce_map(shape: &[usize], axes: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let out: Vec<usize> = shape
        .iter()
        .enumerate()
        .map(|(d, &s)| if axes.contains(&d) { 1 } else { s })
        .collect();
    let ost = strides(&out);
    // The output offset moves by the output's stride along a kept dim and stays along a
    // reduced one (no division per element).
    let step: Vec<isize> = (0..shape.len())
        .map(|d| {
            if axes.contains(&d) {
                0
            } else {
                ost[d] as isize
            }
        })
        .collect();
    (strided_offsets(shape, &step, 0), out)
}

fn reduce_t<T: Num>(x: &Tensor, axes: &[usize], op: Red) -> Result<(Vec<usize>, Vec<T>)> {
    let v = x.as_slice::<T>()?;
    let (map, out) = reduce_map(x.shape(), axes);
    let n_out: usize = out.iter().product();
    let count = x.len().checked_div(n_out).unwrap_or(0);
    let res: Vec<T> = match op {
        Red::Max | Red::Min => {
            let mut acc = vec![
                if op == Red::Max {
                    T::lowest()
                } else {
                    T::highest()
                };
                n_out
            ];
            for (i, &o) in map.iter().enumerate() {
                let (a, b) = (acc[o], v[i]);
                if b.is_nan() || (op == Red::Max && b > a) || (op == Red::Min && b < a) {
                    acc[o] = b;
                }
            }
            acc
        }
        _ if !T::IS_FLOAT && matches!(op, Red::Sum | Red::Prod | Red::SumSquare | Red::L1) => {
            let mut acc = vec![if op == Red::Prod { T::one() } else { T::zero() }; n_out];
            for (i, &o) in map.iter().enumerate() {
                let x = v[i];
                acc[o] = match op {
                    Red::Sum => acc[o].add(x),
                    Red::Prod => acc[o].mul(x),
                    Red::SumSquare => acc[o].add(x.mul(x)),
                    _ => acc[o].add(if x < T::zero() { T::zero().sub(x) } else { x }),
                };
            }
            acc
        }
        _ => {
            let mut mx = vec![f64::NEG_INFINITY; n_out];
            if op == Red::LogSumExp {
                for (i, &o) in map.iter().enumerate() {
                    mx[o] = mx[o].max(v[i].to_f64());
                }
                for m in mx.iter_mut() {
                    if !m.is_finite() {
                        *m = 0.0;
                    }
                }
            }
            let mut acc = vec![if op == Red::Prod { 1.0 } else { 0.0 }; n_out];
            for (i, &o) in map.iter().enumerate() {
                let x = v[i].to_f64();
                match op {
                    Red::Prod => acc[o] *= x,
                    Red::L1 => acc[o] += x.abs(),
                    Red::L2 | Red::SumSquare => acc[o] += x * x,
                    Red::LogSumExp => acc[o] += (x - mx[o]).exp(),
                    _ => acc[o] += x,
                }
            }
            acc.iter()
                .zip(&mx)
                .map(|(&a, &m)| {
                    T::from_f64(match op {
                        Red::Mean => a / count as f64,
                        Red::L2 => a.sqrt(),
                        Red::LogSum => a.ln(),
                        Red::LogSumExp => a.ln() + m,
                        _ => a,
                    })
                })
                .collect()
        }
    };
    Ok((out, res))
}

fn reduce(cx: &Ctx, op: Red) -> Result<Tensor> {
    let x = cx.t(0)?;
    let since = if op == Red::Sum { 13 } else { 18 };
    let axes = if cx.opset() < since {
        cx.aints("axes")
    } else {
        cx.opt(1).map(|t| t.to_i64_vec()).transpose()?
    };
    let keep = cx.ai("keepdims", 1) != 0;
    let axes: Vec<usize> = match axes {
        Some(a) if !a.is_empty() => a
            .iter()
            .map(|&a| axis(a, x.rank()))
            .collect::<Result<_>>()?,
        _ if cx.ai("noop_with_empty_axes", 0) != 0 => {
            // identity, except for the ops that transform each element
            return match op {
                Red::LogSum | Red::SumSquare | Red::L1 | Red::L2 => reduce_each(x, op),
                _ => Ok(x.clone()),
            };
        }
        _ => (0..x.rank()).collect(),
    };
    fn go<T: Num>(x: &Tensor, axes: &[usize], op: Red) -> Result<Tensor> {
        let (shape, v) = reduce_t::<T>(x, axes, op)?;
        Tensor::from_vec(shape, v)
    }
    let t = dispatch!(x.dtype(), num, go, x, &axes, op)?;
    if keep {
        Ok(t)
    } else {
        let shape = (0..x.rank())
            .filter(|d| !axes.contains(d))
            .map(|d| t.shape()[d])
            .collect();
        t.reshape(shape)
    }
}

fn reduce_each(x: &Tensor, op: Red) -> Result<Tensor> {
    crate::ops::elementwise::map_float(x, &move |v| match op {
        Red::LogSum => v.ln(),
        Red::SumSquare => v * v,
        _ => v.abs(),
    })
}

fn arg(cx: &Ctx, max: bool) -> Result<Tensor> {
    let x = cx.t(0)?;
    let a = axis(cx.ai("axis", 0), x.rank())?;
    let keep = cx.ai("keepdims", 1) != 0;
    let last = cx.ai("select_last_index", 0) != 0;
    let v = x.to_f64_vec()?;
    let d = x.shape()[a];
    let inner: usize = x.shape()[a + 1..].iter().product();
    let outer: usize = x.shape()[..a].iter().product();
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let mut best = 0;
            for k in 1..d {
                let (c, b) = (v[(o * d + k) * inner + i], v[(o * d + best) * inner + i]);
                let better = if max {
                    c > b || (last && c == b)
                } else {
                    c < b || (last && c == b)
                };
                if better {
                    best = k;
                }
            }
            out.push(best as i64);
        }
    }
    let mut shape = x.shape().to_vec();
    if keep {
        shape[a] = 1;
    } else {
        shape.remove(a);
    }
    Tensor::from_vec(shape, out)
}

#[derive(Clone, Copy, PartialEq)]
enum Soft {
    Softmax,
    LogSoftmax,
    Hardmax,
}

fn softmax(cx: &Ctx, kind: Soft) -> Result<Tensor> {
    let x = cx.t(0)?;
    let legacy = cx.opset() < 13;
    let a = axis(cx.ai("axis", if legacy { 1 } else { -1 }), x.rank())?;
    if kind == Soft::Softmax && x.dtype() == DType::F32 && (legacy || a + 1 == x.rank()) {
        // One row per softmax: the last axis, or (legacy) everything from `axis` on.
        let rows: usize = x.shape()[..a].iter().product();
        return crate::ops::fast::softmax_last_f32(x, x.len() / rows.max(1));
    }
    let (outer, d, inner) = if legacy {
        (
            x.shape()[..a].iter().product::<usize>(),
            x.shape()[a..].iter().product::<usize>(),
            1,
        )
    } else {
        (
            x.shape()[..a].iter().product(),
            x.shape()[a],
            x.shape()[a + 1..].iter().product(),
        )
    };
    fn go<T: Num>(x: &Tensor, outer: usize, d: usize, inner: usize, kind: Soft) -> Result<Tensor> {
        let v = x.as_slice::<T>()?;
        let mut out = vec![T::zero(); v.len()];
        let mut buf = vec![0f64; d];
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| (o * d + k) * inner + i;
                let mut m = f64::NEG_INFINITY;
                let mut arg = 0;
                for k in 0..d {
                    buf[k] = v[at(k)].to_f64();
                    if buf[k] > m {
                        m = buf[k];
                        arg = k;
                    }
                }
                match kind {
                    Soft::Hardmax => out[at(arg)] = T::one(),
                    Soft::Softmax => {
                        // Each exponential once, summed in order.
                        buf.iter_mut().for_each(|b| *b = (*b - m).exp());
                        let s: f64 = buf.iter().sum();
                        for k in 0..d {
                            out[at(k)] = T::from_f64(buf[k] / s);
                        }
                    }
                    Soft::LogSoftmax => {
                        let s: f64 = buf.iter().map(|&b| (b - m).exp()).sum();
                        for k in 0..d {
                            out[at(k)] = T::from_f64(buf[k] - m - s.ln());
                        }
                    }
                }
            }
        }
        Tensor::from_vec(x.shape().to_vec(), out)
    }
    dispatch!(x.dtype(), float, go, x, outer, d, inner, kind)
}

fn topk(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let k = if cx.opset() < 10 {
        cx.ai("k", 0)
    } else {
        cx.t(1)?.scalar_i64()?
    };
    let a = axis(cx.ai("axis", -1), x.rank())?;
    let largest = cx.ai("largest", 1) != 0;
    let d = x.shape()[a];
    if k < 0 || k as usize > d {
        kbail!("k = {k} for an axis of {d}");
    }
    let k = k as usize;
    let inner: usize = x.shape()[a + 1..].iter().product();
    let outer: usize = x.shape()[..a].iter().product();
    let v = x.to_f64_vec()?;
    let mut offs = Vec::with_capacity(outer * k * inner);
    let mut idx = vec![0i64; outer * k * inner];
    for o in 0..outer {
        for i in 0..inner {
            let mut order: Vec<usize> = (0..d).collect();
            let val = |j: usize| v[(o * d + j) * inner + i];
            order.sort_by(|&p, &q| {
                let (a, b) = (val(p), val(q));
                let c = if largest {
                    b.partial_cmp(&a)
                } else {
                    a.partial_cmp(&b)
                };
                c.unwrap_or(std::cmp::Ordering::Equal).then(p.cmp(&q))
            });
            for (r, &j) in order[..k].iter().enumerate() {
                idx[(o * k + r) * inner + i] = j as i64;
            }
        }
    }
    for o in 0..outer {
        for r in 0..k {
            for i in 0..inner {
                offs.push((o * d + idx[(o * k + r) * inner + i] as usize) * inner + i);
            }
        }
    }
    let mut shape = x.shape().to_vec();
    shape[a] = k;
    let vals = crate::ops::shape::take(x, &offs, shape.clone())?;
    Ok(vec![
        Value::Tensor(vals),
        Value::Tensor(Tensor::from_vec(shape, idx)?),
    ])
}

fn cum(cx: &Ctx, prod: bool) -> Result<Tensor> {
    let x = cx.t(0)?;
    let a = axis(cx.t(1)?.scalar_i64()?, x.rank())?;
    let excl = cx.ai("exclusive", 0) != 0;
    let rev = cx.ai("reverse", 0) != 0;
    fn go<T: Num>(x: &Tensor, a: usize, excl: bool, rev: bool, prod: bool) -> Result<Tensor> {
        let v = x.as_slice::<T>()?;
        let d = x.shape()[a];
        let inner: usize = x.shape()[a + 1..].iter().product();
        let outer: usize = x.shape()[..a].iter().product();
        let mut out = vec![T::zero(); v.len()];
        for o in 0..outer {
            for i in 0..inner {
                let mut acc = if prod { T::one() } else { T::zero() };
                for s in 0..d {
                    let k = if rev { d - 1 - s } else { s };
                    let at = (o * d + k) * inner + i;
                    if excl {
                        out[at] = acc;
                    }
                    acc = if prod { acc.mul(v[at]) } else { acc.add(v[at]) };
                    if !excl {
                        out[at] = acc;
                    }
                }
            }
        }
        Tensor::from_vec(x.shape().to_vec(), out)
    }
    dispatch!(x.dtype(), num_nobool, go, x, a, excl, rev, prod)
}

/// The static rules of the softmaxes (input 0's shape, about 5 operations an element).
pub fn rules(op: &str) -> Option<Rules> {
    matches!(op, "Softmax" | "LogSoftmax" | "Hardmax")
        .then_some(Rules::with(same_shape, per_input_5))
}

/// Reductions and axis ops; `None` when `cx`'s op is not one of them.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "ReduceSum" => |cx| one(reduce(cx, Red::Sum)?),
        "ReduceMean" => |cx| one(reduce(cx, Red::Mean)?),
        "ReduceMax" => |cx| one(reduce(cx, Red::Max)?),
        "ReduceMin" => |cx| one(reduce(cx, Red::Min)?),
        "ReduceProd" => |cx| one(reduce(cx, Red::Prod)?),
        "ReduceL1" => |cx| one(reduce(cx, Red::L1)?),
        "ReduceL2" => |cx| one(reduce(cx, Red::L2)?),
        "ReduceLogSum" => |cx| one(reduce(cx, Red::LogSum)?),
        "ReduceLogSumExp" => |cx| one(reduce(cx, Red::LogSumExp)?),
        "ReduceSumSquare" => |cx| one(reduce(cx, Red::SumSquare)?),
        "ArgMax" => |cx| one(arg(cx, true)?),
        "ArgMin" => |cx| one(arg(cx, false)?),
        "Softmax" => |cx| one(softmax(cx, Soft::Softmax)?),
        "LogSoftmax" => |cx| one(softmax(cx, Soft::LogSoftmax)?),
        "Hardmax" => |cx| one(softmax(cx, Soft::Hardmax)?),
        // With `sorted` 0 any order is allowed; ours is sorted.
        "TopK" => topk,
        "CumSum" => |cx| one(cum(cx, false)?),
        "CumProd" => |cx| one(cum(cx, true)?),
        _ => return None,
    };
    Some(k)
}
