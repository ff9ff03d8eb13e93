// Memory the kernels read: one anonymous mapping, 2 MiB aligned, backed by
// huge pages where the system allows and locked where permitted.
//
// Order of preference: explicit hugetlbfs pages (MAP_HUGETLB; only if pages
// are reserved), then transparent huge pages (madvise(MADV_HUGEPAGE) on a
// 2 MiB aligned range, before first touch so faults allocate huge pages),
// then normal pages. What was actually obtained is measured afterwards, not
// assumed (see measure_huge_pages).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "util/error.h"

namespace colibri {

// How a region's pages were backed (src/api maps it to colibri_huge_page_kind_t).
enum class HugePageKind { kNone, kTransparent, kHugetlbfs };

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

class WeightRegion {
 public:
  WeightRegion() = default;
  // Throws Error(Status::kOutOfMemory) if no memory can be mapped.
  WeightRegion(size_t bytes, bool want_huge_pages);
  ~WeightRegion();
  WeightRegion(WeightRegion&& other) noexcept;
  WeightRegion& operator=(WeightRegion&& other) noexcept;
  WeightRegion(const WeightRegion&) = delete;
  WeightRegion& operator=(const WeightRegion&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  HugePageKind huge_page_kind() const { return kind_; }

  // Best effort mlock. Returns true on success; on failure fills *why.
  bool lock(std::string* why);
  bool locked() const { return locked_; }

  // Bytes of this region currently backed by huge pages: all of it for
  // hugetlbfs; for THP, what /proc/self/smaps reports (call after the pages
  // have been written).
  uint64_t measure_huge_pages() const;

 private:
  void release() noexcept;
  uint8_t* data_ = nullptr;  // start of the usable, 2 MiB aligned range
  size_t size_ = 0;          // usable bytes
  void* map_base_ = nullptr; // what munmap needs
  size_t map_size_ = 0;
  HugePageKind kind_ = HugePageKind::kNone;
  bool locked_ = false;
};

// Writes back and evicts [data, data + bytes) from every cache level
// (clflush per 64-byte line on x86; nothing elsewhere), so that the next read
// comes from memory as a model's weights do when they exceed the last-level
// cache: what a decode-time kernel measurement must see.
void evict_from_caches(const void* data, size_t bytes);

}  // namespace colibri
