//! IQ3_XXS and IQ3_S: groups of 4 weights from a lattice of 8 (XXS: even, 4..62) or odd
//! (S: 1..15) magnitudes, signs per 8 weights, scaled per 32.
//!
//! Layouts (256 weights): IQ3_XXS `d: f16, qs: [u8; 96]`: 64 grid indices, then per 32 weights
//! a u32 of four 7-bit sign indices and a 4-bit scale. IQ3_S `d, qs: [u8; 64]` (low 8 index
//! bits), `qh: [u8; 8]` (ninth bits), `signs: [u8; 32]`, `scales: [u8; 4]` (two 4-bit scales).

use super::grids::{IQ3S_GRID, IQ3XXS_GRID};
use super::{dot8, dot_scaled_lanes, grid4, ksigns, sign, store, BlockFormat};
use crate::quant::blocks::{rd_f16, rd_f32, rd_u32, Q8_K_QS};
use ferrum_core::DType;

pub(crate) struct Iq3Xxs;
pub(crate) struct Iq3S;

const Q8K: usize = 292;

/// Two grid entries (8 weights) with signs `s`, as ints.
#[inline(always)]
fn signed(g1: u32, g2: u32, s: u8) -> [i32; 8] {
    let (a, b) = (grid4(g1), grid4(g2));
    std::array::from_fn(|j| {
        let g = if j < 4 { a[j] } else { b[j - 4] };
        g as i32 * sign(s, j)
    })
}

/// `db · grid · sign` for 8 weights in ggml's order (elements j and j + 4 interleaved by j, which
/// changes nothing: each output is its own product).
#[inline(always)]
fn put8(y: &mut [f32], db: f32, g1: u32, g2: u32, s: u8) {
    let (a, b) = (grid4(g1), grid4(g2));
    for j in 0..4 {
        y[j] = db * a[j] as f32 * sign(s, j) as f32;
        y[j + 4] = db * b[j] as f32 * sign(s, j + 4) as f32;
    }
}

impl BlockFormat for Iq3Xxs {
    fn dtype(&self) -> DType {
        DType::IQ3_XXS
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = rd_f16(b, 0);
        for ib32 in 0..8 {
            let aux = rd_u32(b, 2 + 64 + 4 * ib32);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            for l in 0..4 {
                let q = &b[2 + 8 * ib32 + 2 * l..];
                let (g1, g2) = (IQ3XXS_GRID[q[0] as usize], IQ3XXS_GRID[q[1] as usize]);
                put8(
                    &mut y[32 * ib32 + 8 * l..],
                    db,
                    g1,
                    g2,
                    ksigns(aux >> (7 * l)),
                );
            }
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(98).zip(a.chunks_exact(Q8K)) {
            let d = rd_f16(bx, 0) * rd_f32(by, 0);
            let q8 = &by[Q8_K_QS..];
            let mut bsum = 0i32;
            for ib32 in 0..8 {
                let aux = rd_u32(bx, 2 + 64 + 4 * ib32);
                let ls = 2 * (aux >> 28) as i32 + 1;
                let mut sumi = 0;
                for l in 0..4 {
                    let q = &bx[2 + 8 * ib32 + 2 * l..];
                    let v = signed(
                        IQ3XXS_GRID[q[0] as usize],
                        IQ3XXS_GRID[q[1] as usize],
                        ksigns(aux >> (7 * l)),
                    );
                    sumi += dot8(&v, &q8[32 * ib32 + 8 * l..]);
                }
                bsum += sumi * ls;
            }
            sumf += d * bsum as f32;
        }
        0.25 * sumf
    }
    /// `ggml_vec_dot_iq3_xxs_q8_K`, AVX2: one scale per 32 weights.
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        dot_scaled_lanes(w, a, 98, 0.25, unpack_xxs)
    }
    fn tiled(&self, b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) -> Option<f32> {
        unpack_xxs(b, q, sc);
        Some(rd_f16(b, 0) * 0.25)
    }
}

/// IQ3_S field offsets.
const S_QS: usize = 2;
const S_QH: usize = 66;
const S_SIGNS: usize = 74;
const S_SCALES: usize = 106;

/// IQ3_S: the two grid entries and the sign byte of group l (0..4) of the 32 weights ib32.
#[inline(always)]
fn s_group(b: &[u8], ib32: usize, l: usize) -> (u32, u32, u8) {
    let qs = &b[S_QS + 8 * ib32 + 2 * l..];
    let qh = b[S_QH + ib32] as usize;
    let i1 = qs[0] as usize | ((qh << (8 - 2 * l)) & 256);
    let i2 = qs[1] as usize | ((qh << (7 - 2 * l)) & 256);
    (IQ3S_GRID[i1], IQ3S_GRID[i2], b[S_SIGNS + 4 * ib32 + l])
}

/// IQ3_S: the scale multiplier 1 + 2·s of the 32 weights ib32.
#[inline(always)]
fn s_scale(b: &[u8], ib32: usize) -> i32 {
    let sc = b[S_SCALES + ib32 / 2];
    let s = if ib32.is_multiple_of(2) {
        sc & 0xf
    } else {
        sc >> 4
    };
    1 + 2 * s as i32
}

impl BlockFormat for Iq3S {
    fn dtype(&self) -> DType {
        DType::IQ3_S
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = rd_f16(b, 0);
        for ib32 in 0..8 {
            let db = d * s_scale(b, ib32) as f32;
            for l in 0..4 {
                let (g1, g2, s) = s_group(b, ib32, l);
                put8(&mut y[32 * ib32 + 8 * l..], db, g1, g2, s);
            }
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(110).zip(a.chunks_exact(Q8K)) {
            let d = rd_f16(bx, 0) * rd_f32(by, 0);
            let q8 = &by[Q8_K_QS..];
            let mut bsum = 0i32;
            for ib32 in 0..8 {
                let mut sumi = 0;
                for l in 0..4 {
                    let (g1, g2, s) = s_group(bx, ib32, l);
                    sumi += dot8(&signed(g1, g2, s), &q8[32 * ib32 + 8 * l..]);
                }
                bsum += sumi * s_scale(bx, ib32);
            }
            sumf += d * bsum as f32;
        }
        sumf
    }
    /// `ggml_vec_dot_iq3_s_q8_K`, AVX2: one scale per 32 weights.
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        dot_scaled_lanes(w, a, 110, 1.0, unpack_s)
    }
    fn tiled(&self, b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) -> Option<f32> {
        unpack_s(b, q, sc);
        Some(rd_f16(b, 0))
    }
}

/// IQ3_XXS: the block's 256 signed weights and its 16 scales (one per 32, twice).
fn unpack_xxs(b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) {
    for ib32 in 0..8 {
        let aux = rd_u32(b, 2 + 64 + 4 * ib32);
        sc[2 * ib32] = 2 * (aux >> 28) as i32 + 1;
        sc[2 * ib32 + 1] = sc[2 * ib32];
        for l in 0..4 {
            let g = &b[2 + 8 * ib32 + 2 * l..];
            let v = signed(
                IQ3XXS_GRID[g[0] as usize],
                IQ3XXS_GRID[g[1] as usize],
                ksigns(aux >> (7 * l)),
            );
            store(q, ib32, l, &v);
        }
    }
}

/// IQ3_S: as [`unpack_xxs`].
fn unpack_s(b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) {
    for ib32 in 0..8 {
        sc[2 * ib32] = s_scale(b, ib32);
        sc[2 * ib32 + 1] = sc[2 * ib32];
        for l in 0..4 {
            let (g1, g2, s) = s_group(b, ib32, l);
            store(q, ib32, l, &signed(g1, g2, s));
        }
    }
}
