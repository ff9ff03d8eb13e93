#include "runtime/memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "util/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>  // _mm_clflush, _mm_mfence: SSE2, in every x86-64
#endif

namespace colibri {

namespace {

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

bool thp_allowed() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(f, line)) return false;
  // The active mode is bracketed: "always [madvise] never".
  return line.find("[always]") != std::string::npos || line.find("[madvise]") != std::string::npos;
}

}  // namespace

WeightRegion::WeightRegion(size_t bytes, bool want_huge_pages) {
  if (bytes == 0) bytes = 1;
  size_ = bytes;
  const size_t rounded = round_up(bytes, kHugePageBytes);

  if (want_huge_pages) {
    void* p = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p != MAP_FAILED) {
      map_base_ = p;
      map_size_ = rounded;
      data_ = static_cast<uint8_t*>(p);
      kind_ = HugePageKind::kHugetlbfs;
      return;
    }
  }

  // Over-allocate by one huge page so the usable range can start 2 MiB
  // aligned: THP can only back whole aligned 2 MiB extents.
  map_size_ = rounded + kHugePageBytes;
  void* p = ::mmap(nullptr, map_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    map_size_ = 0;
    fail(Status::kOutOfMemory,
         errno_message("cannot map " + std::to_string(bytes) + " bytes for expert weights", errno));
  }
  map_base_ = p;
  const uintptr_t aligned = round_up(reinterpret_cast<uintptr_t>(p), kHugePageBytes);
  data_ = reinterpret_cast<uint8_t*>(aligned);
  if (want_huge_pages && thp_allowed() && ::madvise(data_, rounded, MADV_HUGEPAGE) == 0) {
    kind_ = HugePageKind::kTransparent;
  }
}

WeightRegion::~WeightRegion() { release(); }

WeightRegion::WeightRegion(WeightRegion&& o) noexcept
    : data_(o.data_), size_(o.size_), map_base_(o.map_base_), map_size_(o.map_size_),
      kind_(o.kind_), locked_(o.locked_) {
  o.data_ = nullptr;
  o.map_base_ = nullptr;
  o.size_ = o.map_size_ = 0;
  o.locked_ = false;
}

WeightRegion& WeightRegion::operator=(WeightRegion&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    size_ = o.size_;
    map_base_ = o.map_base_;
    map_size_ = o.map_size_;
    kind_ = o.kind_;
    locked_ = o.locked_;
    o.data_ = nullptr;
    o.map_base_ = nullptr;
    o.size_ = o.map_size_ = 0;
    o.locked_ = false;
  }
  return *this;
}

void WeightRegion::release() noexcept {
  if (map_base_ == nullptr) return;
  if (locked_) ::munlock(data_, size_);
  ::munmap(map_base_, map_size_);
  map_base_ = nullptr;
  data_ = nullptr;
  size_ = map_size_ = 0;
  locked_ = false;
}

bool WeightRegion::lock(std::string* why) {
  if (locked_) return true;
  if (::mlock(data_, size_) == 0) {
    locked_ = true;
    return true;
  }
  const int err = errno;
  if (why != nullptr) {
    *why = errno_message("mlock of " + std::to_string(size_) + " bytes refused", err);
    if (err == EPERM || err == ENOMEM) {
      *why += " (needs CAP_IPC_LOCK or a higher RLIMIT_MEMLOCK; running unlocked)";
    }
  }
  return false;
}

uint64_t WeightRegion::measure_huge_pages() const {
  if (data_ == nullptr) return 0;
  if (kind_ == HugePageKind::kHugetlbfs) return size_;
  if (kind_ != HugePageKind::kTransparent) return 0;
  // Find our mapping's block in smaps and sum its AnonHugePages.
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  const uintptr_t base = reinterpret_cast<uintptr_t>(data_);
  bool in_block = false;
  uint64_t total_kb = 0;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " ", &lo, &hi) == 2 &&
        line.find(':') > line.find(' ')) {
      in_block = lo < base + size_ && base < hi;
      continue;
    }
    unsigned long long kb = 0;
    if (in_block && std::sscanf(line.c_str(), "AnonHugePages: %llu kB", &kb) == 1) total_kb += kb;
  }
  const uint64_t bytes = total_kb * 1024;
  return bytes < size_ ? bytes : size_;
}

void evict_from_caches(const void* data, size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  const auto* p = static_cast<const char*>(data);
  for (size_t o = 0; o < bytes; o += 64) _mm_clflush(p + o);
  if (bytes > 0) _mm_clflush(p + bytes - 1);
  _mm_mfence();
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace colibri
