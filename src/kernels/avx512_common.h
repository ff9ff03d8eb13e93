// Small AVX-512 building blocks shared by the prefill kernels
// (ffn_avx512_gemm.cpp, ffn_avx512_tokens.cpp, ffn_amx.cpp,
// ffn_avx512_bf16.cpp) and attention (attn_avx512.cpp). Include ONLY
// from translation units compiled with AVX-512 flags.
//
// Everything is in an anonymous namespace on purpose: each including TU
// gets its own internal copy, compiled with its own flags, so the linker can
// never merge one TU's copy into code that runs on a CPU without AVX-512
// (which an ordinary inline function, with vague linkage, would allow).
#pragma once

#include <stdlib.h>

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"
#include "kernels/x86_intrinsics.h"

namespace colibri::kernels {
namespace {

// 16 consecutive weights of one row from element k, widened to fp32.
inline __m512 load16(const void* row, size_t k, WeightType t) {
  switch (t) {
    case WeightType::kF32:
      return _mm512_loadu_ps(static_cast<const float*>(row) + k);
    case WeightType::kF16:
      return _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + k)));
    case WeightType::kBF16: {
      const __m512i wide = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + k)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    default:  // block formats run the tables of ffn_quant.cpp
      break;
  }
  return _mm512_setzero_ps();
}

// In-register transpose of a 16x16 block of 32-bit elements: r[i] holds row
// i on entry and column i on exit.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r now holds, per 128-bit lane, 4x4 transposed sub-blocks; combine lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// exp(x) for 16 lanes: 2^(x log2 e) split into an integer power, applied
// with vscalefps (which saturates to 0 / inf instead of wrapping), and a
// degree-6 polynomial for 2^f on f in [-0.5, 0.5] (relative error ~2e-7, the
// level of fp32 rounding). A scalar expf per element cost as much as the
// FMAs themselves for d_model around 1024.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  // Taylor coefficients of 2^f = e^(f ln 2).
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// exp for 16 lanes, exact at the ends: n = round(x log2 e), r = x - n ln 2 (two-part ln 2),
// Cephes' degree-7 polynomial on |r| <= ln2/2 (about 1 ulp), scaled by 2^n
// with vscalefps, which also gives inf / 0 for large |x|. The clamp keeps
// r finite for infinite x (exp(+inf) = inf, exp(-inf) = 0); NaN passes
// through (min/max return their second operand when it is NaN).
inline __m512 exp16_clamped(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 q = _mm512_set1_ps(1.9875691500e-4f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(q, r2, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(e, n);
}

// silu(g) * u = g / (1 + exp(-g)) * u. For g very negative exp(-g) is inf
// and the quotient is -0, the limit.
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

}  // namespace
}  // namespace colibri::kernels
