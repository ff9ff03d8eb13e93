#include "moe/model.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "io/checksum.h"
#include "util/c_enum.h"
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
    fail(Status::kInvalidArgument, "options.n_threads must be >= 0 (0 = one per core), got " +
                                           std::to_string(o.n_threads));
  }
  manifest_ = load_manifest(dir);
  if (o.verify_checksums != 0) verify_manifest_checksum(dir);
  StoreOptions so;
  so.verify_checksums = o.verify_checksums != 0;
  so.huge_pages = o.huge_pages != 0;
  so.lock_memory = o.lock_memory != 0;
  store_ = std::make_unique<ExpertStore>(dir, manifest_, so, warnings);
  start(o);
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

namespace {

[[noreturn]] void bad_desc(const std::string& what) {
  fail(Status::kInvalidArgument, "colibri_open_memory: " + what);
}

void require_expert(const colibri_expert_weights_t& w, const std::string& name) {
  if (w.gate == nullptr) bad_desc(name + ".gate is NULL");
  if (w.up == nullptr) bad_desc(name + ".up is NULL");
  if (w.down == nullptr) bad_desc(name + ".down is NULL");
}

// The manifest a directory holding `desc` would have: the same limits apply.
Manifest manifest_of(const colibri_model_desc_t& d) {
  if (d.layers == nullptr) bad_desc("desc->layers is NULL");
  const int dtype = raw_enum(d.dtype);
  if (dtype < 0 || dtype >= kWeightTypeCount) {
    bad_desc("dtype " + std::to_string(dtype) + " is not a known dtype (" + dtype_names() + ")");
  }
  const auto type = static_cast<WeightType>(dtype);  // colibri_dtype_t's values are WeightType's
  const bool quantized = weight_format(type).quantized;
  const int down_dtype = quantized ? raw_enum(d.down_dtype) : dtype;
  if (down_dtype < 0 || down_dtype >= kWeightTypeCount) {
    bad_desc("down_dtype " + std::to_string(down_dtype) + " is not a known dtype (" + dtype_names() + ")");
  }
  const auto down_type = static_cast<WeightType>(down_dtype);
  if (const std::string why = dtype_pair_problem(type, down_type); !why.empty()) bad_desc(why);
  const int family = raw_enum(d.router.family);
  if (family < 0 || family > kLastRouterFamily) {
    bad_desc("router.family " + std::to_string(family) + " is not a known router family");
  }
  if (d.shared_d_ff < 0) bad_desc("shared_d_ff must be >= 0, got " + std::to_string(d.shared_d_ff));
  Manifest m;
  m.n_layers = d.n_layers;
  m.n_experts = d.n_experts;
  m.d_model = d.d_model;
  m.d_ff = d.d_ff;
  m.dtype = type;
  m.down_dtype = down_type;
  m.router.family = static_cast<RouterFamily>(family);
  m.router.top_k = d.router.top_k;
  m.router.norm_topk_prob = d.router.norm_topk_prob;
  m.router.n_group = d.router.n_group;
  m.router.topk_group = d.router.topk_group;
  m.router.routed_scaling_factor = d.router.routed_scaling_factor;
  m.shared_d_ff = d.shared_d_ff;
  m.version = quantized ? 3 : 2;
  // Dimension and size limits first (the manifest parser holds them), so
  // the loops below never walk past what the caller could have allocated.
  try {
    parse_manifest(manifest_to_json(m), "colibri_open_memory: desc");
  } catch (const Error& e) {
    fail(Status::kInvalidArgument, e.what());
  }
  validate_router(m.router, d.n_experts, "colibri_open_memory: router", Status::kInvalidArgument);
  bool any_gate = false, all_gate = true;
  for (int64_t l = 0; l < d.n_layers; ++l) {
    const colibri_layer_weights_t& lw = d.layers[l];
    const std::string layer = "layers[" + std::to_string(l) + "]";
    if (lw.experts == nullptr) bad_desc(layer + ".experts is NULL");
    for (int64_t e = 0; e < d.n_experts; ++e) {
      require_expert(lw.experts[e], layer + ".experts[" + std::to_string(e) + "]");
    }
    if (m.has_router() && lw.router == nullptr) bad_desc(layer + ".router is NULL (the model has a router)");
    if (m.has_shared()) {
      require_expert(lw.shared, layer + ".shared");
      any_gate |= lw.shared_gate != nullptr;
      all_gate &= lw.shared_gate != nullptr;
    }
  }
  if (any_gate && !all_gate) bad_desc("shared_gate must be given for every layer or for none");
  m.shared_gate = m.has_shared() && any_gate;
  return m;
}

}  // namespace

Model::Model(const colibri_model_desc_t& desc, const colibri_open_options_t& o, std::string* warnings) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.n_threads < 0) {
    fail(Status::kInvalidArgument, "options.n_threads must be >= 0 (0 = one per core), got " +
                                           std::to_string(o.n_threads));
  }
  manifest_ = manifest_of(desc);
  StoreOptions so;
  so.verify_checksums = false;
  so.huge_pages = o.huge_pages != 0;
  so.lock_memory = o.lock_memory != 0;
  store_ = std::make_unique<ExpertStore>(desc, manifest_, so, warnings);
  start(o);
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Model::swap_expert(int32_t layer, int32_t expert, const uint8_t* bytes, size_t size, const std::string& what,
                        const uint64_t* checksum, std::string* warnings) {
  if (layer < 0 || layer >= manifest_.n_layers) {
    fail(Status::kInvalidArgument, "colibri_swap_expert: layer " + std::to_string(layer) + " is out of range [0, " +
                                           std::to_string(manifest_.n_layers) + ")");
  }
  if (expert < 0 || expert >= manifest_.n_experts) {
    fail(Status::kInvalidArgument, "colibri_swap_expert: expert " + std::to_string(expert) +
                                           " is out of range [0, " + std::to_string(manifest_.n_experts) + ")");
  }
  const uint64_t want = manifest_.expert_file_bytes();
  if (size != want) {
    fail(Status::kFormat, what + ": " + std::to_string(size) + " bytes, expected " + std::to_string(want) +
                                 " (gate, up [d_ff " + std::to_string(manifest_.d_ff) + "][d_model " +
                                 std::to_string(manifest_.d_model) + "] and down, " + expert_types(manifest_) + ")");
  }
  if (checksum != nullptr) {
    const uint64_t actual = xxh64(bytes, size);
    if (actual != *checksum) {
      fail(Status::kChecksum, what + ": checksum mismatch: expected " + format_checksum(*checksum) + ", got " +
                                     format_checksum(actual));
    }
  }
  // Packed outside the call lock: inference goes on meanwhile.
  WeightRegion fresh = store_->pack_replacement(bytes, warnings);
  WeightRegion retired;
  engine_->exclusive([&] { retired = store_->replace(layer, expert, std::move(fresh)); });
  expert_swaps_.fetch_add(1, std::memory_order_relaxed);
  // `retired` is unmapped here, after the lock: no call can be reading it.
}

void Model::start(const colibri_open_options_t& o) {
  // Workers spin between calls, so more threads than cores only steals time
  // from each other.
  const int cores = online_cores();
  int threads = o.n_threads == 0 ? cores : o.n_threads;
  if (threads > cores) threads = cores;
  pool_ = std::make_unique<ThreadPool>(threads, o.pin_threads != 0);
  if (o.bf16_compute != 0 && o.exact_prefill != 0) {
    fail(Status::kInvalidArgument,
         "options.bf16_compute and options.exact_prefill are both set; they ask for opposite precisions");
  }
  // Decode is fp32-grade for every weight type; prefill precision follows the
  // options (docs/PRECISION.md). model_kernels() says which tables run.
  const kernels::Isa isa = kernels::default_isa();
  const kernels::PrefillPrecision precision = o.exact_prefill != 0  ? kernels::PrefillPrecision::kExact
                                              : o.bf16_compute != 0 ? kernels::PrefillPrecision::kBf16
                                                                    : kernels::PrefillPrecision::kDefault;
  const kernels::KernelPlan plan = kernels::plan_kernels(isa, store_->shape(), precision);
  engine_ = std::make_unique<Engine>(*store_, manifest_.n_layers, manifest_.n_experts, *pool_, plan);
  const kernels::PrefillTiers& prefill = plan.prefill;
  if (manifest_.has_router()) engine_->set_router(manifest_.router);
  kernels_description_ = std::string("decode ") + engine_->kernels().name;
  for (int i = 0; i < prefill.count; ++i) {
    kernels_description_ += std::string(i == 0 ? ", prefill " : ", ") + prefill.tier[i].table->name + " from " +
                            std::to_string(prefill.tier[i].min_tokens) + " tokens/expert";
  }
  if (o.reserve_tokens < 0) {
    fail(Status::kInvalidArgument, "options.reserve_tokens must be >= 0, got " +
                                           std::to_string(o.reserve_tokens));
  }
  engine_->reserve(o.reserve_tokens, std::min(manifest_.n_experts, 8));
}

}  // namespace colibri
