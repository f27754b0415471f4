#!/usr/bin/env python3
"""ferrum beside llama.cpp, same run: `ferrum bench` and `llama-bench` alternate per (model,
threads), and the table gives the median tokens/s of each and their ratio.

The kernel tier is chosen by --tier: `default` (the CPU's best), `avx2` (FERRUM_NO_AVX512=1,
compared with llama.cpp built for AVX2 only: `LLAMACPP_AVX2_ONLY=1 scripts/llamacpp/build.sh`)
or `portable` (FERRUM_FORCE_SCALAR=1, beside the same AVX2 llama.cpp for scale).

Usage: scripts/bench_vs_llamacpp.py [--tier avx2] [-p 512] [-n 128] [-t 1,2] [-r 3]
           [--models smollm2,gemma3,qwen2] [--ferrum target/release/ferrum] [--llamacpp DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
    "qwen2": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
LLAMACPP = pathlib.Path("/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")


def ferrum(binary: str, model: str, p: int, n: int, t: int, r: int, env: dict) -> dict:
    out = subprocess.run([binary, "bench", "-m", model, "-p", str(p), "-n", str(n), "-t", str(t),
                          "-r", str(r), "--json"], check=True, capture_output=True, text=True,
                         env=env).stdout
    return {row["test"]: statistics.median(row["samples_tokens_per_second"])
            for row in json.loads(out)}


def llamacpp(binary: pathlib.Path, model: str, p: int, n: int, t: int, r: int) -> dict:
    out = subprocess.run([str(binary), "-m", model, "-p", str(p), "-n", str(n), "-t", str(t),
                          "-r", str(r), "-o", "json"], check=True, capture_output=True,
                         text=True).stdout
    res = {}
    for row in json.loads(out):
        test = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        res[test] = statistics.median(row["samples_ts"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tier", choices=["default", "avx2", "portable"], default="default")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("-r", type=int, default=3, help="repetitions per figure")
    ap.add_argument("--models", default="smollm2,gemma3,qwen2")
    ap.add_argument("--ferrum", default=str(REPO / "target" / "release" / "ferrum"))
    ap.add_argument("--llamacpp", default=str(LLAMACPP),
                    help="llama.cpp source folder holding build/ and build-avx2/")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    a = ap.parse_args()

    env = dict(os.environ)
    build = "build"
    if a.tier == "avx2":
        env["FERRUM_NO_AVX512"] = "1"
        build = "build-avx2"
    elif a.tier == "portable":
        env["FERRUM_FORCE_SCALAR"] = "1"
        build = "build-avx2"
    bench = pathlib.Path(a.llamacpp) / build / "bin" / "llama-bench"
    if not bench.exists():
        print(f"{bench} not found: build it with "
              f"{'LLAMACPP_AVX2_ONLY=1 ' if build != 'build' else ''}scripts/llamacpp/build.sh",
              file=sys.stderr)
        return 2
    rows = []
    print(f"tier {a.tier}: ferrum {a.ferrum} vs {bench}  (median tokens/s of {a.r} runs)")
    print("| model | threads | test | ferrum | llama.cpp | ratio |")
    print("|---|---:|---|---:|---:|---:|")
    for key in a.models.split(","):
        path = REPO / "models" / MODELS.get(key, key)
        if not path.exists():
            print(f"| {key} | | | model {path} missing (scripts/fetch_models.py) | | |")
            continue
        for t in [int(x) for x in a.t.split(",")]:
            f = ferrum(a.ferrum, str(path), a.p, a.n, t, a.r, env)
            lc = llamacpp(bench, str(path), a.p, a.n, t, a.r)
            for test in f:
                if test in lc:
                    ratio = f[test] / lc[test]
                    rows.append({"model": key, "threads": t, "test": test, "ferrum": f[test],
                                 "llamacpp": lc[test], "ratio": ratio})
                    print(f"| {key} | {t} | {test} | {f[test]:.1f} | {lc[test]:.1f} | "
                          f"{ratio:.2f}x |", flush=True)
    if a.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
