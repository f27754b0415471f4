"""ferrum.InferenceSession: onnxruntime's API, its errors, and the GIL released while it runs."""

from __future__ import annotations

import importlib
import pathlib
import threading
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ferrum


def ort_script(rt, model_path: str):
    """A typical onnxruntime script; the test runs it with `rt` = onnxruntime and = ferrum,
    the import being the only difference."""
    so = rt.SessionOptions()
    so.intra_op_num_threads = 2
    so.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = rt.InferenceSession(model_path, sess_options=so, providers=["CPUExecutionProvider"])
    ins = [(i.name, list(i.shape), i.type) for i in sess.get_inputs()]
    outs = [(o.name, list(o.shape), o.type) for o in sess.get_outputs()]
    feed = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        n = int(np.prod(shape))
        feed[i.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    results = sess.run(None, feed)
    named = sess.run([outs[0][0]], feed)
    meta = sess.get_modelmeta()
    return {
        "inputs": ins,
        "outputs": outs,
        "results": results,
        "named": named,
        "meta": (meta.producer_name, meta.graph_name, meta.domain, meta.version),
        "providers": sess.get_providers(),
    }


@pytest.mark.parametrize("index", range(9))
def test_light_models_match_onnxruntime(light_models, index):
    model = str(light_models[index] / "model.onnx")
    ort = importlib.import_module("onnxruntime")
    a = ort_script(ort, model)
    b = ort_script(importlib.import_module("ferrum"), model)
    assert a["inputs"] == b["inputs"]
    assert a["outputs"] == b["outputs"]
    assert a["meta"] == b["meta"]
    assert a["providers"] == b["providers"]
    assert len(a["results"]) == len(b["results"])
    for x, y in zip(a["results"], b["results"]):
        assert isinstance(y, np.ndarray)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-5)
    np.testing.assert_array_equal(b["named"][0], b["results"][0])


def _model(nodes, inputs, outputs, inits=(), opset=17, **kw) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], **kw)
    return m.SerializeToString()


@pytest.fixture(scope="module")
def add_model(tmp_path_factory) -> pathlib.Path:
    """y = x + b, z = x * 2 with a symbolic batch dim and metadata."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 3])
    b = numpy_helper.from_array(np.array([1, 2, 3], np.float32), "b")
    two = numpy_helper.from_array(np.array(2, np.float32), "two")
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["y"], name="add0"),
         helper.make_node("Mul", ["x", "two"], ["z"], name="mul0")],
        "adder", [x], [y, z], initializer=[b, two], doc_string="graph doc")
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests",
                          domain="ferrum.test", model_version=7, doc_string="model doc")
    helper.set_model_props(m, {"author": "ferrum", "purpose": "tests"})
    p = tmp_path_factory.mktemp("m") / "add.onnx"
    p.write_bytes(m.SerializeToString())
    return p


def test_metadata_and_symbolic_dims(add_model):
    s = ferrum.InferenceSession(str(add_model))
    (i,) = s.get_inputs()
    assert (i.name, i.shape, i.type) == ("x", ["N", 3], "tensor(float)")
    assert [o.name for o in s.get_outputs()] == ["y", "z"]
    m = s.get_modelmeta()
    assert m.producer_name == "tests"
    assert m.graph_name == "adder"
    assert m.domain == "ferrum.test"
    assert m.version == 7
    assert m.description == "model doc"
    assert m.graph_description == "graph doc"
    assert m.custom_metadata_map == {"author": "ferrum", "purpose": "tests"}
    assert s.get_providers() == ["CPUExecutionProvider"]
    assert [o.name for o in s.get_overridable_initializers()] == []


def test_run_outputs_and_layouts(add_model):
    s = ferrum.InferenceSession(add_model, providers=["CPUExecutionProvider"])  # os.PathLike
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y, z = s.run(None, {"x": x})
    np.testing.assert_array_equal(y, x + [1, 2, 3])
    np.testing.assert_array_equal(z, x * 2)
    assert s.run([], {"x": x})[0].shape == (4, 3)
    z2, y2 = s.run(["z", "y"], {"x": x})
    np.testing.assert_array_equal(z2, z)
    np.testing.assert_array_equal(y2, y)
    # Non-contiguous and Fortran-ordered inputs are read in logical order.
    xt = np.arange(12, dtype=np.float32).reshape(3, 4).T
    np.testing.assert_array_equal(s.run(["y"], {"x": xt})[0], xt + [1, 2, 3])
    xf = np.asfortranarray(x)
    np.testing.assert_array_equal(s.run(["y"], {"x": xf})[0], x + [1, 2, 3])
    # Outputs are independent, writable arrays.
    y[0, 0] = 100
    assert s.run(["y"], {"x": x})[0][0, 0] == 1


def test_inputs_read_in_place_never_written(tmp_path):
    """A contiguous input is read without a copy (peak memory does not grow by its size), ops
    that may write their input in place leave the caller's array as it was, and unaligned,
    strided, read-only and odd-boolean inputs still give the right values."""
    import resource
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])
    l_out = helper.make_tensor_value_info("l", TensorProto.FLOAT, [1])
    r_out = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N"])
    i_out = helper.make_tensor_value_info("i", TensorProto.FLOAT, ["N"])
    start = numpy_helper.from_array(np.array([-1], np.int64), "start")
    end = numpy_helper.from_array(np.array([1 << 40], np.int64), "end")
    last = ferrum.InferenceSession(_model([helper.make_node("Slice", ["x", "start", "end"], ["l"])],
                                          [x], [l_out], inits=[start, end]))
    # 256 MiB of input: a copy would raise the peak RSS by that much.
    big = np.ones(64 << 20, np.float32)
    big[-1] = 5
    last.run(None, {"x": big[:1024]})  # warm-up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    (tail,) = last.run(None, {"x": big})
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert tail.tolist() == [5.0]
    assert grew < 64 << 10, f"peak RSS grew by {grew} KiB reading a 256 MiB input"
    del big
    sess = ferrum.InferenceSession(_model([helper.make_node("Relu", ["x"], ["r"]),
                                           helper.make_node("Identity", ["x"], ["i"])],
                                          [x], [r_out, i_out]))
    # In-place candidates (Relu, Identity) leave the input as it was; outputs are new arrays.
    a = np.array([-1.0, 2.0, -3.0, 4.0], np.float32)
    keep = a.copy()
    r, i = sess.run(["r", "i"], {"x": a})
    np.testing.assert_array_equal(a, keep)
    np.testing.assert_array_equal(r, np.maximum(keep, 0))
    np.testing.assert_array_equal(i, keep)
    i[0] = 99
    assert a[0] == -1.0
    # Read-only, strided and unaligned inputs.
    ro = keep.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(sess.run(["r"], {"x": ro})[0], np.maximum(keep, 0))
    np.testing.assert_array_equal(sess.run(["r"], {"x": np.repeat(keep, 2)[::2]})[0], np.maximum(keep, 0))
    raw = np.zeros(4 * 4 + 1, np.uint8)
    unaligned = raw[1:].view(np.float32)
    unaligned[:] = keep
    assert unaligned.ctypes.data % 4 != 0
    np.testing.assert_array_equal(sess.run(["i"], {"x": unaligned})[0], keep)
    # A NumPy bool byte other than 0/1 (made through a view) reads as true.
    b_in = helper.make_tensor_value_info("b", TensorProto.BOOL, [3])
    b_out = helper.make_tensor_value_info("nb", TensorProto.BOOL, [3])
    nb = ferrum.InferenceSession(_model([helper.make_node("Not", ["b"], ["nb"])], [b_in], [b_out]))
    odd = np.array([0, 1, 7], np.uint8).view(np.bool_)
    assert nb.run(None, {"b": odd})[0].tolist() == [True, False, False]


def test_from_bytes_and_session_options(add_model):
    so = ferrum.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ferrum.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ferrum.InferenceSession(add_model.read_bytes(), so)
    assert s.get_session_options().intra_op_num_threads == 1
    assert s.get_session_options().graph_optimization_level == ferrum.GraphOptimizationLevel.ORT_DISABLE_ALL
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(s.run(None, {"x": x})[0], x + [1, 2, 3])
    with pytest.warns(UserWarning, match="CPU only"):
        ferrum.InferenceSession(add_model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert ferrum.get_available_providers() == ["CPUExecutionProvider"]


def test_every_optimization_level_agrees_with_onnxruntime():
    """Conv + Relu (fused into one node from ORT_ENABLE_EXTENDED on) at every level: onnxruntime's result."""
    rng = np.random.default_rng()
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    m = _model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                helper.make_node("Relu", ["c"], ["y"])], [x], [y], [w, b])
    feed = {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    import onnxruntime as ort
    want = ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    L = ferrum.GraphOptimizationLevel
    for level in (L.ORT_DISABLE_ALL, L.ORT_ENABLE_BASIC, L.ORT_ENABLE_EXTENDED, L.ORT_ENABLE_ALL):
        so = ferrum.SessionOptions()
        so.graph_optimization_level = level
        got = ferrum.InferenceSession(m, so).run(None, feed)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(level))


def test_dtypes_round_trip(tmp_path):
    """Identity over many element types: inputs go in and come back as the same arrays."""
    import ml_dtypes
    cases = [
        (TensorProto.FLOAT, np.float32), (TensorProto.DOUBLE, np.float64),
        (TensorProto.FLOAT16, np.float16), (TensorProto.INT8, np.int8),
        (TensorProto.INT16, np.int16), (TensorProto.INT32, np.int32),
        (TensorProto.INT64, np.int64), (TensorProto.UINT8, np.uint8),
        (TensorProto.UINT16, np.uint16), (TensorProto.UINT32, np.uint32),
        (TensorProto.UINT64, np.uint64), (TensorProto.BOOL, np.bool_),
        (TensorProto.BFLOAT16, ml_dtypes.bfloat16), (TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn),
        (TensorProto.INT4, ml_dtypes.int4),
    ]
    for code, dt in cases:
        x = helper.make_tensor_value_info("x", code, [2, 3])
        y = helper.make_tensor_value_info("y", code, [2, 3])
        m = _model([helper.make_node("Identity", ["x"], ["y"])], [x], [y], opset=21)
        s = ferrum.InferenceSession(m)
        assert s.get_inputs()[0].type == s.get_outputs()[0].type
        a = (np.arange(6).reshape(2, 3) % 2 == 1) if dt is np.bool_ else np.arange(-1, 5).reshape(2, 3).astype(dt)
        if dt in (np.uint8, np.uint16, np.uint32, np.uint64):
            a = np.arange(6).reshape(2, 3).astype(dt)
        (out,) = s.run(None, {"x": a})
        assert out.dtype == a.dtype, (code, out.dtype)
        np.testing.assert_array_equal(out.astype(np.float64) if dt not in (np.bool_,) else out,
                                      a.astype(np.float64) if dt not in (np.bool_,) else a)
    # Strings.
    x = helper.make_tensor_value_info("x", TensorProto.STRING, [2])
    y = helper.make_tensor_value_info("y", TensorProto.STRING, [2])
    s = ferrum.InferenceSession(_model([helper.make_node("Identity", ["x"], ["y"])], [x], [y]))
    (out,) = s.run(None, {"x": np.array(["héllo", "world"], dtype=object)})
    assert out.tolist() == ["héllo", "world"]


def test_sequence_and_optional_io():
    seq_t = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)
    out = helper.make_tensor_value_info("n", TensorProto.INT64, [])
    m = _model([helper.make_node("SequenceLength", ["s"], ["n"])], [seq_t], [out])
    s = ferrum.InferenceSession(m)
    assert s.get_inputs()[0].type == "seq(tensor(float))"
    (n,) = s.run(None, {"s": [np.zeros(2, np.float32), np.ones(3, np.float32)]})
    assert n.shape == () and int(n) == 2
    # A sequence output comes back as a list of arrays.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    so = helper.make_tensor_sequence_value_info("o", TensorProto.FLOAT, None)
    m = _model([helper.make_node("SequenceConstruct", ["x", "x"], ["o"])], [x], [so])
    (o,) = ferrum.InferenceSession(m).run(None, {"x": np.array([1, 2], np.float32)})
    assert isinstance(o, list) and len(o) == 2
    np.testing.assert_array_equal(o[1], [1, 2])
    # Optional input: None is an empty optional.
    opt = helper.make_value_info("x", helper.make_optional_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, [2])))
    b = helper.make_tensor_value_info("b", TensorProto.BOOL, [])
    m = _model([helper.make_node("OptionalHasElement", ["x"], ["b"])], [opt], [b], opset=18)
    s = ferrum.InferenceSession(m)
    assert s.get_inputs()[0].type == "optional(tensor(float))"
    assert bool(s.run(None, {"x": None})[0]) is False
    assert bool(s.run(None, {"x": np.zeros(2, np.float32)})[0]) is True


def test_bad_input_raises_clear_exceptions(add_model, tmp_path):
    s = ferrum.InferenceSession(str(add_model))
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ferrum.InvalidArgument, match=r"input 'x' must be FLOAT, got DOUBLE"):
        s.run(None, {"x": x.astype(np.float64)})
    with pytest.raises(ValueError, match=r"input 'x' must have shape \[N, 3\], got \[2, 4\]"):
        s.run(None, {"x": np.ones((2, 4), np.float32)})
    with pytest.raises(ValueError, match=r"input 'x' must have shape"):
        s.run(None, {"x": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"input 'x' is required"):
        s.run(None, {})
    with pytest.raises(ValueError, match=r"no output named 'w' \(outputs: y, z\)"):
        s.run(["w"], {"x": x})
    with pytest.raises(ValueError, match=r"no input named 'q' \(inputs: x\)"):
        s.run(None, {"x": x, "q": x})
    with pytest.raises(ValueError, match=r"not supported"):
        s.run(None, {"x": np.ones((2, 3), np.complex64)})
    with pytest.raises(ValueError, match=r"not an array of numbers or strings"):
        s.run(None, {"x": object()})
    with pytest.raises(ValueError, match=r"input .x. is not an array"):
        s.run(None, {"x": [[1.0, 2.0, 3.0], [1.0, 2.0]]})
    with pytest.raises(TypeError):
        s.run(None, [x])  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        ferrum.InferenceSession(str(tmp_path / "nope.onnx"))
    with pytest.raises(ferrum.NoSuchFile):
        ferrum.InferenceSession(tmp_path / "nope.onnx")
    with pytest.raises(ferrum.InvalidGraph):
        ferrum.InferenceSession(b"this is not a model")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07\x12garbage")
    with pytest.raises(ferrum.FerrumError):
        ferrum.InferenceSession(str(bad))
    with pytest.raises(TypeError):
        ferrum.InferenceSession(12345)  # type: ignore[arg-type]
    # The session still works after all that.
    np.testing.assert_array_equal(s.run(["y"], {"x": x})[0], x + [1, 2, 3])


def test_node_failure_names_the_node():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])
    m = _model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="the_reshape")], [x, shape], [y])
    s = ferrum.InferenceSession(m)
    with pytest.raises(ferrum.RuntimeException, match="the_reshape"):
        s.run(None, {"x": np.ones(6, np.float32), "shape": np.array([4], np.int64)})
    unsupported = _model([helper.make_node("NoSuchOp", ["x"], ["y"], name="mystery", domain="")],
                         [x], [y])
    with pytest.raises(ferrum.FerrumError, match="mystery|NoSuchOp"):
        ferrum.InferenceSession(unsupported).run(None, {"x": np.ones(2, np.float32)})


def test_ml_dtypes_names_match_onnx():
    """Every storage-only type ferrum reads from ml_dtypes is the one onnx.numpy_helper uses."""
    for code in (TensorProto.BFLOAT16, TensorProto.FLOAT8E5M2, TensorProto.UINT4, TensorProto.FLOAT4E2M1):
        dt = helper.tensor_dtype_to_np_dtype(code)
        t = helper.make_tensor_value_info("x", code, [3])
        # Identity takes float4e2m1 since opset 23 (the types are checked at load).
        m = _model([helper.make_node("Identity", ["x"], ["y"])], [t],
                   [helper.make_tensor_value_info("y", code, [3])], opset=23)
        a = np.array([0, 1, 2]).astype(dt)
        (o,) = ferrum.InferenceSession(m).run(None, {"x": a})
        assert o.dtype == dt
        np.testing.assert_array_equal(o.astype(np.float32), a.astype(np.float32))


def test_gil_released_while_running(light_models):
    """While one thread is inside `run`, another Python thread keeps running: the longest gap
    between its wake-ups stays far below the time `run` takes (a held GIL would stall it for
    the whole run). Independent of how busy the machine's cores are."""
    model = str(next(d for d in light_models if "resnet50" in d.name) / "model.onnx")
    s = ferrum.InferenceSession(model)
    name = s.get_inputs()[0].name
    x = np.zeros((1, 3, 224, 224), np.float32)
    s.run(None, {name: x})
    stamps = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    for _ in range(3):
        s.run(None, {name: x})
    run_time = (time.perf_counter() - t0) / 3
    stop.set()
    t.join()
    inside = [b - a for a, b in zip(stamps, stamps[1:]) if a >= t0]
    assert len(inside) > 10
    assert max(inside) < run_time / 2, (max(inside), run_time)
