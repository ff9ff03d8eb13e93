#include "util/weight_format.h"

#include <cstring>

#include "util/half.h"

namespace colibri {

namespace {

void f32_to_float(const void* src, float* dst, size_t n) { std::memcpy(dst, src, n * sizeof(float)); }
void f32_from_float(const float* src, void* dst, size_t n) { std::memcpy(dst, src, n * sizeof(float)); }

void f16_to_float_row(const void* src, float* dst, size_t n) {
  const auto* h = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_float(h[i]);
}
void f16_from_float_row(const float* src, void* dst, size_t n) {
  auto* h = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; ++i) h[i] = float_to_f16(src[i]);
}

void bf16_to_float_row(const void* src, float* dst, size_t n) {
  const auto* h = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(h[i]);
}
void bf16_from_float_row(const float* src, void* dst, size_t n) {
  auto* h = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; ++i) h[i] = float_to_bf16(src[i]);
}

// Indexed by WeightType.
constexpr WeightFormat kFormats[kWeightTypeCount] = {
    {WeightType::kF32, "f32", 1, 4, f32_to_float, f32_from_float},
    {WeightType::kF16, "f16", 1, 2, f16_to_float_row, f16_from_float_row},
    {WeightType::kBF16, "bf16", 1, 2, bf16_to_float_row, bf16_from_float_row},
};

}  // namespace

const WeightFormat& weight_format(WeightType t) {
  const auto i = static_cast<size_t>(t);
  return kFormats[i < static_cast<size_t>(kWeightTypeCount) ? i : 0];
}

size_t weight_row_bytes(WeightType t, size_t n) {
  const WeightFormat& f = weight_format(t);
  return n / f.block_elements * f.block_bytes;
}

size_t padded_row_elements(WeightType t, size_t n, size_t align_bytes) {
  const WeightFormat& f = weight_format(t);
  size_t blocks = (n + f.block_elements - 1) / f.block_elements;
  while (blocks * f.block_bytes % align_bytes != 0) ++blocks;
  return blocks * f.block_elements;
}

}  // namespace colibri
