//! Qwen3-MoE (Qwen Team 2025, "Qwen3 Technical Report"; Qwen3-30B-A3B: 128 experts, 8 per token):
//! the Qwen3 layer ([`super::qwen3::QkNormLayer`]) whose feed-forward block is a mixture of
//! experts with renormalised routing weights ([`super::moe`]). Reference: llama.cpp
//! `src/models/qwen3moe.cpp`.
//!
//! Per layer: Qwen3's attention, then x = x + Σ_{e in top-k} w_e SwiGLU_e(RMSNorm(x) * ffn_norm).

use ferrum_core::Result;

use super::arch::{ArchDef, Experts, Layer, LayerTensors, TensorSpec, BASE};
use super::blocks::{moe_tensors, ATTENTION, QK_NORM};
use super::config::Config;
use super::llama::NORMS;
use super::qwen3::QkNormLayer;

pub static ARCH: ArchDef = ArchDef {
    name: "qwen3moe",
    about: "Qwen3 mixture of experts (30B-A3B, 235B-A22B)",
    hf_types: &[("qwen3_moe", "Qwen3MoeForCausalLM")],
    experts: Experts::Always,
    tensors,
    build,
    ..BASE
};

fn tensors(_: &Config) -> Vec<TensorSpec> {
    let moe = moe_tensors(
        "mlp.gate",
        [
            "mlp.experts.{e}.gate_proj",
            "mlp.experts.{e}.up_proj",
            "mlp.experts.{e}.down_proj",
        ],
    );
    [NORMS.as_slice(), &ATTENTION, &QK_NORM, &moe].concat()
}

fn build(cfg: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Ok(Box::new(QkNormLayer::load(cfg, t)?))
}
