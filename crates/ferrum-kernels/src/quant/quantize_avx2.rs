//! AVX2 activation quantizers, byte-identical to the scalar ones in `quantize.rs` (same f32
//! operations: max, one division, one multiply per element, round half to even).

use super::blocks::*;
use super::dot_avx2::hsum_i32x8;
use core::arch::x86_64::*;

/// Maximum of 8 f32 (exact in any order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hmax8(x: __m256) -> f32 {
    let r = _mm_max_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_max_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Minimum of 8 f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hmin8(x: __m256) -> f32 {
    let r = _mm_min_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let r = _mm_min_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_min_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// 8 f32 from `x[0..8]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld8(x: &[f32]) -> __m256 {
    let x: &[f32; 8] = x[..8].try_into().unwrap();
    // SAFETY: `x` is exactly 8 readable f32; loadu has no alignment requirement.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

/// round-half-even(v · mul) as i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round_mul(v: __m256, mul: __m256) -> __m256i {
    let r =
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v, mul));
    _mm256_cvtps_epi32(r)
}

/// Packs 4x8 i32 (elements 0..32 in order) into 32 saturated i8 and stores them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pack_store(i: [__m256i; 4], out: &mut [u8]) {
    let p01 = _mm256_packs_epi32(i[0], i[1]);
    let p23 = _mm256_packs_epi32(i[2], i[3]);
    let p = _mm256_packs_epi16(p01, p23);
    // The packs work per 128-bit lane: restore element order.
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let out: &mut [u8; 32] = (&mut out[..32]).try_into().unwrap();
    // SAFETY: `out` is exactly 32 writable bytes; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, p) }
}

/// Q8_0 (34-byte blocks) or, with `with_sum`, Q8_1 (40-byte blocks).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn quantize_q8_0(src: &[f32], dst: &mut [u8], with_sum: bool) {
    let bb = if with_sum { 40 } else { 34 };
    let sign = _mm256_set1_ps(-0.0);
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(bb)) {
        let v = [ld8(&x[0..]), ld8(&x[8..]), ld8(&x[16..]), ld8(&x[24..])];
        let mut m = _mm256_andnot_ps(sign, v[0]);
        for &vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, vi));
        }
        let amax = hmax8(m);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        b[0..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
        let mul = _mm256_set1_ps(id);
        let i = [
            round_mul(v[0], mul),
            round_mul(v[1], mul),
            round_mul(v[2], mul),
            round_mul(v[3], mul),
        ];
        if with_sum {
            let s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let s = d * hsum_i32x8(s) as f32;
            b[2..4].copy_from_slice(&f32_to_f16_bits(s).to_le_bytes());
            pack_store(i, &mut b[Q8_1_QS..]);
            b[Q8_1_QS + QK..].fill(0);
        } else {
            pack_store(i, &mut b[Q8_0_QS..]);
        }
    }
}

/// Q8_K (292-byte blocks), as `quantize_row_q8_K_ref`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(292)) {
        let mut vmax = ld8(x);
        let mut vmin = vmax;
        for j in (8..QK_K).step_by(8) {
            let v = ld8(&x[j..]);
            vmax = _mm256_max_ps(vmax, v);
            vmin = _mm256_min_ps(vmin, v);
        }
        let (hi, lo) = (hmax8(vmax), hmin8(vmin));
        let amax = hi.max(-lo);
        if amax.is_nan() || amax <= 0.0 {
            b.fill(0);
            continue;
        }
        // The signed value of the first element with the largest |x|.
        let max = if hi == amax && -lo != amax {
            hi
        } else if -lo == amax && hi != amax {
            lo
        } else {
            *x.iter().find(|v| v.abs() == amax).unwrap()
        };
        let iscale = -127.0f32 / max;
        let mul = _mm256_set1_ps(iscale);
        let cap = _mm256_set1_epi32(127);
        for c in 0..8 {
            let mut i = [_mm256_setzero_si256(); 4];
            for (k, ik) in i.iter_mut().enumerate() {
                let v = ld8(&x[32 * c + 8 * k..]);
                *ik = _mm256_min_epi32(round_mul(v, mul), cap);
            }
            for g in 0..2 {
                let s = hsum_i32x8(_mm256_add_epi32(i[2 * g], i[2 * g + 1]));
                let off = Q8_K_BSUMS + 2 * (2 * c + g);
                b[off..off + 2].copy_from_slice(&(s as i16).to_le_bytes());
            }
            pack_store(i, &mut b[Q8_K_QS + 32 * c..]);
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}
