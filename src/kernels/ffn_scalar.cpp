// Portable reference kernels: always built, always tested, and the definition
// the SIMD kernels are checked against. Plain C++, no ISA flags.
#include <cmath>

#include "kernels/kernels.h"
#include "util/half.h"

namespace colibri::kernels {
namespace {

inline float load_weight(const void* base, size_t index, WeightType t) {
  switch (t) {
    case WeightType::kF32:
      return static_cast<const float*>(base)[index];
    case WeightType::kF16:
      return f16_to_float(static_cast<const uint16_t*>(base)[index]);
    case WeightType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
    default:  // block formats run the tables of ffn_quant.cpp
      break;
  }
  return 0.0f;
}

// Four partial sums, so the scalar path is not one long dependency chain and
// its rounding matches the SIMD kernels' reduction order more closely.
float dot_row(const void* weights, size_t row_offset, const float* x, int32_t n, WeightType t) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int32_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int32_t j = 0; j < 4; ++j) acc[j] += load_weight(weights, row_offset + i + j, t) * x[i + j];
  }
  for (; i < n; ++i) acc[0] += load_weight(weights, row_offset + i, t) * x[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

void gate_up_scalar(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                    const int32_t* token_index, int32_t n, int32_t f_begin, int32_t f_end, float* h,
                    size_t ldh, KernelScratch* /*scratch*/) {
  for (int32_t f = f_begin; f < f_end; ++f) {
    const size_t gate_row = static_cast<size_t>(2 * f) * s.gate_up_stride;
    const size_t up_row = gate_row + s.gate_up_stride;
    for (int32_t i = 0; i < n; ++i) {
      const float* xi = x + static_cast<size_t>(token_index[i]) * ldx;
      const float g = dot_row(gate_up, gate_row, xi, s.d_model, s.weight_type);
      const float u = dot_row(gate_up, up_row, xi, s.d_model, s.weight_type);
      h[static_cast<size_t>(i) * ldh + f] = apply_glu(s.epilogue, f, g, u);
    }
  }
}

void down_scalar(const ExpertShape& s, const void* down, const float* h, size_t ldh,
                 const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin,
                 int32_t d_end, float* y, size_t ldy, KernelScratch* /*scratch*/) {
  const float* bias = s.epilogue.down_bias;
  for (int32_t d = d_begin; d < d_end; ++d) {
    const size_t row = static_cast<size_t>(d) * s.down_stride;
    for (int32_t i = 0; i < n; ++i) {
      float v = dot_row(down, row, h + static_cast<size_t>(i) * ldh, s.d_ff, s.weight_type);
      if (bias != nullptr) v += bias[d];
      y[static_cast<size_t>(token_index[i]) * ldy + d] += weight[i] * v;
    }
  }
}

}  // namespace

const KernelTable& scalar_kernels() {
  static const KernelTable table = [] {
    KernelTable t{Isa::kScalar, "scalar", gate_up_scalar, down_scalar};
    t.any_epilogue = true;
    return t;
  }();
  return table;
}

}  // namespace colibri::kernels
