//! `expf` with the bits of glibc's (the one llama.cpp's attention calls on Linux), in plain Rust
//! and sixteen or eight lanes at a time.
//!
//! glibc computes `exp(x)` in double precision: `x·32/ln2 = k + r` (k rounded to an integer by
//! adding 1.5·2^52), `2^(k/32)` from a 32-entry table with `k / 32` added to its exponent, and a
//! cubic in `r` for `2^(r/32)`; then one rounding to f32. Its x86-64 build with FMA (the one the
//! dynamic loader picks on any CPU with FMA) fuses four of those products with their sums; the
//! functions here do the same operations in the same order, so they return the same bits
//! for every input (checked against the C library over all 2^32 inputs by
//! `tests::equals_the_c_library_everywhere`, ignored by default; a sample runs in CI). The
//! attention kernels call them, SIMD and portable alike, so their softmax factors agree bit for
//! bit with each other on every platform, and with llama.cpp's on glibc.

/// `32 / ln 2`.
const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe);
/// `1.5·2^52`: adding it rounds to an integer held in the low mantissa bits.
const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);
/// The cubic's coefficients for `2^(r/32)`: `C0·r³ + C1·r² + C2·r + 1`.
const C0: f64 = f64::from_bits(0x3ebc_6af8_4b91_2394);
const C1: f64 = f64::from_bits(0x3f2e_bfce_50fa_c4f3);
const C2: f64 = f64::from_bits(0x3f96_2e42_ff0c_52d6);
/// `bits(2^(i/32)) - (i << 47)`: adding `k << 47` then puts `k / 32` in the exponent.
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// Bits 20..31 of `|x|` above which `x` takes [`special`]'s path (|x| >= 88, inf, NaN).
const ABSTOP_MAX: u32 = 0x42a;

/// `e^x`, bit for bit as glibc's `expf`.
#[inline]
pub fn expf(x: f32) -> f32 {
    if (x.to_bits() >> 20) & 0x7ff > ABSTOP_MAX {
        if let Some(y) = special(x) {
            return y;
        }
    }
    let xd = x as f64;
    let kd_shifted = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd_shifted.to_bits();
    let kd = kd_shifted - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(TABLE[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = r.mul_add(C0, C1);
    let r2 = r * r;
    let y = r.mul_add(C2, 1.0);
    (z.mul_add(r2, y) * s) as f32
}

/// glibc's results for |x| >= 88 and non-finite x; `None` where the main path applies.
#[inline(never)]
fn special(x: f32) -> Option<f32> {
    let bits = x.to_bits();
    if bits == f32::NEG_INFINITY.to_bits() {
        Some(0.0)
    } else if (bits >> 20) & 0x7ff >= 0x7f8 {
        Some(x + x)
    } else if x > f32::from_bits(0x42b1_7217) {
        // above ln(2^128): overflow
        Some(f32::INFINITY)
    } else if x < f32::from_bits(0xc2cf_f1b4) {
        // below ln(2^-150): underflow to zero
        Some(0.0)
    } else if x < f32::from_bits(0xc2ce_8ecf) {
        // below ln(2^-149): the smallest subnormal
        Some(f32::from_bits(1))
    } else {
        None
    }
}

/// `x[i] = expf(x[i])` for every element, sixteen or eight at a time where the CPU allows.
pub fn expf_slice(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        if f.avx512f && f.x86_simd() {
            // SAFETY: the CPU has AVX-512F, and AVX2/FMA/F16C (`x86_simd`).
            unsafe { expf_slice_avx512(x) };
            return;
        }
        if f.x86_simd() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { expf_slice_avx2(x) };
            return;
        }
    }
    for v in x.iter_mut() {
        *v = expf(*v);
    }
}

/// [`expf_slice`] by 16-lane vectors ([`expf16`]), the tail by [`expf`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn expf_slice_avx512(x: &mut [f32]) {
    use core::arch::x86_64::*;
    // SAFETY: the chunk holds 16 f32 (unaligned load and store).
    by_chunks::<16>(x, |c| unsafe {
        _mm512_storeu_ps(c.as_mut_ptr(), expf16(_mm512_loadu_ps(c.as_ptr())))
    });
}

/// [`expf_slice`] by 8-lane vectors ([`expf8`]), the tail by [`expf`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn expf_slice_avx2(x: &mut [f32]) {
    use core::arch::x86_64::*;
    // SAFETY: the chunk holds 8 f32 (unaligned load and store).
    by_chunks::<8>(x, |c| unsafe {
        _mm256_storeu_ps(c.as_mut_ptr(), expf8(_mm256_loadu_ps(c.as_ptr())))
    });
}

/// Runs `chunk` over the whole L-element chunks of `x` and [`expf`] over the rest.
#[inline(always)]
fn by_chunks<const L: usize>(x: &mut [f32], mut chunk: impl FnMut(&mut [f32])) {
    let mut chunks = x.chunks_exact_mut(L);
    for c in &mut chunks {
        chunk(c);
    }
    for v in chunks.into_remainder() {
        *v = expf(*v);
    }
}

/// `ys[i] = expf(xs[i])` for the lanes set in `odd` (those the vector path leaves to
/// [`special`]).
#[cfg(target_arch = "x86_64")]
fn redo_lanes(xs: &[f32], ys: &mut [f32], odd: u32) {
    for (i, (y, &x)) in ys.iter_mut().zip(xs).enumerate() {
        if odd & (1 << i) != 0 {
            *y = expf(x);
        }
    }
}

/// [`expf`] of 16 lanes (AVX-512F): the main path in two halves of eight doubles, then any lane
/// with |x| >= 88 or not finite redone by [`expf`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) fn expf16(x: core::arch::x86_64::__m512) -> core::arch::x86_64::__m512 {
    use core::arch::x86_64::*;
    let tab: [__m512i; 4] = core::array::from_fn(|q| {
        // SAFETY: TABLE holds 32 u64, so entries 8q..8q+8 are in bounds.
        unsafe { _mm512_loadu_si512(TABLE.as_ptr().add(8 * q) as *const _) }
    });
    let half = |xd: __m512d| -> __m256 {
        let kd_shifted = _mm512_fmadd_pd(_mm512_set1_pd(INV_LN2_N), xd, _mm512_set1_pd(SHIFT));
        let ki = _mm512_castpd_si512(kd_shifted);
        let kd = _mm512_sub_pd(kd_shifted, _mm512_set1_pd(SHIFT));
        let r = _mm512_fmsub_pd(_mm512_set1_pd(INV_LN2_N), xd, kd);
        // TABLE[ki % 32]: entries 0..16 and 16..32 by index bits 0..4, bit 4 choosing.
        let t_lo = _mm512_permutex2var_epi64(tab[0], ki, tab[1]);
        let t_hi = _mm512_permutex2var_epi64(tab[2], ki, tab[3]);
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, t_lo, t_hi);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let z = _mm512_fmadd_pd(r, _mm512_set1_pd(C0), _mm512_set1_pd(C1));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, _mm512_set1_pd(C2), _mm512_set1_pd(1.0));
        let y = _mm512_mul_pd(_mm512_fmadd_pd(z, r2, y), s);
        _mm512_cvtpd_ps(y)
    };
    let lo = half(_mm512_cvtps_pd(_mm512_castps512_ps256(x)));
    let hi = half(_mm512_cvtps_pd(_mm256_castpd_ps(
        _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)),
    )));
    let y = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castps_pd(_mm512_castps256_ps512(lo)),
        _mm256_castps_pd(hi),
    ));
    let abstop = _mm512_and_si512(
        _mm512_srli_epi32::<20>(_mm512_castps_si512(x)),
        _mm512_set1_epi32(0x7ff),
    );
    let odd = _mm512_cmpgt_epi32_mask(abstop, _mm512_set1_epi32(ABSTOP_MAX as i32));
    if odd == 0 {
        return y;
    }
    let mut xs = [0f32; 16];
    let mut ys = [0f32; 16];
    // SAFETY: both arrays hold 16 f32.
    unsafe {
        _mm512_storeu_ps(xs.as_mut_ptr(), x);
        _mm512_storeu_ps(ys.as_mut_ptr(), y);
    }
    redo_lanes(&xs, &mut ys, odd as u32);
    // SAFETY: `ys` holds 16 f32.
    unsafe { _mm512_loadu_ps(ys.as_ptr()) }
}

/// [`expf`] of 8 lanes (AVX2 + FMA): the main path in two halves of four doubles, the table
/// entries gathered, then any lane with |x| >= 88 or not finite redone by [`expf`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn expf8(x: core::arch::x86_64::__m256) -> core::arch::x86_64::__m256 {
    use core::arch::x86_64::*;
    let half = |xd: __m256d| -> __m128 {
        let kd_shifted = _mm256_fmadd_pd(_mm256_set1_pd(INV_LN2_N), xd, _mm256_set1_pd(SHIFT));
        let ki = _mm256_castpd_si256(kd_shifted);
        let kd = _mm256_sub_pd(kd_shifted, _mm256_set1_pd(SHIFT));
        let r = _mm256_fmsub_pd(_mm256_set1_pd(INV_LN2_N), xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: every index is below 32, inside TABLE.
        let t = unsafe { _mm256_i64gather_epi64::<8>(TABLE.as_ptr() as *const i64, idx) };
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(r, _mm256_set1_pd(C0), _mm256_set1_pd(C1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(r, _mm256_set1_pd(C2), _mm256_set1_pd(1.0));
        let y = _mm256_mul_pd(_mm256_fmadd_pd(z, r2, y), s);
        _mm256_cvtpd_ps(y)
    };
    let lo = half(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    let hi = half(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
    let y = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi);
    let abstop = _mm256_and_si256(
        _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
        _mm256_set1_epi32(0x7ff),
    );
    let odd = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(
        abstop,
        _mm256_set1_epi32(ABSTOP_MAX as i32),
    )));
    if odd == 0 {
        return y;
    }
    let mut xs = [0f32; 8];
    let mut ys = [0f32; 8];
    // SAFETY: both arrays hold 8 f32.
    unsafe {
        _mm256_storeu_ps(xs.as_mut_ptr(), x);
        _mm256_storeu_ps(ys.as_mut_ptr(), y);
    }
    redo_lanes(&xs, &mut ys, odd as u32);
    // SAFETY: `ys` holds 8 f32.
    unsafe { _mm256_loadu_ps(ys.as_ptr()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The C library's `expf` (on glibc, the function these reproduce).
    fn libc_expf(x: f32) -> f32 {
        x.exp()
    }

    /// glibc's x86-64 build with FMA, the variant these reproduce (its loader picks it on CPUs
    /// with FMA; elsewhere another variant rounds otherwise, within an ulp).
    fn on_glibc() -> bool {
        #[cfg(all(target_os = "linux", target_env = "gnu", target_arch = "x86_64"))]
        {
            crate::cpu::features().x86_simd()
        }
        #[cfg(not(all(target_os = "linux", target_env = "gnu", target_arch = "x86_64")))]
        false
    }

    /// Our three versions over `xs`: the scalar one always, the vector ones where this CPU has
    /// them; each must give the scalar one's bits. Returns the scalar results.
    fn all_versions(xs: &[f32]) -> Vec<f32> {
        let scalar: Vec<f32> = xs.iter().map(|&x| expf(x)).collect();
        #[cfg(target_arch = "x86_64")]
        {
            let f = crate::cpu::features();
            let mut runs: Vec<(&str, Vec<f32>)> = Vec::new();
            if f.avx512f && f.x86_simd() {
                let mut v = xs.to_vec();
                // SAFETY: the CPU has AVX-512F, AVX2 and FMA.
                unsafe { expf_slice_avx512(&mut v) };
                runs.push(("avx512", v));
            }
            if f.x86_simd() {
                let mut v = xs.to_vec();
                // SAFETY: the CPU has AVX2 and FMA.
                unsafe { expf_slice_avx2(&mut v) };
                runs.push(("avx2", v));
            }
            for (name, v) in runs {
                for ((x, a), b) in xs.iter().zip(&v).zip(&scalar) {
                    assert!(
                        a.to_bits() == b.to_bits(),
                        "{name}: expf({x:e}) = {a:e}, scalar {b:e}"
                    );
                }
            }
        }
        scalar
    }

    /// Random inputs over the whole range softmax uses and beyond (fresh each run), the edges
    /// of every special case, and non-finite values: the vector versions equal the scalar one,
    /// which is within 1 ulp of the C library everywhere and equal to it on glibc.
    #[test]
    fn equals_the_c_library() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            | 1;
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut xs: Vec<f32> = (0..1 << 20)
            .map(|i| match i % 4 {
                // any bit pattern (NaNs, infinities, subnormals included)
                0 => f32::from_bits(next() as u32),
                // softmax arguments: (-110, 0]
                1 => -((next() >> 40) as f32 / (1u64 << 24) as f32) * 110.0,
                // around the overflow and underflow edges
                2 => f32::from_bits(0x42b1_7217u32.wrapping_add((next() % 64) as u32 - 32)),
                _ => -f32::from_bits(0x42cf_f1b4u32.wrapping_add((next() % 2048) as u32 - 1024)),
            })
            .collect();
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            88.0,
            -88.0,
            f32::from_bits(0x42b1_7217),
            f32::from_bits(0xc2cf_f1b4),
            f32::from_bits(0xc2ce_8ecf),
        ]);
        let ours = all_versions(&xs);
        for (&x, &y) in xs.iter().zip(&ours) {
            let c = libc_expf(x);
            if on_glibc() {
                assert!(
                    y.to_bits() == c.to_bits() || (y.is_nan() && c.is_nan()),
                    "expf({x:e}) = {y:e}, glibc {c:e} (seed {seed:#x})"
                );
            } else {
                let ulps = (y.to_bits() as i64 - c.to_bits() as i64).abs();
                assert!(
                    ulps <= 1 || (y.is_nan() && c.is_nan()),
                    "expf({x:e}) = {y:e}, libm {c:e} (seed {seed:#x})"
                );
            }
        }
    }

    /// Every one of the 2^32 inputs against the C library (about a minute in release):
    /// `cargo test --release -p ferrum-kernels expf -- --ignored`.
    #[test]
    #[ignore]
    fn equals_the_c_library_everywhere() {
        assert!(on_glibc(), "the exhaustive check compares against glibc");
        let step = 1u64 << 24;
        let mut xs = vec![0f32; step as usize];
        for start in (0..1u64 << 32).step_by(step as usize) {
            for (i, x) in xs.iter_mut().enumerate() {
                *x = f32::from_bits((start + i as u64) as u32);
            }
            let ours = all_versions(&xs);
            for (&x, &y) in xs.iter().zip(&ours) {
                let c = libc_expf(x);
                assert!(
                    y.to_bits() == c.to_bits() || (y.is_nan() && c.is_nan()),
                    "expf({x:e} = {:#x}) = {y:e}, glibc {c:e}",
                    x.to_bits()
                );
            }
        }
    }
}
