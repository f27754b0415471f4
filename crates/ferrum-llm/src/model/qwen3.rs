//! Qwen3 (Qwen Team 2025, "Qwen3 Technical Report"), dense models 0.6B-32B: the Llama layer
//! ([`super::llama::DecoderLayer`]) with a per-head RMSNorm of Q and K before RoPE ("QK-norm"),
//! NeoX-style RoPE and no biases. Reference: llama.cpp `src/models/qwen3.cpp`.
//!
//! Per layer:
//!   h = RMSNorm(x) * attn_norm
//!   q, k, v = h Wq, h Wk, h Wv
//!   q = RMSNorm_head(q) * q_norm;  k = RMSNorm_head(k) * k_norm
//!   RoPE(q), RoPE(k);  x = x + Attention(q, k, v) Wo
//!   x = x + SwiGLU block(RMSNorm(x) * ffn_norm)

use ferrum_core::{Buf, Result};

use super::arch::{ArchDef, Layer, LayerTensors, TensorSpec, BASE};
use super::blocks::{Moe, QkNorm, ATTENTION, MLP, QK_NORM};
use super::config::Config;
use super::llama::{DecoderLayer, NORMS};
use super::weights::Linear;
use super::Step;

pub static ARCH: ArchDef = ArchDef {
    name: "qwen3",
    about: "Qwen3 dense",
    hf_types: &[("qwen3", "Qwen3ForCausalLM")],
    tensors,
    build,
    ..BASE
};

fn tensors(_: &Config) -> Vec<TensorSpec> {
    [NORMS.as_slice(), &ATTENTION, &QK_NORM, &MLP].concat()
}

fn build(cfg: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Ok(Box::new(QkNormLayer::load(cfg, t)?))
}

/// The pre-norm decoder layer with QK-norm (Qwen3 and Qwen3-MoE).
#[derive(Clone, Debug)]
pub struct QkNormLayer {
    pub layer: DecoderLayer,
    pub qk_norm: QkNorm,
}

impl QkNormLayer {
    pub fn load(cfg: &Config, t: &mut LayerTensors) -> Result<QkNormLayer> {
        Ok(QkNormLayer {
            qk_norm: QkNorm::load(t)?,
            layer: DecoderLayer::load(cfg, t)?,
        })
    }
}

impl Layer for QkNormLayer {
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
    fn moe(&self) -> Option<&Moe> {
        self.layer.moe()
    }
    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
