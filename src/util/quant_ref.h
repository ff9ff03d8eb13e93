// Scalar reference quantisation and dequantisation of the block formats
// (quant_blocks.h), following ggml's reference code (quantize_row_*_ref,
// dequantize_row_*), so the bytes equal what llama.cpp and the gguf
// package write and read. n is a multiple of the format's block size
// (32 for q8_0 / q4_0 / q4_1 / q5_0 / q5_1 / mxfp4 / iq4_nl, 256 for the
// K formats and iq4_xs); dst holds n / block blocks.

// These are the formats' WeightFormat::to_float / from_float.
#pragma once

#include <cstddef>
#include <cstdint>

namespace colibri {

void dequantize_q8_0(const void* src, float* dst, size_t n);
void dequantize_q4_0(const void* src, float* dst, size_t n);
void dequantize_q4_k(const void* src, float* dst, size_t n);
void dequantize_q5_k(const void* src, float* dst, size_t n);
void dequantize_q6_k(const void* src, float* dst, size_t n);
void dequantize_mxfp4(const void* src, float* dst, size_t n);
void dequantize_q4_1(const void* src, float* dst, size_t n);
void dequantize_q5_0(const void* src, float* dst, size_t n);
void dequantize_q5_1(const void* src, float* dst, size_t n);
void dequantize_iq4_nl(const void* src, float* dst, size_t n);
void dequantize_iq4_xs(const void* src, float* dst, size_t n);
// Element j (< 32)'s five-bit code of a q5_0 / q5_1 block: its nibble plus
// 16 times bit j of qh (little-endian).
int q5_code(const uint8_t* qs, const uint8_t* qh, int j);
void dequantize_q2_k(const void* src, float* dst, size_t n);
void dequantize_iq2_xxs(const void* src, float* dst, size_t n);
void dequantize_iq3_xxs(const void* src, float* dst, size_t n);
void dequantize_iq1_s(const void* src, float* dst, size_t n);
void dequantize_iq1_m(const void* src, float* dst, size_t n);
void dequantize_iq2_xs(const void* src, float* dst, size_t n);
void dequantize_iq2_s(const void* src, float* dst, size_t n);
void dequantize_iq3_s(const void* src, float* dst, size_t n);
// An IQ1_M super-block's f16 d, from the top nibbles of its scale words.
uint16_t iq1_m_d(const uint8_t* scales);
void dequantize_q3_k(const void* src, float* dst, size_t n);
// A q3_K super-block's 16 sub-block scales, sc - 32 (-32 .. 31), from its
// 12 packed bytes.
void q3_k_scales(const uint8_t* packed, int8_t* out);
// An IQ4_XS sub-block's 6-bit scale ls_j (0..63; the scale is d * (ls_j - 32)).
int iq4_xs_scale(const void* block, int j);

// An MXFP4 block's scale, 2^(e - 128) exactly (ggml's
// ggml_e8m0_to_fp32_half; subnormal for e < 2).
float mxfp4_scale(uint8_t e);

// FP8 e4m3 (BlockFp8E4M3): one code's value, exactly (NaN for 0x7f / 0xff),
// and the code nearest to v (ties to even; beyond 448 in magnitude 448,
// as the quantiser never asks for more; NaN to 0x7f with v's sign).
float e4m3_to_float(uint8_t code);
uint8_t float_to_e4m3(float v);
void dequantize_fp8_e4m3(const void* src, float* dst, size_t n);
// Per block d = max|x| / 448 and codes e4m3(x / d): DeepSeek's
// weight_quant at a 1 x 128 tile.
void quantize_fp8_e4m3(const float* src, void* dst, size_t n);

void dequantize_tq1_0(const void* src, float* dst, size_t n);
void dequantize_tq2_0(const void* src, float* dst, size_t n);
// Trit k (0..4) of a TQ1_0 byte, 0..2 (BlockTq1_0).
int tq1_trit(uint8_t q, int k);

void quantize_q8_0(const float* src, void* dst, size_t n);
void quantize_q4_0(const float* src, void* dst, size_t n);
void quantize_q4_k(const float* src, void* dst, size_t n);
void quantize_q5_k(const float* src, void* dst, size_t n);
void quantize_q6_k(const float* src, void* dst, size_t n);
void quantize_mxfp4(const float* src, void* dst, size_t n);
void quantize_q4_1(const float* src, void* dst, size_t n);
void quantize_q5_0(const float* src, void* dst, size_t n);
void quantize_q5_1(const float* src, void* dst, size_t n);
void quantize_q2_k(const float* src, void* dst, size_t n);
void quantize_q3_k(const float* src, void* dst, size_t n);
// ggml's quantize_iq4_nl / quantize_iq4_xs without an importance matrix
// (weights x^2, seven scale trials a block): the bytes llama-quantize
// writes (ggml's quantize_row_iq4_nl_ref skips the trials). The gguf
// package has no quantiser for these; tests/test_quant_ref.cpp pins the
// bytes to ggml's.
void quantize_iq4_nl(const float* src, void* dst, size_t n);
void quantize_iq4_xs(const float* src, void* dst, size_t n);
// ggml's quantize_row_tq1_0_ref / quantize_row_tq2_0_ref (the gguf
// package's TQ1_0 / TQ2_0 quantize_blocks): d = max |x| per 256, each
// weight rounded (half away from zero) to -1, 0 or 1 of d.
void quantize_tq1_0(const float* src, void* dst, size_t n);
void quantize_tq2_0(const float* src, void* dst, size_t n);

}  // namespace colibri
