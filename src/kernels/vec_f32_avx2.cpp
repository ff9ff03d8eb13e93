// AVX2 + FMA level of vec_f32.h. Compiled with -mavx2 -mfma only.
#include <immintrin.h>

#include "kernels/vec_f32.h"

namespace colibri::kernels {

float dot_f32_avx2(const float* a, const float* b, int32_t n) {
  __m256 s0 = _mm256_setzero_ps();
  __m256 s1 = _mm256_setzero_ps();
  int32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  s0 = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float s = _mm_cvtss_f32(h);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy_f32_avx2(float alpha, const float* x, float* y, int32_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace colibri::kernels
