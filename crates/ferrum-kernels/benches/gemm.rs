//! f32 GEMM throughput (GFLOP/s) on square and network-shaped problems, per thread count:
//! `cargo bench -p ferrum-kernels --bench gemm [-- THREADS... [--all-isas | --isa NAME]
//! [--reps N] [--shape MxNxK]... [--bf16]]`.
//!
//! `--bf16` also times each shape with one operand packed ahead, in f32 and in bf16 (the tile
//! unit where the CPU has AMX-BF16, else AVX512-BF16's dot product): B packed (a MatMul's weight) and A packed (a Conv's
//! filter, B rounded at each call), and A packed with a convolution's epilogue (row bias,
//! residual, Relu).
//!
//! Each figure is the median of `--reps` timed runs (default 9) after one warm-up run; by default
//! only the best microkernel ([`isa`]) is measured, `--all-isas` measures every one this CPU runs.
//! Without `--shape`, every shape below and the batched attention products.

use ferrum_kernels::gemm::{
    available_isas, bf16_supported, gemm_batch_with, gemm_ex_with, gemm_with, isa, Act, Bias,
    Epilogue, Isa, Lhs, Mat, PackedA, PackedB, Precision, Rhs,
};

mod common;

/// Median seconds of `reps` runs of `f` after one warm-up run (and the fastest, with
/// `FERRUM_BENCH_MIN=1`: the better estimate on a machine shared with other work).
fn time(reps: usize, f: impl FnMut()) -> f64 {
    let (median, fastest) = common::timings(reps, f);
    if std::env::var_os("FERRUM_BENCH_MIN").is_some() {
        fastest
    } else {
        median
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let all_isas = args.iter().any(|a| a == "--all-isas");
    let bf16 = args.iter().any(|a| a == "--bf16");
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(9usize);
    let threads: Vec<usize> = args
        .iter()
        .enumerate()
        .filter(|(i, _)| *i == 0 || !args[i - 1].starts_with("--"))
        .filter_map(|(_, a)| a.parse().ok())
        .collect();
    let threads = if threads.is_empty() {
        vec![1, 2]
    } else {
        threads
    };
    let named = args
        .windows(2)
        .find(|w| w[0] == "--isa")
        .map(|w| w[1].to_lowercase());
    let isas = if all_isas {
        available_isas()
    } else if let Some(name) = named {
        available_isas()
            .into_iter()
            .filter(|i| format!("{i:?}").to_lowercase() == name)
            .collect()
    } else {
        vec![isa()]
    };
    // (m, n, k): square; ResNet-50 convs as im2col GEMMs (Cout x OH*OW x Cin*kh*kw); BERT-base
    // projections (tokens x out x in) and attention products (QK^T, PV); ViT-B/16 projections;
    // MobileNetV2 1x1 convs.
    let only: Vec<(usize, usize, usize)> = args
        .windows(2)
        .filter(|w| w[0] == "--shape")
        .filter_map(|w| {
            let d: Vec<usize> = w[1].split('x').filter_map(|x| x.parse().ok()).collect();
            (d.len() == 3).then(|| (d[0], d[1], d[2]))
        })
        .collect();
    let all_shapes = [
        (1024, 1024, 1024),
        (64, 12544, 147),
        (64, 3136, 576),
        (512, 196, 1024),
        (2048, 49, 512),
        (128, 768, 768),
        (128, 3072, 768),
        (128, 128, 64),
        (128, 64, 128),
        (197, 768, 768),
        (197, 3072, 768),
        (96, 12544, 16),
        (24, 3136, 144),
        (960, 49, 160),
    ];
    let shapes = if only.is_empty() {
        all_shapes.to_vec()
    } else {
        only.clone()
    };
    for &t in &threads {
        ferrum_kernels::pool::set_threads(Some(t));
        for &isa in &isas {
            for &(m, n, k) in &shapes {
                let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
                let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
                let mut c = vec![0f32; m * n];
                let s = time(reps, || {
                    gemm_with(
                        isa,
                        t,
                        m,
                        n,
                        k,
                        1.0,
                        Mat::row_major(&a, k),
                        Mat::row_major(&b, n),
                        0.0,
                        &mut c,
                        n,
                    )
                });
                let gf = 2.0 * (m * n * k) as f64 / s / 1e9;
                println!(
                    "{t} threads {isa:?} {m}x{n}x{k}: {:.3} ms, {gf:.1} GFLOP/s",
                    s * 1e3
                );
                if bf16 {
                    packed(isa, t, reps, (m, n, k), (&a, &b));
                }
            }
            if only.is_empty() {
                extras(isa, t, reps);
            }
        }
    }
}

/// One shape with B packed ahead and with A packed ahead, in f32 and (where the CPU runs it)
/// bf16.
fn packed(
    isa: Isa,
    t: usize,
    reps: usize,
    (m, n, k): (usize, usize, usize),
    (a, b): (&[f32], &[f32]),
) {
    let mut c = vec![0f32; m * n];
    let mut product = |lhs: Lhs, rhs: Rhs| {
        gemm_ex_with(
            isa,
            t,
            m,
            n,
            k,
            1.0,
            lhs,
            rhs,
            0.0,
            &mut c,
            n,
            &Epilogue::NONE,
        )
    };
    let report = |p: Precision, what: &str, s: f64| {
        let gf = 2.0 * (m * n * k) as f64 / s / 1e9;
        println!(
            "{t} threads {p:?} {what} {m}x{n}x{k}: {:.3} ms, {gf:.1} GFLOP/s",
            s * 1e3
        );
    };
    let mut precisions = vec![Precision::F32];
    if bf16_supported() {
        precisions.push(Precision::Bf16);
    }
    for p in precisions {
        let (am, bm) = (Mat::row_major(a, k), Mat::row_major(b, n));
        let pb = PackedB::with_precision(k, n, bm, p);
        let pa = PackedA::with_precision(m, k, am, p);
        for (what, lhs, rhs) in [
            ("B packed", Lhs::Mat(am), Rhs::Packed(&pb)),
            ("A packed", Lhs::Packed(&pa), Rhs::Mat(bm)),
        ] {
            report(p, what, time(reps, || product(lhs, rhs)));
        }
        // B packed, a different copy at each run (the copies together well past the last-level
        // cache): the weights come from memory, as in a network's forward pass.
        let copies = ((1usize << 30) / pb.size_bytes().max(1)).clamp(2, 256);
        let cold: Vec<PackedB> = (0..copies)
            .map(|_| PackedB::with_precision(k, n, bm, p))
            .collect();
        cold.iter()
            .for_each(|pb| product(Lhs::Mat(am), Rhs::Packed(pb)));
        let mut next = 0;
        let s = time(reps.max(copies), || {
            next += 1;
            product(Lhs::Mat(am), Rhs::Packed(&cold[(next - 1) % copies]))
        });
        report(p, "B packed, from memory", s);
        // The same for A packed (a convolution's filter), B the call's activations.
        drop(cold);
        let copies = ((1usize << 30) / pa.size_bytes().max(1)).clamp(2, 256);
        let cold: Vec<PackedA> = (0..copies)
            .map(|_| PackedA::with_precision(m, k, am, p))
            .collect();
        // Each copy used once before the timing: a product that reads a packed operand in
        // another panel width (A swapped to B's side for a short product) converts it on first
        // use and keeps it, as a network's session does once.
        cold.iter()
            .for_each(|pa| product(Lhs::Packed(pa), Rhs::Mat(bm)));
        let mut next = 0;
        let s = time(reps.max(copies), || {
            next += 1;
            product(Lhs::Packed(&cold[(next - 1) % copies]), Rhs::Mat(bm))
        });
        report(p, "A packed, from memory", s);
        // A packed with a convolution's epilogue (a bias per row, a residual of C's shape, Relu):
        // ResNet's last 1x1 layer of a block, C and the residual each a fresh stream. f32 only:
        // a bf16 product takes no residual in its epilogue (the caller accumulates into it).
        if p != Precision::F32 {
            continue;
        }
        let bias: Vec<f32> = (0..m).map(|i| (i % 3) as f32 * 0.1).collect();
        let z: Vec<f32> = (0..m * n).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
        let epi = Epilogue {
            bias: Bias::Row(&bias),
            act: Act::Relu,
            residual: Some(&z),
        };
        let mut out = vec![0f32; m * n];
        let s = time(reps, || {
            gemm_ex_with(
                isa,
                t,
                m,
                n,
                k,
                1.0,
                Lhs::Packed(&pa),
                Rhs::Mat(bm),
                0.0,
                &mut out,
                n,
                &epi,
            )
        });
        report(p, "A packed, bias + residual + Relu", s);
        // The same from memory, as in a network's forward pass (16 sets of B, residual and C,
        // together past the last-level cache): C a fresh buffer, then C the residual's own
        // memory (the product accumulated into it, same bits), as a session does when the
        // product is the residual's last reader.
        let sets = 16;
        let bs: Vec<Vec<f32>> = (0..sets).map(|_| b.to_vec()).collect();
        let mut zs: Vec<Vec<f32>> = (0..sets).map(|_| z.clone()).collect();
        let mut outs: Vec<Vec<f32>> = (0..sets).map(|_| vec![0f32; m * n]).collect();
        for in_place in [false, true] {
            let mut next = 0;
            let s = time(reps.max(2 * sets), || {
                next += 1;
                let i = next % sets;
                let bm = Mat::row_major(&bs[i], n);
                let (beta, c, residual) = if in_place {
                    (1.0, &mut zs[i], None)
                } else {
                    (0.0, &mut outs[i], Some(&zs[i][..]))
                };
                let epi = Epilogue {
                    bias: Bias::Row(&bias),
                    act: Act::Relu,
                    residual,
                };
                gemm_ex_with(
                    isa,
                    t,
                    m,
                    n,
                    k,
                    1.0,
                    Lhs::Packed(&pa),
                    Rhs::Mat(bm),
                    beta,
                    c,
                    n,
                    &epi,
                )
            });
            let what = if in_place {
                "A packed, bias + residual + Relu, from memory, into the residual"
            } else {
                "A packed, bias + residual + Relu, from memory"
            };
            report(p, what, s);
        }
    }
}

/// BERT-base attention per layer: 12 heads of `Q K^T` (128 x 128 x 64) and of `P V`
/// (128 x 64 x 128), one product after another and as one batch; and BERT's FFN up-projection
/// (128 x 3072 x 768) with its bias and GELU, plain and with the weights packed ahead, the
/// epilogue fused.
fn extras(isa: Isa, t: usize, reps: usize) {
    let count = 12;
    for (m, n, k) in [(128, 128, 64), (128, 64, 128)] {
        let a: Vec<f32> = (0..count * m * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..count * k * n).map(|i| (i % 5) as f32 * 0.1).collect();
        let mut c = vec![0f32; count * m * n];
        let av = |i: usize| Mat::row_major(&a[i * m * k..][..m * k], k);
        let bv = |i: usize| Mat::row_major(&b[i * k * n..][..k * n], n);
        let one_by_one = time(reps, || {
            for (i, ci) in c.chunks_mut(m * n).enumerate() {
                gemm_with(isa, t, m, n, k, 1.0, av(i), bv(i), 0.0, ci, n);
            }
        });
        let batched = time(reps, || {
            gemm_batch_with(isa, t, count, m, n, k, 1.0, &av, &bv, &mut c)
        });
        let flop = 2.0 * (count * m * n * k) as f64;
        println!(
            "{t} threads {isa:?} {count}x {m}x{n}x{k}: one by one {:.1} GFLOP/s, batched {:.1} GFLOP/s",
            flop / one_by_one / 1e9,
            flop / batched / 1e9
        );
    }
    let (m, n, k) = (128, 3072, 768);
    // Products of a few units either side of 0, where GELU is not a step.
    let a: Vec<f32> = (0..m * k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i % 5) as f32 - 2.0) * 0.1).collect();
    let bias: Vec<f32> = (0..n).map(|i| (i % 3) as f32 * 0.1).collect();
    let mut c = vec![0f32; m * n];
    let (av, bv) = (Mat::row_major(&a, k), Mat::row_major(&b, n));
    let packed = PackedB::new(k, n, bv);
    let epi = Epilogue {
        bias: Bias::Col(&bias),
        act: Act::Gelu,
        residual: None,
    };
    let mut run = |rhs: Rhs, epi: &Epilogue| {
        time(reps, || {
            gemm_ex_with(isa, t, m, n, k, 1.0, Lhs::Mat(av), rhs, 0.0, &mut c, n, epi)
        })
    };
    let plain = run(Rhs::Mat(bv), &Epilogue::NONE);
    let fused = run(Rhs::Mat(bv), &epi);
    let prepacked = run(Rhs::Packed(&packed), &epi);
    let flop = 2.0 * (m * n * k) as f64;
    println!(
        "{t} threads {isa:?} {m}x{n}x{k}: plain {:.1} GFLOP/s, bias + GELU fused {:.1}, \
         and B packed ahead {:.1}",
        flop / plain / 1e9,
        flop / fused / 1e9,
        flop / prepacked / 1e9
    );
}
