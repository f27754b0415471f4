//! The architecture registry. Every architecture ferrum runs is one file of this folder
//! (`llama.rs`, `qwen3.rs`, `gemma3.rs`, ...) holding one [`ArchDef`], plus its line in
//! [`REGISTRY`]. An [`ArchDef`] declares what the generic loaders cannot know:
//! - its hyperparameter conventions: RoPE style, default norm epsilon, sliding-window layout,
//!   experts, the Hugging Face `model_type`s it answers to and their defaults (the keys every
//!   architecture shares are read by [`super::config`] and [`crate::hf::config`]);
//! - its per-layer tensors ([`TensorSpec`]: GGUF name, Hugging Face name, shape, required or
//!   optional), which [`super::weights::Weights::load`] reads, checks and stores once, from a
//!   GGUF file or a safetensors folder alike;
//! - its layer, built from those tensors and run from the shared blocks of [`super::blocks`]
//!   ([`Layer`]).

use std::fmt;

use ferrum_core::{Buf, Error, Result};
use ferrum_kernels::ops::RopeStyle;

use super::blocks::Moe;
use super::config::Config;
use super::weights::Linear;
use super::{gemma2, gemma3, gptoss, llama, phi3, qwen2, qwen3, qwen3moe, Step};

/// Every architecture, by its GGUF `general.architecture` name: one line each.
pub static REGISTRY: &[&ArchDef] = &[
    &llama::ARCH,
    &qwen2::ARCH,
    &qwen3::ARCH,
    &qwen3moe::ARCH,
    &phi3::ARCH,
    &gemma2::ARCH,
    &gemma3::ARCH,
    &gptoss::ARCH,
];

/// Conventions a family of architectures shares in its configs and checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Pre-norm decoder with SwiGLU: Llama and the models derived from it.
    Llama,
    /// Gemma: embeddings scaled by sqrt(n_embd), GeGLU, norms stored as `w` in checkpoints and
    /// `1 + w` in GGUF, queries scaled by `query_pre_attn_scalar`, a default chat template.
    Gemma,
}

/// Which layers attend through a sliding window, when the model names one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swa {
    /// The architecture has no local layers (a window in its metadata is inert).
    Never,
    /// Every layer (Mistral-style).
    EveryLayer,
    /// Every n-th layer (il % n == n - 1) is global, the rest local (Gemma 2: 2, Gemma 3: 6).
    Pattern(usize),
}

/// Whether the feed-forward blocks are mixtures of experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Experts {
    Never,
    /// When the metadata counts experts (Llama files hold Mixtral).
    Optional,
    Always,
}

/// One architecture: its conventions, its tensors and its layer.
pub struct ArchDef {
    /// GGUF `general.architecture`.
    pub name: &'static str,
    /// The models it covers, for `ferrum info` and errors.
    pub about: &'static str,
    /// Hugging Face (`model_type`, `architectures[0]`) pairs it loads; the first is what
    /// [`Config::to_hf_json`] writes.
    pub hf_types: &'static [(&'static str, &'static str)],
    pub family: Family,
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon when the metadata has none.
    pub rms_eps: f32,
    pub swa: Swa,
    /// Whether local layers rotate with a base of their own (`rope.freq_base_swa`,
    /// `rope_local_base_freq`; 10 000 by default) and without the global layers' scaling.
    pub swa_rope_base: bool,
    pub experts: Experts,
    /// Whether Q, K and V carry biases (Hugging Face `attention_bias` is implied).
    pub qkv_bias: bool,
    /// Hugging Face checkpoints store Q and K rows in rotate-half order; GGUF (and so ferrum,
    /// with [`RopeStyle::Norm`]) wants consecutive pairs: the loader permutes them.
    pub hf_permute_qk: bool,
    /// Defaults of Hugging Face configs that omit a key: head dim, vocabulary, RoPE theta.
    pub hf_head_dim: Option<usize>,
    pub hf_vocab: Option<usize>,
    pub hf_rope_theta: f64,
    /// Architecture-specific adjustments once the shared keys are read.
    pub fixup: fn(&mut Config),
    /// The tensors of one layer.
    pub tensors: fn(&Config) -> Vec<TensorSpec>,
    /// A layer from its tensors (each taken by its GGUF name).
    pub build: fn(&Config, &mut LayerTensors) -> Result<Box<dyn Layer>>,
}

/// No adjustment ([`ArchDef::fixup`]).
pub fn no_fixup(_: &mut Config) {}

fn no_tensors(_: &Config) -> Vec<TensorSpec> {
    Vec::new()
}

fn no_layer(_: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Err(Error::msg(format!("{}: no layer defined", t.arch)))
}

/// What an architecture's definition says unless it says otherwise (`..BASE`): NeoX RoPE, RMSNorm
/// epsilon 1e-6, no local layers, no experts, no biases, Hugging Face defaults of none and RoPE
/// theta 10 000. Every definition names itself, its Hugging Face types, tensors and layer.
pub const BASE: ArchDef = ArchDef {
    name: "",
    about: "",
    hf_types: &[],
    family: Family::Llama,
    rope_style: RopeStyle::Neox,
    rms_eps: 1e-6,
    swa: Swa::Never,
    swa_rope_base: false,
    experts: Experts::Never,
    qkv_bias: false,
    hf_permute_qk: false,
    hf_head_dim: None,
    hf_vocab: None,
    hf_rope_theta: 10_000.0,
    fixup: no_fixup,
    tensors: no_tensors,
    build: no_layer,
};

/// An architecture of the [`REGISTRY`] (compared by name).
#[derive(Clone, Copy)]
pub struct Arch(&'static ArchDef);

impl Arch {
    /// The architecture a GGUF file names, or an error listing the supported ones.
    pub fn from_name(name: &str) -> Result<Arch> {
        REGISTRY
            .iter()
            .find(|d| d.name == name)
            .map(|d| Arch(d))
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "architecture '{name}' (supported: {})",
                    names().join(", ")
                ))
            })
    }

    /// The architecture of a Hugging Face `model_type`.
    pub fn from_hf_type(model_type: &str) -> Option<Arch> {
        REGISTRY
            .iter()
            .find(|d| d.hf_types.iter().any(|&(t, _)| t == model_type))
            .map(|d| Arch(d))
    }

    pub fn name(self) -> &'static str {
        self.0.name
    }

    pub fn def(self) -> &'static ArchDef {
        self.0
    }

    pub fn is_gemma(self) -> bool {
        self.0.family == Family::Gemma
    }
}

impl std::ops::Deref for Arch {
    type Target = ArchDef;
    fn deref(&self) -> &ArchDef {
        self.0
    }
}

impl PartialEq for Arch {
    fn eq(&self, other: &Arch) -> bool {
        self.0.name == other.0.name
    }
}
impl Eq for Arch {}

impl fmt::Debug for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Arch({})", self.0.name)
    }
}

/// The GGUF names of every architecture.
pub fn names() -> Vec<&'static str> {
    REGISTRY.iter().map(|d| d.name).collect()
}

/// Every Hugging Face `model_type` some architecture loads.
pub fn hf_model_types() -> Vec<&'static str> {
    REGISTRY
        .iter()
        .flat_map(|d| d.hf_types.iter().map(|&(t, _)| t))
        .collect()
}

/// A size read from the config ([`TensorSpec`] shapes).
pub type Dim = fn(&Config) -> usize;

/// The sizes tensors are made of.
pub mod dim {
    use super::Dim;
    pub const EMBD: Dim = |c| c.n_embd;
    pub const Q: Dim = |c| c.q_dim();
    pub const KV: Dim = |c| c.kv_dim();
    pub const HEAD: Dim = |c| c.head_dim;
    pub const FF: Dim = |c| c.n_ff;
    pub const FF_EXP: Dim = |c| c.moe.map_or(0, |m| m.n_ff_exp);
    pub const EXPERTS: Dim = |c| c.moe.map_or(0, |m| m.n_expert);
    pub const HEADS: Dim = |c| c.n_head;
}

/// The shape of a layer tensor, GGUF order (`n_in` contiguous).
#[derive(Clone, Copy)]
pub enum Shape {
    /// A norm's weights.
    Vector(Dim),
    /// A projection `[n_in] -> [n_out]`, with a bias vector when `bias`.
    Matrix { n_in: Dim, n_out: Dim, bias: bool },
    /// A matrix whose rows stack several projections (Phi-3's QKV, gate-up): each part is a
    /// projection of its own, named by its GGUF role.
    Stacked {
        n_in: Dim,
        parts: &'static [(&'static str, Dim)],
    },
    /// `[n_in, n_out, n_expert]`: one projection per expert, with a bias `[n_out, n_expert]`
    /// when `bias`.
    Experts { n_in: Dim, n_out: Dim, bias: bool },
}

/// One tensor of a layer.
#[derive(Clone, Copy)]
pub struct TensorSpec {
    /// The GGUF name within the layer: `blk.N.{gguf}.weight` (and `.bias`).
    pub gguf: &'static str,
    /// The Hugging Face name within `model.layers.N.`, before `.weight`; `{e}` stands for the
    /// expert's index where a checkpoint stores each expert apart.
    pub hf: &'static str,
    pub shape: Shape,
    pub required: bool,
}

impl TensorSpec {
    pub const fn vector(gguf: &'static str, hf: &'static str, n: Dim) -> Self {
        Self {
            gguf,
            hf,
            shape: Shape::Vector(n),
            required: true,
        }
    }

    pub const fn matrix(gguf: &'static str, hf: &'static str, n_in: Dim, n_out: Dim) -> Self {
        Self {
            gguf,
            hf,
            shape: Shape::Matrix {
                n_in,
                n_out,
                bias: false,
            },
            required: true,
        }
    }

    pub const fn stacked(
        gguf: &'static str,
        hf: &'static str,
        n_in: Dim,
        parts: &'static [(&'static str, Dim)],
    ) -> Self {
        Self {
            gguf,
            hf,
            shape: Shape::Stacked { n_in, parts },
            required: true,
        }
    }

    pub const fn experts(gguf: &'static str, hf: &'static str, n_in: Dim, n_out: Dim) -> Self {
        Self {
            gguf,
            hf,
            shape: Shape::Experts {
                n_in,
                n_out,
                bias: false,
            },
            required: true,
        }
    }

    /// The same projection (or experts) with a bias.
    pub const fn with_bias(self) -> Self {
        match self.shape {
            Shape::Matrix { n_in, n_out, .. } => Self {
                shape: Shape::Matrix {
                    n_in,
                    n_out,
                    bias: true,
                },
                ..self
            },
            Shape::Experts { n_in, n_out, .. } => Self {
                shape: Shape::Experts {
                    n_in,
                    n_out,
                    bias: true,
                },
                ..self
            },
            _ => self,
        }
    }

    /// The same tensor, loaded when the file has it.
    pub const fn optional(self) -> Self {
        Self {
            required: false,
            ..self
        }
    }
}

/// A layer tensor as loaded: a norm, a projection, or one projection per expert.
pub enum Loaded {
    Vector(Vec<f32>),
    Linear(Linear),
    Experts(Vec<Linear>),
}

/// The tensors of one layer, handed to [`ArchDef::build`], which takes each by its GGUF name.
pub struct LayerTensors {
    pub il: usize,
    arch: &'static str,
    items: Vec<(&'static str, Loaded)>,
}

impl LayerTensors {
    pub fn new(il: usize, arch: &'static str, items: Vec<(&'static str, Loaded)>) -> Self {
        Self { il, arch, items }
    }

    fn take(&mut self, name: &str) -> Option<Loaded> {
        let i = self.items.iter().position(|(n, _)| *n == name)?;
        Some(self.items.swap_remove(i).1)
    }

    fn missing(&self, name: &str, what: &str) -> Error {
        Error::msg(format!(
            "{}: layer {} has no {what} '{name}' (not among the architecture's tensors)",
            self.arch, self.il
        ))
    }

    /// A norm's weights.
    pub fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        match self.take(name) {
            Some(Loaded::Vector(v)) => Ok(v),
            _ => Err(self.missing(name, "vector")),
        }
    }

    /// A projection (or one part of a stacked one).
    pub fn linear(&mut self, name: &str) -> Result<Linear> {
        match self.take(name) {
            Some(Loaded::Linear(l)) => Ok(l),
            _ => Err(self.missing(name, "projection")),
        }
    }

    /// A projection declared optional: `None` when the file has none.
    pub fn opt_linear(&mut self, name: &str) -> Option<Linear> {
        match self.take(name) {
            Some(Loaded::Linear(l)) => Some(l),
            _ => None,
        }
    }

    /// Each expert's projection.
    pub fn experts(&mut self, name: &str) -> Result<Vec<Linear>> {
        match self.take(name) {
            Some(Loaded::Experts(v)) => Ok(v),
            _ => Err(self.missing(name, "expert tensor")),
        }
    }

    /// Fails if the build left a tensor unused (a declaration the layer does not use).
    pub fn finish(self) -> Result<()> {
        match self.items.first() {
            None => Ok(()),
            Some((n, _)) => Err(Error::msg(format!(
                "{}: layer {} loaded '{n}' but does not use it",
                self.arch, self.il
            ))),
        }
    }
}

/// One decoder layer of some architecture.
pub trait Layer: Send + Sync + fmt::Debug {
    /// Runs the layer on the residual stream `x` ([T, n_embd]), in place.
    fn forward(&self, il: usize, s: &mut Step, x: &mut Buf);
    /// Every projection, each named by its GGUF role ([`Linear::kind`]).
    fn linears(&self) -> Vec<&Linear>;
    /// [`Layer::linears`], mutably and in the same order.
    fn linears_mut(&mut self) -> Vec<&mut Linear>;
    /// Every norm's weights, by GGUF name.
    fn norms(&self) -> Vec<(&'static str, &[f32])>;
    /// The mixture of experts, if the feed-forward block is one.
    fn moe(&self) -> Option<&Moe> {
        None
    }
    fn boxed_clone(&self) -> Box<dyn Layer>;
}

impl dyn Layer {
    /// The projection with this GGUF role (`attn_q`, `ffn_down`, ...); the first expert's for
    /// an expert role.
    pub fn linear(&self, kind: &str) -> Option<&Linear> {
        self.linears().into_iter().find(|l| l.kind == kind)
    }

    /// The norm with this GGUF name (`attn_norm`, `post_ffw_norm`, ...).
    pub fn norm(&self, name: &str) -> Option<&[f32]> {
        self.norms()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
    }
}

impl Clone for Box<dyn Layer> {
    fn clone(&self) -> Self {
        self.boxed_clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_architecture_is_found_by_its_names() {
        for d in REGISTRY {
            assert_eq!(Arch::from_name(d.name).unwrap().name(), d.name);
            for &(t, _) in d.hf_types {
                assert_eq!(Arch::from_hf_type(t).unwrap().name(), d.name, "{t}");
            }
        }
        let e = Arch::from_name("gpt2").unwrap_err().to_string();
        assert!(e.contains("'gpt2'") && e.contains("llama, qwen2"), "{e}");
        // No GGUF name or model_type is claimed twice.
        let mut n = names();
        n.sort();
        n.dedup();
        assert_eq!(n.len(), REGISTRY.len());
        let mut t = hf_model_types();
        let len = t.len();
        t.sort();
        t.dedup();
        assert_eq!(t.len(), len);
    }

    #[test]
    fn tensor_names_are_unique_within_a_layer() {
        use crate::model::config::MoeConfig;
        for d in REGISTRY {
            let mut cfg = Config {
                arch: Arch(d),
                n_vocab: 64,
                n_embd: 32,
                n_layer: 2,
                n_ff: 48,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 8,
                n_rot: 8,
                rope_style: d.rope_style,
                rope_base: 10_000.0,
                rope_scaling: Default::default(),
                long_rope: None,
                rope_base_swa: 10_000.0,
                rms_eps: d.rms_eps,
                n_ctx_train: 128,
                sliding_window: None,
                swa_pattern: 1,
                moe: None,
                attn_scale: 1.0,
                attn_softcap: None,
                final_softcap: None,
                kv_type: ferrum_core::DType::F16,
            };
            if d.experts != Experts::Never {
                cfg.moe = Some(MoeConfig {
                    n_expert: 4,
                    n_expert_used: 2,
                    n_ff_exp: 8,
                    norm: true,
                    gating: crate::model::config::Gating::Softmax,
                    act: crate::model::config::ExpertAct::Silu,
                });
            }
            let specs = (d.tensors)(&cfg);
            assert!(!d.name.is_empty() && !specs.is_empty(), "{}", d.name);
            // The names the layer's tensors are taken by (a stacked matrix's parts).
            let names: Vec<&str> = specs
                .iter()
                .flat_map(|s| match s.shape {
                    Shape::Stacked { parts, .. } => parts.iter().map(|p| p.0).collect(),
                    _ => vec![s.gguf],
                })
                .collect();
            let mut names = names;
            let n = names.len();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), n, "{}", d.name);
            let hf: Vec<&str> = specs.iter().map(|s| s.hf).collect();
            assert!(hf.iter().all(|h| !h.is_empty() && !h.ends_with(".weight")));
        }
    }
}
