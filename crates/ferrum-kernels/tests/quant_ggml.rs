//! Against ggml itself: fixtures written by scripts/gen_quant_fixtures.py with GGML_CPU_LIB set,
//! which called an x86 AVX2 ("haswell") build of ggml's CPU backend through ctypes (see
//! tests/fixtures/quant/ggml_dots.txt for the exact build); IQ4_NL / IQ4_XS cases come from
//! `ggml_dots_iq4.qdot` (a native x86 build: those kernels have an AVX2 branch only); the block
//! formats of `quant::formats` (i-quants, TQ1_0/TQ2_0, MXFP4) from `ggml_dots_iquants.qdot`
//! (a native x86 build: those kernels have an AVX2 branch only) and
//! `ggml_dots_iquants_generic.qdot` (ggml's generic C on the same cases, for `vec_dot_ref`).
//!
//! * Activation quantization (`from_float` of each weight type's `vec_dot_type`): bit-exact, every
//!   case (ggml's Q8_1 blocks are 36 bytes, ours 40 with 4 zero padding bytes: compared per field).
//! * `vec_dot`, whichever kernels are active (AVX2, or the portable x86-order kernels on other
//!   CPUs and with `FERRUM_FORCE_SCALAR=1`), and `vec_dot_lanes` (the portable kernels, on any
//!   CPU): bit-exact for the types whose llama.cpp AVX2 kernel ours mirrors lane for lane
//!   (`BIT_EXACT`, every weight type); the rest within 4·k·u·Σ|w·x| (k = blocks + 16,
//!   u = 2^-23), since only the float summation order differs. `vec_dot_ref` (ggml's generic C
//!   order) always gets that tolerance.

mod common;

use common::BLOCK_FORMATS;
use ferrum_core::DType;
use ferrum_kernels::quant::{dequantize_row, vec_dot_lanes, vec_dot_ref};
use ferrum_kernels::quant::{isa, quantize_row, vec_dot, vec_dot_type};
use std::path::Path;

/// Weight types whose dot product (AVX2 kernels and portable kernels alike) reproduces
/// llama.cpp's AVX2 build bit for bit.
const BIT_EXACT: [DType; 25] = [
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
    DType::IQ2_XXS,
    DType::IQ2_XS,
    DType::IQ2_S,
    DType::IQ3_XXS,
    DType::IQ3_S,
    DType::IQ1_S,
    DType::IQ1_M,
    DType::TQ1_0,
    DType::TQ2_0,
    DType::MXFP4,
];

struct Case {
    dtype: DType,
    n: usize,
    w: Vec<u8>,
    x: Vec<f32>,
    act: Vec<u8>,
    dot: f32,
}

fn load() -> Vec<Case> {
    let mut cases = load_file("ggml_dots.qdot");
    cases.extend(load_file("ggml_dots_iq4.qdot"));
    cases.extend(load_file("ggml_dots_iquants.qdot"));
    cases
}

/// The block formats of `quant::formats` (i-quants, ternary, MXFP4): their `vec_dot_ref` is
/// ggml's generic C, checked against `ggml_dots_iquants_generic.qdot` (the same cases as
/// `ggml_dots_iquants.qdot`, computed by `ggml_vec_dot_*_generic` called by name); their
/// `vec_dot` (portable, x86 order) is in [`BIT_EXACT`]. (`common::BLOCK_FORMATS` lists them.)

#[test]
fn block_formats_reference_is_ggml_generic_c_bit_for_bit() {
    let cases = load_file("ggml_dots_iquants_generic.qdot");
    let mut seen = std::collections::BTreeSet::new();
    for c in &cases {
        assert!(BLOCK_FORMATS.contains(&c.dtype), "{}", c.dtype);
        let at = vec_dot_type(c.dtype);
        let mut act = vec![0u8; at.row_bytes(c.n).unwrap()];
        quantize_row(at, &c.x, &mut act);
        assert_eq!(act, c.act, "{} n={}: {at} bytes", c.dtype, c.n);
        let v = vec_dot_ref(c.dtype, &c.w, &act, c.n);
        assert!(v.is_finite(), "{} n={}: {v}", c.dtype, c.n);
        assert_eq!(
            v.to_bits(),
            c.dot.to_bits(),
            "{} n={}: vec_dot_ref {v:e} vs ggml generic {:e}",
            c.dtype,
            c.n,
            c.dot
        );
        seen.insert(c.dtype.name());
    }
    assert_eq!(seen.len(), BLOCK_FORMATS.len(), "types covered: {seen:?}");
}

fn load_file(name: &str) -> Vec<Case> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quant")
        .join(name);
    let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&b[0..4], b"QDOT");
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let count = u32_at(4);
    let mut o = 8;
    let mut out = Vec::new();
    for _ in 0..count {
        let dtype = DType::from_ggml_id(u32_at(o) as u32).unwrap();
        let (n, wb, ab) = (u32_at(o + 4), u32_at(o + 8), u32_at(o + 12));
        o += 16;
        let w = b[o..o + wb].to_vec();
        o += wb;
        let x = b[o..o + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        o += 4 * n;
        let act = b[o..o + ab].to_vec();
        o += ab;
        let dot = f32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        o += 4;
        out.push(Case {
            dtype,
            n,
            w,
            x,
            act,
            dot,
        });
    }
    assert_eq!(o, b.len());
    out
}

#[test]
fn activation_quantization_matches_ggml() {
    for c in load() {
        let at = vec_dot_type(c.dtype);
        let mut ours = vec![0u8; at.row_bytes(c.n).unwrap()];
        quantize_row(at, &c.x, &mut ours);
        if at == DType::Q8_1 {
            assert_eq!(c.act.len(), c.n / 32 * 36);
            for (k, (g, o)) in c.act.chunks(36).zip(ours.chunks(40)).enumerate() {
                assert_eq!(g, &o[..36], "{} n={} Q8_1 block {k}", c.dtype, c.n);
                assert_eq!(&o[36..], &[0u8; 4], "padding");
            }
        } else {
            assert_eq!(ours, c.act, "{} n={}: {at} bytes differ", c.dtype, c.n);
        }
    }
}

#[test]
fn dot_products_match_ggml() {
    let mut exact = 0;
    for c in load() {
        let at = vec_dot_type(c.dtype);
        let mut act = vec![0u8; at.row_bytes(c.n).unwrap()];
        quantize_row(at, &c.x, &mut act);
        let ours = vec_dot(c.dtype, &c.w, &act, c.n);
        let lanes = vec_dot_lanes(c.dtype, &c.w, &act, c.n);
        let reference = vec_dot_ref(c.dtype, &c.w, &act, c.n);
        assert!(ours.is_finite() && lanes.is_finite() && c.dot.is_finite());
        if BIT_EXACT.contains(&c.dtype) {
            for (what, v) in [("vec_dot", ours), ("vec_dot_lanes", lanes)] {
                assert_eq!(
                    v.to_bits(),
                    c.dot.to_bits(),
                    "{} n={}: {what} {v:e} vs ggml {:e} (kernels: {:?})",
                    c.dtype,
                    c.n,
                    c.dot,
                    isa()
                );
            }
            exact += 1;
        }
        let mut wd = vec![0f32; c.n];
        let mut xd = vec![0f32; c.n];
        dequantize_row(c.dtype, &c.w, &mut wd);
        dequantize_row(at, &act, &mut xd);
        // Σ|w|·|x| bounds the summation error; weight mins here are ≤ |d|·63, so the |w| of
        // the dequantized values (plus 64·|dmin| slack per element) covers the min terms too.
        let mag: f64 = wd
            .iter()
            .zip(&xd)
            .map(|(&w, &x)| (w.abs() as f64 + 64.0 * 0.05) * x.abs() as f64)
            .sum();
        let k = if c.dtype.is_quantized() {
            c.n / c.dtype.block_size() + 16
        } else {
            c.n / 8 + 40
        };
        let tol = 4.0 * k as f64 * f32::EPSILON as f64 * mag;
        for (what, v) in [
            ("vec_dot", ours),
            ("vec_dot_lanes", lanes),
            ("vec_dot_ref", reference),
        ] {
            assert!(
                (v as f64 - c.dot as f64).abs() <= tol,
                "{} n={}: {what} {v:e} vs ggml {:e} (tol {tol:e})",
                c.dtype,
                c.n,
                c.dot
            );
        }
    }
    eprintln!(
        "{exact} dot products bit-identical to ggml, by vec_dot and vec_dot_lanes (kernels: {:?})",
        isa()
    );
}
