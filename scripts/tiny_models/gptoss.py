#!/usr/bin/env python3
"""A tiny random-weight gpt-oss model (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card") as
GGUF, written directly with the `gguf` package (no PyTorch needed), and its llama.cpp references.

gpt-oss as llama.cpp runs it (`src/models/openai-moe.cpp`): Q/K/V/O projections with biases,
learned per-head attention sinks, every other layer local (sliding window), YaRN RoPE (NeoX
style), a mixture of experts with a biased router whose top-k logits are softmaxed
(SOFTMAX_WEIGHT gating), biased expert projections, and the clamped SwiGLU
(x = min(g, 7), y = clamp(u, -7, 7), x * sigmoid(1.702 x) * (y + 1)). The tokenizer (2048
tokens) is copied from the tiny Llama model.

Writes tests/models/tiny/gptoss.f32.gguf and, with llama.cpp's tools from BIN_DIR,
gptoss.mxfp4.gguf (experts in MXFP4, as the published checkpoints) and a llama-server
reference for each (`*.llamacpp.json`).

Usage: python3 scripts/tiny_models/gptoss.py BIN_DIR
"""
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "models" / "tiny"
ARCH = "gpt-oss"
N_EMBD, N_HEAD, N_KV, HEAD_DIM, N_FF, N_EXPERT, N_USED, N_LAYER = 64, 4, 2, 32, 64, 8, 2, 2
SEED = 1234


def main():
    bindir = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    rng = np.random.default_rng(SEED)
    src = gguf.GGUFReader(TINY / "llama.f32.gguf")
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].contents())

    out = TINY / "gptoss.f32.gguf"
    w = gguf.GGUFWriter(out, ARCH)
    w.add_name("tiny gpt-oss")
    w.add_block_count(N_LAYER)
    w.add_context_length(512)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_expert_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_USED)
    w.add_sliding_window(8)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        v = field.contents()
        t = field.types
        if t[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, v) if t[1] == gguf.GGUFValueType.STRING else \
                w.add_key_value(key, v, t[0], sub_type=t[1])
        else:
            w.add_key_value(key, v, t[0])

    def tensor(name, *shape, scale=0.1, offset=0.0):
        # numpy shape is outermost-first: a GGUF [n_in, n_out] matrix is (n_out, n_in).
        w.add_tensor(name, (offset + scale * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", n_vocab, N_EMBD, scale=0.5)
    tensor("output_norm.weight", N_EMBD, scale=0.1, offset=1.0)
    tensor("output.weight", n_vocab, N_EMBD, scale=0.3)
    q, kv = N_HEAD * HEAD_DIM, N_KV * HEAD_DIM
    for il in range(N_LAYER):
        p = f"blk.{il}"
        tensor(f"{p}.attn_norm.weight", N_EMBD, offset=1.0)
        tensor(f"{p}.post_attention_norm.weight", N_EMBD, offset=1.0)
        tensor(f"{p}.attn_q.weight", q, N_EMBD, scale=0.25)
        tensor(f"{p}.attn_q.bias", q)
        tensor(f"{p}.attn_k.weight", kv, N_EMBD, scale=0.25)
        tensor(f"{p}.attn_k.bias", kv)
        tensor(f"{p}.attn_v.weight", kv, N_EMBD, scale=0.25)
        tensor(f"{p}.attn_v.bias", kv)
        tensor(f"{p}.attn_output.weight", N_EMBD, q, scale=0.15)
        tensor(f"{p}.attn_output.bias", N_EMBD)
        tensor(f"{p}.attn_sinks.weight", N_HEAD, scale=1.0)
        tensor(f"{p}.ffn_gate_inp.weight", N_EXPERT, N_EMBD, scale=0.3)
        tensor(f"{p}.ffn_gate_inp.bias", N_EXPERT)
        # Large enough that the clamps at +-7 bite on some rows.
        tensor(f"{p}.ffn_gate_exps.weight", N_EXPERT, N_FF, N_EMBD, scale=0.6)
        tensor(f"{p}.ffn_gate_exps.bias", N_EXPERT, N_FF)
        tensor(f"{p}.ffn_up_exps.weight", N_EXPERT, N_FF, N_EMBD, scale=0.6)
        tensor(f"{p}.ffn_up_exps.bias", N_EXPERT, N_FF)
        tensor(f"{p}.ffn_down_exps.weight", N_EXPERT, N_EMBD, N_FF, scale=0.1)
        tensor(f"{p}.ffn_down_exps.bias", N_EXPERT, N_EMBD)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out.name}: {out.stat().st_size} bytes")
    if bindir is None:
        return
    mx = TINY / "gptoss.mxfp4.gguf"
    subprocess.run([str(bindir / "llama-quantize"), str(out), str(mx), "MXFP4_MOE"], check=True,
                   capture_output=True)
    print(f"{mx.name}: {mx.stat().st_size} bytes")
    for m in (out, mx):
        ref = TINY / (m.name[: -len(".gguf")] + ".llamacpp.json")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "llamacpp" / "make_reference.py"),
                        str(bindir / "llama-server"), str(m), str(ref), "--ignore-eos"], check=True)
        print(f"{ref.name} written")


if __name__ == "__main__":
    main()
