//! llama.cpp prefill float orders: `vec_dot_q4k_gemm_order` (`ggml_gemm_q4_K_8x8_q8_K`) and
//! `vec_dot_q6k_tiled_order` (`tiled_run_micro_vnni_8x16`). Fresh random inputs on every run; the
//! seed is printed in every failure message, rerun with `QUANT_SEED=<seed>` to reproduce.
//!
//! * SIMD == scalar reference bit for bit (same exact integer sums, same float operations).
//! * Reference vs f64 Σ dequant(w)·dequant(act): |Δ| ≤ 4·k·u·M, the bound of tests/quant_random.rs
//!   (u = 2^-23, k = blocks + 16, M = Σ |x_i|·(|A_i| + |B_i|), w = A − B with B the dmin part).
//! * vs the existing `vec_dot` (same integers, other float order): |Δ| ≤ 2·4·k·u·M.
//! * With float steps that are exact (d = dmin = 1, d_x = 1, small sums) every order gives the
//!   same value: the integer sums are the same.
//! * Every check demands finite values, so a NaN never passes.

use ferrum_core::{f16, DType};
use ferrum_kernels::quant::{
    dequantize_row, quantize_row, vec_dot, vec_dot_q4k_gemm_order, vec_dot_q4k_gemm_order_ref,
    vec_dot_q4k_repacked_ref, vec_dot_q6k_tiled_order, vec_dot_q6k_tiled_order_ref, vec_dot_ref,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

fn seed() -> u64 {
    match std::env::var("QUANT_SEED") {
        Ok(s) => s.parse().expect("QUANT_SEED must be a u64"),
        Err(_) => rand::random(),
    }
}

/// The order under test: (SIMD-dispatched, scalar reference).
type Dot = fn(&[u8], &[u8], usize) -> f32;

fn order_of(t: DType) -> (Dot, Dot) {
    match t {
        DType::Q4_K => (vec_dot_q4k_gemm_order, vec_dot_q4k_gemm_order_ref),
        DType::Q6_K => (vec_dot_q6k_tiled_order, vec_dot_q6k_tiled_order_ref),
        _ => unreachable!(),
    }
}

/// f16 scale fields (d, then dmin for Q4_K).
fn scale_fields(t: DType) -> &'static [usize] {
    match t {
        DType::Q4_K => &[0, 2],
        DType::Q6_K => &[208],
        _ => unreachable!(),
    }
}

fn put_f16(b: &mut [u8], off: usize, v: f16) {
    b[off..off + 2].copy_from_slice(&v.to_bits().to_le_bytes());
}

fn random_weights(t: DType, n: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut b = vec![0u8; t.row_bytes(n).unwrap()];
    rng.fill(&mut b[..]);
    for blk in b.chunks_exact_mut(t.block_bytes()) {
        for &off in scale_fields(t) {
            let mag = 10f32.powf(rng.gen_range(-4.0..0.5));
            let sign = if rng.gen_bool(0.5) { -1.0 } else { 1.0 };
            put_f16(blk, off, f16::from_f32(sign * mag));
        }
    }
    b
}

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
    if rng.gen_bool(0.3) {
        let start = 32 * rng.gen_range(0..n / 32);
        x[start..start + 32].fill(0.0);
    }
    x
}

fn quantize_q8k(x: &[f32]) -> Vec<u8> {
    let mut act = vec![0u8; DType::Q8_K.row_bytes(x.len()).unwrap()];
    quantize_row(DType::Q8_K, x, &mut act);
    act
}

/// (f64 Σ dequant(w)·dequant(act), tolerance 4·k·u·M).
fn f64_dot_and_tol(t: DType, w: &[u8], act: &[u8], n: usize) -> (f64, f64) {
    let mut wd = vec![0f32; n];
    dequantize_row(t, w, &mut wd);
    let mut xd = vec![0f32; n];
    dequantize_row(DType::Q8_K, act, &mut xd);
    let mut wa = wd.clone();
    if t == DType::Q4_K {
        let mut w0 = w.to_vec();
        for blk in w0.chunks_exact_mut(t.block_bytes()) {
            blk[2..4].fill(0);
        }
        dequantize_row(t, &w0, &mut wa);
    }
    let (mut exact, mut mag) = (0f64, 0f64);
    for i in 0..n {
        let (w, a, x) = (wd[i] as f64, wa[i] as f64, xd[i] as f64);
        exact += w * x;
        mag += x.abs() * (a.abs() + (a - w).abs());
    }
    let k = (n / 256 + 16) as f64;
    (exact, 4.0 * k * f32::EPSILON as f64 * mag + 1e-30)
}

/// Whether `a` and `b` are the same finite f32 (NaN or infinity never passes).
fn same_finite(a: f32, b: f32) -> bool {
    a.is_finite() && a.to_bits() == b.to_bits()
}

fn check(t: DType, w: &[u8], act: &[u8], n: usize, ctx: &str) {
    let (fast, reference) = order_of(t);
    let s = fast(w, act, n);
    let r = reference(w, act, n);
    assert!(same_finite(s, r), "{ctx}: {t} n={n}: simd {s} vs ref {r}");
    let (exact, tol) = f64_dot_and_tol(t, w, act, n);
    assert!(
        (r as f64 - exact).abs() <= tol,
        "{ctx}: {t} n={n}: ref {r} vs f64 {exact} (tol {tol:e})"
    );
    for (what, other) in [
        ("vec_dot", vec_dot(t, w, act, n)),
        ("vec_dot_ref", vec_dot_ref(t, w, act, n)),
    ] {
        assert!(
            other.is_finite() && (r as f64 - other as f64).abs() <= 2.0 * tol,
            "{ctx}: {t} n={n}: order {r} vs {what} {other} (tol {:e})",
            2.0 * tol
        );
    }
}

#[test]
fn orders_on_random_blocks() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    eprintln!("seed {seed} (kernels: {:?})", ferrum_kernels::quant::isa());
    for t in [DType::Q4_K, DType::Q6_K] {
        for i in 0..60 {
            let n = if i < 50 {
                256 * rng.gen_range(1..=12)
            } else {
                [1024, 1536, 2048, 4096][i % 4]
            };
            let w = random_weights(t, n, &mut rng);
            let act = quantize_q8k(&random_activations(n, &mut rng));
            check(t, &w, &act, n, &format!("seed {seed}"));
        }
    }
}

/// Extreme but valid blocks: every code at its max/min with large scales.
#[test]
fn orders_on_saturated_blocks() {
    for t in [DType::Q4_K, DType::Q6_K] {
        for fill in [0x00u8, 0xff, 0x80, 0x7f] {
            let n = 512;
            let mut w = vec![fill; t.row_bytes(n).unwrap()];
            for blk in w.chunks_exact_mut(t.block_bytes()) {
                for &off in scale_fields(t) {
                    put_f16(blk, off, f16::from_f32(1.5));
                }
            }
            let x: Vec<f32> = (0..n)
                .map(|i| if i % 2 == 0 { 100.0 } else { -100.0 })
                .collect();
            check(t, &w, &quantize_q8k(&x), n, &format!("fill {fill:#x}"));
        }
    }
}

/// A Q8_K row with d = 1 and the given quants (bsums consistent).
fn q8k_unit_row(q: &[i8]) -> Vec<u8> {
    let mut act = Vec::new();
    for blk in q.chunks_exact(256) {
        act.extend_from_slice(&1f32.to_le_bytes());
        act.extend(blk.iter().map(|&v| v as u8));
        for g in blk.chunks_exact(16) {
            let s: i32 = g.iter().map(|&v| v as i32).sum();
            act.extend_from_slice(&(s as i16).to_le_bytes());
        }
    }
    act
}

/// With d_w = dmin_w = d_x = 1 and small quants (every partial sum < 2^24) every float step is exact, so all orders must give
/// the same value: the integer sums are the same as the existing dots'.
#[test]
fn orders_share_the_integer_sums() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for t in [DType::Q4_K, DType::Q6_K] {
        for _ in 0..20 {
            let n = 256 * rng.gen_range(1..=4);
            let mut w = random_weights(t, n, &mut rng);
            for blk in w.chunks_exact_mut(t.block_bytes()) {
                for &off in scale_fields(t) {
                    put_f16(blk, off, f16::from_f32(1.0));
                }
                if t == DType::Q6_K {
                    // Small int8 scales keep the sums far below 2^24.
                    for s in &mut blk[192..208] {
                        *s = (*s as i8 / 8) as u8;
                    }
                }
            }
            let q: Vec<i8> = (0..n).map(|_| rng.gen_range(-15..=15)).collect();
            let act = q8k_unit_row(&q);
            let (fast, reference) = order_of(t);
            let got = [
                fast(&w, &act, n),
                reference(&w, &act, n),
                vec_dot(t, &w, &act, n),
                vec_dot_ref(t, &w, &act, n),
            ];
            let (exact, _) = f64_dot_and_tol(t, &w, &act, n);
            assert!(exact.abs() < (1 << 24) as f64, "seed {seed}: {exact}");
            for g in got {
                assert!(
                    g.is_finite() && g as f64 == exact,
                    "seed {seed}: {t} n={n}: {got:?} vs exact {exact}"
                );
            }
            if t == DType::Q4_K {
                assert_eq!(vec_dot_q4k_repacked_ref(&w, &act, n) as f64, exact);
            }
        }
    }
}

/// A NaN scale gives NaN in both paths, and the checks above reject it.
#[test]
fn nan_never_passes() {
    let mut rng = StdRng::seed_from_u64(7);
    for t in [DType::Q4_K, DType::Q6_K] {
        let n = 512;
        let mut w = random_weights(t, n, &mut rng);
        put_f16(&mut w, scale_fields(t)[0], f16::NAN);
        let act = quantize_q8k(&random_activations(n, &mut rng));
        let (fast, reference) = order_of(t);
        let (s, r) = (fast(&w, &act, n), reference(&w, &act, n));
        assert!(s.is_nan() && r.is_nan(), "{t}: {s} {r}");
        assert!(!same_finite(s, r));
        assert!(!same_finite(f32::NAN, f32::NAN));
        assert!(std::panic::catch_unwind(|| check(t, &w, &act, n, "nan")).is_err());
    }
}

/// Real rows of gemma-3-270m (offsets from tests/fixtures/quant/real_tensors.txt; skipped when
/// models/ is absent) with random activations.
#[test]
fn orders_on_real_rows() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let list = fs::read_to_string(dir.join("tests/fixtures/quant/real_tensors.txt")).unwrap();
    let wanted = [
        ("blk.0.attn_output.weight", DType::Q4_K),
        ("blk.0.ffn_down.weight", DType::Q6_K),
    ];
    for (name, t) in wanted {
        let f: Vec<&str> = list
            .lines()
            .find(|l| l.contains("gemma-3-270m") && l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("{name} not in real_tensors.txt"))
            .split_whitespace()
            .collect();
        assert_eq!(f[2], t.name());
        let (offset, ne0, rows): (u64, usize, usize) = (
            f[3].parse().unwrap(),
            f[4].parse().unwrap(),
            f[5].parse().unwrap(),
        );
        let Ok(mut file) = fs::File::open(dir.join("../..").join(f[0])) else {
            eprintln!("skipping {name}: {} not found", f[0]);
            continue;
        };
        let rb = t.row_bytes(ne0).unwrap();
        let mut bytes = vec![0u8; rb * rows];
        file.seek(SeekFrom::Start(offset)).unwrap();
        file.read_exact(&mut bytes).unwrap();
        for v in 0..3 {
            let act = quantize_q8k(&random_activations(ne0, &mut rng));
            for (r, w) in bytes.chunks_exact(rb).enumerate() {
                check(
                    t,
                    w,
                    &act,
                    ne0,
                    &format!("seed {seed}: {name} row {r} act {v}"),
                );
            }
        }
    }
}
