//! The blocks every architecture is built from: self-attention over the paged cache (with the
//! per-head Q/K norm some add), the gated feed-forward block and the mixture of experts. Each
//! block declares its tensors ([`TensorSpec`]) and is built from them ([`LayerTensors`]); an
//! architecture's file composes them into its layer.

use ferrum_core::{Buf, Result};

use super::arch::{dim, LayerTensors, TensorSpec};
use super::config::Config;
use super::weights::Linear;
use super::{geglu, moe, rms_norm_inplace, rope, scale, swiglu, trace, Attend, Step};

/// The attention projections as most checkpoints store them.
pub const ATTENTION: [TensorSpec; 4] = [
    TensorSpec::matrix("attn_q", "self_attn.q_proj", dim::EMBD, dim::Q),
    TensorSpec::matrix("attn_k", "self_attn.k_proj", dim::EMBD, dim::KV),
    TensorSpec::matrix("attn_v", "self_attn.v_proj", dim::EMBD, dim::KV),
    TensorSpec::matrix("attn_output", "self_attn.o_proj", dim::Q, dim::EMBD),
];

/// Per-head RMSNorm weights of Q and K (Qwen3, Gemma 3).
pub const QK_NORM: [TensorSpec; 2] = [
    TensorSpec::vector("attn_q_norm", "self_attn.q_norm", dim::HEAD),
    TensorSpec::vector("attn_k_norm", "self_attn.k_norm", dim::HEAD),
];

/// A gated feed-forward block's projections.
pub const MLP: [TensorSpec; 3] = [
    TensorSpec::matrix("ffn_gate", "mlp.gate_proj", dim::EMBD, dim::FF),
    TensorSpec::matrix("ffn_up", "mlp.up_proj", dim::EMBD, dim::FF),
    TensorSpec::matrix("ffn_down", "mlp.down_proj", dim::FF, dim::EMBD),
];

/// Self-attention's projections: `q, k, v = h Wq, h Wk, h Wv`, output `a Wo`.
#[derive(Clone, Debug)]
pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub output: Linear,
}

/// How a layer's attention runs.
#[derive(Clone, Copy, Default)]
pub struct AttnOpts<'a> {
    /// Per-head RMSNorm of Q and K before RoPE.
    pub qk_norm: Option<&'a QkNorm>,
    /// Local layers rotate with their own RoPE table when the step has one (Gemma).
    pub local_rope: bool,
    /// Multiply Q by the scale before attention (Gemma) rather than the scores.
    pub scale_q: bool,
    /// Per query head, a logit joining the softmax with no value (gpt-oss's sinks).
    pub sinks: Option<&'a [f32]>,
}

impl Attention {
    pub fn load(t: &mut LayerTensors) -> Result<Attention> {
        Ok(Attention {
            q: t.linear("attn_q")?,
            k: t.linear("attn_k")?,
            v: t.linear("attn_v")?,
            output: t.linear("attn_output")?,
        })
    }

    pub fn linears(&self) -> [&Linear; 4] {
        [&self.q, &self.k, &self.v, &self.output]
    }

    pub fn linears_mut(&mut self) -> [&mut Linear; 4] {
        [&mut self.q, &mut self.k, &mut self.v, &mut self.output]
    }

    /// Self-attention of `h` (the normed residual stream, [T, n_embd]): Q, K, V, RoPE, cached
    /// causal attention (through the sliding window on local layers), the output projection.
    /// In the last layer the rows logits do not need are dropped from both the output and `x`
    /// ([`Step::keep_output_rows`]).
    pub fn forward(&self, il: usize, s: &mut Step, h: &[f32], x: &mut Buf, o: AttnOpts) -> Buf {
        let cfg = s.cfg;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        // [T, n_head * head_dim], [T, n_head_kv * head_dim] twice.
        let [mut q, mut k, v] =
            Linear::forward_many("attn_qkv", [&self.q, &self.k, &self.v], h, &s.segs);
        if let Some(n) = o.qk_norm {
            rms_norm_inplace(&mut q, &n.q, cfg.rms_eps); // per head: rows of head_dim
            rms_norm_inplace(&mut k, &n.k, cfg.rms_eps);
            trace("Qcur_normed", Some(il), &q, nh * hd);
            trace("Kcur_normed", Some(il), &k, nkv * hd);
        }
        let local = cfg.is_swa_layer(il);
        let r = match (&s.rope_swa, local && o.local_rope) {
            (Some(r), true) => r,
            _ => &s.rope,
        };
        rope(r, &mut q, nh, hd);
        rope(r, &mut k, nkv, hd);
        let kq_scale = if o.scale_q {
            scale(&mut q, cfg.attn_scale);
            1.0
        } else {
            cfg.attn_scale
        };
        trace("Qcur", Some(il), &q, nh * hd);
        trace("Kcur", Some(il), &k, nkv * hd);
        trace("Vcur", Some(il), &v, nkv * hd);
        let window = if local { cfg.sliding_window } else { None };
        let how = Attend {
            scale: kq_scale,
            window,
            sinks: o.sinks,
        };
        let a = s.attend(il, &q, &k, &v, how);
        trace("kqv_out", Some(il), &a, nh * hd);
        let mut out = self.output.forward(&a, &s.segs);
        s.keep_output_rows(il, x, &mut out);
        out
    }
}

/// Per-head RMSNorm weights of Q and K.
#[derive(Clone, Debug)]
pub struct QkNorm {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
}

impl QkNorm {
    pub fn load(t: &mut LayerTensors) -> Result<QkNorm> {
        Ok(QkNorm {
            q: t.vector("attn_q_norm")?,
            k: t.vector("attn_k_norm")?,
        })
    }

    pub fn norms(&self) -> [(&'static str, &[f32]); 2] {
        [("attn_q_norm", &self.q), ("attn_k_norm", &self.k)]
    }
}

/// A gated feed-forward block's three projections: `down(act(gate x) * up x)`.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    pub fn load(t: &mut LayerTensors) -> Result<Mlp> {
        Ok(Mlp {
            gate: t.linear("ffn_gate")?,
            up: t.linear("ffn_up")?,
            down: t.linear("ffn_down")?,
        })
    }

    /// `down(SiLU(gate h) * up h)`.
    pub fn swiglu(&self, h: &[f32], segs: &[usize]) -> Buf {
        let [mut g, u] = Linear::forward_many("ffn_gate_up", [&self.gate, &self.up], h, segs);
        swiglu(&mut g, &u); // [T, n_ff]
        self.down.forward(&g, segs)
    }

    /// `down(GELU_tanh(gate h) * up h)`.
    pub fn geglu(&self, il: usize, h: &[f32], segs: &[usize]) -> Buf {
        let [mut g, u] = Linear::forward_many("ffn_gate_up", [&self.gate, &self.up], h, segs);
        geglu(&mut g, &u); // [T, n_ff]
        trace("ffn_geglu", Some(il), &g, self.gate.n_out);
        self.down.forward(&g, segs)
    }
}

/// A mixture of experts ([`super::config::MoeConfig`]): the router, `[n_embd] -> [n_expert]`, and
/// each expert's projections, stored one matrix per expert.
#[derive(Clone, Debug)]
pub struct Moe {
    pub router: Linear,
    pub experts: Vec<Mlp>,
}

/// A layer's SwiGLU feed-forward block: dense, or a mixture of experts ([`moe`]).
#[derive(Clone, Debug)]
pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

/// The tensors of a mixture of experts whose checkpoints name the router `router` and each
/// expert's projections `experts.{e}.{gate, up, down}` within the layer.
pub fn moe_tensors(router: &'static str, [gate, up, down]: [&'static str; 3]) -> [TensorSpec; 4] {
    [
        TensorSpec::matrix("ffn_gate_inp", router, dim::EMBD, dim::EXPERTS),
        TensorSpec::experts("ffn_gate_exps", gate, dim::EMBD, dim::FF_EXP),
        TensorSpec::experts("ffn_up_exps", up, dim::EMBD, dim::FF_EXP),
        TensorSpec::experts("ffn_down_exps", down, dim::FF_EXP, dim::EMBD),
    ]
}

impl Moe {
    /// The router and the experts ([`moe_tensors`]).
    pub fn load(t: &mut LayerTensors) -> Result<Moe> {
        let router = t.linear("ffn_gate_inp")?;
        let gate = t.experts("ffn_gate_exps")?;
        let up = t.experts("ffn_up_exps")?;
        let down = t.experts("ffn_down_exps")?;
        let experts = gate
            .into_iter()
            .zip(up)
            .zip(down)
            .map(|((gate, up), down)| Mlp { gate, up, down })
            .collect();
        Ok(Moe { router, experts })
    }

    /// The router's then each expert's projections.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut v = vec![&self.router];
        for m in &self.experts {
            v.extend([&m.gate, &m.up, &m.down]);
        }
        v
    }

    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = vec![&mut self.router];
        for m in &mut self.experts {
            v.extend([&mut m.gate, &mut m.up, &mut m.down]);
        }
        v
    }
}

impl Ffn {
    /// A mixture of experts when the model has one, else the dense block ([`MLP`]'s tensors).
    pub fn load(cfg: &Config, t: &mut LayerTensors) -> Result<Ffn> {
        match cfg.moe {
            None => Ok(Ffn::Dense(Mlp::load(t)?)),
            Some(_) => Ok(Ffn::Moe(Moe::load(t)?)),
        }
    }

    /// The block's output for `h` ([T, n_embd]).
    pub fn forward(&self, cfg: &Config, h: &[f32], segs: &[usize]) -> Buf {
        match self {
            Ffn::Dense(m) => m.swiglu(h, segs),
            Ffn::Moe(m) => {
                let mc = cfg.moe.expect("a mixture of experts has its config");
                moe::forward(m, &mc, h, cfg.n_embd, segs)
            }
        }
    }

    /// The projections: the dense block's, or the router's then each expert's.
    pub fn linears(&self) -> Vec<&Linear> {
        match self {
            Ffn::Dense(m) => vec![&m.gate, &m.up, &m.down],
            Ffn::Moe(moe) => moe.linears(),
        }
    }

    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Ffn::Dense(m) => vec![&mut m.gate, &mut m.up, &mut m.down],
            Ffn::Moe(moe) => moe.linears_mut(),
        }
    }
}
