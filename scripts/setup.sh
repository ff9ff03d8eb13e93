#!/usr/bin/env bash
# Installs the Debian packages Colibri needs to build and test, if missing.
# Each is chosen on purpose:
#   cmake, g++            build
#   nlohmann-json3-dev    manifest parsing (JSON)
#   libxxhash-dev         checksums of weight and routing files (XXH64)
#   libcli11-dev          command-line parsing for the colibri tool
#   libgtest-dev          unit tests
#   valgrind              leak check in the test suite
set -euo pipefail

packages=(cmake g++ make pkg-config nlohmann-json3-dev libxxhash-dev libcli11-dev libgtest-dev valgrind)
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
