// Read-only memory map of a whole file. The mapping lives only while the
// model is being opened: weights are copied into the packed layout and the
// file is unmapped, so a file that changes on disk later cannot fault a
// running model (SIGBUS on a truncated mapping).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>
#include "util/error.h"

namespace colibri {

class MappedFile {
 public:
  MappedFile() = default;
  // Throws Error(Status::kIo) naming the path when it cannot be opened.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Drops the whole pages inside [p, p + n) from this process's memory
  // (they are read again if touched): a reader done with a part of a large
  // file keeps its RSS bounded. Ignores ranges outside the mapping.
  void release(const void* p, size_t n) const;
  const std::string& path() const { return path_; }

 private:
  void reset() noexcept;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Opens a regular file read-only; *size receives its size. Throws
// Error(Status::kIo) naming the path. The caller closes the descriptor.
int open_regular_file(const std::string& path, uint64_t* size);

// Reads up to n bytes at offset (retrying short reads); returns how many
// were read, fewer only at the end of the file. Throws Error(Status::kIo).
size_t read_at(int fd, const std::string& path, uint64_t offset, uint8_t* out, size_t n);

// Whole file into memory (for small files: manifests, routing). Throws
// Error(Status::kIo) on failure, Error(Status::kFormat) if larger than
// max_bytes.
std::string read_small_file(const std::string& path, size_t max_bytes);

// Reads exactly `expected_bytes` of `path` into `buffer` (resized). Read,
// not mapped: a file truncated or replaced while we read it gives an error
// (Error(Status::kFormat) naming the path), never SIGBUS. Throws
// Error(Status::kIo) when the file cannot be opened or read.
void read_file_exact(const std::string& path, uint64_t expected_bytes, std::vector<uint8_t>& buffer);

// Writes `data` to `path` through a temporary file in the same directory and
// rename(), so readers never see a partial file and a failure leaves none.
void write_file_atomic(const std::string& path, const void* data, size_t size);

}  // namespace colibri
