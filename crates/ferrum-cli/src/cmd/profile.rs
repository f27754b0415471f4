//! `ferrum profile`: where a prompt and a generation spend their time, per operator.
//!
//! Runs `-p N` prompt tokens (in prefill chunks) and then `-n M` single-token decode steps (of
//! `--batch B` sequences at once, each step one forward pass) with operator profiling on, and prints one table per phase: operator, layer class, calls, total ms,
//! share of the phase's wall time, GFLOP/s, GB/s, arithmetic intensity (FLOPs per byte) and the
//! share reached of the roofline bound at that intensity, min(peak FLOP/s, intensity x memory
//! bandwidth), with this machine's measured ceilings (`ferrum bench --machine`, measured now if
//! none are cached). `--trace` writes a Chrome trace (chrome://tracing, Perfetto) and `--roofline`
//! an SVG roofline chart with one point per operator class.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use ferrum_kernels::profile::{self, Event};
use ferrum_llm::generate::PREFILL_CHUNK;
use ferrum_llm::model::{KvCache, KvPool, Logits, SeqInput};
use serde_json::json;

use super::machine::{self, Ceilings};
use crate::common::ModelArgs;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens to process (0: none).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Tokens to generate one at a time after the prompt (0: none).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    pub n_gen: usize,
    /// Write a Chrome trace (JSON, loads in Perfetto or chrome://tracing) of every operator call.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write a roofline chart (SVG) with the machine's ceilings and one point per operator class.
    #[arg(long)]
    pub roofline: Option<PathBuf>,
    /// Sequences decoded together (each with its own copy of the prompt, shifted by its index):
    /// every prompt chunk and every decode step is one forward pass over all of them, as the
    /// server's batched decode runs them.
    #[arg(long, default_value_t = 1, value_name = "B")]
    pub batch: usize,
    /// Also measure what profiling costs: N rounds of the generation phase with profiling on and
    /// off in turn (fresh cache each), printing the medians. Off, each operator call pays one
    /// relaxed atomic load, strictly less than on, so the on-cost bounds the off-cost. 0: skip.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub overhead: usize,
}

struct Phase {
    name: &'static str,
    wall_s: f64,
    events: Vec<Event>,
}

pub fn run(a: Args) -> Result<()> {
    if a.n_prompt == 0 && a.n_gen == 0 {
        bail!("nothing to profile: give -p and/or -n");
    }
    if a.n_prompt + a.n_gen > 1 << 20 {
        bail!("-p + -n is too large");
    }
    let llm = a.model.load()?;
    let threads = ferrum_kernels::pool::threads();
    let ceilings = match machine::load_cached() {
        Some(c) => c,
        None => {
            eprintln!("no cached machine ceilings: measuring them (ferrum bench --machine) ...");
            let c = machine::measure();
            ferrum_kernels::pool::set_threads(Some(threads));
            let _ = machine::save(&c);
            c
        }
    };
    let cfg = &llm.model.config;
    if a.batch == 0 || a.batch > 256 {
        bail!("--batch must be between 1 and 256");
    }
    // The prompt, then the tokens fed while generating (as `ferrum bench` picks them); sequence
    // i reads them from offset i.
    let b = a.batch;
    let all = super::bench::bench_tokens(&llm, a.n_prompt + a.n_gen + b);
    let toks: Vec<&[u32]> = (0..b).map(|i| &all[i..i + a.n_prompt + a.n_gen]).collect();
    let tokens = toks[0];
    let bs = 16;
    let per_seq = (a.n_prompt + a.n_gen + 1).div_ceil(bs);
    let mut pool = KvPool::new(cfg, b * per_seq, bs)?;
    pool.set_seq_context(per_seq * bs);
    let tables: Vec<Vec<u32>> = (0..b)
        .map(|i| (0..per_seq).map(|j| (i * per_seq + j) as u32).collect())
        .collect();
    // One forward pass over every sequence's tokens `from..to`.
    let mut step = |from: usize, to: usize| -> Result<()> {
        let seqs = (0..b)
            .map(|i| SeqInput {
                tokens: &toks[i][from..to],
                start: from,
                table: &tables[i],
                want: Logits::Last,
            })
            .collect();
        llm.model.forward_batch(&mut pool, seqs)?;
        Ok(())
    };

    // Warm-up (page faults, pool start) outside the profile.
    llm.model
        .forward(&tokens[..1], 0, &mut KvCache::new(cfg, 1), Logits::Last)?;

    let mut phases = Vec::new();
    if a.n_prompt > 0 {
        profile::start();
        let t = Instant::now();
        for from in (0..a.n_prompt).step_by(PREFILL_CHUNK) {
            step(from, (from + PREFILL_CHUNK).min(a.n_prompt))?;
        }
        let wall_s = t.elapsed().as_secs_f64();
        phases.push(Phase {
            name: "prompt",
            wall_s,
            events: profile::stop(),
        });
    }
    if a.n_gen > 0 {
        let mut wall_s = 0.0;
        profile::start();
        for i in 0..a.n_gen {
            let t = Instant::now();
            step(a.n_prompt + i, a.n_prompt + i + 1)?;
            wall_s += t.elapsed().as_secs_f64();
        }
        phases.push(Phase {
            name: "generation",
            wall_s,
            events: profile::stop(),
        });
    }

    println!(
        "model {} ({}), {} thread(s); ceilings: {:.0} GFLOP/s peak FMA, {:.1} GB/s memory read",
        llm.name,
        cfg.arch.name(),
        threads,
        peak(&ceilings, threads),
        bandwidth(&ceilings, threads)
    );
    for ph in &phases {
        print_phase(ph, &ceilings, threads, b * a.n_prompt, b * a.n_gen);
        if ph.name == "generation" && b == 1 && a.n_gen > 0 {
            print_weight_traffic(&llm, ph, a.n_gen);
        }
    }
    if a.overhead > 0 && a.n_gen > 0 {
        let (prompt, gen) = tokens.split_at(a.n_prompt);
        print_overhead(&llm, prompt, gen, a.overhead)?;
    }
    if let Some(path) = &a.trace {
        write_trace(path, &phases)?;
        println!("trace: {}", path.display());
    }
    if let Some(path) = &a.roofline {
        std::fs::write(path, roofline_svg(&phases, &ceilings, threads))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("roofline: {}", path.display());
    }
    Ok(())
}

/// One-token decode is bound by the weight bytes it reads: the matmuls' bytes per token against
/// the model's active weights (for a mixture of experts, the shared weights plus `used / total`
/// of the expert weights, since only the routed experts run).
fn print_weight_traffic(llm: &ferrum_llm::Llm, ph: &Phase, n_gen: usize) {
    let w = &llm.model.weights;
    let total = w.n_bytes() as f64;
    let mut experts = 0f64;
    for l in &w.layers {
        if let Some(m) = l.moe() {
            for e in &m.experts {
                experts += [&e.gate, &e.up, &e.down]
                    .iter()
                    .map(|x| x.weight.n_bytes() as f64)
                    .sum::<f64>();
            }
        }
    }
    let active = match &llm.model.config.moe {
        Some(m) => total - experts + experts * m.n_expert_used as f64 / m.n_expert as f64,
        None => total,
    };
    // Token embedding rows are gathered, not streamed: leave that matrix out of both sides.
    let embd = w.token_embd.n_bytes() as f64;
    let read: f64 = ph
        .events
        .iter()
        .filter(|e| e.op == "matmul")
        .map(|e| e.bytes)
        .sum::<f64>()
        / n_gen as f64;
    let gathered = if w.tied() { 0.0 } else { embd };
    let active_streamed = active - gathered;
    println!(
        "weights read per generated token: {:.2} MiB by the matmuls, {:.2} MiB active ({:.0}% of it; every matrix but the embedding {:.2} MiB{})",
        read / 1048576.0,
        active_streamed / 1048576.0,
        100.0 * read / active_streamed,
        (total - gathered) / 1048576.0,
        if experts > 0.0 {
            format!(", experts {:.2} MiB", experts / 1048576.0)
        } else {
            String::new()
        }
    );
}

/// Generation wall time with profiling on vs off, `rounds` of each in turn (each round writes
/// the same cache positions after the prompt again), medians per token.
fn print_overhead(llm: &ferrum_llm::Llm, prompt: &[u32], gen: &[u32], rounds: usize) -> Result<()> {
    let cfg = &llm.model.config;
    let mut cache = KvCache::new(cfg, prompt.len() + gen.len() + 1);
    for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
        llm.model
            .forward(chunk, i * PREFILL_CHUNK, &mut cache, Logits::Last)?;
    }
    let mut times = [Vec::new(), Vec::new()]; // [off, on]
    let mut calls_per_token = 0.0;
    for round in 0..2 * rounds {
        let on = round % 2 == 1;
        if on {
            profile::start();
        }
        let t = Instant::now();
        for (i, &tok) in gen.iter().enumerate() {
            llm.model
                .forward(&[tok], prompt.len() + i, &mut cache, Logits::Last)?;
        }
        let per_token = t.elapsed().as_secs_f64() / gen.len() as f64;
        if on {
            calls_per_token = profile::stop().len() as f64 / gen.len() as f64;
        }
        times[on as usize].push(per_token);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (off, on) = (median(&mut times[0]), median(&mut times[1]));
    println!(
        "\nprofiler cost, generation, median of {rounds} rounds each: off {:.3} ms/token, on {:.3} ms/token ({:+.2}%); off costs at most what on costs",
        off * 1e3,
        on * 1e3,
        100.0 * (on - off) / off
    );
    // The off path alone: one disabled `record` per operator call.
    let n = 10_000_000u64;
    let t = Instant::now();
    let mut acc = 0u64;
    for i in 0..n {
        acc = acc.wrapping_add(profile::record("op", "class", 0.0, 0.0, || {
            std::hint::black_box(i)
        }));
    }
    std::hint::black_box(acc);
    let call_s = t.elapsed().as_secs_f64() / n as f64;
    println!(
        "profiler off: {calls_per_token:.0} operator calls/token x {:.2} ns per disabled call = {:.2} us/token ({:.4}% of a token)",
        call_s * 1e9,
        calls_per_token * call_s * 1e6,
        100.0 * calls_per_token * call_s / off
    );
    Ok(())
}

fn peak(c: &Ceilings, threads: usize) -> f64 {
    if threads <= 1 {
        c.fma_gflops_1
    } else {
        c.fma_gflops_1
            + (c.fma_gflops_all - c.fma_gflops_1) * ((threads - 1) as f64)
                / ((c.threads.max(2) - 1) as f64)
    }
}

fn bandwidth(c: &Ceilings, threads: usize) -> f64 {
    if threads <= 1 {
        c.mem_read_gbs_1
    } else {
        c.mem_read_gbs_all
    }
}

/// Totals of one (operator, class).
#[derive(Default)]
struct Row {
    calls: usize,
    ns: u64,
    flops: f64,
    bytes: f64,
}

fn group(events: &[Event]) -> BTreeMap<(&'static str, &'static str), Row> {
    let mut m: BTreeMap<(&'static str, &'static str), Row> = BTreeMap::new();
    for e in events {
        let r = m.entry((e.op, e.class)).or_default();
        r.calls += 1;
        r.ns += e.dur_ns;
        r.flops += e.flops;
        r.bytes += e.bytes;
    }
    m
}

fn print_phase(ph: &Phase, c: &Ceilings, threads: usize, n_prompt: usize, n_gen: usize) {
    let groups = group(&ph.events);
    let mut rows: Vec<_> = groups.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1.ns));
    let covered: u64 = rows.iter().map(|(_, r)| r.ns).sum();
    let wall_ms = ph.wall_s * 1e3;
    let tokens = if ph.name == "prompt" { n_prompt } else { n_gen };
    println!(
        "\n{} phase: {tokens} tokens in {wall_ms:.1} ms ({:.1} tokens/s); profiled operators cover {:.1}% of it",
        ph.name,
        tokens as f64 / ph.wall_s,
        100.0 * covered as f64 / 1e6 / wall_ms
    );
    println!(
        "| op | class | calls | total ms | % time | GFLOP/s | GB/s | FLOP/byte | % of roofline |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let (pk, bw) = (peak(c, threads), bandwidth(c, threads));
    for ((op, class), r) in rows {
        let s = r.ns as f64 / 1e9;
        let gflops = r.flops / s / 1e9;
        let gbs = r.bytes / s / 1e9;
        let ai = if r.bytes > 0.0 {
            r.flops / r.bytes
        } else {
            0.0
        };
        let bound = if r.flops > 0.0 {
            (pk).min(ai * bw)
        } else {
            f64::NAN
        };
        // Byte-only operators are measured against bandwidth.
        let frac = if r.flops > 0.0 {
            100.0 * gflops / bound
        } else {
            100.0 * gbs / bw
        };
        println!(
            "| {op} | {class} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | {:.0} |",
            r.calls,
            s * 1e3,
            100.0 * s * 1e3 / wall_ms,
            gflops,
            gbs,
            ai,
            frac
        );
    }
}

fn write_trace(path: &PathBuf, phases: &[Phase]) -> Result<()> {
    let mut events = Vec::new();
    let mut offset_us = 0.0;
    for (i, ph) in phases.iter().enumerate() {
        let end = ph
            .events
            .iter()
            .map(|e| (e.start_ns + e.dur_ns) as f64 / 1e3)
            .fold(0.0, f64::max);
        events.push(json!({
            "name": ph.name, "cat": "phase", "ph": "X", "pid": 1, "tid": 0,
            "ts": offset_us, "dur": end,
        }));
        for e in &ph.events {
            events.push(json!({
                "name": format!("{} {}", e.op, e.class),
                "cat": e.op,
                "ph": "X",
                "pid": 1,
                "tid": 1,
                "ts": offset_us + e.start_ns as f64 / 1e3,
                "dur": e.dur_ns as f64 / 1e3,
                "args": {"flops": e.flops, "bytes": e.bytes, "phase": ph.name, "index": i},
            }));
        }
        offset_us += end + 1000.0;
    }
    let doc = json!({ "traceEvents": events, "displayTimeUnit": "ms" });
    std::fs::write(path, serde_json::to_string(&doc)?)
        .with_context(|| format!("writing {}", path.display()))
}

fn roofline_svg(phases: &[Phase], c: &Ceilings, threads: usize) -> String {
    let (pk, bw) = (peak(c, threads), bandwidth(c, threads));
    let (w, h, ml, mb, mt, mr) = (760.0, 520.0, 70.0, 50.0, 30.0, 190.0);
    let (x0, x1) = (-2.0f64, 3.0f64); // log10 FLOP/byte
    let (y0, y1) = (-1.0f64, (pk * 4.0).log10().ceil());
    let px = |ai: f64| ml + (ai.log10().clamp(x0, x1) - x0) / (x1 - x0) * (w - ml - mr);
    let py = |g: f64| h - mb - (g.max(1e-9).log10().clamp(y0, y1) - y0) / (y1 - y0) * (h - mb - mt);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{ml}" y="18" font-size="13">Roofline, {threads} thread(s): {pk:.0} GFLOP/s peak FMA, {bw:.1} GB/s memory read</text>"#
    );
    // Grid and axes.
    for d in (x0 as i32)..=(x1 as i32) {
        let x = px(10f64.powi(d));
        let _ = writeln!(
            s,
            r##"<line x1="{x}" y1="{mt}" x2="{x}" y2="{}" stroke="#ddd"/><text x="{x}" y="{}" text-anchor="middle">{}</text>"##,
            h - mb,
            h - mb + 15.0,
            10f64.powi(d)
        );
    }
    for d in (y0 as i32)..=(y1 as i32) {
        let y = py(10f64.powi(d));
        let _ = writeln!(
            s,
            r##"<line x1="{ml}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            w - mr,
            ml - 5.0,
            y + 4.0,
            10f64.powi(d)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">arithmetic intensity (FLOP/byte)</text>"#,
        (ml + w - mr) / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">GFLOP/s</text>"#,
        (mt + h - mb) / 2.0,
        (mt + h - mb) / 2.0
    );
    // Ceilings: bandwidth slope up to the ridge, then the compute roof.
    let ridge = pk / bw;
    let a_lo = 10f64.powf(x0);
    let _ = writeln!(
        s,
        r##"<polyline fill="none" stroke="#c00" stroke-width="2" points="{},{} {},{} {},{}"/>"##,
        px(a_lo),
        py(a_lo * bw),
        px(ridge),
        py(pk),
        px(10f64.powf(x1)),
        py(pk)
    );
    // Points: one per (phase, op, class).
    let colors = ["#1f77b4", "#2ca02c"];
    let mut ly = mt + 10.0;
    for (pi, ph) in phases.iter().enumerate() {
        let color = colors[pi % colors.len()];
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{ly}" fill="{color}" font-size="12">{} phase</text>"#,
            w - mr + 10.0,
            ph.name
        );
        ly += 15.0;
        for ((op, class), r) in group(&ph.events) {
            if r.flops <= 0.0 || r.bytes <= 0.0 || r.ns == 0 {
                continue;
            }
            let secs = r.ns as f64 / 1e9;
            let (ai, g) = (r.flops / r.bytes, r.flops / secs / 1e9);
            let (x, y) = (px(ai), py(g));
            let _ = writeln!(
                s,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{color}"><title>{} {op} {class}: {g:.1} GFLOP/s at {ai:.2} FLOP/byte</title></circle>"#,
                ph.name
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" font-size="9" fill="{color}">{class}</text>"#,
                x + 5.0,
                y - 3.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
