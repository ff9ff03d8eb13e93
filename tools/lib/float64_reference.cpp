#include "lib/float64_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "io/mapped_file.h"
#include "util/half.h"

namespace colibri {

ReferenceExpert load_reference_expert(const std::string& dir, const Manifest& m, int32_t layer, int32_t expert) {
  MappedFile f(dir + "/" + m.expert_file(layer, expert));
  const size_t D = static_cast<size_t>(m.d_model), F = static_cast<size_t>(m.d_ff);
  const size_t n = D * F;
  // Every format through its reference dequantiser (weight_format.h).
  std::vector<float> widened(3 * n);
  const LayerTypes t = m.layer_types(layer);
  const size_t gate_bytes = Manifest::matrix_bytes(t.dtype, m.d_ff, m.d_model);
  convert_rows_to_float(t.dtype, f.data(), 2 * F, D, widened.data());
  convert_rows_to_float(t.down_dtype, f.data() + 2 * gate_bytes, D, F, widened.data() + 2 * n);
  std::vector<double> all(widened.begin(), widened.end());
  ReferenceExpert e;
  e.gate.assign(all.begin(), all.begin() + static_cast<ptrdiff_t>(n));
  e.up.assign(all.begin() + static_cast<ptrdiff_t>(n), all.begin() + static_cast<ptrdiff_t>(2 * n));
  e.down.assign(all.begin() + static_cast<ptrdiff_t>(2 * n), all.end());
  if (m.expert_bias) {
    std::vector<float> bias(2 * F + D);
    std::memcpy(bias.data(), f.data() + 2 * gate_bytes + Manifest::matrix_bytes(t.down_dtype, m.d_model, m.d_ff),
                bias.size() * sizeof(float));
    e.gate_bias.assign(bias.begin(), bias.begin() + static_cast<ptrdiff_t>(F));
    e.up_bias.assign(bias.begin() + static_cast<ptrdiff_t>(F), bias.begin() + static_cast<ptrdiff_t>(2 * F));
    e.down_bias.assign(bias.begin() + static_cast<ptrdiff_t>(2 * F), bias.end());
  }
  return e;
}

std::vector<double> reference_layer(const std::string& dir, int32_t layer, int32_t T,
                                           const float* x, int32_t k, const int32_t* ids,
                                           const float* w) {
  const Manifest m = load_manifest(dir);
  const size_t D = static_cast<size_t>(m.d_model), F = static_cast<size_t>(m.d_ff);
  std::vector<ReferenceExpert> experts(static_cast<size_t>(m.n_experts));
  std::vector<bool> loaded(static_cast<size_t>(m.n_experts), false);
  std::vector<double> y(static_cast<size_t>(T) * D, 0.0), h(F);
  for (int32_t t = 0; t < T; ++t) {
    const float* xt = x + static_cast<size_t>(t) * D;
    for (int32_t j = 0; j < k; ++j) {
      const int32_t e = ids[static_cast<size_t>(t) * k + j];
      if (e < 0) continue;
      if (!loaded[static_cast<size_t>(e)]) {
        experts[static_cast<size_t>(e)] = load_reference_expert(dir, m, layer, e);
        loaded[static_cast<size_t>(e)] = true;
      }
      const ReferenceExpert& ex = experts[static_cast<size_t>(e)];
      for (size_t f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (size_t d = 0; d < D; ++d) {
          g += ex.gate[f * D + d] * xt[d];
          u += ex.up[f * D + d] * xt[d];
        }
        if (!ex.gate_bias.empty()) {
          g += ex.gate_bias[f];
          u += ex.up_bias[f];
        }
        if (m.clamped_swiglu()) {
          const double limit = m.swiglu_limit;
          g = std::min(g, limit);
          u = std::clamp(u, -limit, limit);
          h[f] = (u + 1.0) * g / (1.0 + std::exp(-static_cast<double>(m.swiglu_alpha) * g));
        } else {
          h[f] = g / (1.0 + std::exp(-g)) * u;
        }
      }
      const double wt = w[static_cast<size_t>(t) * k + j];
      for (size_t d = 0; d < D; ++d) {
        double acc = 0;
        for (size_t f = 0; f < F; ++f) acc += ex.down[d * F + f] * h[f];
        if (!ex.down_bias.empty()) acc += ex.down_bias[d];
        y[static_cast<size_t>(t) * D + d] += wt * acc;
      }
    }
  }
  return y;
}

double relative_l2(const float* got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace colibri
