#!/usr/bin/env python3
"""Write a random-weight llama GGUF of a chosen size (F16), for speed comparisons of weight types
on one model shape: quantize it with llama.cpp's llama-quantize to each type and run
`ferrum bench` on the results. The tokenizer and its metadata are copied from a small GGUF
(default tests/models/tiny/llama256.q8_0.gguf); the weights are seeded Gaussian noise scaled
like an initialised model, so the outputs mean nothing: only the speed does.

Usage: scripts/synthetic_llama.py OUT.gguf [--hidden 1024] [--ff 2816] [--layers 16]
       [--heads 16] [--kv-heads 4] [--tokenizer-from tests/models/tiny/llama256.q8_0.gguf]
Needs the `gguf` and `numpy` packages.
"""
import argparse

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--tokenizer-from", default="tests/models/tiny/llama256.q8_0.gguf")
    a = ap.parse_args()
    src = GGUFReader(a.tokenizer_from)
    w = GGUFWriter(a.out, "llama")
    for name, field in src.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[1]
            vals = [field.parts[i] for i in field.data]
            if sub == GGUFValueType.STRING:
                vals = [bytes(v).decode("utf-8", errors="replace") for v in vals]
            else:
                vals = [v.tolist()[0] for v in vals]
            w.add_array(name, vals)
        elif vtype == GGUFValueType.STRING:
            w.add_string(name, bytes(field.parts[field.data[0]]).decode())
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    hd = a.hidden // a.heads
    w.add_name("synthetic")
    w.add_context_length(4096)
    w.add_embedding_length(a.hidden)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)
    rng = np.random.default_rng(7)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    w.add_tensor("token_embd.weight", mat(n_vocab, a.hidden))
    w.add_tensor("output_norm.weight", np.ones(a.hidden, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, a.hidden))
    kv = a.kv_heads * hd
    for i in range(a.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(a.hidden, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(a.hidden, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", mat(a.hidden, a.hidden))
        w.add_tensor(p + "attn_k.weight", mat(kv, a.hidden))
        w.add_tensor(p + "attn_v.weight", mat(kv, a.hidden))
        w.add_tensor(p + "attn_output.weight", mat(a.hidden, a.hidden))
        w.add_tensor(p + "ffn_gate.weight", mat(a.ff, a.hidden))
        w.add_tensor(p + "ffn_up.weight", mat(a.ff, a.hidden))
        w.add_tensor(p + "ffn_down.weight", mat(a.hidden, a.ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
