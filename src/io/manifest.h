// The model directory's manifest, colibri.json (docs/FORMAT.md).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "colibri.h"
#include "util/weight_format.h"

namespace colibri {

inline constexpr const char* kManifestName = "colibri.json";
// Beside it: "xxh64:<16 hex>\n", the XXH64 of colibri.json's bytes, so a
// flipped byte anywhere in the manifest (even in a field a reader ignores)
// is caught. Optional: hand-written manifests need not have one.
inline constexpr const char* kManifestChecksumName = "colibri.json.xxh64";
inline constexpr const char* kManifestFormat = "colibri-moe";
// Written for models with a router or a shared expert; v1 otherwise, so
// older readers still open plain expert models. Both are read.
inline constexpr int kManifestVersion = 2;

// Limits that keep every size computation in range; far above real models.
inline constexpr int64_t kMaxLayers = 4096;
inline constexpr int64_t kMaxExperts = 65536;
inline constexpr int64_t kMaxDim = int64_t{1} << 20;
inline constexpr uint64_t kMaxModelBytes = uint64_t{1} << 46;  // 64 TiB

WeightType weight_type_of(colibri_dtype_t dtype);

struct Manifest {
  int32_t version = kManifestVersion;
  int32_t n_layers = 0;
  int32_t n_experts = 0;
  int32_t d_model = 0;
  int32_t d_ff = 0;
  colibri_dtype_t dtype = COLIBRI_DTYPE_F16;
  std::string activation = "swiglu";
  // v2: built-in router (family NONE = none) and shared expert (0 = none).
  colibri_router_desc_t router{};
  int32_t shared_d_ff = 0;
  bool shared_gate = false;
  std::string source_json;  // provenance, kept verbatim ("" = none)
  std::map<std::string, uint64_t> checksums;  // relative path -> xxh64

  bool has_router() const { return router.family != COLIBRI_ROUTER_NONE; }
  bool has_shared() const { return shared_d_ff > 0; }
  bool router_has_bias() const { return router.family == COLIBRI_ROUTER_DEEPSEEK_V3; }
  WeightType weight_type() const { return weight_type_of(dtype); }
  // Bytes of a [rows][cols] weight matrix of the model's dtype, as stored in
  // its files (rows unpadded).
  uint64_t matrix_bytes(int32_t rows, int32_t cols) const;
  uint64_t expert_file_bytes() const;
  // f32 [E][D], then f32 [E] bias for DeepSeek-V3.
  uint64_t router_file_bytes() const;
  uint64_t shared_file_bytes() const;       // 3 * D * shared_d_ff * dtype
  uint64_t shared_gate_file_bytes() const;  // f32 [D]
  // "expert_03.bin" for one layer, "layer_01/expert_03.bin" for several;
  // likewise router.bin, shared_expert.bin, shared_gate.bin.
  std::string expert_file(int32_t layer, int32_t expert) const;
  std::string layer_file(int32_t layer, const char* name) const;
  std::string router_file(int32_t layer) const { return layer_file(layer, "router.bin"); }
  std::string shared_file(int32_t layer) const { return layer_file(layer, "shared_expert.bin"); }
  std::string shared_gate_file(int32_t layer) const { return layer_file(layer, "shared_gate.bin"); }

  // Every weight file of the model with its exact size, layer by layer:
  // router, experts, shared expert, shared gate.
  template <class Visit>
  void for_each_weight_file(Visit&& visit) const {
    for (int32_t l = 0; l < n_layers; ++l) {
      if (has_router()) visit(router_file(l), router_file_bytes());
      for (int32_t e = 0; e < n_experts; ++e) visit(expert_file(l, e), expert_file_bytes());
      if (has_shared()) {
        visit(shared_file(l), shared_file_bytes());
        if (shared_gate) visit(shared_gate_file(l), shared_gate_file_bytes());
      }
    }
  }
};

// "mixtral", "qwen2_moe", ... (the Hugging Face model_type); "none".
const char* router_family_name(colibri_router_family_t family);
bool parse_router_family(const std::string& name, colibri_router_family_t* out);
// Throws Error(COLIBRI_ERR_INVALID_ARGUMENT or `status`) with `where`
// prefixed when the router's parameters do not fit n_experts.
void validate_router(const colibri_router_desc_t& router, int32_t n_experts, const std::string& where,
                     colibri_status_t status);

// Parses and validates manifest JSON text; `source` names it in errors.
// Throws Error(COLIBRI_ERR_FORMAT) naming the field at fault.
Manifest parse_manifest(const std::string& text, const std::string& source);
Manifest load_manifest(const std::string& model_dir);
// Checks colibri.json against colibri.json.xxh64 when that file exists.
// Throws Error(COLIBRI_ERR_CHECKSUM) on a mismatch, Error(COLIBRI_ERR_FORMAT)
// for a malformed checksum file. Returns whether a checksum was checked.
bool verify_manifest_checksum(const std::string& model_dir);
// Writes colibri.json, then its checksum file (both atomically).
void write_manifest(const std::string& model_dir, const Manifest& manifest);
std::string manifest_to_json(const Manifest& manifest);

bool parse_dtype(const std::string& name, colibri_dtype_t* out);

}  // namespace colibri
