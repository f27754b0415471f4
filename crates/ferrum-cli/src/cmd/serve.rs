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
    /// Memory of the paged KV-cache pool, allocated at start: bytes, or with a unit (512MiB, 2GiB,
    /// 1.5GB). Default: enough for --max-num-seqs requests of the full context, at most a quarter
    /// of the memory available at start. Must hold at least one full context.
    #[arg(long, value_parser = parse_bytes)]
    pub kv_cache_memory: Option<usize>,
    /// Positions per KV-cache block (a power of two): the unit of allocation and of prefix sharing.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Do not share KV blocks of common prompt prefixes between requests.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Seconds running requests may take to finish after SIGTERM or SIGINT (no new connections
    /// are accepted meanwhile); requests still running then end with an error.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
}

/// "1073741824", "512MiB", "2GiB", "1.5GB", "800k": a size in bytes.
fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 512MiB, 2GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => {
            return Err(format!(
                "unknown size unit {u:?} (use B, KiB, MiB, GiB, kB, MB, GB)"
            ))
        }
    };
    let bytes = x * mult;
    if !bytes.is_finite() || bytes < 1.0 || bytes > (1u64 << 50) as f64 {
        return Err(format!("{s:?} is not a usable size"));
    }
    Ok(bytes as usize)
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
            prefix_caching: !a.no_prefix_cache,
        },
        max_queue: a.max_queue,
        kv_cache_memory: a.kv_cache_memory,
        block_size: a.block_size,
        drain_timeout: std::time::Duration::try_from_secs_f64(a.drain_timeout)
            .map_err(|_| anyhow::anyhow!("--drain-timeout must be a number of seconds >= 0"))?,
    };
    ferrum_server::serve(llm, cfg, |addr| {
        println!("ferrum serve: listening on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
    })
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("800k"), Ok(800_000));
        for bad in ["", "GiB", "-1", "2XB", "0", "1e9"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
