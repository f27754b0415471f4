//! x86 kernels of [`super`]: the AVX-512 VNNI `vpdpbusd` tile, the AVX2 `vpmaddwd` tile and the
//! f32 -> u8 quantizers.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Finish, OutPtr};

/// [`super::Layout::Quads`]: columns per panel, rows per tile.
const PANEL: usize = 16;
const MR: usize = 6;
/// [`super::Layout::Pairs`]: columns per panel, rows per tile.
const PANEL8: usize = 8;
const MR8: usize = 6;

/// VNNI: rows `rows` of the column block starting at panel `p0` (`np` panels, at most 4), in
/// tiles of up to `MR` rows.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI must be present; every row in `rows` of `a` must hold `fin.b.kp`
/// readable bytes from `i * lda`; `p0 + np` panels must exist.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn block_vnni(
    a: &[u8],
    lda: usize,
    rows: Range<usize>,
    p0: usize,
    np: usize,
    fin: &Finish,
) {
    let mut i = rows.start;
    while i < rows.end {
        let r = MR.min(rows.end - i);
        // SAFETY: as this function's contract, for rows i..i + r.
        unsafe {
            macro_rules! go {
                ($($R:literal)*) => {
                    match (r, np) {
                        $( ($R, 1) => tile::<$R, 1>(a, lda, i, p0, fin),
                           ($R, 2) => tile::<$R, 2>(a, lda, i, p0, fin),
                           ($R, 3) => tile::<$R, 3>(a, lda, i, p0, fin),
                           ($R, 4) => tile::<$R, 4>(a, lda, i, p0, fin), )*
                        _ => unreachable!("tile {r} x {np}"),
                    }
                };
            }
            go!(1 2 3 4 5 6);
        }
        i += r;
    }
}

/// AVX2: rows `rows` of the column block starting at panel `p0` (`np` panels of 8, at most 2),
/// in tiles of up to `MR8` rows; `a` is A widened to 16 bits, row `i` at `a[i * lda..]`.
///
/// # Safety
/// AVX2 must be present; `fin.b` must be in the `Pairs` layout with `p0 + np` panels; every row
/// in `rows` of `a` must hold `fin.b.kp` values from `i * lda`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn block_avx2(
    a: &[u16],
    lda: usize,
    rows: Range<usize>,
    p0: usize,
    np: usize,
    fin: &Finish,
) {
    let mut i = rows.start;
    while i < rows.end {
        let r = MR8.min(rows.end - i);
        // SAFETY: as this function's contract, for rows i..i + r.
        unsafe {
            macro_rules! go {
                ($($R:literal)*) => {
                    match (r, np) {
                        $( ($R, 1) => tile8::<$R, 1>(a, lda, i, p0, fin),
                           ($R, 2) => tile8::<$R, 2>(a, lda, i, p0, fin), )*
                        _ => unreachable!("tile {r} x {np}"),
                    }
                };
            }
            go!(1 2 3 4 5 6);
        }
        i += r;
    }
}

/// One `R x (P * 8)` AVX2 tile: per pair of k, each row's two 16-bit values broadcast as one
/// i32, `vpmaddwd` against the panel's 8 columns x 2 values, added to the row's accumulators.
///
/// # Safety
/// As [`block_avx2`].
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn tile8<const R: usize, const P: usize>(
    a: &[u16],
    lda: usize,
    i0: usize,
    p0: usize,
    fin: &Finish,
) {
    let b = fin.b;
    let kp = b.kp;
    let pairs = kp / 2;
    let stride = kp * PANEL8;
    assert!(p0 + P <= b.n.div_ceil(PANEL8) && (i0 + R - 1) * lda + kp <= a.len());
    assert!(b.wide.len() >= (p0 + P) * stride);
    let bp = b.wide.as_ptr().add(p0 * stride);
    let ap = a.as_ptr().add(i0 * lda);
    let mut acc = [[_mm256_setzero_si256(); P]; R];
    for g in 0..pairs {
        let mut bv = [_mm256_setzero_si256(); P];
        for (q, v) in bv.iter_mut().enumerate() {
            // SAFETY: panel p0 + q's pair g: 16 values inside `b.wide` (asserted above).
            *v = _mm256_loadu_si256(bp.add(q * stride + g * 16) as *const _);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: row i0 + r's values 2g, 2g + 1, inside `a` (asserted above).
            let av = _mm256_set1_epi32((ap.add(r * lda + 2 * g) as *const i32).read_unaligned());
            for q in 0..P {
                row[q] = _mm256_add_epi32(row[q], _mm256_madd_epi16(av, bv[q]));
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (q, &v) in row.iter().enumerate() {
            let j0 = (p0 + q) * PANEL8;
            if j0 + PANEL8 <= b.n {
                store8(fin, i0 + r, j0, v);
            } else {
                let mut raw = [0i32; PANEL8];
                _mm256_storeu_si256(raw.as_mut_ptr() as *mut _, v);
                fin.store(i0 + r, j0, &raw[..b.n - j0]);
            }
        }
    }
}

/// [`store16`] for 8 columns.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store8(fin: &Finish, i: usize, j0: usize, raw: __m256i) {
    let (rs, za) = fin.row_terms[i];
    let cs = _mm256_loadu_si256(fin.b.col_sums[j0..j0 + PANEL8].as_ptr() as *const _);
    let bt = if fin.b_terms.len() == 1 {
        _mm256_set1_epi32(fin.b_terms[0])
    } else {
        _mm256_loadu_si256(fin.b_terms[j0..j0 + PANEL8].as_ptr() as *const _)
    };
    let v = _mm256_add_epi32(
        _mm256_sub_epi32(raw, _mm256_mullo_epi32(_mm256_set1_epi32(za), cs)),
        _mm256_mullo_epi32(bt, _mm256_set1_epi32(rs)),
    );
    match fin.out {
        OutPtr::I32(p, ld) => {
            // SAFETY: (i, j0..j0 + 8) is in this task's tile (see OutPtr).
            _mm256_storeu_si256(p.add(i * ld + j0) as *mut _, v)
        }
        OutPtr::F32(p, ld) => {
            let s = if fin.scale.len() == 1 {
                _mm256_set1_ps(fin.scale[0])
            } else {
                _mm256_loadu_ps(fin.scale[j0..j0 + PANEL8].as_ptr())
            };
            // Multiply, then add: the unfused chain's two roundings (no FMA).
            let mut y = _mm256_mul_ps(_mm256_cvtepi32_ps(v), s);
            if let Some(bias) = fin.bias {
                y = _mm256_add_ps(y, _mm256_loadu_ps(bias[j0..j0 + PANEL8].as_ptr()));
            }
            // SAFETY: as above.
            _mm256_storeu_ps(p.add(i * ld + j0), y)
        }
        OutPtr::Q8 {
            p,
            rs,
            cs,
            zero,
            signed,
        } => {
            let s = if fin.scale.len() == 1 {
                _mm256_set1_ps(fin.scale[0])
            } else {
                _mm256_loadu_ps(fin.scale[j0..j0 + PANEL8].as_ptr())
            };
            let mut y = _mm256_mul_ps(_mm256_cvtepi32_ps(v), s);
            if let Some(bias) = fin.bias {
                y = _mm256_add_ps(y, _mm256_loadu_ps(bias[j0..j0 + PANEL8].as_ptr()));
            }
            // `min(y, hold)` gives `hold` for a NaN y (the second operand), as f32::min.
            let hold = _mm256_set1_ps(super::Q8_HOLD);
            y = _mm256_max_ps(
                _mm256_min_ps(y, hold),
                _mm256_sub_ps(_mm256_setzero_ps(), hold),
            );
            // Round half to even (the default rounding mode), add the zero point, then narrow
            // with saturation to 16 and 8 bits: the clamp.
            let q = _mm256_add_epi32(_mm256_cvtps_epi32(y), _mm256_set1_epi32(zero));
            let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
            let w = _mm_packs_epi32(lo, hi);
            let bytes = if signed {
                _mm_packs_epi16(w, w)
            } else {
                _mm_packus_epi16(w, w)
            };
            if cs == 1 {
                // SAFETY: (i, j0..j0 + 8) is in this task's tile, bytes i * rs + j0.. (see
                // OutPtr).
                _mm_storel_epi64(p.add(i * rs + j0) as *mut _, bytes);
            } else {
                let mut b = [0u8; 16];
                _mm_storeu_si128(b.as_mut_ptr() as *mut _, bytes);
                for (c, &v) in b[..PANEL8].iter().enumerate() {
                    // SAFETY: as above, element (i, j0 + c).
                    *p.add(i * rs + (j0 + c) * cs) = v;
                }
            }
        }
    }
}

/// One `R x (P * 16)` tile: rows `i0..i0 + R`, panels `p0..p0 + P`, over the whole inner
/// dimension, then finished and stored.
///
/// # Safety
/// As [`block_vnni`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile<const R: usize, const P: usize>(
    a: &[u8],
    lda: usize,
    i0: usize,
    p0: usize,
    fin: &Finish,
) {
    let b = fin.b;
    let groups = b.kp / 4;
    let stride = b.kp * PANEL;
    assert!(p0 + P <= b.n.div_ceil(PANEL) && (i0 + R - 1) * lda + b.kp <= a.len());
    let bp = b.data.as_ptr().add(p0 * stride);
    let ap = a.as_ptr().add(i0 * lda);
    let mut acc = [[_mm512_setzero_si512(); P]; R];
    for g in 0..groups {
        let mut bv = [_mm512_setzero_si512(); P];
        for (q, v) in bv.iter_mut().enumerate() {
            // SAFETY: panel p0 + q's group g: 64 bytes inside `b.data` (asserted above).
            *v = _mm512_loadu_si512(bp.add(q * stride + g * 64) as *const _);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: row i0 + r's bytes 4g..4g + 4, inside `a` (asserted above).
            let av = _mm512_set1_epi32((ap.add(r * lda + 4 * g) as *const i32).read_unaligned());
            for q in 0..P {
                row[q] = _mm512_dpbusd_epi32(row[q], av, bv[q]);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (q, &v) in row.iter().enumerate() {
            let j0 = (p0 + q) * PANEL;
            if j0 + PANEL <= b.n {
                store16(fin, i0 + r, j0, v);
            } else {
                let mut raw = [0i32; PANEL];
                _mm512_storeu_si512(raw.as_mut_ptr() as *mut _, v);
                fin.store(i0 + r, j0, &raw[..b.n - j0]);
            }
        }
    }
}

/// Finishes and stores 16 whole columns `j0..j0 + 16` of row `i` (the vector form of
/// [`Finish::store`], the same operations lane by lane).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn store16(fin: &Finish, i: usize, j0: usize, raw: __m512i) {
    if let OutPtr::Q8 { .. } = fin.out {
        // Requantized outputs take the scalar epilogue.
        let mut r = [0i32; PANEL];
        _mm512_storeu_si512(r.as_mut_ptr() as *mut _, raw);
        fin.store(i, j0, &r);
        return;
    }
    let (rs, za) = fin.row_terms[i];
    let cs = _mm512_loadu_si512(fin.b.col_sums[j0..j0 + PANEL].as_ptr() as *const _);
    let bt = if fin.b_terms.len() == 1 {
        _mm512_set1_epi32(fin.b_terms[0])
    } else {
        _mm512_loadu_si512(fin.b_terms[j0..j0 + PANEL].as_ptr() as *const _)
    };
    let v = _mm512_add_epi32(
        _mm512_sub_epi32(raw, _mm512_mullo_epi32(_mm512_set1_epi32(za), cs)),
        _mm512_mullo_epi32(bt, _mm512_set1_epi32(rs)),
    );
    match fin.out {
        OutPtr::I32(p, ld) => {
            // SAFETY: (i, j0..j0 + 16) is in this task's tile (see OutPtr).
            _mm512_storeu_si512(p.add(i * ld + j0) as *mut _, v)
        }
        OutPtr::F32(p, ld) => {
            let s = if fin.scale.len() == 1 {
                _mm512_set1_ps(fin.scale[0])
            } else {
                _mm512_loadu_ps(fin.scale[j0..j0 + PANEL].as_ptr())
            };
            // Multiply, then add: the unfused chain's two roundings (no FMA).
            let mut y = _mm512_mul_ps(_mm512_cvtepi32_ps(v), s);
            if let Some(bias) = fin.bias {
                y = _mm512_add_ps(y, _mm512_loadu_ps(bias[j0..j0 + PANEL].as_ptr()));
            }
            // SAFETY: as above.
            _mm512_storeu_ps(p.add(i * ld + j0), y)
        }
        OutPtr::Q8 { .. } => unreachable!("handled above"),
    }
}

/// [`super::quantize_u8`] in 16 lanes: the same f32 division, round-half-even, add and clamp.
///
/// # Safety
/// AVX-512 F/BW/VL must be present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_u8_avx512(x: &[f32], scale: f32, zp: f32, out: &mut [u8]) {
    assert_eq!(x.len(), out.len());
    let (s, z) = (_mm512_set1_ps(scale), _mm512_set1_ps(zp));
    let (lo, hi) = (_mm512_setzero_ps(), _mm512_set1_ps(255.0));
    let n16 = x.len() / 16 * 16;
    for i in (0..n16).step_by(16) {
        // SAFETY: i + 16 <= len for both slices.
        let v = _mm512_loadu_ps(x.as_ptr().add(i));
        let q = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_div_ps(v, s),
        );
        // max(., 0) first: it returns 0 for NaN, as the scalar clamp-then-cast does.
        let q = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, z), lo), hi);
        let b = _mm512_cvtusepi32_epi8(_mm512_cvttps_epi32(q));
        _mm_storeu_si128(out.as_mut_ptr().add(i) as *mut _, b);
    }
    super::quantize_u8_portable(&x[n16..], scale, zp, &mut out[n16..]);
}

/// [`super::quantize_u8`] in 8 lanes (AVX2): the same operations as the AVX-512 form.
///
/// # Safety
/// AVX2 must be present.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_u8_avx2(x: &[f32], scale: f32, zp: f32, out: &mut [u8]) {
    assert_eq!(x.len(), out.len());
    let (s, z) = (_mm256_set1_ps(scale), _mm256_set1_ps(zp));
    let (lo, hi) = (_mm256_setzero_ps(), _mm256_set1_ps(255.0));
    let n8 = x.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= len for both slices.
        let v = _mm256_loadu_ps(x.as_ptr().add(i));
        let q = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_div_ps(v, s),
        );
        // max(., 0) first: it returns 0 for NaN (the second operand), as the scalar
        // clamp-then-cast does.
        let q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, z), lo), hi);
        let w = _mm256_cvttps_epi32(q);
        // 8 i32 in 0..=255 -> 8 bytes.
        let p16 = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
        let p8 = _mm_packus_epi16(p16, p16);
        _mm_storel_epi64(out.as_mut_ptr().add(i) as *mut _, p8);
    }
    super::quantize_u8_portable(&x[n8..], scale, zp, &mut out[n8..]);
}
