//! Ops of recent sequence models: RotaryEmbedding (23), LinearAttention and
//! CausalConvWithState (27).

use crate::ops::elementwise::cast;
use crate::ops::{one, Kernel};
use crate::ops::{unsupported, Ctx};
use crate::tensor::{Tensor, Value};
use crate::{kbail, Result};

fn rotary(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let cos = cx.t(1)?.to_f64_vec()?;
    let sin = cx.t(2)?.to_f64_vec()?;
    let pos = cx.opt(3).map(|t| t.to_i64_vec()).transpose()?;
    let interleaved = cx.ai("interleaved", 0) != 0;
    // View as [B, S, H, D] with strides into x's layout.
    let (b, s, h, d, four) = match x.rank() {
        4 => (x.shape()[0], x.shape()[2], x.shape()[1], x.shape()[3], true),
        3 => {
            let h = cx.ai("num_heads", 0) as usize;
            if h == 0 || x.shape()[2] % h != 0 {
                kbail!("num_heads must divide the hidden size");
            }
            (x.shape()[0], x.shape()[1], h, x.shape()[2] / h, false)
        }
        _ => kbail!("input must be 3-D or 4-D"),
    };
    let rd = match cx.ai("rotary_embedding_dim", 0) as usize {
        0 => d,
        r => r,
    };
    let half = rd / 2;
    let xv = x.to_f64_vec()?;
    let mut out = xv.clone();
    let at = |bi: usize, si: usize, hi: usize| {
        if four {
            ((bi * h + hi) * s + si) * d
        } else {
            ((bi * s + si) * h + hi) * d
        }
    };
    for bi in 0..b {
        for si in 0..s {
            let row = match &pos {
                Some(p) => p[bi * s + si] as usize,
                None => bi * s + si,
            };
            if (row + 1) * half > cos.len() || (row + 1) * half > sin.len() {
                kbail!("position {row} is beyond the cos/sin caches");
            }
            let (c, sn) = (&cos[row * half..][..half], &sin[row * half..][..half]);
            for hi in 0..h {
                let o = at(bi, si, hi);
                for j in 0..half {
                    let (i1, i2) = if interleaved {
                        (o + 2 * j, o + 2 * j + 1)
                    } else {
                        (o + j, o + half + j)
                    };
                    let (x1, x2) = (xv[i1], xv[i2]);
                    out[i1] = c[j] * x1 - sn[j] * x2;
                    out[i2] = sn[j] * x1 + c[j] * x2;
                }
            }
        }
    }
    cast(&Tensor::from_vec(x.shape().to_vec(), out)?, x.dtype())
}

/// Offset of head `hh` at step `i` of batch `b` in a `[B, T, NH*D]` tensor.
fn idx4(t: usize, i: usize, hh: usize, d: usize, b: usize, nh: usize) -> usize {
    ((b * t + i) * nh + hh) * d
}

fn linear_attention(cx: &Ctx) -> Result<Vec<Value>> {
    let (q, k, v) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    let rule = cx.astr("update_rule", "gated_delta");
    let gating = matches!(rule.as_str(), "gated" | "gated_delta");
    let delta = matches!(rule.as_str(), "delta" | "gated_delta");
    if !matches!(rule.as_str(), "linear" | "gated" | "delta" | "gated_delta") {
        return Err(unsupported(format!("update_rule '{rule}'")));
    }
    let hq = cx.ai("q_num_heads", 0) as usize;
    let hk = cx.ai("kv_num_heads", 0) as usize;
    if q.rank() != 3
        || k.rank() != 3
        || v.rank() != 3
        || hq == 0
        || hk == 0
        || !hq.is_multiple_of(hk)
    {
        kbail!("query/key/value must be 3-D with q_num_heads a multiple of kv_num_heads");
    }
    let (b, t) = (q.shape()[0], q.shape()[1]);
    let dk = q.shape()[2] / hq;
    let dv = v.shape()[2] / hk;
    let group = hq / hk;
    let f = |x: &Tensor| -> Result<Vec<f64>> {
        Ok(x.to_f64_vec()?.iter().map(|&v| v as f32 as f64).collect())
    };
    let (qv, kv, vv) = (f(q)?, f(k)?, f(v)?);
    let decay = if gating { Some(cx.t(4)?) } else { None };
    let beta = if delta { Some(cx.t(5)?) } else { None };
    let dec = decay.map(f).transpose()?;
    let bet = beta.map(f).transpose()?;
    let dec_last = decay.map_or(0, |d| d.shape()[2]);
    let bet_last = beta.map_or(0, |d| d.shape()[2]);
    let past = cx.opt(3);
    let mut state = match past {
        Some(p) => f(p)?,
        None => vec![0f64; b * hk * dk * dv],
    };
    if state.len() != b * hk * dk * dv {
        kbail!("past_state has the wrong size");
    }
    let scale = match cx.af("scale", 0.0) {
        0.0 => 1.0 / (dk as f64).sqrt(),
        s => s as f64,
    };
    let mut out = vec![0f64; b * t * hq * dv];
    let mut vt = vec![0f64; dv];
    for i in 0..t {
        for bi in 0..b {
            for h in 0..hk {
                let st = &mut state[(bi * hk + h) * dk * dv..][..dk * dv];
                let kt = &kv[idx4(t, i, h, dk, bi, hk)..][..dk];
                vt.copy_from_slice(&vv[idx4(t, i, h, dv, bi, hk)..][..dv]);
                if let Some(g) = &dec {
                    for a in 0..dk {
                        let gv = if dec_last == hk {
                            g[(bi * t + i) * hk + h]
                        } else {
                            g[((bi * t + i) * hk + h) * dk + a]
                        };
                        let e = gv.exp();
                        st[a * dv..(a + 1) * dv].iter_mut().for_each(|x| *x *= e);
                    }
                }
                if let Some(be) = &bet {
                    let bv = if bet_last == hk {
                        be[(bi * t + i) * hk + h]
                    } else {
                        be[bi * t + i]
                    };
                    for m in 0..dv {
                        let retrieved: f64 = (0..dk).map(|a| st[a * dv + m] * kt[a]).sum();
                        vt[m] = bv * (vt[m] - retrieved);
                    }
                }
                for a in 0..dk {
                    for m in 0..dv {
                        st[a * dv + m] += kt[a] * vt[m];
                    }
                }
            }
            for hh in 0..hq {
                let h = hh / group;
                let st = &state[(bi * hk + h) * dk * dv..][..dk * dv];
                let qt = &qv[idx4(t, i, hh, dk, bi, hq)..][..dk];
                for m in 0..dv {
                    let s: f64 = (0..dk).map(|a| qt[a] * st[a * dv + m]).sum();
                    out[((bi * t + i) * hq + hh) * dv + m] = scale * s;
                }
            }
        }
    }
    let y = cast(&Tensor::from_vec(vec![b, t, hq * dv], out)?, q.dtype())?;
    let sdt = past.map_or(q.dtype(), |p| p.dtype());
    let st = cast(&Tensor::from_vec(vec![b, hk, dk, dv], state)?, sdt)?;
    Ok(vec![Value::Tensor(y), Value::Tensor(st)])
}

fn causal_conv(cx: &Ctx) -> Result<Vec<Value>> {
    let (x, w) = (cx.t(0)?, cx.t(1)?);
    if x.rank() != 3 || w.rank() != 3 {
        kbail!("input and weight must be 3-D");
    }
    let (b, c, l) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    let k = w.shape()[2];
    let act = cx.astr("activation", "none");
    let xv = x.to_f64_vec()?;
    let wv = w.to_f64_vec()?;
    let bias = cx.opt(2).map(|t| t.to_f64_vec()).transpose()?;
    let past = cx.opt(3).map(|t| t.to_f64_vec()).transpose()?;
    let pl = l + k - 1;
    let mut padded = vec![0f64; b * c * pl];
    for bi in 0..b {
        for ch in 0..c {
            let row = &mut padded[(bi * c + ch) * pl..][..pl];
            if let Some(p) = &past {
                row[..k - 1].copy_from_slice(&p[(bi * c + ch) * (k - 1)..][..k - 1]);
            }
            row[k - 1..].copy_from_slice(&xv[(bi * c + ch) * l..][..l]);
        }
    }
    let mut out = vec![0f64; b * c * l];
    for bi in 0..b {
        for ch in 0..c {
            let row = &padded[(bi * c + ch) * pl..][..pl];
            for i in 0..l {
                let s: f64 = (0..k).map(|j| row[i + j] * wv[ch * k + j]).sum::<f64>()
                    + bias.as_ref().map_or(0.0, |b| b[ch]);
                out[(bi * c + ch) * l + i] = s;
            }
        }
    }
    let y = cast(&Tensor::from_vec(vec![b, c, l], out)?, x.dtype())?;
    let y = match act.as_str() {
        "none" => y,
        "silu" | "swish" => {
            let v: Vec<f64> = y
                .to_f64_vec()?
                .iter()
                .map(|&v| v / (1.0 + (-v).exp()))
                .collect();
            cast(&Tensor::from_vec(vec![b, c, l], v)?, x.dtype())?
        }
        a => return Err(unsupported(format!("activation '{a}'"))),
    };
    let mut state = Vec::with_capacity(b * c * (k - 1));
    for row in padded.chunks(pl) {
        state.extend_from_slice(&row[pl - (k - 1)..]);
    }
    let st = cast(&Tensor::from_vec(vec![b, c, k - 1], state)?, x.dtype())?;
    Ok(vec![Value::Tensor(y), Value::Tensor(st)])
}

pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "RotaryEmbedding" => |cx| one(rotary(cx)?),
        "LinearAttention" => linear_attention,
        "CausalConvWithState" => causal_conv,
        _ => return None,
    };
    Some(k)
}
