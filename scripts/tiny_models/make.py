#!/usr/bin/env python3
"""Tiny random-weight models of every architecture ferrum runs, with PyTorch references.

For each architecture this builds a seeded 2-layer model with Hugging Face `transformers`
(hidden 32, 4 query heads over 2 KV heads of 16 dims, weights large enough that the logits are
far from flat), saves it as a Hugging Face folder (F32 safetensors), converts it to an F32 GGUF
with llama.cpp's own `convert_hf_to_gguf.py`, and records what PyTorch computes in float64 for a
few prompts: the prompt's token ids, a 16-token greedy continuation, and the top-5 next-token
probabilities at every position of prompt + continuation (one teacher-forced pass).
`crates/ferrum-llm/tests/tiny_models.rs` runs ferrum on both files against those figures.

The tokenizer is SmolLM2's (a real byte-level BPE), cut to its first VOCAB tokens (the special
tokens, the 256 byte symbols and the most frequent merges) and the merges that stay inside them,
so the embedding table stays small (each model is well under 1 MB). llama.cpp's converter names
the pre-tokenizer by hashing how a check text tokenizes; the cut vocabulary hashes differently,
so the wrapper below tells it the pre-tokenizer is SmolLM2's ("smollm"), which it is, and lets
Gemma 2's converter take a BPE tokenizer (it wants SentencePiece) as Gemma 3's already does.

Usage (needs torch, transformers, safetensors, numpy; the llama.cpp source tree that
scripts/llamacpp/build.sh unpacks):
    python3 scripts/tiny_models/make.py --out tests/models/tiny [--only qwen3 gemma2]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

VOCAB = 2048
PROMPTS = [
    ("The capital of France is", False),
    ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
     "went out every morning before dawn. One day he caught a fish that could speak, and "
     "it begged him to let it go.", False),
    ("Numbers 0123456789, symbols #$%&*, accents café naïve, emoji 🙂 and CJK 日本語. "
     "A longer tail of plain words follows so that the sequence runs well past the sliding "
     "window and past the original context of the scaled RoPE models: the quick brown fox "
     "jumps over the lazy dog, again and again, while the farmer counts his sheep one by "
     "one and the river keeps flowing to the sea without a pause.", False),
    ("What is the tallest mountain in the world?", True),
]
N_GREEDY = 16


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def build_tokenizer(smollm_gguf: Path, out: Path, gguf_py: Path):
    """SmolLM2's tokenizer cut to VOCAB tokens, as tokenizer.json + tokenizer_config.json."""
    sys.path.insert(0, str(gguf_py))
    import gguf  # noqa: E402

    r = gguf.GGUFReader(str(smollm_gguf))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = strings("tokenizer.ggml.merges")
    tf = r.fields["tokenizer.ggml.token_type"]
    types = [int(tf.parts[i][0]) for i in tf.data]
    tmpl_f = r.fields["tokenizer.chat_template"]
    template = bytes(tmpl_f.parts[tmpl_f.data[0]]).decode("utf-8")

    # The first VOCAB - 16 tokens, then the byte symbols of SmolLM2's vocabulary that fall after
    # them (every byte must stay encodable), then padding with the next tokens up to VOCAB.
    keep = tokens[:VOCAB - 16]
    byte_syms = set(bytes_to_unicode().values())
    keep += [t for t in tokens[VOCAB - 16:] if t in byte_syms]
    assert len(keep) <= VOCAB, "too many byte symbols past the cut"
    keep += [t for t in tokens[VOCAB - 16:] if t not in set(keep)][:VOCAB - len(keep)]
    assert len(keep) == VOCAB
    kept = set(keep)
    types = [types[tokens.index(t)] for t in keep]
    vocab = {t: i for i, t in enumerate(keep)}
    kept_merges = []
    for m in merges:
        a, b = m.split(" ", 1)
        if a in kept and b in kept and (a + b) in kept:
            kept_merges.append(m)
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(keep) if types[i] == 3
    ]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": True},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab, "merges": kept_merges,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = {
        "add_prefix_space": False,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "GPT2Tokenizer",
        "chat_template": template,
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                               "single_word", "special")}
            for a in added
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    log(f"tokenizer: {len(keep)} tokens, {len(kept_merges)} merges, {len(added)} special")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def architectures():
    """name -> (config class name, model class name, config kwargs)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=64,
                  max_position_embeddings=512, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(common, rope_theta=10000.0)),
        "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
            common, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(
            common, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})),
        "mistral_swa": ("MistralConfig", "MistralForCausalLM", dict(common, sliding_window=8)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(common, rope_theta=1000000.0)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(common, rope_theta=1000000.0)),
        "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
            common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
            common, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
            common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
            sliding_window=8, query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh")),
        # Gemma 3's five local layers to one global: llama.cpp hard-wires that pattern (the
        # converter drops layer_types), so the model has six layers.
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
            common, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16,
            rope_local_base_freq=10000.0, rope_theta=1000000.0)),
        # Phi-3's head size is hidden / heads (no head_dim key), so hidden is 64 here.
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
            {k: v for k, v in common.items() if k != "head_dim"}, hidden_size=64,
            rope_theta=10000.0, partial_rotary_factor=1.0, sliding_window=None)),
    }


def build(name, spec, out: Path, tok_dir: Path, llamacpp: Path, seed: int):
    import numpy as np
    import torch
    import transformers
    from transformers import AutoTokenizer

    cfg_cls, model_cls, kw = spec
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**kw)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    model.config._attn_implementation = "eager"
    # The plain per-expert loop (the grouped kernels take no float64).
    model.config._experts_implementation = "eager"
    # Weights large enough that the logits are not flat: unit-variance rows for projections,
    # embeddings of std 0.6 (the tied head then gives logits of std ~3), norm weights near 1 (Gemma's stored as w with 1 + w applied).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1]
                std = 0.6 if "embed" in pname else 1.0 / fan_in ** 0.5
                if "lm_head" in pname:
                    std *= 3.5  # an untied head: logits of std ~3.5, as the tied models
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in pname:
                base = 0.0 if name.startswith("gemma") else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    d = out / name
    if d.exists():
        shutil.rmtree(d)
    model.save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).symlink_to(os.path.relpath(tok_dir / f, d))
    gguf_path = out / f"{name}.f32.gguf"
    convert(d, gguf_path, llamacpp)

    tok = AutoTokenizer.from_pretrained(d)
    m64 = model.double()
    prompts = []
    for text, chat in PROMPTS:
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(text)["input_ids"]
        seq = list(ids)
        with torch.no_grad():
            for _ in range(N_GREEDY):
                logits = m64(torch.tensor([seq])).logits[0, -1]
                seq.append(int(torch.argmax(logits)))
            probs = torch.softmax(m64(torch.tensor([seq])).logits[0], dim=-1)
        top = []
        for row in probs:
            p, i = torch.topk(row, 5)
            top.append({"ids": [int(x) for x in i],
                        "probs": [float(f"{float(x):.7g}") for x in p]})
        tops = [t["probs"][0] for t in top]
        prompts.append({"text": text, "chat": chat, "prompt_ids": ids,
                        "greedy_ids": seq[len(ids):], "top": top})
        log(f"{name}: {len(ids)} prompt ids, top-1 prob min {min(tops):.3f} "
            f"median {float(np.median(tops)):.3f} max {max(tops):.3f}")
    ref = {"model": name, "architecture": model_cls, "transformers": transformers.__version__,
           "torch": torch.__version__, "seed": seed, "prompts": prompts}
    (out / f"{name}.json").write_text(json.dumps(ref, ensure_ascii=False, indent=None))
    sizes = {p.name: p.stat().st_size for p in [d / "model.safetensors", gguf_path]}
    log(f"{name}: {sizes}")


CONVERT_WRAPPER = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {gguf_py!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
# Gemma 2's converter insists on a SentencePiece tokenizer.model; ours is byte-level BPE, which
# its Gemma 3 sibling already takes through the GPT-2 path.
import conversion.gemma as gemma
gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outtype", "f32", "--outfile", {dst!r}]
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""


def convert(src: Path, dst: Path, llamacpp: Path):
    code = CONVERT_WRAPPER.format(root=str(llamacpp), gguf_py=str(llamacpp / "gguf-py"),
                                  src=str(src), dst=str(dst),
                                  script=str(llamacpp / "convert_hf_to_gguf.py"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert {src.name}: {r.stderr[-3000:]}")


# Quantized models are checked against llama.cpp (not PyTorch): a wider llama (rows of 256 and
# 512, so the 256-element K-quant and IQ4_XS blocks apply) quantized by llama-quantize, with
# llama-server's greedy continuations and top-5 probabilities as the reference.
QUANT_TYPES = ["Q8_0", "Q4_K_M", "IQ4_XS", "IQ4_NL"]


def build_quantized(out: Path, tok_dir: Path, llamacpp: Path, seed: int, bindir: Path):
    import tempfile
    spec = ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=512, max_position_embeddings=512,
        # Untied: with a tied head this wide, the input embedding dominates the logits and the
        # model only repeats its last token.
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        rope_theta=10000.0))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # The F32 model and its PyTorch reference stay in the scratch folder.
        shutil.copytree(tok_dir, tmp / "tokenizer")
        build("llama256", spec, tmp, tmp / "tokenizer", llamacpp, seed)
        for qt in QUANT_TYPES:
            dst = out / f"llama256.{qt.lower()}.gguf"
            subprocess.run([str(bindir / "llama-quantize"), str(tmp / "llama256.f32.gguf"),
                            str(dst), qt], check=True, capture_output=True)
            ref = out / f"llama256.{qt.lower()}.llamacpp.json"
            subprocess.run([sys.executable, str(Path(__file__).parent.parent / "llamacpp" /
                                                "make_reference.py"),
                            str(bindir / "llama-server"), str(dst), str(ref)], check=True)
            log(f"{dst.name}: {dst.stat().st_size} bytes, reference {ref.name}")


# The i-quants, ternary and Q3_K_M, requantized from llama256.q8_0.gguf (so no PyTorch is needed)
# by llama-quantize with an importance matrix (IQ1/IQ2 refuse to quantize without one) that
# llama-imatrix computes on a fixed text. Their references get 96 tokens per continuation: the
# coarser models fall into byte tokens sooner, which leaves fewer positions comparable.
IQUANT_TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0",
                "TQ2_0", "Q3_K_M"]



def build_iquants(out: Path, bindir: Path):
    import tempfile
    src = out / "llama256.q8_0.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = tmp / "calibration.txt"
        text.write_text("\n".join(p for p, _ in PROMPTS) * 40)
        imatrix = tmp / "imatrix.gguf"
        subprocess.run([str(bindir / "llama-imatrix"), "-m", str(src), "-f", str(text), "-o",
                        str(imatrix), "-c", "128", "--chunks", "20", "-t", "2"], check=True,
                       capture_output=True)
        for qt in IQUANT_TYPES:
            dst = out / f"llama256.{qt.lower()}.gguf"
            subprocess.run([str(bindir / "llama-quantize"), "--allow-requantize", "--imatrix",
                            str(imatrix), str(src), str(dst), qt], check=True,
                           capture_output=True)
            ref = out / f"llama256.{qt.lower()}.llamacpp.json"
            subprocess.run([sys.executable, str(Path(__file__).parent.parent / "llamacpp" /
                                                "make_reference.py"),
                            str(bindir / "llama-server"), str(dst), str(ref), "--n-predict",
                            "96"], check=True)
            log(f"{dst.name}: {dst.stat().st_size} bytes, reference {ref.name}")


# Every architecture quantized: the F32 GGUFs requantized to Q8_0 (rows of 32: no 256-element type
# fits them), with llama-server references. Qwen2's and Phi-3's tiny models do not load in
# llama.cpp (head_dim x heads != hidden; a BPE vocabulary under the phi3 name).
Q8_ARCHS = ["llama3", "qwen3", "qwen3moe", "mixtral", "gemma2", "gemma3"]


def build_q8_archs(out: Path, bindir: Path):
    for arch in Q8_ARCHS:
        dst = out / f"{arch}.q8_0.gguf"
        subprocess.run([str(bindir / "llama-quantize"), str(out / f"{arch}.f32.gguf"), str(dst),
                        "Q8_0"], check=True, capture_output=True)
        ref = out / f"{arch}.q8_0.llamacpp.json"
        subprocess.run([sys.executable, str(Path(__file__).parent.parent / "llamacpp" /
                                            "make_reference.py"),
                        str(bindir / "llama-server"), str(dst), str(ref)], check=True)
        log(f"{dst.name}: {dst.stat().st_size} bytes, reference {ref.name}")


def main():
    here = Path(__file__).resolve().parent
    root = here.parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=root / "tests/models/tiny",
                    help="output folder (default: tests/models/tiny)")
    ap.add_argument("--only", nargs="*", help="build only these architectures")
    ap.add_argument("--llamacpp", type=Path,
                    default=Path(os.environ.get(
                        "LLAMACPP_DIR",
                        "/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")),
                    help="llama.cpp source tree with convert_hf_to_gguf.py (env LLAMACPP_DIR)")
    ap.add_argument("--smollm2", type=Path, default=root / "models/SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="SmolLM2 GGUF whose tokenizer is cut down")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the random weights")
    ap.add_argument("--quantized", type=Path, metavar="BIN_DIR",
                    help="also build the quantized llama256 models and their llama.cpp "
                         "references with llama-quantize and llama-server from BIN_DIR")
    ap.add_argument("--iquants", type=Path, metavar="BIN_DIR",
                    help="only requantize llama256.q8_0.gguf to the i-quant and ternary types "
                         "and record their references, with llama-imatrix, llama-quantize and "
                         "llama-server from BIN_DIR")
    ap.add_argument("--q8-archs", type=Path, metavar="BIN_DIR",
                    help="only requantize the F32 GGUFs of " + ", ".join(Q8_ARCHS) + " to Q8_0 "
                         "and record their llama-server references")
    args = ap.parse_args()
    if args.q8_archs:
        build_q8_archs(args.out, args.q8_archs)
        return
    if args.iquants:
        build_iquants(args.out, args.iquants)
        return
    tok_dir = args.out / "tokenizer"
    build_tokenizer(args.smollm2, tok_dir, args.llamacpp / "gguf-py")
    if args.quantized:
        build_quantized(args.out, tok_dir, args.llamacpp, args.seed, args.quantized)
        if not args.only:
            return
    archs = architectures()
    for name in args.only or list(archs):
        build(name, archs[name], args.out, tok_dir, args.llamacpp, args.seed)


if __name__ == "__main__":
    main()
