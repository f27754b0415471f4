#!/usr/bin/env python3
"""An independent check of `ferrum run --precision bf16` on the exported models: PyTorch computes
the same arithmetic (every group-1 Conv's and every Linear's weight and input rounded to bf16,
nearest even, the product in f32; BatchNorm folded into the Conv first, as ferrum's passes do) and
the script reports how far ferrum's bf16 outputs are from it, and how far both are from the float
model. A small first distance with a large second one says the error is bf16's, not ferrum's.

Usage (inside scripts/onnx_models.sh's venv, after it exported the models):
  .venv-models/bin/python scripts/bf16_reference.py FERRUM CACHE [MODELS]
MODELS: comma-separated, default resnet50,mobilenet_v2,bert_base (ViT-B/16 is left out:
torchvision's attention calls its projection weights directly, so no module hook sees their
inputs).
"""
import os
import subprocess
import sys
import tempfile

import numpy as np
import onnx
import torch
from onnx import numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tools"))
import make_onnx_models  # noqa: E402


def load_pb(path):
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def round_bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


def simulate(m):
    """Rounds the weights and inputs of the products ferrum runs in bf16."""
    for mod in m.modules():
        prepacked = isinstance(mod, torch.nn.Linear) or (
            isinstance(mod, torch.nn.Conv2d) and mod.groups == 1)
        if not prepacked:
            continue
        with torch.no_grad():
            mod.weight.copy_(round_bf16(mod.weight))
        mod.register_forward_pre_hook(lambda _, args: (round_bf16(args[0]),) + tuple(args[1:]))


def distance(got, ref):
    d = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    rms = np.sqrt((d ** 2).mean() / max((ref.astype(np.float64) ** 2).mean(), 1e-30))
    return float(d.max()), float(rms)


def main():
    ferrum, cache = sys.argv[1], sys.argv[2]
    names = (sys.argv[3] if len(sys.argv) > 3 else "resnet50,mobilenet_v2,bert_base").split(",")
    print("| model | output | ferrum bf16 vs PyTorch bf16: max abs / RMS rel | "
          "ferrum bf16 vs float | PyTorch bf16 vs float |")
    print("|---|---|---|---|---|")
    for name in names:
        m, inputs, _, out_names, _ = make_onnx_models.build(name)
        m.eval()
        if name != "bert_base":
            from torch.fx.experimental.optimization import fuse
            m = fuse(m)
        mod = make_onnx_models._Wrap(m) if name == "bert_base" else m
        simulate(m)
        with torch.no_grad():
            ref = mod(*inputs)
        ref = [r.numpy() for r in (ref if isinstance(ref, tuple) else (ref,))]
        d = os.path.join(cache, name)
        ds = os.path.join(d, "test_data_set_0")
        floats = [load_pb(os.path.join(ds, f"output_{j}.pb")) for j in range(len(ref))]
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([ferrum, "run", "--quiet", "--model", os.path.join(d, "model.onnx"),
                            "--inputs", ds, "--outputs", tmp, "--precision", "bf16"], check=True)
            ours = [load_pb(os.path.join(tmp, f"output_{j}.pb")) for j in range(len(ref))]
        for j, o in enumerate(out_names):
            a, b, c = distance(ours[j], ref[j]), distance(ours[j], floats[j]), \
                distance(ref[j], floats[j])
            print(f"| {name} | {o} | {a[0]:.3g} / {a[1]:.3g} | {b[0]:.3g} / {b[1]:.3g} | "
                  f"{c[0]:.3g} / {c[1]:.3g} |", flush=True)


if __name__ == "__main__":
    main()
