//! The kernel harness, in the manner of ggml's test-backend-ops: every kernel tier this CPU (and
//! the environment) allows runs in this one process (`cpu::set_tier_cap`), over every weight type
//! and a set of call shapes, against the plain references, on fresh random inputs each run (the
//! seed is in every failure; rerun with `QUANT_SEED=<seed>`).
//!
//! * Matmul: for each (tier, weight type, call shape) the product equals, bit for bit, the plain
//!   reference of its float order: per token the order `Order::of` names for its sequence
//!   (llama.cpp's x86 orders), except that with `FERRUM_DOT_ORDER=blocks` a Q4_1, Q5_0 or Q8_0
//!   matrix in the 16-row layout read by the AVX-512 tier gives every token the block order of
//!   its packed kernel (tests/block_order.rs covers that order by itself); computed one
//!   output at a time by the portable kernels (`vec_dot_lanes`, `vec_dot_blocks` and the exact
//!   scalar twins of the repacked/tiled orders) on `quantize_row_ref`'s activations. Both
//!   a matrix stored for the tier (`PackedMatrix::new` under the cap) and one packed for the top
//!   tier, read by the tier's kernels, are checked. Each output is also within
//!   2^-6 · Σ|w·x| + 1e-5 of the f64 reference (`matmul_ref`), so the order reference itself is
//!   sane. Finite values only: a NaN never passes.
//! * Attention, SwiGLU, GeGLU: each tier's kernel equals the portable one bit for bit.
//!
//! A new weight type (`DType::ALL`) or tier (`cpu::Tier::ALL`) adds its rows to the table.
//! One test function: the tier cap is process-wide.

mod common;

use ferrum_core::{f16, Bytes, DType};
use ferrum_kernels::attention::{attention, attention_portable, AttnParams};
use ferrum_kernels::cpu::{self, Tier};
use ferrum_kernels::matmul::{matmul_ref, Order, PackedMatrix, WeightRef};
use ferrum_kernels::ops;
use ferrum_kernels::quant;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn seed() -> u64 {
    match std::env::var("QUANT_SEED") {
        Ok(s) => s.parse().expect("QUANT_SEED must be a u64"),
        Err(_) => rand::random(),
    }
}

/// The weight types (those with a dot product; the activation-only ones are skipped).
fn weight_types() -> Vec<DType> {
    DType::ALL
        .into_iter()
        .filter(|&t| !matches!(t, DType::Q8_1 | DType::Q8_K))
        .collect()
}

/// Random rows of `dtype` made by quantizing random values with the reference quantizer where
/// one exists (so scales are sane), else random finite floats.
fn random_matrix(dtype: DType, rows: usize, cols: usize, rng: &mut StdRng) -> Vec<u8> {
    let rb = dtype.row_bytes(cols).unwrap();
    let mut out = vec![0u8; rb * rows];
    for row in out.chunks_exact_mut(rb) {
        let v: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        match dtype {
            DType::F32 => {
                for (o, x) in row.chunks_exact_mut(4).zip(&v) {
                    o.copy_from_slice(&x.to_le_bytes());
                }
            }
            DType::F16 => {
                for (o, x) in row.chunks_exact_mut(2).zip(&v) {
                    o.copy_from_slice(&f16::from_f32(*x).to_bits().to_le_bytes());
                }
            }
            DType::BF16 => {
                for (o, x) in row.chunks_exact_mut(2).zip(&v) {
                    o.copy_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
                }
            }
            _ => random_quant_row(dtype, row, rng),
        }
    }
    out
}

/// Random bytes with sane f16 scale fields for the block-quantized types.
fn random_quant_row(dtype: DType, row: &mut [u8], rng: &mut StdRng) {
    rng.fill(row);
    let put = |b: &mut [u8], off: usize, v: f32| {
        b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
    };
    for blk in row.chunks_exact_mut(dtype.block_bytes()) {
        let d = rng.gen_range(0.0005f32..0.01);
        let m = rng.gen_range(-0.05f32..0.05);
        match dtype {
            DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::IQ4_NL | DType::IQ4_XS => {
                put(blk, 0, d)
            }
            DType::Q4_1 | DType::Q5_1 => {
                put(blk, 0, d);
                put(blk, 2, m);
            }
            // K-quants: d and dmin lead the block (Q2_K: after 16 + 64 bytes).
            DType::Q2_K => {
                put(blk, 80, d);
                put(blk, 82, d);
            }
            DType::Q3_K => put(blk, 108, d),
            DType::Q4_K | DType::Q5_K => {
                put(blk, 0, d);
                put(blk, 2, d);
            }
            DType::Q6_K => put(blk, 208, d),
            other => common::set_scale(other, blk, f16::from_f32(d)),
        }
    }
}

/// The reference product: token by token in the order llama.cpp gives its sequence (with
/// `blocks`, the block order for every token), one output at a time with the portable
/// exact-order kernels.
fn reference(
    dtype: DType,
    rows: usize,
    cols: usize,
    w: &[u8],
    x: &[f32],
    segs: &[usize],
    blocks: bool,
) -> Vec<f32> {
    let at = quant::vec_dot_type(dtype);
    let ab = at.row_bytes(cols).unwrap();
    let rb = dtype.row_bytes(cols).unwrap();
    let mut act = vec![0u8; ab];
    let mut y = Vec::with_capacity(x.len() / cols * rows);
    let mut tok_rows = x.chunks_exact(cols);
    for &n in segs {
        for tok in 0..n {
            quant::quantize_row_ref(at, tok_rows.next().unwrap(), &mut act);
            for r in 0..rows {
                let wr = &w[r * rb..(r + 1) * rb];
                let order = if blocks {
                    Order::Blocks
                } else {
                    Order::of(dtype, rows, n, tok)
                };
                y.push(match order {
                    Order::Vec => quant::vec_dot_lanes(dtype, wr, &act, cols),
                    Order::Q4kGemv => quant::vec_dot_q4k_repacked_ref(wr, &act, cols),
                    Order::Q4kGemm => quant::vec_dot_q4k_gemm_order_ref(wr, &act, cols),
                    Order::Q6kTiled => quant::vec_dot_q6k_tiled_order_ref(wr, &act, cols),
                    Order::Tiled => quant::vec_dot_tiled_order(dtype, wr, &act, cols),
                    Order::Blocks => quant::vec_dot_blocks(dtype, wr, &act, cols),
                });
            }
        }
    }
    y
}

#[test]
fn every_tier_matches_the_reference_on_every_type_and_shape() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let tiers = cpu::features().tiers();
    let top = *tiers.last().unwrap();
    // One-token sequences (decode steps), short and long prompts, and mixes of both.
    let shapes: &[&[usize]] = &[
        &[1],
        &[2],
        &[3],
        &[1, 1, 1, 1, 1, 1, 1, 1],
        &[5, 1, 1],
        &[12],
        &[1, 9, 1],
        &[33],
    ];
    let mut table = Vec::new();
    for dtype in weight_types() {
        let (rows, cols) = if dtype.block_size() == 256 {
            (32, 512)
        } else {
            (48, 96)
        };
        let w = random_matrix(dtype, rows, cols, &mut rng);
        // Packed for the top tier (what a model loaded here holds).
        cpu::set_tier_cap(None);
        let top_matrix = PackedMatrix::new(dtype, rows, cols, Bytes::from_vec(w.clone())).unwrap();
        for &tier in &tiers {
            cpu::set_tier_cap(Some(tier));
            let own = PackedMatrix::new(dtype, rows, cols, Bytes::from_vec(w.clone())).unwrap();
            let mut checked = 0;
            for segs in shapes {
                let t: usize = segs.iter().sum();
                let x: Vec<f32> = (0..t * cols).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
                let mut exact = vec![0f32; t * rows];
                matmul_ref(
                    &WeightRef {
                        dtype,
                        rows,
                        cols,
                        data: &w,
                    },
                    &x,
                    &mut exact,
                );
                for (which, m) in [
                    ("stored for the tier", &own),
                    ("packed for the top", &top_matrix),
                ] {
                    let blocks = tier == Tier::Avx512Vnni
                        && m.layout().name() == "x16"
                        && quant::has_blocks_order(dtype)
                        && ferrum_kernels::matmul::block_order();
                    let want = reference(dtype, rows, cols, &w, &x, segs, blocks);
                    let mut got = vec![f32::NAN; t * rows];
                    m.matmul(&x, &mut got, segs);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        let (tok, r) = (i / rows, i % rows);
                        assert!(
                            a.is_finite() && a.to_bits() == b.to_bits(),
                            "seed {seed}: tier {tier}, {dtype} ({which}, {} layout), segs {segs:?}, \
                             token {tok} row {r}: {a} vs reference {b}",
                            m.layout().name()
                        );
                        let xr = &x[tok * cols..(tok + 1) * cols];
                        let mut wr = vec![0f32; cols];
                        let rb = dtype.row_bytes(cols).unwrap();
                        quant::dequantize_row(dtype, &w[r * rb..(r + 1) * rb], &mut wr);
                        let mag: f64 = wr.iter().zip(xr).map(|(p, q)| (p * q).abs() as f64).sum();
                        let err = (*a as f64 - exact[i] as f64).abs();
                        assert!(
                            err <= mag / 64.0 + 1e-5,
                            "seed {seed}: tier {tier}, {dtype}, segs {segs:?}: {a} vs f64 {} (|w·x| {mag})",
                            exact[i]
                        );
                    }
                    checked += 1;
                }
            }
            table.push(format!(
                "{:<14} {dtype:<5} {:<9} {checked} products",
                tier.name(),
                own.layout().name()
            ));
        }
    }
    // Attention and the gated activations: each tier's kernel is the portable one, bit for bit.
    for &tier in &tiers {
        cpu::set_tier_cap(Some(tier));
        for &(nh, nkv, hd) in &[
            (9, 3, 64),
            (14, 2, 64),
            (4, 1, 256),
            (6, 2, 128),
            (2, 1, 80),
        ] {
            let ctx = 48;
            let k: Vec<f16> = (0..ctx * nkv * hd)
                .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let v: Vec<f16> = (0..ctx * nkv * hd)
                .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let positions: Vec<usize> = (30..38).collect();
            let q: Vec<f32> = (0..positions.len() * nh * hd)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            // Attention sinks (gpt-oss) on every other call, above and below the scores.
            let sinks: Vec<f32> = (0..nh).map(|_| rng.gen_range(-3.0..6.0)).collect();
            for with_sinks in [false, true] {
                let p = AttnParams {
                    n_head: nh,
                    n_head_kv: nkv,
                    head_dim: hd,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window: None,
                    softcap: None,
                    sinks: with_sinks.then_some(&sinks[..]),
                };
                let mut a = vec![f32::NAN; q.len()];
                let mut b = vec![f32::NAN; q.len()];
                attention(&p, &q, &k, &v, &positions, &mut a);
                attention_portable(&p, &q, &k, &v, &positions, &mut b);
                assert!(
                    a.iter()
                        .zip(&b)
                        .all(|(x, y)| x.is_finite() && x.to_bits() == y.to_bits()),
                    "seed {seed}: tier {tier}: attention {nh}x{hd} (sinks {with_sinks}) differs \
                     from the portable kernel"
                );
            }
        }
        for n in [1, 15, 16, 17, 100, 1536, 100_003] {
            let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-8.0..8.0)).collect();
            let u: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let (mut a, mut b) = (g.clone(), g.clone());
            ops::swiglu(&mut a, &u);
            ops::swiglu_portable(&mut b, &u);
            assert!(
                a.iter()
                    .zip(&b)
                    .all(|(x, y)| x.is_finite() && x.to_bits() == y.to_bits()),
                "seed {seed}: tier {tier}: swiglu of {n}"
            );
            let (mut a, mut b) = (g.clone(), g);
            ops::geglu(&mut a, &u);
            ops::geglu_portable(&mut b, &u);
            assert!(
                a.iter()
                    .zip(&b)
                    .all(|(x, y)| x.is_finite() && x.to_bits() == y.to_bits()),
                "seed {seed}: tier {tier}: geglu of {n}"
            );
        }
        table.push(format!("{:<14} attention, swiglu, geglu", tier.name()));
    }
    cpu::set_tier_cap(None);
    assert!(tiers.contains(&Tier::Portable));
    let _ = top;
    eprintln!("kernel harness, seed {seed}:\n{}", table.join("\n"));
}
