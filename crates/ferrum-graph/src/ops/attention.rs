//! Attention (opsets 23-25): scaled dot-product attention with masks, causal and sliding-window
//! bias, grouped KV heads, past key/value caches and softcap. A reference loop in f64.

use crate::ops::elementwise::{bstrides, cast};
use crate::ops::shape::{concat_t, transpose_t};
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
