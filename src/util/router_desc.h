// The built-in router's description below the C ABI: the same fields and
// values as RouterDesc / RouterFamily, which src/api
// (and Model's constructor from a colibri_model_desc_t) convert from and to.
#pragma once

#include <cstdint>

namespace colibri {

// Values as RouterFamily's.
enum class RouterFamily : int32_t {
  kNone = 0,  // the model has no router
  kMixtral = 1,
  kQwen2Moe = 2,
  kQwen3Moe = 3,
  kOlmoe = 4,
  kDeepseekV2 = 5,
  kDeepseekV3 = 6,
  kGptOss = 7,
};
inline constexpr int32_t kLastRouterFamily = static_cast<int32_t>(RouterFamily::kGptOss);

struct RouterDesc {
  RouterFamily family = RouterFamily::kNone;
  int32_t top_k = 0;                   // experts per token, 1 .. n_experts
  int32_t norm_topk_prob = 0;          // 1 = renormalise the chosen weights
  int32_t n_group = 1;                 // DeepSeek: expert groups (<= 1: no grouping)
  int32_t topk_group = 1;              // DeepSeek: groups kept, 1 .. n_group
  float routed_scaling_factor = 1.0f;  // DeepSeek; 1 elsewhere
};

}  // namespace colibri
