#include "moe/model.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "io/checksum.h"
#include "moe/gguf_model.h"
#include "moe/kernel_choice.h"
#include "util/c_enum.h"
#include "util/error.h"

namespace colibri {

namespace {

void check_threads(const OpenOptions& o) {
  if (o.threads < 0) {
    fail(Status::kInvalidArgument,
         "options.n_threads must be >= 0 (0 = one per core), got " + std::to_string(o.threads));
  }
}

// OpenOptions::local_experts as one flag per (layer, expert); empty = all.
std::vector<uint8_t> local_expert_mask(const OpenOptions& o, const Manifest& m) {
  if (o.local_experts.empty()) return {};
  const size_t E = static_cast<size_t>(m.n_experts), L = static_cast<size_t>(m.n_layers);
  if (o.local_experts.size() != E && o.local_experts.size() != L * E) {
    fail(Status::kInvalidArgument, "options.local_experts_len is " + std::to_string(o.local_experts.size()) +
                                       "; expected n_experts (" + std::to_string(E) + ", every layer alike) or " +
                                       "n_layers * n_experts (" + std::to_string(L * E) + ", layer-major)");
  }
  std::vector<uint8_t> mask(L * E);
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = o.local_experts[o.local_experts.size() == E ? i % E : i] != 0;
  return mask;
}

StoreOptions store_options(const OpenOptions& o, bool verify, const Manifest& m) {
  StoreOptions so;
  so.verify_checksums = verify;
  so.huge_pages = o.huge_pages;
  so.lock_memory = o.lock_memory;
  so.local_experts = local_expert_mask(o, m);
  so.skip_shared = o.skip_shared;
  return so;
}

void append_warning(std::string* warnings, const std::string& w) {
  if (warnings == nullptr) return;
  if (!warnings->empty()) *warnings += "; ";
  *warnings += w;
}

std::string block_list(const std::vector<int32_t>& blocks) {
  std::string s;
  for (size_t i = 0; i < blocks.size(); ++i) s += (i ? ", " : "") + std::to_string(blocks[i]);
  return s;
}

// Every routed expert of a model directory: one file each, its manifest
// checksum when verifying.
CacheSource directory_source(const std::string& dir, const Manifest& m, bool verify) {
  CacheSource src;
  src.n_experts = m.n_experts;
  for (int32_t l = 0; l < m.n_layers; ++l) {
    src.shapes.push_back(layer_expert_shape(m, l));
    for (int32_t e = 0; e < m.n_experts; ++e) {
      const std::string name = m.expert_file(l, e);
      ExpertLocation loc;
      loc.n_parts = 1;
      loc.part[0] = {static_cast<int32_t>(src.files.paths.size()), 0, m.expert_file_bytes(l)};
      if (auto it = m.checksums.find(name); verify && it != m.checksums.end()) {
        loc.has_checksum = true;
        loc.checksum = it->second;
      }
      src.files.paths.push_back(dir + "/" + name);
      src.files.sizes.push_back(m.expert_file_bytes(l));
      src.locations.push_back(loc);
    }
  }
  return src;
}

// A GGUF's routed experts: slices of its expert tensors (gate, up, down and
// gpt-oss's biases), found from the buffers load_gguf_model mapped.
CacheSource gguf_source(const GgufModel& g) {
  const Manifest& m = g.manifest;
  CacheSource src;
  src.n_experts = m.n_experts;
  for (const GgufFile& f : g.files) {
    src.files.paths.push_back(f.source());
    src.files.sizes.push_back(f.size());
  }
  const size_t D = static_cast<size_t>(m.d_model), F = static_cast<size_t>(m.d_ff);
  for (int32_t l = 0; l < m.n_layers; ++l) {
    const kernels::ExpertShape shape = layer_expert_shape(m, l);
    src.shapes.push_back(shape);
    for (int32_t e = 0; e < m.n_experts; ++e) {
      const ExpertBuffers& b = g.layers[static_cast<size_t>(l)].experts[static_cast<size_t>(e)];
      const void* ptrs[6] = {b.gate, b.up, b.down, b.gate_bias, b.up_bias, b.down_bias};
      const uint64_t bytes[6] = {F * weight_row_bytes(shape.weight_type, D), F * weight_row_bytes(shape.weight_type, D),
                                 D * weight_row_bytes(shape.down_type, F), F * 4, F * 4, D * 4};
      ExpertLocation loc;
      loc.n_parts = m.expert_bias ? 6 : 3;
      for (int i = 0; i < loc.n_parts; ++i) {
        bool found = false;
        for (size_t fi = 0; fi < g.files.size() && !found; ++fi) {
          uint64_t offset = 0;
          if (ptrs[i] != nullptr && g.files[fi].file_offset(ptrs[i], bytes[i], &offset)) {
            loc.part[i] = {static_cast<int32_t>(fi), offset, bytes[i]};
            found = true;
          }
        }
        if (!found) {
          // A tensor Colibri converted at open (not as stored): nothing to read back.
          fail(Status::kUnsupported, g.path + ": layer " + std::to_string(l) + " expert " + std::to_string(e) +
                                         ": its weights are not stored in the file as they are used, so they "
                                         "cannot be read on demand under max_resident");
        }
      }
      src.locations.push_back(loc);
    }
  }
  return src;
}

}  // namespace

int32_t Model::budget_slots(const OpenOptions& o, const std::string& what) {
  if (!(o.max_resident_percent >= 0.0 && o.max_resident_percent <= 100.0)) {
    fail(Status::kInvalidArgument, "options.max_resident_percent must be in [0, 100], got " +
                                       std::to_string(o.max_resident_percent));
  }
  if (o.io_threads < 0 || o.io_threads > 64) {
    fail(Status::kInvalidArgument,
         "options.io_threads must be in [0, 64] (0 = the default), got " + std::to_string(o.io_threads));
  }
  experts_bytes_ = 0;
  slot_bytes_ = 0;
  // Under expert parallelism the budget is of this process's share.
  const std::vector<uint8_t> local = local_expert_mask(o, manifest_);
  for (int32_t l = 0; l < manifest_.n_layers; ++l) {
    const size_t b = packed_expert_slot_bytes(layer_expert_shape(manifest_, l));
    uint64_t n = static_cast<uint64_t>(manifest_.n_experts);
    if (!local.empty()) {
      const auto first = local.begin() + static_cast<std::ptrdiff_t>(l) * manifest_.n_experts;
      n = static_cast<uint64_t>(std::count(first, first + manifest_.n_experts, uint8_t{1}));
    }
    experts_bytes_ += static_cast<uint64_t>(b) * n;
    slot_bytes_ = std::max(slot_bytes_, b);
  }
  const uint64_t from_percent =
      static_cast<uint64_t>(static_cast<double>(experts_bytes_) * o.max_resident_percent / 100.0);
  const uint64_t budget = std::max(o.max_resident_bytes, from_percent);
  if (budget == 0 || budget >= experts_bytes_) return 0;
  const uint64_t slots = budget / slot_bytes_;
  if (slots == 0) {
    fail(Status::kInvalidArgument, what + ": max_resident of " + std::to_string(budget) +
                                       " bytes holds no expert: one packed expert is " + std::to_string(slot_bytes_) +
                                       " bytes (the model's experts are " + std::to_string(experts_bytes_) + ")");
  }
  return static_cast<int32_t>(std::min<uint64_t>(slots, static_cast<uint64_t>(manifest_.n_layers) * manifest_.n_experts));
}

void Model::start_cache(const OpenOptions& o, CacheSource source, int32_t slots, std::string* warnings) {
  CacheOptions co;
  co.slots = slots;
  co.slot_bytes = slot_bytes_;
  co.policy = o.eviction;
  // The disk measured read faster with about 100 MB of whole experts in
  // flight (8 readers of 12.6 MB experts beat 4 by 1.08-1.5x, docs/CACHE.md);
  // each reader also stages one expert outside the budget, so large experts
  // get fewer readers.
  constexpr uint64_t kInFlightBytes = 128ull << 20;
  co.readers = o.io_threads != 0
                   ? o.io_threads
                   : static_cast<int32_t>(std::clamp<uint64_t>(kInFlightBytes / std::max<size_t>(slot_bytes_, 1), 2, 8));
  co.direct_io = o.direct_io;
  co.io_engine = o.io_engine;
  std::string why;
  if (o.io_engine == IoEngine::kIoUring && !io_uring_usable(&why)) {
    fail(Status::kUnsupported, "options.io_engine is io_uring, which is not usable here: " + why);
  }
  co.verify_checksums = o.verify_checksums;
  co.huge_pages = o.huge_pages;
  co.lock_memory = o.lock_memory;
  cache_ = std::make_unique<ExpertCache>(std::move(source), co, warnings);
}

Model::Model(const std::string& dir, const OpenOptions& o, std::string* warnings) {
  const auto t0 = std::chrono::steady_clock::now();
  check_threads(o);
  if (is_gguf_file(dir)) {
    // The weights are copied into the store, then the file is unmapped.
    Progress progress(o.progress);
    progress.report(0.0f);
    const GgufModel g = load_gguf_model(dir);
    manifest_ = g.manifest;
    const int32_t slots = budget_slots(o, dir);
    StoreOptions so = store_options(o, false, manifest_);
    so.defer_experts = slots > 0;
    so.progress = &progress;
    store_ = std::make_unique<ExpertStore>(g.layers, manifest_, so, warnings,
                                           [&g](int32_t layer) { g.release_layer(layer); },
                                           [&g](const void* p, size_t n) { g.release_bytes(p, n); });
    if (slots > 0) start_cache(o, gguf_source(g), slots, warnings);
    first_block_ = g.first_block;
    const int32_t last = g.first_block + manifest_.n_layers - 1;
    source_description_ = "gguf " + g.architecture + ", layers 0-" + std::to_string(manifest_.n_layers - 1) +
                          " = blocks " + std::to_string(g.first_block) + "-" + std::to_string(last) + " of " +
                          std::to_string(g.block_count) + ", " + g.expert_types;
    if (!g.dense_blocks.empty()) {
      source_description_ += ", dense blocks skipped: " + block_list(g.dense_blocks);
      append_warning(warnings, dir + ": dense blocks " + block_list(g.dense_blocks) +
                                   " have no experts and are skipped; layer l is block " +
                                   std::to_string(g.first_block) + " + l");
    }
    if (g.mtp_blocks > 0) {
      source_description_ += ", multi-token-prediction blocks skipped: " +
                             std::to_string(g.block_count - g.mtp_blocks) + "-" + std::to_string(g.block_count - 1);
    }
    start(o, warnings);
    progress.report(1.0f);
    load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return;
  }
  Progress progress(o.progress);
  progress.report(0.0f);
  manifest_ = load_manifest(dir);
  if (o.verify_checksums) verify_manifest_checksum(dir);
  const int32_t slots = budget_slots(o, dir);
  StoreOptions so = store_options(o, o.verify_checksums, manifest_);
  so.defer_experts = slots > 0;
  so.progress = &progress;
  store_ = std::make_unique<ExpertStore>(dir, manifest_, so, warnings);
  if (slots > 0) start_cache(o, directory_source(dir, manifest_, o.verify_checksums), slots, warnings);
  start(o, warnings);
  progress.report(1.0f);
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Model::Model(const Manifest& manifest, const std::vector<LayerBuffers>& layers, const OpenOptions& o,
             std::string* warnings, const ExpertFetch& fetch) {
  const auto t0 = std::chrono::steady_clock::now();
  check_threads(o);
  manifest_ = manifest;
  if (o.max_resident_bytes != 0 || o.max_resident_percent != 0.0) {
    fail(Status::kInvalidArgument, "options.max_resident_bytes / max_resident_percent apply to models opened from "
                                   "files (a model directory or a GGUF file), whose experts can be read again; "
                                   "colibri_open_memory's weights are the caller's memory");
  }
  Progress progress(o.progress);
  progress.report(0.0f);
  StoreOptions so = store_options(o, false, manifest_);
  so.progress = &progress;
  store_ = std::make_unique<ExpertStore>(layers, manifest_, so, warnings, std::function<void(int32_t)>{},
                                         std::function<void(const void*, size_t)>{}, fetch);
  start(o, warnings);
  progress.report(1.0f);
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
  if (!store_->local(layer, expert)) {
    fail(Status::kInvalidArgument, "colibri_swap_expert: expert " + std::to_string(expert) + " of layer " +
                                       std::to_string(layer) + " is not computed by this process (options.local_experts)");
  }
  const uint64_t want = manifest_.expert_file_bytes(layer);
  if (size != want) {
    fail(Status::kFormat, what + ": " + std::to_string(size) + " bytes, expected " + std::to_string(want) +
                                 " (gate, up [d_ff " + std::to_string(manifest_.d_ff) + "][d_model " +
                                 std::to_string(manifest_.d_model) + "] and down, " + expert_types(manifest_, layer) + ")");
  }
  if (checksum != nullptr) {
    const uint64_t actual = xxh64(bytes, size);
    if (actual != *checksum) {
      fail(Status::kChecksum, what + ": checksum mismatch: expected " + format_checksum(*checksum) + ", got " +
                                     format_checksum(actual));
    }
  }
  // Packed outside the call lock: inference goes on meanwhile.
  WeightRegion fresh = store_->pack_replacement(layer, bytes, warnings);
  WeightRegion retired;
  engine_->exclusive([&] {
    retired = store_->replace(layer, expert, std::move(fresh));
    // The store's copy wins from now on; the cached one of the old weights
    // is dropped so its slot serves others.
    if (cache_ != nullptr) cache_->forget(layer, expert);
  });
  expert_swaps_.fetch_add(1, std::memory_order_relaxed);
  // `retired` is unmapped here, after the lock: no call can be reading it.
}

void Model::start(const OpenOptions& o, std::string* warnings) {
  // Workers spin between calls, so more threads than cores only steals time
  // from each other.
  const int cores = online_cores();
  int threads = o.threads == 0 ? cores : o.threads;
  if (threads > cores) threads = cores;
  pool_ = shared_thread_pool(threads, o.pin_threads);
  if (o.bf16_compute && o.exact_prefill) {
    fail(Status::kInvalidArgument,
         "options.bf16_compute and options.exact_prefill are both set; they ask for opposite precisions");
  }
  // Decode is fp32-grade for every weight type; prefill precision follows the
  // options (docs/PRECISION.md). model_kernels() says which tables run.
  const kernels::Isa isa = kernels::default_isa();
  const kernels::PrefillPrecision precision = o.exact_prefill ? kernels::PrefillPrecision::kExact
                                              : o.bf16_compute ? kernels::PrefillPrecision::kBf16
                                                                    : kernels::PrefillPrecision::kDefault;
  std::vector<kernels::KernelPlan> plans;
  plans.reserve(static_cast<size_t>(manifest_.n_layers));
  for (int32_t l = 0; l < manifest_.n_layers; ++l) plans.push_back(kernels::plan_kernels(isa, store_->shape(l), precision));
  engine_ = std::make_unique<Engine>(*store_, manifest_.n_layers, manifest_.n_experts, *pool_, plans);
  if (manifest_.has_router()) engine_->set_router(manifest_.router);
  if (cache_ != nullptr) engine_->set_cache(cache_.get(), o.speculate && manifest_.has_router());
  // Under a budget the experts are not all in memory to be timed.
  std::string measured;
  // Nor are another process's experts (expert parallelism).
  if (o.tune_kernels && cache_ == nullptr && o.local_experts.empty() && kernel_choice_allowed_by_environment()) {
    KernelChoiceRequest request;
    request.isa = isa;
    request.precision = precision;
    request.threads = pool_->size();
    request.n_experts = manifest_.n_experts;
    request.top_k = manifest_.has_router() ? manifest_.router.top_k : std::min(manifest_.n_experts, 8);
    request.cache_path = kernel_choice_cache_path();
    measured = choose_kernels_by_measurement(*engine_, *store_, manifest_.n_layers, request, warnings);
    for (int32_t l = 0; l < manifest_.n_layers; ++l) plans[static_cast<size_t>(l)] = engine_->plan(l);
  }
  // "decode ..., prefill ... from N tokens/expert"; layers of other types
  // (Manifest::layer_dtypes) run other tables: each set is listed with its layers.
  const auto describe = [](const kernels::KernelPlan& p) { return kernels::describe_plan(p, "tokens/expert"); };
  std::vector<std::pair<std::string, std::string>> sets;  // description, its layers
  for (int32_t l = 0; l < manifest_.n_layers; ++l) {
    const std::string d = describe(plans[static_cast<size_t>(l)]);
    auto it = std::find_if(sets.begin(), sets.end(), [&](const auto& e) { return e.first == d; });
    if (it == sets.end()) {
      sets.emplace_back(d, std::to_string(l));
    } else {
      it->second.append(",").append(std::to_string(l));
    }
  }
  if (sets.size() == 1) {
    kernels_description_ = sets[0].first;
  } else {
    for (const auto& [d, layers] : sets) {
      if (!kernels_description_.empty()) kernels_description_.append("; ");
      kernels_description_.append("layers ").append(layers).append(": ").append(d);
    }
  }
  if (!measured.empty()) kernels_description_ += " (chosen by measurement: " + measured + ")";
  if (o.reserve_tokens < 0) {
    fail(Status::kInvalidArgument, "options.reserve_tokens must be >= 0, got " +
                                           std::to_string(o.reserve_tokens));
  }
  engine_->reserve(o.reserve_tokens, std::min(manifest_.n_experts, 8));
}

}  // namespace colibri
