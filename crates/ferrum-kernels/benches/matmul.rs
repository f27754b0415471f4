//! Throughput of `matmul` (no criterion): `cargo bench -p ferrum-kernels --bench matmul`.
//! GEMV (one token; weights 64 MiB, beyond the last-level cache): GB/s of weight bytes, beside
//! the machine's read bandwidth when `ferrum bench --machine` has cached it. GEMM (512 tokens,
//! a model-size matrix): GFLOP/s counting 2·rows·cols·tokens. Medians of 7 runs, 1 and 2 threads.

use ferrum_core::{f16, Bytes, DType};
use ferrum_kernels::matmul::{matmul, WeightRef};
use ferrum_kernels::pool;
use std::hint::black_box;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Weights in a huge-page backed buffer, as models are loaded ([`Bytes::pack`]).
fn weights(t: DType, rows: usize, cols: usize, rng: &mut Rng) -> Bytes {
    let raw = raw_weights(t, rows, cols, rng);
    Bytes::pack(&[&raw]).unwrap().pop().unwrap()
}

fn raw_weights(t: DType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..rows * t.row_bytes(cols).unwrap())
        .map(|_| rng.next() as u8)
        .collect();
    let fields: &[usize] = match t {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q6_K => &[208],
        _ => &[],
    };
    for blk in w.chunks_exact_mut(t.block_bytes()) {
        for &o in fields {
            blk[o..o + 2].copy_from_slice(&f16::from_f32(0.01).to_bits().to_le_bytes());
        }
    }
    w
}

/// `FERRUM_BENCH_TYPES=Q8_0,Q4_1` limits the run to those types.
fn bench_types() -> Vec<DType> {
    let all = [
        DType::Q4_1,
        DType::Q5_0,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ];
    match std::env::var("FERRUM_BENCH_TYPES") {
        Ok(v) => all
            .into_iter()
            .filter(|t| v.split(',').any(|n| n.eq_ignore_ascii_case(&t.to_string())))
            .collect(),
        Err(_) => all.to_vec(),
    }
}

mod common;

/// Median seconds of `reps` timed runs of `f`, after one untimed warm-up run.
fn median_secs(reps: usize, f: impl FnMut()) -> f64 {
    common::timings(reps, f).0
}

fn main() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    println!("| kernel | shape | threads | median ms | throughput |");
    println!("|---|---|---:|---:|---:|");
    for dtype in bench_types() {
        let cols = if dtype.block_size() == 256 { 1024 } else { 576 };
        let rb = dtype.row_bytes(cols).unwrap();
        // GEMV over 64 MiB of weights (memory) and over 8 MiB (fits the last-level cache).
        // `FERRUM_BENCH_GEMM_ONLY=1` skips them.
        let gemv_sizes: &[usize] = if std::env::var_os("FERRUM_BENCH_GEMM_ONLY").is_some() {
            &[]
        } else {
            &[64, 8]
        };
        for &mib in gemv_sizes {
            let rows = (mib << 20) / rb / 16 * 16;
            let w = weights(dtype, rows, cols, &mut rng);
            let wr = WeightRef {
                dtype,
                rows,
                cols,
                data: &w,
            };
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y = vec![0f32; rows];
            for threads in [1, 2] {
                pool::set_threads(Some(threads));
                let s = median_secs(15, || matmul(&wr, black_box(&x), &mut y));
                println!(
                    "| gemv {dtype} ({mib} MiB) | {rows}x{cols} x 1 | {threads} | {:.3} | {:.1} GB/s |",
                    s * 1e3,
                    w.len() as f64 / s / 1e9
                );
            }
            #[cfg(target_arch = "x86_64")]
            if let Some(packed) = ferrum_kernels::matmul::avx512::pack_x16(dtype, &w, rows, cols)
                .filter(|_| ferrum_kernels::matmul::avx512::available())
            {
                let packed = Bytes::pack(&[&packed]).unwrap().pop().unwrap();
                for threads in [1, 2] {
                    pool::set_threads(Some(threads));
                    let s = median_secs(15, || {
                        ferrum_kernels::matmul::avx512::gemv_x16(
                            dtype,
                            &packed,
                            rows,
                            cols,
                            black_box(&x),
                            &mut y,
                        )
                    });
                    println!(
                        "| gemv {dtype} 16-row packed ({mib} MiB) | {rows}x{cols} x 1 | {threads} | {:.3} | {:.1} GB/s |",
                        s * 1e3,
                        packed.len() as f64 / s / 1e9
                    );
                }
                // A batched decode step (8 tokens) with the weights streamed from memory, as
                // in a model, whose matrices do not stay in cache from one step to the next:
                // the whole 64 MiB matrix at once, and 64 matrices of 1536 rows in turn (a
                // model's calls, each starting cold).
                if mib == 64 {
                    let t = 8;
                    let x8: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.37).sin()).collect();
                    let mut y8 = vec![0f32; t * rows];
                    let rows_m = 1536;
                    let per = packed.len() / (rows / 16) * (rows_m / 16);
                    let n_m = 64.min(packed.len() / per);
                    let x16 = |w: &[u8], r: usize, y: &mut [f32]| {
                        ferrum_kernels::matmul::avx512::gemv_x16(
                            dtype,
                            w,
                            r,
                            cols,
                            black_box(&x8),
                            &mut y[..t * r],
                        )
                    };
                    for threads in [1, 2] {
                        pool::set_threads(Some(threads));
                        let (s, fastest) = common::timings(9, || x16(&packed, rows, &mut y8));
                        println!(
                            "| gemv {dtype} 16-row packed ({mib} MiB) | {rows}x{cols} x {t} | {threads} | {:.3} (fastest {:.3}) | {:.1} GFLOP/s |",
                            s * 1e3,
                            fastest * 1e3,
                            2.0 * (rows * cols * t) as f64 / s / 1e9,
                        );
                        let (s, fastest) = common::timings(9, || {
                            for i in 0..n_m {
                                x16(&packed[i * per..(i + 1) * per], rows_m, &mut y8);
                            }
                        });
                        println!(
                            "| gemv {dtype} 16-row packed, {n_m} matrices in turn | {rows_m}x{cols} x {t} | {threads} | {:.3} (fastest {:.3}) a matrix | {:.1} GFLOP/s |",
                            s * 1e3 / n_m as f64,
                            fastest * 1e3 / n_m as f64,
                            2.0 * (n_m * rows_m * cols * t) as f64 / s / 1e9,
                        );
                    }
                }
            }
        }
        // `FERRUM_BENCH_GEMV_ONLY=1`: the GEMV rows above only.
        if std::env::var_os("FERRUM_BENCH_GEMV_ONLY").is_some() {
            continue;
        }
        // Batched decode and prompts: T tokens over a model-size matrix (1536 x cols), through
        // PackedMatrix's plan and through the row-major kernels, GFLOP/s;
        // `FERRUM_BENCH_GEMM_ONLY=1` skips it.
        #[cfg(target_arch = "x86_64")]
        if std::env::var_os("FERRUM_BENCH_GEMM_ONLY").is_none() {
            use ferrum_kernels::matmul::{Layout, PackedMatrix};
            let rows = 1536;
            let w = weights(dtype, rows, cols, &mut rng);
            let m = PackedMatrix::new(dtype, rows, cols, w.clone()).unwrap();
            if m.layout() != Layout::RowMajor {
                let wr = WeightRef {
                    dtype,
                    rows,
                    cols,
                    data: &w,
                };
                for threads in [1, 2] {
                    pool::set_threads(Some(threads));
                    for t in [1, 2, 4, 8, 16, 32, 64, 512] {
                        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.37).sin()).collect();
                        let mut y = vec![0f32; t * rows];
                        // Up to 16: that many one-token sequences (a decode step); beyond, one
                        // prompt of t tokens.
                        let segs = if t <= 16 { vec![1; t] } else { vec![t] };
                        let flops = 2.0 * (rows * cols * t) as f64;
                        let reps = if t > 64 { 7 } else { 31 };
                        let sp = median_secs(reps, || m.matmul(black_box(&x), &mut y, &segs));
                        let sr = median_secs(reps, || matmul(&wr, black_box(&x), &mut y));
                        println!(
                            "| {dtype} packed plan / row-major | {rows}x{cols} x {t} | {threads} | {:.3} / {:.3} | {:.1} / {:.1} GFLOP/s |",
                            sp * 1e3,
                            sr * 1e3,
                            flops / sp / 1e9,
                            flops / sr / 1e9
                        );
                    }
                }
            }
        }
        // GEMM: 1536 x cols weights, 512 tokens.
        let (rows, t) = (1536, 512);
        let w = weights(dtype, rows, cols, &mut rng);
        let wr = WeightRef {
            dtype,
            rows,
            cols,
            data: &w,
        };
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = vec![0f32; t * rows];
        for threads in [1, 2] {
            pool::set_threads(Some(threads));
            let s = median_secs(7, || matmul(&wr, black_box(&x), &mut y));
            println!(
                "| gemm {dtype} | {rows}x{cols} x {t} | {threads} | {:.3} | {:.1} GFLOP/s |",
                s * 1e3,
                2.0 * (rows * cols * t) as f64 / s / 1e9
            );
        }
    }
}
