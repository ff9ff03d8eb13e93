// Reader for GGUF files (llama.cpp's model format, versions 2 and 3, little
// endian): a header (magic "GGUF", version, tensor and key/value counts),
// the key/value metadata, the tensor table (name, dimensions, ggml type,
// offset into the data section), then the tensor data from the first
// multiple of general.alignment (default 32) after the table.
//
// The format is small and files come from anywhere, so this parser is ours
// and trusts nothing: every length and count is checked against the bytes
// that are left before it is used, sizes are computed without overflow,
// keys and tensor names must be unique, every tensor's data must lie inside
// the file at an aligned offset without overlapping another's, and its
// first dimension must hold whole blocks of its type. Every violation is an
// Error(Status::kFormat) naming the file and the key or tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/mapped_file.h"

namespace colibri {

// Metadata value types, as GGUF numbers them.
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
const char* gguf_type_name(GgufType t);

// ggml tensor types (the values GGUF stores) that Colibri computes on.
namespace ggml_type {
inline constexpr uint32_t kF32 = 0;
inline constexpr uint32_t kF16 = 1;
inline constexpr uint32_t kQ4_0 = 2;
inline constexpr uint32_t kQ4_1 = 3;
inline constexpr uint32_t kQ5_0 = 6;
inline constexpr uint32_t kQ5_1 = 7;
inline constexpr uint32_t kQ8_0 = 8;
inline constexpr uint32_t kQ2_K = 10;
inline constexpr uint32_t kQ3_K = 11;
inline constexpr uint32_t kQ4_K = 12;
inline constexpr uint32_t kQ5_K = 13;
inline constexpr uint32_t kQ6_K = 14;
inline constexpr uint32_t kIQ2_XXS = 16;
inline constexpr uint32_t kIQ2_XS = 17;
inline constexpr uint32_t kIQ3_XXS = 18;
inline constexpr uint32_t kIQ1_S = 19;
inline constexpr uint32_t kIQ4_NL = 20;
inline constexpr uint32_t kIQ3_S = 21;
inline constexpr uint32_t kIQ2_S = 22;
inline constexpr uint32_t kIQ4_XS = 23;
inline constexpr uint32_t kIQ1_M = 29;
inline constexpr uint32_t kBF16 = 30;
inline constexpr uint32_t kTQ1_0 = 34;
inline constexpr uint32_t kTQ2_0 = 35;
inline constexpr uint32_t kMXFP4 = 39;
}  // namespace ggml_type

// Elements and bytes per block of a ggml type, and its name ("Q4_K");
// false for a value no ggml release has defined (or that was removed).
bool ggml_type_size(uint32_t type, uint32_t* block_elements, uint32_t* block_bytes);
std::string ggml_type_name(uint32_t type);

struct GgufValue {
  GgufType type = GgufType::kUint8;
  // Scalars: integers in `i` (and, when non-negative, `u`), floats in `f`,
  // bools as 0/1 in all three; strings in `s`.
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  bool is_negative = false;  // an integer below zero (`u` is then 0)
  std::string s;
  // Arrays: element type and count; integer and float elements are kept in
  // `numbers` (strings and nested arrays are checked and skipped).
  GgufType element_type = GgufType::kUint8;
  uint64_t count = 0;
  std::vector<double> numbers;

  bool is_integer() const;
  bool is_number() const { return is_integer() || type == GgufType::kFloat32 || type == GgufType::kFloat64; }
};

struct GgufTensor {
  std::string name;
  uint32_t n_dims = 0;
  uint64_t ne[4] = {1, 1, 1, 1};  // ne[0] varies fastest (a row)
  uint32_t type = 0;              // ggml type as stored
  uint64_t offset = 0;            // from the start of the file
  uint64_t bytes = 0;
  uint64_t rows() const { return ne[1] * ne[2] * ne[3]; }
};

// Larger counts are refused before anything is allocated for them: real
// files hold a few thousand tensors and keys.
inline constexpr uint64_t kMaxGgufTensors = 1u << 20;
inline constexpr uint64_t kMaxGgufKeys = 1u << 20;

// A parsed GGUF file: metadata, tensor table, and (for open) the mapping.
class GgufFile {
 public:
  // Maps `path` and parses it; throws Error(kIo) when it cannot be read,
  // Error(kFormat) naming the file and key or tensor when it is malformed.
  static GgufFile open(const std::string& path);
  // Parses the bytes [data, data + size), which must outlive the result;
  // `source` starts every error message (fuzzing, tests).
  static GgufFile parse(const uint8_t* data, size_t size, const std::string& source);

  GgufFile() = default;
  GgufFile(GgufFile&&) noexcept = default;
  GgufFile& operator=(GgufFile&&) noexcept = default;

  const std::string& source() const { return source_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  uint64_t size() const { return size_; }

  const std::vector<std::string>& keys() const { return key_order_; }
  const GgufValue* find(const std::string& key) const;
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* tensor(const std::string& name) const;
  // The tensor's bytes (inside the file, checked at parse time).
  const uint8_t* data(const GgufTensor& t) const { return bytes_ + t.offset; }
  // Where p lies in the file, when [p, p + n) is inside it (readers that
  // go back to the file for a tensor's bytes, moe/expert_cache.h).
  bool file_offset(const void* p, uint64_t n, uint64_t* offset) const {
    const auto* b = static_cast<const uint8_t*>(p);
    if (bytes_ == nullptr || b < bytes_ || b > bytes_ + size_ || n > static_cast<uint64_t>(bytes_ + size_ - b)) return false;
    *offset = static_cast<uint64_t>(b - bytes_);
    return true;
  }
  // Drops a tensor's pages from memory once it has been copied (opened
  // files only; MappedFile::release).
  void release(const GgufTensor& t) const { file_.release(data(t), static_cast<size_t>(t.bytes)); }
  // The same for any range; ranges outside this file are ignored.
  void release(const void* p, size_t n) const { file_.release(p, n); }

  // Typed metadata: nullopt-style lookups that throw Error(kFormat) naming
  // the file and key when the key is present with a value of another kind.
  bool get_string(const std::string& key, std::string* out) const;
  bool get_uint(const std::string& key, uint64_t* out) const;  // a non-negative integer
  bool get_float(const std::string& key, double* out) const;   // any number
  bool get_bool(const std::string& key, bool* out) const;      // a bool (or a 0/1 integer)

 private:
  MappedFile file_;
  const uint8_t* bytes_ = nullptr;
  uint64_t size_ = 0;
  std::string source_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::unordered_map<std::string, GgufValue> values_;
  std::vector<std::string> key_order_;
  std::vector<GgufTensor> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;

  void parse_bytes();
};

}  // namespace colibri
