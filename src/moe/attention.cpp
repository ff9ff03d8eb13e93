#include "moe/attention.h"

#include <algorithm>
#include <atomic>
#include <new>
#include <string>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attn.h"
#include "util/error.h"

namespace colibri {
namespace {

// The heads of one kv head at one query token: their keys and values are
// the same rows, so the kernels read each row once for all of them.
void attend_group(const AttentionArgs& a, const kernels::AttnKernels& kern, int32_t b, int32_t g, int32_t t,
                  std::vector<float>* scratch) {
  const int32_t rep = a.heads / a.kv_heads;
  const int64_t position = static_cast<int64_t>(a.kv_len) - a.q_len + t;
  int32_t lo = 0;
  int32_t hi = a.kv_len;  // positions [lo, hi) are candidates; a mask filters further
  const uint8_t* mask = nullptr;
  const float* add = nullptr;
  if (a.mask != nullptr) {
    mask = a.mask + b * a.mask_stride[0] + t * a.mask_stride[1];
  } else if (a.additive_mask != nullptr) {
    add = a.additive_mask + b * a.mask_stride[0] + t * a.mask_stride[1];
  } else {
    hi = static_cast<int32_t>(std::min<int64_t>(position + 1, a.kv_len));
    if (a.window > 0) lo = static_cast<int32_t>(std::max<int64_t>(0, position - a.window + 1));
  }
  const int32_t n = std::max(hi - lo, 0);
  float* out = a.out + (static_cast<int64_t>(b) * a.q_len + t) * a.heads * a.v_dim +
               static_cast<int64_t>(g) * rep * a.v_dim;
  scratch->resize(static_cast<size_t>(rep) * static_cast<size_t>(std::max(n, 1)) + static_cast<size_t>(rep));
  float* scores = scratch->data();
  float* inv_sum = scores + static_cast<size_t>(rep) * static_cast<size_t>(std::max(n, 1));
  const float* q = a.q + b * a.q_stride[0] + static_cast<int64_t>(g) * rep * a.q_stride[1] + t * a.q_stride[2];
  const float* k = a.k + b * a.k_stride[0] + g * a.k_stride[1] + lo * a.k_stride[2];
  const float* v = a.v + b * a.v_stride[0] + g * a.v_stride[1] + lo * a.v_stride[2];
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  kern.scores(q, a.q_stride[1], rep, k, a.k_stride[2], n, a.qk_dim, a.scale, false, scores, n);
  if (a.k2 != nullptr) {
    const float* k2 = a.k2 + b * a.k2_stride[0] + g * a.k2_stride[1] + lo * a.k2_stride[2];
    kern.scores(q + a.qk_dim, a.q_stride[1], rep, k2, a.k2_stride[2], n, a.qk2_dim, a.scale, true, scores, n);
  }
  for (int32_t j = 0; j < rep; ++j) {
    float* row = scores + static_cast<size_t>(j) * n;
    if (mask != nullptr) {
      for (int32_t s = 0; s < n; ++s) {
        if (mask[(lo + s) * a.mask_stride[2]] == 0) row[s] = kNegInf;
      }
    } else if (add != nullptr) {
      for (int32_t s = 0; s < n; ++s) row[s] += add[(lo + s) * a.mask_stride[2]];
    }
    const int32_t h = g * rep + j;
    float m = a.sinks != nullptr ? a.sinks[h] : kNegInf;
    for (int32_t s = 0; s < n; ++s) m = std::max(m, row[s]);
    if (m == kNegInf) {
      // Nothing visible: zero weights, so the sum below gives zeros.
      std::fill(row, row + n, 0.0f);
      inv_sum[j] = 0.0f;
      continue;
    }
    float sum = kern.exp_sum(row, n, m);
    if (a.sinks != nullptr) sum += std::exp(a.sinks[h] - m);
    inv_sum[j] = 1.0f / sum;
  }
  kern.weighted_sum(scores, n, rep, v, a.v_stride[2], n, a.v_dim, out, a.v_dim);
  for (int32_t j = 0; j < rep; ++j) {
    float* o = out + static_cast<int64_t>(j) * a.v_dim;
    for (int32_t d = 0; d < a.v_dim; ++d) o[d] *= inv_sum[j];
  }
}

}  // namespace

void attention(const AttentionArgs& a, kernels::Isa isa, ThreadPool* pool) {
  const kernels::AttnKernels& kern = kernels::attn_kernels(isa);
  const int64_t items = static_cast<int64_t>(a.batch) * a.kv_heads * a.q_len;
  if (items == 0) return;
  const auto run_item = [&](int64_t item, std::vector<float>* scratch) {
    const int32_t t = static_cast<int32_t>(item % a.q_len);
    const int64_t bg = item / a.q_len;
    attend_group(a, kern, static_cast<int32_t>(bg / a.kv_heads), static_cast<int32_t>(bg % a.kv_heads), t, scratch);
  };
  // One score buffer per pool thread for this call (a thread_local one
  // would outlive the call in the process-wide pool's workers).
  const int n_threads = pool == nullptr ? 1 : pool->size();
  std::vector<std::vector<float>> scratch(static_cast<size_t>(n_threads));
  if (pool == nullptr || n_threads == 1 || items == 1) {
    for (int64_t i = 0; i < items; ++i) run_item(i, &scratch[0]);
    return;
  }
  // Pool jobs must not throw: a worker that cannot grow its buffer says so
  // and the call fails after the others finish.
  std::atomic<bool> out_of_memory{false};
  pool->parallel_for(items, 0, [&](int64_t item, int thread) {
    try {
      run_item(item, &scratch[static_cast<size_t>(thread)]);
    } catch (const std::bad_alloc&) {
      out_of_memory.store(true, std::memory_order_relaxed);
    }
  });
  if (out_of_memory.load()) fail(Status::kOutOfMemory, "attention: out of memory for the scores of " + std::to_string(a.kv_len) + " positions");
}

}  // namespace colibri
