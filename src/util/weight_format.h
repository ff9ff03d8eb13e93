// Weight formats: the one place that knows how each format stores a row.
//
// A format packs `block_elements` consecutive elements of a row into
// `block_bytes` bytes: one element per block for the float formats (4 or 2
// bytes), and for block-quantised formats a block of 32 or 256 elements with
// its scales. Row strides, file and matrix sizes, copies and the reference
// conversions all ask here; nothing else may assume an element size.
//
// The functions are defined out of line, so the instruction-set files may
// call them (an inline function called there could be emitted with their
// flags and bound by baseline code: tests/isa_linkage.sh).
#pragma once

#include <cstddef>
#include <cstdint>

namespace colibri {

// Values match colibri_dtype_t (src/api maps them).
enum class WeightType : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kQ8_0 = 3,
  kQ4_0 = 4,
  kQ4_K = 5,
  kQ5_K = 6,
  kQ6_K = 7,
  kMXFP4 = 8,
  kQ4_1 = 9,
  kQ5_0 = 10,
  kQ5_1 = 11,
  kIQ4_NL = 12,
  kIQ4_XS = 13,
  kQ2_K = 14,
  kQ3_K = 15,
  kIQ2_XXS = 16,
  kIQ3_XXS = 17,
  kIQ1_S = 18,
  kIQ1_M = 19,
  kIQ2_XS = 20,
  kIQ2_S = 21,
  kIQ3_S = 22,
  kFP8_E4M3 = 23,
  kTQ1_0 = 24,
  kTQ2_0 = 25,
};
inline constexpr int kWeightTypeCount = 26;

struct WeightFormat {
  WeightType type;
  const char* name;  // as manifests and the CLI spell it: "f32", "bf16", "q4_k", ...
  uint32_t block_elements;
  uint32_t block_bytes;
  // The scalar reference: n elements (a multiple of block_elements) of a
  // row, widened or dequantised to float. The SIMD kernels must agree.
  void (*to_float)(const void* src, float* dst, size_t n);
  // The nearest representable values (round to nearest even), n as above;
  // nullptr for the formats that are read, not made (the i-quants whose
  // quantisers need an importance matrix).
  void (*from_float)(const float* src, void* dst, size_t n);
  // Block-quantised (the integer kernels, quant_dot.h) rather than a float type.
  bool quantized;
};

const WeightFormat& weight_format(WeightType t);
// The type named `name` ("q4_k"); false if none.
bool parse_weight_type(const char* name, WeightType* out);

// Bytes of a row of n elements: whole blocks, the last one zero-padded
// when n is not a multiple of block_elements (the float types: n * size).
size_t weight_row_bytes(WeightType t, size_t n);

// rows x n floats to rows of type t (weight_row_bytes(t, n) each; the
// last block of a row padded with zeros), and back (the padding dropped).
// May allocate one row of scratch; throws Error (kUnsupported) for a type
// without from_float. convert_rows_from_float splits the rows
// among up to `threads` threads (the caller's among them; fewer when a
// thread cannot be started): the block quantisers run at about 10 M
// weights per second per core, so a Mixtral-sized layer takes minutes on
// one. The bytes do not depend on the thread count.
void convert_rows_from_float(WeightType t, const float* src, size_t rows, size_t n, void* dst, int threads = 1);
// std::thread::hardware_concurrency(), at least 1.
int conversion_threads();
void convert_rows_to_float(WeightType t, const void* src, size_t rows, size_t n, float* dst);

// n rounded up to whole blocks, and for the float types on to whole
// `align_bytes` lines of them (quantised rows are not aligned: their
// kernels load unaligned, and padding a 34-byte block row to a cache line
// could take 31 blocks).
size_t padded_row_elements(WeightType t, size_t n, size_t align_bytes);

}  // namespace colibri
