//! Elementwise ops: binary with multidirectional (numpy) broadcasting, variadic, unary, Cast.

use crate::ops::fast;
use crate::ops::vecmath::{Bin as FastBin, Unary};
use crate::ops::{
    one, per_output, same_shape, unsupported, with_slot, Ctx, Inferred, IntoKernel, Kernel, Known,
    Reuse, Rules,
};
use crate::tensor::{numel, DType, Data, Elem, Num, Tensor, Value};
use crate::{dispatch, kbail, Result};

/// The numpy broadcast of two shapes.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r {
            a[i + a.len() - r]
        } else {
            1
        };
        let db = if i + b.len() >= r {
            b[i + b.len() - r]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            kbail!("shapes {a:?} and {b:?} do not broadcast");
        };
    }
    Ok(out)
}

/// Strides of `shape` seen from the broadcast shape `out` (0 on broadcast dims).
pub fn bstrides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let mut s = vec![0; out.len()];
    let off = out.len() - shape.len();
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        s[i + off] = if shape[i] == 1 { 0 } else { acc };
        acc *= shape[i];
    }
    s
}

/// Offsets of `shape`'s elements seen from `out`, when `shape` broadcasts to exactly `out`
/// (unidirectional broadcasting: Gemm's C, normalization scales, attention masks).
pub fn broadcast_to(shape: &[usize], out: &[usize]) -> Result<Vec<usize>> {
    if shape.len() > out.len() || broadcast_shape(shape, out)? != out {
        kbail!("shape {shape:?} does not broadcast to {out:?}");
    }
    Ok(broadcast_offsets(&[shape], out).remove(0))
}

/// For each element of `out` (row-major), the offsets into inputs of the given shapes
/// (which must broadcast to `out`).
pub fn broadcast_offsets(shapes: &[&[usize]], out: &[usize]) -> Vec<Vec<usize>> {
    let n = numel(out).unwrap_or(0);
    let strides: Vec<Vec<usize>> = shapes.iter().map(|s| bstrides(s, out)).collect();
    let mut offs: Vec<Vec<usize>> = vec![Vec::with_capacity(n); shapes.len()];
    let mut idx = vec![0usize; out.len()];
    let mut cur = vec![0usize; shapes.len()];
    for _ in 0..n {
        for (k, o) in offs.iter_mut().enumerate() {
            o.push(cur[k]);
        }
        for d in (0..out.len()).rev() {
            idx[d] += 1;
            for (k, c) in cur.iter_mut().enumerate() {
                *c += strides[k][d];
            }
            if idx[d] < out[d] {
                break;
            }
            for (k, c) in cur.iter_mut().enumerate() {
                *c -= strides[k][d] * out[d];
            }
            idx[d] = 0;
        }
    }
    offs
}

/// Calls `f` with the offsets into each of `shapes` (each broadcast to `out`) of every
/// element of `out`, in row-major order: [`broadcast_offsets`] without the tables.
pub fn broadcast_walk<const K: usize>(
    shapes: [&[usize]; K],
    out: &[usize],
    mut f: impl FnMut([usize; K]) -> Result<()>,
) -> Result<()> {
    let n = numel(out).unwrap_or(0);
    let strides: [Vec<usize>; K] = shapes.map(|s| bstrides(s, out));
    let mut idx = vec![0usize; out.len()];
    let mut cur = [0usize; K];
    for _ in 0..n {
        f(cur)?;
        for d in (0..out.len()).rev() {
            idx[d] += 1;
            for (c, st) in cur.iter_mut().zip(&strides) {
                *c += st[d];
            }
            if idx[d] < out[d] {
                break;
            }
            for (c, st) in cur.iter_mut().zip(&strides) {
                *c -= st[d] * out[d];
            }
            idx[d] = 0;
        }
    }
    Ok(())
}

/// Applies `f` over the broadcast of `a` and `b`.
pub fn zip_with<A: Clone, B: Clone, O: Elem>(
    a: &[A],
    ash: &[usize],
    b: &[B],
    bsh: &[usize],
    mut f: impl FnMut(A, B) -> Result<O>,
) -> Result<(Vec<usize>, Vec<O>)> {
    let out = broadcast_shape(ash, bsh)?;
    let mut v = O::room(numel(&out).unwrap_or(0));
    if ash == bsh {
        for (x, y) in a.iter().zip(b) {
            v.push(f(x.clone(), y.clone())?);
        }
    } else if b.len() == 1 && out == ash {
        for x in a {
            v.push(f(x.clone(), b[0].clone())?);
        }
    } else {
        broadcast_walk([ash, bsh], &out, |[i, j]| {
            v.push(f(a[i].clone(), b[j].clone())?);
            Ok(())
        })?;
    }
    Ok((out, v))
}

#[derive(Clone, Copy, PartialEq)]
enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Mod,
    FMod,
    Max,
    Min,
    BitAnd,
    BitOr,
    BitXor,
    Shl,
    Shr,
    PRelu,
}

fn bin_num<T: Num>(op: Bin, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let x = a.as_slice::<T>()?;
    let bits = (T::DT.size() * 8) as u32;
    let signed = matches!(T::DT, DType::I8 | DType::I16 | DType::I32 | DType::I64);
    let f = |p: T, q: T| -> Result<T> {
        Ok(match op {
            Bin::Add => p.add(q),
            Bin::Sub => p.sub(q),
            Bin::Mul => p.mul(q),
            Bin::Div => p.div(q)?,
            Bin::Pow => unreachable!("Pow has its own exponent type"),
            Bin::Mod | Bin::FMod if T::IS_FLOAT => {
                let (p, q) = (p.to_f64(), q.to_f64());
                let mut r = p % q;
                if op == Bin::Mod && r != 0.0 && ((r < 0.0) != (q < 0.0)) {
                    r += q;
                }
                T::from_f64(r)
            }
            Bin::Mod | Bin::FMod => {
                let (p, q) = (p.to_i128(), q.to_i128());
                if q == 0 {
                    kbail!("integer modulo by zero");
                }
                let r = if op == Bin::Mod {
                    p.rem_euclid(q)
                } else {
                    p % q
                };
                let r = if op == Bin::Mod && r != 0 && q < 0 {
                    r + q
                } else {
                    r
                };
                T::from_i128(r)
            }
            Bin::Max => {
                if p.is_nan() || q.is_nan() {
                    if p.is_nan() {
                        p
                    } else {
                        q
                    }
                } else if q > p {
                    q
                } else {
                    p
                }
            }
            Bin::Min => {
                if p.is_nan() || q.is_nan() {
                    if p.is_nan() {
                        p
                    } else {
                        q
                    }
                } else if q < p {
                    q
                } else {
                    p
                }
            }
            Bin::BitAnd => T::from_i128(p.to_i128() & q.to_i128()),
            Bin::BitOr => T::from_i128(p.to_i128() | q.to_i128()),
            Bin::BitXor => T::from_i128(p.to_i128() ^ q.to_i128()),
            Bin::Shl | Bin::Shr => {
                let (v, s) = (p.to_i128(), q.to_i128());
                let r = if s < 0 || s >= bits as i128 {
                    if op == Bin::Shr && signed && v < 0 {
                        -1
                    } else {
                        0
                    }
                } else if op == Bin::Shl {
                    v << s
                } else {
                    v >> s
                };
                T::from_i128(r)
            }
            Bin::PRelu => {
                if p < T::zero() {
                    p.mul(q)
                } else {
                    p
                }
            }
        })
    };
    let (shape, v) = zip_with(x, a.shape(), b.as_slice::<T>()?, b.shape(), f)?;
    Tensor::from_vec(shape, v)
}

fn pow<T: Num>(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let e = b.to_f64_vec()?;
    let exp_int = b.dtype().is_int();
    let (shape, v) = zip_with(a.as_slice::<T>()?, a.shape(), &e, b.shape(), |p, q| {
        if T::IS_FLOAT {
            Ok(T::from_f64(p.to_f64().powf(q)))
        } else if exp_int && q >= 0.0 {
            let mut r: i128 = 1;
            let base = p.to_i128();
            for _ in 0..(q as u64).min(128) {
                r = r.wrapping_mul(base);
            }
            Ok(T::from_i128(r))
        } else {
            Ok(T::from_f64(p.to_f64().powf(q)))
        }
    })?;
    Tensor::from_vec(shape, v)
}

#[derive(Clone, Copy)]
enum Cmp {
    Eq,
    Lt,
    Gt,
    Le,
    Ge,
}

fn cmp<T: Elem + PartialOrd>(op: Cmp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (shape, v) = zip_with(
        a.as_slice::<T>()?,
        a.shape(),
        b.as_slice::<T>()?,
        b.shape(),
        |p, q| {
            Ok(match op {
                Cmp::Eq => p == q,
                Cmp::Lt => p < q,
                Cmp::Gt => p > q,
                Cmp::Le => p <= q,
                Cmp::Ge => p >= q,
            })
        },
    )?;
    Tensor::from_vec(shape, v)
}

fn same_type(a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        kbail!("input types differ: {} and {}", a.dtype(), b.dtype());
    }
    Ok(())
}

/// Legacy (opset < 7) `broadcast`/`axis` attributes: B aligned at `axis` of A.
fn legacy_b(cx: &Ctx, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if cx.opset() >= 7 || cx.ai("broadcast", 0) == 0 {
        return Ok(b.clone());
    }
    let Some(ax) = cx.attr("axis").map(|_| cx.ai("axis", 0)) else {
        return Ok(b.clone());
    };
    let ax = crate::ops::axis(ax, a.rank())?;
    let mut shape = vec![1; ax];
    shape.extend_from_slice(b.shape());
    while shape.len() < a.rank() {
        shape.push(1);
    }
    b.clone().reshape(shape)
}

fn binary(cx: &Ctx, op: Bin) -> Result<Tensor> {
    let a = cx.t(0)?;
    let mut b = legacy_b(cx, a, cx.t(1)?)?;
    if op == Bin::PRelu
        && cx.opset() < 7
        && b.rank() == 1
        && a.rank() > 2
        && b.len() == a.shape()[1]
    {
        // PRelu-6: a 1-D slope is per channel.
        let mut shape = vec![b.len()];
        shape.resize(a.rank() - 1, 1);
        b = b.reshape(shape)?;
    }
    if op == Bin::Pow {
        return dispatch!(a.dtype(), num_nobool, pow, a, &b);
    }
    same_type(a, &b)?;
    match (op, a.dtype()) {
        (Bin::BitAnd | Bin::BitOr | Bin::BitXor | Bin::Shl | Bin::Shr, dt) if !dt.is_int() => {
            Err(crate::Error::UnsupportedType(dt.to_string()))
        }
        _ => dispatch!(a.dtype(), num_nobool, bin_num, op, a, &b),
    }
}

fn logical(a: &Tensor, b: &Tensor, f: fn(bool, bool) -> bool) -> Result<Tensor> {
    let (shape, v) = zip_with(
        a.as_slice::<bool>()?,
        a.shape(),
        b.as_slice::<bool>()?,
        b.shape(),
        |p, q| Ok(f(p, q)),
    )?;
    Tensor::from_vec(shape, v)
}

fn variadic(cx: &Ctx, op: Bin) -> Result<Tensor> {
    let n = cx.n_in();
    if n == 0 {
        kbail!("needs at least one input");
    }
    let mut acc = cx.t(0)?.clone();
    for i in 1..n {
        let b = cx.t(i)?;
        same_type(&acc, b)?;
        acc = dispatch!(acc.dtype(), num_nobool, bin_num, op, &acc, b)?;
    }
    if op == Bin::Add && cx.node.op == "Mean" {
        fn div<T: Num>(t: &Tensor, n: usize) -> Result<Tensor> {
            let v = t
                .as_slice::<T>()?
                .iter()
                .map(|x| T::from_f64(x.to_f64() / n as f64))
                .collect();
            Tensor::from_vec(t.shape().to_vec(), v)
        }
        acc = dispatch!(acc.dtype(), num_nobool, div, &acc, n)?;
    }
    Ok(acc)
}

fn where_op(cx: &Ctx) -> Result<Tensor> {
    let c = cx.t(0)?;
    let (x, y) = (cx.t(1)?, cx.t(2)?);
    same_type(x, y)?;
    if x.dtype() == DType::F32 && c.dtype() == DType::Bool {
        return crate::ops::fast::where_f32(c, x, y);
    }
    fn go<T: Elem>(c: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let out = broadcast_shape(&broadcast_shape(c.shape(), x.shape())?, y.shape())?;
        let offs = broadcast_offsets(&[c.shape(), x.shape(), y.shape()], &out);
        let (cv, xv, yv) = (
            c.as_slice::<bool>()?,
            x.as_slice::<T>()?,
            y.as_slice::<T>()?,
        );
        let v = (0..offs[0].len())
            .map(|k| {
                if cv[offs[0][k]] {
                    xv[offs[1][k]].clone()
                } else {
                    yv[offs[2][k]].clone()
                }
            })
            .collect();
        Tensor::from_vec(out, v)
    }
    dispatch!(x.dtype(), all, go, c, x, y)
}

/// Maps every element through `f` in f64, for float tensors.
pub fn map_float(t: &Tensor, f: &dyn Fn(f64) -> f64) -> Result<Tensor> {
    fn go<T: Num>(t: &Tensor, f: &dyn Fn(f64) -> f64) -> Result<Tensor> {
        let v = t
            .as_slice::<T>()?
            .iter()
            .map(|x| T::from_f64(f(x.to_f64())))
            .collect();
        Tensor::from_vec(t.shape().to_vec(), v)
    }
    dispatch!(t.dtype(), float, go, t, f)
}

/// Maps every element through `f` in f64, for any numeric tensor (integers round-trip exactly
/// below 2^53).
fn map_num(t: &Tensor, f: &dyn Fn(f64) -> f64) -> Result<Tensor> {
    fn go<T: Num>(t: &Tensor, f: &dyn Fn(f64) -> f64) -> Result<Tensor> {
        let v = t
            .as_slice::<T>()?
            .iter()
            .map(|x| T::from_f64(f(x.to_f64())))
            .collect();
        Tensor::from_vec(t.shape().to_vec(), v)
    }
    dispatch!(t.dtype(), num_nobool, go, t, f)
}

fn map_pred(t: &Tensor, f: &dyn Fn(f64) -> bool) -> Result<Tensor> {
    fn go<T: Num>(t: &Tensor, f: &dyn Fn(f64) -> bool) -> Result<Tensor> {
        let v: Vec<bool> = t.as_slice::<T>()?.iter().map(|x| f(x.to_f64())).collect();
        Tensor::from_vec(t.shape().to_vec(), v)
    }
    dispatch!(t.dtype(), num, go, t, f)
}

/// The error function (Taylor series, then 1 past |x| = 5.9 where erf(x) rounds to 1 in f64).
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let ax = x.abs();
    if ax > 5.9 {
        return x.signum();
    }
    if ax > 2.5 {
        // Continued fraction for erfc (Lentz), accurate for larger |x|.
        let z = ax;
        let mut f = z;
        let mut c = z;
        let mut d = 0.0;
        for k in 1..200 {
            let an = k as f64 / 2.0;
            d = z + an * d;
            d = 1.0 / d;
            c = z + an / c;
            let delta = c * d;
            f *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        let erfc = (-z * z).exp() / (f * std::f64::consts::PI.sqrt());
        return x.signum() * (1.0 - erfc);
    }
    let mut sum = 0.0;
    let mut term = x;
    let x2 = x * x;
    let mut n = 0.0;
    loop {
        let t = term / (2.0 * n + 1.0);
        sum += t;
        if t.abs() < 1e-17 * sum.abs() {
            break;
        }
        n += 1.0;
        term *= -x2 / n;
        if n > 200.0 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// A float op applied to every element in f64 (rounded once to the input's type).
fn float_map(cx: &Ctx, f: &dyn Fn(f64) -> f64) -> Result<Vec<Value>> {
    one(map_float(cx.t(0)?, f)?)
}

/// The float32 fast path of `op` where it applies, else `reference`.
fn fast_or(cx: &Ctx, op: Unary, reference: fn(&Ctx) -> Result<Vec<Value>>) -> Result<Vec<Value>> {
    match fast::unary(cx, op)? {
        Some(t) => one(t),
        None => reference(cx),
    }
}

/// The kernel of a unary op without attributes (computed in f64).
fn unary(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "Exp" => |cx| float_map(cx, &f64::exp),
        "Log" => |cx| float_map(cx, &f64::ln),
        "Sqrt" => |cx| fast_or(cx, Unary::Sqrt, |cx| float_map(cx, &f64::sqrt)),
        "Reciprocal" => |cx| float_map(cx, &|x| 1.0 / x),
        "Sin" => |cx| float_map(cx, &f64::sin),
        "Cos" => |cx| float_map(cx, &f64::cos),
        "Tan" => |cx| float_map(cx, &f64::tan),
        "Asin" => |cx| float_map(cx, &f64::asin),
        "Acos" => |cx| float_map(cx, &f64::acos),
        "Atan" => |cx| float_map(cx, &f64::atan),
        "Sinh" => |cx| float_map(cx, &f64::sinh),
        "Cosh" => |cx| float_map(cx, &f64::cosh),
        "Asinh" => |cx| float_map(cx, &f64::asinh),
        "Acosh" => |cx| float_map(cx, &f64::acosh),
        "Atanh" => |cx| float_map(cx, &f64::atanh),
        "Tanh" => |cx| float_map(cx, &f64::tanh),
        "Sigmoid" => |cx| fast_or(cx, Unary::Sigmoid, sigmoid_f64),
        "Erf" => |cx| fast_or(cx, Unary::Erf, |cx| float_map(cx, &erf)),
        "Floor" => |cx| float_map(cx, &f64::floor),
        "Ceil" => |cx| float_map(cx, &f64::ceil),
        "Round" => |cx| float_map(cx, &f64::round_ties_even),
        "Softsign" => |cx| float_map(cx, &|x| x / (1.0 + x.abs())),
        "Softplus" => |cx| float_map(cx, &|x| if x > 30.0 { x } else { x.exp().ln_1p() }),
        "Mish" => |cx| {
            float_map(cx, &|x| {
                x * (if x > 30.0 { x } else { x.exp().ln_1p() }).tanh()
            })
        },
        "HardSwish" => |cx| {
            fast_or(cx, Unary::HardSwish, |cx| {
                float_map(cx, &|x| x * (x / 6.0 + 0.5).clamp(0.0, 1.0))
            })
        },
        _ => return unary_attr(op),
    };
    Some(k)
}

/// Attribute `alpha` (default `d`) in f64.
fn alpha(cx: &Ctx, d: f32) -> f64 {
    cx.af("alpha", d) as f64
}

/// The logistic function in f64 (other float types than float32).
fn sigmoid_f64(cx: &Ctx) -> Result<Vec<Value>> {
    float_map(cx, &|x| {
        if x >= 0.0 {
            1.0 / (1.0 + (-x).exp())
        } else {
            let e = x.exp();
            e / (1.0 + e)
        }
    })
}

/// HardSigmoid's float32 lane op, from the node's `alpha` and `beta`.
fn hard_sigmoid(cx: &Ctx) -> Unary {
    Unary::HardSigmoid(cx.af("alpha", 0.2), cx.af("beta", 0.5))
}

/// HardSigmoid in f64 (other float types than float32).
fn hard_sigmoid_f64(cx: &Ctx) -> Result<Vec<Value>> {
    let (a, b) = (alpha(cx, 0.2), cx.af("beta", 0.5) as f64);
    float_map(cx, &|v| (a * v + b).clamp(0.0, 1.0))
}

/// The kernel of a unary op with attributes, or on other types than floats.
fn unary_attr(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "Abs" => |cx| one(map_num_signed(cx.t(0)?, |v| v.abs())?),
        "Neg" => |cx| one(map_num_signed(cx.t(0)?, |v| -v)?),
        "Sign" => |cx| {
            one(map_num(cx.t(0)?, &|v| {
                if v > 0.0 {
                    1.0
                } else if v < 0.0 {
                    -1.0
                } else {
                    v
                }
            })?)
        },
        "Relu" => |cx| {
            fast_or(cx, Unary::Relu, |cx| {
                one(map_num(cx.t(0)?, &|v| if v > 0.0 { v } else { 0.0 })?)
            })
        },
        "Elu" => |cx| {
            let a = alpha(cx, 1.0);
            float_map(cx, &|v| if v > 0.0 { v } else { a * (v.exp() - 1.0) })
        },
        "Celu" => |cx| {
            let a = alpha(cx, 1.0);
            float_map(cx, &|v| v.max(0.0) + (a * ((v / a).exp() - 1.0)).min(0.0))
        },
        "Selu" => |cx| {
            let a = cx.af("alpha", 1.673_263_2) as f64;
            let g = cx.af("gamma", 1.050_701) as f64;
            float_map(cx, &|v| {
                if v > 0.0 {
                    g * v
                } else {
                    g * (a * v.exp() - a)
                }
            })
        },
        "LeakyRelu" => |cx| {
            let a = alpha(cx, 0.01);
            float_map(cx, &|v| if v >= 0.0 { v } else { a * v })
        },
        "ThresholdedRelu" => |cx| {
            let a = alpha(cx, 1.0);
            float_map(cx, &|v| if v > a { v } else { 0.0 })
        },
        "HardSigmoid" => |cx| fast_or(cx, hard_sigmoid(cx), hard_sigmoid_f64),
        "Shrink" => |cx| {
            let (b, l) = (cx.af("bias", 0.0) as f64, cx.af("lambd", 0.5) as f64);
            one(map_num(cx.t(0)?, &|v| {
                if v < -l {
                    v + b
                } else if v > l {
                    v - b
                } else {
                    0.0
                }
            })?)
        },
        "Swish" => |cx| {
            let a = alpha(cx, 1.0);
            float_map(cx, &|v| v / (1.0 + (-a * v).exp()))
        },
        "Gelu" => |cx| {
            if cx.astr("approximate", "none") == "tanh" {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                float_map(cx, &|v| {
                    0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())
                })
            } else {
                float_map(cx, &|v| 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2)))
            }
        },
        "Not" => |cx| {
            let x = cx.t(0)?;
            let v: Vec<bool> = x.as_slice::<bool>()?.iter().map(|b| !b).collect();
            one(Tensor::from_vec(x.shape().to_vec(), v)?)
        },
        "BitwiseNot" => |cx| {
            fn go<T: Num>(t: &Tensor) -> Result<Tensor> {
                let v = t
                    .as_slice::<T>()?
                    .iter()
                    .map(|x| T::from_i128(!x.to_i128()))
                    .collect();
                Tensor::from_vec(t.shape().to_vec(), v)
            }
            let x = cx.t(0)?;
            one(dispatch!(x.dtype(), int, go, x)?)
        },
        "IsNaN" => |cx| {
            let x = cx.t(0)?;
            if x.dtype() == DType::F32 {
                return one(crate::ops::fast::isnan_f32(x)?);
            }
            one(map_pred(x, &f64::is_nan)?)
        },
        "IsInf" => |cx| {
            let (neg, pos) = (
                cx.ai("detect_negative", 1) != 0,
                cx.ai("detect_positive", 1) != 0,
            );
            one(map_pred(cx.t(0)?, &|v| {
                v.is_infinite() && ((v > 0.0 && pos) || (v < 0.0 && neg))
            })?)
        },
        _ => return None,
    };
    Some(k)
}

/// Abs/Neg: exact for every integer width (no f64 round trip), f64 for floats.
fn map_num_signed(t: &Tensor, f: fn(f64) -> f64) -> Result<Tensor> {
    fn go<T: Num>(t: &Tensor, f: fn(f64) -> f64) -> Result<Tensor> {
        let neg = f(-1.0) == 1.0 && f(1.0) == -1.0;
        let v = t
            .as_slice::<T>()?
            .iter()
            .map(|x| {
                if T::IS_FLOAT {
                    T::from_f64(f(x.to_f64()))
                } else {
                    let i = x.to_i128();
                    T::from_i128(if neg { i.wrapping_neg() } else { i.abs() })
                }
            })
            .collect();
        Tensor::from_vec(t.shape().to_vec(), v)
    }
    dispatch!(t.dtype(), num_nobool, go, t, f)
}

/// Casts a tensor to `to` (saturating for float8 targets, E8M0 rounding up).
pub fn cast(t: &Tensor, to: DType) -> Result<Tensor> {
    cast_with(t, to, true, "up")
}

/// Casts a tensor to `to`; `saturate` and `round_mode` apply to float8 targets.
pub fn cast_with(t: &Tensor, to: DType, saturate: bool, round_mode: &str) -> Result<Tensor> {
    use crate::small;
    if t.dtype() == to {
        return Ok(t.clone());
    }
    if to.is_small() {
        let int_target = matches!(to, DType::I4 | DType::U4 | DType::I2 | DType::U2);
        let codes: Vec<u8> = if t.dtype().is_int() || t.dtype() == DType::Bool {
            let v = t.to_f64_vec()?;
            if int_target {
                t.to_i64_vec()
                    .unwrap_or_else(|_| v.iter().map(|&x| x as i64).collect())
                    .iter()
                    .map(|&x| small::encode_int(to, x as i128))
                    .collect()
            } else {
                v.iter()
                    .map(|&x| small::encode(to, x, saturate, round_mode))
                    .collect()
            }
        } else {
            let v = match t.data() {
                Data::Str(_) => cast(t, DType::F64)?.to_f64_vec()?,
                _ => t.to_f64_vec()?,
            };
            v.iter()
                .map(|&x| small::encode(to, x, saturate, round_mode))
                .collect()
        };
        return Tensor::new(t.shape().to_vec(), Data::Code(to, codes));
    }
    if t.dtype().is_small() {
        let v = t.to_f64_vec()?;
        return cast_with(
            &Tensor::from_vec(t.shape().to_vec(), v)?,
            to,
            saturate,
            round_mode,
        );
    }
    fn from_str<D: Num>(v: &[String]) -> Result<Data> {
        let out: Vec<D> = v
            .iter()
            .map(|s| {
                let s = s.trim();
                let f = match s.to_ascii_lowercase().as_str() {
                    "inf" | "+inf" | "infinity" | "+infinity" => f64::INFINITY,
                    "-inf" | "-infinity" => f64::NEG_INFINITY,
                    "nan" | "+nan" | "-nan" => f64::NAN,
                    _ => {
                        if !D::IS_FLOAT {
                            if let Ok(i) = s.parse::<i128>() {
                                return D::from_i128(i);
                            }
                        }
                        s.parse::<f64>().unwrap_or(f64::NAN)
                    }
                };
                D::from_f64(f)
            })
            .collect();
        Ok(D::into_data(out))
    }
    fn to_str<S: Num>(v: &[S]) -> Result<Data> {
        Ok(Data::Str(
            v.iter()
                .map(|x| {
                    if S::IS_FLOAT {
                        let f = x.to_f64();
                        if f.is_nan() {
                            "NaN".to_string()
                        } else if f.is_infinite() {
                            if f > 0.0 { "INF" } else { "-INF" }.to_string()
                        } else {
                            format!("{}", x.to_f64() as f32)
                        }
                    } else if S::DT == DType::Bool {
                        (x.to_i128() != 0).to_string()
                    } else {
                        x.to_i128().to_string()
                    }
                })
                .collect(),
        ))
    }
    fn num_to<S: Num, D: Num>(v: &[S]) -> Result<Data> {
        let out: Vec<D> = if S::IS_FLOAT {
            v.iter()
                .map(|x| {
                    let f = x.to_f64();
                    if !D::IS_FLOAT && D::DT != DType::Bool && f.is_finite() {
                        // Out-of-range floats keep the low bits of their integer value, as numpy does.
                        D::from_i128(f.trunc() as i128)
                    } else {
                        D::from_f64(f)
                    }
                })
                .collect()
        } else {
            v.iter().map(|x| D::from_i128(x.to_i128())).collect()
        };
        Ok(D::into_data(out))
    }
    fn src<S: Num>(t: &Tensor, to: DType) -> Result<Data> {
        let v = t.as_slice::<S>()?;
        macro_rules! go {
            ($($d:ident => $ty:ty),*) => {
                match to {
                    DType::Str => to_str::<S>(v),
                    $(DType::$d => num_to::<S, $ty>(v),)*
                    d => Err(crate::Error::UnsupportedType(d.to_string())),
                }
            };
        }
        go!(F32 => f32, F64 => f64, F16 => half::f16, BF16 => half::bf16, I8 => i8, I16 => i16,
            I32 => i32, I64 => i64, U8 => u8, U16 => u16, U32 => u32, U64 => u64, Bool => bool)
    }
    let data = if t.dtype() == DType::Str {
        let v = t.as_slice::<String>()?;
        dispatch!(to, num, from_str, v)?
    } else {
        dispatch!(t.dtype(), num, src, t, to)?
    };
    Tensor::new(t.shape().to_vec(), data)
}

fn cast_to(cx: &Ctx) -> Result<DType> {
    let code = match cx.attr("to") {
        Some(crate::ir::Attr::Str(s)) => {
            let name = String::from_utf8_lossy(s).to_uppercase();
            (0..29).find(|&c| DType::onnx_name(c) == name).unwrap_or(0)
        }
        _ => cx.ai("to", 0) as i32,
    };
    DType::from_onnx(code).ok_or_else(|| crate::Error::UnsupportedType(DType::onnx_name(code)))
}

fn clip(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let (lo, hi) = if cx.opset() < 11 {
        (
            cx.attr("min").map(|_| cx.af("min", 0.0) as f64),
            cx.attr("max").map(|_| cx.af("max", 0.0) as f64),
        )
    } else {
        (
            cx.opt(1).map(|t| t.scalar_f64()).transpose()?,
            cx.opt(2).map(|t| t.scalar_f64()).transpose()?,
        )
    };
    fn go<T: Num>(t: &Tensor, lo: Option<f64>, hi: Option<f64>) -> Result<Tensor> {
        let (lo, hi) = (lo.map(T::from_f64), hi.map(T::from_f64));
        let v = t
            .as_slice::<T>()?
            .iter()
            .map(|&x| {
                let mut y = x;
                if let Some(l) = lo {
                    if y < l {
                        y = l;
                    }
                }
                if let Some(h) = hi {
                    if y > h {
                        y = h;
                    }
                }
                y
            })
            .collect();
        Tensor::from_vec(t.shape().to_vec(), v)
    }
    dispatch!(x.dtype(), num_nobool, go, x, lo, hi)
}

/// A binary op, on the float32 fast path where it has one.
fn bin(cx: &Ctx, op: Bin) -> Result<Vec<Value>> {
    let fast_op = match op {
        Bin::Add => Some(FastBin::Add),
        Bin::Sub => Some(FastBin::Sub),
        Bin::Mul => Some(FastBin::Mul),
        Bin::Div => Some(FastBin::Div),
        _ => None,
    };
    if let Some(f) = fast_op {
        if let Some(t) = fast::arith(cx, f)? {
            return one(t);
        }
    }
    one(binary(cx, op)?)
}

/// A comparison of two tensors of one type.
fn compare(cx: &Ctx, op: Cmp) -> Result<Vec<Value>> {
    let (a, b) = (cx.t(0)?, cx.t(1)?);
    same_type(a, b)?;
    one(dispatch!(a.dtype(), all, cmp, op, a, b)?)
}

/// And, Or, Xor on booleans (legacy broadcasting before opset 7).
fn logic(cx: &Ctx, f: fn(bool, bool) -> bool) -> Result<Vec<Value>> {
    let a = cx.t(0)?;
    one(logical(a, &legacy_b(cx, a, cx.t(1)?)?, f)?)
}

/// The elementwise ops that can write their output into an operand's memory, on their float32
/// fast paths: Add, Sub, Mul and Div into either operand of the output's shape; Relu, Sqrt,
/// Erf, Sigmoid, HardSigmoid and HardSwish into their input. Elsewhere the kernel runs as usual.
pub fn reuse(op: &str) -> Option<Reuse> {
    let (at, kernel): (&'static [usize], IntoKernel) = match op {
        "Add" => (&[0, 1], |cx, at, slot| bin_into(cx, at, slot, FastBin::Add)),
        "Sub" => (&[0, 1], |cx, at, slot| bin_into(cx, at, slot, FastBin::Sub)),
        "Mul" => (&[0, 1], |cx, at, slot| bin_into(cx, at, slot, FastBin::Mul)),
        "Div" => (&[0, 1], |cx, at, slot| bin_into(cx, at, slot, FastBin::Div)),
        "Relu" => (&[0], |cx, at, slot| unary_into(cx, at, slot, Unary::Relu)),
        "Sqrt" => (&[0], |cx, at, slot| unary_into(cx, at, slot, Unary::Sqrt)),
        "Erf" => (&[0], |cx, at, slot| unary_into(cx, at, slot, Unary::Erf)),
        "Sigmoid" => (&[0], |cx, at, slot| {
            unary_into(cx, at, slot, Unary::Sigmoid)
        }),
        "HardSwish" => (&[0], |cx, at, slot| {
            unary_into(cx, at, slot, Unary::HardSwish)
        }),
        "HardSigmoid" => (&[0], |cx, at, slot| {
            unary_into(cx, at, slot, hard_sigmoid(cx))
        }),
        _ => return None,
    };
    Some(Reuse { at, kernel })
}

/// The node's own kernel, with the handed-over operand read from `slot`.
fn as_usual(cx: &Ctx, at: usize, slot: &mut Option<Tensor>) -> Result<Vec<Value>> {
    let k = kernel(&cx.node.op).ok_or_else(|| unsupported(format!("op {}", cx.node.op)))?;
    with_slot(cx, at, slot, k)
}

/// A binary op written into operand `at` ([`fast::arith_into`]), else as usual.
fn bin_into(cx: &Ctx, at: usize, slot: &mut Option<Tensor>, op: FastBin) -> Result<Vec<Value>> {
    if let Some(t) = slot.take() {
        match fast::arith_into(cx, at, t, op)? {
            Ok(out) => return one(out),
            Err(t) => *slot = Some(t),
        }
    }
    as_usual(cx, at, slot)
}

/// A unary op written into its input ([`fast::unary_into`]), else as usual.
fn unary_into(cx: &Ctx, at: usize, slot: &mut Option<Tensor>, op: Unary) -> Result<Vec<Value>> {
    if let Some(t) = slot.take() {
        match fast::unary_into(t, op)? {
            Ok(out) => return one(out),
            Err(t) => *slot = Some(t),
        }
    }
    as_usual(cx, at, slot)
}

/// The static rules of an elementwise op: the inputs broadcast together (input 0's shape for
/// the unary ops and casts); one operation per output element for the arithmetic ones.
pub fn rules(op: &str) -> Option<Rules> {
    let arithmetic = matches!(
        op,
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Mod" | "Max" | "Min" | "Sum" | "Mean" | "PRelu"
    );
    let broadcast = arithmetic
        || matches!(
            op,
            "BitwiseAnd"
                | "BitwiseOr"
                | "BitwiseXor"
                | "BitShift"
                | "Equal"
                | "Less"
                | "Greater"
                | "LessOrEqual"
                | "GreaterOrEqual"
                | "And"
                | "Or"
                | "Xor"
                | "Where"
        );
    if broadcast {
        return Some(if arithmetic {
            Rules::with(broadcast_all, per_output)
        } else {
            Rules::shape(broadcast_all)
        });
    }
    match op {
        "Cast" | "CastLike" | "BitCast" | "Not" | "BitwiseNot" | "IsNaN" | "IsInf" | "Sign"
        | "Abs" => Some(Rules::shape(same_shape)),
        _ if unary(op).is_some() || op == "Clip" => Some(Rules::with(same_shape, per_output)),
        _ => None,
    }
}

/// The shape rule of the broadcasting ops: every input's shape broadcast together.
fn broadcast_all(k: &Known) -> Option<Inferred> {
    let mut acc = k.dims(0)?.to_vec();
    for i in 1..k.n_in() {
        acc = broadcast_shape(&acc, k.dims(i)?).ok()?;
    }
    Some(Inferred::dims(acc))
}

/// The kernel of an elementwise op (binary, variadic, unary, Where, Clip, casts).
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "Add" => |cx| bin(cx, Bin::Add),
        "Sub" => |cx| bin(cx, Bin::Sub),
        "Mul" => |cx| bin(cx, Bin::Mul),
        "Div" => |cx| bin(cx, Bin::Div),
        "Pow" => |cx| bin(cx, Bin::Pow),
        "Mod" => |cx| {
            let fmod = cx.ai("fmod", 0) != 0;
            bin(cx, if fmod { Bin::FMod } else { Bin::Mod })
        },
        "BitwiseAnd" => |cx| bin(cx, Bin::BitAnd),
        "BitwiseOr" => |cx| bin(cx, Bin::BitOr),
        "BitwiseXor" => |cx| bin(cx, Bin::BitXor),
        "BitShift" => |cx| match cx.astr("direction", "").as_str() {
            "LEFT" => bin(cx, Bin::Shl),
            "RIGHT" => bin(cx, Bin::Shr),
            d => Err(unsupported(format!("BitShift direction '{d}'"))),
        },
        "PRelu" => |cx| bin(cx, Bin::PRelu),
        "Equal" => |cx| compare(cx, Cmp::Eq),
        "Less" => |cx| compare(cx, Cmp::Lt),
        "Greater" => |cx| compare(cx, Cmp::Gt),
        "LessOrEqual" => |cx| compare(cx, Cmp::Le),
        "GreaterOrEqual" => |cx| compare(cx, Cmp::Ge),
        "And" => |cx| logic(cx, |p, q| p && q),
        "Or" => |cx| logic(cx, |p, q| p || q),
        "Xor" => |cx| logic(cx, |p, q| p ^ q),
        "Max" => |cx| one(variadic(cx, Bin::Max)?),
        "Min" => |cx| one(variadic(cx, Bin::Min)?),
        "Sum" | "Mean" => |cx| one(variadic(cx, Bin::Add)?),
        "Where" => |cx| one(where_op(cx)?),
        "Clip" => |cx| match fast::clip(cx)? {
            Some(t) => one(t),
            None => one(clip(cx)?),
        },
        "Cast" => |cx| {
            one(cast_with(
                cx.t(0)?,
                cast_to(cx)?,
                cx.ai("saturate", 1) != 0,
                &cx.astr("round_mode", "up"),
            )?)
        },
        "BitCast" => |cx| {
            let x = cx.t(0)?;
            let to = cast_to(cx)?;
            if to.size() != x.dtype().size()
                || to.is_small()
                || to == DType::Str
                || x.dtype() == DType::Str
            {
                return Err(unsupported(format!("BitCast from {} to {to}", x.dtype())));
            }
            let mut p = crate::onnx::tensor_to_proto(x, "");
            p.data_type = to.onnx();
            one(crate::onnx::tensor_from_proto(&p, None)?)
        },
        "CastLike" => |cx| {
            one(cast_with(
                cx.t(0)?,
                cx.t(1)?.dtype(),
                cx.ai("saturate", 1) != 0,
                &cx.astr("round_mode", "up"),
            )?)
        },
        _ => return unary(op),
    };
    Some(k)
}
