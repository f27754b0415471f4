//! Flags and helpers shared by the subcommands: model location, threads, sampling, loading.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrum_llm::{Llm, LoadOptions, SamplingParams};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The model used when --model is not given.
pub const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FERRUM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Path to a GGUF model file. Default: SmolLM2-135M-Instruct Q4_1 from $FERRUM_MODELS_DIR or
    /// ./models (fetched by `python3 scripts/fetch_models.py`).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Worker threads for the kernels (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Store all weights as F32 and run without quantized kernels (slow; a reference path).
    #[arg(long)]
    pub dequantize: bool,
    /// Storage type of the KV cache, K and V alike (llama.cpp's -ctk/-ctv): f16 (default, as
    /// llama.cpp), f32 (exact, twice the memory), q8_0 (half of f16), q4_0 (a quarter, plus
    /// scales). The quantized types need a head dimension that is a multiple of 32.
    #[arg(long, value_name = "TYPE", default_value = "f16", value_parser = parse_kv_type)]
    pub kv_cache_type: ferrum_core::DType,
    /// Summation order of the quantized matrix products. `llama` (the default): llama.cpp's x86
    /// order, so outputs match llama.cpp's bit for bit. `blocks`: on CPUs with AVX-512 VNNI,
    /// Q4_1, Q5_0 and Q8_0 weights sum each 32-element block as one integer before a single
    /// float multiply-add, about half the vector work (SmolLM2, 2 threads: prompts ~1.4x and
    /// 8-sequence batched decode ~1.15x faster; one-stream decode, memory-bound, unchanged); results then differ from llama.cpp's by float
    /// rounding, which the next layer's activation quantization can grow to a few hundredths in
    /// token probabilities. Same as the environment's `FERRUM_DOT_ORDER=blocks`.
    #[arg(long, value_name = "ORDER", value_parser = ["llama", "blocks"])]
    pub dot_order: Option<String>,
}

/// Applies `--dot-order` (process-wide; without the flag, `FERRUM_DOT_ORDER` decides).
pub fn set_dot_order(order: Option<&str>) {
    if let Some(o) = order {
        ferrum_kernels::matmul::set_block_order(o == "blocks");
    }
    tracing::info!(
        blocks = ferrum_kernels::matmul::block_order(),
        "quantized dot products in the block order"
    );
}

/// `f32`, `f16`, `q8_0` or `q4_0` (any case) as a KV-cache storage type.
pub fn parse_kv_type(s: &str) -> std::result::Result<ferrum_core::DType, String> {
    ferrum_llm::model::kv_cache::KV_TYPES
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(s))
        .ok_or_else(|| format!("unknown KV cache type '{s}' (f32, f16, q8_0, q4_0)"))
}

impl ModelArgs {
    pub fn path(&self) -> Result<PathBuf> {
        if let Some(p) = &self.model {
            return Ok(p.clone());
        }
        let dir = std::env::var_os("FERRUM_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("models"));
        let p = dir.join(DEFAULT_MODEL);
        if !p.exists() {
            bail!(
                "no --model given and the default model {} is missing: run `python3 scripts/fetch_models.py`",
                p.display()
            );
        }
        Ok(p)
    }

    /// Sets the thread count, then loads the model with a progress bar if loading takes over a second.
    pub fn load(&self) -> Result<Llm> {
        set_threads(self.threads)?;
        set_dot_order(self.dot_order.as_deref());
        let path = self.path()?;
        if !path.exists() {
            bail!("{}: no such file", path.display());
        }
        let start = Instant::now();
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(
            path.file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        let mut shown = false;
        let opts = LoadOptions {
            dequantize: self.dequantize,
            kv_type: self.kv_cache_type,
        };
        let llm = Llm::load(&path, &opts, &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            if !shown && start.elapsed() > Duration::from_secs(1) {
                bar.set_draw_target(ProgressDrawTarget::stderr());
                shown = true;
            }
        })
        .with_context(|| format!("loading {}", path.display()))?;
        bar.finish_and_clear();
        tracing::info!(model = %llm.name, seconds = start.elapsed().as_secs_f64(), "model loaded");
        Ok(llm)
    }
}

pub fn set_threads(threads: Option<usize>) -> Result<()> {
    if threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    ferrum_kernels::pool::set_threads(threads);
    Ok(())
}

/// Sampling flags (defaults are llama.cpp's).
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature; 0 means greedy (always the most likely token).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability adds up to P (1.0: off).
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0: off).
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise tokens seen in the last --repeat-last-n tokens (1.0: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Subtracted from the logit of every token already seen (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit per time it was seen (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Random seed; the same seed and settings reproduce the same text. Default: random.
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    pub fn params(&self) -> Result<SamplingParams> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: self.repeat_last_n,
            seed,
        };
        p.validate().map_err(anyhow::Error::msg)?;
        Ok(p)
    }
}
