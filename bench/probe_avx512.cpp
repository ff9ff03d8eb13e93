// AVX-512F loops of colibri_probe (compiled with -mavx512f only).
#include <immintrin.h>

#include "probe_kernels.h"

namespace colibri_probe {

namespace {

// Not _mm512_reduce_add_ps: GCC 12's version trips -Wuninitialized inside
// its own header (_mm256_undefined_pd), which -Werror builds refuse.
inline float hsum(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0;
  for (float x : lanes) s += x;
  return s;
}

// Two 64-byte lines per stream per round and two accumulators per stream: the
// adds never form a chain long enough to limit the loads, so the loop is
// bound by memory alone.
template <int S>
float read_streams(const float* const* streams, size_t n) {
  const float* p[S];
  for (int s = 0; s < S; ++s) p[s] = streams[s];
  __m512 acc[2 * S];
  for (int s = 0; s < 2 * S; ++s) acc[s] = _mm512_setzero_ps();
  for (size_t i = 0; i < n; i += 32) {
    for (int s = 0; s < S; ++s) {
      acc[2 * s] = _mm512_add_ps(acc[2 * s], _mm512_load_ps(p[s] + i));
      acc[2 * s + 1] = _mm512_add_ps(acc[2 * s + 1], _mm512_load_ps(p[s] + i + 16));
    }
  }
  for (int s = 1; s < 2 * S; ++s) acc[0] = _mm512_add_ps(acc[0], acc[s]);
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
  const __m512 vs = _mm512_set1_ps(s);
  if (nontemporal) {
    for (size_t i = 0; i < n; i += 16) {
      _mm512_stream_ps(a + i, _mm512_fmadd_ps(vs, _mm512_load_ps(c + i), _mm512_load_ps(b + i)));
    }
    _mm_sfence();
  } else {
    for (size_t i = 0; i < n; i += 16) {
      _mm512_store_ps(a + i, _mm512_fmadd_ps(vs, _mm512_load_ps(c + i), _mm512_load_ps(b + i)));
    }
  }
}

// 16 accumulators cover FMA latency (4 cycles) x 2 ports with room to spare;
// all 18 live values fit in the 32 zmm registers, so nothing touches memory.
float fma(uint64_t iters) {
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  __m512 a0 = _mm512_set1_ps(0.f), a1 = _mm512_set1_ps(1.f), a2 = _mm512_set1_ps(2.f),
         a3 = _mm512_set1_ps(3.f), a4 = _mm512_set1_ps(4.f), a5 = _mm512_set1_ps(5.f),
         a6 = _mm512_set1_ps(6.f), a7 = _mm512_set1_ps(7.f), a8 = _mm512_set1_ps(8.f),
         a9 = _mm512_set1_ps(9.f), a10 = _mm512_set1_ps(10.f), a11 = _mm512_set1_ps(11.f),
         a12 = _mm512_set1_ps(12.f), a13 = _mm512_set1_ps(13.f), a14 = _mm512_set1_ps(14.f),
         a15 = _mm512_set1_ps(15.f);
  for (uint64_t i = 0; i < iters; ++i) {
    a0 = _mm512_fmadd_ps(a0, x, y);
    a1 = _mm512_fmadd_ps(a1, x, y);
    a2 = _mm512_fmadd_ps(a2, x, y);
    a3 = _mm512_fmadd_ps(a3, x, y);
    a4 = _mm512_fmadd_ps(a4, x, y);
    a5 = _mm512_fmadd_ps(a5, x, y);
    a6 = _mm512_fmadd_ps(a6, x, y);
    a7 = _mm512_fmadd_ps(a7, x, y);
    a8 = _mm512_fmadd_ps(a8, x, y);
    a9 = _mm512_fmadd_ps(a9, x, y);
    a10 = _mm512_fmadd_ps(a10, x, y);
    a11 = _mm512_fmadd_ps(a11, x, y);
    a12 = _mm512_fmadd_ps(a12, x, y);
    a13 = _mm512_fmadd_ps(a13, x, y);
    a14 = _mm512_fmadd_ps(a14, x, y);
    a15 = _mm512_fmadd_ps(a15, x, y);
  }
  const __m512 s = _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                    _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))),
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)),
                    _mm512_add_ps(_mm512_add_ps(a12, a13), _mm512_add_ps(a14, a15))));
  return hsum(s);
}

}  // namespace

Kernels avx512_kernels() { return {"avx512", 512, 16, read, triad, fma}; }

}  // namespace colibri_probe
