// Float vector primitives for the model paths outside the experts (the
// attention over a KV cache): a dot product and y += a*x, per instruction
// set behind one table, with a scalar reference. Kernels for quantised
// weights live in the registry (kernels.h); these take float32 only.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace colibri::kernels {

struct VecF32 {
  Isa isa = Isa::kScalar;
  // sum_i a[i] * b[i], i < n.
  float (*dot)(const float* a, const float* b, int32_t n) = nullptr;
  // y[i] += alpha * x[i], i < n.
  void (*axpy)(float alpha, const float* x, float* y, int32_t n) = nullptr;
};

// The primitives for `isa`, or for the highest supported level below it.
const VecF32& vec_f32(Isa isa);

// Per-level definitions (vec_f32.cpp, vec_f32_avx2.cpp, vec_f32_avx512.cpp).
float dot_f32_scalar(const float* a, const float* b, int32_t n);
void axpy_f32_scalar(float alpha, const float* x, float* y, int32_t n);
float dot_f32_avx2(const float* a, const float* b, int32_t n);
void axpy_f32_avx2(float alpha, const float* x, float* y, int32_t n);
float dot_f32_avx512(const float* a, const float* b, int32_t n);
void axpy_f32_avx512(float alpha, const float* x, float* y, int32_t n);

}  // namespace colibri::kernels
