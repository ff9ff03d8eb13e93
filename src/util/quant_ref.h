// Scalar reference quantisation and dequantisation of the block formats
// (quant_blocks.h), following ggml's reference code (quantize_row_*_ref,
// dequantize_row_*), so the bytes equal what llama.cpp and the gguf
// package write and read. n is a multiple of the format's block size
// (32 for q8_0 / q4_0, 256 for the K formats); dst holds n / block blocks.
// These are the formats' WeightFormat::to_float / from_float.
#pragma once

#include <cstddef>

namespace colibri {

void dequantize_q8_0(const void* src, float* dst, size_t n);
void dequantize_q4_0(const void* src, float* dst, size_t n);
void dequantize_q4_k(const void* src, float* dst, size_t n);
void dequantize_q5_k(const void* src, float* dst, size_t n);
void dequantize_q6_k(const void* src, float* dst, size_t n);

void quantize_q8_0(const float* src, void* dst, size_t n);
void quantize_q4_0(const float* src, void* dst, size_t n);
void quantize_q4_k(const float* src, void* dst, size_t n);
void quantize_q5_k(const float* src, void* dst, size_t n);
void quantize_q6_k(const float* src, void* dst, size_t n);

}  // namespace colibri
