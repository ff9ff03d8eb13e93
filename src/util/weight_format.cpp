#include "util/weight_format.h"

#include <cstring>
#include <vector>

#include "util/half.h"
#include "util/quant_blocks.h"
#include "util/quant_ref.h"

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
    {WeightType::kF32, "f32", 1, 4, f32_to_float, f32_from_float, false},
    {WeightType::kF16, "f16", 1, 2, f16_to_float_row, f16_from_float_row, false},
    {WeightType::kBF16, "bf16", 1, 2, bf16_to_float_row, bf16_from_float_row, false},
    {WeightType::kQ8_0, "q8_0", kQK32, sizeof(BlockQ8_0), dequantize_q8_0, quantize_q8_0, true},
    {WeightType::kQ4_0, "q4_0", kQK32, sizeof(BlockQ4_0), dequantize_q4_0, quantize_q4_0, true},
    {WeightType::kQ4_K, "q4_k", kQKK, sizeof(BlockQ4K), dequantize_q4_k, quantize_q4_k, true},
    {WeightType::kQ5_K, "q5_k", kQKK, sizeof(BlockQ5K), dequantize_q5_k, quantize_q5_k, true},
    {WeightType::kQ6_K, "q6_k", kQKK, sizeof(BlockQ6K), dequantize_q6_k, quantize_q6_k, true},
};

}  // namespace

const WeightFormat& weight_format(WeightType t) {
  const auto i = static_cast<size_t>(t);
  return kFormats[i < static_cast<size_t>(kWeightTypeCount) ? i : 0];
}

bool parse_weight_type(const char* name, WeightType* out) {
  if (name == nullptr) return false;
  for (const WeightFormat& f : kFormats) {
    if (std::strcmp(f.name, name) == 0) {
      if (out != nullptr) *out = f.type;
      return true;
    }
  }
  return false;
}

size_t weight_row_bytes(WeightType t, size_t n) {
  const WeightFormat& f = weight_format(t);
  return (n + f.block_elements - 1) / f.block_elements * f.block_bytes;
}

void convert_rows_from_float(WeightType t, const float* src, size_t rows, size_t n, void* dst) {
  const WeightFormat& f = weight_format(t);
  const size_t padded = (n + f.block_elements - 1) / f.block_elements * f.block_elements;
  const size_t row_bytes = weight_row_bytes(t, n);
  std::vector<float> row(padded == n ? 0 : padded, 0.0f);
  auto* out = static_cast<uint8_t*>(dst);
  for (size_t r = 0; r < rows; ++r) {
    const float* in = src + r * n;
    if (padded != n) {
      std::memcpy(row.data(), in, n * sizeof(float));
      in = row.data();
    }
    f.from_float(in, out + r * row_bytes, padded);
  }
}

void convert_rows_to_float(WeightType t, const void* src, size_t rows, size_t n, float* dst) {
  const WeightFormat& f = weight_format(t);
  const size_t padded = (n + f.block_elements - 1) / f.block_elements * f.block_elements;
  const size_t row_bytes = weight_row_bytes(t, n);
  std::vector<float> row(padded == n ? 0 : padded);
  const auto* in = static_cast<const uint8_t*>(src);
  for (size_t r = 0; r < rows; ++r) {
    float* out = padded == n ? dst + r * n : row.data();
    f.to_float(in + r * row_bytes, out, padded);
    if (padded != n) std::memcpy(dst + r * n, row.data(), n * sizeof(float));
  }
}

size_t padded_row_elements(WeightType t, size_t n, size_t align_bytes) {
  const WeightFormat& f = weight_format(t);
  size_t blocks = (n + f.block_elements - 1) / f.block_elements;
  if (f.quantized) return blocks * f.block_elements;
  while (blocks * f.block_bytes % align_bytes != 0) ++blocks;
  return blocks * f.block_elements;
}

}  // namespace colibri
