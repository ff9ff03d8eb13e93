#include "moe/expert_cache.h"

#include <algorithm>
#include <chrono>

#include "io/checksum.h"
#include "moe/expert_store.h"
#include "util/error.h"

namespace colibri {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

ExpertCache::ExpertCache(CacheSource source, const CacheOptions& options, std::string* warnings)
    : source_(std::move(source)), options_(options) {
  const size_t n_keys = source_.locations.size();
  region_ = WeightRegion(static_cast<size_t>(options_.slots) * options_.slot_bytes, options_.huge_pages);
  if (options_.lock_memory) {
    std::string why;
    if (!region_.lock(&why) && warnings != nullptr) {
      if (!warnings->empty()) *warnings += "; ";
      *warnings += why;
    }
  }
  entries_.resize(n_keys);
  errors_.resize(n_keys);
  failed_status_.resize(n_keys, Status::kOk);
  predicted_.assign(n_keys, 0);
  has_prediction_.assign(source_.shapes.size(), 0);
  slot_key_.assign(static_cast<size_t>(options_.slots), -1);
  for (int32_t s = options_.slots - 1; s >= 0; --s) free_slots_.push_back(s);
  const double half_life = options_.half_life > 0.0 ? options_.half_life : 4.0 * options_.slots;
  policy_ = CachePolicy(options_.policy, n_keys, half_life);
  stats_.slots = options_.slots;
  stats_.slot_bytes = options_.slot_bytes;
  const int32_t readers = std::max(1, options_.readers);
  readers_.reserve(static_cast<size_t>(readers));
  for (int i = 0; i < readers; ++i) readers_.emplace_back([this, i] { reader_main(i); });
}

ExpertCache::~ExpertCache() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : readers_) t.join();
}

int32_t ExpertCache::take_slot_locked() {
  if (!free_slots_.empty()) {
    const int32_t s = free_slots_.back();
    free_slots_.pop_back();
    return s;
  }
  int64_t victim = -1;
  for (const int64_t k : slot_key_) {
    if (k < 0) continue;
    const Entry& e = entries_[static_cast<size_t>(k)];
    if (e.state != State::kResident || e.pins != 0) continue;
    if (victim < 0 || policy_.before(static_cast<size_t>(k), static_cast<size_t>(victim))) victim = k;
  }
  if (victim < 0) return -1;
  Entry& v = entries_[static_cast<size_t>(victim)];
  const int32_t s = v.slot;
  v.slot = -1;
  v.state = State::kAbsent;
  v.prefetched = false;
  slot_key_[static_cast<size_t>(s)] = -1;
  ++stats_.evictions;
  return s;
}

void ExpertCache::start_read_locked(size_t k, int32_t slot, bool prefetch) {
  Entry& e = entries_[k];
  e.slot = slot;
  e.state = State::kLoading;
  e.prefetched = prefetch;
  slot_key_[static_cast<size_t>(slot)] = static_cast<int64_t>(k);
  (prefetch ? prefetch_jobs_ : demand_jobs_).push_back({k, slot});
  if (prefetch) ++stats_.prefetch_reads;
  work_cv_.notify_one();
}

void ExpertCache::promote_locked(size_t k) {
  const auto it = std::find_if(prefetch_jobs_.begin(), prefetch_jobs_.end(), [k](const Job& j) { return j.key == k; });
  if (it == prefetch_jobs_.end()) return;  // a reader has it already
  demand_jobs_.push_back(*it);
  prefetch_jobs_.erase(it);
}

void ExpertCache::begin(int32_t layer, const int32_t* experts, int32_t n) {
  std::unique_lock<std::mutex> lock(mutex_);
  // Pin first: none of these can be chosen as another's victim.
  for (int32_t i = 0; i < n; ++i) ++entries_[key(layer, experts[i])].pins;
  for (int32_t i = 0; i < n; ++i) {
    const size_t k = key(layer, experts[i]);
    policy_.touch(k);
    Entry& e = entries_[k];
    if (e.state == State::kResident || e.state == State::kLoading) {
      ++stats_.hits;
      if (e.state == State::kLoading && e.prefetched) promote_locked(k);
      if (e.prefetched) {
        ++stats_.prefetch_used;
        e.prefetched = false;
      }
      continue;
    }
    ++stats_.misses;
    int32_t slot = take_slot_locked();
    // Every slot loading or pinned: the pins fit (n <= slots), so a read
    // in flight (a prefetch's) frees one when it lands.
    while (slot < 0) {
      done_cv_.wait(lock);
      slot = take_slot_locked();
    }
    start_read_locked(k, slot, false);
  }
}

int32_t ExpertCache::wait_ready(int32_t layer, const int32_t* experts, int32_t n, const uint8_t** bases) {
  std::unique_lock<std::mutex> lock(mutex_);
  Entry& first = entries_[key(layer, experts[0])];
  if (first.state == State::kLoading) {
    const auto t0 = std::chrono::steady_clock::now();
    while (first.state == State::kLoading) done_cv_.wait(lock);
    stats_.wait_seconds += seconds_since(t0);
  }
  int32_t ready = 0;
  for (; ready < n; ++ready) {
    const size_t k = key(layer, experts[ready]);
    Entry& e = entries_[k];
    if (e.state == State::kResident) {
      bases[ready] = slot_data(e.slot);
      continue;
    }
    if (e.state == State::kLoading || ready > 0) break;  // a later wait_ready reports a failure
    // A failed read (kFailed), or gone in between (kAbsent cannot happen
    // while pinned). The next call that needs it reads it again.
    const std::string message = errors_[k];
    e.state = State::kAbsent;
    fail(failed_status_[k], message);
  }
  return ready;
}

void ExpertCache::release(int32_t layer, const int32_t* experts, int32_t n) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int32_t i = 0; i < n; ++i) {
      Entry& e = entries_[key(layer, experts[i])];
      if (e.pins > 0) --e.pins;
    }
  }
  done_cv_.notify_all();
}

int32_t ExpertCache::prefetch(int32_t layer, const int32_t* experts, int32_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  int32_t started = 0;
  for (int32_t i = 0; i < n; ++i) {
    const size_t k = key(layer, experts[i]);
    Entry& e = entries_[k];
    if (e.state == State::kResident || e.state == State::kLoading) continue;
    const int32_t slot = take_slot_locked();
    if (slot < 0) break;
    start_read_locked(k, slot, true);
    ++started;
  }
  return started;
}

void ExpertCache::predict(int32_t layer, const int32_t* experts, int32_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t base = key(layer, 0);
  std::fill(predicted_.begin() + static_cast<std::ptrdiff_t>(base),
            predicted_.begin() + static_cast<std::ptrdiff_t>(base) + source_.n_experts, 0);
  for (int32_t i = 0; i < n; ++i) {
    if (predicted_[base + static_cast<size_t>(experts[i])] == 0) ++stats_.predicted;
    predicted_[base + static_cast<size_t>(experts[i])] = 1;
  }
  has_prediction_[static_cast<size_t>(layer)] = 1;
}

void ExpertCache::score_prediction(int32_t layer, const int32_t* experts, int32_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (has_prediction_[static_cast<size_t>(layer)] == 0) return;
  has_prediction_[static_cast<size_t>(layer)] = 0;
  const size_t base = key(layer, 0);
  for (int32_t i = 0; i < n; ++i) stats_.predicted_used += predicted_[base + static_cast<size_t>(experts[i])];
}

void ExpertCache::forget(int32_t layer, int32_t expert) {
  std::unique_lock<std::mutex> lock(mutex_);
  const size_t k = key(layer, expert);
  Entry& e = entries_[k];
  while (e.state == State::kLoading) done_cv_.wait(lock);
  if (e.state == State::kResident && e.pins == 0) {
    slot_key_[static_cast<size_t>(e.slot)] = -1;
    free_slots_.push_back(e.slot);
    e.slot = -1;
    e.state = State::kAbsent;
    e.prefetched = false;
  }
}

CacheStats ExpertCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats s = stats_;
  s.resident_experts = 0;
  for (const int64_t k : slot_key_) {
    if (k >= 0 && entries_[static_cast<size_t>(k)].state == State::kResident) ++s.resident_experts;
  }
  return s;
}

void ExpertCache::fill(ExpertReader& reader, const Job& job, double* checksum_seconds) {
  const ExpertLocation& loc = source_.locations[job.key];
  const int32_t layer = static_cast<int32_t>(job.key / static_cast<size_t>(source_.n_experts));
  const int32_t expert = static_cast<int32_t>(job.key % static_cast<size_t>(source_.n_experts));
  const std::string& path = source_.files.paths[static_cast<size_t>(loc.part[0].file)];
  const uint8_t* parts[6] = {};
  ReadCounters counters;
  reader.read(source_.files, loc, parts, &counters);
  Entry& e = entries_[job.key];  // seen/first_checksum: only the one reader of this key touches them
  if (options_.verify_checksums) {
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t actual = expert_parts_checksum(parts, loc);
    *checksum_seconds += seconds_since(t0);
    const std::string which = " (layer " + std::to_string(layer) + " expert " + std::to_string(expert) + ")";
    if (loc.has_checksum && actual != loc.checksum) {
      fail(Status::kChecksum, path + ": checksum mismatch" + which + ": manifest says " +
                                  format_checksum(loc.checksum) + ", file is " + format_checksum(actual));
    }
    if (!loc.has_checksum) {
      if (e.seen && actual != e.first_checksum) {
        fail(Status::kChecksum, path + ": expert weights changed while the model is open" + which + ": first read " +
                                    format_checksum(e.first_checksum) + ", now " + format_checksum(actual));
      }
      e.first_checksum = actual;
      e.seen = true;
    }
  }
  const kernels::ExpertShape& shape = source_.shapes[static_cast<size_t>(layer)];
  uint8_t* dst = slot_data(job.slot);
  if (loc.n_parts == 1) {
    pack_expert(parts[0], shape, dst);
  } else {
    ExpertParts p{parts[0], parts[1], parts[2]};
    if (loc.n_parts == 6) {
      p.gate_bias = parts[3];
      p.up_bias = parts[4];
      p.down_bias = parts[5];
    }
    pack_expert_parts(p, shape, dst);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.bytes_read += counters.bytes;
  stats_.direct_reads += counters.direct_reads;
  stats_.uring_reads += counters.uring_reads;
}

void ExpertCache::reader_main(int /*index*/) {
  size_t staging = 0;
  for (const ExpertLocation& loc : source_.locations) staging = std::max(staging, ExpertReader::staging_bytes(loc));
  // kIoUring was checked usable at open; should this thread's ring still
  // fail, its reads fall back to pread rather than leave the cache without
  // a reader.
  std::unique_ptr<ExpertReader> made;
  try {
    made = std::make_unique<ExpertReader>(staging, options_.direct_io, options_.io_engine);
  } catch (const Error&) {
    made = std::make_unique<ExpertReader>(staging, options_.direct_io, IoEngine::kPread);
  }
  ExpertReader& reader = *made;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stopping_ || !demand_jobs_.empty() || !prefetch_jobs_.empty(); });
    if (stopping_) return;
    std::deque<Job>& queue = demand_jobs_.empty() ? prefetch_jobs_ : demand_jobs_;
    const Job job = queue.front();
    queue.pop_front();
    lock.unlock();
    const auto t0 = std::chrono::steady_clock::now();
    std::string error;
    Status status = Status::kOk;
    double checksum_seconds = 0.0;
    try {
      fill(reader, job, &checksum_seconds);
    } catch (const Error& err) {
      status = err.status();
      error = err.what();
    } catch (const std::exception& err) {
      status = Status::kInternal;
      error = err.what();
    }
    const double seconds = seconds_since(t0);
    lock.lock();
    Entry& e = entries_[job.key];
    stats_.read_seconds += seconds;
    stats_.checksum_seconds += checksum_seconds;
    if (status == Status::kOk) {
      e.state = State::kResident;
      ++stats_.reads;
    } else {
      e.state = State::kFailed;
      e.prefetched = false;
      errors_[job.key] = error;
      failed_status_[job.key] = status;
      slot_key_[static_cast<size_t>(job.slot)] = -1;
      free_slots_.push_back(job.slot);
      e.slot = -1;
      ++stats_.read_failures;
    }
    done_cv_.notify_all();
  }
}

}  // namespace colibri
