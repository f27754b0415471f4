//! Neural-network ops: MatMul, Gemm, Conv, pooling, normalizations, Einsum, quantization.
//! Reference loops in f64; the result is rounded once to the output type.

use crate::ops::elementwise::{broadcast_offsets, broadcast_shape, cast};
use crate::ops::fused::Act;
use crate::ops::shape::strides;
use crate::ops::{axis, unsupported, Ctx};
use crate::ops::{fast, linear};
use crate::ops::{numel, one, per_input_5, same_shape, Inferred, Kernel, Rules};
use crate::passes::Role;
use crate::tensor::{DType, Tensor, Value};
use crate::{kbail, Result};

pub(super) fn f64_tensor(shape: Vec<usize>, v: Vec<f64>, dt: DType) -> Result<Tensor> {
    cast(&Tensor::from_vec(shape, v)?, dt)
}

/// The shapes of a numpy matmul: `[.., m, k] x [.., k, n]` after promoting 1-D operands, the
/// operands' batch dims, their broadcast, and the output shape (a promoted dim dropped again).
pub struct MatmulDims {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub abatch: Vec<usize>,
    pub bbatch: Vec<usize>,
    pub batch: Vec<usize>,
    pub out_shape: Vec<usize>,
}

impl MatmulDims {
    pub fn of(ash: &[usize], bsh: &[usize]) -> Result<MatmulDims> {
        if ash.is_empty() || bsh.is_empty() {
            kbail!("MatMul of a scalar");
        }
        let mut ash2 = ash.to_vec();
        let mut bsh2 = bsh.to_vec();
        if ash.len() == 1 {
            ash2.insert(0, 1);
        }
        if bsh.len() == 1 {
            bsh2.push(1);
        }
        let (m, k) = (ash2[ash2.len() - 2], ash2[ash2.len() - 1]);
        let (k2, n) = (bsh2[bsh2.len() - 2], bsh2[bsh2.len() - 1]);
        if k != k2 {
            kbail!("MatMul of {ash:?} and {bsh:?}: inner dims differ");
        }
        ash2.truncate(ash2.len() - 2);
        bsh2.truncate(bsh2.len() - 2);
        let batch = broadcast_shape(&ash2, &bsh2)?;
        let mut out_shape = batch.clone();
        if ash.len() > 1 {
            out_shape.push(m);
        }
        if bsh.len() > 1 {
            out_shape.push(n);
        }
        Ok(MatmulDims {
            m,
            k,
            n,
            abatch: ash2,
            bbatch: bsh2,
            batch,
            out_shape,
        })
    }
}

/// numpy matmul of f64 data: 1-D operands are promoted and the added dim dropped; batch dims
/// broadcast.
pub fn matmul_f64(
    a: &[f64],
    ash: &[usize],
    b: &[f64],
    bsh: &[usize],
) -> Result<(Vec<usize>, Vec<f64>)> {
    let MatmulDims {
        m,
        k,
        n,
        abatch,
        bbatch,
        batch,
        out_shape,
    } = MatmulDims::of(ash, bsh)?;
    let offs = broadcast_offsets(&[&abatch, &bbatch], &batch);
    let nb = offs[0].len();
    let mut out = vec![0f64; nb * m * n];
    for bi in 0..nb {
        let (ao, bo) = (offs[0][bi] * m * k, offs[1][bi] * k * n);
        let o = &mut out[bi * m * n..(bi + 1) * m * n];
        for i in 0..m {
            for p in 0..k {
                let av = a[ao + i * k + p];
                if av == 0.0 {
                    continue;
                }
                let brow = &b[bo + p * n..bo + (p + 1) * n];
                for (j, bv) in brow.iter().enumerate() {
                    o[i * n + j] += av * bv;
                }
            }
        }
    }
    // NaN/Inf in B with a zero in A: redo those rows exactly (0 * inf must be NaN).
    if b.iter().any(|x| !x.is_finite()) {
        for bi in 0..nb {
            let (ao, bo) = (offs[0][bi] * m * k, offs[1][bi] * k * n);
            for i in 0..m {
                for j in 0..n {
                    out[bi * m * n + i * n + j] =
                        (0..k).map(|p| a[ao + i * k + p] * b[bo + p * n + j]).sum();
                }
            }
        }
    }
    Ok((out_shape, out))
}

fn matmul(cx: &Ctx) -> Result<Tensor> {
    let (a, b) = (cx.t(0)?, cx.t(1)?);
    if fast::all_f32(&[a, b]) {
        return linear::matmul(a, b, cx.packed_b(1, Role::B));
    }
    let (shape, v) = matmul_f64(&a.to_f64_vec()?, a.shape(), &b.to_f64_vec()?, b.shape())?;
    f64_tensor(shape, v, a.dtype())
}

/// `(x - zero_point)` as f64, with the zero point broadcast per row (`axis` 0) or per column.
pub(super) fn minus_zp(x: &Tensor, zp: Option<&Tensor>, per_col: bool) -> Result<Vec<f64>> {
    let mut v = x.to_f64_vec()?;
    if let Some(z) = zp {
        let z = z.to_f64_vec()?;
        if z.len() == 1 {
            v.iter_mut().for_each(|e| *e -= z[0]);
        } else if per_col {
            let n = *x.shape().last().unwrap_or(&1);
            v.iter_mut().enumerate().for_each(|(i, e)| *e -= z[i % n]);
        } else {
            let r = x.rank();
            let (m, n) = (x.shape()[r - 2], x.shape()[r - 1]);
            v.iter_mut()
                .enumerate()
                .for_each(|(i, e)| *e -= z[(i / n) % m]);
        }
    }
    Ok(v)
}

pub(crate) fn gemm(cx: &Ctx) -> Result<Tensor> {
    gemm_act(cx, Act::Identity)
}

/// Gemm followed by `act` (FusedGemm): in the float32 product's epilogue where it can be.
pub(crate) fn gemm_act(cx: &Ctx, act: Act) -> Result<Tensor> {
    let (a, b) = (cx.t(0)?, cx.t(1)?);
    let (ta, tb) = (cx.ai("transA", 0) != 0, cx.ai("transB", 0) != 0);
    let (alpha, beta) = (cx.af("alpha", 1.0) as f64, cx.af("beta", 1.0) as f64);
    if a.rank() != 2 || b.rank() != 2 {
        kbail!("Gemm expects 2-D A and B");
    }
    let (m, k) = if ta {
        (a.shape()[1], a.shape()[0])
    } else {
        (a.shape()[0], a.shape()[1])
    };
    let (k2, n) = if tb {
        (b.shape()[1], b.shape()[0])
    } else {
        (b.shape()[0], b.shape()[1])
    };
    if k != k2 {
        kbail!("Gemm inner dims differ: {:?} {:?}", a.shape(), b.shape());
    }
    if fast::all_f32(&[a, b]) && cx.opt(2).is_none_or(|c| c.dtype() == DType::F32) {
        return linear::gemm_op(
            a,
            b,
            cx.opt(2),
            (ta, tb),
            alpha as f32,
            beta as f32,
            (m, n, k),
            cx.packed_b(1, if tb { Role::BTransposed } else { Role::B }),
            act,
        );
    }
    let (av, bv) = (a.to_f64_vec()?, b.to_f64_vec()?);
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0;
            for p in 0..k {
                let x = if ta { av[p * m + i] } else { av[i * k + p] };
                let y = if tb { bv[j * k + p] } else { bv[p * n + j] };
                s += x * y;
            }
            out[i * n + j] = alpha * s;
        }
    }
    if let Some(c) = cx.opt(2) {
        let cv = c.to_f64_vec()?;
        let offs = [crate::ops::elementwise::broadcast_to(c.shape(), &[m, n])?];
        for (o, &ci) in out.iter_mut().zip(&offs[0]) {
            *o += beta * cv[ci];
        }
    }
    let y = f64_tensor(vec![m, n], out, a.dtype())?;
    crate::ops::fused::Epi { z: None, act }.finish(y)
}

fn batch_norm(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let training = cx.ai("training_mode", 0) != 0;
    let eps = cx.af("epsilon", 1e-5) as f64;
    let (scale, b, mut mean, mut var) = (
        cx.t(1)?.to_f64_vec()?,
        cx.t(2)?.to_f64_vec()?,
        cx.t(3)?.to_f64_vec()?,
        cx.t(4)?.to_f64_vec()?,
    );
    let c = if x.rank() > 1 { x.shape()[1] } else { 1 };
    let inner: usize = x.shape().get(2..).map_or(1, |s| s.iter().product());
    // Inference on float32: one multiply and one add per element, the per-channel factor
    // `scale / sqrt(var + eps)` computed in f64 and rounded once.
    let params_f32 = (1..5).all(|i| {
        cx.opt(i)
            .is_some_and(|t| t.dtype() == DType::F32 && t.len() == c)
    });
    if !training && x.dtype() == DType::F32 && params_f32 && c > 0 && inner > 0 && !x.is_empty() {
        let a: Vec<f32> = (0..c)
            .map(|k| (scale[k] / (var[k] + eps).sqrt()) as f32)
            .collect();
        let m: Vec<f32> = mean.iter().map(|&v| v as f32).collect();
        let bb: Vec<f32> = b.iter().map(|&v| v as f32).collect();
        let y = crate::ops::fast::batch_norm_f32(x.as_slice::<f32>()?, c, inner, &m, &a, &bb);
        return Ok(vec![Value::Tensor(Tensor::from_vec(
            x.shape().to_vec(),
            y,
        )?)]);
    }
    let v = x.to_f64_vec()?;
    let mut running = None;
    if training {
        // Batch statistics over N and the spatial dims; running stats blend in with momentum.
        let momentum = cx.af("momentum", 0.9) as f64;
        let count = (v.len() / c.max(1)) as f64;
        let mut bm = vec![0f64; c];
        let mut bv = vec![0f64; c];
        for (i, &e) in v.iter().enumerate() {
            bm[(i / inner) % c] += e / count;
        }
        for (i, &e) in v.iter().enumerate() {
            let ch = (i / inner) % c;
            bv[ch] += (e - bm[ch]).powi(2) / count;
        }
        let rm: Vec<f64> = (0..c)
            .map(|k| mean[k] * momentum + bm[k] * (1.0 - momentum))
            .collect();
        let rv: Vec<f64> = (0..c)
            .map(|k| var[k] * momentum + bv[k] * (1.0 - momentum))
            .collect();
        running = Some((rm, rv));
        mean = bm;
        var = bv;
    }
    let out = v
        .iter()
        .enumerate()
        .map(|(i, &e)| {
            let ch = (i / inner) % c;
            (e - mean[ch]) / (var[ch] + eps).sqrt() * scale[ch] + b[ch]
        })
        .collect();
    let mut res = vec![Value::Tensor(f64_tensor(
        x.shape().to_vec(),
        out,
        x.dtype(),
    )?)];
    if let Some((rm, rv)) = running {
        res.push(Value::Tensor(f64_tensor(vec![c], rm, x.dtype())?));
        res.push(Value::Tensor(f64_tensor(vec![c], rv, x.dtype())?));
    }
    Ok(res)
}

/// Normalizes each of `outer` groups of `inner` consecutive elements; returns (y, mean, inv std).
fn normalize(v: &[f64], inner: usize, eps: f64, rms: bool) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let outer = v.len().checked_div(inner).unwrap_or(0);
    let mut y = vec![0f64; v.len()];
    let (mut means, mut invs) = (Vec::with_capacity(outer), Vec::with_capacity(outer));
    for o in 0..outer {
        let s = &v[o * inner..(o + 1) * inner];
        let mean = if rms {
            0.0
        } else {
            s.iter().sum::<f64>() / inner as f64
        };
        let var = s.iter().map(|&e| (e - mean) * (e - mean)).sum::<f64>() / inner as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for (j, &e) in s.iter().enumerate() {
            y[o * inner + j] = (e - mean) * inv;
        }
        means.push(mean);
        invs.push(inv);
    }
    (y, means, invs)
}

fn layer_norm(cx: &Ctx, rms: bool) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let a = axis(cx.ai("axis", -1), x.rank())?;
    let eps = cx.af("epsilon", 1e-5) as f64;
    let inner: usize = x.shape()[a..].iter().product();
    let tail_is = |t: &Tensor| t.dtype() == DType::F32 && t.shape() == &x.shape()[a..];
    if !rms
        && x.dtype() == DType::F32
        && cx.node.outputs.len() == 1
        && tail_is(cx.t(1)?)
        && cx.opt(2).is_none_or(tail_is)
    {
        let y = fast::layer_norm_f32(x, inner, eps, cx.t(1)?, cx.opt(2))?;
        return Ok(vec![Value::Tensor(y)]);
    }
    let xv = x.to_f64_vec()?;
    let (mut y, means, invs) = normalize(&xv, inner, eps, rms);
    let tail = &x.shape()[a..];
    let apply = |y: &mut Vec<f64>, t: &Tensor, add: bool| -> Result<()> {
        let tv = t.to_f64_vec()?;
        let offs = [crate::ops::elementwise::broadcast_to(t.shape(), tail)?];
        for (i, e) in y.iter_mut().enumerate() {
            let s = tv[offs[0][i % inner]];
            if add {
                *e += s;
            } else {
                *e *= s;
            }
        }
        Ok(())
    };
    apply(&mut y, cx.t(1)?, false)?;
    if let Some(b) = cx.opt(2) {
        apply(&mut y, b, true)?;
    }
    let mut stat_shape = x.shape().to_vec();
    for d in stat_shape[a..].iter_mut() {
        *d = 1;
    }
    let stash = if cx.ai("stash_type", 1) == 1 {
        DType::F32
    } else {
        x.dtype()
    };
    let mut out = vec![Value::Tensor(f64_tensor(x.shape().to_vec(), y, x.dtype())?)];
    if !rms {
        out.push(Value::Tensor(f64_tensor(stat_shape.clone(), means, stash)?));
        out.push(Value::Tensor(f64_tensor(stat_shape, invs, stash)?));
    }
    Ok(out)
}

fn instance_norm(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let eps = cx.af("epsilon", 1e-5) as f64;
    let (scale, b) = (cx.t(1)?.to_f64_vec()?, cx.t(2)?.to_f64_vec()?);
    let c = x.shape()[1];
    let inner: usize = x.shape()[2..].iter().product();
    let (mut y, _, _) = normalize(&x.to_f64_vec()?, inner, eps, false);
    for (i, e) in y.iter_mut().enumerate() {
        let ch = (i / inner) % c;
        *e = *e * scale[ch] + b[ch];
    }
    f64_tensor(x.shape().to_vec(), y, x.dtype())
}

fn group_norm(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let eps = cx.af("epsilon", 1e-5) as f64;
    let groups = cx.ai("num_groups", 1).max(1) as usize;
    let (scale, b) = (cx.t(1)?.to_f64_vec()?, cx.t(2)?.to_f64_vec()?);
    let c = x.shape()[1];
    let sp: usize = x.shape()[2..].iter().product();
    let inner = c / groups * sp;
    let (mut y, _, _) = normalize(&x.to_f64_vec()?, inner, eps, false);
    for (i, e) in y.iter_mut().enumerate() {
        let ch = (i / sp) % c;
        let si = if scale.len() == c {
            ch
        } else {
            ch / (c / groups)
        };
        *e = *e * scale[si] + b[si];
    }
    f64_tensor(x.shape().to_vec(), y, x.dtype())
}

fn lrn(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let size = cx.ai("size", 1) as usize;
    let (alpha, beta, bias) = (
        cx.af("alpha", 1e-4) as f64,
        cx.af("beta", 0.75) as f64,
        cx.af("bias", 1.0) as f64,
    );
    let c = x.shape()[1];
    let inner: usize = x.shape()[2..].iter().product();
    let v = x.to_f64_vec()?;
    let lo = (size - 1) / 2;
    let hi = (size - 1).div_ceil(2);
    let out = (0..v.len())
        .map(|i| {
            let ch = (i / inner) % c;
            let base = i - ch * inner;
            let s: f64 = (ch.saturating_sub(lo)..=(ch + hi).min(c - 1))
                .map(|j| v[base + j * inner].powi(2))
                .sum();
            v[i] / (bias + alpha / size as f64 * s).powf(beta)
        })
        .collect();
    f64_tensor(x.shape().to_vec(), out, x.dtype())
}

fn lp_norm(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let a = axis(cx.ai("axis", -1), x.rank())?;
    let p = cx.ai("p", 2);
    let d = x.shape()[a];
    let inner: usize = x.shape()[a + 1..].iter().product();
    let v = x.to_f64_vec()?;
    let mut out = v.clone();
    for o in 0..v.len() / (d * inner).max(1) {
        for i in 0..inner {
            let at = |k: usize| (o * d + k) * inner + i;
            let norm = if p == 1 {
                (0..d).map(|k| v[at(k)].abs()).sum::<f64>()
            } else {
                (0..d).map(|k| v[at(k)].powi(2)).sum::<f64>().sqrt()
            };
            for k in 0..d {
                out[at(k)] = if norm == 0.0 { 0.0 } else { v[at(k)] / norm };
            }
        }
    }
    f64_tensor(x.shape().to_vec(), out, x.dtype())
}

fn mvn(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let axes: Vec<usize> = cx
        .aints("axes")
        .unwrap_or(vec![0, 2, 3])
        .iter()
        .map(|&a| axis(a, x.rank()))
        .collect::<Result<_>>()?;
    let v = x.to_f64_vec()?;
    let st = strides(x.shape());
    let key = |i: usize| -> usize {
        (0..x.rank())
            .filter(|d| !axes.contains(d))
            .map(|d| (i / st[d]) % x.shape()[d] * st[d])
            .sum()
    };
    let mut sum = std::collections::HashMap::new();
    for (i, &e) in v.iter().enumerate() {
        let s = sum.entry(key(i)).or_insert((0.0, 0.0, 0usize));
        s.0 += e;
        s.1 += e * e;
        s.2 += 1;
    }
    let out = v
        .iter()
        .enumerate()
        .map(|(i, &e)| {
            let (s, s2, n) = sum[&key(i)];
            let mean = s / n as f64;
            let var = s2 / n as f64 - mean * mean;
            (e - mean) / (var.max(0.0).sqrt() + 1e-9)
        })
        .collect();
    f64_tensor(x.shape().to_vec(), out, x.dtype())
}

fn einsum(cx: &Ctx) -> Result<Tensor> {
    let eq: String = cx
        .astr("equation", "")
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let ts: Vec<&Tensor> = (0..cx.n_in()).map(|i| cx.t(i)).collect::<Result<_>>()?;
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != ts.len() {
        kbail!(
            "equation '{eq}' has {} operands, {} given",
            terms.len(),
            ts.len()
        );
    }
    // Expand "..." into upper-case-free placeholder letters per operand.
    let mut ell_rank = 0;
    for (t, x) in terms.iter().zip(&ts) {
        let letters = t.len() - if t.contains("...") { 3 } else { 0 };
        if !t.is_ascii() || letters > x.rank() || (!t.contains("...") && letters != x.rank()) {
            kbail!("term '{t}' does not fit an operand of rank {}", x.rank());
        }
        if t.contains("...") {
            ell_rank = ell_rank.max(x.rank() - letters);
        }
    }
    let ell: Vec<char> = (0..ell_rank)
        .map(|i| char::from_u32(0x100 + i as u32).unwrap_or('?'))
        .collect();
    let expand = |t: &str, rank: usize| -> Vec<char> {
        if let Some(p) = t.find("...") {
            let n = rank + 3 - t.len();
            let mut v: Vec<char> = t[..p].chars().collect();
            v.extend(&ell[ell_rank - n..]);
            v.extend(t[p + 3..].chars());
            v
        } else {
            t.chars().collect()
        }
    };
    let labels: Vec<Vec<char>> = terms
        .iter()
        .zip(&ts)
        .map(|(t, x)| expand(t, x.rank()))
        .collect();
    let mut size: std::collections::BTreeMap<char, usize> = Default::default();
    for (l, x) in labels.iter().zip(&ts) {
        if l.len() != x.rank() {
            kbail!(
                "operand of rank {} for '{}'",
                x.rank(),
                l.iter().collect::<String>()
            );
        }
        for (c, &d) in l.iter().zip(x.shape()) {
            let e = size.entry(*c).or_insert(d);
            if *e != d {
                if *e == 1 {
                    *e = d;
                } else if d != 1 {
                    kbail!("label {c} has sizes {e} and {d}");
                }
            }
        }
    }
    let out: Vec<char> = match rhs {
        Some(r) => {
            if r.contains("...") {
                let mut v: Vec<char> = r[..r.find("...").unwrap_or(0)].chars().collect();
                v.extend(&ell);
                v.extend(r[r.find("...").unwrap_or(0) + 3..].chars());
                v
            } else {
                r.chars().collect()
            }
        }
        None => {
            let mut once: Vec<char> = size
                .keys()
                .filter(|c| {
                    **c < '\u{100}' && labels.iter().flatten().filter(|x| x == c).count() == 1
                })
                .copied()
                .collect();
            once.sort();
            let mut v = ell.clone();
            v.extend(once);
            v
        }
    };
    if let Some(c) = out.iter().find(|c| !size.contains_key(c)) {
        kbail!("output label '{c}' appears in no input");
    }
    let all: Vec<char> = size.keys().copied().collect();
    let dims: Vec<usize> = all.iter().map(|c| size[c]).collect();
    let pos = |c: &char| all.iter().position(|x| x == c).unwrap_or(0);
    let vals: Vec<Vec<f64>> = ts.iter().map(|t| t.to_f64_vec()).collect::<Result<_>>()?;
    let op_st: Vec<Vec<(usize, usize)>> = labels
        .iter()
        .zip(&ts)
        .map(|(l, x)| {
            let st = strides(x.shape());
            l.iter()
                .enumerate()
                .map(|(k, c)| (pos(c), if x.shape()[k] == 1 { 0 } else { st[k] }))
                .collect()
        })
        .collect();
    let oshape: Vec<usize> = out.iter().map(|c| size[c]).collect();
    let ost = strides(&oshape);
    let opos: Vec<usize> = out.iter().map(pos).collect();
    let mut res = vec![0f64; oshape.iter().product()];
    let total: usize = dims.iter().product();
    if total > crate::onnx::MAX_ELEMENTS {
        kbail!("einsum too large");
    }
    let ast = strides(&dims);
    for i in 0..total {
        let idx: Vec<usize> = (0..dims.len()).map(|d| (i / ast[d]) % dims[d]).collect();
        let mut p = 1.0;
        for (k, st) in op_st.iter().enumerate() {
            let off: usize = st.iter().map(|&(a, s)| idx[a] * s).sum();
            p *= vals[k][off];
        }
        let o: usize = opos.iter().zip(&ost).map(|(&a, &s)| idx[a] * s).sum();
        res[o] += p;
    }
    f64_tensor(oshape, res, ts[0].dtype())
}

/// NegativeLogLikelihoodLoss over log-probabilities `x` [N, C, d...]; SoftmaxCrossEntropyLoss
/// first takes the log-softmax over C (and returns it as a second output).
fn nll_loss(cx: &Ctx, softmax: bool) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let target = cx.t(1)?.to_i64_vec()?;
    let weight = cx.opt(2).map(|w| w.to_f64_vec()).transpose()?;
    let reduction = cx.astr("reduction", "mean");
    let ignore = cx.attr("ignore_index").map(|_| cx.ai("ignore_index", 0));
    if x.rank() < 2 {
        kbail!("input must have rank >= 2");
    }
    let (n, c) = (x.shape()[0], x.shape()[1]);
    let d: usize = x.shape()[2..].iter().product();
    let mut xv = x.to_f64_vec()?;
    if softmax {
        for b in 0..n {
            for j in 0..d {
                let at = |k: usize| (b * c + k) * d + j;
                let m = (0..c).map(|k| xv[at(k)]).fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = (0..c).map(|k| (xv[at(k)] - m).exp()).sum();
                for k in 0..c {
                    xv[at(k)] = xv[at(k)] - m - s.ln();
                }
            }
        }
    }
    if target.len() != n * d {
        kbail!("target has {} elements, expected {}", target.len(), n * d);
    }
    let mut loss = vec![0f64; n * d];
    let mut wsum = 0.0;
    for (i, &t) in target.iter().enumerate() {
        let (b, j) = (i / d, i % d);
        if Some(t) == ignore {
            continue;
        }
        if t < 0 || t as usize >= c {
            kbail!("target {t} out of range for {c} classes");
        }
        let w = weight.as_ref().map_or(1.0, |w| w[t as usize]);
        loss[i] = -xv[(b * c + t as usize) * d + j] * w;
        wsum += w;
    }
    // The reference divides by the total weight, except with neither weights nor an explicit
    // ignore_index of -1... where it takes a plain mean over every element.
    let mean_plain = weight.is_none() && ignore == Some(-1);
    let out = match reduction.as_str() {
        "none" => f64_tensor(cx.t(1)?.shape().to_vec(), loss, x.dtype())?,
        "sum" => f64_tensor(vec![], vec![loss.iter().sum()], x.dtype())?,
        "mean" => {
            let total: f64 = loss.iter().sum();
            let denom = if mean_plain { loss.len() as f64 } else { wsum };
            f64_tensor(vec![], vec![total / denom], x.dtype())?
        }
        r => return Err(unsupported(format!("reduction '{r}'"))),
    };
    let mut res = vec![Value::Tensor(out)];
    if softmax && cx.node.outputs.len() > 1 {
        res.push(Value::Tensor(f64_tensor(
            x.shape().to_vec(),
            xv,
            x.dtype(),
        )?));
    }
    Ok(res)
}

/// The static rules of MatMul (also a fused one's): numpy's matmul shapes, a multiply-add per
/// output and inner element.
pub const MATMUL_RULES: Rules = Rules::with(
    |k| {
        let (a, b) = (k.dims(0)?, k.dims(1)?);
        if a.len() < 2 || b.len() < 2 {
            return None;
        }
        let mut dims = broadcast_shape(&a[..a.len() - 2], &b[..b.len() - 2]).ok()?;
        dims.push(a[a.len() - 2]);
        dims.push(b[b.len() - 1]);
        Some(Inferred::dims(dims))
    },
    |k, out| Some(2.0 * numel(out) * *k.dims(0)?.last()? as f64),
);

/// The static rules of Gemm (also a fused one's): `[M, N]` from A and B as transposed.
pub const GEMM_RULES: Rules = Rules::with(
    |k| {
        let (&[a0, a1], &[b0, b1]) = (k.dims(0)?, k.dims(1)?) else {
            return None;
        };
        let m = if k.ai("transA", 0) != 0 { a1 } else { a0 };
        let n = if k.ai("transB", 0) != 0 { b0 } else { b1 };
        Some(Inferred::dims(vec![m, n]))
    },
    |k, out| {
        let a = k.dims(0)?;
        let inner = if k.ai("transA", 0) != 0 {
            a.first()?
        } else {
            a.get(1)?
        };
        Some(2.0 * numel(out) * *inner as f64)
    },
);

/// The static rules of the products and normalizations.
pub fn rules(op: &str) -> Option<Rules> {
    Some(match op {
        "MatMul" => MATMUL_RULES,
        "Gemm" => GEMM_RULES,
        "BatchNormalization"
        | "LayerNormalization"
        | "InstanceNormalization"
        | "RMSNormalization"
        | "GroupNormalization" => Rules::with(same_shape, per_input_5),
        "LRN" | "LpNormalization" | "MeanVarianceNormalization" => Rules::shape(same_shape),
        _ => return None,
    })
}

/// Neural-network ops; `None` when `cx`'s op is not one of them.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "MatMul" => |cx| one(matmul(cx)?),
        "Gemm" => |cx| one(gemm(cx)?),
        "BatchNormalization" => batch_norm,
        "InstanceNormalization" => |cx| one(instance_norm(cx)?),
        "LayerNormalization" => |cx| layer_norm(cx, false),
        "RMSNormalization" => |cx| layer_norm(cx, true),
        "GroupNormalization" => |cx| one(group_norm(cx)?),
        "LRN" => |cx| one(lrn(cx)?),
        "LpNormalization" => |cx| one(lp_norm(cx)?),
        "MeanVarianceNormalization" => |cx| one(mvn(cx)?),
        "Einsum" => |cx| one(einsum(cx)?),
        "NegativeLogLikelihoodLoss" => |cx| nll_loss(cx, false),
        "SoftmaxCrossEntropyLoss" => |cx| nll_loss(cx, true),
        _ => return None,
    };
    Some(k)
}
