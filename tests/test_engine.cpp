// Engine correctness through the C ABI: colibri_infer against an independent
// float64 reference computed here with plain loops from the weights as they
// are STORED on disk (read back from the expert files and widened with the
// reference f16/bf16 conversions).
//
// The same executable is registered three times in CMake: with the detected
// ISA, with COLIBRI_ISA=scalar and with COLIBRI_ISA=avx2.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "colibri.h"
#include "lib/model_writer.h"
#include "kernels/kernels.h"
#include "moe/model.h"
#include "util/half.h"

#include "test_util.h"

namespace {

// ----------------------------------------------------------------- helpers
// A fresh directory, removed on destruction.
struct TempDir : colibri_test::TempDir {
  TempDir() : colibri_test::TempDir("colibri_engine") {}
};

const char* dtype_str(colibri::WeightType d) {
  switch (d) {
    case colibri::WeightType::kF32: return "f32";
    case colibri::WeightType::kF16: return "f16";
    case colibri::WeightType::kBF16: return "bf16";
    default: break;
  }
  return "?";
}

float nan_poison() { return std::numeric_limits<float>::quiet_NaN(); }

bool isa_env_is(const char* name) {
  const char* v = std::getenv("COLIBRI_ISA");
  return v != nullptr && std::strcmp(v, name) == 0;
}

// One expert's weights as stored, widened to float (exact).
struct RefExpert {
  std::vector<float> gate;  // [F][D]
  std::vector<float> up;    // [F][D]
  std::vector<float> down;  // [D][F]
};

// The weights of one layer, read back from the expert files on disk. File
// names and layout follow docs/FORMAT.md (written here independently of the
// library's own helpers): "expert_%02d.bin" for single-layer models,
// "layer_%02d/expert_%02d.bin" otherwise; gate [F][D], up [F][D], down [D][F],
// little-endian elements of the model's dtype.
struct RefLayer {
  int32_t D = 0, F = 0;
  std::vector<RefExpert> experts;
};

std::string expert_file_name(int32_t n_layers, int32_t layer, int32_t expert) {
  char buf[64];
  if (n_layers == 1) {
    std::snprintf(buf, sizeof buf, "expert_%02d.bin", expert);
  } else {
    std::snprintf(buf, sizeof buf, "layer_%02d/expert_%02d.bin", layer, expert);
  }
  return buf;
}

std::vector<float> decode_stored(const std::vector<uint8_t>& bytes, colibri::WeightType dtype) {
  std::vector<float> out;
  if (dtype == colibri::WeightType::kF32) {
    out.resize(bytes.size() / 4);
    for (size_t i = 0; i < out.size(); ++i) {
      const uint32_t u = static_cast<uint32_t>(bytes[4 * i]) |
                         static_cast<uint32_t>(bytes[4 * i + 1]) << 8 |
                         static_cast<uint32_t>(bytes[4 * i + 2]) << 16 |
                         static_cast<uint32_t>(bytes[4 * i + 3]) << 24;
      out[i] = colibri::bits_float(u);
    }
  } else {
    out.resize(bytes.size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      const uint16_t h = static_cast<uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8));
      out[i] = dtype == colibri::WeightType::kF16 ? colibri::f16_to_float(h) : colibri::bf16_to_float(h);
    }
  }
  return out;
}

RefLayer load_ref_layer(const std::string& dir, const colibri::ModelWriteSpec& spec,
                        int32_t layer) {
  RefLayer r;
  r.D = spec.d_model;
  r.F = spec.d_ff;
  const size_t DF = static_cast<size_t>(r.D) * static_cast<size_t>(r.F);
  const size_t elem = spec.dtype == colibri::WeightType::kF32 ? 4 : 2;
  r.experts.resize(static_cast<size_t>(spec.n_experts));
  for (int32_t e = 0; e < spec.n_experts; ++e) {
    const std::string path = dir + "/" + expert_file_name(spec.n_layers, layer, e);
    std::ifstream in(path, std::ios::binary);
    EXPECT_TRUE(in.good()) << "cannot read " << path;
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(bytes.size(), 3 * DF * elem) << path;
    bytes.resize(3 * DF * elem);
    const std::vector<float> all = decode_stored(bytes, spec.dtype);
    RefExpert& x = r.experts[static_cast<size_t>(e)];
    x.gate.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(DF));
    x.up.assign(all.begin() + static_cast<std::ptrdiff_t>(DF), all.begin() + static_cast<std::ptrdiff_t>(2 * DF));
    x.down.assign(all.begin() + static_cast<std::ptrdiff_t>(2 * DF), all.end());
  }
  return r;
}

// y[t] = sum_j w[t][j] * down_e(silu(gate_e x[t]) * up_e x[t]), in float64.
std::vector<double> reference(const RefLayer& L, int32_t T, int32_t k, const float* x,
                              const int32_t* ids, const float* w) {
  const size_t D = static_cast<size_t>(L.D), F = static_cast<size_t>(L.F);
  std::vector<double> y(static_cast<size_t>(T) * D, 0.0);
  std::vector<double> h(F);
  for (int32_t t = 0; t < T; ++t) {
    const float* xt = x + static_cast<size_t>(t) * D;
    for (int32_t j = 0; j < k; ++j) {
      const int32_t e = ids[static_cast<size_t>(t) * static_cast<size_t>(k) + static_cast<size_t>(j)];
      if (e == -1) continue;
      const double wt = w[static_cast<size_t>(t) * static_cast<size_t>(k) + static_cast<size_t>(j)];
      const RefExpert& ex = L.experts[static_cast<size_t>(e)];
      for (size_t f = 0; f < F; ++f) {
        double g = 0.0, u = 0.0;
        for (size_t d = 0; d < D; ++d) {
          g += static_cast<double>(ex.gate[f * D + d]) * xt[d];
          u += static_cast<double>(ex.up[f * D + d]) * xt[d];
        }
        h[f] = g / (1.0 + std::exp(-g)) * u;
      }
      for (size_t d = 0; d < D; ++d) {
        double acc = 0.0;
        for (size_t f = 0; f < F; ++f) acc += static_cast<double>(ex.down[d * F + f]) * h[f];
        y[static_cast<size_t>(t) * D + d] += wt * acc;
      }
    }
  }
  return y;
}

double tolerance(colibri::WeightType dtype) { return dtype == colibri::WeightType::kF32 ? 1e-5 : 5e-3; }

// Relative L2 error check; on failure describes the worst element.
::testing::AssertionResult close_to_reference(const std::vector<float>& y,
                                              const std::vector<double>& ref, int32_t D,
                                              double tol, const std::string& what) {
  if (y.size() != ref.size()) {
    return ::testing::AssertionFailure() << what << ": size " << y.size() << " vs " << ref.size();
  }
  double err2 = 0.0, ref2 = 0.0, worst = -1.0;
  size_t worst_i = 0;
  size_t n_nonfinite = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (!std::isfinite(y[i])) {
      if (n_nonfinite++ == 0) worst_i = i;
      worst = std::numeric_limits<double>::infinity();
      continue;
    }
    const double diff = static_cast<double>(y[i]) - ref[i];
    err2 += diff * diff;
    ref2 += ref[i] * ref[i];
    if (std::fabs(diff) > worst) {
      worst = std::fabs(diff);
      worst_i = i;
    }
  }
  const auto describe = [&](::testing::AssertionResult r) {
    const size_t t = D > 0 ? worst_i / static_cast<size_t>(D) : 0;
    const size_t d = D > 0 ? worst_i % static_cast<size_t>(D) : 0;
    if (!y.empty()) {
      r << "; worst element [token " << t << "][d " << d << "]: got " << y[worst_i] << ", want "
        << ref[worst_i];
    }
    return r;
  };
  if (n_nonfinite > 0) {
    return describe(::testing::AssertionFailure()
                    << what << ": " << n_nonfinite << " non-finite output elements (unwritten?)");
  }
  if (ref2 == 0.0) {
    if (err2 == 0.0) return ::testing::AssertionSuccess();
    return describe(::testing::AssertionFailure() << what << ": reference is all zero, output is not");
  }
  const double rel = std::sqrt(err2 / ref2);
  if (rel <= tol) return ::testing::AssertionSuccess();
  return describe(::testing::AssertionFailure()
                  << what << ": relative L2 error " << rel << " > " << tol);
}

struct Routing {
  int32_t k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Distinct experts per token, weights uniform in [-1, 2] (some > 1, some
// negative). holes: some slots -1, and token 1 (if any) has no expert at all.
Routing random_routing(std::mt19937& rng, int32_t T, int32_t E, int32_t k, bool holes) {
  Routing r;
  r.k = k;
  r.ids.resize(static_cast<size_t>(T) * static_cast<size_t>(k));
  r.weights.resize(r.ids.size());
  std::vector<int32_t> perm(static_cast<size_t>(E));
  std::uniform_real_distribution<float> wdist(-1.0f, 2.0f);
  std::bernoulli_distribution hole(0.25);
  for (int32_t t = 0; t < T; ++t) {
    for (int32_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = e;
    // Partial Fisher-Yates: the first k entries are a random k-subset.
    for (int32_t j = 0; j < k; ++j) {
      std::uniform_int_distribution<int32_t> pick(j, E - 1);
      std::swap(perm[static_cast<size_t>(j)], perm[static_cast<size_t>(pick(rng))]);
    }
    for (int32_t j = 0; j < k; ++j) {
      const size_t s = static_cast<size_t>(t) * static_cast<size_t>(k) + static_cast<size_t>(j);
      r.ids[s] = perm[static_cast<size_t>(j)];
      r.weights[s] = wdist(rng);
      if (holes && (hole(rng) || t == 1)) r.ids[s] = -1;
    }
  }
  return r;
}

std::vector<float> random_input(std::mt19937& rng, int32_t T, int32_t D) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * static_cast<size_t>(D));
  for (float& v : x) {
    v = dist(rng);
    if (v == 0.0f) v = 0.5f;
  }
  return x;
}

colibri_model_t* open_model(const std::string& dir, int32_t n_threads = 0) {
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.n_threads = n_threads;
  colibri_model_t* m = nullptr;
  const colibri_status_t st = colibri_open(dir.c_str(), &o, &m);
  EXPECT_EQ(st, COLIBRI_OK) << colibri_last_error();
  return m;
}

colibri_status_t run_infer(colibri_model_t* m, int32_t layer, int32_t T, const float* x, float* y,
                           const Routing& r, int32_t n_threads = 0) {
  colibri_infer_t in;
  colibri_infer_default(&in);
  in.layer = layer;
  in.n_tokens = T;
  in.input = x;
  in.output = y;
  in.top_k = r.k;
  in.expert_ids = r.ids.data();
  in.expert_weights = r.weights.data();
  in.n_threads = n_threads;
  return colibri_infer(m, &in);
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// ------------------------------------------------------- randomized cases

struct Case {
  int32_t E, k, D, F, T;
  bool holes;
};

// Every value of every dimension appears at least once in this list, and the
// list runs with each dtype, so every value meets every dtype. D*F stays
// small where E or T is large.
//   E: 1 3 8 16 60 128 256   k: 1 2 4 6 8   T: 0 1 3 37 1024
//   D: 1 7 100 129 512 1024  F: 1 7 100 129 256 1024
const Case kCases[] = {
    {1, 1, 1, 1, 1, false},
    {1, 1, 7, 7, 3, false},
    {1, 1, 129, 100, 1024, false},
    {3, 2, 7, 129, 37, true},
    {3, 1, 512, 1024, 3, false},
    {3, 2, 1024, 256, 3, true},
    {8, 4, 100, 7, 37, false},
    {8, 8, 7, 129, 1024, true},
    {8, 2, 100, 100, 0, false},
    {16, 6, 1, 100, 37, true},
    {16, 4, 129, 129, 37, false},
    {60, 6, 100, 129, 3, false},
    {60, 4, 7, 1, 1024, true},
    {128, 8, 7, 100, 37, false},
    {128, 1, 1, 7, 1, true},
    {256, 8, 7, 7, 1024, true},
    {256, 2, 100, 1, 37, false},
    {256, 6, 129, 7, 3, false},
    {256, 8, 1, 1, 0, true},
};

using CaseParam = std::tuple<Case, colibri::WeightType>;

std::string case_string(const Case& c, colibri::WeightType dtype) {
  std::ostringstream s;
  s << "E=" << c.E << " k=" << c.k << " D=" << c.D << " F=" << c.F << " T=" << c.T
    << " dtype=" << dtype_str(dtype) << (c.holes ? " holes" : "");
  return s.str();
}

class EngineCase : public ::testing::TestWithParam<CaseParam> {};

TEST_P(EngineCase, MatchesFloat64Reference) {
  const Case c = std::get<0>(GetParam());
  const colibri::WeightType dtype = std::get<1>(GetParam());
  const std::string what = case_string(c, dtype);
  SCOPED_TRACE(what);
  // The scalar kernels are a correctness baseline, not fast (and this binary
  // also runs under sanitizers and valgrind): the big-T cases add nothing
  // there that the small ones do not already check. COLIBRI_TEST_FULL=1
  // runs them anyway.
  if (isa_env_is("scalar") && c.T >= 1024 && std::getenv("COLIBRI_TEST_FULL") == nullptr) {
    GTEST_SKIP() << "T=1024 skipped with COLIBRI_ISA=scalar (set COLIBRI_TEST_FULL=1 to run)";
  }

  TempDir tmp;
  ASSERT_FALSE(tmp.path().empty());
  colibri::ModelWriteSpec spec;
  spec.n_layers = 1;
  spec.n_experts = c.E;
  spec.d_model = c.D;
  spec.d_ff = c.F;
  spec.dtype = dtype;
  const uint64_t seed = 1000u + static_cast<uint64_t>(c.E) * 31u + static_cast<uint64_t>(c.D) * 7u +
                        static_cast<uint64_t>(c.F) + static_cast<uint64_t>(dtype);
  colibri::write_random_model(tmp.path(), spec, seed);
  const RefLayer ref_layer = load_ref_layer(tmp.path(), spec, 0);

  colibri_model_t* m = open_model(tmp.path());
  ASSERT_NE(m, nullptr);

  std::mt19937 rng(static_cast<uint32_t>(seed * 2654435761u));
  const Routing r = random_routing(rng, c.T, c.E, c.k, c.holes);
  const std::vector<float> x = random_input(rng, c.T, c.D);

  if (c.T == 0) {
    // No-op: a poisoned buffer stays exactly as it was.
    std::vector<float> y(16, nan_poison());
    std::vector<float> before = y;
    float xin[16] = {0};
    const colibri_status_t st = run_infer(m, 0, 0, xin, y.data(), r);
    EXPECT_EQ(st, COLIBRI_OK) << colibri_last_error();
    EXPECT_EQ(std::memcmp(y.data(), before.data(), y.size() * sizeof(float)), 0);
  } else {
    std::vector<float> y(static_cast<size_t>(c.T) * static_cast<size_t>(c.D), nan_poison());
    const colibri_status_t st = run_infer(m, 0, c.T, x.data(), y.data(), r);
    ASSERT_EQ(st, COLIBRI_OK) << colibri_last_error();
    const std::vector<double> ref = reference(ref_layer, c.T, c.k, x.data(), r.ids.data(), r.weights.data());
    EXPECT_TRUE(close_to_reference(y, ref, c.D, tolerance(dtype), what));
    // A second call on the same model (scratch reused) with a poisoned
    // buffer gives the same bits.
    std::vector<float> y2(y.size(), nan_poison());
    ASSERT_EQ(run_infer(m, 0, c.T, x.data(), y2.data(), r), COLIBRI_OK) << colibri_last_error();
    EXPECT_TRUE(bitwise_equal(y, y2)) << what << ": second call differs";
  }
  colibri_free(m);
}

std::string case_name(const ::testing::TestParamInfo<CaseParam>& info) {
  const Case c = std::get<0>(info.param);
  std::ostringstream s;
  s << "E" << c.E << "_k" << c.k << "_D" << c.D << "_F" << c.F << "_T" << c.T << "_"
    << dtype_str(std::get<1>(info.param)) << (c.holes ? "_holes" : "");
  return s.str();
}

INSTANTIATE_TEST_SUITE_P(Randomized, EngineCase,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(colibri::WeightType::kF32, colibri::WeightType::kF16,
                                                              colibri::WeightType::kBF16)),
                         case_name);

// ------------------------------------------------------- focused properties

class EngineTest : public ::testing::Test {
 protected:
  TempDir tmp_;
};

TEST_F(EngineTest, ZeroTokensAcceptsNullPointers) {
  colibri::ModelWriteSpec spec;
  spec.n_experts = 4;
  spec.d_model = 8;
  spec.d_ff = 16;
  spec.dtype = colibri::WeightType::kF16;
  colibri::write_random_model(tmp_.path(), spec, 7);
  colibri_model_t* m = open_model(tmp_.path());
  ASSERT_NE(m, nullptr);

  colibri_infer_t in;
  colibri_infer_default(&in);
  in.n_tokens = 0;
  in.top_k = 2;
  EXPECT_EQ(colibri_infer(m, &in), COLIBRI_OK) << colibri_last_error();  // all pointers NULL

  // Non-NULL but T=0: nothing is read or written.
  float y[8];
  for (float& v : y) v = nan_poison();
  const int32_t ids[2] = {0, 1};
  const float w[2] = {1.0f, 1.0f};
  in.output = y;
  in.expert_ids = ids;
  in.expert_weights = w;
  EXPECT_EQ(colibri_infer(m, &in), COLIBRI_OK) << colibri_last_error();
  for (float v : y) EXPECT_TRUE(std::isnan(v));
  colibri_free(m);
}

TEST_F(EngineTest, AllSlotsEmptyGivesZeros) {
  colibri::ModelWriteSpec spec;
  spec.n_experts = 4;
  spec.d_model = 33;
  spec.d_ff = 17;
  spec.dtype = colibri::WeightType::kBF16;
  colibri::write_random_model(tmp_.path(), spec, 8);
  colibri_model_t* m = open_model(tmp_.path());
  ASSERT_NE(m, nullptr);
  std::mt19937 rng(8);
  const int32_t T = 5;
  Routing r;
  r.k = 3;
  r.ids.assign(static_cast<size_t>(T * r.k), -1);
  r.weights.assign(r.ids.size(), 1.5f);
  const std::vector<float> x = random_input(rng, T, spec.d_model);
  std::vector<float> y(x.size(), nan_poison());
  ASSERT_EQ(run_infer(m, 0, T, x.data(), y.data(), r), COLIBRI_OK) << colibri_last_error();
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], 0.0f) << "element " << i;
  colibri_free(m);
}

TEST_F(EngineTest, ThreadCountDoesNotChangeBits) {
  struct Shape {
    int32_t E, k, D, F, T;
    colibri::WeightType dtype;
  };
  const Shape shapes[] = {
      {8, 4, 192, 320, 37, colibri::WeightType::kF32},
      {8, 2, 129, 100, 1024, colibri::WeightType::kF16},
      {60, 6, 100, 64, 3, colibri::WeightType::kBF16},
  };
  for (const Shape& s : shapes) {
    SCOPED_TRACE("E=" + std::to_string(s.E) + " D=" + std::to_string(s.D) + " T=" + std::to_string(s.T));
    TempDir dir;
    colibri::ModelWriteSpec spec;
    spec.n_experts = s.E;
    spec.d_model = s.D;
    spec.d_ff = s.F;
    spec.dtype = s.dtype;
    colibri::write_random_model(dir.path(), spec, 11);
    colibri_model_t* m = open_model(dir.path(), 2);
    ASSERT_NE(m, nullptr);
    std::mt19937 rng(12);
    const Routing r = random_routing(rng, s.T, s.E, s.k, true);
    const std::vector<float> x = random_input(rng, s.T, s.D);
    std::vector<float> y1(x.size(), nan_poison()), y2(x.size(), nan_poison()),
        y0(x.size(), nan_poison());
    ASSERT_EQ(run_infer(m, 0, s.T, x.data(), y1.data(), r, 1), COLIBRI_OK) << colibri_last_error();
    ASSERT_EQ(run_infer(m, 0, s.T, x.data(), y2.data(), r, 2), COLIBRI_OK) << colibri_last_error();
    ASSERT_EQ(run_infer(m, 0, s.T, x.data(), y0.data(), r, 0), COLIBRI_OK) << colibri_last_error();
    EXPECT_TRUE(bitwise_equal(y1, y2)) << "n_threads 1 vs 2";
    EXPECT_TRUE(bitwise_equal(y1, y0)) << "n_threads 1 vs 0 (all)";
    const RefLayer L = load_ref_layer(dir.path(), spec, 0);
    EXPECT_TRUE(close_to_reference(y1, reference(L, s.T, s.k, x.data(), r.ids.data(), r.weights.data()),
                                   s.D, tolerance(s.dtype), "n_threads 1"));
    colibri_free(m);
  }
}

TEST_F(EngineTest, LayerIndexSelectsItsWeights) {
  colibri::ModelWriteSpec spec;
  spec.n_layers = 3;
  spec.n_experts = 5;
  spec.d_model = 40;
  spec.d_ff = 24;
  spec.dtype = colibri::WeightType::kF32;
  // Layers differ in scale and sign pattern, so a wrong layer cannot pass.
  colibri::write_model_dir(tmp_.path(), spec, [&](int32_t layer, int32_t expert, float* w) {
    std::mt19937 g(static_cast<uint32_t>(1000 * layer + expert));
    std::uniform_real_distribution<float> dist(-0.3f, 0.3f);
    const size_t n = 3 * static_cast<size_t>(spec.d_model) * static_cast<size_t>(spec.d_ff);
    for (size_t i = 0; i < n; ++i) w[i] = dist(g) * static_cast<float>(layer + 1);
  });
  colibri_model_t* m = open_model(tmp_.path());
  ASSERT_NE(m, nullptr);
  colibri_model_info_t info;
  ASSERT_EQ(colibri_model_info(m, &info), COLIBRI_OK);
  EXPECT_EQ(info.n_layers, 3);

  std::mt19937 rng(3);
  const int32_t T = 9;
  const Routing r = random_routing(rng, T, spec.n_experts, 2, false);
  const std::vector<float> x = random_input(rng, T, spec.d_model);
  std::vector<std::vector<float>> outs;
  for (int32_t layer = 0; layer < 3; ++layer) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const RefLayer L = load_ref_layer(tmp_.path(), spec, layer);
    std::vector<float> y(x.size(), nan_poison());
    ASSERT_EQ(run_infer(m, layer, T, x.data(), y.data(), r), COLIBRI_OK) << colibri_last_error();
    EXPECT_TRUE(close_to_reference(y, reference(L, T, 2, x.data(), r.ids.data(), r.weights.data()),
                                   spec.d_model, tolerance(spec.dtype), "layer " + std::to_string(layer)));
    outs.push_back(y);
  }
  EXPECT_FALSE(bitwise_equal(outs[0], outs[1]));
  EXPECT_FALSE(bitwise_equal(outs[1], outs[2]));
  colibri_free(m);
}

// Layer folders are named "layer_%02d": from layer 100 on the name has
// three digits ("layer_100"). Tiny experts keep this cheap.
TEST_F(EngineTest, MoreThanHundredLayers) {
  colibri::ModelWriteSpec spec;
  spec.n_layers = 101;
  spec.n_experts = 2;
  spec.d_model = 3;
  spec.d_ff = 2;
  spec.dtype = colibri::WeightType::kF32;
  ASSERT_NO_THROW(colibri::write_random_model(tmp_.path(), spec, 41));
  colibri_model_t* m = open_model(tmp_.path());
  ASSERT_NE(m, nullptr);
  std::mt19937 rng(42);
  const int32_t T = 4;
  const Routing r = random_routing(rng, T, spec.n_experts, 2, false);
  const std::vector<float> x = random_input(rng, T, spec.d_model);
  for (int32_t layer : {0, 99, 100}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const RefLayer L = load_ref_layer(tmp_.path(), spec, layer);
    std::vector<float> y(x.size(), nan_poison());
    ASSERT_EQ(run_infer(m, layer, T, x.data(), y.data(), r), COLIBRI_OK) << colibri_last_error();
    EXPECT_TRUE(close_to_reference(y, reference(L, T, 2, x.data(), r.ids.data(), r.weights.data()),
                                   spec.d_model, tolerance(spec.dtype), "layer " + std::to_string(layer)));
  }
  colibri_free(m);
}

std::string route_text(const Routing& r, int32_t T) {
  std::string text = "# token, ids..., weights...\n";
  char buf[64];
  for (int32_t t = 0; t < T; ++t) {
    text += std::to_string(t);
    for (int32_t j = 0; j < r.k; ++j) text += ", " + std::to_string(r.ids[static_cast<size_t>(t * r.k + j)]);
    for (int32_t j = 0; j < r.k; ++j) {
      std::snprintf(buf, sizeof buf, ", %.9g", static_cast<double>(r.weights[static_cast<size_t>(t * r.k + j)]));
      text += buf;
    }
    text += "\n";
  }
  return text;
}

TEST_F(EngineTest, RoutingBlobMatchesExplicitArrays) {
  enum Mode { kF32Weights, kF16Weights, kCompact };
  struct Shape {
    int32_t E, k, D, F, T;
    colibri::WeightType dtype;
    Mode mode;
  };
  const Shape shapes[] = {
      {8, 2, 64, 96, 37, colibri::WeightType::kF16, kF32Weights},
      {256, 8, 5, 3, 20, colibri::WeightType::kF32, kF32Weights},   // ids up to 255: 8-bit
      {300, 6, 7, 9, 50, colibri::WeightType::kBF16, kF32Weights},  // > 256 experts: 16-bit ids
      {3, 3, 33, 5, 1, colibri::WeightType::kF32, kF32Weights},
      {16, 4, 24, 40, 9, colibri::WeightType::kF16, kF16Weights},
      {4, 2, 31, 17, 37, colibri::WeightType::kBF16, kCompact},
  };
  for (const Shape& s : shapes) {
    SCOPED_TRACE("E=" + std::to_string(s.E) + " k=" + std::to_string(s.k) + " mode " +
                 std::to_string(static_cast<int>(s.mode)));
    TempDir dir;
    colibri::ModelWriteSpec spec;
    spec.n_experts = s.E;
    spec.d_model = s.D;
    spec.d_ff = s.F;
    spec.dtype = s.dtype;
    colibri::write_random_model(dir.path(), spec, 21);
    colibri_model_t* m = open_model(dir.path());
    ASSERT_NE(m, nullptr);
    std::mt19937 rng(22);
    Routing r = random_routing(rng, s.T, s.E, s.k, false);
    const std::vector<float> x = random_input(rng, s.T, s.D);

    const std::string text = route_text(r, s.T);
    colibri_route_compile_options_t co;
    colibri_route_compile_options_default(&co);
    co.n_experts = s.E;
    if (s.mode == kF16Weights) co.weight_encoding = COLIBRI_ROUTE_WEIGHTS_F16;
    if (s.mode == kCompact) co.compact = 1;
    void* blob = nullptr;
    size_t blob_size = 0;
    ASSERT_EQ(colibri_route_compile(text.data(), text.size(), "engine.route", &co, &blob, &blob_size),
              COLIBRI_OK)
        << colibri_last_error();

    if (s.mode != kF32Weights) {
      // Lossy weight encodings: the explicit arrays are what the blob decodes to.
      colibri_routing_t* decoded = nullptr;
      ASSERT_EQ(colibri_routing_decode(blob, blob_size, s.E, "engine blob", &decoded), COLIBRI_OK)
          << colibri_last_error();
      ASSERT_EQ(colibri_routing_n_tokens(decoded), s.T);
      ASSERT_EQ(colibri_routing_top_k(decoded), s.k);
      const int32_t* ids = colibri_routing_expert_ids(decoded);
      const float* ws = colibri_routing_expert_weights(decoded);
      for (size_t i = 0; i < r.ids.size(); ++i) {
        EXPECT_EQ(ids[i], r.ids[i]) << "slot " << i;
        if (s.mode == kF16Weights) {
          EXPECT_EQ(ws[i], colibri::f16_to_float(colibri::float_to_f16(r.weights[i]))) << "slot " << i;
        }
      }
      r.weights.assign(ws, ws + r.ids.size());
      colibri_routing_free(decoded);
    }

    std::vector<float> ya(x.size(), nan_poison()), yb(x.size(), nan_poison());
    ASSERT_EQ(run_infer(m, 0, s.T, x.data(), ya.data(), r), COLIBRI_OK) << colibri_last_error();
    colibri_infer_t in;
    colibri_infer_default(&in);
    in.n_tokens = s.T;
    in.input = x.data();
    in.output = yb.data();
    in.routing_blob = blob;
    in.routing_blob_size = blob_size;
    // Explicit arrays are ignored when a blob is given; make them garbage.
    in.top_k = 0;
    ASSERT_EQ(colibri_infer(m, &in), COLIBRI_OK) << colibri_last_error();
    EXPECT_TRUE(bitwise_equal(ya, yb)) << "blob path differs from explicit arrays";
    const RefLayer L = load_ref_layer(dir.path(), spec, 0);
    EXPECT_TRUE(close_to_reference(yb, reference(L, s.T, s.k, x.data(), r.ids.data(), r.weights.data()),
                                   s.D, tolerance(s.dtype), "blob"));
    colibri_buffer_free(blob);
    colibri_free(m);
  }
}

TEST_F(EngineTest, ConcurrentCallsFromFourThreads) {
  colibri::ModelWriteSpec spec;
  spec.n_experts = 16;
  spec.d_model = 96;
  spec.d_ff = 80;
  spec.dtype = colibri::WeightType::kF16;
  colibri::write_random_model(tmp_.path(), spec, 31);
  const RefLayer L = load_ref_layer(tmp_.path(), spec, 0);
  colibri_model_t* m = open_model(tmp_.path());
  ASSERT_NE(m, nullptr);

  constexpr int kThreads = 4;
  constexpr int kCalls = 8;
  struct Job {
    int32_t T = 0;
    Routing r;
    std::vector<float> x;
    std::vector<double> ref;
    std::vector<float> first;  // output of the first call
    int failures = 0;
    int mismatches = 0;
    std::string error;
  };
  std::vector<Job> jobs(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    std::mt19937 rng(static_cast<uint32_t>(100 + i));
    Job& j = jobs[static_cast<size_t>(i)];
    j.T = 5 + 13 * i;  // different shapes per thread
    j.r = random_routing(rng, j.T, spec.n_experts, 1 + i, i % 2 == 1);
    j.x = random_input(rng, j.T, spec.d_model);
    j.ref = reference(L, j.T, j.r.k, j.x.data(), j.r.ids.data(), j.r.weights.data());
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      Job& j = jobs[static_cast<size_t>(i)];
      for (int call = 0; call < kCalls; ++call) {
        std::vector<float> y(j.x.size(), nan_poison());
        if (run_infer(m, 0, j.T, j.x.data(), y.data(), j.r) != COLIBRI_OK) {
          ++j.failures;
          j.error = colibri_last_error();
          continue;
        }
        if (call == 0) {
          j.first = y;
        } else if (!bitwise_equal(y, j.first)) {
          ++j.mismatches;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    const Job& j = jobs[static_cast<size_t>(i)];
    SCOPED_TRACE("thread " + std::to_string(i));
    EXPECT_EQ(j.failures, 0) << j.error;
    EXPECT_EQ(j.mismatches, 0);
    EXPECT_TRUE(close_to_reference(j.first, j.ref, spec.d_model, tolerance(spec.dtype),
                                   "thread " + std::to_string(i)));
  }
  colibri_stats_t st;
  ASSERT_EQ(colibri_stats(m, &st), COLIBRI_OK);
  EXPECT_EQ(st.infer_calls, static_cast<uint64_t>(kThreads * kCalls));
  colibri_free(m);
}

// The engine reports its decode table: the fp32 table of the level, except
// bf16 weights on AVX512_BF16 CPUs, which get the fp32-grade split table.
TEST_F(EngineTest, KernelTableFollowsWeightType) {
  namespace k = colibri::kernels;
  for (const colibri::WeightType dtype : {colibri::WeightType::kF32, colibri::WeightType::kF16, colibri::WeightType::kBF16}) {
    SCOPED_TRACE(dtype_str(dtype));
    TempDir dir;
    colibri::ModelWriteSpec spec;
    spec.n_experts = 2;
    spec.d_model = 16;
    spec.d_ff = 8;
    spec.dtype = dtype;
    colibri::write_random_model(dir.path(), spec, 5);
    colibri::OpenOptions o;
    o.threads = 1;
    std::string warnings;
    colibri::Model model(dir.path(), o, &warnings);
    const k::KernelTable& table = model.engine().kernels();
    // The AMX level decodes with the AVX-512 kernels.
    const k::Isa decode_isa = std::min(k::default_isa(), k::Isa::kAvx512);
    const bool split = dtype == colibri::WeightType::kBF16 && k::bf16_compute_available(k::default_isa());
    EXPECT_STREQ(table.name, split ? "avx512-bf16-split" : k::isa_name(decode_isa));
    EXPECT_EQ(table.isa, decode_isa);
    std::printf("%s weights: %s kernels\n", dtype_str(dtype), table.name);
  }
}

// Relative L2 error of each weight type's kernel path on one realistic-ish
// layer (numbers quoted in docs/PRECISION.md), printed and recorded as test
// properties, and held to the same tolerance as the other engine tests.
TEST_F(EngineTest, PrecisionPerWeightType) {
  for (const colibri::WeightType dtype : {colibri::WeightType::kF32, colibri::WeightType::kF16, colibri::WeightType::kBF16}) {
    SCOPED_TRACE(dtype_str(dtype));
    TempDir dir;
    colibri::ModelWriteSpec spec;
    spec.n_experts = 8;
    spec.d_model = 512;
    spec.d_ff = 1024;
    spec.dtype = dtype;
    colibri::write_random_model(dir.path(), spec, 77);
    const RefLayer L = load_ref_layer(dir.path(), spec, 0);
    std::string warnings;
    colibri::Model model(dir.path(), colibri::OpenOptions{}, &warnings);
    std::mt19937 rng(78);
    const int32_t T = 64;
    const Routing r = random_routing(rng, T, spec.n_experts, 2, false);
    const std::vector<float> x = random_input(rng, T, spec.d_model);
    std::vector<float> y(x.size(), nan_poison());
    colibri::InferArgs a;
    a.n_tokens = T;
    a.input = x.data();
    a.output = y.data();
    a.top_k = r.k;
    a.expert_ids = r.ids.data();
    a.expert_weights = r.weights.data();
    model.engine().infer(a);
    const std::vector<double> ref = reference(L, T, r.k, x.data(), r.ids.data(), r.weights.data());
    double err2 = 0.0, ref2 = 0.0;
    for (size_t i = 0; i < y.size(); ++i) {
      err2 += (y[i] - ref[i]) * (y[i] - ref[i]);
      ref2 += ref[i] * ref[i];
    }
    const double rel = std::sqrt(err2 / ref2);
    const char* kernels = model.engine().kernels().name;
    std::printf("relative L2 error, %s weights, %s kernels: %.3g\n", dtype_str(dtype), kernels, rel);
    RecordProperty(std::string("rel_l2_") + dtype_str(dtype) + "_" + kernels, std::to_string(rel));
    EXPECT_TRUE(close_to_reference(y, ref, spec.d_model, tolerance(dtype), kernels));
  }
}

// The CMake registrations engine_scalar / engine_avx2 set COLIBRI_ISA; make
// sure the engine level really is the one requested (never above detection).
TEST(EngineIsa, EnvironmentSelectsIsa) {
  namespace k = colibri::kernels;
  const char* env = std::getenv("COLIBRI_ISA");
  const k::Isa chosen = k::default_isa();
  RecordProperty("isa", k::isa_name(chosen));
  std::printf("engine ISA: %s (COLIBRI_ISA=%s)\n", k::isa_name(chosen), env ? env : "<unset>");
  k::Isa requested;
  if (env != nullptr && k::parse_isa(env, &requested)) {
    const k::Isa detected = k::detect_isa();
    EXPECT_EQ(chosen, requested < detected ? requested : detected);
  } else {
    EXPECT_EQ(chosen, k::detect_isa());
  }
}

}  // namespace
