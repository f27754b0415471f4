//! Causal scaled-dot-product attention over an f16 KV cache, one query row at a time with an online
//! softmax (running max and sum; Milakov & Gimelshein 2018, FlashAttention's recurrence), so no
//! score matrix is materialised. Grouped-query attention: query head h reads KV head h / (n_head / n_head_kv).
//!
//! Numerics follow llama.cpp's CPU flash-attention path: Q is rounded to f16 (K is f16 in the cache),
//! dot products and softmax run in f32, and the V.p accumulator is f16.

use half::f16;
use rayon::prelude::*;

/// Shape and masking of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Multiplies q.k (1/sqrt(head_dim) for Llama; 1 for Gemma 3, which pre-scales Q).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys p-window+1 ..= p. `None`: all earlier keys.
    pub window: Option<usize>,
}

/// `q`: [T, n_head*head_dim]; `k`, `v`: the layer's cache, [ctx, n_head_kv*head_dim] f16, filled at
/// least up to the largest position; `positions[t]`: the position of query t; `out`: [T, n_head*head_dim].
pub fn attention(
    p: &AttnParams,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    positions: &[usize],
    out: &mut [f32],
) {
    let (hd, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
    assert!(
        nh % nkv == 0,
        "attention: n_head {nh} is not a multiple of n_head_kv {nkv}"
    );
    assert_eq!(q.len(), positions.len() * nh * hd, "attention: q shape");
    assert_eq!(out.len(), q.len(), "attention: out shape");
    let kv_row = nkv * hd;
    let max_pos = positions.iter().copied().max().unwrap_or(0);
    assert!(
        k.len() >= (max_pos + 1) * kv_row && v.len() >= (max_pos + 1) * kv_row,
        "attention: cache too short"
    );
    let group = nh / nkv;

    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (t, h) = (idx / nh, idx % nh);
        let pos = positions[t];
        let kvh = h / group;
        let qh: Vec<f32> = q[idx * hd..(idx + 1) * hd]
            .iter()
            .map(|&x| f16::from_f32(x).to_f32())
            .collect();
        let start = match p.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        let mut m = f32::NEG_INFINITY;
        let mut s = 0f32;
        // The V.p accumulator is kept in f16 and rounded after every update, as llama.cpp's CPU
        // flash attention does with an f16 V cache (its `VKQ16`).
        let mut acc = vec![f16::ZERO; hd];
        for j in start..=pos {
            let kr = &k[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
            let mut dot = 0f32;
            for (a, b) in qh.iter().zip(kr) {
                dot += a * b.to_f32();
            }
            let score = dot * p.scale;
            let vr = &v[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
            let mut ms = 1f32;
            let mut vs = 1f32;
            if score > m {
                ms = (m - score).exp();
                m = score;
                for a in acc.iter_mut() {
                    *a = f16::from_f32(a.to_f32() * ms);
                }
            } else {
                vs = (score - m).exp();
            }
            for (a, b) in acc.iter_mut().zip(vr) {
                *a = f16::from_f32(b.to_f32().mul_add(vs, a.to_f32()));
            }
            s = s * ms + vs;
        }
        let inv = 1.0 / s;
        for (dst, a) in o.iter_mut().zip(&acc) {
            *dst = a.to_f32() * inv;
        }
    });
}

/// Plain reference: full scores, f64 softmax, no f16 rounding of Q.
pub fn attention_ref(
    p: &AttnParams,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    positions: &[usize],
    out: &mut [f32],
) {
    let (hd, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
    let kv_row = nkv * hd;
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            let start = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let scores: Vec<f64> = (start..=pos)
                .map(|j| {
                    let kr = &k[j * kv_row + kvh * hd..][..hd];
                    qh.iter()
                        .zip(kr)
                        .map(|(&a, b)| a as f64 * b.to_f64())
                        .sum::<f64>()
                        * p.scale as f64
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for d in 0..hd {
                let val: f64 = (start..=pos)
                    .zip(&w)
                    .map(|(j, wj)| wj * v[j * kv_row + kvh * hd + d].to_f64())
                    .sum();
                out[(t * nh + h) * hd + d] = (val / sum) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn online_softmax_matches_reference() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (nh, nkv, hd, window) in [(4, 2, 16, None), (4, 1, 32, Some(5)), (3, 3, 8, None)] {
            let ctx = 20;
            let positions: Vec<usize> = (12..20).collect();
            let k: Vec<f16> = (0..ctx * nkv * hd)
                .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let v: Vec<f16> = (0..ctx * nkv * hd)
                .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let q: Vec<f32> = (0..positions.len() * nh * hd)
                .map(|_| rng.gen_range(-2.0..2.0))
                .collect();
            let p = AttnParams {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
            };
            let mut a = vec![0.0; q.len()];
            let mut b = vec![0.0; q.len()];
            attention(&p, &q, &k, &v, &positions, &mut a);
            attention_ref(&p, &q, &k, &v, &positions, &mut b);
            for (x, y) in a.iter().zip(&b) {
                // Q is rounded to f16 and V.p accumulates in f16 (rel. 2^-11 per step): 1e-2 absolute.
                assert!(
                    x.is_finite() && (x - y).abs() < 5e-3,
                    "seed {seed}: {x} vs {y}"
                );
            }
        }
    }
}
