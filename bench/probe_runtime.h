// The probe's threads and memory, shared by colibri_probe and
// colibri_layer_bench (which runs the probe's loops next to a layer call).
#pragma once

#include <sched.h>
#include <sys/mman.h>

#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace colibri_probe {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kHugePage = 2 * kMiB;

// ------------------------------------------------------------------- team

// A fixed set of threads; the caller is member 0. Threads are created once,
// so a run's time holds no thread creation, and they block (not spin) on the
// barrier between runs so the probe leaves the host alone when idle.
class Team {
 public:
  Team(int n, bool pin) : n_(n), start_(n), end_(n) {
    if (pin) pin_to(0);
    for (int i = 1; i < n; ++i) {
      threads_.emplace_back([this, i, pin] {
        if (pin) pin_to(i);
        for (;;) {
          start_.arrive_and_wait();
          if (quit_) return;
          (*job_)(i);
          end_.arrive_and_wait();
        }
      });
    }
  }
  ~Team() {
    quit_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_) t.join();
  }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  int size() const { return n_; }

  // Runs fn(member) on every member; wall seconds from release to the last
  // member's finish.
  double run(const std::function<void(int)>& fn) {
    job_ = &fn;
    start_.arrive_and_wait();
    const auto t0 = std::chrono::steady_clock::now();
    fn(0);
    end_.arrive_and_wait();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  static void pin_to(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<unsigned>(cpu) % CPU_SETSIZE, &set);
    sched_setaffinity(0, sizeof set, &set);
  }

  int n_;
  std::barrier<> start_, end_;
  const std::function<void(int)>* job_ = nullptr;
  bool quit_ = false;
  std::vector<std::thread> threads_;
};

// ------------------------------------------------------------------ memory

// Anonymous memory at a 2 MiB boundary, advised before the first touch so the
// kernel can back it with huge pages from the first fault (or told never to).
class Buffer {
 public:
  Buffer(size_t bytes, bool huge) : bytes_(bytes) {
    const size_t map = bytes + kHugePage;
    void* raw = ::mmap(nullptr, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::runtime_error("mmap of " + std::to_string(bytes) + " bytes failed");
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
    // Unmap the unaligned head and tail so the buffer is a VMA of its own
    // and smaps reports exactly its pages.
    if (aligned > start) ::munmap(raw, aligned - start);
    const uintptr_t end = aligned + bytes, map_end = start + map;
    if (map_end > end) ::munmap(reinterpret_cast<void*>(end), map_end - end);
    p_ = reinterpret_cast<float*>(aligned);
    advice_ok_ = ::madvise(p_, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) == 0;
  }
  ~Buffer() { ::munmap(p_, bytes_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  float* data() const { return p_; }
  size_t bytes() const { return bytes_; }
  size_t floats() const { return bytes_ / sizeof(float); }
  bool advice_ok() const { return advice_ok_; }

  // Bytes of this buffer backed by transparent huge pages, from the
  // AnonHugePages lines of /proc/self/smaps for the VMAs inside it.
  uint64_t thp_bytes() const {
    std::ifstream f("/proc/self/smaps");
    std::string line;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p_), hi = lo + bytes_;
    bool inside = false;
    uint64_t total = 0;
    while (std::getline(f, line)) {
      unsigned long long a = 0, b = 0;
      char dash = 0;
      std::istringstream head(line);
      // A VMA header line starts with "start-end" in hex.
      if (line.find('-') != std::string::npos && (head >> std::hex >> a >> dash >> b) && dash == '-' &&
          line.find(':') > line.find(' ')) {
        inside = a < hi && b > lo;
        continue;
      }
      if (inside && line.rfind("AnonHugePages:", 0) == 0) {
        total += std::strtoull(line.c_str() + 14, nullptr, 10) * 1024;
      }
    }
    return total;
  }

 private:
  size_t bytes_;
  float* p_ = nullptr;
  bool advice_ok_ = false;
};

}  // namespace colibri_probe
