// AVX-512F (+DQ) level of attn.h. Query rows go in blocks of 8, 4 and 1:
// each key and value row is loaded once per block, and a block's 8 dot
// products are reduced together (one transposing fold instead of 8
// horizontal sums). Dimensions off the 16-lane width run masked.

#include "kernels/attn.h"
#include "kernels/avx512_common.h"

namespace colibri::kernels {
namespace {

inline __mmask16 tail_mask(int32_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// Lane sums of 8 vectors: out[i] = sum of a[i]'s 16 lanes.
inline __m256 fold8(const __m512* a) {
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  __m512 c[2];
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]);
    const __m512d y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // c[0]'s 128-bit lanes hold rows 0-3's partial sums, c[1]'s rows 4-7's.
  const __m512 f = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 g = _mm512_shuffle_f32x4(f, f, _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_add_ps(_mm512_extractf32x8_ps(g, 0), _mm512_extractf32x8_ps(g, 1));
}

inline __m128 fold4(const __m512* a) {
  __m512 b[2];
  for (int i = 0; i < 2; ++i) {
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  const __m512d x = _mm512_castps_pd(b[0]);
  const __m512d y = _mm512_castps_pd(b[1]);
  const __m512 c = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  const __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(c, 0), _mm512_extractf32x8_ps(c, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline float fold1(__m512 a) {
  const __m256 h8 = _mm256_add_ps(_mm512_extractf32x8_ps(a, 0), _mm512_extractf32x8_ps(a, 1));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

template <int R>
void scores_block(const float* q, int64_t ld_q, const float* k, int64_t ld_k, int32_t n_keys, int32_t dim,
                  float scale, bool accumulate, float* scores, int64_t ld_scores) {
  const int32_t full = dim & ~15;
  const __mmask16 tail = tail_mask(dim - full);
  for (int32_t s = 0; s < n_keys; ++s) {
    const float* ks = k + s * ld_k;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int32_t d = 0; d < full; d += 16) {
      const __m512 kv = _mm512_loadu_ps(ks + d);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * ld_q + d), kv, acc[r]);
    }
    if (tail != 0) {
      const __m512 kv = _mm512_maskz_loadu_ps(tail, ks + full);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + r * ld_q + full), kv, acc[r]);
      }
    }
    alignas(32) float out[8];
    if constexpr (R == 8) {
      _mm256_store_ps(out, _mm256_mul_ps(fold8(acc), _mm256_set1_ps(scale)));
    } else if constexpr (R == 4) {
      _mm_store_ps(out, _mm_mul_ps(fold4(acc), _mm_set1_ps(scale)));
    } else {
      out[0] = fold1(acc[0]) * scale;
    }
    for (int r = 0; r < R; ++r) {
      float* score = scores + r * ld_scores + s;
      *score = accumulate ? *score + out[r] : out[r];
    }
  }
}

void scores_avx512(const float* q, int64_t ld_q, int32_t rows, const float* k, int64_t ld_k, int32_t n_keys,
                   int32_t dim, float scale, bool accumulate, float* scores, int64_t ld_scores) {
  int32_t r = 0;
  for (; r + 8 <= rows; r += 8) scores_block<8>(q + r * ld_q, ld_q, k, ld_k, n_keys, dim, scale, accumulate, scores + r * ld_scores, ld_scores);
  for (; r + 4 <= rows; r += 4) scores_block<4>(q + r * ld_q, ld_q, k, ld_k, n_keys, dim, scale, accumulate, scores + r * ld_scores, ld_scores);
  for (; r < rows; ++r) scores_block<1>(q + r * ld_q, ld_q, k, ld_k, n_keys, dim, scale, accumulate, scores + r * ld_scores, ld_scores);
}

float exp_sum_avx512(float* x, int32_t n, float max) {
  const __m512 m = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  int32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16_clamped(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 t = tail_mask(n - i);
    const __m512 e = _mm512_maskz_mov_ps(t, exp16_clamped(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, x + i), m)));
    _mm512_mask_storeu_ps(x + i, t, e);
    sum = _mm512_add_ps(sum, e);
  }
  return fold1(sum);
}

// R rows of probabilities against 32 value columns at a time (two
// vectors), so each broadcast probability feeds two FMAs.
template <int R>
void weighted_block(const float* p, int64_t ld_p, const float* v, int64_t ld_v, int32_t n_keys, int32_t dim,
                    float* out, int64_t ld_out) {
  for (int32_t d = 0; d < dim; d += 32) {
    const __mmask16 m0 = dim - d >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(dim - d);
    const __mmask16 m1 = dim - d >= 32 ? static_cast<__mmask16>(0xFFFF) : dim - d > 16 ? tail_mask(dim - d - 16) : 0;
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int32_t s = 0; s < n_keys; ++s) {
      const float* vs = v + s * ld_v + d;
      const __m512 v0 = _mm512_maskz_loadu_ps(m0, vs);
      const __m512 v1 = _mm512_maskz_loadu_ps(m1, vs + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(p[r * ld_p + s]);
        acc0[r] = _mm512_fmadd_ps(w, v0, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(w, v1, acc1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(out + r * ld_out + d, m0, acc0[r]);
      _mm512_mask_storeu_ps(out + r * ld_out + d + 16, m1, acc1[r]);
    }
  }
}

void weighted_sum_avx512(const float* p, int64_t ld_p, int32_t rows, const float* v, int64_t ld_v, int32_t n_keys,
                         int32_t dim, float* out, int64_t ld_out) {
  int32_t r = 0;
  for (; r + 8 <= rows; r += 8) weighted_block<8>(p + r * ld_p, ld_p, v, ld_v, n_keys, dim, out + r * ld_out, ld_out);
  for (; r + 4 <= rows; r += 4) weighted_block<4>(p + r * ld_p, ld_p, v, ld_v, n_keys, dim, out + r * ld_out, ld_out);
  for (; r < rows; ++r) weighted_block<1>(p + r * ld_p, ld_p, v, ld_v, n_keys, dim, out + r * ld_out, ld_out);
}

}  // namespace

AttnKernels attn_kernels_avx512() {
  return AttnKernels{Isa::kAvx512, scores_avx512, exp_sum_avx512, weighted_sum_avx512};
}

}  // namespace colibri::kernels
