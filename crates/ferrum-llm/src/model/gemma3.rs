//! Gemma 3 (Gemma Team 2025, "Gemma 3 Technical Report") and Gemma 2 (Gemma Team 2024, "Gemma 2:
//! Improving Open Language Models at a Practical Size"). References: Hugging Face
//! `modeling_gemma3.py` / `modeling_gemma2.py`, llama.cpp `src/models/gemma3.cpp` / `gemma2.cpp`.
//!
//! x = embed(t) * sqrt(n_embd). Per layer (norm weights in GGUF already include Gemma's +1):
//!   h = RMSNorm(x) * attn_norm
//!   q, k, v = h Wq, h Wk, h Wv
//!   (Gemma 3) q = RMSNorm_head(q) * q_norm;  k = RMSNorm_head(k) * k_norm
//!   RoPE(q), RoPE(k)   (Gemma 3: base 10 000 on sliding-window layers, rope.freq_base on global ones)
//!   q = q / sqrt(query_pre_attn_scalar)     (d_head, except Gemma 2 27B)
//!   x = x + RMSNorm(Attention(q, k, v) Wo) * post_attention_norm
//!       (Gemma 2: scores soft-capped, s -> cap tanh(s / cap); local layers: each query sees the
//!       last `sliding_window` positions; every 6th layer (Gemma 3) or every 2nd (Gemma 2) is global)
//!   h = RMSNorm(x) * ffn_norm
//!   x = x + RMSNorm((GELU_tanh(h Wg) * (h Wu)) Wd) * post_ffw_norm

use super::weights::Weights;
use super::{add, geglu, rms_norm, rms_norm_inplace, rope, scale, trace, Step};
use ferrum_core::Buf;

pub fn forward(w: &Weights, s: &mut Step, x: &mut Buf) {
    let cfg = s.cfg;
    let (nh, nkv, hd, eps) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps);
    let e = cfg.n_embd;
    scale(x, (e as f32).sqrt());
    trace("inp_scaled", None, x, e);
    let q_scale = cfg.attn_scale;
    for (il, l) in w.layers.iter().enumerate() {
        let swa = cfg.is_swa_layer(il);
        let (Some(post_attn), Some(post_ffw)) = (&l.post_attention_norm, &l.post_ffw_norm) else {
            unreachable!("Weights::load requires Gemma's post-norms");
        };
        let h = rms_norm(x, &l.attn_norm, eps);
        trace("attn_norm", Some(il), &h, e);
        let mut q = l.attn_q.forward(&h, &s.segs); // [T, n_head * head_dim]
        let mut k = l.attn_k.forward(&h, &s.segs); // [T, n_head_kv * head_dim]
        let v = l.attn_v.forward(&h, &s.segs); // [T, n_head_kv * head_dim]
        if let (Some(q_norm), Some(k_norm)) = (&l.attn_q_norm, &l.attn_k_norm) {
            rms_norm_inplace(&mut q, q_norm, eps); // per head: rows of head_dim
            rms_norm_inplace(&mut k, k_norm, eps);
        }
        let r = match (&s.rope_swa, swa) {
            (Some(r), true) => r,
            _ => &s.rope,
        };
        rope(r, &mut q, nh, hd);
        rope(r, &mut k, nkv, hd);
        scale(&mut q, q_scale);
        trace("Qcur", Some(il), &q, nh * hd);
        trace("Kcur", Some(il), &k, nkv * hd);
        trace("Vcur", Some(il), &v, nkv * hd);
        let window = if swa { cfg.sliding_window } else { None };
        let a = s.attend(il, &q, &k, &v, 1.0, window);
        trace("kqv_out", Some(il), &a, nh * hd);
        let mut o = l.attn_output.forward(&a, &s.segs);
        s.keep_output_rows(il, x, &mut o);
        let o = rms_norm(&o, post_attn, eps);
        trace("attn_post_norm", Some(il), &o, e);
        add(x, &o);
        trace("ffn_inp", Some(il), x, e);

        let h = rms_norm(x, &l.ffn_norm, eps);
        trace("ffn_norm", Some(il), &h, e);
        let mlp = l.mlp();
        let mut g = mlp.gate.forward(&h, &s.segs); // [T, n_ff]
        geglu(&mut g, &mlp.up.forward(&h, &s.segs));
        trace("ffn_geglu", Some(il), &g, cfg.n_ff);
        let f = rms_norm(&mlp.down.forward(&g, &s.segs), post_ffw, eps);
        trace("ffn_post_norm", Some(il), &f, e);
        add(x, &f);
        trace("l_out", Some(il), x, e);
    }
}
