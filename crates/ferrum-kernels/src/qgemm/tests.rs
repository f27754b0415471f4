//! [`qgemm`] against [`qgemm_ref`] on fresh random inputs each run (the seed is printed on
//! failure), for every kernel this CPU runs, one to three threads; integer outputs must be equal,
//! and so must the f32 ones (the same two roundings). The quantizer against its portable form,
//! NaN, infinities and halves included.

use rand::{Rng, SeedableRng};

use super::*;

/// Every (layout, kernel) pair this CPU runs: the portable kernel on two layouts, and each
/// layout's SIMD kernels where present.
fn kernels() -> Vec<(Layout, Kernel)> {
    let mut v = vec![
        (Layout::Quads, Kernel::Portable),
        (Layout::Pairs, Kernel::Portable),
    ];
    if cfg!(target_arch = "x86_64") && cpu::features().x86_simd() {
        v.push((Layout::Pairs, Kernel::Avx2));
    }
    if use_vnni() {
        v.push((Layout::Quads, Kernel::Vnni));
        v.push((Layout::Tiles, Kernel::Vnni));
    }
    if use_amx() {
        v.push((Layout::Tiles, Kernel::Amx));
    }
    v
}

#[derive(Debug)]
struct Case {
    m: usize,
    k: usize,
    n: usize,
    a: Vec<u8>,
    a_zero: Vec<i32>,
    b_signed: bool,
    b: Vec<u8>,
    b_zero: Vec<i32>,
    scale: Vec<f32>,
    bias: Option<Vec<f32>>,
}

fn random_case(rng: &mut impl Rng) -> Case {
    let dim = |rng: &mut dyn rand::RngCore, big: usize| match rng.gen_range(0..3) {
        0 => rng.gen_range(1..8),
        1 => rng.gen_range(1..big),
        _ => big + rng.gen_range(0..big),
    };
    // Rows up to 80: whole AMX blocks of 32 and the rows left over.
    let (m, k, n) = (dim(rng, 40), dim(rng, 70), dim(rng, 150));
    let b_signed = rng.gen_bool(0.5);
    let a: Vec<u8> = (0..m * k).map(|_| rng.gen()).collect();
    let b: Vec<u8> = (0..k * n).map(|_| rng.gen()).collect();
    let a_zero = if rng.gen_bool(0.3) {
        (0..m).map(|_| rng.gen_range(0..256)).collect()
    } else {
        vec![rng.gen_range(0..256)]
    };
    let zb = |rng: &mut dyn rand::RngCore| {
        if b_signed {
            rng.gen_range(-128..128)
        } else {
            rng.gen_range(0..256)
        }
    };
    let b_zero = match rng.gen_range(0..3) {
        0 => vec![0],
        1 => vec![zb(rng)],
        _ => (0..n).map(|_| zb(rng)).collect(),
    };
    let scale = if rng.gen_bool(0.5) {
        vec![rng.gen_range(1e-5..1e-2)]
    } else {
        (0..n).map(|_| rng.gen_range(1e-5..1e-2)).collect()
    };
    let bias = rng
        .gen_bool(0.5)
        .then(|| (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect());
    Case {
        m,
        k,
        n,
        a,
        a_zero,
        b_signed,
        b,
        b_zero,
        scale,
        bias,
    }
}

fn bytes(c: &Case) -> Vec<i8> {
    c.b.iter().map(|&v| v as i8).collect()
}

#[test]
fn qgemm_matches_reference() {
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..60 {
        let c = random_case(&mut rng);
        let signed = bytes(&c);
        let bsrc = if c.b_signed {
            Bytes::I8(&signed)
        } else {
            Bytes::U8(&c.b)
        };
        let (want_i, want_f) = qgemm_ref(
            c.m,
            c.k,
            c.n,
            &c.a,
            &c.a_zero,
            bsrc,
            &c.b_zero,
            Some((&c.scale, c.bias.as_deref())),
        );
        // B handed over transposed half the time (strides), A with a wider leading dimension.
        let packed = |layout| {
            if case % 2 == 0 {
                PackedI8::with_layout(c.k, c.n, bsrc, c.n, 1, layout)
            } else {
                let bt: Vec<u8> = (0..c.n * c.k)
                    .map(|e| c.b[(e % c.k) * c.n + e / c.k])
                    .collect();
                let bts: Vec<i8> = bt.iter().map(|&v| v as i8).collect();
                let src = if c.b_signed {
                    Bytes::I8(&bts)
                } else {
                    Bytes::U8(&bt)
                };
                PackedI8::with_layout(c.k, c.n, src, 1, c.k, layout)
            }
        };
        let lda = c.k + case % 3;
        let mut a = vec![0u8; c.m * lda];
        for i in 0..c.m {
            a[i * lda..i * lda + c.k].copy_from_slice(&c.a[i * c.k..(i + 1) * c.k]);
        }
        let qa = QuantA {
            data: &a,
            m: c.m,
            ld: lda,
            zero: &c.a_zero,
            zero_padded: false,
        };
        // Requantized outputs: scales such that the values spread over about +-150 steps.
        let big = want_f.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let scale8: Vec<f32> = c.scale.iter().map(|s| s * 150.0 / big).collect();
        let bias8: Option<Vec<f32>> = c
            .bias
            .as_ref()
            .map(|b| b.iter().map(|v| v * 150.0 / big).collect());
        let (_, want_y) = qgemm_ref(
            c.m,
            c.k,
            c.n,
            &c.a,
            &c.a_zero,
            bsrc,
            &c.b_zero,
            Some((&scale8, bias8.as_deref())),
        );
        let signed8 = case % 4 < 2;
        let zero8 = (case as i32 * 37) % 256 - if signed8 { 128 } else { 0 };
        // The rule written out: hold within +-65536 (NaN as +65536), round half to even, add
        // the zero point, clamp to the type.
        let want_q: Vec<u8> = want_y
            .iter()
            .map(|&y| {
                let y = if y.is_nan() {
                    65536.0
                } else {
                    y.clamp(-65536.0, 65536.0)
                };
                let r = y.round_ties_even() as i64 + zero8 as i64;
                if signed8 {
                    r.clamp(-128, 127) as i8 as u8
                } else {
                    r.clamp(0, 255) as u8
                }
            })
            .collect();
        for (layout, kernel) in kernels() {
            let packed = packed(layout);
            for threads in 1..=3 {
                pool::set_threads(Some(threads));
                let mut got = vec![i32::MIN; c.m * c.n];
                let out = QOut::I32 {
                    out: &mut got,
                    ld: c.n,
                };
                qgemm_on(qa, &packed, &c.b_zero, out, kernel);
                assert!(
                    got == want_i,
                    "seed {seed} case {case} {kernel:?} on {layout:?}, threads {threads}: i32 output \
                     differs ({}x{}x{}, b signed {}, zero points {:?} / {:?})",
                    c.m,
                    c.k,
                    c.n,
                    c.b_signed,
                    c.a_zero.len(),
                    c.b_zero.len()
                );
                let mut got = vec![f32::NAN; c.m * c.n];
                let out = QOut::F32 {
                    out: &mut got,
                    ld: c.n,
                    scale: &c.scale,
                    bias: c.bias.as_deref(),
                };
                qgemm_on(qa, &packed, &c.b_zero, out, kernel);
                let same = got
                    .iter()
                    .zip(&want_f)
                    .all(|(g, w)| g.to_bits() == w.to_bits());
                assert!(
                    same,
                    "seed {seed} case {case} {kernel:?} on {layout:?}, threads {threads}: f32 output \
                     differs"
                );
                // Row-major, or transposed (column j at j * m).
                let transposed = (case + threads) % 2 == 1;
                let (rs, cs) = if transposed { (1, c.m) } else { (c.n, 1) };
                let mut got = vec![0xA5u8; c.m * c.n];
                let out = QOut::Q8 {
                    out: &mut got,
                    rs,
                    cs,
                    scale: &scale8,
                    bias: bias8.as_deref(),
                    zero: zero8,
                    signed: signed8,
                };
                qgemm_on(qa, &packed, &c.b_zero, out, kernel);
                for i in 0..c.m {
                    for j in 0..c.n {
                        assert_eq!(
                            got[i * rs + j * cs],
                            want_q[i * c.n + j],
                            "seed {seed} case {case} {kernel:?} on {layout:?}, threads {threads}: \
                             8-bit output ({i}, {j}) differs (value {}, zero {zero8}, signed \
                             {signed8}, transposed {transposed})",
                            want_y[i * c.n + j]
                        );
                    }
                }
            }
        }
    }
    pool::set_threads(None);
}

#[test]
fn large_product_splits_rows_and_columns_alike() {
    // Big enough for the thread split (column blocks and row chunks, and A's widening and row
    // sums in chunks of rows), edges on both sides.
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (m, k, n) = (301, 516, 200);
    let a: Vec<u8> = (0..m * k).map(|_| rng.gen()).collect();
    let b: Vec<i8> = (0..k * n).map(|_| rng.gen()).collect();
    let (want, _) = qgemm_ref(m, k, n, &a, &[128], Bytes::I8(&b), &[3], None);
    for (layout, kernel) in kernels() {
        let packed = PackedI8::with_layout(k, n, Bytes::I8(&b), n, 1, layout);
        for threads in [1, 2, 4] {
            pool::set_threads(Some(threads));
            let mut got = vec![0; m * n];
            qgemm_on(
                QuantA {
                    data: &a,
                    m,
                    ld: k,
                    zero: &[128],
                    zero_padded: false,
                },
                &packed,
                &[3],
                QOut::I32 {
                    out: &mut got,
                    ld: n,
                },
                kernel,
            );
            assert!(got == want, "seed {seed} {kernel:?} threads {threads}");
        }
    }
    pool::set_threads(None);
}

#[test]
fn quantizer_matches_portable_form_and_reference_rule() {
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..40 {
        let n = rng.gen_range(0..300);
        let spread = [1e-3f32, 1.0, 100.0][case % 3];
        let mut x: Vec<f32> = (0..n).map(|_| rng.gen_range(-spread..spread)).collect();
        if n > 10 && case % 4 == 0 {
            x[1] = f32::NAN;
            x[2] = f32::INFINITY;
            x[3] = f32::NEG_INFINITY;
            x[4] = -0.0;
        }
        let (lo, hi) = x
            .iter()
            .fold((0f32, 0f32), |(a, b), &v| (a.min(v), b.max(v)));
        let scale = if hi == lo { 1.0 } else { hi - lo } / 255.0;
        let zp = (0.0 - lo / scale).clamp(0.0, 255.0).round_ties_even();
        // Halves: values that land exactly between two steps.
        if n > 20 {
            x[10] = 2.5 * scale;
            x[11] = -3.5 * scale;
        }
        let mut want = vec![0u8; n];
        quantize_u8_portable(&x, scale, zp, &mut want);
        for (i, (&w, &v)) in want.iter().zip(&x).enumerate() {
            let r = ((v / scale).round_ties_even() + zp).clamp(0.0, 255.0);
            let r = if r.is_nan() { 0 } else { r as u8 };
            assert_eq!(w, r, "seed {seed} case {case} element {i}: {v}");
        }
        let mut got = vec![7u8; n];
        quantize_u8(&x, scale, zp, &mut got);
        assert_eq!(got, want, "seed {seed} case {case}");
    }
}

#[test]
fn zero_padded_rows_give_the_compact_rows_product() {
    // A's rows `kp` apart with zeros past k (an im2col written for the kernels) against the
    // same rows packed tight: the same exact products, on every kernel this CPU runs.
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..20 {
        let (m, k, n) = (
            rng.gen_range(1..80),
            rng.gen_range(1..200),
            rng.gen_range(1..70),
        );
        let a: Vec<u8> = (0..m * k).map(|_| rng.gen()).collect();
        let b: Vec<u8> = (0..k * n).map(|_| rng.gen()).collect();
        let packed = PackedI8::new(k, n, Bytes::U8(&b), n, 1);
        let kp = packed.kp();
        let mut wide = crate::aligned::Aligned::zeroed(m * kp);
        for i in 0..m {
            wide.bytes_mut()[i * kp..i * kp + k].copy_from_slice(&a[i * k..(i + 1) * k]);
        }
        let za = [rng.gen_range(0..256)];
        let product = |data: &[u8], ld: usize, zero_padded: bool| {
            let mut out = vec![0i32; m * n];
            qgemm(
                QuantA {
                    data,
                    m,
                    ld,
                    zero: &za,
                    zero_padded,
                },
                &packed,
                &[3],
                QOut::I32 {
                    out: &mut out,
                    ld: n,
                },
            );
            out
        };
        assert_eq!(
            product(wide.bytes(), kp, true),
            product(&a, k, false),
            "seed {seed} case {case}: {m} x {k} x {n}, kp {kp}"
        );
    }
}

#[test]
fn quantized_add_matches_the_chain() {
    // Every instruction set against the portable form (bit for bit), and that against an f64
    // evaluation of the chain: the two may differ by one step only where the float32 sum lies
    // within rounding of a half.
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..40 {
        let n = rng.gen_range(0..200);
        let a: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        let b: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        let p = |rng: &mut rand::rngs::StdRng| {
            (
                rng.gen_range(0..=255u8) as f32,
                rng.gen_range(1e-3f32..0.2) * if case % 5 == 0 { 10.0 } else { 1.0 },
            )
        };
        let (pa, pb, pc) = (p(&mut rng), p(&mut rng), p(&mut rng));
        let mut want = vec![0u8; n];
        qadd_u8_portable(&a, pa, &b, pb, pc, &mut want);
        for i in 0..n {
            let v = (a[i] as f64 - pa.0 as f64) * pa.1 as f64
                + (b[i] as f64 - pb.0 as f64) * pb.1 as f64;
            let r = ((v / pc.1 as f64).round() + pc.0 as f64).clamp(0.0, 255.0);
            assert!(
                (r - want[i] as f64).abs() <= 1.0,
                "seed {seed} case {case} element {i}: {} vs {r}",
                want[i]
            );
        }
        let mut got = vec![7u8; n];
        qadd_u8(&a, pa, &b, pb, pc, &mut got);
        assert_eq!(got, want, "seed {seed} case {case}");
    }
}

#[test]
fn dynamic_quantizer_scale_and_zero_point() {
    pool::set_threads(Some(2));
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for n in [0usize, 5, 100, 70_001, 200_000] {
        let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0..5.0)).collect();
        let mut q = vec![0u8; n];
        let (s, z) = quantize_dynamic_u8(&x, &mut q);
        let (lo, hi) = x
            .iter()
            .fold((0f32, 0f32), |(a, b), &v| (a.min(v), b.max(v)));
        let want_s = if hi == lo { 1.0 } else { hi - lo } / 255.0;
        let want_z = (0.0 - lo / want_s).clamp(0.0, 255.0).round_ties_even();
        assert_eq!((s, z), (want_s, want_z as u8), "seed {seed} n {n}");
        let mut want = vec![0u8; n];
        quantize_u8_portable(&x, want_s, want_z, &mut want);
        assert_eq!(q, want, "seed {seed} n {n}");
    }
    pool::set_threads(None);
}

#[test]
fn byte_sums_match_the_plain_sum() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    for len in (0..300).chain([4096, 100_003]) {
        let v: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        // Every start, so the masked tail and unaligned loads are both exercised.
        let start = rng.gen_range(0..=len.min(63));
        let want = v[start..].iter().map(|&x| x as u64).sum::<u64>() as u32;
        assert_eq!(
            byte_sum_portable(&v[start..]),
            want,
            "portable, {len} bytes"
        );
        assert_eq!(
            byte_sum(&v[start..]),
            want,
            "byte_sum, {len} bytes from {start}"
        );
    }
}

#[test]
fn gathered_rows_give_the_product_of_the_written_rows() {
    // A's rows as runs of an image (some in the padding) against the reference on the same rows
    // written out: every kernel this CPU runs, runs of 4 to 64 bytes (the VNNI kernel reads
    // them in place) and of other lengths (written out first), zero points that need the row
    // sums and ones that do not, 8-bit and i32 outputs, one to three threads.
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..40 {
        let run = if case % 4 == 3 {
            rng.gen_range(1..20)
        } else {
            4 * rng.gen_range(1..17)
        };
        let (taps, m, n) = (
            rng.gen_range(1..10),
            rng.gen_range(1..60),
            rng.gen_range(1..90),
        );
        let k = taps * run;
        let image: Vec<u8> = (0..rng.gen_range(run..run + 400))
            .map(|_| rng.gen())
            .collect();
        let offsets: Vec<u32> = (0..m * taps)
            .map(|_| {
                if rng.gen_bool(0.15) {
                    Gathered::PAD
                } else {
                    rng.gen_range(0..=image.len() - run) as u32
                }
            })
            .collect();
        let fill = vec![rng.gen::<u8>(); run];
        let g = Gathered {
            image: &image,
            offsets: &offsets,
            taps,
            run,
            fill: &fill,
        };
        let mut rows = vec![0u8; m * k];
        g.write_rows(0, k, &mut rows);
        let b: Vec<i8> = (0..k * n).map(|_| rng.gen()).collect();
        let b_zero = if case % 2 == 0 {
            vec![0]
        } else {
            (0..n).map(|_| rng.gen_range(-128..128)).collect()
        };
        let a_zero = if case % 3 == 0 {
            (0..m).map(|_| rng.gen_range(0..256)).collect()
        } else {
            vec![rng.gen_range(0..256)]
        };
        let (want, _) = qgemm_ref(m, k, n, &rows, &a_zero, Bytes::I8(&b), &b_zero, None);
        let scale = vec![0.01f32];
        let (_, want_y) = qgemm_ref(
            m,
            k,
            n,
            &rows,
            &a_zero,
            Bytes::I8(&b),
            &b_zero,
            Some((&scale, None)),
        );
        let want_q: Vec<u8> = want_y
            .iter()
            .map(|&y| (y.round_ties_even() as i64 + 5).clamp(0, 255) as u8)
            .collect();
        for (layout, kernel) in kernels() {
            let packed = PackedI8::with_layout(k, n, Bytes::I8(&b), n, 1, layout);
            for threads in 1..=3 {
                pool::set_threads(Some(threads));
                let what = format!(
                    "seed {seed} case {case} {kernel:?} on {layout:?}, threads {threads}: \
                     {m} x {taps} runs of {run} x {n}"
                );
                let mut got = vec![i32::MIN; m * n];
                let out = QOut::I32 {
                    out: &mut got,
                    ld: n,
                };
                qgemm_gathered_on(g, m, &a_zero, &packed, &b_zero, out, kernel);
                assert!(got == want, "{what}: i32 output differs");
                let mut got = vec![0xA5u8; m * n];
                let out = QOut::Q8 {
                    out: &mut got,
                    rs: n,
                    cs: 1,
                    scale: &scale,
                    bias: None,
                    zero: 5,
                    signed: false,
                };
                qgemm_gathered_on(g, m, &a_zero, &packed, &b_zero, out, kernel);
                assert!(got == want_q, "{what}: 8-bit output differs");
            }
        }
    }
    pool::set_threads(None);
}
