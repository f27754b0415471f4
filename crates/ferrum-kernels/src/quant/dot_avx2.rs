//! x86_64 AVX2 + FMA + F16C kernels. Only reached after [`super::isa`] detected those features;
//! every kernel is a safe `#[target_feature]` function whose loads go through bounds-checked
//! helpers, so the only `unsafe` is the raw load itself and the call from the dispatcher.
//!
//! Integer partial sums are exact (the same integers as the scalar reference); float
//! accumulation uses 8 f32 lanes and FMA, in the lane layout of llama.cpp's AVX2 kernels
//! (`arch/x86/quants.c`, `vec.h`), so results match an AVX2 build of ggml bit for bit
//! (tests/quant_ggml.rs), and the scalar reference within a few ulps of the row's magnitude.

use super::blocks::*;
use super::dot_avx2_k;
use super::quantize_avx2;
use core::arch::x86_64::*;
use ferrum_core::DType;

/// AVX2 dot product, or `None` when this weight type has no AVX2 kernel.
/// Lengths were checked by the caller.
pub(crate) fn vec_dot(weight: DType, w: &[u8], a: &[u8], n: usize) -> Option<f32> {
    debug_assert!(super::isa() == super::Isa::Avx2);
    // SAFETY: the dispatcher only calls this after `isa()` detected AVX2, FMA and F16C at run
    // time, which are the features every kernel below is compiled for.
    unsafe {
        Some(match weight {
            DType::Q4_0 => dot_q4_0(w, a),
            DType::Q5_0 => dot_q5_0(w, a),
            DType::Q8_0 => dot_q8_0(w, a),
            DType::Q4_1 => dot_q4_1(w, a),
            DType::Q5_1 => dot_q5_1(w, a),
            DType::Q2_K => dot_avx2_k::dot_q2k(w, a),
            DType::Q3_K => dot_avx2_k::dot_q3k(w, a),
            DType::Q4_K => dot_avx2_k::dot_q4k(w, a),
            DType::Q5_K => dot_avx2_k::dot_q5k(w, a),
            DType::Q6_K => dot_avx2_k::dot_q6k(w, a),
            DType::IQ4_NL => dot_iq4nl(w, a),
            DType::IQ4_XS => dot_iq4xs(w, a),
            DType::F16 => dot_f16(w, a, n),
            DType::F32 => dot_f32(w, a, n),
            DType::BF16 => dot_bf16(w, a, n),
            _ => return None,
        })
    }
}

/// AVX2 activation quantizer; returns false when `dtype` has none (the caller falls back to
/// scalar). Lengths were checked by the caller. Output bytes equal the scalar quantizer's.
pub(crate) fn quantize(dtype: DType, src: &[f32], dst: &mut [u8]) -> bool {
    // SAFETY: as in `vec_dot`, only called after run-time detection of AVX2/FMA/F16C.
    unsafe {
        match dtype {
            DType::Q8_0 => quantize_avx2::quantize_q8_0(src, dst, false),
            DType::Q8_1 => quantize_avx2::quantize_q8_0(src, dst, true),
            DType::Q8_K => quantize_avx2::quantize_q8_k(src, dst),
            _ => return false,
        }
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// binary16 at `b[off..off + 2]` to f32 (exact), with F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn h2f(b: &[u8], off: usize) -> f32 {
    let bits = u16::from_le_bytes([b[off], b[off + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Unaligned load of the first 32 bytes of `b` (panics if shorter).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn ld256(b: &[u8]) -> __m256i {
    let b: &[u8; 32] = b[..32].try_into().unwrap();
    // SAFETY: `b` is exactly 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
}

/// Unaligned load of the first 16 bytes of `b` (panics if shorter).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn ld128(b: &[u8]) -> __m128i {
    let b: &[u8; 16] = b[..16].try_into().unwrap();
    // SAFETY: `b` is exactly 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) }
}

/// 8 f32 from the first 32 bytes of `b` (little-endian).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_f32x8(b: &[u8]) -> __m256 {
    _mm256_castsi256_ps(ld256(b))
}

/// 8 f32 from 8 binary16 in the first 16 bytes of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_f16x8(b: &[u8]) -> __m256 {
    _mm256_cvtph_ps(ld128(b))
}

/// 8 f32 from 8 bf16 in the first 16 bytes of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_bf16x8(b: &[u8]) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(b))))
}

/// 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15) then high nibbles (16..31).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles32(qs: &[u8]) -> __m256i {
    let x = ld128(qs);
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(x, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), m);
    _mm256_set_m128i(hi, lo)
}

/// The 32 bits of `qh` -> 32 bytes, 0xFF where bit i is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bits_to_bytes(qh: u32) -> __m256i {
    let v = _mm256_set1_epi32(qh as i32);
    // Byte i takes byte i/8 of qh (the shuffle works per 128-bit lane; both hold qh).
    let pick = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let v = _mm256_and_si256(_mm256_shuffle_epi8(v, pick), bit);
    _mm256_cmpeq_epi8(v, bit)
}

/// Σ of products of signed bytes, 4 consecutive products per i32 lane, as f32.
/// `y` must not contain -128 (activation quants are in [-127, 127]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_i8_pairs(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// Σ of products of unsigned `x` (≤ 127) with signed `y`, 4 per i32 lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_u8_i8_pairs(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// Horizontal sum of 8 f32 (llama.cpp's `hsum_float_8` order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum8(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Horizontal sum of 8 i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_i32x8(x: __m256i) -> i32 {
    let r = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256::<1>(x));
    let r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
    let r = _mm_add_epi32(r, _mm_shuffle_epi32::<0b10_11_00_01>(r));
    _mm_cvtsi128_si32(r)
}

// ---------------------------------------------------------------------------------------------
// "_0" weights x Q8_0: acc += (d_w·d_x) · Σ qw·qx, per block.

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_x_q8_0(w: &[u8], a: &[u8], bw: usize, unpack: impl Fn(&[u8]) -> __m256i) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (bx, by) in w.chunks_exact(bw).zip(a.chunks_exact(34)) {
        let d = _mm256_set1_ps(h2f(bx, 0) * h2f(by, 0));
        let q = _mm256_cvtepi32_ps(sum_i8_pairs(unpack(bx), ld256(&by[Q8_0_QS..])));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum8(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_0(w: &[u8], a: &[u8]) -> f32 {
    dot_x_q8_0(w, a, 18, |bx| {
        _mm256_sub_epi8(nibbles32(&bx[Q4_0_QS..]), _mm256_set1_epi8(8))
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5_0(w: &[u8], a: &[u8]) -> f32 {
    dot_x_q8_0(w, a, 22, |bx| {
        // q - 16 = nibble | 0xF0 (as i8) where the 5th bit is clear, nibble where it is set.
        let high = _mm256_andnot_si256(
            bits_to_bytes(rd_u32(bx, Q5_0_QH)),
            _mm256_set1_epi8(0xf0u8 as i8),
        );
        _mm256_or_si256(nibbles32(&bx[Q5_0_QS..]), high)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0(w: &[u8], a: &[u8]) -> f32 {
    dot_x_q8_0(w, a, 34, |bx| ld256(&bx[Q8_0_QS..]))
}

// IQ4_NL x Q8_0 and IQ4_XS x Q8_K (llama.cpp's AVX2 `ggml_vec_dot_iq4_nl_q8_0` /
// `ggml_vec_dot_iq4_xs_q8_K`): the 4-bit indices become table values by a byte shuffle.

/// 16 bytes of IQ4 index pairs -> the 32 table values (low nibbles, then high nibbles).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_values32(table: __m128i, qs: &[u8]) -> __m256i {
    let x = ld128(qs);
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_shuffle_epi8(table, _mm_and_si128(x, m));
    let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(x), m));
    _mm256_set_m128i(hi, lo)
}

/// The IQ4 table as a vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_table() -> __m128i {
    ld128(&KVALUES_IQ4NL.map(|v| v as u8))
}

/// Blocks in pairs into two accumulators (even, odd), `hsum8(acc1 + acc2)`, then a last unpaired
/// block as a scalar multiply-add.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_iq4nl(w: &[u8], a: &[u8]) -> f32 {
    let table = iq4_table();
    let nb = w.len() / 18;
    let block = |ib: usize| {
        let (bx, by) = (&w[18 * ib..18 * ib + 18], &a[34 * ib..34 * ib + 34]);
        let p = sum_i8_pairs(iq4_values32(table, &bx[IQ4_NL_QS..]), ld256(&by[Q8_0_QS..]));
        (h2f(by, 0) * h2f(bx, 0), p)
    };
    let (mut acc1, mut acc2) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut ib = 0;
    while ib + 1 < nb {
        let (d, p) = block(ib);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc1);
        let (d, p) = block(ib + 1);
        acc2 = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc2);
        ib += 2;
    }
    let mut sumf = hsum8(_mm256_add_ps(acc1, acc2));
    if ib < nb {
        let (d, p) = block(ib);
        sumf += d * hsum_i32x8(p) as f32;
    }
    sumf
}

/// Per super-block the eight groups' lanes, each times its scale, summed exactly (pairs of 8-bit
/// products as i16, then `madd` by the group's scale, two groups per step into two sums, as
/// llama.cpp does); one FMA of `d_w·d_x` per super-block; `hsum8`.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_iq4xs(w: &[u8], a: &[u8]) -> f32 {
    let table = iq4_table();
    let mut acc = _mm256_setzero_ps();
    for (bx, by) in w.chunks_exact(136).zip(a.chunks_exact(292)) {
        let sc = iq4xs_scales(bx);
        let (mut s1, mut s2) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for ib in (0..8).step_by(2) {
            let v1 = iq4_values32(table, &bx[IQ4_XS_QS + 16 * ib..]);
            let v2 = iq4_values32(table, &bx[IQ4_XS_QS + 16 * ib + 16..]);
            let y1 = ld256(&by[Q8_K_QS + 32 * ib..]);
            let y2 = ld256(&by[Q8_K_QS + 32 * ib + 32..]);
            // |v|·(y with v's sign), 8-bit pairs summed to i16 (no saturation: |v|, |y| <= 127).
            let p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(v1, v1), _mm256_sign_epi8(y1, v1));
            let p2 = _mm256_maddubs_epi16(_mm256_sign_epi8(v2, v2), _mm256_sign_epi8(y2, v2));
            let l1 = _mm256_set1_epi16(sc[ib] as i16);
            let l2 = _mm256_set1_epi16(sc[ib + 1] as i16);
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, l1));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(p2, l2));
        }
        let d = _mm256_set1_ps(h2f(bx, 0) * rd_f32(by, 0));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(s1, s2)), acc);
    }
    hsum8(acc)
}

// "_1" weights x Q8_1: acc += (d_w·d_x) · Σ qw·qx, plus Σ m_w·s_x kept in a scalar.

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_x_q8_1(w: &[u8], a: &[u8], bw: usize, unpack: impl Fn(&[u8]) -> __m256i) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    for (bx, by) in w.chunks_exact(bw).zip(a.chunks_exact(40)) {
        summs += h2f(bx, 2) * h2f(by, 2);
        let d = _mm256_set1_ps(h2f(bx, 0) * h2f(by, 0));
        let q = _mm256_cvtepi32_ps(sum_u8_i8_pairs(unpack(bx), ld256(&by[Q8_1_QS..])));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum8(acc) + summs
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_1(w: &[u8], a: &[u8]) -> f32 {
    dot_x_q8_1(w, a, 20, |bx| nibbles32(&bx[Q4_1_QS..]))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5_1(w: &[u8], a: &[u8]) -> f32 {
    dot_x_q8_1(w, a, 24, |bx| {
        let high = _mm256_and_si256(bits_to_bytes(rd_u32(bx, Q5_1_QH)), _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles32(&bx[Q5_1_QS..]), high)
    })
}

// ---------------------------------------------------------------------------------------------
// Float weights: 4 accumulators of 8 lanes over steps of 32 elements, reduced as ggml's
// `GGML_F32x8_REDUCE`; the n % 32 leftovers are added afterwards (in f64 for F16/BF16 as ggml).

/// ggml's `GGML_F32x8_REDUCE` of 4 accumulators.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce4(s: [__m256; 4]) -> f32 {
    let s0 = _mm256_add_ps(s[0], s[2]);
    let s1 = _mm256_add_ps(s[1], s[3]);
    let s0 = _mm256_add_ps(s0, s1);
    let t0 = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps::<1>(s0));
    let t1 = _mm_hadd_ps(t0, t0);
    _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16(w: &[u8], a: &[u8], n: usize) -> f32 {
    let np = n & !31;
    let mut s = [_mm256_setzero_ps(); 4];
    for i in (0..np).step_by(32) {
        for (j, sj) in s.iter_mut().enumerate() {
            let o = 2 * (i + 8 * j);
            *sj = _mm256_fmadd_ps(ld_f16x8(&w[o..]), ld_f16x8(&a[o..]), *sj);
        }
    }
    let mut sumf = reduce4(s) as f64;
    for i in np..n {
        sumf += (rd_f16(w, 2 * i) * rd_f16(a, 2 * i)) as f64;
    }
    sumf as f32
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32(w: &[u8], a: &[u8], n: usize) -> f32 {
    let np = n & !31;
    let mut s = [_mm256_setzero_ps(); 4];
    for i in (0..np).step_by(32) {
        for (j, sj) in s.iter_mut().enumerate() {
            let o = 4 * (i + 8 * j);
            *sj = _mm256_fmadd_ps(ld_f32x8(&w[o..]), ld_f32x8(&a[o..]), *sj);
        }
    }
    let mut sumf = reduce4(s);
    for i in np..n {
        sumf += rd_f32(w, 4 * i) * rd_f32(a, 4 * i);
    }
    sumf
}

/// BF16 as ggml's AVX2 `ggml_vec_dot_bf16`: products are exact in f32.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_bf16(w: &[u8], a: &[u8], n: usize) -> f32 {
    let np = n & !31;
    let mut c = [_mm256_setzero_ps(); 4];
    for i in (0..np).step_by(32) {
        for (j, cj) in c.iter_mut().enumerate() {
            let o = 2 * (i + 8 * j);
            *cj = _mm256_add_ps(_mm256_mul_ps(ld_bf16x8(&w[o..]), ld_bf16x8(&a[o..])), *cj);
        }
    }
    let c0 = _mm256_add_ps(_mm256_add_ps(c[0], c[2]), _mm256_add_ps(c[1], c[3]));
    let mut sumf = hsum8(c0) as f64;
    for i in np..n {
        let x = bf16_bits_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]]));
        let y = bf16_bits_to_f32(u16::from_le_bytes([a[2 * i], a[2 * i + 1]]));
        sumf += (x * y) as f64;
    }
    sumf as f32
}
