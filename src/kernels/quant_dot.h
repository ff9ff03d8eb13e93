// Integer dot products of block-quantised weight rows with activations
// quantised to int8: the inner loops of the quantised FFN table
// (ffn_quant.cpp), one implementation per instruction set behind one table.
//
// Activations are quantised per block, symmetric, to int8 in [-127, 127]
// with one float scale (d = max|x| / 127, q = round-to-nearest-even(x / d)):
//   - in blocks of 32 (ActBlock32) for q8_0 and q4_0 weights, whose blocks
//     have one scale per 32 weights;
//   - in blocks of 256 (ActBlockK) for the K formats, so a super-block's
//     integer products can be summed with its integer sub-block scales
//     before one conversion to float, as ggml's q8_K does.
// Each block also carries the sums of its quants (the compensation for the
// weights' offsets: q4_0's -8, the K formats' mins, q6_k's -32), so the
// kernels multiply unsigned weight codes by signed activations
// (vpdpbusd / vpmaddubsw) and subtract offset * sum once per (sub-)block.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

namespace colibri::kernels {

struct ActBlock32 {
  float d;
  int32_t sum;  // sum of qs
  int8_t qs[32];
};
struct ActBlockK {
  float d;
  int16_t bsums[16];  // bsums[j] = sum of qs[16j .. 16j+15]
  int8_t qs[256];
};
static_assert(sizeof(ActBlock32) == 40);
static_assert(sizeof(ActBlockK) == 292);

struct QuantDotKernels {
  const char* name;  // "q4_k-avx512-vnni", ...
  // Quantises x[0, n_valid) followed by zeros up to n (a multiple of the
  // weight format's block) into n / block activation blocks at `out`.
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
// Bytes of the activation blocks for a row of n elements (a multiple of the
// block) against weights of type t.
size_t act_row_bytes(WeightType t, size_t n);

// The kernels for quantised type t at the highest level <= isa this CPU
// supports; nullptr when t is not quantised.
const QuantDotKernels* quant_dot_kernels(WeightType t, Isa isa);

// Per-ISA entries (qdot_<isa>.cpp); nullptr when t is not quantised.
const QuantDotKernels* quant_dot_scalar(WeightType t);
#if defined(COLIBRI_HAVE_X86_KERNELS)
const QuantDotKernels* quant_dot_avx2(WeightType t);
// Needs AVX512_VNNI (cpu_has_avx512_vnni()).
const QuantDotKernels* quant_dot_avx512(WeightType t);
#endif

}  // namespace colibri::kernels
