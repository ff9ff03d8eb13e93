// std::vector whose data starts on a cache line, for buffers the kernels
// write whole lines of (streaming stores need 64-byte alignment).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace colibri {

template <class T, size_t Align = 64>
struct AlignedAllocator {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = AlignedAllocator<U, Align>;
  };
  AlignedAllocator() = default;
  template <class U>
  explicit AlignedAllocator(const AlignedAllocator<U, Align>& /*other*/) {}

  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{Align})); }
  void deallocate(T* p, size_t /*n*/) noexcept { ::operator delete(p, std::align_val_t{Align}); }

  template <class U>
  bool operator==(const AlignedAllocator<U, Align>& /*other*/) const {
    return true;
  }
  template <class U>
  bool operator!=(const AlignedAllocator<U, Align>& /*other*/) const {
    return false;
  }
};

template <class T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace colibri
