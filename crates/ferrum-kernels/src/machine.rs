//! Measures this machine's ceilings: peak FMA throughput and memory / cache bandwidth. The
//! profiler's roofline uses them, and the performance notes quote kernels as fractions of them.
//!
//! * FMA: independent chains of fused multiply-adds in the widest vectors the CPU has
//!   (AVX-512, else AVX2), enough chains to cover latency x pipes; 2 FLOPs per lane per FMA.
//! * Read bandwidth: sum a buffer with several accumulators, in 512-bit loads where the CPU has
//!   them (bytes read per second).
//! * Copy bandwidth: copy one buffer into another; bytes read plus bytes written per second
//!   (the convention of STREAM's "copy" and numpy's copyto figures).
//!
//! Buffers larger than the last-level cache give memory bandwidth; buffers that fit a core's L2
//! (or the shared L3) give cache bandwidth. Multi-thread figures split the work over the pool.

use std::time::Instant;

use crate::pool;
use ferrum_core::HugeBuf;

/// GFLOP/s of `threads` threads issuing FMAs for about `seconds`.
pub fn peak_fma_gflops(threads: usize, seconds: f64) -> f64 {
    // Calibrate the iteration count on one thread.
    let mut iters = 1u64 << 16;
    loop {
        let t = Instant::now();
        std::hint::black_box(fma_loop(iters));
        let dt = t.elapsed().as_secs_f64();
        if dt > seconds / 4.0 || iters > 1 << 40 {
            iters = ((iters as f64) * seconds / dt.max(1e-9)) as u64;
            break;
        }
        iters *= 4;
    }
    let iters = iters.max(1);
    let flops_per_iter = fma_flops_per_iter();
    pool::set_threads(Some(threads));
    let t = Instant::now();
    pool::parallel_for(threads, |_| {
        std::hint::black_box(fma_loop(iters));
    });
    let dt = t.elapsed().as_secs_f64();
    (threads as f64 * iters as f64 * flops_per_iter) / dt / 1e9
}

/// Chains per loop iteration (covers 4-cycle FMA latency on 2-3 pipes).
const CHAINS: usize = 12;

fn fma_flops_per_iter() -> f64 {
    (CHAINS * 2 * lanes()) as f64
}

fn lanes() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx512f {
            return 16;
        }
        if crate::cpu::features().avx2 && crate::cpu::features().fma {
            return 8;
        }
    }
    1
}

fn fma_loop(iters: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx512f {
            // SAFETY: AVX-512F was detected at run time.
            return unsafe { fma_loop_avx512(iters) };
        }
        if crate::cpu::features().avx2 && crate::cpu::features().fma {
            // SAFETY: AVX2 and FMA were detected at run time.
            return unsafe { fma_loop_avx2(iters) };
        }
    }
    let mut acc = [1f32; CHAINS];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_loop_avx512(iters: u64) -> f32 {
    use core::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    let m = _mm512_set1_ps(0.999_999);
    let c = _mm512_set1_ps(1e-7);
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, m, c);
        }
    }
    let mut s = _mm512_setzero_ps();
    for a in acc {
        s = _mm512_add_ps(s, a);
    }
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_loop_avx2(iters: u64) -> f32 {
    use core::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    let m = _mm256_set1_ps(0.999_999);
    let c = _mm256_set1_ps(1e-7);
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, m, c);
        }
    }
    let mut s = _mm256_setzero_ps();
    for a in acc {
        s = _mm256_add_ps(s, a);
    }
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 f32; storeu has no alignment requirement.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

/// Wrapping sum of `x` as u64 words; every byte is read once. With AVX-512, 512-bit loads into
/// 8 independent accumulators (the widest loads the kernels use, so the ceiling is not set by
/// the load width); else 32 u64 lanes the compiler vectorises.
fn sum_bytes(x: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::features().avx512f {
        // SAFETY: AVX-512F was detected at run time.
        return unsafe { sum_bytes_avx512(x) };
    }
    sum_bytes_portable(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_bytes_avx512(x: &[u8]) -> u64 {
    use core::arch::x86_64::*;
    let chunks = x.chunks_exact(512);
    let tail = sum_bytes_portable(chunks.remainder());
    let mut acc = [_mm512_setzero_si512(); 8];
    for c in chunks {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 512 bytes, so bytes 64i..64i+64 are readable; unaligned load.
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().add(64 * i) as *const _) };
            *a = _mm512_add_epi64(*a, v);
        }
    }
    let mut s = _mm512_setzero_si512();
    for a in acc {
        s = _mm512_add_epi64(s, a);
    }
    tail.wrapping_add(_mm512_reduce_add_epi64(s) as u64)
}

fn sum_bytes_portable(x: &[u8]) -> u64 {
    let mut acc = [0u64; 32];
    let chunks = x.chunks_exact(256);
    let tail: u64 = chunks.remainder().iter().map(|&b| b as u64).sum();
    for c in chunks {
        for (a, w) in acc.iter_mut().zip(c.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap()));
        }
    }
    acc.iter().fold(tail, |s, &a| s.wrapping_add(a))
}

fn huge(len: usize, fill: u8) -> HugeBuf {
    let mut b = HugeBuf::zeroed(len).expect("allocating a benchmark buffer");
    b.fill(fill);
    b
}

/// Read bandwidth in GB/s over a buffer of `bytes` (per thread: `bytes / threads`), repeated
/// until about `seconds` have passed. Small buffers measure cache bandwidth.
pub fn read_bandwidth(bytes: usize, threads: usize, seconds: f64) -> f64 {
    let per = (bytes / threads).max(4096) / 256 * 256;
    let bufs: Vec<HugeBuf> = (0..threads).map(|i| huge(per, i as u8 + 1)).collect();
    pool::set_threads(Some(threads));
    // Warm up (cache fill).
    pool::parallel_for(threads, |i| {
        std::hint::black_box(sum_bytes(&bufs[i]));
    });
    let reps = repetitions(per, seconds, |_| {
        std::hint::black_box(sum_bytes(&bufs[0]));
    });
    let t = Instant::now();
    pool::parallel_for(threads, |i| {
        for _ in 0..reps {
            std::hint::black_box(sum_bytes(std::hint::black_box(&bufs[i])));
        }
    });
    let dt = t.elapsed().as_secs_f64();
    (threads * per * reps) as f64 / dt / 1e9
}

/// Copy bandwidth in GB/s (bytes read + bytes written) over buffers of `bytes` each.
pub fn copy_bandwidth(bytes: usize, threads: usize, seconds: f64) -> f64 {
    let per = (bytes / threads).max(4096);
    let src: Vec<HugeBuf> = (0..threads).map(|i| huge(per, i as u8 + 1)).collect();
    let mut dst: Vec<HugeBuf> = (0..threads).map(|_| huge(per, 0)).collect();
    pool::set_threads(Some(threads));
    let reps = {
        let (s0, d0) = (&src[0], &mut dst[0]);
        repetitions(per * 2, seconds, |_| {
            d0.copy_from_slice(s0);
            std::hint::black_box(&d0);
        })
    };
    let t = Instant::now();
    pool::parallel_chunks_mut(&mut dst, 1, |i, d| {
        for _ in 0..reps {
            d[0].copy_from_slice(&src[i]);
            std::hint::black_box(&d[0]);
        }
    });
    let dt = t.elapsed().as_secs_f64();
    (threads * per * 2 * reps) as f64 / dt / 1e9
}

/// How many runs of `f` (touching `bytes`) take about `seconds` on one thread.
fn repetitions(bytes: usize, seconds: f64, mut f: impl FnMut(usize)) -> usize {
    let t = Instant::now();
    f(bytes);
    let one = t.elapsed().as_secs_f64().max(1e-7);
    ((seconds / one) as usize).clamp(1, 1 << 24)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_are_positive_and_ordered() {
        let f1 = peak_fma_gflops(1, 0.02);
        assert!(f1.is_finite() && f1 > 0.1, "fma {f1}");
        let l2 = read_bandwidth(256 << 10, 1, 0.02);
        let mem = read_bandwidth(64 << 20, 1, 0.02);
        assert!(l2.is_finite() && l2 > 0.1 && mem > 0.1, "l2 {l2} mem {mem}");
        let cp = copy_bandwidth(16 << 20, 1, 0.02);
        assert!(cp.is_finite() && cp > 0.1, "copy {cp}");
        assert_eq!(sum_bytes(&[1u8; 1000]), 96 * 0x0101_0101_0101_0101 + 232);
        pool::set_threads(None);
    }
}
