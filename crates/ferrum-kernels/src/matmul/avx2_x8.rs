//! Q5_0, Q4_1 and Q8_0 on the AVX2 tiers: [`Layout::X8`], 8 rows interleaved so that one 256-bit
//! vector holds 4 consecutive elements of each of 8 rows, and the kernels over it.
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
//! * Q4_1 needs no correction (its quants are unsigned): per token `maddubs`, `madd`, cvt and
//!   FMA, and `vec_dot`'s separate chain `summs += m_w·s_x` per block, 8 rows in one vector,
//!   added to each row's sum at the end.
//! * Q8_0 stores its quants as they are; per 32 products `vec_dot`'s `|w|` (once for the
//!   tokens), `sign(x, w)`, `maddubs`, `madd`, cvt and FMA, where the X4 tiles also broadcast
//!   and convert each row's `d` per block: the tied 262144 x 640 output of Gemma 3 270M decodes
//!   at 30-31 GB/s (the memory roof) instead of 22.
//! * A group's block `ib` is one cell of the file's size (8 rows x 22 bytes for Q5_0, x 20 for
//!   Q4_1): the 8 rows' `d` (f16), Q4_1's 8 `m` (f16), then 4 vectors of nibbles (vector c: low
//!   nibbles are group-vector c, high nibbles group-vector c + 4), then Q5_0's vector of 5th
//!   bits (bit g of byte i: group-vector g, position i); Q8_0's (x 34): the 8 `d`, then the 8
//!   group-vectors of quants. Position i of a group-vector is row i / 4, element 4g + i % 4 of
//!   the block.
//!
//! A decode step streams each group once; tasks take runs of consecutive groups so a thread reads
//! one stretch of the matrix. A prompt's task forms its group's values `q` and scales once
//! ([`Unpacked`]) and then runs every token over them ([`gemv_unpacked`]): per 32 products and
//! token the same five operations, no unpacking (Q8_0 has nothing to unpack: its prompts run
//! [`gemv`] on the stored group, two tokens at a time).

use super::{OutPtr, Src};
use crate::pool;
use core::arch::x86_64::*;
use ferrum_core::DType;
use std::cell::RefCell;

/// Rows per group.
pub(super) const GROUP: usize = 8;
/// Most tokens of one call of the kernel (decode; more take the prompt path).
pub(super) const MAX_TOKENS: usize = 3;

// Kind codes (const generic parameters of the kernels).
const K_Q5_0: u8 = 0;
const K_Q4_1: u8 = 1;
const K_Q8_0: u8 = 2;

/// The kind code of a type with an X8 layout.
fn kind_of(dtype: DType) -> Option<u8> {
    match dtype {
        DType::Q5_0 => Some(K_Q5_0),
        DType::Q4_1 => Some(K_Q4_1),
        DType::Q8_0 => Some(K_Q8_0),
        _ => None,
    }
}

/// Weight block bytes of kind `k` (Q5_0: d, qh, 16 bytes of nibbles; Q4_1: d, m, nibbles;
/// Q8_0: d, 32 quants).
const fn block(k: u8) -> usize {
    match k {
        K_Q4_1 => 20,
        K_Q8_0 => 34,
        _ => 22,
    }
}
/// Bytes of one block of a group.
const fn cell_len(k: u8) -> usize {
    GROUP * block(k)
}
/// Offsets in a cell: Q4_1's m, the 4 nibble vectors (Q8_0: the 8 quant vectors), Q5_0's
/// 5th-bit vector.
const M: usize = 16;
const fn nib_off(k: u8) -> usize {
    if k == K_Q4_1 {
        32
    } else {
        16
    }
}
const HIGH: usize = 16 + 4 * 32;
/// Activation block bytes (Q8_0 34, Q8_1 40 here: Q4_1's) and the offset of its quants.
const fn act_block(k: u8) -> (usize, usize) {
    if k == K_Q4_1 {
        (40, 4)
    } else {
        (34, 2)
    }
}

/// Bytes of a `rows` x `cols` matrix in [`Layout::X8`] (`None`: not Q5_0, Q4_1, Q8_0 or Q6_K,
/// or not whole blocks).
pub(super) fn x8_len(dtype: DType, rows: usize, cols: usize) -> Option<usize> {
    if dtype == DType::Q6_K {
        return super::avx2_q6k::x8_len(rows, cols);
    }
    kind_of(dtype)?;
    if rows == 0 || cols == 0 || !cols.is_multiple_of(32) {
        return None;
    }
    dtype
        .row_bytes(cols)?
        .checked_mul(rows.next_multiple_of(GROUP))
}

/// The unsigned value of element `j` of a block of kind `k`: Q5_0 `q + 16` (5 bits), Q4_1 the
/// nibble.
fn value(k: u8, blk: &[u8], j: usize) -> u8 {
    let qs = &blk[block(k) - 16..];
    let nib = if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 };
    if k == K_Q4_1 {
        return nib;
    }
    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
    nib | ((((qh >> j) & 1) as u8) << 4)
}

/// Writes groups `g0 ..` of the row-major `src` (`rows` x `cols`, Q5_0, Q4_1, Q8_0 or Q6_K) into
/// `dst` (whole groups; the last one padded by repeating the last row).
pub(super) fn pack_x8_groups(
    dtype: DType,
    src: &[u8],
    rows: usize,
    cols: usize,
    g0: usize,
    dst: &mut [u8],
) {
    if dtype == DType::Q6_K {
        return super::avx2_q6k::pack_groups(src, rows, cols, g0, dst);
    }
    let k = kind_of(dtype).expect("X8 type");
    let (bl, cl, nib_at) = (block(k), cell_len(k), nib_off(k));
    let rb = cols / 32 * bl;
    for (gi, group) in dst.chunks_exact_mut(GROUP * rb).enumerate() {
        let r0 = (g0 + gi) * GROUP;
        for (ib, cell) in group.chunks_exact_mut(cl).enumerate() {
            cell.fill(0);
            for r in 0..GROUP {
                let row = (r0 + r).min(rows - 1);
                let blk = &src[row * rb + ib * bl..][..bl];
                cell[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
                if k == K_Q4_1 {
                    cell[M + 2 * r..M + 2 * r + 2].copy_from_slice(&blk[2..4]);
                }
                if k == K_Q8_0 {
                    // Quants as they are: group-vector g holds elements 4g..4g+4 of each row.
                    for g in 0..8 {
                        cell[nib_at + 32 * g + 4 * r..][..4]
                            .copy_from_slice(&blk[2 + 4 * g..][..4]);
                    }
                    continue;
                }
                for g in 0..8 {
                    for e in 0..4 {
                        let v = value(k, blk, 4 * g + e);
                        let i = 4 * r + e;
                        let nib = v & 15;
                        cell[nib_at + 32 * (g % 4) + i] |= if g < 4 { nib } else { nib << 4 };
                        if k == K_Q5_0 {
                            cell[HIGH + i] |= (v >> 4) << g;
                        }
                    }
                }
            }
        }
    }
}

/// Row `r` of an [`Layout::X8`] matrix in the file's layout, into `out` (`row_bytes` long).
pub(super) fn unpack_row_x8(w: &Src, r: usize, out: &mut [u8]) {
    if w.dtype == DType::Q6_K {
        return super::avx2_q6k::unpack_row(w, r, out);
    }
    let k = kind_of(w.dtype).expect("X8 type");
    let (bl, cl, nib_at) = (block(k), cell_len(k), nib_off(k));
    let rb = w.row_bytes();
    let group = &w.data[r / GROUP * GROUP * rb..][..GROUP * rb];
    let rr = r % GROUP;
    for (ib, blk) in out.chunks_exact_mut(bl).enumerate() {
        let cell = &group[ib * cl..][..cl];
        blk[..2].copy_from_slice(&cell[2 * rr..2 * rr + 2]);
        if k == K_Q8_0 {
            for g in 0..8 {
                blk[2 + 4 * g..][..4].copy_from_slice(&cell[nib_at + 32 * g + 4 * rr..][..4]);
            }
            continue;
        }
        let mut qh = 0u32;
        let mut qs = [0u8; 16];
        for g in 0..8 {
            for e in 0..4 {
                let (i, j) = (4 * rr + e, 4 * g + e);
                let byte = cell[nib_at + 32 * (g % 4) + i];
                let nib = if g < 4 { byte & 15 } else { byte >> 4 };
                if k == K_Q5_0 {
                    qh |= u32::from((cell[HIGH + i] >> g) & 1) << j;
                }
                if j < 16 {
                    qs[j] |= nib;
                } else {
                    qs[j - 16] |= nib << 4;
                }
            }
        }
        if k == K_Q4_1 {
            blk[2..4].copy_from_slice(&cell[M + 2 * rr..M + 2 * rr + 2]);
        } else {
            blk[2..6].copy_from_slice(&qh.to_le_bytes());
        }
        blk[bl - 16..].copy_from_slice(&qs);
    }
}

thread_local! {
    /// Per call: each token's d_x (and Q4_1's s_x) as f32 per block, and Q5_0's corrections
    /// 16·Σx per block and 4-element group.
    static PREP: RefCell<Prep> = const {
        RefCell::new(Prep { d: Vec::new(), s: Vec::new(), corr: Vec::new() })
    };
    /// A prompt task's group, unpacked (per worker thread).
    static UNPACKED: RefCell<Unpacked> = const {
        RefCell::new(Unpacked { q: Vec::new(), d: Vec::new(), m: Vec::new() })
    };
}

/// The tokens' per-block numbers ([`prepare`]).
struct Prep {
    d: Vec<f32>,
    s: Vec<f32>,
    corr: Vec<i32>,
}

/// One 256-bit vector's bytes, aligned.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Line([u8; 32]);

/// A group's blocks unpacked for a prompt: per block the 8 group-vectors of values `q`, the 8
/// rows' d (and Q4_1's m) as f32.
struct Unpacked {
    q: Vec<Line>,
    d: Vec<Line>,
    m: Vec<Line>,
}

/// f32 of the binary16 at `b[0..2]` (exact).
fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Each token's per-block numbers for the `t` tokens of `act` (blocks of kind `k`'s activation
/// type): d_x, Q4_1's s_x, Q5_0's corrections (16·Σx per 4-element group).
fn prepare(k: u8, act: &[u8], ab: usize, t: usize, p: &mut Prep) {
    let (ba, qs) = act_block(k);
    p.d.clear();
    p.s.clear();
    p.corr.clear();
    for tok in 0..t {
        for blk in act[tok * ab..][..ab].chunks_exact(ba) {
            p.d.push(f16_at(blk));
            if k == K_Q4_1 {
                p.s.push(f16_at(&blk[2..]));
            } else if k == K_Q5_0 {
                for g in blk[qs..qs + 32].chunks_exact(4) {
                    p.corr
                        .push(16 * g.iter().map(|&v| v as i8 as i32).sum::<i32>());
                }
            }
        }
    }
}

/// One token's operands: its quant blocks, their d (and s) as f32, and (Q5_0) per block and
/// 4-element group 16 times the group's sum.
struct Tok<'a> {
    q: &'a [u8],
    d: &'a [f32],
    s: &'a [f32],
    corr: &'a [i32],
}

impl Prep {
    /// Token `tok`'s operands (`nb` blocks of `act`, `ab` bytes a token).
    fn tok<'a>(&'a self, k: u8, act: &'a [u8], ab: usize, nb: usize, tok: usize) -> Tok<'a> {
        Tok {
            q: &act[tok * ab..][..ab],
            d: &self.d[tok * nb..][..nb],
            s: if k == K_Q4_1 {
                &self.s[tok * nb..][..nb]
            } else {
                &[]
            },
            corr: if k == K_Q5_0 {
                &self.corr[tok * nb * 8..][..nb * 8]
            } else {
                &[]
            },
        }
    }
}

/// Checks a product's operands; returns (kind, blocks per row).
fn check(w: &Src, act: &[u8], ab: usize, t: usize) -> (u8, usize) {
    assert!(
        crate::cpu::features().x86_simd(),
        "X8 kernels need AVX2+FMA+F16C"
    );
    let k = kind_of(w.dtype).expect("X8 type");
    let (rows, cols) = (w.rows, w.cols);
    let nb = cols / 32;
    assert_eq!(
        Some(w.data.len()),
        x8_len(w.dtype, rows, cols),
        "X8: weight bytes"
    );
    assert!(
        ab == nb * act_block(k).0 && act.len() >= t * ab,
        "X8: activation shape"
    );
    (k, nb)
}

/// `y[tok, r]` (`y`: [T, rows]) for the `t` (1..=[`MAX_TOKENS`]) tokens of `act` (`ab` bytes
/// each, quantized as `quant::vec_dot_type`) over the [`Layout::X8`] matrix `w`; each output
/// equals `quant::vec_dot` on the AVX2 tier. Only for CPUs with AVX2, FMA and F16C (checked).
pub(super) fn matmul(w: &Src, act: &[u8], ab: usize, t: usize, out: OutPtr) {
    let (k, nb) = check(w, act, ab, t);
    assert!((1..=MAX_TOKENS).contains(&t), "X8 decode: 1..=3 tokens");
    let rows = w.rows;
    PREP.with_borrow_mut(|p| {
        prepare(k, act, ab, t, p);
        let p = &*p;
        let groups = rows.div_ceil(GROUP);
        let glen = nb * cell_len(k);
        pool::parallel_runs(groups, |g| {
            let group = &w.data[g * glen..][..glen];
            let mut o = [[0f32; GROUP]; MAX_TOKENS];
            macro_rules! call {
                ($k:expr, $n:literal) => {{
                    let a: [Tok; $n] = core::array::from_fn(|c| p.tok(k, act, ab, nb, c));
                    // SAFETY: AVX2+FMA+F16C were checked by `check`.
                    let v = unsafe { gemv::<$k, $n>(group, nb, &a) };
                    o[..$n].copy_from_slice(&v);
                }};
            }
            match (k, t) {
                (K_Q4_1, 1) => call!(K_Q4_1, 1),
                (K_Q4_1, 2) => call!(K_Q4_1, 2),
                (K_Q4_1, _) => call!(K_Q4_1, 3),
                (K_Q8_0, 1) => call!(K_Q8_0, 1),
                (K_Q8_0, 2) => call!(K_Q8_0, 2),
                (K_Q8_0, _) => call!(K_Q8_0, 3),
                (_, 1) => call!(K_Q5_0, 1),
                (_, 2) => call!(K_Q5_0, 2),
                _ => call!(K_Q5_0, 3),
            }
            store(out, rows, g, &o[..t]);
        });
    });
}

/// Writes group `g`'s outputs `o[tok]` (rows past the end dropped).
pub(super) fn store(out: OutPtr, rows: usize, g: usize, o: &[[f32; GROUP]]) {
    let r0 = g * GROUP;
    for (tok, v) in o.iter().enumerate() {
        for (j, &val) in v.iter().enumerate().take(rows - r0) {
            // SAFETY: the caller's `y` is [o.len(), rows] and `r0 + j < rows`; only the task of
            // group g writes its rows.
            unsafe { *out.at(tok * rows + r0 + j) = val };
        }
    }
}

/// `y[tok, r]` for a prompt (any number of tokens) over the [`Layout::X8`] matrix `w`; the same
/// outputs as [`matmul`]. Only for CPUs with AVX2, FMA and F16C (checked).
pub(super) fn matmul_prompt(w: &Src, act: &[u8], ab: usize, t: usize, out: OutPtr) {
    let (k, nb) = check(w, act, ab, t);
    let rows = w.rows;
    PREP.with_borrow_mut(|p| {
        prepare(k, act, ab, t, p);
        let p = &*p;
        let glen = nb * cell_len(k);
        pool::parallel_for(rows.div_ceil(GROUP), |g| {
            let group = &w.data[g * glen..][..glen];
            if k == K_Q8_0 {
                // Q8_0's values are the stored bytes: nothing to unpack; tokens in pairs share
                // each |w|.
                for tok in (0..t).step_by(2) {
                    let a: [Tok; 2] =
                        core::array::from_fn(|c| p.tok(k, act, ab, nb, (tok + c).min(t - 1)));
                    // SAFETY: AVX2+FMA+F16C were checked by `check`.
                    let v = unsafe { gemv::<K_Q8_0, 2>(group, nb, &a) };
                    let n = (t - tok).min(2);
                    store(out_row(out, tok, rows), rows, g, &v[..n]);
                }
                return;
            }
            UNPACKED.with_borrow_mut(|u| {
                for tok in 0..t {
                    let a = p.tok(k, act, ab, nb, tok);
                    // SAFETY (both calls): AVX2+FMA+F16C were checked by `check`.
                    let v = unsafe {
                        if k == K_Q4_1 {
                            if tok == 0 {
                                unpack_group::<K_Q4_1>(group, nb, u);
                            }
                            gemv_unpacked::<K_Q4_1>(u, nb, &a)
                        } else {
                            if tok == 0 {
                                unpack_group::<K_Q5_0>(group, nb, u);
                            }
                            gemv_unpacked::<K_Q5_0>(u, nb, &a)
                        }
                    };
                    store(out_row(out, tok, rows), rows, g, &[v]);
                }
            })
        });
    });
}

/// `out` moved to token `tok`'s row of a [T, rows] output.
fn out_row(out: OutPtr, tok: usize, rows: usize) -> OutPtr {
    OutPtr(out.at(tok * rows))
}

/// The 8 group-vectors of values `q` of cell `cell` (kind `K`).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `cell` is readable for a whole cell of kind `K`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values<const K: u8>(cell: *const u8) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0f);
    let m10 = _mm256_set1_epi8(0x10);
    // SAFETY: the nibble vectors (Q8_0: the quant vectors) and (Q5_0) the 5th-bit vector lie
    // inside the cell.
    unsafe {
        if K == K_Q8_0 {
            return core::array::from_fn(|g| {
                _mm256_loadu_si256(cell.add(nib_off(K) + 32 * g) as *const __m256i)
            });
        }
        let nib: [__m256i; 4] = core::array::from_fn(|c| {
            _mm256_loadu_si256(cell.add(nib_off(K) + 32 * c) as *const __m256i)
        });
        let lo: [__m256i; 8] = core::array::from_fn(|g| {
            let v = if g < 4 {
                nib[g]
            } else {
                _mm256_srli_epi16::<4>(nib[g - 4])
            };
            _mm256_and_si256(v, m4)
        });
        if K == K_Q4_1 {
            return lo;
        }
        // Bit g of each byte to bit 4: from `hb << 4` for g < 4, from `hb` for g >= 4 (16-bit
        // shifts; the bit kept never crosses from the other byte).
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
        core::array::from_fn(|g| _mm256_or_si256(lo[g], _mm256_and_si256(highs[g], m10)))
    }
}

/// The 8 rows of `group` (`nb` cells of kind `K`) times the `T` tokens `a`: `out[c][r]` equals
/// `quant::vec_dot` of row r and token c on the AVX2 tier, bit for bit.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[allow(clippy::needless_range_loop)] // index loops over per-token register arrays
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<const K: u8, const T: usize>(
    group: &[u8],
    nb: usize,
    a: &[Tok; T],
) -> [[f32; GROUP]; T] {
    let (cl, (ba, aqs)) = (cell_len(K), act_block(K));
    assert!(group.len() >= nb * cl, "gemv x8: short group");
    for at in a {
        assert!(
            at.q.len() >= nb * ba
                && at.d.len() >= nb
                && (K != K_Q4_1 || at.s.len() >= nb)
                && (K != K_Q5_0 || at.corr.len() >= nb * 8),
            "gemv x8: short activation row"
        );
    }
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 8]; T];
    let mut summs = [_mm256_setzero_ps(); T];
    for ib in 0..nb {
        // SAFETY (whole block): cell `ib` of the group, block `ib` of every token's quants, its
        // d, s and corrections lie inside the slices (asserted above).
        unsafe {
            let cell = group.as_ptr().add(ib * cl);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(cell as *const __m128i));
            let dp: [__m256; T] = core::array::from_fn(|c| {
                _mm256_mul_ps(dw, _mm256_set1_ps(*a[c].d.get_unchecked(ib)))
            });
            if K == K_Q4_1 {
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(cell.add(M) as *const __m128i));
                for c in 0..T {
                    let sx = _mm256_set1_ps(*a[c].s.get_unchecked(ib));
                    summs[c] = _mm256_add_ps(summs[c], _mm256_mul_ps(mw, sx));
                }
            }
            let q = values::<K>(cell);
            for g in 0..8 {
                // Q8_0: |w| and, per token, x with w's sign (`mul_sum_i8_pairs`).
                let aq = if K == K_Q8_0 {
                    _mm256_sign_epi8(q[g], q[g])
                } else {
                    q[g]
                };
                for c in 0..T {
                    let x =
                        (a[c].q.as_ptr().add(ib * ba + aqs + 4 * g) as *const i32).read_unaligned();
                    let mut x = _mm256_set1_epi32(x);
                    if K == K_Q8_0 {
                        x = _mm256_sign_epi8(x, q[g]);
                    }
                    let mut p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, x), ones);
                    if K == K_Q5_0 {
                        let corr = *a[c].corr.get_unchecked(ib * 8 + g);
                        p = _mm256_sub_epi32(p, _mm256_set1_epi32(corr));
                    }
                    acc[c][g] = _mm256_fmadd_ps(dp[c], _mm256_cvtepi32_ps(p), acc[c][g]);
                }
            }
        }
    }
    let mut out = [[0f32; GROUP]; T];
    for c in 0..T {
        let mut r = hsum_lanes(&acc[c]);
        if K == K_Q4_1 {
            r = _mm256_add_ps(r, summs[c]);
        }
        // SAFETY: `out[c]` holds 8 f32.
        unsafe { _mm256_storeu_ps(out[c].as_mut_ptr(), r) };
    }
    out
}

/// Unpacks the `nb` cells of `group` (kind `K`) into `u`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_group<const K: u8>(group: &[u8], nb: usize, u: &mut Unpacked) {
    let cl = cell_len(K);
    assert!(group.len() >= nb * cl, "unpack_group: short group");
    u.q.resize(nb * 8, Line([0; 32]));
    u.d.resize(nb, Line([0; 32]));
    u.m.resize(nb, Line([0; 32]));
    for ib in 0..nb {
        // SAFETY: cell `ib` lies inside `group` (asserted); `u` holds 8 lines per block and one
        // per block in `d` and `m` (resized above), 32-byte aligned.
        unsafe {
            let cell = group.as_ptr().add(ib * cl);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(cell as *const __m128i));
            _mm256_store_ps(u.d.as_mut_ptr().add(ib) as *mut f32, dw);
            if K == K_Q4_1 {
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(cell.add(M) as *const __m128i));
                _mm256_store_ps(u.m.as_mut_ptr().add(ib) as *mut f32, mw);
            }
            let q = values::<K>(cell);
            for (g, &v) in q.iter().enumerate() {
                _mm256_store_si256(u.q.as_mut_ptr().add(ib * 8 + g) as *mut __m256i, v);
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
unsafe fn gemv_unpacked<const K: u8>(u: &Unpacked, nb: usize, a: &Tok) -> [f32; GROUP] {
    let (ba, aqs) = act_block(K);
    assert!(
        u.q.len() >= nb * 8 && u.d.len() >= nb && u.m.len() >= nb,
        "gemv_unpacked: short group"
    );
    assert!(
        a.q.len() >= nb * ba
            && a.d.len() >= nb
            && (K != K_Q4_1 || a.s.len() >= nb)
            && (K != K_Q5_0 || a.corr.len() >= nb * 8),
        "gemv_unpacked: short activation row"
    );
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut summs = _mm256_setzero_ps();
    for ib in 0..nb {
        // SAFETY: block `ib` of the unpacked group and of the token lie inside the slices
        // (asserted above); the lines are 32-byte aligned.
        unsafe {
            let dw = _mm256_load_ps(u.d.as_ptr().add(ib) as *const f32);
            let dp = _mm256_mul_ps(dw, _mm256_set1_ps(*a.d.get_unchecked(ib)));
            if K == K_Q4_1 {
                let mw = _mm256_load_ps(u.m.as_ptr().add(ib) as *const f32);
                let sx = _mm256_set1_ps(*a.s.get_unchecked(ib));
                summs = _mm256_add_ps(summs, _mm256_mul_ps(mw, sx));
            }
            for g in 0..8 {
                let q = _mm256_load_si256(u.q.as_ptr().add(ib * 8 + g) as *const __m256i);
                let x = (a.q.as_ptr().add(ib * ba + aqs + 4 * g) as *const i32).read_unaligned();
                let mut p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_set1_epi32(x)), ones);
                if K == K_Q5_0 {
                    let corr = *a.corr.get_unchecked(ib * 8 + g);
                    p = _mm256_sub_epi32(p, _mm256_set1_epi32(corr));
                }
                acc[g] = _mm256_fmadd_ps(dp, _mm256_cvtepi32_ps(p), acc[g]);
            }
        }
    }
    let mut r = hsum_lanes(&acc);
    if K == K_Q4_1 {
        r = _mm256_add_ps(r, summs);
    }
    let mut out = [0f32; GROUP];
    // SAFETY: `out` holds 8 f32.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), r) };
    out
}

/// `hsum_float_8` of each row's 8 lanes (lane g of row r in `v[g]`, element r): (l0 + l4,
/// l1 + l5, l2 + l6, l3 + l7), then (0 + 2) + (1 + 3), for the 8 rows at once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_lanes(v: &[__m256; 8]) -> __m256 {
    let t0 = _mm256_add_ps(v[0], v[4]);
    let t1 = _mm256_add_ps(v[1], v[5]);
    let t2 = _mm256_add_ps(v[2], v[6]);
    let t3 = _mm256_add_ps(v[3], v[7]);
    _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3))
}
