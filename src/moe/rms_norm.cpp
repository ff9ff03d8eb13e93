#include "moe/rms_norm.h"

#include <cmath>

namespace colibri {

void rms_norm_rows(const float* x, size_t ld, const float* weight, int32_t rows, int32_t dim, float eps, float* y) {
  for (int32_t r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * ld;
    float* yr = y + static_cast<size_t>(r) * ld;
    // Four partial sums: independent chains the compiler can pipeline.
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    int32_t i = 0;
    for (; i + 4 <= dim; i += 4) {
      for (int j = 0; j < 4; ++j) s[j] += static_cast<double>(xr[i + j]) * xr[i + j];
    }
    for (; i < dim; ++i) s[0] += static_cast<double>(xr[i]) * xr[i];
    const double mean = (s[0] + s[1] + s[2] + s[3]) / dim;
    // PyTorch: x * rsqrt(float(mean) + eps), then * weight, all in float.
    const float inv = 1.0f / std::sqrt(static_cast<float>(mean) + eps);
    for (i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

}  // namespace colibri
