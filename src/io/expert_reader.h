// On-demand reads of one expert's bytes from the model's files, for the
// expert cache (moe/expert_cache.h). Files are opened per read (O_DIRECT
// where the filesystem takes it, so the page cache does not hold a second
// copy) and read, never mapped: a file shortened or replaced while the
// model runs gives an Error from the read, not SIGBUS.
//
// Two engines. pread: the expert's parts one after another, one request in
// flight per reader. io_uring (liburing, where the build has it and the
// kernel allows it): the parts cut into 2 MiB pieces, all in flight at once
// on the reader's own ring, so a few readers keep many requests at the
// device. Measured equal within noise at the same experts in flight
// (docs/CACHE.md), so pread is the default.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "util/aligned_vector.h"

namespace colibri {

struct FileExtent {
  int32_t file = -1;  // index into ExpertFiles
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// Where one expert's bytes are. One part: a whole expert file (gate, up,
// down[, biases], the model directory's layout). Several parts: gate, up,
// down[, gate bias, up bias, down bias] tensor slices of a larger file (a
// GGUF's expert tensors, in one file or several of a split set).
struct ExpertLocation {
  int32_t n_parts = 0;
  FileExtent part[6];
  bool has_checksum = false;  // of the parts' bytes (expert_parts_checksum)
  uint64_t checksum = 0;
};

struct ExpertFiles {
  std::vector<std::string> paths;
  std::vector<uint64_t> sizes;  // what each file measured at open
};

// xxh64 of a whole expert file for one part (so it equals the manifest's
// checksum), else of the parts' xxh64 values in order.
uint64_t expert_parts_checksum(const uint8_t* const* parts, const ExpertLocation& loc);

struct ReadCounters {
  uint64_t bytes = 0;         // read from the files
  uint64_t direct_reads = 0;  // reads that bypassed the page cache
  uint64_t buffered_reads = 0;
  uint64_t uring_reads = 0;   // reads through io_uring
};

enum class IoEngine {
  kPread,
  kIoUring,  // refused where not usable
};

// Whether this build and kernel can run io_uring reads; *why says why not.
bool io_uring_usable(std::string* why);

// One reader's staging buffer and file access. Not thread-safe: the cache
// gives each reader thread its own.
class ExpertReader {
 public:
  // `max_staging`: the largest staging_bytes() of any location it will
  // read. Throws Error(kUnsupported) for IoEngine::kIoUring where
  // io_uring is not usable.
  ExpertReader(size_t max_staging, bool direct_io, IoEngine engine = IoEngine::kPread);
  ~ExpertReader();
  ExpertReader(const ExpertReader&) = delete;
  ExpertReader& operator=(const ExpertReader&) = delete;

  // Reads loc's parts; parts[i] points into the staging buffer, valid until
  // the next read. Throws Error(kIo) when a file cannot be opened or read,
  // Error(kFormat) when it is shorter than the part or its size changed
  // since open, naming the file.
  void read(const ExpertFiles& files, const ExpertLocation& loc, const uint8_t* parts[6], ReadCounters* counters);

  // Staging bytes a location needs (each part on its own aligned span).
  static size_t staging_bytes(const ExpertLocation& loc);

 private:
  struct Ring;
  void read_uring(const ExpertFiles& files, const ExpertLocation& loc, const uint8_t* parts[6], ReadCounters* counters);

  std::vector<uint8_t, AlignedAllocator<uint8_t, 4096>> staging_;  // page-aligned for O_DIRECT
  bool direct_io_;
  std::unique_ptr<Ring> ring_;  // null: pread
};

}  // namespace colibri
