//! Hugging Face model folders: `config.json`, `*.safetensors` weights, `tokenizer.json`.
//!
//! - [`config`]: `config.json` to [`crate::Config`] ([`HfConfig`]).
//! - [`safetensors`]: the container format, read memory-mapped and written.
//! - [`source`]: the weights as a [`crate::model::TensorSource`] under GGUF names ([`HfSource`]).
//! - [`hub`]: downloading files of a hub repository.
//!
//! [`load`] (also `Llm::load_hf`, and `Llm::load` on a folder) puts them together.

pub mod config;
pub mod hub;
pub mod safetensors;
pub mod source;

use std::path::Path;

use ferrum_core::{Error, Result};
use ferrum_tokenizer::Tokenizer;

pub use config::HfConfig;
pub use source::{hf_tensor_name, permute_qk_rows, HfName, HfSource};

use crate::model::{Model, Weights};
use crate::{Llm, LoadOptions};

/// Loads a model folder as [`crate::Llm::load_hf`] documents. `progress(done, total)` reports layers.
pub fn load(dir: &Path, opts: &LoadOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<Llm> {
    let config_path = dir.join("config.json");
    let text = match std::fs::read_to_string(&config_path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::msg(format!(
                "{} has no config.json: not a Hugging Face model folder",
                dir.display()
            )))
        }
        Err(e) => return Err(Error::io(&config_path, e)),
    };
    let hf = HfConfig::parse(&text)?;
    let mut config = hf.config.clone();
    config.kv_type = opts.kv_type;
    crate::model::kv_cache::check_kv_type(&config)?;

    let tok_path = dir.join("tokenizer.json");
    if !tok_path.is_file() {
        return Err(Error::msg(format!(
            "{} has no tokenizer.json (ferrum reads the fast-tokenizer file; tokenizer.model alone is not supported)",
            dir.display()
        )));
    }
    let tokenizer = Tokenizer::from_hf_file(&tok_path)?;
    // HF embeddings are often padded past the tokenizer (e.g. to a multiple of 64); never shorter.
    if tokenizer.vocab_size() > config.n_vocab {
        return Err(Error::msg(format!(
            "tokenizer.json has {} tokens but config.json's vocab_size is {}",
            tokenizer.vocab_size(),
            config.n_vocab
        )));
    }

    let source = HfSource::open_dir(dir, &hf)?;
    let mut weights = Weights::load(&source, &config, progress)?;
    if opts.dequantize {
        weights = weights.dequantized()?;
    }
    let chat_template = match tokenizer.chat_template() {
        Some(t) => Some(t.to_string()),
        None => chat_template_from_files(dir)?,
    };
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string());
    Ok(Llm {
        model: Model::new(config, weights),
        tokenizer: std::sync::Arc::new(tokenizer),
        chat_template,
        name,
    })
}

/// The chat template of a folder whose tokenizer did not carry one (the tokenizer reads
/// `tokenizer_config.json`): `chat_template.jinja`, which newer `transformers` save separately.
fn chat_template_from_files(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if !jinja.is_file() {
        return Ok(None);
    }
    std::fs::read_to_string(&jinja)
        .map(Some)
        .map_err(|e| Error::io(&jinja, e))
}
