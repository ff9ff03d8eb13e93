#include "io/manifest.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "io/checksum.h"
#include "io/mapped_file.h"
#include "util/error.h"

namespace colibri {

using nlohmann::json;

namespace {

constexpr size_t kMaxManifestBytes = 64u << 20;

[[noreturn]] void bad_field(const std::string& source, const std::string& field,
                            const std::string& what) {
  fail(Status::kFormat, source + ": field \"" + field + "\": " + what);
}

const json& require(const json& doc, const std::string& source, const char* field) {
  auto it = doc.find(field);
  if (it == doc.end()) fail(Status::kFormat, source + ": missing field \"" + field + "\"");
  return *it;
}

int32_t require_dim(const json& doc, const std::string& source, const char* field, int64_t max) {
  const json& v = require(doc, source, field);
  if (!v.is_number_integer()) bad_field(source, field, "must be an integer");
  // Read through int64 so huge or negative values are caught, not wrapped.
  int64_t n = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(max)) {
      bad_field(source, field, std::to_string(u) + " is out of range [1, " + std::to_string(max) + "]");
    }
    n = static_cast<int64_t>(u);
  } else {
    n = v.get<int64_t>();
  }
  if (n < 1 || n > max) {
    bad_field(source, field, std::to_string(n) + " is out of range [1, " + std::to_string(max) + "]");
  }
  return static_cast<int32_t>(n);
}

// True if `file` is exactly the name of one of the model's weight files.
// Parsed rather than enumerated: a model may have millions of experts.
bool names_model_file(const Manifest& m, const std::string& file) {
  int layer = 0, consumed = 0;
  std::string rest = file;
  if (m.n_layers > 1) {
    if (std::sscanf(file.c_str(), "layer_%d/%n", &layer, &consumed) != 1 || consumed == 0) return false;
    if (layer < 0 || layer >= m.n_layers) return false;
    rest = file.substr(static_cast<size_t>(consumed));
  }
  if ((m.has_router() && file == m.router_file(layer)) || (m.has_shared() && file == m.shared_file(layer)) ||
      (m.has_shared() && m.shared_gate && file == m.shared_gate_file(layer))) {
    return true;
  }
  int expert = 0;
  consumed = 0;
  if (std::sscanf(rest.c_str(), "expert_%d.bin%n", &expert, &consumed) != 1) return false;
  if (consumed != static_cast<int>(rest.size())) return false;
  if (expert < 0 || expert >= m.n_experts) return false;
  return m.expert_file(layer, expert) == file;  // rejects "expert_3.bin", "expert_+03.bin"
}

bool require_bool(const json& doc, const std::string& source, const char* field, bool fallback) {
  auto it = doc.find(field);
  if (it == doc.end()) return fallback;
  if (!it->is_boolean()) bad_field(source, field, "must be true or false");
  return it->get<bool>();
}

RouterDesc parse_router(const json& r, const std::string& source, int32_t n_experts) {
  const std::string where = source + ": router";
  if (!r.is_object()) bad_field(source, "router", "must be an object");
  RouterDesc d{};
  const json& family = require(r, where, "family");
  if (!family.is_string() || !parse_router_family(family.get<std::string>(), &d.family) ||
      d.family == RouterFamily::kNone) {
    bad_field(where, "family", "unknown router family " + family.dump() +
                                   " (expected mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3 or gpt_oss)");
  }
  d.top_k = require_dim(r, where, "top_k", kMaxExperts);
  d.norm_topk_prob = require_bool(r, where, "norm_topk_prob", d.family == RouterFamily::kMixtral || d.family == RouterFamily::kGptOss) ? 1 : 0;
  if (r.contains("n_group")) d.n_group = require_dim(r, where, "n_group", kMaxExperts);
  if (r.contains("topk_group")) d.topk_group = require_dim(r, where, "topk_group", kMaxExperts);
  if (auto it = r.find("routed_scaling_factor"); it != r.end()) {
    if (!it->is_number()) bad_field(where, "routed_scaling_factor", "must be a number");
    d.routed_scaling_factor = it->get<float>();
  }
  validate_router(d, n_experts, where, Status::kFormat);
  return d;
}

}  // namespace

const char* router_family_name(RouterFamily family) {
  switch (family) {
    case RouterFamily::kNone: return "none";
    case RouterFamily::kMixtral: return "mixtral";
    case RouterFamily::kQwen2Moe: return "qwen2_moe";
    case RouterFamily::kQwen3Moe: return "qwen3_moe";
    case RouterFamily::kOlmoe: return "olmoe";
    case RouterFamily::kDeepseekV2: return "deepseek_v2";
    case RouterFamily::kDeepseekV3: return "deepseek_v3";
    case RouterFamily::kGptOss: return "gpt_oss";
  }
  return "unknown";
}

bool parse_router_family(const std::string& name, RouterFamily* out) {
  for (int32_t f = 0; f <= kLastRouterFamily; ++f) {
    const auto family = static_cast<RouterFamily>(f);
    if (name == router_family_name(family)) {
      *out = family;
      return true;
    }
  }
  return false;
}

void validate_router(const RouterDesc& r, int32_t n_experts, const std::string& where,
                     Status status) {
  auto bad = [&](const std::string& what) { fail(status, where + ": " + what); };
  if (r.family < RouterFamily::kNone || r.family > RouterFamily::kGptOss) {
    bad("unknown family " + std::to_string(static_cast<int>(r.family)));
  }
  if (r.family == RouterFamily::kNone) return;
  if (r.top_k < 1 || r.top_k > n_experts) {
    bad("top_k " + std::to_string(r.top_k) + " is out of range [1, n_experts " + std::to_string(n_experts) + "]");
  }
  const bool deepseek = r.family == RouterFamily::kDeepseekV2 || r.family == RouterFamily::kDeepseekV3;
  if (!deepseek && (r.n_group > 1 || r.topk_group > 1)) bad("n_group/topk_group apply to DeepSeek routers only");
  if (r.n_group < 1 || r.n_group > n_experts || n_experts % r.n_group != 0) {
    bad("n_group " + std::to_string(r.n_group) + " must divide n_experts " + std::to_string(n_experts));
  }
  if (r.topk_group < 1 || r.topk_group > r.n_group) {
    bad("topk_group " + std::to_string(r.topk_group) + " is out of range [1, n_group " + std::to_string(r.n_group) + "]");
  }
  if (static_cast<int64_t>(r.topk_group) * (n_experts / r.n_group) < r.top_k) {
    bad("top_k " + std::to_string(r.top_k) + " exceeds the experts of topk_group " + std::to_string(r.topk_group) +
        " groups (" + std::to_string(n_experts / r.n_group) + " experts each)");
  }
  if (r.family == RouterFamily::kDeepseekV3 && r.n_group > 1 && n_experts / r.n_group < 2) {
    bad("deepseek_v3 group scores need at least 2 experts per group");
  }
  if (!(r.routed_scaling_factor > 0.0f) || !std::isfinite(r.routed_scaling_factor)) {
    bad("routed_scaling_factor must be a positive finite number");
  }
  if (!deepseek && r.routed_scaling_factor != 1.0f) bad("routed_scaling_factor applies to DeepSeek routers only");
  if (r.family == RouterFamily::kGptOss && r.norm_topk_prob == 0) {
    bad("gpt_oss weights are a softmax over the chosen experts: norm_topk_prob must be true");
  }
}

uint64_t Manifest::router_file_bytes() const {
  const uint64_t e = static_cast<uint64_t>(n_experts);
  return 4 * e * static_cast<uint64_t>(d_model) + (router_has_bias() ? 4 * e : 0);
}

uint64_t Manifest::matrix_bytes(WeightType t, int32_t rows, int32_t cols) {
  return static_cast<uint64_t>(rows) * weight_row_bytes(t, static_cast<size_t>(cols));
}

// gate and up [F][D], then down [D][F].
uint64_t Manifest::shared_file_bytes(int32_t layer) const {
  const LayerTypes t = layer_types(layer);
  return 2 * matrix_bytes(t.dtype, shared_d_ff, d_model) + matrix_bytes(t.down_dtype, d_model, shared_d_ff);
}

uint64_t Manifest::shared_gate_file_bytes() const { return 4ull * static_cast<uint64_t>(d_model); }

std::string Manifest::layer_file(int32_t layer, const char* name) const {
  if (n_layers == 1) return name;
  char buf[32];
  std::snprintf(buf, sizeof buf, "layer_%02d/", layer);
  return buf + std::string(name);
}

bool parse_dtype(const std::string& name, WeightType* out) { return parse_weight_type(name.c_str(), out); }

std::string expert_types(const Manifest& m, int32_t layer) {
  const LayerTypes t = m.layer_types(layer);
  std::string s = weight_format(t.dtype).name;
  if (t.down_dtype != t.dtype) s += std::string(" (down ") + weight_format(t.down_dtype).name + ")";
  return s;
}

bool parse_dtype_mix(const std::string& name, WeightType* out, WeightType* down) {
  if (name == "q4_k_m") {
    *out = WeightType::kQ4_K;
    *down = WeightType::kQ6_K;
    return true;
  }
  if (!parse_dtype(name, out)) return false;
  *down = *out;
  return true;
}

const char* dtype_names() {
  return "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, mxfp4, iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, "
         "iq3_xxs, iq3_s, iq4_nl, iq4_xs, fp8_e4m3, tq1_0, tq2_0";
}

std::string dtype_pair_problem(WeightType dtype, WeightType down_dtype) {
  if (dtype == down_dtype) return "";
  const bool q = weight_format(dtype).quantized;
  const bool down_q = weight_format(down_dtype).quantized;
  if (q && down_q) return "";
  return std::string("down_dtype ") + weight_format(down_dtype).name + " cannot go with dtype " +
         weight_format(dtype).name + " (a different down type is for block formats only)";
}

uint64_t Manifest::expert_bias_bytes() const {
  return expert_bias ? 4 * (2 * static_cast<uint64_t>(d_ff) + static_cast<uint64_t>(d_model)) : 0;
}

int32_t Manifest::minimum_version() const {
  if (expert_bias || activation != "swiglu") return 4;
  if (quantized() || down_dtype != dtype) return 3;
  return has_router() || has_shared() ? 2 : 1;
}

uint64_t Manifest::expert_file_bytes(int32_t layer) const {
  const LayerTypes t = layer_types(layer);
  return 2 * matrix_bytes(t.dtype, d_ff, d_model) + matrix_bytes(t.down_dtype, d_model, d_ff) + expert_bias_bytes();
}

uint64_t Manifest::max_expert_file_bytes() const {
  uint64_t most = expert_file_bytes(0);
  for (const LayerTypes& t : layer_dtypes) {
    const uint64_t b =
        2 * matrix_bytes(t.dtype, d_ff, d_model) + matrix_bytes(t.down_dtype, d_model, d_ff) + expert_bias_bytes();
    if (b > most) most = b;
  }
  return most;
}

std::string Manifest::expert_file(int32_t layer, int32_t expert) const {
  char buf[64];
  if (n_layers == 1) {
    std::snprintf(buf, sizeof buf, "expert_%02d.bin", expert);
  } else {
    std::snprintf(buf, sizeof buf, "layer_%02d/expert_%02d.bin", layer, expert);
  }
  return buf;
}

Manifest parse_manifest(const std::string& text, const std::string& source) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    // e.what() carries the byte offset; keep only that part of the message.
    fail(Status::kFormat, source + ": invalid JSON at byte " + std::to_string(e.byte) + ": " +
                                 std::string(e.what()));
  } catch (const json::exception& e) {
    // Not only syntax: a number too large for a double ("2e4708314") is an
    // out_of_range thrown by the parser. Found by fuzz_manifest.
    fail(Status::kFormat, source + ": invalid JSON: " + std::string(e.what()));
  }
  if (!doc.is_object()) fail(Status::kFormat, source + ": top level must be a JSON object");

  const json& format = require(doc, source, "format");
  if (!format.is_string() || format.get<std::string>() != kManifestFormat) {
    bad_field(source, "format", std::string("must be \"") + kManifestFormat + "\"");
  }
  Manifest m;
  const json& version = require(doc, source, "version");
  if (!version.is_number_integer()) bad_field(source, "version", "must be an integer");
  if (version.get<int64_t>() < 1 || version.get<int64_t>() > kManifestVersion) {
    bad_field(source, "version", "unsupported version " + version.dump() + " (this build reads 1 to 3)");
  }
  m.version = static_cast<int32_t>(version.get<int64_t>());
  m.n_layers = require_dim(doc, source, "n_layers", kMaxLayers);
  m.n_experts = require_dim(doc, source, "n_experts", kMaxExperts);
  m.d_model = require_dim(doc, source, "d_model", kMaxDim);
  m.d_ff = require_dim(doc, source, "d_ff", kMaxDim);

  const json& dtype = require(doc, source, "dtype");
  if (!dtype.is_string() || !parse_dtype(dtype.get<std::string>(), &m.dtype)) {
    bad_field(source, "dtype", "unknown dtype " + dtype.dump() + " (expected one of " + dtype_names() + ")");
  }
  m.down_dtype = m.dtype;
  if (auto it = doc.find("down_dtype"); it != doc.end()) {
    if (!it->is_string() || !parse_dtype(it->get<std::string>(), &m.down_dtype)) {
      bad_field(source, "down_dtype", "unknown dtype " + it->dump() + " (expected one of " + dtype_names() + ")");
    }
  }
  if (const std::string why = dtype_pair_problem(m.dtype, m.down_dtype); !why.empty()) bad_field(source, "down_dtype", why);
  if (m.version < 3 && (m.quantized() || m.down_dtype != m.dtype)) {
    bad_field(source, "dtype", "block-quantised weights need \"version\": 3");
  }
  if (auto it = doc.find("layer_dtypes"); it != doc.end()) {
    if (m.version < 3 || !m.quantized()) bad_field(source, "layer_dtypes", "is for block formats in \"version\": 3");
    if (!it->is_array() || it->size() != static_cast<size_t>(m.n_layers)) {
      bad_field(source, "layer_dtypes", "must be an array of n_layers (" + std::to_string(m.n_layers) + ") entries");
    }
    for (size_t l = 0; l < it->size(); ++l) {
      const json& e = (*it)[l];
      const std::string where = "layer_dtypes[" + std::to_string(l) + "]";
      LayerTypes t;
      if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_string() ||
          !parse_dtype(e[0].get<std::string>(), &t.dtype) || !parse_dtype(e[1].get<std::string>(), &t.down_dtype)) {
        bad_field(source, where, "must be [dtype, down_dtype], both one of " + std::string(dtype_names()));
      }
      if (!weight_format(t.dtype).quantized || !weight_format(t.down_dtype).quantized) {
        bad_field(source, where, "must name block formats");
      }
      if (l == 0 && !(t == LayerTypes{m.dtype, m.down_dtype})) {
        bad_field(source, where, "must equal dtype / down_dtype");
      }
      m.layer_dtypes.push_back(t);
    }
  }
  const json& activation = require(doc, source, "activation");
  if (!activation.is_string() ||
      (activation.get<std::string>() != "swiglu" && activation.get<std::string>() != "clamped_swiglu")) {
    bad_field(source, "activation",
              "unknown activation " + activation.dump() + " (expected \"swiglu\" or \"clamped_swiglu\")");
  }
  m.activation = activation.get<std::string>();
  if (m.version < 4 && m.clamped_swiglu()) bad_field(source, "activation", "clamped_swiglu needs \"version\": 4");
  for (const auto& [field, value] : {std::pair{"swiglu_alpha", &m.swiglu_alpha}, std::pair{"swiglu_limit", &m.swiglu_limit}}) {
    auto it = doc.find(field);
    if (it == doc.end()) continue;
    if (!m.clamped_swiglu()) bad_field(source, field, "applies to \"activation\": \"clamped_swiglu\" only");
    if (!it->is_number() || !std::isfinite(it->get<double>()) || !(it->get<double>() > 0.0) ||
        it->get<double>() > 1e30) {
      bad_field(source, field, "must be a positive finite number");
    }
    *value = it->get<float>();
  }
  m.expert_bias = require_bool(doc, source, "expert_bias", false);
  if (m.version < 4 && m.expert_bias) bad_field(source, "expert_bias", "needs \"version\": 4");

  // Multiply step by step, checking against the limit before each product:
  // the factors are bounded, but their full product can exceed 64 bits.
  uint64_t total = m.max_expert_file_bytes();  // < 3 * 2^40 * 4: fits
  for (const uint64_t factor : {static_cast<uint64_t>(m.n_experts), static_cast<uint64_t>(m.n_layers)}) {
    if (total > kMaxModelBytes || total > kMaxModelBytes / factor) {
      fail(Status::kFormat, source + ": dimensions too large: n_layers * n_experts * 3 * d_model * "
                                        "d_ff * sizeof(dtype) exceeds " + std::to_string(kMaxModelBytes) +
                                        " bytes");
    }
    total *= factor;
  }

  if (m.version >= 2) {
    if (auto it = doc.find("router"); it != doc.end() && !it->is_null()) {
      m.router = parse_router(*it, source, m.n_experts);
    }
    if (auto it = doc.find("shared_expert"); it != doc.end() && !it->is_null()) {
      if (!it->is_object()) bad_field(source, "shared_expert", "must be an object");
      m.shared_d_ff = require_dim(*it, source + ": shared_expert", "d_ff", kMaxDim);
      m.shared_gate = require_bool(*it, source + ": shared_expert", "gate", false);
      if (m.shared_file_bytes(0) > kMaxModelBytes / static_cast<uint64_t>(m.n_layers) / 2) {
        fail(Status::kFormat, source + ": shared expert too large");
      }
      if (m.expert_bias || m.clamped_swiglu()) {
        bad_field(source, "shared_expert", "cannot go with expert_bias or clamped_swiglu (no model family has both)");
      }
    }
    if (auto it = doc.find("source"); it != doc.end()) m.source_json = it->dump();
  } else {
    for (const char* v2_field : {"router", "shared_expert"}) {
      if (doc.contains(v2_field)) bad_field(source, v2_field, "needs \"version\": 2");
    }
  }

  if (auto it = doc.find("checksums"); it != doc.end()) {
    if (!it->is_object()) bad_field(source, "checksums", "must be an object");
    for (const auto& [file, value] : it->items()) {
      const std::string field = "checksums." + file;
      // Only the model's own files: a key like "../x" must not make us read
      // outside the directory.
      if (!names_model_file(m, file)) bad_field(source, field, "names no weight file of this model");
      if (!value.is_string()) bad_field(source, field, "must be a string \"xxh64:<16 hex>\"");
      const auto hash = parse_checksum(value.get<std::string>());
      if (!hash) bad_field(source, field, "malformed checksum " + value.dump() + " (expected \"xxh64:<16 hex>\")");
      m.checksums[file] = *hash;
    }
  }
  return m;
}

Manifest load_manifest(const std::string& model_dir) {
  const std::string path = model_dir + "/" + kManifestName;
  return parse_manifest(read_small_file(path, kMaxManifestBytes), path);
}

bool verify_manifest_checksum(const std::string& model_dir) {
  const std::string sum_path = model_dir + "/" + kManifestChecksumName;
  struct stat st {};
  if (::stat(sum_path.c_str(), &st) != 0) return false;
  std::string text = read_small_file(sum_path, 256);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  const auto want = parse_checksum(text);
  if (!want) fail(Status::kFormat, sum_path + ": malformed checksum (expected \"xxh64:<16 hex>\")");
  const std::string path = model_dir + "/" + kManifestName;
  const std::string manifest = read_small_file(path, kMaxManifestBytes);
  const uint64_t actual = xxh64(manifest.data(), manifest.size());
  if (actual != *want) {
    fail(Status::kChecksum, path + ": checksum mismatch: " + kManifestChecksumName + " says " +
                                   format_checksum(*want) + ", file is " + format_checksum(actual));
  }
  return true;
}

void write_manifest(const std::string& model_dir, const Manifest& m) {
  const std::string text = manifest_to_json(m);
  write_file_atomic(model_dir + "/" + kManifestName, text.data(), text.size());
  const std::string sum = format_checksum(xxh64(text.data(), text.size())) + "\n";
  write_file_atomic(model_dir + "/" + kManifestChecksumName, sum.data(), sum.size());
}

std::string manifest_to_json(const Manifest& m) {
  json doc;
  doc["format"] = kManifestFormat;
  doc["version"] = m.version;
  doc["n_layers"] = m.n_layers;
  doc["n_experts"] = m.n_experts;
  doc["d_model"] = m.d_model;
  doc["d_ff"] = m.d_ff;
  doc["dtype"] = weight_format(m.dtype).name;
  if (m.down_dtype != m.dtype) doc["down_dtype"] = weight_format(m.down_dtype).name;
  if (!m.layer_dtypes.empty()) {
    json types = json::array();
    for (const LayerTypes& t : m.layer_dtypes) types.push_back({weight_format(t.dtype).name, weight_format(t.down_dtype).name});
    doc["layer_dtypes"] = types;
  }
  doc["activation"] = m.activation;
  if (m.clamped_swiglu()) {
    doc["swiglu_alpha"] = m.swiglu_alpha;
    doc["swiglu_limit"] = m.swiglu_limit;
  }
  if (m.expert_bias) doc["expert_bias"] = true;
  if (m.has_router()) {
    const RouterDesc& r = m.router;
    doc["router"] = {{"family", router_family_name(r.family)},
                     {"top_k", r.top_k},
                     {"norm_topk_prob", r.norm_topk_prob != 0},
                     {"n_group", r.n_group},
                     {"topk_group", r.topk_group},
                     {"routed_scaling_factor", r.routed_scaling_factor}};
  }
  if (m.has_shared()) doc["shared_expert"] = {{"d_ff", m.shared_d_ff}, {"gate", m.shared_gate}};
  if (!m.source_json.empty()) doc["source"] = json::parse(m.source_json);
  if (!m.checksums.empty()) {
    json sums = json::object();
    for (const auto& [file, hash] : m.checksums) sums[file] = format_checksum(hash);
    doc["checksums"] = sums;
  }
  return doc.dump(2) + "\n";
}

}  // namespace colibri
