#!/usr/bin/env python3
"""Record llama.cpp's reference outputs for a GGUF model, in the layout of ../shared/reference/llm-*.json.

Starts the reference `llama-server` (built by scripts/llamacpp/build.sh) on the model, and for each
prompt records: its token ids (with and without special tokens, and the pieces), the server's
greedy continuation of 48 tokens (`--n-predict`) (`/completion`, temperature 0, no prompt cache) with the top-5
log-probabilities at every step (the server's pre-sampling softmax over the full logits), and the
text. Writes one JSON file that ferrum's llama.cpp reference tests read.

Usage: scripts/llamacpp/make_reference.py LLAMA_SERVER MODEL.gguf OUT.json [--port 8199] [--n-predict 48]
       [--server-args '-ctk q8_0 -ctv q8_0'] [--ignore-eos]
Standard library only.
"""
import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
import urllib.request

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    "The quick brown fox",
    "In machine learning, a transformer is",
]
N_PREDICT = 48
SETTINGS = {"ctx": 4096, "parallel": 4, "threads": 2}
REQUEST = {"endpoint": "/completion", "temperature": 0, "n_predict": N_PREDICT, "n_probs": 5,
           "cache_prompt": False, "return_tokens": True}


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("server")
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("--n-predict", type=int, default=N_PREDICT,
                    help=f"tokens per continuation (default {N_PREDICT}); more for models whose "
                         "byte tokens leave fewer positions comparable")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="continue past end-of-generation tokens (random-weight models draw them, "
                         "and this llama-server then returns no probabilities)")
    ap.add_argument("--server-args", default="",
                    help="extra llama-server flags, one string (e.g. '-ctk q8_0 -ctv q8_0')")
    a = ap.parse_args()
    extra = a.server_args.split()
    proc = subprocess.Popen([a.server, "-m", a.model, "--port", str(a.port), "-c", str(SETTINGS["ctx"]),
                             "-np", str(SETTINGS["parallel"]), "-t", str(SETTINGS["threads"])] + extra,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() > deadline or proc.poll() is not None:
                sys.exit("llama-server did not come up")
            time.sleep(0.2)
        completions = []
        for p in PROMPTS:
            tok = lambda special: post(a.port, "/tokenize", {"content": p, "add_special": special,
                                                             "with_pieces": True})["tokens"]
            plain, special = tok(False), tok(True)
            body = {k: v for k, v in REQUEST.items() if k != "endpoint"}
            body["n_predict"] = a.n_predict
            if a.ignore_eos:
                body["ignore_eos"] = True
            body["prompt"] = p
            r = post(a.port, "/completion", body)
            steps = []
            for s in r["completion_probabilities"]:
                steps.append({
                    "id": s["id"], "token": s["token"], "logprob": s["logprob"],
                    "top5": [{"id": t["id"], "token": t["token"], "logprob": t["logprob"],
                              "prob": math.exp(t["logprob"])} for t in s["top_logprobs"]],
                })
            completions.append({
                "prompt": p,
                "prompt_tokens_add_special_false": [t["id"] for t in plain],
                "prompt_pieces": [t["piece"] for t in plain],
                "prompt_tokens_add_special_true": [t["id"] for t in special],
                "prompt_tokens_used_by_server": [t["id"] for t in special],
                "tokens_evaluated": r["tokens_evaluated"],
                "tokens": r["tokens"],
                "text": r["content"],
                "stop_type": r["stop_type"],
                "top_probs": steps,
            })
            print(f"{p!r}: {r['content'][:60]!r}", flush=True)
        props = json.load(urllib.request.urlopen(f"http://127.0.0.1:{a.port}/props", timeout=10))
        out = {
            "model_file": a.model.rsplit("/", 1)[-1],
            "model_sha256": sha256_of(a.model),
            "llama_cpp_commit": props.get("build_info", "?"),
            "server_settings": {**SETTINGS, "extra_args": extra},
            "request": {**REQUEST, "n_predict": a.n_predict},
            "probs_note": "top_probs are the server's pre-sampling top-5 (softmax over full logits); "
                          "prob = exp(logprob) as returned by the server",
            "completions": completions,
            "note": "Reference outputs of llama.cpp (CPU) made by scripts/llamacpp/make_reference.py: "
                    "greedy continuations of raw prompts with per-step top-5 probabilities.",
        }
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
            f.write("\n")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
