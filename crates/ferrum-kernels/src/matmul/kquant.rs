//! AVX-512 VNNI prompt kernels for Q4_K and Q6_K weights, in the float orders llama.cpp's prefill
//! uses for them ([`Order::Q4kGemm`], [`Order::Q4kGemv`], [`Order::Q6kTiled`]).
//!
//! Those orders are exact integer sums per super-block (Q4_K: per 64-element chunk) followed by a
//! few scalar FMAs, so the integer part may be computed any way at all. Here each task unpacks 4
//! weight rows once into plain signed bytes (Q4_K 0..15, Q6_K -32..31) with per-lane scale
//! vectors, then walks the tokens: per super-block, 4 VNNI dot products of 64 bytes, scaled per
//! lane, reduced, and finished by the scalar epilogue of [`crate::quant`]'s reference for that
//! order. Results equal `vec_dot_q4k_gemm_order` / `vec_dot_q4k_repacked` /
//! `vec_dot_q6k_tiled_order` bit for bit (tests/matmul_tiles.rs).

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts

use core::arch::x86_64::*;

use ferrum_core::DType;

use super::{Order, OutPtr, WeightRef};
use crate::quant::blocks::{rd_f16, rd_f32, scale_min_k4, unpack_q4k, unpack_q6k};
use crate::quant::QK_K;

/// Q8_K block: d (f32), 256 quants, 16 bsums (i16).
const Q8K_BYTES: usize = 292;
const ROWS: usize = 4;

/// Whether these kernels take a product of `dtype` with these per-token orders.
pub fn supports(dtype: DType, orders: &[Order]) -> bool {
    super::avx512::available()
        && match dtype {
            DType::Q6_K => orders.iter().all(|&o| o == Order::Q6kTiled),
            DType::Q4_K => orders
                .iter()
                .all(|&o| matches!(o, Order::Q4kGemm | Order::Q4kGemv)),
            _ => false,
        }
}

/// One weight row unpacked: quants as signed bytes (Q4_K 0..15, Q6_K -32..31), per-lane start
/// values `-128·Σ w` over each 4 bytes (the activations enter VNNI as unsigned `a + 128`), per
/// super-block lane scales and floats.
struct Unpacked {
    q: Vec<u8>,
    corr: Vec<i32>,
    /// Per super-block, 4 vectors of 16 i32: the scale of each lane's sub-block.
    scales: Vec<i32>,
    /// Q4_K: per super-block the 8 mins (16 slots; Q6_K leaves them unused).
    aux: Vec<i32>,
    /// Per super-block: d, and dmin (Q4_K).
    d: Vec<f32>,
    dmin: Vec<f32>,
}

impl Unpacked {
    fn new(nsb: usize) -> Self {
        Unpacked {
            q: vec![0; nsb * QK_K],
            corr: vec![0; nsb * 64],
            scales: vec![0; nsb * 64],
            aux: vec![0; nsb * 16],
            d: vec![0.0; nsb],
            dmin: vec![0.0; nsb],
        }
    }

    fn fill(&mut self, dtype: DType, row: &[u8]) {
        let bb = dtype.block_bytes();
        let mut q = [0i8; QK_K];
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            let co = &mut self.corr[b * 64..(b + 1) * 64];
            let qo = &mut self.q[b * QK_K..(b + 1) * QK_K];
            let so = &mut self.scales[b * 64..(b + 1) * 64];
            let ao = &mut self.aux[b * 16..(b + 1) * 16];
            if dtype == DType::Q4_K {
                unpack_q4k(blk, &mut q);
                for (o, &v) in qo.iter_mut().zip(&q) {
                    *o = v as u8;
                }
                let (sc, m) = scale_min_k4(&blk[4..16]);
                // Lane i of chunk p covers elements 64p + 4i .. + 4: sub-block 2p + i / 8.
                for p in 0..4 {
                    for i in 0..16 {
                        so[16 * p + i] = sc[2 * p + i / 8] as i32;
                    }
                }
                for j in 0..8 {
                    ao[j] = m[j] as i32;
                }
                self.d[b] = rd_f16(blk, 0);
                self.dmin[b] = rd_f16(blk, 2);
            } else {
                unpack_q6k(blk, &mut q);
                for (o, &v) in qo.iter_mut().zip(&q) {
                    *o = v as u8;
                }
                // Sub-blocks of 16 elements: lane i of chunk p is sub-block 4p + i / 4.
                for p in 0..4 {
                    for i in 0..16 {
                        so[16 * p + i] = blk[192 + 4 * p + i / 4] as i8 as i32;
                    }
                }
                self.d[b] = rd_f16(blk, 208);
            }
            for (lane, c) in co.iter_mut().enumerate() {
                let w: i32 = qo[4 * lane..4 * lane + 4]
                    .iter()
                    .map(|&v| v as i8 as i32)
                    .sum();
                *c = -128 * w;
            }
        }
    }
}

/// `y[tok, r]` for every token of `act` (`t` rows of Q8_K, `ab` bytes each) and every row of `w`.
pub fn matmul_k(w: &WeightRef, act: &[u8], ab: usize, t: usize, orders: &[Order], y: &mut [f32]) {
    assert!(supports(w.dtype, orders), "matmul_k: {}", w.dtype);
    let (rows, cols) = (w.rows, w.cols);
    let nsb = cols / QK_K;
    assert_eq!(ab, nsb * Q8K_BYTES, "matmul_k: activation row bytes");
    assert!(act.len() >= t * ab && orders.len() == t && y.len() == t * rows);
    let rb = w.row_bytes();
    let out = OutPtr(y.as_mut_ptr());
    crate::pool::parallel_for(rows.div_ceil(ROWS), |task| {
        let r0 = task * ROWS;
        let n = ROWS.min(rows - r0);
        let mut un: Vec<Unpacked> = (0..n).map(|_| Unpacked::new(nsb)).collect();
        for (i, u) in un.iter_mut().enumerate() {
            u.fill(w.dtype, &w.data[(r0 + i) * rb..(r0 + i + 1) * rb]);
        }
        // A last task of fewer than 4 rows repeats its last row; the extra results are dropped.
        let rows4: [&Unpacked; ROWS] = core::array::from_fn(|i| &un[i.min(n - 1)]);
        for tok in 0..t {
            let a = &act[tok * ab..(tok + 1) * ab];
            // SAFETY: `supports` checked AVX-512 VNNI; each row and `a` hold nsb super-blocks.
            let v = unsafe { rows4_k(w.dtype, rows4, a, nsb, orders[tok] == Order::Q4kGemm) };
            for (i, &val) in v[..n].iter().enumerate() {
                // SAFETY: tok < t and r0 + i < rows: inside `y`; only this task writes row r0 + i.
                unsafe { *out.at(tok * rows + r0 + i) = val };
            }
        }
    });
}

/// The 16 bsums (Σ of each 16 activations) of a Q8_K block.
#[inline(always)]
fn bsums(by: &[u8]) -> [i32; 16] {
    let b: &[u8; 32] = by[260..292].try_into().unwrap();
    let mut out = [0i32; 16];
    for g in 0..16 {
        out[g] = i16::from_le_bytes([b[2 * g], b[2 * g + 1]]) as i32;
    }
    out
}

/// `aux[i]` of the 4 rows as one vector.
#[inline(always)]
fn mins4(u: &[&Unpacked; ROWS], i: usize) -> __m128i {
    // SAFETY: SSE2 is part of the x86_64 baseline.
    unsafe { _mm_setr_epi32(u[0].aux[i], u[1].aux[i], u[2].aux[i], u[3].aux[i]) }
}

/// 4 rows x one token: the integer sums of the 4 rows' chunks reduced together, and the float
/// epilogue run on the 4 rows as the lanes of one vector, each lane doing exactly the scalar
/// operations of the order's reference (`quant::vec_dot_q4k_gemm_order_ref`,
/// `vec_dot_q4k_repacked_ref`, `vec_dot_q6k_tiled_order_ref`) for its row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
fn rows4_k(dtype: DType, u: [&Unpacked; ROWS], a: &[u8], nsb: usize, gemm: bool) -> [f32; ROWS] {
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let mut acc = _mm_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for b in 0..nsb {
        let by = &a[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
        let qa = &by[4..4 + QK_K];
        // v[p][r]: chunk p of row r, 16 lanes of scale * Σ4 a·w.
        let mut ip = [_mm_setzero_si128(); 4];
        for p in 0..4 {
            // SAFETY: 64 bytes at 64p of the 256 quants.
            let av = unsafe { _mm512_loadu_si512(qa.as_ptr().add(64 * p) as *const _) };
            let av = _mm512_xor_si512(av, flip);
            let mut v = [_mm512_setzero_si512(); ROWS];
            for r in 0..ROWS {
                let o = b * QK_K + 64 * p;
                let os = b * 64 + 16 * p;
                // SAFETY: `u[r]` holds nsb super-blocks: q[o..o+64], scales/corr[os..os+16].
                unsafe {
                    let wv = _mm512_loadu_si512(u[r].q.as_ptr().add(o) as *const _);
                    let s = _mm512_loadu_si512(u[r].scales.as_ptr().add(os) as *const _);
                    let c = _mm512_loadu_si512(u[r].corr.as_ptr().add(os) as *const _);
                    v[r] = _mm512_mullo_epi32(_mm512_dpbusd_epi32(c, av, wv), s);
                }
            }
            // The 4 rows' 16-lane vectors to [row0, row1, row2, row3] sums (integers: exact).
            let t0 = _mm512_add_epi32(
                _mm512_unpacklo_epi32(v[0], v[1]),
                _mm512_unpackhi_epi32(v[0], v[1]),
            );
            let t1 = _mm512_add_epi32(
                _mm512_unpacklo_epi32(v[2], v[3]),
                _mm512_unpackhi_epi32(v[2], v[3]),
            );
            let u4 = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
            let h = _mm256_add_epi32(
                _mm512_castsi512_si256(u4),
                _mm512_extracti64x4_epi64::<1>(u4),
            );
            ip[p] = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        }
        let dy = _mm_set1_ps(rd_f32(by, 0));
        let d = _mm_setr_ps(u[0].d[b], u[1].d[b], u[2].d[b], u[3].d[b]);
        if dtype == DType::Q6_K {
            let s = _mm_add_epi32(_mm_add_epi32(ip[0], ip[1]), _mm_add_epi32(ip[2], ip[3]));
            let r = _mm_mul_ps(_mm_cvtepi32_ps(s), d);
            acc = _mm_fmadd_ps(r, dy, acc);
            continue;
        }
        let bs = bsums(by);
        let dmin = _mm_setr_ps(u[0].dmin[b], u[1].dmin[b], u[2].dmin[b], u[3].dmin[b]);
        let mins = |j: usize| mins4(&u, b * 16 + j);
        if gemm {
            let dd = _mm_mul_ps(d, dy);
            let dm = _mm_mul_ps(dmin, dy);
            for p in 0..4 {
                let mp = _mm_add_epi32(
                    _mm_mullo_epi32(mins(2 * p), _mm_set1_epi32(bs[4 * p] + bs[4 * p + 1])),
                    _mm_mullo_epi32(
                        mins(2 * p + 1),
                        _mm_set1_epi32(bs[4 * p + 2] + bs[4 * p + 3]),
                    ),
                );
                acc = _mm_fmadd_ps(_mm_cvtepi32_ps(ip[p]), dd, acc);
                acc_m = _mm_fmadd_ps(_mm_cvtepi32_ps(mp), dm, acc_m);
            }
        } else {
            let isum = _mm_add_epi32(_mm_add_epi32(ip[0], ip[1]), _mm_add_epi32(ip[2], ip[3]));
            let mut imin = _mm_setzero_si128();
            for g in 0..16 {
                imin = _mm_add_epi32(imin, _mm_mullo_epi32(mins(g / 2), _mm_set1_epi32(bs[g])));
            }
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), _mm_mul_ps(d, dy), acc);
            acc_m = _mm_fmadd_ps(_mm_cvtepi32_ps(imin), _mm_mul_ps(dmin, dy), acc_m);
        }
    }
    let mut out = [0f32; ROWS];
    // SAFETY: `out` holds 4 f32.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc, acc_m)) };
    out
}
