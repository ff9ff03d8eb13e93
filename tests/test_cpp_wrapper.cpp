// include/colibri.hpp, the header-only C++ wrapper over the C ABI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "colibri.hpp"
#include "lib/model_writer.h"
#include "test_util.h"

namespace {

TEST(CppWrapper, OpenRouteInferAndErrors) {
  colibri_test::TempDir dir;
  colibri::ModelWriteSpec spec;
  spec.n_experts = 8;
  spec.d_model = 48;
  spec.d_ff = 32;
  spec.dtype = colibri::WeightType::kF32;
  spec.router.family = colibri::RouterFamily::kMixtral;
  spec.router.top_k = 2;
  spec.router.norm_topk_prob = 1;
  colibri::write_random_model(dir.path(), spec, 4);

  colibri_cpp::Model model(dir.path());
  const colibri_model_info_t info = model.info();
  EXPECT_EQ(info.router_family, COLIBRI_ROUTER_MIXTRAL);
  ASSERT_EQ(info.router_top_k, 2);

  const int32_t T = 6;
  std::vector<float> x(static_cast<size_t>(T) * 48);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<float> routed(x.size(), std::nanf("")), explicit_out(x.size(), std::nanf(""));
  model.infer(0, T, x.data(), routed.data());
  std::vector<int32_t> ids(static_cast<size_t>(T) * 2);
  std::vector<float> w(ids.size());
  model.route(0, T, x.data(), ids.data(), w.data());
  for (int32_t t = 0; t < T; ++t) EXPECT_NEAR(w[2 * t] + w[2 * t + 1], 1.0f, 1e-6f);  // Mixtral renormalises
  model.infer(0, T, x.data(), explicit_out.data(), 2, ids.data(), w.data());
  EXPECT_EQ(0, std::memcmp(routed.data(), explicit_out.data(), routed.size() * sizeof(float)));

  // Errors surface as exceptions with the library's status and message.
  try {
    model.infer(3, T, x.data(), routed.data());
    FAIL() << "layer 3 accepted";
  } catch (const colibri_cpp::Error& e) {
    EXPECT_EQ(e.status(), COLIBRI_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("layer 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(colibri_cpp::Model(dir.path() + "/missing"), colibri_cpp::Error);

  // Move semantics: the moved-from handle is empty, the target works.
  colibri_cpp::Model moved = std::move(model);
  moved.infer(0, T, x.data(), explicit_out.data());
  EXPECT_EQ(0, std::memcmp(routed.data(), explicit_out.data(), routed.size() * sizeof(float)));
}

}  // namespace
