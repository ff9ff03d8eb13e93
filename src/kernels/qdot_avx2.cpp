// AVX2 integer dot-product kernels (quant_dot.h), built with -mavx2 -mfma
// -mf16c, for CPUs without AVX-VNNI (qdot_avxvnni.cpp compiles the same
// kernels, qdot_avx2_impl.h, with vpdpbusd). The u8 x s8 products go
// through vpmaddubsw into int16 pair sums, as many added in int16 as stay
// below 2^15 for the codes' range, then vpmaddwd by ones into int32.
// fp8_e4m3 takes the fp32 kernel of qdot_fp8_impl.h (no integer products).
//
// Everything lives in an anonymous namespace (tests/isa_linkage.sh).
#include "kernels/qdot_avx2_impl.h"
#include "kernels/qdot_ternary_impl.h"
#include "kernels/qdot_fp8_impl.h"

namespace colibri::kernels {
namespace {

struct MaddubsDot {
  static constexpr bool kSaturatesInt16 = true;

  template <int K, int kMaxCode>
  static __m256i dot(__m256i acc, const __m256i* u, const __m256i* s) {
    // vpmaddubsw saturates each pair sum to int16 and so would a sum of
    // them: kPerSum pair sums of codes up to kMaxCode against |s| <= 127
    // stay below 2^15 (q4_0: 8, q4_k / q5_k: 4, q6_k: 2, q8_0's |w|: 1).
    constexpr int kPerSum = 32767 / (2 * kMaxCode * 127);
    static_assert(kPerSum >= 1, "the codes' pair products do not fit int16");
    const __m256i ones = _mm256_set1_epi16(1);
    for (int k0 = 0; k0 < K; k0 += kPerSum) {
      __m256i s16 = _mm256_maddubs_epi16(u[k0], s[k0]);
      for (int k = k0 + 1; k < K && k < k0 + kPerSum; ++k) {
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[k], s[k]));
      }
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s16, ones));
    }
    return acc;
  }

  // With the pair sums' int16 stage in registers, 4 tokens keep codes and
  // accumulators in the 16 ymm.
  static constexpr int max_tokens(WeightType) { return 4; }
};

const QuantDotKernels kQ8_0 = {"q8_0-avx2", quantize_act, dot_rows_32<MaddubsDot, Block32::kQ8_0>};
const QuantDotKernels kQ4_0 = {"q4_0-avx2", quantize_act, dot_rows_32<MaddubsDot, Block32::kQ4_0>};
const QuantDotKernels kMxfp4 = {"mxfp4-avx2", quantize_act, dot_rows_32<MaddubsDot, Block32::kMxfp4>};
const QuantDotKernels kQ4_1 = {"q4_1-avx2", quantize_act, dot_rows_32<MaddubsDot, Block32::kQ4_1>};
const QuantDotKernels kQ5_0 = {"q5_0-avx2", quantize_act, dot_rows_32<MaddubsDot, Block32::kQ5_0>};
const QuantDotKernels kQ5_1 = {"q5_1-avx2", quantize_act, dot_rows_32<MaddubsDot, Block32::kQ5_1>};
const QuantDotKernels kIq4Nl = {"iq4_nl-avx2", quantize_act, dot_rows_32<MaddubsDot, Block32::kIq4Nl>};
const QuantDotKernels kIq4Xs = {"iq4_xs-avx2", quantize_act, dot_rows_32<MaddubsDot, Block32::kIq4Xs>};
const QuantDotKernels kQ2_K = {"q2_k-avx2", quantize_act, dot_rows_k<MaddubsDot, Kind::kQ2K>};
const QuantDotKernels kQ3_K = {"q3_k-avx2", quantize_act, dot_rows_k<MaddubsDot, Kind::kQ3K>};
const QuantDotKernels kIq2Xxs = {"iq2_xxs-avx2", quantize_act, dot_rows_grid<MaddubsDot, Grid::kIq2Xxs>};
const QuantDotKernels kIq3Xxs = {"iq3_xxs-avx2", quantize_act, dot_rows_grid<MaddubsDot, Grid::kIq3Xxs>};
const QuantDotKernels kIq1S = {"iq1_s-avx2", quantize_act, dot_rows_grid<MaddubsDot, Grid::kIq1S>};
const QuantDotKernels kIq1M = {"iq1_m-avx2", quantize_act, dot_rows_grid<MaddubsDot, Grid::kIq1M>};
const QuantDotKernels kIq2Xs = {"iq2_xs-avx2", quantize_act, dot_rows_grid<MaddubsDot, Grid::kIq2Xs>};
const QuantDotKernels kIq2S = {"iq2_s-avx2", quantize_act, dot_rows_grid<MaddubsDot, Grid::kIq2S>};
const QuantDotKernels kIq3S = {"iq3_s-avx2", quantize_act, dot_rows_grid<MaddubsDot, Grid::kIq3S>};
const QuantDotKernels kQ4_K = {"q4_k-avx2", quantize_act, dot_rows_k<MaddubsDot, Kind::kQ4K>};
const QuantDotKernels kQ5_K = {"q5_k-avx2", quantize_act, dot_rows_k<MaddubsDot, Kind::kQ5K>};
const QuantDotKernels kQ6_K = {"q6_k-avx2", quantize_act, dot_rows_k<MaddubsDot, Kind::kQ6K>};
const QuantDotKernels kFp8E4M3 = {"fp8_e4m3-avx2", fp8::copy_act, fp8::dot_rows<Fp8Ymm>};

const QuantDotKernels kTq1_0 = {"tq1_0-avx2", quantize_act, dot_rows_ternary<MaddubsDot, Ternary::kTq1>};
const QuantDotKernels kTq2_0 = {"tq2_0-avx2", quantize_act, dot_rows_ternary<MaddubsDot, Ternary::kTq2>};

}  // namespace

// Compiled once per far prefetch hint (quant_dot.h).
namespace COLIBRI_QDOT_VARIANT {

const QuantDotKernels* quant_dot_avx2(WeightType t) {
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
