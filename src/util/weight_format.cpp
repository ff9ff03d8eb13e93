#include "util/weight_format.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <system_error>
#include <thread>
#include <vector>

#include "util/error.h"
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
    {WeightType::kMXFP4, "mxfp4", kQK32, sizeof(BlockMxfp4), dequantize_mxfp4, quantize_mxfp4, true},
    {WeightType::kQ4_1, "q4_1", kQK32, sizeof(BlockQ4_1), dequantize_q4_1, quantize_q4_1, true},
    {WeightType::kQ5_0, "q5_0", kQK32, sizeof(BlockQ5_0), dequantize_q5_0, quantize_q5_0, true},
    {WeightType::kQ5_1, "q5_1", kQK32, sizeof(BlockQ5_1), dequantize_q5_1, quantize_q5_1, true},
    {WeightType::kIQ4_NL, "iq4_nl", kQK32, sizeof(BlockIq4Nl), dequantize_iq4_nl, quantize_iq4_nl, true},
    {WeightType::kIQ4_XS, "iq4_xs", kQKK, sizeof(BlockIq4Xs), dequantize_iq4_xs, quantize_iq4_xs, true},
    {WeightType::kQ2_K, "q2_k", kQKK, sizeof(BlockQ2K), dequantize_q2_k, quantize_q2_k, true},
    {WeightType::kQ3_K, "q3_k", kQKK, sizeof(BlockQ3K), dequantize_q3_k, quantize_q3_k, true},
    {WeightType::kIQ2_XXS, "iq2_xxs", kQKK, sizeof(BlockIq2Xxs), dequantize_iq2_xxs, nullptr, true},
    {WeightType::kIQ3_XXS, "iq3_xxs", kQKK, sizeof(BlockIq3Xxs), dequantize_iq3_xxs, nullptr, true},
    {WeightType::kIQ1_S, "iq1_s", kQKK, sizeof(BlockIq1S), dequantize_iq1_s, nullptr, true},
    {WeightType::kIQ1_M, "iq1_m", kQKK, sizeof(BlockIq1M), dequantize_iq1_m, nullptr, true},
    {WeightType::kIQ2_XS, "iq2_xs", kQKK, sizeof(BlockIq2Xs), dequantize_iq2_xs, nullptr, true},
    {WeightType::kIQ2_S, "iq2_s", kQKK, sizeof(BlockIq2S), dequantize_iq2_s, nullptr, true},
    {WeightType::kIQ3_S, "iq3_s", kQKK, sizeof(BlockIq3S), dequantize_iq3_s, nullptr, true},
    {WeightType::kFP8_E4M3, "fp8_e4m3", kQKFp8, sizeof(BlockFp8E4M3), dequantize_fp8_e4m3, quantize_fp8_e4m3,
     true},
    {WeightType::kTQ1_0, "tq1_0", kQKK, sizeof(BlockTq1_0), dequantize_tq1_0, quantize_tq1_0, true},
    {WeightType::kTQ2_0, "tq2_0", kQKK, sizeof(BlockTq2_0), dequantize_tq2_0, quantize_tq2_0, true},
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

namespace {

// Rows [r0, r1); `row` holds `padded` floats when n < padded. Allocates
// nothing and throws nothing (it runs on threads of its own).
void convert_row_range(const WeightFormat& f, const float* src, size_t r0, size_t r1, size_t n, size_t padded,
                       size_t row_bytes, float* row, uint8_t* out) noexcept {
  for (size_t r = r0; r < r1; ++r) {
    const float* in = src + r * n;
    if (padded != n) {
      std::memcpy(row, in, n * sizeof(float));
      std::memset(row + n, 0, (padded - n) * sizeof(float));
      in = row;
    }
    f.from_float(in, out + r * row_bytes, padded);
  }
}

}  // namespace

int conversion_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void convert_rows_from_float(WeightType t, const float* src, size_t rows, size_t n, void* dst, int threads) {
  const WeightFormat& f = weight_format(t);
  if (f.from_float == nullptr) {
    fail(Status::kUnsupported, std::string(f.name) +
                                   " is read as stored, not made: its quantiser needs an importance matrix "
                                   "(llama.cpp's llama-quantize --imatrix)");
  }
  const size_t padded = (n + f.block_elements - 1) / f.block_elements * f.block_elements;
  const size_t row_bytes = weight_row_bytes(t, n);
  auto* out = static_cast<uint8_t*>(dst);
  // Threads only where quantising costs more than starting them.
  constexpr size_t kElementsPerThread = size_t{1} << 20;
  size_t parts = threads > 1 && f.quantized ? static_cast<size_t>(threads) : 1;
  parts = std::min(parts, std::max<size_t>(1, rows * n / kElementsPerThread));
  parts = std::min(parts, std::max<size_t>(rows, 1));
  const size_t scratch = padded == n ? 0 : padded;
  std::vector<float> rows_scratch(parts * scratch);
  std::vector<std::thread> team;
  team.reserve(parts);
  // Part p is rows [rows * p / parts, rows * (p + 1) / parts); part 0 is this thread's.
  for (size_t p = 1; p < parts; ++p) {
    const size_t r0 = rows * p / parts;
    const size_t r1 = rows * (p + 1) / parts;
    float* row = rows_scratch.data() + p * scratch;
    try {
      team.emplace_back(convert_row_range, std::cref(f), src, r0, r1, n, padded, row_bytes, row, out);
    } catch (const std::system_error&) {
      // No more threads: this thread also does the parts not started.
      convert_row_range(f, src, r0, rows, n, padded, row_bytes, row, out);
      break;
    }
  }
  convert_row_range(f, src, 0, rows / parts, n, padded, row_bytes, rows_scratch.data(), out);
  for (std::thread& th : team) th.join();
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
