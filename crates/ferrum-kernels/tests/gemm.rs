//! The blocked f32 GEMM against a float64 reference, on fresh random shapes (odd sizes, edges of
//! every block size, transposed and strided operands, alpha / beta), for every microkernel this
//! CPU runs and one to three threads.
//!
//! Tolerance: |got - want| <= 1e-5 * (sum over p of |alpha * a_ip * b_pj| + |beta * c_ij|) + 1e-30,
//! i.e. f32 rounding of a sum of k products (bounded by about k * 2^-24 of the absolute sum; the
//! blocked sums stay far below that). NaN never passes: the check is `err <= tol`.

use ferrum_kernels::gemm::{available_isas, gemm_ref, gemm_with, kc, Isa, Mat, MC};
use rand::{Rng, SeedableRng};

struct Case {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    alpha: f32,
    beta: f32,
}

fn run_case(rng: &mut impl Rng, c: &Case, isa: Isa, threads: usize) {
    let Case {
        m,
        n,
        k,
        ta,
        tb,
        alpha,
        beta,
    } = *c;
    // Leading dimensions with slack, so strides differ from the logical widths.
    let lda = if ta { m } else { k } + rng.gen_range(0..3);
    let ldb = if tb { k } else { n } + rng.gen_range(0..3);
    let ldc = n + rng.gen_range(0..3);
    let a: Vec<f32> = (0..lda * if ta { k } else { m })
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let b: Vec<f32> = (0..ldb * if tb { n } else { k })
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let c0: Vec<f32> = (0..ldc * m).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let av = if ta {
        Mat::transposed(&a, lda)
    } else {
        Mat::row_major(&a, lda)
    };
    let bv = if tb {
        Mat::transposed(&b, ldb)
    } else {
        Mat::row_major(&b, ldb)
    };
    let mut want = c0.clone();
    gemm_ref(m, n, k, alpha, av, bv, beta, &mut want, ldc);
    let mut got = c0.clone();
    gemm_with(isa, threads, m, n, k, alpha, av, bv, beta, &mut got, ldc);
    for i in 0..m {
        for j in 0..n {
            let abs: f64 = (0..k)
                .map(|p| {
                    let x = if ta { a[p * lda + i] } else { a[i * lda + p] };
                    let y = if tb { b[j * ldb + p] } else { b[p * ldb + j] };
                    (alpha as f64 * x as f64 * y as f64).abs()
                })
                .sum::<f64>()
                + if beta == 0.0 {
                    0.0
                } else {
                    (beta as f64 * c0[i * ldc + j] as f64).abs()
                };
            let tol = 1e-5 * abs + 1e-30;
            let (g, w) = (got[i * ldc + j] as f64, want[i * ldc + j] as f64);
            let err = (g - w).abs();
            assert!(
                err <= tol,
                "{isa:?} t{threads} m{m} n{n} k{k} ta{ta} tb{tb} alpha {alpha} beta {beta}: \
                 C[{i}][{j}] = {g}, want {w} (err {err:e}, tol {tol:e})"
            );
        }
        // Columns past n (the slack of ldc) are never written.
        for j in n..ldc {
            if i * ldc + j < got.len() {
                assert_eq!(got[i * ldc + j].to_bits(), c0[i * ldc + j].to_bits());
            }
        }
    }
}

fn random_dim(rng: &mut impl Rng, block: usize) -> usize {
    match rng.gen_range(0..4) {
        0 => rng.gen_range(1..8),
        1 => rng.gen_range(1..80),
        // Around a block edge.
        2 => (block as isize + rng.gen_range(-2..3)).max(1) as usize,
        _ => rng.gen_range(1..2 * block + 5),
    }
}

#[test]
fn random_shapes_match_the_f64_reference() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    for isa in available_isas() {
        for case in 0..40 {
            let c = Case {
                m: random_dim(&mut rng, MC),
                n: random_dim(&mut rng, 64),
                k: random_dim(&mut rng, kc()),
                ta: rng.gen(),
                tb: rng.gen(),
                alpha: if case % 5 == 0 { 0.75 } else { 1.0 },
                beta: [0.0, 1.0, -0.5][case % 3],
            };
            run_case(&mut rng, &c, isa, 1 + case % 3);
        }
    }
}

#[test]
fn large_threaded_shapes() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    for isa in available_isas() {
        for (m, n, k) in [
            (64, 3137, 147),
            (301, 67, 600),
            (129, 769, 513),
            (512, 49, 700),
        ] {
            let c = Case {
                m,
                n,
                k,
                ta: n == 49,
                tb: isa == Isa::Avx2,
                alpha: 1.0,
                beta: 0.0,
            };
            run_case(&mut rng, &c, isa, 2);
        }
    }
}

#[test]
fn beta_zero_ignores_nan_in_c_and_nan_inputs_propagate() {
    let (m, n, k) = (13, 37, 9);
    let a = vec![1f32; m * k];
    let mut b = vec![0.5f32; k * n];
    for isa in available_isas() {
        let mut c = vec![f32::NAN; m * n];
        gemm_with(
            isa,
            1,
            m,
            n,
            k,
            1.0,
            Mat::row_major(&a, k),
            Mat::row_major(&b, n),
            0.0,
            &mut c,
            n,
        );
        assert!(c.iter().all(|&v| v == 4.5), "{isa:?}");
        b[3 * n + 5] = f32::INFINITY;
        let mut za = a.clone();
        za[2 * k + 3] = 0.0; // 0 * inf is NaN in row 2, column 5
        gemm_with(
            isa,
            1,
            m,
            n,
            k,
            1.0,
            Mat::row_major(&za, k),
            Mat::row_major(&b, n),
            0.0,
            &mut c,
            n,
        );
        assert!(c[2 * n + 5].is_nan(), "{isa:?}");
        assert!(c[5] == f32::INFINITY, "{isa:?}");
        b[3 * n + 5] = 0.5;
    }
}

#[test]
fn fma_kernels_and_thread_counts_give_the_same_bits() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let (m, n, k) = (157, 203, 611);
    let a: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let b: Vec<f32> = (0..k * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut first: Option<Vec<f32>> = None;
    // The FMA kernels (the scalar one rounds each product).
    for isa in available_isas().into_iter().filter(|&i| i != Isa::Scalar) {
        for threads in [1, 2, 3] {
            let mut c = vec![0f32; m * n];
            gemm_with(
                isa,
                threads,
                m,
                n,
                k,
                1.0,
                Mat::row_major(&a, k),
                Mat::row_major(&b, n),
                0.0,
                &mut c,
                n,
            );
            match &first {
                None => first = Some(c),
                Some(f) => assert!(
                    f.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{isa:?} with {threads} threads differs"
                ),
            }
        }
    }
}
