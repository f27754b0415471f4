//! AVX2 prompt kernels for Q4_K and Q6_K weights: the AVX2 tier's counterpart of `kquant` (read
//! its module text first), in the same float orders ([`Order::Q4kGemm`], [`Order::Q4kGemv`],
//! [`Order::Q6kTiled`]) and so with the same bits.
//!
//! Those orders are exact integer sums per sub-block (or pair of sub-blocks) followed by a few
//! scalar FMAs, so only the integer part differs from the AVX-512 kernels. Without VNNI the
//! integer product of 4 unsigned weight bytes and 4 signed activation bytes takes `maddubs`
//! (to i16 pairs) and a `madd` (to i32), and the i16 pairs have room to be summed first:
//!
//! * Each task unpacks 16 weight rows once, as two sets of 8 (one 256-bit vector: 8 rows' i32
//!   lanes), interleaved per 4 elements: one 32-byte line holds elements 4g..4g+4 of the 8 rows
//!   (Q4_K as 0..15, Q6_K as q + 32, both unsigned). A token's 4 activations of group g are
//!   broadcast to every lane; `maddubs` gives, in i16 lanes 2r and 2r+1, row r's two pair sums.
//! * Q4_K: a 32-element sub-block's 8 `maddubs` are added in i16 (each at most 2·15·128, so
//!   8 of them stay below 2^15), and one `madd` against the rows' scale (in both i16 lanes of
//!   the row) gives the scaled sub-block sum per row. The mins: one `madd` per pair of
//!   sub-blocks, the rows' two mins against the token's two 32-element sums (Σ of two bsums).
//! * Q6_K: a 16-element sub-block's `maddubs` are added two at a time (each at most 2·63·128,
//!   so two stay below 2^15), each pair `madd`-ed against the rows' scale; the weights' +32 is
//!   taken out per super-block by 8 `madd`s of the rows' scale pairs against the token's bsum
//!   pairs (read straight from the Q8_K block), times 32.
//!
//! Every sum is the exact integer the reference forms; the float epilogue then runs per lane
//! (row) exactly as `kquant`'s does, so results equal `vec_dot_q4k_gemm_order` /
//! `vec_dot_q4k_repacked` / `vec_dot_q6k_tiled_order` bit for bit (tests/matmul_tiles.rs and the
//! tier harness, tests/tiers.rs).
//!
//! Each task walks the tokens in blocks of [`TOKEN_BLOCK`] (their activations stay in L2) and
//! runs both 8-row sets over a block before the next.

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts

use core::arch::x86_64::*;

use ferrum_core::DType;

use super::{Order, OutPtr, Src, ROWS16};
use crate::quant::blocks::{rd_f16, scale_min_k4, unpack_q4k, unpack_q6k};
use crate::quant::QK_K;

/// Q8_K block: d (f32), 256 quants, 16 bsums (i16).
const Q8K_BYTES: usize = 292;
/// Offset of the bsums in a Q8_K block.
const Q8K_BSUMS: usize = 260;
/// Weight rows per kernel call: one i32 lane each.
const ROWS: usize = 8;
/// Tokens per call of the tile kernel.
const TOKENS: usize = 4;
/// Tokens a task walks before moving to its other 8 rows.
const TOKEN_BLOCK: usize = 64;

/// One 256-bit vector's bytes, aligned for aligned loads.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Line([u8; 32]);

const ZERO_LINE: Line = Line([0; 32]);

/// Whether these kernels take a product of `dtype` with these per-token orders on this CPU.
pub fn supports(dtype: DType, orders: &[Order]) -> bool {
    crate::cpu::features().x86_simd()
        && match dtype {
            DType::Q6_K => orders.iter().all(|&o| o == Order::Q6kTiled),
            DType::Q4_K => orders
                .iter()
                .all(|&o| matches!(o, Order::Q4kGemm | Order::Q4kGemv)),
            _ => false,
        }
}

/// 8 weight rows unpacked and interleaved (see the module text). Every field is a list of
/// 32-byte lines, one vector each.
struct Rows8 {
    /// Per super-block, 64 lines: line g holds elements 4g..4g+4 of the 8 rows.
    q: Vec<Line>,
    /// Per super-block, one line per sub-block (Q4_K 8, Q6_K 16): row r's scale in i16 lanes
    /// 2r and 2r+1.
    sc: Vec<Line>,
    /// Per super-block, pairs of per-row i16: Q4_K 4 lines, (min 2p, min 2p+1) of each row;
    /// Q6_K 8 lines, (scale 2k, scale 2k+1) of each row.
    pairs: Vec<Line>,
    /// Per super-block, 8 f32: the rows' d (and Q4_K's dmin).
    d: Vec<Line>,
    dmin: Vec<Line>,
}

impl Rows8 {
    const fn new() -> Self {
        Rows8 {
            q: Vec::new(),
            sc: Vec::new(),
            pairs: Vec::new(),
            d: Vec::new(),
            dmin: Vec::new(),
        }
    }

    /// Unpacks `rows` (8 rows of `nsb` super-blocks of `dtype`).
    fn fill(&mut self, dtype: DType, rows: &[&[u8]], nsb: usize) {
        debug_assert_eq!(rows.len(), ROWS);
        let bb = dtype.block_bytes();
        let q4k = dtype == DType::Q4_K;
        let (n_sub, n_pairs) = if q4k { (8, 4) } else { (16, 8) };
        for (v, n) in [
            (&mut self.q, nsb * 64),
            (&mut self.sc, nsb * n_sub),
            (&mut self.pairs, nsb * n_pairs),
            (&mut self.d, nsb),
            (&mut self.dmin, nsb),
        ] {
            v.clear();
            v.resize(n, ZERO_LINE);
        }
        let put_i16x2 = |l: &mut Line, r: usize, a: i16, b: i16| {
            l.0[4 * r..4 * r + 2].copy_from_slice(&a.to_le_bytes());
            l.0[4 * r + 2..4 * r + 4].copy_from_slice(&b.to_le_bytes());
        };
        let put_f32 = |l: &mut Line, r: usize, v: f32| {
            l.0[4 * r..4 * r + 4].copy_from_slice(&v.to_le_bytes())
        };
        let mut q = [0i8; QK_K];
        for (r, row) in rows.iter().enumerate() {
            for b in 0..nsb {
                let blk = &row[b * bb..(b + 1) * bb];
                let off = if q4k {
                    unpack_q4k(blk, &mut q);
                    let (sc, m) = scale_min_k4(&blk[4..16]);
                    for j in 0..8 {
                        put_i16x2(&mut self.sc[b * 8 + j], r, sc[j] as i16, sc[j] as i16);
                    }
                    for p in 0..4 {
                        let (m0, m1) = (m[2 * p] as i16, m[2 * p + 1] as i16);
                        put_i16x2(&mut self.pairs[b * 4 + p], r, m0, m1);
                    }
                    put_f32(&mut self.d[b], r, rd_f16(blk, 0));
                    put_f32(&mut self.dmin[b], r, rd_f16(blk, 2));
                    0i8
                } else {
                    unpack_q6k(blk, &mut q);
                    let sc = |s: usize| blk[192 + s] as i8 as i16;
                    for s in 0..16 {
                        put_i16x2(&mut self.sc[b * 16 + s], r, sc(s), sc(s));
                    }
                    for k in 0..8 {
                        put_i16x2(&mut self.pairs[b * 8 + k], r, sc(2 * k), sc(2 * k + 1));
                    }
                    put_f32(&mut self.d[b], r, rd_f16(blk, 208));
                    32
                };
                for g in 0..64 {
                    let l = &mut self.q[b * 64 + g].0[4 * r..4 * r + 4];
                    for k in 0..4 {
                        l[k] = (q[4 * g + k] + off) as u8;
                    }
                }
            }
        }
    }
}

thread_local! {
    /// Each worker's unpacked rows: a task's two sets of 8.
    static ROWS8: std::cell::RefCell<[Rows8; 2]> =
        const { std::cell::RefCell::new([Rows8::new(), Rows8::new()]) };
    /// Q4_K: per token and super-block, 4 i32, each two i16: the sums of 32-element
    /// sub-blocks 2p and 2p+1 of the activations (bsum pairs). Built once per call.
    static PREP: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `y[tok, r]` for every token of `act` (`t` rows of Q8_K, `ab` bytes each) and every row of `w`.
pub(crate) fn matmul_k(w: &Src, act: &[u8], ab: usize, t: usize, orders: &[Order], y: &mut [f32]) {
    assert!(supports(w.dtype, orders), "kquant_avx2: {}", w.dtype);
    let (rows, cols) = (w.rows, w.cols);
    let nsb = cols / QK_K;
    assert_eq!(ab, nsb * Q8K_BYTES, "kquant_avx2: activation row bytes");
    assert!(act.len() >= t * ab && orders.len() == t && y.len() == t * rows);
    let out = OutPtr(y.as_mut_ptr());
    let dtype = w.dtype;
    PREP.with_borrow_mut(|prep| {
        prep.clear();
        if dtype == DType::Q4_K {
            prep.resize(t * nsb * 4, 0);
            for tok in 0..t {
                for b in 0..nsb {
                    let bs = bsums(&act[tok * ab + b * Q8K_BYTES..][..Q8K_BYTES]);
                    for p in 0..4 {
                        // Each sum of 32 activations fits i16 (|q| <= 128).
                        let s0 = (bs[4 * p] + bs[4 * p + 1]) as i16;
                        let s1 = (bs[4 * p + 2] + bs[4 * p + 3]) as i16;
                        prep[(tok * nsb + b) * 4 + p] =
                            (s0 as u16 as u32 | ((s1 as u16 as u32) << 16)) as i32;
                    }
                }
            }
        }
        let prep = &prep[..];
        crate::pool::parallel_for(rows.div_ceil(ROWS16), |task| {
            let r_task = task * ROWS16;
            ROWS8.with_borrow_mut(|sets| {
                // A last task of fewer than 16 rows repeats its last row; the extra results are
                // dropped.
                w.with_rows16(r_task, |rws| {
                    sets[0].fill(dtype, &rws[..ROWS], nsb);
                    if r_task + ROWS < rows {
                        sets[1].fill(dtype, &rws[ROWS..], nsb);
                    }
                });
                let gemm = |tok: usize| orders[tok] == Order::Q4kGemm;
                for tb in (0..t).step_by(TOKEN_BLOCK) {
                    let te = (tb + TOKEN_BLOCK).min(t);
                    for (h, u) in sets.iter().enumerate() {
                        let r0 = r_task + h * ROWS;
                        if r0 >= rows {
                            break;
                        }
                        let n = ROWS.min(rows - r0);
                        let k = Kernel {
                            dtype,
                            u,
                            act,
                            ab,
                            prep,
                            nsb,
                        };
                        let store = |tok: usize, v: &[f32; ROWS]| {
                            for (i, &val) in v[..n].iter().enumerate() {
                                // SAFETY: tok < t and r0 + i < rows: inside `y`; only this task
                                // writes row r0 + i.
                                unsafe { *out.at(tok * rows + r0 + i) = val };
                            }
                        };
                        let mut tok = tb;
                        while tok + TOKENS <= te {
                            let o = k.tile::<TOKENS>(tok, core::array::from_fn(|c| gemm(tok + c)));
                            o.iter().enumerate().for_each(|(c, v)| store(tok + c, v));
                            tok += TOKENS;
                        }
                        match te - tok {
                            3 => {
                                let o = k.tile::<3>(tok, core::array::from_fn(|c| gemm(tok + c)));
                                o.iter().enumerate().for_each(|(c, v)| store(tok + c, v));
                            }
                            2 => {
                                let o = k.tile::<2>(tok, core::array::from_fn(|c| gemm(tok + c)));
                                o.iter().enumerate().for_each(|(c, v)| store(tok + c, v));
                            }
                            1 => store(tok, &k.tile::<1>(tok, [gemm(tok)])[0]),
                            _ => {}
                        }
                    }
                }
            });
        });
    });
}

/// The 16 bsums (Σ of each 16 activations) of a Q8_K block.
#[inline(always)]
fn bsums(by: &[u8]) -> [i32; 16] {
    let b: &[u8; 32] = by[Q8K_BSUMS..Q8K_BYTES].try_into().unwrap();
    core::array::from_fn(|g| i16::from_le_bytes([b[2 * g], b[2 * g + 1]]) as i32)
}

/// One call's operands: 8 unpacked rows against the tokens of `act`.
struct Kernel<'a> {
    dtype: DType,
    u: &'a Rows8,
    act: &'a [u8],
    ab: usize,
    prep: &'a [i32],
    nsb: usize,
}

impl Kernel<'_> {
    /// The 8 rows x `C` tokens from `tok0`; `gemm[c]`: token `tok0 + c` takes the Q4_K GEMM order.
    fn tile<const C: usize>(&self, tok0: usize, gemm: [bool; C]) -> [[f32; ROWS]; C] {
        let nsb = self.nsb;
        let q4k = self.dtype == DType::Q4_K;
        let (n_sub, n_pairs) = if q4k { (8, 4) } else { (16, 8) };
        assert!(
            self.u.q.len() >= nsb * 64
                && self.u.sc.len() >= nsb * n_sub
                && self.u.pairs.len() >= nsb * n_pairs
                && self.u.d.len() >= nsb
                && self.u.dmin.len() >= nsb
        );
        assert!(self.act.len() >= (tok0 + C) * self.ab && self.ab >= nsb * Q8K_BYTES);
        assert!(!q4k || self.prep.len() >= (tok0 + C) * nsb * 4);
        assert!(crate::cpu::features().x86_simd());
        // SAFETY: AVX2 and FMA checked; every buffer the kernel reads holds what it reads
        // (asserted above).
        unsafe {
            if q4k {
                self.tile_q4k::<C>(tok0, gemm)
            } else {
                self.tile_q6k::<C>(tok0)
            }
        }
    }

    /// The i32 at byte `off` of token `tok`'s super-block `b`, in every lane.
    #[inline(always)]
    unsafe fn act32(&self, tok: usize, b: usize, off: usize) -> __m256i {
        // SAFETY: the caller keeps tok and b inside the activations and off + 4 <= Q8K_BYTES
        // (checked by `tile`).
        unsafe {
            let p = self.act.as_ptr().add(tok * self.ab + b * Q8K_BYTES + off);
            _mm256_set1_epi32((p as *const i32).read_unaligned())
        }
    }

    /// Token `tok`'s 4 activations of group `g` (elements 4g..4g+4) of super-block `b`, in
    /// every lane.
    #[inline(always)]
    unsafe fn a4(&self, tok: usize, b: usize, g: usize) -> __m256i {
        // SAFETY: as for `act32`.
        unsafe { self.act32(tok, b, 4 + 4 * g) }
    }

    /// Token `tok`'s d of super-block `b` in every lane.
    #[inline(always)]
    unsafe fn dy(&self, tok: usize, b: usize) -> __m256 {
        // SAFETY: as for `act32`.
        unsafe {
            let p = self.act.as_ptr().add(tok * self.ab + b * Q8K_BYTES);
            _mm256_set1_ps((p as *const f32).read_unaligned())
        }
    }

    #[inline(always)]
    unsafe fn line_i(v: &[Line], i: usize) -> __m256i {
        // SAFETY: the caller keeps i inside `v` (checked by `tile`); lines are 32-byte aligned.
        unsafe { _mm256_load_si256(v.as_ptr().add(i) as *const __m256i) }
    }

    #[inline(always)]
    unsafe fn line_f(v: &[Line], i: usize) -> __m256 {
        // SAFETY: as for `line_i`.
        unsafe { _mm256_load_ps(v.as_ptr().add(i) as *const f32) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_q6k<const C: usize>(&self, tok0: usize) -> [[f32; ROWS]; C] {
        let u = self.u;
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..self.nsb {
            // SAFETY (whole block): indices inside the buffers checked by `tile`.
            unsafe {
                // 32·Σ_s scale_s·bsum_s per row: the weights' +32 taken out.
                let mut corr = [_mm256_setzero_si256(); C];
                for k in 0..8 {
                    let sp = Self::line_i(&u.pairs, b * 8 + k);
                    for c in 0..C {
                        let bs = self.act32(tok0 + c, b, Q8K_BSUMS + 4 * k);
                        corr[c] = _mm256_add_epi32(corr[c], _mm256_madd_epi16(sp, bs));
                    }
                }
                let mut tot: [__m256i; C] = core::array::from_fn(|c| {
                    _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<5>(corr[c]))
                });
                for s in 0..16 {
                    let sc = Self::line_i(&u.sc, b * 16 + s);
                    for half in 0..2 {
                        let g0 = 4 * s + 2 * half;
                        let w0 = Self::line_i(&u.q, b * 64 + g0);
                        let w1 = Self::line_i(&u.q, b * 64 + g0 + 1);
                        for c in 0..C {
                            let p = _mm256_add_epi16(
                                _mm256_maddubs_epi16(w0, self.a4(tok0 + c, b, g0)),
                                _mm256_maddubs_epi16(w1, self.a4(tok0 + c, b, g0 + 1)),
                            );
                            tot[c] = _mm256_add_epi32(tot[c], _mm256_madd_epi16(p, sc));
                        }
                    }
                }
                let d = Self::line_f(&u.d, b);
                for c in 0..C {
                    let r = _mm256_mul_ps(_mm256_cvtepi32_ps(tot[c]), d);
                    acc[c] = _mm256_fmadd_ps(r, self.dy(tok0 + c, b), acc[c]);
                }
            }
        }
        let mut out = [[0f32; ROWS]; C];
        for c in 0..C {
            // SAFETY: `out[c]` holds 8 f32.
            unsafe { _mm256_storeu_ps(out[c].as_mut_ptr(), acc[c]) };
        }
        out
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_q4k<const C: usize>(&self, tok0: usize, gemm: [bool; C]) -> [[f32; ROWS]; C] {
        let u = self.u;
        let mut acc = [_mm256_setzero_ps(); C];
        let mut acc_m = [_mm256_setzero_ps(); C];
        for b in 0..self.nsb {
            // SAFETY (whole block): indices inside the buffers checked by `tile`.
            unsafe {
                let d = Self::line_f(&u.d, b);
                let dmin = Self::line_f(&u.dmin, b);
                let mut isum = [_mm256_setzero_si256(); C];
                let mut imin = [_mm256_setzero_si256(); C];
                for p in 0..4 {
                    let mut ip = [_mm256_setzero_si256(); C];
                    for j in 2 * p..2 * p + 2 {
                        let mut s16 = [_mm256_setzero_si256(); C];
                        for g in 8 * j..8 * j + 8 {
                            let wv = Self::line_i(&u.q, b * 64 + g);
                            for c in 0..C {
                                s16[c] = _mm256_add_epi16(
                                    s16[c],
                                    _mm256_maddubs_epi16(wv, self.a4(tok0 + c, b, g)),
                                );
                            }
                        }
                        let sc = Self::line_i(&u.sc, b * 8 + j);
                        for c in 0..C {
                            ip[c] = _mm256_add_epi32(ip[c], _mm256_madd_epi16(s16[c], sc));
                        }
                    }
                    let mins = Self::line_i(&u.pairs, b * 4 + p);
                    for c in 0..C {
                        let pr = _mm256_set1_epi32(
                            *self.prep.get_unchecked(((tok0 + c) * self.nsb + b) * 4 + p),
                        );
                        let mp = _mm256_madd_epi16(mins, pr);
                        if gemm[c] {
                            let dy = self.dy(tok0 + c, b);
                            acc[c] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(ip[c]),
                                _mm256_mul_ps(d, dy),
                                acc[c],
                            );
                            acc_m[c] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(mp),
                                _mm256_mul_ps(dmin, dy),
                                acc_m[c],
                            );
                        } else {
                            isum[c] = _mm256_add_epi32(isum[c], ip[c]);
                            imin[c] = _mm256_add_epi32(imin[c], mp);
                        }
                    }
                }
                for c in 0..C {
                    if !gemm[c] {
                        let dy = self.dy(tok0 + c, b);
                        acc[c] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(isum[c]),
                            _mm256_mul_ps(d, dy),
                            acc[c],
                        );
                        acc_m[c] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(imin[c]),
                            _mm256_mul_ps(dmin, dy),
                            acc_m[c],
                        );
                    }
                }
            }
        }
        let mut out = [[0f32; ROWS]; C];
        for c in 0..C {
            // SAFETY: `out[c]` holds 8 f32.
            unsafe { _mm256_storeu_ps(out[c].as_mut_ptr(), _mm256_sub_ps(acc[c], acc_m[c])) };
        }
        out
    }
}
