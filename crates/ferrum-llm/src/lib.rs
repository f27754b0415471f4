//! ferrum-llm: large language models on ferrum's kernels.
//!
//! - [`model`]: configs, weights and the architectures (llama, qwen2, gemma3), the KV cache.
//! - [`generate`]: prompt prefill, sampling or teacher forcing, streaming text, stop strings.
//! - [`output`]: one sequence's output as tokens are drawn (text, stop strings, finish reason),
//!   shared by [`generate`] and the server's engine; token log-probabilities.
//! - [`grammar`]: constrained decoding (JSON Schema, regex, choices, Lark, GBNF) as token masks.
//! - [`sampling`]: llama.cpp's sampler chain; [`perplexity`]: llama-perplexity's method.
//! - [`Llm`]: a model, its tokenizer and chat template, loaded from a GGUF file or a Hugging Face folder.
//! - [`hf`]: Hugging Face `config.json`, safetensors weights, hub downloads.

pub mod generate;
pub mod grammar;
pub mod hf;
pub mod model;
pub mod output;
pub mod perplexity;
pub mod sampling;
pub mod text;

use std::path::Path;
use std::sync::Arc;

use ferrum_core::{DType, Error, Result};
use ferrum_gguf::GgufFile;
use ferrum_tokenizer::Tokenizer;

pub use generate::{generate, FinishReason, GenerateRequest, Generation};
pub use model::{Config, Model};
pub use sampling::SamplingParams;

/// Options for [`Llm::load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Store every matrix as F32 (a reference path without quantized kernels).
    pub dequantize: bool,
    /// Storage type of the KV cache: F16 (the default, as llama.cpp's), F32, Q8_0 or Q4_0
    /// (llama.cpp's `-ctk/-ctv`; the quantized types need a head dimension that is a multiple
    /// of 32). Checked at load.
    pub kv_type: DType,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dequantize: false,
            kv_type: DType::F16,
        }
    }
}

/// A loaded model with everything needed to turn text into text.
pub struct Llm {
    pub model: Model,
    /// Shared with the grammar compiler, which walks its vocabulary.
    pub tokenizer: Arc<Tokenizer>,
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
        let started = std::time::Instant::now();
        let file = GgufFile::open(path)?;
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            tensors = file.tensors.len(),
            "GGUF header and metadata parsed"
        );
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
        let started = std::time::Instant::now();
        let mut config = Config::from_gguf(file)?;
        config.kv_type = opts.kv_type;
        model::kv_cache::check_kv_type(&config)?;
        let tokenizer = Tokenizer::from_gguf(file)?;
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            vocab = tokenizer.vocab_size(),
            "config and tokenizer read"
        );
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
            weights = weights.dequantized()?;
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
            tokenizer: Arc::new(tokenizer),
            name,
        })
    }

    /// The chat template to use: the model's own, else a built-in one for Gemma 3 (whose GGUF
    /// files here carry none), else ChatML.
    pub fn chat_template(&self) -> Result<ferrum_tokenizer::ChatTemplate> {
        let tok = &self.tokenizer;
        let piece = |id: Option<u32>| {
            id.map(|i| String::from_utf8_lossy(&tok.token_bytes(i, true)).into_owned())
                .unwrap_or_default()
        };
        let source = match &self.chat_template {
            Some(t) => t.as_str(),
            None if self.model.config.arch.is_gemma() => GEMMA_TEMPLATE,
            None => CHATML_TEMPLATE,
        };
        ferrum_tokenizer::ChatTemplate::new(source, &piece(tok.bos()), &piece(tok.eos()))
    }

    /// Renders `messages` with [`Llm::chat_template`] (with the generation prompt) and tokenizes
    /// the result, special tokens parsed. A template that writes the BOS text itself gets no
    /// second BOS.
    pub fn encode_chat(
        &self,
        template: &ferrum_tokenizer::ChatTemplate,
        messages: &[ferrum_tokenizer::ChatMessage],
    ) -> Result<Vec<u32>> {
        let rendered = template.render(messages, true)?;
        Ok(self.encode_rendered_chat(&rendered))
    }

    /// Tokens of a rendered chat: special tokens in the text are parsed, and BOS is added unless
    /// the template wrote it.
    pub fn encode_rendered_chat(&self, rendered: &str) -> Vec<u32> {
        let bos = self
            .tokenizer
            .bos()
            .map(|i| String::from_utf8_lossy(&self.tokenizer.token_bytes(i, true)).into_owned())
            .unwrap_or_default();
        let add_special = bos.is_empty() || !rendered.starts_with(&bos);
        self.tokenizer.encode(rendered, add_special, true)
    }
}

/// Gemma 3's chat format (the Hugging Face template's behaviour: a system message is folded into
/// the first user turn; the assistant is called "model").
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}{% if role == 'system' %}{{ '<start_of_turn>user\n' + m['content'] + '\n\n' }}{% else %}{% if not (loop.index0 == 1 and messages[0]['role'] == 'system') %}{{ '<start_of_turn>' + role + '\n' }}{% endif %}{{ m['content'] + '<end_of_turn>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/// ChatML, the fallback for models without a template.
const CHATML_TEMPLATE: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
