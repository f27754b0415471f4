//! `ferrum bench --machine`: this machine's ceilings, printed and cached as JSON for the profiler
//! (`$FERRUM_MACHINE_FILE`, else `$XDG_CACHE_HOME/ferrum/machine.json`, else
//! `~/.cache/ferrum/machine.json`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use ferrum_kernels::{machine, pool};
use serde::{Deserialize, Serialize};

/// Measured ceilings; bandwidths in GB/s (10^9 bytes/s), compute in GFLOP/s.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Ceilings {
    pub cpu: String,
    pub threads: usize,
    pub fma_gflops_1: f64,
    pub fma_gflops_all: f64,
    pub mem_read_gbs_1: f64,
    pub mem_read_gbs_all: f64,
    pub mem_copy_gbs_1: f64,
    pub mem_copy_gbs_all: f64,
    pub l2_read_gbs_1: f64,
    pub l3_read_gbs_1: f64,
}

pub fn cache_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FERRUM_MACHINE_FILE") {
        return PathBuf::from(p);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("ferrum").join("machine.json")
}

/// The cached ceilings, if `ferrum bench --machine` ran on this machine before.
pub fn load_cached() -> Option<Ceilings> {
    let s = std::fs::read_to_string(cache_path()).ok()?;
    serde_json::from_str(&s).ok()
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Trials per ceiling: each figure is the best of them, since a ceiling is the most the machine
/// does and a busy neighbour on a shared host only ever lowers a trial.
const TRIALS: usize = 3;

fn best(f: impl Fn() -> f64) -> f64 {
    (0..TRIALS).map(|_| f()).fold(0.0, f64::max)
}

pub fn measure() -> Ceilings {
    let all = pool::available_threads();
    let secs = 0.25;
    let big = 1 << 30; // 1 GiB: far beyond any last-level cache here
    let c = Ceilings {
        cpu: cpu_name(),
        threads: all,
        fma_gflops_1: best(|| machine::peak_fma_gflops(1, secs)),
        fma_gflops_all: best(|| machine::peak_fma_gflops(all, secs)),
        mem_read_gbs_1: best(|| machine::read_bandwidth(big, 1, secs)),
        mem_read_gbs_all: best(|| machine::read_bandwidth(big, all, secs)),
        mem_copy_gbs_1: best(|| machine::copy_bandwidth(big / 2, 1, secs)),
        mem_copy_gbs_all: best(|| machine::copy_bandwidth(big / 2, all, secs)),
        l2_read_gbs_1: best(|| machine::read_bandwidth(256 << 10, 1, secs)),
        l3_read_gbs_1: best(|| machine::read_bandwidth(8 << 20, 1, secs)),
    };
    pool::set_threads(None);
    c
}

/// Caches `c` for later runs; returns where.
pub fn save(c: &Ceilings) -> Result<PathBuf> {
    let path = cache_path();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(c)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

pub fn run(json: bool) -> Result<()> {
    eprintln!("measuring this machine's ceilings (about 15 s) ...");
    let c = measure();
    let path = save(&c)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&c)?);
        return Ok(());
    }
    println!("machine: {} ({} threads)", c.cpu, c.threads);
    println!("| ceiling | 1 thread | {} threads |", c.threads);
    println!("|---|---:|---:|");
    println!(
        "| peak FMA, GFLOP/s (f32) | {:.1} | {:.1} |",
        c.fma_gflops_1, c.fma_gflops_all
    );
    println!(
        "| memory read, GB/s (1 GiB) | {:.1} | {:.1} |",
        c.mem_read_gbs_1, c.mem_read_gbs_all
    );
    println!(
        "| memory copy, GB/s read+write (512 MiB) | {:.1} | {:.1} |",
        c.mem_copy_gbs_1, c.mem_copy_gbs_all
    );
    println!("| L2 read, GB/s (256 KiB) | {:.1} | |", c.l2_read_gbs_1);
    println!("| L3 read, GB/s (8 MiB) | {:.1} | |", c.l3_read_gbs_1);
    println!("cached in {}", path.display());
    Ok(())
}
