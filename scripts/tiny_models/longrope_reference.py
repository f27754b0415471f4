#!/usr/bin/env python3
"""LongRoPE reference for the tiny Phi-3 model, in float64 numpy (no torch needed).

The forward pass is written from Hugging Face's `modeling_phi3.py` and its LongRoPE parameters
(`_compute_longrope_parameters`): inverse frequencies 1 / (factor_i * base^(2i/d)), cos/sin
multiplied by the attention factor sqrt(1 + ln(s) / ln(original)), s = max positions / original.
It is first checked against the PyTorch reference of the plain model (tests/models/tiny/phi3.json,
every top-5 probability within 1e-5; PyTorch computes the RoPE frequencies in f32), then run with the short and the long factor sets of
`tiny_models.rs::phi3_longrope_both_formats` on the same prompts and continuations; the result is
tests/models/tiny/phi3-longrope.json.

Usage: python3 scripts/tiny_models/longrope_reference.py
"""
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "models" / "tiny"

# The factor sets and lengths the Rust test uses.
SHORT = [1.0 + 0.25 * i for i in range(8)]
LONG = [2.0 + 3.0 * i for i in range(8)]
MAX_POS, ORIG = 2048, 256


def load_safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32", (name, e["dtype"])
        a, b = e["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype="<f4").reshape(e["shape"]).astype(np.float64)
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def forward(w, cfg, ids, factors, attn_factor):
    """Logits [T, vocab] of the causal model over `ids`."""
    e, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or e // nh
    eps, base = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    inv = 1.0 / (np.array(factors, dtype=np.float64) * base ** (np.arange(0, hd, 2) / hd))
    ang = np.outer(np.arange(t), inv)
    ang = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(ang) * attn_factor, np.sin(ang) * attn_factor
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for il in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{il}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        qkv = h @ w[p + "self_attn.qkv_proj.weight"].T
        q = qkv[:, : nh * hd].reshape(t, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(t, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(t, nkv, hd)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        g = nh // nkv
        out = np.zeros((t, nh, hd))
        for hh in range(nh):
            s = q[:, hh] @ k[:, hh // g].T / math.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            out[:, hh] = s @ v[:, hh // g]
        x = x + out.reshape(t, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gu = h @ w[p + "mlp.gate_up_proj.weight"].T
        gate, up = gu[:, : gu.shape[1] // 2], gu[:, gu.shape[1] // 2 :]
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def softmax(z):
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def main():
    cfg = json.loads((TINY / "phi3" / "config.json").read_text())
    w = load_safetensors(TINY / "phi3" / "model.safetensors")
    ref = json.loads((TINY / "phi3.json").read_text())
    worst = 0.0
    for pr in ref["prompts"]:
        ids = pr["prompt_ids"] + pr["greedy_ids"]
        probs = softmax(forward(w, cfg, ids, [1.0] * 8, 1.0))
        for pos, top in enumerate(pr["top"]):
            for i, p in zip(top["ids"], top["probs"]):
                worst = max(worst, abs(probs[pos, i] - p))
    print(f"plain model against PyTorch: worst |dp| {worst:.2e}")
    if worst > 1e-5:
        sys.exit("the numpy forward pass does not match PyTorch's")

    s = MAX_POS / ORIG
    attn = math.sqrt(1.0 + math.log(s) / math.log(ORIG))
    out = {
        "model": "phi3 + LongRoPE",
        "short_factor": SHORT,
        "long_factor": LONG,
        "max_position_embeddings": MAX_POS,
        "original_max_position_embeddings": ORIG,
        "attention_factor": attn,
        "prompts": [],
    }
    for pr in ref["prompts"]:
        ids = pr["prompt_ids"] + pr["greedy_ids"]
        entry = {"ids": ids}
        for name, ff in (("short", SHORT), ("long", LONG)):
            probs = softmax(forward(w, cfg, ids, ff, attn))
            entry[name] = [
                {"ids": [int(i) for i in np.argsort(-row)[:5]],
                 "probs": [round(float(row[i]), 9) for i in np.argsort(-row)[:5]]}
                for row in probs
            ]
        out["prompts"].append(entry)
    (TINY / "phi3-longrope.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {TINY / 'phi3-longrope.json'} ({len(out['prompts'])} prompts)")


if __name__ == "__main__":
    main()
