//! Hyperparameters of a decoder-only transformer, read from GGUF metadata or a Hugging Face config.json.

use ferrum_core::{DType, Error, Result};
use ferrum_gguf::GgufFile;
use ferrum_kernels::ops::{RopeScaling, RopeStyle, Yarn};

pub use super::arch::Arch;
use super::arch::{Experts, Swa};

/// A mixture-of-experts feed-forward block (Shazeer et al. 2017; Mixtral, Qwen3-MoE): a router
/// scores every expert per token, the `n_expert_used` best run, and their outputs are summed
/// weighted by the router's softmax probabilities (renormalised over the chosen ones if `norm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Hidden size of one expert.
    pub n_ff_exp: usize,
    /// Whether the chosen experts' weights are renormalised to sum to 1.
    pub norm: bool,
    /// How the router's scores become the chosen experts' weights.
    pub gating: Gating,
    /// The experts' gated activation.
    pub act: ExpertAct,
}

/// How a router picks experts and weighs them (llama.cpp's `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert, the top k of the probabilities (Mixtral, Qwen3-MoE).
    Softmax,
    /// The top k of the raw scores, then a softmax over those k (gpt-oss).
    SoftmaxWeight,
}

/// An expert's gated activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertAct {
    /// SiLU(gate) * up.
    Silu,
    /// gpt-oss's clamped SwiGLU ([`ferrum_kernels::ops::swiglu_oai`], alpha 1.702, limit 7).
    SwigluOai,
}

/// LongRoPE (Ding et al. 2024; Phi-3 128k, Phi-3.5, Phi-4-mini): per-pair frequency divisors for
/// contexts up to the original training length (`short`) and beyond it (`long`), with cos/sin
/// scaled by an attention factor. As llama.cpp does, the context a sequence may reach picks one
/// set for the whole run ([`Config::rope_scaling_for`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    pub n_ctx_orig: usize,
    pub short: RopeScaling,
    pub long: RopeScaling,
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
    /// Context extension of RoPE (linear, YaRN, per-pair frequency factors); identity if none.
    /// With LongRoPE, its short-context set.
    pub rope_scaling: RopeScaling,
    /// LongRoPE's two factor sets, for the models that have them.
    pub long_rope: Option<LongRope>,
    /// RoPE base of sliding-window layers (Gemma 3: 10 000).
    pub rope_base_swa: f32,
    pub rms_eps: f32,
    pub n_ctx_train: usize,
    /// Sliding-window size of local layers, if the model has them.
    pub sliding_window: Option<usize>,
    /// Every `swa_pattern`-th layer (il % pattern == pattern-1) is global; the rest are local.
    /// 1: every layer is local (Mistral-style sliding window).
    pub swa_pattern: usize,
    /// The mixture of experts, for models whose feed-forward blocks are one.
    pub moe: Option<MoeConfig>,
    /// Multiplies q.k: 1/sqrt(head_dim), or Gemma's 1/sqrt(query_pre_attn_scalar).
    pub attn_scale: f32,
    /// Gemma 2: attention scores become cap * tanh(score / cap).
    pub attn_softcap: Option<f32>,
    /// Gemma 2: logits become cap * tanh(logit / cap).
    pub final_softcap: Option<f32>,
    /// Storage type of the KV cache (a run-time choice, not the model's: `LoadOptions::kv_type`;
    /// F16 unless asked otherwise, as llama.cpp's default).
    pub kv_type: DType,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// The RoPE scaling for sequences of up to `n_ctx` positions: LongRoPE's long factors when
    /// `n_ctx` exceeds the original training context (llama.cpp's rule), else `rope_scaling`.
    pub fn rope_scaling_for(&self, n_ctx: usize) -> &RopeScaling {
        match &self.long_rope {
            Some(lr) if n_ctx > lr.n_ctx_orig => &lr.long,
            _ => &self.rope_scaling,
        }
    }

    /// Whether layer `il` attends through the sliding window.
    pub fn is_swa_layer(&self, il: usize) -> bool {
        self.sliding_window.is_some()
            && (self.swa_pattern <= 1 || il % self.swa_pattern < self.swa_pattern - 1)
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
        let (rope_scaling, long_rope) = gguf_rope_scaling(f, arch_name, n_rot)?;
        let n_layer = need_u("block_count")?;
        let moe = match get_u("expert_count").unwrap_or(0) {
            0 => None,
            n_expert => Some(MoeConfig {
                n_expert,
                n_expert_used: need_u("expert_used_count")?,
                n_ff_exp: match get_u("expert_feed_forward_length") {
                    Some(n) => n,
                    None => need_u("feed_forward_length")?,
                },
                // llama.cpp renormalises the chosen experts' weights for llama (Mixtral) and
                // qwen3moe alike.
                norm: true,
                gating: Gating::Softmax,
                act: ExpertAct::Silu,
            }),
        };
        match (arch.experts, &moe) {
            (Experts::Always, None) => {
                return Err(Error::msg(format!(
                    "GGUF metadata: {arch_name} without {arch_name}.expert_count"
                )))
            }
            (Experts::Never, Some(_)) => {
                return Err(Error::Unsupported(format!(
                    "{arch_name} with experts ({arch_name}.expert_count > 0)"
                )))
            }
            _ => {}
        }
        // Local layers, where the architecture has them (an inert window is ignored, as
        // llama.cpp does for Qwen files).
        let sliding_window = match arch.swa {
            Swa::Never => None,
            _ => get_u("attention.sliding_window").filter(|&w| w > 0),
        };
        let rope_base = get_f("rope.freq_base").unwrap_or(10000.0);
        let mut cfg = Config {
            arch,
            n_vocab,
            n_embd,
            n_layer,
            n_ff: match (get_u("feed_forward_length"), &moe) {
                (Some(n), _) => n,
                (None, Some(m)) => m.n_ff_exp,
                (None, None) => need_u("feed_forward_length")?,
            },
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_style: arch.rope_style,
            rope_base,
            rope_scaling,
            long_rope,
            rope_base_swa: if arch.swa_rope_base {
                get_f("rope.freq_base_swa").unwrap_or(10000.0)
            } else {
                rope_base
            },
            rms_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(arch.rms_eps),
            n_ctx_train: get_u("context_length").unwrap_or(4096),
            sliding_window,
            swa_pattern: match arch.swa {
                Swa::Pattern(n) => n,
                _ => 1,
            },
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: get_f("attn_logit_softcapping").filter(|&c| c != 0.0),
            final_softcap: get_f("final_logit_softcapping").filter(|&c| c != 0.0),
            kv_type: DType::F16,
            moe,
        };
        (arch.fixup)(&mut cfg);
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
        if self.rope_style == RopeStyle::Norm && self.n_rot != self.head_dim {
            return bad(format!(
                "{} requires rope.dimension_count == head dim",
                self.arch.name()
            ));
        }
        if let Some(m) = &self.moe {
            if m.n_expert_used == 0 || m.n_expert_used > m.n_expert || m.n_ff_exp == 0 {
                return bad(format!(
                    "{} of {} experts per token with expert size {}",
                    m.n_expert_used, m.n_expert, m.n_ff_exp
                ));
            }
        }
        let scalings = match &self.long_rope {
            Some(lr) => vec![&self.rope_scaling, &lr.short, &lr.long],
            None => vec![&self.rope_scaling],
        };
        for rs in scalings {
            if let Some(ff) = &rs.freq_factors {
                if ff.len() != self.n_rot / 2 || ff.iter().any(|f| !f.is_finite() || *f <= 0.0) {
                    return bad(format!(
                        "{} RoPE frequency factors for {} rotated dims (need n_rot/2 positive ones)",
                        ff.len(),
                        self.n_rot
                    ));
                }
            }
            let fs = rs.freq_scale;
            if !(fs.is_finite() && fs > 0.0) {
                return bad(format!("RoPE frequency scale {fs}"));
            }
            if let Some(y) = &rs.yarn {
                if !(y.attn_factor.is_finite() && y.attn_factor > 0.0) {
                    return bad(format!("RoPE attention factor {}", y.attn_factor));
                }
            }
        }
        if self.n_layer == 0 || self.n_ff == 0 || self.n_vocab == 0 || self.head_dim == 0 {
            return bad("zero layers, feed-forward size, vocabulary or head dim".into());
        }
        Ok(())
    }
}

/// RoPE context extension from GGUF metadata, read as llama.cpp reads it: `rope.scaling.type`
/// (`none`, `linear`, `yarn`), the factor from `rope.scale_linear` or `rope.scaling.factor`
/// (freq_scale = 1/factor), YaRN's `rope.scaling.original_context_length`, `attn_factor` and
/// `yarn_beta_fast`/`yarn_beta_slow` (32 and 1 by default), per-pair frequency factors from
/// the `rope_freqs.weight` tensor (Llama 3.1+), and LongRoPE's `rope_factors_short.weight` /
/// `rope_factors_long.weight` (Phi-3 128k, Phi-3.5, Phi-4-mini) with `rope.scaling.attn_factor`
/// scaling cos/sin (llama.cpp applies that factor whatever the scaling type).
fn gguf_rope_scaling(
    f: &GgufFile,
    arch: &str,
    n_rot: usize,
) -> Result<(RopeScaling, Option<LongRope>)> {
    let key = |k: &str| format!("{arch}.{k}");
    let get_f = |k: &str| -> Option<f32> { f.get(&key(k)).and_then(|v| v.as_f32()) };
    let kind = f
        .get(&key("rope.scaling.type"))
        .and_then(|v| v.as_str())
        .unwrap_or("none");
    let factor = get_f("rope.scale_linear")
        .or_else(|| get_f("rope.scaling.factor"))
        .unwrap_or(0.0);
    let freq_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };
    let mut scaling = RopeScaling {
        freq_scale,
        ..RopeScaling::default()
    };
    let n_ctx_orig = f
        .get(&key("rope.scaling.original_context_length"))
        .and_then(|v| v.as_u64())
        .or_else(|| f.get(&key("context_length")).and_then(|v| v.as_u64()))
        .unwrap_or(0) as usize;
    let attn_factor = get_f("rope.scaling.attn_factor").unwrap_or(1.0);
    match kind {
        "none" | "linear" | "longrope" => {
            if attn_factor != 1.0 {
                // cos/sin scaled by the factor with no ramp (ggml's ext_factor 0).
                scaling.yarn = Some(Yarn {
                    ext_factor: 0.0,
                    attn_factor,
                    n_ctx_orig: n_ctx_orig.max(1),
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                });
            }
        }
        "yarn" => {
            if n_ctx_orig == 0 {
                return Err(Error::msg(
                    "GGUF metadata: YaRN RoPE scaling without an original context length",
                ));
            }
            scaling.yarn = Some(Yarn {
                ext_factor: get_f("rope.scaling.yarn_ext_factor").unwrap_or(1.0),
                attn_factor,
                n_ctx_orig,
                beta_fast: get_f("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
                beta_slow: get_f("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
            });
        }
        other => {
            return Err(Error::Unsupported(format!(
                "RoPE scaling '{other}' (supported: none, linear, yarn, and rope_freqs or \
                 LongRoPE factors)"
            )))
        }
    }
    let factors = |name: &str| -> Result<Option<Vec<f32>>> {
        let Some(t) = f.tensor(name) else {
            return Ok(None);
        };
        if t.dtype != ferrum_core::DType::F32 || t.dims != [(n_rot / 2) as u64] {
            return Err(Error::msg(format!(
                "{name} is {} {:?}, expected F32 [{}]",
                t.dtype,
                t.dims,
                n_rot / 2
            )));
        }
        let bytes = f.tensor_data(t);
        Ok(Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    };
    if let Some(ff) = factors("rope_freqs.weight")? {
        // llama.cpp prefers these over LongRoPE's when a file has both.
        scaling.freq_factors = Some(ff);
        return Ok((scaling, None));
    }
    let long_rope = match (
        factors("rope_factors_short.weight")?,
        factors("rope_factors_long.weight")?,
    ) {
        (None, None) => None,
        (Some(short), Some(long)) => {
            if n_ctx_orig == 0 {
                return Err(Error::msg(
                    "GGUF metadata: LongRoPE factors without an original context length",
                ));
            }
            let with = |ff: Vec<f32>| RopeScaling {
                freq_factors: Some(ff),
                ..scaling.clone()
            };
            Some(LongRope {
                n_ctx_orig,
                short: with(short),
                long: with(long),
            })
        }
        _ => {
            return Err(Error::msg(
                "GGUF file has one of rope_factors_short.weight and rope_factors_long.weight \
                 without the other",
            ))
        }
    };
    match &long_rope {
        Some(lr) => scaling = lr.short.clone(),
        None if kind == "longrope" => {
            return Err(Error::Unsupported(
                "RoPE scaling 'longrope' without its factors (rope_factors_short.weight and \
                 rope_factors_long.weight)"
                    .into(),
            ))
        }
        None => {}
    }
    Ok((scaling, long_rope))
}
