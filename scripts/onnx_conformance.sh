#!/usr/bin/env bash
# ONNX conformance of `ferrum run`: the onnx 1.23.2 node tests (generated once into a git-ignored
# cache), the light_* models, and the simple / pytorch-converted / pytorch-operator suites shipped
# in the onnx wheel. Compares each suite's pass count with tests/onnx/baseline.json and fails when
# one drops, naming the tests that passed in tests/onnx/results.txt but not now.
#
# Usage: scripts/onnx_conformance.sh [FERRUM_BINARY]      (default: $FERRUM_BIN or target/debug/ferrum)
#   ONNX_CONFORMANCE_UPDATE=1  rewrite the baseline and the result list from this run
#   ONNX_CONFORMANCE_JOBS=N    parallel tests (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-${FERRUM_BIN:-target/debug/ferrum}}"
JOBS="${ONNX_CONFORMANCE_JOBS:-2}"
VENV=.venv-onnx
CACHE=.onnx-tests
RUNNER=../shared/tools/onnx_conformance.py
[ -x "$BIN" ] || { echo "ferrum binary '$BIN' not found: build it first (cargo build -p ferrum-cli)" >&2; exit 2; }
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
# The generated node tests' expected outputs come from these packages, so they are pinned: the
# baseline holds for this set. (ml_dtypes 0.7 turns an out-of-range float cast to int4 / int2
# into 0 where earlier versions wrap around; ONNX leaves that case undefined, and 24 cast tests
# changed their expected values with it.) The cache records the set it was generated with.
PINS="onnx==1.23.2 ml_dtypes==0.6.0 numpy==2.4.6"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" - "$PINS" <<'PYEOF' 2>/dev/null
import sys, onnx, ml_dtypes, numpy
have = f"onnx=={onnx.__version__} ml_dtypes=={ml_dtypes.__version__} numpy=={numpy.__version__}"
sys.exit(0 if have == sys.argv[1] else 1)
PYEOF
then
    python3 -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet --disable-pip-version-check $PINS
fi
PY="$VENV/bin/python"
if [ ! -f "$CACHE/.complete" ] || [ "$(cat "$CACHE/.complete")" != "$PINS" ]; then
    rm -rf "$CACHE"
    "$PY" "$RUNNER" generate "$CACHE" > /dev/null 2>&1
    echo "$PINS" > "$CACHE/.complete"
fi
DATA="$("$PY" -c 'import onnx, os; print(os.path.join(os.path.dirname(onnx.__file__), "backend/test/data"))')"
RESULTS="$CACHE/results.jsonl"
start=$(date +%s)
"$PY" "$RUNNER" run "$CACHE/node" "$CACHE/light" "$DATA/simple" "$DATA/pytorch-converted" "$DATA/pytorch-operator" \
    --cmd "$BIN run --quiet --model {model} --inputs {inputs} --outputs {outputs}" \
    -j "$JOBS" --timeout 300 --json "$RESULTS"
echo "conformance run took $(( $(date +%s) - start )) s"
"$PY" - "$RESULTS" tests/onnx/baseline.json tests/onnx/results.txt "${ONNX_CONFORMANCE_UPDATE:-0}" <<'PYEOF'
import json, os, sys
from collections import Counter
results, baseline_path, list_path, update = sys.argv[1:5]
recs = [json.loads(l) for l in open(results)]
for r in recs:
    r["suite"] = os.path.basename(r["suite"].rstrip("/"))
now = {f"{r['suite']}/{r['test']}": r["status"] for r in recs}
counts = Counter(r["suite"] for r in recs if r["status"] == "pass")
totals = Counter(r["suite"] for r in recs)
summary = {s: {"passed": counts[s], "total": totals[s]} for s in sorted(totals)}
if update == "1":
    json.dump(summary, open(baseline_path, "w"), indent=2, sort_keys=True)
    with open(list_path, "w") as f:
        for k in sorted(now):
            f.write(f"{k}\t{now[k]}\n")
    print(f"baseline updated: {baseline_path}, {list_path}")
    sys.exit(0)
base = json.load(open(baseline_path))
before = {}
for line in open(list_path):
    k, st = line.rstrip("\n").split("\t")
    before[k] = st
lost = sorted(k for k, st in before.items() if st == "pass" and now.get(k) != "pass")
gained = sorted(k for k, st in now.items() if st == "pass" and before.get(k) != "pass")
bad = False
for s in sorted(set(base) | set(summary)):
    b = base.get(s, {}).get("passed", 0)
    n = summary.get(s, {}).get("passed", 0)
    t = summary.get(s, {}).get("total", 0)
    flag = "  <-- below baseline" if n < b else ""
    print(f"{s:20} {n:5}/{t:<5} (baseline {b}){flag}")
    bad |= n < b
if gained:
    print(f"{len(gained)} tests pass that did not in the baseline (update with ONNX_CONFORMANCE_UPDATE=1)")
if lost:
    print("passed in the baseline, not now:")
    for k in lost:
        print(f"  {k}: {now.get(k, 'missing')}")
sys.exit(1 if bad else 0)
PYEOF
