#!/usr/bin/env python3
"""Generate the dequantization fixtures of ferrum-kernels' quant module from an independent
implementation: the `gguf` Python package (`gguf.quants.dequantize`, NumPy).

Setup (once, from the repository root):

    python3 -m venv .venv && .venv/bin/pip install gguf==0.19.0 numpy

Run (from the repository root):

    .venv/bin/python scripts/gen_quant_fixtures.py

Writes into crates/ferrum-kernels/tests/fixtures/quant/:

* `<TYPE>_random.qfix` for every type `gguf.quants.dequantize` supports among ferrum's types
  (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS):
  a few blocks of
  seeded random bytes whose f16 scale fields (d, m, dmin) are overwritten with finite random values
  of sensible magnitude and random sign, so every bit pattern of the quant fields occurs.
  F16/BF16 values are random bit patterns with NaN/Inf patterns replaced (subnormals kept).
* `<TYPE>_real_<model>.qfix`: a few real blocks of each quantized type present in the two model
  files under models/ (read with gguf.GGUFReader), when those files exist.
* `real_tensors.txt`: for one tensor per (model, type), its absolute data offset, shape and a
  hash + sum of the full dequantized tensor, so the Rust test can check whole real tensors
  without storing them (the test is skipped when the model files are absent).

Optional, when the environment variable GGML_CPU_LIB names an x86 AVX2 build of ggml's CPU backend
(e.g. node-llama-cpp's `bins/linux-x64/libggml-cpu-haswell.so`, next to its `libggml-base.so`):
* `ggml_dots.qdot` + `ggml_dots.txt`: random weight rows (and one real row per quantized type
  of each model file present) and random activations, the activations as
  ggml's `from_float` of the weight's `vec_dot_type` quantizes them, and ggml's `vec_dot` result,
  all computed by calling that library through ctypes (`ggml_get_type_traits_cpu`). Without the
  variable the existing files are left untouched.
  `.qdot` format: b"QDOT", u32 case count, then per case u32 ggml weight type, u32 n,
  u32 weight bytes, u32 activation bytes, the weight bytes, n f32 activations, ggml's activation
  bytes (note: ggml's Q8_1 block is 36 bytes), f32 ggml dot.
  With `--iq4-dots` only `ggml_dots_iq4.qdot` is written: the IQ4_NL/IQ4_XS cases (their x86
  kernels have an AVX2 branch only, so a native AVX-512 build of ggml gives the same order).

`.qfix` format (all little-endian): b"QFIX", u32 ggml type id, u32 n_elements, u32 n_bytes,
n_bytes raw block bytes, then n_elements f32 expected values.

Hash of a dequantized tensor (the f32 bit patterns b_i as u64, i = flat index, row-major):
H = sum_i b_i * (2*i + 1) mod 2^64. Sum = float64 sum of the values (informational).
"""

import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "ferrum-kernels", "tests", "fixtures", "quant")
MODELS = {
    "smollm2": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "models/gemma-3-270m-q4_k_m.gguf",
}

# type -> (elements per block, bytes per block, offsets of f16 scale fields)
LAYOUT = {
    T.F32: (1, 4, []),
    T.F16: (1, 2, []),
    T.BF16: (1, 2, []),
    T.Q4_0: (32, 18, [0]),
    T.Q4_1: (32, 20, [0, 2]),
    T.Q5_0: (32, 22, [0]),
    T.Q5_1: (32, 24, [0, 2]),
    T.Q8_0: (32, 34, [0]),
    T.Q2_K: (256, 84, [80, 82]),
    T.Q3_K: (256, 110, [108]),
    T.Q4_K: (256, 144, [0, 2]),
    T.Q5_K: (256, 176, [0, 2]),
    T.Q6_K: (256, 210, [208]),
    T.IQ4_NL: (32, 18, [0]),
    T.IQ4_XS: (256, 136, [0]),
}
# Types whose ggml dots live in ggml_dots_iq4.qdot (made with --iq4-dots).
IQ_TYPES = (T.IQ4_NL, T.IQ4_XS)
# The block formats of ferrum-kernels' quant/formats (made with --iquants): scale fields as above;
# IQ1_M's f16 scale is spread over the top nibbles of its four u16 scale words, and MXFP4 has an
# E8M0 exponent byte instead (see fix_scales).
NEW_LAYOUT = {
    T.IQ2_XXS: (256, 66, [0]),
    T.IQ2_XS: (256, 74, [0]),
    T.IQ2_S: (256, 82, [0]),
    T.IQ3_XXS: (256, 98, [0]),
    T.IQ3_S: (256, 110, [0]),
    T.IQ1_S: (256, 50, [0]),
    T.IQ1_M: (256, 56, []),
    T.TQ1_0: (256, 54, [52]),
    T.TQ2_0: (256, 66, [64]),
    T.MXFP4: (32, 17, []),
}
LAYOUT.update(NEW_LAYOUT)


def fix_scales(qtype, block, h):
    """Writes the f16 scale `h` into a raw block of a type with no plain f16 scale field."""
    if qtype == T.IQ1_M:
        bits = int(np.frombuffer(h.tobytes(), dtype=np.uint16)[0])
        for i in range(4):
            word = int(block[48 + 2 * i]) | (int(block[49 + 2 * i]) << 8)
            word = (word & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
            block[48 + 2 * i] = word & 0xFF
            block[49 + 2 * i] = word >> 8
    elif qtype == T.MXFP4:
        # 2^(e-127)/2 near |h|: the same magnitudes (E8M0 has no sign; the codes carry it).
        mag = max(abs(float(h)), 1e-30)
        block[0] = min(250, max(0, int(np.floor(np.log2(mag))) + 128))


def random_f16_scale(rng):
    """A finite f16 of magnitude 1e-5..1 (normal and subnormal range), random sign."""
    mag = 10.0 ** rng.uniform(-5.0, 0.0)
    sign = -1.0 if rng.random() < 0.5 else 1.0
    return np.float16(sign * mag)


def random_blocks(qtype, rng):
    per, nbytes, scale_offs = LAYOUT[qtype]
    if qtype == T.F32:
        n = 64
        vals = rng.standard_normal(n).astype(np.float32) * np.float32(3.0)
        vals[0] = np.float32(-0.0)
        vals[1] = np.float32(1e-40)  # subnormal
        vals[2] = np.float32(3.0e38)
        return vals.view(np.uint8)
    if qtype in (T.F16, T.BF16):
        n = 256
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
        exp_mask = np.uint16(0x7C00) if qtype == T.F16 else np.uint16(0x7F80)
        bad = (bits & exp_mask) == exp_mask
        bits[bad] &= np.uint16(~0x4000 & 0xFFFF)  # clear the top exponent bit: finite
        bits[0] = 0x8000  # -0
        bits[1] = 0x0001  # smallest subnormal
        return bits.view(np.uint8)
    n_blocks = 4 if per == 256 else 8
    raw = rng.integers(0, 256, size=n_blocks * nbytes, dtype=np.uint32).astype(np.uint8)
    for b in range(n_blocks):
        for off in scale_offs:
            h = random_f16_scale(rng)
            raw[b * nbytes + off : b * nbytes + off + 2] = np.frombuffer(h.tobytes(), dtype=np.uint8)
        fix_scales(qtype, raw[b * nbytes : (b + 1) * nbytes], random_f16_scale(rng))
    if qtype == T.MXFP4:
        raw[0], raw[nbytes] = 0, 1  # subnormal scales
    return raw


def write_fixture(name, qtype, raw):
    per, nbytes, _ = LAYOUT[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    assert raw.size % nbytes == 0
    n = raw.size // nbytes * per
    expected = dequantize(raw.reshape(-1, nbytes), qtype)
    expected = np.asarray(expected, dtype=np.float32).reshape(-1)
    assert expected.size == n, (name, expected.size, n)
    assert np.all(np.isfinite(expected)), name
    path = os.path.join(OUT, name + ".qfix")
    with open(path, "wb") as f:
        f.write(b"QFIX")
        f.write(struct.pack("<III", int(qtype), n, raw.size))
        f.write(raw.tobytes())
        f.write(expected.astype("<f4").tobytes())
    return os.path.getsize(path)


def tensor_hash(values):
    bits = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    idx = np.arange(bits.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(bits * (np.uint64(2) * idx + np.uint64(1)), dtype=np.uint64))


def real_fixtures(rng, lines):
    total = 0
    for model, rel in MODELS.items():
        path = os.path.join(ROOT, rel)
        if not os.path.exists(path):
            print(f"skipping {model}: {rel} not found", file=sys.stderr)
            continue
        reader = GGUFReader(path)
        by_type = {}
        for t in reader.tensors:
            by_type.setdefault(t.tensor_type, []).append(t)
        for qtype, tensors in sorted(by_type.items(), key=lambda kv: int(kv[0])):
            if qtype not in LAYOUT:
                continue
            per, nbytes, _ = LAYOUT[qtype]
            # Whole-tensor check: the smallest non-embedding tensor of this type.
            cands = [t for t in tensors if t.name != "token_embd.weight"] or tensors
            t = min(cands, key=lambda t: (int(t.n_bytes), t.name))
            ne = [int(x) for x in t.shape]
            ne0 = ne[0]
            rows = int(t.n_elements) // ne0
            data = np.asarray(t.data)
            if per > 1:
                deq = dequantize(data.reshape(rows, -1), qtype)
            else:
                deq = np.asarray(data, dtype=np.float32)
            deq = np.asarray(deq, dtype=np.float32).reshape(rows, ne0)
            lines.append(
                f"{rel} {t.name} {qtype.name} {int(t.data_offset)} {ne0} {rows} "
                f"{tensor_hash(deq):016x} {float(np.sum(deq, dtype=np.float64))!r}"
            )
            if per == 1:
                continue
            # A few real blocks: from the first row, a middle row and the last row.
            blocks = data.reshape(-1, nbytes)
            k = 2 if per == 256 else 4
            picks = sorted(set([0, 1] + list(rng.integers(0, blocks.shape[0], size=k))))[: k + 2]
            picks.append(blocks.shape[0] - 1)
            raw = np.concatenate([blocks[i] for i in picks])
            total += write_fixture(f"{qtype.name}_real_{model}", qtype, raw)
    return total


def ggml_dots(lib_path, rng, types=None, name="ggml_dots", real=True, generic=False):
    """Dot products and activation quantization by ggml itself (see the module docstring)."""
    import ctypes

    base = os.path.join(os.path.dirname(lib_path), "libggml-base.so")
    ctypes.CDLL(base, mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()

    class Traits(ctypes.Structure):
        _fields_ = [
            ("from_float", ctypes.c_void_p),
            ("vec_dot", ctypes.c_void_p),
            ("vec_dot_type", ctypes.c_int),
            ("nrows", ctypes.c_int64),
        ]

    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    from_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    vec_dot_t = ctypes.CFUNCTYPE(
        None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t,
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
    )
    act_sizes = {T.F32: (1, 4), T.F16: (1, 2), T.BF16: (1, 2), T.Q8_0: (32, 34),
                 T.Q8_1: (32, 36), T.Q8_K: (256, 292)}
    cases = []
    generic_dots = []
    for qtype in types or [t for t in LAYOUT if t not in IQ_TYPES and t not in NEW_LAYOUT]:
        per, nbytes, scale_offs = LAYOUT[qtype]
        tr = cpu.ggml_get_type_traits_cpu(int(qtype)).contents
        at = T(tr.vec_dot_type)
        aper, abytes = act_sizes[at]
        lengths = [256, 512, 1024] if per == 256 else [32, 96, 544]
        if qtype in IQ_TYPES or qtype in NEW_LAYOUT:
            lengths += [768, 2048] if per == 256 else [64, 1024]
        if per == 1:
            lengths = [37, 256, 544]
        for n in lengths:
            if per == 1:
                x = (rng.standard_normal(n) * 1.5).astype(np.float32)
                w = np.zeros(n * nbytes, dtype=np.uint8)
                dequant_dtype = {T.F32: np.float32, T.F16: np.float16}.get(qtype)
                if dequant_dtype is not None:
                    w = x.astype(dequant_dtype).view(np.uint8).copy()
                else:  # BF16: truncate-round via ggml's own from_float
                    fn = from_float_t(cpu.ggml_get_type_traits_cpu(int(T.BF16)).contents.from_float)
                    fn(x.ctypes.data, w.ctypes.data, n)
            else:
                w = rng.integers(0, 256, size=n // per * nbytes, dtype=np.uint32).astype(np.uint8)
                for b in range(n // per):
                    for off in scale_offs:
                        h = np.float16(rng.uniform(0.0005, 0.05) * (1 if rng.random() < 0.8 else -1))
                        w[b * nbytes + off : b * nbytes + off + 2] = np.frombuffer(h.tobytes(), np.uint8)
                    h = np.float16(rng.uniform(0.0005, 0.05) * (1 if rng.random() < 0.8 else -1))
                    fix_scales(qtype, w[b * nbytes : (b + 1) * nbytes], h)
            x = (rng.standard_normal(n) * rng.choice([0.01, 1.0, 30.0])).astype(np.float32)
            if n >= 64:
                x[32:64] = 0.0  # an all-zero activation block
            x[5] = np.float32(-abs(x).max() * 1.5)  # a negative max
            act = np.zeros(n // aper * abytes, dtype=np.uint8)
            act_tr = cpu.ggml_get_type_traits_cpu(int(at)).contents
            from_float_t(act_tr.from_float)(x.ctypes.data, act.ctypes.data, n)
            out = ctypes.c_float(0.0)
            vec_dot_t(tr.vec_dot)(n, ctypes.byref(out), 0, w.ctypes.data, 0, act.ctypes.data, 0, 1)
            if generic:
                # ggml's generic C of the same product (`ggml_vec_dot_<w>_<a>_generic`).
                fn = getattr(cpu, f"ggml_vec_dot_{qtype.name.lower()}_{at.name.lower().replace('_k', '_K')}_generic")
                g = ctypes.c_float(0.0)
                vec_dot_t(ctypes.cast(fn, ctypes.c_void_p).value)(
                    n, ctypes.byref(g), 0, w.ctypes.data, 0, act.ctypes.data, 0, 1)
                generic_dots.append(g.value)
            cases.append((int(qtype), n, w, x, act, out.value))
    # One real row per (model, quantized weight type), with a random activation row.
    for rel in MODELS.values() if real else []:
        mpath = os.path.join(ROOT, rel)
        if not os.path.exists(mpath):
            continue
        seen = set()
        for t in GGUFReader(mpath).tensors:
            qtype = t.tensor_type
            if qtype in seen or qtype not in LAYOUT or LAYOUT[qtype][0] == 1:
                continue
            seen.add(qtype)
            n = int(t.shape[0])
            w = np.ascontiguousarray(np.asarray(t.data)[1], dtype=np.uint8)
            tr = cpu.ggml_get_type_traits_cpu(int(qtype)).contents
            at = T(tr.vec_dot_type)
            aper, abytes = act_sizes[at]
            x = (rng.standard_normal(n) * 2.0).astype(np.float32)
            act = np.zeros(n // aper * abytes, dtype=np.uint8)
            from_float_t(cpu.ggml_get_type_traits_cpu(int(at)).contents.from_float)(
                x.ctypes.data, act.ctypes.data, n)
            out = ctypes.c_float(0.0)
            vec_dot_t(tr.vec_dot)(n, ctypes.byref(out), 0, w.ctypes.data, 0, act.ctypes.data, 0, 1)
            cases.append((int(qtype), n, w, x, act, out.value))
    write_qdot(name, cases)
    if generic:
        write_qdot(name + "_generic", [c[:5] + (g,) for c, g in zip(cases, generic_dots)])
    path = os.path.join(OUT, name + ".qdot")
    with open(os.path.join(OUT, name + ".txt"), "w") as f:
        kind = {"ggml_dots": "x86 AVX2 build",
                "ggml_dots_iq4": "x86 build; the IQ4 kernels have an AVX2 branch only"}.get(
                    name, "native x86 build of this machine; the _generic file: its generic C")
        f.write(f"source: {os.path.basename(lib_path)} (ggml CPU backend, {kind})\n")
        meta = os.path.join(os.path.dirname(lib_path), "_nlcBuildMetadata.json")
        if os.path.exists(meta):
            f.write("build metadata: " + open(meta).read().strip() + "\n")
        f.write(f"cases: {len(cases)}\n")
    return os.path.getsize(path)


def write_qdot(name, cases):
    with open(os.path.join(OUT, name + ".qdot"), "wb") as f:
        f.write(b"QDOT")
        f.write(struct.pack("<I", len(cases)))
        for qtype, n, w, x, act, dot in cases:
            f.write(struct.pack("<IIII", qtype, n, w.size, act.size))
            f.write(w.tobytes())
            f.write(x.astype("<f4").tobytes())
            f.write(act.tobytes())
            f.write(struct.pack("<f", dot))


def main():
    os.makedirs(OUT, exist_ok=True)
    if "--iq4-dots" in sys.argv:
        # Only ggml's IQ4_NL / IQ4_XS dots, into ggml_dots_iq4.qdot. Their x86 kernels have an
        # AVX2 branch only, so any x86 build with AVX2 (a native one too) gives their order.
        lib = os.environ["GGML_CPU_LIB"]
        size = ggml_dots(lib, np.random.default_rng(78), types=list(IQ_TYPES),
                         name="ggml_dots_iq4", real=False)
        print(f"wrote {size} bytes to {OUT}/ggml_dots_iq4.qdot")
        return
    if "--q4-0-quantizer" in sys.argv:
        # ggml's quantize_row_q4_0_ref (a Q4_0 KV cache is written by it) on random rows:
        # q4_0_quantize.bin = u32 n, n f32 inputs, then the Q4_0 bytes.
        import ctypes
        lib = ctypes.CDLL(os.path.join(os.path.dirname(os.environ["GGML_CPU_LIB"]), "libggml-base.so"))
        rng = np.random.default_rng(81)
        x = (rng.standard_normal(32 * 64) * rng.choice([0.01, 1.0, 30.0], size=32 * 64)).astype(np.float32)
        x[32:64] = 0.0  # an all-zero block
        x[64:96] = 1.0  # all equal
        x[100] = -x[96:128].__abs__().max() * 2  # a negative max
        out = np.zeros(64 * 18, dtype=np.uint8)
        lib.quantize_row_q4_0_ref(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                                  ctypes.c_int64(x.size))
        with open(os.path.join(OUT, "q4_0_quantize.bin"), "wb") as f:
            f.write(struct.pack("<I", x.size))
            f.write(x.astype("<f4").tobytes())
            f.write(out.tobytes())
        print("wrote q4_0_quantize.bin")
        return
    if "--iquants" in sys.argv:
        # The formats of quant/formats only: their dequantization fixtures, and with
        # GGML_CPU_LIB ggml's dots, by its x86 kernels (ggml_dots_iquants.qdot) and by its
        # generic C (ggml_dots_iquants_generic.qdot), on the same cases.
        rng = np.random.default_rng(20261124)
        total = 0
        for qtype in NEW_LAYOUT:
            total += write_fixture(f"{qtype.name}_random", qtype, random_blocks(qtype, rng))
        lib = os.environ.get("GGML_CPU_LIB")
        if lib:
            total += ggml_dots(lib, np.random.default_rng(79), types=list(NEW_LAYOUT),
                               name="ggml_dots_iquants", real=False, generic=True)
        print(f"wrote {total} bytes of fixtures to {OUT}")
        return
    for f in os.listdir(OUT):
        if f.endswith(".qfix") or f == "real_tensors.txt":
            os.remove(os.path.join(OUT, f))
    rng = np.random.default_rng(20240531)
    total = 0
    for qtype in LAYOUT:
        if qtype not in NEW_LAYOUT:
            total += write_fixture(f"{qtype.name}_random", qtype, random_blocks(qtype, rng))
    lines = []
    total += real_fixtures(rng, lines)
    with open(os.path.join(OUT, "real_tensors.txt"), "w") as f:
        f.write("# model_path tensor type data_offset ne0 rows hash(sum b_i*(2i+1) mod 2^64) sum_f64\n")
        for line in lines:
            f.write(line + "\n")
    lib = os.environ.get("GGML_CPU_LIB")
    if lib:
        total += ggml_dots(lib, np.random.default_rng(77))
    print(f"wrote {total} bytes of fixtures and {len(lines)} real-tensor lines to {OUT}")


if __name__ == "__main__":
    main()
