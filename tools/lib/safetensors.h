// Reader for safetensors files (the Hugging Face checkpoint format): an
// 8-byte little-endian header length N, N bytes of JSON describing each
// tensor (dtype, shape, data_offsets relative to the end of the header), then
// the raw little-endian tensor bytes.
//
// Checkpoints come from anywhere, so the parser trusts nothing: the header
// length, every tensor's dtype, shape and offsets are checked (offsets inside
// the file, size == product(shape) * dtype size with no overflow, no two
// tensors overlapping) before any tensor byte is touched. Every violation is
// an Error(Status::kFormat) naming the file and the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>
#include "util/error.h"


namespace colibri {

// Larger headers are refused before being read: real ones are a few MB at
// most, and the bound keeps a hostile length from allocating much.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull * 1000 * 1000;

enum class StDtype {
  kF64, kF32, kF16, kBF16,
  kI64, kI32, kI16, kI8, kU64, kU32, kU16, kU8, kBool,
  kF8E4M3, kF8E5M2, kF8E8M0,
};

// The format's dtype names: "F32", "BF16", ...; false for an unknown name.
bool parse_st_dtype(const std::string& name, StDtype* out);
const char* st_dtype_name(StDtype dtype);
size_t st_dtype_size(StDtype dtype);

struct StTensor {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<uint64_t> shape;
  uint64_t n_elements = 0;  // product of shape (1 for a scalar)
  uint64_t offset = 0;      // from the start of the file
  uint64_t n_bytes = 0;
};

struct StHeader {
  std::vector<StTensor> tensors;  // in header (name) order
  uint64_t data_start = 0;        // 8 + header length
};

// Parses and checks the header of the safetensors bytes [data, data + size);
// `source` (normally the path) starts every error message.
StHeader parse_safetensors(const uint8_t* data, size_t size, const std::string& source);
// The same when only the file's first `available` bytes are at `data` (the
// header): `size` is the whole file's, for the offset checks. Reads no byte
// at or past `available`; a header longer than that is refused.
StHeader parse_safetensors(const uint8_t* data, size_t size, size_t available, const std::string& source);

// A checked safetensors file, read with pread (not mapped: a checkpoint
// truncated while it is converted gives an error, not SIGBUS). Tensor data
// is read through read_floats, one slice at a time, so a conversion never
// needs more than the slice in memory.
class SafetensorsFile {
 public:
  // Throws Error(Status::kIo) when the file cannot be opened or read,
  // Error(Status::kFormat) for a malformed one.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<StTensor>& tensors() const { return header_.tensors; }
  const StTensor* find(const std::string& name) const;

  // Converts elements [first, first + count) of `t` (a tensor of this file)
  // to float32, exactly; only F32, F16 and BF16 are accepted
  // (Error(Status::kFormat) otherwise).
  void read_floats(const StTensor& t, uint64_t first, uint64_t count, float* out) const;
  // Bytes [first, first + count) of a one-byte tensor (U8: packed codes
  // and scales; F8_E4M3: FP8 codes), as stored.
  void read_u8(const StTensor& t, uint64_t first, uint64_t count, uint8_t* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  StHeader header_;
  std::unordered_map<std::string, size_t> index_;
};

// Exact conversion of `count` little-endian values of `dtype` (F32, F16 or
// BF16) at `src` to float32.
void st_to_floats(StDtype dtype, const uint8_t* src, size_t count, float* out);

}  // namespace colibri
