//! `ferrum bench`: prompt-processing (ppN) and generation (tgN) speed in llama-bench's table shape,
//! and `--machine`, this machine's compute and memory ceilings.
//!
//! As llama-bench does: `ppN` runs N tokens (BOS then pseudo-random ids) through an empty cache in
//! prefill chunks and times it; `tgN` decodes N tokens one at a time from an empty cache (each
//! step computes logits; no sampling). Each (test, threads) pair gets one warm-up run, then `-r`
//! timed repetitions; the table shows the median tokens/s and the standard deviation.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args as ClapArgs;
use ferrum_llm::generate::PREFILL_CHUNK;
use ferrum_llm::model::{KvCache, Logits};
use ferrum_llm::Llm;
use serde_json::json;

use crate::common::ModelArgs;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Path to a GGUF model file (default: the default model, as for `generate`).
    #[arg(short, long)]
    pub model: Option<std::path::PathBuf>,
    /// Prompt lengths to test (comma-separated; 0 skips prompt processing).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (comma-separated; 0 skips generation).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Thread counts to test (comma-separated). Default: all cores.
    #[arg(short, long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Timed repetitions of each test (after one warm-up run).
    #[arg(short, long, default_value_t = 5)]
    pub repetitions: usize,
    /// Batched decoding, in the shape of llama.cpp's `llama-batched-bench`: for each B given
    /// (comma-separated), B sequences each process a prompt of every `-p` length, then decode
    /// every `-n` tokens together (one forward pass per step for all B); prints prompt and
    /// decode tokens/s, aggregated over the sequences.
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Print one JSON array (an object per test and thread count) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Storage type of the KV cache (f16, f32, q8_0, q4_0; llama-bench's -ctk/-ctv).
    #[arg(long, value_name = "TYPE", default_value = "f16", value_parser = crate::common::parse_kv_type)]
    pub kv_cache_type: ferrum_core::DType,
    /// Summation order of the quantized matrix products, as for `generate`: `llama` (default,
    /// llama.cpp's bits) or `blocks` (faster on AVX-512 VNNI for Q4_1, Q5_0, Q8_0; see
    /// `ferrum generate --help`).
    #[arg(long, value_name = "ORDER", value_parser = ["llama", "blocks"])]
    pub dot_order: Option<String>,
    /// Measure this machine's ceilings (FMA GFLOP/s, memory and cache bandwidth) instead, print
    /// them, and cache them for `ferrum profile`.
    #[arg(long)]
    pub machine: bool,
}

pub fn run(a: Args) -> Result<()> {
    if a.machine {
        return super::machine::run(a.json);
    }
    if a.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    if a.threads.contains(&0) {
        bail!("--threads must be at least 1");
    }
    let threads = if a.threads.is_empty() {
        vec![ferrum_kernels::pool::available_threads()]
    } else {
        a.threads.clone()
    };
    let margs = ModelArgs {
        model: a.model.clone(),
        threads: None,
        dequantize: false,
        kv_cache_type: a.kv_cache_type,
        dot_order: a.dot_order.clone(),
    };
    let llm = margs.load()?;
    if ferrum_kernels::matmul::block_order() && !a.json {
        println!(
            "quantized products in the block order (--dot-order blocks): figures are not of \
             llama.cpp's float order\n"
        );
    }
    if !a.batch.is_empty() {
        return batched(&a, &llm, &threads);
    }
    let cfg = &llm.model.config;
    let size = llm.model.weights.n_bytes();
    let params = llm.model.weights.n_params();

    let mut tests: Vec<(String, usize, bool)> = Vec::new();
    for &p in a.n_prompt.iter().filter(|&&p| p > 0) {
        tests.push((format!("pp{p}"), p, true));
    }
    for &n in a.n_gen.iter().filter(|&&n| n > 0) {
        tests.push((format!("tg{n}"), n, false));
    }
    for (_, n, _) in &tests {
        if *n > 1 << 20 {
            bail!("test length {n} is too large");
        }
    }

    let ceilings = super::machine::load_cached();
    let bytes_per_token = llm
        .model
        .weights
        .bytes_per_token(llm.model.config.moe.map_or(0, |m| m.n_expert_used));
    // Decode bound: weight bytes per token over the measured read bandwidth at this thread count.
    let bound = |t: usize| -> Option<f64> {
        let c = ceilings.as_ref()?;
        let gbs = if t <= 1 {
            c.mem_read_gbs_1
        } else {
            c.mem_read_gbs_all
        };
        Some(gbs * 1e9 / bytes_per_token as f64)
    };
    let mut notes = Vec::new();
    let mut rows = Vec::new();
    if !a.json {
        println!(
            "| model                          |       size |     params | backend    | threads |            test |                  t/s |"
        );
        println!(
            "| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |"
        );
    }
    for &t in &threads {
        ferrum_kernels::pool::set_threads(Some(t));
        for (name, n, is_prompt) in &tests {
            let ctx = n + 1;
            let mut cache = KvCache::new(cfg, ctx);
            let tokens = bench_tokens(&llm, *n);
            let run_once = |cache: &mut KvCache| -> Result<f64> {
                let start = Instant::now();
                if *is_prompt {
                    for (i, chunk) in tokens.chunks(PREFILL_CHUNK).enumerate() {
                        llm.model
                            .forward(chunk, i * PREFILL_CHUNK, cache, Logits::Last)?;
                    }
                } else {
                    for (pos, &tok) in tokens.iter().enumerate() {
                        llm.model.forward(&[tok], pos, cache, Logits::Last)?;
                    }
                }
                Ok(start.elapsed().as_secs_f64())
            };
            run_once(&mut cache)?;
            let mut speeds: Vec<f64> = (0..a.repetitions)
                .map(|_| run_once(&mut cache).map(|s| *n as f64 / s))
                .collect::<Result<_>>()?;
            speeds.sort_by(f64::total_cmp);
            let median = if speeds.len() % 2 == 1 {
                speeds[speeds.len() / 2]
            } else {
                (speeds[speeds.len() / 2 - 1] + speeds[speeds.len() / 2]) / 2.0
            };
            let mean = speeds.iter().sum::<f64>() / speeds.len() as f64;
            let stddev = if speeds.len() > 1 {
                (speeds.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (speeds.len() - 1) as f64)
                    .sqrt()
            } else {
                0.0
            };
            let tg_bound = if *is_prompt { None } else { bound(t) };
            if let Some(b) = tg_bound {
                notes.push(format!(
                    "{name} at {t} thread(s): {median:.1} tok/s = {:.0}% of the memory-bandwidth bound {b:.0} tok/s ({:.1} MB of weights per token)",
                    100.0 * median / b,
                    bytes_per_token as f64 / 1e6
                ));
            }
            if a.json {
                rows.push(json!({
                    "bandwidth_bound_tokens_per_second": tg_bound,
                    "model": llm.name,
                    "dot_order": dot_order_name(),
                    "model_bytes": size,
                    "model_params": params,
                    "test": name,
                    "threads": t,
                    "tokens_per_second": median,
                    "stddev": stddev,
                    "repetitions": a.repetitions,
                    "samples_tokens_per_second": speeds,
                }));
            } else {
                println!(
                    "| {:<30} | {:>6.2} MiB | {:>8.2} M | {:<10} | {:>7} | {:>15} | {:>20} |",
                    truncate(&format!("{} {}", cfg.arch.name(), llm.name), 30),
                    size as f64 / (1u64 << 20) as f64,
                    params as f64 / 1e6,
                    backend(),
                    t,
                    name,
                    format!("{median:.2} ± {stddev:.2}")
                );
            }
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else if ceilings.is_none() && a.n_gen.iter().any(|&n| n > 0) {
        println!("\n(run `ferrum bench --machine` once to see decode speed against the memory-bandwidth bound)");
    } else if !notes.is_empty() {
        println!();
        for n in notes {
            println!("{n}");
        }
    }
    Ok(())
}

/// Median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `--batch`: llama-batched-bench's test. For each (threads, prompt length P, generation length
/// N, batch B): B sequences with P-token prompts (distinct pseudo-random tokens each) are
/// prefilled in forward passes of up to [`PREFILL_CHUNK`] tokens (several sequences per pass,
/// as a server's scheduler packs them), then decode N steps of B tokens, each step one forward
/// pass over all B sequences with their caches in one paged pool. Times are medians over the
/// repetitions (after a warm-up).
fn batched(a: &Args, llm: &Llm, threads: &[usize]) -> Result<()> {
    use ferrum_llm::model::{KvPool, SeqInput};
    if a.batch.contains(&0) || a.batch.iter().any(|&b| b > 1024) {
        bail!("--batch sizes must be between 1 and 1024");
    }
    let cfg = &llm.model.config;
    let bs = 16;
    let mut rows = Vec::new();
    if !a.json {
        println!(
            "|    PP |     TG |    B | threads |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
        );
        println!(
            "|-------|--------|------|---------|--------|----------|----------|----------|----------|----------|----------|"
        );
    }
    for &t in threads {
        ferrum_kernels::pool::set_threads(Some(t));
        for &pp in &a.n_prompt {
            for &tg in &a.n_gen {
                if pp + tg == 0 || pp + tg > 1 << 20 {
                    bail!("prompt {pp} + generation {tg} tokens is out of range");
                }
                for &b in &a.batch {
                    let per_seq = (pp + tg).div_ceil(bs);
                    let mut pool = KvPool::new(cfg, b * per_seq, bs)?;
                    pool.set_seq_context(per_seq * bs);
                    let tables: Vec<Vec<u32>> = (0..b)
                        .map(|i| (0..per_seq).map(|j| (i * per_seq + j) as u32).collect())
                        .collect();
                    // Sequence i's tokens: the bench sequence, shifted by i (distinct prompts).
                    let all = bench_tokens(llm, pp + tg + b);
                    let toks: Vec<&[u32]> = (0..b).map(|i| &all[i..i + pp + tg]).collect();
                    let mut run_once = || -> Result<(f64, f64)> {
                        let start = Instant::now();
                        // Prompts: whole sequences' chunks packed into passes of PREFILL_CHUNK.
                        let mut done = vec![0usize; b];
                        while done.iter().any(|&d| d < pp) {
                            let mut budget = PREFILL_CHUNK;
                            let mut seqs = Vec::new();
                            for i in 0..b {
                                if done[i] < pp && budget > 0 {
                                    let n = (pp - done[i]).min(budget);
                                    seqs.push(SeqInput {
                                        tokens: &toks[i][done[i]..done[i] + n],
                                        start: done[i],
                                        table: &tables[i],
                                        want: if done[i] + n == pp {
                                            Logits::Last
                                        } else {
                                            Logits::None
                                        },
                                    });
                                    done[i] += n;
                                    budget -= n;
                                }
                            }
                            llm.model.forward_batch(&mut pool, seqs)?;
                        }
                        let t_pp = start.elapsed().as_secs_f64();
                        let start = Instant::now();
                        for step in 0..tg {
                            let seqs: Vec<SeqInput> = (0..b)
                                .map(|i| SeqInput {
                                    tokens: &toks[i][pp + step..pp + step + 1],
                                    start: pp + step,
                                    table: &tables[i],
                                    want: Logits::Last,
                                })
                                .collect();
                            llm.model.forward_batch(&mut pool, seqs)?;
                        }
                        Ok((t_pp, start.elapsed().as_secs_f64()))
                    };
                    run_once()?;
                    let runs: Vec<(f64, f64)> = (0..a.repetitions)
                        .map(|_| run_once())
                        .collect::<Result<_>>()?;
                    let t_pp = median(&mut runs.iter().map(|r| r.0).collect::<Vec<_>>());
                    let t_tg = median(&mut runs.iter().map(|r| r.1).collect::<Vec<_>>());
                    let (n_pp, n_tg) = ((b * pp) as f64, (b * tg) as f64);
                    let rate = |n: f64, s: f64| if s > 0.0 { n / s } else { 0.0 };
                    let (s_pp, s_tg) = (rate(n_pp, t_pp), rate(n_tg, t_tg));
                    let s_all = rate(n_pp + n_tg, t_pp + t_tg);
                    if a.json {
                        rows.push(json!({
                            "model": llm.name,
                            "dot_order": dot_order_name(),
                            "pp": pp,
                            "tg": tg,
                            "batch": b,
                            "threads": t,
                            "n_kv": b * (pp + tg),
                            "t_pp": t_pp,
                            "speed_pp": s_pp,
                            "t_tg": t_tg,
                            "speed_tg": s_tg,
                            "t": t_pp + t_tg,
                            "speed": s_all,
                            "repetitions": a.repetitions,
                        }));
                    } else {
                        println!(
                            "| {pp:5} | {tg:6} | {b:4} | {t:7} | {:6} | {t_pp:8.3} | {s_pp:8.2} | {t_tg:8.3} | {s_tg:8.2} | {:8.3} | {s_all:8.2} |",
                            b * (pp + tg),
                            t_pp + t_tg
                        );
                    }
                }
            }
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    Ok(())
}

/// The summation order of the quantized products (`--dot-order`), for the JSON rows.
fn dot_order_name() -> &'static str {
    if ferrum_kernels::matmul::block_order() {
        "blocks"
    } else {
        "llama"
    }
}

/// The kernel set in use, for the table's backend column.
fn backend() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if ferrum_kernels::matmul::avx512::available() {
        return "CPU AVX512";
    }
    match ferrum_kernels::quant::isa() {
        ferrum_kernels::quant::Isa::Avx2 => "CPU AVX2",
        ferrum_kernels::quant::Isa::Scalar => "CPU scalar",
    }
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// `n` token ids: BOS (when the model adds one), then a fixed pseudo-random sequence.
pub(crate) fn bench_tokens(llm: &Llm, n: usize) -> Vec<u32> {
    let n_vocab = llm.model.config.n_vocab as u64;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut v: Vec<u32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n_vocab) as u32
        })
        .collect();
    if let (Some(first), Some(bos)) = (
        v.first_mut(),
        llm.tokenizer.bos().filter(|_| llm.tokenizer.add_bos()),
    ) {
        *first = bos;
    }
    v
}
