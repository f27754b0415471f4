"""MobileNetV2 (torchvision's architecture, width 1.0, 224x224) written directly as ONNX with
seeded random weights, BatchNorm folded into the convolutions as torch.onnx.export folds it:
Conv / Clip(0, 6) / Add / GlobalAveragePool / Flatten / Gemm, opset 17. Builds the model the
overhead benchmark times without the 6 GB torch install (scripts/onnx_models.sh exports the
PyTorch one).

Usage: python mobilenet_v2.py OUT.onnx
"""

from __future__ import annotations

import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
            (6, 160, 3, 2), (6, 320, 1, 1)]


def build(seed: int = 0):
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    count = [0]

    def conv(x, cin, cout, k, stride, groups, relu6):
        i = count[0]
        count[0] += 1
        w = (rng.standard_normal((cout, cin // groups, k, k)) *
             np.sqrt(2.0 / (cin // groups * k * k))).astype(np.float32)
        b = (rng.standard_normal(cout) * 0.01).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"conv{i}.w"))
        inits.append(numpy_helper.from_array(b, f"conv{i}.b"))
        y = f"conv{i}"
        nodes.append(helper.make_node("Conv", [x, f"conv{i}.w", f"conv{i}.b"], [y], name=f"Conv_{i}",
                                      kernel_shape=[k, k], strides=[stride, stride],
                                      pads=[k // 2] * 4, group=groups))
        if relu6:
            nodes.append(helper.make_node("Clip", [y, "zero", "six"], [y + "_r"], name=f"Clip_{i}"))
            y += "_r"
        return y

    inits.append(numpy_helper.from_array(np.array(0, np.float32), "zero"))
    inits.append(numpy_helper.from_array(np.array(6, np.float32), "six"))
    x = conv("input", 3, 32, 3, 2, 1, True)
    cin = 32
    for t, c, n, s in SETTINGS:
        for j in range(n):
            stride = s if j == 0 else 1
            hidden = cin * t
            h = x if t == 1 else conv(x, cin, hidden, 1, 1, 1, True)
            h = conv(h, hidden, hidden, 3, stride, hidden, True)
            h = conv(h, hidden, c, 1, 1, 1, False)
            if stride == 1 and cin == c:
                nodes.append(helper.make_node("Add", [x, h], [h + "_add"], name=f"Add_{h}"))
                h += "_add"
            x, cin = h, c
    x = conv(x, cin, 1280, 1, 1, 1, True)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool"], name="GlobalAveragePool_0"))
    nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="Flatten_0", axis=1))
    fw = (rng.standard_normal((1000, 1280)) * 0.01).astype(np.float32)
    inits.append(numpy_helper.from_array(fw, "fc.w"))
    inits.append(numpy_helper.from_array(np.zeros(1000, np.float32), "fc.b"))
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["output"], name="Gemm_0", transB=1))
    g = helper.make_graph(
        nodes, "mobilenet_v2",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1000])],
        initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                             producer_name="ferrum-bench")


if __name__ == "__main__":
    with open(sys.argv[1], "wb") as f:
        f.write(build().SerializeToString())
