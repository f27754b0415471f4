//! `ferrum serve`: the OpenAI-compatible server (see `ferrum-server`).

use anyhow::{bail, Result};
use clap::Args as ClapArgs;
use ferrum_server::{EngineConfig, ServerConfig};

use crate::common::ModelArgs;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed when ready).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Model name reported by /v1/models (default: the model's name).
    #[arg(long)]
    pub model_id: Option<String>,
    /// Largest prompt + completion of one request, in tokens.
    #[arg(short, long, default_value_t = 4096)]
    pub ctx_size: usize,
    /// Requests generating at once; more wait in the queue.
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    /// Tokens per engine step (decode tokens plus prompt chunks): long prompts are split so other
    /// requests keep decoding.
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Requests that may wait beyond the running ones; more are refused with 429 and Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
}

pub fn run(a: Args) -> Result<()> {
    if a.max_num_seqs == 0 || a.max_batch_tokens == 0 || a.ctx_size < 2 {
        bail!("--max-num-seqs and --max-batch-tokens must be at least 1, --ctx-size at least 2");
    }
    let llm = a.model.load()?;
    let cfg = ServerConfig {
        host: a.host.clone(),
        port: a.port,
        model_id: a.model_id.clone().unwrap_or_else(|| llm.name.clone()),
        engine: EngineConfig {
            max_num_seqs: a.max_num_seqs,
            max_batch_tokens: a.max_batch_tokens,
            ctx_size: a.ctx_size.min(llm.model.config.n_ctx_train.max(2)),
        },
        max_queue: a.max_queue,
    };
    ferrum_server::serve(llm, cfg, |addr| {
        println!("ferrum serve: listening on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
    })
}
