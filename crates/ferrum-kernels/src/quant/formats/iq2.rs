//! IQ2_XXS, IQ2_XS and IQ2_S: groups of 8 weights taken from a lattice of magnitudes
//! {0x08, 0x19, 0x2b}, each group with 8 sign bits, scaled per 32 (XXS) or per 16 (XS, S).
//!
//! Layouts (256 weights): IQ2_XXS `d: f16, qs: [u16; 32]` (per 32 weights two u32: four 8-bit
//! grid indices, then four 7-bit sign indices and a 4-bit scale); IQ2_XS `d, qs: [u16; 32]`
//! (9-bit grid index + 7-bit sign index each), `scales: [u8; 8]` (two 4-bit scales);
//! IQ2_S `d, qs: [u8; 64]` (32 low index bytes, then 32 sign bytes), `qh: [u8; 8]` (2 high
//! index bits per group), `scales: [u8; 8]`.

use super::grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID};
use super::{dot8, dot_scaled_lanes, grid8, ksigns, rd_u16, sign, store, BlockFormat};
use crate::quant::blocks::{rd_f16, rd_f32, Q8_K_QS};
use ferrum_core::DType;

pub(crate) struct Iq2Xxs;
pub(crate) struct Iq2Xs;
pub(crate) struct Iq2S;

const Q8K: usize = 292;

/// Signed group `g` of 8 (grid entry with its signs applied) as ints.
#[inline(always)]
fn signed(grid: u64, s: u8) -> [i32; 8] {
    let g = grid8(grid);
    std::array::from_fn(|j| g[j] as i32 * sign(s, j))
}

/// Writes `db · grid[j] · sign_j` for one group, in ggml's order (`db * grid[j] * ±1`).
#[inline(always)]
fn put8(y: &mut [f32], db: f32, grid: u64, s: u8) {
    let g = grid8(grid);
    for j in 0..8 {
        y[j] = db * g[j] as f32 * sign(s, j) as f32;
    }
}

/// IQ2_XXS's two words for 32 weights.
#[inline(always)]
fn xxs_words(b: &[u8], ib32: usize) -> (u32, u32) {
    let o = 2 + 8 * ib32;
    (
        u32::from_le_bytes(b[o..o + 4].try_into().unwrap()),
        u32::from_le_bytes(b[o + 4..o + 8].try_into().unwrap()),
    )
}

impl BlockFormat for Iq2Xxs {
    fn dtype(&self) -> DType {
        DType::IQ2_XXS
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = rd_f16(b, 0);
        for ib32 in 0..8 {
            let (idx, aux) = xxs_words(b, ib32);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
            for l in 0..4 {
                let grid = IQ2XXS_GRID[(idx >> (8 * l)) as usize & 255];
                let s = ksigns(aux >> (7 * l));
                put8(&mut y[32 * ib32 + 8 * l..], db, grid, s);
            }
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(66).zip(a.chunks_exact(Q8K)) {
            let d = rd_f16(bx, 0) * rd_f32(by, 0);
            let q8 = &by[Q8_K_QS..];
            let mut bsum = 0i32;
            for ib32 in 0..8 {
                let (idx, aux) = xxs_words(bx, ib32);
                let ls = 2 * (aux >> 28) as i32 + 1;
                let mut sumi = 0;
                for l in 0..4 {
                    let grid = IQ2XXS_GRID[(idx >> (8 * l)) as usize & 255];
                    let v = signed(grid, ksigns(aux >> (7 * l)));
                    sumi += dot8(&v, &q8[32 * ib32 + 8 * l..]);
                }
                bsum += sumi * ls;
            }
            sumf += d * bsum as f32;
        }
        0.125 * sumf
    }
    /// `ggml_vec_dot_iq2_xxs_q8_K`, AVX2: one scale per 32 weights.
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        dot_scaled_lanes(w, a, 66, 0.125, unpack_xxs)
    }
    fn tiled(&self, b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) -> Option<f32> {
        unpack_xxs(b, q, sc);
        Some(rd_f16(b, 0) * 0.125)
    }
}

impl BlockFormat for Iq2Xs {
    fn dtype(&self) -> DType {
        DType::IQ2_XS
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = rd_f16(b, 0);
        for ib32 in 0..8 {
            let sc = b[66 + ib32];
            let db = [
                d * (0.5 + (sc & 0xf) as f32) * 0.25,
                d * (0.5 + (sc >> 4) as f32) * 0.25,
            ];
            for l in 0..4 {
                let q = rd_u16(b, 2 + 2 * (4 * ib32 + l));
                let grid = IQ2XS_GRID[(q & 511) as usize];
                put8(
                    &mut y[32 * ib32 + 8 * l..],
                    db[l / 2],
                    grid,
                    ksigns(q as u32 >> 9),
                );
            }
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(74).zip(a.chunks_exact(Q8K)) {
            let d = rd_f16(bx, 0) * rd_f32(by, 0);
            let q8 = &by[Q8_K_QS..];
            let mut bsum = 0i32;
            for ib32 in 0..8 {
                let sc = bx[66 + ib32];
                let ls = [2 * (sc & 0xf) as i32 + 1, 2 * (sc >> 4) as i32 + 1];
                for half in 0..2 {
                    let mut sumi = 0;
                    for l in 2 * half..2 * half + 2 {
                        let q = rd_u16(bx, 2 + 2 * (4 * ib32 + l));
                        let v = signed(IQ2XS_GRID[(q & 511) as usize], ksigns(q as u32 >> 9));
                        sumi += dot8(&v, &q8[32 * ib32 + 8 * l..]);
                    }
                    bsum += sumi * ls[half];
                }
            }
            sumf += d * bsum as f32;
        }
        0.125 * sumf
    }
    /// `ggml_vec_dot_iq2_xs_q8_K`, AVX2: one scale per 16 weights.
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        dot_scaled_lanes(w, a, 74, 0.125, unpack_xs)
    }
    fn tiled(&self, b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) -> Option<f32> {
        unpack_xs(b, q, sc);
        Some(rd_f16(b, 0) * 0.125)
    }
}

/// IQ2_S field offsets.
const S_QS: usize = 2;
const S_SIGNS: usize = 34;
const S_QH: usize = 66;
const S_SCALES: usize = 74;

/// IQ2_S: the grid index of group l (0..4) of the 32 weights ib32.
#[inline(always)]
fn s_index(b: &[u8], ib32: usize, l: usize) -> usize {
    b[S_QS + 4 * ib32 + l] as usize | ((b[S_QH + ib32] as usize) << (8 - 2 * l) & 0x300)
}

impl BlockFormat for Iq2S {
    fn dtype(&self) -> DType {
        DType::IQ2_S
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = rd_f16(b, 0);
        for ib32 in 0..8 {
            let sc = b[S_SCALES + ib32];
            let db = [
                d * (0.5 + (sc & 0xf) as f32) * 0.25,
                d * (0.5 + (sc >> 4) as f32) * 0.25,
            ];
            for l in 0..4 {
                let grid = IQ2S_GRID[s_index(b, ib32, l)];
                let s = b[S_SIGNS + 4 * ib32 + l];
                put8(&mut y[32 * ib32 + 8 * l..], db[l / 2], grid, s);
            }
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(82).zip(a.chunks_exact(Q8K)) {
            let d = rd_f16(bx, 0) * rd_f32(by, 0);
            let q8 = &by[Q8_K_QS..];
            let mut bsum = 0i32;
            for ib32 in 0..8 {
                let sc = bx[S_SCALES + ib32];
                let ls = [1 + 2 * (sc & 0xf) as i32, 1 + 2 * (sc >> 4) as i32];
                let mut sumi = [0i32; 2];
                for l in 0..4 {
                    let v = signed(IQ2S_GRID[s_index(bx, ib32, l)], bx[S_SIGNS + 4 * ib32 + l]);
                    sumi[l / 2] += dot8(&v, &q8[32 * ib32 + 8 * l..]);
                }
                bsum += ls[0] * sumi[0] + ls[1] * sumi[1];
            }
            sumf += d * bsum as f32;
        }
        0.125 * sumf
    }
    /// `ggml_vec_dot_iq2_s_q8_K`, AVX2: one scale per 16 weights.
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        dot_scaled_lanes(w, a, 82, 0.125, unpack_s)
    }
    fn tiled(&self, b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) -> Option<f32> {
        unpack_s(b, q, sc);
        Some(rd_f16(b, 0) * 0.125)
    }
}

/// IQ2_XXS: the block's 256 signed weights (grid values with signs) and its 16 scales.
fn unpack_xxs(b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) {
    for ib32 in 0..8 {
        let (idx, aux) = xxs_words(b, ib32);
        sc[2 * ib32] = 2 * (aux >> 28) as i32 + 1;
        sc[2 * ib32 + 1] = sc[2 * ib32];
        for l in 0..4 {
            let grid = IQ2XXS_GRID[(idx >> (8 * l)) as usize & 255];
            store(q, ib32, l, &signed(grid, ksigns(aux >> (7 * l))));
        }
    }
}

/// IQ2_XS: as [`unpack_xxs`].
fn unpack_xs(b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) {
    for ib32 in 0..8 {
        let s = b[66 + ib32];
        sc[2 * ib32] = 2 * (s & 0xf) as i32 + 1;
        sc[2 * ib32 + 1] = 2 * (s >> 4) as i32 + 1;
        for l in 0..4 {
            let g = rd_u16(b, 2 + 2 * (4 * ib32 + l));
            let v = signed(IQ2XS_GRID[(g & 511) as usize], ksigns(g as u32 >> 9));
            store(q, ib32, l, &v);
        }
    }
}

/// IQ2_S: as [`unpack_xxs`].
fn unpack_s(b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) {
    for ib32 in 0..8 {
        let s = b[S_SCALES + ib32];
        sc[2 * ib32] = 1 + 2 * (s & 0xf) as i32;
        sc[2 * ib32 + 1] = 1 + 2 * (s >> 4) as i32;
        for l in 0..4 {
            let v = signed(IQ2S_GRID[s_index(b, ib32, l)], b[S_SIGNS + 4 * ib32 + l]);
            store(q, ib32, l, &v);
        }
    }
}
