// A dense linear layer, y = x W^T (+ b), with W in any format the experts
// use (the float types and GGUF's block formats), through the same kernel
// registry: W is the "down" block of an expert with d_model = out_features
// rows and d_ff = in_features, so decode runs the int8 (or exact-dequant)
// tables and many-token calls the prefill tiers plan_kernels picks for that
// shape. The attention projections, dense MLPs, shared experts and LM head
// of a whole model (python/colibri/model_loader.py) are these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "runtime/memory.h"
#include "runtime/thread_pool.h"
#include "util/aligned_vector.h"
#include "util/weight_format.h"

namespace colibri {

struct LinearOptions {
  int32_t threads = 0;  // 0: one per online core; the pool is the process's shared one for that count
  bool exact = false;   // fp32 activations against the dequantised weights (exact_prefill's contract)
  bool huge_pages = true;
  bool lock_memory = false;
  // Kernels at this level or the highest supported below it; -1: the
  // process default (COLIBRI_ISA). Tests force each level through it.
  int isa = -1;
  // Where more than one level can compute W (block formats), time each
  // level's tables on W itself at create and keep the fastest (kernel_choice.h,
  // remembered in the same cache file as the experts' choices); not when `isa`
  // is forced or the environment fixes the kernels (COLIBRI_ISA, COLIBRI_TUNE=0).
  bool tune = true;
};

class Linear {
 public:
  // `rows` holds groups x out_features rows of in_features elements as the
  // format stores them (weight_row_bytes(type, in_features) bytes each,
  // `size` bytes in all; checked): `groups` matrices W_g one after another
  // (DeepSeek's per-head attn_k_b / attn_v_b; 1 for a plain layer).
  // `bias` is groups x out_features floats or null. Both are copied.
  // `name` appears in errors. Throws colibri::Error.
  Linear(WeightType type, int32_t out_features, int32_t in_features, const void* rows, size_t size,
         const float* bias, const LinearOptions& options, const std::string& name, std::string* warnings,
         int32_t groups = 1);

  // y[t][g][o] = sum_i x[t][g][i] W_g[o][i] + b[g][o] for t < n_tokens; x
  // rows (groups x in_features) ldx floats apart, y rows (groups x
  // out_features) ldy apart, y overwritten. Calls on one layer are
  // serialised; different layers run one after another on their shared pool.
  void forward(int32_t n_tokens, const float* x, size_t ldx, float* y, size_t ldy);

  // One group's matrix: out_features x in_features.
  int32_t out_features() const { return shape_.d_model; }
  int32_t in_features() const { return shape_.d_ff; }
  int32_t groups() const { return groups_; }
  WeightType type() const { return shape_.down_type; }
  size_t weight_bytes() const { return weight_bytes_; }
  int threads() const { return pool_->size(); }
  // "decode int8-avx512, prefill amx-bf16-dequant from 24 tokens", and where
  // the levels were timed " (chosen by measurement: measured now, ...)".
  const std::string& kernels_description() const { return kernels_; }

 private:
  void choose_kernels(kernels::Isa isa, bool exact, std::string* warnings);

  kernels::ExpertShape shape_;
  int32_t groups_ = 1;
  size_t group_bytes_ = 0;  // packed bytes of one group's matrix
  WeightRegion weights_;
  size_t weight_bytes_ = 0;
  std::vector<float> bias_;
  kernels::KernelPlan plan_;
  std::string kernels_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<kernels::KernelScratch[]> scratch_;  // one per pool thread
  std::mutex mutex_;  // guards the scratch below and scratch_
  AlignedVector<uint8_t> prepared_;
  std::vector<int32_t> identity_;
  std::vector<float> ones_;
};

}  // namespace colibri
