// The float64 reference (src/moe/reference.h) under the names the tests use.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "lib/float64_reference.h"

namespace colibri_test {

using colibri::load_reference_expert;
using colibri::reference_layer;
using colibri::ReferenceExpert;
using colibri::relative_l2;

// down(silu(gate x) * up x) in float64; w holds gate [F][D], up [F][D],
// down [D][F] (an expert file's order).
inline std::vector<double> swiglu_ffn(const std::vector<double>& w, size_t D, size_t F, const float* x) {
  std::vector<double> h(F), y(D, 0.0);
  for (size_t f = 0; f < F; ++f) {
    double g = 0, u = 0;
    for (size_t d = 0; d < D; ++d) {
      g += w[f * D + d] * x[d];
      u += w[F * D + f * D + d] * x[d];
    }
    h[f] = g / (1.0 + std::exp(-g)) * u;
  }
  for (size_t d = 0; d < D; ++d) {
    for (size_t f = 0; f < F; ++f) y[d] += w[2 * F * D + d * F + f] * h[f];
  }
  return y;
}

}  // namespace colibri_test
