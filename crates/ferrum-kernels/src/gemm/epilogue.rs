//! The fused epilogue of [`super::gemm_ex`]: a bias and an activation applied to each tile of C
//! as its last K block is written.

/// An element-wise activation applied to `alpha * A B + beta * C + bias`.
///
/// [`Act::apply`] is the definition. All but GeluTanh are computed in f32 (and vectorised in
/// the AVX-512 and AVX2 kernels, bit for bit the same; Gelu by [`gelu_erf`], Sigmoid and SiLU
/// by [`sigmoid_f32`], within 4 and 5 ulp of the exact values); GeluTanh in f64, rounded once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    Identity,
    /// `x > 0 ? x : 0` (NaN gives 0).
    Relu,
    /// `y = x < lo ? lo : x`, then `y > hi ? hi : y` (NaN stays NaN).
    Clip {
        lo: f32,
        hi: f32,
    },
    /// `x >= 0 ? x : slope * x`.
    LeakyRelu(f32),
    /// `1 / (1 + exp(-x))`.
    Sigmoid,
    /// `clamp(alpha * x + beta, 0, 1)`.
    HardSigmoid {
        alpha: f32,
        beta: f32,
    },
    /// `x * clamp(x / 6 + 1 / 2, 0, 1)`.
    HardSwish,
    /// `x / (1 + exp(-x))`.
    Silu,
    /// `x / 2 * (1 + erf(x / sqrt 2))`.
    Gelu,
    /// `x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))`.
    GeluTanh,
}

impl Act {
    /// The activation of one value.
    pub fn apply(self, x: f32) -> f32 {
        let d = x as f64;
        match self {
            Act::Identity => x,
            Act::Relu => {
                if x > 0.0 {
                    x
                } else {
                    0.0
                }
            }
            Act::Clip { lo, hi } => {
                let y = if x < lo { lo } else { x };
                if y > hi {
                    hi
                } else {
                    y
                }
            }
            Act::LeakyRelu(s) => {
                if x >= 0.0 {
                    x
                } else {
                    s * x
                }
            }
            Act::Sigmoid => sigmoid_f32(x),
            Act::HardSigmoid { alpha, beta } => clamp01(alpha * x + beta),
            Act::HardSwish => x * clamp01(x * (1.0 / 6.0) + 0.5),
            Act::Silu => x * sigmoid_f32(x),
            Act::Gelu => gelu_erf(x),
            Act::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                (0.5 * d * (1.0 + (c * (d + 0.044715 * d * d * d)).tanh())) as f32
            }
        }
    }

    /// Whether the AVX-512 kernel applies it in registers.
    pub(crate) fn is_vector(self) -> bool {
        matches!(
            self,
            Act::Identity
                | Act::Relu
                | Act::Clip { .. }
                | Act::LeakyRelu(_)
                | Act::Gelu
                | Act::Sigmoid
                | Act::Silu
                | Act::HardSigmoid { .. }
                | Act::HardSwish
        )
    }
}

/// A bias added before the activation.
#[derive(Clone, Copy, Debug)]
pub enum Bias<'a> {
    None,
    /// One value per row of C (at least `m`).
    Row(&'a [f32]),
    /// One value per column of C (at least `n`).
    Col(&'a [f32]),
}

/// What [`super::gemm_ex`] applies to C: `act((x + residual) + bias)`, where `x` is the product
/// (plus C's old value where it accumulates).
#[derive(Clone, Copy, Debug)]
pub struct Epilogue<'a> {
    pub bias: Bias<'a>,
    pub act: Act,
    /// A matrix of C's shape and row stride (`ldc`): a residual connection fused into the
    /// product that feeds it (f32 products only). It joins the sum where C's old value would
    /// (with the first block of K, before the bias), so a product with this residual and one
    /// accumulating (`beta` 1) into a C that holds it give the same bits: a caller that owns
    /// the residual's memory can write the output there.
    pub residual: Option<&'a [f32]>,
}

impl Epilogue<'_> {
    /// No bias, identity activation: plain `alpha * A B + beta * C`.
    pub const NONE: Epilogue<'static> = Epilogue {
        bias: Bias::None,
        act: Act::Identity,
        residual: None,
    };

    pub(super) fn is_none(&self) -> bool {
        matches!(self.bias, Bias::None) && self.act == Act::Identity && self.residual.is_none()
    }
}

impl Default for Epilogue<'_> {
    fn default() -> Self {
        Epilogue::NONE
    }
}

/// `ln erfc(a / sqrt 2)` (= `ln 2 Phi(-a)`) on `0 <= a <= GELU_CUT` as a polynomial in
/// `t = a * (2 / GELU_CUT) - 1`, lowest power first: a least-squares Chebyshev fit of degree 11
/// (error 5.4e-8 of the logarithm, so of erfc relatively).
pub(crate) const GELU_Q: [f32; 12] = [
    -5.122_764,
    -8.392_377,
    -3.482_321_7,
    -0.127_057_72,
    0.054_062_296,
    -0.021_654_33,
    0.007_696_221,
    -0.002_255_248_4,
    5.043_924e-4,
    1.000_685_9e-4,
    -2.911_398_2e-4,
    1.297_959_5e-4,
];
/// Where [`gelu_erf`] stops evaluating: past it GELU is `x` (or 0 below), within 1.1e-7.
pub(crate) const GELU_CUT: f32 = 5.5;
/// Cephes' e^r on `|r| <= ln 2 / 2`: `1 + r + r^2 P(r)`, `P`'s highest power first.
pub const EXP_P: [f32; 6] = [
    1.987_569_2e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];
/// `1.5 * 2^23`: added to a float below 2^22 in magnitude, rounds it to an integer.
pub const ROUND_MAGIC: f32 = 12_582_912.0;
/// ln 2 in two parts (Cody-Waite), the first with trailing zero bits so `n * LN2_HI` is exact.
pub const LN2_HI: f32 = 0.693_359_4;
pub const LN2_LO: f32 = -2.121_944_4e-4;

/// GELU, erf form, `x Phi(x)` (`Phi` the normal distribution), in float32 throughout:
/// `E = erfc(|x| / sqrt 2) = e^(Q(|x|))` ([`GELU_Q`], then e^q by Cody-Waite reduction and
/// Cephes' polynomial), then `x E / 2` for negative x and `x - x E / 2` otherwise: no
/// cancellation on either side, so the negative tail keeps its relative accuracy (within 1e-5
/// down to -5.5) and the result is within `2^-22 (1 + |x|)` of the exact GELU everywhere
/// (`gelu_erf_matches_the_f64_definition`). Past `|x| = 5.5` it is `x`, or `-0` below (NaN at
/// -inf, as `x (1 + erf)/2` is). About 30 operations a value, every multiply-add fused, so the
/// AVX-512 GEMM epilogue's vector form gives the same bits.
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    let a = x.abs();
    let ac = if a < GELU_CUT { a } else { GELU_CUT };
    let t = ac.mul_add(2.0 / GELU_CUT, -1.0);
    let mut q = GELU_Q[11];
    for &c in GELU_Q[..11].iter().rev() {
        q = q.mul_add(t, c);
    }
    // e^q for q in [-18.2, 0]: n = round(q log2 e), r = q - n ln 2, e^r 2^n.
    let z = q.mul_add(std::f32::consts::LOG2_E, ROUND_MAGIC);
    let n = z - ROUND_MAGIC;
    let r = n.mul_add(-LN2_HI, q);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // z's low mantissa bits hold n (z and the magic constant share their exponent); 2^n's
    // exponent field is n + 127. Integer arithmetic on the bits, which vectorises (a float to
    // int conversion does not: Rust's saturating `as`).
    let nb = (z.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let e = y * f32::from_bits((nb.wrapping_add(127) << 23) as u32);
    let g = (0.5 * x) * e;
    let v = if x < 0.0 { g } else { x - g };
    if a > GELU_CUT {
        if x < 0.0 {
            x * 0.0
        } else {
            x
        }
    } else {
        v
    }
}

/// Below this [`exp_f32`] gives 0 (e^-87 is still a normal float32, 2^n stays a normal scale).
pub(crate) const EXP_LO: f32 = -87.0;
/// Above this [`exp_f32`] gives +inf (e^88.72 overflows float32).
pub(crate) const EXP_HI: f32 = 88.7;

/// e^(d + err) for a float32 `d` and a small correction `err` (the rounding error of the
/// subtraction that produced `d`, or 0): Cody-Waite reduction by ln 2, Cephes' degree-7
/// polynomial, scaling by 2^n through the exponent bits. Within 2 ulp of the true value for
/// `d` in [-87, 88.7]; 0 below, +inf above, NaN for NaN. Each multiply and add rounded on its
/// own (none fused), so the scalar code vectorises to the same bits with or without FMA, and
/// the AVX-512 and AVX2 epilogues' forms repeat it operation for operation.
#[inline(always)]
pub fn exp_f32(d: f32, err: f32) -> f32 {
    let c = if d < EXP_LO { EXP_LO } else { d };
    let c = if c > EXP_HI { EXP_HI } else { c };
    let z = c * std::f32::consts::LOG2_E + ROUND_MAGIC;
    let n = z - ROUND_MAGIC;
    let r = ((c - n * LN2_HI) + err) - n * LN2_LO;
    let r2 = r * r;
    let mut p = EXP_P[0];
    for &k in &EXP_P[1..] {
        p = p * r + k;
    }
    let y = p * r2 + r + 1.0;
    // z's low mantissa bits hold n + 2^22; the exponent field of 2^n is n + 127.
    let bits = (z.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let scale = f32::from_bits((bits.wrapping_add(127) << 23) as u32);
    let e = y * scale;
    let e = if d < EXP_LO { 0.0 } else { e };
    if d > EXP_HI {
        f32::INFINITY
    } else {
        e
    }
}

/// The logistic function in float32: `e = e^-|x|` by [`exp_f32`], then `1 / (1 + e)` for
/// `x >= 0` and `e * (1 / (1 + e))` below, so neither side overflows or loses its small values.
/// Within 4 ulp of the exact value (e within 2 ulp, one rounding for the sum, one for the
/// quotient and one for the product); 0 for `x` below about -87, NaN for NaN.
#[inline(always)]
pub fn sigmoid_f32(x: f32) -> f32 {
    let e = exp_f32(-x.abs(), 0.0);
    let s = 1.0 / (1.0 + e);
    if x >= 0.0 {
        s
    } else {
        e * s
    }
}

/// `clamp(v, 0, 1)` with NaN kept (a comparison with NaN is false both ways).
#[inline(always)]
pub fn clamp01(v: f32) -> f32 {
    let y = if v < 0.0 { 0.0 } else { v };
    if y > 1.0 {
        1.0
    } else {
        y
    }
}

/// The error function for `z >= 0` below 2.5: its Maclaurin series (terms fall below 1e-17 of
/// the sum well within 60 terms).
#[cfg(test)]
fn erf_series(z: f64) -> f64 {
    let z2 = z * z;
    let mut term = z; // z^(2n+1) (-1)^n / n!
    let mut sum = z;
    for n in 1..80 {
        term *= -z2 / n as f64;
        let t = term / (2 * n + 1) as f64;
        sum += t;
        if t.abs() < 1e-17 * sum.abs() {
            break;
        }
    }
    sum * std::f64::consts::FRAC_2_SQRT_PI
}

/// The complementary error function for `z >= 2.5`: the continued fraction
/// `exp(-z^2) / sqrt(pi) / (z + (1/2) / (z + 1 / (z + (3/2) / (z + ...))))`, evaluated from a
/// fixed depth upwards.
#[cfg(test)]
fn erfc_fraction(z: f64) -> f64 {
    let mut f = z;
    for n in (1..=120).rev() {
        f = z + (n as f64 / 2.0) / f;
    }
    (-z * z).exp() / (std::f64::consts::PI.sqrt() * f)
}

/// erf(z), accurate to about 1e-15.
#[cfg(test)]
pub(super) fn erf(z: f64) -> f64 {
    if z.is_nan() {
        return z;
    }
    let a = z.abs();
    let v = if a < 2.5 {
        erf_series(a)
    } else if a < 6.0 {
        1.0 - erfc_fraction(a)
    } else {
        1.0
    };
    v.copysign(z)
}

/// erfc(z) for `z >= 0` (relative accuracy kept for large z).
#[cfg(test)]
pub(super) fn erfc(z: f64) -> f64 {
    if z < 2.5 {
        1.0 - erf_series(z)
    } else if z < 27.0 {
        erfc_fraction(z)
    } else {
        0.0
    }
}
