// Kernels chosen by measurement. The registry (kernels/registry.cpp) picks
// tables by instruction-set level, but the highest level is not always the
// fastest: on AMD Zen 4 the AVX2 q4_0 and MXFP4 kernels beat the AVX-512
// ones (docs/KERNELS.md). So at open, where more than one level can compute
// a layer's block-format experts, each level's tables are timed on that
// layer's own experts (one token per expert, new experts every call, and
// kManyTokens tokens per expert) and the fastest kept, remembered per CPU,
// library version, thread count, far-prefetch hint and expert shape in a
// small file so the next open measures nothing. Dense layers (linear.h) take
// the same measurement through choose_plan_by_measurement.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "kernels/kernels.h"
#include "moe/engine.h"
#include "moe/expert_store.h"

namespace colibri {

struct KernelChoiceRequest {
  kernels::Isa isa = kernels::Isa::kScalar;  // the level the plans were made at
  kernels::PrefillPrecision precision = kernels::PrefillPrecision::kDefault;
  int threads = 1;        // the pool's
  int32_t n_experts = 0;
  int32_t top_k = 8;      // experts per token in the timed calls (at most n_experts)
  std::string cache_path; // "" = measure, remember nothing
};

// $COLIBRI_CACHE_DIR/kernels.tsv, else $XDG_CACHE_HOME/colibri/kernels.tsv,
// else $HOME/.cache/colibri/kernels.tsv; "" when none of them is set.
std::string kernel_choice_cache_path();

// False when the environment fixes the kernels: COLIBRI_ISA set (a forced
// level) or COLIBRI_TUNE=0.
bool kernel_choice_allowed_by_environment();

// For each distinct expert shape among the layers whose formats more than
// one level can run, the measured (or remembered) fastest tables replace
// the engine's plans for those layers. Returns what was chosen and why, one
// "; "-separated entry per shape ("" when nothing had a choice); a cache
// file that cannot be read or written is reported in *warnings and
// otherwise ignored. The store's experts must all be resident.
std::string choose_kernels_by_measurement(Engine& engine, const ExpertStore& store, int32_t n_layers,
                                          const KernelChoiceRequest& request, std::string* warnings);

// Seconds of one call of a layer run with `plan` at `tokens` tokens (per
// expert, for an MoE layer).
using PlanTimer = std::function<double(const kernels::KernelPlan& plan, int32_t tokens)>;

struct PlanChoice {
  kernels::KernelPlan plan;  // the chosen one; `top` where nothing had a choice
  bool had_choice = false;   // more than one level's tables could run the shape
  std::string description;   // "measured now, 1 token int8-avx512-vnni 0.2 ms / int8-avx2 0.18 ms, ..."
  std::string warning;       // a cache file that could not be read or written; "" otherwise
};

// The measured (or remembered) fastest levels for one shape, starting from
// the registry's plan `top` at request.isa: decode (1 token) and many-token
// (16) calls timed through `time` for each level's distinct tables, the
// winner kept only when more than 5% faster than `top`'s, remembered under
// a key of the request, the shape, `what` ("top-k 8" for an MoE layer,
// "linear" for a dense one) and the candidate tables.
PlanChoice choose_plan_by_measurement(const KernelChoiceRequest& request, const kernels::ExpertShape& shape,
                                      const kernels::KernelPlan& top, const std::string& what,
                                      const PlanTimer& time);

// What the cache file remembers for layers of `shape` opened as `request`
// says ("decode avx512 level, many tokens amx level (timings)"), or "".
std::string remembered_kernel_choice(const KernelChoiceRequest& request, const kernels::ExpertShape& shape);

}  // namespace colibri
