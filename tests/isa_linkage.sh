#!/usr/bin/env bash
# Fails if an object file compiled for an instruction set above the baseline
# (ffn_avx2, ffn_avx512*, ffn_amx, qdot_avx2, qdot_avxvnni, qdot_avx512,
# qdequant_avx512, attn_avx2, attn_avx512, probe_avx*/probe_amx) defines a symbol with vague linkage
# (nm types W, V, u, i: inline functions, template instantiations, static
# locals of inline functions). The linker keeps one arbitrary copy of each
# such symbol for the whole program; if it kept the AVX-512 copy of, say, an
# inline helper of kernels.h, a scalar caller would run AVX-512 code and die
# with SIGILL on a CPU without it. A -O0 build inlines nothing, so
# scripts/test.sh also runs this on one.
#
#   isa_linkage.sh NM OBJECT...   (objects not named for an ISA are ignored)
set -euo pipefail
nm_tool="$1"
shift
checked=0
bad=0
for obj in "$@"; do
  case "$(basename "$obj")" in
    ffn_avx2.* | ffn_avx512* | ffn_amx.* | qdot_avx2.* | qdot_avxvnni.* | qdot_avx512* | qdequant_avx512.* | attn_avx2.* | attn_avx512.* | probe_avx2.* | probe_avx512* | probe_amx.*) ;;
    *) continue ;;
  esac
  checked=$((checked + 1))
  # DW.ref.__gxx_personality_v0 (a weak pointer to the C++ personality
  # routine that objects with exception tables carry, e.g. in sanitizer
  # builds) is the same data in every object: not code, allowed.
  vague="$("$nm_tool" -C --defined-only "$obj" | awk '$2 ~ /^[WVui]$/ && $3 !~ /^DW\.ref\./')"
  if [[ -n "$vague" ]]; then
    echo "isa_linkage: $obj defines symbols other code could bind to (give them internal linkage):" >&2
    echo "$vague" >&2
    bad=1
  fi
done
if ((checked == 0)); then
  echo "isa_linkage: no instruction-set object among the $# given" >&2
  exit 1
fi
((bad == 0)) || exit 1
echo "isa_linkage: $checked instruction-set objects, no vague-linkage symbols"
