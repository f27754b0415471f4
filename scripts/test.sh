#!/usr/bin/env bash
# Runs ferrum's whole test suite: fetches the test models (cached in ./models), checks formatting
# and lints, then builds once and runs every test, the real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 scripts/fetch_models.py
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace
