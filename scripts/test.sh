#!/usr/bin/env bash
# Set up, then build and run the whole test suite: a Release build (plus a
# smoke run of the benchmark suite), an AddressSanitizer +
# UndefinedBehaviorSanitizer build, a ThreadSanitizer build of the tests that
# run threads against each other, clang-tidy over src/, and every fuzz target
# for a short time (FUZZ_SECONDS, default 30).
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
# ThreadSanitizer: the concurrency tests (hot swap under load, concurrent
# callers, the pool) and the API/router tests that drive the pool.
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLIBRI_SANITIZE_THREAD=ON -DCOLIBRI_WERROR=ON >/dev/null
cmake --build build-tsan -j"$jobs" --target test_swap test_api test_router test_engine
for t in test_swap test_api test_router; do
  TSAN_OPTIONS=halt_on_error=1 "build-tsan/tests/$t"
done
TSAN_OPTIONS=halt_on_error=1 build-tsan/tests/test_engine \
  --gtest_filter='EngineTest.ConcurrentCallsFromFourThreads:EngineTest.ThreadCountDoesNotChangeBits'

./scripts/tidy.sh
./scripts/fuzz.sh "${FUZZ_SECONDS:-30}"
echo "all tests passed"
