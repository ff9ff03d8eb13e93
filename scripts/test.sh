#!/usr/bin/env bash
# Set up, then build and run the whole test suite twice: a Release build (plus
# a smoke run of the benchmark suite), and an AddressSanitizer +
# UndefinedBehaviorSanitizer build.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
jobs="$(nproc)"

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOLIBRI_WERROR=ON -DCOLIBRI_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build -j"$jobs"
(cd build && ctest --output-on-failure -j"$jobs")

# The benchmark suite as a smoke run only (tiny shapes, a few iterations):
# it checks that every part runs and that outputs agree with PyTorch, never
# how fast anything is.
/usr/bin/python3 bench/run_suite.py --smoke --build-dir build --out-dir build/bench-smoke

cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLIBRI_SANITIZE_ADDRESS=ON \
  -DCOLIBRI_WERROR=ON >/dev/null
cmake --build build-asan -j"$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure -j"$jobs" -LE no-asan)
echo "all tests passed"
