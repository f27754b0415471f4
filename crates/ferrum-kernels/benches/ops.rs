//! Throughput of the non-matmul kernels (no criterion): `cargo bench -p ferrum-kernels --bench ops`.
//! RMSNorm, RoPE, SwiGLU, GeGLU on a 512-token prompt of SmolLM2/Gemma-sized rows (GB/s of f32
//! read + written), and attention (GFLOP/s counting 4·head_dim FLOPs per query-key pair) for a
//! 512-token prompt, for one token over a 2048-token cache, and for a batched decode step (8
//! sequences of one query each over paged caches, 30 layers' caches in turn so they come from
//! beyond L2, as in a model; `-- batched` runs it alone). Medians of 7 runs, 1 and 2 threads.

use ferrum_core::f16;
use ferrum_kernels::attention::{
    attention, attention_paged_batch, AttnParams, KvRows, PagedKv, SeqAttn,
};
use ferrum_kernels::ops::{self, RopeCache, RopeStyle};
use ferrum_kernels::pool;
use std::hint::black_box;

mod common;

/// Median seconds of 7 runs of `f`.
fn median_secs(f: impl FnMut()) -> f64 {
    common::timings(7, f).0
}

fn vals(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 + seed) * 0.731).sin()).collect()
}

fn main() {
    println!("| kernel | shape | threads | median ms | throughput |");
    println!("|---|---|---:|---:|---:|");
    let t = 512;
    // `-- batched`: only the batched decode step.
    let only_batched = std::env::args().any(|a| a == "batched");
    for threads in [1, 2] {
        pool::set_threads(Some(threads));
        if only_batched {
            batched_decode(threads);
            continue;
        }
        let (e, ff) = (576, 1536);
        let x = vals(t * e, 1.0);
        let w = vals(e, 2.0);
        let mut y = vec![0f32; t * e];
        let s = median_secs(|| ops::rms_norm(black_box(&x), &w, 1e-5, &mut y));
        println!(
            "| rms_norm | {t}x{e} | {threads} | {:.3} | {:.1} GB/s |",
            s * 1e3,
            (8 * t * e) as f64 / s / 1e9
        );
        let positions: Vec<usize> = (0..t).collect();
        let rope = RopeCache::new(&positions, 64, 10000.0, RopeStyle::Neox);
        let mut q = vals(t * e, 3.0);
        let s = median_secs(|| rope.apply(black_box(&mut q), 9, 64));
        println!(
            "| rope | {t}x9x64 | {threads} | {:.3} | {:.1} GB/s |",
            s * 1e3,
            (8 * t * e) as f64 / s / 1e9
        );
        let up = vals(t * ff, 4.0);
        let g0 = vals(t * ff, 5.0);
        let mut g = g0.clone();
        let s = median_secs(|| {
            g.copy_from_slice(&g0);
            ops::swiglu(black_box(&mut g), &up)
        });
        println!(
            "| swiglu | {t}x{ff} | {threads} | {:.3} | {:.1} GB/s |",
            s * 1e3,
            (12 * t * ff) as f64 / s / 1e9
        );
        let s = median_secs(|| {
            g.copy_from_slice(&g0);
            ops::geglu(black_box(&mut g), &up)
        });
        println!(
            "| geglu | {t}x{ff} | {threads} | {:.3} | {:.1} GB/s |",
            s * 1e3,
            (12 * t * ff) as f64 / s / 1e9
        );
        for (label, nh, nkv, hd, n_q, ctx) in [
            ("prompt", 9, 3, 64, 512, 512),
            ("decode", 9, 3, 64, 1, 2048),
            ("decode", 9, 3, 64, 1, 64),
            ("prompt", 4, 1, 256, 512, 512),
            ("decode", 4, 1, 256, 1, 2048),
            ("prompt", 8, 2, 128, 512, 512),
            ("decode", 8, 2, 128, 1, 2048),
        ] {
            let k: Vec<f16> = vals(ctx * nkv * hd, 6.0)
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect();
            let v: Vec<f16> = vals(ctx * nkv * hd, 7.0)
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect();
            let q = vals(n_q * nh * hd, 8.0);
            let positions: Vec<usize> = (ctx - n_q..ctx).collect();
            let p = llama_params(nh, nkv, hd);
            let mut out = vec![0f32; q.len()];
            let s = median_secs(|| attention(&p, black_box(&q), &k, &v, &positions, &mut out));
            let pairs: usize = positions.iter().map(|&pos| pos + 1).sum::<usize>() * nh;
            println!(
                "| attention {label} | {n_q} queries, {nh}x{hd} heads, ctx {ctx} | {threads} | {:.3} | {:.1} GFLOP/s, {:.1} ns per (row, key) and thread |",
                s * 1e3,
                (4 * hd * pairs) as f64 / s / 1e9,
                s * 1e9 * threads as f64 / pairs as f64
            );
        }
        batched_decode(threads);
    }
}

/// Llama-style attention: 1/sqrt(head_dim) scale, no window, cap or sinks.
fn llama_params(nh: usize, nkv: usize, hd: usize) -> AttnParams<'static> {
    AttnParams {
        n_head: nh,
        n_head_kv: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        window: None,
        softcap: None,
        sinks: None,
    }
}

/// A batched decode step's attention as a served SmolLM2 runs it: 8 sequences (contexts 128 to
/// 240) of one query each, 9 query heads over 3 KV heads of 64, paged caches of 16-row blocks
/// with each sequence's blocks apart; one call per layer over 30 layers' caches (the time is
/// per layer).
fn batched_decode(threads: usize) {
    let (nh, nkv, hd, bs) = (9, 3, 64, 16);
    let layers: usize = std::env::var("LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let ctxs: Vec<usize> = (0..8).map(|i| 128 + 16 * i).collect();
    let row = nkv * hd;
    let blocks_per_seq: Vec<usize> = ctxs.iter().map(|c| c.div_ceil(bs)).collect();
    let n_blocks: usize = blocks_per_seq.iter().sum();
    // Each sequence's blocks in order, the sequences' runs interleaved block by block (a pool
    // filled by sequences growing together).
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); ctxs.len()];
    let mut next = 0u32;
    for b in 0..*blocks_per_seq.iter().max().unwrap() {
        for (s, t) in tables.iter_mut().enumerate() {
            if b < blocks_per_seq[s] {
                t.push(next);
                next += 1;
            }
        }
    }
    let caches: Vec<(Vec<f16>, Vec<f16>)> = (0..layers)
        .map(|l| {
            let n = n_blocks * bs * row;
            // Values in [-1, 1) from a cheap hash (30 layers of sines would take longer than
            // the timed calls).
            let val = |i: usize, seed: usize| {
                let h = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                f16::from_f32(h as f32 / (1u64 << 23) as f32 - 1.0)
            };
            let k = (0..n).map(|i| val(i, 2 * l + 1)).collect();
            let v = (0..n).map(|i| val(i, 2 * l + 2)).collect();
            (k, v)
        })
        .collect();
    let positions: Vec<[usize; 1]> = ctxs.iter().map(|&c| [c - 1]).collect();
    let q = vals(ctxs.len() * nh * hd, 8.0);
    let p = llama_params(nh, nkv, hd);
    let mut out = vec![0f32; q.len()];
    // The median, and the fastest (load on a shared machine only slows a run down).
    let (s, fastest) = common::timings(31, || {
        for (k, v) in &caches {
            let seqs: Vec<SeqAttn> = tables
                .iter()
                .zip(&positions)
                .map(|(t, pos)| SeqAttn {
                    kv: PagedKv {
                        k: KvRows::F16(k),
                        v: KvRows::F16(v),
                        table: t,
                        block_size: bs,
                    },
                    positions: pos,
                })
                .collect();
            attention_paged_batch(&p, black_box(&q), &seqs, &mut out);
        }
    });
    let (s, fastest) = (s / layers as f64, fastest / layers as f64);
    let pairs: usize = ctxs.iter().sum::<usize>() * nh;
    println!(
        "| attention batched decode | 8 x 1 query, {nh}x{hd} heads, ctx 128-240, paged | {threads} | {:.3} (fastest {:.3}) | {:.1} GFLOP/s, {:.1} ns per (row, key) and thread |",
        s * 1e3,
        fastest * 1e3,
        (4 * hd * pairs) as f64 / s / 1e9,
        s * 1e9 * threads as f64 / pairs as f64
    );
}
