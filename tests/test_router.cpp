// The built-in router (format v2): each family's selection rule against an
// independent float64 implementation, shared experts, models built from
// memory, and the manifest's v2 fields.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "io/manifest.h"
#include "io/mapped_file.h"
#include "lib/model_writer.h"
#include "moe/router.h"
#include "reference.h"
#include "util/half.h"
#include "io/mapped_file.h"
#include "test_util.h"

namespace {

using colibri_test::relative_l2;

struct Choice {
  std::vector<int32_t> ids;
  std::vector<double> weights;
  double margin = 0;  // gap between the k-th and (k+1)-th ranked value (ties make this 0)
};

// Float64 reference of the rules in include/colibri.h, written from the
// families' published forward code, not from src/moe/router.cpp.
Choice reference_choice(const colibri::RouterDesc& r, const std::vector<double>& logits, const double* bias) {
  const int E = static_cast<int>(logits.size());
  if (r.family == colibri::RouterFamily::kGptOss) {
    // transformers' GptOssTopKRouter: linear with bias, topk of the logits,
    // softmax over the k values.
    std::vector<double> biased(E);
    for (int e = 0; e < E; ++e) biased[e] = logits[e] + (bias ? bias[e] : 0.0);
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return biased[a] > biased[b]; });
    Choice c;
    double sum = 0;
    for (int j = 0; j < r.top_k; ++j) {
      c.ids.push_back(order[j]);
      c.weights.push_back(std::exp(biased[order[j]]));
      sum += c.weights.back();
    }
    for (double& w : c.weights) w /= sum;
    c.margin = r.top_k < E ? biased[order[r.top_k - 1]] - biased[order[r.top_k]] : INFINITY;
    return c;
  }
  const bool v3 = r.family == colibri::RouterFamily::kDeepseekV3;
  std::vector<double> score(E), rank(E);
  if (v3) {
    for (int e = 0; e < E; ++e) score[e] = 1.0 / (1.0 + std::exp(-logits[e]));
  } else {
    const double mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += score[e] = std::exp(logits[e] - mx);
    for (double& v : score) v /= sum;
  }
  for (int e = 0; e < E; ++e) rank[e] = score[e] + (v3 && bias ? bias[e] : 0.0);
  const bool deepseek = v3 || r.family == colibri::RouterFamily::kDeepseekV2;
  if (deepseek && r.n_group > 1) {
    const int per = E / r.n_group;
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < r.n_group; ++g) {
      std::vector<double> in(rank.begin() + g * per, rank.begin() + (g + 1) * per);
      std::sort(in.rbegin(), in.rend());
      groups.push_back({v3 ? in[0] + in[1] : in[0], g});
    }
    std::stable_sort(groups.begin(), groups.end(), [](auto a, auto b) { return a.first > b.first; });
    std::vector<bool> keep(r.n_group, false);
    for (int i = 0; i < r.topk_group; ++i) keep[groups[i].second] = true;
    for (int e = 0; e < E; ++e) {
      if (!keep[e / per]) rank[e] = -INFINITY;
    }
  }
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rank[a] > rank[b]; });
  Choice c;
  double sum = 0;
  for (int j = 0; j < r.top_k; ++j) {
    c.ids.push_back(order[j]);
    c.weights.push_back(score[order[j]]);
    sum += score[order[j]];
  }
  c.margin = r.top_k < E ? rank[order[r.top_k - 1]] - rank[order[r.top_k]] : INFINITY;
  const bool norm = r.norm_topk_prob != 0;
  for (double& w : c.weights) {
    switch (r.family) {
      case colibri::RouterFamily::kMixtral: w /= sum; break;
      case colibri::RouterFamily::kQwen2Moe:
      case colibri::RouterFamily::kQwen3Moe:
      case colibri::RouterFamily::kOlmoe:
        if (norm) w /= sum;
        break;
      case colibri::RouterFamily::kDeepseekV2:
        w = r.top_k > 1 && norm ? w / (sum + 1e-20) : w * r.routed_scaling_factor;
        break;
      case colibri::RouterFamily::kDeepseekV3:
        if (norm) w /= sum + 1e-20;
        w *= r.routed_scaling_factor;
        break;
      default: break;
    }
  }
  return c;
}

colibri::RouterDesc make_router(colibri::RouterFamily family, int32_t top_k, int32_t norm, int32_t n_group = 1,
                                  int32_t topk_group = 1, float scale = 1.0f) {
  colibri::RouterDesc r;
  r.family = family;
  r.top_k = top_k;
  r.norm_topk_prob = norm;
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.routed_scaling_factor = scale;
  return r;
}

std::vector<colibri::RouterDesc> all_rules(int32_t E) {
  return {
      make_router(colibri::RouterFamily::kMixtral, 2, 1),
      make_router(colibri::RouterFamily::kQwen2Moe, 4, 0),
      make_router(colibri::RouterFamily::kQwen2Moe, 4, 1),
      make_router(colibri::RouterFamily::kQwen3Moe, 8, 1),
      make_router(colibri::RouterFamily::kOlmoe, 8, 0),
      make_router(colibri::RouterFamily::kDeepseekV2, 6, 0, 1, 1, 16.0f),  // greedy, scaled
      make_router(colibri::RouterFamily::kDeepseekV2, 6, 0, 8, 3, 16.0f),  // group-limited
      make_router(colibri::RouterFamily::kDeepseekV2, 6, 1, 8, 3, 16.0f),  // renormalised
      make_router(colibri::RouterFamily::kDeepseekV3, 8, 1, 8, 4, 2.5f),
      make_router(colibri::RouterFamily::kDeepseekV3, 8, 0, 1, 1, 2.5f),
      make_router(colibri::RouterFamily::kGptOss, 4, 1),
  };
}

TEST(RouterRule, MatchesFloat64ReferenceOnRandomLogits) {
  const int32_t E = 64;
  std::mt19937 rng(7);
  std::normal_distribution<float> n01(0.0f, 2.0f);
  std::uniform_real_distribution<float> ub(-0.3f, 0.3f);
  for (const colibri::RouterDesc& r : all_rules(E)) {
    colibri::RouterRule rule(r, E);
    std::vector<float> bias(E);
    std::vector<double> bias64(E);
    for (int e = 0; e < E; ++e) bias64[e] = bias[e] = ub(rng);
    int checked = 0;
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<float> logits(E);
      std::vector<double> logits64(E);
      for (int e = 0; e < E; ++e) logits64[e] = logits[e] = n01(rng);
      const Choice want = reference_choice(r, logits64, bias64.data());
      if (want.margin < 1e-5) continue;  // a near-tie: either choice is right
      std::vector<int32_t> ids(r.top_k, -7);
      std::vector<float> w(r.top_k, std::nanf(""));
      rule.select(logits.data(), bias.data(), ids.data(), w.data());
      ++checked;
      for (int j = 0; j < r.top_k; ++j) {
        ASSERT_EQ(ids[j], want.ids[j]) << colibri::router_family_name(r.family) << " trial " << trial << " slot " << j;
        ASSERT_NEAR(w[j], want.weights[j], 1e-5 * std::max(1.0, std::fabs(want.weights[j])))
            << colibri::router_family_name(r.family) << " trial " << trial;
      }
    }
    EXPECT_GT(checked, 250) << colibri::router_family_name(r.family);
  }
}

TEST(RouterRule, TiesGoToTheLowerExpertIndex) {
  const int32_t E = 8;
  colibri::RouterRule rule(make_router(colibri::RouterFamily::kQwen3Moe, 3, 0), E);
  const std::vector<float> logits = {0.5f, 1.0f, 0.0f, 1.0f, 1.0f, 0.2f, 1.0f, -1.0f};
  int32_t ids[3];
  float w[3];
  rule.select(logits.data(), nullptr, ids, w);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 3);
  EXPECT_EQ(ids[2], 4);
  // Tied groups too: groups {0,1} and {2,3} score the same; group 0 wins.
  colibri::RouterRule grouped(make_router(colibri::RouterFamily::kDeepseekV2, 2, 0, 4, 1), E);
  const std::vector<float> flat = {1.0f, 0.0f, 0.0f, 1.0f, -2.0f, -2.0f, -2.0f, -2.0f};
  grouped.select(flat.data(), nullptr, ids, w);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 1);
}

TEST(RouterRule, DeepSeekV3NeverChoosesExpertsOfDroppedGroups) {
  // Biased scores of the kept group all negative: a rule that zero-fills
  // dropped groups (instead of excluding them) would pick from them.
  const int32_t E = 8;
  colibri::RouterRule rule(make_router(colibri::RouterFamily::kDeepseekV3, 4, 1, 2, 1, 1.0f), E);
  const std::vector<float> logits(E, 0.0f);  // sigmoid 0.5 everywhere
  const std::vector<float> bias = {-0.6f, -0.7f, -0.8f, -0.9f, -1.5f, -1.5f, -1.5f, -1.5f};
  int32_t ids[4];
  float w[4];
  rule.select(logits.data(), bias.data(), ids, w);
  for (int j = 0; j < 4; ++j) {
    EXPECT_LT(ids[j], 4) << "expert of the dropped group chosen";
    EXPECT_NEAR(w[j], 0.25f, 1e-6f);  // unbiased scores renormalised
  }
}

// ---------------------------------------------------------------- models

struct LayerRef {
  std::vector<double> router;  // [E][D]
  std::vector<double> bias;    // [E] or empty
  colibri_test::ReferenceExpert shared;
  std::vector<double> shared_gate;  // [D] or empty
};

std::vector<double> read_f32_file(const std::string& path, size_t n) {
  colibri::MappedFile f(path);
  EXPECT_EQ(f.size(), 4 * n);
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) {
    float x;
    std::memcpy(&x, f.data() + 4 * i, 4);
    v[i] = x;
  }
  return v;
}

// The whole layer in float64: router choice (reference rule), routed
// experts and shared expert, from the files in `dir`.
std::vector<double> reference_routed_layer(const std::string& dir, int32_t layer, int32_t T, const float* x,
                                           double* min_margin) {
  const colibri::Manifest m = colibri::load_manifest(dir);
  const size_t D = static_cast<size_t>(m.d_model), E = static_cast<size_t>(m.n_experts);
  std::vector<double> y(static_cast<size_t>(T) * D, 0.0);
  if (m.has_router()) {
    std::vector<double> rw = read_f32_file(dir + "/" + m.router_file(layer), E * D + (m.router_has_bias() ? E : 0));
    const double* bias = m.router_has_bias() ? rw.data() + E * D : nullptr;
    const int32_t k = m.router.top_k;
    std::vector<int32_t> ids(static_cast<size_t>(T) * k);
    std::vector<float> w(static_cast<size_t>(T) * k);
    *min_margin = INFINITY;
    for (int32_t t = 0; t < T; ++t) {
      std::vector<double> logits(E, 0.0);
      for (size_t e = 0; e < E; ++e) {
        for (size_t d = 0; d < D; ++d) logits[e] += rw[e * D + d] * x[static_cast<size_t>(t) * D + d];
      }
      const Choice c = reference_choice(m.router, logits, bias);
      *min_margin = std::min(*min_margin, c.margin);
      for (int32_t j = 0; j < k; ++j) {
        ids[static_cast<size_t>(t) * k + j] = c.ids[j];
        w[static_cast<size_t>(t) * k + j] = static_cast<float>(c.weights[j]);
      }
    }
    y = colibri_test::reference_layer(dir, layer, T, x, k, ids.data(), w.data());
  }
  if (m.has_shared()) {
    colibri::Manifest sm = m;  // the shared file reads like an expert of d_ff shared_d_ff
    sm.d_ff = m.shared_d_ff;
    colibri::MappedFile f(dir + "/" + m.shared_file(layer));
    const size_t F = static_cast<size_t>(m.shared_d_ff);
    std::vector<double> all(3 * F * D);
    for (size_t i = 0; i < all.size(); ++i) {
      if (m.dtype == colibri::WeightType::kF32) {
        float v;
        std::memcpy(&v, f.data() + 4 * i, 4);
        all[i] = v;
      } else {
        const uint16_t h = static_cast<uint16_t>(f.data()[2 * i] | (f.data()[2 * i + 1] << 8));
        all[i] = m.dtype == colibri::WeightType::kF16 ? colibri::f16_to_float(h) : colibri::bf16_to_float(h);
      }
    }
    std::vector<double> gate;
    if (m.shared_gate) gate = read_f32_file(dir + "/" + m.shared_gate_file(layer), D);
    std::vector<double> h(F);
    for (int32_t t = 0; t < T; ++t) {
      const float* xt = x + static_cast<size_t>(t) * D;
      double s = 1.0;
      if (!gate.empty()) {
        double dot = 0;
        for (size_t d = 0; d < D; ++d) dot += gate[d] * xt[d];
        s = 1.0 / (1.0 + std::exp(-dot));
      }
      for (size_t fi = 0; fi < F; ++fi) {
        double g = 0, u = 0;
        for (size_t d = 0; d < D; ++d) {
          g += all[fi * D + d] * xt[d];
          u += all[F * D + fi * D + d] * xt[d];
        }
        h[fi] = g / (1.0 + std::exp(-g)) * u;
      }
      for (size_t d = 0; d < D; ++d) {
        double acc = 0;
        for (size_t fi = 0; fi < F; ++fi) acc += all[2 * F * D + d * F + fi] * h[fi];
        y[static_cast<size_t>(t) * D + d] += s * acc;
      }
    }
  }
  return y;
}

std::vector<float> random_input(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

struct FamilyCase {
  const char* name;
  colibri::RouterDesc router;
  int32_t shared_d_ff;
  bool shared_gate;
};

std::vector<FamilyCase> family_cases() {
  return {
      {"mixtral", make_router(colibri::RouterFamily::kMixtral, 2, 1), 0, false},
      {"qwen2_moe", make_router(colibri::RouterFamily::kQwen2Moe, 4, 0), 96, true},
      {"qwen3_moe", make_router(colibri::RouterFamily::kQwen3Moe, 4, 1), 0, false},
      {"olmoe", make_router(colibri::RouterFamily::kOlmoe, 4, 0), 0, false},
      {"deepseek_v2", make_router(colibri::RouterFamily::kDeepseekV2, 3, 0, 4, 2, 16.0f), 160, false},
      {"deepseek_v3", make_router(colibri::RouterFamily::kDeepseekV3, 4, 1, 4, 2, 2.5f), 64, false},
  };
}

TEST(BuiltInRouter, EachFamilyMatchesTheFloat64ReferenceEndToEnd) {
  for (const colibri_dtype_t dtype : {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_BF16}) {
    for (const FamilyCase& fc : family_cases()) {
      SCOPED_TRACE(std::string(fc.name) + " " + colibri_dtype_name(dtype));
      colibri_test::TempDir dir;
      colibri::ModelWriteSpec spec;
      spec.n_layers = 2;
      spec.n_experts = 16;
      spec.d_model = 80;
      spec.d_ff = 48;
      spec.dtype = colibri_test::weight_type(dtype);
      spec.router = fc.router;
      spec.shared_d_ff = fc.shared_d_ff;
      spec.shared_gate = fc.shared_gate;
      colibri::write_random_model(dir.path(), spec, 11);
      colibri_model_t* model = nullptr;
      ASSERT_EQ(colibri_open(dir.path().c_str(), nullptr, &model), COLIBRI_OK) << colibri_last_error();
      colibri_model_info_t info;
      ASSERT_EQ(colibri_model_info(model, &info), COLIBRI_OK);
      EXPECT_EQ(info.format_version, 2);
      EXPECT_EQ(static_cast<int>(info.router_family), static_cast<int>(fc.router.family));
      EXPECT_EQ(info.router_top_k, fc.router.top_k);
      EXPECT_EQ(info.shared_d_ff, fc.shared_d_ff);
      int compared = 0;
      for (const int32_t T : {1, 5, 200}) {
        const std::vector<float> x = random_input(static_cast<size_t>(T) * spec.d_model, 100 + T);
        std::vector<float> y(x.size(), std::nanf(""));
        colibri_infer_t in;
        colibri_infer_default(&in);
        in.layer = 1;
        in.n_tokens = T;
        in.input = x.data();
        in.output = y.data();
        ASSERT_EQ(colibri_infer(model, &in), COLIBRI_OK) << colibri_last_error();
        double margin = 0;
        const std::vector<double> ref = reference_routed_layer(dir.path(), 1, T, x.data(), &margin);
        if (margin < 1e-4) continue;  // a near-tie in some token: the choice may differ
        ++compared;
        // Activations are rounded to bf16 for bf16 weights (docs/PRECISION.md).
        EXPECT_LE(relative_l2(y.data(), ref), dtype == COLIBRI_DTYPE_F32 ? 1e-5 : 5e-3) << "T=" << T;

        // colibri_route alone gives the reference's choice.
        std::vector<int32_t> ids(static_cast<size_t>(T) * fc.router.top_k, -5);
        std::vector<float> w(ids.size(), std::nanf(""));
        ASSERT_EQ(colibri_route(model, 1, T, x.data(), ids.data(), w.data()), COLIBRI_OK) << colibri_last_error();
        for (float v : w) EXPECT_TRUE(std::isfinite(v));
        // Running the layer with that routing explicitly gives the same output.
        std::vector<float> y2(x.size(), std::nanf(""));
        in.output = y2.data();
        in.top_k = fc.router.top_k;
        in.expert_ids = ids.data();
        in.expert_weights = w.data();
        ASSERT_EQ(colibri_infer(model, &in), COLIBRI_OK) << colibri_last_error();
        EXPECT_EQ(0, std::memcmp(y.data(), y2.data(), y.size() * sizeof(float)));
      }
      EXPECT_GE(compared, 2) << "too many near-ties: the comparison hardly ran";
      colibri_free(model);
    }
  }
}

TEST(BuiltInRouter, ModelWithoutRouterRefusesCallsWithoutRouting) {
  colibri_test::TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_experts = 4;
  spec.d_model = 32;
  spec.d_ff = 16;
  colibri::write_random_model(dir.path(), spec, 3);
  colibri_model_t* model = nullptr;
  ASSERT_EQ(colibri_open(dir.path().c_str(), nullptr, &model), COLIBRI_OK) << colibri_last_error();
  std::vector<float> x(32, 1.0f), y(32, 7.0f);
  colibri_infer_t in;
  colibri_infer_default(&in);
  in.n_tokens = 1;
  in.input = x.data();
  in.output = y.data();
  EXPECT_EQ(colibri_infer(model, &in), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("no built-in router"), std::string::npos) << colibri_last_error();
  EXPECT_EQ(y[0], 7.0f);  // output untouched
  int32_t ids[2];
  float w[2];
  EXPECT_EQ(colibri_route(model, 0, 1, x.data(), ids, w), COLIBRI_ERR_INVALID_ARGUMENT);
  colibri_free(model);
}

TEST(SharedExpert, RunsForEveryTokenWithExternalRouting) {
  // Shared expert with explicit routing, including tokens with no routed
  // expert at all (-1 in every slot): they get the shared expert alone.
  colibri_test::TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_experts = 8;
  spec.d_model = 48;
  spec.d_ff = 32;
  spec.dtype = colibri::WeightType::kF32;
  spec.shared_d_ff = 72;
  spec.shared_gate = true;
  colibri::write_random_model(dir.path(), spec, 5);
  colibri_model_t* model = nullptr;
  ASSERT_EQ(colibri_open(dir.path().c_str(), nullptr, &model), COLIBRI_OK) << colibri_last_error();
  for (const int32_t T : {1, 3, 150}) {
    const int32_t k = 2;
    const std::vector<float> x = random_input(static_cast<size_t>(T) * 48, 9 + T);
    std::vector<int32_t> ids(static_cast<size_t>(T) * k);
    std::vector<float> w(ids.size());
    std::mt19937 rng(T);
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = (i / k) % 3 == 1 ? -1 : static_cast<int32_t>(rng() % 8);
      w[i] = 0.25f + static_cast<float>(rng() % 100) / 200.0f;
    }
    std::vector<float> y(x.size(), std::nanf(""));
    colibri_infer_t in;
    colibri_infer_default(&in);
    in.n_tokens = T;
    in.input = x.data();
    in.output = y.data();
    in.top_k = k;
    in.expert_ids = ids.data();
    in.expert_weights = w.data();
    ASSERT_EQ(colibri_infer(model, &in), COLIBRI_OK) << colibri_last_error();
    std::vector<double> ref = colibri_test::reference_layer(dir.path(), 0, T, x.data(), k, ids.data(), w.data());
    double unused = 0;
    const std::vector<double> shared = reference_routed_layer(dir.path(), 0, T, x.data(), &unused);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += shared[i];
    EXPECT_LE(relative_l2(y.data(), ref), 1e-5) << "T=" << T;
  }
  colibri_free(model);
}

// ----------------------------------------------------------- from memory

// Holds the buffers of a model directory's files, as a framework would.
struct MemoryModel {
  colibri::Manifest m;
  std::vector<std::vector<uint8_t>> experts, shared;
  std::vector<std::vector<float>> router, shared_gate;
  std::vector<std::vector<colibri_expert_weights_t>> expert_ptrs;
  std::vector<colibri_layer_weights_t> layers;
  colibri_model_desc_t desc{};

  explicit MemoryModel(const std::string& dir) : m(colibri::load_manifest(dir)) {
    auto bytes_of = [&](const std::string& name) {
      colibri::MappedFile f(dir + "/" + name);
      return std::vector<uint8_t>(f.data(), f.data() + f.size());
    };
    auto floats_of = [&](const std::string& name) {
      const std::vector<uint8_t> b = bytes_of(name);
      std::vector<float> v(b.size() / 4);
      std::memcpy(v.data(), b.data(), b.size());
      return v;
    };
    const size_t FD = colibri::Manifest::matrix_bytes(m.weight_type(), m.d_ff, m.d_model);
    const size_t SD = colibri::Manifest::matrix_bytes(m.weight_type(), m.shared_d_ff, m.d_model);
    for (int32_t l = 0; l < m.n_layers; ++l) {
      for (int32_t e = 0; e < m.n_experts; ++e) experts.push_back(bytes_of(m.expert_file(l, e)));
      router.push_back(m.has_router() ? floats_of(m.router_file(l)) : std::vector<float>());
      shared.push_back(m.has_shared() ? bytes_of(m.shared_file(l)) : std::vector<uint8_t>());
      shared_gate.push_back(m.shared_gate ? floats_of(m.shared_gate_file(l)) : std::vector<float>());
    }
    expert_ptrs.resize(static_cast<size_t>(m.n_layers));
    for (int32_t l = 0; l < m.n_layers; ++l) {
      for (int32_t e = 0; e < m.n_experts; ++e) {
        const uint8_t* p = experts[static_cast<size_t>(l) * m.n_experts + e].data();
        expert_ptrs[l].push_back({p, p + FD, p + 2 * FD, nullptr, nullptr, nullptr});
      }
      colibri_layer_weights_t lw{};
      lw.experts = expert_ptrs[l].data();
      if (m.has_router()) {
        lw.router = router[l].data();
        if (m.router_has_bias()) lw.router_bias = router[l].data() + static_cast<size_t>(m.n_experts) * m.d_model;
      }
      if (m.has_shared()) {
        const uint8_t* p = shared[l].data();
        lw.shared = {p, p + SD, p + 2 * SD, nullptr, nullptr, nullptr};
        if (m.shared_gate) lw.shared_gate = shared_gate[l].data();
      }
      layers.push_back(lw);
    }
    colibri_model_desc_default(&desc);
    desc.n_layers = m.n_layers;
    desc.n_experts = m.n_experts;
    desc.d_model = m.d_model;
    desc.d_ff = m.d_ff;
    desc.dtype = colibri_test::c_dtype(m.dtype);
    desc.shared_d_ff = m.shared_d_ff;
    desc.router = colibri_test::c_router_desc(m.router);
    desc.layers = layers.data();
  }
};

// Both models (64 wide, built-in router) give bit-identical outputs for
// `T` random tokens through `layer`.
void expect_same_outputs(colibri_model_t* a_model, colibri_model_t* b_model, int32_t layer, int32_t T,
                         uint32_t seed) {
  const std::vector<float> x = random_input(static_cast<size_t>(T) * 64, seed);
  std::vector<float> a(x.size(), std::nanf("")), b(x.size(), std::nanf(""));
  colibri_infer_t in;
  colibri_infer_default(&in);
  in.layer = layer;
  in.n_tokens = T;
  in.input = x.data();
  in.output = a.data();
  ASSERT_EQ(colibri_infer(a_model, &in), COLIBRI_OK) << colibri_last_error();
  in.output = b.data();
  ASSERT_EQ(colibri_infer(b_model, &in), COLIBRI_OK) << colibri_last_error();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

// Two f16 layers of 16 experts (64 wide, d_ff 40) with the case's router
// and shared expert.
void write_family_model(const std::string& dir, const FamilyCase& fc, uint64_t seed) {
  colibri::ModelWriteSpec spec;
  spec.n_layers = 2;
  spec.n_experts = 16;
  spec.d_model = 64;
  spec.d_ff = 40;
  spec.dtype = colibri::WeightType::kF16;
  spec.router = fc.router;
  spec.shared_d_ff = fc.shared_d_ff;
  spec.shared_gate = fc.shared_gate;
  colibri::write_random_model(dir, spec, seed);
}

TEST(OpenMemory, SameResultsAsTheModelDirectory) {
  for (const FamilyCase& fc : family_cases()) {
    SCOPED_TRACE(fc.name);
    colibri_test::TempDir dir;
    write_family_model(dir.path(), fc, 21);
    colibri_model_t* from_dir = nullptr;
    ASSERT_EQ(colibri_open(dir.path().c_str(), nullptr, &from_dir), COLIBRI_OK) << colibri_last_error();
    colibri_model_t* from_mem = nullptr;
    {
      MemoryModel mm(dir.path());
      ASSERT_EQ(colibri_open_memory(&mm.desc, nullptr, &from_mem), COLIBRI_OK) << colibri_last_error();
      // The buffers go away here: the model must have copied them.
    }
    expect_same_outputs(from_dir, from_mem, 1, 33, 77);
    colibri_free(from_dir);
    colibri_free(from_mem);
  }
}

// fetch_expert: each expert is handed over in a buffer that is scribbled
// over as soon as the next one is asked for, so a library that kept a
// pointer instead of copying would compute garbage; the calls must come in
// (layer, expert) order.
struct Fetcher {
  const MemoryModel* mm = nullptr;
  std::vector<uint8_t> buffer;
  std::vector<std::pair<int32_t, int32_t>> calls;
  int32_t fail_at = -1;  // return an error on this call

  static int32_t fetch(void* user, int32_t layer, int32_t expert, colibri_expert_weights_t* out) {
    auto* self = static_cast<Fetcher*>(user);
    if (static_cast<int32_t>(self->calls.size()) == self->fail_at) return 7;
    self->calls.emplace_back(layer, expert);
    const colibri::Manifest& m = self->mm->m;
    const std::vector<uint8_t>& src = self->mm->experts[static_cast<size_t>(layer) * m.n_experts + expert];
    std::fill(self->buffer.begin(), self->buffer.end(), uint8_t{0xA5});  // the previous expert is gone
    self->buffer.assign(src.begin(), src.end());
    const size_t FD = colibri::Manifest::matrix_bytes(m.weight_type(), m.d_ff, m.d_model);
    const uint8_t* p = self->buffer.data();
    *out = {p, p + FD, p + 2 * FD, nullptr, nullptr, nullptr};
    return 0;
  }
};

TEST(OpenMemory, ExpertsFetchedOneAtATimeGiveTheSameResults) {
  for (const FamilyCase& fc : family_cases()) {
    SCOPED_TRACE(fc.name);
    colibri_test::TempDir dir;
    write_family_model(dir.path(), fc, 23);
    MemoryModel mm(dir.path());
    colibri_model_t* given = nullptr;
    ASSERT_EQ(colibri_open_memory(&mm.desc, nullptr, &given), COLIBRI_OK) << colibri_last_error();
    Fetcher f;
    f.mm = &mm;
    std::vector<colibri_layer_weights_t> layers = mm.layers;
    for (auto& lw : layers) lw.experts = nullptr;
    colibri_model_desc_t d = mm.desc;
    d.layers = layers.data();
    d.fetch_expert = &Fetcher::fetch;
    d.fetch_user = &f;
    colibri_model_t* fetched = nullptr;
    ASSERT_EQ(colibri_open_memory(&d, nullptr, &fetched), COLIBRI_OK) << colibri_last_error();
    ASSERT_EQ(f.calls.size(), static_cast<size_t>(2 * 16));
    for (size_t i = 0; i < f.calls.size(); ++i) {
      EXPECT_EQ(f.calls[i], std::make_pair(static_cast<int32_t>(i / 16), static_cast<int32_t>(i % 16)));
    }
    for (int32_t layer = 0; layer < 2; ++layer) expect_same_outputs(given, fetched, layer, 19, 78);
    colibri_free(given);
    colibri_free(fetched);
  }
}

TEST(OpenMemory, FetchErrorsAreRefusedByName) {
  colibri_test::TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_layers = 2;
  spec.n_experts = 4;
  spec.d_model = 32;
  spec.d_ff = 16;
  spec.router = make_router(colibri::RouterFamily::kMixtral, 2, 1);
  colibri::write_random_model(dir.path(), spec, 5);
  MemoryModel mm(dir.path());
  Fetcher f;
  f.mm = &mm;
  f.fail_at = 6;  // layer 1, expert 2
  std::vector<colibri_layer_weights_t> layers = mm.layers;
  for (auto& lw : layers) lw.experts = nullptr;
  colibri_model_desc_t d = mm.desc;
  d.layers = layers.data();
  d.fetch_expert = &Fetcher::fetch;
  d.fetch_user = &f;
  colibri_model_t* model = reinterpret_cast<colibri_model_t*>(0x1);
  EXPECT_EQ(colibri_open_memory(&d, nullptr, &model), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(model, nullptr);
  EXPECT_NE(std::string(colibri_last_error()).find("layers[1].experts[2]"), std::string::npos) << colibri_last_error();
  EXPECT_NE(std::string(colibri_last_error()).find("returned 7"), std::string::npos) << colibri_last_error();
  // Experts given and fetched at once is ambiguous.
  d.layers = mm.layers.data();
  f.fail_at = -1;
  EXPECT_EQ(colibri_open_memory(&d, nullptr, &model), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("layers[0].experts must be NULL"), std::string::npos)
      << colibri_last_error();
}

// Writes any int into an enum field, as C code may (a C++ cast to an
// out-of-range enum value would itself be undefined).
template <class Enum>
void set_raw(Enum& field, int value) {
  std::memcpy(&field, &value, sizeof value);
}

TEST(OpenMemory, BadDescriptionsAreRefusedByName) {
  colibri_test::TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_experts = 4;
  spec.d_model = 32;
  spec.d_ff = 16;
  spec.router = make_router(colibri::RouterFamily::kMixtral, 2, 1);
  spec.shared_d_ff = 24;
  colibri::write_random_model(dir.path(), spec, 3);
  MemoryModel mm(dir.path());
  auto expect_refused = [&](const colibri_model_desc_t& d, const char* needle) {
    colibri_model_t* model = reinterpret_cast<colibri_model_t*>(0x1);
    EXPECT_EQ(colibri_open_memory(&d, nullptr, &model), COLIBRI_ERR_INVALID_ARGUMENT) << needle;
    EXPECT_EQ(model, nullptr);
    EXPECT_NE(std::string(colibri_last_error()).find(needle), std::string::npos)
        << "want '" << needle << "' in: " << colibri_last_error();
  };
  colibri_model_t* model = nullptr;
  EXPECT_EQ(colibri_open_memory(nullptr, nullptr, &model), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(colibri_open_memory(&mm.desc, nullptr, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);

  colibri_model_desc_t d = mm.desc;
  d.layers = nullptr;
  expect_refused(d, "layers");
  d = mm.desc;
  d.n_experts = 0;
  expect_refused(d, "n_experts");
  d = mm.desc;
  set_raw(d.dtype, 9);  // as a C caller could
  expect_refused(d, "dtype");
  d = mm.desc;
  d.router.top_k = 5;
  expect_refused(d, "top_k");
  d = mm.desc;
  set_raw(d.router.family, 42);
  expect_refused(d, "family");
  d = mm.desc;
  d.router.n_group = 2;  // grouping is DeepSeek's only
  expect_refused(d, "n_group");
  d = mm.desc;
  d.shared_d_ff = -1;
  expect_refused(d, "shared_d_ff");

  std::vector<colibri_expert_weights_t> experts = mm.expert_ptrs[0];
  experts[3].up = nullptr;
  std::vector<colibri_layer_weights_t> layers = mm.layers;
  layers[0].experts = experts.data();
  d = mm.desc;
  d.layers = layers.data();
  expect_refused(d, "layers[0].experts[3].up");
  layers = mm.layers;
  layers[0].router = nullptr;
  d.layers = layers.data();
  expect_refused(d, "layers[0].router");
  layers = mm.layers;
  layers[0].shared.down = nullptr;
  d.layers = layers.data();
  expect_refused(d, "layers[0].shared.down");
}

// ------------------------------------------------------------ manifest v2

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

TEST(ManifestV2, BadRouterAndSharedFieldsAreNamed) {
  colibri_test::TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_experts = 8;
  spec.d_model = 32;
  spec.d_ff = 16;
  spec.router = make_router(colibri::RouterFamily::kDeepseekV3, 2, 1, 4, 2, 2.0f);
  spec.shared_d_ff = 24;
  colibri::write_random_model(dir.path(), spec, 3);
  const std::string path = dir.path() + "/colibri.json";
  const std::string good = read_text(path);
  auto expect_bad = [&](const std::string& from, const std::string& to, const char* needle) {
    std::string text = good;
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    write_text(path, text);
    colibri_model_t* model = nullptr;
    EXPECT_EQ(colibri_open(dir.path().c_str(), nullptr, &model), COLIBRI_ERR_FORMAT) << to;
    EXPECT_NE(std::string(colibri_last_error()).find(needle), std::string::npos)
        << "want '" << needle << "' in: " << colibri_last_error();
    colibri_free(model);
  };
  expect_bad("\"deepseek_v3\"", "\"gpt\"", "family");
  expect_bad("\"top_k\": 2", "\"top_k\": 9", "top_k");
  expect_bad("\"top_k\": 2", "\"top_k\": 0", "top_k");
  expect_bad("\"n_group\": 4", "\"n_group\": 3", "n_group");
  expect_bad("\"topk_group\": 2", "\"topk_group\": 5", "topk_group");
  expect_bad("\"d_ff\": 24", "\"d_ff\": -24", "d_ff");
  expect_bad("\"norm_topk_prob\": true", "\"norm_topk_prob\": 1", "norm_topk_prob");
  write_text(path, good);

  // Every v2 file is size-checked and checksummed, by name.
  for (const std::string name : {"router.bin", "shared_expert.bin"}) {
    const std::string file = dir.path() + "/" + name;
    const std::string original = read_text(file);
    std::string bytes = original;
    bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x10);
    write_text(file, bytes);
    colibri_model_t* model = nullptr;
    EXPECT_EQ(colibri_open(dir.path().c_str(), nullptr, &model), COLIBRI_ERR_CHECKSUM) << name;
    EXPECT_NE(std::string(colibri_last_error()).find(name), std::string::npos) << colibri_last_error();
    bytes.pop_back();
    write_text(file, bytes);
    EXPECT_EQ(colibri_open(dir.path().c_str(), nullptr, &model), COLIBRI_ERR_FORMAT) << name;
    EXPECT_NE(std::string(colibri_last_error()).find(name), std::string::npos) << colibri_last_error();
    std::filesystem::remove(file);
    EXPECT_EQ(colibri_open(dir.path().c_str(), nullptr, &model), COLIBRI_ERR_IO) << name;
    EXPECT_NE(std::string(colibri_last_error()).find(name), std::string::npos) << colibri_last_error();
    write_text(file, original);
  }
  colibri_model_t* model = nullptr;
  ASSERT_EQ(colibri_open(dir.path().c_str(), nullptr, &model), COLIBRI_OK) << colibri_last_error();
  colibri_free(model);
}

TEST(ManifestV2, PlainModelsAreStillWrittenAsVersion1) {
  colibri_test::TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_experts = 2;
  spec.d_model = 16;
  spec.d_ff = 16;
  colibri::write_random_model(dir.path(), spec, 1);
  EXPECT_NE(read_text(dir.path() + "/colibri.json").find("\"version\": 1"), std::string::npos);
}

}  // namespace
