// AVX-VNNI integer dot-product kernels (quant_dot.h), built with -mavx2
// -mfma -mf16c -mavxvnni: the kernels of qdot_avx2_impl.h with vpdpbusd on
// ymm (VEX-encoded), which adds each dword lane's four u8 x s8 products
// straight into int32. Without the int16 stage no pair sum can saturate, so
// q8_0's codes are biased by 128 instead of taking the sign trick. Only
// called when cpu_has_avx_vnni(): Alder Lake and later client cores, Sierra
// Forest; CPUs that also have AVX512_VNNI (Sapphire Rapids, Zen 5) take
// qdot_avx512.cpp unless the level is lowered to avx2. fp8_e4m3 takes the
// fp32 kernel of qdot_fp8_impl.h, as qdot_avx2.cpp does.
//
// Everything lives in an anonymous namespace (tests/isa_linkage.sh).
#include "kernels/qdot_avx2_impl.h"
#include "kernels/qdot_ternary_impl.h"
#include "kernels/qdot_fp8_impl.h"

#if !defined(__AVXVNNI__)
#error "qdot_avxvnni.cpp needs -mavxvnni"
#endif

namespace colibri::kernels {
namespace {

struct VnniDot {
  static constexpr bool kSaturatesInt16 = false;

  template <int K, int kMaxCode>
  static __m256i dot(__m256i acc, const __m256i* u, const __m256i* s) {
    static_assert(kMaxCode <= 255, "vpdpbusd takes unsigned bytes");
    // One dependency chain: with 4-8 tokens per pass their chains overlap,
    // and splitting each in two (one more add) measured 5-15% slower.
    for (int k = 0; k < K; ++k) acc = _mm256_dpbusd_avx_epi32(acc, u[k], s[k]);
    return acc;
  }

  // 8 tokens per pass (measured 1.1-1.2x faster than 4 at 8 and more
  // tokens); q6_k's unpacking needs more registers, and 4 ran faster there
  // (q3_k and q2_k share its kernel).
  static constexpr int max_tokens(WeightType t) {
    return t == WeightType::kQ6_K || t == WeightType::kQ3_K || t == WeightType::kQ2_K ? 4 : 8;
  }
};

const QuantDotKernels kQ8_0 = {"q8_0-avx2-vnni", quantize_act, dot_rows_32<VnniDot, Block32::kQ8_0>};
const QuantDotKernels kQ4_0 = {"q4_0-avx2-vnni", quantize_act, dot_rows_32<VnniDot, Block32::kQ4_0>};
const QuantDotKernels kMxfp4 = {"mxfp4-avx2-vnni", quantize_act, dot_rows_32<VnniDot, Block32::kMxfp4>};
const QuantDotKernels kQ4_1 = {"q4_1-avx2-vnni", quantize_act, dot_rows_32<VnniDot, Block32::kQ4_1>};
const QuantDotKernels kQ5_0 = {"q5_0-avx2-vnni", quantize_act, dot_rows_32<VnniDot, Block32::kQ5_0>};
const QuantDotKernels kQ5_1 = {"q5_1-avx2-vnni", quantize_act, dot_rows_32<VnniDot, Block32::kQ5_1>};
const QuantDotKernels kIq4Nl = {"iq4_nl-avx2-vnni", quantize_act, dot_rows_32<VnniDot, Block32::kIq4Nl>};
const QuantDotKernels kIq4Xs = {"iq4_xs-avx2-vnni", quantize_act, dot_rows_32<VnniDot, Block32::kIq4Xs>};
const QuantDotKernels kQ2_K = {"q2_k-avx2-vnni", quantize_act, dot_rows_k<VnniDot, Kind::kQ2K>};
const QuantDotKernels kQ3_K = {"q3_k-avx2-vnni", quantize_act, dot_rows_k<VnniDot, Kind::kQ3K>};
const QuantDotKernels kIq2Xxs = {"iq2_xxs-avx2-vnni", quantize_act, dot_rows_grid<VnniDot, Grid::kIq2Xxs>};
const QuantDotKernels kIq3Xxs = {"iq3_xxs-avx2-vnni", quantize_act, dot_rows_grid<VnniDot, Grid::kIq3Xxs>};
const QuantDotKernels kIq1S = {"iq1_s-avx2-vnni", quantize_act, dot_rows_grid<VnniDot, Grid::kIq1S>};
const QuantDotKernels kIq1M = {"iq1_m-avx2-vnni", quantize_act, dot_rows_grid<VnniDot, Grid::kIq1M>};
const QuantDotKernels kIq2Xs = {"iq2_xs-avx2-vnni", quantize_act, dot_rows_grid<VnniDot, Grid::kIq2Xs>};
const QuantDotKernels kIq2S = {"iq2_s-avx2-vnni", quantize_act, dot_rows_grid<VnniDot, Grid::kIq2S>};
const QuantDotKernels kIq3S = {"iq3_s-avx2-vnni", quantize_act, dot_rows_grid<VnniDot, Grid::kIq3S>};
const QuantDotKernels kQ4_K = {"q4_k-avx2-vnni", quantize_act, dot_rows_k<VnniDot, Kind::kQ4K>};
const QuantDotKernels kQ5_K = {"q5_k-avx2-vnni", quantize_act, dot_rows_k<VnniDot, Kind::kQ5K>};
const QuantDotKernels kQ6_K = {"q6_k-avx2-vnni", quantize_act, dot_rows_k<VnniDot, Kind::kQ6K>};
const QuantDotKernels kFp8E4M3 = {"fp8_e4m3-avx2-vnni", fp8::copy_act, fp8::dot_rows<Fp8Ymm>};

const QuantDotKernels kTq1_0 = {"tq1_0-avx2-vnni", quantize_act, dot_rows_ternary<VnniDot, Ternary::kTq1>};
const QuantDotKernels kTq2_0 = {"tq2_0-avx2-vnni", quantize_act, dot_rows_ternary<VnniDot, Ternary::kTq2>};

}  // namespace

// Compiled once per far prefetch hint (quant_dot.h).
namespace COLIBRI_QDOT_VARIANT {

const QuantDotKernels* quant_dot_avx_vnni(WeightType t) {
  switch (t) {
    case WeightType::kQ8_0:
      return &kQ8_0;
    case WeightType::kQ4_0:
      return &kQ4_0;
    case WeightType::kQ4_K:
      return &kQ4_K;
    case WeightType::kQ5_K:
      return &kQ5_K;
    case WeightType::kQ6_K:
      return &kQ6_K;
    case WeightType::kMXFP4:
      return &kMxfp4;
    case WeightType::kQ4_1:
      return &kQ4_1;
    case WeightType::kQ5_0:
      return &kQ5_0;
    case WeightType::kQ5_1:
      return &kQ5_1;
    case WeightType::kIQ4_NL:
      return &kIq4Nl;
    case WeightType::kIQ4_XS:
      return &kIq4Xs;
    case WeightType::kQ2_K:
      return &kQ2_K;
    case WeightType::kQ3_K:
      return &kQ3_K;
    case WeightType::kIQ2_XXS:
      return &kIq2Xxs;
    case WeightType::kIQ3_XXS:
      return &kIq3Xxs;
    case WeightType::kIQ1_S:
      return &kIq1S;
    case WeightType::kIQ1_M:
      return &kIq1M;
    case WeightType::kIQ2_XS:
      return &kIq2Xs;
    case WeightType::kIQ2_S:
      return &kIq2S;
    case WeightType::kIQ3_S:
      return &kIq3S;
    case WeightType::kFP8_E4M3:
      return &kFp8E4M3;
    case WeightType::kTQ1_0:
      return &kTq1_0;
    case WeightType::kTQ2_0:
      return &kTq2_0;
    default:
      return nullptr;
  }
}

}  // namespace COLIBRI_QDOT_VARIANT
}  // namespace colibri::kernels
