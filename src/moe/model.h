// A loaded model: manifest, packed experts, thread pool and engine. This is
// what the C ABI's opaque colibri_model_t wraps.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include <vector>

#include "io/manifest.h"
#include "moe/engine.h"
#include "moe/expert_cache.h"
#include "moe/expert_store.h"
#include "moe/weight_buffers.h"
#include "runtime/thread_pool.h"

namespace colibri {

// How to open a model (the C ABI's colibri_open_options_t, mapped in
// src/api; include/colibri.h documents each field).
struct OpenOptions {
  int32_t threads = 0;  // 0: one per online core
  bool lock_memory = true;
  bool huge_pages = true;
  bool verify_checksums = true;
  bool pin_threads = false;
  int32_t reserve_tokens = 64;
  bool bf16_compute = false;
  bool exact_prefill = false;
  // Memory budget for routed experts' weights: bytes, or a percentage of
  // their packed size (the larger when both are set); 0 and 0: none. A
  // budget the model fits in changes nothing.
  uint64_t max_resident_bytes = 0;
  double max_resident_percent = 0.0;
  int32_t io_threads = 0;  // reader threads under a budget; 0: by the bytes in flight (Model::start_cache)
  EvictionPolicy eviction = EvictionPolicy::kDecayedFrequency;
  bool direct_io = true;
  IoEngine io_engine = IoEngine::kPread;
  bool speculate = true;   // router speculation under a budget
  // Time the levels that can run the experts and keep the fastest
  // (moe/kernel_choice.h); off under a budget and where the environment
  // fixes the kernels (COLIBRI_ISA, COLIBRI_TUNE=0).
  bool tune_kernels = true;
  // Called with how far the open has come; false cancels it (util/progress.h).
  std::function<bool(float)> progress;
  // Expert parallelism: nonzero for the routed experts this process
  // computes, n_experts bytes (every layer alike) or n_layers * n_experts
  // (layer-major); empty = all. skip_shared leaves the shared expert out.
  std::vector<uint8_t> local_experts;
  bool skip_shared = false;
};

class Model {
 public:
  // A model directory, or a GGUF file (or the first file of a split set:
  // its MoE layers, moe/gguf_model.h). Throws colibri::Error. Warnings
  // (e.g. mlock refused, dense GGUF blocks skipped) go to *warnings.
  Model(const std::string& path, const OpenOptions& options, std::string* warnings);
  // From weights in memory, one LayerBuffers per layer, described by
  // `manifest` (validated by the caller, as parse_manifest does, and with
  // every pointer it implies set).
  // `fetch` supplies the experts of layers whose `experts` is empty.
  Model(const Manifest& manifest, const std::vector<LayerBuffers>& layers, const OpenOptions& options,
        std::string* warnings, const ExpertFetch& fetch = {});

  const Manifest& manifest() const { return manifest_; }
  Engine& engine() { return *engine_; }
  const ExpertStore& store() const { return *store_; }
  // The resident expert cache; nullptr without a budget (or when the
  // model fits in it).
  const ExpertCache* cache() const { return cache_.get(); }
  ExpertCache* cache() { return cache_.get(); }
  // Bytes of every routed expert packed (what no budget keeps resident).
  uint64_t experts_bytes() const { return experts_bytes_; }
  int threads() const { return pool_->size(); }
  double load_seconds() const { return load_seconds_; }
  const std::string& kernels_description() const { return kernels_description_; }
  // Where the weights came from: "directory", or for a GGUF file its
  // architecture, which blocks the layers are, and the tensor types.
  const std::string& source_description() const { return source_description_; }
  // The GGUF block of layer 0 (0 for other sources).
  int32_t first_block() const { return first_block_; }
  std::atomic<uint64_t>& infer_calls() { return infer_calls_; }
  uint64_t expert_swaps() const { return expert_swaps_.load(std::memory_order_relaxed); }

  // colibri_swap_expert: `bytes` are expert-file bytes (already in memory),
  // `what` names their source in errors. Throws; on error nothing changed.
  void swap_expert(int32_t layer, int32_t expert, const uint8_t* bytes, size_t size, const std::string& what,
                   const uint64_t* checksum, std::string* warnings);
  uint64_t infer_calls_count() const { return infer_calls_.load(std::memory_order_relaxed); }

 private:
  // Everything after the store: pool, engine, kernel choice, scratch.
  void start(const OpenOptions& options, std::string* warnings);
  // The cache's slot count for the options' budget (0: no budget, or one
  // the experts fit in); sets experts_bytes_ and slot_bytes_. Throws for a
  // bad budget, naming `what` (the model's path).
  int32_t budget_slots(const OpenOptions& options, const std::string& what);
  void start_cache(const OpenOptions& options, CacheSource source, int32_t slots, std::string* warnings);

  Manifest manifest_;
  std::unique_ptr<ExpertStore> store_;
  std::unique_ptr<ExpertCache> cache_;  // destroyed before the store (its readers stop first)
  uint64_t experts_bytes_ = 0;
  size_t slot_bytes_ = 0;
  std::shared_ptr<ThreadPool> pool_;  // shared_thread_pool: one per thread count in the process
  std::unique_ptr<Engine> engine_;
  double load_seconds_ = 0.0;
  std::string kernels_description_;
  std::string source_description_ = "colibri model directory";
  int32_t first_block_ = 0;
  std::atomic<uint64_t> infer_calls_{0};
  std::atomic<uint64_t> expert_swaps_{0};
};

}  // namespace colibri
