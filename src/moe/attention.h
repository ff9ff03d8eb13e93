// Scaled dot-product attention of a few query tokens over a KV cache, the
// step every decode token takes in every layer: grouped-query heads, a
// causal or explicit mask, a sliding window, per-head sink logits
// (gpt-oss). Float32 in and out; the sums in float32 with the softmax's
// maximum subtracted first, as PyTorch's kernels do.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"
#include "runtime/thread_pool.h"

namespace colibri {

struct AttentionArgs {
  int32_t batch = 0;
  int32_t heads = 0;     // query heads
  int32_t kv_heads = 0;  // divides heads; head h reads kv head h / (heads / kv_heads)
  int32_t q_len = 0;     // query tokens: the last q_len positions of the cache
  int32_t kv_len = 0;    // positions in the cache, the new ones included
  int32_t qk_dim = 0;
  int32_t v_dim = 0;
  // Element strides between batches, heads and tokens; the last dimension
  // is contiguous. Strides of 0 broadcast.
  const float* q = nullptr;  // [batch][heads][q_len][qk_dim]
  int64_t q_stride[3] = {0, 0, 0};
  const float* k = nullptr;  // [batch][kv_heads][kv_len][qk_dim]
  int64_t k_stride[3] = {0, 0, 0};
  const float* v = nullptr;  // [batch][kv_heads][kv_len][v_dim]
  int64_t v_stride[3] = {0, 0, 0};
  // A key stored in two parts (DeepSeek's latent and rope parts, cached
  // apart): q rows hold qk_dim + qk2_dim floats, the last qk2_dim against
  // k2 [batch][kv_heads][kv_len][qk2_dim]. nullptr / 0: one part.
  const float* k2 = nullptr;
  int64_t k2_stride[3] = {0, 0, 0};
  int32_t qk2_dim = 0;
  // Nonzero where query t may see position s: [batch][q_len][kv_len],
  // shared by the heads. nullptr: causal, query t at position
  // kv_len - q_len + t sees positions up to its own.
  const uint8_t* mask = nullptr;
  // Or added to the scaled scores (an eager attention's float mask), same
  // layout; at most one of the two.
  const float* additive_mask = nullptr;
  int64_t mask_stride[3] = {0, 0, 0};
  // With the causal mask only: query at position p sees s > p - window
  // (0: every earlier position).
  int32_t window = 0;
  // One logit per head that joins the softmax's denominator and adds no
  // value (gpt-oss's sinks); nullptr: none.
  const float* sinks = nullptr;
  float scale = 1.0f;
  // [batch][q_len][heads][v_dim], contiguous; overwritten. A query that
  // sees no position (and has no sink) gets zeros.
  float* out = nullptr;
};

// Runs on `pool` (items: batch x kv head x query token), with the float
// primitives of `isa` (or the highest supported level below it).
void attention(const AttentionArgs& a, kernels::Isa isa, ThreadPool* pool);

}  // namespace colibri
