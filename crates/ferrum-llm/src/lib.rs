//! ferrum-llm: large language models on ferrum's kernels.
//!
//! - [`model`]: configs, weights and the architectures (llama, qwen2, gemma3), the KV cache.
//! - [`generate`]: prompt prefill, sampling or teacher forcing, streaming text, stop strings.
//! - [`sampling`]: llama.cpp's sampler chain; [`perplexity`]: llama-perplexity's method.
//! - [`Llm`]: a model, its tokenizer and chat template, loaded from a GGUF file or a Hugging Face folder.
//! - [`hf`]: Hugging Face `config.json`, safetensors weights, hub downloads.

pub mod generate;
pub mod hf;
pub mod model;
pub mod perplexity;
pub mod sampling;
pub mod text;

use std::path::Path;

use ferrum_core::{Error, Result};
use ferrum_gguf::GgufFile;
use ferrum_tokenizer::Tokenizer;

pub use generate::{generate, FinishReason, GenerateRequest, Generation};
pub use model::{Config, Model};
pub use sampling::SamplingParams;

/// Options for [`Llm::load`].
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Store every matrix as F32 (a reference path without quantized kernels).
    pub dequantize: bool,
}

/// A loaded model with everything needed to turn text into text.
pub struct Llm {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
    /// A short human name (general.name or the file name).
    pub name: String,
}

impl Llm {
    /// Loads a GGUF file, or a Hugging Face model folder (see [`Llm::load_hf`]; a `.safetensors`
    /// or `config.json` path loads the folder holding it). `progress(done, total)` reports layers loaded.
    pub fn load(
        path: &Path,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Llm> {
        if path.is_dir() {
            return Self::load_hf(path, opts, progress);
        }
        let hf_file = path.extension().is_some_and(|e| e == "safetensors")
            || path.file_name().is_some_and(|n| n == "config.json");
        if hf_file {
            let dir = path
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            return Self::load_hf(dir, opts, progress);
        }
        let file = GgufFile::open(path)?;
        Self::from_gguf(&file, path, opts, progress)
    }

    /// Loads a Hugging Face model folder: `config.json` (llama, mistral, qwen2, gemma3), the
    /// `*.safetensors` weights (F32/F16/BF16, sharded through `model.safetensors.index.json` or
    /// not; memory-mapped), `tokenizer.json`, and the chat template from `tokenizer_config.json`
    /// or `chat_template.jinja`. With `opts.dequantize` every matrix is re-stored as F32.
    pub fn load_hf(
        dir: &Path,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Llm> {
        hf::load(dir, opts, progress)
    }

    pub fn from_gguf(
        file: &GgufFile,
        path: &Path,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Llm> {
        let config = Config::from_gguf(file)?;
        let tokenizer = Tokenizer::from_gguf(file)?;
        if tokenizer.vocab_size() != config.n_vocab {
            return Err(Error::msg(format!(
                "tokenizer has {} tokens but the model's vocabulary is {}",
                tokenizer.vocab_size(),
                config.n_vocab
            )));
        }
        let mut weights =
            model::Weights::load(&model::weights::GgufSource(file), &config, progress)?;
        if opts.dequantize {
            weights = weights.dequantized();
        }
        let name = file
            .get("general.name")
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| {
                path.file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            });
        Ok(Llm {
            chat_template: tokenizer.chat_template().map(str::to_string),
            model: Model::new(config, weights),
            tokenizer,
            name,
        })
    }
}
