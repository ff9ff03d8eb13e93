#!/usr/bin/env bash
# Set up, then build and run the whole test suite: a Release build (plus a
# smoke run of the benchmark suite), an AddressSanitizer +
# UndefinedBehaviorSanitizer build, a ThreadSanitizer build of the tests that
# run threads against each other, clang-tidy over src/, and every fuzz target
# for a short time (FUZZ_SECONDS, default 30).
set -euo pipefail
cd "$(dirname "$0")/.."
# setup.sh prints the project Python's path last (.venv/bin/python).
python="$(./scripts/setup.sh | tail -n 1)"
jobs="$(nproc)"

# Runs ctest in build dir $1 with the remaining arguments (label filters)
# and checks that it ran every test that build holds for that filter, and
# at least $MIN_TESTS: a build configured without tests (e.g. by
# scripts/demo.sh, which turns them off) must fail here, not pass with
# "No tests were found".
run_ctest() {
  local dir="$1" min="$2"
  shift 2
  local expected
  expected="$(cd "$dir" && ctest -N "$@" | sed -n 's/^Total Tests: \([0-9]*\)$/\1/p')"
  if [[ -z "$expected" || "$expected" -lt "$min" ]]; then
    echo "test.sh: $dir holds ${expected:-no} tests for '$*', expected at least $min" >&2
    exit 1
  fi
  local log="$dir/ctest-run.log"
  (cd "$dir" && ctest --output-on-failure --no-tests=error -j"$jobs" "$@") | tee "$log"
  local ran
  ran="$(sed -n 's/.*tests passed.* out of \([0-9]*\)$/\1/p' "$log" | tail -n 1)"
  if [[ "$ran" != "$expected" ]]; then
    echo "test.sh: ctest in $dir ran ${ran:-no} tests, the build holds $expected" >&2
    exit 1
  fi
  # A test that exits 77 is "skipped" and still counted as passed: the
  # Python tests do that when their interpreter lacks NumPy or PyTorch.
  # (gtest cases that skip themselves, e.g. AMX tests on a CPU without AMX,
  # are skipped legitimately.)
  if grep -qE '^[[:space:]]*[0-9]+ - python \(Skipped\)' "$log"; then
    echo "test.sh: ctest in $dir skipped the Python tests (see $log)" >&2
    exit 1
  fi
  echo "test.sh: $dir: $ran of $expected tests run and passed"
}

# Every option the suite relies on is set here, so a build/ left by
# scripts/demo.sh (tests off) or by hand is reconfigured, not reused as is.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOLIBRI_BUILD_TESTS=ON -DCOLIBRI_BUILD_TOOLS=ON \
  -DCOLIBRI_BUILD_BENCHMARKS=ON -DCOLIBRI_WERROR=ON -DCOLIBRI_NATIVE=OFF -DCOLIBRI_SANITIZE_ADDRESS=OFF \
  -DCOLIBRI_SANITIZE_THREAD=OFF -DCOLIBRI_BUILD_FUZZERS=OFF -DCOLIBRI_PYTHON="$python" >/dev/null
cmake --build build -j"$jobs"
# The Release suite must include the stages that only run there.
for t in python emulated_cpus kernel_bench_smoke precision_scalar engine_avx2; do
  (cd build && ctest -N -R "^$t\$" | grep -q "Total Tests: 1") ||
    { echo "test.sh: the Release build has no test '$t'" >&2; exit 1; }
done
run_ctest build 300

# The benchmark suite as a smoke run only (tiny shapes, a few iterations):
# it checks that every part runs and that outputs agree with PyTorch, never
# how fast anything is.
"$python" bench/run_suite.py --smoke --build-dir build --out-dir build/bench-smoke

cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLIBRI_BUILD_TESTS=ON -DCOLIBRI_BUILD_TOOLS=ON \
  -DCOLIBRI_SANITIZE_ADDRESS=ON -DCOLIBRI_SANITIZE_THREAD=OFF -DCOLIBRI_WERROR=ON >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 run_ctest build-asan 300 -LE no-asan
# ThreadSanitizer: the concurrency tests (hot swap under load, concurrent
# callers, the pool) and the API/router tests that drive the pool.
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLIBRI_BUILD_TESTS=ON -DCOLIBRI_SANITIZE_THREAD=ON \
  -DCOLIBRI_SANITIZE_ADDRESS=OFF -DCOLIBRI_WERROR=ON >/dev/null
cmake --build build-tsan -j"$jobs" --target test_swap test_api test_router test_engine
for t in test_swap test_api test_router; do
  TSAN_OPTIONS=halt_on_error=1 "build-tsan/tests/$t"
done
TSAN_OPTIONS=halt_on_error=1 build-tsan/tests/test_engine \
  --gtest_filter='EngineTest.ConcurrentCallsFromFourThreads:EngineTest.ThreadCountDoesNotChangeBits'

./scripts/tidy.sh
./scripts/fuzz.sh "${FUZZ_SECONDS:-30}"
echo "all tests passed"
