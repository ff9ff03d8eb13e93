// gpt-oss-style models (format v4: the clamped SwiGLU, expert biases, the
// gpt_oss router with its logit bias) end to end through the C ABI: model
// directories in float and block formats (MXFP4 among them), caller
// routing and the built-in router, against the float64 reference on the
// dequantised weights; models from memory; hot swap of a biased expert;
// the manifest's v4 fields. Registered once per instruction set through
// COLIBRI_ISA.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "io/manifest.h"
#include "io/mapped_file.h"
#include "lib/float64_reference.h"
#include "lib/model_writer.h"
#include "util/weight_format.h"

#include "test_util.h"

namespace {

using Opened = colibri_test::OpenedModel;
using colibri_test::open_test_model;

colibri::ModelWriteSpec gpt_oss_spec(colibri::WeightType t) {
  colibri::ModelWriteSpec spec;
  spec.n_layers = 2;
  spec.n_experts = 8;
  spec.d_model = 160;
  spec.d_ff = 96;
  spec.dtype = t;
  spec.clamped_swiglu = true;
  spec.expert_bias = true;
  spec.router.family = colibri::RouterFamily::kGptOss;
  spec.router.top_k = 4;
  spec.router.norm_topk_prob = 1;
  return spec;
}

// Inputs large enough that the clamps bite (gpt-oss's hidden states after
// its RMSNorm have entries of several units).
std::vector<float> input(int32_t T, int32_t D, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<float> x(static_cast<size_t>(T) * D);
  for (float& v : x) v = nd(rng);
  return x;
}

void routing(int32_t T, int32_t k, int32_t E, bool skew, uint32_t seed, std::vector<int32_t>* ids,
             std::vector<float>* w) {
  std::mt19937 rng(seed);
  ids->assign(static_cast<size_t>(T) * k, -1);
  w->assign(ids->size(), 0.0f);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int32_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    if (skew) std::swap(perm[0], *std::find(perm.begin(), perm.end(), 0));
    for (int32_t j = 0; j < k; ++j) {
      if (skew && j == k - 1 && t % 3 == 0) continue;
      (*ids)[static_cast<size_t>(t) * k + j] = perm[static_cast<size_t>(j)];
      (*w)[static_cast<size_t>(t) * k + j] = u(rng);
    }
  }
}

std::vector<float> infer(colibri_model_t* m, int32_t layer, const std::vector<float>& x, int32_t D, int32_t k,
                         const std::vector<int32_t>* ids, const std::vector<float>* w) {
  const auto T = static_cast<int32_t>(x.size() / static_cast<size_t>(D));
  std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
  colibri_infer_t call;
  colibri_infer_default(&call);
  call.layer = layer;
  call.n_tokens = T;
  call.input = x.data();
  call.output = y.data();
  if (ids != nullptr) {
    call.top_k = k;
    call.expert_ids = ids->data();
    call.expert_weights = w->data();
  }
  EXPECT_EQ(colibri_infer(m, &call), COLIBRI_OK) << colibri_last_error();
  return y;
}

struct Format {
  const char* name;
  colibri::WeightType type;
  double tolerance;        // default precision
  double exact_tolerance;  // exact_prefill
};

// Float formats compute in fp32 (activations are never rounded for these
// experts: only tables that compute the epilogue run them, all fp32-grade);
// block formats with int8 activations by default (docs/PRECISION.md).
const Format kFormats[] = {
    {"f32", colibri::WeightType::kF32, 1e-5, 1e-5},     {"bf16", colibri::WeightType::kBF16, 1e-5, 1e-5},
    {"q8_0", colibri::WeightType::kQ8_0, 2e-2, 1e-5},   {"mxfp4", colibri::WeightType::kMXFP4, 2e-2, 1e-5},
    {"q4_k", colibri::WeightType::kQ4_K, 2e-2, 1e-5},
};

class GptOssModel : public ::testing::TestWithParam<Format> {};

TEST_P(GptOssModel, CallerRoutingMatchesReference) {
  const Format f = GetParam();
  colibri_test::TempDir tmp("colibri_gpt_oss");
  const colibri::ModelWriteSpec spec = gpt_oss_spec(f.type);
  colibri::write_random_model(tmp.path(), spec, 5);
  EXPECT_EQ(colibri::load_manifest(tmp.path()).version, 4);
  for (bool exact : {false, true}) {
    Opened m;
    m.model = open_test_model(tmp.path(), exact);
    ASSERT_NE(m.model, nullptr);
    colibri_model_info_t info;
    ASSERT_EQ(colibri_model_info(m.model, &info), COLIBRI_OK);
    EXPECT_EQ(info.activation, COLIBRI_ACTIVATION_CLAMPED_SWIGLU);
    EXPECT_EQ(info.expert_bias, 1);
    EXPECT_FLOAT_EQ(info.swiglu_limit, 7.0f);
    EXPECT_FLOAT_EQ(info.swiglu_alpha, 1.702f);
    EXPECT_EQ(info.router_family, COLIBRI_ROUTER_GPT_OSS);
    uint32_t seed = 1;
    double worst = 0.0;
    for (int32_t T : {1, 3, 17, 96}) {
      for (bool skew : {false, true}) {
        const int32_t layer = static_cast<int32_t>(seed % 2);
        const std::vector<float> x = input(T, spec.d_model, seed);
        std::vector<int32_t> ids;
        std::vector<float> w;
        routing(T, 4, spec.n_experts, skew, seed++, &ids, &w);
        const std::vector<float> y = infer(m.model, layer, x, spec.d_model, 4, &ids, &w);
        const std::vector<double> ref = colibri::reference_layer(tmp.path(), layer, T, x.data(), 4, ids.data(), w.data());
        const double err = colibri::relative_l2(y.data(), ref);
        worst = std::max(worst, err);
        EXPECT_LE(err, exact ? f.exact_tolerance : f.tolerance)
            << f.name << (exact ? " exact" : "") << " T=" << T << " skew=" << skew << " "
            << colibri_model_kernels(m.model);
      }
    }
    std::printf("%-5s %-7s worst relative L2 %.3g (%s)\n", f.name, exact ? "exact" : "default", worst,
                colibri_model_kernels(m.model));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, GptOssModel, ::testing::ValuesIn(kFormats),
                         [](const ::testing::TestParamInfo<Format>& p) { return std::string(p.param.name); });

// The reference itself: with the clamps out of reach it differs from the
// clamped model by far more than the tolerances, so the comparisons above
// would catch a kernel that skips the clamp or a bias.
TEST(GptOssReference, ClampsAndBiasesChangeTheOutput) {
  colibri_test::TempDir tmp("colibri_gpt_oss");
  const colibri::ModelWriteSpec spec = gpt_oss_spec(colibri::WeightType::kF32);
  colibri::write_random_model(tmp.path(), spec, 5);
  const int32_t T = 8;
  const std::vector<float> x = input(T, spec.d_model, 3);
  std::vector<int32_t> ids;
  std::vector<float> w;
  routing(T, 4, spec.n_experts, false, 3, &ids, &w);
  const std::vector<double> ref = colibri::reference_layer(tmp.path(), 0, T, x.data(), 4, ids.data(), w.data());
  auto variant = [&](auto edit) {
    colibri_test::TempDir other("colibri_gpt_oss");
    colibri::ModelWriteSpec s = spec;
    edit(s);
    colibri::write_random_model(other.path(), s, 5);
    return colibri::reference_layer(other.path(), 0, T, x.data(), 4, ids.data(), w.data());
  };
  std::vector<float> ref_f(ref.begin(), ref.end());
  const std::vector<double> unclamped = variant([](colibri::ModelWriteSpec& s) { s.swiglu_limit = 1e6f; });
  EXPECT_GT(colibri::relative_l2(ref_f.data(), unclamped), 0.1);
  const std::vector<double> plain = variant([](colibri::ModelWriteSpec& s) { s.clamped_swiglu = false; });
  EXPECT_GT(colibri::relative_l2(ref_f.data(), plain), 0.1);
}

// The built-in gpt_oss router: colibri_route against an independent float64
// implementation (logits + bias, top k, softmax over the k), and the layer
// it routes against the reference with that routing.
TEST(GptOssRouter, BuiltInRoutingMatchesReference) {
  colibri_test::TempDir tmp("colibri_gpt_oss");
  const colibri::ModelWriteSpec spec = gpt_oss_spec(colibri::WeightType::kMXFP4);
  colibri::write_random_model(tmp.path(), spec, 9);
  const colibri::Manifest man = colibri::load_manifest(tmp.path());
  Opened m;
  m.model = open_test_model(tmp.path(), true);
  ASSERT_NE(m.model, nullptr);
  const int32_t T = 40, E = spec.n_experts, D = spec.d_model, k = 4;
  for (int32_t layer = 0; layer < 2; ++layer) {
    const std::vector<float> x = input(T, D, 50 + static_cast<uint32_t>(layer));
    colibri::MappedFile rf(tmp.path() + "/" + man.router_file(layer));
    ASSERT_EQ(rf.size(), man.router_file_bytes());
    std::vector<float> router(static_cast<size_t>(E) * (D + 1));
    std::memcpy(router.data(), rf.data(), router.size() * sizeof(float));
    const float* bias = router.data() + static_cast<size_t>(E) * D;
    std::vector<int32_t> want_ids(static_cast<size_t>(T) * k);
    std::vector<float> want_w(want_ids.size());
    int confident = 0;
    for (int32_t t = 0; t < T; ++t) {
      std::vector<double> logit(static_cast<size_t>(E));
      for (int32_t e = 0; e < E; ++e) {
        double acc = bias[e];
        for (int32_t d = 0; d < D; ++d) {
          acc += static_cast<double>(router[static_cast<size_t>(e) * D + d]) * x[static_cast<size_t>(t) * D + d];
        }
        logit[static_cast<size_t>(e)] = acc;
      }
      std::vector<int32_t> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logit[a] > logit[b]; });
      double sum = 0;
      for (int32_t j = 0; j < k; ++j) sum += std::exp(logit[order[j]] - logit[order[0]]);
      for (int32_t j = 0; j < k; ++j) {
        want_ids[static_cast<size_t>(t) * k + j] = order[j];
        want_w[static_cast<size_t>(t) * k + j] = static_cast<float>(std::exp(logit[order[j]] - logit[order[0]]) / sum);
      }
      confident += logit[order[k - 1]] - logit[order[k]] > 1e-3 ? 1 : 0;
    }
    EXPECT_EQ(confident, T) << "a near-tie in the reference: pick another seed";
    std::vector<int32_t> ids(want_ids.size(), -9);
    std::vector<float> w(want_w.size(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_EQ(colibri_route(m.model, layer, T, x.data(), ids.data(), w.data()), COLIBRI_OK) << colibri_last_error();
    EXPECT_EQ(ids, want_ids);
    for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], want_w[i], 1e-5) << i;
    const std::vector<float> y = infer(m.model, layer, x, D, k, nullptr, nullptr);
    const std::vector<double> ref =
        colibri::reference_layer(tmp.path(), layer, T, x.data(), k, want_ids.data(), want_w.data());
    EXPECT_LE(colibri::relative_l2(y.data(), ref), 1e-5);
  }
}

// colibri_open_memory with the biases in the desc: the same bits as the
// model directory holding the same weights.
TEST(GptOssMemory, SameResultsAsTheModelDirectory) {
  colibri_test::TempDir tmp("colibri_gpt_oss");
  const colibri::ModelWriteSpec spec = gpt_oss_spec(colibri::WeightType::kQ8_0);
  colibri::write_random_model(tmp.path(), spec, 13);
  const colibri::Manifest man = colibri::load_manifest(tmp.path());
  const int32_t E = spec.n_experts, D = spec.d_model, F = spec.d_ff;
  const size_t gate_bytes = colibri::Manifest::matrix_bytes(man.dtype, F, D);
  const size_t matrices = 2 * gate_bytes + colibri::Manifest::matrix_bytes(man.dtype, D, F);
  std::vector<std::vector<uint8_t>> files;
  std::vector<std::vector<float>> routers, biases;
  std::vector<std::vector<colibri_expert_weights_t>> experts(static_cast<size_t>(spec.n_layers));
  std::vector<colibri_layer_weights_t> layers(static_cast<size_t>(spec.n_layers));
  for (int32_t l = 0; l < spec.n_layers; ++l) {
    colibri::MappedFile rf(tmp.path() + "/" + man.router_file(l));
    routers.emplace_back(static_cast<size_t>(E) * (D + 1));
    std::memcpy(routers.back().data(), rf.data(), routers.back().size() * sizeof(float));
    for (int32_t e = 0; e < E; ++e) {
      colibri::MappedFile f(tmp.path() + "/" + man.expert_file(l, e));
      files.emplace_back(f.data(), f.data() + f.size());
      biases.emplace_back(2 * static_cast<size_t>(F) + D);
      std::memcpy(biases.back().data(), files.back().data() + matrices, biases.back().size() * sizeof(float));
    }
  }
  for (int32_t l = 0; l < spec.n_layers; ++l) {
    for (int32_t e = 0; e < E; ++e) {
      const size_t i = static_cast<size_t>(l) * E + static_cast<size_t>(e);
      const uint8_t* p = files[i].data();
      const float* b = biases[i].data();
      experts[static_cast<size_t>(l)].push_back({p, p + gate_bytes, p + 2 * gate_bytes, b, b + F, b + 2 * F});
    }
    layers[static_cast<size_t>(l)] = colibri_layer_weights_t{};
    layers[static_cast<size_t>(l)].experts = experts[static_cast<size_t>(l)].data();
    layers[static_cast<size_t>(l)].router = routers[static_cast<size_t>(l)].data();
    layers[static_cast<size_t>(l)].router_bias = routers[static_cast<size_t>(l)].data() + static_cast<size_t>(E) * D;
  }
  colibri_model_desc_t desc;
  colibri_model_desc_default(&desc);
  EXPECT_EQ(desc.activation, COLIBRI_ACTIVATION_SWIGLU);
  desc.n_layers = spec.n_layers;
  desc.n_experts = E;
  desc.d_model = D;
  desc.d_ff = F;
  desc.dtype = COLIBRI_DTYPE_Q8_0;
  desc.down_dtype = COLIBRI_DTYPE_Q8_0;
  desc.router = colibri_test::c_router_desc(spec.router);
  desc.layers = layers.data();
  desc.activation = COLIBRI_ACTIVATION_CLAMPED_SWIGLU;
  desc.expert_bias = 1;
  Opened mem, dir;
  ASSERT_EQ(colibri_open_memory(&desc, nullptr, &mem.model), COLIBRI_OK) << colibri_last_error();
  dir.model = open_test_model(tmp.path(), false);
  ASSERT_NE(dir.model, nullptr);
  for (int32_t T : {1, 9}) {
    const std::vector<float> x = input(T, D, 70 + static_cast<uint32_t>(T));
    const std::vector<float> a = infer(mem.model, 1, x, D, 0, nullptr, nullptr);
    const std::vector<float> b = infer(dir.model, 1, x, D, 0, nullptr, nullptr);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "T=" << T;
  }
  // A bad activation is refused by name.
  desc.activation = static_cast<colibri_activation_t>(7);
  colibri_model_t* bad = nullptr;
  EXPECT_EQ(colibri_open_memory(&desc, nullptr, &bad), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("activation"), std::string::npos) << colibri_last_error();
}

// A swapped-in expert brings its biases: the output follows the new file.
TEST(GptOssSwap, SwappedExpertBringsItsBiases) {
  colibri_test::TempDir a("colibri_gpt_oss"), b("colibri_gpt_oss");
  colibri::ModelWriteSpec spec = gpt_oss_spec(colibri::WeightType::kF32);
  spec.n_layers = 1;
  colibri::write_random_model(a.path(), spec, 21);
  colibri::write_random_model(b.path(), spec, 22);
  Opened m;
  m.model = open_test_model(a.path(), true);
  ASSERT_NE(m.model, nullptr);
  colibri_swap_source_t src{};
  const std::string replacement = b.path() + "/expert_03.bin";
  src.path = replacement.c_str();
  ASSERT_EQ(colibri_swap_expert(m.model, 0, 3, &src), COLIBRI_OK) << colibri_last_error();
  // The reference on a directory holding a's experts with b's expert 3.
  std::filesystem::copy_file(replacement, a.path() + "/expert_03.bin", std::filesystem::copy_options::overwrite_existing);
  const int32_t T = 6;
  const std::vector<float> x = input(T, spec.d_model, 4);
  std::vector<int32_t> ids(static_cast<size_t>(T) * 4);
  std::vector<float> w(ids.size(), 0.25f);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 3) % static_cast<size_t>(spec.n_experts));
  const std::vector<float> y = infer(m.model, 0, x, spec.d_model, 4, &ids, &w);
  const std::vector<double> ref = colibri::reference_layer(a.path(), 0, T, x.data(), 4, ids.data(), w.data());
  EXPECT_LE(colibri::relative_l2(y.data(), ref), 1e-5);
}

TEST(GptOssManifest, V4FieldsAreReadWrittenAndRefusedByName) {
  const std::string base = R"({"format": "colibri-moe", "n_layers": 1, "n_experts": 2, "d_model": 64, "d_ff": 32,
                               "dtype": "f32", )";
  auto parse = [&](const std::string& rest) { return colibri::parse_manifest(base + rest, "m.json"); };
  const colibri::Manifest m =
      parse(R"("version": 4, "activation": "clamped_swiglu", "swiglu_limit": 5.5, "expert_bias": true})");
  EXPECT_TRUE(m.clamped_swiglu());
  EXPECT_FLOAT_EQ(m.swiglu_limit, 5.5f);
  EXPECT_FLOAT_EQ(m.swiglu_alpha, 1.702f);
  EXPECT_EQ(m.expert_file_bytes(0), uint64_t{3 * 64 * 32 * 4 + (2 * 32 + 64) * 4});
  EXPECT_EQ(m.minimum_version(), 4);
  const colibri::Manifest again = colibri::parse_manifest(colibri::manifest_to_json(m), "again.json");
  EXPECT_TRUE(again.clamped_swiglu() && again.expert_bias);
  EXPECT_FLOAT_EQ(again.swiglu_limit, 5.5f);
  auto refused = [&](const std::string& rest, const char* field) {
    try {
      parse(rest);
      ADD_FAILURE() << "accepted: " << rest;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refused(R"("version": 3, "activation": "clamped_swiglu"})", "activation");
  refused(R"("version": 3, "activation": "swiglu", "expert_bias": true})", "expert_bias");
  refused(R"("version": 4, "activation": "gelu"})", "activation");
  refused(R"("version": 4, "activation": "swiglu", "swiglu_limit": 7})", "swiglu_limit");
  refused(R"("version": 4, "activation": "clamped_swiglu", "swiglu_limit": -1})", "swiglu_limit");
  refused(R"("version": 4, "activation": "clamped_swiglu", "swiglu_alpha": "x"})", "swiglu_alpha");
  refused(R"("version": 4, "activation": "swiglu", "expert_bias": 1})", "expert_bias");
  refused(R"("version": 4, "activation": "clamped_swiglu", "shared_expert": {"d_ff": 16}})", "shared_expert");
  refused(R"("version": 4, "activation": "swiglu", "router": {"family": "gpt_oss", "top_k": 1,
              "norm_topk_prob": false}})", "norm_topk_prob");
}

}  // namespace
