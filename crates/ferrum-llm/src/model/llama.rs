//! Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models"): Llama 1-3
//! (with Llama 3.1's RoPE frequency factors), SmolLM, Mistral (a sliding window on every layer)
//! and Mixtral (Jiang et al. 2024: each feed-forward block a mixture of 8 experts, 2 per token).
//! Reference: llama.cpp `src/models/llama.cpp`. Its layer is the pre-norm decoder layer that
//! Qwen2, Qwen3 and Phi-3 reuse.
//!
//! Per layer, with x the residual stream [T, n_embd]:
//!   h = RMSNorm(x) * attn_norm
//!   q, k, v = h Wq, h Wk, h Wv
//!   RoPE(q), RoPE(k)                                (scaled as the model asks: Llama 3.1 factors, ...)
//!   x = x + Attention(q, k, v) Wo                   (softmax(q k^T / sqrt(d_head)) v, causal)
//!   h = RMSNorm(x) * ffn_norm
//!   x = x + (SiLU(h Wg) * (h Wu)) Wd                (or a mixture of such experts: [`super::moe`])

use ferrum_core::{Buf, Result};
use ferrum_kernels::ops::RopeStyle;

use super::arch::{dim, ArchDef, Experts, Layer, LayerTensors, Swa, TensorSpec, BASE};
use super::blocks::{moe_tensors, Attention, AttnOpts, Ffn, Moe, QkNorm, ATTENTION, MLP};
use super::config::Config;
use super::weights::Linear;
use super::{add, rms_norm, trace, Step};

pub static ARCH: ArchDef = ArchDef {
    name: "llama",
    about: "Llama 1-3, SmolLM, Mistral, Mixtral",
    hf_types: &[
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("mixtral", "MixtralForCausalLM"),
    ],
    rope_style: RopeStyle::Norm,
    rms_eps: 1e-5,
    swa: Swa::EveryLayer,
    experts: Experts::Optional,
    hf_permute_qk: true,
    tensors,
    build,
    ..BASE
};

/// The two norms of a pre-norm layer.
pub const NORMS: [TensorSpec; 2] = [
    TensorSpec::vector("attn_norm", "input_layernorm", dim::EMBD),
    TensorSpec::vector("ffn_norm", "post_attention_layernorm", dim::EMBD),
];

fn tensors(cfg: &Config) -> Vec<TensorSpec> {
    let mut v = [NORMS.as_slice(), &ATTENTION].concat();
    match cfg.moe {
        // Mixtral's checkpoints: `block_sparse_moe.gate`, experts' w1 (gate), w3 (up), w2 (down).
        Some(_) => v.extend(moe_tensors(
            "block_sparse_moe.gate",
            [
                "block_sparse_moe.experts.{e}.w1",
                "block_sparse_moe.experts.{e}.w3",
                "block_sparse_moe.experts.{e}.w2",
            ],
        )),
        None => v.extend(MLP),
    }
    v
}

fn build(cfg: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Ok(Box::new(DecoderLayer::load(cfg, t)?))
}

/// The pre-norm decoder layer: RMSNorm, attention, residual; RMSNorm, SwiGLU block, residual.
#[derive(Clone, Debug)]
pub struct DecoderLayer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
}

impl DecoderLayer {
    pub fn load(cfg: &Config, t: &mut LayerTensors) -> Result<DecoderLayer> {
        Ok(DecoderLayer {
            attn_norm: t.vector("attn_norm")?,
            attn: Attention::load(t)?,
            ffn_norm: t.vector("ffn_norm")?,
            ffn: Ffn::load(cfg, t)?,
        })
    }

    /// The layer, with Q and K normed per head when `qk_norm` is given (Qwen3).
    pub fn run(&self, il: usize, s: &mut Step, x: &mut Buf, qk_norm: Option<&QkNorm>) {
        let cfg = s.cfg;
        let e = cfg.n_embd;
        let h = rms_norm(x, &self.attn_norm, cfg.rms_eps);
        trace("attn_norm", Some(il), &h, e);
        let opts = AttnOpts {
            qk_norm,
            ..AttnOpts::default()
        };
        let o = self.attn.forward(il, s, &h, x, opts);
        add(x, &o);
        trace("ffn_inp", Some(il), x, e);

        let h = rms_norm(x, &self.ffn_norm, cfg.rms_eps);
        trace("ffn_norm", Some(il), &h, e);
        let f = self.ffn.forward(cfg, &h, &s.segs);
        trace("ffn_out", Some(il), &f, e);
        add(x, &f);
        trace("l_out", Some(il), x, e);
    }

    pub fn linears(&self) -> Vec<&Linear> {
        let mut v = self.attn.linears().to_vec();
        v.extend(self.ffn.linears());
        v
    }

    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v: Vec<&mut Linear> = self.attn.linears_mut().into_iter().collect();
        v.extend(self.ffn.linears_mut());
        v
    }

    pub fn norms(&self) -> Vec<(&'static str, &[f32])> {
        vec![("attn_norm", &self.attn_norm), ("ffn_norm", &self.ffn_norm)]
    }
}

impl Layer for DecoderLayer {
    fn forward(&self, il: usize, s: &mut Step, x: &mut Buf) {
        self.run(il, s, x, None)
    }
    fn linears(&self) -> Vec<&Linear> {
        DecoderLayer::linears(self)
    }
    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        DecoderLayer::linears_mut(self)
    }
    fn norms(&self) -> Vec<(&'static str, &[f32])> {
        DecoderLayer::norms(self)
    }
    fn moe(&self) -> Option<&Moe> {
        match &self.ffn {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }
    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
