//! Phi-3 (Abdin et al. 2024, "Phi-3 Technical Report"), Phi-3.5-mini, Phi-4-mini: the Llama layer
//! ([`super::llama::DecoderLayer`]) stored with Q, K and V stacked in one matrix and gate and up
//! in another (split by rows on load, without a copy), NeoX-style RoPE. Reference: llama.cpp
//! `src/models/phi3.cpp`. The 128k-context variants, Phi-3.5 and Phi-4-mini rotate with LongRoPE's
//! factors ([`super::config::LongRope`], read by the config loaders).
//!
//! Per layer: [q; k; v] = h W_qkv;  [g; u] = h W_gate_up;  otherwise as Llama.

use ferrum_core::Result;

use super::arch::{dim, ArchDef, Dim, Layer, LayerTensors, Swa, TensorSpec, BASE};
use super::config::Config;
use super::llama::{DecoderLayer, NORMS};

pub static ARCH: ArchDef = ArchDef {
    name: "phi3",
    about: "Phi-3, Phi-3.5-mini, Phi-4-mini",
    hf_types: &[("phi3", "Phi3ForCausalLM")],
    rms_eps: 1e-5,
    swa: Swa::EveryLayer,
    tensors,
    build,
    ..BASE
};

const QKV: &[(&str, Dim)] = &[("attn_q", dim::Q), ("attn_k", dim::KV), ("attn_v", dim::KV)];
/// Gate first, then up.
const GATE_UP: &[(&str, Dim)] = &[("ffn_gate", dim::FF), ("ffn_up", dim::FF)];

fn tensors(_: &Config) -> Vec<TensorSpec> {
    let mut t = NORMS.to_vec();
    t.extend([
        TensorSpec::stacked("attn_qkv", "self_attn.qkv_proj", dim::EMBD, QKV),
        TensorSpec::matrix("attn_output", "self_attn.o_proj", dim::Q, dim::EMBD),
        TensorSpec::stacked("ffn_up", "mlp.gate_up_proj", dim::EMBD, GATE_UP),
        TensorSpec::matrix("ffn_down", "mlp.down_proj", dim::FF, dim::EMBD),
    ]);
    t
}

fn build(cfg: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Ok(Box::new(DecoderLayer::load(cfg, t)?))
}
