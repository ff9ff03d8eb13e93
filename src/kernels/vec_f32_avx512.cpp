// AVX-512F (+DQ for the fold) level of vec_f32.h; tails run masked, so no scalar loop.
#include <immintrin.h>

#include "kernels/vec_f32.h"

namespace colibri::kernels {

float dot_f32_avx512(const float* a, const float* b, int32_t n) {
  __m512 s0 = _mm512_setzero_ps();
  __m512 s1 = _mm512_setzero_ps();
  int32_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s1);
  }
  // GCC 12's _mm512_reduce_add_ps reads an uninitialised register in its
  // header (-Wuninitialized); fold by hand instead.
  const __m512 s = _mm512_add_ps(s0, s1);
  __m256 h8 = _mm256_add_ps(_mm512_extractf32x8_ps(s, 0), _mm512_extractf32x8_ps(s, 1));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

void axpy_f32_avx512(float alpha, const float* x, float* y, int32_t n) {
  const __m512 a = _mm512_set1_ps(alpha);
  int32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

}  // namespace colibri::kernels
