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

/// ggml evaluates GELU through a table indexed by the f16 bits of the input, holding f16 results
/// (`GGML_GELU_FP16`); we do the same so Gemma's activations round where llama.cpp's do.
fn gelu_table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_tanh(f16::from_bits(bits).to_f32())))
            .collect()
    })
}

#[inline]
fn gelu_ggml(table: &[f16], x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        table[f16::from_f32(x).to_bits() as usize].to_f32()
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: lengths differ");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `gate[i] = gelu(gate[i]) * up[i]`, GELU as ggml tabulates it.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "geglu: lengths differ");
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_ggml(table, *g) * u;
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
