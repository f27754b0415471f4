#!/usr/bin/env python3
"""Differences and latency of `ferrum run` beside ONNX Runtime on the exported models
(scripts/onnx_models.sh calls this inside its venv).

Usage: onnx_models.py FERRUM CACHE MODELS [--repeat N] [--rounds R] [--threads 1,2]
                      [--precision f32|bf16]

For each model in CACHE/<name>/ (make_onnx_models.py's layout): ferrum's outputs on
test_data_set_0, compared with ONNX Runtime's (CPU, ORT_ENABLE_ALL) and with PyTorch's (the stored
output_J.pb): max |diff|, max |diff| / max |reference|, and the worst |diff| / (atol + rtol |ref|)
(the comparison passes when that is <= 1); then the median latency over N runs after one warm-up
at each thread count: ferrum from `ferrum run --repeat N --threads T` (model loading and file I/O
excluded), ONNX Runtime from session.run with intra_op_num_threads = T; with --rounds R the two
alternate R times and each figure is the median of its R medians. Prints a markdown table.
With --precision bf16, ferrum runs its opt-in bf16 products (`ferrum run --precision bf16`) and a
note per model gives their distance from PyTorch's float outputs (max |diff|, RMS relative, and
for a classifier's logits whether the top class agrees) beside ONNX Runtime's float one.
"""
import argparse
import json
import os
import re
import subprocess
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper


def load_pb(path):
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def diffs(got, ref, rtol, atol):
    worst_abs = worst_rel = worst_ratio = 0.0
    for g, r in zip(got, ref):
        g, r = g.astype(np.float64), r.astype(np.float64)
        d = np.abs(g - r)
        if np.isnan(d).any():
            return float("nan"), float("nan"), float("nan")
        worst_abs = max(worst_abs, float(d.max()))
        worst_rel = max(worst_rel, float(d.max() / max(np.abs(r).max(), 1e-30)))
        worst_ratio = max(worst_ratio, float((d / (atol + rtol * np.abs(r))).max()))
    return worst_abs, worst_rel, worst_ratio


def ferrum_time(ferrum, model, inputs, threads, repeat, precision):
    out = subprocess.run(
        [ferrum, "run", "--quiet", "--model", model, "--inputs", inputs,
         "--threads", str(threads), "--repeat", str(repeat), "--precision", precision],
        check=True, capture_output=True, text=True).stdout
    m = re.search(r"time: median ([0-9.]+) ms", out)
    c = re.search(r"session: ([0-9.]+) ms", out)
    return float(m.group(1)), float(c.group(1))


def ort_session(model, threads):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def ort_time(sess, feeds, repeat):
    sess.run(None, feeds)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        sess.run(None, feeds)
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ferrum")
    ap.add_argument("cache")
    ap.add_argument("models")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate ferrum and ONNX Runtime this many times per thread count "
                         "(--repeat runs each) and report the median of the rounds' medians, so "
                         "load that comes and goes on a shared host weighs on both")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    info = {}
    if os.path.exists(os.path.join(a.cache, "models.json")):
        info = json.load(open(os.path.join(a.cache, "models.json")))
    rows = []
    notes = []
    for name in a.models.split(","):
        d = os.path.join(a.cache, name)
        model = os.path.join(d, "model.onnx")
        ds = os.path.join(d, "test_data_set_0")
        tol = json.load(open(os.path.join(d, "data.json")))
        rtol, atol = tol.get("rtol", 1e-3), tol.get("atol", 1e-7)
        m = onnx.load(model, load_external_data=False)
        inits = {i.name for i in m.graph.initializer}
        ins = [v.name for v in m.graph.input if v.name not in inits]
        feeds = {n: load_pb(os.path.join(ds, f"input_{j}.pb")) for j, n in enumerate(ins)}
        n_out = len(m.graph.output)
        torch_out = [load_pb(os.path.join(ds, f"output_{j}.pb")) for j in range(n_out)]
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([a.ferrum, "run", "--quiet", "--model", model, "--inputs", ds,
                            "--outputs", tmp, "--precision", a.precision], check=True)
            ours = [load_pb(os.path.join(tmp, f"output_{j}.pb")) for j in range(n_out)]
        ort_out = ort_session(model, 2).run(None, feeds)
        vs_ort = diffs(ours, ort_out, rtol, atol)
        vs_torch = diffs(ours, torch_out, rtol, atol)
        ort_vs_torch = diffs(ort_out, torch_out, rtol, atol)
        passed = vs_torch[2] <= 1.0
        times = {}
        created = {}
        for t in threads:
            start = time.perf_counter()
            sess = ort_session(model, t)
            created["ort"] = (time.perf_counter() - start) * 1e3
            fr, orr = [], []
            for _ in range(max(1, a.rounds)):
                ft, created["ferrum"] = ferrum_time(a.ferrum, model, ds, t, a.repeat, a.precision)
                fr.append(ft)
                orr.append(ort_time(sess, feeds, a.repeat))
            times[("ferrum", t)] = float(np.median(fr))
            times[("ort", t)] = float(np.median(orr))
            del sess
        gflops = info.get(name, info.get(tol.get("quantized_from"), {})).get("gflops", float("nan"))
        def rms(got):
            return max(float(np.sqrt(((g.astype(np.float64) - r) ** 2).mean() /
                                     max((r.astype(np.float64) ** 2).mean(), 1e-30)))
                       for g, r in zip(got, torch_out))

        def top1(got):
            # Per row of a classifier's logits (batch x classes): the share whose top class
            # matches PyTorch's.
            r, g = torch_out[0], got[0]
            if r.ndim != 2 or r.shape[1] < 10:
                return "-"
            return f"{float((r.argmax(1) == g.argmax(1)).mean()):.2f}"
        if a.precision != "f32" and "quantized_from" not in tol:
            notes.append(f"{name} with ferrum's {a.precision} products: distance from PyTorch's "
                         f"float outputs, max |diff| / RMS relative / top-1 agreement: ferrum "
                         f"{vs_torch[0]:.4g} / {rms(ours):.4g} / {top1(ours)}, ONNX Runtime (f32) "
                         f"{ort_vs_torch[0]:.4g} / {rms(ort_out):.4g} / {top1(ort_out)}")
        if "quantized_from" in tol:
            notes.append(f"{name} ({tol.get('recipe', 'quantized')} of {tol['quantized_from']}): "
                         f"distance from the float model's PyTorch outputs, max |diff| / RMS "
                         f"relative: ferrum {vs_torch[0]:.4g} / {rms(ours):.4g}, ONNX Runtime "
                         f"{ort_vs_torch[0]:.4g} / {rms(ort_out):.4g}")
        rows.append((name, gflops, times, created, vs_ort, vs_torch, ort_vs_torch, passed, atol))
        print(f"{name}: done", flush=True)
    head = "| model | GFLOPs | " + " | ".join(
        f"ferrum {t}t ms | ORT {t}t ms" for t in threads) + \
        " | session ferrum / ORT ms | vs ORT max abs / rel | vs torch max abs / rel | worst diff/tol vs torch (ORT's) | atol | pass |"
    print()
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, gflops, times, created, vo, vt, ot, passed, atol in rows:
        cells = " | ".join(f"{times[('ferrum', t)]:.1f} | {times[('ort', t)]:.1f}" for t in threads)
        print(f"| {name} | {gflops:.2f} | {cells} | {created['ferrum']:.0f} / {created['ort']:.0f} | {vo[0]:.2e} / {vo[1]:.2e} | "
              f"{vt[0]:.2e} / {vt[1]:.2e} | {vt[2]:.3f} ({ot[2]:.3f}) | {atol:g} | "
              f"{'pass' if passed else 'FAIL'} |")
    for n in notes:
        print(f"\n{n}")
    print(f"\nferrum precision {a.precision}; onnxruntime {ort.__version__}, onnx {onnx.__version__}; "
          f"medians of {a.repeat} runs "
          + (f"(median of {a.rounds} alternated rounds) " if a.rounds > 1 else "")
          + "after one warm-up; rel = max |diff| / max |reference|; session = creating the session "
          "(load, import, graph passes; the last thread count's).")


if __name__ == "__main__":
    main()
