#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace colibri {

namespace {

// First `k` of `idx` ordered by value descending, lower index first on ties.
void top_indices(const float* value, int32_t n, int32_t k, std::vector<int32_t>& idx) {
  idx.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = i;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [value](int32_t a, int32_t b) {
    return value[a] > value[b] || (value[a] == value[b] && a < b);
  });
}

}  // namespace

RouterRule::RouterRule(const RouterDesc& desc, int32_t n_experts)
    : desc_(desc), n_experts_(n_experts) {
  const size_t E = static_cast<size_t>(n_experts);
  scores_.resize(E);
  choice_.resize(E);
  order_.resize(E);
  group_.resize(static_cast<size_t>(std::max(desc.n_group, 1)));
  group_kept_.resize(group_.size());
}

void RouterRule::select(const float* logits, const float* bias, int32_t* ids, float* weights) {
  const int32_t E = n_experts_;
  const int32_t k = desc_.top_k;
  if (desc_.family == RouterFamily::kGptOss) {
    // gpt-oss: the top k of the biased logits, then a softmax over those k
    // (transformers' GptOssTopKRouter), the best one's logit subtracted.
    float* c = choice_.data();
    for (int32_t e = 0; e < E; ++e) c[e] = logits[e] + (bias != nullptr ? bias[e] : 0.0f);
    top_indices(c, E, k, order_);
    const float peak = c[order_[0]];
    float sum = 0.0f;
    for (int32_t j = 0; j < k; ++j) {
      ids[j] = order_[static_cast<size_t>(j)];
      weights[j] = std::exp(c[ids[j]] - peak);
      sum += weights[j];
    }
    for (int32_t j = 0; j < k; ++j) weights[j] /= sum;
    return;
  }
  const bool v3 = desc_.family == RouterFamily::kDeepseekV3;
  float* s = scores_.data();
  if (v3) {
    for (int32_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else {
    // Softmax in fp32 with the maximum subtracted, as torch.softmax does.
    float peak = logits[0];
    for (int32_t e = 1; e < E; ++e) peak = std::max(peak, logits[e]);
    float sum = 0.0f;
    for (int32_t e = 0; e < E; ++e) {
      s[e] = std::exp(logits[e] - peak);
      sum += s[e];
    }
    const float inv = 1.0f / sum;
    for (int32_t e = 0; e < E; ++e) s[e] *= inv;
  }
  float* c = choice_.data();
  for (int32_t e = 0; e < E; ++e) c[e] = s[e] + (v3 && bias != nullptr ? bias[e] : 0.0f);

  const bool grouped = (desc_.family == RouterFamily::kDeepseekV2 || v3) && desc_.n_group > 1;
  if (grouped) {
    const int32_t G = desc_.n_group;
    const int32_t per = E / G;
    for (int32_t g = 0; g < G; ++g) {
      const float* cg = c + static_cast<size_t>(g) * per;
      if (v3) {
        // Sum of the group's two best choice scores.
        float best = -std::numeric_limits<float>::infinity(), second = best;
        for (int32_t i = 0; i < per; ++i) {
          if (cg[i] > best) {
            second = best;
            best = cg[i];
          } else if (cg[i] > second) {
            second = cg[i];
          }
        }
        group_[static_cast<size_t>(g)] = best + second;
      } else {
        group_[static_cast<size_t>(g)] = *std::max_element(cg, cg + per);
      }
    }
    top_indices(group_.data(), G, desc_.topk_group, order_);
    std::fill(group_kept_.begin(), group_kept_.end(), 0);
    for (int32_t i = 0; i < desc_.topk_group; ++i) group_kept_[static_cast<size_t>(order_[static_cast<size_t>(i)])] = 1;
    // Experts of dropped groups can never be chosen.
    for (int32_t e = 0; e < E; ++e) {
      if (!group_kept_[static_cast<size_t>(e / per)]) c[e] = -std::numeric_limits<float>::infinity();
    }
  }
  top_indices(c, E, k, order_);

  float sum = 0.0f;
  for (int32_t j = 0; j < k; ++j) {
    ids[j] = order_[static_cast<size_t>(j)];
    weights[j] = s[ids[j]];
    sum += weights[j];
  }
  switch (desc_.family) {
    case RouterFamily::kMixtral:
      for (int32_t j = 0; j < k; ++j) weights[j] /= sum;
      break;
    case RouterFamily::kQwen2Moe:
    case RouterFamily::kQwen3Moe:
    case RouterFamily::kOlmoe:
      if (desc_.norm_topk_prob) {
        for (int32_t j = 0; j < k; ++j) weights[j] /= sum;
      }
      break;
    case RouterFamily::kDeepseekV2:
      // DeepSeek-V2's own code: renormalise (k > 1), or else scale.
      if (k > 1 && desc_.norm_topk_prob) {
        for (int32_t j = 0; j < k; ++j) weights[j] /= sum + 1e-20f;
      } else {
        for (int32_t j = 0; j < k; ++j) weights[j] *= desc_.routed_scaling_factor;
      }
      break;
    case RouterFamily::kDeepseekV3:
      for (int32_t j = 0; j < k; ++j) {
        if (desc_.norm_topk_prob) weights[j] /= sum + 1e-20f;
        weights[j] *= desc_.routed_scaling_factor;
      }
      break;
    case RouterFamily::kNone:
    case RouterFamily::kGptOss:  // returned above
      break;
  }
}

}  // namespace colibri
