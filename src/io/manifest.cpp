#include "io/manifest.h"

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
  fail(COLIBRI_ERR_FORMAT, source + ": field \"" + field + "\": " + what);
}

const json& require(const json& doc, const std::string& source, const char* field) {
  auto it = doc.find(field);
  if (it == doc.end()) fail(COLIBRI_ERR_FORMAT, source + ": missing field \"" + field + "\"");
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

// True if `file` is exactly the name of one of the model's expert files.
// Parsed rather than enumerated: a model may have millions of experts.
bool names_expert_file(const Manifest& m, const std::string& file) {
  int layer = 0, expert = 0, consumed = 0;
  if (m.n_layers == 1) {
    if (std::sscanf(file.c_str(), "expert_%d.bin%n", &expert, &consumed) != 1) return false;
  } else if (std::sscanf(file.c_str(), "layer_%d/expert_%d.bin%n", &layer, &expert, &consumed) != 2) {
    return false;
  }
  if (consumed != static_cast<int>(file.size())) return false;
  if (layer < 0 || layer >= m.n_layers || expert < 0 || expert >= m.n_experts) return false;
  return m.expert_file(layer, expert) == file;  // rejects "expert_3.bin", "expert_+03.bin"
}

}  // namespace

bool parse_dtype(const std::string& name, colibri_dtype_t* out) {
  if (name == "f32") *out = COLIBRI_DTYPE_F32;
  else if (name == "f16") *out = COLIBRI_DTYPE_F16;
  else if (name == "bf16") *out = COLIBRI_DTYPE_BF16;
  else return false;
  return true;
}

uint64_t Manifest::expert_file_bytes() const {
  return 3ull * static_cast<uint64_t>(d_model) * static_cast<uint64_t>(d_ff) * dtype_size();
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
    fail(COLIBRI_ERR_FORMAT, source + ": invalid JSON at byte " + std::to_string(e.byte) + ": " +
                                 std::string(e.what()));
  }
  if (!doc.is_object()) fail(COLIBRI_ERR_FORMAT, source + ": top level must be a JSON object");

  const json& format = require(doc, source, "format");
  if (!format.is_string() || format.get<std::string>() != kManifestFormat) {
    bad_field(source, "format", std::string("must be \"") + kManifestFormat + "\"");
  }
  Manifest m;
  const json& version = require(doc, source, "version");
  if (!version.is_number_integer()) bad_field(source, "version", "must be an integer");
  if (version.get<int64_t>() != kManifestVersion) {
    bad_field(source, "version", "unsupported version " + version.dump() + " (this build reads 1)");
  }
  m.version = kManifestVersion;
  m.n_layers = require_dim(doc, source, "n_layers", kMaxLayers);
  m.n_experts = require_dim(doc, source, "n_experts", kMaxExperts);
  m.d_model = require_dim(doc, source, "d_model", kMaxDim);
  m.d_ff = require_dim(doc, source, "d_ff", kMaxDim);

  const json& dtype = require(doc, source, "dtype");
  if (!dtype.is_string() || !parse_dtype(dtype.get<std::string>(), &m.dtype)) {
    bad_field(source, "dtype", "unknown dtype " + dtype.dump() + " (expected \"f16\", \"bf16\" or \"f32\")");
  }
  const json& activation = require(doc, source, "activation");
  if (!activation.is_string() || activation.get<std::string>() != "swiglu") {
    bad_field(source, "activation", "unknown activation " + activation.dump() + " (expected \"swiglu\")");
  }

  // Multiply step by step, checking against the limit before each product:
  // the factors are bounded, but their full product can exceed 64 bits.
  uint64_t total = m.expert_file_bytes();  // < 3 * 2^40 * 4: fits
  for (const uint64_t factor : {static_cast<uint64_t>(m.n_experts), static_cast<uint64_t>(m.n_layers)}) {
    if (total > kMaxModelBytes || total > kMaxModelBytes / factor) {
      fail(COLIBRI_ERR_FORMAT, source + ": dimensions too large: n_layers * n_experts * 3 * d_model * "
                                        "d_ff * sizeof(dtype) exceeds " + std::to_string(kMaxModelBytes) +
                                        " bytes");
    }
    total *= factor;
  }

  if (auto it = doc.find("checksums"); it != doc.end()) {
    if (!it->is_object()) bad_field(source, "checksums", "must be an object");
    for (const auto& [file, value] : it->items()) {
      const std::string field = "checksums." + file;
      // Only the model's own files: a key like "../x" must not make us read
      // outside the directory.
      if (!names_expert_file(m, file)) bad_field(source, field, "names no expert file of this model");
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

std::string manifest_to_json(const Manifest& m) {
  json doc;
  doc["format"] = kManifestFormat;
  doc["version"] = m.version;
  doc["n_layers"] = m.n_layers;
  doc["n_experts"] = m.n_experts;
  doc["d_model"] = m.d_model;
  doc["d_ff"] = m.d_ff;
  doc["dtype"] = colibri_dtype_name(m.dtype);
  doc["activation"] = m.activation;
  if (!m.checksums.empty()) {
    json sums = json::object();
    for (const auto& [file, hash] : m.checksums) sums[file] = format_checksum(hash);
    doc["checksums"] = sums;
  }
  return doc.dump(2) + "\n";
}

}  // namespace colibri
