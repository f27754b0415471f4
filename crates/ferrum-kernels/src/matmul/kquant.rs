//! AVX-512 VNNI prompt kernels for Q4_K and Q6_K weights, in the float orders llama.cpp's prefill
//! uses for them ([`Order::Q4kGemm`], [`Order::Q4kGemv`], [`Order::Q6kTiled`]).
//!
//! Those orders are exact integer sums per super-block (Q4_K: per 64-element chunk) followed by a
//! few scalar FMAs, so the integer part may be computed any way at all. Here each task unpacks 16
//! weight rows once, interleaved: per 4 consecutive elements, one 64-byte line holding them for
//! all 16 rows (Q4_K as 0..15, Q6_K as q + 32, both unsigned), so one VNNI instruction against
//! a token's 4 activations broadcast to every lane advances 16 rows' sums. The sums of a
//! sub-block are scaled per lane (row) and added; the float epilogue then runs on the 16 rows as
//! the lanes of one vector, each lane doing exactly the scalar operations of the order's
//! reference (`quant::vec_dot_q4k_gemm_order_ref`, `vec_dot_q4k_repacked_ref`,
//! `vec_dot_q6k_tiled_order_ref`) for its row. Results equal `vec_dot_q4k_gemm_order` /
//! `vec_dot_q4k_repacked` / `vec_dot_q6k_tiled_order` bit for bit (tests/matmul_tiles.rs).

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts

use core::arch::x86_64::*;

use ferrum_core::DType;

use super::avx512::Line;
use super::{Order, OutPtr, Src};
use crate::quant::blocks::{rd_f16, scale_min_k4, unpack_q4k, unpack_q6k};
use crate::quant::QK_K;

/// Q8_K block: d (f32), 256 quants, 16 bsums (i16).
const Q8K_BYTES: usize = 292;
/// Weight rows per task: one vector lane each.
const ROWS: usize = 16;
/// Tokens per call of the tile kernel.
const TOKENS: usize = 4;

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

/// 16 weight rows unpacked and interleaved (see the module text). Every field is a list of
/// 64-byte lines, one vector each.
struct Rows16 {
    /// Per super-block, 64 lines: line g holds elements 4g..4g+4 of the 16 rows.
    q: Vec<Line>,
    /// Per super-block, one line of 16 i32 per sub-block (Q4_K: 8 of 32 elements, Q6_K: 16 of 16):
    /// the rows' scales.
    sc: Vec<Line>,
    /// Q4_K: per super-block, 8 lines of 16 i32: the rows' mins.
    mins: Vec<Line>,
    /// Per super-block, 16 f32: the rows' d (and Q4_K's dmin).
    d: Vec<Line>,
    dmin: Vec<Line>,
}

const ZERO_LINE: Line = Line([0; 64]);

impl Rows16 {
    const fn new() -> Self {
        Rows16 {
            q: Vec::new(),
            sc: Vec::new(),
            mins: Vec::new(),
            d: Vec::new(),
            dmin: Vec::new(),
        }
    }

    /// Unpacks `rows` (16 rows of `nsb` super-blocks of `dtype`).
    fn fill(&mut self, dtype: DType, rows: &[&[u8]; ROWS], nsb: usize) {
        let bb = dtype.block_bytes();
        let n_sub = if dtype == DType::Q4_K { 8 } else { 16 };
        for (v, n) in [
            (&mut self.q, nsb * 64),
            (&mut self.sc, nsb * n_sub),
            (&mut self.mins, nsb * 8),
            (&mut self.d, nsb),
            (&mut self.dmin, nsb),
        ] {
            v.clear();
            v.resize(n, ZERO_LINE);
        }
        let put_i32 = |l: &mut Line, r: usize, v: i32| {
            l.0[4 * r..4 * r + 4].copy_from_slice(&v.to_le_bytes())
        };
        let put_f32 = |l: &mut Line, r: usize, v: f32| {
            l.0[4 * r..4 * r + 4].copy_from_slice(&v.to_le_bytes())
        };
        let mut q = [0i8; QK_K];
        for (r, row) in rows.iter().enumerate() {
            for b in 0..nsb {
                let blk = &row[b * bb..(b + 1) * bb];
                let off = if dtype == DType::Q4_K {
                    unpack_q4k(blk, &mut q);
                    let (sc, m) = scale_min_k4(&blk[4..16]);
                    for j in 0..8 {
                        put_i32(&mut self.sc[b * 8 + j], r, sc[j] as i32);
                        put_i32(&mut self.mins[b * 8 + j], r, m[j] as i32);
                    }
                    put_f32(&mut self.d[b], r, rd_f16(blk, 0));
                    put_f32(&mut self.dmin[b], r, rd_f16(blk, 2));
                    0i8
                } else {
                    unpack_q6k(blk, &mut q);
                    for s in 0..16 {
                        put_i32(&mut self.sc[b * 16 + s], r, blk[192 + s] as i8 as i32);
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
    /// Each worker's unpacked rows.
    static ROWS16: std::cell::RefCell<Rows16> = const { std::cell::RefCell::new(Rows16::new()) };
    /// Per-token integers from the activations' bsums, built once per call on the calling thread.
    static PREP: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `y[tok, r]` for every token of `act` (`t` rows of Q8_K, `ab` bytes each) and every row of `w`.
pub(crate) fn matmul_k(w: &Src, act: &[u8], ab: usize, t: usize, orders: &[Order], y: &mut [f32]) {
    assert!(supports(w.dtype, orders), "matmul_k: {}", w.dtype);
    let (rows, cols) = (w.rows, w.cols);
    let nsb = cols / QK_K;
    assert_eq!(ab, nsb * Q8K_BYTES, "matmul_k: activation row bytes");
    assert!(act.len() >= t * ab && orders.len() == t && y.len() == t * rows);
    let out = OutPtr(y.as_mut_ptr());
    let dtype = w.dtype;
    PREP.with_borrow_mut(|prep| {
        // Per token and super-block, 16 i32: Q4_K the 8 sums of each 32 activations (bsum pairs),
        // Q6_K the start value -32·Σ of each 16 activations (the weights enter as q + 32).
        prep.clear();
        prep.resize(t * nsb * 16, 0);
        for tok in 0..t {
            for b in 0..nsb {
                let bs = bsums(&act[tok * ab + b * Q8K_BYTES..][..Q8K_BYTES]);
                let p = &mut prep[(tok * nsb + b) * 16..][..16];
                if dtype == DType::Q4_K {
                    for j in 0..8 {
                        p[j] = bs[2 * j] + bs[2 * j + 1];
                    }
                } else {
                    for s in 0..16 {
                        p[s] = -32 * bs[s];
                    }
                }
            }
        }
        let prep = &prep[..];
        crate::pool::parallel_for(rows.div_ceil(ROWS), |task| {
            let r0 = task * ROWS;
            let n = ROWS.min(rows - r0);
            // A last task of fewer than 16 rows repeats its last row; the extra results are dropped.
            ROWS16.with_borrow_mut(|u| {
                w.with_rows16(r0, |rws| u.fill(dtype, rws, nsb));
                let k = Kernel {
                    dtype,
                    u: &*u,
                    act,
                    ab,
                    prep,
                    nsb,
                };
                let store = |tok: usize, v: &[f32; ROWS]| {
                    for (i, &val) in v[..n].iter().enumerate() {
                        // SAFETY: tok < t and r0 + i < rows: inside `y`; only this task writes
                        // row r0 + i.
                        unsafe { *out.at(tok * rows + r0 + i) = val };
                    }
                };
                let gemm = |tok: usize| orders[tok] == Order::Q4kGemm;
                let mut tok = 0;
                while tok + TOKENS <= t {
                    let o = k.tile::<TOKENS>(tok, core::array::from_fn(|c| gemm(tok + c)));
                    o.iter().enumerate().for_each(|(c, v)| store(tok + c, v));
                    tok += TOKENS;
                }
                match t - tok {
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
            });
        });
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

/// One call's operands: 16 unpacked rows against the tokens of `act`.
struct Kernel<'a> {
    dtype: DType,
    u: &'a Rows16,
    act: &'a [u8],
    ab: usize,
    prep: &'a [i32],
    nsb: usize,
}

impl Kernel<'_> {
    /// The 16 rows x `C` tokens from `tok0`; `gemm[c]`: token `tok0 + c` takes the Q4_K GEMM order.
    fn tile<const C: usize>(&self, tok0: usize, gemm: [bool; C]) -> [[f32; ROWS]; C] {
        let nsb = self.nsb;
        let n_sub = if self.dtype == DType::Q4_K { 8 } else { 16 };
        assert!(
            self.u.q.len() >= nsb * 64
                && self.u.sc.len() >= nsb * n_sub
                && self.u.mins.len() >= nsb * 8
                && self.u.d.len() >= nsb
                && self.u.dmin.len() >= nsb
        );
        assert!(self.act.len() >= (tok0 + C) * self.ab && self.ab >= nsb * Q8K_BYTES);
        assert!(self.prep.len() >= (tok0 + C) * nsb * 16);
        assert!(super::avx512::available());
        // SAFETY: AVX-512 VNNI checked; every buffer the kernel reads holds what it reads
        // (asserted above).
        unsafe {
            if self.dtype == DType::Q4_K {
                self.tile_q4k::<C>(tok0, gemm)
            } else {
                self.tile_q6k::<C>(tok0)
            }
        }
    }

    /// Token `tok`'s 4 activations of group `g` (elements 4g..4g+4) of super-block `b`, in
    /// every lane.
    #[inline(always)]
    unsafe fn a4(&self, tok: usize, b: usize, g: usize) -> __m512i {
        // SAFETY: the caller keeps tok, b and g inside the activations (checked by `tile`).
        unsafe {
            let p = self
                .act
                .as_ptr()
                .add(tok * self.ab + b * Q8K_BYTES + 4 + 4 * g);
            _mm512_set1_epi32((p as *const i32).read_unaligned())
        }
    }

    /// Token `tok`'s d of super-block `b` in every lane.
    #[inline(always)]
    unsafe fn dy(&self, tok: usize, b: usize) -> __m512 {
        // SAFETY: as for `a4`.
        unsafe {
            let p = self.act.as_ptr().add(tok * self.ab + b * Q8K_BYTES);
            _mm512_set1_ps((p as *const f32).read_unaligned())
        }
    }

    #[inline(always)]
    unsafe fn prep(&self, tok: usize, b: usize, i: usize) -> __m512i {
        // SAFETY: as for `a4`.
        unsafe { _mm512_set1_epi32(*self.prep.get_unchecked((tok * self.nsb + b) * 16 + i)) }
    }

    #[inline(always)]
    unsafe fn line_i(v: &[Line], i: usize) -> __m512i {
        // SAFETY: the caller keeps i inside `v` (checked by `tile`); lines are 64-byte aligned.
        unsafe { _mm512_load_si512(v.as_ptr().add(i) as *const _) }
    }

    #[inline(always)]
    unsafe fn line_f(v: &[Line], i: usize) -> __m512 {
        // SAFETY: as for `line_i`.
        unsafe { _mm512_load_ps(v.as_ptr().add(i) as *const f32) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    unsafe fn tile_q6k<const C: usize>(&self, tok0: usize) -> [[f32; ROWS]; C] {
        let u = self.u;
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..self.nsb {
            let mut tot = [_mm512_setzero_si512(); C];
            for s in 0..16 {
                // SAFETY (whole block): indices inside the buffers checked by `tile`.
                unsafe {
                    let mut i: [__m512i; C] = core::array::from_fn(|c| self.prep(tok0 + c, b, s));
                    for g in 4 * s..4 * s + 4 {
                        let wv = Self::line_i(&u.q, b * 64 + g);
                        for c in 0..C {
                            i[c] = _mm512_dpbusd_epi32(i[c], wv, self.a4(tok0 + c, b, g));
                        }
                    }
                    let sc = Self::line_i(&u.sc, b * 16 + s);
                    for c in 0..C {
                        tot[c] = _mm512_add_epi32(tot[c], _mm512_mullo_epi32(i[c], sc));
                    }
                }
            }
            // SAFETY: as above.
            unsafe {
                let d = Self::line_f(&u.d, b);
                for c in 0..C {
                    let r = _mm512_mul_ps(_mm512_cvtepi32_ps(tot[c]), d);
                    acc[c] = _mm512_fmadd_ps(r, self.dy(tok0 + c, b), acc[c]);
                }
            }
        }
        let mut out = [[0f32; ROWS]; C];
        for c in 0..C {
            // SAFETY: `out[c]` holds 16 f32.
            unsafe { _mm512_storeu_ps(out[c].as_mut_ptr(), acc[c]) };
        }
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    unsafe fn tile_q4k<const C: usize>(&self, tok0: usize, gemm: [bool; C]) -> [[f32; ROWS]; C] {
        let u = self.u;
        let mut acc = [_mm512_setzero_ps(); C];
        let mut acc_m = [_mm512_setzero_ps(); C];
        for b in 0..self.nsb {
            // SAFETY (whole block): indices inside the buffers checked by `tile`.
            unsafe {
                let d = Self::line_f(&u.d, b);
                let dmin = Self::line_f(&u.dmin, b);
                let mut isum = [_mm512_setzero_si512(); C];
                for p in 0..4 {
                    let mut ip = [_mm512_setzero_si512(); C];
                    for j in 2 * p..2 * p + 2 {
                        let mut i = [_mm512_setzero_si512(); C];
                        for g in 8 * j..8 * j + 8 {
                            let wv = Self::line_i(&u.q, b * 64 + g);
                            for c in 0..C {
                                i[c] = _mm512_dpbusd_epi32(i[c], wv, self.a4(tok0 + c, b, g));
                            }
                        }
                        let sc = Self::line_i(&u.sc, b * 8 + j);
                        for c in 0..C {
                            ip[c] = _mm512_add_epi32(ip[c], _mm512_mullo_epi32(i[c], sc));
                        }
                    }
                    for c in 0..C {
                        if gemm[c] {
                            let dy = self.dy(tok0 + c, b);
                            let m0 = Self::line_i(&u.mins, b * 8 + 2 * p);
                            let m1 = Self::line_i(&u.mins, b * 8 + 2 * p + 1);
                            let mp = _mm512_add_epi32(
                                _mm512_mullo_epi32(m0, self.prep(tok0 + c, b, 2 * p)),
                                _mm512_mullo_epi32(m1, self.prep(tok0 + c, b, 2 * p + 1)),
                            );
                            acc[c] = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(ip[c]),
                                _mm512_mul_ps(d, dy),
                                acc[c],
                            );
                            acc_m[c] = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(mp),
                                _mm512_mul_ps(dmin, dy),
                                acc_m[c],
                            );
                        } else {
                            isum[c] = _mm512_add_epi32(isum[c], ip[c]);
                        }
                    }
                }
                for c in 0..C {
                    if !gemm[c] {
                        let dy = self.dy(tok0 + c, b);
                        let mut imin = _mm512_setzero_si512();
                        for j in 0..8 {
                            let m = Self::line_i(&u.mins, b * 8 + j);
                            imin = _mm512_add_epi32(
                                imin,
                                _mm512_mullo_epi32(m, self.prep(tok0 + c, b, j)),
                            );
                        }
                        acc[c] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(isum[c]),
                            _mm512_mul_ps(d, dy),
                            acc[c],
                        );
                        acc_m[c] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(imin),
                            _mm512_mul_ps(dmin, dy),
                            acc_m[c],
                        );
                    }
                }
            }
        }
        let mut out = [[0f32; ROWS]; C];
        for c in 0..C {
            // SAFETY: `out[c]` holds 16 f32.
            unsafe { _mm512_storeu_ps(out[c].as_mut_ptr(), _mm512_sub_ps(acc[c], acc_m[c])) };
        }
        out
    }
}

/// Two Q6_K rows x one Q8_K activation row in the float order of `vec_dot` (llama.cpp's AVX2
/// `ggml_vec_dot_q6_K_q8_K`): per super-block the 8 exact i32 lanes of that kernel (lane l: the
/// scaled products of bytes 4l..4l+4 of every 32-element chunk, minus 32·(scale·bsum) of
/// sub-blocks 2l and 2l+1), then `acc = fma(d_w·d_x, f32(lane), acc)` per lane and
/// `hsum_float_8`. A 512-bit vector holds the two rows' 8 lanes, so the unpacking and the VNNI
/// products serve both rows at once. Same bits as `vec_dot` (tests/matmul_tiles.rs).
pub fn q6k_vec_pair(ra: &[u8], rb: &[u8], act: &[u8], nsb: usize) -> [f32; 2] {
    assert!(
        super::avx512::available(),
        "q6k_vec_pair: CPU lacks AVX-512 VNNI"
    );
    assert!(ra.len() >= nsb * 210 && rb.len() >= nsb * 210 && act.len() >= nsb * Q8K_BYTES);
    // SAFETY: AVX-512 VNNI checked; the rows and the activations hold nsb super-blocks.
    unsafe { q6k_vec_pair_kernel(ra, rb, act, nsb) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_vec_pair_kernel(ra: &[u8], rb: &[u8], act: &[u8], nsb: usize) -> [f32; 2] {
    use crate::quant::blocks::{Q6_K_D, Q6_K_QH, Q6_K_SCALES, Q8_K_BSUMS, Q8_K_QS};
    let m4 = _mm512_set1_epi8(0x0f);
    let m2 = _mm512_set1_epi8(3);
    // Scale lanes of chunk c: row A sub-blocks 2c (lanes 0..4), 2c+1 (4..8); row B likewise.
    let sidx0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 16, 16, 16, 16, 17, 17, 17, 17);
    let mut acc = _mm512_setzero_ps();
    // SAFETY (whole loop): every offset below stays inside super-block b of the rows and of the
    // activations (lengths checked by the caller).
    unsafe {
        let pair = |off: usize| -> __m512i {
            let a = _mm256_loadu_si256(ra.as_ptr().add(off) as *const __m256i);
            let b = _mm256_loadu_si256(rb.as_ptr().add(off) as *const __m256i);
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
        };
        for blk in 0..nsb {
            let (wo, ao) = (blk * 210, blk * Q8K_BYTES);
            let sc_a = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                ra.as_ptr().add(wo + Q6_K_SCALES) as *const __m128i
            ));
            let sc_b = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                rb.as_ptr().add(wo + Q6_K_SCALES) as *const __m128i
            ));
            // 32·(scale·bsum) over sub-block pairs, as the AVX2 kernel's `madd_epi16`.
            let sc16 = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                    ra.as_ptr().add(wo + Q6_K_SCALES) as *const __m128i,
                ))),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(
                    rb.as_ptr().add(wo + Q6_K_SCALES) as *const __m128i
                )),
            );
            let bs = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                act.as_ptr().add(ao + Q8_K_BSUMS) as *const __m256i
            ));
            let sub = _mm512_slli_epi32::<5>(_mm512_madd_epi16(bs, sc16));
            let mut sumi = _mm512_setzero_si512();
            for h in 0..2 {
                let ql0 = pair(wo + 64 * h);
                let ql1 = pair(wo + 64 * h + 32);
                let qh = pair(wo + Q6_K_QH + 32 * h);
                let lows = [
                    _mm512_and_si512(ql0, m4),
                    _mm512_and_si512(ql1, m4),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql0), m4),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql1), m4),
                ];
                for (k, &lo) in lows.iter().enumerate() {
                    let hi =
                        _mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), m2);
                    let q = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hi));
                    let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        act.as_ptr().add(ao + Q8_K_QS + 128 * h + 32 * k) as *const __m256i,
                    ));
                    let c = 4 * h + k;
                    let idx = _mm512_add_epi32(sidx0, _mm512_set1_epi32(2 * c as i32));
                    let s = _mm512_permutex2var_epi32(sc_a, idx, sc_b);
                    let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y);
                    sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(p, s));
                }
            }
            let sumi = _mm512_sub_epi32(sumi, sub);
            let dy = (act.as_ptr().add(ao) as *const f32).read_unaligned();
            let da = crate::quant::blocks::rd_f16(ra, wo + Q6_K_D) * dy;
            let db = crate::quant::blocks::rd_f16(rb, wo + Q6_K_D) * dy;
            let d = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castps_pd(_mm512_set1_ps(da)),
                _mm256_castps_pd(_mm256_set1_ps(db)),
            ));
            acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc);
        }
    }
    let mut l = [0f32; 16];
    // SAFETY: `l` holds 16 f32.
    unsafe { _mm512_storeu_ps(l.as_mut_ptr(), acc) };
    [
        super::avx512::hsum8_order(l[0..8].try_into().unwrap()),
        super::avx512::hsum8_order(l[8..16].try_into().unwrap()),
    ]
}
