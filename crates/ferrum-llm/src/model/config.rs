//! Hyperparameters of a decoder-only transformer, read from GGUF metadata or a Hugging Face config.json.

use ferrum_core::{Error, Result};
use ferrum_gguf::GgufFile;
use ferrum_kernels::ops::RopeStyle;

/// The architectures ferrum runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1/2/3, Mistral, SmolLM: RMSNorm, SwiGLU, RoPE (GGUF rows permuted to consecutive pairs).
    Llama,
    /// Qwen2: Llama with biases on the Q/K/V projections and NeoX RoPE.
    Qwen2,
    /// Gemma 3: embedding scaling, Q/K norms, post-norms, GeGLU, interleaved sliding-window layers.
    Gemma3,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "gemma3" => Ok(Arch::Gemma3),
            other => Err(Error::Unsupported(format!(
                "architecture '{other}' (supported: llama, qwen2, gemma3)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dimensions per head.
    pub n_rot: usize,
    pub rope_style: RopeStyle,
    pub rope_base: f32,
    /// RoPE base of sliding-window layers (Gemma 3: 10 000).
    pub rope_base_swa: f32,
    pub rms_eps: f32,
    pub n_ctx_train: usize,
    /// Sliding-window size of local layers, if the model has them.
    pub sliding_window: Option<usize>,
    /// Every `swa_pattern`-th layer (il % pattern == pattern-1) is global; the rest are local.
    pub swa_pattern: usize,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Whether layer `il` attends through the sliding window.
    pub fn is_swa_layer(&self, il: usize) -> bool {
        self.sliding_window.is_some()
            && self.swa_pattern > 1
            && il % self.swa_pattern < self.swa_pattern - 1
    }

    pub fn from_gguf(f: &GgufFile) -> Result<Config> {
        let arch_name = f
            .architecture()
            .ok_or_else(|| Error::msg("GGUF file has no general.architecture key"))?;
        let arch = Arch::from_name(arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let get_u = |k: &str| -> Option<usize> {
            f.get(&key(k)).and_then(|v| v.as_u64()).map(|v| v as usize)
        };
        let need_u = |k: &str| -> Result<usize> {
            get_u(k).ok_or_else(|| Error::msg(format!("GGUF metadata is missing {}", key(k))))
        };
        let get_f = |k: &str| -> Option<f32> { f.get(&key(k)).and_then(|v| v.as_f32()) };

        let n_embd = need_u("embedding_length")?;
        let n_head = need_u("attention.head_count")?;
        if n_head == 0 || n_embd == 0 {
            return Err(Error::msg("GGUF metadata: zero heads or embedding length"));
        }
        let n_head_kv = get_u("attention.head_count_kv").unwrap_or(n_head);
        let head_dim = get_u("attention.key_length").unwrap_or(n_embd / n_head);
        let n_rot = get_u("rope.dimension_count").unwrap_or(head_dim);
        let n_vocab = match get_u("vocab_size") {
            Some(v) => v,
            None => f
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len())
                .ok_or_else(|| {
                    Error::msg("GGUF metadata: no vocab_size and no tokenizer.ggml.tokens")
                })?,
        };
        // RoPE scaling changes every position's rotation; until it is implemented, a model that
        // asks for it is refused rather than run unscaled (silently wrong).
        let scaling = f
            .get(&key("rope.scaling.type"))
            .and_then(|v| v.as_str())
            .unwrap_or("none");
        let factor = get_f("rope.scaling.factor").unwrap_or(1.0);
        if scaling != "none" && factor != 1.0 {
            return Err(Error::msg(format!(
                "RoPE scaling '{scaling}' (factor {factor}) is not supported yet; refusing to run \
                 the model with unscaled positions"
            )));
        }
        if f.tensor("rope_freqs.weight").is_some() {
            return Err(Error::msg(
                "the model has per-dimension RoPE frequency factors (rope_freqs.weight: Llama 3.1+ \
                 or long-context RoPE), which are not supported yet; refusing to run it with \
                 unscaled positions",
            ));
        }
        let (rope_style, default_eps) = match arch {
            Arch::Llama => (RopeStyle::Norm, 1e-5),
            Arch::Qwen2 => (RopeStyle::Neox, 1e-6),
            Arch::Gemma3 => (RopeStyle::Neox, 1e-6),
        };
        let sliding_window = match arch {
            Arch::Gemma3 => get_u("attention.sliding_window"),
            _ => None,
        };
        let cfg = Config {
            arch,
            n_vocab,
            n_embd,
            n_layer: need_u("block_count")?,
            n_ff: need_u("feed_forward_length")?,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_style,
            rope_base: get_f("rope.freq_base").unwrap_or(10000.0),
            rope_base_swa: 10000.0,
            rms_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(default_eps),
            n_ctx_train: get_u("context_length").unwrap_or(4096),
            sliding_window,
            swa_pattern: if arch == Arch::Gemma3 { 6 } else { 1 },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Rejects shapes the kernels cannot run, with the reason.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::msg(format!("model config: {m}")));
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "{} heads not divisible into {} KV heads",
                self.n_head, self.n_head_kv
            ));
        }
        if self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) {
            return bad(format!(
                "rope dims {} vs head dim {}",
                self.n_rot, self.head_dim
            ));
        }
        if self.arch == Arch::Llama && self.n_rot != self.head_dim {
            return bad("llama requires rope.dimension_count == head dim".into());
        }
        if self.n_layer == 0 || self.n_ff == 0 || self.n_vocab == 0 || self.head_dim == 0 {
            return bad("zero layers, feed-forward size, vocabulary or head dim".into());
        }
        Ok(())
    }
}
