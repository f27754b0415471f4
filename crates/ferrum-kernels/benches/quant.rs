//! Throughput of the quant kernels (no criterion): `cargo bench -p ferrum-kernels --bench quant`.
//! For each weight type: a matrix of model size times one quantized activation row, SIMD
//! (`vec_dot`) vs the portable x86-order kernels (`vec_dot_lanes`, what CPUs without AVX2 run) vs
//! the generic-order scalar reference (`vec_dot_ref`), reported as GB/s of weight bytes; plus the
//! activation quantizers in GB/s of f32 input.

use ferrum_core::{f16, DType};
use ferrum_kernels::quant::{
    isa, quantize_row, quantize_row_ref, vec_dot, vec_dot_lanes, vec_dot_ref, vec_dot_type,
};
use std::hint::black_box;
use std::time::Instant;

/// Deterministic pseudo-random bytes (xorshift), no external crates.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn scale_fields(t: DType) -> &'static [usize] {
    match t {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[],
    }
}

fn weights(t: DType, rows: usize, n: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = t.row_bytes(n).unwrap();
    let mut w = vec![0u8; rows * rb];
    if t.is_quantized() {
        for b in w.iter_mut() {
            *b = rng.next() as u8;
        }
        for blk in w.chunks_exact_mut(t.block_bytes()) {
            for &o in scale_fields(t) {
                let s = f16::from_f32(0.01 * (1.0 + rng.f32()));
                blk[o..o + 2].copy_from_slice(&s.to_bits().to_le_bytes());
            }
        }
    } else {
        let x: Vec<f32> = (0..rows * n).map(|_| rng.f32()).collect();
        quantize_row(t, &x, &mut w);
    }
    w
}

fn time<F: FnMut() -> f32>(mut f: F) -> f64 {
    // Repeat until at least 0.2 s; return seconds per call.
    let mut iters = 1u64;
    loop {
        let t0 = Instant::now();
        let mut s = 0f32;
        for _ in 0..iters {
            s += f();
        }
        black_box(s);
        let dt = t0.elapsed().as_secs_f64();
        if dt > 0.2 {
            return dt / iters as f64;
        }
        iters *= 2;
    }
}

fn main() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (rows, n) = (1536, 2048);
    println!("kernels: {:?}; matrix {rows} x {n}", isa());
    println!(
        "{:<6} {:>12} {:>12} {:>12} {:>8}",
        "type", "simd GB/s", "lanes GB/s", "scalar GB/s", "speedup"
    );
    for t in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::F16,
        DType::BF16,
        DType::F32,
    ] {
        let w = weights(t, rows, n, &mut rng);
        let x: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        let at = vec_dot_type(t);
        let mut a = vec![0u8; at.row_bytes(n).unwrap()];
        quantize_row(at, &x, &mut a);
        let rb = t.row_bytes(n).unwrap();
        let simd = time(|| {
            w.chunks_exact(rb)
                .map(|r| vec_dot(t, black_box(r), &a, n))
                .sum()
        });
        let lanes = time(|| {
            w.chunks_exact(rb)
                .map(|r| vec_dot_lanes(t, black_box(r), &a, n))
                .sum()
        });
        let scalar = time(|| {
            w.chunks_exact(rb)
                .map(|r| vec_dot_ref(t, black_box(r), &a, n))
                .sum()
        });
        let gb = w.len() as f64 / 1e9;
        println!(
            "{:<6} {:>12.2} {:>12.2} {:>12.2} {:>7.1}x",
            t.name(),
            gb / simd,
            gb / lanes,
            gb / scalar,
            scalar / simd
        );
    }
    let x: Vec<f32> = (0..rows * 256).map(|_| rng.f32()).collect();
    println!(
        "{:<6} {:>12} {:>12} {:>8}",
        "quant", "simd GB/s", "scalar GB/s", "speedup"
    );
    for t in [DType::Q8_0, DType::Q8_1, DType::Q8_K] {
        let mut out = vec![0u8; t.row_bytes(x.len()).unwrap()];
        let simd = time(|| {
            quantize_row(t, black_box(&x), &mut out);
            out[0] as f32
        });
        let scalar = time(|| {
            quantize_row_ref(t, black_box(&x), &mut out);
            out[0] as f32
        });
        let gb = (x.len() * 4) as f64 / 1e9;
        println!(
            "{:<6} {:>12.2} {:>12.2} {:>7.1}x",
            t.name(),
            gb / simd,
            gb / scalar,
            scalar / simd
        );
    }
}
