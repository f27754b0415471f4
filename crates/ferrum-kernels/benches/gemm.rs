//! f32 GEMM throughput (GFLOP/s) on square and network-shaped problems, per microkernel and
//! thread count: `cargo bench -p ferrum-kernels --bench gemm [-- THREADS]`.

use std::time::Instant;

use ferrum_kernels::gemm::{available_isas, gemm_with, Mat};

fn main() {
    let threads: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = if threads.is_empty() {
        vec![1, 2]
    } else {
        threads
    };
    // (m, n, k): square, ResNet-50 convs as im2col GEMMs (Cout x OH*OW x Cin*kh*kw), BERT's
    // projections (tokens x out x in).
    let shapes = [
        (1024, 1024, 1024),
        (64, 12544, 147),
        (64, 3136, 576),
        (512, 196, 1024),
        (2048, 49, 512),
        (128, 768, 768),
        (128, 3072, 768),
    ];
    for &t in &threads {
        ferrum_kernels::pool::set_threads(Some(t));
        for isa in available_isas() {
            for &(m, n, k) in &shapes {
                let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
                let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
                let mut c = vec![0f32; m * n];
                let run = |c: &mut [f32]| {
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
                        c,
                        n,
                    )
                };
                run(&mut c);
                let mut times = Vec::new();
                for _ in 0..7 {
                    let s = Instant::now();
                    run(&mut c);
                    times.push(s.elapsed().as_secs_f64());
                }
                times.sort_by(f64::total_cmp);
                let gf = 2.0 * (m * n * k) as f64 / times[3] / 1e9;
                println!(
                    "{t} threads {isa:?} {m}x{n}x{k}: {:.3} ms, {gf:.1} GFLOP/s",
                    times[3] * 1e3
                );
            }
        }
    }
}
