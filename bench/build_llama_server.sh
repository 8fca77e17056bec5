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

# The CPU's own instruction sets, read from /proc/cpuinfo, never AMX: GGML_NATIVE=ON compiles for what
# the compiler detects, and on VMs that advertise AMX without granting it to processes the binary
# dies with SIGILL at its first tile instruction (tilezero). What was chosen is printed and written
# beside the binary (cpu-flags.txt), so a benchmark's results can record it.
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
ISA=()
for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 \
            avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    flag="${pair%%:*}" option="${pair##*:}"
    if [[ "$CPU_FLAGS" == *" $flag "* ]]; then ISA+=("-DGGML_$option=ON"); else ISA+=("-DGGML_$option=OFF"); fi
done
echo "llama.cpp ISA options: ${ISA[*]} (AMX off)"

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$LLAMA" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=OFF "${ISA[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
cmake --build "$WORK/build" --target llama-server -j "$JOBS"
"$BIN" --version
printf '%s\n' "${ISA[@]}" > "$WORK/build/bin/cpu-flags.txt"
echo "built: $BIN"
