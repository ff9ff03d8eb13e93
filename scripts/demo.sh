#!/usr/bin/env bash
# Set up, build (Release) and run the seed's demo.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOLIBRI_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)"
./build/tools/colibri demo "$@"
