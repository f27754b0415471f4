//! x86-64 microkernels for [`super`]: AVX-512F (12 x 32, and 8 x 32 for row counts that 8
//! divides better) and AVX2 + FMA (6 x 16). Each keeps its tile of C in registers (24, 16 and 12
//! accumulators) over a packed K block: per step, the B panel's row is loaded once and every A
//! value is broadcast against it.

use std::arch::x86_64::*;

use super::Micro;

/// The AVX-512 kernel with `MR` rows (12 or 8) and 32 columns.
pub struct Avx512<const MR: usize>;

impl<const MR: usize> Micro for Avx512<MR> {
    const MR: usize = MR;
    const NR: usize = 32;
    #[inline]
    unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, acc: bool) {
        // SAFETY: forwarded from the caller (panel sizes, tile extent, AVX-512F present).
        unsafe { tile_avx512::<MR>(kc, a, b, c, ldc, acc) }
    }
}

/// # Safety
/// `a` holds `kc * MR` floats, `b` holds `kc * 32`, `c` addresses an MR x 32 tile with row
/// stride `ldc`, and the CPU supports AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const MR: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    acc: bool,
) {
    let mut t = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..kc {
        // SAFETY: p < kc, so the loads stay inside the panels the caller vouched for.
        unsafe {
            let b0 = _mm512_loadu_ps(b.add(p * 32));
            let b1 = _mm512_loadu_ps(b.add(p * 32 + 16));
            let ap = a.add(p * MR);
            for (r, row) in t.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*ap.add(r));
                row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                row[1] = _mm512_fmadd_ps(av, b1, row[1]);
            }
        }
    }
    for (r, row) in t.iter().enumerate() {
        // SAFETY: r < MR and 32 columns stay inside the tile the caller vouched for.
        unsafe {
            let p = c.add(r * ldc);
            let (mut v0, mut v1) = (row[0], row[1]);
            if acc {
                v0 = _mm512_add_ps(_mm512_loadu_ps(p), v0);
                v1 = _mm512_add_ps(_mm512_loadu_ps(p.add(16)), v1);
            }
            _mm512_storeu_ps(p, v0);
            _mm512_storeu_ps(p.add(16), v1);
        }
    }
}

pub struct Avx2;

impl Micro for Avx2 {
    const MR: usize = 6;
    const NR: usize = 16;
    #[inline]
    unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, acc: bool) {
        // SAFETY: forwarded from the caller (panel sizes, tile extent, AVX2 and FMA present).
        unsafe { tile_avx2(kc, a, b, c, ldc, acc) }
    }
}

/// # Safety
/// `a` holds `kc * 6` floats, `b` holds `kc * 16`, `c` addresses a 6 x 16 tile with row stride
/// `ldc`, and the CPU supports AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, acc: bool) {
    let mut t = [[_mm256_setzero_ps(); 2]; 6];
    for p in 0..kc {
        // SAFETY: p < kc, so the loads stay inside the panels the caller vouched for.
        unsafe {
            let b0 = _mm256_loadu_ps(b.add(p * 16));
            let b1 = _mm256_loadu_ps(b.add(p * 16 + 8));
            let ap = a.add(p * 6);
            for (r, row) in t.iter_mut().enumerate() {
                let av = _mm256_set1_ps(*ap.add(r));
                row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                row[1] = _mm256_fmadd_ps(av, b1, row[1]);
            }
        }
    }
    for (r, row) in t.iter().enumerate() {
        // SAFETY: r < 6 and 16 columns stay inside the tile the caller vouched for.
        unsafe {
            let p = c.add(r * ldc);
            let (mut v0, mut v1) = (row[0], row[1]);
            if acc {
                v0 = _mm256_add_ps(_mm256_loadu_ps(p), v0);
                v1 = _mm256_add_ps(_mm256_loadu_ps(p.add(8)), v1);
            }
            _mm256_storeu_ps(p, v0);
            _mm256_storeu_ps(p.add(8), v1);
        }
    }
}
