//! AVX-512 (F, BW, VL, VNNI) kernels: prompt tiles for Q4_1, Q5_0 and Q8_0 weights (Q4_1: 4
//! weight rows x up to 4 tokens, each block unpacked once per tile; Q5_0/Q8_0: 8 rows x up to 4
//! tokens over rows each task unpacks once, [`Unpacked`]), and one-token products over Q4_1,
//! Q5_0, Q8_0, Q4_K and Q6_K matrices repacked in groups of 16 rows ([`pack_x16`],
//! [`gemv_x16`]; the K-quants in their own float orders, documented at their kernels).
//!
//! Every output is summed in exactly the float order of the AVX2 `vec_dot` (llama.cpp's order):
//! per block, the 8 i32 lanes of Σ w·a over 4 consecutive bytes (exact integers, so any way of
//! computing them gives the same values), converted to f32 and accumulated by
//! `acc[lane] = fma(d_w·d_a, lane, acc[lane])`; then the 8 lanes are reduced as `hsum_float_8`,
//! and for Q4_1 the separately accumulated Σ m_w·s_a is added. A 512-bit register holds the 8
//! lanes of two rows, which changes no float operation, so the tile results equal `vec_dot`'s bit
//! for bit (tests/matmul_tiles.rs checks it on random data). The exception is opt-in: with
//! [`super::block_order`] on, the packed Q4_1/Q5_0/Q8_0 kernels (`gemv_group_*_blocks`) sum each
//! block's products as one exact integer and do one conversion and one FMA per block, the order
//! of [`crate::quant::vec_dot_blocks`] (tests/block_order.rs).
//!
//! Activations are first laid out per token and block ([`Prepared`]) so that a single 64-byte
//! load serves a row pair:
//! * Q8_1 (for Q4_1): `[a0..15, a0..15, a16..31, a16..31]` against weights unpacked as
//!   `[row0 low nibbles, row1 low, row0 high, row1 high]`; plus `[d_a, s_a, d_a, s_a]`.
//! * Q8_0 (for Q8_0 and Q5_0): `[a0..31, a0..31]` against `[row0 q + 128, row1 q + 128]` (VNNI
//!   multiplies unsigned by signed bytes), with the i32 correction `-128·Σ a` over each 4 bytes as the dot's start
//!   value; plus `d_a`.

#![allow(clippy::needless_range_loop)] // index loops over register arrays mirror the tile shape

use core::arch::x86_64::*;

use ferrum_core::DType;

use crate::quant::QK;

/// Whether this CPU runs these kernels (and the scalar override is off).
pub fn available() -> bool {
    crate::cpu::tier() == crate::cpu::Tier::Avx512Vnni
}

/// Weight types with a tile kernel here.
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_1 | DType::Q5_0 | DType::Q8_0)
}

/// Activation rows in the tile layout, from rows quantized as Q8_1 (Q4_1 weights) or Q8_0.
pub struct Prepared {
    /// Blocks per row.
    pub nb: usize,
    /// Per token and block: 64 bytes of quants.
    pub quants: Vec<u8>,
    /// Q8_0 only: per token and block, 16 i32 start values (the correction for unsigned weights).
    pub corr: Vec<i32>,
    /// Q8_0 only: per token and block, `-128·Σ a` over the whole block (the packed kernels'
    /// start value).
    pub block_corr: Vec<i32>,
    /// Per token and block: `[d, s, d, s]` (Q8_1) or `[d]` (Q8_0).
    pub scales: Vec<f32>,
}

impl Prepared {
    pub const fn new() -> Prepared {
        Prepared {
            nb: 0,
            quants: Vec::new(),
            corr: Vec::new(),
            block_corr: Vec::new(),
            scales: Vec::new(),
        }
    }

    /// Lays out `t` quantized activation rows `act` (`ab` bytes each) for weights of type `w`.
    /// With `quants` false (Q4_1 only: the packed GEMV reads the quants in place, in `act`),
    /// only the scales.
    pub fn fill(&mut self, w: DType, act: &[u8], ab: usize, t: usize, quants: bool) {
        let nb = match w {
            DType::Q4_1 => ab / 40,
            _ => ab / 34, // Q8_0 activations (Q8_0 and Q5_0 weights)
        };
        self.nb = nb;
        // Every value below is written: the buffers keep what they hold rather than be
        // cleared first (a prompt's activations are megabytes).
        assert!(
            quants || w == DType::Q4_1,
            "Prepared::fill: {w} needs its quants"
        );
        overwritten(&mut self.quants, if quants { t * nb * 64 } else { 0 });
        let simd = available();
        match w {
            DType::Q4_1 => {
                overwritten(&mut self.scales, t * nb * 4);
                self.corr.clear();
                self.block_corr.clear();
                if simd {
                    // SAFETY: `available()`: the CPU has AVX-512 (F, VL, VNNI) and F16C; the
                    // buffers were sized above for t * nb blocks (quants: none without them).
                    unsafe { fill_q8_1(&act[..t * ab], &mut self.quants, &mut self.scales) };
                    return;
                }
                for (i, blk) in act[..t * ab].chunks_exact(40).enumerate() {
                    let d = crate::quant::blocks::rd_f16(blk, 0);
                    let s = crate::quant::blocks::rd_f16(blk, 2);
                    self.scales[i * 4..(i + 1) * 4].copy_from_slice(&[d, s, d, s]);
                    if quants {
                        let q = &blk[4..36];
                        let o = &mut self.quants[i * 64..(i + 1) * 64];
                        o[0..16].copy_from_slice(&q[0..16]);
                        o[16..32].copy_from_slice(&q[0..16]);
                        o[32..48].copy_from_slice(&q[16..32]);
                        o[48..64].copy_from_slice(&q[16..32]);
                    }
                }
            }
            _ => {
                overwritten(&mut self.scales, t * nb);
                overwritten(&mut self.corr, t * nb * 16);
                overwritten(&mut self.block_corr, t * nb);
                if simd {
                    // SAFETY: as for Q8_1 above.
                    unsafe {
                        fill_q8_0(
                            &act[..t * ab],
                            &mut self.quants,
                            &mut self.scales,
                            &mut self.corr,
                            &mut self.block_corr,
                        )
                    };
                    return;
                }
                for (i, blk) in act[..t * ab].chunks_exact(34).enumerate() {
                    self.scales[i] = crate::quant::blocks::rd_f16(blk, 0);
                    let q = &blk[2..34];
                    let o = &mut self.quants[i * 64..(i + 1) * 64];
                    o[0..32].copy_from_slice(q);
                    o[32..64].copy_from_slice(q);
                    let c = &mut self.corr[i * 16..(i + 1) * 16];
                    for j in 0..8 {
                        let s: i32 = q[4 * j..4 * j + 4].iter().map(|&b| b as i8 as i32).sum();
                        c[j] = -128 * s;
                        c[j + 8] = -128 * s;
                    }
                    self.block_corr[i] = c[..8].iter().sum();
                }
            }
        }
    }
}

/// [`Prepared::fill`] of Q8_1 rows (40-byte blocks: d, s, 32 quants) with AVX-512: per block the
/// scales as [d, s, d, s] (F16C, exact: the same values as the scalar loop) and, unless `quants`
/// is empty, the quants as [0..16, 0..16, 16..32, 16..32].
#[target_feature(enable = "avx512f,avx512vl,f16c")]
unsafe fn fill_q8_1(act: &[u8], quants: &mut [u8], scales: &mut [f32]) {
    let n = act.len() / 40;
    let with_quants = !quants.is_empty();
    assert!((!with_quants || quants.len() >= 64 * n) && scales.len() >= 4 * n);
    let idx = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    for i in 0..n {
        // SAFETY: block i's 40 bytes lie in `act`, its 64 quants and 4 scales in the outputs
        // (asserted above).
        unsafe {
            let b = act.as_ptr().add(40 * i);
            if with_quants {
                let q = _mm256_loadu_si256(b.add(4) as *const __m256i);
                let o = _mm512_permutexvar_epi64(idx, _mm512_castsi256_si512(q));
                _mm512_storeu_si512(quants.as_mut_ptr().add(64 * i) as *mut _, o);
            }
            let ds = _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const i32).read_unaligned()));
            _mm_storeu_ps(scales.as_mut_ptr().add(4 * i), _mm_movelh_ps(ds, ds));
        }
    }
}

/// [`Prepared::fill`] of Q8_0 rows (34-byte blocks: d, 32 quants) with AVX-512: per block the
/// quants twice, d (F16C, exact), the 16 start values `-128·Σ` of each 4 quants (twice), the
/// sums by `dpbusd` against ones (exact), and `-128·Σ` of all 32.
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,f16c")]
unsafe fn fill_q8_0(
    act: &[u8],
    quants: &mut [u8],
    scales: &mut [f32],
    corr: &mut [i32],
    block_corr: &mut [i32],
) {
    let n = act.len() / 34;
    assert!(
        quants.len() >= 64 * n
            && scales.len() >= n
            && corr.len() >= 16 * n
            && block_corr.len() >= n
    );
    let ones = _mm256_set1_epi8(1);
    for i in 0..n {
        // SAFETY: block i's 34 bytes lie in `act`, its outputs in theirs (asserted above).
        unsafe {
            let b = act.as_ptr().add(34 * i);
            let q = _mm256_loadu_si256(b.add(2) as *const __m256i);
            _mm512_storeu_si512(
                quants.as_mut_ptr().add(64 * i) as *mut _,
                _mm512_broadcast_i64x4(q),
            );
            let d = _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const u16).read_unaligned() as i32));
            *scales.get_unchecked_mut(i) = _mm_cvtss_f32(d);
            let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, q);
            let c = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(sums));
            _mm512_storeu_si512(
                corr.as_mut_ptr().add(16 * i) as *mut _,
                _mm512_broadcast_i64x4(c),
            );
            *block_corr.get_unchecked_mut(i) = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(c));
        }
    }
}

/// `v` resized to `n` values without clearing those it keeps (the caller writes all of them).
fn overwritten<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    v.truncate(n);
    v.resize(n, T::default());
}

impl Default for Prepared {
    fn default() -> Self {
        Self::new()
    }
}

/// `out[c][r] = row r · token tok0 + c`, for 4 Q4_1 weight rows (`rows[r]`, each `nb` blocks;
/// they may repeat) and `C` consecutive tokens starting at `tok0`. (Q5_0 and Q8_0 prompts go
/// through [`tile8_unpacked`].)
pub fn tile<const C: usize>(
    dtype: DType,
    rows: [&[u8]; 4],
    p: &Prepared,
    tok0: usize,
) -> [[f32; 4]; C] {
    assert_eq!(dtype, DType::Q4_1, "tile: Q4_1 only");
    let nb = p.nb;
    for r in rows {
        assert!(r.len() >= nb * 20, "tile: weight row too short");
    }
    assert!(p.quants.len() >= (tok0 + C) * nb * 64, "tile: activations");
    assert!(available(), "tile: CPU lacks AVX-512 VNNI");
    // SAFETY: `available()` confirmed AVX-512 F/BW/VL/VNNI (and AVX2/FMA/F16C) at run time, and
    // the lengths the kernel reads were checked above.
    unsafe { tile_q4_1::<C>(rows, p, tok0) }
}

/// Asks the CPU to bring `bytes` into L1 ahead of use (a hint; no effect on results).
#[inline]
pub fn prefetch(bytes: &[u8]) {
    for i in (0..bytes.len()).step_by(64) {
        // SAFETY: prefetch never faults and has no architectural effect; the address is in
        // `bytes` anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(i) as *const i8) };
    }
}

/// `hsum_float_8` of the 8 lanes `l` (in lane order), in its exact order.
#[inline(always)]
pub(crate) fn hsum8_order(l: [f32; 8]) -> f32 {
    let r = [l[4] + l[0], l[5] + l[1], l[6] + l[2], l[7] + l[3]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Loads `N` bytes at `p` (caller guarantees they are readable).
#[inline(always)]
unsafe fn ld128(p: *const u8) -> __m128i {
    // SAFETY: the caller guarantees 16 readable bytes at `p`; no alignment is needed.
    unsafe { _mm_loadu_si128(p as *const __m128i) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_q4_1<const C: usize>(rows: [&[u8]; 4], p: &Prepared, tok0: usize) -> [[f32; 4]; C] {
    let nb = p.nb;
    let m4 = _mm256_set1_epi8(0x0f);
    // Lanes of [d0, m0, d1, m1] feeding the d vector [d0 x4, d1 x4, d0 x4, d1 x4].
    let didx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
    let mut acc = [[_mm512_setzero_ps(); C]; 2];
    let mut summs = [[_mm_setzero_ps(); C]; 2];
    let wp = rows.map(|r| r.as_ptr());
    for b in 0..nb {
        for pair in 0..2 {
            let (r0, r1) = (wp[2 * pair], wp[2 * pair + 1]);
            // SAFETY: block b of each row is within the row (lengths checked by `tile`).
            let (x, dm) = unsafe {
                let x = _mm256_set_m128i(ld128(r1.add(b * 20 + 4)), ld128(r0.add(b * 20 + 4)));
                let dm0 = (r0.add(b * 20) as *const i32).read_unaligned();
                let dm1 = (r1.add(b * 20) as *const i32).read_unaligned();
                (x, _mm_cvtph_ps(_mm_setr_epi32(dm0, dm1, 0, 0)))
            };
            // dm = [d0, m0, d1, m1]
            let lo = _mm256_and_si256(x, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m4);
            let wz = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            for c in 0..C {
                let i = (tok0 + c) * nb + b;
                // SAFETY: token tok0 + c < t and b < nb, checked by `tile`.
                let (a, sc) = unsafe {
                    (
                        _mm512_loadu_si512(p.quants.as_ptr().add(i * 64) as *const _),
                        _mm_loadu_ps(p.scales.as_ptr().add(i * 4)),
                    )
                };
                let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wz, a);
                let dmx = _mm_mul_ps(dm, sc); // [d0·da, m0·sa, d1·da, m1·sa]
                summs[pair][c] = _mm_add_ps(summs[pair][c], dmx);
                let d = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(dmx));
                acc[pair][c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), acc[pair][c]);
            }
        }
    }
    let mut out = [[0f32; 4]; C];
    for pair in 0..2 {
        for c in 0..C {
            let mut l = [0f32; 16];
            let mut s = [0f32; 4];
            // SAFETY: `l` holds 16 f32 and `s` 4; unaligned stores.
            unsafe {
                _mm512_storeu_ps(l.as_mut_ptr(), acc[pair][c]);
                _mm_storeu_ps(s.as_mut_ptr(), summs[pair][c]);
            }
            // Row 0 of the pair: lanes 0..4 and 8..12; row 1: 4..8 and 12..16.
            let r0 = [l[0], l[1], l[2], l[3], l[8], l[9], l[10], l[11]];
            let r1 = [l[4], l[5], l[6], l[7], l[12], l[13], l[14], l[15]];
            out[c][2 * pair] = hsum8_order(r0) + s[1];
            out[c][2 * pair + 1] = hsum8_order(r1) + s[3];
        }
    }
    out
}

/// Block `b` of Q8_0 rows `r0` and `r1` as 64 unsigned bytes `q + 128`
/// (`[row0 elements 0..32, row1 elements 0..32]`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_q8_0_pair(r0: *const u8, r1: *const u8, b: usize) -> __m512i {
    // SAFETY: the caller guarantees block b of both rows is readable.
    let wz = unsafe {
        let q0 = _mm256_loadu_si256(r0.add(b * 34 + 2) as *const __m256i);
        let q1 = _mm256_loadu_si256(r1.add(b * 34 + 2) as *const __m256i);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q0), q1)
    };
    _mm512_xor_si512(wz, _mm512_set1_epi8(0x80u8 as i8))
}

/// Q5_0: q = (nibble | 5th bit << 4) - 16, so q + 128 = (nibble | bit << 4) + 112.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_q5_0_pair(r0: *const u8, r1: *const u8, b: usize) -> __m512i {
    // SAFETY: the caller guarantees block b of both rows is readable.
    let (x, qh) = unsafe {
        let x = _mm256_set_m128i(ld128(r1.add(b * 22 + 6)), ld128(r0.add(b * 22 + 6)));
        let h0 = (r0.add(b * 22 + 2) as *const u32).read_unaligned() as u64;
        let h1 = (r1.add(b * 22 + 2) as *const u32).read_unaligned() as u64;
        (x, h0 | (h1 << 32))
    };
    let m4 = _mm256_set1_epi8(0x0f);
    let lo = _mm256_and_si256(x, m4); // [row0 elements 0..16, row1 elements 0..16]
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m4); // elements 16..32
                                                              // [row0 lo, row0 hi, row1 lo, row1 hi]
    let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
    let z = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
    let z = _mm512_or_si512(z, _mm512_maskz_mov_epi8(qh, _mm512_set1_epi8(0x10)));
    _mm512_add_epi8(z, _mm512_set1_epi8(112))
}

/// Weight rows per call of the tile kernel of `dtype`: 8 for Q5_0 and Q8_0 ([`tile8_unpacked`]),
/// 4 for Q4_1 ([`tile`]).
pub fn tile_rows(dtype: DType) -> usize {
    match dtype {
        DType::Q5_0 | DType::Q8_0 => 8,
        _ => 4,
    }
}

/// One 64-byte line, 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Line(pub [u8; 64]);

/// Q5_0 or Q8_0 weight rows unpacked for [`tile8_unpacked`]: per block and row pair, the 64
/// unsigned bytes `q + 128` of the two rows (`[row0 elements 0..32, row1 elements 0..32]`) and
/// their scales as `[d0 x8, d1 x8]`. A task unpacks its rows once and runs every token over them.
pub struct Unpacked {
    nb: usize,
    pairs: usize,
    quants: Vec<Line>,
    scales: Vec<Line>,
}

impl Unpacked {
    pub const fn new() -> Unpacked {
        Unpacked {
            nb: 0,
            pairs: 0,
            quants: Vec::new(),
            scales: Vec::new(),
        }
    }

    /// Unpacks `rows` (an even number of rows of `nb` blocks of `dtype`, Q5_0 or Q8_0).
    pub fn fill(&mut self, dtype: DType, rows: &[&[u8]], nb: usize) {
        let bw = match dtype {
            DType::Q5_0 => 22,
            DType::Q8_0 => 34,
            other => panic!("Unpacked: no layout for {other}"),
        };
        assert!(rows.len().is_multiple_of(2), "Unpacked: odd row count");
        for r in rows {
            assert!(r.len() >= nb * bw, "Unpacked: weight row too short");
        }
        assert!(available(), "Unpacked: CPU lacks AVX-512 VNNI");
        let pairs = rows.len() / 2;
        self.nb = nb;
        self.pairs = pairs;
        self.quants.clear();
        self.quants.resize(nb * pairs, Line([0; 64]));
        self.scales.clear();
        self.scales.resize(nb * pairs, Line([0; 64]));
        // SAFETY: `available()` was checked; the rows hold `nb` blocks (checked above).
        unsafe { unpack_rows(self, bw, rows) }
    }
}

/// [`Unpacked::fill`]'s loop (sizes set and checked by the caller).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_rows(u: &mut Unpacked, bw: usize, rows: &[&[u8]]) {
    let (nb, pairs) = (u.nb, u.pairs);
    let didx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for b in 0..nb {
        for pair in 0..pairs {
            let (r0, r1) = (rows[2 * pair].as_ptr(), rows[2 * pair + 1].as_ptr());
            let at = b * pairs + pair;
            // SAFETY: block b of both rows is readable (checked by the caller) and `at` is
            // inside both buffers.
            unsafe {
                let d0 = (r0.add(b * bw) as *const u16).read_unaligned();
                let d1 = (r1.add(b * bw) as *const u16).read_unaligned();
                let d = _mm_cvtph_ps(_mm_setr_epi16(d0 as i16, d1 as i16, 0, 0, 0, 0, 0, 0));
                let dz = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(d));
                _mm512_store_ps(u.scales.as_mut_ptr().add(at) as *mut f32, dz);
                let wz = if bw == 34 {
                    unpack_q8_0_pair(r0, r1, b)
                } else {
                    unpack_q5_0_pair(r0, r1, b)
                };
                _mm512_store_si512(u.quants.as_mut_ptr().add(at) as *mut _, wz);
            }
        }
    }
}

impl Default for Unpacked {
    fn default() -> Self {
        Self::new()
    }
}

/// `out[c][r] = row 2·pair0 + r · token tok0 + c` for the 8 unpacked rows of pairs
/// `pair0..pair0 + 4` and `C` consecutive tokens. Per block and output, the float operations
/// of `vec_dot`: one product `d_w·d_a`, one conversion and one FMA per lane, then `hsum_float_8`.
pub fn tile8_unpacked<const C: usize>(
    u: &Unpacked,
    pair0: usize,
    p: &Prepared,
    tok0: usize,
) -> [[f32; 8]; C] {
    assert!(pair0 + 4 <= u.pairs && u.nb == p.nb, "tile8_unpacked: rows");
    assert!(
        p.quants.len() >= (tok0 + C) * p.nb * 64
            && p.corr.len() >= (tok0 + C) * p.nb * 16
            && p.scales.len() >= (tok0 + C) * p.nb,
        "tile8_unpacked: activations"
    );
    assert!(available(), "tile8_unpacked: CPU lacks AVX-512 VNNI");
    // SAFETY: `available()` confirmed AVX-512 F/BW/VL/VNNI at run time, and the lengths the
    // kernel reads were checked above.
    unsafe { tile8_unpacked_kernel::<C>(u, pair0, p, tok0) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile8_unpacked_kernel<const C: usize>(
    u: &Unpacked,
    pair0: usize,
    p: &Prepared,
    tok0: usize,
) -> [[f32; 8]; C] {
    let nb = p.nb;
    let mut acc = [[_mm512_setzero_ps(); C]; 4];
    for b in 0..nb {
        let at = b * u.pairs + pair0;
        // SAFETY: pairs pair0..pair0 + 4 of block b are inside the buffers (checked by the caller).
        let (wz, dw): ([__m512i; 4], [__m512; 4]) = unsafe {
            (
                core::array::from_fn(|k| {
                    _mm512_load_si512(u.quants.as_ptr().add(at + k) as *const _)
                }),
                core::array::from_fn(|k| {
                    _mm512_load_ps(u.scales.as_ptr().add(at + k) as *const f32)
                }),
            )
        };
        for c in 0..C {
            let i = (tok0 + c) * nb + b;
            // SAFETY: token tok0 + c < t and b < nb, checked by the caller.
            let (a, corr, da) = unsafe {
                (
                    _mm512_loadu_si512(p.quants.as_ptr().add(i * 64) as *const _),
                    _mm512_loadu_si512(p.corr.as_ptr().add(i * 16) as *const _),
                    _mm512_set1_ps(*p.scales.get_unchecked(i)),
                )
            };
            for pair in 0..4 {
                let isum = _mm512_dpbusd_epi32(corr, wz[pair], a);
                let d = _mm512_mul_ps(dw[pair], da);
                acc[pair][c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), acc[pair][c]);
            }
        }
    }
    let mut out = [[0f32; 8]; C];
    for pair in 0..4 {
        for c in 0..C {
            let mut l = [0f32; 16];
            // SAFETY: `l` holds 16 f32; unaligned store.
            unsafe { _mm512_storeu_ps(l.as_mut_ptr(), acc[pair][c]) };
            out[c][2 * pair] = hsum8_order(l[0..8].try_into().unwrap());
            out[c][2 * pair + 1] = hsum8_order(l[8..16].try_into().unwrap());
        }
    }
    out
}

/// Elements per block of the types here.
pub const BLOCK: usize = QK;

// ---------------------------------------------------------------------------------------------
// One-token products over weights repacked in groups of 16 rows.

/// Rows per group of the packed layouts.
pub const GROUP: usize = 16;

/// Field sizes of one (group, block) cell of a packed type: per row, bytes of scale fields
/// (f16 d, then f16 m for Q4_1), of high bits (Q5_0's u32) and of quants.
fn cell_fields(dtype: DType) -> Option<(usize, usize, usize)> {
    match dtype {
        DType::Q8_0 => Some((2, 0, 32)),
        DType::Q5_0 => Some((2, 4, 16)),
        DType::Q4_1 => Some((4, 0, 16)),
        _ => None,
    }
}

/// Bytes of one (group, block) cell.
fn cell_bytes(dtype: DType) -> usize {
    let (s, h, q) = cell_fields(dtype).expect("packed type");
    GROUP * (s + h + q)
}

/// Repacks a row-major Q8_0, Q5_0 or Q4_1 matrix (`rows` a multiple of 16) for [`gemv_x16`]:
/// for each group of 16 rows and each block, a cell holding the 16 rows' d scales (then Q4_1's
/// 16 m values, or Q5_0's fifth bits as 8 64-bit masks, one per `vec_dot` lane), then their
/// quants interleaved in lines of 64 bytes, line k holding quant bytes 4k..4k+4 of the 16 rows
/// (Q8_0: 8 lines, each one 4-element lane of `vec_dot` for all 16 rows; Q4_1, Q5_0: 4 lines,
/// each nibble half of a line one such lane). One token then
/// streams the matrix front to back, and one vector load fetches a field of 16 rows. Q4_K and
/// Q6_K and IQ4_XS have cells of their own ([`Q4K_CELL`], [`Q6K_CELL`], [`IQ4XS_CELL`]). `None` for other types or shapes.
pub fn pack_x16(dtype: DType, data: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
    let mut out = vec![0u8; packed_len(dtype, rows, cols)?];
    pack_x16_groups(dtype, data, rows, cols, 0, &mut out).then_some(out)
}

/// [`pack_x16`] into `out`, for the groups from `g0` on that `out` holds (whole cells of
/// consecutive groups): the loader packs a matrix in parallel, a run of groups per task, straight
/// into its final buffer. `false` (nothing written) if the type, shape or sizes do not fit.
pub fn pack_x16_groups(
    dtype: DType,
    data: &[u8],
    rows: usize,
    cols: usize,
    g0: usize,
    out: &mut [u8],
) -> bool {
    let Some((block, cell_len)) = packed_cell(dtype) else {
        return false;
    };
    let bb = dtype.block_bytes();
    if packed_len(dtype, rows, cols).is_none() || data.len() != rows * (cols / block) * bb {
        return false;
    }
    let nb = cols / block;
    let rb = nb * bb;
    let group_len = nb * cell_len;
    if !out.len().is_multiple_of(group_len) || g0 + out.len() / group_len > rows / GROUP {
        return false;
    }
    for (gi, group) in out.chunks_exact_mut(group_len).enumerate() {
        let g = g0 + gi;
        for (b, cell) in group.chunks_exact_mut(cell_len).enumerate() {
            for r in 0..GROUP {
                let blk = &data[(g * GROUP + r) * rb + b * bb..][..bb];
                match dtype {
                    DType::Q4_K => fill_cell_q4k(cell, r, blk),
                    DType::Q6_K => fill_cell_q6k(cell, r, blk),
                    DType::IQ4_XS => fill_cell_iq4xs(cell, r, blk),
                    _ => fill_cell(dtype, cell, r, blk),
                }
            }
        }
    }
    true
}

/// Writes row r's block `blk` (Q8_0, Q5_0 or Q4_1) into its cell of [`pack_x16`]'s layout.
fn fill_cell(dtype: DType, cell: &mut [u8], r: usize, blk: &[u8]) {
    let (sf, hf, qf) = cell_fields(dtype).expect("packed type");
    let bb = blk.len();
    // Block layouts: Q8_0 d qs[32]; Q5_0 d qh[4] qs[16]; Q4_1 d m qs[16].
    cell[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
    if dtype == DType::Q4_1 {
        cell[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2].copy_from_slice(&blk[2..4]);
    }
    if dtype == DType::Q5_0 {
        // The fifth bits as 8 masks, one per `vec_dot` lane j (elements 4j..4j+4): bit 4r + i
        // of mask j is bit 4j + i of row r's qh.
        let qh = u32::from_le_bytes(blk[2..6].try_into().unwrap());
        for j in 0..8 {
            let at = GROUP * sf + 8 * j + r / 2;
            let nib = (((qh >> (4 * j)) & 0xf) as u8) << (4 * (r % 2));
            let keep = 0xf0u8 >> (4 * (r % 2));
            cell[at] = (cell[at] & keep) | nib;
        }
    }
    // Interleaved: line k holds quant bytes 4k..4k+4 of each row (row r at 4r..4r+4). For Q8_0
    // that is elements 4k..4k+4 of the 16 rows; for Q4_1 and Q5_0 the low nibbles are elements
    // 4k..4k+4 and the high nibbles elements 16+4k..16+4k+4.
    for k in 0..qf / 4 {
        let at = GROUP * (sf + hf) + 64 * k + 4 * r;
        cell[at..at + 4].copy_from_slice(&blk[bb - qf + 4 * k..bb - qf + 4 * k + 4]);
    }
}

/// Bytes of one (16-row group, super-block) cell of a packed Q4_K matrix: the rows' f16 `d` and
/// `dmin` (2 x 32 bytes), their 6-bit sub-block scales and mins widened to bytes (`[j][r]`, 2 x 128
/// bytes), then the quants as 32 lines of 64 bytes: line `8p + k` holds quant bytes
/// `32p + 4k .. 32p + 4k + 4` of each row (row r at bytes 4r..4r+4), so its low nibbles are
/// elements 4k..4k+4 of sub-block 2p and its high nibbles the same of sub-block 2p+1, for all 16
/// rows. (2368 bytes against 16 x 144 in the file: 2.8% more.)
pub const Q4K_CELL: usize = 64 + 256 + 2048;

/// Bytes of one (16-row group, super-block) cell of a packed IQ4_XS matrix: the rows' f16 `d`
/// (32 bytes), their sub-block scales `ls - 32` as i8 (`[ib][r]`, 128 bytes), then the quants as
/// 32 lines of 64 bytes: line `4ib + k` holds quant bytes `16ib + 4k .. 16ib + 4k + 4` of each row
/// (row r at bytes 4r..4r+4), so its low nibbles are elements 4k..4k+4 of sub-block ib (the
/// `vec_dot` lane k) and its high nibbles elements 16+4k..16+4k+4 (lane 4+k), for all 16 rows.
/// (2208 bytes against 16 x 136 in the file: 1.5% more.)
pub const IQ4XS_CELL: usize = 32 + 128 + 2048;

/// Writes row r's IQ4_XS super-block `blk` into its [`IQ4XS_CELL`] cell.
fn fill_cell_iq4xs(cell: &mut [u8], r: usize, blk: &[u8]) {
    use crate::quant::blocks::{iq4xs_scales, IQ4_XS_QS};
    cell[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
    for (ib, &sc) in iq4xs_scales(blk).iter().enumerate() {
        cell[32 + 16 * ib + r] = sc as i8 as u8;
    }
    for line in 0..32 {
        let at = 160 + 64 * line + 4 * r;
        cell[at..at + 4].copy_from_slice(&blk[IQ4_XS_QS + 4 * line..IQ4_XS_QS + 4 * line + 4]);
    }
}

/// Writes row r's Q4_K super-block `blk` into its [`Q4K_CELL`] cell.
fn fill_cell_q4k(cell: &mut [u8], r: usize, blk: &[u8]) {
    use crate::quant::blocks::{scale_min_k4, Q4_K_QS, Q4_K_SCALES};
    cell[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
    cell[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&blk[2..4]);
    let (sc, m) = scale_min_k4(&blk[Q4_K_SCALES..Q4_K_SCALES + 12]);
    for j in 0..8 {
        cell[64 + 16 * j + r] = sc[j];
        cell[192 + 16 * j + r] = m[j];
    }
    for line in 0..32 {
        let at = 320 + 64 * line + 4 * r;
        cell[at..at + 4].copy_from_slice(&blk[Q4_K_QS + 4 * line..Q4_K_QS + 4 * line + 4]);
    }
}

/// Bytes of one (16-row group, super-block) cell of a packed Q6_K matrix: 48 lines of quants, then
/// the rows' i8 sub-block scales (`[s][r]`, 256 bytes), their f16 `d` (32 bytes) and 32 bytes of
/// padding so cells stay line-aligned. Quant lines come in threes per (half h, lane l): quant
/// bytes `ql[64h + 4l ..][..4]`, `ql[64h + 32 + 4l ..][..4]` and `qh[32h + 4l ..][..4]` of each
/// row (row r at bytes 4r..4r+4). Those hold, for all 16 rows, the 4 elements that lane l of
/// `vec_dot`'s 8 lanes takes from each of the half's four 32-element chunks. (3392 bytes against
/// 16 x 210 in the file: 1% more.)
pub const Q6K_CELL: usize = 48 * 64 + 256 + 32 + 32;

/// Writes row r's Q6_K super-block `blk` into its [`Q6K_CELL`] cell.
fn fill_cell_q6k(cell: &mut [u8], r: usize, blk: &[u8]) {
    use crate::quant::blocks::{Q6_K_D, Q6_K_QH, Q6_K_SCALES};
    for h in 0..2 {
        for l in 0..8 {
            let at = 64 * 3 * (8 * h + l) + 4 * r;
            let src = [
                64 * h + 4 * l,
                64 * h + 32 + 4 * l,
                Q6_K_QH + 32 * h + 4 * l,
            ];
            for (i, &from) in src.iter().enumerate() {
                cell[at + 64 * i..at + 64 * i + 4].copy_from_slice(&blk[from..from + 4]);
            }
        }
    }
    for sb in 0..16 {
        cell[48 * 64 + 16 * sb + r] = blk[Q6_K_SCALES + sb];
    }
    let d = 48 * 64 + 256 + 2 * r;
    cell[d..d + 2].copy_from_slice(&blk[Q6_K_D..Q6_K_D + 2]);
}

/// `y[tok, r] = W[r] · x[tok]` for the `t` tokens of `x` ([t, cols]; `y` is [t, rows]) over a
/// matrix packed by [`pack_x16`], each output in the float order of the type's `vec_dot` (Q4_K:
/// of llama.cpp's repacked GEMV, [`crate::quant::vec_dot_q4k_repacked`]), so the same bits as
/// [`super::matmul`] gives one token alone. Each thread takes a run of 16-row groups and runs
/// every token over a group before the next, so a group is read from memory once per call
/// (from L1 for the tokens after the first). Needs [`available`].
pub fn gemv_x16(dtype: DType, packed: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    gemv_x16_order(dtype, packed, rows, cols, x, y, false)
}

/// [`gemv_x16`], or with `tiled` (IQ4_XS only) every output in the order of llama.cpp's tiled
/// prompt matmul ([`crate::quant::vec_dot_tiled_order`]) instead of `vec_dot`'s.
pub fn gemv_x16_order(
    dtype: DType,
    packed: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
    tiled: bool,
) {
    gemv_x16_parts(dtype, &mut [X16Part { packed, rows, y }], cols, x, tiled)
}

/// One matrix of a [`gemv_x16_parts`] call: its packed bytes, its rows and its output
/// ([t, rows]).
pub struct X16Part<'a> {
    pub packed: &'a [u8],
    pub rows: usize,
    pub y: &'a mut [f32],
}

/// [`gemv_x16_order`] for several matrices of one type and width over the same tokens (a
/// layer's Q, K and V projections): the activations are quantized once, and the matrices'
/// groups, taken one after another, are split over the threads as one matrix's would be, in a
/// single parallel call. Each output gets the bits the matrix's own call gives.
pub fn gemv_x16_parts(dtype: DType, parts: &mut [X16Part], cols: usize, x: &[f32], tiled: bool) {
    assert!(available(), "gemv_x16: CPU lacks AVX-512 VNNI");
    assert!(
        !tiled || dtype == DType::IQ4_XS,
        "gemv_x16: no tiled order for {dtype}"
    );
    let (block, cell_len) =
        packed_cell(dtype).unwrap_or_else(|| panic!("gemv_x16: no packed layout for {dtype}"));
    assert!(cols.is_multiple_of(block), "gemv_x16: {dtype} x{cols}");
    let nb = cols / block;
    assert!(x.len().is_multiple_of(cols), "gemv_x16: x");
    let t = x.len() / cols;
    for part in parts.iter() {
        let rows = part.rows;
        assert!(
            rows.is_multiple_of(GROUP),
            "gemv_x16: {dtype} {rows}x{cols}"
        );
        assert_eq!(
            part.packed.len(),
            rows / GROUP * nb * cell_len,
            "gemv_x16: packed bytes"
        );
        assert_eq!(part.y.len(), t * rows, "gemv_x16: y");
    }
    if t == 0 || parts.is_empty() {
        return;
    }
    // Where each part's groups start in the run of all parts' groups (inline for a few parts).
    let mut first: smallvec::SmallVec<[usize; 5]> = smallvec::SmallVec::new();
    let mut n_groups = 0;
    for part in parts.iter() {
        first.push(n_groups);
        n_groups += part.rows / GROUP;
    }
    first.push(n_groups);
    let outs: smallvec::SmallVec<[(&[u8], usize, super::OutPtr); 4]> = parts
        .iter_mut()
        .map(|p| (p.packed, p.rows, super::OutPtr(p.y.as_mut_ptr())))
        .collect();
    let act_type = crate::quant::vec_dot_type(dtype);
    let ab = act_type.row_bytes(cols).expect("whole blocks");
    let kq = matches!(dtype, DType::Q4_K | DType::Q6_K | DType::IQ4_XS);
    // The activation buffers are matmul's per-thread scratch: no allocation per token.
    super::with_scratch(|act, p| {
        act.resize(ab * t, 0);
        for (xr, ar) in x.chunks_exact(cols).zip(act.chunks_exact_mut(ab)) {
            crate::quant::quantize_row(act_type, xr, ar);
        }
        if !kq {
            // Q4_1: the kernel reads the quants in place (a copy would miss the cache the
            // weights stream through, on the calling thread alone).
            p.fill(dtype, act, ab, t, dtype != DType::Q4_1);
        }
        // With several threads, one contiguous run of groups per thread: each thread then
        // streams its part of the matrix front to back instead of hopping over the other's
        // tasks, which retrains the hardware prefetcher at every task (Gemma 3's decode at 2
        // threads: 108 -> 116-144 tok/s). One thread keeps 4-group tasks.
        let groups_per_task = match crate::pool::threads() {
            1 => 4,
            n => n_groups.div_ceil(n),
        };
        let group_bytes = nb * cell_len;
        let (p, act) = (&*p, &*act);
        // Group `gg` of the run: its part's bytes, rows and output, and its index there.
        let group_at = |gg: usize| {
            let i = first.partition_point(|&f| f <= gg) - 1;
            let (packed, rows, out) = outs[i];
            (packed, rows, out, gg - first[i])
        };
        // Q4_1, Q5_0, Q8_0: several tokens per pass over a group, 2 in llama.cpp's order (8
        // accumulators a token), 4 in the block order (one).
        let blocks = super::block_order();
        let per_pass = match (crate::quant::has_blocks_order(dtype), blocks) {
            (false, _) => 1,
            (true, false) => 2,
            (true, true) => 4,
        };
        crate::pool::parallel_for(n_groups.div_ceil(groups_per_task), |task| {
            let g0 = task * groups_per_task;
            let groups = g0..(g0 + groups_per_task).min(n_groups);
            // Tokens in blocks, so a block's activations stay in L1 while the task's groups
            // pass over them (a group's weights come from memory for the first block, then
            // from L2).
            for tb in (0..t).step_by(GEMV_TOKEN_BLOCK) {
                let te = (tb + GEMV_TOKEN_BLOCK).min(t);
                for gg in groups.clone() {
                    let (packed, rows, out, g) = group_at(gg);
                    let w = &packed[g * group_bytes..(g + 1) * group_bytes];
                    let store = |tok: usize, v: &[f32; GROUP]| {
                        for (i, &val) in v.iter().enumerate() {
                            // SAFETY: tok < t and g * 16 + i < rows: inside the part's output
                            // ([t, rows]); only this task writes group g's rows.
                            unsafe { *out.at(tok * rows + g * GROUP + i) = val };
                        }
                    };
                    // Several passes over this group (a batched step): the next group's
                    // weights are asked into L2 a part per pass, so its first pass does not
                    // wait on memory (the hardware prefetcher alone leaves every call's
                    // stream short of data: `cargo bench --bench matmul`, "in turn" rows).
                    let n_pass = (te - tb).div_ceil(per_pass);
                    let next = (n_pass > 1 && gg + 1 < groups.end).then(|| {
                        let (packed, _, _, g) = group_at(gg + 1);
                        &packed[g * group_bytes..(g + 1) * group_bytes]
                    });
                    let mut pass = 0;
                    let mut prefetch_next = || {
                        if let Some(nx) = next {
                            let part = nx.len() * pass / n_pass..nx.len() * (pass + 1) / n_pass;
                            prefetch_l2(&nx[part.start / 64 * 64..part.end]);
                        }
                        pass += 1;
                    };
                    let mut tok = tb;
                    if per_pass > 1 {
                        // Several tokens per pass over the group: its weights loaded and
                        // unpacked once for all of them.
                        while tok < te {
                            prefetch_next();
                            let n = (te - tok).min(per_pass);
                            // SAFETY: `available()` was checked; `w` holds nb cells of
                            // `dtype`, `p` t tokens of nb prepared blocks (Q4_1: `act`, t
                            // Q8_1 rows), and tok + n <= t.
                            unsafe {
                                match n {
                                    4 => group_pass::<4>(dtype, blocks, w, p, act, tok, &store),
                                    3 => group_pass::<3>(dtype, blocks, w, p, act, tok, &store),
                                    2 => group_pass::<2>(dtype, blocks, w, p, act, tok, &store),
                                    _ => group_pass::<1>(dtype, blocks, w, p, act, tok, &store),
                                }
                            }
                            tok += n;
                        }
                    }
                    for tok in tok..te {
                        prefetch_next();
                        let a = &act[tok * ab..(tok + 1) * ab];
                        // SAFETY: `available()` was checked; `w` holds nb cells of `dtype`, `p`
                        // t tokens of nb prepared blocks of its activation type (K-quants: `a`,
                        // nb Q8_K blocks).
                        let v = unsafe {
                            match dtype {
                                DType::Q4_K => gemv_group_q4_k(w, a, nb),
                                DType::Q6_K => gemv_group_q6_k(w, a, nb),
                                DType::IQ4_XS if tiled => gemv_group_iq4xs::<true>(w, a, nb),
                                _ => gemv_group_iq4xs::<false>(w, a, nb),
                            }
                        };
                        store(tok, &v);
                    }
                }
            }
        });
    })
}

/// `N` tokens from `tok` over one group of Q4_1, Q5_0 or Q8_0 rows, in the block order if
/// `blocks` (else llama.cpp's), each token's 16 outputs handed to `store`.
///
/// # Safety
/// As the group kernels: AVX-512 VNNI available, `w` one group's cells, `p` (and for Q4_1 `act`)
/// prepared for at least `tok + N` tokens.
#[inline(always)]
unsafe fn group_pass<const N: usize>(
    dtype: DType,
    blocks: bool,
    w: &[u8],
    p: &Prepared,
    act: &[u8],
    tok: usize,
    store: &impl Fn(usize, &[f32; GROUP]),
) {
    // SAFETY: forwarded from the caller.
    let v = unsafe {
        match (dtype, blocks) {
            (DType::Q8_0, true) => gemv_group_q8_0_blocks::<N>(w, p, tok),
            (DType::Q5_0, true) => gemv_group_q5_0_blocks::<N>(w, p, tok),
            (_, true) => gemv_group_q4_1_blocks::<N>(w, p, act, tok),
            (DType::Q8_0, false) => gemv_group_q8_0_lanes::<N>(w, p, tok),
            (DType::Q5_0, false) => gemv_group_q5_0_lanes::<N>(w, p, tok),
            (_, false) => gemv_group_q4_1_lanes::<N>(w, p, act, tok),
        }
    };
    for (c, o) in v.iter().enumerate() {
        store(tok + c, o);
    }
}

/// Asks the CPU to bring the cache lines that start in `bytes` into L2 (a hint: no effect on
/// results).
#[inline(always)]
fn prefetch_l2(bytes: &[u8]) {
    for off in (0..bytes.len()).step_by(64) {
        // SAFETY: a prefetch never faults; the address lies inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().add(off) as *const i8) };
    }
}

/// Tokens whose activations [`gemv_x16`] keeps in L1 while a task's groups pass over them.
const GEMV_TOKEN_BLOCK: usize = 32;

/// (elements per block, bytes per (group, block) cell) of a packed type.
pub fn packed_cell(dtype: DType) -> Option<(usize, usize)> {
    match dtype {
        DType::Q4_K => Some((crate::quant::QK_K, Q4K_CELL)),
        DType::Q6_K => Some((crate::quant::QK_K, Q6K_CELL)),
        DType::IQ4_XS => Some((crate::quant::QK_K, IQ4XS_CELL)),
        _ if cell_fields(dtype).is_some() => Some((QK, cell_bytes(dtype))),
        _ => None,
    }
}

/// Bytes of a `rows` x `cols` matrix packed by [`pack_x16`], `None` where it has no packed layout.
pub fn packed_len(dtype: DType, rows: usize, cols: usize) -> Option<usize> {
    let (block, cell) = packed_cell(dtype)?;
    (rows.is_multiple_of(GROUP) && cols.is_multiple_of(block) && rows > 0)
        .then(|| rows / GROUP * (cols / block) * cell)
}

/// Writes row `r` (0..16) of a packed group (`nb` cells of [`pack_x16`]'s layout) back in the
/// file's block layout: the exact inverse of the packing, so `out` is the original row's bytes.
pub fn unpack_row_x16(dtype: DType, group: &[u8], nb: usize, r: usize, out: &mut [u8]) {
    use crate::quant::blocks::{Q4_K_QS, Q4_K_SCALES, Q6_K_D, Q6_K_QH, Q6_K_SCALES};
    let (_, cell_len) = packed_cell(dtype).expect("packed type");
    let bb = dtype.block_bytes();
    assert!(r < GROUP && group.len() >= nb * cell_len && out.len() == nb * bb);
    for (b, blk) in out.chunks_exact_mut(bb).enumerate() {
        let cell = &group[b * cell_len..(b + 1) * cell_len];
        match dtype {
            DType::Q4_K => {
                blk[0..2].copy_from_slice(&cell[2 * r..2 * r + 2]);
                blk[2..4].copy_from_slice(&cell[32 + 2 * r..32 + 2 * r + 2]);
                let sc: [u8; 8] = core::array::from_fn(|j| cell[64 + 16 * j + r]);
                let m: [u8; 8] = core::array::from_fn(|j| cell[192 + 16 * j + r]);
                // The inverse of `scale_min_k4`: bytes 0..4 hold sc[0..4] and the top bits of
                // sc[4..8], bytes 4..8 the same for the mins, bytes 8..12 the low nibbles.
                let q = &mut blk[Q4_K_SCALES..Q4_K_SCALES + 12];
                for j in 0..4 {
                    q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
                    q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
                    q[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
                }
                for line in 0..32 {
                    let at = 320 + 64 * line + 4 * r;
                    blk[Q4_K_QS + 4 * line..Q4_K_QS + 4 * line + 4]
                        .copy_from_slice(&cell[at..at + 4]);
                }
            }
            DType::IQ4_XS => {
                use crate::quant::blocks::{IQ4_XS_QS, IQ4_XS_SCALES_H, IQ4_XS_SCALES_L};
                blk[0..2].copy_from_slice(&cell[2 * r..2 * r + 2]);
                // The inverse of `iq4xs_scales`: ls = sc + 32 (6 bits), low 4 bits in the nibble
                // ib % 2 of scales_l[ib / 2], high 2 bits at bits 2ib.. of scales_h.
                let mut h = 0u16;
                blk[IQ4_XS_SCALES_L..IQ4_XS_SCALES_L + 4].fill(0);
                for ib in 0..8 {
                    let ls = (cell[32 + 16 * ib + r] as i8 as i32 + 32) as u16;
                    blk[IQ4_XS_SCALES_L + ib / 2] |= ((ls & 15) as u8) << (4 * (ib % 2));
                    h |= (ls >> 4) << (2 * ib);
                }
                blk[IQ4_XS_SCALES_H..IQ4_XS_SCALES_H + 2].copy_from_slice(&h.to_le_bytes());
                for line in 0..32 {
                    let at = 160 + 64 * line + 4 * r;
                    blk[IQ4_XS_QS + 4 * line..IQ4_XS_QS + 4 * line + 4]
                        .copy_from_slice(&cell[at..at + 4]);
                }
            }
            DType::Q6_K => {
                for h in 0..2 {
                    for l in 0..8 {
                        let at = 64 * 3 * (8 * h + l) + 4 * r;
                        let dst = [
                            64 * h + 4 * l,
                            64 * h + 32 + 4 * l,
                            Q6_K_QH + 32 * h + 4 * l,
                        ];
                        for (i, &to) in dst.iter().enumerate() {
                            blk[to..to + 4].copy_from_slice(&cell[at + 64 * i..at + 64 * i + 4]);
                        }
                    }
                }
                for sb in 0..16 {
                    blk[Q6_K_SCALES + sb] = cell[48 * 64 + 16 * sb + r];
                }
                let d = 48 * 64 + 256 + 2 * r;
                blk[Q6_K_D..Q6_K_D + 2].copy_from_slice(&cell[d..d + 2]);
            }
            _ => {
                let (sf, hf, qf) = cell_fields(dtype).expect("packed type");
                blk[0..2].copy_from_slice(&cell[2 * r..2 * r + 2]);
                if dtype == DType::Q4_1 {
                    blk[2..4].copy_from_slice(&cell[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2]);
                }
                if dtype == DType::Q5_0 {
                    let mut qh = 0u32;
                    for j in 0..8 {
                        let nib = (cell[GROUP * sf + 8 * j + r / 2] >> (4 * (r % 2))) & 0xf;
                        qh |= (nib as u32) << (4 * j);
                    }
                    blk[2..6].copy_from_slice(&qh.to_le_bytes());
                }
                for k in 0..qf / 4 {
                    let at = GROUP * (sf + hf) + 64 * k + 4 * r;
                    blk[bb - qf + 4 * k..bb - qf + 4 * k + 4].copy_from_slice(&cell[at..at + 4]);
                }
            }
        }
    }
}

/// One group of Q4_K rows x Q8_K activations (`nb` super-blocks) over [`Q4K_CELL`] cells, in the
/// order of llama.cpp's repacked GEMV: per super-block the exact integer sums
/// I = Σ_j sc_j·Σ q·y and M = Σ_j m_j·(bsum pair j) (16 rows as vector lanes), then
/// `acc = fma(f32(I), d_w·d_y, acc)`, `acc_m = fma(f32(M), dmin_w·d_y, acc_m)`; the result is
/// `acc − acc_m`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_q4_k(w: &[u8], act: &[u8], nb: usize) -> [f32; GROUP] {
    const AB: usize = 292; // Q8_K block: f32 d, i8 qs[256], i16 bsums[16]
    assert!(w.len() >= nb * Q4K_CELL && act.len() >= nb * AB);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = _mm512_setzero_ps();
    let mut acc_m = _mm512_setzero_ps();
    for b in 0..nb {
        // SAFETY: cell b and activation block b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * Q4K_CELL);
            let y = act.as_ptr().add(b * AB);
            let ya = |e: usize| _mm512_set1_epi32((y.add(4 + e) as *const i32).read_unaligned());
            let bsum = |g: usize| (y.add(260 + 2 * g) as *const i16).read_unaligned() as i32;
            let bytes16 =
                |at: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(cell.add(at) as *const __m128i));
            let mut isum = _mm512_setzero_si512();
            for p in 0..4 {
                let (mut lo_sum, mut hi_sum) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for k in 0..8 {
                    let line = 320 + 64 * (8 * p + k);
                    let x = _mm512_loadu_si512(cell.add(line) as *const _);
                    let lo = _mm512_and_si512(x, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), m4);
                    lo_sum = _mm512_dpbusd_epi32(lo_sum, lo, ya(64 * p + 4 * k));
                    hi_sum = _mm512_dpbusd_epi32(hi_sum, hi, ya(64 * p + 32 + 4 * k));
                }
                isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(lo_sum, bytes16(64 + 32 * p)));
                isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(hi_sum, bytes16(80 + 32 * p)));
            }
            let mut imin = _mm512_setzero_si512();
            for j in 0..8 {
                let pair = _mm512_set1_epi32(bsum(2 * j) + bsum(2 * j + 1));
                imin = _mm512_add_epi32(imin, _mm512_mullo_epi32(bytes16(192 + 16 * j), pair));
            }
            let dy = _mm512_set1_ps((y as *const f32).read_unaligned());
            let d = _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_loadu_si256(cell as *const __m256i)),
                dy,
            );
            let dm = _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_loadu_si256(cell.add(32) as *const __m256i)),
                dy,
            );
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, acc);
            acc_m = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), dm, acc_m);
        }
    }
    let mut out = [0f32; GROUP];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_sub_ps(acc, acc_m)) };
    out
}

/// `kvalues_iq4nl + 128`: the IQ4 values as unsigned bytes, for VNNI's unsigned operand.
const IQ4_VALUES_U8: [u8; 16] = [
    1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241,
];

/// One group of IQ4_XS rows ([`IQ4XS_CELL`] cells) x one token's Q8_K activations, in the float
/// order of `vec_dot` (llama.cpp's AVX2 `ggml_vec_dot_iq4_xs_q8_K`): per super-block the exact
/// integer lanes t = Σ_ib (ls_ib − 32)·Σ_{4 elements of lane t} q·y, held as 8 vectors of the
/// 16 rows (VNNI on the values + 128, less 128·Σy of the 4 activations), then per lane
/// `acc_t = fma(d_w·d_y, f32(lane_t), acc_t)`; the result is `hsum_float_8` of each row's 8
/// lanes, here vertical adds across the lane vectors.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_iq4xs<const TILED: bool>(w: &[u8], act: &[u8], nb: usize) -> [f32; GROUP] {
    const AB: usize = 292; // Q8_K block: f32 d, i8 qs[256], i16 bsums[16]
    assert!(w.len() >= nb * IQ4XS_CELL && act.len() >= nb * AB);
    let m4 = _mm512_set1_epi8(0x0f);
    // SAFETY: the table is 16 readable bytes.
    let table = _mm512_broadcast_i32x4(unsafe {
        _mm_loadu_si128(IQ4_VALUES_U8.as_ptr() as *const __m128i)
    });
    let mut acc = [_mm512_setzero_ps(); 8];
    for b in 0..nb {
        // SAFETY: cell b and activation block b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * IQ4XS_CELL);
            let y = act.as_ptr().add(b * AB);
            // Activations e..e+4 broadcast, and 128 times their sum (the unsigned offset of the
            // values), all 64 sums by four VNNI products against ones.
            let ya = |e: usize| _mm512_set1_epi32((y.add(4 + e) as *const i32).read_unaligned());
            let mut sums = [0i32; 64];
            for c in 0..4 {
                let yc = _mm512_loadu_si512(y.add(4 + 64 * c) as *const _);
                let s4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), yc);
                _mm512_storeu_si512(
                    sums.as_mut_ptr().add(16 * c) as *mut _,
                    _mm512_slli_epi32::<7>(s4),
                );
            }
            let off = |e: usize| _mm512_set1_epi32(sums[e / 4]);
            let mut lanes = [_mm512_setzero_si512(); 8];
            for ib in 0..8 {
                let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(cell.add(32 + 16 * ib) as *const _));
                for k in 0..4 {
                    let x = _mm512_loadu_si512(cell.add(160 + 64 * (4 * ib + k)) as *const _);
                    let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(x, m4));
                    let hi =
                        _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(x), m4));
                    let (e_lo, e_hi) = (32 * ib + 4 * k, 32 * ib + 16 + 4 * k);
                    let zero = _mm512_setzero_si512();
                    let p_lo = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, lo, ya(e_lo)), off(e_lo));
                    let p_hi = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, hi, ya(e_hi)), off(e_hi));
                    lanes[k] = _mm512_add_epi32(lanes[k], _mm512_mullo_epi32(p_lo, sc));
                    lanes[k + 4] = _mm512_add_epi32(lanes[k + 4], _mm512_mullo_epi32(p_hi, sc));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(cell as *const __m256i));
            let dy = _mm512_set1_ps((y as *const f32).read_unaligned());
            if TILED {
                // The tiled prompt matmul's epilogue: the super-block's whole sum S (exact),
                // r = f32(S)·d_w, acc = fma(r, d_y, acc); kept in acc[0].
                let mut s = lanes[0];
                for l in &lanes[1..] {
                    s = _mm512_add_epi32(s, *l);
                }
                let r = _mm512_mul_ps(_mm512_cvtepi32_ps(s), dw);
                acc[0] = _mm512_fmadd_ps(r, dy, acc[0]);
            } else {
                let d = _mm512_mul_ps(dw, dy);
                for t in 0..8 {
                    acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lanes[t]), acc[t]);
                }
            }
        }
    }
    if TILED {
        let mut out = [0f32; GROUP];
        // SAFETY: `out` holds 16 f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), acc[0]) };
        return out;
    }
    // hsum_float_8 per row: r_j = x_{4+j} + x_j, then (r0 + r2) + (r1 + r3).
    let r: [__m512; 4] = core::array::from_fn(|j| _mm512_add_ps(acc[4 + j], acc[j]));
    let sum = _mm512_add_ps(_mm512_add_ps(r[0], r[2]), _mm512_add_ps(r[1], r[3]));
    let mut out = [0f32; GROUP];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), sum) };
    out
}

/// One group of Q8_0 rows x Q8_0 activations of `N` consecutive tokens from `tok`, over the
/// interleaved cells of [`pack_x16`]: line k of a block is `vec_dot`'s lane k (4 consecutive
/// elements) for all 16 rows, taken by VNNI as unsigned `q + 128` with the prepared `-128·Σ a`
/// over the lane's 4 activations as the start value, which gives `vec_dot`'s exact Σ q·a; then
/// `acc[k] = fma(d_w·d_a, f32(lane), acc[k])` (lane r = row r) and `hsum_float_8`. The weights
/// are loaded once for the N tokens; each token's outputs are the one-token kernel's bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_q8_0_lanes<const N: usize>(
    w: &[u8],
    p: &Prepared,
    tok: usize,
) -> [[f32; GROUP]; N] {
    let nb = p.nb;
    let cell_len = GROUP * 34;
    let t0 = tok * nb;
    let tn = (tok + N) * nb;
    assert!(
        w.len() >= nb * cell_len
            && p.quants.len() >= tn * 64
            && p.corr.len() >= tn * 16
            && p.scales.len() >= tn
    );
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let mut acc = [[_mm512_setzero_ps(); 8]; N];
    for b in 0..nb {
        // SAFETY: cell b and the N tokens' activation blocks b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * cell_len);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(cell as *const __m256i));
            let at = |c: usize| t0 + c * nb + b;
            let d: [__m512; N] = core::array::from_fn(|c| {
                _mm512_mul_ps(dw, _mm512_set1_ps(*p.scales.get_unchecked(at(c))))
            });
            // Prepared Q8_0 layout: elements 0..32 at bytes 0..32; `corr` lane k is -128·Σ a
            // over elements 4k..4k+4.
            let av = |c: usize, k: usize| {
                let a = p.quants.as_ptr().add(at(c) * 64);
                _mm512_set1_epi32((a.add(4 * k) as *const i32).read_unaligned())
            };
            let start =
                |c: usize, k: usize| _mm512_set1_epi32(*p.corr.get_unchecked(at(c) * 16 + k));
            for k in 0..8 {
                let q = _mm512_loadu_si512(cell.add(2 * GROUP + 64 * k) as *const _);
                let wz = _mm512_xor_si512(q, flip);
                for c in 0..N {
                    let isum = _mm512_dpbusd_epi32(start(c, k), wz, av(c, k));
                    acc[c][k] = _mm512_fmadd_ps(d[c], _mm512_cvtepi32_ps(isum), acc[c][k]);
                }
            }
        }
    }
    let mut out = [[0f32; GROUP]; N];
    for c in 0..N {
        // SAFETY: `out[c]` holds 16 f32.
        unsafe { _mm512_storeu_ps(out[c].as_mut_ptr(), hsum8_lanes(&acc[c])) };
    }
    out
}

/// One group of Q5_0 rows x Q8_0 activations of `N` consecutive tokens from `tok` (the weights
/// loaded and unpacked once for all), over the interleaved cells of [`pack_x16`]: per
/// block, each nibble half of a line plus its lane's fifth-bit mask is one of `vec_dot`'s 8 lanes
/// (4 consecutive elements) for all 16 rows. The quants go to VNNI unsigned (0..31) with
/// `-16·Σ a` over the lane's 4 activations as the start value, which gives `vec_dot`'s exact
/// Σ (q − 16)·a; then `acc[j] = fma(d_w·d_a, f32(lane), acc[j])` and `hsum_float_8`. Same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_q5_0_lanes<const N: usize>(
    w: &[u8],
    p: &Prepared,
    tok: usize,
) -> [[f32; GROUP]; N] {
    let nb = p.nb;
    let cell_len = GROUP * 22;
    let t0 = tok * nb;
    let tn = (tok + N) * nb;
    assert!(
        w.len() >= nb * cell_len
            && p.quants.len() >= tn * 64
            && p.corr.len() >= tn * 16
            && p.scales.len() >= tn
    );
    let m4 = _mm512_set1_epi8(0x0f);
    let sixteen = _mm512_set1_epi8(16);
    let mut acc = [[_mm512_setzero_ps(); 8]; N];
    for b in 0..nb {
        // SAFETY: cell b and the N tokens' activation blocks b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * cell_len);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(cell as *const __m256i));
            let at = |c: usize| t0 + c * nb + b;
            let d: [__m512; N] = core::array::from_fn(|c| {
                _mm512_mul_ps(dw, _mm512_set1_ps(*p.scales.get_unchecked(at(c))))
            });
            // Prepared Q8_0 layout: elements 0..32 at bytes 0..32; `corr` lane j is -128·Σ a
            // over elements 4j..4j+4, so -16·Σ a is a shift (exact: a multiple of 128).
            let av = |c: usize, off: usize| {
                let a = p.quants.as_ptr().add(at(c) * 64);
                _mm512_set1_epi32((a.add(off) as *const i32).read_unaligned())
            };
            let start =
                |c: usize, j: usize| _mm512_set1_epi32(*p.corr.get_unchecked(at(c) * 16 + j) >> 3);
            let mask = |j: usize| (cell.add(32 + 8 * j) as *const u64).read_unaligned();
            for k in 0..4 {
                let x = _mm512_loadu_si512(cell.add(96 + 64 * k) as *const _);
                let lo = _mm512_and_si512(x, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), m4);
                let lo = _mm512_mask_add_epi8(lo, mask(k), lo, sixteen);
                let hi = _mm512_mask_add_epi8(hi, mask(4 + k), hi, sixteen);
                for c in 0..N {
                    let slo = _mm512_dpbusd_epi32(start(c, k), lo, av(c, 4 * k));
                    let shi = _mm512_dpbusd_epi32(start(c, 4 + k), hi, av(c, 16 + 4 * k));
                    acc[c][k] = _mm512_fmadd_ps(d[c], _mm512_cvtepi32_ps(slo), acc[c][k]);
                    acc[c][k + 4] = _mm512_fmadd_ps(d[c], _mm512_cvtepi32_ps(shi), acc[c][k + 4]);
                }
            }
        }
    }
    let mut out = [[0f32; GROUP]; N];
    for c in 0..N {
        // SAFETY: `out[c]` holds 16 f32.
        unsafe { _mm512_storeu_ps(out[c].as_mut_ptr(), hsum8_lanes(&acc[c])) };
    }
    out
}

/// One group of Q4_1 rows x Q8_1 activations of `N` consecutive tokens from `tok`, over the
/// interleaved cells of [`pack_x16`]: per block, each nibble half of a line is one of
/// `vec_dot`'s 8 lanes (4 consecutive elements) for all 16 rows, so lane j of every row
/// accumulates in vector `acc[j]` (lane r = row r) by the same `fma(d_w·d_a, f32(lane), acc)`;
/// the end reduces the 8 vectors in `hsum_float_8`'s order and adds the rows' Σ m·s, summed in
/// the row kernel's order. Same bits as `vec_dot` for each token; the weights are loaded and
/// unpacked once for the N tokens. The quants are read in place from the Q8_1 rows `act`
/// (40-byte blocks, quants at bytes 4..36), the scales from `p` ([`Prepared::fill`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_q4_1_lanes<const N: usize>(
    w: &[u8],
    p: &Prepared,
    act: &[u8],
    tok: usize,
) -> [[f32; GROUP]; N] {
    let nb = p.nb;
    let cell_len = GROUP * 20;
    let t0 = tok * nb;
    let tn = (tok + N) * nb;
    assert!(w.len() >= nb * cell_len && act.len() >= tn * 40 && p.scales.len() >= tn * 4);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [[_mm512_setzero_ps(); 8]; N];
    let mut summs = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY: cell b and the N tokens' activation blocks b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * cell_len);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(cell as *const __m256i));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(cell.add(32) as *const __m256i));
            let at = |c: usize| t0 + c * nb + b;
            let d: [__m512; N] = core::array::from_fn(|c| {
                _mm512_mul_ps(dw, _mm512_set1_ps(*p.scales.get_unchecked(4 * at(c))))
            });
            for c in 0..N {
                let sa = *p.scales.get_unchecked(4 * at(c) + 1);
                summs[c] = _mm512_add_ps(summs[c], _mm512_mul_ps(mw, _mm512_set1_ps(sa)));
            }
            // Elements e..e + 4 of a Q8_1 block (its quants at bytes 4..36).
            let av = |c: usize, e: usize| {
                let q = act.as_ptr().add(at(c) * 40 + 4);
                _mm512_set1_epi32((q.add(e) as *const i32).read_unaligned())
            };
            for k in 0..4 {
                let x = _mm512_loadu_si512(cell.add(64 + 64 * k) as *const _);
                let lo = _mm512_and_si512(x, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), m4);
                for c in 0..N {
                    let slo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, av(c, 4 * k));
                    let shi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, av(c, 16 + 4 * k));
                    acc[c][k] = _mm512_fmadd_ps(d[c], _mm512_cvtepi32_ps(slo), acc[c][k]);
                    acc[c][k + 4] = _mm512_fmadd_ps(d[c], _mm512_cvtepi32_ps(shi), acc[c][k + 4]);
                }
            }
        }
    }
    let mut out = [[0f32; GROUP]; N];
    for c in 0..N {
        let h = hsum8_lanes(&acc[c]);
        // SAFETY: `out[c]` holds 16 f32.
        unsafe { _mm512_storeu_ps(out[c].as_mut_ptr(), _mm512_add_ps(h, summs[c])) };
    }
    out
}

/// One group of Q8_0 rows x Q8_0 activations of `N` consecutive tokens from `tok`, over the
/// interleaved cells of [`pack_x16`], in the block order ([`crate::quant::vec_dot_blocks`]):
/// line k of a block holds elements 4k..4k+4 of all 16 rows (row r in i32 lane r), taken by VNNI
/// as unsigned `q + 128`; the 8 lines' products are summed in the same i32 lanes from the start
/// value `-128·Σ a` of the block ([`Prepared::block_corr`]), which gives the exact Σ q·a; then
/// one `acc = fma(d_w·d_a, f32(Σ), acc)` per block. The weights are loaded once for the N tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_q8_0_blocks<const N: usize>(
    w: &[u8],
    p: &Prepared,
    tok: usize,
) -> [[f32; GROUP]; N] {
    let nb = p.nb;
    let cell_len = GROUP * 34;
    let t0 = tok * nb;
    let tn = (tok + N) * nb;
    assert!(
        w.len() >= nb * cell_len
            && p.quants.len() >= tn * 64
            && p.block_corr.len() >= tn
            && p.scales.len() >= tn
    );
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY: cell b and the N tokens' activation blocks b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * cell_len);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(cell as *const __m256i));
            let wz: [__m512i; 8] = core::array::from_fn(|k| {
                _mm512_xor_si512(
                    _mm512_loadu_si512(cell.add(2 * GROUP + 64 * k) as *const _),
                    flip,
                )
            });
            for c in 0..N {
                let at = t0 + c * nb + b;
                // Prepared Q8_0 layout: elements 0..32 at bytes 0..32.
                let a = p.quants.as_ptr().add(at * 64);
                let av =
                    |k: usize| _mm512_set1_epi32((a.add(4 * k) as *const i32).read_unaligned());
                // Two chains of 4 (latency), added at the end: integer sums, exact.
                let mut s0 = _mm512_dpbusd_epi32(
                    _mm512_set1_epi32(*p.block_corr.get_unchecked(at)),
                    wz[0],
                    av(0),
                );
                let mut s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wz[1], av(1));
                for k in (2..8).step_by(2) {
                    s0 = _mm512_dpbusd_epi32(s0, wz[k], av(k));
                    s1 = _mm512_dpbusd_epi32(s1, wz[k + 1], av(k + 1));
                }
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(*p.scales.get_unchecked(at)));
                acc[c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[c]);
            }
        }
    }
    let mut out = [[0f32; GROUP]; N];
    for c in 0..N {
        // SAFETY: `out[c]` holds 16 f32.
        unsafe { _mm512_storeu_ps(out[c].as_mut_ptr(), acc[c]) };
    }
    out
}

/// One group of Q5_0 rows x Q8_0 activations of `N` consecutive tokens from `tok`, over the
/// interleaved cells of [`pack_x16`], in the block order: each nibble half of a line plus its
/// fifth-bit mask holds 4 consecutive elements of all 16 rows, unsigned (0..31); the block's
/// products are summed in i32 lanes (row r in lane r) from the start value `-16·Σ a` of the
/// block, which gives the exact Σ (q − 16)·a; then one `acc = fma(d_w·d_a, f32(Σ), acc)` per
/// block. The weights are loaded and unpacked once for the N tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_q5_0_blocks<const N: usize>(
    w: &[u8],
    p: &Prepared,
    tok: usize,
) -> [[f32; GROUP]; N] {
    let nb = p.nb;
    let cell_len = GROUP * 22;
    let t0 = tok * nb;
    let tn = (tok + N) * nb;
    assert!(
        w.len() >= nb * cell_len
            && p.quants.len() >= tn * 64
            && p.block_corr.len() >= tn
            && p.scales.len() >= tn
    );
    let m4 = _mm512_set1_epi8(0x0f);
    let sixteen = _mm512_set1_epi8(16);
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY: cell b and the N tokens' activation blocks b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * cell_len);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(cell as *const __m256i));
            let mask = |j: usize| (cell.add(32 + 8 * j) as *const u64).read_unaligned();
            let x: [__m512i; 4] =
                core::array::from_fn(|k| _mm512_loadu_si512(cell.add(96 + 64 * k) as *const _));
            // lo[k]: elements 4k..4k+4; hi[k]: elements 16+4k..16+4k+4.
            let lo: [__m512i; 4] = core::array::from_fn(|k| {
                let v = _mm512_and_si512(x[k], m4);
                _mm512_mask_add_epi8(v, mask(k), v, sixteen)
            });
            let hi: [__m512i; 4] = core::array::from_fn(|k| {
                let v = _mm512_and_si512(_mm512_srli_epi16::<4>(x[k]), m4);
                _mm512_mask_add_epi8(v, mask(4 + k), v, sixteen)
            });
            for c in 0..N {
                let at = t0 + c * nb + b;
                // Prepared Q8_0 layout: elements 0..32 at bytes 0..32; -16·Σ a is the block's
                // -128·Σ a shifted (exact: a multiple of 128).
                let a = p.quants.as_ptr().add(at * 64);
                let av = |e: usize| _mm512_set1_epi32((a.add(e) as *const i32).read_unaligned());
                let start = _mm512_set1_epi32(*p.block_corr.get_unchecked(at) >> 3);
                let mut s0 = _mm512_dpbusd_epi32(start, lo[0], av(0));
                let mut s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], av(16));
                for k in 1..4 {
                    s0 = _mm512_dpbusd_epi32(s0, lo[k], av(4 * k));
                    s1 = _mm512_dpbusd_epi32(s1, hi[k], av(16 + 4 * k));
                }
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(*p.scales.get_unchecked(at)));
                acc[c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[c]);
            }
        }
    }
    let mut out = [[0f32; GROUP]; N];
    for c in 0..N {
        // SAFETY: `out[c]` holds 16 f32.
        unsafe { _mm512_storeu_ps(out[c].as_mut_ptr(), acc[c]) };
    }
    out
}

/// One group of Q4_1 rows x Q8_1 activations of `N` consecutive tokens from `tok`, over the
/// interleaved cells of [`pack_x16`], in the block order: each nibble half of a line holds 4
/// consecutive elements of all 16 rows; the block's products are summed in i32 lanes (row r in
/// lane r), exact; then one `acc = fma(d_w·d_a, f32(Σ), acc)` and `sm = fma(m_w, s_a, sm)` per
/// block, and `acc + sm` at the end. The weights are loaded and unpacked once for the N tokens.
/// The quants are read in place from the Q8_1 rows `act` (40-byte blocks, quants at bytes
/// 4..36), the scales from `p` ([`Prepared::fill`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_q4_1_blocks<const N: usize>(
    w: &[u8],
    p: &Prepared,
    act: &[u8],
    tok: usize,
) -> [[f32; GROUP]; N] {
    let nb = p.nb;
    let cell_len = GROUP * 20;
    let t0 = tok * nb;
    let tn = (tok + N) * nb;
    assert!(w.len() >= nb * cell_len && act.len() >= tn * 40 && p.scales.len() >= tn * 4);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); N];
    let mut sm = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY: cell b and the N tokens' activation blocks b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * cell_len);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(cell as *const __m256i));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(cell.add(32) as *const __m256i));
            let x: [__m512i; 4] =
                core::array::from_fn(|k| _mm512_loadu_si512(cell.add(64 + 64 * k) as *const _));
            // lo[k]: elements 4k..4k+4; hi[k]: elements 16+4k..16+4k+4.
            let lo: [__m512i; 4] = core::array::from_fn(|k| _mm512_and_si512(x[k], m4));
            let hi: [__m512i; 4] =
                core::array::from_fn(|k| _mm512_and_si512(_mm512_srli_epi16::<4>(x[k]), m4));
            for c in 0..N {
                let at = t0 + c * nb + b;
                // Elements e..e + 4 of the Q8_1 block (its quants at bytes 4..36).
                let q = act.as_ptr().add(at * 40 + 4);
                let av = |e: usize| _mm512_set1_epi32((q.add(e) as *const i32).read_unaligned());
                let mut s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], av(0));
                let mut s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], av(16));
                for k in 1..4 {
                    s0 = _mm512_dpbusd_epi32(s0, lo[k], av(4 * k));
                    s1 = _mm512_dpbusd_epi32(s1, hi[k], av(16 + 4 * k));
                }
                let sc = p.scales.as_ptr().add(4 * at);
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(*sc));
                acc[c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[c]);
                sm[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*sc.add(1)), sm[c]);
            }
        }
    }
    let mut out = [[0f32; GROUP]; N];
    for c in 0..N {
        // SAFETY: `out[c]` holds 16 f32.
        unsafe { _mm512_storeu_ps(out[c].as_mut_ptr(), _mm512_add_ps(acc[c], sm[c])) };
    }
    out
}

/// [`hsum8_order`] lane by lane: `acc[j]` holds lane j of 16 rows' 8-lane accumulators.
#[target_feature(enable = "avx512f")]
fn hsum8_lanes(acc: &[__m512; 8]) -> __m512 {
    // hsum_float_8 per row: r = [l4+l0, l5+l1, l6+l2, l7+l3], then (r0+r2)+(r1+r3).
    let r: [__m512; 4] = core::array::from_fn(|j| _mm512_add_ps(acc[j + 4], acc[j]));
    _mm512_add_ps(_mm512_add_ps(r[0], r[2]), _mm512_add_ps(r[1], r[3]))
}

/// One group of Q6_K rows x Q8_K activations (`nb` super-blocks) over [`Q6K_CELL`] cells, in
/// `vec_dot`'s float order (llama.cpp's AVX2 `ggml_vec_dot_q6_K_q8_K`): per super-block, lane l
/// of its 8 i32 lanes is Σ over the 8 chunks of scale·(the 4 products of chunk bytes 4l..4l+4),
/// minus 32·(scale·bsum) of sub-blocks 2l and 2l+1 (exact); then `acc_l = fma(d_w·d_y, f32(lane),
/// acc_l)`, and `hsum_float_8` at the end. Lane l of all 16 rows is vector `acc[l]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_group_q6_k(w: &[u8], act: &[u8], nb: usize) -> [f32; GROUP] {
    const AB: usize = 292; // Q8_K block: f32 d, i8 qs[256], i16 bsums[16]
    const SC: usize = 48 * 64;
    assert!(w.len() >= nb * Q6K_CELL && act.len() >= nb * AB);
    let m4 = _mm512_set1_epi8(0x0f);
    let m30 = _mm512_set1_epi8(0x30);
    let lo16 = _mm512_set1_epi32(0xffff);
    let mut acc = [_mm512_setzero_ps(); 8];
    for b in 0..nb {
        // SAFETY: cell b and activation block b are in bounds (asserted above).
        unsafe {
            let cell = w.as_ptr().add(b * Q6K_CELL);
            let y = act.as_ptr().add(b * AB);
            let ya = |e: usize| _mm512_set1_epi32((y.add(4 + e) as *const i32).read_unaligned());
            let bsum = |g: usize| (y.add(260 + 2 * g) as *const i16).read_unaligned() as i32;
            // Sub-block sb's scales of the 16 rows as i32 lanes.
            let scale = |sb: usize| {
                _mm512_cvtepi8_epi32(_mm_loadu_si128(cell.add(SC + 16 * sb) as *const __m128i))
            };
            let mut sumi = [_mm512_setzero_si512(); 8];
            for h in 0..2 {
                // The half's 8 sub-block scales as i16 pairs (sc, sc) for `dpwssd`.
                let sc: [__m512i; 8] = core::array::from_fn(|j| {
                    let v = scale(8 * h + j);
                    _mm512_or_si512(_mm512_and_si512(v, lo16), _mm512_slli_epi32::<16>(v))
                });
                for l in 0..8 {
                    let at = 64 * 3 * (8 * h + l);
                    let ql0 = _mm512_loadu_si512(cell.add(at) as *const _);
                    let ql1 = _mm512_loadu_si512(cell.add(at + 64) as *const _);
                    let qh = _mm512_loadu_si512(cell.add(at + 128) as *const _);
                    let lows = [
                        _mm512_and_si512(ql0, m4),
                        _mm512_and_si512(ql1, m4),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(ql0), m4),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(ql1), m4),
                    ];
                    // Chunk k's two high bits, moved to bits 4..6 (masked below).
                    let his = [
                        _mm512_slli_epi16::<4>(qh),
                        _mm512_slli_epi16::<2>(qh),
                        qh,
                        _mm512_srli_epi16::<2>(qh),
                    ];
                    for k in 0..4 {
                        // q = (hi & 0x30) | lo: the 6-bit quants, unsigned.
                        let q = _mm512_ternarylogic_epi32::<0xEA>(his[k], m30, lows[k]);
                        let p = _mm512_maddubs_epi16(q, ya(128 * h + 32 * k + 4 * l));
                        sumi[l] = _mm512_dpwssd_epi32(sumi[l], p, sc[2 * k + l / 4]);
                    }
                }
            }
            let dy = _mm512_set1_ps((y as *const f32).read_unaligned());
            let d = _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_loadu_si256(cell.add(SC + 256) as *const __m256i)),
                dy,
            );
            for l in 0..8 {
                let c = _mm512_add_epi32(
                    _mm512_mullo_epi32(scale(2 * l), _mm512_set1_epi32(bsum(2 * l))),
                    _mm512_mullo_epi32(scale(2 * l + 1), _mm512_set1_epi32(bsum(2 * l + 1))),
                );
                let lane = _mm512_sub_epi32(sumi[l], _mm512_slli_epi32::<5>(c));
                acc[l] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lane), acc[l]);
            }
        }
    }
    let mut out = [0f32; GROUP];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), hsum8_lanes(&acc)) };
    out
}
