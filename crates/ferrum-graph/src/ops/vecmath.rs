//! float32 loops written for the compiler's vectoriser (fixed lanes, selects instead of branches,
//! no bounds checks in the inner loops), each compiled three times: portable, AVX2 and AVX-512,
//! picked at run time from [`ferrum_kernels::cpu::features`]. No loop here uses `mul_add`, and
//! Rust never contracts `a * b + c`, so every tier gives the same bits.
//!
//! The transcendental lanes ([`exp_lane`], [`erf_lane`]) are polynomial approximations; their
//! accuracy is stated on each and checked by the tests at the end against the f64 reference.

use ferrum_kernels::gemm::clamp01;
use std::mem::MaybeUninit;

/// Lanes of the manual reductions (a multiple of every vector width used).
const L: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Isa {
    Portable,
    Avx2,
    Avx512,
}

/// The widest instruction set the loops here are compiled for that this process may use.
pub fn isa() -> Isa {
    let f = ferrum_kernels::cpu::features();
    if f.avx512f && f.avx512bw && f.avx512vl && f.avx2 && f.fma {
        Isa::Avx512
    } else if f.avx2 && f.fma {
        Isa::Avx2
    } else {
        Isa::Portable
    }
}

/// Defines `fn $name` whose body is compiled for the portable target, AVX2 and AVX-512, and run
/// as the widest one [`isa`] allows.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                fn wide($($arg: $ty),*) $(-> $ret)? {
                    imp($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    imp($($arg),*)
                }
                match isa() {
                    // SAFETY: `isa` reports Avx512 only when the CPU (and the process's
                    // overrides) allow AVX-512 F/BW/VL, AVX2 and FMA.
                    Isa::Avx512 => return unsafe { wide($($arg),*) },
                    // SAFETY: `isa` reports Avx2 only when the CPU allows AVX2 and FMA.
                    Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    Isa::Portable => {}
                }
            }
            imp($($arg),*)
        }
    };
}

// e^(d + err) (`exp_lane`) and the logistic function (`sigmoid_lane`) in float32 are the
// kernels' (`gemm::exp_f32`, `gemm::sigmoid_f32`: within 2 and 4 ulp), so an activation applied
// here and one fused into a product's epilogue give the same bits.
pub use ferrum_kernels::gemm::{exp_f32 as exp_lane, sigmoid_f32 as sigmoid_lane};

/// e^(x - m), the subtraction's rounding error carried into the reduction (TwoSum), so the
/// result is within 2 ulp of e^(x - m) however large |x - m| is.
#[inline(always)]
pub fn exp_diff_lane(x: f32, m: f32) -> f32 {
    let d = x - m;
    let bv = d - x;
    let av = d - bv;
    let err = (x - av) + (-m - bv);
    exp_lane(d, err)
}

/// erf(x) = x * P(x^2) on [0, 1) (relative error of the fit 1.3e-9).
const ERF_A: [f32; 7] = [
    std::f32::consts::FRAC_2_SQRT_PI,
    -0.376_126_26,
    0.112_835_82,
    -0.026_853_691,
    0.005_188_099,
    -8.008_189e-4,
    7.847_259e-5,
];
/// erfc(x) * e^(x^2) on [1, 4] as a polynomial in u = (x - 2.5) / 1.5 (relative error of the fit
/// 6e-9).
const ERF_B: [f32; 13] = [
    0.210_806_36,
    -0.111_521_01,
    0.056_110_517,
    -0.027_005_67,
    0.012_489_176,
    -0.005_567_65,
    0.002_404_004_4,
    -0.001_016_381_3,
    4.099_893_4e-4,
    -1.446_941e-4,
    5.902_049_5e-5,
    -3.665_495e-5,
    1.244_564_9e-5,
];

/// `ERF_A[0]` and `ERF_B[0]` in f64, for the last step of each polynomial.
const ERF_A0: f64 = std::f64::consts::FRAC_2_SQRT_PI;
const ERF_B0: f64 = 0.210_806_363_689_416_7;

/// `P(t)` of erf's fit below |x| = 1 past its constant term (`t = x^2`): `ERF_A[1..]` by Horner
/// in float32.
#[inline(always)]
fn erf_small_poly(t: f32) -> f32 {
    let mut p = ERF_A[6];
    for &a in ERF_A[1..6].iter().rev() {
        p = p * t + a;
    }
    p
}

/// erfc's fit on [1, 4] for |x| = `ax`: |x| clamped to [1, 4], `u = (xb - 2.5) / 1.5`, and
/// `R(u)` past its constant term (`ERF_B[1..]` by Horner in float32).
#[inline(always)]
fn erf_big_poly(ax: f32) -> (f32, f32, f32) {
    let xb = if ax < 1.0 { 1.0 } else { ax };
    let xb = if xb > 4.0 { 4.0 } else { xb };
    let u = (xb - 2.5) * (1.0 / 1.5);
    let mut q = ERF_B[12];
    for &b in ERF_B[1..12].iter().rev() {
        q = q * u + b;
    }
    (xb, u, q)
}

/// erf for float32 without branches: `x * P(x^2)` below |x| = 1, `1 - e^(-x^2) R(x)` up to 4,
/// +-1 from 4 on (erf(4) rounds to 1 in float32). The polynomials run in float32 up to their
/// last step, which (with the products and the final subtraction) runs in f64 and is rounded
/// once, so the result is within 1 ulp of the f64 reference rounded to float32 (checked by
/// `erf_lane_matches_f64_erf`). NaN stays NaN, -0 stays -0.
#[inline(always)]
pub fn erf_lane(x: f32) -> f32 {
    let ax = x.abs();
    let t = x * x;
    let p = erf_small_poly(t);
    let xd = x as f64;
    let small = (xd * (ERF_A0 + xd * xd * p as f64)) as f32;
    let (xb, u, q) = erf_big_poly(ax);
    let r = ERF_B0 + u as f64 * q as f64;
    // x^2 exactly as a float32 and its rounding error.
    let xx = xb as f64 * xb as f64;
    let xx32 = xx as f32;
    let e = exp_lane(-xx32, (xx32 as f64 - xx) as f32);
    let big = ((1.0 - e as f64 * r) as f32).copysign(x);
    let y = if ax < 1.0 { small } else { big };
    if ax >= 4.0 {
        1f32.copysign(x)
    } else {
        y
    }
}

multiversion! {
    /// Softmax of each row of `d` elements of `x` into `out` (the same length, a multiple of
    /// `d`): the row's max (NaN ignored, as the reference), e^(x - max) by [`exp_diff_lane`],
    /// their sum in f64 lanes, each exponential times the sum's f64 reciprocal rounded once. A row
    /// holding NaN or +inf, or only -inf, comes out all NaN, as in the reference.
    pub fn softmax_rows(x: &[f32], out: &mut [MaybeUninit<f32>], d: usize) {
        assert!(d > 0 && x.len() == out.len() && x.len().is_multiple_of(d));
        // The exponentials, in a recycled buffer of this thread.
        let mut e = ferrum_core::Buf::overwritten(d);
        for (row, orow) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let m = row_max(row);
            for (o, &v) in e.iter_mut().zip(row) {
                *o = exp_diff_lane(v, m);
            }
            let inv = 1.0 / sum_f64(&e, |v| v);
            for (o, &v) in orow.iter_mut().zip(&e) {
                o.write((v as f64 * inv) as f32);
            }
        }
    }
}

multiversion! {
    /// Attention's scores to probabilities, in place, row by row (`d` scores a row): each score
    /// divided by (`post.1`) or multiplied by `post.0`, plus its mask value (`mask[i * mrs + j *
    /// mcs]` for row `i`, column `j`; `mcs` 0 broadcasts one value over the row), then softmax
    /// with [`softmax_rows`]' arithmetic; with `nan_to_zero`, a NaN probability (a row of only
    /// -inf, or holding NaN or +inf) becomes 0. The same bits as the unfused Mul/Div, Add,
    /// Softmax and `Where(IsNaN(p), 0, p)` nodes on the same scores.
    pub fn attention_rows(s: &mut [f32], d: usize, post: Option<(f32, bool)>, mask: Option<(&[f32], usize, usize)>, nan_to_zero: bool) {
        assert!(d > 0 && s.len().is_multiple_of(d));
        for (i, row) in s.chunks_exact_mut(d).enumerate() {
            match post {
                Some((c, true)) => row.iter_mut().for_each(|v| *v /= c),
                Some((c, false)) => row.iter_mut().for_each(|v| *v *= c),
                None => {}
            }
            match mask {
                Some((m, mrs, 1)) => {
                    for (v, &mv) in row.iter_mut().zip(&m[i * mrs..][..d]) {
                        *v += mv;
                    }
                }
                Some((m, mrs, _)) => {
                    let mv = m[i * mrs];
                    row.iter_mut().for_each(|v| *v += mv);
                }
                None => {}
            }
            let m = row_max(row);
            for v in row.iter_mut() {
                *v = exp_diff_lane(*v, m);
            }
            let inv = 1.0 / sum_f64(row, |v| v);
            for v in row.iter_mut() {
                let p = (*v as f64 * inv) as f32;
                *v = if nan_to_zero && p.is_nan() { 0.0 } else { p };
            }
        }
    }
}

/// The largest value of a row, NaN ignored (-inf for an empty row or one of only NaN), in
/// lanes.
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; L];
    let mut ch = row.chunks_exact(L);
    for c in &mut ch {
        let c: &[f32; L] = c.try_into().unwrap();
        for j in 0..L {
            if c[j] > acc[j] {
                acc[j] = c[j];
            }
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(ch.remainder()) {
        if v > m {
            m = v;
        }
    }
    m
}

/// Sum of `f(x[i])` over a slice in f64 lanes.
#[inline(always)]
fn sum_f64(x: &[f32], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0f64; L];
    let mut ch = x.chunks_exact(L);
    for c in &mut ch {
        let c: &[f32; L] = c.try_into().unwrap();
        for j in 0..L {
            acc[j] += f(c[j] as f64);
        }
    }
    let mut s = 0f64;
    for &v in ch.remainder() {
        s += f(v as f64);
    }
    s + acc.iter().sum::<f64>()
}

multiversion! {
    /// LayerNormalization of each row of `scale.len()` elements: f64 mean and variance (summed
    /// in lanes), then `(x - mean) * inv * scale + bias` in f64 rounded once to float32, the
    /// reference's formula; only the summation order differs from it.
    pub fn layer_norm_rows(x: &[f32], out: &mut [MaybeUninit<f32>], eps: f64, scale: &[f32], bias: Option<&[f32]>) {
        let n = scale.len();
        assert!(n > 0 && x.len() == out.len() && x.len().is_multiple_of(n));
        assert!(bias.is_none_or(|b| b.len() == n));
        for (row, orow) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            let mean = sum_f64(row, |v| v) / n as f64;
            let var = sum_f64(row, |v| (v - mean) * (v - mean)) / n as f64;
            let inv = 1.0 / (var + eps).sqrt();
            match bias {
                Some(b) => {
                    for (((o, &e), &s), &b) in orow.iter_mut().zip(row).zip(scale).zip(b) {
                        o.write(((e as f64 - mean) * inv * s as f64 + b as f64) as f32);
                    }
                }
                None => {
                    for ((o, &e), &s) in orow.iter_mut().zip(row).zip(scale) {
                        o.write(((e as f64 - mean) * inv * s as f64) as f32);
                    }
                }
            }
        }
    }
}

/// The binary arithmetic ops of the fast paths.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Bin {
    Add,
    Sub,
    Mul,
    Div,
}

#[inline(always)]
fn bin_loop(op: Bin, a: &[f32], b: &[f32], out: &mut [MaybeUninit<f32>]) {
    assert!(a.len() == out.len() && b.len() == out.len());
    match op {
        Bin::Add => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                o.write(x + y);
            }
        }
        Bin::Sub => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                o.write(x - y);
            }
        }
        Bin::Mul => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                o.write(x * y);
            }
        }
        Bin::Div => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                o.write(x / y);
            }
        }
    }
}

#[inline(always)]
fn bin_scalar_loop(op: Bin, a: &[f32], y: f32, out: &mut [MaybeUninit<f32>]) {
    assert_eq!(a.len(), out.len());
    match op {
        Bin::Add => {
            for (o, &x) in out.iter_mut().zip(a) {
                o.write(x + y);
            }
        }
        Bin::Sub => {
            for (o, &x) in out.iter_mut().zip(a) {
                o.write(x - y);
            }
        }
        Bin::Mul => {
            for (o, &x) in out.iter_mut().zip(a) {
                o.write(x * y);
            }
        }
        Bin::Div => {
            for (o, &x) in out.iter_mut().zip(a) {
                o.write(x / y);
            }
        }
    }
}

#[inline(always)]
fn scalar_bin_loop(op: Bin, x: f32, b: &[f32], out: &mut [MaybeUninit<f32>]) {
    assert_eq!(b.len(), out.len());
    match op {
        Bin::Add => {
            for (o, &y) in out.iter_mut().zip(b) {
                o.write(x + y);
            }
        }
        Bin::Sub => {
            for (o, &y) in out.iter_mut().zip(b) {
                o.write(x - y);
            }
        }
        Bin::Mul => {
            for (o, &y) in out.iter_mut().zip(b) {
                o.write(x * y);
            }
        }
        Bin::Div => {
            for (o, &y) in out.iter_mut().zip(b) {
                o.write(x / y);
            }
        }
    }
}

/// How one operand of a binary op is read along an output row.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    /// The row itself (as long as the output's).
    Row(&'a [f32]),
    /// One value repeated along the row.
    Scalar(f32),
}

multiversion! {
    /// `out[i] = a[i] op b[i]` with either side possibly one repeated value; every element of
    /// `out` is written (a row operand must be as long as `out`).
    pub fn bin_row(op: Bin, a: Operand, b: Operand, out: &mut [MaybeUninit<f32>]) {
        match (a, b) {
            (Operand::Row(a), Operand::Row(b)) => bin_loop(op, a, b, out),
            (Operand::Row(a), Operand::Scalar(y)) => bin_scalar_loop(op, a, y, out),
            (Operand::Scalar(x), Operand::Row(b)) => scalar_bin_loop(op, x, b, out),
            (Operand::Scalar(x), Operand::Scalar(y)) => {
                let v = match op {
                    Bin::Add => x + y,
                    Bin::Sub => x - y,
                    Bin::Mul => x * y,
                    Bin::Div => x / y,
                };
                out.fill(MaybeUninit::new(v));
            }
        }
    }
}

/// The unary ops of the fast paths.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Unary {
    Relu,
    Sqrt,
    Erf,
    /// Clip to [lo, hi]: below lo -> lo, then above hi -> hi; NaN stays.
    Clip(f32, f32),
    /// `x` when `x >= 0`, else `alpha * x`.
    LeakyRelu(f32),
    /// GELU, erf form, `x Phi(x)`: [`ferrum_kernels::gemm::gelu_erf`] (float32, within
    /// `2^-22 (1 + |x|)` of the exact value; the same bits as a GEMM epilogue's GELU).
    Gelu,
    /// The logistic function `1 / (1 + e^-x)` ([`sigmoid_lane`]).
    Sigmoid,
    /// SiLU (swish), `x * sigmoid(x)` ([`sigmoid_lane`]).
    Silu,
    /// `clamp(alpha * x + beta, 0, 1)`, NaN kept.
    HardSigmoid(f32, f32),
    /// `x * clamp(x / 6 + 1 / 2, 0, 1)`, NaN kept.
    HardSwish,
}

impl Unary {
    /// Whether the op costs a polynomial or an exponential an element (Erf, GELU, Sigmoid,
    /// SiLU), not a compare or a multiply-add: worth a pool task sooner, and better run over a
    /// whole output than lane by lane inside another kernel's blocks.
    pub fn is_costly(self) -> bool {
        matches!(
            self,
            Unary::Erf | Unary::Gelu | Unary::Sigmoid | Unary::Silu
        )
    }
}

/// One value of a [`Unary`] op.
#[inline(always)]
pub fn unary_lane(op: Unary, v: f32) -> f32 {
    match op {
        Unary::Relu => {
            if v > 0.0 {
                v
            } else {
                0.0
            }
        }
        Unary::Sqrt => v.sqrt(),
        Unary::Erf => erf_lane(v),
        Unary::Clip(lo, hi) => {
            let y = if v < lo { lo } else { v };
            if y > hi {
                hi
            } else {
                y
            }
        }
        Unary::LeakyRelu(a) => {
            if v >= 0.0 {
                v
            } else {
                a * v
            }
        }
        Unary::Gelu => ferrum_kernels::gemm::gelu_erf(v),
        Unary::Sigmoid => sigmoid_lane(v),
        Unary::Silu => v * sigmoid_lane(v),
        Unary::HardSigmoid(a, b) => clamp01(a * v + b),
        Unary::HardSwish => v * clamp01(v * (1.0 / 6.0) + 0.5),
    }
}

multiversion! {
    /// `v[i] = op(v[i])` in place.
    pub fn unary_inplace(op: Unary, v: &mut [f32]) {
        // One loop per op, so each body is vectorised on its own.
        match op {
            Unary::Relu => for x in v.iter_mut() { *x = unary_lane(Unary::Relu, *x) },
            Unary::Sqrt => for x in v.iter_mut() { *x = unary_lane(Unary::Sqrt, *x) },
            Unary::Erf => for x in v.iter_mut() { *x = unary_lane(Unary::Erf, *x) },
            Unary::Clip(lo, hi) => for x in v.iter_mut() { *x = unary_lane(Unary::Clip(lo, hi), *x) },
            Unary::LeakyRelu(a) => for x in v.iter_mut() { *x = unary_lane(Unary::LeakyRelu(a), *x) },
            Unary::Gelu => for x in v.iter_mut() { *x = unary_lane(Unary::Gelu, *x) },
            Unary::Sigmoid => for x in v.iter_mut() { *x = unary_lane(Unary::Sigmoid, *x) },
            Unary::Silu => for x in v.iter_mut() { *x = unary_lane(Unary::Silu, *x) },
            Unary::HardSigmoid(a, b) => {
                for x in v.iter_mut() { *x = unary_lane(Unary::HardSigmoid(a, b), *x) }
            }
            Unary::HardSwish => for x in v.iter_mut() { *x = unary_lane(Unary::HardSwish, *x) },
        }
    }
}

multiversion! {
    /// `y[j] = x . b[j * k..][..k]` for each `j < y.len()`, each dot product summed in 16
    /// interleaved lanes (a multiply, then an add, per lane and step), then the lanes in order,
    /// then the tail.
    pub fn dot16_rows(x: &[f32], b: &[f32], k: usize, y: &mut [f32]) {
        for (j, yj) in y.iter_mut().enumerate() {
            *yj = dot16(&x[..k], &b[j * k..][..k]);
        }
    }
}

multiversion! {
    /// `y[j] = sum over p of x[p] * b[p * n + j]` for `j < y.len()` (`y` starting at 0), rows
    /// of `b` added one after another.
    pub fn axpy_rows(x: &[f32], b: &[f32], n: usize, y: &mut [f32]) {
        y.fill(0.0);
        for (p, &xp) in x.iter().enumerate() {
            let row = &b[p * n..][..y.len()];
            y.iter_mut().zip(row).for_each(|(o, &v)| *o += xp * v);
        }
    }
}

/// A dot product in 16 interleaved lanes, then the lanes and the tail (see [`dot16_rows`]).
#[inline(always)]
fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Lanes of the depthwise kernel's output blocks.
pub const DW_LANES: usize = L;

/// An output block's starting values (`v`: at most `L`, the rest 0): a whole block is one
/// fixed-size copy (a vector load), not a call to `memcpy` with a run-time length.
#[inline(always)]
fn load_block(v: &[f32]) -> [f32; L] {
    match <&[f32; L]>::try_from(v) {
        Ok(whole) => *whole,
        Err(_) => {
            let mut acc = [0f32; L];
            acc[..v.len()].copy_from_slice(v);
            acc
        }
    }
}

/// Stores the first `o.len()` lanes of `acc` (at most `L`), a whole block as one fixed-size copy.
#[inline(always)]
fn store_block(acc: &[f32; L], o: &mut [MaybeUninit<f32>]) {
    match <&mut [MaybeUninit<f32>; L]>::try_from(&mut *o) {
        Ok(whole) => *whole = acc.map(MaybeUninit::new),
        Err(_) => {
            for (d, &v) in o.iter_mut().zip(acc) {
                d.write(v);
            }
        }
    }
}

/// A depthwise output plane's size, and the input rows between output rows (the stride).
#[derive(Clone, Copy)]
pub struct DwOut {
    pub oh: usize,
    pub ow: usize,
    pub s0: usize,
}

/// Where a depthwise plane's outputs start and what follows the taps: output `i` starts at
/// `z[i] + bias` (a residual) or `0 + bias`, and `act` (if any) is applied to each output before
/// it is stored.
#[derive(Clone, Copy)]
pub struct DwEnds<'a> {
    pub bias: f32,
    pub z: Option<&'a [f32]>,
    pub act: Option<Unary>,
}

multiversion! {
    /// One depthwise-convolution output plane `o` (`oh x ow`, every element written) from a
    /// zero-padded input split by column phase, `xp` (rows of `wph` values, at least
    /// [`DW_LANES`] values of slack at the end). `taps` holds each tap's (phase row offset,
    /// column offset, weight); output row `oy` reads phase rows from `oy * s0`. Each block of
    /// `L` outputs of a row starts as `ends` says, adds its taps in order in registers and is
    /// stored through `ends.act`; a short last block computes all lanes and stores the valid
    /// ones.
    pub fn depthwise_rows(xp: &[f32], wph: usize, taps: &[(usize, usize, f32)], ends: DwEnds, o: &mut [MaybeUninit<f32>], out: DwOut) {
        dw_plane::<1>(xp, wph, taps, ends, o, out)
    }
}

multiversion! {
    /// [`depthwise_rows`] for a column stride of 2 on an unsplit zero-padded plane `xp` (rows
    /// of `wp` values, at least `2 * DW_LANES` values of slack at the end): output column `ox`
    /// of a tap at column offset `b` reads `xp[row * wp + b + 2 * ox]`. The same operations in
    /// the same order as the phase-split form.
    pub fn depthwise_rows_s2(xp: &[f32], wp: usize, taps: &[(usize, usize, f32)], ends: DwEnds, o: &mut [MaybeUninit<f32>], out: DwOut) {
        dw_plane::<2>(xp, wp, taps, ends, o, out)
    }
}

/// Output blocks of a depthwise plane computed together: each block's sum is one chain of
/// dependent adds (a mul and an add per tap, in tap order), so one block at a time waits on
/// the add's latency at every tap; `DW_GROUP` independent blocks keep both vector ports busy.
const DW_GROUP: usize = 4;

/// [`depthwise_rows`] (`S = 1`) and [`depthwise_rows_s2`] (`S = 2`): the plane's `L`-wide
/// output blocks, row by row, [`DW_GROUP`] blocks at a time.
#[inline(always)]
fn dw_plane<const S: usize>(
    xp: &[f32],
    wr: usize,
    taps: &[(usize, usize, f32)],
    ends: DwEnds,
    o: &mut [MaybeUninit<f32>],
    out: DwOut,
) {
    let DwOut { oh, ow, s0 } = out;
    let nb = ow.div_ceil(L);
    let total = oh * nb;
    let full = total / DW_GROUP * DW_GROUP;
    for first in (0..full).step_by(DW_GROUP) {
        dw_blocks::<DW_GROUP, S>(xp, wr, taps, ends, o, ow, s0, first);
    }
    for first in full..total {
        dw_blocks::<1, S>(xp, wr, taps, ends, o, ow, s0, first);
    }
}

/// `G` consecutive output blocks of a depthwise plane (block `i`: row `i / nb`, columns from
/// `(i % nb) * L`), each summed in its own registers: starting value, then every tap in order,
/// then the activation.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn dw_blocks<const G: usize, const S: usize>(
    xp: &[f32],
    wr: usize,
    taps: &[(usize, usize, f32)],
    ends: DwEnds,
    o: &mut [MaybeUninit<f32>],
    ow: usize,
    s0: usize,
    first: usize,
) {
    let nb = ow.div_ceil(L);
    let mut acc = [[0f32; L]; G];
    // Each block's output offset, length and input offset (of tap offset 0).
    let mut at = [(0usize, 0usize, 0usize); G];
    for g in 0..G {
        let (oy, ox0) = ((first + g) / nb, (first + g) % nb * L);
        let n = L.min(ow - ox0);
        at[g] = (oy * ow + ox0, n, oy * s0 * wr + S * ox0);
        acc[g] = match ends.z {
            Some(z) => load_block(&z[at[g].0..][..n]),
            None => [0.0; L],
        };
        for v in acc[g].iter_mut() {
            *v += ends.bias;
        }
    }
    for &(r, b, wv) in taps {
        let t = r * wr + b;
        for g in 0..G {
            let src = &xp[t + at[g].2..][..S * L];
            for l in 0..L {
                acc[g][l] += wv * src[S * l];
            }
        }
    }
    for g in 0..G {
        match ends.act {
            None => {}
            Some(Unary::Relu) => acc[g] = acc[g].map(|v| unary_lane(Unary::Relu, v)),
            Some(Unary::Clip(lo, hi)) => {
                acc[g] = acc[g].map(|v| unary_lane(Unary::Clip(lo, hi), v))
            }
            Some(op) => acc[g] = acc[g].map(|v| unary_lane(op, v)),
        }
        store_block(&acc[g], &mut o[at[g].0..][..at[g].1]);
    }
}

multiversion! {
    /// One output row of a channels-last depthwise convolution: `o` holds `ow` pixels of `c`
    /// channels each, starting as the bias (and residual), and each tap `t` adds
    /// `w[t * c + ch] * x[taps[t] + px * step + ch]` in tap order (the same operations in the
    /// same order as [`depthwise_rows`], so the two agree bit for bit). `L` channels at a time
    /// in registers; the channels past the last whole block one by one.
    pub fn depthwise_nhwc_row(x: &[f32], taps: &[usize], w: &[f32], o: &mut [f32], c: usize, ow: usize, step: usize) {
        let full = c / L * L;
        // DW_GROUP pixels at a time per channel block: independent add chains overlap.
        let pg = ow / DW_GROUP * DW_GROUP;
        for px0 in (0..pg).step_by(DW_GROUP) {
            for cb in (0..full).step_by(L) {
                let mut acc = [[0f32; L]; DW_GROUP];
                for (g, a) in acc.iter_mut().enumerate() {
                    *a = load_block(&o[(px0 + g) * c + cb..][..L]);
                }
                for (t, &off) in taps.iter().enumerate() {
                    let ws = &w[t * c + cb..][..L];
                    for (g, a) in acc.iter_mut().enumerate() {
                        let xs = &x[off + (px0 + g) * step + cb..][..L];
                        for l in 0..L {
                            a[l] += ws[l] * xs[l];
                        }
                    }
                }
                for (g, a) in acc.iter().enumerate() {
                    let o = &mut o[(px0 + g) * c + cb..][..L];
                    let o: &mut [f32; L] = o.try_into().unwrap();
                    *o = *a;
                }
            }
        }
        for px in 0..ow {
            let ob = px * c;
            for cb in (0..if px < pg { 0 } else { full }).step_by(L) {
                let mut acc = load_block(&o[ob + cb..][..L]);
                for (t, &off) in taps.iter().enumerate() {
                    let xs = &x[off + px * step + cb..][..L];
                    let ws = &w[t * c + cb..][..L];
                    for l in 0..L {
                        acc[l] += ws[l] * xs[l];
                    }
                }
                let o: &mut [f32; L] = (&mut o[ob + cb..][..L]).try_into().unwrap();
                *o = acc;
            }
            for ch in full..c {
                let mut a = o[ob + ch];
                for (t, &off) in taps.iter().enumerate() {
                    a += w[t * c + ch] * x[off + px * step + ch];
                }
                o[ob + ch] = a;
            }
        }
    }
}

multiversion! {
    /// `out[i] = op(x[i])`, every element of `out` written (`x` as long as `out`).
    pub fn unary_slice(op: Unary, x: &[f32], out: &mut [MaybeUninit<f32>]) {
        assert_eq!(x.len(), out.len());
        // Plain `for` loops: an iterator's `for_each` would leave the body in a generic `fold`
        // compiled once, without this function's target features.
        match op {
            Unary::Relu => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(if v > 0.0 { v } else { 0.0 });
                }
            }
            Unary::Sqrt => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(v.sqrt());
                }
            }
            Unary::Erf => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(erf_lane(v));
                }
            }
            Unary::Clip(lo, hi) => {
                for (o, &v) in out.iter_mut().zip(x) {
                    let y = if v < lo { lo } else { v };
                    o.write(if y > hi { hi } else { y });
                }
            }
            Unary::LeakyRelu(a) => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(unary_lane(Unary::LeakyRelu(a), v));
                }
            }
            Unary::Gelu => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(unary_lane(Unary::Gelu, v));
                }
            }
            Unary::Sigmoid => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(unary_lane(Unary::Sigmoid, v));
                }
            }
            Unary::Silu => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(unary_lane(Unary::Silu, v));
                }
            }
            Unary::HardSigmoid(a, b) => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(unary_lane(Unary::HardSigmoid(a, b), v));
                }
            }
            Unary::HardSwish => {
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(unary_lane(Unary::HardSwish, v));
                }
            }
        }
    }
}

multiversion! {
    /// `out[i] = (x[i] - m) * a + b` (a multiply, then an add), every element of `out` written
    /// (`x` as long as `out`): an inference BatchNormalization's channel.
    pub fn affine_slice(x: &[f32], m: f32, a: f32, b: f32, out: &mut [MaybeUninit<f32>]) {
        assert_eq!(x.len(), out.len());
        for (o, &v) in out.iter_mut().zip(x) {
            o.write((v - m) * a + b);
        }
    }
}

multiversion! {
    /// `out[i] = x[i].is_nan()`, every element of `out` written (`x` as long as `out`).
    pub fn isnan_slice(x: &[f32], out: &mut [MaybeUninit<bool>]) {
        assert_eq!(x.len(), out.len());
        for (o, &v) in out.iter_mut().zip(x) {
            o.write(v.is_nan());
        }
    }
}

/// How one input of Where is read along an output row.
#[derive(Clone, Copy)]
pub enum Pick<'a, T> {
    Row(&'a [T]),
    Scalar(T),
}

multiversion! {
    /// One output row of Where: `out[i] = if c[i] { x[i] } else { y[i] }`, each input a row or
    /// one repeated value; every element of `out` written (rows as long as `out`).
    pub fn where_row(c: Pick<bool>, x: Pick<f32>, y: Pick<f32>, out: &mut [MaybeUninit<f32>]) {
        let n = out.len();
        for p in [x, y] {
            if let Pick::Row(v) = p {
                assert_eq!(v.len(), n);
            }
        }
        if let Pick::Row(c) = c {
            assert_eq!(c.len(), n);
        }
        match (c, x, y) {
            (Pick::Scalar(c), x, y) => match if c { x } else { y } {
                Pick::Row(v) => {
                    for (o, &v) in out.iter_mut().zip(v) {
                        o.write(v);
                    }
                }
                Pick::Scalar(v) => out.fill(MaybeUninit::new(v)),
            },
            (Pick::Row(c), Pick::Row(x), Pick::Row(y)) => {
                for (((o, &c), &x), &y) in out.iter_mut().zip(c).zip(x).zip(y) {
                    o.write(if c { x } else { y });
                }
            }
            (Pick::Row(c), Pick::Row(x), Pick::Scalar(y)) => {
                for ((o, &c), &x) in out.iter_mut().zip(c).zip(x) {
                    o.write(if c { x } else { y });
                }
            }
            (Pick::Row(c), Pick::Scalar(x), Pick::Row(y)) => {
                for ((o, &c), &y) in out.iter_mut().zip(c).zip(y) {
                    o.write(if c { x } else { y });
                }
            }
            (Pick::Row(c), Pick::Scalar(x), Pick::Scalar(y)) => {
                for (o, &c) in out.iter_mut().zip(c) {
                    o.write(if c { x } else { y });
                }
            }
        }
    }
}

// The max pool's combinations, shared with the kernels' pooled convolution.
use ferrum_kernels::direct::{max_no_nan, pool_max};

/// `out[i]` = the pooling max of `terms(0)[i]`, `terms(1)[i]`, ... in that order (`count >= 1`
/// terms of at least `out.len()` values), or of `out[i]` and then those with `keep`. The
/// combination (first largest, or first NaN, wins) is associative, so the terms are taken three
/// or two at a time in one pass each: fewer loads and stores of `out` than a pass per term.
/// `comb` is that combination ([`pool_max`], or [`max_no_nan`] where no term is NaN).
#[inline(always)]
fn max_terms<'a>(
    out: &mut [f32],
    count: usize,
    keep: bool,
    terms: impl Fn(usize) -> &'a [f32],
    comb: impl Fn(f32, f32) -> f32,
) {
    let n = out.len();
    let mut t = 0;
    let mut first = !keep;
    while t < count {
        let left = count - t;
        if left >= 3 {
            let (a, b, c) = (&terms(t)[..n], &terms(t + 1)[..n], &terms(t + 2)[..n]);
            if first {
                for i in 0..n {
                    out[i] = comb(comb(a[i], b[i]), c[i]);
                }
            } else {
                for i in 0..n {
                    out[i] = comb(out[i], comb(comb(a[i], b[i]), c[i]));
                }
            }
            t += 3;
        } else if left == 2 {
            let (a, b) = (&terms(t)[..n], &terms(t + 1)[..n]);
            if first {
                for i in 0..n {
                    out[i] = comb(a[i], b[i]);
                }
            } else {
                for i in 0..n {
                    out[i] = comb(out[i], comb(a[i], b[i]));
                }
            }
            t += 2;
        } else {
            let a = &terms(t)[..n];
            if first {
                out.copy_from_slice(a);
            } else {
                for i in 0..n {
                    out[i] = comb(out[i], a[i]);
                }
            }
            t += 1;
        }
        first = false;
    }
}

/// The geometry of a 2-D pooling: input size, kernel, strides (>= 1), dilations (>= 1), leading
/// padding and output size, each as (rows, columns).
#[derive(Clone, Copy, Debug)]
pub struct PoolGeom {
    pub input: [usize; 2],
    pub k: [usize; 2],
    pub s: [usize; 2],
    pub d: [usize; 2],
    pub pad: [usize; 2],
    pub out: [usize; 2],
}

multiversion! {
    /// 2-D MaxPool of whole planes (`x`: planes of `input`, `out`: as many planes of `out`,
    /// every value written), separably: each input row's max over the kernel's columns (the
    /// row padded with -inf and split into its stride's phases, so every step reads
    /// contiguously), then each output row's max over the kernel's rows, up to three terms per
    /// pass ([`max_terms`]). The first largest value (or first NaN) of a window in row-major
    /// order wins either way, so the bits are the reference's, which visits the window row by
    /// row.
    pub fn maxpool_planes(x: &[f32], out: &mut [f32], g: &PoolGeom) {
        let ([ih, iw], [_, kw], [_, sw], [_, dw], [_, pw], [oh, ow]) =
            (g.input, g.k, g.s, g.d, g.pad, g.out);
        // Columns of the padded row that any window reaches.
        let wp = ((ow - 1) * sw + (kw.max(1) - 1) * dw + 1).max(pw + iw);
        let nph = wp.div_ceil(sw);
        // The whole plane padded (rows of `nph * sw`), its phases (each `ih * nph`), the rows'
        // maxima (rows of `nph`), each pass one long loop over the plane rather than a short
        // one a row; `extra` values of -inf past the padded plane and the phases for the
        // largest tap offset, read by the last row's columns past `ow` (never used).
        let n = ih * nph;
        let extra = (kw.max(1) - 1) * dw + 1;
        let plen = n * sw + extra;
        let qlen = if sw == 1 { 0 } else { n * sw + extra };
        // The scratch in a recycled buffer of this thread, set to -inf as fresh scratch would be.
        let mut buf = ferrum_core::Buf::with_capacity(plen + qlen + n);
        buf.resize(plen + qlen + n, f32::NEG_INFINITY);
        let (padded, rest) = buf.split_at_mut(plen);
        let (phases, h) = rest.split_at_mut(qlen);
        for (plane, oplane) in x.chunks_exact(ih * iw).zip(out.chunks_exact_mut(oh * ow)) {
            // A plane without NaN takes one `maxps` per combination instead of a compare,
            // a NaN test and a blend (ResNet-50's 64 x 112 x 112 max pool, one thread:
            // see the kernel timings below); the same bits either way.
            let mut scratch = (&mut *padded, &mut *phases, &mut *h);
            if plane.iter().fold(false, |a, v| a | v.is_nan()) {
                pool_plane(plane, oplane, g, &mut scratch, nph, pool_max);
            } else {
                pool_plane(plane, oplane, g, &mut scratch, nph, max_no_nan);
            }
        }
    }
}

/// One plane of [`maxpool_planes`] with the combination `comb` (see [`max_terms`]); scratch:
/// the padded plane, its phases, the rows' maxima (rows of `nph`).
#[inline(always)]
fn pool_plane(
    plane: &[f32],
    oplane: &mut [f32],
    g: &PoolGeom,
    (padded, phases, h): &mut (&mut [f32], &mut [f32], &mut [f32]),
    nph: usize,
    comb: impl Fn(f32, f32) -> f32 + Copy,
) {
    let ([ih, iw], [kh, kw], [sh, sw], [dh, dw], [ph, pw], [_, ow]) =
        (g.input, g.k, g.s, g.d, g.pad, g.out);
    let (wrow, n) = (nph * sw, ih * nph);
    for (r, src) in plane.chunks_exact(iw).enumerate() {
        padded[r * wrow + pw..][..iw].copy_from_slice(src);
    }
    // Phase p of the whole plane: column j * sw + p of every padded row, rows of nph.
    let (ph_src, block): (&[f32], usize) = if sw == 1 {
        (padded, 0)
    } else {
        split_phases(&padded[..n * sw], sw, phases);
        (phases, n)
    };
    // Each row's max over the kernel's columns, for every row at once (row r, column j at
    // r * nph + j; the columns past ow mix two rows and are not read). pool_max(-inf, v) is
    // v, bit for bit: a max starts at its first term.
    max_terms(
        &mut h[..n],
        kw,
        false,
        |kx| {
            let t = kx * dw;
            &ph_src[(t % sw) * block + t / sw..][..n]
        },
        comb,
    );
    let h = &**h;
    for (oy, orow) in oplane.chunks_exact_mut(ow).enumerate() {
        // The kernel's rows inside the input: a run of consecutive ky.
        let iy = |ky: usize| (oy * sh + ky * dh) as isize - ph as isize;
        let k0 = (0..kh).find(|&ky| iy(ky) >= 0);
        let k1 = (0..kh).rev().find(|&ky| iy(ky) < ih as isize);
        match (k0, k1) {
            (Some(k0), Some(k1)) if k0 <= k1 => {
                max_terms(
                    orow,
                    k1 - k0 + 1,
                    false,
                    |j| &h[iy(k0 + j) as usize * nph..][..ow],
                    comb,
                );
            }
            _ => orow.fill(f32::NEG_INFINITY),
        }
    }
}

/// `phases[p * n + j] = src[j * s + p]` with `n = src.len() / s` (`src.len()` a multiple of `s`).
#[inline(always)]
fn split_phases(src: &[f32], s: usize, phases: &mut [f32]) {
    let n = src.len() / s;
    if s == 2 {
        // Indexed over exact-length slices, so that the compiler vectorises the
        // deinterleave (two vector loads, two permutes per 2 x lanes values).
        let (p0, p1) = phases.split_at_mut(n);
        let (p0, p1, src) = (&mut p0[..n], &mut p1[..n], &src[..2 * n]);
        for i in 0..n {
            p0[i] = src[2 * i];
            p1[i] = src[2 * i + 1];
        }
        return;
    }
    for (j, c) in src.chunks_exact(s).enumerate() {
        for (p, &v) in c.iter().enumerate() {
            phases[p * n + j] = v;
        }
    }
}

/// `acc[i] += x[i * s] as f64` for each `i < acc.len()` (`x` long enough): one tap of a row
/// of average-pool windows, stride `s`; 1 and 2 (the common strides) as loops of their own so
/// that each vectorises (widening converts; for 2, a deinterleave).
#[inline(always)]
fn add_strided_f64(acc: &mut [f64], x: &[f32], s: usize) {
    let n = acc.len();
    match s {
        1 => {
            for (a, &v) in acc.iter_mut().zip(&x[..n]) {
                *a += v as f64;
            }
        }
        2 => {
            let x = &x[..2 * n - 1];
            for i in 0..n {
                acc[i] += x[2 * i] as f64;
            }
        }
        _ => {
            for (a, &v) in acc.iter_mut().zip(x.iter().step_by(s)) {
                *a += v as f64;
            }
        }
    }
}

/// How [`avg_pool_plane`] walks a plane: per output row the input rows its windows cover (in
/// the input); per kernel column the run of outputs `lo..hi` whose tap lies in the input row
/// and the column of output 0's tap (may be negative); the horizontal stride; per output the
/// divisor, or its reciprocal where `recip` (every divisor a power of two).
pub struct AvgPoolWalk<'a> {
    pub rows: &'a [Vec<usize>],
    pub runs: &'a [(usize, usize, isize)],
    pub stride: usize,
    pub div: &'a [f64],
    pub recip: bool,
}

multiversion! {
    /// One plane of a 2-D float32 AveragePool (`xp`: rows of `iw`; `out`: rows of
    /// `acc.len()`): each output's taps inside the input summed in f64 in row-major tap order
    /// (tap row, then tap column; a sum starts at +0 and so is never -0, so skipping a tap and
    /// adding 0 agree), then divided (or multiplied by the exact reciprocal) and rounded once.
    pub fn avg_pool_plane(xp: &[f32], iw: usize, out: &mut [f32], walk: &AvgPoolWalk, acc: &mut [f64]) {
        let ow = acc.len();
        for (oy, ys) in walk.rows.iter().enumerate() {
            acc.fill(0.0);
            for &y in ys {
                let row = &xp[y * iw..][..iw];
                for &(lo, hi, at0) in walk.runs {
                    if lo < hi {
                        let start = (at0 + (lo * walk.stride) as isize) as usize;
                        add_strided_f64(&mut acc[lo..hi], &row[start..], walk.stride);
                    }
                }
            }
            let orow = &mut out[oy * ow..][..ow];
            let d = &walk.div[oy * ow..][..ow];
            if walk.recip {
                for ((o, &a), &m) in orow.iter_mut().zip(&*acc).zip(d) {
                    *o = (a * m) as f32;
                }
            } else {
                for ((o, &a), &q) in orow.iter_mut().zip(&*acc).zip(d) {
                    *o = (a / q) as f32;
                }
            }
        }
    }
}

multiversion! {
    /// Sum of a slice, in f64 lanes.
    pub fn sum_slice_f64(x: &[f32]) -> f64 {
        sum_f64(x, |v| v)
    }
}

multiversion! {
    /// Per channel `j < c` of channels-last values `x` (`[pixels, c]`), appended to `out`: the
    /// mean of that channel's values, its f64 sum taken in [`sum_f64`]'s order over them (what
    /// `sum_slice_f64` gives for the channel's NCHW plane: pixel `p` of the whole groups of `L`
    /// into lane `p % L`, the pixels left over in order, then their sum plus the lanes' sum),
    /// divided by `pixels` and rounded once. `c > 0`.
    pub fn channel_means_f32(x: &[f32], c: usize, out: &mut Vec<f32>) {
        // Channels in blocks of B, so that a block's lanes (8 KiB) stay in the first-level
        // cache.
        const B: usize = 64;
        let pixels = x.len() / c;
        let full = pixels / L * L;
        for j0 in (0..c).step_by(B) {
            let w = B.min(c - j0);
            let mut lanes = [[0f64; B]; L];
            let mut rest = [0f64; B];
            for p in 0..pixels {
                let acc = if p < full {
                    &mut lanes[p % L]
                } else {
                    &mut rest
                };
                for (a, &v) in acc[..w].iter_mut().zip(&x[p * c + j0..][..w]) {
                    *a += v as f64;
                }
            }
            out.extend((0..w).map(|j| {
                let sum = rest[j] + lanes.iter().map(|l| l[j]).sum::<f64>();
                (sum / pixels as f64) as f32
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::elementwise::erf;

    /// Distance in float32 steps (ulp) between two finite values of the same sign or zero.
    fn ulps(a: f32, b: f32) -> u32 {
        let key = |v: f32| {
            let i = v.to_bits() as i32;
            if i < 0 {
                i32::MIN.wrapping_sub(i) as i64
            } else {
                i as i64
            }
        };
        (key(a) - key(b)).unsigned_abs() as u32
    }

    fn rng(seed: u64) -> impl FnMut() -> f64 {
        let mut s = seed;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// Sigmoid, SiLU, HardSigmoid and HardSwish lanes against f64 on fresh random inputs
    /// (the seed is printed on failure): Sigmoid within 4 ulp, SiLU within 5 (one more
    /// rounding), the piecewise-linear two within 2 ulp or 1.2e-7·max(1, |x|) (their f32
    /// `a·x + b` cancels near the lower corner); outputs the same
    /// through `unary_slice` and `unary_inplace` (the vector loops) as lane by lane; NaN stays NaN.
    #[test]
    fn sigmoid_family_lanes_match_f64() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        let mut r = rng(seed);
        let xs: Vec<f32> = (0..200_000)
            .map(|i| match i % 4 {
                0 => (r() * 200.0 - 100.0) as f32,
                1 => (r() * 16.0 - 8.0) as f32,
                2 => ((r() * 2.0 - 1.0) * 1e-3) as f32,
                _ => (r() * 170.0 - 87.0) as f32,
            })
            .collect();
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let hsig = |x: f64| (0.3f32 as f64 * x + 0.4f32 as f64).clamp(0.0, 1.0);
        type Case<'a> = (Unary, &'a dyn Fn(f64) -> f64, u32);
        let cases: [Case; 4] = [
            (Unary::Sigmoid, &sig, 4),
            (Unary::Silu, &|x: f64| x * sig(x), 5),
            (Unary::HardSigmoid(0.3, 0.4), &hsig, 2),
            (
                Unary::HardSwish,
                &|x: f64| x * (x / 6.0 + 0.5).clamp(0.0, 1.0),
                2,
            ),
        ];
        for (op, f, tol) in cases {
            let mut out = vec![MaybeUninit::new(f32::NAN); xs.len()];
            unary_slice(op, &xs, &mut out);
            let mut inplace = xs.clone();
            unary_inplace(op, &mut inplace);
            for (i, &x) in xs.iter().enumerate() {
                let got = unary_lane(op, x);
                // SAFETY: `unary_slice` wrote every element.
                let sliced = unsafe { out[i].assume_init() };
                assert_eq!(
                    got.to_bits(),
                    sliced.to_bits(),
                    "seed {seed}: {op:?}({x}) slice"
                );
                assert_eq!(
                    got.to_bits(),
                    inplace[i].to_bits(),
                    "seed {seed}: {op:?}({x}) in place"
                );
                let want = f(x as f64) as f32;
                // Where exp_lane flushes to 0 (below about -87) the true values are under
                // 2e-38 (SiLU's, times |x|).
                let linear = matches!(op, Unary::HardSigmoid(..) | Unary::HardSwish);
                let ok = if got == 0.0 && want.abs() <= 2e-38 * x.abs().max(1.0) {
                    true
                } else if linear {
                    // a·x + b in f32 cancels near the clamp's lower corner: absolute there.
                    ulps(got, want) <= tol
                        || (got as f64 - want as f64).abs() <= 1.2e-7 * x.abs().max(1.0) as f64
                } else {
                    ulps(got, want) <= tol
                };
                assert!(ok, "seed {seed}: {op:?}({x}) = {got}, f64 {want}");
            }
            assert!(unary_lane(op, f32::NAN).is_nan(), "{op:?}(NaN)");
        }
        assert_eq!(sigmoid_lane(f32::INFINITY), 1.0);
        assert_eq!(sigmoid_lane(f32::NEG_INFINITY), 0.0);
        assert_eq!(sigmoid_lane(0.0), 0.5);
    }

    #[test]
    fn exp_lane_matches_f64_exp() {
        let mut r = rng(0x9e37_79b9_7f4a_7c15);
        let mut worst = 0;
        for i in 0..400_000 {
            let x = if i % 2 == 0 {
                (r() * 175.0 - 87.0) as f32
            } else {
                (r() * 2.0 - 1.0) as f32
            };
            let want = (x as f64).exp() as f32;
            let got = exp_lane(x, 0.0);
            worst = worst.max(ulps(got, want));
        }
        assert!(worst <= 2, "exp: {worst} ulp");
        assert_eq!(exp_lane(f32::NEG_INFINITY, 0.0), 0.0);
        assert_eq!(exp_lane(-100.0, 0.0), 0.0);
        assert_eq!(exp_lane(f32::INFINITY, 0.0), f32::INFINITY);
        assert!(exp_lane(f32::NAN, 0.0).is_nan());
        assert_eq!(exp_lane(0.0, 0.0), 1.0);
    }

    #[test]
    fn exp_diff_lane_carries_the_subtraction_error() {
        let mut r = rng(7);
        let mut worst = 0;
        for _ in 0..200_000 {
            let m = (r() * 200.0 - 100.0) as f32;
            let x = m - (r() * 80.0) as f32;
            let want = (x as f64 - m as f64).exp() as f32;
            worst = worst.max(ulps(exp_diff_lane(x, m), want));
        }
        assert!(worst <= 2, "exp(x - m): {worst} ulp");
    }

    #[test]
    fn erf_lane_matches_f64_erf() {
        let mut r = rng(42);
        let mut worst = 0;
        for i in 0..400_000 {
            let x = match i % 4 {
                0 => (r() * 10.0 - 5.0) as f32,
                1 => (r() * 2.0 - 1.0) as f32,
                2 => ((r() * 2.0 - 1.0) * 1e-3) as f32,
                _ => (r() * 2.0 + 0.5) as f32,
            };
            let want = erf(x as f64) as f32;
            let got = erf_lane(x);
            worst = worst.max(ulps(got, want));
        }
        assert!(worst <= 1, "erf: {worst} ulp");
        for v in [0.0f32, -0.0, 1e-40, -1e-40, 1.0, -1.0, 4.0, -4.0, 3.99] {
            let (got, want) = (erf_lane(v), erf(v as f64) as f32);
            assert!(ulps(got, want) <= 1, "erf({v}) = {got}, want {want}");
            assert_eq!(got.is_sign_negative(), v.is_sign_negative());
        }
        assert_eq!(erf_lane(f32::INFINITY), 1.0);
        assert_eq!(erf_lane(f32::NEG_INFINITY), -1.0);
        assert!(erf_lane(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_lane_matches_the_f64_definition() {
        let mut r = rng(7);
        // GELU against the float64 chain: within 2^-22 (1 + |x|).
        for i in 0..100_000 {
            let x = (r() * 20.0 - 10.0) as f32 * if i % 2 == 0 { 1.0 } else { 0.1 };
            let d = x as f64;
            let want = d * (1.0 + erf(d / std::f64::consts::SQRT_2)) * 0.5;
            let got = unary_lane(Unary::Gelu, x) as f64;
            assert!(
                (got - want).abs() <= 2f64.powi(-22) * (1.0 + d.abs()),
                "gelu({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn every_tier_gives_the_same_erf_and_gelu_bits() {
        let mut r = rng(3);
        let x: Vec<f32> = (0..4099).map(|_| (r() * 12.0 - 6.0) as f32).collect();
        let mut a = vec![MaybeUninit::new(0f32); x.len()];
        unary_slice(Unary::Erf, &x, &mut a);
        for (&v, y) in x.iter().zip(&a) {
            // SAFETY: every element was initialised (with 0, then by the kernel).
            let y = unsafe { y.assume_init() };
            assert_eq!(erf_lane(v).to_bits(), y.to_bits());
        }
        // GELU too: the vector loops give the scalar lane's bits (every multiply-add fused).
        let x: Vec<f32> = (0..4099).map(|_| (r() * 16.0 - 8.0) as f32).collect();
        unary_slice(Unary::Gelu, &x, &mut a);
        let mut b = x.clone();
        unary_inplace(Unary::Gelu, &mut b);
        for ((&v, y), &z) in x.iter().zip(&a).zip(&b) {
            // SAFETY: every element was initialised (with 0, then by the kernel).
            let y = unsafe { y.assume_init() };
            let want = ferrum_kernels::gemm::gelu_erf(v).to_bits();
            assert_eq!((want, want), (y.to_bits(), z.to_bits()), "gelu({v})");
        }
    }

    /// Timings of the kernels on the shapes of BERT / ViT / ResNet-50 (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn kernel_timings() {
        fn time(name: &str, elems: usize, mut f: impl FnMut()) {
            f();
            let mut best = f64::MAX;
            for _ in 0..20 {
                let t = std::time::Instant::now();
                f();
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{name:12} {:8.1} us {:6.3} ns/elem",
                best * 1e6,
                best * 1e9 / elems as f64
            );
        }
        let mut r = rng(1);
        let x: Vec<f32> = (0..160 * 3072).map(|_| (r() * 8.0 - 4.0) as f32).collect();
        let mut o = vec![MaybeUninit::new(0f32); x.len()];
        time("erf", x.len(), || unary_slice(Unary::Erf, &x, &mut o));
        time("gelu", x.len(), || unary_slice(Unary::Gelu, &x, &mut o));
        let mut g = x.clone();
        time("gelu inplace", x.len(), || {
            unary_inplace(Unary::Gelu, &mut g)
        });
        time("relu", x.len(), || unary_slice(Unary::Relu, &x, &mut o));
        let y = x.clone();
        time("add", x.len(), || {
            bin_row(Bin::Add, Operand::Row(&x), Operand::Row(&y), &mut o)
        });
        let n = 12 * 197 * 197;
        time("softmax", n, || softmax_rows(&x[..n], &mut o[..n], 197));
        let n = 197 * 768;
        let sc = vec![1.5f32; 768];
        time("layernorm", n, || {
            layer_norm_rows(&x[..n], &mut o[..n], 1e-5, &sc, Some(&sc))
        });
        let g = PoolGeom {
            input: [112, 112],
            k: [3, 3],
            s: [2, 2],
            d: [1, 1],
            pad: [1, 1],
            out: [56, 56],
        };
        let xp: Vec<f32> = (0..64 * 112 * 112).map(|_| r() as f32).collect();
        let mut op = vec![f32::NEG_INFINITY; 64 * 56 * 56];
        time("maxpool", xp.len(), || maxpool_planes(&xp, &mut op, &g));
        let c: Vec<bool> = x.iter().map(|&v| v > 0.0).collect();
        time("where", x.len(), || {
            where_row(Pick::Row(&c), Pick::Row(&x), Pick::Scalar(0.0), &mut o)
        });
        let mut b = vec![MaybeUninit::new(false); x.len()];
        time("isnan", x.len(), || isnan_slice(&x, &mut b));
    }
}
