// Open options that change which kernels run: bf16_compute and
// reserve_tokens. Results stay within the core tolerances, and the kernels the
// model reports match the option.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "lib/model_writer.h"
#include "kernels/amx.h"
#include "reference.h"
#include "test_util.h"

namespace {

struct TempDir : colibri_test::TempDir {
  TempDir() : colibri_test::TempDir("colibri_options"), path(colibri_test::TempDir::path()) {}
  const std::string path;
};

// T tokens routed so that every expert gets many tokens: the prefill path.
double run_relative_error(const std::string& dir, const colibri_open_options_t& o, int T, int k, int E,
                          int D, std::string* kernels) {
  colibri_model_t* m = nullptr;
  EXPECT_EQ(colibri_open(dir.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  if (m == nullptr) return INFINITY;
  *kernels = colibri_model_kernels(m);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * D), y(x.size(), NAN), w(static_cast<size_t>(T) * k);
  std::vector<int32_t> ids(w.size());
  for (float& v : x) v = u(rng);
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      ids[static_cast<size_t>(t) * k + j] = (t + j * 3) % E;
      w[static_cast<size_t>(t) * k + j] = u(rng);
    }
  }
  colibri_infer_t r;
  colibri_infer_default(&r);
  r.n_tokens = T;
  r.input = x.data();
  r.output = y.data();
  r.top_k = k;
  r.expert_ids = ids.data();
  r.expert_weights = w.data();
  EXPECT_EQ(colibri_infer(m, &r), COLIBRI_OK) << colibri_last_error();
  colibri_free(m);
  const std::vector<double> ref = colibri_test::reference_layer(dir, 0, T, x.data(), k, ids.data(), w.data());
  return colibri_test::relative_l2(y.data(), ref);
}

// A 4-expert model with d_model 160 and d_ff 144: both at least
// kBf16RoundingMinDim, so the rounding prefill tables may run on it.
void write_precision_model(const std::string& dir, colibri_dtype_t dtype, uint64_t seed) {
  colibri::ModelWriteSpec spec;
  spec.n_experts = 4;
  spec.d_model = 160;
  spec.d_ff = 144;
  spec.dtype = colibri_test::weight_type(dtype);
  colibri::write_random_model(dir, spec, seed);
}

TEST(OpenOptions, Bf16ComputeOnF16ModelIsOptInAndWithinTolerance) {
  TempDir dir;
  write_precision_model(dir.path, COLIBRI_DTYPE_F16, 3);
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  EXPECT_EQ(o.bf16_compute, 0);
  EXPECT_EQ(o.exact_prefill, 0);
  EXPECT_EQ(o.reserve_tokens, 64);
  std::string kernels;
  const double accurate = run_relative_error(dir.path, o, 256, 2, 4, 160, &kernels);
  EXPECT_LE(accurate, 1e-5) << kernels;  // fp32 paths only: f16 weights used exactly
  EXPECT_EQ(kernels.find("bf16"), std::string::npos) << kernels;
  o.bf16_compute = 1;
  const double rounded = run_relative_error(dir.path, o, 256, 2, 4, 160, &kernels);
  EXPECT_LE(rounded, 5e-3) << kernels;
  // AMX runs only at level amx (COLIBRI_ISA=avx512/avx2/scalar turn it off).
  if (colibri::kernels::default_isa() == colibri::kernels::Isa::kAmx) {
    EXPECT_NE(kernels.find("amx-bf16"), std::string::npos) << kernels;
    EXPECT_GT(rounded, accurate);  // the option did change the arithmetic
  }
}

// bf16 weights: many-token calls round activations on AMX tiles by
// default; exact_prefill keeps every call at fp32 grade (the stored bf16
// weights used exactly), so the error drops to fp32 summation error.
TEST(OpenOptions, ExactPrefillOnBf16ModelIsFp32Grade) {
  TempDir dir;
  write_precision_model(dir.path, COLIBRI_DTYPE_BF16, 8);
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  std::string kernels;
  // "decode X, prefill Y from N tokens/expert, ...": the prefill part.
  const auto prefill_of = [](const std::string& k) {
    const size_t at = k.find("prefill");
    return at == std::string::npos ? std::string() : k.substr(at);
  };
  const double by_default = run_relative_error(dir.path, o, 256, 2, 4, 160, &kernels);
  EXPECT_LE(by_default, 5e-3) << kernels;
  EXPECT_EQ(prefill_of(kernels).find("avx512-bf16"), std::string::npos) << kernels;  // never without asking
  if (colibri::kernels::default_isa() == colibri::kernels::Isa::kAmx) {
    EXPECT_NE(kernels.find("amx-bf16"), std::string::npos) << kernels;
  }
  o.exact_prefill = 1;
  const double exact = run_relative_error(dir.path, o, 256, 2, 4, 160, &kernels);
  EXPECT_LE(exact, 1e-5) << kernels;
  EXPECT_EQ(prefill_of(kernels).find("bf16"), std::string::npos) << kernels;
}

TEST(OpenOptions, ReserveTokensZeroAndLargeCallsStillCorrect) {
  TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_experts = 3;
  spec.d_model = 33;
  spec.d_ff = 47;
  spec.dtype = colibri::WeightType::kF32;
  colibri::write_random_model(dir.path, spec, 4);
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.reserve_tokens = 0;  // every call grows scratch
  std::string kernels;
  EXPECT_LE(run_relative_error(dir.path, o, 300, 2, 3, 33, &kernels), 1e-5);
  o.reserve_tokens = -1;
  colibri_model_t* m = nullptr;
  EXPECT_EQ(colibri_open(dir.path.c_str(), &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(std::string(colibri_last_error()).find("reserve_tokens"), std::string::npos);
}

// Skewed routing: every token to one expert (that expert takes the prefill
// path, the other 15 are empty), then the same with k=2 where the second slot
// is spread, then a single token. Every dtype; within the core tolerances.
TEST(EngineRouting, SkewedEmptyExpertsAndSingleToken) {
  for (colibri_dtype_t dtype : {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16}) {
    SCOPED_TRACE(colibri_dtype_name(dtype));
    TempDir dir;
    colibri::ModelWriteSpec spec;
    spec.n_experts = 16;
    spec.d_model = 72;
    spec.d_ff = 40;
    spec.dtype = colibri_test::weight_type(dtype);
    colibri::write_random_model(dir.path, spec, 11);
    colibri_model_t* m = nullptr;
    ASSERT_EQ(colibri_open(dir.path.c_str(), nullptr, &m), COLIBRI_OK) << colibri_last_error();
    const double tol = dtype == COLIBRI_DTYPE_F32 ? 1e-5 : 5e-3;
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int k : {1, 2}) {
      for (int T : {200, 1}) {
        std::vector<float> x(static_cast<size_t>(T) * 72), y(x.size(), NAN), w(static_cast<size_t>(T) * k);
        std::vector<int32_t> ids(w.size());
        for (float& v : x) v = u(rng);
        for (int t = 0; t < T; ++t) {
          ids[static_cast<size_t>(t) * k] = 9;  // the hot expert
          if (k == 2) ids[static_cast<size_t>(t) * k + 1] = t % 3;
          for (int j = 0; j < k; ++j) w[static_cast<size_t>(t) * k + j] = u(rng);
        }
        colibri_infer_t r;
        colibri_infer_default(&r);
        r.n_tokens = T;
        r.input = x.data();
        r.output = y.data();
        r.top_k = k;
        r.expert_ids = ids.data();
        r.expert_weights = w.data();
        ASSERT_EQ(colibri_infer(m, &r), COLIBRI_OK) << colibri_last_error();
        const std::vector<double> ref =
            colibri_test::reference_layer(dir.path, 0, T, x.data(), k, ids.data(), w.data());
        EXPECT_LE(colibri_test::relative_l2(y.data(), ref), tol) << "k=" << k << " T=" << T;
      }
    }
    colibri_free(m);
  }
}

}  // namespace

namespace {

struct ProgressLog {
  std::vector<float> seen;
  float cancel_at = 2.0f;  // return 0 once progress reaches this
};

int32_t record_progress(float progress, void* user) {
  auto* log = static_cast<ProgressLog*>(user);
  log->seen.push_back(progress);
  return progress >= log->cancel_at ? 0 : 1;
}

}  // namespace

// The progress callback sees 0 first and 1 last, never going back, a
// bounded number of times; returning 0 cancels the open with
// COLIBRI_ERR_CANCELLED and no model (ASan's leak check runs this too);
// the next open is unaffected.
TEST(OpenOptions, ProgressCallbackReportsAndCancels) {
  TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_layers = 3;
  spec.n_experts = 96;
  spec.d_model = 32;
  spec.d_ff = 32;
  spec.dtype = colibri::WeightType::kF32;
  colibri::write_random_model(dir.path, spec, 9);
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.tune_kernels = 0;
  ProgressLog log;
  o.progress = record_progress;
  o.progress_user_data = &log;
  colibri_model_t* m = nullptr;
  ASSERT_EQ(colibri_open(dir.path.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  colibri_free(m);
  ASSERT_GE(log.seen.size(), 3u);
  EXPECT_LE(log.seen.size(), 202u);
  EXPECT_EQ(log.seen.front(), 0.0f);
  EXPECT_EQ(log.seen.back(), 1.0f);
  for (size_t i = 1; i < log.seen.size(); ++i) EXPECT_GT(log.seen[i], log.seen[i - 1]) << i;

  ProgressLog cancel;
  cancel.cancel_at = 0.3f;
  o.progress_user_data = &cancel;
  m = nullptr;
  EXPECT_EQ(colibri_open(dir.path.c_str(), &o, &m), COLIBRI_ERR_CANCELLED);
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(std::string(colibri_last_error()).find("cancelled by its progress callback"), std::string::npos)
      << colibri_last_error();
  EXPECT_STREQ(colibri_status_name(COLIBRI_ERR_CANCELLED), "cancelled");
  ASSERT_FALSE(cancel.seen.empty());
  EXPECT_GE(cancel.seen.back(), 0.3f);
  EXPECT_LT(cancel.seen.back(), 1.0f);

  // Cancelled at the very end (1.0): still no model.
  cancel.seen.clear();
  cancel.cancel_at = 1.0f;
  EXPECT_EQ(colibri_open(dir.path.c_str(), &o, &m), COLIBRI_ERR_CANCELLED);
  EXPECT_EQ(m, nullptr);

  o.progress = nullptr;
  ASSERT_EQ(colibri_open(dir.path.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  colibri_free(m);
}

namespace {

// One call of `model` with the built-in router on T random tokens; NaN-poisoned output.
std::vector<float> routed_output(colibri_model_t* model, int32_t layer, const std::vector<float>& x, int T) {
  std::vector<float> y(x.size(), NAN);
  colibri_infer_t r;
  colibri_infer_default(&r);
  r.layer = layer;
  r.n_tokens = T;
  r.input = x.data();
  r.output = y.data();
  EXPECT_EQ(colibri_infer(model, &r), COLIBRI_OK) << colibri_last_error();
  return y;
}

}  // namespace

// Expert parallelism: two processes' shares (here two models in one) that
// cover every expert, the shared expert in one of them, add up to the whole
// layer's output for decode and prefill, each packing about half the
// experts; per-layer placements; bad lengths and swaps of another share's
// expert are refused.
TEST(OpenOptions, LocalExpertSharesSumToTheWholeLayer) {
  TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_layers = 2;
  spec.n_experts = 16;
  spec.d_model = 64;
  spec.d_ff = 48;
  spec.dtype = colibri::WeightType::kF32;
  spec.router.family = colibri::RouterFamily::kQwen2Moe;
  spec.router.top_k = 4;
  spec.router.norm_topk_prob = 0;
  spec.shared_d_ff = 32;
  spec.shared_gate = true;
  colibri::write_random_model(dir.path, spec, 21);
  const int E = spec.n_experts, D = spec.d_model;

  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.tune_kernels = 0;
  colibri_model_t* whole = nullptr;
  ASSERT_EQ(colibri_open(dir.path.c_str(), &o, &whole), COLIBRI_OK) << colibri_last_error();

  // Share A: even experts in layer 0, the first half in layer 1, and the
  // shared expert; share B: the rest, no shared expert.
  std::vector<uint8_t> a(static_cast<size_t>(2 * E)), b(a.size());
  for (int e = 0; e < E; ++e) {
    a[static_cast<size_t>(e)] = e % 2 == 0;
    a[static_cast<size_t>(E + e)] = e < E / 2;
  }
  for (size_t i = 0; i < a.size(); ++i) b[i] = !a[i];
  colibri_model_t* part[2] = {nullptr, nullptr};
  o.local_experts = a.data();
  o.local_experts_len = static_cast<int64_t>(a.size());
  ASSERT_EQ(colibri_open(dir.path.c_str(), &o, &part[0]), COLIBRI_OK) << colibri_last_error();
  o.local_experts = b.data();
  o.skip_shared_expert = 1;
  ASSERT_EQ(colibri_open(dir.path.c_str(), &o, &part[1]), COLIBRI_OK) << colibri_last_error();

  colibri_stats_t sw, s0, s1;
  ASSERT_EQ(colibri_stats(whole, &sw), COLIBRI_OK);
  ASSERT_EQ(colibri_stats(part[0], &s0), COLIBRI_OK);
  ASSERT_EQ(colibri_stats(part[1], &s1), COLIBRI_OK);
  EXPECT_LT(s0.bytes_mapped, sw.bytes_mapped * 6 / 10) << s0.bytes_mapped << " of " << sw.bytes_mapped;
  EXPECT_LT(s1.bytes_mapped, s0.bytes_mapped) << "share B holds no shared expert";

  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const int T : {1, 3, 40}) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      std::vector<float> x(static_cast<size_t>(T) * D);
      for (float& v : x) v = u(rng);
      const std::vector<float> want = routed_output(whole, layer, x, T);
      const std::vector<float> y0 = routed_output(part[0], layer, x, T);
      const std::vector<float> y1 = routed_output(part[1], layer, x, T);
      double err = 0.0, norm = 0.0;
      for (size_t i = 0; i < want.size(); ++i) {
        const double d = static_cast<double>(y0[i]) + y1[i] - want[i];
        err += d * d;
        norm += static_cast<double>(want[i]) * want[i];
      }
      EXPECT_LT(std::sqrt(err / norm), 1e-6) << "T " << T << " layer " << layer;
      // Neither share alone is the whole layer.
      double alone = 0.0;
      for (size_t i = 0; i < want.size(); ++i) alone += std::fabs(static_cast<double>(y0[i]) - want[i]);
      EXPECT_GT(alone, 1e-3) << "T " << T << " layer " << layer;
    }
  }
  // Another share's expert cannot be swapped in here.
  std::vector<uint8_t> bytes(static_cast<size_t>(3) * spec.d_model * spec.d_ff * 4, 0);
  colibri_swap_source_t source;
  colibri_swap_source_default(&source);
  source.data = bytes.data();
  source.size = bytes.size();
  source.dtype = COLIBRI_DTYPE_F32;
  EXPECT_EQ(colibri_swap_expert(part[0], 0, 1, &source), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("not computed by this process"), std::string::npos)
      << colibri_last_error();
  for (colibri_model_t* m : part) colibri_free(m);
  colibri_free(whole);

  // One mask for every layer works too; other lengths are refused.
  std::vector<uint8_t> every(static_cast<size_t>(E), 1);
  o.local_experts = every.data();
  o.local_experts_len = E;
  o.skip_shared_expert = 0;
  colibri_model_t* m = nullptr;
  ASSERT_EQ(colibri_open(dir.path.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  colibri_free(m);
  m = nullptr;
  o.local_experts_len = E - 1;
  EXPECT_EQ(colibri_open(dir.path.c_str(), &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(std::string(colibri_last_error()).find("local_experts_len is 15"), std::string::npos)
      << colibri_last_error();
}
