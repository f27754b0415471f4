//! Mixture-of-experts feed-forward block (Shazeer et al. 2017, "Outrageously Large Neural
//! Networks"; Jiang et al. 2024, "Mixtral of Experts"; Qwen3-MoE). Reference: llama.cpp
//! `build_moe_ffn` with softmax gating.
//!
//! For each token row h:
//!   p = softmax(h W_router)                      (over all experts)
//!   E = the n_used experts with the largest p     (in descending order of p)
//!   w_e = p_e, or p_e / sum_{e in E} p_e when the model renormalises
//!   y = sum_{e in E} w_e * down_e(SiLU(gate_e h) * up_e h)     (summed in the order of E)
//!
//! Only the chosen experts run. The rows of a step are grouped by expert, so each chosen expert's
//! matrices are read once per step for all the rows that picked it.

use ferrum_core::Buf;
use ferrum_kernels::profile;

use super::blocks::Moe;
use super::config::MoeConfig;
use super::swiglu;

/// The chosen experts of one row and their weights, in descending order of router probability
/// (ties: the lower expert index first).
pub fn route(logits: &[f32], cfg: &MoeConfig) -> Vec<(usize, f32)> {
    // Softmax as ggml's: exp(x - max), summed in f64, then scaled by 1/sum in f32.
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits.iter().map(|&x| (x - max).exp()).collect();
    let sum: f64 = p.iter().map(|&x| x as f64).sum();
    let inv = (1.0 / sum) as f32;
    for x in &mut p {
        *x *= inv;
    }
    let mut order: Vec<usize> = (0..p.len()).collect();
    // NaN router outputs sort last rather than panic.
    order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap_or(std::cmp::Ordering::Equal));
    order.truncate(cfg.n_expert_used);
    let mut chosen: Vec<(usize, f32)> = order.into_iter().map(|e| (e, p[e])).collect();
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
        swiglu(&mut g, &m.up.forward(&hx, &n));
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
    }
}
