//! Hugging Face `config.json` to [`Config`] and back.
//!
//! Supported `model_type`s: `llama` and `mistral` ([`Arch::Llama`]; the loader permutes Q/K rows
//! into GGUF's order, so RoPE runs in the consecutive-pairs style), `qwen2` ([`Arch::Qwen2`]) and
//! `gemma3_text` / `gemma3` ([`Arch::Gemma3`]; for the multimodal `gemma3` the `text_config` part).
//! Settings the model code cannot honour (attention biases on llama, logit soft-capping, linear or
//! YaRN RoPE scaling, ...) are errors naming the key rather than silently different outputs.

use ferrum_core::{Error, Result};
use ferrum_kernels::ops::RopeStyle;
use serde_json::{json, Map, Value};

use crate::model::config::{Arch, Config};

/// What `config.json` says: the [`Config`] plus the facts the weight loader needs.
#[derive(Clone, Debug)]
pub struct HfConfig {
    pub config: Config,
    /// The `model_type` the file named (`llama`, `mistral`, `qwen2`, `gemma3_text`, `gemma3`).
    pub model_type: String,
    /// Whether the LM head is the embedding matrix (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
    /// `torch_dtype` (informational: tensors carry their own dtype).
    pub torch_dtype: Option<String>,
}

fn bad(msg: impl std::fmt::Display) -> Error {
    Error::msg(format!("config.json: {msg}"))
}

fn unsupported(msg: impl std::fmt::Display) -> Error {
    Error::Unsupported(format!("config.json: {msg}"))
}

/// Typed access to one JSON object with `config.json`-flavoured errors.
struct Obj<'a>(&'a Map<String, Value>);

impl Obj<'_> {
    /// The value of `key`, treating JSON `null` as absent.
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| bad(format!("{key} must be a non-negative integer, found {v}"))),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| bad(format!("missing {key}")))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| bad(format!("{key} must be a number, found {v}"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| bad(format!("{key} must be true or false, found {v}"))),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| bad(format!("{key} must be a string, found {v}"))),
        }
    }
}

/// `model_type` from the `architectures` list, for files that omit it.
fn model_type_of_architecture(a: &str) -> Option<&'static str> {
    Some(match a {
        "LlamaForCausalLM" => "llama",
        "MistralForCausalLM" => "mistral",
        "Qwen2ForCausalLM" => "qwen2",
        "Gemma3ForCausalLM" => "gemma3_text",
        "Gemma3ForConditionalGeneration" => "gemma3",
        _ => return None,
    })
}

/// RoPE scaling: `dynamic` (NTK) leaves positions within the original training length unscaled,
/// so it runs with a warning; every other kind changes all positions and is refused until it is
/// implemented (llama3's frequency factors among them: running them unscaled is silently wrong).
fn check_rope_scaling(c: &Obj) -> Result<()> {
    let Some(rs) = c.get("rope_scaling").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let kind = rs
        .get("rope_type")
        .or_else(|| rs.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("?");
    match kind {
        "default" => Ok(()),
        "dynamic" => {
            tracing::warn!(
                "config.json: rope_scaling type 'dynamic' is not implemented; RoPE runs unscaled, \
                 which matches the model up to its original training length only"
            );
            Ok(())
        }
        other => Err(unsupported(format!("rope_scaling type '{other}'"))),
    }
}

impl HfConfig {
    /// Parses the text of a `config.json`.
    pub fn parse(config_json: &str) -> Result<HfConfig> {
        let root: Value =
            serde_json::from_str(config_json).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let root = root.as_object().ok_or_else(|| bad("not a JSON object"))?;
        let top = Obj(root);
        let model_type = match top.opt_str("model_type")? {
            Some(t) => t.to_string(),
            None => top
                .get("architectures")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(Value::as_str)
                .and_then(model_type_of_architecture)
                .ok_or_else(|| bad("no model_type (and no known entry in architectures)"))?
                .to_string(),
        };
        let arch = match model_type.as_str() {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gemma3" | "gemma3_text" => Arch::Gemma3,
            other => {
                return Err(Error::Unsupported(format!(
                    "Hugging Face model_type '{other}' (supported: llama, mistral, qwen2, gemma3, gemma3_text)"
                )))
            }
        };
        // Multimodal Gemma 3 keeps the language model's settings in text_config.
        let c = match (
            model_type.as_str(),
            root.get("text_config").and_then(Value::as_object),
        ) {
            ("gemma3", Some(tc)) => Obj(tc),
            _ => Obj(root),
        };
        let gemma = arch == Arch::Gemma3;

        let n_embd = c.usize("hidden_size")?;
        let n_head = c.usize("num_attention_heads")?;
        if n_head == 0 || n_embd == 0 {
            return Err(bad("hidden_size and num_attention_heads must be positive"));
        }
        let n_head_kv = c.opt_usize("num_key_value_heads")?.unwrap_or(n_head);
        let head_dim = match c.opt_usize("head_dim")? {
            Some(d) => d,
            None if gemma => 256,
            None => n_embd / n_head,
        };
        let n_rot = match c.opt_f64("partial_rotary_factor")? {
            Some(f) if f != 1.0 => (head_dim as f64 * f).round() as usize,
            _ => head_dim,
        };
        let vocab = match (c.opt_usize("vocab_size")?, gemma) {
            (Some(v), _) => v,
            (None, true) => 262_208,
            (None, false) => return Err(bad("missing vocab_size")),
        };

        // Activation and biases: the model code hard-wires SwiGLU (llama, qwen2) or GeGLU (gemma3).
        let act_key = if gemma {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        let want_act = if gemma { "gelu_pytorch_tanh" } else { "silu" };
        if let Some(act) = c.opt_str(act_key)? {
            if act != want_act && !(gemma && act == "gelu_tanh") {
                return Err(unsupported(format!(
                    "{act_key} '{act}' ({model_type} runs {want_act})"
                )));
            }
        }
        if arch != Arch::Qwen2 && c.opt_bool("attention_bias")?.unwrap_or(false) {
            return Err(unsupported(format!(
                "attention_bias = true for {model_type}"
            )));
        }
        if c.opt_bool("mlp_bias")?.unwrap_or(false) {
            return Err(unsupported("mlp_bias = true"));
        }
        check_rope_scaling(&c)?;

        let (sliding_window, swa_pattern, rope_base_swa) = if gemma {
            for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
                if c.get(key).is_some() {
                    return Err(unsupported(format!(
                        "{key} (Gemma 3 without soft-capping only)"
                    )));
                }
            }
            if c.opt_bool("use_bidirectional_attention")?.unwrap_or(false) {
                return Err(unsupported("use_bidirectional_attention = true"));
            }
            let qpas = c
                .opt_f64("query_pre_attn_scalar")?
                .unwrap_or(head_dim as f64);
            if qpas != head_dim as f64 {
                return Err(unsupported(format!(
                    "query_pre_attn_scalar {qpas} differs from head_dim {head_dim}"
                )));
            }
            let n_layer = c.usize("num_hidden_layers")?;
            let pattern = gemma_swa_pattern(&c, n_layer)?;
            let window = c.opt_usize("sliding_window")?.unwrap_or(4096);
            let base = c.opt_f64("rope_local_base_freq")?.unwrap_or(10_000.0) as f32;
            (Some(window), pattern, base)
        } else {
            if arch == Arch::Qwen2 && c.opt_bool("use_sliding_window")?.unwrap_or(false) {
                return Err(unsupported("use_sliding_window = true for qwen2"));
            }
            // Mistral's sliding_window is ignored, as llama.cpp does for the llama architecture.
            (None, 1, 10_000.0)
        };

        let config = Config {
            arch,
            n_vocab: vocab,
            n_embd,
            n_layer: c.usize("num_hidden_layers")?,
            n_ff: c.usize("intermediate_size")?,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_style: if arch == Arch::Llama {
                RopeStyle::Norm
            } else {
                RopeStyle::Neox
            },
            rope_base: c.opt_f64("rope_theta")?.unwrap_or(if gemma {
                1_000_000.0
            } else {
                10_000.0
            }) as f32,
            rope_base_swa,
            rms_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            n_ctx_train: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            sliding_window,
            swa_pattern,
        };
        config.validate()?;
        let tie_word_embeddings = match c.opt_bool("tie_word_embeddings")? {
            Some(t) => t,
            None => top.opt_bool("tie_word_embeddings")?.unwrap_or(gemma),
        };
        Ok(HfConfig {
            config,
            tie_word_embeddings,
            torch_dtype: c
                .opt_str("torch_dtype")?
                .or(top.opt_str("torch_dtype")?)
                .map(str::to_string),
            model_type,
        })
    }
}

/// Gemma 3's local/global layer pattern: from `layer_types` (it must be periodic with the global
/// layer last), else `sliding_window_pattern` / `_sliding_window_pattern`, else 6.
fn gemma_swa_pattern(c: &Obj, n_layer: usize) -> Result<usize> {
    if let Some(types) = c.get("layer_types") {
        let types = types
            .as_array()
            .filter(|a| a.len() == n_layer)
            .ok_or_else(|| bad(format!("layer_types must be a list of {n_layer} strings")))?;
        let global: Vec<bool> = types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(true),
                Some("sliding_attention") => Ok(false),
                _ => Err(unsupported(format!("layer type {t}"))),
            })
            .collect::<Result<_>>()?;
        let pattern = global
            .iter()
            .position(|&g| g)
            .map_or(n_layer + 1, |i| i + 1);
        let matches = global
            .iter()
            .enumerate()
            .all(|(il, &g)| g == (il % pattern == pattern - 1));
        if !matches {
            return Err(unsupported(
                "layer_types that are not every N-th layer global (the rest sliding-window)",
            ));
        }
        return Ok(pattern);
    }
    let p = match c.opt_usize("sliding_window_pattern")? {
        Some(p) => Some(p),
        None => c.opt_usize("_sliding_window_pattern")?,
    };
    Ok(p.unwrap_or(6).max(1))
}

impl Config {
    /// Reads a Hugging Face `config.json` (its text). See [`HfConfig::parse`] for what else it says.
    pub fn from_hf(config_json: &str) -> Result<Config> {
        Ok(HfConfig::parse(config_json)?.config)
    }

    /// A Hugging Face `config.json` describing this model (the inverse of [`Config::from_hf`]).
    pub fn to_hf_json(&self, tie_word_embeddings: bool) -> Value {
        let (model_type, architecture) = match self.arch {
            Arch::Llama => ("llama", "LlamaForCausalLM"),
            Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Arch::Gemma3 => ("gemma3_text", "Gemma3ForCausalLM"),
        };
        let mut v = json!({
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": self.n_embd,
            "num_hidden_layers": self.n_layer,
            "intermediate_size": self.n_ff,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_head_kv,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_base as f64,
            "rms_norm_eps": self.rms_eps as f64,
            "max_position_embeddings": self.n_ctx_train,
            "vocab_size": self.n_vocab,
            "tie_word_embeddings": tie_word_embeddings,
            "torch_dtype": "float32",
        });
        let m = v.as_object_mut().expect("object literal");
        if self.n_rot != self.head_dim {
            m.insert(
                "partial_rotary_factor".into(),
                json!(self.n_rot as f64 / self.head_dim as f64),
            );
        }
        match self.arch {
            Arch::Llama | Arch::Qwen2 => {
                m.insert("hidden_act".into(), json!("silu"));
            }
            Arch::Gemma3 => {
                m.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
                m.insert("query_pre_attn_scalar".into(), json!(self.head_dim));
                m.insert(
                    "rope_local_base_freq".into(),
                    json!(self.rope_base_swa as f64),
                );
                m.insert("sliding_window".into(), json!(self.sliding_window));
                m.insert("sliding_window_pattern".into(), json!(self.swa_pattern));
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-05,
        "rope_theta": 100000, "max_position_embeddings": 8192, "vocab_size": 49152,
        "tie_word_embeddings": true, "rope_scaling": null, "hidden_act": "silu"}"#;

    #[test]
    fn llama() {
        let h = HfConfig::parse(SMOL).unwrap();
        let c = &h.config;
        assert_eq!(
            (c.arch, c.n_embd, c.n_layer, c.n_ff),
            (Arch::Llama, 576, 30, 1536)
        );
        assert_eq!((c.n_head, c.n_head_kv, c.head_dim, c.n_rot), (9, 3, 64, 64));
        assert_eq!(
            (c.rope_base, c.rms_eps, c.n_ctx_train, c.n_vocab),
            (1e5, 1e-5, 8192, 49152)
        );
        assert_eq!(c.rope_style, RopeStyle::Norm);
        assert!(h.tie_word_embeddings && c.sliding_window.is_none());
    }

    #[test]
    fn gemma3_text_and_roundtrip() {
        let g = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": 640, "intermediate_size": 2048, "num_attention_heads": 4,
            "num_hidden_layers": 18, "num_key_value_heads": 1, "head_dim": 256,
            "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "sliding_window": 512, "_sliding_window_pattern": 6, "vocab_size": 262144,
            "final_logit_softcapping": null, "attn_logit_softcapping": null,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
              "sliding_attention", "sliding_attention", "full_attention",
              "sliding_attention", "sliding_attention", "sliding_attention",
              "sliding_attention", "sliding_attention", "full_attention",
              "sliding_attention", "sliding_attention", "sliding_attention",
              "sliding_attention", "sliding_attention", "full_attention"]}"#;
        let h = HfConfig::parse(g).unwrap();
        let c = &h.config;
        assert_eq!(
            (c.arch, c.head_dim, c.sliding_window, c.swa_pattern),
            (Arch::Gemma3, 256, Some(512), 6)
        );
        assert_eq!(
            (c.rope_base, c.rope_base_swa, c.rope_style),
            (1e6, 1e4, RopeStyle::Neox)
        );
        assert!(h.tie_word_embeddings);
        assert!(c.is_swa_layer(4) && !c.is_swa_layer(5));

        let back = HfConfig::parse(&c.to_hf_json(true).to_string())
            .unwrap()
            .config;
        assert_eq!(format!("{back:?}"), format!("{c:?}"));
        let smol = HfConfig::parse(SMOL).unwrap().config;
        let back = Config::from_hf(&smol.to_hf_json(true).to_string()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{smol:?}"));
    }

    #[test]
    fn multimodal_gemma3_uses_text_config() {
        let g = r#"{"model_type": "gemma3", "text_config": {"model_type": "gemma3_text",
            "hidden_size": 2560, "intermediate_size": 10240, "num_attention_heads": 8,
            "num_hidden_layers": 34, "num_key_value_heads": 4, "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152}}"#;
        let c = Config::from_hf(g).unwrap();
        assert_eq!(
            (c.n_embd, c.n_layer, c.head_dim, c.n_vocab),
            (2560, 34, 256, 262_208)
        );
    }

    #[test]
    fn errors_name_the_problem() {
        let err = |s: &str| Config::from_hf(s).unwrap_err().to_string();
        assert!(err(r#"{"model_type": "gpt_neox"}"#).contains("'gpt_neox'"));
        assert!(err("[1]").contains("not a JSON object"));
        assert!(err("{").contains("invalid JSON"));
        assert!(err(&SMOL.replace("\"hidden_size\": 576,", "")).contains("missing hidden_size"));
        assert!(err(&SMOL.replace("576", "\"576\"")).contains("hidden_size must be"));
        assert!(err(&SMOL.replace("\"silu\"", "\"gelu\"")).contains("hidden_act 'gelu'"));
        let scaled = SMOL.replace(
            "\"rope_scaling\": null",
            r#""rope_scaling": {"type": "linear", "factor": 2}"#,
        );
        assert!(err(&scaled).contains("rope_scaling type 'linear'"));
        // Llama 3.1's frequency factors change every position: refused, not run unscaled.
        let llama3 = SMOL.replace(
            "\"rope_scaling\": null",
            r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        );
        assert!(err(&llama3).contains("rope_scaling type 'llama3'"));
        assert!(
            err(&SMOL.replace("\"num_key_value_heads\": 3", "\"num_key_value_heads\": 4"))
                .contains("KV heads")
        );
    }
}
