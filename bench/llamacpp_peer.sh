#!/usr/bin/env bash
# Builds the llama.cpp peer benchmark: ggml's CPU backend from the llama.cpp
# that PyPI's llama-cpp-python source distribution vendors, and our harnesses
# bench/llamacpp_moe.cpp (one layer, weights in memory) and
# bench/llamacpp_mmap.cpp (a GGUF mmapped, the page-cache baseline) against it. Nothing of llama.cpp/ggml is committed;
# everything lands in the work directory.
#
#   bench/llamacpp_peer.sh [WORK_DIR]      # default build/llamacpp-peer (git-ignored)
#   bench/llamacpp_peer.sh --fetch-only [WORK_DIR]
#                                          # steps 1-2 only; prints the extracted
#                                          # sdist directory (bench/llamacpp_bench.sh)
#
# Re-runnable: a finished step (download, extraction, ggml build) is skipped;
# the harness is recompiled when its source is newer than the binary.
# Environment:
#   LLAMACPP_PY_VERSION  llama-cpp-python version to download (default 0.3.36,
#                        the one this was tested with; "latest": the newest on
#                        PyPI, or the newest already in WORK_DIR/dl once there)
#   PIP                  pip to use (default .venv/bin/pip, else pip3)
#   JOBS                 parallel build jobs (default 2)
#   GGML_OPENMP          ON (default, as llama.cpp builds) or OFF
#   GGML_AMX             OFF (default) or ON, as bench/llamacpp_bench.sh: ggml's AMX
#                        extra buffer type (compiled in by -march=native on a CPU
#                        with AMX) takes q4_0/q8_0/q4_K/q6_K weights of a plain
#                        MUL_MAT (llamacpp_linear), and its tile kernels crash this
#                        version on the dev machine (SIGILL/SIGSEGV at tileloadd in
#                        tinygemm_kernel_amx, on a T=128 mul_mat). OFF builds with
#                        -mno-amx-tile -mno-amx-int8 -mno-amx-bf16, keeping the
#                        CPU_REPACK AVX-512 kernels. MUL_MAT_ID (llamacpp_moe)
#                        never uses the AMX buffer type, so OFF does not change it.
# Needs network access for the first step only; fails clearly without it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FETCH_ONLY=0
[[ "${1:-}" == "--fetch-only" ]] && { FETCH_ONLY=1; shift; }
WORK="${1:-$ROOT/build/llamacpp-peer}"
VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
OPENMP="${GGML_OPENMP:-ON}"
AMX="${GGML_AMX:-OFF}"
if [[ -z "${PIP:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/pip" ]]; then PIP="$ROOT/.venv/bin/pip"; else PIP="pip3"; fi
fi

die() { echo "llamacpp_peer.sh: error: $*" >&2; exit 1; }
say() { echo "llamacpp_peer.sh: $*" >&2; }

mkdir -p "$WORK/dl"
WORK="$(cd "$WORK" && pwd)"

# ---------------------------------------------------------------- 1. download
spec="llama-cpp-python"
[[ "$VERSION" != "latest" ]] && spec="llama-cpp-python==$VERSION"
if [[ "$VERSION" == "latest" ]]; then
    sdist="$(ls -1 "$WORK"/dl/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -1 || true)"
else
    sdist="$WORK/dl/llama_cpp_python-$VERSION.tar.gz"
    [[ -f "$sdist" ]] || sdist=""
fi
if [[ -z "$sdist" ]]; then
    say "downloading the $spec source distribution from PyPI"
    t0=$SECONDS
    # --no-build-isolation: pip would otherwise install the build backend
    # just to read the metadata; we only want the archive.
    if ! "$PIP" download --no-binary :all: --no-deps --no-build-isolation -d "$WORK/dl.tmp" "$spec" >&2 \
        && ! "$PIP" download --no-binary :all: --no-deps -d "$WORK/dl.tmp" "$spec" >&2; then
        rm -rf "$WORK/dl.tmp"
        die "could not download $spec (no network, or PyPI unreachable?). This benchmark needs the sdist once; put llama_cpp_python-<version>.tar.gz into $WORK/dl/ by hand to build offline."
    fi
    f="$(ls -1 "$WORK"/dl.tmp/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)"
    [[ -n "$f" ]] || die "pip did not leave a llama_cpp_python-*.tar.gz in $WORK/dl.tmp"
    mv "$f" "$WORK/dl/"
    rm -rf "$WORK/dl.tmp"
    sdist="$WORK/dl/$(basename "$f")"
    say "downloaded $(basename "$sdist") in $((SECONDS - t0)) s"
fi
name="$(basename "$sdist" .tar.gz)"            # llama_cpp_python-X.Y.Z
SRC="$WORK/$name"
GGML="$SRC/vendor/llama.cpp/ggml"

# ---------------------------------------------------------------- 2. extract
if [[ ! -f "$SRC/.extracted" ]]; then
    say "extracting $(basename "$sdist")"
    rm -rf "$SRC"
    tar -xzf "$sdist" -C "$WORK"
    [[ -f "$GGML/CMakeLists.txt" ]] || die "$sdist has no vendor/llama.cpp/ggml/CMakeLists.txt"
    touch "$SRC/.extracted"
fi
# The sdist leaves out ggml/ggml.pc.in, which ggml's standalone configure
# copies for `make install` only; an empty one lets the configure finish.
[[ -f "$GGML/ggml.pc.in" ]] || : > "$GGML/ggml.pc.in"
if [[ "$FETCH_ONLY" == 1 ]]; then echo "$SRC"; exit 0; fi
ggml_version="$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)).*/\2/p' "$GGML/CMakeLists.txt" | paste -sd. -)"

# ---------------------------------------------------------------- 3. ggml (CPU backend only)
BUILD="$WORK/ggml-build"
libs=("$BUILD/src/libggml.a" "$BUILD/src/libggml-cpu.a" "$BUILD/src/libggml-base.a")
stamp="$name openmp=$OPENMP amx=$AMX llamafile=ON"
noamx=""
[[ "$AMX" == "OFF" ]] && noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [[ ! -f "$BUILD/.built" ]] || [[ "$(cat "$BUILD/.built")" != "$stamp" ]]; then
    say "configuring ggml $ggml_version ($name) in $BUILD"
    t0=$SECONDS
    # GGML_NATIVE: -march=native (AVX-512, VNNI, BF16, AMX where the CPU has them;
    # AMX unless GGML_AMX=ON is taken out again by -mno-amx-*, see above).
    # GGML_LLAMAFILE: llamafile's tinyBLAS sgemm for MUL_MAT with more than one
    # token (f32/f16/bf16/q8_0/q4_0 weights in the plain CPU buffer). ggml's own
    # CMakeLists leaves it off; llama.cpp's top-level CMakeLists turns it on, so
    # llama.cpp runs with it (llamacpp_linear's T=128 cases; MUL_MAT_ID does not use it).
    # GGML_CPU_REPACK: the "CPU_REPACK" extra buffer type, which repacks
    # q4_0/q4_K/iq4_nl/q8_0 weights into interleaved layouts for the AVX-512/AVX2
    # GEMV/GEMM kernels (on by default; spelled out here).
    # Only the CPU backend; no tests, examples or tools.
    cmake -S "$GGML" -B "$BUILD" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" \
        -DGGML_CPU=ON \
        -DGGML_CPU_REPACK=ON \
        -DGGML_LLAMAFILE=ON \
        -DGGML_OPENMP="$OPENMP" \
        -DGGML_BACKEND_DL=OFF \
        -DGGML_BUILD_TESTS=OFF \
        -DGGML_BUILD_EXAMPLES=OFF \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF >&2 \
        || die "cmake configure of ggml failed"
    say "building ggml (-j$JOBS)"
    cmake --build "$BUILD" -j"$JOBS" --target ggml ggml-cpu ggml-base >&2 || die "ggml build failed"
    for l in "${libs[@]}"; do [[ -f "$l" ]] || die "expected $l after the ggml build"; done
    echo "$stamp" > "$BUILD/.built"
    say "ggml built in $((SECONDS - t0)) s"
fi

# ---------------------------------------------------------------- 4. harnesses
# compile SRC EXE [extra flags]: recompiled when the source or ggml is newer.
compile() {
    local src="$1" exe="$2"; shift 2
    if [[ -x "$exe" && ! "$src" -nt "$exe" && ! "$BUILD/.built" -nt "$exe" ]]; then return; fi
    say "compiling $src"
    local omp=()
    [[ "$OPENMP" == "ON" ]] && omp=(-fopenmp)
    ${CXX:-g++} -O2 -std=c++17 -Wall -Wextra -DLLAMACPP_PEER_PACKAGE="\"$name\"" "$@" \
        -I"$GGML/include" "$src" -o "$exe.tmp" \
        -Wl,--start-group "${libs[@]}" -Wl,--end-group "${omp[@]}" -lpthread -ldl -lm \
        || die "compilation of $src failed"
    mv "$exe.tmp" "$exe"
}
EXE="$WORK/llamacpp_moe"
compile "$ROOT/bench/llamacpp_moe.cpp" "$EXE" -DLLAMACPP_PEER_GGML_VERSION="\"$ggml_version\""
# The page-cache peer of bench/cache_bench.py: a GGUF mmapped as llama.cpp maps it.
MMAP_EXE="$WORK/llamacpp_mmap"
compile "$ROOT/bench/llamacpp_mmap.cpp" "$MMAP_EXE"
# The dense-layer peer of bench/linear_bench.py: one ggml_mul_mat.
LINEAR_EXE="$WORK/llamacpp_linear"
compile "$ROOT/bench/llamacpp_linear.cpp" "$LINEAR_EXE"
say "ready: $EXE, $MMAP_EXE and $LINEAR_EXE (package $name, ggml $ggml_version)"
echo "$EXE"
