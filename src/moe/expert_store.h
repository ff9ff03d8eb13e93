// The experts' weights in the kernels' layout (see kernels/kernels.h): the
// seed's "expert loader". Opening reads each expert file once (mmap), checks
// its size and checksum, and repacks it into one huge-page-backed, locked
// region; the files are unmapped afterwards.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/manifest.h"
#include "kernels/kernels.h"
#include "moe/weight_buffers.h"
#include "runtime/memory.h"

namespace colibri {

size_t packed_gate_up_bytes(const kernels::ExpertShape& shape);
size_t packed_expert_bytes(const kernels::ExpertShape& shape);

struct StoreOptions {
  bool verify_checksums = true;
  bool huge_pages = true;
  bool lock_memory = true;
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
  ExpertStore(const std::vector<LayerBuffers>& layers, const Manifest& manifest, const StoreOptions& options,
              std::string* warnings);

  const kernels::ExpertShape& shape() const { return shape_; }
  const uint8_t* gate_up(int32_t layer, int32_t expert) const { return base(layer, expert); }
  const uint8_t* down(int32_t layer, int32_t expert) const { return base(layer, expert) + gate_up_bytes_; }

  // Router of a layer, packed as the "down" block of router_shape() (E rows
  // of D f32), so the down kernels compute its logits; nullptr without one.
  const kernels::ExpertShape& router_shape() const { return router_shape_; }
  const uint8_t* router(int32_t layer) const { return has_router_ ? extras(layer) : nullptr; }
  const float* router_bias(int32_t layer) const {  // [E], DeepSeek-V3 only
    return router_bias_.empty() ? nullptr : router_bias_.data() + static_cast<size_t>(layer) * n_experts_;
  }
  // Shared expert (shape shared_shape()) and its gate [D] f32, or nullptr.
  const kernels::ExpertShape& shared_shape() const { return shared_shape_; }
  const uint8_t* shared_gate_up(int32_t layer) const {
    return shared_bytes_ != 0 ? extras(layer) + router_bytes_ : nullptr;
  }
  const uint8_t* shared_down(int32_t layer) const {
    return shared_bytes_ != 0 ? extras(layer) + router_bytes_ + packed_gate_up_bytes(shared_shape_) : nullptr;
  }
  const float* shared_gate(int32_t layer) const {
    return shared_gate_.empty() ? nullptr : shared_gate_.data() + static_cast<size_t>(layer) * shape_.d_model;
  }

  const WeightRegion& region() const { return region_; }
  const StoreStats& stats() const { return stats_; }

  // Hot swap, in two steps. pack_replacement packs expert-file bytes
  // (already checked by the caller) into a region of their own, locked and
  // huge-page backed as the store's; it touches no shared state. replace
  // then points (layer, expert) at it and returns the region that held the
  // previous copy if it was a replacement itself (empty otherwise: the
  // original copy stays in the main region). replace must not run while a
  // call reads the store (the engine runs it under its call lock).
  WeightRegion pack_replacement(const uint8_t* file_bytes, std::string* warnings) const;
  WeightRegion replace(int32_t layer, int32_t expert, WeightRegion&& fresh);

 private:
  void layout(const Manifest& m, const StoreOptions& options);
  void finish(const StoreOptions& options, std::string* warnings);
  size_t slot(int32_t layer, int32_t expert) const {
    return static_cast<size_t>(layer) * static_cast<size_t>(n_experts_) + static_cast<size_t>(expert);
  }
  // Where each expert lives: its place in the main region, or a
  // replacement region after a swap.
  const uint8_t* base(int32_t layer, int32_t expert) const { return slots_[slot(layer, expert)]; }
  // Per-layer router and shared expert, after all experts.
  const uint8_t* extras(int32_t layer) const {
    return region_.data() + static_cast<size_t>(n_layers_) * n_experts_ * expert_bytes_ +
           static_cast<size_t>(layer) * (router_bytes_ + shared_bytes_);
  }
  uint8_t* mutable_at(const uint8_t* p) { return const_cast<uint8_t*>(p); }

  kernels::ExpertShape shape_;
  kernels::ExpertShape router_shape_;
  kernels::ExpertShape shared_shape_;
  int32_t n_layers_ = 0;
  int32_t n_experts_ = 0;
  bool has_router_ = false;
  size_t gate_up_bytes_ = 0;
  size_t expert_bytes_ = 0;
  size_t router_bytes_ = 0;
  size_t shared_bytes_ = 0;
  std::vector<float> router_bias_;  // [L][E]
  std::vector<float> shared_gate_;  // [L][D]
  WeightRegion region_;
  std::vector<const uint8_t*> slots_;                     // [L*E]
  std::unordered_map<size_t, WeightRegion> replacements_;  // slot -> its swapped-in copy
  StoreOptions options_;
  StoreStats stats_;
};

// Packs one expert file's bytes (gate [F][D], up [F][D], down [D][F]) into
// the kernel layout at dst (expert_bytes(shape) bytes, padding zeroed).
void pack_expert(const uint8_t* file_bytes, const kernels::ExpertShape& shape, uint8_t* dst);
// Same from three separate matrices.
void pack_expert_parts(const uint8_t* gate, const uint8_t* up, const uint8_t* down,
                       const kernels::ExpertShape& shape, uint8_t* dst);

}  // namespace colibri
