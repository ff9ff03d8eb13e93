// The MoE engine: turns one call's routing into kernel work.
//
// 1. Bucket the (token, slot) pairs by expert (counting sort), so each
//    expert's weights are read once per call however many tokens chose it.
// 2. Phase 1 over (expert, block of d_ff rows) items: h = silu(gate x) * (up x)
//    for the expert's tokens.
// 3. Phase 2 over blocks of d_model rows: each item zeroes its columns of the
//    output and adds every active expert's w * (down h), experts in ascending
//    order, then the shared expert's (if any). Threads own disjoint output columns, so there are no atomics on
//    the output and the result does not depend on the thread count.
#pragma once

#include <cstdint>
#include <mutex>
#include <memory>
#include <vector>

#include "kernels/kernels.h"
#include "moe/expert_cache.h"
#include "moe/expert_store.h"
#include "moe/router.h"
#include "runtime/fair_mutex.h"
#include "runtime/thread_pool.h"
#include "util/aligned_vector.h"
#include "util/error.h"

namespace colibri {

struct InferArgs {
  int32_t layer = 0;
  int32_t n_tokens = 0;
  const float* input = nullptr;
  float* output = nullptr;
  int32_t top_k = 0;
  const int32_t* expert_ids = nullptr;  // [T][k], -1 = empty slot; nullptr = built-in router
  const float* expert_weights = nullptr;
  int threads = 0;  // 0 = all of the pool
};

class Engine {
 public:
  // `plans`: the tables for each layer's experts (kernels::plan_kernels on
  // store.shape(layer)), one per layer.
  Engine(const ExpertStore& store, int32_t n_layers, int32_t n_experts, ThreadPool& pool,
         std::vector<kernels::KernelPlan> plans);

  // Sizes the scratch for calls of up to `tokens` tokens with `top_k`
  // experts each, so such calls allocate nothing. Larger calls grow the
  // scratch once, inside the call, and keep it.
  void reserve(int32_t tokens, int32_t top_k);

  // Validates ids (throws Error(Status::kInvalidArgument) before touching
  // the output) and runs the layer. Concurrent calls are serialised.
  void infer(const InferArgs& args);

  // Same, but the routing comes from routing.bin bytes, decoded into the
  // engine's scratch space.
  void infer_blob(const InferArgs& args, const void* blob, size_t blob_size);

  // The built-in router alone: ids/weights [T][router top_k]. Throws
  // INVALID_ARGUMENT when the model has no router.
  void route(int32_t layer, int32_t n_tokens, const float* input, int32_t* ids, float* weights, int threads);

  // Experts not in the store come from `cache` (a model opened with a
  // memory budget); `speculate`: prefetch the next layer's experts that its
  // router predicts from this call's input (built-in router only).
  void set_cache(ExpertCache* cache, bool speculate);

  // Installs the built-in router (the store must hold its weights).
  void set_router(const RouterDesc& desc);
  bool has_router() const { return router_.desc().family != RouterFamily::kNone; }

  // Layer `layer`'s tables.
  const kernels::KernelPlan& plan(int32_t layer) const { return plans_[static_cast<size_t>(layer)]; }
  // Replaces them (the kernel choice by measurement at open, moe/kernel_choice.h).
  void set_plan(int32_t layer, const kernels::KernelPlan& plan);
  const kernels::KernelTable& kernels() const { return *plans_[0].decode; }

  // Runs fn with no call in flight and none starting until it returns: the
  // grace period of a hot swap (calls are serialised, so once the call lock
  // is held no call can still be reading what fn replaces).
  template <class Fn>
  void exclusive(Fn&& fn) {
    std::lock_guard<FairMutex> lock(call_mutex_);
    fn();
  }

  // Kernels for experts by the tokens they received in a call (the prefill
  // paths); below the first tier the decode kernels run. No tiers disables
  // the switch.
  const kernels::PrefillTiers& prefill_kernels() const { return plans_[0].prefill; }

 private:
  struct Phase1Item {
    int32_t active;  // index into active_experts_; -1 = the shared expert
    int32_t f_begin;
  };

  void run_locked(const InferArgs& args);
  void bucket(const InferArgs& args);
  // Router logits -> router_ids_/router_weights_ for a.n_tokens tokens.
  // ids/weights must hold n_tokens * top_k (reserve_tokens_locked first
  // when they are blob_ids_ / blob_weights_, which it may grow).
  void route_locked(int32_t layer, int32_t n_tokens, const float* input, int threads, int32_t* ids, float* weights);
  // With a cache: the next layer's router on this call's input, its
  // experts into speculated_ (prefetched by run_cached).
  void speculate_locked(int32_t layer, int32_t n_tokens, const float* input, int threads);
  // A call whose experts come from the cache, streamed through its pool.
  template <class RunExperts>
  void run_cached(const InferArgs& a, const RunExperts& run_experts);
  void compute_shared_scale(const InferArgs& a);
  void check_layer(int32_t layer) const;
  void reserve_tokens_locked(int32_t tokens);
  void reserve_kernel_scratch(int32_t tokens);
  // Bytes of either phase's prepared inputs for `slots` routed slots over
  // any number of active experts, plus the shared expert's for `tokens`.
  size_t prepared_bound(size_t slots, int32_t tokens) const;
  // Plans and runs the preparation of a phase's inputs (kernels::PrepareFn)
  // for the routed experts and/or the shared expert; sets prepared_offset_
  // and shared_prepared_offset_ (kNotPrepared where not prepared).
  void prepare_inputs(kernels::Phase phase, const InferArgs& a, int threads, size_t i0, size_t i1, bool routed,
                      bool shared);

  const ExpertStore& store_;
  int32_t n_layers_;
  int32_t n_experts_;
  ThreadPool& pool_;
  std::vector<kernels::KernelPlan> plans_;  // [layer]
  // One layer of each distinct expert shape (types), for reservations.
  std::vector<int32_t> distinct_layers_;
  // The prefill kernels' working memory, one per pool thread, sized by
  // reserve() and passed to the kernels of the work items that thread runs.
  std::unique_ptr<kernels::KernelScratch[]> kernel_scratch_;

  const kernels::KernelTable& table_for(int32_t layer, int32_t n_tokens) const {
    return plans_[static_cast<size_t>(layer)].pick(n_tokens);
  }

  FairMutex call_mutex_;  // guards the scratch below; callers served in arrival order
  // Scratch, grown on demand and reused across calls.
  std::vector<int32_t> expert_offsets_;  // [E+1] start of each expert's slots
  std::vector<int32_t> slot_token_;      // [slots] token of each slot, grouped by expert
  std::vector<float> slot_weight_;       // [slots]
  std::vector<int32_t> active_experts_;  // experts with at least one slot, ascending
  std::vector<Phase1Item> phase1_items_;
  // A phase's inputs prepared by the experts' tables (kernels::PrepareFn),
  // for the phase running: one region per job, at prepared_offset_[active
  // index] (kNotPrepared: the kernel converts them itself) or
  // shared_prepared_offset_.
  struct PrepareJob {
    int32_t active;  // index into active_experts_; -1 = the shared expert
    size_t offset;
  };
  static constexpr size_t kNotPrepared = ~size_t{0};
  std::vector<PrepareJob> prepare_jobs_;
  std::vector<size_t> prepared_offset_;
  size_t shared_prepared_offset_ = kNotPrepared;
  AlignedVector<uint8_t> prepared_;
  AlignedVector<float> hidden_;          // [slots][ldh] silu(gate x) * up x; rows on cache lines
  std::vector<const uint8_t*> expert_base_;  // [active index] packed expert
  // Under a budget (cache_): the call's experts that the cache serves, their
  // active indices and slots, and the router's guess for the next layer.
  ExpertCache* cache_ = nullptr;
  bool speculate_ = false;
  std::vector<int32_t> cached_ids_, cached_index_;
  std::vector<const uint8_t*> cached_bases_;
  std::vector<int32_t> spec_ids_;
  std::vector<float> spec_weights_;
  std::vector<uint8_t> spec_mark_;
  std::vector<int32_t> speculated_;
  int32_t n_speculated_ = 0;
  std::vector<int32_t> blob_ids_;        // decoded routing.bin, or the router's choice
  std::vector<float> blob_weights_;
  // Built-in router and shared expert.
  RouterRule router_;
  kernels::KernelPlan router_plan_;  // f32 weights, fp32 compute
  std::vector<float> logits_;          // [T][E]
  std::vector<int32_t> identity_;      // 0, 1, 2, ... (token index of the shared expert / router)
  std::vector<float> ones_;            // weight 1 per token (router logits)
  std::vector<float> shared_scale_;    // [T] sigmoid(shared_gate . x) or 1
  AlignedVector<float> shared_hidden_; // [T][ldh_shared]
};

}  // namespace colibri
