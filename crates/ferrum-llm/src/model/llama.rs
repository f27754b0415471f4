//! Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models"), also
//! SmolLM2, Mistral, Mixtral (experts), Qwen2 (Q/K/V biases), Qwen3 (Q/K norms) and Qwen3-MoE.
//! References: llama.cpp `src/models/llama.cpp`, `qwen2.cpp`, `qwen3.cpp`, `qwen3moe.cpp`.
//!
//! Per layer, with x the residual stream [T, n_embd]:
//!   h = RMSNorm(x) * attn_norm
//!   q, k, v = h Wq (+bq), h Wk (+bk), h Wv (+bv)
//!   (Qwen3) q = RMSNorm_head(q) * q_norm;  k = RMSNorm_head(k) * k_norm
//!   RoPE(q), RoPE(k)                                (scaled as the model asks: Llama 3.1 factors, ...)
//!   x = x + Attention(q, k, v) Wo                   (softmax(q k^T / sqrt(d_head)) v, causal)
//!   h = RMSNorm(x) * ffn_norm
//!   x = x + (SiLU(h Wg) * (h Wu)) Wd                (or a mixture of such experts: [`super::moe`])

use super::weights::Weights;
use super::{add, feed_forward_swiglu, rms_norm, rms_norm_inplace, rope, trace, Step};
use ferrum_core::Buf;

pub fn forward(w: &Weights, s: &mut Step, x: &mut Buf) {
    let cfg = s.cfg;
    let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
    let kq_scale = cfg.attn_scale;
    for (il, l) in w.layers.iter().enumerate() {
        let e = cfg.n_embd;
        let h = rms_norm(x, &l.attn_norm, cfg.rms_eps);
        trace("attn_norm", Some(il), &h, e);
        let mut q = l.attn_q.forward(&h, &s.segs); // [T, n_head * head_dim]
        let mut k = l.attn_k.forward(&h, &s.segs); // [T, n_head_kv * head_dim]
        let v = l.attn_v.forward(&h, &s.segs); // [T, n_head_kv * head_dim]
        if let (Some(qn), Some(kn)) = (&l.attn_q_norm, &l.attn_k_norm) {
            rms_norm_inplace(&mut q, qn, cfg.rms_eps); // per head: rows of head_dim
            rms_norm_inplace(&mut k, kn, cfg.rms_eps);
            trace("Qcur_normed", Some(il), &q, nh * hd);
            trace("Kcur_normed", Some(il), &k, nkv * hd);
        }
        rope(&s.rope, &mut q, nh, hd);
        rope(&s.rope, &mut k, nkv, hd);
        trace("Qcur", Some(il), &q, nh * hd);
        trace("Kcur", Some(il), &k, nkv * hd);
        trace("Vcur", Some(il), &v, nkv * hd);
        let window = if cfg.is_swa_layer(il) {
            cfg.sliding_window
        } else {
            None
        };
        let a = s.attend(il, &q, &k, &v, kq_scale, window);
        trace("kqv_out", Some(il), &a, nh * hd);
        let mut o = l.attn_output.forward(&a, &s.segs);
        s.keep_output_rows(il, x, &mut o);
        add(x, &o);
        trace("ffn_inp", Some(il), x, e);

        let h = rms_norm(x, &l.ffn_norm, cfg.rms_eps);
        trace("ffn_norm", Some(il), &h, e);
        let f = feed_forward_swiglu(&l.ffn, cfg, &h, &s.segs);
        trace("ffn_out", Some(il), &f, e);
        add(x, &f);
        trace("l_out", Some(il), x, e);
    }
}
