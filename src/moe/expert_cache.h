// The resident expert cache of a model opened with a memory budget
// (OpenOptions::max_resident_bytes): a fixed pool of expert slots in one
// huge-page, locked region, filled on demand from the model's files by a
// pool of reader threads (io/expert_reader.h) and emptied by an eviction
// policy (moe/cache_policy.h). The engine pins the experts of a call as
// slots allow (begin), computes each run that has landed (wait_ready) and
// releases it for the next experts' reads; colibri_prefetch and the engine's
// router speculation start reads that nobody waits for.
//
// Thread safety: every method may be called from any thread; one mutex
// guards the bookkeeping, and the readers hold it only to take a job and
// to publish its result. Slot memory is written by one reader while its
// entry is kLoading and read by calls only while pinned, so neither needs
// the mutex.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/expert_reader.h"
#include "kernels/kernels.h"
#include "moe/cache_policy.h"
#include "runtime/memory.h"
#include "util/error.h"

namespace colibri {

struct CacheOptions {
  int32_t slots = 0;       // experts the pool holds (>= 1)
  size_t slot_bytes = 0;   // of the largest packed expert, whole cache lines
  EvictionPolicy policy = EvictionPolicy::kDecayedFrequency;
  double half_life = 0.0;  // in lookups; 0: 4x slots
  int32_t readers = 4;     // reader threads (each with its own reads in flight)
  IoEngine io_engine = IoEngine::kPread;
  bool direct_io = true;
  bool verify_checksums = true;  // manifest checksums, else the first read's
  bool huge_pages = true;
  bool lock_memory = true;
};

struct CacheStats {
  int32_t slots = 0;
  uint64_t slot_bytes = 0;
  uint64_t resident_experts = 0;  // slots holding an expert now
  uint64_t hits = 0;              // lookups of a call that found the expert resident or on its way
  uint64_t misses = 0;            // lookups that had to start a read
  uint64_t reads = 0;             // reads finished (calls' and prefetches')
  uint64_t read_failures = 0;
  uint64_t bytes_read = 0;
  uint64_t direct_reads = 0;      // of reads, O_DIRECT
  uint64_t uring_reads = 0;       // of reads, through io_uring
  double read_seconds = 0.0;      // summed over readers, read + check + pack
  double checksum_seconds = 0.0;  // of which checksums
  double wait_seconds = 0.0;      // calls waiting for reads
  uint64_t prefetch_reads = 0;    // reads started by prefetch or speculation
  uint64_t prefetch_used = 0;     // of which a call later used
  uint64_t predicted = 0;         // experts the router speculation predicted
  uint64_t predicted_used = 0;    // of which the next call of that layer used
  uint64_t evictions = 0;
};

// What the readers need to fill a slot: where each expert is, and its
// packed shape (layer-dependent types).
struct CacheSource {
  ExpertFiles files;
  std::vector<ExpertLocation> locations;      // [layer * n_experts + expert]
  std::vector<kernels::ExpertShape> shapes;   // [layer], epilogue flags set
  int32_t n_experts = 0;
};

class ExpertCache {
 public:
  // Throws Error(kOutOfMemory) when the pool cannot be mapped; mlock
  // refusals go to *warnings.
  ExpertCache(CacheSource source, const CacheOptions& options, std::string* warnings);
  ~ExpertCache();
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  int32_t slots() const { return options_.slots; }
  size_t region_bytes() const { return region_.size(); }

  // Pins experts[0..n) of `layer` (at most slots(), distinct) and starts
  // reads of those not resident; counts one lookup each for the policy.
  void begin(int32_t layer, const int32_t* experts, int32_t n);
  // Waits until experts[0] (pinned by begin) is resident, then returns how
  // many leading experts are (>= 1), bases[i] = packed expert i. A call
  // computes those while the rest load. On a failed read of experts[0]
  // throws that read's Error; the experts stay pinned either way (release
  // them).
  int32_t wait_ready(int32_t layer, const int32_t* experts, int32_t n, const uint8_t** bases);
  void release(int32_t layer, const int32_t* experts, int32_t n);

  // Starts reads of experts not resident, evicting only unpinned experts;
  // never waits, never fails (a failed prefetch is retried by the call
  // that needs it). Returns the reads started.
  int32_t prefetch(int32_t layer, const int32_t* experts, int32_t n);

  // Router speculation bookkeeping: `experts` are what layer `layer` is
  // predicted to use next; score_prediction compares a call's actual set.
  void predict(int32_t layer, const int32_t* experts, int32_t n);
  void score_prediction(int32_t layer, const int32_t* experts, int32_t n);

  // Drops (layer, expert)'s copy after a hot swap (the swapped-in copy is
  // held by the store). Waits for a read of it in flight.
  void forget(int32_t layer, int32_t expert);

  CacheStats stats() const;

 private:
  enum class State : uint8_t { kAbsent, kLoading, kResident, kFailed };
  struct Entry {
    int32_t slot = -1;
    State state = State::kAbsent;
    bool prefetched = false;  // read by a prefetch, not used yet
    bool seen = false;        // first_checksum is set
    uint32_t pins = 0;
    uint64_t first_checksum = 0;
  };
  struct Job {
    size_t key;
    int32_t slot;
  };

  size_t key(int32_t layer, int32_t expert) const {
    return static_cast<size_t>(layer) * static_cast<size_t>(source_.n_experts) + static_cast<size_t>(expert);
  }
  uint8_t* slot_data(int32_t slot) const { return region_.data() + static_cast<size_t>(slot) * options_.slot_bytes; }
  // A free slot or an evicted one; -1 when every slot is pinned or loading.
  int32_t take_slot_locked();
  void start_read_locked(size_t key, int32_t slot, bool prefetch);
  // A queued prefetch of `key` that a call now waits for joins the call's reads.
  void promote_locked(size_t key);
  void reader_main(int index);
  // Reads, checks and packs one expert into its slot (no lock held).
  void fill(ExpertReader& reader, const Job& job, double* checksum_seconds);

  CacheSource source_;
  CacheOptions options_;
  WeightRegion region_;
  std::vector<Entry> entries_;         // [key]
  std::vector<int64_t> slot_key_;      // [slot] key held, -1 free
  std::vector<int32_t> free_slots_;
  std::vector<std::string> errors_;    // [key] message of a failed read
  std::vector<Status> failed_status_;  // [key] and its status
  std::vector<uint8_t> predicted_;     // [key] speculation's last guess
  std::vector<uint8_t> has_prediction_;  // [layer]
  CachePolicy policy_;
  // Reads a call waits for go before prefetches, which a wrong guess or a
  // caller's large colibri_prefetch could otherwise queue ahead of them.
  std::deque<Job> demand_jobs_;
  std::deque<Job> prefetch_jobs_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;  // readers wait for jobs
  std::condition_variable done_cv_;  // calls wait for reads, take_slot for evictable slots
  bool stopping_ = false;
  CacheStats stats_;
  std::vector<std::thread> readers_;
};

}  // namespace colibri
