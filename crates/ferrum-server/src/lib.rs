//! ferrum-server: an OpenAI-compatible HTTP server over ferrum-llm.
//!
//! - [`engine`]: the scheduler and model runner, a synchronous state machine on its own thread
//!   (continuous batching over `Model::forward_batch`).
//! - [`api`]: the HTTP layer (axum on tokio), talking to the engine through channels.
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

pub mod api;
pub mod engine;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

use anyhow::{Context, Result};
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
            },
            max_queue: 256,
        }
    }
}

/// Serves `llm` until SIGINT or SIGTERM, then stops accepting connections, lets running requests
/// finish, and returns. `on_ready` gets the bound address once the server accepts connections.
pub fn serve(llm: Llm, cfg: ServerConfig, on_ready: impl FnOnce(SocketAddr)) -> Result<()> {
    let llm = Arc::new(llm);
    let template = llm.chat_template().context("the model's chat template")?;
    let (etx, erx) = std::sync::mpsc::channel();
    let metrics = Arc::new(engine::Metrics::default());
    let engine = {
        let llm = Arc::clone(&llm);
        let ecfg = cfg.engine.clone();
        let m = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("ferrum-engine".into())
            .spawn(move || engine::run(llm, ecfg, erx, m))
            .context("starting the engine thread")?
    };
    let kv_per_token = 2 * 2 * llm.model.config.n_layer * llm.model.config.kv_dim();
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
        kv_capacity_bytes: kv_per_token * cfg.engine.ctx_size * cfg.engine.max_num_seqs,
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
            .with_graceful_shutdown(shutdown_signal())
            .await
            .context("serving HTTP")
    })?;
    // The router (and with it the engine's sender) is gone: the engine finishes what it accepted.
    engine
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    Ok(())
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
