// The experts' weights in the kernels' layout (see kernels/kernels.h): the
// seed's "expert loader". Opening reads each expert file once (mmap), checks
// its size and checksum, and repacks it into one huge-page-backed, locked
// region; the files are unmapped afterwards.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/manifest.h"
#include "kernels/kernels.h"
#include "moe/weight_buffers.h"
#include "runtime/memory.h"
#include "util/progress.h"

namespace colibri {

size_t packed_gate_up_bytes(const kernels::ExpertShape& shape);
// Where a packed expert's biases start (after gate/up and down), f32:
// gate/up [2F] in the rows' order, then down [D]; present when
// shape.epilogue.biased.
size_t packed_bias_offset(const kernels::ExpertShape& shape);
size_t packed_expert_bytes(const kernels::ExpertShape& shape);
// The activation and bias flag of the manifest's experts.
kernels::Epilogue model_epilogue(const Manifest& m);
// Layer `layer`'s routed expert shape (its types, the model's epilogue),
// and the bytes one packed expert of it takes in the store or a cache
// slot (whole cache lines).
kernels::ExpertShape layer_expert_shape(const Manifest& m, int32_t layer);
size_t packed_expert_slot_bytes(const kernels::ExpertShape& shape);

struct StoreOptions {
  bool verify_checksums = true;
  bool huge_pages = true;
  bool lock_memory = true;
  // Leave the routed experts out of the region (an ExpertCache holds them,
  // moe/expert_cache.h); routers and shared experts are packed as always.
  bool defer_experts = false;
  // Told of each packed expert (as 0-0.9 of the open), when set.
  Progress* progress = nullptr;
  // Expert parallelism: [n_layers * n_experts] (layer-major), nonzero for
  // the experts this process computes; empty = all. Only those are packed.
  std::vector<uint8_t> local_experts;
  // Leave the shared expert (and its gate) out: another process has it.
  bool skip_shared = false;
};

struct StoreStats {
  uint64_t bytes_files = 0;
  uint64_t bytes_locked = 0;
  uint64_t bytes_huge_pages = 0;
  double verify_seconds = 0.0;
};

class ExpertStore {
 public:
  // Reads the model directory. Throws colibri::Error naming the file at
  // fault. Non-fatal problems (mlock refused) are appended to *warnings.
  ExpertStore(const std::string& model_dir, const Manifest& manifest, const StoreOptions& options,
              std::string* warnings);
  // Copies weights already in memory (caller buffers, a mapped file's
  // tensors), one LayerBuffers per layer; `manifest` describes them
  // (checksums unused). Pointers were checked by the caller.
  // `layer_packed`, when given, runs after each layer is copied, and
  // `source_copied` after each expert with each of its gate, up and down
  // source ranges (a mapped file's reader releases those pages, so an
  // open peaks at the packed experts plus one expert, not plus a layer:
  // one Mixtral-8x7B layer's experts are 0.9 GB in Q4_K_M). `fetch`
  // supplies the experts of layers whose `experts` is empty.
  ExpertStore(const std::vector<LayerBuffers>& layers, const Manifest& manifest, const StoreOptions& options,
              std::string* warnings, const std::function<void(int32_t layer)>& layer_packed = {},
              const std::function<void(const void* data, size_t bytes)>& source_copied = {},
              const ExpertFetch& fetch = {});

  // Layer `layer`'s expert shape (its types: layers may differ, see
  // Manifest::layer_dtypes); shape() is layer 0's.
  const kernels::ExpertShape& shape(int32_t layer) const { return layers_[static_cast<size_t>(layer)].shape; }
  const kernels::ExpertShape& shape() const { return shape(0); }
  int32_t n_layers() const { return n_layers_; }
  const uint8_t* gate_up(int32_t layer, int32_t expert) const { return base(layer, expert); }
  const uint8_t* down(int32_t layer, int32_t expert) const {
    return base(layer, expert) + layers_[static_cast<size_t>(layer)].gate_up_bytes;
  }
  // Layer `layer`'s shape with expert `expert`'s biases set in its
  // epilogue (shape(layer) itself when the model has none).
  kernels::ExpertShape expert_shape(int32_t layer, int32_t expert) const {
    return expert_shape_at(layer, base(layer, expert));
  }
  // The same for a packed expert at `packed` (the store's or a cache slot).
  kernels::ExpertShape expert_shape_at(int32_t layer, const uint8_t* packed) const {
    const Layer& L = layers_[static_cast<size_t>(layer)];
    kernels::ExpertShape s = L.shape;
    if (s.epilogue.biased) {
      const auto* bias = reinterpret_cast<const float*>(packed + L.bias_offset);
      s.epilogue.gate_up_bias = bias;
      s.epilogue.down_bias = bias + 2 * static_cast<size_t>(s.d_ff);
    }
    return s;
  }

  // Router of a layer, packed as the "down" block of router_shape() (E rows
  // of D f32), so the down kernels compute its logits; nullptr without one.
  const kernels::ExpertShape& router_shape() const { return router_shape_; }
  const uint8_t* router(int32_t layer) const { return has_router_ ? extras(layer) : nullptr; }
  const float* router_bias(int32_t layer) const {  // [E], DeepSeek-V3 only
    return router_bias_.empty() ? nullptr : router_bias_.data() + static_cast<size_t>(layer) * n_experts_;
  }
  // Shared expert of a layer (shape shared_shape(layer), the layer's types)
  // and its gate [D] f32, or nullptr.
  const kernels::ExpertShape& shared_shape(int32_t layer) const {
    return layers_[static_cast<size_t>(layer)].shared_shape;
  }
  const kernels::ExpertShape& shared_shape() const { return shared_shape(0); }
  const uint8_t* shared_gate_up(int32_t layer) const {
    return layers_[static_cast<size_t>(layer)].shared_bytes != 0 ? extras(layer) + router_bytes_ : nullptr;
  }
  const uint8_t* shared_down(int32_t layer) const {
    return layers_[static_cast<size_t>(layer)].shared_bytes != 0
               ? extras(layer) + router_bytes_ + packed_gate_up_bytes(shared_shape(layer))
               : nullptr;
  }
  const float* shared_gate(int32_t layer) const {
    return shared_gate_.empty() ? nullptr : shared_gate_.data() + static_cast<size_t>(layer) * d_model_;
  }

  // Bytes of layer `layer`'s packed experts: gate/up, and all of one
  // (whole cache lines, the size of an ExpertCache slot).
  size_t gate_up_bytes(int32_t layer) const { return layers_[static_cast<size_t>(layer)].gate_up_bytes; }
  size_t expert_bytes(int32_t layer) const { return layers_[static_cast<size_t>(layer)].expert_bytes; }
  // With defer_experts, only swapped-in experts are here (nullptr for the
  // rest: the cache has them); otherwise every expert.
  bool experts_deferred() const { return options_.defer_experts; }
  // Whether this process computes expert `expert` of `layer`
  // (StoreOptions::local_experts); routing to the others adds nothing.
  bool local(int32_t layer, int32_t expert) const {
    return options_.local_experts.empty() || options_.local_experts[slot(layer, expert)] != 0;
  }
  const uint8_t* packed_expert(int32_t layer, int32_t expert) const { return base(layer, expert); }

  const WeightRegion& region() const { return region_; }
  const StoreStats& stats() const { return stats_; }

  // Hot swap, in two steps. pack_replacement packs expert-file bytes
  // (already checked by the caller) into a region of their own, locked and
  // huge-page backed as the store's; it touches no shared state. replace
  // then points (layer, expert) at it and returns the region that held the
  // previous copy if it was a replacement itself (empty otherwise: the
  // original copy stays in the main region). replace must not run while a
  // call reads the store (the engine runs it under its call lock).
  WeightRegion pack_replacement(int32_t layer, const uint8_t* file_bytes, std::string* warnings) const;
  WeightRegion replace(int32_t layer, int32_t expert, WeightRegion&& fresh);

 private:
  void layout(const Manifest& m, const StoreOptions& options);
  void finish(const StoreOptions& options, std::string* warnings);
  // Reports expert `expert` of `layer` packed to options.progress.
  static void expert_packed(const Manifest& m, const StoreOptions& options, int32_t layer, int32_t expert);
  size_t slot(int32_t layer, int32_t expert) const {
    return static_cast<size_t>(layer) * static_cast<size_t>(n_experts_) + static_cast<size_t>(expert);
  }
  // Where each expert lives: its place in the main region, or a
  // replacement region after a swap.
  const uint8_t* base(int32_t layer, int32_t expert) const { return slots_[slot(layer, expert)]; }
  // Per-layer router and shared expert, after the layer's experts.
  const uint8_t* extras(int32_t layer) const {
    const Layer& L = layers_[static_cast<size_t>(layer)];
    return region_.data() + L.offset + L.packed_experts * L.expert_bytes;
  }
  uint8_t* mutable_at(const uint8_t* p) { return const_cast<uint8_t*>(p); }

  // One layer's part of the region: its experts, then its router and shared expert.
  struct Layer {
    kernels::ExpertShape shape;
    kernels::ExpertShape shared_shape;
    size_t offset = 0;         // in region_
    size_t gate_up_bytes = 0;  // of one packed expert
    size_t bias_offset = 0;    // of one packed expert's biases
    size_t expert_bytes = 0;   // of one packed expert, whole cache lines
    size_t packed_experts = 0;  // experts in the region (local, not deferred)
    size_t shared_bytes = 0;
  };
  std::vector<Layer> layers_;
  kernels::ExpertShape router_shape_;
  int32_t n_layers_ = 0;
  int32_t n_experts_ = 0;
  int32_t d_model_ = 0;
  bool has_router_ = false;
  size_t router_bytes_ = 0;
  std::vector<float> router_bias_;  // [L][E]
  std::vector<float> shared_gate_;  // [L][D]
  WeightRegion region_;
  std::vector<const uint8_t*> slots_;                     // [L*E]
  std::unordered_map<size_t, WeightRegion> replacements_;  // slot -> its swapped-in copy
  StoreOptions options_;
  StoreStats stats_;
};

// Packs one expert file's bytes (gate [F][D], up [F][D], down [D][F], then
// with shape.epilogue.biased f32 biases gate [F], up [F], down [D]) into
// the kernel layout at dst (packed_expert_bytes(shape) bytes, padding zeroed).
void pack_expert(const uint8_t* file_bytes, const kernels::ExpertShape& shape, uint8_t* dst);
// Same from separate matrices and bias vectors (f32, any alignment; a null
// bias is zeros; biases are read only when shape.epilogue.biased).
struct ExpertParts {
  const uint8_t* gate = nullptr;
  const uint8_t* up = nullptr;
  const uint8_t* down = nullptr;
  const uint8_t* gate_bias = nullptr;
  const uint8_t* up_bias = nullptr;
  const uint8_t* down_bias = nullptr;
};
void pack_expert_parts(const ExpertParts& parts, const kernels::ExpertShape& shape, uint8_t* dst);

}  // namespace colibri
