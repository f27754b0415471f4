//! What the kernel benches share.

use std::time::Instant;

/// Median and fastest seconds of `reps` runs of `f`, after one warm-up run. (Load on a shared
/// machine only slows a run down, so the fastest is the better estimate there.)
pub fn timings(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut v: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0])
}
