//! Activations of the gated feed-forward blocks: SwiGLU (Llama) and GeGLU with tanh GELU (Gemma).

use half::f16;
use std::sync::OnceLock;

/// SiLU, x * sigmoid(x).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044_715;

/// GELU, tanh approximation, computed in f32.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// [`gelu_tanh`] as ggml's x86 build computes it when filling its table: GCC contracts
/// `1 + a·x·x` into one fused multiply-add, `fma(a·x, x, 1)` (changes the f16 result for a few
/// inputs, e.g. x = -1.999).
#[inline]
fn gelu_tanh_ggml(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (GELU_COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// ggml evaluates GELU through a table indexed by the f16 bits of the input, holding f16 results
/// (`GGML_GELU_FP16`); we do the same so Gemma's activations round where llama.cpp's do.
/// The table has one padding entry past index 65535, so a 4-byte gather at any index stays inside.
fn gelu_table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_tanh_ggml(f16::from_bits(bits).to_f32())))
            .chain(std::iter::once(f16::ZERO))
            .collect()
    })
}

/// gelu(x) * u as `ggml_vec_geglu_f32` computes it: +0 (never -0) below -10, x * u above 10,
/// the f16 table in between.
#[inline]
fn geglu_ggml(table: &[f16], x: f32, u: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x * u
    } else {
        table[f16::from_f32(x).to_bits() as usize].to_f32() * u
    }
}

/// exp(x) as ggml's vectorised SiLU computes it (an Arm optimized-routines style approximation,
/// max error ~1.5 ulp): n = round(x log2 e), b = x - n ln2 (two-part constant), a degree-5
/// polynomial for e^b, scaled by 2^n. Each step is one fused multiply-add, as in the SIMD code,
/// so our SwiGLU rounds where llama.cpp's does.
#[inline(always)]
fn expf_ggml(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), SHIFT); // log2(e)
    let n = z - SHIFT;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),
        (-n).mul_add(f32::from_bits(0x3f31_7200), x),
    ); // ln2 lo, hi
    if n.abs() > 192.0 {
        return if n > 0.0 { f32::INFINITY } else { 0.0 };
    }
    let u = b * b;
    // Coefficients c5..c1 of e^b ~ 1 + c1 b + c2 b^2 + ... + c5 b^5.
    let p45 = f32::from_bits(0x3c07_2010).mul_add(b, f32::from_bits(0x3d2b_9f17));
    let p23 = f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb));
    let p01 = f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0);
    let j = p45.mul_add(u, p23).mul_add(u, p01);
    // j * 2^n with one rounding, as the SIMD code's scalef: 2^n in two exact halves, so neither
    // the power (2^128 is not an f32) nor j * 2^(n/2) leaves the normal range (|n| <= 192 here).
    let n = n as i32;
    let (a, b) = (n / 2, n - n / 2);
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    j * pow2(a) * pow2(b)
}

/// Plain version of [`swiglu`] (ggml's order, one element at a time), for tests.
pub fn swiglu_portable(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: lengths differ");
    swiglu_ggml(gate, up)
}

/// SIMD width of ggml's SiLU on AVX-512: elements past the last full block use libm's expf.
const GGML_SILU_BLOCK: usize = 16;

#[inline(always)]
fn swiglu_ggml(gate: &mut [f32], up: &[f32]) {
    let full = gate.len() / GGML_SILU_BLOCK * GGML_SILU_BLOCK;
    for (g, &u) in gate[..full].iter_mut().zip(&up[..full]) {
        *g = (*g / (1.0 + expf_ggml(-*g))) * u;
    }
    for (g, &u) in gate[full..].iter_mut().zip(&up[full..]) {
        *g = silu(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn swiglu_fma(gate: &mut [f32], up: &[f32]) {
    swiglu_ggml(gate, up)
}

/// ggml's AVX-512 SiLU·up, 16 lanes at a time: the same operations as [`expf_ggml`] and
/// [`swiglu_ggml`] (`scalef` multiplies by 2^n with one rounding, as `j * 2^n` does there), so the
/// same bits, without a libm call per element. The tail past a multiple of 16 is left to the caller.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn swiglu_avx512(gate: &mut [f32], up: &[f32]) -> usize {
    use core::arch::x86_64::*;
    let full = gate.len() / GGML_SILU_BLOCK * GGML_SILU_BLOCK;
    let shift = _mm512_set1_ps(12_582_912.0);
    let one = _mm512_set1_ps(1.0);
    for i in (0..full).step_by(16) {
        // SAFETY: i + 16 <= full <= gate.len() == up.len().
        let (g, u) = unsafe {
            (
                _mm512_loadu_ps(gate.as_ptr().add(i)),
                _mm512_loadu_ps(up.as_ptr().add(i)),
            )
        };
        let x = _mm512_sub_ps(_mm512_setzero_ps(), g); // -g, exact
        let z = _mm512_fmadd_ps(x, _mm512_set1_ps(f32::from_bits(0x3fb8_aa3b)), shift);
        let n = _mm512_sub_ps(z, shift);
        let b = _mm512_fnmadd_ps(
            n,
            _mm512_set1_ps(f32::from_bits(0x35bf_be8e)),
            _mm512_fnmadd_ps(n, _mm512_set1_ps(f32::from_bits(0x3f31_7200)), x),
        );
        let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let uu = _mm512_mul_ps(b, b);
        let p45 = _mm512_fmadd_ps(
            _mm512_set1_ps(f32::from_bits(0x3c07_2010)),
            b,
            _mm512_set1_ps(f32::from_bits(0x3d2b_9f17)),
        );
        let p23 = _mm512_fmadd_ps(
            _mm512_set1_ps(f32::from_bits(0x3e2a_af33)),
            b,
            _mm512_set1_ps(f32::from_bits(0x3eff_fedb)),
        );
        let p01 = _mm512_fmadd_ps(_mm512_set1_ps(f32::from_bits(0x3f7f_fff6)), b, one);
        let j = _mm512_fmadd_ps(_mm512_fmadd_ps(p45, uu, p23), uu, p01);
        let e = _mm512_scalef_ps(j, n);
        let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(n, _mm512_setzero_ps());
        let inf_or_zero = _mm512_maskz_mov_ps(pos, _mm512_set1_ps(f32::INFINITY));
        let e = _mm512_mask_blend_ps(big, e, inf_or_zero);
        let r = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(gate.as_mut_ptr().add(i), r) };
    }
    full
}

/// Below this many elements a gated activation runs on the calling thread alone.
const PARALLEL_MIN: usize = 1 << 15;
/// Elements per task of a parallel gated activation (a multiple of [`GGML_SILU_BLOCK`], so
/// every task but the last holds whole blocks and the last one the call's tail).
const PER_TASK: usize = 1 << 14;

/// Runs the element-wise `f` over `gate` and `up`, split across the pool when the call is large
/// (a prompt's activations).
fn gated(gate: &mut [f32], up: &[f32], f: impl Fn(&mut [f32], &[f32]) + Sync) {
    if gate.len() < PARALLEL_MIN {
        return f(gate, up);
    }
    crate::pool::parallel_chunks_mut(gate, PER_TASK, |ci, g| {
        f(g, &up[ci * PER_TASK..][..g.len()])
    });
}

/// `gate[i] = silu(gate[i]) * up[i]`, SiLU computed as ggml's vector code does.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: lengths differ");
    gated(gate, up, swiglu_serial);
}

fn swiglu_serial(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::features().avx512f {
        // SAFETY: the CPU reports AVX-512F (and so FMA).
        let done = unsafe { swiglu_avx512(gate, up) };
        for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
            *g = silu(*g) * u;
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::features().x86_simd() {
        // SAFETY: the CPU reports AVX2, FMA and F16C.
        let done = unsafe { swiglu_avx2(gate, up) };
        for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
            *g = silu(*g) * u;
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::features().fma {
        // SAFETY: the CPU reports FMA.
        unsafe { swiglu_fma(gate, up) };
        return;
    }
    swiglu_ggml(gate, up);
}

/// [`swiglu_avx512`] in 8 lanes: [`expf_ggml`]'s operations, its `j * 2^a * 2^b` as two
/// multiplies by powers of two made from the exponent bits. Does the same leading elements (the
/// whole 16-element blocks, ggml's AVX-512 SIMD width) and leaves the tail to the caller.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_avx2(gate: &mut [f32], up: &[f32]) -> usize {
    use core::arch::x86_64::*;
    let full = gate.len() / GGML_SILU_BLOCK * GGML_SILU_BLOCK;
    let shift = _mm256_set1_ps(12_582_912.0);
    let one = _mm256_set1_ps(1.0);
    let bias = _mm256_set1_epi32(127);
    let pow2 = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(e, bias)));
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= full <= gate.len() == up.len().
        let (g, u) = unsafe {
            (
                _mm256_loadu_ps(gate.as_ptr().add(i)),
                _mm256_loadu_ps(up.as_ptr().add(i)),
            )
        };
        let x = _mm256_sub_ps(_mm256_setzero_ps(), g); // -g, exact
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3fb8_aa3b)), shift);
        let n = _mm256_sub_ps(z, shift);
        let b = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(f32::from_bits(0x35bf_be8e)),
            _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3f31_7200)), x),
        );
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let big = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
        let uu = _mm256_mul_ps(b, b);
        let p45 = _mm256_fmadd_ps(
            _mm256_set1_ps(f32::from_bits(0x3c07_2010)),
            b,
            _mm256_set1_ps(f32::from_bits(0x3d2b_9f17)),
        );
        let p23 = _mm256_fmadd_ps(
            _mm256_set1_ps(f32::from_bits(0x3e2a_af33)),
            b,
            _mm256_set1_ps(f32::from_bits(0x3eff_fedb)),
        );
        let p01 = _mm256_fmadd_ps(_mm256_set1_ps(f32::from_bits(0x3f7f_fff6)), b, one);
        let j = _mm256_fmadd_ps(_mm256_fmadd_ps(p45, uu, p23), uu, p01);
        // n / 2 rounded toward zero (as the scalar code's integer division), and the rest; both
        // within ±96 where |n| <= 192, so 2^a and 2^b are normal. Lanes with |n| > 192 are
        // replaced below whatever these give.
        let ni = _mm256_cvtps_epi32(n);
        let a = _mm256_srai_epi32::<1>(_mm256_add_epi32(ni, _mm256_srli_epi32::<31>(ni)));
        let rest = _mm256_sub_epi32(ni, a);
        let e = _mm256_mul_ps(_mm256_mul_ps(j, pow2(a)), pow2(rest));
        let pos = _mm256_cmp_ps::<_CMP_GT_OQ>(n, _mm256_setzero_ps());
        let inf_or_zero = _mm256_and_ps(pos, _mm256_set1_ps(f32::INFINITY));
        let e = _mm256_blendv_ps(e, inf_or_zero, big);
        let r = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(gate.as_mut_ptr().add(i), r) };
    }
    full
}

/// `gate[i] = gelu(gate[i]) * up[i]`, GELU as ggml tabulates it.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "geglu: lengths differ");
    gated(gate, up, geglu_serial);
}

fn geglu_serial(gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::features().avx512f && crate::cpu::features().f16c {
        // SAFETY: the CPU reports AVX-512F and F16C; the table has 65537 entries.
        done = unsafe { geglu_avx512(table, gate, up) };
    } else if crate::cpu::features().x86_simd() {
        // SAFETY: the CPU reports AVX2, FMA and F16C; the table has 65537 entries.
        done = unsafe { geglu_avx2(table, gate, up) };
    }
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        *g = geglu_ggml(table, *g, u);
    }
}

/// Plain version of [`geglu`] (one element at a time), for tests.
pub fn geglu_portable(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "geglu: lengths differ");
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = geglu_ggml(table, *g, u);
    }
}

/// [`geglu_ggml`] 16 lanes at a time: f16 bits of x by `vcvtps2ph` (round to nearest even, as
/// `f16::from_f32`), the table read by a gather, the same branches as blends. Returns how many
/// leading elements it did (a multiple of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn geglu_avx512(table: &[f16], gate: &mut [f32], up: &[f32]) -> usize {
    use core::arch::x86_64::*;
    assert!(table.len() > u16::MAX as usize + 1);
    let full = gate.len() / 16 * 16;
    let lo = _mm512_set1_ps(-10.0);
    let hi = _mm512_set1_ps(10.0);
    for i in (0..full).step_by(16) {
        // SAFETY: i + 16 <= full <= gate.len() == up.len(); the gather reads 4 bytes at
        // 2 * index for indices <= 65535, inside the padded table.
        unsafe {
            let x = _mm512_loadu_ps(gate.as_ptr().add(i));
            let u = _mm512_loadu_ps(up.as_ptr().add(i));
            let bits = _mm512_cvtepu16_epi32(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
            let raw = _mm512_i32gather_epi32::<2>(bits, table.as_ptr() as *const i32);
            let g = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
            let mut r = _mm512_mul_ps(g, u);
            let big = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, hi);
            r = _mm512_mask_blend_ps(big, r, _mm512_mul_ps(x, u));
            let small = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(x, lo);
            r = _mm512_mask_blend_ps(small, r, _mm512_setzero_ps());
            _mm512_storeu_ps(gate.as_mut_ptr().add(i), r);
        }
    }
    full
}

/// [`geglu_avx512`] 8 lanes at a time, for the AVX2 tier (an AVX2 gather of the table's
/// halves, packed to 8 f16 and widened by F16C). Returns how many leading elements it did (a
/// multiple of 8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn geglu_avx2(table: &[f16], gate: &mut [f32], up: &[f32]) -> usize {
    use core::arch::x86_64::*;
    assert!(table.len() > u16::MAX as usize + 1);
    let full = gate.len() / 8 * 8;
    let lo = _mm256_set1_ps(-10.0);
    let hi = _mm256_set1_ps(10.0);
    let low16 = _mm256_set1_epi32(0xffff);
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= full <= gate.len() == up.len(); the gather reads 4 bytes at
        // 2 * index for indices <= 65535, inside the padded table.
        unsafe {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let bits = _mm256_cvtepu16_epi32(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
            let raw = _mm256_i32gather_epi32::<2>(table.as_ptr() as *const i32, bits);
            let raw = _mm256_and_si256(raw, low16);
            let h = _mm_packus_epi32(
                _mm256_castsi256_si128(raw),
                _mm256_extracti128_si256::<1>(raw),
            );
            let g = _mm256_cvtph_ps(h);
            let mut r = _mm256_mul_ps(g, u);
            r = _mm256_blendv_ps(r, _mm256_mul_ps(x, u), _mm256_cmp_ps::<_CMP_GE_OQ>(x, hi));
            r = _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LE_OQ>(x, lo));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), r);
        }
    }
    full
}

/// gpt-oss's clamped SwiGLU, as ggml's `swiglu_oai` computes it (a scalar loop with libm's
/// `expf`): with x = min(gate, limit) and y = clamp(up, -limit, limit),
/// `gate[i] = x / (1 + exp(-alpha x)) * (y + 1)`. gpt-oss uses alpha 1.702 and limit 7.
pub fn swiglu_oai(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    assert_eq!(gate.len(), up.len(), "swiglu_oai: lengths differ");
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = if limit < *g { limit } else { *g };
        let y = u.clamp(-limit, limit);
        let glu = x / (1.0 + (alpha * (-x)).exp());
        *g = glu * (y + 1.0);
    }
}

#[cfg(test)]
mod swiglu_oai_tests {
    use super::*;

    /// Against the formula in f64 on fresh random inputs, including values past the clamps.
    #[test]
    fn matches_f64() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n = 4096;
        let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-12.0..12.0)).collect();
        let u: Vec<f32> = (0..n).map(|_| rng.gen_range(-12.0..12.0)).collect();
        let mut out = g.clone();
        swiglu_oai(&mut out, &u, 1.702, 7.0);
        for ((&x, &y), &got) in g.iter().zip(&u).zip(&out) {
            let (x, y) = ((x as f64).min(7.0), (y as f64).clamp(-7.0, 7.0));
            let want = x / (1.0 + (-1.702 * x).exp()) * (y + 1.0);
            assert!(
                got.is_finite() && (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "seed {seed}: {got} vs {want}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gelu_f64(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    }

    #[test]
    fn activations_match_f64_reference() {
        let xs: Vec<f32> = (-2000..2000).map(|i| i as f32 * 0.0071).collect();
        let mut g = xs.clone();
        swiglu(&mut g, &vec![1.0; xs.len()]);
        for (&x, &y) in xs.iter().zip(&g) {
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            assert!(y.is_finite() && (y as f64 - want).abs() < 1e-6 * (1.0 + want.abs()));
        }
        let mut g = xs.clone();
        geglu(&mut g, &vec![1.0; xs.len()]);
        for (&x, &y) in xs.iter().zip(&g) {
            // Input and output both pass through f16: relative error up to ~2 * 2^-11.
            let want = gelu_f64(x as f64);
            assert!(
                y.is_finite() && (y as f64 - want).abs() <= 2e-3 * (want.abs() + 1e-2),
                "{x}: {y} vs {want}"
            );
        }
        let mut big = vec![-11.0f32, 12.0];
        geglu(&mut big, &[1.0, 1.0]);
        assert_eq!(big, vec![0.0, 12.0]);
    }
}

#[cfg(test)]
mod ggml_exp_tests {
    use super::*;

    #[test]
    fn expf_ggml_is_within_two_ulp_of_f64_exp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = expf_ggml(x) as f64;
            let want = (x as f64).exp();
            let ulp = (want.abs() * f32::EPSILON as f64).max(f32::MIN_POSITIVE as f64);
            assert!(
                got.is_finite() && (got - want).abs() <= 2.0 * ulp,
                "x={x}: {got} vs {want}"
            );
            x += 0.0137;
        }
        assert_eq!(expf_ggml(-200.0), 0.0);
        assert_eq!(expf_ggml(200.0), f32::INFINITY);
    }
}
