//! The portable x86-order kernels (`quant::vec_dot_lanes`, the `Isa::Scalar` path of `vec_dot`)
//! against the AVX2 kernels and the generic-order reference. Fresh random inputs on every run; the
//! seed is printed in every failure message, rerun with `QUANT_SEED=<seed>` to reproduce.
//!
//! * `vec_dot_lanes` == `vec_dot` bit for bit, finite, for every weight type and many row lengths
//!   (1, 2, 3, 4, 5, 7, 8, 9, 16, 17 and random block counts; float rows of every length mod 32).
//!   With the AVX2 kernels active (`isa() == Isa::Avx2`) this is the portable-vs-AVX2 check; on
//!   other CPUs (or with `FERRUM_FORCE_SCALAR=1`) `vec_dot` is the portable kernel itself, so only
//!   the dispatch is checked and the AVX2 comparison is reported as skipped.
//! * `vec_dot_lanes` vs `vec_dot_ref` (ggml's generic C order): |Δ| ≤ 4·k·u·M, the bound of
//!   tests/quant_random.rs (u = 2^-23, k = blocks + 16, or n/8 + 40 for F32/F16/BF16,
//!   M = Σ_i |x_i|·(|A_i| + |B_i|), w = A − B with B the "min" part). Same exact integer sums,
//!   only the float accumulation order differs.
//! * Every check demands finite values, so a NaN never passes.

mod common;

use common::{cancellation, min_field, offset_magnitude, set_scale, BLOCK_FORMATS};
use ferrum_core::{f16, DType};
use ferrum_kernels::quant::{
    dequantize_row, isa, quantize_row, vec_dot, vec_dot_lanes, vec_dot_ref, vec_dot_type, Isa,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const OWN_KERNELS: [DType; 15] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
];

/// Every weight type: those with kernels of their own, then the block formats.
fn weights() -> impl Iterator<Item = DType> {
    OWN_KERNELS.into_iter().chain(BLOCK_FORMATS)
}

fn seed() -> u64 {
    match std::env::var("QUANT_SEED") {
        Ok(s) => s.parse().expect("QUANT_SEED must be a u64"),
        Err(_) => rand::random(),
    }
}

/// A random valid weight row: random bytes with finite random f16 scales (quantized types), or
/// random values of mixed magnitude (float types).
fn random_weights(t: DType, n: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut b = vec![0u8; t.row_bytes(n).unwrap()];
    match t {
        DType::F32 | DType::F16 | DType::BF16 => {
            let scale = 10f32.powf(rng.gen_range(-2.0..2.0));
            let x: Vec<f32> = (0..n)
                .map(|_| rng.gen_range(-1.0f32..1.0) * scale)
                .collect();
            quantize_row(t, &x, &mut b);
        }
        _ => {
            rng.fill(&mut b[..]);
            for blk in b.chunks_exact_mut(t.block_bytes()) {
                let mag = 10f32.powf(rng.gen_range(-4.0..0.5));
                let sign = if rng.gen_bool(0.5) { -1.0 } else { 1.0 };
                set_scale(t, blk, f16::from_f32(sign * mag));
            }
        }
    }
    b
}

/// Random activations: mixed magnitudes, occasional outliers and all-zero blocks.
fn random_activations(n: usize, rng: &mut StdRng) -> Vec<f32> {
    let scale = 10f32.powf(rng.gen_range(-3.0..2.0));
    let mut x: Vec<f32> = (0..n)
        .map(|_| {
            let v = rng.gen_range(-1.0f32..1.0) * scale;
            if rng.gen_ratio(1, 50) {
                v * 30.0
            } else {
                v
            }
        })
        .collect();
    if n >= 64 && rng.gen_bool(0.3) {
        let start = 32 * rng.gen_range(0..n / 32);
        x[start..start + 32].fill(0.0);
    }
    x
}

/// 4·k·u·M for this row pair (see the module docs).
fn tolerance(t: DType, w: &[u8], act: &[u8], n: usize) -> f64 {
    let at = vec_dot_type(t);
    let mut wd = vec![0f32; n];
    dequantize_row(t, w, &mut wd);
    let mut xd = vec![0f32; n];
    dequantize_row(at, act, &mut xd);
    let mut wa = wd.clone();
    if let Some(off) = min_field(t) {
        let mut w0 = w.to_vec();
        for blk in w0.chunks_exact_mut(t.block_bytes()) {
            blk[off..off + 2].fill(0);
        }
        dequantize_row(t, &w0, &mut wa);
    }
    let mag: f64 = (0..n)
        .map(|i| {
            let (w, a, x) = (wd[i] as f64, wa[i] as f64, xd[i] as f64);
            x.abs() * (a.abs() + (a - w).abs())
        })
        .sum::<f64>()
        + offset_magnitude(t, w, &xd);
    let k = if t.is_quantized() {
        (n / t.block_size() + 16) as f64
    } else {
        (n / 8 + 40) as f64
    };
    4.0 * k * f32::EPSILON as f64 * mag * cancellation(t) + 1e-30
}

/// Checks one row pair; returns whether the result was compared with the AVX2 kernels.
fn check(t: DType, w: &[u8], act: &[u8], n: usize, ctx: &str) -> bool {
    let lanes = vec_dot_lanes(t, w, act, n);
    let dispatched = vec_dot(t, w, act, n);
    let simd = isa() == Isa::Avx2;
    let what = if simd { "AVX2" } else { "vec_dot (portable)" };
    assert!(
        lanes.is_finite() && lanes.to_bits() == dispatched.to_bits(),
        "{ctx}: {t} n={n}: portable {lanes:e} ({:#010x}) vs {what} {dispatched:e} ({:#010x})",
        lanes.to_bits(),
        dispatched.to_bits()
    );
    let reference = vec_dot_ref(t, w, act, n);
    let tol = tolerance(t, w, act, n);
    assert!(
        reference.is_finite() && (lanes as f64 - reference as f64).abs() <= tol,
        "{ctx}: {t} n={n}: portable {lanes:e} vs generic-order ref {reference:e} (tol {tol:e})"
    );
    simd
}

/// Row lengths in elements: fixed block counts plus random ones (quantized types); every length
/// mod 32 around the 32-element steps plus random ones (float types).
fn lengths(t: DType, rng: &mut StdRng) -> Vec<usize> {
    let bs = t.block_size();
    if t.is_quantized() {
        let mut blocks = vec![1, 2, 3, 4, 5, 7, 8, 9, 16, 17];
        blocks.extend((0..8).map(|_| rng.gen_range(1..=24)));
        if bs == 32 {
            blocks.extend([18, 64, 96]);
        }
        blocks.into_iter().map(|b| b * bs).collect()
    } else {
        let mut n: Vec<usize> = (1..=70).collect();
        n.extend([
            95, 96, 97, 127, 128, 129, 255, 256, 257, 576, 1024, 2048, 2049,
        ]);
        n.extend((0..12).map(|_| rng.gen_range(1..=3000)));
        n
    }
}

#[test]
fn portable_equals_avx2_bit_for_bit() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    eprintln!("seed {seed} (kernels: {:?})", isa());
    let mut compared = 0usize;
    let mut cases = 0usize;
    for t in weights() {
        for n in lengths(t, &mut rng) {
            for rep in 0..3 {
                let w = random_weights(t, n, &mut rng);
                let at = vec_dot_type(t);
                let mut act = vec![0u8; at.row_bytes(n).unwrap()];
                quantize_row(at, &random_activations(n, &mut rng), &mut act);
                let ctx = format!("seed {seed}: rep {rep}");
                compared += check(t, &w, &act, n, &ctx) as usize;
                cases += 1;
            }
        }
    }
    if compared == 0 {
        eprintln!(
            "AVX2 comparison skipped: kernels are {:?} (no AVX2+FMA+F16C, or FERRUM_FORCE_SCALAR); \
             checked {cases} cases against vec_dot's dispatch and vec_dot_ref only",
            isa()
        );
    } else {
        eprintln!("{compared} of {cases} cases bit-identical to the AVX2 kernels");
    }
}

/// Extreme but valid blocks: every code at its max/min (and mid) value with large scales, and
/// alternating-sign activations, so every lane carries large, cancelling partial sums.
#[test]
fn portable_equals_avx2_on_saturated_blocks() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for t in weights().filter(|t| t.is_quantized()) {
        for fill in [0x00u8, 0xff, 0x80, 0x7f, 0x55, 0xaa] {
            for blocks in [1, 3, 8] {
                let n = blocks * t.block_size();
                let mut w = vec![fill; t.row_bytes(n).unwrap()];
                for blk in w.chunks_exact_mut(t.block_bytes()) {
                    set_scale(t, blk, f16::from_f32(rng.gen_range(0.5f32..1.5)));
                }
                let x: Vec<f32> = (0..n)
                    .map(|i| {
                        let v = 100.0 + rng.gen_range(0.0f32..1.0);
                        if i % 2 == 0 {
                            v
                        } else {
                            -v
                        }
                    })
                    .collect();
                let at = vec_dot_type(t);
                let mut act = vec![0u8; at.row_bytes(n).unwrap()];
                quantize_row(at, &x, &mut act);
                check(t, &w, &act, n, &format!("seed {seed}: fill {fill:#x}"));
            }
        }
    }
}

/// A NaN scale gives a NaN, which the checks above reject.
#[test]
fn nan_never_passes() {
    let mut rng = StdRng::seed_from_u64(7);
    // MXFP4's scale is a power of two (E8M0) with no NaN code.
    for t in weights().filter(|&t| t.is_quantized() && t != DType::MXFP4) {
        let n = 2 * t.block_size();
        let mut w = random_weights(t, n, &mut rng);
        set_scale(t, &mut w[..t.block_bytes()], f16::NAN);
        let at = vec_dot_type(t);
        let mut act = vec![0u8; at.row_bytes(n).unwrap()];
        quantize_row(at, &random_activations(n, &mut rng), &mut act);
        assert!(vec_dot_lanes(t, &w, &act, n).is_nan(), "{t}");
        assert!(std::panic::catch_unwind(|| check(t, &w, &act, n, "nan")).is_err());
    }
}

#[test]
#[should_panic(expected = "vec_dot")]
fn vec_dot_lanes_rejects_short_activation() {
    let w = vec![0u8; 18];
    let a = vec![0u8; 33];
    vec_dot_lanes(DType::Q4_0, &w, &a, 32);
}

#[test]
#[should_panic(expected = "activation-only")]
fn vec_dot_lanes_rejects_activation_only_weight() {
    let w = vec![0u8; 292];
    vec_dot_lanes(DType::Q8_K, &w, &w, 256);
}
