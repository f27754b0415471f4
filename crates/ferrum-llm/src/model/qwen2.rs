//! Qwen2 (Yang et al. 2024, "Qwen2 Technical Report"), Qwen2.5 and Qwen2.5-Coder: the Llama layer
//! ([`super::llama::DecoderLayer`]) with biases on the Q, K and V projections, NeoX-style RoPE
//! (rotate-half) and RMSNorm epsilon 1e-6. Reference: llama.cpp `src/models/qwen2.cpp`.
//!
//! Per layer: q, k, v = h Wq + bq, h Wk + bk, h Wv + bv; the rest as Llama.

use ferrum_core::Result;

use super::arch::{ArchDef, Layer, LayerTensors, TensorSpec, BASE};
use super::blocks::{ATTENTION, MLP};
use super::config::Config;
use super::llama::{DecoderLayer, NORMS};

pub static ARCH: ArchDef = ArchDef {
    name: "qwen2",
    about: "Qwen2, Qwen2.5, Qwen2.5-Coder",
    hf_types: &[("qwen2", "Qwen2ForCausalLM")],
    qkv_bias: true,
    tensors,
    build,
    ..BASE
};

fn tensors(_: &Config) -> Vec<TensorSpec> {
    let [q, k, v, o] = ATTENTION;
    let mut t = NORMS.to_vec();
    t.extend([q.with_bias(), k.with_bias(), v.with_bias(), o]);
    t.extend(MLP);
    t
}

fn build(cfg: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Ok(Box::new(DecoderLayer::load(cfg, t)?))
}
