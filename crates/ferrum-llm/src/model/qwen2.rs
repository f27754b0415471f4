//! Qwen2 (Yang et al. 2024, "Qwen2 Technical Report"), Qwen2.5 and Qwen2.5-Coder: the Llama layer
//! ([`super::llama::DecoderLayer`]) with biases on the Q, K and V projections, NeoX-style RoPE
//! (rotate-half) and RMSNorm epsilon 1e-6. Reference: llama.cpp `src/models/qwen2.cpp`.
//!
//! Per layer: q, k, v = h Wq + bq, h Wk + bk, h Wv + bv; the rest as Llama.

use ferrum_core::Result;
use ferrum_kernels::ops::RopeStyle;

use super::arch::{no_fixup, ArchDef, Experts, Family, Layer, LayerTensors, Swa, TensorSpec};
use super::blocks::{ATTENTION, MLP};
use super::config::Config;
use super::llama::{DecoderLayer, NORMS};

pub static ARCH: ArchDef = ArchDef {
    name: "qwen2",
    about: "Qwen2, Qwen2.5, Qwen2.5-Coder",
    hf_types: &[("qwen2", "Qwen2ForCausalLM")],
    family: Family::Llama,
    rope_style: RopeStyle::Neox,
    rms_eps: 1e-6,
    // Qwen files may name a window that the model does not use (as llama.cpp, ignored).
    swa: Swa::Never,
    swa_rope_base: false,
    experts: Experts::Never,
    qkv_bias: true,
    hf_permute_qk: false,
    hf_head_dim: None,
    hf_vocab: None,
    hf_rope_theta: 10_000.0,
    fixup: no_fixup,
    tensors,
    build,
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
