//! gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"): a pre-norm mixture-of-experts
//! decoder whose attention has biases and learned sinks, every other layer local. Reference:
//! llama.cpp `src/models/openai-moe.cpp` (GGUF only: Hugging Face checkpoints store the experts
//! fused and in MXFP4 blocks, which no name mapping covers).
//!
//! Per layer, with x the residual stream [T, n_embd]:
//!   h = RMSNorm(x) * attn_norm
//!   q, k, v = h Wq + bq, h Wk + bk, h Wv + bv;  RoPE(q), RoPE(k)   (YaRN, NeoX style)
//!   x = x + Attention(q, k, v) Wo + bo
//!       (softmax over the keys and a per-head sink logit s_h:
//!        p_j = e^{a_j} / (e^{s_h} + Σ_i e^{a_i}); even layers see the last `sliding_window` keys)
//!   h = RMSNorm(x) * post_attention_norm
//!   r = h W_router + b_router;  E = top-k(r);  w = softmax(r_E)
//!   x = x + Σ_{e in E} w_e (W_down,e SwiGLU_oai(h W_gate,e + b, h W_up,e + b) + b_down,e)
//!       with SwiGLU_oai(g, u) = min(g, 7) σ(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)

use ferrum_core::{Buf, Result};

use super::arch::{dim, ArchDef, Experts, Layer, LayerTensors, Swa, TensorSpec, BASE};
use super::blocks::{moe_tensors, Attention, AttnOpts, Moe, ATTENTION};
use super::config::{Config, ExpertAct, Gating};
use super::weights::Linear;
use super::{add, moe, rms_norm, trace, Step};

pub static ARCH: ArchDef = ArchDef {
    name: "gpt-oss",
    about: "gpt-oss (20B, 120B)",
    rms_eps: 1e-5,
    swa: Swa::Pattern(2),
    experts: Experts::Always,
    qkv_bias: true,
    hf_rope_theta: 150_000.0,
    fixup,
    tensors,
    build,
    ..BASE
};

/// Its routing and activation (llama.cpp: SOFTMAX_WEIGHT gating, no renormalisation,
/// `swiglu_oai`).
fn fixup(cfg: &mut Config) {
    if let Some(m) = &mut cfg.moe {
        m.gating = Gating::SoftmaxWeight;
        m.act = ExpertAct::SwigluOai;
        m.norm = false;
    }
}

fn tensors(_: &Config) -> Vec<TensorSpec> {
    let mut t = vec![
        TensorSpec::vector("attn_norm", "input_layernorm", dim::EMBD),
        TensorSpec::vector("post_attention_norm", "post_attention_layernorm", dim::EMBD),
        TensorSpec::vector("attn_sinks", "self_attn.sinks", dim::HEADS),
    ];
    t.extend(ATTENTION.map(TensorSpec::with_bias));
    t.extend(
        moe_tensors(
            "mlp.router",
            [
                "mlp.experts.{e}.gate_proj",
                "mlp.experts.{e}.up_proj",
                "mlp.experts.{e}.down_proj",
            ],
        )
        .map(TensorSpec::with_bias),
    );
    t
}

fn build(_: &Config, t: &mut LayerTensors) -> Result<Box<dyn Layer>> {
    Ok(Box::new(GptOssLayer {
        attn_norm: t.vector("attn_norm")?,
        attn: Attention::load(t)?,
        sinks: t.vector("attn_sinks")?,
        post_attention_norm: t.vector("post_attention_norm")?,
        moe: Moe::load(t)?,
    }))
}

#[derive(Clone, Debug)]
pub struct GptOssLayer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    /// Per query head, the sink logit.
    pub sinks: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub moe: Moe,
}

impl Layer for GptOssLayer {
    fn forward(&self, il: usize, s: &mut Step, x: &mut Buf) {
        let cfg = s.cfg;
        let e = cfg.n_embd;
        let h = rms_norm(x, &self.attn_norm, cfg.rms_eps);
        trace("attn_norm", Some(il), &h, e);
        let opts = AttnOpts {
            sinks: Some(&self.sinks),
            ..AttnOpts::default()
        };
        let o = self.attn.forward(il, s, &h, x, opts);
        add(x, &o);
        trace("ffn_inp", Some(il), x, e);

        let h = rms_norm(x, &self.post_attention_norm, cfg.rms_eps);
        trace("attn_post_norm", Some(il), &h, e);
        let mc = cfg.moe.expect("gpt-oss has experts");
        let f = moe::forward(&self.moe, &mc, &h, e, &s.segs);
        trace("ffn_moe_out", Some(il), &f, e);
        add(x, &f);
        trace("l_out", Some(il), x, e);
    }
    fn linears(&self) -> Vec<&Linear> {
        let mut v = self.attn.linears().to_vec();
        v.extend(self.moe.linears());
        v
    }
    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v: Vec<&mut Linear> = self.attn.linears_mut().into_iter().collect();
        v.extend(self.moe.linears_mut());
        v
    }
    fn norms(&self) -> Vec<(&'static str, &[f32])> {
        vec![
            ("attn_norm", &self.attn_norm),
            ("post_attention_norm", &self.post_attention_norm),
            ("attn_sinks", &self.sinks),
        ]
    }
    fn moe(&self) -> Option<&Moe> {
        Some(&self.moe)
    }
    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
