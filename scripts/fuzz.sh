#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) and runs each for a set
# time, starting from the committed seed corpus in fuzz/corpus/<target>/.
# New inputs the fuzzer finds go to a scratch copy, not into the repository.
# Fails on any crash, leak or sanitizer report.
#   scripts/fuzz.sh [seconds per target, default 30] [target ...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
shift || true
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=()
  for f in fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi

CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLIBRI_BUILD_FUZZERS=ON \
  -DCOLIBRI_SANITIZE_ADDRESS=ON -DCOLIBRI_BUILD_TESTS=OFF -DCOLIBRI_BUILD_TOOLS=OFF >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target "${targets[@]}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
status=0
for t in "${targets[@]}"; do
  name="${t#fuzz_}"
  mkdir -p "$work/$name"
  cp fuzz/corpus/"$name"/* "$work/$name/" 2>/dev/null || true
  log="$work/$name.log"
  echo "fuzz: $t for ${seconds}s"
  if ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "build-fuzz/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/$name-" "$work/$name" >"$log" 2>&1; then
    runs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')"
    echo "fuzz: $t clean, $runs executions"
  else
    echo "fuzz: $t FAILED; last lines of its log:"
    tail -40 "$log"
    for a in "$work/$name"-*; do [[ -e "$a" ]] && { echo "reproducer: $a"; xxd "$a" | head -20; }; done
    status=1
  fi
done
exit "$status"
