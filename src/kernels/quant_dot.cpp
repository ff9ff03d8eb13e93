// The block formats' integer dot-product tables: the activation rows' size
// and which instruction set's kernels run. Compiled without ISA flags (it
// decides what may run).
#include "kernels/quant_dot.h"

#include "kernels/amx.h"

#include "util/weight_format.h"

namespace colibri::kernels {

bool is_quantized(WeightType t) {
  switch (t) {
    case WeightType::kQ8_0:
    case WeightType::kQ4_0:
    case WeightType::kQ4_K:
    case WeightType::kQ5_K:
    case WeightType::kQ6_K:
    case WeightType::kMXFP4:
    case WeightType::kQ4_1:
    case WeightType::kQ5_0:
    case WeightType::kQ5_1:
    case WeightType::kIQ4_NL:
    case WeightType::kIQ4_XS:
    case WeightType::kQ2_K:
    case WeightType::kQ3_K:
    case WeightType::kIQ2_XXS:
    case WeightType::kIQ3_XXS:
    case WeightType::kIQ1_S:
    case WeightType::kIQ1_M:
    case WeightType::kIQ2_XS:
    case WeightType::kIQ2_S:
    case WeightType::kIQ3_S:
    case WeightType::kFP8_E4M3:
    case WeightType::kTQ1_0:
    case WeightType::kTQ2_0:
      return true;
    default:
      return false;
  }
}

size_t act_row_bytes(WeightType t, size_t n) {
  if (t == WeightType::kFP8_E4M3) return n * sizeof(float);
  // qs[n], d[n / 32] (float), sums[n / 16] (int16): quant_dot.h.
  return is_quantized(t) ? n + n / kActBlock * sizeof(float) + n / 16 * sizeof(int16_t) : 0;
}

#if defined(COLIBRI_HAVE_X86_KERNELS)
namespace {

using EntryFn = const QuantDotKernels* (*)(WeightType);

// The entry of the compilation far_prefetch_nta() picks (quant_dot.h).
template <EntryFn kL2, EntryFn kNta>
const QuantDotKernels* picked(WeightType t) {
  return far_prefetch_nta() ? kNta(t) : kL2(t);
}

}  // namespace

const QuantDotKernels* quant_dot_avx2(WeightType t) { return picked<far_l2::quant_dot_avx2, far_nta::quant_dot_avx2>(t); }
const QuantDotKernels* quant_dot_avx_vnni(WeightType t) {
  return picked<far_l2::quant_dot_avx_vnni, far_nta::quant_dot_avx_vnni>(t);
}
const QuantDotKernels* quant_dot_avx512(WeightType t) {
  return picked<far_l2::quant_dot_avx512, far_nta::quant_dot_avx512>(t);
}
const QuantDotKernels* quant_dot_avx512_ymm(WeightType t) {
  return picked<far_l2::quant_dot_avx512_ymm, far_nta::quant_dot_avx512_ymm>(t);
}
const QuantDotKernels* quant_dot_avx512_grid(WeightType t) {
  return picked<far_l2::quant_dot_avx512_grid, far_nta::quant_dot_avx512_grid>(t);
}
const QuantDotKernels* quant_dot_avx512_planes(WeightType t) {
  return picked<far_l2::quant_dot_avx512_planes, far_nta::quant_dot_avx512_planes>(t);
}
const QuantDotKernels* quant_dot_amx_int8(WeightType t) {
  return picked<far_l2::quant_dot_amx_int8, far_nta::quant_dot_amx_int8>(t);
}
#endif

const QuantDotKernels* quant_dot_kernels(WeightType t, Isa isa) {
  if (!is_quantized(t)) return nullptr;
  const Isa detected = detect_isa();
  const Isa level = isa < detected ? isa : detected;
#if defined(COLIBRI_HAVE_X86_KERNELS)
  // Otherwise kAmx decodes with the AVX-512 kernels; without AVX512_VNNI the AVX-512
  // level takes the AVX2-level ones, with AVX-VNNI where the CPU has it.
  // Every block format has an AVX-512 table; mxfp4's runs only its
  // many-token kernel itself and hands fewer tokens to the AVX2 level's
  // (an AVX-512 port of the transposed block-32 kernel, scales by
  // vpgatherdd, ran a gpt-oss-20b layer 30% slower than those on Zen 4).
  // kAmx with AMX-INT8: the same kernels with the many-token products on
  // tiles, for the formats that have them.
  if (level >= Isa::kAmx && cpu_has_avx512_vnni() && amx_int8_available()) {
    if (const QuantDotKernels* k = quant_dot_amx_int8(t)) return k;
  }
  if (level >= Isa::kAvx512 && cpu_has_avx512_vnni()) {
    if (const QuantDotKernels* k = quant_dot_avx512(t)) return k;
  }
  // The AVX2 level: with vpdpbusd where the CPU has it, VEX-encoded
  // (AVX-VNNI) or else EVEX-encoded on ymm (AVX512_VNNI + VL: Zen 4, Ice
  // Lake), whose products go straight into int32 instead of through
  // vpmaddubsw's pair sums and the sign trick. On Zen 4, one thread, a
  // 2048x768 expert at one token: q8_0 67 against 44 GOP/s, mxfp4 83
  // against 61, q6_k 54 against 50, q4_0 and q4_k even
  // (colibri_qdot_bench); the kernel choice by measurement then weighs
  // them against the zmm tables.
  if (level >= Isa::kAvx2) {
    if (cpu_has_avx_vnni()) {
      if (const QuantDotKernels* k = quant_dot_avx_vnni(t)) return k;
    } else if (detected >= Isa::kAvx512 && cpu_has_avx512_vnni()) {
      if (const QuantDotKernels* k = quant_dot_avx512_ymm(t)) return k;
    }
    if (const QuantDotKernels* k = quant_dot_avx2(t)) return k;
  }
#else
  (void)level;
#endif
  return quant_dot_scalar(t);
}

}  // namespace colibri::kernels
