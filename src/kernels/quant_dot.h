// Integer dot products of block-quantised weight rows with activations
// quantised to int8: the inner loops of the quantised FFN table
// (ffn_quant.cpp), one implementation per instruction set behind one table.
//
// Activations are quantised in blocks of 32 elements (for every format),
// symmetric, to int8 in [-127, 127] with one float scale per block
// (d = max|x| / 127, q = round-to-nearest-even(x / d)): one scale per 32
// follows outlier channels closely enough for a whole layer to stay within
// 2% relative L2 of float64, where one per 256 (ggml's q8_K) does not. The
// K formats' sub-blocks (32 elements for q4_k / q5_k, 16 for q6_k) lie
// inside one activation block, so each sub-block's integer product is
// exact and then takes its float scales (the SIMD kernels arrange the codes
// so that each vector lane sums one sub-block, and do sixteen such
// multiply-adds per instruction). The sums of the quants per 16 elements
// carry the weights' offsets (q4_0's -8, the K formats' mins, q6_k's -32),
// so the kernels multiply unsigned weight codes by signed activations
// (vpdpbusd / vpmaddubsw) and subtract offset * sum once per (sub-)block.
//
// One token's activation row of n elements (n a multiple of 32), struct of
// arrays, act_row_bytes(t, n) = n + n / 4 bytes, no alignment required:
//   int8_t  qs[n]         at byte 0
//   float   d[n / 32]     at byte n           (block b: elements [32b, 32b + 32))
//   int16_t sums[n / 16]  at byte n + n / 8   (sums[h] = qs[16h] + ... + qs[16h + 15])
// The kernels rearrange these once per dot_rows call into the orders their
// vectors want (transposed groups of blocks or sub-blocks, on the stack).
//
// FP8 e4m3 weights (fp8_e4m3) are the exception: their codes are not
// integers, so their activations stay fp32 (act_row_bytes = 4 n: x and
// zeros to n) and the kernels convert each code exactly (every e4m3 value
// is an f16 value) and multiply-add in fp32: FP8 models compute at fp32
// grade against their dequantised weights, on every level.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

namespace colibri::kernels {

// Elements per activation block (one float scale each).
inline constexpr int kActBlock = 32;

struct QuantDotKernels {
  const char* name;  // "q4_k-avx512-vnni", ...
  // Quantises x[0, n_valid) followed by zeros up to n (a multiple of the
  // weight format's block) into the activation row at `out` (the layout
  // above; the same bytes for every format and instruction set).
  void (*quantize_act)(const float* x, size_t n_valid, size_t n, void* out);
  // For r < rows, t < tokens:
  //   out[t * ld_out + r] = sum over the n / block blocks of
  //                         dequantised(row r) . dequantised(activation t)
  // with row r at w + r * row_bytes and activation t at act + t * act_bytes.
  // Integer products are exact; the float combination order is the
  // implementation's, so instruction sets agree to float rounding.
  void (*dot_rows)(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes,
                   int32_t tokens, size_t n, float* out, size_t ld_out);
};

// True for the block-quantised types (q8_0, q4_0, q4_k, q5_k, q6_k).
bool is_quantized(WeightType t);
// Bytes of one token's activation row of n elements (a multiple of the
// weight block) against weights of type t: n + n / 4; 0 when t is not
// quantised.
size_t act_row_bytes(WeightType t, size_t n);

// The kernels for quantised type t at the highest level <= isa this CPU
// supports; nullptr when t is not quantised. At the AVX2 level (and at
// AVX-512 without AVX512_VNNI) the AVX-VNNI kernels where the CPU has them.
const QuantDotKernels* quant_dot_kernels(WeightType t, Isa isa);

// AVX-VNNI (vpdpbusd on ymm, VEX-encoded): CPUID.(EAX=7,ECX=1):EAX bit 4,
// and only where the AVX2 level is usable (the OS saves YMM state). False
// without x86 kernels.
bool cpu_has_avx_vnni();

// Per-ISA entries (qdot_<isa>.cpp); nullptr when t is not quantised.
const QuantDotKernels* quant_dot_scalar(WeightType t);
// Rows of block-quantised weights to bf16: n elements (a multiple of the
// format's block) at src to dst, each the bf16 nearest (ties to even, NaN
// kept quiet) to the reference dequantiser's float, as float_to_bf16 of
// WeightFormat::to_float gives. For the AMX prefill tier (ffn_quant.cpp).
using DequantBf16Fn = void (*)(const void* src, size_t n, uint16_t* dst);

#if defined(COLIBRI_HAVE_X86_KERNELS)
// qdequant_avx512.cpp (AVX-512 F/BW/VL/DQ and AVX512_BF16, which every AMX
// CPU has); nullptr when t is not quantised.
DequantBf16Fn dequant_bf16_avx512(WeightType t);
const QuantDotKernels* quant_dot_avx2(WeightType t);
// qdot_avxvnni.cpp: the AVX2 kernels with vpdpbusd; needs cpu_has_avx_vnni().
const QuantDotKernels* quant_dot_avx_vnni(WeightType t);
// Needs AVX512_VNNI (cpu_has_avx512_vnni()).
const QuantDotKernels* quant_dot_avx512(WeightType t);
// qdot_avx512vl.cpp: the AVX2-level kernels with EVEX vpdpbusd on ymm, for
// the formats qdot_avx512.cpp has no kernels of its own for (it hands them
// these); needs AVX512_VNNI.
const QuantDotKernels* quant_dot_avx512_ymm(WeightType t);
// qdot_avx512_grid.cpp: the grid i-quants on zmm, a super-block at a time;
// nullptr for other formats; needs AVX512_VNNI.
const QuantDotKernels* quant_dot_avx512_grid(WeightType t);
// For the many-token kernel of qdot_avx512.cpp: the super-blocks of 16 rows
// of a grid format (row r's at blocks + r * row_bytes) unpacked. codes[256 r
// + 64 j + 8 m + i]: value 8 j + i of row r's sub-block m plus
// kGridCodeOffset; scales[16 r + 2 m + h]: the scale of half h (values 16 h
// .. 16 h + 15) of sub-block m (equal halves for the formats scaled per 32).
// Buffers 64-byte aligned. Needs AVX512_VNNI.
inline constexpr int kGridCodeOffset = 128;
// unpack_grid_rows16_avx512: in far_l2 and far_nta below.
// qdot_avx512_planes.cpp: TQ1_0, TQ2_0, Q2_K and Q3_K on zmm, a
// super-block at a time (Q2_K and Q3_K: the calls and rows the many-token
// kernel of qdot_avx512.cpp leaves); nullptr for other formats; needs
// AVX512_VNNI.
const QuantDotKernels* quant_dot_avx512_planes(WeightType t);
// The AVX-512 kernels whose many-token products run on AMX-INT8 tiles
// (names "<format>-amx-int8"); nullptr for the formats without them. Only
// where amx_int8_available() (amx.h).
const QuantDotKernels* quant_dot_amx_int8(WeightType t);

// The integer-dot translation units above (qdot_avx2, qdot_avxvnni,
// qdot_avx512, qdot_avx512vl, qdot_avx512_grid, qdot_avx512_planes) are
// compiled twice (CMakeLists.txt): into far_l2 with their far prefetch
// (8 KiB ahead of the rows they read) into L2, and into far_nta with it
// non-temporal. The entries above, defined in quant_dot.cpp, hand out the
// one far_prefetch_nta() picks for this CPU: a choice per build of the
// kernels rather than a branch in their loops (a branch there grew them past
// GCC's inlining limits: one-token q4_0 layers 3x slower).
#define COLIBRI_QDOT_VARIANT_ENTRIES                                                                              \
  const QuantDotKernels* quant_dot_avx2(WeightType t);                                                          \
  const QuantDotKernels* quant_dot_avx_vnni(WeightType t);                                                      \
  const QuantDotKernels* quant_dot_avx512(WeightType t);                                                        \
  const QuantDotKernels* quant_dot_avx512_ymm(WeightType t);                                                    \
  const QuantDotKernels* quant_dot_avx512_grid(WeightType t);                                                   \
  void unpack_grid_rows16_avx512(WeightType t, const uint8_t* blocks, size_t row_bytes, uint8_t* codes,         \
                                 float* scales);                                                                \
  const QuantDotKernels* quant_dot_avx512_planes(WeightType t);                                                 \
  const QuantDotKernels* quant_dot_amx_int8(WeightType t);
namespace far_l2 {
COLIBRI_QDOT_VARIANT_ENTRIES
}  // namespace far_l2
namespace far_nta {
COLIBRI_QDOT_VARIANT_ENTRIES
}  // namespace far_nta
#undef COLIBRI_QDOT_VARIANT_ENTRIES
// What a translation unit of the two compilations defines (CMakeLists.txt
// sets both macros); the defaults keep other compilations of the header whole.
#if !defined(COLIBRI_QDOT_VARIANT)
#define COLIBRI_QDOT_VARIANT far_l2
#endif
#if !defined(COLIBRI_FAR_PREFETCH_NTA)
#define COLIBRI_FAR_PREFETCH_NTA 0
#endif
#if COLIBRI_FAR_PREFETCH_NTA
#define COLIBRI_FAR_PREFETCH_HINT _MM_HINT_NTA
#else
#define COLIBRI_FAR_PREFETCH_HINT _MM_HINT_T1
#endif
#endif

}  // namespace colibri::kernels
