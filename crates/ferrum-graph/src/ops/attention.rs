//! Attention (opsets 23-25): scaled dot-product attention with masks, causal and sliding-window
//! bias, grouped KV heads, past key/value caches and softcap. A reference loop in f64.

use ferrum_kernels::gemm::{gemm_with, isa, Mat};
use ferrum_kernels::pool;

use crate::ops::elementwise::{broadcast_offsets, broadcast_shape, bstrides, cast};
use crate::ops::nn::{matmul_f64, MatmulDims};
use crate::ops::shape::{concat_t, transpose_t};
use crate::ops::vecmath;
use crate::ops::Ctx;
use crate::tensor::{DType, Tensor, Value};
use crate::{kbail, Result};

/// `[B, S, H*D]` to `[B, H, S, D]`.
fn to_heads(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, s, hd) = (t.shape()[0], t.shape()[1], t.shape()[2]);
    if heads == 0 || hd % heads != 0 {
        kbail!("hidden size {hd} is not a multiple of {heads} heads");
    }
    transpose_t(
        &t.clone().reshape(vec![b, s, heads, hd / heads])?,
        &[0, 2, 1, 3],
    )
}

pub fn attention(cx: &Ctx) -> Result<Vec<Value>> {
    let (q0, k0, v0) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    let dt = q0.dtype();
    let three_d = q0.rank() == 3;
    let (q, mut k, mut v) = if three_d {
        let qh = cx.ai("q_num_heads", 0) as usize;
        let kh = cx.ai("kv_num_heads", 0) as usize;
        (to_heads(q0, qh)?, to_heads(k0, kh)?, to_heads(v0, kh)?)
    } else if q0.rank() == 4 {
        (q0.clone(), k0.clone(), v0.clone())
    } else {
        kbail!("Q must be 3-D or 4-D");
    };
    let past_len = match (cx.opt(4), cx.opt(5)) {
        (Some(pk), Some(pv)) => {
            k = concat_t(&[pk, &k], 2)?;
            v = concat_t(&[pv, &v], 2)?;
            pk.shape()[2]
        }
        _ => 0,
    };
    let nonpad = cx.opt(6).map(|t| t.to_i64_vec()).transpose()?;
    let (b, hq, sq, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (hk, skv, dv) = (k.shape()[1], k.shape()[2], v.shape()[3]);
    if hk == 0 || hq % hk != 0 || v.shape()[1] != hk {
        kbail!("{hq} query heads cannot share {hk} key/value heads");
    }
    let scale = match cx.attr("scale") {
        Some(_) => cx.af("scale", 1.0) as f64,
        None => 1.0 / (d as f64).sqrt(),
    };
    let sqrt_scale = scale.sqrt();
    let softcap = cx.af("softcap", 0.0) as f64;
    let causal = cx.ai("is_causal", 0) != 0;
    let mode = cx.ai("qk_matmul_output_mode", 0);
    let (left, right) = (
        cx.ai("left_window_size", -1),
        cx.ai("right_window_size", -1),
    );
    let (qv, kv, vv) = (q.to_f64_vec()?, k.to_f64_vec()?, v.to_f64_vec()?);
    let mask = cx.opt(3);
    let (mask_v, mask_st, mask_last, mask_bool) = match mask {
        Some(m) => {
            let mut shape = m.shape().to_vec();
            if shape.is_empty() {
                kbail!("attn_mask must have rank >= 1");
            }
            let last = *shape.last().unwrap_or(&0);
            let full = [b, hq, sq, skv];
            let off = 4usize.saturating_sub(shape.len());
            if shape.len() > 4
                || last > skv
                || shape[..shape.len() - 1]
                    .iter()
                    .enumerate()
                    .any(|(i, &d)| d != 1 && d != full[off + i])
            {
                kbail!("attn_mask {:?} does not broadcast to {full:?}", m.shape());
            }
            *shape.last_mut().expect("rank >= 1") = skv;
            let mut st = bstrides(m.shape(), &[b, hq, sq, skv]);
            // the real last-dim stride (the padded tail is handled separately)
            if last > 1 {
                st[3] = 1;
            }
            (m.to_f64_vec()?, st, last, m.dtype() == DType::Bool)
        }
        None => (vec![], vec![], 0, false),
    };
    let offset_of = |bi: usize| -> i64 {
        match (&nonpad, past_len) {
            (Some(np), 0) => np.get(bi).copied().unwrap_or(skv as i64) - sq as i64,
            _ => past_len as i64,
        }
    };
    let rep = hq / hk;
    let mut out = vec![0f64; b * hq * sq * dv];
    let mut qk_out = vec![0f64; b * hq * sq * skv];
    let mut scores = vec![0f64; skv];
    let mut bias = vec![0f64; skv];
    for bi in 0..b {
        let off = offset_of(bi);
        for h in 0..hq {
            let kh = h / rep;
            for i in 0..sq {
                for j in 0..skv {
                    let mut bv = 0.0;
                    if mask.is_some() {
                        let m = if j >= mask_last && mask_last != 1 {
                            if mask_bool {
                                0.0
                            } else {
                                f64::NEG_INFINITY
                            }
                        } else {
                            let jj = if mask_last == 1 { 0 } else { j };
                            mask_v[bi * mask_st[0]
                                + h * mask_st[1]
                                + i * mask_st[2]
                                + jj * mask_st[3]]
                        };
                        bv += if mask_bool {
                            if m != 0.0 {
                                0.0
                            } else {
                                f64::NEG_INFINITY
                            }
                        } else {
                            m
                        };
                    }
                    if causal && j as i64 > i as i64 + off {
                        bv = f64::NEG_INFINITY;
                    }
                    if left >= 0 || right >= 0 {
                        let diff = i as i64 + off - j as i64;
                        if (left >= 0 && diff > left) || (right >= 0 && -diff > right) {
                            bv = f64::NEG_INFINITY;
                        }
                    }
                    if let Some(np) = &nonpad {
                        if j as i64 >= np.get(bi).copied().unwrap_or(skv as i64) {
                            bv = f64::NEG_INFINITY;
                        }
                    }
                    bias[j] = bv;
                    let qrow = &qv[((bi * hq + h) * sq + i) * d..][..d];
                    let krow = &kv[((bi * hk + kh) * skv + j) * d..][..d];
                    let mut s: f64 = qrow
                        .iter()
                        .zip(krow)
                        .map(|(a, c)| (a * sqrt_scale) * (c * sqrt_scale))
                        .sum();
                    if softcap > 0.0 {
                        s = softcap * (s / softcap).tanh();
                    }
                    scores[j] = s;
                }
                let row = ((bi * hq + h) * sq + i) * skv;
                if mode == 0 || mode == 1 {
                    qk_out[row..row + skv].copy_from_slice(&scores);
                }
                for j in 0..skv {
                    scores[j] += bias[j];
                }
                if mode == 2 {
                    qk_out[row..row + skv].copy_from_slice(&scores);
                }
                let all_masked = bias.iter().all(|x| *x == f64::NEG_INFINITY);
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let m = if m == f64::NEG_INFINITY { 0.0 } else { m };
                let mut sum = 0.0;
                for s in scores.iter_mut() {
                    *s = (*s - m).exp();
                    sum += *s;
                }
                if sum == 0.0 {
                    sum = 1.0;
                }
                for s in scores.iter_mut() {
                    *s = if all_masked { 0.0 } else { *s / sum };
                }
                if mode == 3 {
                    qk_out[row..row + skv].copy_from_slice(&scores);
                }
                let o = &mut out[((bi * hq + h) * sq + i) * dv..][..dv];
                for (j, &p) in scores.iter().enumerate() {
                    if p == 0.0 {
                        continue;
                    }
                    let vrow = &vv[((bi * hk + kh) * skv + j) * dv..][..dv];
                    for (x, y) in o.iter_mut().zip(vrow) {
                        *x += p * y;
                    }
                }
            }
        }
    }
    let y = cast(&Tensor::from_vec(vec![b, hq, sq, dv], out)?, dt)?;
    let y = if three_d {
        transpose_t(&y, &[0, 2, 1, 3])?.reshape(vec![b, sq, hq * dv])?
    } else {
        y
    };
    let mut res = vec![Value::Tensor(y), Value::Tensor(k), Value::Tensor(v)];
    if cx.node.outputs.len() > 3 {
        res.push(Value::Tensor(cast(
            &Tensor::from_vec(vec![b, hq, sq, skv], qk_out)?,
            dt,
        )?));
    }
    Ok(res)
}

/// FlexAttention (ai.onnx.preview): attention whose scores and probabilities may be rewritten
/// by `score_mod` / `prob_mod` subgraphs, run on the whole [B, H, L, S] tensor.
pub fn flex_attention(cx: &Ctx) -> Result<Vec<Value>> {
    let (q, k, v) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        kbail!("FlexAttention needs rank-4 Q, K, V");
    }
    let (b, hq, l, e) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (hk, s, ev) = (k.shape()[1], k.shape()[2], v.shape()[3]);
    if hk == 0 || hq % hk != 0 {
        kbail!("{hq} query heads cannot share {hk} key/value heads");
    }
    let scale = match cx.attr("scale") {
        Some(_) => cx.af("scale", 1.0) as f64,
        None => 1.0 / (e as f64).sqrt(),
    };
    let sq = (scale as f32).sqrt() as f64;
    let compute = match cx.attr("softmax_precision") {
        Some(_) => DType::from_onnx(cx.ai("softmax_precision", 1) as i32).unwrap_or(DType::F32),
        None if q.dtype() == DType::F64 => DType::F64,
        None => DType::F32,
    };
    let (qv, kv, vv) = (q.to_f64_vec()?, k.to_f64_vec()?, v.to_f64_vec()?);
    let rep = hq / hk;
    let mut scores = vec![0f64; b * hq * l * s];
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..l {
                for j in 0..s {
                    let qr = &qv[((bi * hq + h) * l + i) * e..][..e];
                    let kr = &kv[((bi * hk + h / rep) * s + j) * e..][..e];
                    scores[((bi * hq + h) * l + i) * s + j] =
                        qr.iter().zip(kr).map(|(a, c)| (a * sq) * (c * sq)).sum();
                }
            }
        }
    }
    let shape = vec![b, hq, l, s];
    let mut st = cast(
        &cast(&Tensor::from_vec(shape.clone(), scores)?, q.dtype())?,
        compute,
    )?;
    let run_mod = |name: &str, t: Tensor| -> Result<Tensor> {
        match cx.attr(name) {
            Some(crate::ir::Attr::Graph(g)) => {
                let out = crate::exec::run_graph(g, vec![Some(Value::Tensor(t))], Some(cx.env))?;
                cast(
                    &out.into_iter()
                        .next()
                        .ok_or_else(|| crate::kerr!("{name} has no output"))?
                        .into_tensor()?,
                    compute,
                )
            }
            _ => Ok(t),
        }
    };
    st = run_mod("score_mod", st)?;
    let mut p = st.to_f64_vec()?;
    for row in p.chunks_mut(s) {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|x| (x - m).exp()).sum();
        row.iter_mut().for_each(|x| *x = (*x - m).exp() / sum);
    }
    let pt = run_mod("prob_mod", cast(&Tensor::from_vec(shape, p)?, compute)?)?;
    let p = pt.to_f64_vec()?;
    let mut out = vec![0f64; b * hq * l * ev];
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..l {
                let prow = &p[((bi * hq + h) * l + i) * s..][..s];
                let o = &mut out[((bi * hq + h) * l + i) * ev..][..ev];
                for (j, &w) in prow.iter().enumerate() {
                    let vr = &vv[((bi * hk + h / rep) * s + j) * ev..][..ev];
                    for (x, y) in o.iter_mut().zip(vr) {
                        *x += w * y;
                    }
                }
            }
        }
    }
    Ok(vec![Value::Tensor(cast(
        &Tensor::from_vec(vec![b, hq, l, ev], out)?,
        v.dtype(),
    )?)])
}

/// `com.ferrum.FusedAttention` (made by the attention pass from PyTorch's exported chain):
/// inputs Q `[.., sq, d]`, K `[.., d, sk]` (the first MatMul's B; `[.., sk, d]` with
/// `b_transposed = 1`), V `[.., sk, dv]`, then optional: an additive mask broadcasting to the
/// scores `[.., sq, sk]`, and scalar multipliers of Q and of K. Computes
/// `softmax((Q q_scale) (K k_scale) post + mask) V` along the last axis, where `post` is a
/// multiplication by `post_scale` (or a division, `post_div = 1`), and with `nan_to_zero = 1` a
/// NaN probability is 0 (`Where(IsNaN(p), 0, p)`). Batch dims broadcast as MatMul's do.
///
/// float32 with scalar scales runs [`attention_f32`]; anything else the f64 reference
/// [`attention_reference`], rounded once to the output type.
pub fn fused_attention(cx: &Ctx) -> Result<Tensor> {
    let spec = FusedSpec {
        post: match cx.af("post_scale", 1.0) {
            c if cx.ai("post_div", 0) != 0 => Some((c, true)),
            c if c != 1.0 => Some((c, false)),
            _ => None,
        },
        nan_to_zero: cx.ai("nan_to_zero", 0) != 0,
    };
    let (q, k, v) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    if k.rank() < 2 {
        kbail!(
            "FusedAttention: K must have rank 2 or more, got {:?}",
            k.shape()
        );
    }
    let k = if cx.ai("b_transposed", 0) != 0 {
        let r = k.rank();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        Operand::Swapped(k, perm)
    } else {
        Operand::Plain(k)
    };
    let (mask, qs, ks) = (cx.opt(3), cx.opt(4), cx.opt(5));
    // A scale of one element that does not raise the rank of what it multiplies.
    let f32_scalar = |s: Option<&Tensor>, of: &Tensor| {
        s.is_none_or(|s| s.dtype() == DType::F32 && s.len() == 1 && s.rank() <= of.rank())
    };
    let all_f32 = [Some(q), Some(k.tensor()), Some(v), mask]
        .iter()
        .flatten()
        .all(|t| t.dtype() == DType::F32);
    if all_f32 && f32_scalar(qs, q) && f32_scalar(ks, k.tensor()) && q.rank() >= 2 && v.rank() >= 2
    {
        let scalar = |s: Option<&Tensor>| -> Result<Option<f32>> {
            s.map(|s| Ok(s.as_slice::<f32>()?[0])).transpose()
        };
        if let Some(t) = attention_f32(q, &k, v, mask, (scalar(qs)?, scalar(ks)?), spec)? {
            return Ok(t);
        }
    }
    let k = k.materialize()?;
    attention_reference(q, &k, v, mask, (qs, ks), spec)
}

/// The chain's scalar parts: the scores' multiplier or divisor, and NaN handling.
#[derive(Clone, Copy, Debug)]
pub struct FusedSpec {
    /// `(c, true)`: scores divided by `c`; `(c, false)`: multiplied by `c`.
    pub post: Option<(f32, bool)>,
    pub nan_to_zero: bool,
}

/// K as given, or as its last two dims swapped (read through a transposed view).
enum Operand<'a> {
    Plain(&'a Tensor),
    Swapped(&'a Tensor, Vec<usize>),
}

impl Operand<'_> {
    fn tensor(&self) -> &Tensor {
        match self {
            Operand::Plain(t) | Operand::Swapped(t, _) => t,
        }
    }

    /// The `[.., d, sk]` operand's shape.
    fn shape(&self) -> Vec<usize> {
        match self {
            Operand::Plain(t) => t.shape().to_vec(),
            Operand::Swapped(t, perm) => perm.iter().map(|&p| t.shape()[p]).collect(),
        }
    }

    fn materialize(&self) -> Result<Tensor> {
        match self {
            Operand::Plain(t) => Ok((*t).clone()),
            Operand::Swapped(t, perm) => transpose_t(t, perm),
        }
    }
}

/// Query rows per task of [`attention_f32`]: the scores of one task (`ROWS x sk` floats) stay
/// in L2 between the two products.
const ROWS: usize = 64;

thread_local! {
    /// [`attention_f32`]'s per-thread buffers: scores, scaled Q rows, scaled K.
    static SCRATCH: std::cell::RefCell<[Vec<f32>; 3]> = Default::default();
}

/// [`fused_attention`] on float32 with scalar scales: per (batch, block of [`ROWS`] query rows)
/// one GEMM for the scores, the row pass of [`vecmath::attention_rows`] in place, one GEMM into
/// the output. Tasks split across the pool by batch entry (and by row block when there are too
/// few batch entries to keep every thread busy); the score matrix never exists whole. `None`
/// when the mask would broadcast the scores to a larger shape (left to the reference).
fn attention_f32(
    q: &Tensor,
    k: &Operand,
    v: &Tensor,
    mask: Option<&Tensor>,
    (q_scale, k_scale): (Option<f32>, Option<f32>),
    spec: FusedSpec,
) -> Result<Option<Tensor>> {
    let kshape = k.shape();
    let d1 = MatmulDims::of(q.shape(), &kshape)?;
    let (sq, d, sk) = (d1.m, d1.k, d1.n);
    let mut sshape = d1.batch.clone();
    sshape.extend([sq, sk]);
    let d2 = MatmulDims::of(&sshape, v.shape())?;
    let dv = d2.n;
    let batch = d2.batch.clone();
    let nb: usize = batch.iter().product();
    // Each operand's batch offset (in matrices) for every output batch entry.
    let pad = |b: &[usize]| {
        let mut p = vec![1; batch.len() - b.len().min(batch.len())];
        p.extend_from_slice(b);
        p
    };
    let qb = broadcast_offsets(&[&pad(&d1.abatch)], &batch).remove(0);
    let kb = broadcast_offsets(&[&pad(&d1.bbatch)], &batch).remove(0);
    let vb = broadcast_offsets(&[&pad(&d2.bbatch)], &batch).remove(0);
    // The mask: its batch offsets, and row / column strides (0 where it broadcasts).
    let mask = match mask {
        Some(m) => {
            let mut full = batch.clone();
            full.extend([sq, sk]);
            if m.rank() > full.len() || broadcast_shape(m.shape(), &full)? != full {
                return Ok(None);
            }
            let st = bstrides(m.shape(), &full);
            let r = full.len();
            let mut mb = m.shape().to_vec();
            let keep = mb.len().saturating_sub(2);
            mb.truncate(keep);
            let mrows = if m.rank() >= 2 {
                m.shape()[m.rank() - 2]
            } else {
                1
            };
            let mcols = if m.rank() >= 1 {
                m.shape()[m.rank() - 1]
            } else {
                1
            };
            let per = mrows * mcols;
            let offs = broadcast_offsets(&[&pad(&mb)], &batch).remove(0);
            Some((m.as_slice::<f32>()?, offs, per, st[r - 2], st[r - 1]))
        }
        None => None,
    };
    let (qv, kv, vv) = (
        q.as_slice::<f32>()?,
        k.tensor().as_slice::<f32>()?,
        v.as_slice::<f32>()?,
    );
    let swapped = matches!(k, Operand::Swapped(..));
    let mut out_shape = batch.clone();
    out_shape.extend([sq, dv]);
    if d == 0 {
        return Ok(None);
    }
    if nb == 0 || sq == 0 || dv == 0 || sk == 0 {
        return Tensor::from_vec(out_shape, vec![0f32; nb * sq * dv]).map(Some);
    }
    let run_block = |bi: usize, r0: usize, o: &mut [f32]| {
        let cnt = o.len() / dv;
        SCRATCH.with(|sc| {
            let mut sc = sc.borrow_mut();
            let [sbuf, qbuf, kbuf] = &mut *sc;
            // Q rows, scaled as `Mul(Q, q_scale)` would.
            let qrows = &qv[(qb[bi] * sq + r0) * d..][..cnt * d];
            let qm = match q_scale {
                Some(c) => {
                    qbuf.clear();
                    qbuf.extend(qrows.iter().map(|&x| x * c));
                    Mat::row_major(qbuf, d)
                }
                None => Mat::row_major(qrows, d),
            };
            let kmat = &kv[kb[bi] * d * sk..][..d * sk];
            let kdata: &[f32] = match k_scale {
                Some(c) => {
                    kbuf.clear();
                    kbuf.extend(kmat.iter().map(|&x| x * c));
                    kbuf
                }
                None => kmat,
            };
            // B = K^T: `[d, sk]` row-major, or the `[sk, d]` K read transposed.
            let km = if swapped {
                Mat::transposed(kdata, d)
            } else {
                Mat::row_major(kdata, sk)
            };
            sbuf.resize(cnt * sk, 0.0);
            let s = &mut sbuf[..cnt * sk];
            gemm_with(isa(), 1, cnt, sk, d, 1.0, qm, km, 0.0, s, sk);
            let m = mask
                .as_ref()
                .map(|(mv, offs, per, mrs, mcs)| (&mv[offs[bi] * per + r0 * mrs..], *mrs, *mcs));
            vecmath::attention_rows(s, sk, spec.post, m, spec.nan_to_zero);
            let vm = Mat::row_major(&vv[vb[bi] * sk * dv..][..sk * dv], dv);
            gemm_with(
                isa(),
                1,
                cnt,
                dv,
                sk,
                1.0,
                Mat::row_major(s, sk),
                vm,
                0.0,
                o,
                dv,
            );
        });
    };
    let mut out = vec![0f32; nb * sq * dv];
    let threads = pool::threads();
    if nb >= 2 * threads {
        // Enough batch entries (heads) for every thread: one task each, row blocks in turn.
        pool::parallel_chunks_mut(&mut out, sq * dv, |bi, o| {
            for (blk, ob) in o.chunks_mut(ROWS * dv).enumerate() {
                run_block(bi, blk * ROWS, ob);
            }
        });
    } else {
        // Few batch entries: the threads split each one's query rows.
        let rows = sq.div_ceil(2 * threads).clamp(1, ROWS);
        for (bi, ob) in out.chunks_mut(sq * dv).enumerate() {
            pool::parallel_chunks_mut(ob, rows * dv, |blk, o| run_block(bi, blk * rows, o));
        }
    }
    Tensor::from_vec(out_shape, out).map(Some)
}

/// [`fused_attention`] in f64 for any float type and any broadcasting scales: the plain
/// definition, each product summed in order, rounded once to Q's type at the end.
fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    (qs, ks): (Option<&Tensor>, Option<&Tensor>),
    spec: FusedSpec,
) -> Result<Tensor> {
    let scaled = |t: &Tensor, s: Option<&Tensor>| -> Result<(Vec<usize>, Vec<f64>)> {
        let tv = t.to_f64_vec()?;
        let Some(s) = s else {
            return Ok((t.shape().to_vec(), tv));
        };
        let sv = s.to_f64_vec()?;
        let shape = broadcast_shape(t.shape(), s.shape())?;
        let offs = broadcast_offsets(&[t.shape(), s.shape()], &shape);
        let v = offs[0]
            .iter()
            .zip(&offs[1])
            .map(|(&a, &b)| tv[a] * sv[b])
            .collect();
        Ok((shape, v))
    };
    let (qsh, qv) = scaled(q, qs)?;
    let (ksh, kv) = scaled(k, ks)?;
    let (ssh, mut s) = matmul_f64(&qv, &qsh, &kv, &ksh)?;
    let sk = *ssh.last().unwrap_or(&1);
    if let Some((c, div)) = spec.post {
        let c = c as f64;
        s.iter_mut()
            .for_each(|x| *x = if div { *x / c } else { *x * c });
    }
    let (ssh, mut s) = match mask {
        Some(m) => {
            let mv = m.to_f64_vec()?;
            let shape = broadcast_shape(&ssh, m.shape())?;
            let offs = broadcast_offsets(&[&ssh, m.shape()], &shape);
            let v = offs[0]
                .iter()
                .zip(&offs[1])
                .map(|(&a, &b)| s[a] + mv[b])
                .collect();
            (shape, v)
        }
        None => (ssh, s),
    };
    for row in s.chunks_mut(sk.max(1)) {
        let m = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        let e: Vec<f64> = row.iter().map(|&x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for (x, e) in row.iter_mut().zip(e) {
            let p = e / sum;
            *x = if spec.nan_to_zero && p.is_nan() {
                0.0
            } else {
                p
            };
        }
    }
    let (osh, o) = matmul_f64(&s, &ssh, &v.to_f64_vec()?, v.shape())?;
    crate::ops::nn::f64_tensor(osh, o, q.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_t(r: &mut rand::rngs::StdRng, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_vec(
            shape.to_vec(),
            (0..n).map(|_| r.gen_range(-1.0f32..1.0)).collect(),
        )
        .unwrap()
    }

    /// The float32 kernel against the f64 reference on fresh random shapes: batch dims that
    /// broadcast, K read transposed, query counts across several row blocks, masks of every
    /// broadcast form (fully masked rows with `nan_to_zero`), scales and a divided score, 1-3
    /// threads. Tolerance: |fast - reference| <= 1e-5 * (1 + d) for inputs in [-1, 1] (scores
    /// summed over d terms in f32; the probabilities sum to 1, so the output is no larger than
    /// V). NaN fails.
    #[test]
    fn the_float32_kernel_matches_the_f64_reference() {
        let seed: u64 = rand::random();
        eprintln!("seed {seed}");
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..60 {
            ferrum_kernels::pool::set_threads(Some(1 + case % 3));
            let (h, sq, sk) = (r.gen_range(1..5), r.gen_range(1..150), r.gen_range(1..90));
            let (d, dv) = (r.gen_range(1..40), r.gen_range(1..40));
            let two = r.gen_bool(0.5);
            let qb = if two { vec![2, h] } else { vec![h] };
            let kb = if r.gen_bool(0.3) {
                vec![1, h]
            } else {
                qb.clone()
            };
            let vb = if r.gen_bool(0.3) { vec![h] } else { qb.clone() };
            let shape = |b: &[usize], m: usize, n: usize| [b, &[m, n][..]].concat();
            let q = rand_t(&mut r, &shape(&qb, sq, d));
            let swapped = r.gen_bool(0.5);
            let k = if swapped {
                rand_t(&mut r, &shape(&kb, sk, d))
            } else {
                rand_t(&mut r, &shape(&kb, d, sk))
            };
            let v = rand_t(&mut r, &shape(&vb, sk, dv));
            let nan_to_zero = r.gen_bool(0.5);
            let lead = if two { vec![2, 1] } else { vec![1] };
            let mshape = match r.gen_range(0..5) {
                0 => None,
                1 => Some(vec![sq, sk]),
                2 => Some([&lead[..], &[1, sk]].concat()),
                3 => Some(vec![1]),
                _ => Some([&qb[..], &[sq, 1]].concat()),
            };
            let mask = mshape.map(|ms| {
                let n: usize = ms.iter().product();
                let vals = (0..n)
                    .map(|i| match r.gen_range(0..6) {
                        // Whole rows masked only where NaN becomes 0.
                        0 if nan_to_zero || i % 2 == 1 => f32::NEG_INFINITY,
                        1 => -30.0,
                        _ => r.gen_range(-2.0f32..2.0),
                    })
                    .collect();
                Tensor::from_vec(ms, vals).unwrap()
            });
            let scale =
                |r: &mut rand::rngs::StdRng| r.gen_bool(0.5).then(|| r.gen_range(0.1f32..2.0));
            let (qs, ks) = (scale(&mut r), scale(&mut r));
            let post = match r.gen_range(0..3) {
                0 => None,
                1 => Some(((d as f32).sqrt(), true)),
                _ => Some((0.3, false)),
            };
            let spec = FusedSpec { post, nan_to_zero };
            let kop = if swapped {
                let rk = k.rank();
                let mut perm: Vec<usize> = (0..rk).collect();
                perm.swap(rk - 2, rk - 1);
                Operand::Swapped(&k, perm)
            } else {
                Operand::Plain(&k)
            };
            let fast = attention_f32(&q, &kop, &v, mask.as_ref(), (qs, ks), spec)
                .unwrap()
                .expect("the mask fits the scores");
            let scalar = |s: Option<f32>| s.map(|c| Tensor::from_vec(vec![1], vec![c]).unwrap());
            let (qst, kst) = (scalar(qs), scalar(ks));
            let want = attention_reference(
                &q,
                &kop.materialize().unwrap(),
                &v,
                mask.as_ref(),
                (qst.as_ref(), kst.as_ref()),
                spec,
            )
            .unwrap();
            assert_eq!(fast.shape(), want.shape(), "case {case}");
            let (a, b) = (
                fast.as_slice::<f32>().unwrap(),
                want.as_slice::<f32>().unwrap(),
            );
            let tol = 1e-5 * (1.0 + d as f32);
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() <= tol || (x.is_nan() && y.is_nan() && !nan_to_zero),
                    "case {case} (q {:?} k {:?} v {:?} swapped {swapped} spec {spec:?}) element {i}: {x} vs {y}",
                    q.shape(),
                    k.shape(),
                    v.shape()
                );
            }
        }
        ferrum_kernels::pool::set_threads(None);
    }
}
