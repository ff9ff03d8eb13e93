// The MoE engine: turns one call's routing into kernel work.
//
// 1. Bucket the (token, slot) pairs by expert (counting sort), so each
//    expert's weights are read once per call however many tokens chose it.
// 2. Phase 1 over (expert, block of d_ff rows) items: h = silu(gate x) * (up x)
//    for the expert's tokens.
// 3. Phase 2 over blocks of d_model rows: each item zeroes its columns of the
//    output and adds every active expert's w * (down h), experts in ascending
//    order. Threads own disjoint output columns, so there are no atomics on
//    the output and the result does not depend on the thread count.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "kernels/kernels.h"
#include "moe/expert_store.h"
#include "runtime/thread_pool.h"

namespace colibri {

struct InferArgs {
  int32_t layer = 0;
  int32_t n_tokens = 0;
  const float* input = nullptr;
  float* output = nullptr;
  int32_t top_k = 0;
  const int32_t* expert_ids = nullptr;  // [T][k], -1 = empty slot
  const float* expert_weights = nullptr;
  int threads = 0;  // 0 = all of the pool
};

class Engine {
 public:
  Engine(const ExpertStore& store, int32_t n_layers, int32_t n_experts, ThreadPool& pool,
         const kernels::KernelTable& kernels);

  // Sizes the scratch for calls of up to `tokens` tokens with `top_k`
  // experts each, so such calls allocate nothing. Larger calls grow the
  // scratch once, inside the call, and keep it.
  void reserve(int32_t tokens, int32_t top_k);

  // Validates ids (throws Error(COLIBRI_ERR_INVALID_ARGUMENT) before touching
  // the output) and runs the layer. Concurrent calls are serialised.
  void infer(const InferArgs& args);

  // Same, but the routing comes from routing.bin bytes, decoded into the
  // engine's scratch space.
  void infer_blob(const InferArgs& args, const void* blob, size_t blob_size);

  const kernels::KernelTable& kernels() const { return *kernels_; }

  // Kernels for experts that received at least `min_tokens` tokens in a
  // call (the prefill GEMM path); below that the decode kernels run.
  // nullptr disables the switch.
  void set_prefill_kernels(const kernels::KernelTable* table, int32_t min_tokens) {
    prefill_ = table;
    prefill_min_tokens_ = min_tokens;
  }
  const kernels::KernelTable* prefill_kernels() const { return prefill_; }
  int32_t prefill_min_tokens() const { return prefill_min_tokens_; }

 private:
  struct Phase1Item {
    int32_t active;  // index into active_experts_
    int32_t f_begin;
  };

  void run_locked(const InferArgs& args);
  void bucket(const InferArgs& args);

  const ExpertStore& store_;
  int32_t n_layers_;
  int32_t n_experts_;
  ThreadPool& pool_;
  const kernels::KernelTable* kernels_;
  const kernels::KernelTable* prefill_ = nullptr;
  int32_t prefill_min_tokens_ = 0;

  const kernels::KernelTable& table_for(int32_t n_tokens) const {
    return prefill_ != nullptr && n_tokens >= prefill_min_tokens_ ? *prefill_ : *kernels_;
  }

  std::mutex call_mutex_;  // guards the scratch below
  // Scratch, grown on demand and reused across calls.
  std::vector<int32_t> expert_offsets_;  // [E+1] start of each expert's slots
  std::vector<int32_t> slot_token_;      // [slots] token of each slot, grouped by expert
  std::vector<float> slot_weight_;       // [slots]
  std::vector<int32_t> active_experts_;  // experts with at least one slot, ascending
  std::vector<Phase1Item> phase1_items_;
  std::vector<float> hidden_;            // [slots][ldh] silu(gate x) * up x
  std::vector<int32_t> blob_ids_;        // decoded routing.bin
  std::vector<float> blob_weights_;
};

}  // namespace colibri
