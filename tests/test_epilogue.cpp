// The kernels' epilogues: the clamped SwiGLU (gpt-oss) and expert biases,
// for every table that claims them (KernelTable::any_epilogue) at every
// level this CPU runs, against a float64 reference on the weights as the
// table sees them (dequantised by the format's reference dequantiser).
// Inputs are scaled so that the clamps bite on a good share of the rows;
// the test checks that they do, and that a plain SwiGLU or a dropped bias
// would fail it. Output buffers are poisoned (NaN) before every call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "moe/expert_store.h"
#include "runtime/memory.h"
#include "util/weight_format.h"

#include "kernel_scratch.h"

namespace {

using colibri::WeightType;
using namespace colibri::kernels;

// Relative L2 allowed against the float64 reference: tables that keep
// activations in fp32, and the int8 tables (activations quantised to int8
// blocks, docs/PRECISION.md).
constexpr double kFloatTolerance = 2e-5;
constexpr double kInt8Tolerance = 3e-2;

struct Expert {
  ExpertShape shape;
  colibri::WeightRegion packed;
  std::vector<double> gate, up, down;             // as the kernels see them: [F][D], [F][D], [D][F]
  std::vector<float> gate_bias, up_bias, down_bias;  // [F], [F], [D]
};

std::vector<float> uniform(size_t n, float scale, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Weights rounded to `t` and back: the values the kernels compute with.
std::vector<double> as_stored(WeightType t, const std::vector<float>& w, size_t rows, size_t cols,
                              std::vector<uint8_t>* bytes) {
  bytes->assign(colibri::weight_row_bytes(t, cols) * rows, 0);
  colibri::convert_rows_from_float(t, w.data(), rows, cols, bytes->data());
  std::vector<float> back(rows * cols);
  colibri::convert_rows_to_float(t, bytes->data(), rows, cols, back.data());
  return {back.begin(), back.end()};
}

Expert make_expert(int32_t D, int32_t F, WeightType t, Activation act, bool biased, std::mt19937_64& rng) {
  Expert e;
  e.shape = make_expert_shape(D, F, t);
  e.shape.epilogue.activation = act;
  e.shape.epilogue.biased = biased;
  const size_t d = static_cast<size_t>(D), f = static_cast<size_t>(F);
  std::vector<uint8_t> gate, up, down;
  e.gate = as_stored(t, uniform(f * d, std::sqrt(3.0f / static_cast<float>(D)), rng), f, d, &gate);
  e.up = as_stored(t, uniform(f * d, std::sqrt(3.0f / static_cast<float>(D)), rng), f, d, &up);
  e.down = as_stored(t, uniform(d * f, std::sqrt(3.0f / static_cast<float>(F)), rng), d, f, &down);
  // Biases of gpt-oss's scale (a few units), large enough to move rows
  // across the clamps.
  e.gate_bias = uniform(f, 3.0f, rng);
  e.up_bias = uniform(f, 3.0f, rng);
  e.down_bias = uniform(d, 2.0f, rng);
  e.packed = colibri::WeightRegion(colibri::packed_expert_bytes(e.shape), false);
  colibri::ExpertParts parts{gate.data(), up.data(), down.data()};
  parts.gate_bias = reinterpret_cast<const uint8_t*>(e.gate_bias.data());
  parts.up_bias = reinterpret_cast<const uint8_t*>(e.up_bias.data());
  parts.down_bias = reinterpret_cast<const uint8_t*>(e.down_bias.data());
  colibri::pack_expert_parts(parts, e.shape, e.packed.data());
  if (biased) {
    // As the engine does (ExpertStore::expert_shape): the packed copies.
    const auto* bias = reinterpret_cast<const float*>(e.packed.data() + colibri::packed_bias_offset(e.shape));
    e.shape.epilogue.gate_up_bias = bias;
    e.shape.epilogue.down_bias = bias + 2 * f;
  }
  return e;
}

// Phase 1's h for one token in float64; `clamped_rows` counts rows where a
// clamp changed g or u.
double reference_h(const Expert& e, const float* x, size_t f, bool clamped, bool biased, int* clamped_rows) {
  const size_t D = static_cast<size_t>(e.shape.d_model);
  double g = 0, u = 0;
  for (size_t j = 0; j < D; ++j) {
    g += e.gate[f * D + j] * x[j];
    u += e.up[f * D + j] * x[j];
  }
  if (biased) {
    g += e.gate_bias[f];
    u += e.up_bias[f];
  }
  if (!clamped) return g / (1.0 + std::exp(-g)) * u;
  const double limit = e.shape.epilogue.limit;
  if (g > limit || std::fabs(u) > limit) ++*clamped_rows;
  g = std::min(g, limit);
  u = std::clamp(u, -limit, limit);
  return (u + 1.0) * g / (1.0 + std::exp(-static_cast<double>(e.shape.epilogue.alpha) * g));
}

double relative_l2(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

struct Variant {
  const KernelTable* table;
  bool int8;
};

// Every table claiming any_epilogue that can run experts of type t here.
std::vector<Variant> tables_for(WeightType t) {
  std::vector<Variant> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!isa_supported(isa)) continue;
    if (colibri::weight_format(t).quantized) {
      out.push_back({&quant_kernels(isa, false), true});
      out.push_back({&quant_kernels(isa, true), false});
    } else {
      out.push_back({&kernel_table(isa), false});
    }
  }
  for (const Variant& v : out) EXPECT_TRUE(v.table->any_epilogue) << v.table->name;
  return out;
}

struct Result {
  double h_err = 0, y_err = 0;
  double plain_h_err = 0;  // the same output against a plain-SwiGLU reference
  double unbiased_y_err = 0;  // against a reference without down's bias
  int clamped_rows = 0, rows = 0;
};

// Both phases of one table on one expert with n tokens (gathered from a
// larger input), over a random row range, the prepared entries when the
// table has them and `prepared` asks for them.
Result run(const Variant& v, const Expert& e, int32_t n, bool prepared, std::mt19937_64& rng) {
  const KernelTable& k = *v.table;
  const ExpertShape& s = e.shape;
  const size_t D = static_cast<size_t>(s.d_model), F = static_cast<size_t>(s.d_ff);
  const bool clamped = s.epilogue.activation == Activation::kClampedSwiGLU;
  const bool biased = s.epilogue.biased;
  const int32_t x_rows = n + 2;
  // std(g) and std(u) about 8 (before the biases): a clamp at 7 changes
  // about half of the rows.
  const std::vector<float> x = uniform(static_cast<size_t>(x_rows) * D, 14.0f, rng);
  std::vector<int32_t> tok(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) tok[static_cast<size_t>(i)] = (i * 7 + 1) % x_rows;
  const int32_t f_begin = static_cast<int32_t>(rng() % 3), f_end = s.d_ff - static_cast<int32_t>(rng() % 3);
  const size_t ldh = F + 5;
  std::vector<float> h(static_cast<size_t>(n) * ldh, std::numeric_limits<float>::quiet_NaN());
  std::vector<uint8_t> prep;
  const bool use_prepared = prepared && k.prepare != nullptr;
  auto* scratch = colibri_test::thread_scratch();
  if (k.reserve != nullptr) k.reserve(s, n, std::max(s.d_model, s.d_ff), scratch);
  if (use_prepared) {
    prep.resize(k.prepared_bytes(s, Phase::kGateUp, n) + 64);
    void* at = prep.data() + (64 - reinterpret_cast<uintptr_t>(prep.data()) % 64) % 64;
    k.prepare(s, Phase::kGateUp, x.data(), D, tok.data(), n, at);
    k.gate_up_prepared(s, e.packed.data(), x.data(), D, tok.data(), at, n, f_begin, f_end, h.data(), ldh, scratch);
  } else {
    k.gate_up(s, e.packed.data(), x.data(), D, tok.data(), n, f_begin, f_end, h.data(), ldh, scratch);
  }
  Result r;
  std::vector<float> got_h;
  std::vector<double> ref_h, plain_h;
  for (int32_t i = 0; i < n; ++i) {
    const float* xi = x.data() + static_cast<size_t>(tok[static_cast<size_t>(i)]) * D;
    for (int32_t f = 0; f < s.d_ff; ++f) {
      const float got = h[static_cast<size_t>(i) * ldh + static_cast<size_t>(f)];
      if (f < f_begin || f >= f_end) {
        EXPECT_TRUE(std::isnan(got)) << k.name << ": wrote h outside its rows at f " << f;
        continue;
      }
      int ignored = 0;
      got_h.push_back(got);
      ref_h.push_back(reference_h(e, xi, static_cast<size_t>(f), clamped, biased, &r.clamped_rows));
      plain_h.push_back(reference_h(e, xi, static_cast<size_t>(f), false, biased, &ignored));
      ++r.rows;
    }
  }
  r.h_err = relative_l2(got_h, ref_h);
  r.plain_h_err = relative_l2(got_h, plain_h);

  // Phase 2 on a fresh h (exact values, rows outside the range too), with
  // routing weights, into a y that already holds values.
  std::vector<float> hin = uniform(static_cast<size_t>(n) * ldh, 2.0f, rng);
  const std::vector<float> weight = uniform(static_cast<size_t>(n), 1.0f, rng);
  const int32_t y_rows = n + 1;
  std::vector<int32_t> ytok(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) ytok[static_cast<size_t>(i)] = (i * 5 + 2) % y_rows;
  std::vector<float> y = uniform(static_cast<size_t>(y_rows) * D, 1.0f, rng);
  const std::vector<float> y0 = y;
  const int32_t d_begin = static_cast<int32_t>(rng() % 3), d_end = s.d_model - static_cast<int32_t>(rng() % 3);
  if (use_prepared) {
    prep.resize(k.prepared_bytes(s, Phase::kDown, n) + 64);
    void* at = prep.data() + (64 - reinterpret_cast<uintptr_t>(prep.data()) % 64) % 64;
    k.prepare(s, Phase::kDown, hin.data(), ldh, nullptr, n, at);
    k.down_prepared(s, e.packed.data() + colibri::packed_gate_up_bytes(s), hin.data(), ldh, at, ytok.data(),
                    weight.data(), n, d_begin, d_end, y.data(), D, scratch);
  } else {
    k.down(s, e.packed.data() + colibri::packed_gate_up_bytes(s), hin.data(), ldh, ytok.data(), weight.data(), n,
           d_begin, d_end, y.data(), D, scratch);
  }
  std::vector<double> ref(y0.begin(), y0.end()), unbiased(y0.begin(), y0.end());
  for (int32_t i = 0; i < n; ++i) {
    const float* hi = hin.data() + static_cast<size_t>(i) * ldh;
    for (int32_t d = d_begin; d < d_end; ++d) {
      double acc = 0;
      for (size_t j = 0; j < F; ++j) acc += e.down[static_cast<size_t>(d) * F + j] * hi[j];
      const size_t at = static_cast<size_t>(ytok[static_cast<size_t>(i)]) * D + static_cast<size_t>(d);
      unbiased[at] += weight[static_cast<size_t>(i)] * acc;
      ref[at] += weight[static_cast<size_t>(i)] * (acc + (biased ? e.down_bias[static_cast<size_t>(d)] : 0.0));
    }
  }
  for (size_t i = 0; i < y.size(); ++i) {
    const auto d = static_cast<int32_t>(i % D);
    if (d < d_begin || d >= d_end) {
      EXPECT_EQ(y[i], y0[i]) << k.name << ": wrote y outside its rows at d " << d;
    }
  }
  // The error of what was added, not of y0's values it was added to.
  std::vector<float> added(y.size());
  std::vector<double> ref_added(y.size()), unbiased_added(y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    added[i] = static_cast<float>(static_cast<double>(y[i]) - y0[i]);
    ref_added[i] = ref[i] - y0[i];
    unbiased_added[i] = unbiased[i] - y0[i];
  }
  r.y_err = relative_l2(added, ref_added);
  r.unbiased_y_err = relative_l2(added, unbiased_added);
  return r;
}

class EpilogueTest : public ::testing::TestWithParam<WeightType> {};

TEST_P(EpilogueTest, ClampedSwigluWithBiasesMatchesReference) {
  const WeightType t = GetParam();
  std::mt19937_64 rng(17 + static_cast<uint64_t>(t));
  // D not a multiple of any block; F leaves tails in the row chunks.
  struct Dims {
    int32_t d, f;
  };
  for (const Dims dims : {Dims{96, 40}, Dims{320, 200}}) {
    for (bool biased : {false, true}) {
      const Expert e = make_expert(dims.d, dims.f, t, Activation::kClampedSwiGLU, biased, rng);
      for (const Variant& v : tables_for(t)) {
        const double tol = v.int8 ? kInt8Tolerance : kFloatTolerance;
        for (int32_t n : {1, 3, 5, 33}) {
          for (bool prepared : {false, true}) {
            const Result r = run(v, e, n, prepared, rng);
            const std::string what = std::string(v.table->name) + " " + colibri::weight_format(t).name +
                                     " D=" + std::to_string(dims.d) + " F=" + std::to_string(dims.f) +
                                     " n=" + std::to_string(n) + (biased ? " biased" : "") +
                                     (prepared ? " prepared" : "");
            EXPECT_LE(r.h_err, tol) << what;
            EXPECT_LE(r.y_err, tol) << what;
            // The test has teeth: the clamps changed many rows, and a plain
            // SwiGLU (or a missing down bias) would be far outside the bound.
            EXPECT_GE(r.clamped_rows * 4, r.rows) << what;
            EXPECT_GT(r.plain_h_err, 5 * tol) << what;
            if (biased) {
              EXPECT_GT(r.unbiased_y_err, 5 * tol) << what;
            }
          }
        }
      }
    }
  }
}

// Plain SwiGLU with biases (the flag alone, no clamp).
TEST_P(EpilogueTest, BiasedSwigluMatchesReference) {
  const WeightType t = GetParam();
  std::mt19937_64 rng(99 + static_cast<uint64_t>(t));
  const Expert e = make_expert(128, 72, t, Activation::kSwiGLU, true, rng);
  for (const Variant& v : tables_for(t)) {
    const double tol = v.int8 ? kInt8Tolerance : kFloatTolerance;
    for (int32_t n : {1, 6}) {
      const Result r = run(v, e, n, true, rng);
      EXPECT_LE(r.h_err, tol) << v.table->name << " n=" << n;
      EXPECT_LE(r.y_err, tol) << v.table->name << " n=" << n;
      EXPECT_GT(r.unbiased_y_err, 5 * tol) << v.table->name;
    }
  }
}

// The plan never hands an expert with another epilogue to a table that
// only computes plain SwiGLU, at any level, precision or token count.
TEST_P(EpilogueTest, PlansUseOnlyTablesThatComputeTheEpilogue) {
  const WeightType t = GetParam();
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx}) {
    if (!isa_supported(isa)) continue;
    for (PrefillPrecision p : {PrefillPrecision::kDefault, PrefillPrecision::kExact, PrefillPrecision::kBf16}) {
      ExpertShape s = make_expert_shape(2880, 2880, t);
      s.epilogue.activation = Activation::kClampedSwiGLU;
      s.epilogue.biased = true;
      const KernelPlan plan = plan_kernels(isa, s, p);
      for (int32_t n : {1, 4, 8, 16, 64, 128, 512}) {
        EXPECT_TRUE(plan.pick(n).any_epilogue) << plan.pick(n).name << " at n=" << n << " " << isa_name(isa);
      }
    }
  }
}

// glu_pairs at every level this CPU runs against apply_glu's formula in
// float64: both activations, with and without biases, every tail length,
// inputs from -120 to 120 (exp over- and underflowing), and NaN in a gate
// and in an up value (which must come out NaN). Outputs poisoned, and
// nothing past fn written.
TEST(GluPairs, EveryLevelMatchesTheFormula) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> wide(-120.0f, 120.0f);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  constexpr int32_t kMax = 53;
  std::vector<float> o(2 * kMax), bias(2 * (kMax + 5));
  for (size_t i = 0; i < o.size(); ++i) o[i] = i % 5 == 0 ? wide(rng) : normal(rng);
  for (float& b : bias) b = normal(rng);
  o[2 * 7] = std::numeric_limits<float>::quiet_NaN();      // a gate
  o[2 * 20 + 1] = std::numeric_limits<float>::quiet_NaN();  // an up value
  const float poison = -12345.0f;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!isa_supported(isa)) continue;
    const GluPairsFn glu = glu_pairs(isa);
    for (Activation act : {Activation::kSwiGLU, Activation::kClampedSwiGLU}) {
      for (bool biased : {false, true}) {
        Epilogue e;
        e.activation = act;
        e.biased = biased;
        e.gate_up_bias = biased ? bias.data() : nullptr;
        const int32_t f0 = biased ? 5 : 0;  // the bias is read from pair f0 on
        for (int32_t fn = 1; fn <= kMax; ++fn) {
          std::vector<float> h(static_cast<size_t>(fn) + 16, poison);
          glu(e, f0, o.data(), fn, h.data());
          for (int32_t f = 0; f < fn; ++f) {
            double g = o[2 * f], u = o[2 * f + 1];
            if (biased) {
              g += bias[2 * static_cast<size_t>(f0 + f)];
              u += bias[2 * static_cast<size_t>(f0 + f) + 1];
            }
            double want;
            if (act == Activation::kSwiGLU) {
              want = g / (1.0 + std::exp(-g)) * u;
            } else {
              g = std::isnan(g) ? g : std::min(g, static_cast<double>(e.limit));
              u = std::isnan(u) ? u : std::max(std::min(u, static_cast<double>(e.limit)), -static_cast<double>(e.limit));
              want = (u + 1.0) * (g / (1.0 + std::exp(-e.alpha * g)));
            }
            const std::string what = std::string(isa_name(isa)) + (act == Activation::kSwiGLU ? " swiglu" : " clamped") +
                                     (biased ? " biased" : "") + " fn=" + std::to_string(fn) + " f=" + std::to_string(f);
            if (std::isnan(want)) {
              EXPECT_TRUE(std::isnan(h[static_cast<size_t>(f)])) << what;
            } else {
              EXPECT_NEAR(h[static_cast<size_t>(f)], want, 2e-6 * std::abs(want) + 1e-30) << what;
            }
          }
          for (size_t f = static_cast<size_t>(fn); f < h.size(); ++f) ASSERT_EQ(h[f], poison) << isa_name(isa) << " fn=" << fn;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, EpilogueTest,
                         ::testing::Values(WeightType::kF32, WeightType::kF16, WeightType::kBF16, WeightType::kQ8_0,
                                           WeightType::kQ4_0, WeightType::kQ4_K, WeightType::kQ6_K,
                                           WeightType::kMXFP4),
                         [](const ::testing::TestParamInfo<WeightType>& p) {
                           return std::string(colibri::weight_format(p.param).name);
                         });

}  // namespace
