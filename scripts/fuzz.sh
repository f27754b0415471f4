#!/usr/bin/env bash
# Runs every fuzz target (fuzz/README.md) for SECONDS each, from the committed seeds, and prints
# executions and crashes per target. Needs a nightly toolchain and cargo-fuzz.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
SECONDS_EACH="${1:-240}"
for t in chat_request json_schema gguf_reader tool_call_stream onnx_import; do
    mkdir -p "corpus/$t"
    cp -n seeds/"$t"/* "corpus/$t/" 2>/dev/null || true
    log="$(mktemp)"
    rc=0
    cargo +nightly fuzz run -O "$t" "corpus/$t" -- -max_total_time="$SECONDS_EACH" -timeout=20 \
        -rss_limit_mb=6144 -max_len=16384 >"$log" 2>&1 || rc=$?
    runs="$(grep -oE 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1 || true)"
    crashes="$(ls "artifacts/$t" 2>/dev/null | wc -l)"
    echo "$t: ${runs:-no summary (exit $rc)}; crash/timeout files in artifacts/$t: $crashes"
    [ "$rc" -eq 0 ] || { grep -E "panicked|ERROR|SUMMARY" "$log" | head -5; }
    rm -f "$log"
done
