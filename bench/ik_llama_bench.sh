#!/usr/bin/env bash
# Builds ik_llama.cpp's llama-bench (the second peer: a llama.cpp fork with
# its own CPU kernels, run-time repacking `-rtr` and fused MoE `-fmoe`) from a
# snapshot of its repository fetched outside this tree (the tool library's
# `fetch github:ikawrakow/ik_llama.cpp` gives a bare git directory). Nothing of
# ik_llama.cpp is committed; the sources are exported from the snapshot and
# built in the work directory. Never run by the tests.
#
#   bench/ik_llama_bench.sh SNAPSHOT_GIT_DIR [WORK_DIR]   # default build/ik-llama-bench (git-ignored)
#
# Re-runnable: export, configure and build are skipped when the binary exists
# for the same commit. Prints the llama-bench path on stdout.
# Environment: JOBS (parallel build jobs, default 2).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "ik_llama_bench.sh: error: $*" >&2; exit 1; }
say() { echo "ik_llama_bench.sh: $*" >&2; }
[[ $# -ge 1 ]] || die "usage: bench/ik_llama_bench.sh SNAPSHOT_GIT_DIR [WORK_DIR]"
GIT_DIR_IN="$1"
WORK="${2:-$ROOT/build/ik-llama-bench}"
JOBS="${JOBS:-2}"
commit="$(git --git-dir="$GIT_DIR_IN" rev-parse HEAD)" || die "$GIT_DIR_IN is not a git directory"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
SRC="$WORK/src"
BUILD="$WORK/build"
EXE="$BUILD/bin/llama-bench"
if [[ ! -x "$EXE" ]] || [[ "$(cat "$BUILD/.built" 2>/dev/null)" != "$commit" ]]; then
    say "exporting ik_llama.cpp $commit into $SRC"
    rm -rf "$SRC"
    mkdir -p "$SRC"
    # File by file: a snapshot may lack its largest blobs (web assets of the
    # server, models), which the CPU build does not need; they are skipped.
    skipped=0
    while IFS=$'\t' read -r meta path; do
        read -r mode type sha <<< "$meta"
        [[ "$type" == "blob" ]] || continue
        mkdir -p "$SRC/$(dirname "$path")"
        if ! git --git-dir="$GIT_DIR_IN" cat-file blob "$sha" > "$SRC/$path" 2>/dev/null; then
            rm -f "$SRC/$path"
            skipped=$((skipped + 1))
            continue
        fi
        [[ "$mode" == "100755" ]] && chmod +x "$SRC/$path"
    done < <(git --git-dir="$GIT_DIR_IN" ls-tree -r "$commit")
    say "exported ($skipped files absent from the snapshot skipped)"
    t0=$SECONDS
    # CPU backend only, static, native; no CUDA, no server, no tests.
    cmake -S "$SRC" -B "$BUILD" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
        -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_SERVER=OFF >&2 \
        || die "cmake configure of ik_llama.cpp failed"
    say "building llama-bench (-j$JOBS)"
    cmake --build "$BUILD" -j"$JOBS" --target llama-bench >&2 || die "ik_llama.cpp build failed"
    [[ -x "$EXE" ]] || die "expected $EXE after the build"
    echo "$commit" > "$BUILD/.built"
    say "built in $((SECONDS - t0)) s"
fi
say "ready: $EXE (ik_llama.cpp $commit)"
echo "$EXE"
