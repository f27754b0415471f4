"""The Python package's overhead over the CLI, measured in one run:

1. ONNX: `InferenceSession.run` on MobileNetV2 against `ferrum run --repeat N` on the same
   model and input (median of N timed runs each, after a warm-up; model loading excluded in
   both). The two alternate for --rounds rounds; the figure is the median of the per-round
   ratios (pairs taken back to back, so a busy machine's drift cancels), beside the medians.
2. LLM: `LLM.generate` against `ferrum bench` on SmolLM2: B sequences with P-token prompts
   (the same pseudo-random tokens `ferrum bench` uses) decoding N tokens, greedy with
   ignore_eos. B=1 is compared with `ferrum bench -p 0 -n N` (tgN: decode tokens/s), B>1 with
   `ferrum bench --batch B -p P -n N` (prompt + decode tokens over their total time, and
   decode tokens/s, from the time after the last first token).

Both sides must come from the same build (profile and source): pass the `ferrum` binary built
with the extension (e.g. target/release/ferrum next to `maturin develop --release`).

Usage: python overhead.py --ferrum-bin target/release/ferrum [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import ferrum

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
# Timed runs per measurement on both sides (`ferrum bench -r`), after a warm-up.
REPS = 3


def cli_onnx_ms(binary: str, model: str, npy: str, threads: int, repeat: int) -> float:
    out = subprocess.run(
        [binary, "run", "--model", model, "--input", f"input={npy}", "--threads", str(threads),
         "--repeat", str(repeat), "--quiet"],
        check=True, capture_output=True, text=True,
    ).stdout
    m = re.search(r"median ([0-9.]+) ms", out)
    assert m, out
    return float(m.group(1))


def py_onnx_ms(sess: "ferrum.InferenceSession", x: np.ndarray, repeat: int) -> float:
    sess.run(None, {"input": x})
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, {"input": x})
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def bench_tokens(n: int, n_vocab: int, bos) -> list:
    """`ferrum bench`'s token sequence (crates/ferrum-cli/src/cmd/bench.rs: xorshift64, BOS first
    when the model adds one)."""
    state = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    v = []
    for _ in range(n):
        state ^= (state << 13) & mask
        state ^= state >> 7
        state ^= (state << 17) & mask
        v.append(state % n_vocab)
    if v and bos is not None:
        v[0] = bos
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ferrum-bin", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20, help="timed ONNX runs per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--skip-onnx", action="store_true")
    ap.add_argument("--skip-llm", action="store_true")
    a = ap.parse_args()
    results = {}

    if not a.skip_onnx:
        with tempfile.TemporaryDirectory() as d:
            model = os.path.join(d, "mobilenet_v2.onnx")
            subprocess.run([sys.executable, str(HERE / "mobilenet_v2.py"), model], check=True)
            x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
            npy = os.path.join(d, "x.npy")
            np.save(npy, x)
            so = ferrum.SessionOptions()
            so.intra_op_num_threads = a.threads
            sess = ferrum.InferenceSession(model, so)
            cli, py = [], []
            for r in range(a.rounds):
                cli.append(cli_onnx_ms(a.ferrum_bin, model, npy, a.threads, a.repeat))
                py.append(py_onnx_ms(sess, x, a.repeat))
                print(f"onnx round {r}: ferrum run {cli[-1]:.3f} ms, InferenceSession.run {py[-1]:.3f} ms",
                      flush=True)
            c, p = statistics.median(cli), statistics.median(py)
            ratio = statistics.median(y / x for x, y in zip(cli, py))
            results["onnx_mobilenet_v2"] = {"cli_ms": c, "python_ms": p, "overhead": ratio - 1,
                                            "rounds_cli": cli, "rounds_python": py}
            print(f"MobileNetV2, {a.threads} threads: ferrum run --repeat {a.repeat}: median {c:.3f} ms, "
                  f"InferenceSession.run: median {p:.3f} ms; paired ratio {100 * (ratio - 1):+.2f}%")

    if not a.skip_llm:
        llm = ferrum.LLM(a.model, n_threads=a.threads, max_num_batched_tokens=512,
                         enable_prefix_caching=False)
        tok = llm.get_tokenizer()
        for b in [int(s) for s in a.batch.split(",")]:
            pp = a.p if b > 1 else 1
            seqs = bench_tokens(pp + a.n + b, tok.vocab_size, tok.bos_token_id)
            prompts = [{"prompt_token_ids": seqs[i:i + pp]} for i in range(b)]
            params = ferrum.SamplingParams(temperature=0, max_tokens=a.n, ignore_eos=True)
            llm.generate(prompts, params)  # warm-up
            cli, py, py_tg, cli_tg = [], [], [], []
            for r in range(a.rounds):
                if b == 1:
                    out = subprocess.run(
                        [a.ferrum_bin, "bench", "-m", a.model, "-p", "0", "-n", str(a.n), "-t",
                         str(a.threads), "-r", str(REPS), "--json"],
                        check=True, capture_output=True, text=True).stdout
                    row = json.loads(out)[0]
                    cli_tg.append(row["tokens_per_second"])
                    cli.append(row["tokens_per_second"])
                else:
                    out = subprocess.run(
                        [a.ferrum_bin, "bench", "-m", a.model, "--batch", str(b), "-p", str(pp),
                         "-n", str(a.n), "-t", str(a.threads), "-r", str(REPS), "--json"],
                        check=True, capture_output=True, text=True).stdout
                    row = json.loads(out)[0]
                    cli.append(row["speed"])
                    cli_tg.append(row["speed_tg"])
                # The same statistic as `ferrum bench -r REPS`: the median of REPS timed runs.
                totals, tgs = [], []
                for _ in range(REPS):
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    total = time.perf_counter() - t0
                    assert all(len(o.outputs[0].token_ids) == a.n for o in outs)
                    first = max(o.metrics["time_to_first_token"] for o in outs)
                    # After the last first token, every sequence decodes its other n - 1 tokens.
                    totals.append(total)
                    tgs.append(b * (a.n - 1) / (total - first))
                tg = statistics.median(tgs)
                py_tg.append(tg)
                py.append(b * (pp + a.n) / statistics.median(totals) if b > 1 else tg)
                print(f"llm B={b} round {r}: ferrum bench {cli[-1]:.1f} t/s (tg {cli_tg[-1]:.1f}), "
                      f"LLM.generate {py[-1]:.1f} t/s (tg {tg:.1f})", flush=True)
            c, p = statistics.median(cli), statistics.median(py)
            ct, pt = statistics.median(cli_tg), statistics.median(py_tg)
            ratio = statistics.median(y / x for x, y in zip(cli, py))
            ratio_tg = statistics.median(y / x for x, y in zip(cli_tg, py_tg))
            results[f"llm_batch{b}"] = {"cli_tokens_per_second": c, "python_tokens_per_second": p,
                                        "difference": ratio - 1, "cli_tg": ct, "python_tg": pt,
                                        "tg_difference": ratio_tg - 1, "rounds_cli": cli,
                                        "rounds_python": py}
            what = f"tg{a.n}" if b == 1 else f"B={b} pp{pp}+tg{a.n} (all tokens / total time)"
            print(f"SmolLM2 {what}, {a.threads} threads: ferrum bench median {c:.1f} t/s, "
                  f"LLM.generate median {p:.1f} t/s, paired ratio {100 * (ratio - 1):+.2f}%; "
                  f"decode only: {ct:.1f} vs {pt:.1f} t/s, paired {100 * (ratio_tg - 1):+.2f}%")
        llm.shutdown()
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
