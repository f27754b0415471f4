//! ferrum-server: an OpenAI-compatible HTTP server over ferrum-llm.
//!
//! - [`scheduler`]: every request the engine holds, as a state machine with no model in it
//!   (`schedule` -> plan, `update` with the step's logits: continuous batching, preemption,
//!   priorities, the prefix cache, sampling through each request's grammar).
//! - [`engine`]: the loop on its own thread that runs `Model::forward_batch` between the
//!   scheduler's two halves; [`kv_blocks`]: the paged KV blocks and the prefix cache.
//! - [`api`]: the HTTP layer (axum on tokio), talking to the engine through channels: the
//!   OpenAI completions and chat endpoints, health, models, metrics. Request schemas and their
//!   validation live apart, in `request` (the shared fields, sampling, `n`, logprobs),
//!   `chat_request` (messages and tools as the chat template reads them, `tool_choice`) and
//!   `structured` (`response_format`, `guided_*`, `grammar`: the grammar a reply must follow).
//! - [`metrics`]: the engine's counters and histograms, and their Prometheus rendering.
//! - [`responses`]: OpenAI's Responses API; [`anthropic`]: Anthropic's Messages API; both render
//!   through the chat template and submit like the chat endpoint.
//! - [`tool_calls`]: tool calls parsed out of model output, whole or streaming, and the grammar
//!   of a required call.
//! - [`tokenize`]: `/tokenize` and `/detokenize`; [`reasoning`]: `<think>` reasoning split from answers.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! let llm = ferrum_llm::Llm::load(
//!     std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
//!     &Default::default(),
//!     &mut |_, _| {},
//! )?;
//! let cfg = ferrum_server::ServerConfig::default();
//! ferrum_server::serve(llm, cfg, |addr| println!("listening on http://{addr}"))?;
//! # Ok(())
//! # }
//! ```

pub mod anthropic;
pub mod api;
pub(crate) mod chat_request;
pub mod engine;
#[doc(hidden)]
pub mod fuzzing;
pub mod kv_blocks;
pub mod metrics;
pub mod reasoning;
pub(crate) mod request;
pub mod responses;
pub mod scheduler;
pub(crate) mod structured;
pub mod tokenize;
pub mod tool_calls;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ferrum_llm::model::KvPool;
use ferrum_llm::Llm;

pub use engine::EngineConfig;

/// Everything `ferrum serve` can set.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// The model name clients see (`/v1/models`) and send.
    pub model_id: String,
    pub engine: EngineConfig,
    /// Requests that may wait beyond the running ones; more get 429 with Retry-After.
    pub max_queue: usize,
    /// Bytes of the KV-cache pool. `None`: enough for `max_num_seqs` full contexts, at most a
    /// quarter of the memory available at start.
    pub kv_cache_memory: Option<usize>,
    /// Positions per KV block (a power of two).
    pub block_size: usize,
    /// After SIGTERM or SIGINT, how long running requests may take to finish before they are
    /// ended with an error.
    pub drain_timeout: std::time::Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            model_id: "default".into(),
            engine: EngineConfig {
                max_num_seqs: 16,
                max_batch_tokens: 512,
                ctx_size: 4096,
                prefix_caching: true,
            },
            max_queue: 256,
            kv_cache_memory: None,
            block_size: 16,
            drain_timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// Serves `llm` until SIGINT or SIGTERM, then stops accepting connections, lets running requests
/// finish, and returns. `on_ready` gets the bound address once the server accepts connections.
pub fn serve(llm: Llm, cfg: ServerConfig, on_ready: impl FnOnce(SocketAddr)) -> Result<()> {
    let llm = Arc::new(llm);
    let template = llm.chat_template().context("the model's chat template")?;
    let pool = kv_pool(&llm, &cfg)?;
    let memory = MemoryReport {
        weights: llm.model.weights.n_bytes(),
        kv_pool: pool.n_bytes(),
    };
    memory.log();
    let (etx, erx) = std::sync::mpsc::channel();
    let metrics = Arc::new(engine::Metrics::default());
    let metrics_for_drain = Arc::clone(&metrics);
    let engine = {
        let llm = Arc::clone(&llm);
        let ecfg = cfg.engine.clone();
        let m = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("ferrum-engine".into())
            .spawn(move || engine::run(llm, ecfg, pool, erx, m))
            .context("starting the engine thread")?
    };
    let state = Arc::new(api::AppState {
        llm,
        template,
        engine: etx,
        model_id: cfg.model_id.clone(),
        ctx_size: cfg.engine.ctx_size,
        next_id: AtomicU64::new(0),
        metrics,
        in_flight: AtomicUsize::new(0),
        max_in_flight: cfg.engine.max_num_seqs + cfg.max_queue,
        block_size: cfg.block_size,
        prefix_caching: cfg.engine.prefix_caching,
        memory,
        grammars: std::sync::OnceLock::new(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
            .await
            .with_context(|| format!("binding {}:{}", cfg.host, cfg.port))?;
        let addr = listener.local_addr()?;
        on_ready(addr);
        axum::serve(listener, api::router(state))
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                // Running requests get `drain_timeout` to finish; then the engine ends them.
                let (m, t) = (metrics_for_drain, cfg.drain_timeout);
                tokio::spawn(async move {
                    tokio::time::sleep(t).await;
                    tracing::warn!("drain time over: ending the requests still running");
                    m.abort_all
                        .store(true, std::sync::atomic::Ordering::Release);
                });
            })
            .await
            .context("serving HTTP")
    })?;
    // The router (and with it the engine's sender) is gone: the engine finishes what it accepted.
    engine
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    Ok(())
}

/// The KV-cache pool `cfg` asks for. Its memory is reserved at start and committed as blocks are
/// first used (the kernel hands out zero pages on first write), so start-up does not pay for
/// memory the first requests do not need. It must hold at least one request of the full context.
pub fn kv_pool(llm: &Llm, cfg: &ServerConfig) -> Result<KvPool> {
    let mcfg = &llm.model.config;
    let bs = cfg.block_size;
    if !bs.is_power_of_two() || bs > 1024 {
        bail!("--block-size {bs} must be a power of two up to 1024");
    }
    let block_bytes = KvPool::block_bytes(mcfg, bs);
    let ctx = cfg.engine.ctx_size;
    let min_blocks = ctx.div_ceil(bs);
    let n_blocks = match cfg.kv_cache_memory {
        Some(bytes) => {
            let n = bytes / block_bytes;
            if n < min_blocks {
                bail!(
                    "--kv-cache-memory {bytes} bytes holds {} tokens; one request of the full \
                     context (--ctx-size {ctx}) needs {} bytes",
                    n * bs,
                    min_blocks * block_bytes
                );
            }
            n
        }
        None => {
            let want = min_blocks * cfg.engine.max_num_seqs;
            let cap = available_memory().map_or(usize::MAX, |m| m / 4 / block_bytes);
            want.min(cap).max(min_blocks)
        }
    };
    let mut pool = KvPool::new(mcfg, n_blocks, bs).context("allocating the KV-cache pool")?;
    // A request reaches at most the context size, however many the pool holds.
    pool.set_seq_context(ctx);
    tracing::info!(
        blocks = n_blocks,
        block_size = bs,
        tokens = n_blocks * bs,
        mib = pool.n_bytes() >> 20,
        "KV-cache pool"
    );
    Ok(pool)
}

/// What the server holds in memory: the weights as stored (each once: repacked for this CPU's
/// kernels, or read in place from the file map), and the KV pool as reserved (committed as
/// blocks are first used).
#[derive(Clone, Copy, Debug)]
pub struct MemoryReport {
    pub weights: usize,
    pub kv_pool: usize,
}

impl MemoryReport {
    /// Logs the parts at start, with the process's resident set now (no KV block is written
    /// yet, so the pool is not in it); the rest of the resident set (tokenizer, code, buffers)
    /// is `other`.
    fn log(&self) {
        let rss = resident_bytes().unwrap_or(0);
        tracing::info!(
            weights_mib = self.weights >> 20,
            kv_pool_reserved_mib = self.kv_pool >> 20,
            rss_mib = rss >> 20,
            other_mib = rss.saturating_sub(self.weights) >> 20,
            "memory at start"
        );
    }
}

/// The process's resident set in bytes (Linux: `VmRSS` in /proc/self/status), `None` where
/// unknown.
pub fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: no new connections; finishing running requests");
}
