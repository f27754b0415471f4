//! [`gemm_ex`] (epilogues, packed operands), [`gemm_batch`] and the activations against the f64
//! reference [`gemm_ref`], on fresh random inputs each run, for every microkernel this CPU runs
//! and one to three threads.
//!
//! Tolerances: the product as in `tests/gemm.rs`, `|got - want| <= 1e-5 * (sum over p of
//! |alpha a_ip b_pj| + |beta c_ij| + |bias|)`; after an activation, 1.5 times that (every
//! activation here is 1.5-Lipschitz or better) plus 2^-22 of the result's size (its rounding).
//! A NaN passes only where the reference is NaN too.

use rand::{Rng, SeedableRng};

use super::*;

const ACTS: [Act; 10] = [
    Act::Identity,
    Act::Relu,
    Act::Clip { lo: -0.25, hi: 0.5 },
    Act::LeakyRelu(0.1),
    Act::Sigmoid,
    Act::HardSigmoid {
        alpha: 0.2,
        beta: 0.5,
    },
    Act::HardSwish,
    Act::Silu,
    Act::Gelu,
    Act::GeluTanh,
];

fn rng() -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(rand::random())
}

fn random_vec(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

/// A random dimension: tiny, small, around `block`, or up to twice it.
fn random_dim(rng: &mut impl Rng, block: usize) -> usize {
    match rng.gen_range(0..4) {
        0 => rng.gen_range(1..8),
        1 => rng.gen_range(1..80),
        2 => (block as isize + rng.gen_range(-2..3)).max(1) as usize,
        _ => rng.gen_range(1..2 * block + 5),
    }
}

/// An `rows x cols` operand, row-major or transposed, with a leading dimension with slack.
struct Operand {
    data: Vec<f32>,
    ld: usize,
    transposed: bool,
}

impl Operand {
    fn new(rng: &mut impl Rng, rows: usize, cols: usize) -> Operand {
        let transposed = rng.gen();
        let ld = if transposed { rows } else { cols } + rng.gen_range(0..3);
        let data = random_vec(rng, ld * if transposed { cols } else { rows });
        Operand {
            data,
            ld,
            transposed,
        }
    }

    fn mat(&self) -> Mat<'_> {
        if self.transposed {
            Mat::transposed(&self.data, self.ld)
        } else {
            Mat::row_major(&self.data, self.ld)
        }
    }
}

struct Case {
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    beta: f32,
    /// 0: none, 1: row, 2: column.
    bias: usize,
    act: Act,
    packed_a: bool,
    packed_b: bool,
    /// Packed operands in bf16 (at least one packed): the reference takes both operands rounded.
    bf16: bool,
}

/// Checks `got` against `want` (the reference before the activation) elementwise, with `abs`
/// the absolute sums that bound the rounding.
#[allow(clippy::too_many_arguments)]
fn check(
    what: &str,
    m: usize,
    n: usize,
    ldc: usize,
    got: &[f32],
    pre: &[f64],
    abs: &[f64],
    act: Act,
) {
    for i in 0..m {
        for j in 0..n {
            let w = act.apply(pre[i * n + j] as f32) as f64;
            let g = got[i * ldc + j] as f64;
            let tol = 1.5 * 1e-5 * abs[i * n + j] + w.abs() * 2f64.powi(-22) + 1e-30;
            if w.is_nan() {
                assert!(g.is_nan(), "{what}: C[{i}][{j}] = {g}, want NaN");
                continue;
            }
            let err = (g - w).abs();
            assert!(
                err <= tol,
                "{what}: C[{i}][{j}] = {g}, want {w} (err {err:e}, tol {tol:e})"
            );
        }
    }
}

fn run_case(rng: &mut impl Rng, cs: &Case, isa: Isa, threads: usize) {
    let Case {
        m,
        n,
        k,
        alpha,
        beta,
        ..
    } = *cs;
    let a = Operand::new(rng, m, k);
    let b = Operand::new(rng, k, n);
    let ldc = n + rng.gen_range(0..3);
    let c0 = random_vec(rng, ldc * m);
    let bias_v = random_vec(rng, m.max(n));
    let bias = match cs.bias {
        1 => Bias::Row(&bias_v[..m]),
        2 => Bias::Col(&bias_v[..n]),
        _ => Bias::None,
    };
    // A residual (C's shape and row stride) in about a third of the f32 cases.
    let zv = (!cs.bf16 && rng.gen_bool(0.35)).then(|| random_vec(rng, ldc * m));
    let epi = Epilogue {
        bias,
        act: cs.act,
        residual: zv.as_deref(),
    };
    // The reference: f64 sums, then the bias and the residual, then (in `check`) the
    // activation.
    let mut pre = vec![0f64; m * n];
    let mut abs = vec![0f64; m * n];
    let (av, bv) = (a.mat(), b.mat());
    let round = |x: f32| {
        if cs.bf16 {
            crate::quant::blocks::bf16_bits_to_f32(crate::quant::blocks::f32_to_bf16_bits(x))
        } else {
            x
        }
    };
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut t) = (0f64, 0f64);
            for p in 0..k {
                let x = alpha as f64 * round(av.at(i, p)) as f64 * round(bv.at(p, j)) as f64;
                s += x;
                t += x.abs();
            }
            if beta != 0.0 {
                let o = beta as f64 * c0[i * ldc + j] as f64;
                s += o;
                t += o.abs();
            }
            let bb = match cs.bias {
                1 => bias_v[i] as f64,
                2 => bias_v[j] as f64,
                _ => 0.0,
            };
            let zz = zv.as_ref().map_or(0.0, |z| z[i * ldc + j] as f64);
            pre[i * n + j] = s + bb + zz;
            abs[i * n + j] = t + bb.abs() + zz.abs();
        }
    }
    let precision = if cs.bf16 {
        Precision::Bf16
    } else {
        Precision::F32
    };
    let pa = cs
        .packed_a
        .then(|| PackedA::with_precision(m, k, av, precision));
    let pb = (cs.packed_b || (cs.bf16 && !cs.packed_a))
        .then(|| PackedB::with_precision(k, n, bv, precision));
    let lhs = pa.as_ref().map_or(Lhs::Mat(av), Lhs::Packed);
    let rhs = pb.as_ref().map_or(Rhs::Mat(bv), Rhs::Packed);
    // C followed by a guard of 64 floats in the same allocation: a store past C's end (a tile
    // edge written unmasked) lands there, where it is seen.
    let guard = f32::from_bits(0x7fc0_1234);
    let mut with_guard = c0.clone();
    with_guard.extend(std::iter::repeat_n(guard, 64));
    gemm_ex_with(
        isa,
        threads,
        m,
        n,
        k,
        alpha,
        lhs,
        rhs,
        beta,
        &mut with_guard[..ldc * m],
        ldc,
        &epi,
    );
    assert!(
        with_guard[ldc * m..]
            .iter()
            .all(|g| g.to_bits() == guard.to_bits()),
        "a store past C's end"
    );
    let got = &with_guard[..ldc * m];
    let what = format!(
        "{isa:?} t{threads} m{m} n{n} k{k} ta{} tb{} alpha {alpha} beta {beta} bias {} {:?} \
         packed {} {} bf16 {} residual {}",
        a.transposed,
        b.transposed,
        cs.bias,
        cs.act,
        cs.packed_a,
        cs.packed_b,
        cs.bf16,
        zv.is_some()
    );
    check(&what, m, n, ldc, got, &pre, &abs, cs.act);
    // Columns past n (the slack of ldc) are never written.
    for i in 0..m {
        for j in n..ldc {
            assert_eq!(
                got[i * ldc + j].to_bits(),
                c0[i * ldc + j].to_bits(),
                "{what}"
            );
        }
    }
}

#[test]
fn gemm_ex_random_epilogues_and_packed_operands_match_the_f64_reference() {
    let mut rng = rng();
    for isa in available_isas() {
        for case in 0..60 {
            let c = Case {
                m: random_dim(&mut rng, MC),
                n: random_dim(&mut rng, 64),
                k: if case % 17 == 0 {
                    0
                } else {
                    random_dim(&mut rng, kc())
                },
                alpha: [1.0, 0.75, -1.5][case % 3],
                beta: [0.0, 1.0, -0.5][case % 4 % 3],
                bias: rng.gen_range(0..3),
                act: ACTS[rng.gen_range(0..ACTS.len())],
                packed_a: rng.gen(),
                packed_b: rng.gen(),
                bf16: false,
            };
            run_case(&mut rng, &c, isa, 1 + case % 3);
        }
    }
}

#[test]
fn convolution_epilogues_match_the_f64_reference() {
    // The epilogues a convolution or a linear layer asks for (a bias per row or column, a
    // residual, the identity, Relu or Clip), on products of whole and partial tiles (any
    // width), with K in one block or several (C then accumulated across the blocks before the
    // epilogue), plain and packed, so each kernel's epilogue runs in every combination.
    let mut rng = rng();
    let acts = [Act::Identity, Act::Relu, Act::Clip { lo: -0.25, hi: 0.5 }];
    for isa in available_isas() {
        for case in 0..48 {
            let c = Case {
                m: rng.gen_range(24..2 * MC),
                n: [64 * rng.gen_range(1..3), rng.gen_range(1..130)][case / 3 % 2],
                k: [rng.gen_range(1..kc()), rng.gen_range(kc() + 1..3 * kc())][case % 2],
                alpha: 1.0,
                beta: [0.0, 1.0][case / 2 % 2],
                bias: case / 4 % 3,
                act: acts[case / 12 % 3],
                packed_a: rng.gen(),
                packed_b: rng.gen(),
                bf16: false,
            };
            run_case(&mut rng, &c, isa, 1 + case % 2);
        }
    }
}

#[test]
fn bf16_products_match_the_f64_reference_on_rounded_operands() {
    if !bf16_supported() {
        eprintln!("skipped: this CPU (or FERRUM_NO_AVX512) runs no bf16 product");
        return;
    }
    let mut rng = rng();
    for case in 0..80 {
        let c = Case {
            m: random_dim(&mut rng, 40),
            n: random_dim(&mut rng, 40),
            k: if case % 17 == 0 {
                0
            } else {
                random_dim(&mut rng, 100)
            },
            alpha: [1.0, 0.75, -1.5][case % 3],
            beta: [0.0, 1.0, -0.5][case % 4 % 3],
            bias: rng.gen_range(0..3),
            act: ACTS[rng.gen_range(0..ACTS.len())],
            packed_a: rng.gen(),
            packed_b: rng.gen(),
            bf16: true,
        };
        run_case(&mut rng, &c, isa(), 1 + case % 3);
    }
    // Shapes that split across threads and blocks (and the tile unit's padding of k and rows).
    for &(m, n, k) in &[
        (97, 130, 300),
        (200, 33, 64),
        (16, 512, 31),
        (33, 17, 1),
        (20, 3000, 40),
    ] {
        let c = Case {
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            bias: 1,
            act: Act::Relu,
            packed_a: true,
            packed_b: false,
            bf16: true,
        };
        run_case(&mut rng, &c, isa(), 2);
        let c = Case {
            bias: 2,
            packed_a: false,
            packed_b: true,
            ..c
        };
        run_case(&mut rng, &c, isa(), 3);
    }
}

#[test]
fn gemm_ex_transposed_and_threaded_shapes() {
    let mut rng = rng();
    // Short wide-K products (computed transposed), threaded splits by rows, by columns and both,
    // and K spanning several blocks.
    let shapes = [
        (130, 100, 300),
        (300, 20, 300),
        (257, 49, 130),
        (97, 7, 513),
        (64, 777, 147),
        (301, 67, 600),
        (200, 150, 257),
    ];
    for isa in available_isas() {
        for (s, &(m, n, k)) in shapes.iter().enumerate() {
            // Four tasks: a 2 x 2 grid where the product allows.
            for threads in 1..=4 {
                let c = Case {
                    m,
                    n,
                    k,
                    alpha: if s % 2 == 0 { 1.0 } else { 0.5 },
                    beta: [0.0, 1.0, 2.0, 0.0][threads - 1],
                    bias: (s + threads) % 3,
                    act: ACTS[(s * 3 + threads) % ACTS.len()],
                    packed_a: (s + threads) % 2 == 0,
                    packed_b: s % 3 == 0,
                    bf16: false,
                };
                run_case(&mut rng, &c, isa, threads);
            }
        }
    }
}

#[test]
fn vector_activations_give_the_bits_of_act_apply() {
    // The kernels' activations (vectorised or not, C stored directly or transposed) against the
    // scalar definition, on biases full of NaN, infinities, signed zeros, values at the clip
    // bounds and at the exponential's.
    let mut rng = rng();
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        -0.25,
        0.5,
        1e30,
        -1e30,
        // The exponential's clamps and overflow (-87, 88.7), HardSwish's knees, a subnormal.
        -87.5,
        -86.9,
        88.5,
        89.0,
        -3.0,
        3.0,
        1e-40,
    ];
    // (29, 77): direct; (150, 20): computed transposed.
    for (m, n, k) in [(29, 77, 40), (150, 20, 40)] {
        let a = random_vec(&mut rng, m * k);
        let b = random_vec(&mut rng, k * n);
        let bias: Vec<f32> = (0..m.max(n))
            .map(|j| {
                if j % 3 == 0 {
                    specials[j / 3 % specials.len()]
                } else {
                    rng.gen_range(-2.0..2.0)
                }
            })
            .collect();
        let (av, bv) = (Mat::row_major(&a, k), Mat::row_major(&b, n));
        for isa in available_isas() {
            for by_row in [false, true] {
                let bias = if by_row {
                    Bias::Row(&bias[..m])
                } else {
                    Bias::Col(&bias[..n])
                };
                let mut plain = vec![0f32; m * n];
                let with_bias = Epilogue {
                    bias,
                    act: Act::Identity,
                    residual: None,
                };
                gemm_ex_with(
                    isa,
                    1,
                    m,
                    n,
                    k,
                    1.0,
                    Lhs::Mat(av),
                    Rhs::Mat(bv),
                    0.0,
                    &mut plain,
                    n,
                    &with_bias,
                );
                for act in ACTS {
                    let mut fused = vec![0f32; m * n];
                    gemm_ex_with(
                        isa,
                        2,
                        m,
                        n,
                        k,
                        1.0,
                        Lhs::Mat(av),
                        Rhs::Mat(bv),
                        0.0,
                        &mut fused,
                        n,
                        &Epilogue {
                            bias,
                            act,
                            residual: None,
                        },
                    );
                    for (i, (&p, &f)) in plain.iter().zip(&fused).enumerate() {
                        let w = act.apply(p);
                        assert!(
                            w.to_bits() == f.to_bits() || (w.is_nan() && f.is_nan()),
                            "{isa:?} m{m} n{n} {act:?} row bias {by_row} at {i}: {f} != \
                             apply({p}) = {w}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn packed_operands_give_the_bits_of_plain_views() {
    let mut rng = rng();
    for isa in available_isas() {
        for &(m, n, k) in &[
            (37, 300, 301),
            (250, 33, 90),
            (13, 5, 7),
            (130, 200, 520),
            (301, 24, 144),
            (97, 16, 600),
            (61, 150, 40),
        ] {
            let a = Operand::new(&mut rng, m, k);
            let b = Operand::new(&mut rng, k, n);
            let (av, bv) = (a.mat(), b.mat());
            let (pa, pb) = (PackedA::new(m, k, av), PackedB::new(k, n, bv));
            let mut want = vec![0f32; m * n];
            gemm_ex_with(
                isa,
                1,
                m,
                n,
                k,
                0.5,
                Lhs::Mat(av),
                Rhs::Mat(bv),
                0.0,
                &mut want,
                n,
                &Epilogue::NONE,
            );
            for (threads, lhs, rhs) in [
                (1, Lhs::Packed(&pa), Rhs::Mat(bv)),
                (2, Lhs::Mat(av), Rhs::Packed(&pb)),
                (3, Lhs::Packed(&pa), Rhs::Packed(&pb)),
            ] {
                let mut got = vec![f32::NAN; m * n];
                gemm_ex_with(
                    isa,
                    threads,
                    m,
                    n,
                    k,
                    0.5,
                    lhs,
                    rhs,
                    0.0,
                    &mut got,
                    n,
                    &Epilogue::NONE,
                );
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{isa:?} m{m} n{n} k{k} t{threads}: packed operands change the result"
                );
            }
        }
    }
}

#[test]
fn a_filter_packed_for_its_product_keeps_the_bits_in_one_layout() {
    let mut rng = rng();
    // Two products that run as C^T = B^T A^T on every kernel, and two that do not.
    for &(m, n, k) in &[(250, 33, 90), (512, 49, 300), (40, 49, 70), (130, 200, 520)] {
        let a = Operand::new(&mut rng, m, k);
        let b = Operand::new(&mut rng, k, n);
        let (av, bv) = (a.mat(), b.mat());
        let run = |pa: &PackedA| {
            let mut c = vec![f32::NAN; m * n];
            gemm_ex(
                m,
                n,
                k,
                1.0,
                Lhs::Packed(pa),
                Rhs::Mat(bv),
                0.0,
                &mut c,
                n,
                &Epilogue::NONE,
            );
            c
        };
        let plain = PackedA::new(m, k, av);
        let fitted = PackedA::for_columns(m, k, av, Precision::F32, n);
        let (plain_bytes, fitted_bytes) = (plain.size_bytes(), fitted.size_bytes());
        let (want, got) = (run(&plain), run(&fitted));
        assert!(
            want.iter()
                .zip(&got)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "m{m} n{n} k{k}: the fitted layout changes the result"
        );
        let swapped = swaps(isa(), m, n);
        assert_eq!(swapped, m >= 250, "m{m} n{n}: the shapes' premise");
        // The plain operand gains B's panels on first use where the product swaps; the
        // fitted one is already in them.
        assert_eq!(plain.size_bytes() > plain_bytes, swapped, "m{m} n{n}");
        assert_eq!(fitted.size_bytes(), fitted_bytes, "m{m} n{n}: held twice");
    }
}

#[test]
fn packed_types_are_send_and_sync_and_take_empty_shapes() {
    fn is<T: Send + Sync + 'static>() {}
    is::<PackedA>();
    is::<PackedB>();
    let pa = PackedA::new(0, 5, Mat::row_major(&[], 5));
    let pb = PackedB::new(0, 3, Mat::row_major(&[], 3));
    assert_eq!((pa.m(), pa.k(), pb.k(), pb.n()), (0, 5, 0, 3));
    // k = 0: C = act(beta C + bias).
    let pa = PackedA::new(2, 0, Mat::row_major(&[], 0));
    let mut c = vec![1.0, -2.0, 3.0, -4.0, 5.0, -6.0];
    let epi = Epilogue {
        bias: Bias::Row(&[0.5, -0.5]),
        act: Act::Relu,
        residual: None,
    };
    gemm_ex(
        2,
        3,
        0,
        1.0,
        Lhs::Packed(&pa),
        Rhs::Packed(&pb),
        2.0,
        &mut c,
        3,
        &epi,
    );
    assert_eq!(c, [2.5, 0.0, 6.5, 0.0, 9.5, 0.0]);
}

#[test]
fn gemm_batch_matches_the_f64_reference() {
    let mut rng = rng();
    for isa in available_isas() {
        for case in 0..24 {
            let count = [0, 1, 2, 3, 5, 12][case % 6];
            let (m, n, k) = match case % 4 {
                0 => (128, 64, 128),
                1 => (
                    rng.gen_range(1..40),
                    rng.gen_range(1..70),
                    rng.gen_range(0..90),
                ),
                2 => (
                    rng.gen_range(1..200),
                    rng.gen_range(1..20),
                    rng.gen_range(1..300),
                ),
                _ => (
                    rng.gen_range(1..9),
                    rng.gen_range(1..9),
                    rng.gen_range(1..9),
                ),
            };
            let threads = 1 + case % 3;
            let alpha = if case % 2 == 0 { 1.0 } else { -0.5 };
            let a: Vec<Operand> = (0..count).map(|_| Operand::new(&mut rng, m, k)).collect();
            let b: Vec<Operand> = (0..count).map(|_| Operand::new(&mut rng, k, n)).collect();
            let mut got = vec![f32::NAN; count * m * n + 3];
            gemm_batch_with(
                isa,
                threads,
                count,
                m,
                n,
                k,
                alpha,
                &|i| a[i].mat(),
                &|i| b[i].mat(),
                &mut got,
            );
            for i in 0..count {
                let mut want = vec![0f32; m * n];
                gemm_ref(m, n, k, alpha, a[i].mat(), b[i].mat(), 0.0, &mut want, n);
                let (av, bv) = (a[i].mat(), b[i].mat());
                for r in 0..m {
                    for j in 0..n {
                        let abs: f64 = (0..k)
                            .map(|p| (alpha as f64 * av.at(r, p) as f64 * bv.at(p, j) as f64).abs())
                            .sum();
                        let (g, w) = (got[i * m * n + r * n + j] as f64, want[r * n + j] as f64);
                        let tol = 1e-5 * abs + 1e-30;
                        assert!(
                            (g - w).abs() <= tol,
                            "{isa:?} t{threads} batch {count} m{m} n{n} k{k}: product {i} \
                             C[{r}][{j}] = {g}, want {w}"
                        );
                    }
                }
            }
            // Past the batch, C is untouched.
            assert!(got[count * m * n..].iter().all(|v| v.is_nan()));
        }
    }
}

#[test]
fn activations_match_their_f64_definitions() {
    // erf / erfc against tabulated values (Abramowitz and Stegun; erfc(5) from mpmath).
    for (z, want) in [
        (0.0, 0.0),
        (0.1, 0.112_462_916_018_284_9),
        (0.5, 0.520_499_877_813_046_5),
        (1.0, 0.842_700_792_949_714_9),
        (2.0, 0.995_322_265_018_952_7),
        (2.5, 0.999_593_047_982_555),
        (3.0, 0.999_977_909_503_001_4),
        (-1.0, -0.842_700_792_949_714_9),
    ] {
        let got = epilogue::erf(z);
        assert!((got - want).abs() <= 1e-13, "erf({z}) = {got}, want {want}");
    }
    // The series and the continued fraction meet at 2.5.
    let (below, at) = (epilogue::erf(2.5 - 1e-12), epilogue::erf(2.5));
    assert!(
        (at - below).abs() <= 1e-14,
        "erf jumps at 2.5: {below} {at}"
    );
    for (z, want) in [
        (2.5, 4.069_520_174_449_59e-4),
        (3.0, 2.209_049_699_858_544e-5),
        (5.0, 1.537_459_794_428_035e-12),
        (10.0, 2.088_487_583_762_545e-45),
    ] {
        let got = epilogue::erfc(z);
        assert!(
            ((got - want) / want).abs() <= 1e-11,
            "erfc({z}) = {got:e}, want {want:e}"
        );
    }
    let g = |x: f32| Act::Gelu.apply(x) as f64;
    assert_eq!(g(0.0), 0.0);
    assert!((g(1.0) - 0.841_344_746_068_543).abs() <= 1e-7);
    // float32 GELU: relative accuracy 1e-5 in the negative tail (see `gelu_erf`).
    assert!((g(-3.0) / -0.004_049_694_094_890_3 - 1.0).abs() <= 1e-5);
    assert!((Act::GeluTanh.apply(1.0) - 0.841_192).abs() <= 1e-6);
    assert!((Act::Sigmoid.apply(2.0) - 0.880_797_1).abs() <= 1e-7);
    assert!((Act::Silu.apply(-1.0) - -0.268_941_43).abs() <= 1e-7);
    assert_eq!(Act::HardSwish.apply(1.0), 1.0 * (1.0 / 6.0 + 0.5) as f32);
    assert_eq!(Act::HardSwish.apply(-4.0), 0.0);
    assert_eq!(Act::Relu.apply(f32::NAN), 0.0);
    assert!(Act::Clip { lo: 0.0, hi: 6.0 }.apply(f32::NAN).is_nan());
    assert_eq!(Act::Clip { lo: 0.0, hi: 6.0 }.apply(7.0), 6.0);
    assert!(Act::Gelu.apply(f32::NAN).is_nan());
    assert!(Act::Sigmoid.apply(f32::NAN).is_nan());
}

#[test]
fn gemm_pack_writes_the_panel_layout() {
    // Every packing path (contiguous lanes, the transposing loops and the AVX-512 transpose,
    // strided) against the layout's definition, padding included.
    let mut rng = rng();
    for w in WIDTHS {
        for _ in 0..6 {
            let rows = rng.gen_range(1..3 * w);
            let kc = rng.gen_range(1..70);
            let x = Operand::new(&mut rng, rows, kc);
            let xv = x.mat();
            let strided = Mat {
                data: &x.data,
                rs: xv.rs * 2,
                cs: xv.cs * 2,
            };
            for (v, r) in [(xv, rows), (strided, rows / 2)] {
                if r == 0 || (r - 1) * v.rs + (kc - 1) * v.cs >= v.data.len() {
                    continue;
                }
                let mut out = vec![f32::NAN; r.next_multiple_of(w) * kc];
                pack(v, r, kc, w, &mut out);
                for q in 0..r.div_ceil(w) {
                    for p in 0..kc {
                        for l in 0..w {
                            let i = q * w + l;
                            let want = if i < r { v.at(i, p) } else { 0.0 };
                            let got = out[q * kc * w + p * w + l];
                            assert_eq!(got.to_bits(), want.to_bits(), "w{w} rows{r} kc{kc}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn gemm_split_plans_balance_the_tasks() {
    type K = Scalar;
    // Tall: rows; wide: columns; more tasks: ranges that cover the product.
    let s = plan_split::<K>(1000, 40, 50, 2, false, false);
    assert_eq!((s.tm, s.tn), (2, 1));
    let s = plan_split::<K>(40, 1000, 50, 2, false, false);
    assert_eq!((s.tm, s.tn), (1, 2));
    for (m, n) in [(512, 512), (9, 9), (24, 700)] {
        let s = plan_split::<K>(m, n, 64, 4, false, false);
        assert!(s.tm * s.tn <= 4 && s.per_m >= 1 && s.per_n >= 1);
        assert!(m.div_ceil(s.per_m) <= s.tm && n.div_ceil(s.per_n) <= s.tn);
    }
    // Ranges on a side packed ahead start on its panels.
    let s = plan_split::<K>(1001, 40, 50, 3, true, false);
    assert_eq!(s.per_m % K::MR, 0);
}

/// `gemm_ex_uninit` writes every element of C, with the bits `gemm_ex` gives at beta 0: C starts
/// as NaN (standing for whatever the memory held), so an element left unwritten fails; shapes
/// cover edge tiles, several K blocks, the transposed product, K = 0 and epilogues.
#[test]
fn gemm_into_uninitialised_c_writes_every_element_as_beta_zero() {
    let mut rng = rng();
    for &(m, n, k) in &[
        (37, 300, 301),
        (250, 33, 90),
        (13, 5, 7),
        (130, 200, 520),
        (512, 49, 300),
        (9, 11, 0),
    ] {
        let a = Operand::new(&mut rng, m, k);
        let b = Operand::new(&mut rng, k, n);
        let (av, bv) = (a.mat(), b.mat());
        let row = random_vec(&mut rng, m);
        let col = random_vec(&mut rng, n);
        let z = random_vec(&mut rng, m * n);
        for (bias, act, residual) in [
            (Bias::None, Act::Identity, None),
            (Bias::Row(&row), Act::Relu, None),
            (Bias::Col(&col), Act::Gelu, None),
            (Bias::Row(&row), Act::Relu, Some(&z[..])),
        ] {
            let epi = Epilogue {
                bias,
                act,
                residual,
            };
            let mut want = vec![0f32; m * n];
            gemm_ex(
                m,
                n,
                k,
                0.5,
                Lhs::Mat(av),
                Rhs::Mat(bv),
                0.0,
                &mut want,
                n,
                &epi,
            );
            let mut got = vec![MaybeUninit::new(f32::NAN); m * n];
            gemm_ex_uninit(m, n, k, 0.5, Lhs::Mat(av), Rhs::Mat(bv), &mut got, n, &epi);
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                // SAFETY: every element was initialised (to NaN) before the call.
                let g = unsafe { g.assume_init() };
                assert_eq!(
                    w.to_bits(),
                    g.to_bits(),
                    "m{m} n{n} k{k} {act:?}: element {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// A product with a residual in its epilogue and the same product accumulated (`beta` 1) into a
/// C that holds the residual give the same bits (what lets a caller that owns the residual's
/// memory write the output there): every ISA, one and two threads, several K blocks (K past
/// `kc()`, 768 or 384), edge tiles, the transposed (short) product, row and column biases, Relu
/// and GELU, A packed ahead.
#[test]
fn a_residual_in_the_epilogue_gives_the_bits_of_accumulating_into_it() {
    let mut rng = rng();
    for &(m, n, k) in &[
        (37, 300, 301),
        (256, 196, 64),
        (130, 200, 1700),
        (512, 49, 1600),
        (13, 5, 7),
    ] {
        let a = Operand::new(&mut rng, m, k);
        let b = Operand::new(&mut rng, k, n);
        let (av, bv) = (a.mat(), b.mat());
        let (pa, pb) = (PackedA::new(m, k, av), PackedB::new(k, n, bv));
        let row = random_vec(&mut rng, m);
        let col = random_vec(&mut rng, n);
        let z = random_vec(&mut rng, m * n);
        for isa in available_isas() {
            for threads in [1, 2] {
                for (bias, act, lhs, rhs) in [
                    (Bias::Row(&row), Act::Relu, Lhs::Packed(&pa), Rhs::Mat(bv)),
                    (Bias::Col(&col), Act::Gelu, Lhs::Mat(av), Rhs::Mat(bv)),
                    (Bias::None, Act::Identity, Lhs::Mat(av), Rhs::Mat(bv)),
                    // A channels-last convolution's: activations by prepacked filters.
                    (Bias::Col(&col), Act::Relu, Lhs::Mat(av), Rhs::Packed(&pb)),
                ] {
                    let mut want = vec![f32::NAN; m * n];
                    let with_z = Epilogue {
                        bias,
                        act,
                        residual: Some(&z),
                    };
                    gemm_ex_with(
                        isa, threads, m, n, k, 0.5, lhs, rhs, 0.0, &mut want, n, &with_z,
                    );
                    let mut got = z.clone();
                    let without = Epilogue {
                        residual: None,
                        ..with_z
                    };
                    gemm_ex_with(
                        isa, threads, m, n, k, 0.5, lhs, rhs, 1.0, &mut got, n, &without,
                    );
                    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                        assert!(!w.is_nan(), "{isa:?} m{m} n{n} k{k}: element {i} is NaN");
                        assert_eq!(
                            w.to_bits(),
                            g.to_bits(),
                            "{isa:?} {threads} threads m{m} n{n} k{k} {act:?}: element {i}: \
                             {g} accumulated vs {w} with the residual"
                        );
                    }
                }
            }
        }
    }
}

/// A random convolution geometry for [`Patches`]: channels, input, kernel, stride, dilation,
/// leading padding and the output size it gives (padding the same on both sides).
#[allow(clippy::type_complexity)]
fn random_patches_geometry(
    rng: &mut impl Rng,
) -> (
    usize,
    [usize; 2],
    [usize; 2],
    [usize; 2],
    [usize; 2],
    [usize; 2],
    [usize; 2],
) {
    loop {
        let c = rng.gen_range(1..12);
        let k = [rng.gen_range(1..6), rng.gen_range(1..6)];
        let s = [rng.gen_range(1..4), rng.gen_range(1..4)];
        let d = [rng.gen_range(1..3), rng.gen_range(1..3)];
        let pad = [rng.gen_range(0..4), rng.gen_range(0..4)];
        let input = [rng.gen_range(1..40), rng.gen_range(1..70)];
        let mut out = [0; 2];
        let mut ok = true;
        for i in 0..2 {
            let span = input[i] + 2 * pad[i];
            let ek = (k[i] - 1) * d[i] + 1;
            if span < ek || pad[i] >= ek {
                ok = false;
                break;
            }
            out[i] = (span - ek) / s[i] + 1;
        }
        if ok {
            return (c, input, k, s, d, pad, out);
        }
    }
}

#[test]
fn patches_pack_the_panel_layout_of_their_definition() {
    // The implicit im2col packer against `Patches::at` (checked against a direct convolution
    // below), for every panel width, random origins, lengths and padding lanes.
    let mut rng = rng();
    for w in WIDTHS {
        for _ in 0..20 {
            let (c, input, k, s, d, pad, out) = random_patches_geometry(&mut rng);
            let x = random_vec(&mut rng, c * input[0] * input[1]);
            let p = Patches::new(&x, c, input, k, s, d, pad, out);
            let (rows, cols) = (p.rows(), p.cols());
            let j0 = rng.gen_range(0..cols);
            let r0 = rng.gen_range(0..rows);
            let n = rng.gen_range(1..=cols - j0);
            let kc = rng.gen_range(1..=rows - r0);
            let mut dst = vec![f32::NAN; n.next_multiple_of(w) * kc];
            patches::pack(&p, j0, r0, n, kc, w, &mut dst);
            for q in 0..n.div_ceil(w) {
                for st in 0..kc {
                    for l in 0..w {
                        let j = q * w + l;
                        let want = if j < n { p.at(r0 + st, j0 + j) } else { 0.0 };
                        let got = dst[q * kc * w + st * w + l];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "w{w} {p:?} j0 {j0} r0 {r0} n {n} kc {kc}: panel {q} step {st} lane {l}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn products_with_patches_match_the_explicit_patch_matrix_and_a_direct_convolution() {
    // W (m x c*kh*kw) times the patches: bit for bit the product with the patch matrix written
    // out (every ISA, 1-3 threads, row counts that put the patches on either side of the
    // transposed product), and within the f32 tolerance of a direct f64 convolution.
    let mut rng = rng();
    for case in 0..24 {
        let (c, input, k, s, d, pad, out) = random_patches_geometry(&mut rng);
        let x = random_vec(&mut rng, c * input[0] * input[1]);
        let p = Patches::new(&x, c, input, k, s, d, pad, out);
        let (kk, n) = (p.rows(), p.cols());
        let m = match case % 3 {
            0 => rng.gen_range(1..20),
            1 => rng.gen_range(20..90),
            _ => 2 * n + rng.gen_range(1..40),
        };
        let w = random_vec(&mut rng, m * kk);
        let explicit: Vec<f32> = (0..kk * n).map(|i| p.at(i / n, i % n)).collect();
        // Direct convolution in f64: every output sums its window's taps.
        let mut direct = vec![0f64; m * n];
        let mut scale = vec![0f64; m * n];
        for (o, (dv, sv)) in direct.iter_mut().zip(scale.iter_mut()).enumerate() {
            let (row, j) = (o / n, o % n);
            let (oy, ox) = (j / out[1], j % out[1]);
            for ch in 0..c {
                for ky in 0..k[0] {
                    for kx in 0..k[1] {
                        let iy = (oy * s[0] + ky * d[0]) as isize - pad[0] as isize;
                        let ix = (ox * s[1] + kx * d[1]) as isize - pad[1] as isize;
                        if iy < 0 || ix < 0 || iy >= input[0] as isize || ix >= input[1] as isize {
                            continue;
                        }
                        let xv = x[(ch * input[0] + iy as usize) * input[1] + ix as usize] as f64;
                        let wv = w[row * kk + (ch * k[0] + ky) * k[1] + kx] as f64;
                        *dv += wv * xv;
                        *sv += (wv * xv).abs();
                    }
                }
            }
        }
        for isa in available_isas() {
            let mut want = vec![0f32; m * n];
            gemm_ex_with(
                isa,
                1,
                m,
                n,
                kk,
                1.0,
                Lhs::Mat(Mat::row_major(&w, kk)),
                Rhs::Mat(Mat::row_major(&explicit, n)),
                0.0,
                &mut want,
                n,
                &Epilogue::NONE,
            );
            for threads in 1..=3 {
                let mut got = vec![f32::NAN; m * n];
                gemm_ex_with(
                    isa,
                    threads,
                    m,
                    n,
                    kk,
                    1.0,
                    Lhs::Mat(Mat::row_major(&w, kk)),
                    Rhs::Patches(&p),
                    0.0,
                    &mut got,
                    n,
                    &Epilogue::NONE,
                );
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        e.to_bits(),
                        "{isa:?} t{threads} m{m} {p:?}: output {i} {g} vs explicit {e}"
                    );
                    let tol = 1e-5 * scale[i] + 1e-30;
                    assert!(
                        (*g as f64 - direct[i]).abs() <= tol,
                        "{isa:?} t{threads} m{m} {p:?}: output {i} {g} vs direct {}",
                        direct[i]
                    );
                }
            }
        }
    }
}

/// The exact GELU, `x (1 + erf(x / sqrt 2)) / 2`, in f64 (erfc for negative x: no cancellation).
fn gelu_f64(x: f64) -> f64 {
    let z = x * std::f64::consts::FRAC_1_SQRT_2;
    let s = if z < 0.0 {
        epilogue::erfc(-z)
    } else {
        1.0 + epilogue::erf(z)
    };
    0.5 * x * s
}

#[test]
fn gelu_erf_matches_the_f64_definition() {
    // Fresh random inputs over the whole useful range and beyond, plus every float32 in a few
    // narrow windows (around 0, the cut at 5.5, and the middle of the fit).
    let mut rng = rng();
    let mut xs: Vec<f32> = (0..400_000)
        .map(|i| {
            let w = [0.1, 1.0, 3.0, 8.0, 100.0][i % 5];
            rng.gen_range(-w..w)
        })
        .collect();
    for c in [0f32, 5.5, -5.5, 1.7, -1.7] {
        let mut v = c;
        for _ in 0..20_000 {
            xs.push(v);
            v = f32::from_bits(v.to_bits().wrapping_add(1));
        }
    }
    let (mut worst_abs, mut worst_rel) = (0f64, 0f64);
    for &x in &xs {
        let d = x as f64;
        let (got, want) = (gelu_erf(x) as f64, gelu_f64(d));
        assert!(got.is_finite(), "gelu({x}) = {got}");
        let err = (got - want).abs();
        worst_abs = worst_abs.max(err / (1.0 + d.abs()));
        assert!(
            err <= 2f64.powi(-22) * (1.0 + d.abs()),
            "gelu({x}) = {got:e}, want {want:e}"
        );
        if (-5.5..0.0).contains(&d) && want != 0.0 {
            let rel = err / want.abs();
            worst_rel = worst_rel.max(rel);
            assert!(
                rel <= 1e-5,
                "gelu({x}) = {got:e}, want {want:e} (relative {rel:e})"
            );
        }
    }
    eprintln!(
        "gelu_erf: worst |error| / (1 + |x|) {worst_abs:e}, worst relative below 0 {worst_rel:e}"
    );
    assert_eq!(gelu_erf(0.0), 0.0);
    assert_eq!(gelu_erf(f32::INFINITY), f32::INFINITY);
    assert!(gelu_erf(f32::NEG_INFINITY).is_nan());
    assert!(gelu_erf(f32::NAN).is_nan());
    assert_eq!(gelu_erf(1e30), 1e30);
    assert_eq!(gelu_erf(-1e30), 0.0);
    assert!(gelu_erf(-1e30).is_sign_negative());
}
