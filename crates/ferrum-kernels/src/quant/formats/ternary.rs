//! TQ1_0 and TQ2_0: ternary weights {-1, 0, 1} times an f16 scale (BitNet b1.58 models).
//!
//! Layouts (256 weights): TQ1_0 `qs: [u8; 48], qh: [u8; 4], d: f16`: five trits per byte as a
//! fixed-point fraction (trit n of byte q is `((q·3^n mod 256)·3) >> 8`), bytes 0..32 giving
//! weights in runs of 32 per trit, bytes 32..48 in runs of 16, and `qh` the last 16 weights
//! (four trits per byte); TQ2_0 `qs: [u8; 64], d: f16`: 2 bits per weight, value - 1.

use super::BlockFormat;
use crate::quant::blocks::{rd_f16, rd_f32, rd_i16, Q8_K_BSUMS, Q8_K_QS};
use crate::quant::dot_lanes::{fma_lanes, hsum8};
use ferrum_core::DType;

pub(crate) struct Tq1_0;
pub(crate) struct Tq2_0;

const Q8K: usize = 292;
const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// Trit n (0, 1, 2) of a TQ1_0 byte.
#[inline(always)]
fn trit(q: u8, n: usize) -> i32 {
    let q = q.wrapping_mul(POW3[n]);
    ((q as u16 * 3) >> 8) as i32
}

/// The 256 ternary values (-1, 0, 1) of a TQ1_0 block, in weight order.
#[inline(always)]
fn tq1_values(b: &[u8]) -> [i8; 256] {
    let mut v = [0i8; 256];
    for n in 0..5 {
        for m in 0..32 {
            v[32 * n + m] = (trit(b[m], n) - 1) as i8;
        }
        for m in 0..16 {
            v[160 + 16 * n + m] = (trit(b[32 + m], n) - 1) as i8;
        }
    }
    for n in 0..4 {
        for j in 0..4 {
            v[240 + 4 * n + j] = (trit(b[48 + j], n) - 1) as i8;
        }
    }
    v
}

/// The 256 values (-1, 0, 1) of a TQ2_0 block, in weight order.
#[inline(always)]
fn tq2_values(b: &[u8]) -> [i8; 256] {
    let mut v = [0i8; 256];
    for half in 0..2 {
        for l in 0..4 {
            for k in 0..32 {
                v[128 * half + 32 * l + k] = ((b[32 * half + k] >> (2 * l)) & 3) as i8 - 1;
            }
        }
    }
    v
}

/// llama.cpp's AVX2 lanes of a ternary block (`ggml_vec_dot_tq1_0_q8_K` / `tq2_0`): the
/// unsigned codes u = v + 1 times the activations, 32 weights at a time, summed in 16-bit pairs,
/// less the activation block sums (bsum p from the pair p), then pairs of those into 8 lanes:
/// lane t = Σ over the elements e with (e mod 32) / 4 = t of u[e]·y[e] − bsum[2t] − bsum[2t+1].
#[inline(always)]
fn ternary_lanes(v: &[i8; 256], by: &[u8]) -> [i32; 8] {
    let y = &by[Q8_K_QS..Q8_K_QS + 256];
    let mut out = [0i32; 8];
    for (e, (&v, &y)) in v.iter().zip(y).enumerate() {
        out[(e % 32) / 4] += (v as i32 + 1) * y as i8 as i32;
    }
    for (t, o) in out.iter_mut().enumerate() {
        *o -= rd_i16(by, Q8_K_BSUMS + 4 * t) as i32 + rd_i16(by, Q8_K_BSUMS + 4 * t + 2) as i32;
    }
    out
}

/// Per block `acc = fma(f32(lanes), d_x·d_w, acc)` (the build fuses its multiply and add);
/// result `hsum8(acc)`.
#[inline(always)]
fn dot_ternary_x86(
    w: &[u8],
    a: &[u8],
    block_bytes: usize,
    d_at: usize,
    values: impl Fn(&[u8]) -> [i8; 256],
) -> f32 {
    let mut acc = [0f32; 8];
    for (bx, by) in w.chunks_exact(block_bytes).zip(a.chunks_exact(Q8K)) {
        let d = rd_f32(by, 0) * rd_f16(bx, d_at);
        fma_lanes(&mut acc, d, &ternary_lanes(&values(bx), by));
    }
    hsum8(&acc)
}

#[inline(always)]
fn isum(v: &[i8; 256], q8: &[u8]) -> i32 {
    v.iter()
        .zip(q8)
        .map(|(&a, &b)| a as i32 * b as i8 as i32)
        .sum()
}

impl BlockFormat for Tq1_0 {
    fn dtype(&self) -> DType {
        DType::TQ1_0
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = rd_f16(b, 52);
        for (o, &q) in y.iter_mut().zip(&tq1_values(b)) {
            *o = q as f32 * d;
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(54).zip(a.chunks_exact(Q8K)) {
            let sum = isum(&tq1_values(bx), &by[Q8_K_QS..]);
            sumf += sum as f32 * (rd_f16(bx, 52) * rd_f32(by, 0));
        }
        sumf
    }
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        dot_ternary_x86(w, a, 54, 52, tq1_values)
    }
}

impl BlockFormat for Tq2_0 {
    fn dtype(&self) -> DType {
        DType::TQ2_0
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = rd_f16(b, 64);
        for (o, &q) in y.iter_mut().zip(&tq2_values(b)) {
            *o = q as f32 * d;
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(66).zip(a.chunks_exact(Q8K)) {
            let sumi = isum(&tq2_values(bx), &by[Q8_K_QS..]);
            sumf += sumi as f32 * (rd_f32(by, 0) * rd_f16(bx, 64));
        }
        sumf
    }
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        dot_ternary_x86(w, a, 66, 64, tq2_values)
    }
}
