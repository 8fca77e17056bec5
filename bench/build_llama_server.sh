#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp sources vendored in llama-cpp-python's sdist
# (PyPI), for the serving benchmark's peer. Idempotent: exits at once if the binary exists.
#
#   bash bench/build_llama_server.sh            # about five minutes on two cores
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 JOBS=2 bash bench/build_llama_server.sh
#
# Everything lands in bench/llama.cpp-build/ (listed in .gitignore); the binary is
# bench/llama.cpp-build/build/bin/llama-server.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="$HERE/llama.cpp-build"
BIN="$WORK/build/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "already built: $BIN"
    exit 0
fi
mkdir -p "$WORK"
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    python -m pip download --no-deps --no-binary :all: --dest "$WORK" "llama-cpp-python==$VERSION"
fi
SRC="$WORK/llama_cpp_python-$VERSION"
if [[ ! -d "$SRC" ]]; then
    tar -xzf "$SDIST" -C "$WORK"
fi
LLAMA="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in $SRC" >&2; exit 1; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$LLAMA" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$WORK/build" --target llama-server -j "$JOBS"
"$BIN" --version
echo "built: $BIN"
