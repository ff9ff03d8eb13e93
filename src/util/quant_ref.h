// Scalar reference quantisation and dequantisation of the block formats
// (quant_blocks.h), following ggml's reference code (quantize_row_*_ref,
// dequantize_row_*), so the bytes equal what llama.cpp and the gguf
// package write and read. n is a multiple of the format's block size
// (32 for q8_0 / q4_0 / mxfp4, 256 for the K formats); dst holds n / block blocks.
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

// An MXFP4 block's scale, 2^(e - 128) exactly (ggml's
// ggml_e8m0_to_fp32_half; subnormal for e < 2).
float mxfp4_scale(uint8_t e);

void quantize_q8_0(const float* src, void* dst, size_t n);
void quantize_q4_0(const float* src, void* dst, size_t n);
void quantize_q4_k(const float* src, void* dst, size_t n);
void quantize_q5_k(const float* src, void* dst, size_t n);
void quantize_q6_k(const float* src, void* dst, size_t n);
void quantize_mxfp4(const float* src, void* dst, size_t n);

}  // namespace colibri
