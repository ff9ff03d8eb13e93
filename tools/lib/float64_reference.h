// A plain float64 reference for one MoE layer, reading the expert files
// straight from a model directory (so it checks the loader's packing too).
// Slow by design: for tests and for checking outputs in `colibri loadtest`,
// never for serving.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/manifest.h"

namespace colibri {

struct ReferenceExpert {
  std::vector<double> gate, up, down;  // [F][D], [F][D], [D][F]
  std::vector<double> gate_bias, up_bias, down_bias;  // [F], [F], [D]; empty without
};

ReferenceExpert load_reference_expert(const std::string& dir, const Manifest& m, int32_t layer, int32_t expert);

// y[t] = sum_j w[t][j] * down_e(silu(gate_e x[t]) * up_e x[t]); id -1 skipped
// (the manifest's activation and biases where it has them).
// (Routed experts only: no router, no shared expert.)
std::vector<double> reference_layer(const std::string& dir, int32_t layer, int32_t T, const float* x, int32_t k,
                                    const int32_t* ids, const float* w);

// ||got - ref|| / ||ref||; NaN anywhere in got gives +inf.
double relative_l2(const float* got, const std::vector<double>& ref);

}  // namespace colibri
