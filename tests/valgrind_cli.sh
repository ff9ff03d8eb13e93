#!/usr/bin/env bash
# Runs open -> infer -> free through the CLI under valgrind's leak checker.
# valgrind does not emulate AVX-512, so the AVX2 kernels are forced.
set -euo pipefail
cli="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$cli" gen --out "$work/m" --experts 6 --d-model 40 --d-ff 24 --layers 2 --dtype bf16 >/dev/null
printf '# t, e1, e2, w1, w2\n0, 1, 5, 0.75, 0.25\n2, 0, 3, 1.5, -0.5\n1, 2, 4, 0.5, 0.5\n' >"$work/r.route"
"$cli" route compile "$work/r.route" -o "$work/r.bin" --model "$work/m" >/dev/null
head -c $((3 * 40 * 4)) /dev/urandom >"$work/x.bin"
for isa in avx2 scalar; do
  COLIBRI_ISA=$isa valgrind --quiet --leak-check=full --show-leak-kinds=definite,indirect,possible \
    --errors-for-leak-kinds=definite,indirect,possible --error-exitcode=99 \
    "$cli" infer --model "$work/m" --routing "$work/r.bin" --input "$work/x.bin" --output "$work/y.bin" --layer 1
done
echo "valgrind: no leaks, no errors"
