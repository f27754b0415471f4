//! Q5_0 decode on the AVX2 tiers: [`Layout::X8`], 8 rows interleaved so that one 256-bit
//! vector holds 4 consecutive elements of each of 8 rows, and the one-token kernel over it.
//!
//! Row-major Q5_0 decode (the [`super::avx2`] tiles) spends most of its time unpacking: per
//! 32-element block and row, the 5th bits are spread to bytes by a shuffle and a compare, the
//! nibbles split, and the signed product needs two `sign` operations, all for one `maddubs`. Here
//! the work per 32 products (8 rows x 4 elements) is two or three operations to form the
//! unsigned 5-bit values `q` (0..31), then per token `maddubs`, `madd`, one subtraction and the
//! float conversion and FMA:
//!
//! * `vec_dot`'s lanes are the exact sums of 4 consecutive products `(q - 16)·x`; here lane r of
//!   vector g holds row r's lane g: `Σ q·x - 16·Σ x` over the same 4 elements (exact integers:
//!   `maddubs` of `q <= 31` against `|x| <= 128` cannot saturate), the second term taken per token
//!   from a table built once per call. Each lane's float chain is then `vec_dot`'s: per block
//!   `acc = fma(d_w·d_x, f32(lane), acc)`, the 8 rows' `d_w·d_x` one multiply, and at the end
//!   `hsum_float_8`'s tree over each row's 8 lanes, done on the 8 rows at once. Same bits as
//!   `quant::vec_dot` (tests/matmul_tiles.rs, tests/tiers.rs).
//! * A group's block `ib` is one 176-byte cell (8 rows x 22 bytes, the file's size): the 8 rows'
//!   `d` (f16), then 4 vectors of nibbles (vector c: low nibbles are group-vector c, high
//!   nibbles group-vector c + 4), then one vector of 5th bits (bit g of byte i: group-vector g,
//!   position i). Position i of a group-vector is row i / 4, element 4g + i % 4 of the block.
//!
//! A decode step streams each group once; tasks take runs of consecutive groups so a thread reads
//! one stretch of the matrix. A prompt's task forms its group's values `q` and scales once
//! ([`Unpacked`]) and then runs every token over them ([`gemv_unpacked`]): per 32 products and
//! token the same five operations, no unpacking.

use super::{OutPtr, Src};
use crate::pool;
use core::arch::x86_64::*;
use ferrum_core::DType;
use std::cell::RefCell;

/// Rows per group.
pub(super) const GROUP: usize = 8;
/// Q5_0 block bytes (d, qh, 16 bytes of nibbles).
const BLOCK: usize = 22;
/// Bytes of one block of a group.
const CELL: usize = GROUP * BLOCK;
/// Offsets in a cell: the 8 rows' d, the 4 nibble vectors, the 5th-bit vector.
const NIB: usize = 16;
const HIGH: usize = NIB + 4 * 32;
/// Q8_0 activation block bytes.
const ACT_BLOCK: usize = 34;
/// Most tokens of one call of the kernel (decode; more take the prompt tiles).
pub(super) const MAX_TOKENS: usize = 3;

/// Bytes of a `rows` x `cols` matrix in [`Layout::X8`] (`None`: not Q5_0, or not whole blocks).
pub(super) fn x8_len(dtype: DType, rows: usize, cols: usize) -> Option<usize> {
    if dtype != DType::Q5_0 || rows == 0 || cols == 0 || !cols.is_multiple_of(32) {
        return None;
    }
    dtype
        .row_bytes(cols)?
        .checked_mul(rows.next_multiple_of(GROUP))
}

/// The unsigned 5-bit value (`q + 16`) of element `j` of a Q5_0 block.
fn q5(blk: &[u8], j: usize) -> u8 {
    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
    let nib = if j < 16 {
        blk[6 + j] & 15
    } else {
        blk[6 + j - 16] >> 4
    };
    nib | ((((qh >> j) & 1) as u8) << 4)
}

/// Writes groups `g0 ..` of the row-major Q5_0 `src` (`rows` x `cols`) into `dst` (whole
/// groups; the last one padded by repeating the last row).
pub(super) fn pack_x8_groups(src: &[u8], rows: usize, cols: usize, g0: usize, dst: &mut [u8]) {
    let rb = cols / 32 * BLOCK;
    for (gi, group) in dst.chunks_exact_mut(GROUP * rb).enumerate() {
        let r0 = (g0 + gi) * GROUP;
        for (ib, cell) in group.chunks_exact_mut(CELL).enumerate() {
            cell.fill(0);
            for r in 0..GROUP {
                let row = (r0 + r).min(rows - 1);
                let blk = &src[row * rb + ib * BLOCK..][..BLOCK];
                cell[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
                for g in 0..8 {
                    for e in 0..4 {
                        let v = q5(blk, 4 * g + e);
                        let i = 4 * r + e;
                        let nib = v & 15;
                        cell[NIB + 32 * (g % 4) + i] |= if g < 4 { nib } else { nib << 4 };
                        cell[HIGH + i] |= (v >> 4) << g;
                    }
                }
            }
        }
    }
}

/// Row `r` of an [`Layout::X8`] matrix in the file's layout, into `out` (`row_bytes` long).
pub(super) fn unpack_row_x8(w: &Src, r: usize, out: &mut [u8]) {
    let rb = w.row_bytes();
    let group = &w.data[r / GROUP * GROUP * rb..][..GROUP * rb];
    let rr = r % GROUP;
    for (ib, blk) in out.chunks_exact_mut(BLOCK).enumerate() {
        let cell = &group[ib * CELL..][..CELL];
        blk[..2].copy_from_slice(&cell[2 * rr..2 * rr + 2]);
        let mut qh = 0u32;
        let mut qs = [0u8; 16];
        for g in 0..8 {
            for e in 0..4 {
                let (i, j) = (4 * rr + e, 4 * g + e);
                let byte = cell[NIB + 32 * (g % 4) + i];
                let nib = if g < 4 { byte & 15 } else { byte >> 4 };
                qh |= u32::from((cell[HIGH + i] >> g) & 1) << j;
                if j < 16 {
                    qs[j] |= nib;
                } else {
                    qs[j - 16] |= nib << 4;
                }
            }
        }
        blk[2..6].copy_from_slice(&qh.to_le_bytes());
        blk[6..].copy_from_slice(&qs);
    }
}

thread_local! {
    /// Per call: each token's d_x as f32 per block, then its corrections 16·Σx per block and
    /// 4-element group.
    static PREP: RefCell<(Vec<f32>, Vec<i32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// A prompt task's group, unpacked (per worker thread).
    static UNPACKED: RefCell<Unpacked> = const { RefCell::new(Unpacked { q: Vec::new(), d: Vec::new() }) };
}

/// One 256-bit vector's bytes, aligned.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Line([u8; 32]);

/// A group's blocks unpacked for a prompt: per block the 8 group-vectors of values `q` (0..31)
/// and the 8 rows' d as f32.
struct Unpacked {
    q: Vec<Line>,
    d: Vec<Line>,
}

/// Each token's d_x (f32, per block) and corrections (16·Σx per block and 4-element group), for
/// the `t` tokens of `act`, into `dx` and `corr`.
fn prepare(act: &[u8], ab: usize, t: usize, dx: &mut Vec<f32>, corr: &mut Vec<i32>) {
    dx.clear();
    corr.clear();
    for tok in 0..t {
        for blk in act[tok * ab..][..ab].chunks_exact(ACT_BLOCK) {
            dx.push(half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32());
            for g in blk[2..].chunks_exact(4) {
                corr.push(16 * g.iter().map(|&v| v as i8 as i32).sum::<i32>());
            }
        }
    }
}

/// `y[tok, r]` for a prompt (any number of tokens) over the [`Layout::X8`] matrix `w`; the same
/// outputs as [`matmul`]. Only for CPUs with AVX2, FMA and F16C (checked).
pub(super) fn matmul_prompt(w: &Src, act: &[u8], ab: usize, t: usize, out: OutPtr) {
    assert!(
        crate::cpu::features().x86_simd(),
        "X8 kernels need AVX2+FMA+F16C"
    );
    let (rows, cols) = (w.rows, w.cols);
    let nb = cols / 32;
    assert!(w.dtype == DType::Q5_0 && w.data.len() == x8_len(w.dtype, rows, cols).unwrap());
    assert!(ab == nb * ACT_BLOCK && act.len() >= t * ab);
    PREP.with_borrow_mut(|(dx, corr)| {
        prepare(act, ab, t, dx, corr);
        let (dx, corr) = (&dx[..], &corr[..]);
        let glen = nb * CELL;
        pool::parallel_for(rows.div_ceil(GROUP), |g| {
            UNPACKED.with_borrow_mut(|u| {
                // SAFETY: AVX2+FMA+F16C were checked above.
                unsafe { unpack_group(&w.data[g * glen..][..glen], nb, u) };
                let r0 = g * GROUP;
                for tok in 0..t {
                    let a = Tok {
                        q: &act[tok * ab..][..ab],
                        d: &dx[tok * nb..][..nb],
                        corr: &corr[tok * nb * 8..][..nb * 8],
                    };
                    // SAFETY: as above.
                    let v = unsafe { gemv_unpacked(u, nb, &a) };
                    for (j, &val) in v.iter().enumerate().take(rows - r0) {
                        // SAFETY: `tok < t` and `r0 + j < rows`, so the index is inside `y`
                        // ([t, rows]); only this task writes rows of group g.
                        unsafe { *out.at(tok * rows + r0 + j) = val };
                    }
                }
            })
        });
    });
}

/// Unpacks the `nb` cells of `group` into `u`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_group(group: &[u8], nb: usize, u: &mut Unpacked) {
    assert!(group.len() >= nb * CELL, "unpack_group: short group");
    u.q.resize(nb * 8, Line([0; 32]));
    u.d.resize(nb, Line([0; 32]));
    let m4 = _mm256_set1_epi8(0x0f);
    let m10 = _mm256_set1_epi8(0x10);
    for ib in 0..nb {
        // SAFETY: cell `ib` lies inside `group` (asserted); `u` holds 8 lines per block and one
        // per block (resized above), 32-byte aligned.
        unsafe {
            let cell = group.as_ptr().add(ib * CELL);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(cell as *const __m128i));
            _mm256_store_ps(u.d.as_mut_ptr().add(ib) as *mut f32, dw);
            let nib: [__m256i; 4] = core::array::from_fn(|c| {
                _mm256_loadu_si256(cell.add(NIB + 32 * c) as *const __m256i)
            });
            let hb = _mm256_loadu_si256(cell.add(HIGH) as *const __m256i);
            let hb4 = _mm256_slli_epi16::<4>(hb);
            let highs = [
                hb4,
                _mm256_srli_epi16::<1>(hb4),
                _mm256_srli_epi16::<2>(hb4),
                _mm256_srli_epi16::<3>(hb4),
                hb,
                _mm256_srli_epi16::<1>(hb),
                _mm256_srli_epi16::<2>(hb),
                _mm256_srli_epi16::<3>(hb),
            ];
            for g in 0..8 {
                let lo = if g < 4 {
                    nib[g]
                } else {
                    _mm256_srli_epi16::<4>(nib[g - 4])
                };
                let q = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(highs[g], m10));
                _mm256_store_si256(u.q.as_mut_ptr().add(ib * 8 + g) as *mut __m256i, q);
            }
        }
    }
}

/// [`gemv`] for one token over an unpacked group: `out[r]` equals `quant::vec_dot` of row r and
/// the token, bit for bit.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[allow(clippy::needless_range_loop)] // index loops over the 8 lane registers
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_unpacked(u: &Unpacked, nb: usize, a: &Tok) -> [f32; GROUP] {
    assert!(
        u.q.len() >= nb * 8 && u.d.len() >= nb,
        "gemv_unpacked: short group"
    );
    assert!(
        a.q.len() >= nb * ACT_BLOCK && a.d.len() >= nb && a.corr.len() >= nb * 8,
        "gemv_unpacked: short activation row"
    );
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 8];
    for ib in 0..nb {
        // SAFETY: block `ib` of the unpacked group and of the token lie inside the slices
        // (asserted above); the lines are 32-byte aligned.
        unsafe {
            let dw = _mm256_load_ps(u.d.as_ptr().add(ib) as *const f32);
            let dp = _mm256_mul_ps(dw, _mm256_set1_ps(*a.d.get_unchecked(ib)));
            for g in 0..8 {
                let q = _mm256_load_si256(u.q.as_ptr().add(ib * 8 + g) as *const __m256i);
                let x =
                    (a.q.as_ptr().add(ib * ACT_BLOCK + 2 + 4 * g) as *const i32).read_unaligned();
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_set1_epi32(x)), ones);
                let corr = *a.corr.get_unchecked(ib * 8 + g);
                let p = _mm256_sub_epi32(p, _mm256_set1_epi32(corr));
                acc[g] = _mm256_fmadd_ps(dp, _mm256_cvtepi32_ps(p), acc[g]);
            }
        }
    }
    let mut out = [0f32; GROUP];
    // SAFETY: `out` holds 8 f32.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), hsum_lanes(&acc)) };
    out
}

/// `hsum_float_8` of each row's 8 lanes (lane g of row r in `v[g]`, element r): (l0 + l4,
/// l1 + l5, l2 + l6, l3 + l7), then (0 + 2) + (1 + 3), for the 8 rows at once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_lanes(v: &[__m256; 8]) -> __m256 {
    let t0 = _mm256_add_ps(v[0], v[4]);
    let t1 = _mm256_add_ps(v[1], v[5]);
    let t2 = _mm256_add_ps(v[2], v[6]);
    let t3 = _mm256_add_ps(v[3], v[7]);
    _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3))
}

/// `y[tok, r]` (`y`: [T, rows]) for the `t` (1..=[`MAX_TOKENS`]) Q8_0 tokens of `act` (`ab`
/// bytes each) over the [`Layout::X8`] matrix `w`; each output equals `quant::vec_dot` on the
/// AVX2 tier. Only for CPUs with AVX2, FMA and F16C (checked).
pub(super) fn matmul(w: &Src, act: &[u8], ab: usize, t: usize, out: OutPtr) {
    assert!(
        crate::cpu::features().x86_simd(),
        "X8 kernels need AVX2+FMA+F16C"
    );
    let (rows, cols) = (w.rows, w.cols);
    let nb = cols / 32;
    assert!(w.dtype == DType::Q5_0 && w.data.len() == x8_len(w.dtype, rows, cols).unwrap());
    assert!((1..=MAX_TOKENS).contains(&t) && ab == nb * ACT_BLOCK && act.len() >= t * ab);
    PREP.with_borrow_mut(|(dx, corr)| {
        prepare(act, ab, t, dx, corr);
        let (dx, corr) = (&dx[..], &corr[..]);
        let groups = rows.div_ceil(GROUP);
        let glen = nb * CELL;
        // Runs of consecutive groups, two per thread: each thread streams one stretch.
        let per = groups.div_ceil(2 * pool::threads()).max(1);
        pool::parallel_for(groups.div_ceil(per), |run| {
            for g in run * per..((run + 1) * per).min(groups) {
                let group = &w.data[g * glen..][..glen];
                let mut o = [[0f32; GROUP]; MAX_TOKENS];
                macro_rules! call {
                    ($n:literal) => {{
                        let a: [Tok; $n] = core::array::from_fn(|c| Tok {
                            q: &act[c * ab..][..ab],
                            d: &dx[c * nb..][..nb],
                            corr: &corr[c * nb * 8..][..nb * 8],
                        });
                        // SAFETY: AVX2+FMA+F16C were checked above.
                        let v = unsafe { gemv::<$n>(group, nb, &a) };
                        o[..$n].copy_from_slice(&v);
                    }};
                }
                match t {
                    1 => call!(1),
                    2 => call!(2),
                    _ => call!(3),
                }
                let r0 = g * GROUP;
                for (tok, v) in o[..t].iter().enumerate() {
                    for (j, &val) in v.iter().enumerate().take(rows - r0) {
                        // SAFETY: `tok < t` and `r0 + j < rows`, so the index is inside `y`
                        // ([t, rows]); only this task writes rows of group g.
                        unsafe { *out.at(tok * rows + r0 + j) = val };
                    }
                }
            }
        });
    });
}

/// One token's operands: its Q8_0 blocks, their d as f32, and per block and 4-element group
/// 16 times the group's sum.
struct Tok<'a> {
    q: &'a [u8],
    d: &'a [f32],
    corr: &'a [i32],
}

/// The 8 rows of `group` (`nb` cells) times the `T` tokens `a`: `out[c][r]` equals
/// `quant::vec_dot` of row r and token c on the AVX2 tier, bit for bit.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[allow(clippy::needless_range_loop)] // index loops over per-token register arrays
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<const T: usize>(group: &[u8], nb: usize, a: &[Tok; T]) -> [[f32; GROUP]; T] {
    assert!(group.len() >= nb * CELL, "gemv x8: short group");
    for at in a {
        assert!(
            at.q.len() >= nb * ACT_BLOCK && at.d.len() >= nb && at.corr.len() >= nb * 8,
            "gemv x8: short activation row"
        );
    }
    let m4 = _mm256_set1_epi8(0x0f);
    let m10 = _mm256_set1_epi8(0x10);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 8]; T];
    for ib in 0..nb {
        // SAFETY (whole block): cell `ib` of the group, block `ib` of every token's quants and
        // its d and corrections lie inside the slices (asserted above).
        unsafe {
            let cell = group.as_ptr().add(ib * CELL);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(cell as *const __m128i));
            let dp: [__m256; T] = core::array::from_fn(|c| {
                _mm256_mul_ps(dw, _mm256_set1_ps(*a[c].d.get_unchecked(ib)))
            });
            let nib: [__m256i; 4] = core::array::from_fn(|c| {
                _mm256_loadu_si256(cell.add(NIB + 32 * c) as *const __m256i)
            });
            let hb = _mm256_loadu_si256(cell.add(HIGH) as *const __m256i);
            // Bit g of each byte to bit 4: from `hb << 4` for g < 4, from `hb` for g >= 4
            // (16-bit shifts; the bit kept never crosses from the other byte).
            let hb4 = _mm256_slli_epi16::<4>(hb);
            // (A macro, not a closure: the intrinsics must inline under this target feature.)
            macro_rules! step {
                ($g:literal, $lo:expr, $high:expr) => {{
                    let q =
                        _mm256_or_si256(_mm256_and_si256($lo, m4), _mm256_and_si256($high, m10));
                    for c in 0..T {
                        let x = (a[c].q.as_ptr().add(ib * ACT_BLOCK + 2 + 4 * $g) as *const i32)
                            .read_unaligned();
                        let p =
                            _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_set1_epi32(x)), ones);
                        let corr = *a[c].corr.get_unchecked(ib * 8 + $g);
                        let p = _mm256_sub_epi32(p, _mm256_set1_epi32(corr));
                        acc[c][$g] = _mm256_fmadd_ps(dp[c], _mm256_cvtepi32_ps(p), acc[c][$g]);
                    }
                }};
            }
            step!(0, nib[0], hb4);
            step!(1, nib[1], _mm256_srli_epi16::<1>(hb4));
            step!(2, nib[2], _mm256_srli_epi16::<2>(hb4));
            step!(3, nib[3], _mm256_srli_epi16::<3>(hb4));
            step!(4, _mm256_srli_epi16::<4>(nib[0]), hb);
            step!(
                5,
                _mm256_srli_epi16::<4>(nib[1]),
                _mm256_srli_epi16::<1>(hb)
            );
            step!(
                6,
                _mm256_srli_epi16::<4>(nib[2]),
                _mm256_srli_epi16::<2>(hb)
            );
            step!(
                7,
                _mm256_srli_epi16::<4>(nib[3]),
                _mm256_srli_epi16::<3>(hb)
            );
        }
    }
    let mut out = [[0f32; GROUP]; T];
    for c in 0..T {
        // SAFETY: `out[c]` holds 8 f32.
        unsafe { _mm256_storeu_ps(out[c].as_mut_ptr(), hsum_lanes(&acc[c])) };
    }
    out
}
