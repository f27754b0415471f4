//! The orthonormal Walsh-Hadamard rotation llama.cpp applies around a quantized KV cache (its
//! `attn_rot_k` / `attn_rot_v`): Q and K, and V, are rotated before K and V are quantized, which
//! spreads an outlier over the whole group so that block quantization loses less; Q·K is
//! unchanged (the rotation is orthonormal) and the attention output is rotated back (H·H = I).
//! Computed as ggml's `ggml_compute_forward_fwht`: each value times 1/√n (an f32), then the
//! butterflies u + v, u − v with spans 1, 2, 4, ..., n/2.

/// Rotates every run of `n` consecutive values of `x` (n a power of two dividing `x.len()`) by
/// the n×n normalised Hadamard matrix (Sylvester order). Applying it twice restores `x` (up to
/// rounding).
///
/// # Panics
/// If `n` is not a power of two or does not divide `x.len()`.
pub fn hadamard_inplace(x: &mut [f32], n: usize) {
    assert!(
        n.is_power_of_two() && x.len().is_multiple_of(n),
        "hadamard: {} values in runs of {n}",
        x.len()
    );
    let scale = 1.0f32 / (n as f32).sqrt();
    for run in x.chunks_exact_mut(n) {
        for v in run.iter_mut() {
            *v *= scale;
        }
        let mut len = 1;
        while len < n {
            for pair in run.chunks_exact_mut(2 * len) {
                let (lo, hi) = pair.split_at_mut(len);
                for (u, v) in lo.iter_mut().zip(hi.iter_mut()) {
                    let (a, b) = (*u, *v);
                    *u = a + b;
                    *v = a - b;
                }
            }
            len *= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Against the n×n matrix H[i][j] = (−1)^popcount(i & j) / √n in f64, on fresh random rows:
    /// within 4·log2(n)·2^-24·Σ|x| per output, and H applied twice gives x back.
    #[test]
    fn matches_the_matrix_and_is_its_own_inverse() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for n in [64usize, 128, 256] {
            let x: Vec<f32> = (0..3 * n).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
            let mut y = x.clone();
            hadamard_inplace(&mut y, n);
            for (xr, yr) in x.chunks_exact(n).zip(y.chunks_exact(n)) {
                let mag: f64 = xr.iter().map(|v| v.abs() as f64).sum::<f64>() / (n as f64).sqrt();
                let tol = 4.0 * (n.trailing_zeros() as f64 + 1.0) * f32::EPSILON as f64 * mag;
                for (i, &got) in yr.iter().enumerate() {
                    let want: f64 = xr
                        .iter()
                        .enumerate()
                        .map(|(j, &v)| {
                            let s = if (i & j).count_ones() % 2 == 0 {
                                1.0
                            } else {
                                -1.0
                            };
                            s * v as f64
                        })
                        .sum::<f64>()
                        / (n as f64).sqrt();
                    assert!(
                        got.is_finite() && (got as f64 - want).abs() <= tol,
                        "seed {seed}: n={n} out {i}: {got} vs {want} (tol {tol:e})"
                    );
                }
            }
            let mut back = y.clone();
            hadamard_inplace(&mut back, n);
            for (a, b) in back.iter().zip(&x) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "seed {seed}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "hadamard")]
    fn refuses_a_run_that_is_not_a_power_of_two() {
        hadamard_inplace(&mut [0.0; 96], 96);
    }
}
