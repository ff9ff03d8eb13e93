#!/usr/bin/env bash
# Builds llama.cpp's own llama-bench (whole-model prompt/generation timing)
# from the llama.cpp that PyPI's llama-cpp-python sdist vendors, the same
# source bench/llamacpp_peer.sh uses (its download/extract step is shared:
# the sdist lands once in build/llamacpp-peer). Nothing of llama.cpp is
# committed; the build lands in the work directory. Never run by the tests.
#
#   bench/llamacpp_bench.sh [WORK_DIR]     # default build/llamacpp-bench (git-ignored)
#
# Re-runnable: configure and build are skipped when the binary exists for the
# same sdist and settings. Prints the llama-bench path on stdout.
# Environment: LLAMACPP_PY_VERSION, PIP (as bench/llamacpp_peer.sh),
#   JOBS         parallel build jobs (default 2)
#   GGML_OPENMP  ON (default, as llama.cpp builds) or OFF
#   GGML_AMX     OFF (default) or ON. ggml's AMX extra buffer type (compiled in
#                by -march=native on a CPU with AMX) crashes this version's
#                llama-bench on the dev machine (SIGSEGV/SIGILL at ldtilecfg in
#                ggml_backend_amx_mul_mat, on the first prompt matmul of a Q8_0 or
#                Q4_K weight; llama.cpp issue 20824). OFF builds with
#                -mno-amx-tile -mno-amx-int8 -mno-amx-bf16, which keeps the
#                CPU_REPACK AVX-512 kernels; ON needs `--repack 0` to run here
#                (that turns repacking off too).
#   TARGETS      build targets (default llama-bench; e.g. "llama-bench llama-simple",
#                which turns on LLAMA_BUILD_EXAMPLES)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$ROOT/build/llamacpp-bench}"
JOBS="${JOBS:-2}"
OPENMP="${GGML_OPENMP:-ON}"
AMX="${GGML_AMX:-OFF}"
TARGETS="${TARGETS:-llama-bench}"

die() { echo "llamacpp_bench.sh: error: $*" >&2; exit 1; }
say() { echo "llamacpp_bench.sh: $*" >&2; }

# Steps 1-2 (download, extract) of the peer script; it prints the sdist directory.
SRC="$(bash "$ROOT/bench/llamacpp_peer.sh" --fetch-only)" || die "download/extract failed"
LLAMA="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA/CMakeLists.txt" ]] || die "$SRC has no vendor/llama.cpp/CMakeLists.txt"
name="$(basename "$SRC")"

examples=OFF
[[ " $TARGETS " == *" llama-simple "* ]] && examples=ON
mkdir -p "$WORK"
BUILD="$(cd "$WORK" && pwd)/build"
stamp="$name openmp=$OPENMP amx=$AMX targets=$TARGETS"
noamx=""
[[ "$AMX" == "OFF" ]] && noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
EXE="$BUILD/bin/llama-bench"
if [[ ! -x "$EXE" ]] || [[ "$(cat "$BUILD/.built" 2>/dev/null)" != "$stamp" ]]; then
    say "configuring llama.cpp ($name) in $BUILD"
    t0=$SECONDS
    # CPU backend only, static, no network (LLAMA_CURL is deprecated in this
    # version; LLAMA_OPENSSL is what pulls HTTPS in), no server/app/tests.
    cmake -S "$LLAMA" -B "$BUILD" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" \
        -DGGML_CPU_REPACK=ON \
        -DGGML_OPENMP="$OPENMP" \
        -DGGML_BACKEND_DL=OFF \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES="$examples" \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF >&2 \
        || die "cmake configure of llama.cpp failed"
    say "building $TARGETS (-j$JOBS)"
    # shellcheck disable=SC2086
    cmake --build "$BUILD" -j"$JOBS" --target $TARGETS >&2 || die "llama.cpp build failed"
    [[ -x "$EXE" ]] || die "expected $EXE after the build"
    echo "$stamp" > "$BUILD/.built"
    say "built in $((SECONDS - t0)) s"
fi
say "ready: $EXE ($name)"
echo "$EXE"
