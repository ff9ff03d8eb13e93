#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "util/error.h"

namespace colibri {

namespace {

// Closes a descriptor on scope exit, whatever path leaves the scope.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

int open_regular_file(const std::string& path, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(Status::kIo, errno_message(path + ": cannot open", errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(Status::kIo, errno_message(path + ": cannot stat", err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(Status::kIo, path + ": not a regular file");
  }
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

size_t read_at(int fd, const std::string& path, uint64_t offset, uint8_t* out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(Status::kIo, errno_message(path + ": read failed", errno));
    }
    if (got == 0) break;  // end of file
    done += static_cast<size_t>(got);
  }
  return done;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  uint64_t bytes = 0;
  const int fd = open_regular_file(path, &bytes);
  FdCloser closer{fd};
  size_ = static_cast<size_t>(bytes);
  if (size_ == 0) return;  // mmap of length 0 is invalid; an empty view is enough
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) fail(Status::kIo, errno_message(path + ": cannot map", errno));
  ::madvise(p, size_, MADV_SEQUENTIAL);
  data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() { reset(); }

void MappedFile::release(const void* p, size_t n) const {
  const auto* b = static_cast<const uint8_t*>(p);
  if (data_ == nullptr || b < data_ || b > data_ + size_ || n > static_cast<size_t>(data_ + size_ - b)) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(b) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(b) + n) / page * page;
  // A private read-only mapping of a file: MADV_DONTNEED only forgets the
  // pages here (the file and the page cache are untouched).
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void MappedFile::reset() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

std::string read_small_file(const std::string& path, size_t max_bytes) {
  uint64_t size = 0;
  const int fd = open_regular_file(path, &size);
  FdCloser closer{fd};
  if (size > max_bytes) {
    fail(Status::kFormat, path + ": file too large (" + std::to_string(size) + " bytes, limit " +
                                 std::to_string(max_bytes) + ")");
  }
  std::string out(static_cast<size_t>(size), '\0');
  // A file that shrank meanwhile gives what is left; callers check sizes.
  out.resize(read_at(fd, path, 0, reinterpret_cast<uint8_t*>(out.data()), out.size()));
  return out;
}

void read_file_exact(const std::string& path, uint64_t expected_bytes, std::vector<uint8_t>& buffer) {
  uint64_t size = 0;
  const int fd = open_regular_file(path, &size);
  FdCloser closer{fd};
  if (size != expected_bytes) {
    fail(Status::kFormat, path + ": " + std::to_string(size) + " bytes, expected " +
                                 std::to_string(expected_bytes) + " (it changed since it was checked)");
  }
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  buffer.resize(static_cast<size_t>(expected_bytes));
  const size_t got = read_at(fd, path, 0, buffer.data(), buffer.size());
  if (got != buffer.size()) {
    fail(Status::kFormat, path + ": file shrank while being read (" + std::to_string(got) + " of " +
                                 std::to_string(expected_bytes) + " bytes)");
  }
}

void write_file_atomic(const std::string& path, const void* data, size_t size) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(Status::kIo, errno_message(path + ": cannot create", errno));
  const auto* bytes = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, bytes + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail(Status::kIo, errno_message(path + ": write failed", err));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(Status::kIo, errno_message(path + ": write failed", err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(Status::kIo, errno_message(path + ": cannot rename into place", err));
  }
}

}  // namespace colibri
