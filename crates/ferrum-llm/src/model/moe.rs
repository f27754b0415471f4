//! Mixture-of-experts feed-forward block (Shazeer et al. 2017, "Outrageously Large Neural
//! Networks"; Jiang et al. 2024, "Mixtral of Experts"; Qwen3-MoE). Reference: llama.cpp
//! `build_moe_ffn` with softmax gating.
//!
//! For each token row h, with router scores r = h W_router (+ b_router):
//!   softmax gating (Mixtral, Qwen3-MoE):
//!     p = softmax(r) over all experts;  E = the n_used largest p (in descending order)
//!     w_e = p_e, or p_e / sum_{e in E} p_e when the model renormalises
//!   softmax-weight gating (gpt-oss):
//!     E = the n_used largest r;  w = softmax(r_E)
//!   y = sum_{e in E} w_e * down_e(act(gate_e h, up_e h))      (summed in the order of E)
//! with act SiLU(g) * u, or gpt-oss's clamped SwiGLU; expert projections may carry biases.
//!
//! Only the chosen experts run. The rows of a step are grouped by expert, so each chosen expert's
//! matrices are read once per step for all the rows that picked it.

use ferrum_core::Buf;
use ferrum_kernels::profile;

use super::blocks::Moe;
use super::config::{ExpertAct, Gating, MoeConfig};
use super::swiglu;

/// Softmax as ggml's: exp(x - max), summed in f64, then scaled by 1/sum in f32.
fn softmax_ggml(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v = (*v - max).exp();
    }
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// The `n` largest of `x` (descending; ties: the lower index first, NaN last).
fn top(x: &[f32], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap_or(std::cmp::Ordering::Equal));
    order.truncate(n);
    order
}

/// The chosen experts of one row and their weights, from the router's scores `logits`, in
/// descending order of score.
pub fn route(logits: &[f32], cfg: &MoeConfig) -> Vec<(usize, f32)> {
    let mut chosen: Vec<(usize, f32)> = match cfg.gating {
        Gating::Softmax => {
            let mut p = logits.to_vec();
            softmax_ggml(&mut p);
            top(&p, cfg.n_expert_used)
                .into_iter()
                .map(|e| (e, p[e]))
                .collect()
        }
        Gating::SoftmaxWeight => {
            let e = top(logits, cfg.n_expert_used);
            let mut w: Vec<f32> = e.iter().map(|&i| logits[i]).collect();
            softmax_ggml(&mut w);
            e.into_iter().zip(w).collect()
        }
    };
    if cfg.norm {
        // llama.cpp clamps the sum away from zero (at 2^-14) before dividing.
        let s = chosen.iter().map(|&(_, w)| w as f64).sum::<f64>() as f32;
        let s = s.max(2f32.powi(-14));
        for (_, w) in &mut chosen {
            *w /= s;
        }
    }
    chosen
}

/// The block's output for `h` ([T, n_embd]); `segs` are the batch's sequences (the router runs
/// per sequence as a dense projection does).
pub fn forward(moe: &Moe, cfg: &MoeConfig, h: &[f32], n_embd: usize, segs: &[usize]) -> Buf {
    let t = h.len() / n_embd;
    let logits = moe.router.forward(h, segs); // [T, n_expert]
    let n_used = cfg.n_expert_used;
    // routes[row * n_used + slot] = (expert, weight)
    let mut routes = Vec::with_capacity(t * n_used);
    profile::record("moe_route", "ffn_moe", 0.0, 0.0, || {
        for row in logits.chunks_exact(cfg.n_expert) {
            routes.extend(route(row, cfg));
        }
    });
    // Per expert, the (row, slot) pairs that chose it.
    let mut picked: Vec<Vec<(usize, usize)>> = vec![Vec::new(); cfg.n_expert];
    for (i, &(e, _)) in routes.iter().enumerate() {
        picked[e].push((i / n_used, i % n_used));
    }
    // ys[(row * n_used + slot) * n_embd ..]: the chosen expert's output for the row, weighted.
    let mut ys = Buf::zeros(t * n_used * n_embd);
    let mut hx = Buf::default();
    for (e, rows) in picked.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let m = &moe.experts[e];
        hx.clear();
        for &(r, _) in rows {
            hx.extend_from_slice(&h[r * n_embd..(r + 1) * n_embd]);
        }
        let n = [rows.len()];
        let mut g = m.gate.forward(&hx, &n);
        let u = m.up.forward(&hx, &n);
        match cfg.act {
            ExpertAct::Silu => swiglu(&mut g, &u),
            ExpertAct::SwigluOai => {
                let len = g.len() as f64;
                profile::record("swiglu_oai", "ffn_act", 8.0 * len, 12.0 * len, || {
                    ferrum_kernels::ops::swiglu_oai(&mut g, &u, 1.702, 7.0)
                })
            }
        }
        let d = m.down.forward(&g, &n);
        for (&(r, slot), y) in rows.iter().zip(d.chunks_exact(n_embd)) {
            let w = routes[r * n_used + slot].1;
            let dst = &mut ys[(r * n_used + slot) * n_embd..][..n_embd];
            for (o, &v) in dst.iter_mut().zip(y) {
                *o = v * w;
            }
        }
    }
    // Sum the slots in order, as llama.cpp adds its views.
    let mut out = Buf::zeros(t * n_embd);
    for (r, o) in out.chunks_exact_mut(n_embd).enumerate() {
        o.copy_from_slice(&ys[r * n_used * n_embd..][..n_embd]);
        for slot in 1..n_used {
            let y = &ys[(r * n_used + slot) * n_embd..][..n_embd];
            for (a, &b) in o.iter_mut().zip(y) {
                *a += b;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_picks_the_largest_and_renormalises() {
        let cfg = MoeConfig {
            n_expert: 5,
            n_expert_used: 2,
            n_ff_exp: 4,
            norm: true,
            gating: Gating::Softmax,
            act: ExpertAct::Silu,
        };
        let r = route(&[0.1, 2.0, -1.0, 1.5, 2.0], &cfg);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 4]);
        assert!((r[0].1 - 0.5).abs() < 1e-6 && (r[1].1 - 0.5).abs() < 1e-6);
        let raw = route(
            &[0.0, 1.0, 0.0],
            &MoeConfig {
                n_expert: 3,
                n_expert_used: 1,
                norm: false,
                ..cfg
            },
        );
        let e = 1f64.exp();
        assert_eq!(raw[0].0, 1);
        assert!((raw[0].1 as f64 - e / (e + 2.0)).abs() < 1e-6);
        // gpt-oss: the two largest scores, softmaxed between themselves.
        let sw = route(
            &[0.5, 3.0, -1.0, 2.0, 0.0],
            &MoeConfig {
                norm: false,
                gating: Gating::SoftmaxWeight,
                ..cfg
            },
        );
        assert_eq!(sw.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        let w = 1.0 / (1.0 + (-1f64).exp());
        assert!((sw[0].1 as f64 - w).abs() < 1e-6 && (sw[1].1 as f64 - (1.0 - w)).abs() < 1e-6);
    }
}
