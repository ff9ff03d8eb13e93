// Rotary position embedding of query or key heads, as the transformers
// MoE families apply it in float32 (rotate_half's convention: element i
// of the first half of the rotated dimensions pairs with element i of the
// second half). One C call where PyTorch runs six to ten operators per
// tensor; the products and sums are rounded one at a time, so the result
// is PyTorch's to the bit (python/colibri/rope.py checks that at install).
#pragma once

#include <cstdint>

namespace colibri {

struct RopeArgs {
  int32_t batch = 0, heads = 0, tokens = 0;
  int32_t head_dim = 0;
  int32_t rotary_dim = 0;  // even, <= head_dim; the dimensions past it are copied
  // cos and sin hold rotary_dim values a position (each half's own), or
  // rotary_dim / 2 shared by both halves (gpt-oss).
  bool half_table = false;
  const float* x = nullptr;  // element strides of [batch, head, token]; last dimension contiguous
  int64_t x_stride[3] = {0, 0, 0};
  float* out = nullptr;  // same shape; may be x
  int64_t out_stride[3] = {0, 0, 0};
  const float* cos = nullptr;  // strides of [batch, token]; 0 broadcasts
  const float* sin = nullptr;
  int64_t table_stride[2] = {0, 0};
};

// out = x * cos + rotate_half(x) * sin on the first rotary_dim dimensions.
void rope(const RopeArgs& a);

}  // namespace colibri
