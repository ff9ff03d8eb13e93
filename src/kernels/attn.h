// The arithmetic of attention over a KV cache (moe/attention.cpp), per
// instruction set behind one table with a scalar reference: scores of a
// few query rows against a run of cached keys, the softmax's
// exponentials, and the probability-weighted sum of the values. Rows are
// the query heads that share one kv head, so each key and value row is
// read once for all of them. Float32 throughout.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace colibri::kernels {

struct AttnKernels {
  Isa isa = Isa::kScalar;
  // scores[r * ld_scores + s] = scale * (q_r . k_s) for r < rows and
  // s < n_keys; q_r = q + r * ld_q, k_s = k + s * ld_k, dim floats each.
  // accumulate: added to what scores holds (a key stored in two parts).
  void (*scores)(const float* q, int64_t ld_q, int32_t rows, const float* k, int64_t ld_k, int32_t n_keys,
                 int32_t dim, float scale, bool accumulate, float* scores, int64_t ld_scores) = nullptr;
  // x[i] = exp(x[i] - max) for i < n (exp(-inf) = 0); returns their sum.
  float (*exp_sum)(float* x, int32_t n, float max) = nullptr;
  // out[r * ld_out + d] = sum_s p[r * ld_p + s] * v[s * ld_v + d] for
  // r < rows, d < dim, s < n_keys (overwrites out).
  void (*weighted_sum)(const float* p, int64_t ld_p, int32_t rows, const float* v, int64_t ld_v, int32_t n_keys,
                       int32_t dim, float* out, int64_t ld_out) = nullptr;
};

// The table of `isa`, or of the highest supported level below it.
const AttnKernels& attn_kernels(Isa isa);

// Per-level tables (attn_scalar.cpp, attn_avx2.cpp, attn_avx512.cpp).
AttnKernels attn_kernels_scalar();
AttnKernels attn_kernels_avx2();
AttnKernels attn_kernels_avx512();

}  // namespace colibri::kernels
