//! Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size").
//! References: Hugging Face `modeling_gemma2.py`, llama.cpp `src/models/gemma2.cpp`. Its layer is
//! the one Gemma 3 extends.
//!
//! x = embed(t) * sqrt(n_embd). Per layer (norm weights in GGUF already include Gemma's +1):
//!   h = RMSNorm(x) * attn_norm
//!   q, k, v = h Wq, h Wk, h Wv;  RoPE(q), RoPE(k)
//!   q = q / sqrt(query_pre_attn_scalar)     (d_head, except Gemma 2 27B: n_embd / n_head)
//!   x = x + RMSNorm(Attention(q, k, v) Wo) * post_attention_norm
//!       (scores soft-capped, s -> cap tanh(s / cap); every other layer local: each query sees
//!       the last `sliding_window` positions)
//!   h = RMSNorm(x) * ffn_norm
//!   x = x + RMSNorm((GELU_tanh(h Wg) * (h Wu)) Wd) * post_ffw_norm
//! and the logits are soft-capped too.

use ferrum_core::{Buf, Result};

use super::arch::{dim, ArchDef, Family, Layer, LayerTensors, Swa, TensorSpec, BASE};
use super::blocks::{Attention, AttnOpts, Mlp, QkNorm, ATTENTION, MLP};
use super::config::Config;
use super::weights::Linear;
use super::{add, rms_norm, trace, Step};

pub static ARCH: ArchDef = ArchDef {
    name: "gemma2",
    about: "Gemma 2",
    hf_types: &[("gemma2", "Gemma2ForCausalLM")],
    family: Family::Gemma,
    swa: Swa::Pattern(2),
    hf_head_dim: Some(256),
    hf_vocab: Some(256_000),
    fixup,
    tensors,
    build,
    ..BASE
};

/// llama.cpp scales Gemma 2 27B's (46 layers) queries by 1/sqrt(n_embd / n_head), its
/// query_pre_attn_scalar, rather than by 1/sqrt(head_dim).
fn fixup(cfg: &mut Config) {
    if cfg.n_layer == 46 {
        cfg.attn_scale = 1.0 / ((cfg.n_embd / cfg.n_head) as f32).sqrt();
    }
}

/// Gemma's four norms: before and after attention, before and after the feed-forward block.
pub const NORMS: [TensorSpec; 4] = [
    TensorSpec::vector("attn_norm", "input_layernorm", dim::EMBD),
    TensorSpec::vector("post_attention_norm", "post_attention_layernorm", dim::EMBD),
    TensorSpec::vector("ffn_norm", "pre_feedforward_layernorm", dim::EMBD),
    TensorSpec::vector("post_ffw_norm", "post_feedforward_layernorm", dim::EMBD),
];

fn tensors(_: &Config) -> Vec<TensorSpec> {
    [NORMS.as_slice(), &ATTENTION, &MLP].concat()
}

fn build(_: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Ok(Box::new(GemmaLayer::load(t)?))
}

/// Gemma's sandwich-norm layer: each block's output is normed again before its residual add.
#[derive(Clone, Debug)]
pub struct GemmaLayer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    pub post_attention_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub mlp: Mlp,
    pub post_ffw_norm: Vec<f32>,
}

impl GemmaLayer {
    pub fn load(t: &mut LayerTensors) -> Result<GemmaLayer> {
        Ok(GemmaLayer {
            attn_norm: t.vector("attn_norm")?,
            attn: Attention::load(t)?,
            post_attention_norm: t.vector("post_attention_norm")?,
            ffn_norm: t.vector("ffn_norm")?,
            mlp: Mlp::load(t)?,
            post_ffw_norm: t.vector("post_ffw_norm")?,
        })
    }

    /// The layer, with Q and K normed per head when `qk_norm` is given (Gemma 3).
    pub fn run(&self, il: usize, s: &mut Step, x: &mut Buf, qk_norm: Option<&QkNorm>) {
        let cfg = s.cfg;
        let (e, eps) = (cfg.n_embd, cfg.rms_eps);
        let h = rms_norm(x, &self.attn_norm, eps);
        trace("attn_norm", Some(il), &h, e);
        let opts = AttnOpts {
            qk_norm,
            local_rope: true,
            scale_q: true,
            sinks: None,
        };
        let o = self.attn.forward(il, s, &h, x, opts);
        let o = rms_norm(&o, &self.post_attention_norm, eps);
        trace("attn_post_norm", Some(il), &o, e);
        add(x, &o);
        trace("ffn_inp", Some(il), x, e);

        let h = rms_norm(x, &self.ffn_norm, eps);
        trace("ffn_norm", Some(il), &h, e);
        let f = rms_norm(&self.mlp.geglu(il, &h, &s.segs), &self.post_ffw_norm, eps);
        trace("ffn_post_norm", Some(il), &f, e);
        add(x, &f);
        trace("l_out", Some(il), x, e);
    }

    pub fn linears(&self) -> Vec<&Linear> {
        let mut v = self.attn.linears().to_vec();
        v.extend([&self.mlp.gate, &self.mlp.up, &self.mlp.down]);
        v
    }

    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v: Vec<&mut Linear> = self.attn.linears_mut().into_iter().collect();
        v.extend([&mut self.mlp.gate, &mut self.mlp.up, &mut self.mlp.down]);
        v
    }

    pub fn norms(&self) -> Vec<(&'static str, &[f32])> {
        vec![
            ("attn_norm", &self.attn_norm),
            ("post_attention_norm", &self.post_attention_norm),
            ("ffn_norm", &self.ffn_norm),
            ("post_ffw_norm", &self.post_ffw_norm),
        ]
    }
}

impl Layer for GemmaLayer {
    fn forward(&self, il: usize, s: &mut Step, x: &mut Buf) {
        self.run(il, s, x, None)
    }
    fn linears(&self) -> Vec<&Linear> {
        GemmaLayer::linears(self)
    }
    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        GemmaLayer::linears_mut(self)
    }
    fn norms(&self) -> Vec<(&'static str, &[f32])> {
        GemmaLayer::norms(self)
    }
    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
