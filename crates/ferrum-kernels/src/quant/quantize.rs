//! Scalar activation quantizers, bit-exact with llama.cpp's x86 build:
//! * Q8_0 / Q8_1 (`arch/x86/quants.c quantize_row_q8_0/_1`): amax over 32, d = amax/127 stored as
//!   f16, multiplier 127/amax in f32 (0 for an all-zero block), q = round-half-to-even(x*mult)
//!   saturated to i8; Q8_1 also stores s = f16(d * Σq) with the f32 d.
//! * Q8_K (`quantize_row_q8_K_ref`): the element of largest |x| (first wins) keeps its sign as
//!   `max`; iscale = -127/max; q = min(127, nearest_int(iscale*x)) (ties to even); d = 1/iscale;
//!   bsums = sums of 16. All-zero block: d = 0, qs = 0, bsums = 0.
//! * F16 / BF16: round to nearest even; F32: copy.
//! * Q4_0 (a KV-cache format, `quantize_row_q4_0_ref`): d = max/-8, q = min(15, trunc(x/d + 8.5)).
//!
//! Q8_1 blocks are 40 bytes here (`DType::Q8_1.block_bytes()`, as gguf-py's size table says):
//! ggml's current `block_q8_1` is 36 bytes (d, s, qs[32]); the 4 trailing bytes are zero padding.
//! Q8_1 never appears in model files, so only the in-memory activation buffers see this.

use super::blocks::*;
use ferrum_core::DType;

/// Quantizes a row; lengths were checked by the caller.
pub(crate) fn quantize(dtype: DType, src: &[f32], dst: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (c, &x) in dst.chunks_exact_mut(4).zip(src) {
                c.copy_from_slice(&x.to_le_bytes());
            }
        }
        DType::F16 => {
            for (c, &x) in dst.chunks_exact_mut(2).zip(src) {
                c.copy_from_slice(&f32_to_f16_bits(x).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (c, &x) in dst.chunks_exact_mut(2).zip(src) {
                c.copy_from_slice(&f32_to_bf16_bits(x).to_le_bytes());
            }
        }
        DType::Q8_0 => {
            for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
                quantize_block_q8_0(x.try_into().unwrap(), b, false);
            }
        }
        DType::Q8_1 => {
            for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(40)) {
                quantize_block_q8_0(x.try_into().unwrap(), b, true);
            }
        }
        DType::Q8_K => {
            for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(292)) {
                quantize_block_q8_k(x.try_into().unwrap(), b);
            }
        }
        DType::Q4_0 => {
            for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(18)) {
                quantize_block_q4_0(x.try_into().unwrap(), b);
            }
        }
        other => panic!(
            "quantize_row: {other} is not an activation or cache format (F32, F16, BF16, Q8_0, \
             Q8_1, Q8_K, Q4_0)"
        ),
    }
}

/// One Q8_0 block (34 bytes) or, with `with_sum`, one Q8_1 block (40 bytes).
#[inline]
pub(crate) fn quantize_block_q8_0(x: &[f32; QK], b: &mut [u8], with_sum: bool) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    b[0..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
    let qs_off = if with_sum { Q8_1_QS } else { Q8_0_QS };
    let mut sum = 0i32;
    for (o, &v) in b[qs_off..qs_off + QK].iter_mut().zip(x) {
        let q = (v * id).round_ties_even().clamp(-128.0, 127.0) as i32;
        sum += q;
        *o = q as i8 as u8;
    }
    if with_sum {
        let s = d * sum as f32;
        b[2..4].copy_from_slice(&f32_to_f16_bits(s).to_le_bytes());
        b[Q8_1_QS + QK..].fill(0);
    }
}

/// One Q4_0 block (18 bytes), as `quantize_row_q4_0_ref` makes it (a KV cache of type Q4_0 is
/// written so): the element of largest |x| (first wins) keeps its sign as `max`, d = max / -8,
/// q = min(15, trunc(x/d + 8.5)); low nibbles hold elements 0..16, high nibbles 16..32.
#[inline]
pub(crate) fn quantize_block_q4_0(x: &[f32; QK], b: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[0..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
    let code = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    for j in 0..QK / 2 {
        b[Q4_0_QS + j] = code(x[j]) | (code(x[QK / 2 + j]) << 4);
    }
}

/// ggml's `nearest_int` (the 1.5*2^23 trick): round to nearest, ties to even, for |v| < 2^22.
#[inline(always)]
pub(crate) fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// One Q8_K block (292 bytes).
#[inline]
pub(crate) fn quantize_block_q8_k(x: &[f32; QK_K], b: &mut [u8]) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        let a = v.abs();
        if a > amax {
            amax = a;
            max = v;
        }
    }
    if amax == 0.0 {
        b.fill(0);
        return;
    }
    let iscale = -127.0f32 / max;
    for (o, &v) in b[Q8_K_QS..Q8_K_QS + QK_K].iter_mut().zip(x) {
        *o = nearest_int(iscale * v).min(127) as i8 as u8;
    }
    for g in 0..16 {
        let s: i32 = b[Q8_K_QS + 16 * g..Q8_K_QS + 16 * g + 16]
            .iter()
            .map(|&q| q as i8 as i32)
            .sum();
        let off = Q8_K_BSUMS + 2 * g;
        b[off..off + 2].copy_from_slice(&(s as i16).to_le_bytes());
    }
    b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}
