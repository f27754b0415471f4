"""Shared fixtures: where the repository's models, binaries and test data are."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared"
MODELS = pathlib.Path(os.environ.get("FERRUM_MODELS_DIR", REPO / "models"))
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
RUNNER = SHARED / "tools" / "onnx_conformance.py"
ONNX_CACHE = REPO / ".onnx-tests"


def ferrum_bin() -> pathlib.Path:
    """The `ferrum` binary the CLI comparisons run: $FERRUM_BIN, else target/debug, else
    target/release (CI builds target/debug before this suite runs)."""
    env = os.environ.get("FERRUM_BIN")
    if env:
        return pathlib.Path(env)
    for p in (REPO / "target" / "debug" / "ferrum", REPO / "target" / "release" / "ferrum"):
        if p.exists():
            return p
    raise RuntimeError(
        "no ferrum binary: build it (cargo build -p ferrum-cli) or set FERRUM_BIN"
    )


@pytest.fixture(scope="session")
def ferrum_cli() -> pathlib.Path:
    """Path of the `ferrum` binary."""
    return ferrum_bin()


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    """SmolLM2-135M-Instruct Q4_1 (fetched by scripts/fetch_models.py)."""
    if not SMOLLM2.exists():
        raise RuntimeError(f"{SMOLLM2} is missing: run python3 scripts/fetch_models.py")
    return SMOLLM2


@pytest.fixture(scope="session")
def onnx_cache() -> pathlib.Path:
    """The generated ONNX node tests and light models (.onnx-tests), made once as
    scripts/onnx_conformance.sh makes them."""
    if not (ONNX_CACHE / ".complete").exists():
        subprocess.run(
            [sys.executable, str(RUNNER), "generate", str(ONNX_CACHE)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        (ONNX_CACHE / ".complete").touch()
    return ONNX_CACHE


@pytest.fixture(scope="session")
def light_models(onnx_cache: pathlib.Path) -> list:
    """The light_* models (onnx's small real networks), as conformance test folders."""
    dirs = sorted(p for p in (onnx_cache / "light").iterdir() if (p / "model.onnx").exists())
    assert len(dirs) == 9, dirs
    return dirs
