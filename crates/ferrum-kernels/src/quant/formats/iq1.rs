//! IQ1_S and IQ1_M: groups of 8 weights in {-1, 0, 1} from a 2048-entry lattice, shifted by
//! ±1/8 and scaled.
//!
//! Layouts (256 weights): IQ1_S `d: f16, qs: [u8; 32]` (low 8 index bits per group),
//! `qh: [u16; 8]` (per 32 weights: four 3-bit index highs, a 3-bit scale, the shift's sign).
//! IQ1_M `qs: [u8; 32]`, `qh: [u8; 16]` (per 16 weights: two 3-bit index highs and two shift
//! signs), `scales: [u8; 8]` (as four u16: 3-bit scales per 16 weights, and in their top
//! nibbles the block's f16 scale).

use super::grids::IQ1S_GRID;
use super::{grid8, lanes256, rd_u16, BlockFormat};
use crate::quant::blocks::{rd_f16, rd_f32, rd_i16, Q8_K_BSUMS, Q8_K_QS};
use crate::quant::dot_lanes::{fma_lanes, hsum8};
use ferrum_core::DType;

pub(crate) struct Iq1S;
pub(crate) struct Iq1M;

const Q8K: usize = 292;
/// `IQ1S_DELTA` / `IQ1M_DELTA`.
const DELTA: f32 = 0.125;

#[inline(always)]
fn dot8(g: u64, q8: &[u8]) -> i32 {
    grid8(g)
        .iter()
        .zip(q8)
        .map(|(&a, &b)| a as i32 * b as i8 as i32)
        .sum()
}

/// IQ1_S: the 16-bit word of the 32 weights ib and the grid entry of its group l.
#[inline(always)]
fn s_group(b: &[u8], ib: usize, l: usize) -> u64 {
    let qh = rd_u16(b, 34 + 2 * ib) as usize;
    IQ1S_GRID[b[2 + 4 * ib + l] as usize | (((qh >> (3 * l)) & 7) << 8)]
}

impl BlockFormat for Iq1S {
    fn dtype(&self) -> DType {
        DType::IQ1_S
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = rd_f16(b, 0);
        for ib in 0..8 {
            let qh = rd_u16(b, 34 + 2 * ib);
            let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
            let delta = if qh & 0x8000 != 0 { -DELTA } else { DELTA };
            for l in 0..4 {
                let g = grid8(s_group(b, ib, l));
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] = dl * (g[j] as f32 + delta);
                }
            }
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(50).zip(a.chunks_exact(Q8K)) {
            let q8 = &by[Q8_K_QS..];
            let (mut sumi, mut sumi1) = (0i32, 0i32);
            for ib in 0..8 {
                let qh = rd_u16(bx, 34 + 2 * ib) as i32;
                let ls = 2 * ((qh >> 12) & 7) + 1;
                let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
                let mut lsum = 0;
                for l in 0..4 {
                    lsum += dot8(s_group(bx, ib, l), &q8[32 * ib + 8 * l..]);
                }
                sumi += ls * lsum;
                let bs = rd_i16(by, Q8_K_BSUMS + 4 * ib) as i32
                    + rd_i16(by, Q8_K_BSUMS + 4 * ib + 2) as i32;
                sumi1 += ls * delta * bs;
            }
            // Two multiply-adds, fused as the compiler fuses them in ggml's x86-64 build.
            let t = DELTA.mul_add(sumi1 as f32, sumi as f32);
            sumf = (rd_f16(bx, 0) * rd_f32(by, 0)).mul_add(t, sumf);
        }
        sumf
    }
    /// `ggml_vec_dot_iq1_s_q8_K`, AVX2: the lattice part in 8 lanes, `acc = fma(d, f32(lanes),
    /// acc)`; the shift part a scalar, `acc1 = fma(d, f32(Σ ls·sign·bsums), acc1)` (the build
    /// fuses it); result `hsum8(acc) + DELTA·acc1` (multiply, then add).
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut acc = [0f32; 8];
        let mut acc1 = 0f32;
        let (mut q, mut sc) = ([0i8; 256], [0i32; 16]);
        for (bx, by) in w.chunks_exact(50).zip(a.chunks_exact(Q8K)) {
            let mut sumi1 = 0i32;
            for ib in 0..8 {
                let qh = rd_u16(bx, 34 + 2 * ib) as i32;
                let ls = 2 * ((qh >> 12) & 7) + 1;
                sc[2 * ib] = ls;
                sc[2 * ib + 1] = ls;
                for l in 0..4 {
                    q[32 * ib + 8 * l..32 * ib + 8 * l + 8]
                        .copy_from_slice(&grid8(s_group(bx, ib, l)));
                }
                let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
                let bs = rd_i16(by, Q8_K_BSUMS + 4 * ib) as i32
                    + rd_i16(by, Q8_K_BSUMS + 4 * ib + 2) as i32;
                sumi1 += bs * delta * ls;
            }
            let d = rd_f32(by, 0) * rd_f16(bx, 0);
            fma_lanes(&mut acc, d, &lanes256(&q, &by[Q8_K_QS..], &sc));
            acc1 = d.mul_add(sumi1 as f32, acc1);
        }
        hsum8(&acc) + DELTA * acc1
    }
    /// Codes 8·g + δ (δ the block's shift sign), scale d/8.
    fn tiled(&self, b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) -> Option<f32> {
        for ib in 0..8 {
            let qh = rd_u16(b, 34 + 2 * ib) as i32;
            let ls = 2 * ((qh >> 12) & 7) + 1;
            sc[2 * ib] = ls;
            sc[2 * ib + 1] = ls;
            let delta: i8 = if qh & 0x8000 != 0 { -1 } else { 1 };
            for l in 0..4 {
                let g = grid8(s_group(b, ib, l));
                for j in 0..8 {
                    q[32 * ib + 8 * l + j] = 8 * g[j] + delta;
                }
            }
        }
        Some(rd_f16(b, 0) * 0.125)
    }
}

/// IQ1_M's four u16 scale words.
#[inline(always)]
fn m_scales(b: &[u8]) -> [u16; 4] {
    std::array::from_fn(|i| rd_u16(b, 48 + 2 * i))
}

/// IQ1_M's f16 block scale, spread over the top nibbles of the scale words.
#[inline(always)]
fn m_d(sc: &[u16; 4]) -> f32 {
    let bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
    half::f16::from_bits(bits).to_f32()
}

/// IQ1_M: the two scale multipliers (1 + 2·s) of the 32 weights ib (first and second 16).
#[inline(always)]
fn m_ls(sc: &[u16; 4], ib: usize) -> [i32; 2] {
    let w = sc[ib / 2] as i32;
    let shift = 6 * (ib % 2) as i32;
    [2 * ((w >> shift) & 7) + 1, 2 * ((w >> (shift + 3)) & 7) + 1]
}

/// IQ1_M: the grid entries and shift signs (-1 or 1) of the four groups of the 32 weights ib.
#[inline(always)]
fn m_groups(b: &[u8], ib: usize) -> [(u64, i32); 4] {
    let qs = &b[4 * ib..];
    let qh = &b[32 + 2 * ib..];
    std::array::from_fn(|l| {
        let h = qh[l / 2] as usize;
        let (hi, neg) = if l % 2 == 0 {
            ((h << 8) & 0x700, h & 0x08 != 0)
        } else {
            ((h << 4) & 0x700, h & 0x80 != 0)
        };
        (IQ1S_GRID[qs[l] as usize | hi], if neg { -1 } else { 1 })
    })
}

impl BlockFormat for Iq1M {
    fn dtype(&self) -> DType {
        DType::IQ1_M
    }
    fn dot_type(&self) -> DType {
        DType::Q8_K
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let sc = m_scales(b);
        let d = m_d(&sc);
        for ib in 0..8 {
            let ls = m_ls(&sc, ib);
            let dl = [d * ls[0] as f32, d * ls[1] as f32];
            for (l, (g, s)) in m_groups(b, ib).into_iter().enumerate() {
                let g = grid8(g);
                let delta = s as f32 * DELTA;
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] = dl[l / 2] * (g[j] as f32 + delta);
                }
            }
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(56).zip(a.chunks_exact(Q8K)) {
            let sc = m_scales(bx);
            let q8 = &by[Q8_K_QS..];
            let (mut sumi1, mut sumi2) = (0i32, 0i32);
            for ib in 0..8 {
                let (mut s1, mut s2) = ([0i32; 2], [0i32; 2]);
                for (l, (g, delta)) in m_groups(bx, ib).into_iter().enumerate() {
                    let y8 = &q8[32 * ib + 8 * l..32 * ib + 8 * l + 8];
                    s1[l / 2] += dot8(g, y8);
                    s2[l / 2] += y8.iter().map(|&v| v as i8 as i32).sum::<i32>() * delta;
                }
                let ls = m_ls(&sc, ib);
                sumi1 += s1[0] * ls[0] + s1[1] * ls[1];
                sumi2 += s2[0] * ls[0] + s2[1] * ls[1];
            }
            // Fused as in `Iq1S::dot`.
            let t = DELTA.mul_add(sumi2 as f32, sumi1 as f32);
            sumf = (m_d(&sc) * rd_f32(by, 0)).mul_add(t, sumf);
        }
        sumf
    }
    /// `ggml_vec_dot_iq1_m_q8_K`, AVX2: the lattice part and the shift part (±1 per 8 weights
    /// times the activations) in two sets of 8 lanes, each `acc = fma(d, f32(lanes), acc)`;
    /// result `fma(hsum8(acc2), DELTA, hsum8(acc1))` (the build fuses it).
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        let (mut acc1, mut acc2) = ([0f32; 8], [0f32; 8]);
        let (mut q, mut qd, mut sc) = ([0i8; 256], [0i8; 256], [0i32; 16]);
        for (bx, by) in w.chunks_exact(56).zip(a.chunks_exact(Q8K)) {
            let scales = m_scales(bx);
            for ib in 0..8 {
                let ls = m_ls(&scales, ib);
                sc[2 * ib] = ls[0];
                sc[2 * ib + 1] = ls[1];
                for (l, (g, delta)) in m_groups(bx, ib).into_iter().enumerate() {
                    let at = 32 * ib + 8 * l;
                    q[at..at + 8].copy_from_slice(&grid8(g));
                    qd[at..at + 8].fill(delta as i8);
                }
            }
            let y = &by[Q8_K_QS..];
            let d = rd_f32(by, 0) * m_d(&scales);
            fma_lanes(&mut acc1, d, &lanes256(&q, y, &sc));
            fma_lanes(&mut acc2, d, &lanes256(&qd, y, &sc));
        }
        hsum8(&acc2).mul_add(DELTA, hsum8(&acc1))
    }
    /// Codes 8·g + δ (δ the shift sign of each 8), scale d/8.
    fn tiled(&self, b: &[u8], q: &mut [i8; 256], sc: &mut [i32; 16]) -> Option<f32> {
        let scales = m_scales(b);
        for ib in 0..8 {
            let ls = m_ls(&scales, ib);
            sc[2 * ib] = ls[0];
            sc[2 * ib + 1] = ls[1];
            for (l, (g, delta)) in m_groups(b, ib).into_iter().enumerate() {
                let g = grid8(g);
                for j in 0..8 {
                    q[32 * ib + 8 * l + j] = 8 * g[j] + delta as i8;
                }
            }
        }
        Some(m_d(&scales) * 0.125)
    }
}
