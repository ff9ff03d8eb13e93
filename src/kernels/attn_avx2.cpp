// AVX2 + FMA level of attn.h: query rows in blocks of 4 and 1 (each key
// and value row loaded once per block, a block's dot products reduced
// together with hadd); dimensions off the 8-lane width finish in scalar.
// No calls into the standard library: at -O0 its inline functions would be
// emitted here with AVX2 code (tests/isa_linkage.sh).
#include "kernels/attn.h"
#include "kernels/avx2_common.h"
#include "kernels/x86_intrinsics.h"

namespace colibri::kernels {
namespace {

inline __m128 fold4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline float fold1(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

template <int R>
void scores_block(const float* q, int64_t ld_q, const float* k, int64_t ld_k, int32_t n_keys, int32_t dim,
                  float scale, bool accumulate, float* scores, int64_t ld_scores) {
  const int32_t full = dim & ~7;
  for (int32_t s = 0; s < n_keys; ++s) {
    const float* ks = k + s * ld_k;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int32_t d = 0; d < full; d += 8) {
      const __m256 kv = _mm256_loadu_ps(ks + d);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ld_q + d), kv, acc[r]);
    }
    float sum[R];
    if constexpr (R == 4) {
      _mm_storeu_ps(sum, fold4(acc));
    } else {
      sum[0] = fold1(acc[0]);
    }
    for (int r = 0; r < R; ++r) {
      for (int32_t d = full; d < dim; ++d) sum[r] += q[r * ld_q + d] * ks[d];
      float* score = scores + r * ld_scores + s;
      *score = accumulate ? *score + sum[r] * scale : sum[r] * scale;
    }
  }
}

void scores_avx2(const float* q, int64_t ld_q, int32_t rows, const float* k, int64_t ld_k, int32_t n_keys,
                 int32_t dim, float scale, bool accumulate, float* scores, int64_t ld_scores) {
  int32_t r = 0;
  for (; r + 4 <= rows; r += 4) scores_block<4>(q + r * ld_q, ld_q, k, ld_k, n_keys, dim, scale, accumulate, scores + r * ld_scores, ld_scores);
  for (; r < rows; ++r) scores_block<1>(q + r * ld_q, ld_q, k, ld_k, n_keys, dim, scale, accumulate, scores + r * ld_scores, ld_scores);
}

float exp_sum_avx2(float* x, int32_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {
    // The tail through the same vector exp (no libm call: an inline
    // std::exp compiled here could be the copy scalar code links to), the
    // unused lanes far below exp's range, so they add 0.
    alignas(32) float tail[8];
    for (int32_t j = 0; j < 8; ++j) tail[j] = i + j < n ? x[i + j] - max : -1e30f;
    const __m256 e = exp_ps(_mm256_load_ps(tail));
    _mm256_store_ps(tail, e);
    for (int32_t j = 0; i + j < n; ++j) x[i + j] = tail[j];
    acc = _mm256_add_ps(acc, e);
  }
  return fold1(acc);
}

template <int R>
void weighted_block(const float* p, int64_t ld_p, const float* v, int64_t ld_v, int32_t n_keys, int32_t d0,
                    float* out, int64_t ld_out) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int32_t s = 0; s < n_keys; ++s) {
    const __m256 v0 = _mm256_loadu_ps(v + s * ld_v + d0);
    const __m256 v1 = _mm256_loadu_ps(v + s * ld_v + d0 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * ld_p + s);
      acc0[r] = _mm256_fmadd_ps(w, v0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w, v1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ld_out + d0, acc0[r]);
    _mm256_storeu_ps(out + r * ld_out + d0 + 8, acc1[r]);
  }
}

void weighted_sum_avx2(const float* p, int64_t ld_p, int32_t rows, const float* v, int64_t ld_v, int32_t n_keys,
                       int32_t dim, float* out, int64_t ld_out) {
  const int32_t full = dim & ~15;
  for (int32_t r = 0; r < rows;) {
    const int32_t block = rows - r >= 4 ? 4 : 1;
    for (int32_t d = 0; d < full; d += 16) {
      if (block == 4) {
        weighted_block<4>(p + r * ld_p, ld_p, v, ld_v, n_keys, d, out + r * ld_out, ld_out);
      } else {
        weighted_block<1>(p + r * ld_p, ld_p, v, ld_v, n_keys, d, out + r * ld_out, ld_out);
      }
    }
    for (int32_t i = 0; i < block; ++i) {
      float* o = out + (r + i) * ld_out;
      for (int32_t d = full; d < dim; ++d) o[d] = 0.0f;
      for (int32_t s = 0; s < n_keys; ++s) {
        const float w = p[(r + i) * ld_p + s];
        for (int32_t d = full; d < dim; ++d) o[d] += w * v[s * ld_v + d];
      }
    }
    r += block;
  }
}

}  // namespace

AttnKernels attn_kernels_avx2() { return AttnKernels{Isa::kAvx2, scores_avx2, exp_sum_avx2, weighted_sum_avx2}; }

}  // namespace colibri::kernels
