#include "kernels/vec_f32.h"

namespace colibri::kernels {

float dot_f32_scalar(const float* a, const float* b, int32_t n) {
  // Four partial sums, as the SIMD levels keep several accumulators: the
  // order differs from a single running sum by float rounding only.
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int32_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) s[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) s[0] += a[i] * b[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

void axpy_f32_scalar(float alpha, const float* x, float* y, int32_t n) {
  for (int32_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

const VecF32& vec_f32(Isa isa) {
  static const VecF32 scalar{Isa::kScalar, dot_f32_scalar, axpy_f32_scalar};
#if defined(COLIBRI_HAVE_X86_KERNELS)
  static const VecF32 avx2{Isa::kAvx2, dot_f32_avx2, axpy_f32_avx2};
  static const VecF32 avx512{Isa::kAvx512, dot_f32_avx512, axpy_f32_avx512};
  if (isa > detect_isa()) isa = detect_isa();
  if (isa >= Isa::kAvx512) return avx512;
  if (isa >= Isa::kAvx2) return avx2;
#else
  (void)isa;
#endif
  return scalar;
}

}  // namespace colibri::kernels
