// RMS normalisation of rows, y = w * x / sqrt(mean(x^2) + eps), as the
// transformers MoE families (Qwen, OLMoE, Mixtral, gpt-oss) compute it in
// float32. A whole model's norms run here so a decode step pays one C call
// per norm instead of PyTorch's six operators (python/colibri/nn.py).
#pragma once

#include <cstddef>
#include <cstdint>

namespace colibri {

// rows x dim floats, rows `ld` apart in x and y; y may be x. The mean of
// squares is summed in double, so the result does not depend on the
// summation order (PyTorch's differs by a few ulp).
void rms_norm_rows(const float* x, size_t ld, const float* weight, int32_t rows, int32_t dim, float eps, float* y);

}  // namespace colibri
