#!/usr/bin/env bash
# The Python package (crates/ferrum-py): builds it into a git-ignored venv with maturin and runs
# its pytest suite (the ONNX conformance suites through ferrum.InferenceSession against the CLI's
# baseline, onnxruntime-vs-ferrum on the light_* models, LLM.generate against `ferrum generate`,
# chat against `ferrum serve`, threads, bad input).
#
# Usage: scripts/python_test.sh [FERRUM_BINARY]   (default: $FERRUM_BIN or target/debug/ferrum)
#   FERRUM_PY_PROFILE=dev|release   cargo profile of the extension (default dev: the workspace's
#                                   optimised test profile, so the crates `cargo test` built in
#                                   target/debug are reused and only ferrum-py itself compiles)
#   PYTEST_ARGS="-k llm"            extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-py
PROFILE="${FERRUM_PY_PROFILE:-dev}"
export FERRUM_BIN="${1:-${FERRUM_BIN:-target/debug/ferrum}}"
[ -x "$FERRUM_BIN" ] || { echo "ferrum binary '$FERRUM_BIN' not found: build it first (cargo build -p ferrum-cli)" >&2; exit 2; }
FERRUM_BIN="$(cd "$(dirname "$FERRUM_BIN")" && pwd)/$(basename "$FERRUM_BIN")"
if [ ! -x "$VENV/bin/maturin" ] || ! "$VENV/bin/python" -c 'import numpy, pytest, onnxruntime, onnx, ml_dtypes; assert onnx.__version__ == "1.23.2"' 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check 'maturin>=1.5,<2' numpy pytest \
        'onnx==1.23.2' onnxruntime ml_dtypes
fi
start=$(date +%s)
# Builds the abi3 extension in the workspace's target/ and installs the package into the venv
# (editable: python/ferrum is used in place).
VIRTUAL_ENV="$PWD/$VENV" PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/maturin" develop --quiet \
    --profile "$PROFILE" -m crates/ferrum-py/Cargo.toml
echo "ferrum-py build and install took $(( $(date +%s) - start )) s"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pytest -q -p no:cacheprovider crates/ferrum-py/tests ${PYTEST_ARGS:-}
