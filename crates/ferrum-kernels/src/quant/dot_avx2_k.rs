//! AVX2 K-quant x Q8_K dot products (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K). Per super-block the integer sum
//! Σ_sub scale·Σ qw·qx is formed exactly in 8 i32 lanes, converted once and accumulated with FMA
//! into 8 f32 lanes scaled by d_w·d_x; the min terms (Σ bsums·min, exact integers in 4 lanes) are
//! scaled by −dmin_w·d_x into 4 more f32 lanes. Same lane layout and final reductions as llama.cpp's
//! AVX2 `ggml_vec_dot_q4_K_q8_K` / `_q6_K_q8_K`.

use super::blocks::*;
use super::dot_avx2::{h2f, hsum8, hsum_i32x8, ld128, ld256};
use core::arch::x86_64::*;

/// Σ_g bsums[g] · min[g/2] of one Q8_K block as 4 exact i32 partial sums (lane j covers
/// sub-blocks 2j and 2j+1 of 32 elements).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bsums_dot_mins(by: &[u8], m: &[u8; 8]) -> __m128i {
    let bs = ld256(&by[Q8_K_BSUMS..]);
    // Pair sums bsums[2j] + bsums[2j+1] (|.| ≤ 2·16·127, no i16 overflow), j = 0..8.
    let pairs = _mm_hadd_epi16(
        _mm256_castsi256_si128(bs),
        _mm256_extracti128_si256::<1>(bs),
    );
    let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(u64::from_le_bytes(*m) as i64));
    _mm_madd_epi16(pairs, mins)
}

/// Q4_K (`hbits` = None) or Q5_K (`hbits` = the 32 qh bytes) x Q8_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q45k(w: &[u8], a: &[u8], five: bool) -> f32 {
    let (bw, qs_off) = if five { (176, Q5_K_QS) } else { (144, Q4_K_QS) };
    let m4 = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for (bx, by) in w.chunks_exact(bw).zip(a.chunks_exact(292)) {
        let dy = rd_f32(by, 0);
        let d = h2f(bx, 0) * dy;
        let dmin = -dy * h2f(bx, 2);
        let (sc, m) = scale_min_k4(&bx[Q4_K_SCALES..Q4_K_SCALES + 12]);
        let prod = _mm_cvtepi32_ps(bsums_dot_mins(by, &m));
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), prod, acc_m);

        let hbits = if five {
            ld256(&bx[Q5_K_QH..])
        } else {
            _mm256_setzero_si256()
        };
        let mut sumi = _mm256_setzero_si256();
        for c in 0..4 {
            let q4 = ld256(&bx[qs_off + 32 * c..]);
            let mut lo = _mm256_and_si256(q4, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
            if five {
                // Bit 2c of qh[l] is the 5th bit of element 64c + l, bit 2c+1 of 64c + 32 + l.
                let sh = _mm_cvtsi32_si128(2 * c as i32);
                let h0 = _mm256_and_si256(_mm256_srl_epi16(hbits, sh), one);
                let sh1 = _mm_cvtsi32_si128(2 * c as i32 + 1);
                let h1 = _mm256_and_si256(_mm256_srl_epi16(hbits, sh1), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(h0));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(h1));
            }
            let y0 = ld256(&by[Q8_K_QS + 64 * c..]);
            let y1 = ld256(&by[Q8_K_QS + 64 * c + 32..]);
            let p0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(lo, y0),
                _mm256_set1_epi16(sc[2 * c] as i16),
            );
            let p1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(hi, y1),
                _mm256_set1_epi16(sc[2 * c + 1] as i16),
            );
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    let acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    let acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    hsum8(acc) + _mm_cvtss_f32(acc_m)
}

/// Q4_K x Q8_K.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q4k(w: &[u8], a: &[u8]) -> f32 {
    dot_q45k(w, a, false)
}

/// Σ_{sub 2c, 2c+1} scale·Σ q·y of the 64-element chunk `c` of one Q4_K / Q8_K block pair as 8
/// exact i32 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_chunk_isums(bx: &[u8], by: &[u8], sc: &[u8; 8], c: usize) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0f);
    let q4 = ld256(&bx[Q4_K_QS + 32 * c..]);
    let lo = _mm256_and_si256(q4, m4);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
    let y0 = ld256(&by[Q8_K_QS + 64 * c..]);
    let y1 = ld256(&by[Q8_K_QS + 64 * c + 32..]);
    let p0 = _mm256_madd_epi16(
        _mm256_maddubs_epi16(lo, y0),
        _mm256_set1_epi16(sc[2 * c] as i16),
    );
    let p1 = _mm256_madd_epi16(
        _mm256_maddubs_epi16(hi, y1),
        _mm256_set1_epi16(sc[2 * c + 1] as i16),
    );
    _mm256_add_epi32(p0, p1)
}

/// Q4_K x Q8_K in the float order of llama.cpp's repacked `ggml_gemv_q4_K_8x8_q8_K` (see
/// `dot::dot_q4k_x8`): the per-super-block integer sums are formed exactly in i32 lanes as in
/// [`dot_q4k`], reduced horizontally (exact), then accumulated with scalar FMAs.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q4k_x8(w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for (bx, by) in w.chunks_exact(144).zip(a.chunks_exact(292)) {
        let dy = rd_f32(by, 0);
        let (sc, m) = scale_min_k4(&bx[Q4_K_SCALES..Q4_K_SCALES + 12]);
        let mins = bsums_dot_mins(by, &m);
        let mut sumi = _mm256_setzero_si256();
        for c in 0..4 {
            sumi = _mm256_add_epi32(sumi, q4k_chunk_isums(bx, by, &sc, c));
        }
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(sumi),
            _mm256_extracti128_si256::<1>(sumi),
        );
        let isum = hsum4_i32(s4);
        let imin = hsum4_i32(mins);
        acc = (isum as f32).mul_add(h2f(bx, 0) * dy, acc);
        acc_m = (imin as f32).mul_add(h2f(bx, 2) * dy, acc_m);
    }
    acc - acc_m
}

/// Q4_K x Q8_K in the float order of llama.cpp's repacked 8x8 GEMM (`ggml_gemm_q4_K_8x8_q8_K`,
/// see `dot::dot_q4k_gemm`): per 64-element chunk p the exact sums I_p (from
/// [`q4k_chunk_isums`]) and M_p (lane p of [`bsums_dot_mins`]) go by scalar FMA into `acc` with
/// d_w·d_x and `acc_m` with dmin_w·d_x.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q4k_gemm(w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for (bx, by) in w.chunks_exact(144).zip(a.chunks_exact(292)) {
        let dy = rd_f32(by, 0);
        let dd = h2f(bx, 0) * dy;
        let dm = h2f(bx, 2) * dy;
        let (sc, m) = scale_min_k4(&bx[Q4_K_SCALES..Q4_K_SCALES + 12]);
        // Lane p of each: chunk p's 8 lanes folded to 4, then pairwise hadds (exact).
        let i01 = _mm_hadd_epi32(
            fold_i32x8(q4k_chunk_isums(bx, by, &sc, 0)),
            fold_i32x8(q4k_chunk_isums(bx, by, &sc, 1)),
        );
        let i23 = _mm_hadd_epi32(
            fold_i32x8(q4k_chunk_isums(bx, by, &sc, 2)),
            fold_i32x8(q4k_chunk_isums(bx, by, &sc, 3)),
        );
        let ip = lanes4(_mm_hadd_epi32(i01, i23));
        let mp = lanes4(bsums_dot_mins(by, &m));
        for p in 0..4 {
            acc = (ip[p] as f32).mul_add(dd, acc);
            acc_m = (mp[p] as f32).mul_add(dm, acc_m);
        }
    }
    acc - acc_m
}

/// The two 128-bit halves of 8 i32 lanes added (lane j + lane j+4; exact).
#[inline]
#[target_feature(enable = "avx2")]
fn fold_i32x8(v: __m256i) -> __m128i {
    _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v))
}

/// The 4 i32 lanes of `x` as an array.
#[inline]
#[target_feature(enable = "avx2")]
fn lanes4(x: __m128i) -> [i32; 4] {
    [
        _mm_extract_epi32::<0>(x),
        _mm_extract_epi32::<1>(x),
        _mm_extract_epi32::<2>(x),
        _mm_extract_epi32::<3>(x),
    ]
}

/// Exact horizontal sum of 4 i32 lanes (wrapping, as the SIMD adds; our sums never overflow).
#[inline]
#[target_feature(enable = "avx2")]
fn hsum4_i32(x: __m128i) -> i32 {
    let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
    let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
    _mm_cvtsi128_si32(x)
}

/// Q5_K x Q8_K.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q5k(w: &[u8], a: &[u8]) -> f32 {
    dot_q45k(w, a, true)
}

/// Q6_K x Q8_K: q in 0..63 from 4 low + 2 high bits. Σ scale·(q − 32)·y is formed as
/// Σ scale·q·y (unsigned q with `maddubs`) minus 32·Σ_g scale_g·bsums_g, the latter in 8 lanes
/// (lane l: groups 2l, 2l+1) subtracted once per super-block, as llama.cpp's AVX2 kernel does.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q6k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (bx, by) in w.chunks_exact(210).zip(a.chunks_exact(292)) {
        let d = h2f(bx, Q6_K_D) * rd_f32(by, 0);
        let sumi = q6k_isums(bx, by);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum8(acc)
}

/// Σ_g scale_g·Σ (q − 32)·y of one Q6_K / Q8_K block pair as 8 exact i32 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k_isums(bx: &[u8], by: &[u8]) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(3);
    let scales = _mm256_cvtepi8_epi16(ld128(&bx[Q6_K_SCALES..]));
    let sub = _mm256_slli_epi32::<5>(_mm256_madd_epi16(ld256(&by[Q8_K_BSUMS..]), scales));
    let mut sumi = _mm256_setzero_si256();
    for h in 0..2 {
        let ql0 = ld256(&bx[64 * h..]);
        let ql1 = ld256(&bx[64 * h + 32..]);
        let qh = ld256(&bx[Q6_K_QH + 32 * h..]);
        let lows = [
            _mm256_and_si256(ql0, m4),
            _mm256_and_si256(ql1, m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
        ];
        for (k, &lo) in lows.iter().enumerate() {
            let sh = _mm_cvtsi32_si128(2 * k as i32);
            let hi = _mm256_and_si256(_mm256_srl_epi16(qh, sh), m2);
            let q = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi));
            let y = ld256(&by[Q8_K_QS + 128 * h + 32 * k..]);
            let g = 8 * h + 2 * k;
            let s = _mm256_set_m128i(
                _mm_set1_epi16(bx[Q6_K_SCALES + g + 1] as i8 as i16),
                _mm_set1_epi16(bx[Q6_K_SCALES + g] as i8 as i16),
            );
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), s);
            sumi = _mm256_add_epi32(sumi, p);
        }
    }
    _mm256_sub_epi32(sumi, sub)
}

/// Q6_K x Q8_K in the float order of llama.cpp's tiled VNNI matmul (see `dot::dot_q6k_tiled`):
/// the integer sums of [`dot_q6k`], reduced exactly per super-block, then `r = f32(S)·d_w` and
/// `acc = fma(r, d_x, acc)` as scalar float operations.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q6k_tiled(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (bx, by) in w.chunks_exact(210).zip(a.chunks_exact(292)) {
        let s = hsum_i32x8(q6k_isums(bx, by));
        let r = s as f32 * h2f(bx, Q6_K_D);
        acc = r.mul_add(rd_f32(by, 0), acc);
    }
    acc
}

/// Q2_K x Q8_K: 2-bit q (unsigned) times scale per 16; the mins (high nibbles of the scale bytes)
/// times bsums go into the same 8 f32 lanes first, scaled by −dmin_w·d_x (llama.cpp's layout).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q2k(w: &[u8], a: &[u8]) -> f32 {
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0f);
    let mut acc = _mm256_setzero_ps();
    for (bx, by) in w.chunks_exact(84).zip(a.chunks_exact(292)) {
        let dy = rd_f32(by, 0);
        let d = dy * h2f(bx, Q2_K_D);
        let dmin = -dy * h2f(bx, Q2_K_D + 2);
        let sc = ld128(bx);
        let mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sc), m4));
        let prod = _mm256_madd_epi16(mins, ld256(&by[Q8_K_BSUMS..]));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), acc);
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            let q2 = ld256(&bx[Q2_K_QS + 32 * h..]);
            for j in 0..4 {
                let q = _mm256_and_si256(_mm256_srl_epi16(q2, _mm_cvtsi32_si128(2 * j as i32)), m3);
                let y = ld256(&by[Q8_K_QS + 128 * h + 32 * j..]);
                let g = 8 * h + 2 * j;
                let s = _mm256_set_m128i(
                    _mm_set1_epi16((bx[g + 1] & 15) as i16),
                    _mm_set1_epi16((bx[g] & 15) as i16),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), s));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum8(acc)
}

/// Q3_K x Q8_K: q = low2 − 4·(high bit clear), formed as maddubs(low2, y) − maddubs(4·!h, y),
/// times the 6-bit scale (minus 32) per 16 elements.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q3k(w: &[u8], a: &[u8]) -> f32 {
    let m3 = _mm256_set1_epi8(3);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    for (bx, by) in w.chunks_exact(110).zip(a.chunks_exact(292)) {
        let d = rd_f32(by, 0) * h2f(bx, Q3_K_D);
        let sc = q3k_scales(&bx[Q3_K_SCALES..Q3_K_SCALES + 12]);
        let hm = ld256(bx);
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            let q3 = ld256(&bx[Q3_K_QS + 32 * h..]);
            for j in 0..4 {
                let low =
                    _mm256_and_si256(_mm256_srl_epi16(q3, _mm_cvtsi32_si128(2 * j as i32)), m3);
                let bit = _mm_cvtsi32_si128((4 * h + j) as i32);
                let set = _mm256_and_si256(_mm256_srl_epi16(hm, bit), one);
                let h4 = _mm256_slli_epi16::<2>(_mm256_xor_si256(set, one));
                let y = ld256(&by[Q8_K_QS + 128 * h + 32 * j..]);
                let p = _mm256_sub_epi16(_mm256_maddubs_epi16(low, y), _mm256_maddubs_epi16(h4, y));
                let g = 8 * h + 2 * j;
                let s = _mm256_set_m128i(
                    _mm_set1_epi16(sc[g + 1] as i16),
                    _mm_set1_epi16(sc[g] as i16),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum8(acc)
}
