//! Attention over f32, Q8_0 and Q4_0 KV caches (`KvRows::F32` / `KvRows::Blocks`), on fresh
//! random inputs (seed printed; rerun with `QUANT_SEED=<seed>`), against a float64 reference
//! computed from what the kernel is given: the dequantized K and V rows and, for a block-typed K,
//! Q as its Q8_0 quantization dequantized (llama.cpp scores a quantized K against Q8_0 Q). Every
//! output within 1e-4·(1 + |ref|) (f32 sums of <= 64 products, f32 exp); NaN never passes.
//! Paged tables (blocks out of order) and grouped-query heads, with and without a window.

use ferrum_core::DType;
use ferrum_kernels::attention::{attention_paged, AttnParams, KvRows, PagedKv};
use ferrum_kernels::quant::{dequantize_row, quantize_row};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn seed() -> u64 {
    match std::env::var("QUANT_SEED") {
        Ok(s) => s.parse().expect("QUANT_SEED must be a u64"),
        Err(_) => rand::random(),
    }
}

/// `x` stored as `t` and read back (what the kernel sees).
fn round_trip(t: DType, x: &[f32]) -> Vec<f32> {
    if t == DType::F32 {
        return x.to_vec();
    }
    let mut b = vec![0u8; t.row_bytes(x.len()).unwrap()];
    quantize_row(t, x, &mut b);
    let mut y = vec![0f32; x.len()];
    dequantize_row(t, &b, &mut y);
    y
}

#[test]
fn quantized_and_f32_caches_match_an_f64_reference() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for t in [DType::F32, DType::Q8_0, DType::Q4_0] {
        for (nh, nkv, hd, window, with_sinks) in [
            (4, 2, 64, None, false),
            (6, 2, 32, Some(5), false),
            (2, 2, 128, None, false),
            (4, 2, 32, Some(5), true),
        ] {
            // Attention sinks (gpt-oss), above and below the scores.
            let sinks: Vec<f32> = (0..nh).map(|_| rng.gen_range(-3.0..6.0)).collect();
            let (bs, n_blocks, ctx) = (4usize, 8usize, 13usize);
            let kv_row = nkv * hd;
            // The sequence's logical blocks, scattered over the pool.
            let mut ids: Vec<u32> = (0..n_blocks as u32).collect();
            ids.shuffle(&mut rng);
            let table = &ids[..ctx.div_ceil(bs)];
            let k: Vec<f32> = (0..ctx * kv_row)
                .map(|_| rng.gen_range(-2.0..2.0))
                .collect();
            let v: Vec<f32> = (0..ctx * kv_row)
                .map(|_| rng.gen_range(-2.0..2.0))
                .collect();
            let q: Vec<f32> = (0..ctx * nh * hd)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let positions: Vec<usize> = (0..ctx).collect();
            // The pool: rows at their paged places, in the cache type.
            let rows = n_blocks * bs;
            let place = |j: usize| table[j / bs] as usize * bs + j % bs;
            let (mut kf, mut vf) = (vec![0f32; rows * kv_row], vec![0f32; rows * kv_row]);
            let rb = t.row_bytes(kv_row).unwrap();
            let (mut kb, mut vb) = (vec![0u8; rows * rb], vec![0u8; rows * rb]);
            for j in 0..ctx {
                let r = place(j);
                let (ks, vs) = (&k[j * kv_row..][..kv_row], &v[j * kv_row..][..kv_row]);
                if t == DType::F32 {
                    kf[r * kv_row..][..kv_row].copy_from_slice(ks);
                    vf[r * kv_row..][..kv_row].copy_from_slice(vs);
                } else {
                    quantize_row(t, ks, &mut kb[r * rb..][..rb]);
                    quantize_row(t, vs, &mut vb[r * rb..][..rb]);
                }
            }
            let (kr, vr) = if t == DType::F32 {
                (KvRows::F32(&kf), KvRows::F32(&vf))
            } else {
                (KvRows::Blocks(t, &kb), KvRows::Blocks(t, &vb))
            };
            let kv = PagedKv {
                k: kr,
                v: vr,
                table,
                block_size: bs,
            };
            let p = AttnParams {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
                softcap: None,
                sinks: with_sinks.then_some(&sinks[..]),
            };
            let mut out = vec![f32::NAN; q.len()];
            attention_paged(&p, &q, kv, &positions, &mut out);
            // The f64 reference on what the kernel reads.
            let kd = round_trip(t, &k);
            let vd = round_trip(t, &v);
            for (pos, qrow) in q.chunks_exact(nh * hd).enumerate() {
                for h in 0..nh {
                    let kvh = h / (nh / nkv);
                    let qh = &qrow[h * hd..(h + 1) * hd];
                    let qh = if t == DType::F32 {
                        qh.to_vec()
                    } else {
                        round_trip(DType::Q8_0, qh)
                    };
                    let start = window.map_or(0, |w: usize| (pos + 1).saturating_sub(w));
                    let scores: Vec<f64> = (start..=pos)
                        .map(|j| {
                            let kj = &kd[j * kv_row + kvh * hd..][..hd];
                            qh.iter()
                                .zip(kj)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * p.scale as f64
                        })
                        .collect();
                    let sink = p.sinks.map(|sk| sk[h] as f64);
                    let m = scores
                        .iter()
                        .copied()
                        .chain(sink)
                        .fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    // A sink joins the denominator only.
                    let sum: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |sk| (sk - m).exp());
                    for d in 0..hd {
                        let want: f64 = (start..=pos)
                            .zip(&w)
                            .map(|(j, wj)| wj * vd[j * kv_row + kvh * hd + d] as f64)
                            .sum::<f64>()
                            / sum;
                        let got = out[(pos * nh + h) * hd + d];
                        assert!(
                            got.is_finite()
                                && (got as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "seed {seed}: {t} {nh}x{hd} window {window:?}: pos {pos} head {h} \
                             dim {d}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
