#!/usr/bin/env bash
# Builds llama.cpp's own server (llama-server) from the llama.cpp sources inside the pinned
# llama-cpp-python source package, for the side-by-side serving and decoding benchmarks only
# (bench/serve.py, bench/gguf.py). Usage: scripts/build_llama_server.sh [DIR] (default build/llama.cpp);
# prints the path of the binary. A second run reuses the build.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-build/llama.cpp}
VERSION=0.3.36
PY=${PY:-.venv/bin/python}
BIN="$DIR/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$DIR"
if [ ! -d "$DIR/src" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" >&2
  tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR" >&2
  mv "$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
  rm -rf "$DIR/llama_cpp_python-$VERSION" "$DIR/llama_cpp_python-$VERSION.tar.gz"
fi
cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >&2
cmake --build "$DIR/build" --target llama-server llama-bench -j "$(nproc)" >&2
echo "$BIN"
