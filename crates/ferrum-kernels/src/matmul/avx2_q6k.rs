//! Q6_K on the AVX2 tiers in [`Layout::X8`]: 8 rows interleaved so that one 256-bit vector holds
//! 4 consecutive elements of each of 8 rows, and the products of up to 3 tokens over it
//! (decode; every call whose tokens all take `vec_dot`'s order).
//!
//! Row by row, `vec_dot`'s AVX2 kernel spends per 32 elements a shift and masks to form the 6-bit
//! values, a `maddubs`, a `madd` with a scale vector built from two broadcasts, and an add; the
//! scale broadcasts and the per-row tails cost about as much as the products, and a one-token
//! product ran at ~14 GB/s where the file streams at ~31. Here one vector of 32 products covers 8
//! rows: the values are formed from one nibble vector and one vector of high bits shared by all
//! tokens, the scales of a 32-element chunk for the 8 rows are two vectors formed once per chunk,
//! and per token the work is `maddubs`, `madd` and an add.
//!
//! Same bits as `quant::vec_dot` on the AVX2 tier (`dot_avx2_k::dot_q6k`): its lane l of a
//! super-block is the exact integer `Σ_chunks Σ_{elements 4l..4l+4} sc·q·y` less
//! `32·(sc[2l]·bsums[2l] + sc[2l+1]·bsums[2l+1])` (the correction taken from the Q8_K block sums
//! by scale pairs, as llama.cpp's kernel does); here lane r of accumulator g holds row r's lane g of that sum, formed
//! the same way (exact integers, no saturation: `maddubs` of q ≤ 63 against |y| ≤ 128), then per
//! super-block `acc = fma(d_w·d_x, f32(lane), acc)` and at the end `hsum_float_8`'s tree for the 8
//! rows at once.
//!
//! A group's super-block `ib` is one cell of the file's size (8 rows x 210 bytes): the 8 rows' `d`
//! (f16), the 16 scales of the 8 rows by scale index (byte `8s + r`), then per 32-element chunk c
//! 4 vectors of nibbles (vector k: low nibbles are group-vector k, high nibbles group-vector k + 4)
//! and 2 vectors of high bits (vector h, bits 2k..2k+2 of each byte: group-vector 4h + k). Position
//! i of group-vector g of chunk c is row i / 4, element 32c + 4g + i % 4.

use super::avx2_x8::{hsum_lanes, store, GROUP};
use super::{OutPtr, Src};
use crate::pool;
use core::arch::x86_64::*;
use ferrum_core::DType;
use std::cell::RefCell;

/// Bytes of a Q6_K block and of a group's cell.
const BLOCK: usize = 210;
const CELL: usize = GROUP * BLOCK;
/// Offsets in a block (ggml's `block_q6_K`): low 4 bits, high 2 bits, scales, d.
const QL: usize = 0;
const QH: usize = 128;
const SCALES: usize = 192;
const D: usize = 208;
/// Offsets in a cell.
const C_SC: usize = 16;
const C_NIB: usize = C_SC + 16 * GROUP;
const C_HI: usize = C_NIB + 8 * 4 * 32;
/// Q8_K activation blocks: d (f32), 256 quants, 16 block sums (i16).
const ACT: usize = 292;
const ACT_QS: usize = 4;
const ACT_BSUMS: usize = 260;
/// Most tokens of one kernel call.
const MAX_TOKENS: usize = 3;

/// Bytes of a `rows` x `cols` Q6_K matrix in [`Layout::X8`] (`None`: not whole blocks).
pub(super) fn x8_len(rows: usize, cols: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return None;
    }
    DType::Q6_K
        .row_bytes(cols)?
        .checked_mul(rows.next_multiple_of(GROUP))
}

/// Where element `j` (0..256) of a Q6_K block keeps its bits: the `ql` byte and whether the high
/// nibble, the `qh` byte and the bit shift there.
fn place(j: usize) -> (usize, bool, usize, u32) {
    let (n, w) = (j / 128, j % 128);
    let (k, l) = (w / 32, w % 32);
    (
        QL + 64 * n + l + 32 * (k % 2),
        k >= 2,
        QH + 32 * n + l,
        2 * k as u32,
    )
}

/// The 6-bit value (0..63) of element `j` of the block `blk`.
fn value(blk: &[u8], j: usize) -> u8 {
    let (ql, high, qh, sh) = place(j);
    let nib = if high { blk[ql] >> 4 } else { blk[ql] & 15 };
    nib | (((blk[qh] >> sh) & 3) << 4)
}

/// Writes groups `g0 ..` of the row-major `src` (`rows` x `cols`) into `dst` (whole groups; the
/// last one padded by repeating the last row).
pub(super) fn pack_groups(src: &[u8], rows: usize, cols: usize, g0: usize, dst: &mut [u8]) {
    let rb = cols / 256 * BLOCK;
    for (gi, group) in dst.chunks_exact_mut(GROUP * rb).enumerate() {
        let r0 = (g0 + gi) * GROUP;
        for (ib, cell) in group.chunks_exact_mut(CELL).enumerate() {
            cell.fill(0);
            for r in 0..GROUP {
                let row = (r0 + r).min(rows - 1);
                let blk = &src[row * rb + ib * BLOCK..][..BLOCK];
                cell[2 * r..2 * r + 2].copy_from_slice(&blk[D..D + 2]);
                for s in 0..16 {
                    cell[C_SC + 8 * s + r] = blk[SCALES + s];
                }
                for c in 0..8 {
                    for g in 0..8 {
                        for e in 0..4 {
                            let v = value(blk, 32 * c + 4 * g + e);
                            let i = 4 * r + e;
                            let nib = v & 15;
                            cell[C_NIB + 128 * c + 32 * (g % 4) + i] |=
                                if g < 4 { nib } else { nib << 4 };
                            cell[C_HI + 64 * c + 32 * (g / 4) + i] |= (v >> 4) << (2 * (g % 4));
                        }
                    }
                }
            }
        }
    }
}

/// Row `r` of a Q6_K [`Layout::X8`] matrix in the file's layout, into `out` (`row_bytes` long):
/// the row's 256 values of each cell gathered in element order, then split into ggml's `ql`/`qh`
/// in its own loop order (the prompt kernels unpack every row of a call this way).
pub(super) fn unpack_row(w: &Src, r: usize, out: &mut [u8]) {
    let rb = w.row_bytes();
    let group = &w.data[r / GROUP * GROUP * rb..][..GROUP * rb];
    let rr = r % GROUP;
    let mut v = [0u8; 256];
    for (ib, blk) in out.chunks_exact_mut(BLOCK).enumerate() {
        let cell = &group[ib * CELL..][..CELL];
        blk[D..D + 2].copy_from_slice(&cell[2 * rr..2 * rr + 2]);
        for s in 0..16 {
            blk[SCALES + s] = cell[C_SC + 8 * s + rr];
        }
        for c in 0..8 {
            let hb = &cell[C_HI + 64 * c..][..64];
            for k in 0..4 {
                let nib = &cell[C_NIB + 128 * c + 32 * k + 4 * rr..][..4];
                for e in 0..4 {
                    let i = 4 * rr + e;
                    let (lo, hi) = (hb[i] >> (2 * k), hb[32 + i] >> (2 * k));
                    v[32 * c + 4 * k + e] = (nib[e] & 15) | ((lo & 3) << 4);
                    v[32 * c + 4 * (k + 4) + e] = (nib[e] >> 4) | ((hi & 3) << 4);
                }
            }
        }
        // ggml's layout (see `place`): per half n and l < 32, ql[l] holds elements l and l + 64,
        // ql[l + 32] elements l + 32 and l + 96, qh[l] the high bits of all four.
        for n in 0..2 {
            let x = &v[128 * n..][..128];
            for l in 0..32 {
                blk[QL + 64 * n + l] = (x[l] & 15) | ((x[l + 64] & 15) << 4);
                blk[QL + 64 * n + 32 + l] = (x[l + 32] & 15) | ((x[l + 96] & 15) << 4);
                blk[QH + 32 * n + l] = (x[l] >> 4)
                    | ((x[l + 32] >> 4) << 2)
                    | ((x[l + 64] >> 4) << 4)
                    | ((x[l + 96] >> 4) << 6);
            }
        }
    }
}

thread_local! {
    /// Per call: each token's d_x per super-block.
    static DX: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `y[tok, r]` (`y`: [t, rows]) for the `t` tokens of `act` (Q8_K rows, `ab` bytes each) over the
/// Q6_K [`Layout::X8`] matrix `w`, every token in `vec_dot`'s order: each output equals
/// `quant::vec_dot` on the AVX2 tier. Tokens go through the kernel 3 at a time, each group's cells
/// staying in cache between them. Only for CPUs with AVX2, FMA and F16C (checked).
pub(super) fn matmul(w: &Src, act: &[u8], ab: usize, t: usize, out: OutPtr) {
    assert!(
        crate::cpu::features().x86_simd(),
        "X8 kernels need AVX2+FMA+F16C"
    );
    assert_eq!(w.dtype, DType::Q6_K, "X8 Q6_K: weight type");
    let (rows, cols) = (w.rows, w.cols);
    let nb = cols / 256;
    assert_eq!(
        Some(w.data.len()),
        x8_len(rows, cols),
        "X8 Q6_K: weight bytes"
    );
    assert!(
        ab == nb * ACT && act.len() >= t * ab,
        "X8 Q6_K: activation shape"
    );
    DX.with_borrow_mut(|dx| {
        dx.clear();
        dx.extend(
            act[..t * ab]
                .chunks_exact(ACT)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        let dx = &*dx;
        let groups = rows.div_ceil(GROUP);
        let glen = nb * CELL;
        pool::parallel_runs(groups, |g| {
            let group = &w.data[g * glen..][..glen];
            for t0 in (0..t).step_by(MAX_TOKENS) {
                let n = (t - t0).min(MAX_TOKENS);
                let tok = |c: usize| {
                    let k = t0 + c.min(n - 1);
                    (&act[k * ab..][..ab], &dx[k * nb..][..nb])
                };
                let mut o = [[0f32; GROUP]; MAX_TOKENS];
                macro_rules! call {
                    ($n:literal) => {{
                        let a: [(&[u8], &[f32]); $n] = core::array::from_fn(tok);
                        // SAFETY: AVX2+FMA+F16C were checked above.
                        let v = unsafe { gemv::<$n>(group, nb, &a) };
                        o[..$n].copy_from_slice(&v);
                    }};
                }
                match n {
                    1 => call!(1),
                    2 => call!(2),
                    _ => call!(3),
                }
                store(OutPtr(out.at(t0 * rows)), rows, g, &o[..n]);
            }
        });
    });
}

/// The 8 rows of `group` (`nb` cells) times the `T` tokens `a` (each its Q8_K row and d_x per
/// super-block): `out[c][r]` equals `quant::vec_dot` of row r and token c on the AVX2 tier, bit
/// for bit.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[allow(clippy::needless_range_loop)] // index loops over per-token register arrays
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<const T: usize>(
    group: &[u8],
    nb: usize,
    a: &[(&[u8], &[f32]); T],
) -> [[f32; GROUP]; T] {
    assert!(group.len() >= nb * CELL, "gemv q6k x8: short group");
    for (q, d) in a {
        assert!(
            q.len() >= nb * ACT && d.len() >= nb,
            "gemv q6k x8: short activation row"
        );
    }
    let m4 = _mm256_set1_epi8(0x0f);
    let m30 = _mm256_set1_epi8(0x30);
    // Interleaves the scales of indices 2g and 2g+1 (bytes 0..8 and 8..16) row by row.
    let pairs = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    let mut acc = [[_mm256_setzero_ps(); 8]; T];
    // A cell's scale vectors: lanes 2r, 2r+1 of `sv[s]` hold row r's scale s (16 elements).
    let mut sv = [_mm256_setzero_si256(); 16];
    for ib in 0..nb {
        // SAFETY (whole block): cell `ib` of the group and block `ib` of every token's Q8_K row
        // and d_x lie inside the slices (asserted above).
        unsafe {
            let cell = group.as_ptr().add(ib * CELL);
            // The next cell, a line at a time (never faults: `wrapping_add`, prefetch only).
            for l in (0..CELL).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(cell.wrapping_add(CELL + l) as *const i8);
            }
            for c in 0..8 {
                let v = _mm256_cvtepi8_epi16(_mm_loadu_si128(cell.add(C_SC + 16 * c) as *const _));
                let (lo, hi) = (_mm256_unpacklo_epi16(v, v), _mm256_unpackhi_epi16(v, v));
                sv[2 * c] = _mm256_permute2x128_si256::<0x20>(lo, hi);
                sv[2 * c + 1] = _mm256_permute2x128_si256::<0x31>(lo, hi);
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(cell as *const __m128i));
            let d: [__m256; T] = core::array::from_fn(|t| {
                _mm256_mul_ps(dw, _mm256_set1_ps(*a[t].1.get_unchecked(ib)))
            });
            // Group-vector G over the 8 chunks: one running sum per token (few registers live),
            // then its correction and the float step.
            macro_rules! lane {
                ($g:literal) => {{
                    let mut isum = [_mm256_setzero_si256(); T];
                    for c in 0..8 {
                        let nib = _mm256_loadu_si256(
                            cell.add(C_NIB + 128 * c + 32 * ($g % 4)) as *const __m256i
                        );
                        let lo4 = if $g < 4 {
                            _mm256_and_si256(nib, m4)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi16::<4>(nib), m4)
                        };
                        let h = _mm256_loadu_si256(
                            cell.add(C_HI + 64 * c + 32 * ($g / 4)) as *const __m256i
                        );
                        // Bits 2k, 2k+1 of each byte to bits 4, 5 (16-bit shifts; what crosses
                        // from the neighbouring byte is masked off).
                        let h = match $g % 4 {
                            0 => _mm256_slli_epi16::<4>(h),
                            1 => _mm256_slli_epi16::<2>(h),
                            2 => h,
                            _ => _mm256_srli_epi16::<2>(h),
                        };
                        let q = _mm256_or_si256(lo4, _mm256_and_si256(h, m30));
                        let s = sv[2 * c + $g / 4];
                        for t in 0..T {
                            let y = (a[t].0.as_ptr().add(ib * ACT + ACT_QS + 32 * c + 4 * $g)
                                as *const i32)
                                .read_unaligned();
                            let p =
                                _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_set1_epi32(y)), s);
                            isum[t] = _mm256_add_epi32(isum[t], p);
                        }
                    }
                    // 32·(sc[2g]·bsums[2g] + sc[2g+1]·bsums[2g+1]), per row.
                    let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                        _mm_loadu_si128(cell.add(C_SC + 16 * $g) as *const _),
                        pairs,
                    ));
                    for t in 0..T {
                        let bs = (a[t].0.as_ptr().add(ib * ACT + ACT_BSUMS + 4 * $g) as *const i32)
                            .read_unaligned();
                        let corr = _mm256_madd_epi16(sc, _mm256_set1_epi32(bs));
                        let v = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(corr));
                        acc[t][$g] = _mm256_fmadd_ps(d[t], _mm256_cvtepi32_ps(v), acc[t][$g]);
                    }
                }};
            }
            lane!(0);
            lane!(1);
            lane!(2);
            lane!(3);
            lane!(4);
            lane!(5);
            lane!(6);
            lane!(7);
        }
    }
    let mut out = [[0f32; GROUP]; T];
    for t in 0..T {
        // SAFETY: `out[t]` holds 8 f32.
        unsafe { _mm256_storeu_ps(out[t].as_mut_ptr(), hsum_lanes(&acc[t])) };
    }
    out
}
