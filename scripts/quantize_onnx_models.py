#!/usr/bin/env python3
"""Int8 versions of the exported models, made with onnxruntime.quantization (scripts/onnx_models.sh
calls this inside its venv).

Usage: quantize_onnx_models.py CACHE NAME...

NAME is <float model>_int8: `bert_base_int8` is `quantize_dynamic(bert_base, weight_type=QInt8)`
(per-tensor weights; activations quantized at run time by DynamicQuantizeLinear), what a user of
ONNX Runtime's dynamic quantization for transformers gets. The CNNs (`resnet50_int8`,
`mobilenet_v2_int8`) are `quantize_static` in QDQ format, as ONNX Runtime recommends for x86:
unsigned 8-bit activations, signed 8-bit weights per output channel, MinMax calibration over
the test input and 15 seeded N(0, 1) images (the exporter's inputs are normalised images of
that scale), after `quant_pre_process` (shape inference and ORT's basic optimisations). Writes CACHE/NAME/ in the float
model's layout: model.onnx, test_data_set_0 (the float model's inputs and PyTorch's float
outputs), and data.json with a tolerance derived from ONNX Runtime's own distance to the float
outputs: atol = 1.5 x ORT's max |int8 - float|, so the conformance runner passes an engine whose
int8 outputs stay about as close to the float model as ORT's do (onnx_models.py prints both).
"""
import json
import os
import shutil
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                      QuantType, quantize_dynamic, quantize_static)
from onnxruntime.quantization.shape_inference import quant_pre_process

STATIC = {"resnet50_int8", "mobilenet_v2_int8"}


class Images(CalibrationDataReader):
    """The test input, then seeded N(0, 1) batches of its shape."""

    def __init__(self, name, first, count=15):
        rng = np.random.default_rng(20261125)
        self.feeds = iter([{name: first}] + [
            {name: rng.standard_normal(first.shape).astype(np.float32)} for _ in range(count)])

    def get_next(self):
        return next(self.feeds, None)


def quantize_static_qdq(src_model, dst_model, feeds):
    pre = dst_model + ".pre.onnx"
    quant_pre_process(src_model, pre, skip_symbolic_shape=True)
    (name, first), = feeds.items()
    quantize_static(pre, dst_model, Images(name, first), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    per_channel=True, calibrate_method=CalibrationMethod.MinMax)
    os.remove(pre)


def load_pb(path):
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def main():
    cache, names = sys.argv[1], sys.argv[2:]
    for name in names:
        if not name.endswith("_int8"):
            sys.exit(f"{name}: only <model>_int8 names are made here")
        src = os.path.join(cache, name[: -len("_int8")])
        dst = os.path.join(cache, name)
        if not os.path.exists(os.path.join(src, "model.onnx")):
            sys.exit(f"{name}: export {os.path.basename(src)} first")
        if name != "bert_base_int8" and name not in STATIC:
            sys.exit(f"{name}: no quantization recipe")
        os.makedirs(dst, exist_ok=True)
        shutil.copytree(os.path.join(src, "test_data_set_0"), os.path.join(dst, "test_data_set_0"),
                        dirs_exist_ok=True)
        m = onnx.load(os.path.join(src, "model.onnx"))
        inits = {i.name for i in m.graph.initializer}
        ins = [v.name for v in m.graph.input if v.name not in inits]
        ds = os.path.join(dst, "test_data_set_0")
        feeds = {n: load_pb(os.path.join(ds, f"input_{j}.pb")) for j, n in enumerate(ins)}
        if name in STATIC:
            quantize_static_qdq(os.path.join(src, "model.onnx"), os.path.join(dst, "model.onnx"),
                                feeds)
            recipe = "quantize_static QDQ, QUInt8 activations, QInt8 per-channel weights, MinMax"
        else:
            quantize_dynamic(os.path.join(src, "model.onnx"), os.path.join(dst, "model.onnx"),
                             weight_type=QuantType.QInt8)
            recipe = "quantize_dynamic QInt8"
        m = onnx.load(os.path.join(dst, "model.onnx"))
        ref = [load_pb(os.path.join(ds, f"output_{j}.pb")) for j in range(len(m.graph.output))]
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        out = ort.InferenceSession(os.path.join(dst, "model.onnx"), so,
                                   providers=["CPUExecutionProvider"]).run(None, feeds)
        worst = max(float(np.abs(o.astype(np.float64) - r).max()) for o, r in zip(out, ref))
        json.dump({"rtol": 0.0, "atol": 1.5 * worst, "ort_max_abs_vs_float": worst,
                   "quantized_from": os.path.basename(src), "recipe": recipe},
                  open(os.path.join(dst, "data.json"), "w"), indent=1)
        print(f"{name}: from {os.path.basename(src)}, ORT int8 max |diff| from float {worst:.4g}")


if __name__ == "__main__":
    main()
