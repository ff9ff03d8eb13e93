// AVX2 + FMA loops of colibri_probe (compiled with -mavx2 -mfma only).
#include <immintrin.h>

#include "probe_kernels.h"

namespace colibri_probe {

namespace {

float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Same access pattern as the AVX-512 loop: two 64-byte lines per stream per
// round, here as four 32-byte loads, one accumulator per line.
template <int S>
float read_streams(const float* const* streams, size_t n) {
  const float* p[S];
  for (int s = 0; s < S; ++s) p[s] = streams[s];
  __m256 acc[2 * S];
  for (int s = 0; s < 2 * S; ++s) acc[s] = _mm256_setzero_ps();
  for (size_t i = 0; i < n; i += 32) {
    for (int s = 0; s < S; ++s) {
      acc[2 * s] = _mm256_add_ps(acc[2 * s], _mm256_add_ps(_mm256_load_ps(p[s] + i), _mm256_load_ps(p[s] + i + 8)));
      acc[2 * s + 1] =
          _mm256_add_ps(acc[2 * s + 1], _mm256_add_ps(_mm256_load_ps(p[s] + i + 16), _mm256_load_ps(p[s] + i + 24)));
    }
  }
  for (int s = 1; s < 2 * S; ++s) acc[0] = _mm256_add_ps(acc[0], acc[s]);
  return hsum(acc[0]);
}

float read(const float* const* streams, int n_streams, size_t n) {
  switch (n_streams) {
    case 1: return read_streams<1>(streams, n);
    case 2: return read_streams<2>(streams, n);
    case 4: return read_streams<4>(streams, n);
    default: return read_streams<8>(streams, n);
  }
}

void triad(float* a, const float* b, const float* c, float s, size_t n, bool nontemporal) {
  const __m256 vs = _mm256_set1_ps(s);
  if (nontemporal) {
    for (size_t i = 0; i < n; i += 8) {
      _mm256_stream_ps(a + i, _mm256_fmadd_ps(vs, _mm256_load_ps(c + i), _mm256_load_ps(b + i)));
    }
    _mm_sfence();
  } else {
    for (size_t i = 0; i < n; i += 8) {
      _mm256_store_ps(a + i, _mm256_fmadd_ps(vs, _mm256_load_ps(c + i), _mm256_load_ps(b + i)));
    }
  }
}

// Only 16 ymm registers: 12 accumulators plus the two operands fit without
// spilling, and 12 still cover FMA latency x 2 ports on every AVX2 core.
float fma(uint64_t iters) {
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  __m256 a0 = _mm256_set1_ps(0.f), a1 = _mm256_set1_ps(1.f), a2 = _mm256_set1_ps(2.f),
         a3 = _mm256_set1_ps(3.f), a4 = _mm256_set1_ps(4.f), a5 = _mm256_set1_ps(5.f),
         a6 = _mm256_set1_ps(6.f), a7 = _mm256_set1_ps(7.f), a8 = _mm256_set1_ps(8.f),
         a9 = _mm256_set1_ps(9.f), a10 = _mm256_set1_ps(10.f), a11 = _mm256_set1_ps(11.f);
  for (uint64_t i = 0; i < iters; ++i) {
    a0 = _mm256_fmadd_ps(a0, x, y);
    a1 = _mm256_fmadd_ps(a1, x, y);
    a2 = _mm256_fmadd_ps(a2, x, y);
    a3 = _mm256_fmadd_ps(a3, x, y);
    a4 = _mm256_fmadd_ps(a4, x, y);
    a5 = _mm256_fmadd_ps(a5, x, y);
    a6 = _mm256_fmadd_ps(a6, x, y);
    a7 = _mm256_fmadd_ps(a7, x, y);
    a8 = _mm256_fmadd_ps(a8, x, y);
    a9 = _mm256_fmadd_ps(a9, x, y);
    a10 = _mm256_fmadd_ps(a10, x, y);
    a11 = _mm256_fmadd_ps(a11, x, y);
  }
  const __m256 s = _mm256_add_ps(
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                    _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))),
      _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
  return hsum(s);
}

}  // namespace

Kernels avx2_kernels() { return {"avx2", 256, 12, read, triad, fma}; }

}  // namespace colibri_probe
