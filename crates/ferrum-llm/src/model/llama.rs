//! Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models"), also
//! SmolLM2, Mistral and, with Q/K/V biases, Qwen2. Reference: llama.cpp `src/models/llama.cpp`.
//!
//! Per layer, with x the residual stream [T, n_embd]:
//!   h = RMSNorm(x) * attn_norm
//!   q, k, v = h Wq (+bq), h Wk (+bk), h Wv (+bv);   RoPE(q), RoPE(k)
//!   x = x + Attention(q, k, v) Wo                   (softmax(q k^T / sqrt(d_head)) v, causal)
//!   h = RMSNorm(x) * ffn_norm
//!   x = x + (SiLU(h Wg) * (h Wu)) Wd

use super::weights::Weights;
use super::{add, rms_norm, rope, swiglu, trace, Step};
use ferrum_core::Buf;

pub fn forward(w: &Weights, s: &mut Step, x: &mut Buf) {
    let cfg = s.cfg;
    let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
    let kq_scale = 1.0 / (hd as f32).sqrt();
    for (il, l) in w.layers.iter().enumerate() {
        let e = cfg.n_embd;
        let h = rms_norm(x, &l.attn_norm, cfg.rms_eps);
        trace("attn_norm", Some(il), &h, e);
        let mut q = l.attn_q.forward(&h, &s.segs); // [T, n_head * head_dim]
        let mut k = l.attn_k.forward(&h, &s.segs); // [T, n_head_kv * head_dim]
        let v = l.attn_v.forward(&h, &s.segs); // [T, n_head_kv * head_dim]
        rope(&s.rope, &mut q, nh, hd);
        rope(&s.rope, &mut k, nkv, hd);
        trace("Qcur", Some(il), &q, nh * hd);
        trace("Kcur", Some(il), &k, nkv * hd);
        trace("Vcur", Some(il), &v, nkv * hd);
        let a = s.attend(il, &q, &k, &v, kq_scale, None);
        trace("kqv_out", Some(il), &a, nh * hd);
        let mut o = l.attn_output.forward(&a, &s.segs);
        s.keep_output_rows(il, x, &mut o);
        add(x, &o);
        trace("ffn_inp", Some(il), x, e);

        let h = rms_norm(x, &l.ffn_norm, cfg.rms_eps);
        trace("ffn_norm", Some(il), &h, e);
        let mut g = l.ffn_gate.forward(&h, &s.segs); // [T, n_ff]
        swiglu(&mut g, &l.ffn_up.forward(&h, &s.segs));
        trace("ffn_swiglu", Some(il), &g, cfg.n_ff);
        let f = l.ffn_down.forward(&g, &s.segs);
        trace("ffn_out", Some(il), &f, e);
        add(x, &f);
        trace("l_out", Some(il), x, e);
    }
}
