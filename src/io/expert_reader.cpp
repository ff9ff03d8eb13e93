#include "io/expert_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "io/checksum.h"
#include "util/error.h"

namespace colibri {

namespace {

// O_DIRECT wants buffer, offset and length aligned to the device's logical
// block; 4 KiB covers every block size in use.
constexpr uint64_t kDirectAlign = 4096;

uint64_t align_down(uint64_t v) { return v / kDirectAlign * kDirectAlign; }
uint64_t align_up(uint64_t v) { return (v + kDirectAlign - 1) / kDirectAlign * kDirectAlign; }

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads [offset, offset + n) into out; returns bytes read (fewer only at
// end of file). -1 with errno on failure.
ssize_t pread_all(int fd, uint8_t* out, size_t n, uint64_t offset) {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return static_cast<ssize_t>(done);
}

}  // namespace

uint64_t expert_parts_checksum(const uint8_t* const* parts, const ExpertLocation& loc) {
  if (loc.n_parts == 1) return xxh64(parts[0], static_cast<size_t>(loc.part[0].bytes));
  uint64_t each[6];
  for (int i = 0; i < loc.n_parts; ++i) each[i] = xxh64(parts[i], static_cast<size_t>(loc.part[i].bytes));
  return xxh64(each, sizeof(uint64_t) * static_cast<size_t>(loc.n_parts));
}

size_t ExpertReader::staging_bytes(const ExpertLocation& loc) {
  uint64_t total = 0;
  for (int i = 0; i < loc.n_parts; ++i) {
    const FileExtent& p = loc.part[i];
    total += align_up(p.offset + p.bytes) - align_down(p.offset);
  }
  return static_cast<size_t>(total);
}

ExpertReader::ExpertReader(size_t max_staging, bool direct_io) : staging_(max_staging), direct_io_(direct_io) {}

namespace {

// One open file of a read: O_DIRECT where the filesystem takes it, its size
// checked against what it measured at open.
class OpenedFile {
 public:
  OpenedFile(const std::string& path, uint64_t size_at_open, bool direct_io) : path_(path) {
    if (direct_io) {
      fd_.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      direct_ = fd_.fd >= 0;
    }
    // tmpfs and some network filesystems refuse O_DIRECT: read through the
    // page cache and drop the pages afterwards.
    if (fd_.fd < 0) fd_.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_.fd < 0) fail(Status::kIo, errno_message(path + ": cannot open expert weights", errno));
    struct stat st {};
    if (::fstat(fd_.fd, &st) != 0) fail(Status::kIo, errno_message(path + ": cannot stat", errno));
    if (static_cast<uint64_t>(st.st_size) != size_at_open) {
      fail(Status::kFormat, path + ": changed while the model is open: " + std::to_string(st.st_size) +
                                " bytes, " + std::to_string(size_at_open) + " at open");
    }
  }
  bool direct() const { return direct_; }

  // [begin, begin + span) (aligned) into out; returns the bytes read.
  uint64_t read(uint8_t* out, uint64_t span, uint64_t begin) {
    ssize_t got = pread_all(fd_.fd, out, static_cast<size_t>(span), begin);
    if (got < 0 && direct_ && errno == EINVAL) {
      // The filesystem accepted O_DIRECT at open but not this read.
      const int buffered = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
      if (buffered < 0) fail(Status::kIo, errno_message(path_ + ": cannot open expert weights", errno));
      ::close(fd_.fd);
      fd_.fd = buffered;
      direct_ = false;
      got = pread_all(fd_.fd, out, static_cast<size_t>(span), begin);
    }
    if (got < 0) fail(Status::kIo, errno_message(path_ + ": read failed", errno));
    if (!direct_) ::posix_fadvise(fd_.fd, static_cast<off_t>(begin), static_cast<off_t>(span), POSIX_FADV_DONTNEED);
    return static_cast<uint64_t>(got);
  }

 private:
  std::string path_;
  Fd fd_;
  bool direct_ = false;
};

}  // namespace

void ExpertReader::read(const ExpertFiles& files, const ExpertLocation& loc, const uint8_t* parts[6],
                        ReadCounters* counters) {
  std::unique_ptr<OpenedFile> file;
  int32_t open_index = -1;
  bool all_direct = true;
  uint8_t* at = staging_.data();
  for (int i = 0; i < loc.n_parts; ++i) {
    const FileExtent& p = loc.part[i];
    const std::string& path = files.paths[static_cast<size_t>(p.file)];
    if (p.file != open_index) {
      file = std::make_unique<OpenedFile>(path, files.sizes[static_cast<size_t>(p.file)], direct_io_);
      open_index = p.file;
    }
    const uint64_t begin = align_down(p.offset);
    const uint64_t span = align_up(p.offset + p.bytes) - begin;
    const uint64_t have = begin + file->read(at, span, begin);
    all_direct &= file->direct();
    if (have < p.offset + p.bytes) {
      fail(Status::kFormat, path + ": truncated while the model is open: bytes " + std::to_string(p.offset) + "-" +
                                std::to_string(p.offset + p.bytes) + " of expert weights, the file ends at " +
                                std::to_string(have));
    }
    parts[i] = at + (p.offset - begin);
    at += span;
    if (counters != nullptr) counters->bytes += p.bytes;
  }
  if (counters != nullptr) ++(all_direct ? counters->direct_reads : counters->buffered_reads);
}

}  // namespace colibri
