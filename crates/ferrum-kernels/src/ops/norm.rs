//! RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * w.

/// Normalises each row of `x` (rows of `w.len()` elements) into `out`, then multiplies by `w`.
///
/// As in ggml: squares are taken in f32 and summed in f64, element after element, the mean is
/// rounded to f32, `scale = 1/sqrtf(mean + eps)`, `y = x * scale`, then a separate multiply by
/// the weight.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(
        n > 0 && x.len().is_multiple_of(n) && out.len() == x.len(),
        "rms_norm: shapes differ"
    );
    out.copy_from_slice(x);
    rms_norm_inplace(out, w, eps);
}

/// Rows per task of a parallel [`rms_norm_inplace`] (and rows whose sums run interleaved).
const ROWS_PER_TASK: usize = 16;
/// Below this many elements a call runs on the calling thread alone.
const PARALLEL_MIN: usize = 1 << 15;

/// [`rms_norm`] in place. A row's sum is one chain of dependent f64 adds (ggml's order), so four
/// rows' chains run interleaved, and large calls (a prompt) split their rows across the pool.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    assert!(
        n > 0 && x.len().is_multiple_of(n),
        "rms_norm: shapes differ"
    );
    if x.len() >= PARALLEL_MIN && x.len() / n > 1 {
        crate::pool::parallel_chunks_mut(x, ROWS_PER_TASK * n, |_, xc| norm_rows(xc, w, eps));
    } else {
        norm_rows(x, w, eps);
    }
}

/// Normalises the rows of `x` in place: four at a time, then the rest one by one.
fn norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    let mut quads = x.chunks_exact_mut(4 * n);
    for q in quads.by_ref() {
        let mut s = [0f64; 4];
        for i in 0..n {
            for (r, sr) in s.iter_mut().enumerate() {
                let v = q[r * n + i];
                *sr += (v * v) as f64;
            }
        }
        for (r, row) in q.chunks_exact_mut(n).enumerate() {
            scale_row(row, w, s[r], eps);
        }
    }
    for row in quads.into_remainder().chunks_exact_mut(n) {
        let s: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        scale_row(row, w, s, eps);
    }
}

/// `row = (row * 1/sqrtf(mean + eps)) * w` with `mean = sum / n` rounded to f32.
fn scale_row(row: &mut [f32], w: &[f32], sum: f64, eps: f32) {
    let mean = (sum / w.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, &g) in row.iter_mut().zip(w) {
        *v = (*v * scale) * g;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's order, one row at a time: what the interleaved and parallel paths must equal.
    fn rms_norm_plain(x: &mut [f32], w: &[f32], eps: f32) {
        for row in x.chunks_exact_mut(w.len()) {
            let mut sum = 0f64;
            for &v in row.iter() {
                sum += (v * v) as f64;
            }
            let mean = (sum / w.len() as f64) as f32;
            let scale = 1.0 / (mean + eps).sqrt();
            for (v, &g) in row.iter_mut().zip(w) {
                *v = (*v * scale) * g;
            }
        }
    }

    /// Row counts around the 4-row groups and the 16-row tasks, rows long enough to take the
    /// parallel path: same bits as one row at a time.
    #[test]
    fn interleaved_and_parallel_rows_equal_one_row_at_a_time() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for &(rows, n) in &[(1, 64), (3, 7), (5, 640), (17, 2048), (70, 896), (513, 64)] {
            let x: Vec<f32> = (0..rows * n)
                .map(|_| rng.gen_range(-30.0f32..30.0))
                .collect();
            let w: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
            let mut want = x.clone();
            rms_norm_plain(&mut want, &w, 1e-6);
            let mut got = x.clone();
            rms_norm_inplace(&mut got, &w, 1e-6);
            let mut out = vec![f32::NAN; x.len()];
            rms_norm(&x, &w, 1e-6, &mut out);
            for (i, ((a, b), c)) in got.iter().zip(&want).zip(&out).enumerate() {
                assert!(
                    b.is_finite() && a.to_bits() == b.to_bits() && c.to_bits() == b.to_bits(),
                    "seed {seed}: {rows}x{n} element {i}: {a} / {c} vs {b}"
                );
            }
        }
    }

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
