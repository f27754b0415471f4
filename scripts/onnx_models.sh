#!/usr/bin/env bash
# Real-size ONNX networks exported from PyTorch with seeded random weights
# (../shared/tools/make_onnx_models.py: ResNet-50, MobileNetV2, BERT-base, ViT-B/16), run by
# `ferrum run` and by ONNX Runtime: the conformance runner's pass/fail per model (rtol 1e-3, atol
# from each model's data.json, against PyTorch's outputs), the largest differences from ONNX
# Runtime and from PyTorch, and median latency at 1 and 2 threads beside ONNX Runtime's.
# Not part of CI: torch is large.
#
# Usage: scripts/onnx_models.sh [FERRUM_BINARY]      (default: $FERRUM_BIN or target/release/ferrum)
#   ONNX_MODELS=resnet50,mobilenet_v2,bert_base,vit_b_16   models to run (resnet50_b8 also exists,
#       and bert_base_int8 / resnet50_int8 / mobilenet_v2_int8: quantized by onnxruntime.quantization,
#       BERT dynamically, the CNNs statically in QDQ form, see scripts/quantize_onnx_models.py)
#   ONNX_MODELS_REPEAT=10    timed runs per measurement (after one warm-up run)
#   ONNX_MODELS_ROUNDS=3     ferrum and ONNX Runtime alternate this many times per thread count;
#       each figure is the median of the rounds' medians (load on a shared host weighs on both)
#   ONNX_MODELS_THREADS=1,2  thread counts for the latency table
#   ONNX_MODELS_PRECISION=f32   bf16: ferrum's opt-in bf16 products (`ferrum run --precision bf16`,
#       AMX-BF16 CPUs), their distance from PyTorch's outputs reported beside ORT's
#
# The venv (.venv-models) and the exported models (.onnx-models) are made once and git-ignored.
# torch from PyPI for Linux x86-64 is the CUDA build: `import torch` loads libcudart, cuBLAS, cuDNN
# and the other CUDA libraries even on a CPU-only machine (with `pip install --no-deps torch` it
# fails: "libcudart.so.13: cannot open shared object file"), so its nvidia-* dependencies come
# along: the venv takes about 6 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-${FERRUM_BIN:-target/release/ferrum}}"
VENV=.venv-models
CACHE=.onnx-models
MODELS="${ONNX_MODELS:-resnet50,mobilenet_v2,bert_base,vit_b_16}"
[ -x "$BIN" ] || { echo "ferrum binary '$BIN' not found: build it first (cargo build --release -p ferrum-cli)" >&2; exit 2; }
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import torch, torchvision, transformers, onnxruntime, numpy, onnx; assert onnx.__version__ == "1.23.2"' 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check torch torchvision transformers 'onnx==1.23.2' onnxruntime numpy
fi
PY="$VENV/bin/python"
missing=""
quant=""
for m in ${MODELS//,/ }; do
    base="${m%_int8}"
    [ -f "$CACHE/$base/model.onnx" ] && [ -f "$CACHE/$base/test_data_set_0/output_0.pb" ] \
        || missing="$missing,$base"
    if [ "$base" != "$m" ] && ! [ -f "$CACHE/$m/data.json" ]; then quant="$quant $m"; fi
done
if [ -n "$missing" ]; then
    echo "exporting ${missing#,} (once, into $CACHE)"
    "$PY" ../shared/tools/make_onnx_models.py "$CACHE" --only "${missing#,}"
fi
if [ -n "$quant" ]; then
    echo "quantizing$quant (once, into $CACHE)"
    "$PY" scripts/quantize_onnx_models.py "$CACHE" $quant
fi
dirs=()
for m in ${MODELS//,/ }; do dirs+=("$CACHE/$m"); done
echo "== conformance runner (rtol 1e-3, atol from data.json, against PyTorch's outputs)"
"$PY" ../shared/tools/onnx_conformance.py run "${dirs[@]}" \
    --cmd "$BIN run --quiet --model {model} --inputs {inputs} --outputs {outputs} --precision ${ONNX_MODELS_PRECISION:-f32}" \
    -j 1 --timeout 600 --json "$CACHE/results.jsonl" || true
"$PY" - "$CACHE/results.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"  {r['test']:<16} {r['status']}" + (f"  ({r['reason']})" if r['status'] != 'pass' else ""))
PYEOF
echo "== differences and latency"
"$PY" scripts/onnx_models.py "$BIN" "$CACHE" "$MODELS" \
    --repeat "${ONNX_MODELS_REPEAT:-10}" --rounds "${ONNX_MODELS_ROUNDS:-3}" \
    --threads "${ONNX_MODELS_THREADS:-1,2}" --precision "${ONNX_MODELS_PRECISION:-f32}"
