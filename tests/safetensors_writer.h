// A minimal safetensors writer for the tests, independent of the reader
// under test: tensors are laid out back to back in the order given, and
// the header is padded with spaces to a multiple of 8 bytes as the
// reference implementation does.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "util/half.h"

namespace colibri_test {

inline std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
  return s;
}

// Bytes of `values` as little-endian "F32", "F16" or "BF16".
inline std::string encode_values(const std::string& dtype, const std::vector<float>& values) {
  std::string out;
  for (float v : values) {
    if (dtype == "F32") {
      const uint32_t u = colibri::float_bits(v);
      for (int b = 0; b < 4; ++b) out.push_back(static_cast<char>(u >> (8 * b)));
    } else {
      const uint16_t h = dtype == "F16" ? colibri::float_to_f16(v) : colibri::float_to_bf16(v);
      out.push_back(static_cast<char>(h));
      out.push_back(static_cast<char>(h >> 8));
    }
  }
  return out;
}

// `values` rounded to what `dtype` can hold, so a test knows exactly what
// the checkpoint stores.
inline std::vector<float> round_to(const std::string& dtype, std::vector<float> values) {
  for (float& v : values) {
    if (dtype == "F16") v = colibri::f16_to_float(colibri::float_to_f16(v));
    else if (dtype == "BF16") v = colibri::bf16_to_float(colibri::float_to_bf16(v));
  }
  return values;
}

inline std::vector<float> random_values(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

struct StEntry {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::string bytes;
};

// Header text and data as given, behind the 8-byte length.
inline std::string raw_safetensors(const std::string& header, const std::string& data = "") {
  return le64(header.size()) + header + data;
}

inline std::string safetensors_bytes(const std::vector<StEntry>& tensors,
                                     const nlohmann::json& metadata = nullptr) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  std::string data;
  for (const StEntry& t : tensors) {
    const uint64_t begin = data.size();
    data += t.bytes;
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  return raw_safetensors(text, data);
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace colibri_test
