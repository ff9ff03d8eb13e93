#include <cmath>

#include "kernels/attn.h"

namespace colibri::kernels {
namespace {

void scores_scalar(const float* q, int64_t ld_q, int32_t rows, const float* k, int64_t ld_k, int32_t n_keys,
                   int32_t dim, float scale, bool accumulate, float* scores, int64_t ld_scores) {
  for (int32_t s = 0; s < n_keys; ++s) {
    const float* ks = k + s * ld_k;
    for (int32_t r = 0; r < rows; ++r) {
      const float* qr = q + r * ld_q;
      // Four partial sums, as the SIMD levels keep several accumulators.
      float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int32_t i = 0;
      for (; i + 4 <= dim; i += 4) {
        for (int j = 0; j < 4; ++j) p[j] += qr[i + j] * ks[i + j];
      }
      for (; i < dim; ++i) p[0] += qr[i] * ks[i];
      const float score = ((p[0] + p[1]) + (p[2] + p[3])) * scale;
      scores[r * ld_scores + s] = accumulate ? scores[r * ld_scores + s] + score : score;
    }
  }
}

float exp_sum_scalar(float* x, int32_t n, float max) {
  float sum = 0.0f;
  for (int32_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  return sum;
}

void weighted_sum_scalar(const float* p, int64_t ld_p, int32_t rows, const float* v, int64_t ld_v, int32_t n_keys,
                         int32_t dim, float* out, int64_t ld_out) {
  for (int32_t r = 0; r < rows; ++r) {
    float* o = out + r * ld_out;
    for (int32_t d = 0; d < dim; ++d) o[d] = 0.0f;
    for (int32_t s = 0; s < n_keys; ++s) {
      const float w = p[r * ld_p + s];
      if (w == 0.0f) continue;
      const float* vs = v + s * ld_v;
      for (int32_t d = 0; d < dim; ++d) o[d] += w * vs[d];
    }
  }
}

}  // namespace

AttnKernels attn_kernels_scalar() { return AttnKernels{Isa::kScalar, scores_scalar, exp_sum_scalar, weighted_sum_scalar}; }

const AttnKernels& attn_kernels(Isa isa) {
  static const AttnKernels scalar = attn_kernels_scalar();
#if defined(COLIBRI_HAVE_X86_KERNELS)
  static const AttnKernels avx2 = attn_kernels_avx2();
  static const AttnKernels avx512 = attn_kernels_avx512();
  if (isa > detect_isa()) isa = detect_isa();
  if (isa >= Isa::kAvx512) return avx512;
  if (isa >= Isa::kAvx2) return avx2;
#else
  (void)isa;
#endif
  return scalar;
}

}  // namespace colibri::kernels
