// vdpbf16ps peak of colibri_probe (compiled with -mavx512f -mavx512bf16; only
// called after CPUID reported AVX512_BF16).
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

}  // namespace

float bf16_dot_avx512(uint64_t iters) {
  // Each vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32
  // lanes: 64 FLOP counted as 2 per pair, as a bf16 GEMM's FLOPs are.
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f));
  const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-6f), _mm512_set1_ps(1e-6f));
  __m512 a0 = _mm512_set1_ps(0.f), a1 = _mm512_set1_ps(1.f), a2 = _mm512_set1_ps(2.f),
         a3 = _mm512_set1_ps(3.f), a4 = _mm512_set1_ps(4.f), a5 = _mm512_set1_ps(5.f),
         a6 = _mm512_set1_ps(6.f), a7 = _mm512_set1_ps(7.f), a8 = _mm512_set1_ps(8.f),
         a9 = _mm512_set1_ps(9.f), a10 = _mm512_set1_ps(10.f), a11 = _mm512_set1_ps(11.f),
         a12 = _mm512_set1_ps(12.f), a13 = _mm512_set1_ps(13.f), a14 = _mm512_set1_ps(14.f),
         a15 = _mm512_set1_ps(15.f);
  for (uint64_t i = 0; i < iters; ++i) {
    a0 = _mm512_dpbf16_ps(a0, x, y);
    a1 = _mm512_dpbf16_ps(a1, x, y);
    a2 = _mm512_dpbf16_ps(a2, x, y);
    a3 = _mm512_dpbf16_ps(a3, x, y);
    a4 = _mm512_dpbf16_ps(a4, x, y);
    a5 = _mm512_dpbf16_ps(a5, x, y);
    a6 = _mm512_dpbf16_ps(a6, x, y);
    a7 = _mm512_dpbf16_ps(a7, x, y);
    a8 = _mm512_dpbf16_ps(a8, x, y);
    a9 = _mm512_dpbf16_ps(a9, x, y);
    a10 = _mm512_dpbf16_ps(a10, x, y);
    a11 = _mm512_dpbf16_ps(a11, x, y);
    a12 = _mm512_dpbf16_ps(a12, x, y);
    a13 = _mm512_dpbf16_ps(a13, x, y);
    a14 = _mm512_dpbf16_ps(a14, x, y);
    a15 = _mm512_dpbf16_ps(a15, x, y);
  }
  const __m512 s = _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                    _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))),
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)),
                    _mm512_add_ps(_mm512_add_ps(a12, a13), _mm512_add_ps(a14, a15))));
  return hsum(s);
}

}  // namespace colibri_probe
