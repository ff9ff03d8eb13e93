// The AVX2-level integer dot-product kernels (qdot_avx2_impl.h) with
// vpdpbusd on ymm in its EVEX encoding (AVX512_VNNI + AVX512VL), for the
// block formats that have no kernel of their own in qdot_avx512.cpp:
// q4_1, q5_0, q5_1, q2_k, q3_k, iq4_nl and iq4_xs. On CPUs with AVX512_VNNI but not
// AVX-VNNI (Zen 4, Ice Lake, Cascade Lake) the products then go straight
// into int32, as on qdot_avxvnni.cpp's CPUs, instead of through
// vpmaddubsw's int16 pair sums; 256-bit vectors, as the AVX2 level's, for
// the formats' byte tables and transposed blocks.
//
// Everything lives in an anonymous namespace (tests/isa_linkage.sh).
#include "kernels/qdot_avx2_impl.h"
#include "kernels/qdot_ternary_impl.h"

#if !defined(__AVX512VNNI__) || !defined(__AVX512VL__)
#error "qdot_avx512vl.cpp needs -mavx512vnni -mavx512vl"
#endif

namespace colibri::kernels {
namespace {

struct EvexVnniDot {
  static constexpr bool kSaturatesInt16 = false;

  template <int K, int kMaxCode>
  static __m256i dot(__m256i acc, const __m256i* u, const __m256i* s) {
    static_assert(kMaxCode <= 255, "vpdpbusd takes unsigned bytes");
    for (int k = 0; k < K; ++k) acc = _mm256_dpbusd_epi32(acc, u[k], s[k]);
    return acc;
  }

  // As qdot_avxvnni.cpp's trait: 8 tokens a pass, 4 for q6_K's kernel.
  static constexpr int max_tokens(WeightType t) {
    return t == WeightType::kQ6_K || t == WeightType::kQ3_K || t == WeightType::kQ2_K ? 4 : 8;
  }
};

const QuantDotKernels kQ8_0 = {"q8_0-avx512-vnni-ymm", quantize_act, dot_rows_32<EvexVnniDot, Block32::kQ8_0>};
const QuantDotKernels kQ4_0 = {"q4_0-avx512-vnni-ymm", quantize_act, dot_rows_32<EvexVnniDot, Block32::kQ4_0>};
const QuantDotKernels kMxfp4 = {"mxfp4-avx512-vnni-ymm", quantize_act, dot_rows_32<EvexVnniDot, Block32::kMxfp4>};
const QuantDotKernels kQ4_K = {"q4_k-avx512-vnni-ymm", quantize_act, dot_rows_k<EvexVnniDot, Kind::kQ4K>};
const QuantDotKernels kQ5_K = {"q5_k-avx512-vnni-ymm", quantize_act, dot_rows_k<EvexVnniDot, Kind::kQ5K>};
const QuantDotKernels kQ6_K = {"q6_k-avx512-vnni-ymm", quantize_act, dot_rows_k<EvexVnniDot, Kind::kQ6K>};
const QuantDotKernels kQ4_1 = {"q4_1-avx512-vnni", quantize_act, dot_rows_32<EvexVnniDot, Block32::kQ4_1>};
const QuantDotKernels kQ5_0 = {"q5_0-avx512-vnni", quantize_act, dot_rows_32<EvexVnniDot, Block32::kQ5_0>};
const QuantDotKernels kQ5_1 = {"q5_1-avx512-vnni", quantize_act, dot_rows_32<EvexVnniDot, Block32::kQ5_1>};
const QuantDotKernels kIq4Nl = {"iq4_nl-avx512-vnni", quantize_act, dot_rows_32<EvexVnniDot, Block32::kIq4Nl>};
const QuantDotKernels kIq4Xs = {"iq4_xs-avx512-vnni", quantize_act, dot_rows_32<EvexVnniDot, Block32::kIq4Xs>};
const QuantDotKernels kQ2_K = {"q2_k-avx512-vnni", quantize_act, dot_rows_k<EvexVnniDot, Kind::kQ2K>};
const QuantDotKernels kQ3_K = {"q3_k-avx512-vnni", quantize_act, dot_rows_k<EvexVnniDot, Kind::kQ3K>};
const QuantDotKernels kIq2Xxs = {"iq2_xxs-avx512-vnni", quantize_act, dot_rows_grid<EvexVnniDot, Grid::kIq2Xxs>};
const QuantDotKernels kIq3Xxs = {"iq3_xxs-avx512-vnni", quantize_act, dot_rows_grid<EvexVnniDot, Grid::kIq3Xxs>};
const QuantDotKernels kIq1S = {"iq1_s-avx512-vnni", quantize_act, dot_rows_grid<EvexVnniDot, Grid::kIq1S>};
const QuantDotKernels kIq1M = {"iq1_m-avx512-vnni", quantize_act, dot_rows_grid<EvexVnniDot, Grid::kIq1M>};
const QuantDotKernels kIq2Xs = {"iq2_xs-avx512-vnni", quantize_act, dot_rows_grid<EvexVnniDot, Grid::kIq2Xs>};
const QuantDotKernels kIq2S = {"iq2_s-avx512-vnni", quantize_act, dot_rows_grid<EvexVnniDot, Grid::kIq2S>};
const QuantDotKernels kIq3S = {"iq3_s-avx512-vnni", quantize_act, dot_rows_grid<EvexVnniDot, Grid::kIq3S>};

const QuantDotKernels kTq1_0 = {"tq1_0-avx512-vnni", quantize_act, dot_rows_ternary<EvexVnniDot, Ternary::kTq1>};
const QuantDotKernels kTq2_0 = {"tq2_0-avx512-vnni", quantize_act, dot_rows_ternary<EvexVnniDot, Ternary::kTq2>};

}  // namespace

// Compiled once per far prefetch hint (quant_dot.h).
namespace COLIBRI_QDOT_VARIANT {

const QuantDotKernels* quant_dot_avx512_ymm(WeightType t) {
  switch (t) {
    case WeightType::kQ8_0:
      return &kQ8_0;
    case WeightType::kQ4_0:
      return &kQ4_0;
    case WeightType::kMXFP4:
      return &kMxfp4;
    case WeightType::kQ4_K:
      return &kQ4_K;
    case WeightType::kQ5_K:
      return &kQ5_K;
    case WeightType::kQ6_K:
      return &kQ6_K;
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
