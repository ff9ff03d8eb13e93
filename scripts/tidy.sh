#!/usr/bin/env bash
# clang-tidy over every translation unit in src/ and tools/lib/ with the checked-in
# .clang-tidy; any finding fails (WarningsAsErrors).
set -euo pipefail
cd "$(dirname "$0")/.."
CC=clang CXX=clang++ cmake -S . -B build-tidy -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCOLIBRI_BUILD_TESTS=OFF \
  -DCOLIBRI_BUILD_TOOLS=ON >/dev/null
mapfile -t files < <(find src tools/lib -name "*.cpp" | sort)
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -n 4 clang-tidy -p build-tidy --quiet
echo "tidy: ${#files[@]} files clean"
