//! Elementwise and row-wise operators of transformer layers, each computed the way llama.cpp's CPU
//! backend does (so our logits agree with it), with a plain f64 reference in the tests.

mod activation;
mod expf;
mod hadamard;
mod norm;
mod rope;

pub use activation::{geglu, geglu_portable, gelu_tanh, silu, swiglu, swiglu_oai, swiglu_portable};
pub use expf::{expf, expf_slice};
pub use hadamard::hadamard_inplace;
pub use norm::{rms_norm, rms_norm_inplace};
pub use rope::{RopeCache, RopeScaling, RopeStyle, Yarn};

/// `x[i] += y[i]`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "add: lengths differ");
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}

/// `x[i] *= s`.
pub fn scale_inplace(x: &mut [f32], s: f32) {
    for a in x.iter_mut() {
        *a *= s;
    }
}

/// Numerically stable softmax in place (f32 exponentials, f64 sum as llama.cpp's softmax does).
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_matches_f64_reference() {
        let x: Vec<f32> = (0..50)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 1.7)
            .collect();
        let mut y = x.clone();
        softmax_inplace(&mut y);
        let m = x
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
        let s: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
        for (a, &b) in y.iter().zip(&x) {
            let r = (b as f64 - m).exp() / s;
            assert!(a.is_finite() && (*a as f64 - r).abs() < 1e-6, "{a} vs {r}");
        }
    }
}
