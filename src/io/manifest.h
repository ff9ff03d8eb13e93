// The model directory's manifest, colibri.json (docs/FORMAT.md).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "colibri.h"

namespace colibri {

inline constexpr const char* kManifestName = "colibri.json";
inline constexpr const char* kManifestFormat = "colibri-moe";
inline constexpr int kManifestVersion = 1;

// Limits that keep every size computation in range; far above real models.
inline constexpr int64_t kMaxLayers = 4096;
inline constexpr int64_t kMaxExperts = 65536;
inline constexpr int64_t kMaxDim = int64_t{1} << 20;
inline constexpr uint64_t kMaxModelBytes = uint64_t{1} << 46;  // 64 TiB

struct Manifest {
  int32_t version = kManifestVersion;
  int32_t n_layers = 0;
  int32_t n_experts = 0;
  int32_t d_model = 0;
  int32_t d_ff = 0;
  colibri_dtype_t dtype = COLIBRI_DTYPE_F16;
  std::string activation = "swiglu";
  std::map<std::string, uint64_t> checksums;  // relative path -> xxh64

  size_t dtype_size() const { return dtype == COLIBRI_DTYPE_F32 ? 4 : 2; }
  uint64_t expert_file_bytes() const;
  // "expert_03.bin" for one layer, "layer_01/expert_03.bin" for several.
  std::string expert_file(int32_t layer, int32_t expert) const;
};

// Parses and validates manifest JSON text; `source` names it in errors.
// Throws Error(COLIBRI_ERR_FORMAT) naming the field at fault.
Manifest parse_manifest(const std::string& text, const std::string& source);
Manifest load_manifest(const std::string& model_dir);
std::string manifest_to_json(const Manifest& manifest);

bool parse_dtype(const std::string& name, colibri_dtype_t* out);

}  // namespace colibri
