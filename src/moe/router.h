// The built-in router's selection rules (one per model family; the table is
// in include/colibri.h and docs/ROUTER.md). The engine computes the logits
// (x . router rows) with the kernels; this turns one token's logits into its
// top-k experts and weights.
//
// Ties: among equal scores the lower expert index wins, for experts and for
// groups alike, so a routing is a pure function of the logits.
#pragma once

#include <cstdint>
#include <vector>

#include "util/router_desc.h"

namespace colibri {

class RouterRule {
 public:
  RouterRule() = default;
  RouterRule(const RouterDesc& desc, int32_t n_experts);

  int32_t top_k() const { return desc_.top_k; }
  const RouterDesc& desc() const { return desc_; }

  // logits [E] -> ids [k] (best first) and weights [k]. `bias` [E] is the
  // DeepSeek-V3 e_score_correction_bias or gpt-oss's logit bias (nullptr =
  // zeros). Not thread-safe:
  // uses the rule's scratch.
  void select(const float* logits, const float* bias, int32_t* ids, float* weights);

 private:
  RouterDesc desc_{};
  int32_t n_experts_ = 0;
  std::vector<float> scores_;   // softmax or sigmoid of the logits
  std::vector<float> choice_;   // what top-k ranks (scores, + bias for V3)
  std::vector<float> group_;    // group scores
  std::vector<int32_t> order_;  // index scratch
  std::vector<uint8_t> group_kept_;
};

}  // namespace colibri
