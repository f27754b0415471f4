//! 8-bit integer GEMM throughput (GOP/s, 2 operations per multiply-add) on the products of a
//! dynamically quantized BERT-base (128 tokens), per thread count:
//! `cargo bench -p ferrum-kernels --bench qgemm [-- THREADS... [--reps N] [--shape MxNxK]...]`.
//!
//! Each figure is the median of `--reps` timed runs (default 9) after one warm-up, for the
//! kernel this CPU runs (`FERRUM_NO_AVX512=1`, `FERRUM_FORCE_SCALAR=1` step down), with the f32
//! epilogue (scale and bias) that MatMulIntegerToFloat uses, or with `--q8` the requantized
//! 8-bit output (per-column scales and bias) of a QLinearConv.

use ferrum_kernels::pool;
use ferrum_kernels::qgemm::{qgemm, Bytes, PackedI8, QOut, QuantA};

mod common;

/// Median seconds of `reps` runs of `f` after one warm-up run.
fn time(reps: usize, f: impl FnMut()) -> f64 {
    common::timings(reps, f).0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut reps = 9;
    let mut threads = Vec::new();
    let mut shapes = Vec::new();
    let mut q8 = false;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--reps" => {
                reps = args[i + 1].parse().expect("--reps N");
                i += 1;
            }
            "--shape" => {
                let d: Vec<usize> = args[i + 1]
                    .split('x')
                    .map(|v| v.parse().expect("--shape MxNxK"))
                    .collect();
                shapes.push((d[0], d[1], d[2]));
                i += 1;
            }
            "--q8" => q8 = true,
            "--bench" => {}
            a => {
                if let Ok(t) = a.parse() {
                    threads.push(t)
                }
            }
        }
        i += 1;
    }
    if threads.is_empty() {
        threads = vec![1, pool::available_threads()];
        threads.dedup();
    }
    if shapes.is_empty() {
        shapes = vec![(128, 768, 768), (128, 3072, 768), (128, 768, 3072)];
    }
    println!("layout: {:?}", ferrum_kernels::qgemm::Layout::for_cpu());
    println!("output: {}", if q8 { "u8 (requantized)" } else { "f32" });
    println!("| m x n x k | threads | ms | GOP/s |");
    println!("|---|---:|---:|---:|");
    for &(m, n, k) in &shapes {
        let a: Vec<u8> = (0..m * k).map(|i| (i * 7 % 251) as u8).collect();
        let b: Vec<i8> = (0..k * n).map(|i| (i * 13 % 255) as i8).collect();
        let packed = PackedI8::new(k, n, Bytes::I8(&b), n, 1);
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
        let scales: Vec<f32> = (0..n).map(|j| 1e-3 + j as f32 * 1e-6).collect();
        let mut out = vec![0f32; m * n];
        let mut out8 = vec![0u8; m * n];
        for &t in &threads {
            pool::set_threads(Some(t));
            let s = time(reps, || {
                let a = QuantA {
                    data: &a,
                    m,
                    ld: k,
                    zero: &[120],
                    zero_padded: false,
                };
                let out = if q8 {
                    QOut::Q8 {
                        out: &mut out8,
                        rs: n,
                        cs: 1,
                        scale: &scales,
                        bias: Some(&bias),
                        zero: 0,
                        signed: false,
                    }
                } else {
                    QOut::F32 {
                        out: &mut out,
                        ld: n,
                        scale: &[1e-4],
                        bias: Some(&bias),
                    }
                };
                qgemm(a, &packed, &[0], out)
            });
            let gops = 2.0 * (m * n * k) as f64 / s / 1e9;
            println!("| {m} x {n} x {k} | {t} | {:.3} | {gops:.1} |", s * 1e3);
        }
    }
}
