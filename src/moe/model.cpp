#include "moe/model.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "util/error.h"

namespace colibri {

namespace {

int online_cores() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

Model::Model(const std::string& dir, const colibri_open_options_t& o, std::string* warnings) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.n_threads < 0) {
    fail(COLIBRI_ERR_INVALID_ARGUMENT, "options.n_threads must be >= 0 (0 = one per core), got " +
                                           std::to_string(o.n_threads));
  }
  manifest_ = load_manifest(dir);
  StoreOptions so;
  so.verify_checksums = o.verify_checksums != 0;
  so.huge_pages = o.huge_pages != 0;
  so.lock_memory = o.lock_memory != 0;
  store_ = std::make_unique<ExpertStore>(dir, manifest_, so, warnings);
  // Workers spin between calls, so more threads than cores only steals time
  // from each other.
  const int cores = online_cores();
  int threads = o.n_threads == 0 ? cores : o.n_threads;
  if (threads > cores) threads = cores;
  pool_ = std::make_unique<ThreadPool>(threads, o.pin_threads != 0);
  // bf16 weights get the bf16-compute kernels where the CPU has them
  // (docs/PRECISION.md); Engine::kernels().name says which table runs.
  const kernels::Isa isa = kernels::default_isa();
  const kernels::WeightType wt = store_->shape().weight_type;
  engine_ = std::make_unique<Engine>(*store_, manifest_.n_layers, manifest_.n_experts, *pool_,
                                     kernels::kernel_table_for(isa, wt));
  int32_t min_tokens = 0;
  const kernels::KernelTable* prefill = kernels::prefill_table_for(isa, wt, o.bf16_compute != 0, &min_tokens);
  engine_->set_prefill_kernels(prefill, min_tokens);
  kernels_description_ = std::string("decode ") + engine_->kernels().name;
  if (prefill != nullptr) {
    kernels_description_ += std::string(", prefill ") + prefill->name + " from " +
                            std::to_string(min_tokens) + " tokens/expert";
  }
  if (o.reserve_tokens < 0) {
    fail(COLIBRI_ERR_INVALID_ARGUMENT, "options.reserve_tokens must be >= 0, got " +
                                           std::to_string(o.reserve_tokens));
  }
  engine_->reserve(o.reserve_tokens, std::min(manifest_.n_experts, 8));
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace colibri
