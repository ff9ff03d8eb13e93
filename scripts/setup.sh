#!/usr/bin/env bash
# Installs the Debian packages Colibri needs to build and test, if missing.
# Each is chosen on purpose:
#   cmake, g++            build
#   nlohmann-json3-dev    manifest parsing (JSON)
#   libxxhash-dev         checksums of weight and routing files (XXH64)
#   libcli11-dev          command-line parsing for the colibri tool
#   libgtest-dev          unit tests
#   libbenchmark-dev      per-kernel throughput benchmark (bench/kernel_bench.cpp)
#   valgrind              leak check in the test suite
#   python3-torch         PyTorch MoE baseline of the benchmark suite (bench/pytorch_moe.py)
#   python3-numpy         reads model files and writes routings in bench/run_suite.py
#   python3-matplotlib    the suite's speed-up chart (bench/run_suite.py)
#   libopenblas0-pthread  multi-threaded BLAS for PyTorch's float32 matmuls in the baseline
#   python3-pytest        runs the Python package's tests (python/tests, ctest's `python`)
#   python3-pip, python3-setuptools  offline install of the Python package (docs/PYTORCH.md)
#   clang, libclang-rt-14-dev  libFuzzer targets of the parsers (scripts/fuzz.sh)
#   clang-tidy            static checks over src/ (.clang-tidy)
#   qemu-user             runs the binaries on emulated CPUs without AVX-512 or AVX
#                         (tests/emulated_cpus.sh)
set -euo pipefail

packages=(cmake g++ make pkg-config nlohmann-json3-dev libxxhash-dev libcli11-dev libgtest-dev libbenchmark-dev valgrind
  python3-torch python3-numpy python3-matplotlib libopenblas0-pthread python3-pytest python3-pip
  python3-setuptools clang libclang-rt-14-dev clang-tidy qemu-user)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
