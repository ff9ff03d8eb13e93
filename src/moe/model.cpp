#include "moe/model.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "io/checksum.h"
#include "moe/gguf_model.h"
#include "util/c_enum.h"
#include "util/error.h"

namespace colibri {

namespace {

int online_cores() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

void check_threads(const OpenOptions& o) {
  if (o.threads < 0) {
    fail(Status::kInvalidArgument,
         "options.n_threads must be >= 0 (0 = one per core), got " + std::to_string(o.threads));
  }
}

StoreOptions store_options(const OpenOptions& o, bool verify) {
  StoreOptions so;
  so.verify_checksums = verify;
  so.huge_pages = o.huge_pages;
  so.lock_memory = o.lock_memory;
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

}  // namespace

Model::Model(const std::string& dir, const OpenOptions& o, std::string* warnings) {
  const auto t0 = std::chrono::steady_clock::now();
  check_threads(o);
  if (is_gguf_file(dir)) {
    // The weights are copied into the store, then the file is unmapped.
    const GgufModel g = load_gguf_model(dir);
    manifest_ = g.manifest;
    store_ = std::make_unique<ExpertStore>(g.layers, manifest_, store_options(o, false), warnings,
                                           [&g](int32_t layer) { g.release_layer(layer); });
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
    start(o);
    load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return;
  }
  manifest_ = load_manifest(dir);
  if (o.verify_checksums) verify_manifest_checksum(dir);
  store_ = std::make_unique<ExpertStore>(dir, manifest_, store_options(o, o.verify_checksums), warnings);
  start(o);
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Model::Model(const Manifest& manifest, const std::vector<LayerBuffers>& layers, const OpenOptions& o,
             std::string* warnings) {
  const auto t0 = std::chrono::steady_clock::now();
  check_threads(o);
  manifest_ = manifest;
  store_ = std::make_unique<ExpertStore>(layers, manifest_, store_options(o, false), warnings);
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
  engine_->exclusive([&] { retired = store_->replace(layer, expert, std::move(fresh)); });
  expert_swaps_.fetch_add(1, std::memory_order_relaxed);
  // `retired` is unmapped here, after the lock: no call can be reading it.
}

void Model::start(const OpenOptions& o) {
  // Workers spin between calls, so more threads than cores only steals time
  // from each other.
  const int cores = online_cores();
  int threads = o.threads == 0 ? cores : o.threads;
  if (threads > cores) threads = cores;
  pool_ = std::make_unique<ThreadPool>(threads, o.pin_threads);
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
  // "decode ..., prefill ... from N tokens/expert"; layers of other types
  // (Manifest::layer_dtypes) run other tables: each set is listed with its layers.
  const auto describe = [](const kernels::KernelPlan& p) {
    std::string d = std::string("decode ") + p.decode->name;
    for (int i = 0; i < p.prefill.count; ++i) {
      d += std::string(i == 0 ? ", prefill " : ", ") + p.prefill.tier[i].table->name + " from " +
           std::to_string(p.prefill.tier[i].min_tokens) + " tokens/expert";
    }
    return d;
  };
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
  if (o.reserve_tokens < 0) {
    fail(Status::kInvalidArgument, "options.reserve_tokens must be >= 0, got " +
                                           std::to_string(o.reserve_tokens));
  }
  engine_->reserve(o.reserve_tokens, std::min(manifest_.n_experts, 8));
}

}  // namespace colibri
