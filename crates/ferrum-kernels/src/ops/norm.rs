//! RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * w.

/// Normalises each row of `x` (rows of `w.len()` elements) into `out`, then multiplies by `w`.
///
/// As in ggml: squares are taken in f32 and summed in f64, the mean is rounded to f32,
/// `scale = 1/sqrtf(mean + eps)`, `y = x * scale`, then a separate multiply by the weight.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(
        n > 0 && x.len().is_multiple_of(n) && out.len() == x.len(),
        "rms_norm: shapes differ"
    );
    for (xr, yr) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((y, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
            *y = (v * scale) * g;
        }
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    assert!(
        n > 0 && x.len().is_multiple_of(n),
        "rms_norm: shapes differ"
    );
    for xr in x.chunks_exact_mut(n) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = (*v * scale) * g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_reference_on_random_rows() {
        let mut seed = 0x9e3779b97f4a7c15u64 ^ std::process::id() as u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
        };
        let n = 96;
        let x: Vec<f32> = (0..3 * n).map(|_| rnd() as f32).collect();
        let w: Vec<f32> = (0..n).map(|_| rnd() as f32).collect();
        let mut y = vec![0.0; x.len()];
        rms_norm(&x, &w, 1e-5, &mut y);
        let mut z = x.clone();
        rms_norm_inplace(&mut z, &w, 1e-5);
        assert_eq!(y, z);
        for r in 0..3 {
            let row = &x[r * n..(r + 1) * n];
            let ms: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64;
            let s = 1.0 / (ms + 1e-5).sqrt();
            for i in 0..n {
                let want = row[i] as f64 * s * w[i] as f64;
                let got = y[r * n + i];
                assert!(got.is_finite() && (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()));
            }
        }
    }
}
