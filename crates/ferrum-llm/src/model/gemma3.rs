//! Gemma 3 (Gemma Team 2025, "Gemma 3 Technical Report"): the Gemma 2 layer
//! ([`super::gemma2::GemmaLayer`]) with a per-head RMSNorm of Q and K instead of soft-capping,
//! five local layers for each global one, and RoPE base 10 000 on local layers (the global
//! ones take `rope.freq_base` and any scaling). References: Hugging Face `modeling_gemma3.py`,
//! llama.cpp `src/models/gemma3.cpp`.
//!
//! Per layer, as Gemma 2 with, after the projections:
//!   q = RMSNorm_head(q) * q_norm;  k = RMSNorm_head(k) * k_norm

use ferrum_core::{Buf, Result};

use super::arch::{ArchDef, Family, Layer, LayerTensors, Swa, TensorSpec, BASE};
use super::blocks::{QkNorm, ATTENTION, MLP, QK_NORM};
use super::config::Config;
use super::gemma2::{GemmaLayer, NORMS};
use super::weights::Linear;
use super::Step;

pub static ARCH: ArchDef = ArchDef {
    name: "gemma3",
    about: "Gemma 3 (text)",
    hf_types: &[
        ("gemma3_text", "Gemma3ForCausalLM"),
        ("gemma3", "Gemma3ForConditionalGeneration"),
    ],
    family: Family::Gemma,
    swa: Swa::Pattern(6),
    swa_rope_base: true,
    hf_head_dim: Some(256),
    hf_vocab: Some(262_208),
    hf_rope_theta: 1_000_000.0,
    tensors,
    build,
    ..BASE
};

fn tensors(_: &Config) -> Vec<TensorSpec> {
    [NORMS.as_slice(), &ATTENTION, &QK_NORM, &MLP].concat()
}

fn build(_: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Ok(Box::new(Gemma3Layer {
        qk_norm: QkNorm::load(t)?,
        layer: GemmaLayer::load(t)?,
    }))
}

#[derive(Clone, Debug)]
pub struct Gemma3Layer {
    pub layer: GemmaLayer,
    pub qk_norm: QkNorm,
}

impl Layer for Gemma3Layer {
    fn forward(&self, il: usize, s: &mut Step, x: &mut Buf) {
        self.layer.run(il, s, x, Some(&self.qk_norm))
    }
    fn linears(&self) -> Vec<&Linear> {
        self.layer.linears()
    }
    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        self.layer.linears_mut()
    }
    fn norms(&self) -> Vec<(&'static str, &[f32])> {
        let mut v = self.layer.norms();
        v.extend(self.qk_norm.norms());
        v
    }
    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
