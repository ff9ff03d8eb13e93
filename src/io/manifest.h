// The model directory's manifest, colibri.json (docs/FORMAT.md).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "util/error.h"
#include "util/router_desc.h"
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
// v3: block-quantised weights (dtype q8_0 ... q6_k, down_dtype), which
// older readers must refuse rather than misread. v4: expert biases and the
// clamped SwiGLU (gpt-oss).
inline constexpr int kManifestVersion = 4;

// Limits that keep every size computation in range; far above real models.
inline constexpr int64_t kMaxLayers = 4096;
inline constexpr int64_t kMaxExperts = 65536;
inline constexpr int64_t kMaxDim = int64_t{1} << 20;
inline constexpr uint64_t kMaxModelBytes = uint64_t{1} << 46;  // 64 TiB

// One layer's types: gate and up, and down.
struct LayerTypes {
  WeightType dtype = WeightType::kF16;
  WeightType down_dtype = WeightType::kF16;
  bool operator==(const LayerTypes& o) const { return dtype == o.dtype && down_dtype == o.down_dtype; }
};

struct Manifest {
  int32_t version = kManifestVersion;
  int32_t n_layers = 0;
  int32_t n_experts = 0;
  int32_t d_model = 0;
  int32_t d_ff = 0;
  WeightType dtype = WeightType::kF16;       // of gate and up (and down, unless down_dtype says otherwise)
  WeightType down_dtype = WeightType::kF16;  // v3; equals dtype for the float types
  // v3, block formats only: each layer's types, for models whose types
  // change from layer to layer (llama.cpp's Q4_K_M gives some layers' down
  // matrices q6_k and the others q4_k). Empty: every layer has dtype /
  // down_dtype; when set, n_layers entries and entry 0 is (dtype, down_dtype).
  std::vector<LayerTypes> layer_dtypes;
  // "swiglu" (silu(gate) * up) or "clamped_swiglu" (v4, gpt-oss:
  // (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit).
  std::string activation = "swiglu";
  float swiglu_alpha = 1.702f;  // clamped_swiglu only
  float swiglu_limit = 7.0f;    // clamped_swiglu only
  // v4: each expert file ends with its biases, f32 gate [d_ff], up [d_ff],
  // down [d_model].
  bool expert_bias = false;
  // v2: built-in router (family NONE = none) and shared expert (0 = none).
  RouterDesc router{};
  int32_t shared_d_ff = 0;
  bool shared_gate = false;
  std::string source_json;  // provenance, kept verbatim ("" = none)
  std::map<std::string, uint64_t> checksums;  // relative path -> xxh64

  bool has_router() const { return router.family != RouterFamily::kNone; }
  bool has_shared() const { return shared_d_ff > 0; }
  // DeepSeek-V3's selection bias, gpt-oss's logit bias.
  bool router_has_bias() const {
    return router.family == RouterFamily::kDeepseekV3 || router.family == RouterFamily::kGptOss;
  }
  bool clamped_swiglu() const { return activation == "clamped_swiglu"; }
  // The lowest version that holds this model (what writers write).
  int32_t minimum_version() const;
  // Bytes of the biases at the end of each expert file (0 without).
  uint64_t expert_bias_bytes() const;
  // Of layer 0 (of every layer unless layer_dtypes says otherwise).
  WeightType weight_type() const { return dtype; }
  WeightType down_weight_type() const { return down_dtype; }
  LayerTypes layer_types(int32_t layer) const {
    return layer_dtypes.empty() ? LayerTypes{dtype, down_dtype} : layer_dtypes[static_cast<size_t>(layer)];
  }
  bool uniform_types() const { return layer_dtypes.empty(); }
  bool quantized() const { return weight_format(weight_type()).quantized; }
  // Bytes of a [rows][cols] weight matrix of type t as stored in the
  // model's files (rows of whole blocks, weight_row_bytes).
  static uint64_t matrix_bytes(WeightType t, int32_t rows, int32_t cols);
  uint64_t expert_file_bytes(int32_t layer) const;
  uint64_t max_expert_file_bytes() const;  // over the layers
  // f32 [E][D], then f32 [E] bias for DeepSeek-V3 and gpt-oss.
  uint64_t router_file_bytes() const;
  uint64_t shared_file_bytes(int32_t layer) const;  // gate, up, down of shared_d_ff
  uint64_t shared_gate_file_bytes() const;  // f32 [D]
  // "expert_03.bin" for one layer, "layer_01/expert_03.bin" for several;
  // likewise router.bin, shared_expert.bin, shared_gate.bin.
  std::string expert_file(int32_t layer, int32_t expert) const;
  std::string layer_file(int32_t layer, const char* name) const;
  std::string router_file(int32_t layer) const { return layer_file(layer, "router.bin"); }
  std::string shared_file(int32_t layer) const { return layer_file(layer, "shared_expert.bin"); }
  std::string shared_gate_file(int32_t layer) const { return layer_file(layer, "shared_gate.bin"); }

  // Every weight file of the model with its exact size and layer, layer by
  // layer: router, experts, shared expert, shared gate.
  template <class Visit>
  void for_each_weight_file(Visit&& visit) const {
    for (int32_t l = 0; l < n_layers; ++l) {
      if (has_router()) visit(router_file(l), router_file_bytes(), l);
      for (int32_t e = 0; e < n_experts; ++e) visit(expert_file(l, e), expert_file_bytes(l), l);
      if (has_shared()) {
        visit(shared_file(l), shared_file_bytes(l), l);
        if (shared_gate) visit(shared_gate_file(l), shared_gate_file_bytes(), l);
      }
    }
  }
};

// "mixtral", "qwen2_moe", ... (the Hugging Face model_type); "none".
const char* router_family_name(RouterFamily family);
bool parse_router_family(const std::string& name, RouterFamily* out);
// Throws Error(Status::kInvalidArgument or `status`) with `where`
// prefixed when the router's parameters do not fit n_experts.
void validate_router(const RouterDesc& router, int32_t n_experts, const std::string& where,
                     Status status);

// Parses and validates manifest JSON text; `source` names it in errors.
// Throws Error(Status::kFormat) naming the field at fault.
Manifest parse_manifest(const std::string& text, const std::string& source);
Manifest load_manifest(const std::string& model_dir);
// Checks colibri.json against colibri.json.xxh64 when that file exists.
// Throws Error(Status::kChecksum) on a mismatch, Error(Status::kFormat)
// for a malformed checksum file. Returns whether a checksum was checked.
bool verify_manifest_checksum(const std::string& model_dir);
// Writes colibri.json, then its checksum file (both atomically).
void write_manifest(const std::string& model_dir, const Manifest& manifest);
std::string manifest_to_json(const Manifest& manifest);

// "bf16", or "q4_k (down q6_k)" for mixed block formats, of one layer: for messages.
std::string expert_types(const Manifest& m, int32_t layer);
// "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k",
// "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs",
// "iq2_s", "iq3_xxs", "iq3_s", "iq4_nl", "iq4_xs", "fp8_e4m3", "tq1_0", "tq2_0".
bool parse_dtype(const std::string& name, WeightType* out);
// As parse_dtype, plus the mixes: "q4_k_m" is q4_k gate and up with q6_k
// down (the larger of the two types llama.cpp's Q4_K_M gives expert down
// matrices, in every layer: a model holds one down type). *down = *out
// for a plain type.
bool parse_dtype_mix(const std::string& name, WeightType* out, WeightType* down);
// The names parse_dtype accepts, for messages: "f32, f16, bf16, q8_0, ...".
const char* dtype_names();
// Empty when gate/up of type `dtype` may pair with down of `down_dtype`
// (the same type, or two block formats); otherwise why not.
std::string dtype_pair_problem(WeightType dtype, WeightType down_dtype);

}  // namespace colibri
