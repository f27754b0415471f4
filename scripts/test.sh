#!/usr/bin/env bash
# Runs ferrum's whole test suite: fetches the test models (cached in ./models), checks formatting
# and lints, then builds once and runs every test, the real-model tests included (and SmolLM2's
# llama.cpp reference tests again on the AVX2 and portable kernel tiers), then drives the
# server with the `openai` Python client (plain, tool-calling and structured-output requests),
# then runs the ONNX conformance suites through `ferrum run`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 scripts/fetch_models.py
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace
# The other kernel tiers against llama.cpp's reference outputs (SmolLM2): the AVX2 tier (what a
# CPU without AVX-512 runs), and the portable kernels (every other CPU; the same bits, by design).
# `--workspace` (not `-p ferrum-llm`) keeps the workspace's feature set, so the test binary built
# above is reused instead of rebuilding its dependencies (three minutes on two cores).
FERRUM_NO_AVX512=1 cargo test --workspace --test llamacpp_reference smollm2
FERRUM_FORCE_SCALAR=1 cargo test --workspace --test llamacpp_reference -- \
    smollm2_teacher_forced smollm2_greedy smollm2_prompt_tokens
# The server with the official `openai` and `anthropic` Python clients (installed into a
# git-ignored venv).
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import openai, anthropic, jsonschema' 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check 'openai>=1.40' 'anthropic>=0.40' \
        'jsonschema>=4'
fi
.venv/bin/python scripts/openai_client_test.py target/debug/ferrum
# Tool calling (Qwen2.5-Coder-0.5B-Instruct, whose template teaches <tool_call>) with the same client.
.venv/bin/python scripts/tool_calls_test.py target/debug/ferrum
# Structured output (JSON Schema, regex, choices, Lark, GBNF, forced tool calls) on SmolLM2 and
# Qwen2.5, every JSON reply checked by the `jsonschema` package.
.venv/bin/python scripts/structured_output_test.py target/debug/ferrum
# ONNX conformance of `ferrum run` against the committed baseline (fails if any suite's pass count drops).
./scripts/onnx_conformance.sh target/debug/ferrum
# The Python package (ferrum.InferenceSession, ferrum.LLM): built into a git-ignored venv with
# maturin (reusing target/debug), then its pytest suite.
./scripts/python_test.sh target/debug/ferrum
