//! The fused epilogue of [`super::gemm_ex`]: a bias and an activation applied to each tile of C
//! as its last K block is written.

/// An element-wise activation applied to `alpha * A B + beta * C + bias`.
///
/// [`Act::apply`] is the definition. Identity, Relu, Clip and LeakyRelu are computed in f32 (and
/// vectorised in the AVX-512 kernel, bit for bit the same); the others in f64, rounded once.
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
            Act::Sigmoid => (1.0 / (1.0 + (-d).exp())) as f32,
            Act::HardSigmoid { alpha, beta } => {
                (alpha as f64 * d + beta as f64).clamp(0.0, 1.0) as f32
            }
            Act::HardSwish => (d * (d / 6.0 + 0.5).clamp(0.0, 1.0)) as f32,
            Act::Silu => (d / (1.0 + (-d).exp())) as f32,
            Act::Gelu => {
                let z = d * std::f64::consts::FRAC_1_SQRT_2;
                // 1 + erf(z) = erfc(-z): no cancellation for negative z.
                let s = if z < 0.0 { erfc(-z) } else { 1.0 + erf(z) };
                (0.5 * d * s) as f32
            }
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
            Act::Identity | Act::Relu | Act::Clip { .. } | Act::LeakyRelu(_)
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

/// What [`super::gemm_ex`] applies to each finished tile of C: `act((x + bias) + residual)`.
#[derive(Clone, Copy, Debug)]
pub struct Epilogue<'a> {
    pub bias: Bias<'a>,
    pub act: Act,
    /// A matrix of C's shape and row stride (`ldc`) added after the bias, before the activation:
    /// a residual connection fused into the product that feeds it (f32 products only).
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

/// The error function for `z >= 0` below 2.5: its Maclaurin series (terms fall below 1e-17 of
/// the sum well within 60 terms).
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
fn erfc_fraction(z: f64) -> f64 {
    let mut f = z;
    for n in (1..=120).rev() {
        f = z + (n as f64 / 2.0) / f;
    }
    (-z * z).exp() / (std::f64::consts::PI.sqrt() * f)
}

/// erf(z), accurate to about 1e-15.
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
pub(super) fn erfc(z: f64) -> f64 {
    if z < 2.5 {
        1.0 - erf_series(z)
    } else if z < 27.0 {
        erfc_fraction(z)
    } else {
        0.0
    }
}
