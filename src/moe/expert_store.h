// The experts' weights in the kernels' layout (see kernels/kernels.h): the
// seed's "expert loader". Opening reads each expert file once (mmap), checks
// its size and checksum, and repacks it into one huge-page-backed, locked
// region; the files are unmapped afterwards.
#pragma once

#include <cstdint>
#include <string>

#include "io/manifest.h"
#include "kernels/kernels.h"
#include "runtime/memory.h"

namespace colibri {

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
  // Throws colibri::Error naming the file at fault. Non-fatal problems (mlock
  // refused) are appended to *warnings.
  ExpertStore(const std::string& model_dir, const Manifest& manifest, const StoreOptions& options,
              std::string* warnings);

  const kernels::ExpertShape& shape() const { return shape_; }
  const uint8_t* gate_up(int32_t layer, int32_t expert) const { return base(layer, expert); }
  const uint8_t* down(int32_t layer, int32_t expert) const { return base(layer, expert) + gate_up_bytes_; }
  const WeightRegion& region() const { return region_; }
  const StoreStats& stats() const { return stats_; }

 private:
  const uint8_t* base(int32_t layer, int32_t expert) const {
    return region_.data() + (static_cast<size_t>(layer) * n_experts_ + static_cast<size_t>(expert)) * expert_bytes_;
  }

  kernels::ExpertShape shape_;
  int32_t n_experts_ = 0;
  size_t gate_up_bytes_ = 0;
  size_t expert_bytes_ = 0;
  WeightRegion region_;
  StoreStats stats_;
};

// Packs one expert file's bytes (gate [F][D], up [F][D], down [D][F]) into
// the kernel layout at dst (expert_bytes(shape) bytes, padding zeroed).
void pack_expert(const uint8_t* file_bytes, const kernels::ExpertShape& shape, uint8_t* dst);
size_t packed_gate_up_bytes(const kernels::ExpertShape& shape);
size_t packed_expert_bytes(const kernels::ExpertShape& shape);

}  // namespace colibri
