"""The ONNX conformance suites through ferrum.InferenceSession: the shared runner
(../shared/tools/onnx_conformance.py) drives an engine that calls the Python API in-process
instead of `ferrum run`, and every test must end as it does for the CLI in the committed
baseline (tests/onnx/results.txt: pass, fail or error)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import onnx

import ferrum

from conftest import REPO, RUNNER


def _runner():
    spec = importlib.util.spec_from_file_location("onnx_conformance", RUNNER)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


class FerrumEngine:
    """The runner's engine interface (prepare, run) over ferrum.InferenceSession. Inputs are
    the numpy values onnx.numpy_helper reads (ml_dtypes arrays, lists for sequences, None for
    empty optionals), fed by name as with onnxruntime."""

    def __init__(self, runner):
        self.runner = runner
        self.options = ferrum.SessionOptions()
        self.options.intra_op_num_threads = 1

    def prepare(self, model_path, model):
        return ferrum.InferenceSession(model_path, self.options)

    def run(self, sess, model, ds_dir, inputs, test_name):
        ins = self.runner.real_inputs(model)
        feeds = {vi.name: v for vi, v in zip(ins, inputs)}
        return sess.run(None, feeds)


def test_conformance_matches_cli_baseline(onnx_cache):
    runner = _runner()
    data = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
    roots = [str(onnx_cache / "node"), str(onnx_cache / "light")] + [
        os.path.join(data, s) for s in ("simple", "pytorch-converted", "pytorch-operator")
    ]
    tests = runner.find_tests(roots)
    engine = FerrumEngine(runner)
    jobs = int(os.environ.get("ONNX_CONFORMANCE_JOBS", "2"))
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        recs = list(ex.map(lambda t: runner.run_one(t, engine, []), tests))
    now = {}
    for r in recs:
        suite = os.path.basename(r["suite"].rstrip("/"))
        now[f"{suite}/{r['test']}"] = (r["status"], r["reason"])
    baseline = {}
    with open(REPO / "tests" / "onnx" / "results.txt") as f:
        for line in f:
            k, st = line.rstrip("\n").split("\t")
            baseline[k] = st
    out = REPO / ".onnx-tests" / "results-python.jsonl"
    with open(out, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    counts = Counter(st for st, _ in now.values())
    print(f"through ferrum.InferenceSession: {dict(counts)} ({len(now)} tests; records in {out})")
    assert set(now) == set(baseline), (
        f"tests missing here: {sorted(set(baseline) - set(now))[:10]}, "
        f"not in the baseline: {sorted(set(now) - set(baseline))[:10]}"
    )
    differ = sorted(k for k in baseline if now[k][0] != baseline[k])
    detail = "\n".join(f"  {k}: CLI {baseline[k]}, Python {now[k][0]}: {now[k][1]}" for k in differ[:40])
    assert not differ, f"{len(differ)} tests end differently than through the CLI:\n{detail}"
