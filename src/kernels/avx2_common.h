// Small AVX2 + FMA building blocks shared by attn_avx2.cpp and
// ffn_avx2.cpp. Include ONLY from translation units compiled with AVX2 and
// FMA flags. Everything is in an anonymous namespace on purpose (see
// avx512_common.h): each including TU gets its own internal copy.
#pragma once

#include "kernels/x86_intrinsics.h"

namespace colibri::kernels {
namespace {

// exp for 8 lanes: as attn_avx512.cpp's exp_ps, with 2^n built in the
// exponent field; 0 below -87.34, infinity above 88.38, NaN in gives
// a finite value (callers keep NaN through their other operands).
inline __m256 exp_ps(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365448f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365448f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  // n in [-126, 128]: 2^n as a float's exponent field; n = 128 (x clamped
  // at 88.38) gives the field of infinity, exp's limit for large x.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

}  // namespace
}  // namespace colibri::kernels
