//! What the server measures and how `/metrics` shows it: the engine's counters, gauges and
//! latency histograms ([`Metrics`], updated by the engine and the scheduler as they run), and
//! their rendering in Prometheus text format ([`render`]) under vLLM's names where vLLM has one
//! (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`,
//! ...) and `ferrum:` names for the rest (KV blocks, weights and pool bytes).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::MemoryReport;

/// Counters and histograms the engine keeps for `/metrics`.
#[derive(Default)]
pub struct Metrics {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// KV blocks held by requests, and the pool's size.
    pub kv_blocks_used: AtomicUsize,
    pub kv_blocks_total: AtomicUsize,
    /// Blocks written at least once (their memory is committed).
    pub kv_blocks_committed: AtomicUsize,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub preemptions: AtomicU64,
    /// Set when the drain time after SIGTERM is over: the engine ends every request it holds.
    pub abort_all: std::sync::atomic::AtomicBool,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Finished requests by reason.
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
    pub finished_abort: AtomicU64,
    /// Seconds from arrival to the first token.
    pub ttft: Histogram,
    /// Seconds between consecutive tokens of a request.
    pub itl: Histogram,
}

/// A Prometheus histogram with fixed bucket bounds (seconds).
pub struct Histogram {
    pub bounds: Vec<f64>,
    inner: Mutex<(Vec<u64>, f64, u64)>, // per-bucket counts, sum, count
}

impl Default for Histogram {
    fn default() -> Self {
        let bounds = vec![
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0,
        ];
        Histogram {
            inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)),
            bounds,
        }
    }
}

impl Histogram {
    pub fn observe(&self, v: f64) {
        let mut g = self.inner.lock().unwrap();
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            g.0[i] += 1;
        }
        g.1 += v;
        g.2 += 1;
    }

    /// Cumulative bucket counts, sum and count.
    pub fn snapshot(&self) -> (Vec<u64>, f64, u64) {
        let g = self.inner.lock().unwrap();
        let mut acc = 0;
        let cum =
            g.0.iter()
                .map(|&c| {
                    acc += c;
                    acc
                })
                .collect();
        (cum, g.1, g.2)
    }
}

/// What `/metrics` reports besides the counters: the model and the memory layout.
pub struct Info<'a> {
    pub model_id: &'a str,
    pub block_size: usize,
    pub prefix_caching: bool,
    pub memory: &'a MemoryReport,
}

/// The metrics in Prometheus text format, with vLLM's metric names where one exists.
pub fn render(m: &Metrics, st: &Info<'_>) -> String {
    use std::fmt::Write as _;
    let label = format!(
        "model_name=\"{}\"",
        st.model_id.replace('\\', "\\\\").replace('"', "\\\"")
    );
    let mut o = String::new();
    let gauge = |o: &mut String, name: &str, help: &str, v: f64| {
        let _ = writeln!(
            o,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{label}}} {v}"
        );
    };
    let counter = |o: &mut String, name: &str, help: &str, v: u64| {
        let _ = writeln!(
            o,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{label}}} {v}"
        );
    };
    gauge(
        &mut o,
        "vllm:num_requests_running",
        "Requests in the running batch.",
        m.running.load(Ordering::Acquire) as f64,
    );
    gauge(
        &mut o,
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled.",
        m.waiting.load(Ordering::Relaxed) as f64,
    );
    let used = m.kv_blocks_used.load(Ordering::Relaxed) as f64;
    let total = m.kv_blocks_total.load(Ordering::Relaxed) as f64;
    gauge(
        &mut o,
        "vllm:kv_cache_usage_perc",
        "Fraction of KV-cache blocks held by requests (cached free blocks count as free).",
        used / total.max(1.0),
    );
    gauge(
        &mut o,
        "ferrum:kv_cache_blocks_used",
        "KV-cache blocks held by requests.",
        used,
    );
    gauge(
        &mut o,
        "ferrum:kv_cache_blocks_free",
        "KV-cache blocks free (including those still caching a prefix).",
        total - used,
    );
    gauge(
        &mut o,
        "ferrum:kv_cache_blocks_committed",
        "KV-cache blocks written at least once (the pool's memory is committed as blocks are first used).",
        m.kv_blocks_committed.load(Ordering::Relaxed) as f64,
    );
    let _ = writeln!(
        o,
        "# HELP vllm:cache_config_info KV-cache configuration.\n# TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{{label},block_size=\"{}\",num_gpu_blocks=\"{}\",\
         enable_prefix_caching=\"{}\",cache_dtype=\"f16\"}} 1",
        st.block_size, total, st.prefix_caching
    );
    counter(
        &mut o,
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        m.prefix_queries.load(Ordering::Relaxed),
    );
    counter(
        &mut o,
        "vllm:prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        m.prefix_hits.load(Ordering::Relaxed),
    );
    counter(
        &mut o,
        "vllm:num_preemptions",
        "Requests preempted (out of KV blocks) to be recomputed later.",
        m.preemptions.load(Ordering::Relaxed),
    );
    counter(
        &mut o,
        "vllm:prompt_tokens_total",
        "Prompt tokens processed.",
        m.prompt_tokens.load(Ordering::Relaxed),
    );
    counter(
        &mut o,
        "vllm:generation_tokens_total",
        "Tokens generated.",
        m.generation_tokens.load(Ordering::Relaxed),
    );
    let _ = writeln!(o, "# HELP vllm:request_success_total Finished requests.\n# TYPE vllm:request_success_total counter");
    for (reason, c) in [
        ("stop", &m.finished_stop),
        ("length", &m.finished_length),
        ("abort", &m.finished_abort),
    ] {
        let _ = writeln!(
            o,
            "vllm:request_success_total{{{label},finished_reason=\"{reason}\"}} {}",
            c.load(Ordering::Relaxed)
        );
    }
    for (name, help, h) in [
        (
            "vllm:time_to_first_token_seconds",
            "Seconds from arrival to the first token.",
            &m.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Seconds between successive tokens of a request.",
            &m.itl,
        ),
    ] {
        let (cum, sum, count) = h.snapshot();
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in h.bounds.iter().zip(&cum) {
            let _ = writeln!(o, "{name}_bucket{{{label},le=\"{b}\"}} {c}");
        }
        let _ = writeln!(o, "{name}_bucket{{{label},le=\"+Inf\"}} {count}");
        let _ = writeln!(
            o,
            "{name}_sum{{{label}}} {sum}\n{name}_count{{{label}}} {count}"
        );
    }
    // Memory: the process's resident set (the standard process-collector name), and what the
    // weights and the KV pool take.
    if let Some(rss) = crate::resident_bytes() {
        let _ = writeln!(
            o,
            "# HELP process_resident_memory_bytes Resident memory size in bytes.
             # TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes {rss}"
        );
    }
    gauge(
        &mut o,
        "ferrum:weights_bytes",
        "Bytes of the model's weights as stored (each matrix once).",
        st.memory.weights as f64,
    );
    gauge(
        &mut o,
        "ferrum:kv_cache_reserved_bytes",
        "Bytes reserved for the KV-cache pool (committed as blocks are first used).",
        st.memory.kv_pool as f64,
    );
    o
}
