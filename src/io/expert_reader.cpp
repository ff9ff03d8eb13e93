#include "io/expert_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#if defined(COLIBRI_HAVE_LIBURING)
#include <liburing.h>
#endif

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
    drop_cached(begin, span);
    return static_cast<uint64_t>(got);
  }

  int fd() const { return fd_.fd; }
  const std::string& path() const { return path_; }
  // Buffered reads leave the page cache holding the bytes: drop them, the
  // slot is the only copy the cache wants.
  void drop_cached(uint64_t begin, uint64_t span) const {
    if (!direct_) ::posix_fadvise(fd_.fd, static_cast<off_t>(begin), static_cast<off_t>(span), POSIX_FADV_DONTNEED);
  }

 private:
  std::string path_;
  Fd fd_;
  bool direct_ = false;
};

[[noreturn]] void truncated(const std::string& path, const FileExtent& p, uint64_t have) {
  fail(Status::kFormat, path + ": truncated while the model is open: bytes " + std::to_string(p.offset) + "-" +
                            std::to_string(p.offset + p.bytes) + " of expert weights, the file ends at " +
                            std::to_string(have));
}

}  // namespace

#if defined(COLIBRI_HAVE_LIBURING)
// Pieces of at most this many bytes: enough of them in flight per expert
// (12 MB: 6) to keep the device busy, few enough that each is one or two
// block-layer requests.
constexpr uint64_t kPieceBytes = 2u << 20;
constexpr unsigned kRingEntries = 32;

struct ExpertReader::Ring {
  io_uring ring{};
  ~Ring() { io_uring_queue_exit(&ring); }
};

bool io_uring_usable(std::string* why) {
  io_uring ring{};
  const int rc = io_uring_queue_init(kRingEntries, &ring, 0);
  if (rc < 0) {
    if (why != nullptr) *why = std::string("io_uring_queue_init failed: ") + std::strerror(-rc);
    return false;
  }
  io_uring_queue_exit(&ring);
  return true;
}
#else
struct ExpertReader::Ring {};

bool io_uring_usable(std::string* why) {
  if (why != nullptr) *why = "this build has no liburing";
  return false;
}
#endif

ExpertReader::ExpertReader(size_t max_staging, bool direct_io, IoEngine engine)
    : staging_(max_staging), direct_io_(direct_io) {
  if (engine == IoEngine::kPread) return;
#if defined(COLIBRI_HAVE_LIBURING)
  auto ring = std::make_unique<Ring>();
  const int rc = io_uring_queue_init(kRingEntries, &ring->ring, 0);
  if (rc < 0) {
    fail(Status::kUnsupported, std::string("io_engine io_uring: io_uring_queue_init failed: ") + std::strerror(-rc));
  }
  ring_ = std::move(ring);
#else
  fail(Status::kUnsupported, "io_engine io_uring: this build has no liburing");
#endif
}

ExpertReader::~ExpertReader() = default;

void ExpertReader::read(const ExpertFiles& files, const ExpertLocation& loc, const uint8_t* parts[6],
                        ReadCounters* counters) {
  if (ring_ != nullptr) {
    read_uring(files, loc, parts, counters);
    return;
  }
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
    if (have < p.offset + p.bytes) truncated(path, p, have);
    parts[i] = at + (p.offset - begin);
    at += span;
    if (counters != nullptr) counters->bytes += p.bytes;
  }
  if (counters != nullptr) ++(all_direct ? counters->direct_reads : counters->buffered_reads);
}

#if defined(COLIBRI_HAVE_LIBURING)
void ExpertReader::read_uring(const ExpertFiles& files, const ExpertLocation& loc, const uint8_t* parts[6],
                              ReadCounters* counters) {
  // Each distinct file once (a GGUF split set may spread the parts).
  std::unique_ptr<OpenedFile> opened[6];
  int32_t opened_index[6] = {-1, -1, -1, -1, -1, -1};
  int file_of_part[6] = {};
  int n_open = 0;
  uint64_t begin[6] = {}, span[6] = {};
  uint8_t* dst[6] = {};
  uint8_t* at = staging_.data();
  for (int i = 0; i < loc.n_parts; ++i) {
    const FileExtent& p = loc.part[i];
    int f = 0;
    while (f < n_open && opened_index[f] != p.file) ++f;
    if (f == n_open) {
      opened[f] = std::make_unique<OpenedFile>(files.paths[static_cast<size_t>(p.file)],
                                               files.sizes[static_cast<size_t>(p.file)], direct_io_);
      opened_index[f] = p.file;
      ++n_open;
    }
    file_of_part[i] = f;
    begin[i] = align_down(p.offset);
    span[i] = align_up(p.offset + p.bytes) - begin[i];
    dst[i] = at;
    at += span[i];
  }

  // Every piece in flight, as many as the ring holds; a piece that fails
  // or comes back short marks its part for a plain pread afterwards, which
  // tells a truncated file from a filesystem that refuses O_DIRECT here
  // and gives the error. Nothing returns before the ring is drained: the
  // kernel writes into the staging buffer until each piece completes.
  bool redo[6] = {};
  int first_error = 0;
  int error_part = -1;
  io_uring& ring = ring_->ring;
  int part = 0;
  uint64_t offset = 0;  // within the current part's span
  unsigned in_flight = 0;
  for (;;) {
    while (in_flight < kRingEntries && part < loc.n_parts && first_error == 0) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) break;
      const uint64_t n = std::min(kPieceBytes, span[part] - offset);
      io_uring_prep_read(sqe, opened[file_of_part[part]]->fd(), dst[part] + offset, static_cast<unsigned>(n),
                         begin[part] + offset);
      // The piece's part and length, to tell a short piece from a whole one.
      io_uring_sqe_set_data64(sqe, (static_cast<uint64_t>(part) << 32) | n);
      ++in_flight;
      offset += n;
      if (offset == span[part]) {
        ++part;
        offset = 0;
      }
    }
    if (in_flight == 0) break;
    const int rc = io_uring_submit_and_wait(&ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // The ring itself failed: no later read uses it (pread from now on).
      ring_.reset();
      fail(Status::kIo, std::string("io_uring_submit_and_wait failed: ") + std::strerror(-rc));
    }
    io_uring_cqe* cqe = nullptr;
    while (in_flight > 0 && io_uring_peek_cqe(&ring, &cqe) == 0) {
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      const int piece_part = static_cast<int>(tag >> 32);
      const uint64_t want = tag & 0xffffffffu;
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      --in_flight;
      if (res < 0 && res != -EINVAL && first_error == 0) {
        first_error = -res;
        error_part = piece_part;
      } else if (res < 0 || static_cast<uint64_t>(res) < want) {
        redo[piece_part] = true;
      }
    }
  }
  if (first_error != 0) {
    const std::string& path = files.paths[static_cast<size_t>(loc.part[std::max(error_part, 0)].file)];
    fail(Status::kIo, errno_message(path + ": read failed", first_error));
  }

  bool all_direct = true;
  for (int i = 0; i < loc.n_parts; ++i) {
    const FileExtent& p = loc.part[i];
    OpenedFile& file = *opened[file_of_part[i]];
    if (redo[i]) {
      const uint64_t have = begin[i] + file.read(dst[i], span[i], begin[i]);
      if (have < p.offset + p.bytes) truncated(file.path(), p, have);
    } else {
      file.drop_cached(begin[i], span[i]);
    }
    all_direct &= file.direct();
    parts[i] = dst[i] + (p.offset - begin[i]);
    if (counters != nullptr) counters->bytes += p.bytes;
  }
  if (counters != nullptr) {
    ++(all_direct ? counters->direct_reads : counters->buffered_reads);
    ++counters->uring_reads;
  }
}
#else
void ExpertReader::read_uring(const ExpertFiles&, const ExpertLocation&, const uint8_t*[6], ReadCounters*) {
  fail(Status::kInternal, "read_uring without liburing");
}
#endif

}  // namespace colibri
