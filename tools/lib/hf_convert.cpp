#include "lib/hf_convert.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <system_error>

#include "io/manifest.h"
#include "io/mapped_file.h"
#include "lib/model_writer.h"
#include "lib/safetensors.h"
#include "util/error.h"
#include "util/quant_blocks.h"
#include "util/quant_ref.h"

namespace colibri {

using nlohmann::json;

namespace {

constexpr size_t kMaxConfigBytes = 16u << 20;
constexpr size_t kMaxIndexBytes = 256u << 20;  // DeepSeek-V3's is ~9 MB
constexpr int64_t kMaxHfLayers = int64_t{1} << 20;

// Which decoder layers carry an MoE block.
enum class LayerRule {
  kEvery,     // Mixtral, OLMoE
  kQwen,      // not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
  kDeepSeek,  // i >= first_k_dense_replace and i % moe_layer_freq == 0
};

enum class SharedKind { kNone, kQwen2, kDeepSeek };

struct Family {
  const char* model_type;
  RouterFamily router;
  const char* experts_field;
  const char* d_ff_field;
  LayerRule layers;
  SharedKind shared;
  bool mixtral_names;  // block_sparse_moe, w1/w3/w2
  bool gpt_oss;        // mlp.router with bias; experts' gate_up_proj [E, D, 2F] interleaved, biases, MXFP4
};

constexpr Family kFamilies[] = {
    {"mixtral", RouterFamily::kMixtral, "num_local_experts", "intermediate_size", LayerRule::kEvery,
     SharedKind::kNone, true, false},
    {"qwen2_moe", RouterFamily::kQwen2Moe, "num_experts", "moe_intermediate_size", LayerRule::kQwen,
     SharedKind::kQwen2, false, false},
    {"qwen3_moe", RouterFamily::kQwen3Moe, "num_experts", "moe_intermediate_size", LayerRule::kQwen,
     SharedKind::kNone, false, false},
    {"olmoe", RouterFamily::kOlmoe, "num_experts", "intermediate_size", LayerRule::kEvery, SharedKind::kNone,
     false, false},
    {"deepseek_v2", RouterFamily::kDeepseekV2, "n_routed_experts", "moe_intermediate_size",
     LayerRule::kDeepSeek, SharedKind::kDeepSeek, false, false},
    {"deepseek_v3", RouterFamily::kDeepseekV3, "n_routed_experts", "moe_intermediate_size",
     LayerRule::kDeepSeek, SharedKind::kDeepSeek, false, false},
    {"gpt_oss", RouterFamily::kGptOss, "num_local_experts", "intermediate_size", LayerRule::kEvery,
     SharedKind::kNone, false, true},
};

// MXFP4 as the gpt-oss checkpoints store it (transformers'
// convert_moe_packed_tensors): per row, groups of 32 values, 16 bytes each
// (the low nibble of byte j is value 2j, the high nibble value 2j + 1) and
// one E8M0 scale byte (2^(scale - 127)) per group; a nibble is an E2M1 code.
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void decode_hf_mxfp4_row(const uint8_t* blocks, const uint8_t* scales, size_t n, float* out) {
  for (size_t g = 0; g < n / 32; ++g) {
    const int exponent = static_cast<int>(scales[g]) - 127;
    for (size_t j = 0; j < 16; ++j) {
      const uint8_t b = blocks[g * 16 + j];
      out[g * 32 + 2 * j] = std::ldexp(kE2M1[b & 15], exponent);
      out[g * 32 + 2 * j + 1] = std::ldexp(kE2M1[b >> 4], exponent);
    }
  }
}

const Family* find_family(const std::string& model_type) {
  for (const Family& f : kFamilies) {
    if (model_type == f.model_type) return &f;
  }
  return nullptr;
}

// Typed access to config.json fields with the errors naming the field. JSON
// null counts as absent: transformers writes null for unset optional fields.
class ConfigReader {
 public:
  ConfigReader(const json& doc, const std::string& source, const std::string& model_type)
      : doc_(doc), source_(source), model_type_(model_type) {}

  bool has(const char* field) const {
    const auto it = doc_.find(field);
    return it != doc_.end() && !it->is_null();
  }

  int64_t integer(const char* field, int64_t min, int64_t max) const {
    if (!has(field)) {
      fail(Status::kFormat, source_ + ": missing field \"" + field + "\", which model_type \"" +
                                   model_type_ + "\" needs (is this an MoE checkpoint?)");
    }
    return to_integer(doc_.at(field), field, min, max);
  }

  int64_t integer_or(const char* field, int64_t fallback, int64_t min, int64_t max) const {
    return has(field) ? to_integer(doc_.at(field), field, min, max) : fallback;
  }

  bool boolean_or(const char* field, bool fallback) const {
    if (!has(field)) return fallback;
    const json& v = doc_.at(field);
    if (!v.is_boolean()) bad(field, "must be true or false, not " + v.dump());
    return v.get<bool>();
  }

  double number_or(const char* field, double fallback) const {
    if (!has(field)) return fallback;
    const json& v = doc_.at(field);
    if (!v.is_number()) bad(field, "must be a number, not " + v.dump());
    return v.get<double>();
  }

  std::string string_or(const char* field, const std::string& fallback) const {
    if (!has(field)) return fallback;
    const json& v = doc_.at(field);
    if (!v.is_string()) bad(field, "must be a string, not " + v.dump());
    return v.get<std::string>();
  }

  std::vector<int64_t> integers_or_empty(const char* field) const {
    std::vector<int64_t> out;
    if (!has(field)) return out;
    const json& v = doc_.at(field);
    if (!v.is_array()) bad(field, "must be an array of layer indices");
    for (const json& x : v) out.push_back(to_integer(x, field, 0, INT64_MAX));
    return out;
  }

  [[noreturn]] void bad(const char* field, const std::string& what) const {
    fail(Status::kFormat, source_ + ": field \"" + field + "\": " + what);
  }

 private:
  int64_t to_integer(const json& v, const char* field, int64_t min, int64_t max) const {
    if (!v.is_number_integer()) {
      bad(field, v.dump() + " is not an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    // Unsigned values above INT64_MAX would wrap in get<int64_t>.
    const bool huge = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
    const int64_t n = huge ? INT64_MAX : v.get<int64_t>();
    if (huge || n < min || n > max) {
      bad(field, v.dump() + " is out of range [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    return n;
  }

  const json& doc_;
  const std::string& source_;
  const std::string& model_type_;
};

// quantization_config: "fp8" (block-scaled e4m3, DeepSeek's and Qwen3's
// FP8 checkpoints) sets the scale tiles; "mxfp4" (gpt-oss) is read from its
// tensors; anything else stores its weights in a way Colibri cannot read.
void parse_quantization_config(const json& doc, const std::string& source, HfMoeConfig& c) {
  const auto it = doc.find("quantization_config");
  if (it == doc.end() || it->is_null()) return;
  const std::string where = source + ": quantization_config";
  if (!it->is_object()) fail(Status::kFormat, where + " must be an object, not " + it->dump());
  const ConfigReader q(*it, where, c.model_type);
  const std::string method = q.string_or("quant_method", "");
  if (method == "mxfp4") return;
  if (method != "fp8") {
    fail(Status::kUnsupported, where + ": field \"quant_method\": \"" + method +
                                   "\" is not supported (convert --hf reads \"fp8\" and \"mxfp4\" checkpoints, "
                                   "and unquantised ones)");
  }
  if (const std::string fmt = q.string_or("fmt", "e4m3"); fmt != "e4m3") {
    fail(Status::kUnsupported, where + ": field \"fmt\": \"" + fmt + "\" is not supported (FP8 is read as e4m3)");
  }
  if (const std::string scheme = q.string_or("activation_scheme", "dynamic"); scheme != "dynamic") {
    fail(Status::kUnsupported, where + ": field \"activation_scheme\": \"" + scheme +
                                   "\" is not supported (FP8 weights are read with dynamic, unquantised activations)");
  }
  if (!q.has("weight_block_size")) {
    q.bad("weight_block_size", "missing: convert --hf reads block-scaled FP8 ([rows, columns], e.g. [128, 128])");
  }
  const json& block = it->at("weight_block_size");
  if (!block.is_array() || block.size() != 2 || !block[0].is_number_integer() || !block[1].is_number_integer() ||
      block[0].get<int64_t>() < 1 || block[1].get<int64_t>() < 1 || block[0].get<int64_t>() > kMaxDim ||
      block[1].get<int64_t>() > kMaxDim) {
    q.bad("weight_block_size", block.dump() + " is not [rows, columns] of positive integers");
  }
  if (block[1].get<int64_t>() % kQKFp8 != 0) {
    q.bad("weight_block_size", block.dump() + ": the column block must be a multiple of " + std::to_string(kQKFp8) +
                                   " (one fp8_e4m3 block's scale)");
  }
  c.fp8_block_rows = static_cast<int32_t>(block[0].get<int64_t>());
  c.fp8_block_cols = static_cast<int32_t>(block[1].get<int64_t>());
}

std::string shape_string(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

struct TensorRef {
  const SafetensorsFile* file = nullptr;
  const StTensor* tensor = nullptr;
  explicit operator bool() const { return tensor != nullptr; }
};

// The checkpoint's tensors: one model.safetensors, or shards listed by
// model.safetensors.index.json. Shards are opened (mapped, header checked)
// when a tensor in them is first needed, so a --layers subset of a large
// checkpoint touches only its own shards.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir) : dir_(dir) {
    const std::string single = dir + "/model.safetensors";
    const std::string index = dir + "/model.safetensors.index.json";
    if (is_regular_file(single)) {
      where_ = single;
      shard_names_.push_back("model.safetensors");
      shards_.push_back(std::make_unique<SafetensorsFile>(single));
      return;
    }
    if (!is_regular_file(index)) {
      fail(Status::kIo, dir + ": no model.safetensors or model.safetensors.index.json");
    }
    where_ = index;
    indexed_ = true;
    json doc;
    try {
      doc = json::parse(read_small_file(index, kMaxIndexBytes));
    } catch (const json::exception& e) {
      fail(Status::kFormat, index + ": invalid JSON: " + e.what());
    }
    if (!doc.is_object()) fail(Status::kFormat, index + ": top level must be a JSON object");
    const auto map = doc.find("weight_map");
    if (map == doc.end() || !map->is_object()) {
      fail(Status::kFormat, index + ": missing object \"weight_map\"");
    }
    std::map<std::string, size_t> shard_ids;
    for (const auto& [name, value] : map->items()) {
      // Only plain names in this directory: an index must not make us map
      // files elsewhere.
      const std::string shard = value.is_string() ? value.get<std::string>() : std::string();
      if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
          shard.find('\0') != std::string::npos) {
        fail(Status::kFormat, index + ": weight_map \"" + name + "\": " + value.dump() +
                                     " is not a file name in the checkpoint directory");
      }
      const auto [it, added] = shard_ids.emplace(shard, shard_names_.size());
      if (added) shard_names_.push_back(shard);
      tensor_shard_.emplace(name, it->second);
    }
    shards_.resize(shard_names_.size());
  }

  // Null when the checkpoint has no tensor of that name.
  TensorRef find(const std::string& name) const {
    if (!indexed_) {
      const StTensor* t = shards_[0]->find(name);
      return t == nullptr ? TensorRef{} : TensorRef{shards_[0].get(), t};
    }
    const auto it = tensor_shard_.find(name);
    if (it == tensor_shard_.end()) return {};
    const size_t shard = it->second;
    if (!shards_[shard]) shards_[shard] = std::make_unique<SafetensorsFile>(dir_ + "/" + shard_names_[shard]);
    const StTensor* t = shards_[shard]->find(name);
    if (t == nullptr) {
      fail(Status::kFormat, where_ + ": weight_map puts tensor \"" + name + "\" in " + shard_names_[shard] +
                                   ", which has no such tensor");
    }
    return {shards_[shard].get(), t};
  }

  // Where a missing tensor should have been: the file or the index.
  const std::string& where() const { return where_; }
  int32_t shards_opened() const {
    int32_t n = 0;
    for (const auto& s : shards_) n += s ? 1 : 0;
    return n;
  }

 private:
  std::string dir_;
  std::string where_;
  bool indexed_ = false;
  std::vector<std::string> shard_names_;
  std::map<std::string, size_t> tensor_shard_;
  mutable std::vector<std::unique_ptr<SafetensorsFile>> shards_;
};

// An FP8 matrix's weight_scale_inv (empty for float tensors).
struct ExpertRefs {
  TensorRef gate, up, down;
  TensorRef gate_scale, up_scale, down_scale;
};

// Every tensor one converted layer needs, resolved and checked.
struct LayerPlan {
  int32_t hf = 0;
  TensorRef router, bias;
  // gpt-oss: the experts as MXFP4 blocks and scales ([E][2F][D/32][16],
  // [E][2F][D/32]; [E][D][F/32][16], [E][D][F/32]) or as floats in
  // gate_up / down ([E][D][2F], [E][F][D]); gate/up columns interleaved
  // (even: gate); biases [E][2F] (interleaved likewise) and [E][D].
  bool gpt_oss = false, mxfp4 = false;
  TensorRef gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias, down_bias;
  bool fused = false;
  std::vector<ExpertRefs> experts;  // per-expert layout
  TensorRef gate_up, down;          // fused layout: [E][2F][D], [E][D][F]
  TensorRef gate_up_scale, down_scale;  // of FP8 fused tensors: [E][2F / br][D / bc], [E][D / br][F / bc]
  ExpertRefs shared;
  TensorRef shared_gate;
};

class Planner {
 public:
  Planner(const Checkpoint& ckpt, const Family& family, const HfMoeConfig& config)
      : ckpt_(ckpt), family_(family), c_(config) {}

  LayerPlan plan(int32_t hf) const {
    if (family_.gpt_oss) return plan_gpt_oss(hf);
    LayerPlan p;
    p.hf = hf;
    const std::string layer = "model.layers." + std::to_string(hf) + ".";
    const uint64_t E = static_cast<uint64_t>(c_.n_experts), D = static_cast<uint64_t>(c_.d_model),
                   F = static_cast<uint64_t>(c_.d_ff);
    const std::string ex = family_.experts_field, ff = family_.d_ff_field;

    // Newer transformers name Mixtral's block "mlp" like the others.
    std::string block = layer + (family_.mixtral_names ? "block_sparse_moe" : "mlp");
    if (family_.mixtral_names && !ckpt_.find(block + ".gate.weight") && ckpt_.find(layer + "mlp.gate.weight")) {
      block = layer + "mlp";
    }
    p.router = require(block + ".gate.weight", {E, D}, ex + ", hidden_size");
    if (c_.router.family == RouterFamily::kDeepseekV3) {
      p.bias = require(block + ".gate.e_score_correction_bias", {E}, ex);
    }

    const char* const* proj = family_.mixtral_names ? kMixtralProj : kProj;
    const std::string first = block + ".experts.0." + proj[0] + ".weight";
    const TensorRef per_expert = ckpt_.find(first);
    const TensorRef gate_up = find_either(block + ".experts.gate_up_proj");
    if (per_expert && gate_up) {
      fail(Status::kFormat, ckpt_.where() + ": layer " + std::to_string(hf) + " has both per-expert (\"" +
                                   first + "\") and fused (\"" + gate_up.tensor->name +
                                   "\") expert tensors");
    }
    if (gate_up) {
      p.fused = true;
      p.gate_up = checked(gate_up, {E, 2 * F, D}, ex + ", 2 x " + ff + ", hidden_size");
      const TensorRef down = find_either(block + ".experts.down_proj");
      if (!down) missing(block + ".experts.down_proj");
      p.down = checked(down, {E, D, F}, ex + ", hidden_size, " + ff);
      p.gate_up_scale = scale_of(p.gate_up);
      p.down_scale = scale_of(p.down);
    } else {
      if (!per_expert) {
        fail(Status::kFormat, ckpt_.where() + ": missing tensor \"" + first + "\" (nor fused \"" + block +
                                     ".experts.gate_up_proj\")");
      }
      p.experts.resize(static_cast<size_t>(E));
      for (uint64_t e = 0; e < E; ++e) {
        const std::string prefix = block + ".experts." + std::to_string(e) + ".";
        p.experts[e] = matrices(prefix, proj, F, ff);
      }
    }

    if (family_.shared == SharedKind::kQwen2) {
      p.shared = matrices(block + ".shared_expert.", kProj, static_cast<uint64_t>(c_.shared_d_ff),
                          "shared_expert_intermediate_size");
      p.shared_gate = require(block + ".shared_expert_gate.weight", {1, D}, "1, hidden_size");
    } else if (family_.shared == SharedKind::kDeepSeek && c_.shared_d_ff > 0) {
      p.shared = matrices(block + ".shared_experts.", kProj, static_cast<uint64_t>(c_.shared_d_ff),
                          "moe_intermediate_size x n_shared_experts");
    }
    return p;
  }

 private:
  static constexpr const char* kProj[3] = {"gate_proj", "up_proj", "down_proj"};
  static constexpr const char* kMixtralProj[3] = {"w1", "w3", "w2"};

  LayerPlan plan_gpt_oss(int32_t hf) const {
    LayerPlan p;
    p.hf = hf;
    p.gpt_oss = true;
    const std::string block = "model.layers." + std::to_string(hf) + ".mlp";
    const uint64_t E = static_cast<uint64_t>(c_.n_experts), D = static_cast<uint64_t>(c_.d_model),
                   F = static_cast<uint64_t>(c_.d_ff);
    p.router = require(block + ".router.weight", {E, D}, "num_local_experts, hidden_size");
    p.bias = require(block + ".router.bias", {E}, "num_local_experts");
    const std::string ex = block + ".experts.";
    p.gate_up_bias = require(ex + "gate_up_proj_bias", {E, 2 * F}, "num_local_experts, 2 x intermediate_size");
    p.down_bias = require(ex + "down_proj_bias", {E, D}, "num_local_experts, hidden_size");
    if (const TensorRef blocks = ckpt_.find(ex + "gate_up_proj_blocks")) {
      p.mxfp4 = true;
      if (D % 32 != 0 || F % 32 != 0) {
        fail(Status::kFormat, blocks.file->path() + ": tensor \"" + blocks.tensor->name +
                                     "\": MXFP4 experts need hidden_size and intermediate_size in multiples of 32 "
                                     "(they are " + std::to_string(D) + " and " + std::to_string(F) + ")");
      }
      p.gate_up_blocks = checked_u8(blocks, {E, 2 * F, D / 32, 16});
      p.gate_up_scales = require_u8(ex + "gate_up_proj_scales", {E, 2 * F, D / 32});
      p.down_blocks = require_u8(ex + "down_proj_blocks", {E, D, F / 32, 16});
      p.down_scales = require_u8(ex + "down_proj_scales", {E, D, F / 32});
    } else {
      const TensorRef gate_up = find_either(ex + "gate_up_proj");
      if (!gate_up) {
        fail(Status::kFormat, ckpt_.where() + ": missing tensor \"" + ex + "gate_up_proj_blocks\" (nor \"" + ex +
                                     "gate_up_proj\")");
      }
      p.gate_up = checked(gate_up, {E, D, 2 * F}, "num_local_experts, hidden_size, 2 x intermediate_size");
      const TensorRef down = find_either(ex + "down_proj");
      if (!down) missing(ex + "down_proj");
      p.down = checked(down, {E, F, D}, "num_local_experts, intermediate_size, hidden_size");
    }
    return p;
  }

  TensorRef require_u8(const std::string& name, const std::vector<uint64_t>& shape) const {
    const TensorRef r = ckpt_.find(name);
    if (!r) missing(name);
    return checked_u8(r, shape);
  }

  static TensorRef checked_u8(const TensorRef& r, const std::vector<uint64_t>& shape) {
    const StTensor& t = *r.tensor;
    const std::string where = r.file->path() + ": tensor \"" + t.name + "\": ";
    if (t.dtype != StDtype::kU8) fail(Status::kFormat, where + "dtype " + st_dtype_name(t.dtype) + ", expected U8");
    if (t.shape != shape) {
      fail(Status::kFormat, where + "shape " + shape_string(t.shape) + ", expected " + shape_string(shape) +
                                   " (from config.json, 32 values per block)");
    }
    return r;
  }

  // gate and up [F][D], down [D][F] under `prefix`.
  ExpertRefs matrices(const std::string& prefix, const char* const* proj, uint64_t F,
                      const std::string& f_name) const {
    const uint64_t D = static_cast<uint64_t>(c_.d_model);
    ExpertRefs r;
    r.gate = require(prefix + proj[0] + ".weight", {F, D}, f_name + ", hidden_size");
    r.up = require(prefix + proj[1] + ".weight", {F, D}, f_name + ", hidden_size");
    r.down = require(prefix + proj[2] + ".weight", {D, F}, "hidden_size, " + f_name);
    r.gate_scale = scale_of(r.gate);
    r.up_scale = scale_of(r.up);
    r.down_scale = scale_of(r.down);
    return r;
  }

  // The fused tensors come with or without a ".weight" suffix.
  TensorRef find_either(const std::string& name) const {
    const TensorRef r = ckpt_.find(name);
    return r ? r : ckpt_.find(name + ".weight");
  }

  [[noreturn]] void missing(const std::string& name) const {
    fail(Status::kFormat, ckpt_.where() + ": missing tensor \"" + name + "\"");
  }

  TensorRef require(const std::string& name, const std::vector<uint64_t>& shape, const std::string& dims) const {
    const TensorRef r = ckpt_.find(name);
    if (!r) missing(name);
    return checked(r, shape, dims);
  }

  TensorRef checked(const TensorRef& r, const std::vector<uint64_t>& shape, const std::string& dims) const {
    const StTensor& t = *r.tensor;
    const std::string where = r.file->path() + ": tensor \"" + t.name + "\": ";
    const bool fp8_checkpoint = c_.fp8_block_rows > 0;
    const bool float_dtype = t.dtype == StDtype::kBF16 || t.dtype == StDtype::kF16 || t.dtype == StDtype::kF32;
    if (!float_dtype && !(fp8_checkpoint && t.dtype == StDtype::kF8E4M3)) {
      const bool fp8 = t.dtype == StDtype::kF8E4M3 || t.dtype == StDtype::kF8E5M2;
      fail(Status::kFormat, where + "dtype " + st_dtype_name(t.dtype) + " is not supported (expected BF16, F16 or F32" +
                                   (fp8_checkpoint ? ", or F8_E4M3 with its weight_scale_inv)"
                                    : fp8 ? "; FP8 tensors need config.json's quantization_config with quant_method "
                                            "\"fp8\" and weight_block_size)"
                                          : ")"));
    }
    if (t.shape != shape) {
      fail(Status::kFormat, where + "shape " + shape_string(t.shape) + ", expected " + shape_string(shape) +
                                   " (" + dims + " from config.json)");
    }
    return r;
  }

  // An F8_E4M3 matrix's scales, "<name>_scale_inv": one float per
  // weight_block_size tile of each matrix ([.., ceil(rows / br),
  // ceil(cols / bc)], the leading dimensions as the weight's); empty for a
  // float tensor.
  TensorRef scale_of(const TensorRef& w) const {
    const StTensor& t = *w.tensor;
    if (t.dtype != StDtype::kF8E4M3) return {};
    const std::string name = t.name + "_scale_inv";
    const TensorRef r = ckpt_.find(name);
    if (!r) {
      fail(Status::kFormat, w.file->path() + ": tensor \"" + t.name + "\" is F8_E4M3 but the checkpoint has no \"" +
                                   name + "\"");
    }
    std::vector<uint64_t> want = t.shape;
    const size_t n = want.size();
    want[n - 2] = (want[n - 2] + static_cast<uint64_t>(c_.fp8_block_rows) - 1) / static_cast<uint64_t>(c_.fp8_block_rows);
    want[n - 1] = (want[n - 1] + static_cast<uint64_t>(c_.fp8_block_cols) - 1) / static_cast<uint64_t>(c_.fp8_block_cols);
    const StTensor& st = *r.tensor;
    const std::string where = r.file->path() + ": tensor \"" + name + "\": ";
    if (st.dtype != StDtype::kF32 && st.dtype != StDtype::kBF16 && st.dtype != StDtype::kF16) {
      fail(Status::kFormat, where + "dtype " + st_dtype_name(st.dtype) + ", expected F32, BF16 or F16");
    }
    if (st.shape != want) {
      fail(Status::kFormat, where + "shape " + shape_string(st.shape) + ", expected " + shape_string(want) + " (" +
                                   shape_string(t.shape) + " in " + std::to_string(c_.fp8_block_rows) + " x " +
                                   std::to_string(c_.fp8_block_cols) + " tiles, weight_block_size)");
    }
    return r;
  }

  const Checkpoint& ckpt_;
  const Family& family_;
  const HfMoeConfig& c_;
};

WeightType weight_type_of_tensor(StDtype d) {
  switch (d) {
    case StDtype::kF32: return WeightType::kF32;
    case StDtype::kBF16: return WeightType::kBF16;
    case StDtype::kF8E4M3: return WeightType::kFP8_E4M3;
    default: return WeightType::kF16;
  }
}

void read_all(const TensorRef& r, float* out) { r.file->read_floats(*r.tensor, 0, r.tensor->n_elements, out); }

// One FP8 matrix's codes and tile scales, read from the checkpoint.
struct Fp8Matrix {
  std::vector<uint8_t> codes;  // [rows][cols]
  std::vector<float> scales;   // [ceil(rows / br)][ceil(cols / bc)]
  size_t tile_cols = 0;        // ceil(cols / bc)

  // Matrix `index` of `w` ([.., rows, cols], F8_E4M3) and its scales.
  void read(const TensorRef& w, const TensorRef& scale, const HfMoeConfig& c, uint64_t index, size_t rows,
            size_t cols) {
    const size_t br = static_cast<size_t>(c.fp8_block_rows), bc = static_cast<size_t>(c.fp8_block_cols);
    tile_cols = (cols + bc - 1) / bc;
    const size_t tiles = (rows + br - 1) / br * tile_cols;
    codes.resize(rows * cols);
    scales.resize(tiles);
    w.file->read_u8(*w.tensor, index * rows * cols, codes.size(), codes.data());
    scale.file->read_floats(*scale.tensor, index * tiles, tiles, scales.data());
  }

  float scale_at(const HfMoeConfig& c, size_t row, size_t col) const {
    return scales[row / static_cast<size_t>(c.fp8_block_rows) * tile_cols + col / static_cast<size_t>(c.fp8_block_cols)];
  }
};

// Matrix `index` ([rows][cols]) of `w` as floats: an FP8 tensor's codes
// times their tile's scale, rounded once to float (the fp8_e4m3 reference
// dequantiser's values), or a float tensor's values.
void read_matrix(const TensorRef& w, const TensorRef& scale, const HfMoeConfig& c, uint64_t index, size_t rows,
                 size_t cols, Fp8Matrix& fp8, float* out) {
  if (!scale) {
    w.file->read_floats(*w.tensor, index * rows * cols, rows * cols, out);
    return;
  }
  fp8.read(w, scale, c, index, rows, cols);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t j = 0; j < cols; ++j) out[r * cols + j] = e4m3_to_float(fp8.codes[r * cols + j]) * fp8.scale_at(c, r, j);
  }
}

// The same matrix as fp8_e4m3 rows, codes and scales as stored: each
// 128-value block lies inside one tile (the column block is a multiple of
// 128), whose scale becomes the block's; a row's last block is padded with
// zero codes.
void encode_fp8_matrix(const TensorRef& w, const TensorRef& scale, const HfMoeConfig& c, uint64_t index, size_t rows,
                       size_t cols, Fp8Matrix& fp8, uint8_t* out) {
  fp8.read(w, scale, c, index, rows, cols);
  const size_t blocks = (cols + kQKFp8 - 1) / kQKFp8;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t b = 0; b < blocks; ++b) {
      BlockFp8E4M3 blk{};
      const size_t first = b * kQKFp8, n = std::min<size_t>(kQKFp8, cols - first);
      blk.d = fp8.scale_at(c, r, first);
      std::memcpy(blk.qs, fp8.codes.data() + r * cols + first, n);
      std::memcpy(out + (r * blocks + b) * sizeof blk, &blk, sizeof blk);
    }
  }
}

// `rows` rows of n values from MXFP4 blocks and scales, starting at row `first`.
void read_hf_mxfp4(const TensorRef& blocks, const TensorRef& scales, uint64_t first, size_t rows, size_t n,
                   std::vector<uint8_t>& codes, std::vector<uint8_t>& exps, float* out) {
  codes.resize(rows * n / 2);
  exps.resize(rows * n / 32);
  blocks.file->read_u8(*blocks.tensor, first * n / 2, codes.size(), codes.data());
  scales.file->read_u8(*scales.tensor, first * n / 32, exps.size(), exps.data());
  for (size_t r = 0; r < rows; ++r) decode_hf_mxfp4_row(codes.data() + r * n / 2, exps.data() + r * n / 32, n, out + r * n);
}

// One gpt-oss expert as the writer takes it: gate [F][D], up [F][D], down
// [D][F], then the biases of gate [F], up [F] and down [D]. The checkpoint
// interleaves gate and up (even rows or columns gate, odd up); MXFP4 rows
// are output rows, the float layout is transposed ([D][2F], [F][D]).
void read_gpt_oss_expert(const LayerPlan& p, uint64_t e, size_t D, size_t F, float* w, std::vector<uint8_t>& codes,
                         std::vector<uint8_t>& scales, std::vector<float>& rows) {
  float* gate = w;
  float* up = w + F * D;
  float* down = w + 2 * F * D;
  rows.resize(2 * F * D);
  if (p.mxfp4) {
    read_hf_mxfp4(p.gate_up_blocks, p.gate_up_scales, e * 2 * F, 2 * F, D, codes, scales, rows.data());
    for (size_t f = 0; f < F; ++f) {
      std::copy_n(rows.data() + 2 * f * D, D, gate + f * D);
      std::copy_n(rows.data() + (2 * f + 1) * D, D, up + f * D);
    }
    read_hf_mxfp4(p.down_blocks, p.down_scales, e * D, D, F, codes, scales, down);
  } else {
    p.gate_up.file->read_floats(*p.gate_up.tensor, e * 2 * F * D, 2 * F * D, rows.data());  // [D][2F]
    for (size_t d = 0; d < D; ++d) {
      for (size_t f = 0; f < F; ++f) {
        gate[f * D + d] = rows[d * 2 * F + 2 * f];
        up[f * D + d] = rows[d * 2 * F + 2 * f + 1];
      }
    }
    p.down.file->read_floats(*p.down.tensor, e * F * D, F * D, rows.data());  // [F][D]
    for (size_t f = 0; f < F; ++f) {
      for (size_t d = 0; d < D; ++d) down[d * F + f] = rows[f * D + d];
    }
  }
  float* bias = w + 3 * F * D;
  rows.resize(2 * F);
  p.gate_up_bias.file->read_floats(*p.gate_up_bias.tensor, e * 2 * F, 2 * F, rows.data());
  for (size_t f = 0; f < F; ++f) {
    bias[f] = rows[2 * f];
    bias[F + f] = rows[2 * f + 1];
  }
  p.down_bias.file->read_floats(*p.down_bias.tensor, e * D, D, bias + 2 * F);
}

// Refuses an existing non-empty directory or a non-directory; an empty
// directory is replaced by the rename at the end.
void check_out_dir(const std::string& out) {
  struct stat st {};
  if (::stat(out.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    fail(Status::kIo, errno_message(out + ": cannot stat", errno));
  }
  if (!S_ISDIR(st.st_mode)) fail(Status::kIo, out + ": exists and is not a directory; refusing to overwrite it");
  std::error_code ec;
  const std::filesystem::directory_iterator it(out, ec);
  if (ec) fail(Status::kIo, out + ": cannot list: " + ec.message());
  if (it != std::filesystem::directory_iterator()) {
    fail(Status::kIo, out + ": exists and is not empty; refusing to overwrite it");
  }
}

}  // namespace

std::string hf_supported_model_types() {
  std::string s;
  for (const Family& f : kFamilies) s += (s.empty() ? "" : ", ") + std::string(f.model_type);
  return s;
}

HfMoeConfig parse_hf_config(const std::string& text, const std::string& source) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    fail(Status::kFormat, source + ": invalid JSON: " + e.what());
  }
  if (!doc.is_object()) fail(Status::kFormat, source + ": top level must be a JSON object");
  const auto type = doc.find("model_type");
  if (type == doc.end() || !type->is_string()) {
    fail(Status::kFormat, source + ": missing string field \"model_type\" (supported: " +
                                 hf_supported_model_types() + ")");
  }
  HfMoeConfig c;
  c.model_type = type->get<std::string>();
  const Family* family = find_family(c.model_type);
  if (family == nullptr) {
    fail(Status::kUnsupported, source + ": model_type \"" + c.model_type +
                                      "\" is not supported (supported: " + hf_supported_model_types() + ")");
  }
  const ConfigReader r(doc, source, c.model_type);
  const bool v3 = family->router == RouterFamily::kDeepseekV3;

  c.n_hidden_layers = static_cast<int32_t>(r.integer("num_hidden_layers", 1, kMaxHfLayers));
  c.d_model = static_cast<int32_t>(r.integer("hidden_size", 1, kMaxDim));
  c.n_experts = static_cast<int32_t>(r.integer(family->experts_field, 1, kMaxExperts));
  c.d_ff = static_cast<int32_t>(r.integer(family->d_ff_field, 1, kMaxDim));
  c.router = RouterDesc{};  // n_group 1, topk_group 1, scaling 1 unless the family says otherwise
  c.router.family = family->router;
  c.router.top_k = static_cast<int32_t>(r.integer("num_experts_per_tok", 1, c.n_experts));
  // Mixtral always renormalises (its config has no such field).
  // Mixtral always renormalises (its config has no such field), and
  // gpt-oss's weights are a softmax over the chosen experts.
  const bool norm = family->router == RouterFamily::kMixtral || family->gpt_oss ? true
                                                                                : r.boolean_or("norm_topk_prob", v3);
  c.router.norm_topk_prob = norm ? 1 : 0;
  if (family->gpt_oss) {
    c.clamped_swiglu = true;
    c.expert_bias = true;
    const double limit = r.number_or("swiglu_limit", 7.0), alpha = r.number_or("swiglu_alpha", 1.702);
    if (!std::isfinite(limit) || limit <= 0 || limit > 1e6) r.bad("swiglu_limit", "must be a positive finite number");
    if (!std::isfinite(alpha) || alpha <= 0 || alpha > 1e6) r.bad("swiglu_alpha", "must be a positive finite number");
    c.swiglu_limit = static_cast<float>(limit);
    c.swiglu_alpha = static_cast<float>(alpha);
  }

  if (family->shared == SharedKind::kQwen2) {
    c.shared_d_ff = static_cast<int32_t>(r.integer("shared_expert_intermediate_size", 1, kMaxDim));
    c.shared_gate = true;
  } else if (family->shared == SharedKind::kDeepSeek) {
    const int64_t n_shared = r.integer_or("n_shared_experts", 0, 0, kMaxExperts);
    if (static_cast<int64_t>(c.d_ff) * n_shared > kMaxDim) {
      r.bad("n_shared_experts", std::to_string(n_shared) + " x moe_intermediate_size " + std::to_string(c.d_ff) +
                                    " exceeds " + std::to_string(kMaxDim));
    }
    c.shared_d_ff = static_cast<int32_t>(c.d_ff * n_shared);
  }

  if (family->layers == LayerRule::kDeepSeek) {
    const std::string method = r.string_or("topk_method", v3 ? "noaux_tc" : "greedy");
    const char* grouped = v3 ? "noaux_tc" : "group_limited_greedy";
    if (method != "greedy" && method != grouped) {
      fail(Status::kUnsupported, source + ": field \"topk_method\": \"" + method + "\" is not supported for " +
                                        c.model_type + " (expected \"greedy\" or \"" + grouped + "\")");
    }
    const std::string scoring = r.string_or("scoring_func", v3 ? "sigmoid" : "softmax");
    if (scoring != (v3 ? "sigmoid" : "softmax")) {
      fail(Status::kUnsupported, source + ": field \"scoring_func\": \"" + scoring + "\" is not supported for " +
                                        c.model_type + " (expected \"" + (v3 ? "sigmoid" : "softmax") + "\")");
    }
    if (method != "greedy") {
      c.router.n_group = static_cast<int32_t>(r.integer("n_group", 1, c.n_experts));
      if (c.n_experts % c.router.n_group != 0) {
        r.bad("n_group", std::to_string(c.router.n_group) + " does not divide " + family->experts_field + " " +
                             std::to_string(c.n_experts));
      }
      c.router.topk_group = static_cast<int32_t>(r.integer("topk_group", 1, c.router.n_group));
    }
    const double scale = r.number_or("routed_scaling_factor", 1.0);
    if (!std::isfinite(scale) || scale <= 0 || scale > 1e6) {
      r.bad("routed_scaling_factor", std::to_string(scale) + " is not a positive finite scale");
    }
    c.router.routed_scaling_factor = static_cast<float>(scale);
  }
  validate_router(c.router, c.n_experts, source, Status::kFormat);

  switch (family->layers) {
    case LayerRule::kEvery:
      for (int32_t i = 0; i < c.n_hidden_layers; ++i) c.moe_layers.push_back(i);
      break;
    case LayerRule::kQwen: {
      const int64_t step = r.integer_or("decoder_sparse_step", 1, 1, kMaxHfLayers);
      const std::vector<int64_t> dense = r.integers_or_empty("mlp_only_layers");
      for (int32_t i = 0; i < c.n_hidden_layers; ++i) {
        if ((i + 1) % step == 0 && std::find(dense.begin(), dense.end(), i) == dense.end()) c.moe_layers.push_back(i);
      }
      break;
    }
    case LayerRule::kDeepSeek: {
      const int64_t first_moe = r.integer_or("first_k_dense_replace", 0, 0, kMaxHfLayers);
      const int64_t freq = r.integer_or("moe_layer_freq", 1, 1, kMaxHfLayers);
      for (int32_t i = 0; i < c.n_hidden_layers; ++i) {
        if (i >= first_moe && i % freq == 0) c.moe_layers.push_back(i);
      }
      break;
    }
  }
  parse_quantization_config(doc, source, c);
  if (c.moe_layers.empty()) {
    fail(Status::kFormat, source + ": no MoE layer among the " + std::to_string(c.n_hidden_layers) +
                                 " decoder layers (check decoder_sparse_step, mlp_only_layers, "
                                 "first_k_dense_replace, moe_layer_freq)");
  }
  return c;
}

HfConvertResult convert_hf_checkpoint(const HfConvertOptions& options) {
  std::string out = options.out_dir;
  // "out/" would otherwise put the temporary directory inside out.
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  if (out.empty() || out == "/") {
    fail(Status::kInvalidArgument, "output directory \"" + options.out_dir + "\" is not usable");
  }
  check_out_dir(out);

  const std::string config_path = options.hf_dir + "/config.json";
  HfConvertResult result;
  result.config = parse_hf_config(read_small_file(config_path, kMaxConfigBytes), config_path);
  const HfMoeConfig& c = result.config;
  const Family& family = *find_family(c.model_type);

  const int32_t first = options.first_layer.value_or(0);
  const int32_t last = options.last_layer.value_or(c.n_hidden_layers - 1);
  const std::string range = std::to_string(first) + "-" + std::to_string(last);
  if (first < 0 || last < first || last >= c.n_hidden_layers) {
    fail(Status::kInvalidArgument, "layers " + range + ": not a range within the model's " +
                                           std::to_string(c.n_hidden_layers) + " decoder layers (0-" +
                                           std::to_string(c.n_hidden_layers - 1) + ")");
  }
  for (int32_t i : c.moe_layers) {
    if (i >= first && i <= last) result.layers.push_back(i);
  }
  if (result.layers.empty()) {
    fail(Status::kInvalidArgument, "layers " + range + ": no MoE layer in that range (the first is " +
                                           std::to_string(c.moe_layers.front()) + ", the last " +
                                           std::to_string(c.moe_layers.back()) + ")");
  }
  if (static_cast<int64_t>(result.layers.size()) > kMaxLayers) {
    fail(Status::kInvalidArgument, "layers " + range + ": " + std::to_string(result.layers.size()) +
                                           " MoE layers, more than " + std::to_string(kMaxLayers) +
                                           " in one model; convert a smaller range");
  }

  // Every tensor is found and checked before anything is written.
  const Checkpoint ckpt(options.hf_dir);
  const Planner planner(ckpt, family, c);
  std::vector<LayerPlan> plans;
  plans.reserve(result.layers.size());
  for (int32_t hf : result.layers) {
    plans.push_back(planner.plan(hf));
    result.fused_layers += plans.back().fused ? 1 : 0;
  }
  result.n_shards = ckpt.shards_opened();
  const LayerPlan& p0 = plans.front();
  result.source_dtype = p0.mxfp4 ? WeightType::kMXFP4
                                 : weight_type_of_tensor(p0.fused || p0.gpt_oss ? p0.gate_up.tensor->dtype
                                                                                : p0.experts[0].gate.tensor->dtype);
  result.dtype = options.dtype.value_or(result.source_dtype);
  result.down_dtype = options.down_dtype.value_or(result.dtype);

  ModelWriteSpec spec;
  spec.n_layers = static_cast<int32_t>(plans.size());
  spec.n_experts = c.n_experts;
  spec.d_model = c.d_model;
  spec.d_ff = c.d_ff;
  spec.dtype = result.dtype;
  spec.down_dtype = result.down_dtype;
  spec.checksums = options.checksums;
  spec.router = c.router;
  spec.shared_d_ff = c.shared_d_ff;
  spec.shared_gate = c.shared_gate;
  spec.clamped_swiglu = c.clamped_swiglu;
  spec.swiglu_alpha = c.swiglu_alpha;
  spec.swiglu_limit = c.swiglu_limit;
  spec.expert_bias = c.expert_bias;
  spec.source_json = json{{"format", "hf"}, {"model_type", c.model_type}, {"layers", result.layers}}.dump();

  const size_t D = static_cast<size_t>(c.d_model), F = static_cast<size_t>(c.d_ff);
  const size_t DF = D * F;
  std::vector<uint8_t> codes, scales;
  std::vector<float> rows;
  Fp8Matrix fp8;
  ModelFill fill;
  fill.expert = [&](int32_t layer, int32_t expert, float* w) {
    const LayerPlan& p = plans[static_cast<size_t>(layer)];
    const uint64_t e = static_cast<uint64_t>(expert);
    if (p.gpt_oss) {
      read_gpt_oss_expert(p, e, D, F, w, codes, scales, rows);
    } else if (p.fused) {
      // gate_up_proj[e] is gate rows then up rows: the expert file's layout.
      read_matrix(p.gate_up, p.gate_up_scale, c, e, 2 * F, D, fp8, w);
      read_matrix(p.down, p.down_scale, c, e, D, F, fp8, w + 2 * DF);
    } else {
      const ExpertRefs& x = p.experts[static_cast<size_t>(expert)];
      read_matrix(x.gate, x.gate_scale, c, 0, F, D, fp8, w);
      read_matrix(x.up, x.up_scale, c, 0, F, D, fp8, w + DF);
      read_matrix(x.down, x.down_scale, c, 0, D, F, fp8, w + 2 * DF);
    }
  };
  // FP8 written as fp8_e4m3: codes and scales kept as stored, no float
  // round trip (a re-quantisation would pick new scales and round again).
  const bool keep_fp8 = result.dtype == WeightType::kFP8_E4M3 && result.down_dtype == WeightType::kFP8_E4M3;
  if (keep_fp8) {
    const uint64_t gate_bytes = Manifest::matrix_bytes(WeightType::kFP8_E4M3, c.d_ff, c.d_model);
    fill.expert_encoded = [&, gate_bytes](int32_t layer, int32_t expert, uint8_t* bytes) {
      const LayerPlan& p = plans[static_cast<size_t>(layer)];
      const uint64_t e = static_cast<uint64_t>(expert);
      if (p.fused) {
        if (!p.gate_up_scale || !p.down_scale) return false;
        encode_fp8_matrix(p.gate_up, p.gate_up_scale, c, e, 2 * F, D, fp8, bytes);
        encode_fp8_matrix(p.down, p.down_scale, c, e, D, F, fp8, bytes + 2 * gate_bytes);
        return true;
      }
      const ExpertRefs& x = p.experts[static_cast<size_t>(expert)];
      if (!x.gate_scale || !x.up_scale || !x.down_scale) return false;
      encode_fp8_matrix(x.gate, x.gate_scale, c, 0, F, D, fp8, bytes);
      encode_fp8_matrix(x.up, x.up_scale, c, 0, F, D, fp8, bytes + gate_bytes);
      encode_fp8_matrix(x.down, x.down_scale, c, 0, D, F, fp8, bytes + 2 * gate_bytes);
      return true;
    };
  }
  fill.router = [&](int32_t layer, float* router, float* bias) {
    const LayerPlan& p = plans[static_cast<size_t>(layer)];
    read_all(p.router, router);
    if (bias != nullptr) {
      if (p.bias) read_all(p.bias, bias);
      else std::fill(bias, bias + c.n_experts, 0.0f);
    }
  };
  const size_t SF_rows = static_cast<size_t>(c.shared_d_ff);
  auto read_shared_gate = [&](const LayerPlan& p, float* gate) {
    if (gate == nullptr) return;
    if (p.shared_gate) read_all(p.shared_gate, gate);
    else std::fill(gate, gate + c.d_model, 0.0f);
  };
  fill.shared = [&](int32_t layer, float* w, float* gate) {
    const LayerPlan& p = plans[static_cast<size_t>(layer)];
    const ExpertRefs& x = p.shared;
    const size_t SF = D * SF_rows;
    read_matrix(x.gate, x.gate_scale, c, 0, SF_rows, D, fp8, w);
    read_matrix(x.up, x.up_scale, c, 0, SF_rows, D, fp8, w + SF);
    read_matrix(x.down, x.down_scale, c, 0, D, SF_rows, fp8, w + 2 * SF);
    read_shared_gate(p, gate);
  };
  if (keep_fp8 && c.shared_d_ff > 0) {
    const uint64_t gate_bytes = Manifest::matrix_bytes(WeightType::kFP8_E4M3, c.shared_d_ff, c.d_model);
    fill.shared_encoded = [&, gate_bytes](int32_t layer, uint8_t* bytes, float* gate) {
      const LayerPlan& p = plans[static_cast<size_t>(layer)];
      const ExpertRefs& x = p.shared;
      if (!x.gate_scale || !x.up_scale || !x.down_scale) return false;
      encode_fp8_matrix(x.gate, x.gate_scale, c, 0, SF_rows, D, fp8, bytes);
      encode_fp8_matrix(x.up, x.up_scale, c, 0, SF_rows, D, fp8, bytes + gate_bytes);
      encode_fp8_matrix(x.down, x.down_scale, c, 0, D, SF_rows, fp8, bytes + 2 * gate_bytes);
      read_shared_gate(p, gate);
      return true;
    };
  }
  const int32_t n_layers = spec.n_layers;
  fill.progress = [&](uint64_t done, uint64_t total) {
    result.bytes_written = done;
    if (!options.progress) return;
    HfConvertProgress pr;
    pr.bytes_done = done;
    pr.bytes_total = total;
    // Every layer has the same files, so bytes tell how many are complete.
    pr.layers_done = total == 0 ? 0 : static_cast<int32_t>(done * static_cast<uint64_t>(n_layers) / total);
    pr.layers_total = n_layers;
    options.progress(pr);
  };

  const std::string tmp = out + ".partial-" + std::to_string(::getpid());
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);  // left by an earlier run that had our pid
  try {
    write_model_dir(tmp, spec, fill);
    if (::rename(tmp.c_str(), out.c_str()) != 0) {
      fail(Status::kIo, errno_message(out + ": cannot move the converted model into place from " + tmp, errno));
    }
  } catch (...) {
    std::filesystem::remove_all(tmp, ec);
    throw;
  }
  return result;
}

}  // namespace colibri
