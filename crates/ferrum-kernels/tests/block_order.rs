//! The block order (`FERRUM_DOT_ORDER=blocks`, `matmul::set_block_order`): with it on, the
//! packed AVX-512 kernels of Q4_1, Q5_0 and Q8_0 give every output of every call, decode steps
//! and prompts alike, the bits of `quant::vec_dot_blocks` (one exact integer sum per block, then
//! one conversion and one FMA), whatever else shares the call; off, llama.cpp's order
//! (`vec_dot`) again. Each output also lies within 2^-6 · Σ|w·x| + 1e-5 of the f64 product
//! (`matmul_ref`: the quantized activations' error). Fresh random inputs each run (the seed is
//! in every failure; rerun with `QUANT_SEED=<seed>`); a NaN never passes.
//!
//! A file of its own: the switch is process-wide.

use ferrum_core::{f16, Bytes, DType};
use ferrum_kernels::matmul::{self, matmul_ref, Order, PackedMatrix, WeightRef};
use ferrum_kernels::quant;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn seed() -> u64 {
    match std::env::var("QUANT_SEED") {
        Ok(s) => s.parse().expect("QUANT_SEED must be a u64"),
        Err(_) => rand::random(),
    }
}

/// Random blocks with sane scales (and Q4_1 minimums).
fn random_weights(dtype: DType, rows: usize, cols: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut w = vec![0u8; dtype.row_bytes(cols).unwrap() * rows];
    rng.fill(&mut w[..]);
    let put = |b: &mut [u8], off: usize, v: f32| {
        b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
    };
    for blk in w.chunks_exact_mut(dtype.block_bytes()) {
        put(blk, 0, rng.gen_range(0.0005f32..0.01));
        if dtype == DType::Q4_1 {
            put(blk, 2, rng.gen_range(-0.05f32..0.05));
        }
    }
    w
}

#[test]
fn packed_kernels_give_the_block_order_bit_for_bit_when_asked() {
    if ferrum_kernels::cpu::tier() != ferrum_kernels::cpu::Tier::Avx512Vnni {
        eprintln!("skipped: this CPU has no AVX-512 VNNI");
        return;
    }
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // Decode batches (one token each), prompts past the kernel's 4-token passes and its
    // 32-token blocks, and mixes.
    let seg_sets: &[&[usize]] = &[&[1], &[1; 8], &[3], &[1; 17], &[5, 1, 2], &[70], &[1, 33]];
    for dtype in [DType::Q4_1, DType::Q5_0, DType::Q8_0] {
        for &(rows, cols) in &[(48usize, 96usize), (160, 576)] {
            let data = random_weights(dtype, rows, cols, &mut rng);
            let m = PackedMatrix::new(dtype, rows, cols, Bytes::from_vec(data.clone())).unwrap();
            assert_eq!(m.layout().name(), "x16", "{dtype}");
            let rb = dtype.row_bytes(cols).unwrap();
            let at = quant::vec_dot_type(dtype);
            let mut act = vec![0u8; at.row_bytes(cols).unwrap()];
            for segs in seg_sets {
                let t: usize = segs.iter().sum();
                let x: Vec<f32> = (0..t * cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let mut exact = vec![0f32; t * rows];
                let w = WeightRef {
                    dtype,
                    rows,
                    cols,
                    data: &data,
                };
                matmul_ref(&w, &x, &mut exact);
                for on in [true, false] {
                    matmul::set_block_order(on);
                    let want_order = if on { Order::Blocks } else { Order::Vec };
                    assert!(m.orders(segs).iter().all(|&o| o == want_order));
                    let mut got = vec![f32::NAN; t * rows];
                    m.matmul(&x, &mut got, segs);
                    for tok in 0..t {
                        let xr = &x[tok * cols..(tok + 1) * cols];
                        quant::quantize_row(at, xr, &mut act);
                        for r in 0..rows {
                            let wr = &data[r * rb..(r + 1) * rb];
                            let want = if on {
                                quant::vec_dot_blocks(dtype, wr, &act, cols)
                            } else {
                                quant::vec_dot(dtype, wr, &act, cols)
                            };
                            let a = got[tok * rows + r];
                            assert!(
                                a.is_finite() && a.to_bits() == want.to_bits(),
                                "seed {seed}: {dtype} {rows}x{cols} segs {segs:?} (blocks {on}) \
                                 token {tok} row {r}: {a} vs reference {want}"
                            );
                            let mut wf = vec![0f32; cols];
                            quant::dequantize_row(dtype, wr, &mut wf);
                            let mag: f64 =
                                wf.iter().zip(xr).map(|(p, q)| (p * q).abs() as f64).sum();
                            let e = exact[tok * rows + r] as f64;
                            assert!(
                                (a as f64 - e).abs() <= mag / 64.0 + 1e-5,
                                "seed {seed}: {dtype} segs {segs:?}: {a} vs f64 {e}"
                            );
                        }
                    }
                }
            }
        }
    }
    matmul::set_block_order(false);
}

/// The scalar reference itself: on random blocks it differs from llama.cpp's order by float
/// rounding only (the integer sums are the same), and from the f64 product of the same
/// quantized operands by at most a few f32 roundings per block.
#[test]
fn block_order_reference_is_the_exact_dot_up_to_rounding() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for dtype in [DType::Q4_1, DType::Q5_0, DType::Q8_0] {
        let cols = 32 * rng.gen_range(1..40);
        let w = random_weights(dtype, 1, cols, &mut rng);
        let at = quant::vec_dot_type(dtype);
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let mut act = vec![0u8; at.row_bytes(cols).unwrap()];
        quant::quantize_row(at, &x, &mut act);
        let b = quant::vec_dot_blocks(dtype, &w, &act, cols) as f64;
        let l = quant::vec_dot(dtype, &w, &act, cols) as f64;
        // f64 of the quantized operands: dequantized weights times dequantized activations,
        // plus (Q4_1) the activation sums the s field carries, as the formula has them.
        let mut wf = vec![0f32; cols];
        quant::dequantize_row(dtype, &w, &mut wf);
        let mut af = vec![0f32; cols];
        quant::dequantize_row(at, &act, &mut af);
        let exact: f64 = wf.iter().zip(&af).map(|(p, q)| *p as f64 * *q as f64).sum();
        let mag: f64 = wf
            .iter()
            .zip(&af)
            .map(|(p, q)| (*p as f64 * *q as f64).abs())
            .sum();
        // Q4_1's m·s term uses s rounded to f16, so allow its rounding too.
        let tol = mag * 1e-5
            + if dtype == DType::Q4_1 {
                mag * 2e-3
            } else {
                0.0
            }
            + 1e-6;
        assert!(
            b.is_finite() && (b - exact).abs() <= tol,
            "seed {seed}: {dtype} x{cols}: block order {b} vs f64 {exact}"
        );
        assert!(
            (b - l).abs() <= mag * 1e-5 + 1e-6,
            "seed {seed}: {dtype} x{cols}: block order {b} vs llama.cpp order {l}"
        );
    }
}
