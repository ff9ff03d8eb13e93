#include "moe/attention.h"

#include <algorithm>
#include <atomic>
#include <new>
#include <string>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/vec_f32.h"
#include "util/error.h"

namespace colibri {
namespace {

// The heads of one kv head at one query token: their keys and values are
// the same rows, so each row is read once from memory for all of them.
void attend_group(const AttentionArgs& a, const kernels::VecF32& vec, int32_t b, int32_t g, int32_t t,
                  std::vector<float>* scratch) {
  const int32_t rep = a.heads / a.kv_heads;
  const int32_t S = a.kv_len;
  const int64_t position = static_cast<int64_t>(a.kv_len) - a.q_len + t;
  int32_t lo = 0;
  int32_t hi = S;  // positions [lo, hi) are candidates; the mask filters further
  const uint8_t* mask = nullptr;
  const float* add = nullptr;
  if (a.mask != nullptr) {
    mask = a.mask + b * a.mask_stride[0] + t * a.mask_stride[1];
  } else if (a.additive_mask != nullptr) {
    add = a.additive_mask + b * a.mask_stride[0] + t * a.mask_stride[1];
  } else {
    hi = static_cast<int32_t>(std::min<int64_t>(position + 1, S));
    if (a.window > 0) lo = static_cast<int32_t>(std::max<int64_t>(0, position - a.window + 1));
  }
  scratch->resize(static_cast<size_t>(rep) * static_cast<size_t>(std::max(S, 1)));
  float* scores = scratch->data();
  const float* k = a.k + b * a.k_stride[0] + g * a.k_stride[1];
  const float* v = a.v + b * a.v_stride[0] + g * a.v_stride[1];
  const float* q0 = a.q + b * a.q_stride[0] + t * a.q_stride[2];
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  for (int32_t s = lo; s < hi; ++s) {
    const bool seen = mask == nullptr || mask[s * a.mask_stride[2]] != 0;
    const float* ks = k + s * a.k_stride[2];
    for (int32_t j = 0; j < rep; ++j) {
      const float* qh = q0 + static_cast<int64_t>(g * rep + j) * a.q_stride[1];
      float score = seen ? vec.dot(qh, ks, a.qk_dim) * a.scale : kNegInf;
      if (add != nullptr) score += add[s * a.mask_stride[2]];
      scores[static_cast<size_t>(j) * S + s] = score;
    }
  }
  float* out_t = a.out + (static_cast<int64_t>(b) * a.q_len + t) * a.heads * a.v_dim;
  float inv[64];
  float* inv_sum = rep <= 64 ? inv : nullptr;
  std::vector<float> inv_big;
  if (inv_sum == nullptr) {
    inv_big.resize(static_cast<size_t>(rep));
    inv_sum = inv_big.data();
  }
  for (int32_t j = 0; j < rep; ++j) {
    const int32_t h = g * rep + j;
    float* row = scores + static_cast<size_t>(j) * S;
    float m = a.sinks != nullptr ? a.sinks[h] : kNegInf;
    for (int32_t s = lo; s < hi; ++s) m = std::max(m, row[s]);
    double sum = 0.0;
    if (m != kNegInf) {
      for (int32_t s = lo; s < hi; ++s) {
        row[s] = row[s] == kNegInf ? 0.0f : std::exp(row[s] - m);
        sum += row[s];
      }
      if (a.sinks != nullptr) sum += std::exp(a.sinks[h] - m);
    } else {
      for (int32_t s = lo; s < hi; ++s) row[s] = 0.0f;
    }
    inv_sum[j] = sum > 0.0 ? static_cast<float>(1.0 / sum) : 0.0f;
    std::fill(out_t + static_cast<int64_t>(h) * a.v_dim, out_t + static_cast<int64_t>(h + 1) * a.v_dim, 0.0f);
  }
  for (int32_t s = lo; s < hi; ++s) {
    const float* vs = v + s * a.v_stride[2];
    for (int32_t j = 0; j < rep; ++j) {
      const float p = scores[static_cast<size_t>(j) * S + s];
      if (p != 0.0f) vec.axpy(p, vs, out_t + static_cast<int64_t>(g * rep + j) * a.v_dim, a.v_dim);
    }
  }
  for (int32_t j = 0; j < rep; ++j) {
    float* o = out_t + static_cast<int64_t>(g * rep + j) * a.v_dim;
    for (int32_t d = 0; d < a.v_dim; ++d) o[d] *= inv_sum[j];
  }
}

}  // namespace

void attention(const AttentionArgs& a, kernels::Isa isa, ThreadPool* pool) {
  const kernels::VecF32& vec = kernels::vec_f32(isa);
  const int64_t items = static_cast<int64_t>(a.batch) * a.kv_heads * a.q_len;
  if (items == 0) return;
  const auto run_item = [&](int64_t item, std::vector<float>* scratch) {
    const int32_t t = static_cast<int32_t>(item % a.q_len);
    const int64_t bg = item / a.q_len;
    attend_group(a, vec, static_cast<int32_t>(bg / a.kv_heads), static_cast<int32_t>(bg % a.kv_heads), t, scratch);
  };
  // One score buffer per thread, kept between calls: a decode loop calls
  // this every layer of every token.
  static thread_local std::vector<float> scratch;
  if (pool == nullptr || pool->size() == 1 || items == 1) {
    for (int64_t i = 0; i < items; ++i) run_item(i, &scratch);
    return;
  }
  // Pool jobs must not throw: a worker that cannot grow its buffer says so
  // and the call fails after the others finish.
  std::atomic<bool> out_of_memory{false};
  pool->parallel_for(items, 0, [&](int64_t item, int) {
    try {
      run_item(item, &scratch);
    } catch (const std::bad_alloc&) {
      out_of_memory.store(true, std::memory_order_relaxed);
    }
  });
  if (out_of_memory.load()) fail(Status::kOutOfMemory, "attention: out of memory for the scores of " + std::to_string(a.kv_len) + " positions");
}

}  // namespace colibri
