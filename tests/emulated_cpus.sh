#!/usr/bin/env bash
# The same binaries on CPUs this machine is not: qemu-user emulates a Haswell
# (AVX2, FMA, F16C, no AVX-512) and a Nehalem (no AVX at all), CPUID and XCR0
# included. On each, the library must pick the right level by itself (avx2,
# scalar), never reach an instruction the CPU lacks (a flag-less file built
# with AVX-512, or an AVX-512 copy of a shared inline function, would kill
# the process with SIGILL here), pass the kernel tests of that level and the
# C ABI tests, and give a layer's output that matches the native scalar one.
#
# Usage: emulated_cpus.sh QEMU COLIBRI_CLI TEST_KERNELS TEST_API
set -euo pipefail
qemu=$1 cli=$2 test_kernels=$3 test_api=$4
# NumPy writes the inputs and compares the outputs: the project's Python (ctest sets it).
python=${COLIBRI_PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# qemu names the host features its CPU models list but TCG lacks (pcid,
# x2apic, ...) on every start; they do not concern user-mode programs.
on_cpu() {
  local cpu=$1
  shift
  "$qemu" -cpu "$cpu" "$@" 2> >(grep -v '^qemu-x86_64: warning: TCG doesn' >&2)
}

# A small f16 model whose sizes are not multiples of any vector width, and
# 24 tokens routed so that experts 0 and 1 get 16 tokens each (a count that
# runs the prefill tables on an AVX-512 machine; avx2 and scalar have one
# table for every count), the rest a few or none.
"$cli" gen --out "$work/model" --experts 8 --d-model 80 --d-ff 72 --dtype f16 --seed 11 >/dev/null
"$python" - "$work" <<'EOF'
import sys
import numpy as np
work = sys.argv[1]
rng = np.random.default_rng(5)
np.asarray(rng.standard_normal((24, 80)), dtype="<f4").tofile(work + "/x.bin")
with open(work + "/r.route", "w") as f:
    for t in range(24):
        e = (0, 1) if t < 16 else tuple(int(v) for v in rng.choice(np.arange(2, 8), 2, replace=False))
        w = rng.uniform(0.1, 0.9)
        f.write("%d, %d, %d, %.6f, %.6f\n" % (t, e[0], e[1], w, 1 - w))
EOF
COLIBRI_ISA=scalar "$cli" infer --model "$work/model" --routing "$work/r.route" --input "$work/x.bin" \
  --output "$work/native.bin" --threads 2

check_cpu() {
  local cpu=$1 level=$2 filter=$3
  echo "== $cpu: expecting level $level"
  local kernels
  kernels=$(on_cpu "$cpu" "$cli" bench --model "$work/model" --tokens 8 --top-k 2 --iters 1 | grep '^kernels')
  if [[ ! $kernels =~ ^kernels\ +decode\ $level$ ]]; then
    echo "FAIL: on $cpu the library chose '$kernels', expected decode $level" >&2
    exit 1
  fi
  on_cpu "$cpu" "$cli" infer --model "$work/model" --routing "$work/r.route" --input "$work/x.bin" \
    --output "$work/$level.bin" --threads 2
  # f16 weights are computed in fp32 at every level: the layer agrees with
  # the native scalar run to fp32 rounding (docs/PRECISION.md: 1e-5).
  "$python" - "$work/native.bin" "$work/$level.bin" <<'EOF'
import sys
import numpy as np
a, b = (np.fromfile(p, dtype="<f4").astype(np.float64) for p in sys.argv[1:3])
assert a.shape == b.shape == (24 * 80,), (a.shape, b.shape)
assert np.all(np.isfinite(b)), "non-finite output"
err = np.linalg.norm(a - b) / np.linalg.norm(a)
print("relative L2 difference from the native scalar run: %.2e" % err)
assert err <= 1e-5, err
EOF
  on_cpu "$cpu" "$test_kernels" --gtest_brief=1 --gtest_filter="$filter"
  on_cpu "$cpu" "$test_api" --gtest_brief=1
}

check_cpu Haswell-v4 avx2 'IsaTest.*:AllIsasAndTypes/KernelTest.*/avx2_*-*RealisticShape*'
check_cpu Nehalem-v1 scalar 'IsaTest.*:AllIsasAndTypes/KernelTest.DownSmallShapes/scalar_*:AllIsasAndTypes/KernelTest.EmptyRangesTouchNothing/*'
echo "emulated CPUs: all checks passed"
