//! Hugging Face `config.json` to [`Config`] and back.
//!
//! Supported `model_type`s: those of the architectures in [`crate::model::arch::REGISTRY`]
//! (each declares its own, and the defaults its configs leave out); for the multimodal `gemma3`
//! the `text_config` part is read. Settings the model code cannot honour (attention biases on llama, logit soft-capping, linear or
//! YaRN RoPE scaling, ...) are errors naming the key rather than silently different outputs.

use ferrum_core::{Error, Result};
use ferrum_kernels::ops::{RopeScaling, Yarn};
use serde_json::{json, Map, Value};

use crate::model::arch::{self, Experts, Family, Swa, REGISTRY};
use crate::model::config::{Arch, Config, ExpertAct, Gating, LongRope, MoeConfig};

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

impl<'a> Obj<'a> {
    /// The value of `key`, treating JSON `null` as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
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
    REGISTRY
        .iter()
        .flat_map(|d| d.hf_types.iter())
        .find(|&&(_, class)| class == a)
        .map(|&(t, _)| t)
}

/// The `model_type`s whose feed-forward blocks are mixtures of experts, with their config keys.
const MOE_TYPES: [&str; 2] = ["mixtral", "qwen3_moe"];

/// Where a config keeps its RoPE settings: transformers 4 writes `rope_theta` (and Gemma 3's
/// `rope_local_base_freq`) at the top and scaling in `rope_scaling`; transformers 5 writes one
/// `rope_parameters` object holding `rope_theta`, `rope_type` and the scaling fields, or (Gemma 3)
/// one such object per layer type (`full_attention`, `sliding_attention`).
struct RopeParams<'a> {
    theta: Option<f64>,
    local_theta: Option<f64>,
    /// The object with `rope_type`/`type` and the scaling fields, if any.
    scaling: Option<&'a Map<String, Value>>,
}

impl<'a> RopeParams<'a> {
    fn read(c: &Obj<'a>) -> Result<RopeParams<'a>> {
        let obj = |v: &'a Value, what: &str| {
            v.as_object()
                .ok_or_else(|| bad(format!("{what} must be an object")))
        };
        let theta_of =
            |m: &Map<String, Value>| -> Result<Option<f64>> { Obj(m).opt_f64("rope_theta") };
        let mut p = RopeParams {
            theta: c.opt_f64("rope_theta")?,
            local_theta: c.opt_f64("rope_local_base_freq")?,
            scaling: match c.get("rope_scaling") {
                Some(v) => Some(obj(v, "rope_scaling")?),
                None => None,
            },
        };
        if let Some(rp) = c.get("rope_parameters") {
            let rp = obj(rp, "rope_parameters")?;
            let (global, local) = match rp.get("full_attention") {
                Some(g) => (
                    obj(g, "rope_parameters.full_attention")?,
                    match rp.get("sliding_attention") {
                        Some(l) => Some(obj(l, "rope_parameters.sliding_attention")?),
                        None => None,
                    },
                ),
                None => (rp, None),
            };
            p.theta = p.theta.or(theta_of(global)?);
            if let Some(l) = local {
                p.local_theta = p.local_theta.or(theta_of(l)?);
                let lo = Obj(l);
                let lt = lo.opt_str("rope_type")?.unwrap_or("default");
                if lt != "default" {
                    return Err(unsupported(format!(
                        "rope_type '{lt}' on sliding-window layers"
                    )));
                }
            }
            if p.scaling.is_none() {
                p.scaling = Some(global);
            }
        }
        Ok(p)
    }
}

/// RoPE context extension from `rope_scaling` (`rope_type` or the older `type`), computed as
/// Hugging Face's `modeling_rope_utils` and llama.cpp's converter do: `linear` (angles / factor),
/// `llama3` (per-pair frequency factors from the wavelength bands, in f32 as the converter writes
/// `rope_freqs.weight`) and `yarn` (ramp between interpolation and extrapolation, attention factor
/// 0.1 ln(factor) + 1 unless given). `dynamic` (NTK) leaves positions within the original training
/// length unscaled, so it runs with a warning; any other kind is refused rather than run unscaled.
fn hf_rope_scaling(
    rope: &RopeParams,
    n_rot: usize,
    base: f32,
    max_pos: Option<usize>,
    top_orig: Option<usize>,
) -> Result<(RopeScaling, Option<LongRope>)> {
    let Some(rs) = rope.scaling else {
        return Ok((RopeScaling::default(), None));
    };
    let rs = Obj(rs);
    let kind = match rs.opt_str("rope_type")? {
        Some(k) => k,
        None => rs.opt_str("type")?.unwrap_or("default"),
    };
    let factor = || -> Result<f32> {
        let f = rs
            .opt_f64("factor")?
            .ok_or_else(|| bad(format!("rope_scaling '{kind}' without a factor")))?;
        if !(f.is_finite() && f > 0.0) {
            return Err(bad(format!("rope_scaling factor {f}")));
        }
        Ok(f as f32)
    };
    let orig = |default: Option<usize>| -> Result<usize> {
        rs.opt_usize("original_max_position_embeddings")?
            .or(default)
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                bad(format!(
                    "rope_scaling '{kind}' needs original_max_position_embeddings"
                ))
            })
    };
    if kind == "longrope" || kind == "su" {
        // LongRoPE: per-pair divisors for short and long contexts; cos/sin scaled by
        // attention_factor, sqrt(1 + ln(s) / ln(original)) with s = max positions / original.
        let n_ctx_orig = rs
            .opt_usize("original_max_position_embeddings")?
            .or(top_orig)
            .filter(|&n| n > 0)
            .ok_or_else(|| bad("rope_scaling longrope needs original_max_position_embeddings"))?;
        let list = |key: &str| -> Result<Vec<f32>> {
            let v = rs
                .get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| bad(format!("rope_scaling longrope needs a list {key}")))?;
            v.iter()
                .map(|x| {
                    x.as_f64()
                        .map(|x| x as f32)
                        .ok_or_else(|| bad(format!("{key} must hold numbers, found {x}")))
                })
                .collect()
        };
        let scale = max_pos.unwrap_or(n_ctx_orig) as f64 / n_ctx_orig as f64;
        let attn_factor = match rs.opt_f64("attention_factor")? {
            Some(a) => a,
            None if scale > 1.0 => (1.0 + scale.ln() / (n_ctx_orig as f64).ln()).sqrt(),
            None => 1.0,
        } as f32;
        let with = |ff: Vec<f32>| RopeScaling {
            freq_scale: 1.0,
            freq_factors: Some(ff),
            yarn: (attn_factor != 1.0).then_some(Yarn {
                ext_factor: 0.0,
                attn_factor,
                n_ctx_orig,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
        };
        let (short, long) = (with(list("short_factor")?), with(list("long_factor")?));
        return Ok((
            short.clone(),
            Some(LongRope {
                n_ctx_orig,
                short,
                long,
            }),
        ));
    }
    let scaling = match kind {
        "default" => Ok(RopeScaling::default()),
        "dynamic" => {
            tracing::warn!(
                "config.json: rope_scaling type 'dynamic' is not implemented; RoPE runs unscaled, \
                 which matches the model up to its original training length only"
            );
            Ok(RopeScaling::default())
        }
        "linear" => Ok(RopeScaling {
            freq_scale: 1.0 / factor()?,
            ..RopeScaling::default()
        }),
        "llama3" => {
            let factor = factor()?;
            let low = rs.opt_f64("low_freq_factor")?.unwrap_or(1.0) as f32;
            let high = rs.opt_f64("high_freq_factor")?.unwrap_or(4.0) as f32;
            let old_ctx = orig(Some(8192))? as f32;
            if high <= low {
                return Err(bad(
                    "rope_scaling: high_freq_factor must exceed low_freq_factor",
                ));
            }
            let (low_wavelen, high_wavelen) = (old_ctx / low, old_ctx / high);
            let factors = (0..n_rot / 2)
                .map(|i| {
                    let freq = 1.0 / base.powf((2 * i) as f32 / n_rot as f32);
                    let wavelen = 2.0 * std::f32::consts::PI / freq;
                    if wavelen < high_wavelen {
                        1.0
                    } else if wavelen > low_wavelen {
                        factor
                    } else {
                        let smooth = (old_ctx / wavelen - low) / (high - low);
                        1.0 / ((1.0 - smooth) / factor + smooth)
                    }
                })
                .collect();
            Ok(RopeScaling {
                freq_factors: Some(factors),
                ..RopeScaling::default()
            })
        }
        "yarn" => {
            let factor = factor()?;
            for key in ["mscale", "mscale_all_dim"] {
                if rs.get(key).is_some() {
                    return Err(unsupported(format!("rope_scaling yarn with {key}")));
                }
            }
            if rs.opt_bool("truncate")? == Some(false) {
                return Err(unsupported("rope_scaling yarn with truncate = false"));
            }
            // HF scales cos/sin by attention_factor, default 0.1 ln(factor) + 1, which is what
            // ggml's YaRN multiplies attn_factor by.
            let default_m = 0.1 * factor.ln() + 1.0;
            let attn_factor = match rs.opt_f64("attention_factor")? {
                Some(a) => a as f32 / default_m,
                None => 1.0,
            };
            Ok(RopeScaling {
                freq_scale: 1.0 / factor,
                freq_factors: None,
                yarn: Some(Yarn {
                    ext_factor: 1.0,
                    attn_factor,
                    n_ctx_orig: orig(max_pos)?,
                    beta_fast: rs.opt_f64("beta_fast")?.unwrap_or(32.0) as f32,
                    beta_slow: rs.opt_f64("beta_slow")?.unwrap_or(1.0) as f32,
                }),
            })
        }
        other => Err(unsupported(format!("rope_scaling type '{other}'"))),
    }?;
    Ok((scaling, None))
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
        let arch = Arch::from_hf_type(&model_type).ok_or_else(|| {
            Error::Unsupported(format!(
                "Hugging Face model_type '{model_type}' (supported: {})",
                arch::hf_model_types().join(", ")
            ))
        })?;
        // Multimodal Gemma 3 keeps the language model's settings in text_config.
        let c = match (
            model_type.as_str(),
            root.get("text_config").and_then(Value::as_object),
        ) {
            ("gemma3", Some(tc)) => Obj(tc),
            _ => Obj(root),
        };
        let gemma = arch.is_gemma();

        let n_embd = c.usize("hidden_size")?;
        let n_head = c.usize("num_attention_heads")?;
        if n_head == 0 || n_embd == 0 {
            return Err(bad("hidden_size and num_attention_heads must be positive"));
        }
        let n_head_kv = c.opt_usize("num_key_value_heads")?.unwrap_or(n_head);
        let head_dim = match c.opt_usize("head_dim")? {
            Some(d) => d,
            None => arch.hf_head_dim.unwrap_or(n_embd / n_head),
        };
        let n_rot = match c.opt_f64("partial_rotary_factor")? {
            Some(f) if f != 1.0 => (head_dim as f64 * f).round() as usize,
            _ => head_dim,
        };
        let vocab = match c.opt_usize("vocab_size")?.or(arch.hf_vocab) {
            Some(v) => v,
            None => return Err(bad("missing vocab_size")),
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
        if !arch.qkv_bias && c.opt_bool("attention_bias")?.unwrap_or(false) {
            return Err(unsupported(format!(
                "attention_bias = true for {model_type}"
            )));
        }
        if c.opt_bool("mlp_bias")?.unwrap_or(false) {
            return Err(unsupported("mlp_bias = true"));
        }
        let rope = RopeParams::read(&c)?;
        let rope_base = rope.theta.unwrap_or(arch.hf_rope_theta) as f32;
        let max_pos = c.opt_usize("max_position_embeddings")?;
        let top_orig = c.opt_usize("original_max_position_embeddings")?;
        let (rope_scaling, long_rope) =
            hf_rope_scaling(&rope, n_rot, rope_base, max_pos, top_orig)?;
        let moe = match model_type.as_str() {
            "qwen3_moe" => {
                if c.opt_usize("decoder_sparse_step")?.unwrap_or(1) != 1 {
                    return Err(unsupported("decoder_sparse_step other than 1"));
                }
                if c.get("mlp_only_layers")
                    .and_then(Value::as_array)
                    .is_some_and(|a| !a.is_empty())
                {
                    return Err(unsupported(
                        "mlp_only_layers (dense layers in a qwen3_moe model)",
                    ));
                }
                Some(MoeConfig {
                    // transformers 5 writes num_local_experts, the published checkpoints
                    // num_experts.
                    n_expert: match c.opt_usize("num_experts")? {
                        Some(n) => n,
                        None => c.usize("num_local_experts")?,
                    },
                    n_expert_used: c.usize("num_experts_per_tok")?,
                    n_ff_exp: c.usize("moe_intermediate_size")?,
                    norm: c.opt_bool("norm_topk_prob")?.unwrap_or(false),
                    gating: Gating::Softmax,
                    act: ExpertAct::Silu,
                })
            }
            "mixtral" => Some(MoeConfig {
                n_expert: c.usize("num_local_experts")?,
                n_expert_used: c.usize("num_experts_per_tok")?,
                n_ff_exp: c.usize("intermediate_size")?,
                norm: true,
                gating: Gating::Softmax,
                act: ExpertAct::Silu,
            }),
            _ => None,
        };
        match (arch.experts, &moe) {
            (Experts::Always, None) => {
                return Err(bad(format!("{model_type} without its experts' settings")))
            }
            (Experts::Never, Some(_)) => return Err(bad(format!("{model_type} with experts"))),
            _ => {}
        }

        let softcap = |key: &str| -> Result<Option<f32>> {
            match c.opt_f64(key)? {
                None | Some(0.0) => Ok(None),
                Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v as f32)),
                Some(v) => Err(bad(format!("{key} must be positive, found {v}"))),
            }
        };
        let (attn_softcap, final_softcap) = if gemma {
            (
                softcap("attn_logit_softcapping")?,
                softcap("final_logit_softcapping")?,
            )
        } else {
            (None, None)
        };
        let mut attn_scale = 1.0 / (head_dim as f32).sqrt();
        let (sliding_window, swa_pattern, rope_base_swa) = if gemma {
            if c.opt_bool("use_bidirectional_attention")?.unwrap_or(false) {
                return Err(unsupported("use_bidirectional_attention = true"));
            }
            let qpas = c
                .opt_f64("query_pre_attn_scalar")?
                .unwrap_or(head_dim as f64);
            if !(qpas.is_finite() && qpas > 0.0) {
                return Err(bad(format!("query_pre_attn_scalar {qpas}")));
            }
            attn_scale = 1.0 / (qpas as f32).sqrt();
            let n_layer = c.usize("num_hidden_layers")?;
            let default_pattern = match arch.swa {
                Swa::Pattern(n) => n,
                _ => 1,
            };
            let pattern = gemma_swa_pattern(&c, n_layer, default_pattern)?;
            let window = c.opt_usize("sliding_window")?.unwrap_or(4096);
            let base = if arch.swa_rope_base {
                rope.local_theta.unwrap_or(10_000.0) as f32
            } else {
                rope_base
            };
            (Some(window), pattern, base)
        } else {
            if c.opt_bool("use_sliding_window")?.unwrap_or(false) {
                return Err(unsupported(format!(
                    "use_sliding_window = true for {model_type}"
                )));
            }
            // Mistral v0.1's window holds on every layer (transformers applies it; later Mistral
            // and Llama configs set it null). Qwen's sliding_window is inert without
            // use_sliding_window.
            let window = match model_type.as_str() {
                "mistral" | "mixtral" | "phi3" => c.opt_usize("sliding_window")?.filter(|&w| w > 0),
                _ => None,
            };
            (window, 1, rope_base)
        };

        let mut config = Config {
            arch,
            n_vocab: vocab,
            n_embd,
            n_layer: c.usize("num_hidden_layers")?,
            n_ff: c.usize("intermediate_size")?,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_style: arch.rope_style,
            rope_base,
            rope_scaling,
            long_rope,
            rope_base_swa,
            rms_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            n_ctx_train: max_pos.unwrap_or(4096),
            sliding_window,
            swa_pattern,
            moe,
            attn_scale,
            attn_softcap,
            final_softcap,
            kv_type: ferrum_core::DType::F16,
        };
        (arch.fixup)(&mut config);
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

/// Gemma's local/global layer pattern: from `layer_types` (it must be periodic with the global
/// layer last), else `sliding_window_pattern` / `_sliding_window_pattern`, else `default` (6 for
/// Gemma 3, 2 for Gemma 2).
fn gemma_swa_pattern(c: &Obj, n_layer: usize, default: usize) -> Result<usize> {
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
    Ok(p.unwrap_or(default).max(1))
}

impl Config {
    /// Reads a Hugging Face `config.json` (its text). See [`HfConfig::parse`] for what else it says.
    pub fn from_hf(config_json: &str) -> Result<Config> {
        Ok(HfConfig::parse(config_json)?.config)
    }

    /// A Hugging Face `config.json` describing this model (the inverse of [`Config::from_hf`]).
    pub fn to_hf_json(&self, tie_word_embeddings: bool) -> Value {
        // The architecture's first model type, or its mixture-of-experts one for a model with
        // experts (Mixtral in a Llama file).
        let types = self.arch.hf_types;
        let (model_type, architecture) = types
            .iter()
            .find(|(t, _)| self.moe.is_some() && MOE_TYPES.contains(t))
            .unwrap_or(&types[0]);
        let (model_type, architecture) = (*model_type, *architecture);
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
        match self.arch.family {
            Family::Llama => {
                m.insert("hidden_act".into(), json!("silu"));
            }
            Family::Gemma => {
                m.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
                m.insert(
                    "query_pre_attn_scalar".into(),
                    json!((1.0 / (self.attn_scale as f64 * self.attn_scale as f64)).round()),
                );
                if let Some(c) = self.attn_softcap {
                    m.insert("attn_logit_softcapping".into(), json!(c as f64));
                }
                if let Some(c) = self.final_softcap {
                    m.insert("final_logit_softcapping".into(), json!(c as f64));
                }
                m.insert(
                    "rope_local_base_freq".into(),
                    json!(self.rope_base_swa as f64),
                );
                m.insert("sliding_window".into(), json!(self.sliding_window));
                m.insert("sliding_window_pattern".into(), json!(self.swa_pattern));
            }
        }
        if let Some(moe) = &self.moe {
            if model_type == "qwen3_moe" {
                m.insert("num_experts".into(), json!(moe.n_expert));
                m.insert("moe_intermediate_size".into(), json!(moe.n_ff_exp));
                m.insert("norm_topk_prob".into(), json!(moe.norm));
            } else {
                m.insert("num_local_experts".into(), json!(moe.n_expert));
            }
            m.insert("num_experts_per_tok".into(), json!(moe.n_expert_used));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrum_kernels::ops::RopeStyle;

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
            (Arch::from_name("llama").unwrap(), 576, 30, 1536)
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
            (Arch::from_name("gemma3").unwrap(), 256, Some(512), 6)
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
        let with =
            |rs: &str| SMOL.replace("\"rope_scaling\": null", &format!("\"rope_scaling\": {rs}"));
        // Scalings that are implemented load; the rest are refused, not run unscaled.
        let linear = Config::from_hf(&with(r#"{"type": "linear", "factor": 2}"#)).unwrap();
        assert_eq!(linear.rope_scaling.freq_scale, 0.5);
        let llama3 = Config::from_hf(&with(
            r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        ))
        .unwrap();
        let ff = llama3.rope_scaling.freq_factors.expect("llama3 factors");
        assert_eq!((ff.len(), ff[0], ff[31]), (32, 1.0, 8.0));
        let yarn = Config::from_hf(&with(
            r#"{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
        ))
        .unwrap();
        assert_eq!(yarn.rope_scaling.freq_scale, 0.25);
        assert_eq!(yarn.rope_scaling.yarn.unwrap().n_ctx_orig, 32768);
        // LongRoPE: the short factors up to the original context, the long ones past it.
        let factors = |v: f32, n: usize| format!("[{}]", vec![v.to_string(); n].join(", "));
        let long = Config::from_hf(&with(&format!(
            r#"{{"rope_type": "longrope", "original_max_position_embeddings": 4096,
            "short_factor": {}, "long_factor": {}}}"#,
            factors(1.5, 32),
            factors(3.0, 32)
        )))
        .unwrap();
        let lr = long.long_rope.as_ref().expect("LongRoPE");
        assert_eq!(lr.n_ctx_orig, 4096);
        assert_eq!(long.rope_scaling_for(4096), &lr.short);
        assert_eq!(long.rope_scaling_for(4097), &lr.long);
        assert_eq!(lr.long.freq_factors.as_ref().unwrap()[5], 3.0);
        // max_position_embeddings 8192 over 4096: sqrt(1 + ln 2 / ln 4096).
        let a = lr.short.yarn.unwrap().attn_factor;
        assert!(
            (a - (1.0 + 2f32.ln() / 4096f32.ln()).sqrt()).abs() < 1e-6,
            "{a}"
        );
        assert!(err(&with(r#"{"rope_type": "longrope", "factor": 4.0}"#))
            .contains("needs original_max_position_embeddings"));
        assert!(err(&with(&format!(
            r#"{{"rope_type": "longrope", "original_max_position_embeddings": 4096,
            "short_factor": {}, "long_factor": {}}}"#,
            factors(1.5, 31),
            factors(3.0, 31)
        )))
        .contains("31 RoPE frequency factors"));
        assert!(err(&with(
            r#"{"rope_type": "yarn", "factor": 4.0, "mscale": 0.7}"#
        ))
        .contains("mscale"));
        assert!(err(&with(r#"{"rope_type": "linear"}"#)).contains("without a factor"));
        assert!(
            err(&SMOL.replace("\"num_key_value_heads\": 3", "\"num_key_value_heads\": 4"))
                .contains("KV heads")
        );
    }
}
