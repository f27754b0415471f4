//! Randomized tests of the quant kernels, fresh inputs on every run. The seed is printed in every
//! failure message; rerun with `QUANT_SEED=<seed>` to reproduce.
//!
//! Tolerances (u = f32::EPSILON = 2^-23, M = Σ_i |x_i|·(|A_i| + |B_i|) where the weight is
//! w_i = A_i − B_i with B the "min" part of Q4_1/Q5_1/Q2_K/Q4_K/Q5_K (0 elsewhere), x = the
//! dequantized quantized activation, k = blocks + 16, or n/8 + 40 for F32/F16/BF16):
//! * vec_dot (SIMD) vs vec_dot_ref (scalar): |Δ| ≤ 4·k·u·M. Integer sums are exact in both, only
//!   the f32 accumulation order (and FMA) differs.
//! * vec_dot_ref vs f64 Σ dequant(w)·dequant(quantize(x)): |Δ| ≤ 4·k·u·M + Σ_b |m_b|·|s_b − d_b·Σq_b|.
//!   The last term is exact bookkeeping for Q4_1/Q5_1: their dot uses the stored f16 block sum
//!   s = f16(d·Σq) (with the unrounded d) where the dequantized activation has f16(d)·Σq.
//! * M grows where a kernel's partial sums cancel: ×9 for IQ1_S/IQ1_M (lattice and shift parts
//!   summed apart), + 2·Σ|d·x| for TQ1_0/TQ2_0 (codes and offset summed apart); see tests/common.
//! * quantizers: bit-exact with the llama.cpp rules; SIMD and scalar quantizers byte-identical.

mod common;

use common::{cancellation, min_field, offset_magnitude, set_scale, BLOCK_FORMATS};
use ferrum_core::{f16, DType};
use ferrum_kernels::quant::{
    dequantize_row, quantize_row, quantize_row_ref, vec_dot, vec_dot_q4k_repacked,
    vec_dot_q4k_repacked_ref, vec_dot_ref, vec_dot_type,
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

fn random_f16_scale(rng: &mut StdRng) -> f16 {
    let mag = 10f32.powf(rng.gen_range(-4.0..0.5));
    let sign = if rng.gen_bool(0.5) { -1.0 } else { 1.0 };
    f16::from_f32(sign * mag)
}

/// A random valid weight row: random bytes with finite random scales (quantized types), or
/// random values (float types).
fn random_weights(t: DType, n: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut b = vec![0u8; t.row_bytes(n).unwrap()];
    match t {
        DType::F32 | DType::F16 | DType::BF16 => {
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
            quantize_row(t, &x, &mut b);
        }
        _ => {
            rng.fill(&mut b[..]);
            for blk in b.chunks_exact_mut(t.block_bytes()) {
                set_scale(t, blk, random_f16_scale(rng));
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

fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

fn check_dot_case(t: DType, n: usize, rng: &mut StdRng, seed: u64) {
    let w = random_weights(t, n, rng);
    let x = random_activations(n, rng);
    let at = vec_dot_type(t);
    let mut act = vec![0u8; at.row_bytes(n).unwrap()];
    quantize_row(at, &x, &mut act);

    let mut wd = vec![0f32; n];
    dequantize_row(t, &w, &mut wd);
    let mut xd = vec![0f32; n];
    dequantize_row(at, &act, &mut xd);
    // Scale part A: the same blocks with the min field zeroed.
    let mut wa = wd.clone();
    if let Some(off) = min_field(t) {
        let mut w0 = w.clone();
        for blk in w0.chunks_exact_mut(t.block_bytes()) {
            blk[off..off + 2].fill(0);
        }
        dequantize_row(t, &w0, &mut wa);
    }
    let mut mag = offset_magnitude(t, &w, &xd);
    let mut exact = 0f64;
    for i in 0..n {
        let (w, a, x) = (wd[i] as f64, wa[i] as f64, xd[i] as f64);
        exact += w * x;
        mag += x.abs() * (a.abs() + (a - w).abs());
    }
    // Q4_1/Q5_1: the dot uses s = f16(d·Σq); the dequantized activation implies f16(d)·Σq.
    let mut s_term = 0f64;
    if at == DType::Q8_1 {
        for (wblk, ablk) in w.chunks_exact(t.block_bytes()).zip(act.chunks_exact(40)) {
            let m = f16_at(wblk, 2) as f64;
            let d = f16_at(ablk, 0) as f64;
            let s = f16_at(ablk, 2) as f64;
            let sumq: i32 = ablk[4..36].iter().map(|&q| q as i8 as i32).sum();
            s_term += m.abs() * (s - d * sumq as f64).abs();
        }
    }
    let k = if t.is_quantized() {
        (n / t.block_size() + 16) as f64
    } else {
        (n / 8 + 40) as f64
    };
    let u = f32::EPSILON as f64;
    let tol = 4.0 * k * u * mag * cancellation(t) + 1e-30;

    let simd = vec_dot(t, &w, &act, n);
    let reference = vec_dot_ref(t, &w, &act, n);
    assert!(
        simd.is_finite() && reference.is_finite(),
        "seed {seed}: {t} n={n}: non-finite dot (simd {simd}, ref {reference})"
    );
    assert!(
        (simd as f64 - reference as f64).abs() <= tol,
        "seed {seed}: {t} n={n}: simd {simd} vs ref {reference} (tol {tol:e}, M {mag:e})"
    );
    assert!(
        (reference as f64 - exact).abs() <= tol + s_term * 1.0001,
        "seed {seed}: {t} n={n}: ref {reference} vs f64 {exact} (tol {tol:e} + {s_term:e})"
    );
    if t == DType::Q4_K {
        // llama.cpp's repacked-Q4_K order: SIMD and scalar are the same float operations on the
        // same exact integer sums, so they agree bit for bit; vs f64 as above.
        let rs = vec_dot_q4k_repacked(&w, &act, n);
        let rr = vec_dot_q4k_repacked_ref(&w, &act, n);
        assert!(
            rs.is_finite() && rs.to_bits() == rr.to_bits(),
            "seed {seed}: Q4_K repacked n={n}: simd {rs} vs ref {rr}"
        );
        assert!(
            (rr as f64 - exact).abs() <= tol,
            "seed {seed}: Q4_K repacked n={n}: ref {rr} vs f64 {exact} (tol {tol:e})"
        );
    }
}

#[test]
fn dots_simd_vs_scalar_vs_f64() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    eprintln!("seed {seed} (kernels: {:?})", ferrum_kernels::quant::isa());
    for t in weights() {
        for _ in 0..40 {
            let n = if t.is_quantized() {
                t.block_size() * rng.gen_range(1..=12)
            } else {
                rng.gen_range(1..=400)
            };
            check_dot_case(t, n, &mut rng, seed);
        }
        // Model-sized rows.
        for n in [576, 640, 1024, 1536, 2048] {
            if n % t.block_size() == 0 {
                check_dot_case(t, n, &mut rng, seed);
            }
        }
    }
}

/// Extreme but valid blocks: every quant at its max/min code with the largest scales.
#[test]
fn dots_with_saturated_blocks() {
    for t in weights().filter(|t| t.is_quantized()) {
        for fill in [0x00u8, 0xff, 0x80, 0x7f] {
            let n = 2 * t.block_size();
            let mut w = vec![fill; t.row_bytes(n).unwrap()];
            for blk in w.chunks_exact_mut(t.block_bytes()) {
                set_scale(t, blk, f16::from_f32(1.5));
            }
            let x: Vec<f32> = (0..n)
                .map(|i| if i % 2 == 0 { 100.0 } else { -100.0 })
                .collect();
            let at = vec_dot_type(t);
            let mut act = vec![0u8; at.row_bytes(n).unwrap()];
            quantize_row(at, &x, &mut act);
            let a = vec_dot(t, &w, &act, n);
            let b = vec_dot_ref(t, &w, &act, n);
            assert!(a.is_finite() && b.is_finite(), "{t}");
            if t == DType::Q4_K {
                let r = vec_dot_q4k_repacked(&w, &act, n);
                let rr = vec_dot_q4k_repacked_ref(&w, &act, n);
                assert!(
                    r.is_finite() && r.to_bits() == rr.to_bits(),
                    "repacked {r} vs {rr}"
                );
                assert!(
                    (r - b).abs() <= 1e-5 * r.abs().max(b.abs()).max(1.0),
                    "Q4_K fill {fill:#x}: repacked {r} vs ref {b}"
                );
            }
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1.0),
                "{t} fill {fill:#x}: simd {a} vs ref {b}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Activation quantizers.

fn expect_q8_0_block(x: &[f32], b: &[u8], with_sum: bool, ctx: &str) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    assert_eq!(
        u16::from_le_bytes([b[0], b[1]]),
        f16::from_f32(d).to_bits(),
        "{ctx}: d"
    );
    let off = if with_sum { 4 } else { 2 };
    let mut sum = 0i32;
    for (i, &v) in x.iter().enumerate() {
        let q = (v * id).round_ties_even() as i32;
        assert_eq!(b[off + i] as i8 as i32, q, "{ctx}: q[{i}] for x={v}");
        sum += q;
    }
    if with_sum {
        assert_eq!(
            u16::from_le_bytes([b[2], b[3]]),
            f16::from_f32(d * sum as f32).to_bits(),
            "{ctx}: s"
        );
    }
}

fn expect_q8_k_block(x: &[f32], b: &[u8], ctx: &str) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        assert!(b.iter().all(|&v| v == 0), "{ctx}: zero block");
        return;
    }
    let iscale = -127.0 / max;
    assert_eq!(
        f32::from_le_bytes(b[0..4].try_into().unwrap()).to_bits(),
        (1.0 / iscale).to_bits(),
        "{ctx}: d"
    );
    for (i, &v) in x.iter().enumerate() {
        let q = ((iscale * v).round_ties_even() as i32).min(127);
        assert_eq!(b[4 + i] as i8 as i32, q, "{ctx}: q[{i}] for x={v}");
    }
    for g in 0..16 {
        let s: i32 = (0..16).map(|j| b[4 + 16 * g + j] as i8 as i32).sum();
        assert_eq!(
            i16::from_le_bytes([b[260 + 2 * g], b[261 + 2 * g]]) as i32,
            s,
            "{ctx}: bsum {g}"
        );
    }
}

fn quantize_both(t: DType, x: &[f32]) -> Vec<u8> {
    let mut a = vec![0u8; t.row_bytes(x.len()).unwrap()];
    let mut b = vec![0xAAu8; a.len()];
    quantize_row(t, x, &mut a);
    quantize_row_ref(t, x, &mut b);
    assert_eq!(a, b, "{t}: SIMD and scalar quantizers differ");
    a
}

fn check_quantizer(t: DType, x: &[f32], ctx: &str) {
    let b = quantize_both(t, x);
    match t {
        DType::Q8_0 => {
            for (i, (xb, bb)) in x.chunks(32).zip(b.chunks(34)).enumerate() {
                expect_q8_0_block(xb, bb, false, &format!("{ctx} block {i}"));
            }
        }
        DType::Q8_1 => {
            for (i, (xb, bb)) in x.chunks(32).zip(b.chunks(40)).enumerate() {
                expect_q8_0_block(xb, bb, true, &format!("{ctx} block {i}"));
            }
        }
        DType::Q8_K => {
            for (i, (xb, bb)) in x.chunks(256).zip(b.chunks(292)).enumerate() {
                expect_q8_k_block(xb, bb, &format!("{ctx} block {i}"));
            }
        }
        _ => unreachable!(),
    }
    // Round trip: |x − dequant| ≤ |d|/2 up to the f16 rounding of d (relative 2^-11, or half an
    // f16 subnormal step 2^-25 per unit of q when amax/127 is below the f16 normal range).
    let mut back = vec![0f32; x.len()];
    dequantize_row(t, &b, &mut back);
    let bs = t.block_size();
    for (i, (&v, &r)) in x.iter().zip(&back).enumerate() {
        assert!(r.is_finite(), "{ctx}: non-finite dequant");
        let blk = &x[i / bs * bs..(i / bs + 1) * bs];
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            (v - r).abs() <= amax / 127.0 * 0.502 + amax * 2e-3 + 127.0 * 2f32.powi(-25),
            "{ctx}: round trip x[{i}]={v} -> {r}"
        );
    }
}

#[test]
fn activation_quantizers_follow_llama_cpp_rules() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for t in [DType::Q8_0, DType::Q8_1, DType::Q8_K] {
        for trial in 0..200 {
            let n = t.block_size() * rng.gen_range(1..=6);
            let x = random_activations(n, &mut rng);
            check_quantizer(t, &x, &format!("seed {seed}: {t} trial {trial}"));
        }
    }
}

#[test]
fn activation_quantizer_special_cases() {
    // Ties: with amax = 127 the Q8_0 multiplier is exactly 1, so k + 0.5 rounds to even.
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    let ties = [2.5f32, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5];
    x[1..1 + ties.len()].copy_from_slice(&ties);
    for t in [DType::Q8_0, DType::Q8_1] {
        let b = quantize_both(t, &x);
        let off = if t == DType::Q8_0 { 2 } else { 4 };
        let want = [127i8, 2, 4, -2, -4, 0, 0, 2, 126, -126];
        for (i, &w) in want.iter().enumerate() {
            assert_eq!(b[off + i] as i8, w, "{t} tie case {i}");
        }
        check_quantizer(t, &x, "ties");
    }
    // All-zero blocks: d = 0, q = 0, s = 0 (Q8_K: everything 0).
    for t in [DType::Q8_0, DType::Q8_1, DType::Q8_K] {
        let z = vec![0f32; t.block_size()];
        assert!(
            quantize_both(t, &z).iter().all(|&v| v == 0),
            "{t} zero block"
        );
        let nz = vec![-0.0f32; t.block_size()];
        check_quantizer(t, &nz, "negative zeros");
    }
    // Q8_K with a negative max: iscale = -127/max > 0, d > 0; the max maps to -127.
    let mut x = vec![0f32; 256];
    x[10] = -127.0; // iscale = 1 exactly: ties in the rest
    x[11] = 2.5;
    x[12] = 3.5;
    x[13] = -0.5;
    x[14] = 126.5;
    let b = quantize_both(DType::Q8_K, &x);
    assert_eq!(f32::from_le_bytes(b[0..4].try_into().unwrap()), 1.0);
    assert_eq!(
        [
            b[14] as i8,
            b[15] as i8,
            b[16] as i8,
            b[17] as i8,
            b[18] as i8
        ],
        [-127, 2, 4, 0, 126]
    );
    check_quantizer(DType::Q8_K, &x, "q8k negative max");
    // Positive max: d < 0 and the quants are negated; first of equal |x| wins.
    let mut x = vec![0f32; 256];
    x[3] = 5.0;
    x[7] = -5.0;
    x[8] = 1.0;
    let b = quantize_both(DType::Q8_K, &x);
    let d = f32::from_le_bytes(b[0..4].try_into().unwrap());
    assert!(d < 0.0, "d = {d}");
    assert_eq!([b[7] as i8, b[11] as i8], [-127, 127]);
    check_quantizer(DType::Q8_K, &x, "q8k positive max");
}

#[test]
fn float_activation_formats() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let x: Vec<f32> = (0..333)
        .map(|_| rng.gen_range(-70000.0f32..70000.0) * rng.gen::<f32>().powi(8))
        .collect();
    let f32b = quantize_both(DType::F32, &x);
    let f16b = quantize_both(DType::F16, &x);
    let bf16b = quantize_both(DType::BF16, &x);
    for (i, &v) in x.iter().enumerate() {
        assert_eq!(
            f32::from_le_bytes(f32b[4 * i..4 * i + 4].try_into().unwrap()),
            v
        );
        assert_eq!(
            u16::from_le_bytes([f16b[2 * i], f16b[2 * i + 1]]),
            f16::from_f32(v).to_bits(),
            "seed {seed}: f16 of {v}"
        );
        assert_eq!(
            u16::from_le_bytes([bf16b[2 * i], bf16b[2 * i + 1]]),
            ferrum_core::bf16::from_f32(v).to_bits(),
            "seed {seed}: bf16 of {v}"
        );
    }
}

#[test]
fn vec_dot_types() {
    use DType::*;
    let pairs = [
        (F32, F32),
        (F16, F16),
        (BF16, BF16),
        (Q4_0, Q8_0),
        (Q5_0, Q8_0),
        (Q8_0, Q8_0),
        (Q4_1, Q8_1),
        (Q5_1, Q8_1),
        (Q2_K, Q8_K),
        (Q3_K, Q8_K),
        (Q4_K, Q8_K),
        (Q5_K, Q8_K),
        (Q6_K, Q8_K),
        (IQ4_NL, Q8_0),
        (IQ4_XS, Q8_K),
    ];
    for (w, a) in pairs {
        assert_eq!(vec_dot_type(w), a, "{w}");
    }
}

#[test]
#[should_panic(expected = "vec_dot")]
fn vec_dot_rejects_short_activation() {
    let w = vec![0u8; 18];
    let a = vec![0u8; 33];
    vec_dot(DType::Q4_0, &w, &a, 32);
}

#[test]
#[should_panic(expected = "activation-only")]
fn vec_dot_rejects_activation_only_weight() {
    let w = vec![0u8; 292];
    vec_dot_ref(DType::Q8_K, &w, &w, 256);
}
