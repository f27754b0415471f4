#!/usr/bin/env bash
# Build the reference llama.cpp (ggml-org/llama.cpp@0c1e57098, as vendored in the
# llama-cpp-python 0.3.36 sdist) OUTSIDE this repository, for numerical comparison.
# Usage: scripts/llamacpp/build.sh [DIR]   (default /tmp/llamacpp)
# Result: DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/{llama-server,llama-eval-callback,llama-bench}
# With LLAMACPP_AVX2_ONLY=1: an AVX2-only build (no AVX-512, no AVX-VNNI), the anchor for ferrum's
# FERRUM_NO_AVX512=1 tier, in build-avx2/bin (llama-bench and llama-server only).
# No llama.cpp code is kept in this repo; only this script.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:-/tmp/llamacpp}"
JOBS="${JOBS:-2}"
mkdir -p "$DIR"
cd "$DIR"
if [ ! -f llama_cpp_python-0.3.36.tar.gz ]; then
  # Only the llama-cpp-python sdist must be a source dist; letting pip take wheels for its
  # build dependencies (scikit-build-core, cmake) avoids building cmake from source.
  pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d .
fi
[ -d llama_cpp_python-0.3.36 ] || tar xzf llama_cpp_python-0.3.36.tar.gz
SRC="$DIR/llama_cpp_python-0.3.36/vendor/llama.cpp"
command -v cmake >/dev/null || { apt-get update && apt-get install -y cmake; }
cd "$SRC"
if [ "${LLAMACPP_AVX2_ONLY:-0}" = 1 ]; then
  cmake -S . -B build-avx2 -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
  nice -n 10 cmake --build build-avx2 -j"$JOBS" --target llama-bench llama-server
  ls -la "$SRC/build-avx2/bin/"
  exit 0
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
nice -n 10 cmake --build build -j"$JOBS" --target llama-server llama-eval-callback llama-bench
# Full-precision tensor dumper (our own code, against llama.h): prints `llama-trace` lines for
# compare_trace.py and, given a directory, writes every f32/f16 tensor as raw f32 (NAME.K.f32).
g++ -O2 -std=c++17 "$HERE/dump_tensors.cpp" -I"$SRC/include" -I"$SRC/ggml/include" -L"$SRC/build/bin" \
  -lllama -lggml -lggml-base -Wl,-rpath,"$SRC/build/bin" -o "$SRC/build/bin/llama-dump-tensors"
ls -la "$SRC/build/bin/"
