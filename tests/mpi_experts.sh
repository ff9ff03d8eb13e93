#!/usr/bin/env bash
# The MPI example (examples/mpi_experts.c) under Debian's OpenMPI: a random
# model with a Qwen2-MoE router and a gated shared expert, its experts split
# over 2 and 3 ranks (3 does not divide 8: shares of 2, 3 and 3), every
# layer's all-reduced output against one process within 1e-5 (--check); a
# mask of the wrong length fails on every rank with the library's message
# and a nonzero exit, without hanging.
#
#   tests/mpi_experts.sh COLIBRI_CLI EXAMPLE WORK_DIR
set -euo pipefail
cli="$1" example="$2" work="$3"
rm -rf "$work"
mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo
"$cli" gen --out "$work/model" --experts 8 --d-model 256 --d-ff 128 --layers 2 --dtype q4_k \
  --router qwen2_moe --top-k 2 --shared-d-ff 256 --shared-gate --seed 3 >/dev/null
for np in 2 3; do
  for tokens in 1 17; do
    out="$(timeout 120 mpirun --oversubscribe -np "$np" "$example" "$work/model" --experts 8 --tokens "$tokens" --check)"
    echo "$out"
    [[ "$(grep -c "^layer .*: $np ranks, $tokens tokens, relative L2 against one process" <<<"$out")" == 2 ]] ||
      { echo "mpi_experts.sh: expected two checked layers at -np $np, T=$tokens" >&2; exit 1; }
  done
done
set +e
err="$(timeout 120 mpirun --oversubscribe -np 2 "$example" "$work/model" --experts 6 2>&1)"
rc=$?
set -e
[[ $rc -ne 0 && $rc -ne 124 ]] || { echo "mpi_experts.sh: a wrong --experts gave rc $rc" >&2; exit 1; }
[[ "$(grep -c "local_experts_len is 6; expected n_experts (8" <<<"$err")" == 2 ]] ||
  { echo "mpi_experts.sh: expected the length error on both ranks, got: $err" >&2; exit 1; }
echo "mpi_experts.sh: ok"
