#include "runtime/thread_pool.h"

#include <map>
#include <utility>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define COLIBRI_CPU_RELAX() _mm_pause()
#else
#define COLIBRI_CPU_RELAX() ((void)0)
#endif

namespace colibri {

namespace {

// About 50-100 microseconds of polling: long enough to catch the next call of
// a decode loop, short enough not to steal a core from the caller's framework.
constexpr int kSpinIterations = 20000;

void pin_to_nth_allowed_cpu(int n) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  const int count = CPU_COUNT(&allowed);
  if (count == 0) return;
  int wanted = n % count;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (wanted-- == 0) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pthread_setaffinity_np(pthread_self(), sizeof one, &one);
      return;
    }
  }
}

}  // namespace

ThreadPool::ThreadPool(int n_threads, bool pin) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  workers_.reserve(static_cast<size_t>(n_threads_ - 1));
  for (int t = 1; t < n_threads_; ++t) {
    workers_.emplace_back([this, t, pin] {
      if (pin) pin_to_nth_allowed_cpu(t);
      worker_main(t);
    });
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::work(int thread) {
  for (;;) {
    const int64_t item = next_item_.fetch_add(1, std::memory_order_relaxed);
    if (item >= n_items_) break;
    fn_(context_, item, thread);
  }
}

void ThreadPool::worker_main(int thread) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t now = generation_.load(std::memory_order_acquire);
    for (int spin = 0; now == seen && spin < kSpinIterations; ++spin) {
      COLIBRI_CPU_RELAX();
      now = generation_.load(std::memory_order_acquire);
    }
    if (now == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      continue;
    }
    seen = now;
    if (stop_.load(std::memory_order_acquire)) return;
    // Every worker acknowledges every job, even one it sits out: then no
    // worker can still be looking at job N when the caller writes job N+1.
    if (thread < active_threads_) work(thread);
    if (pending_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      pending_workers_.notify_one();
    }
  }
}

void ThreadPool::run(int64_t n_items, int threads, ItemFn fn, void* context) {
  if (n_items <= 0) return;
  if (threads <= 0 || threads > n_threads_) threads = n_threads_;
  if (threads > n_items) threads = static_cast<int>(n_items);
  std::lock_guard<std::mutex> lock(job_mutex_);
  if (threads == 1) {
    for (int64_t i = 0; i < n_items; ++i) fn(context, i, 0);
    return;
  }
  fn_ = fn;
  context_ = context;
  n_items_ = n_items;
  active_threads_ = threads;
  next_item_.store(0, std::memory_order_relaxed);
  pending_workers_.store(n_threads_ - 1, std::memory_order_relaxed);
  // Release publishes the job fields above to workers that acquire the new
  // generation.
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  work(0);
  int pending = pending_workers_.load(std::memory_order_acquire);
  for (int spin = 0; pending != 0 && spin < kSpinIterations; ++spin) {
    COLIBRI_CPU_RELAX();
    pending = pending_workers_.load(std::memory_order_acquire);
  }
  while (pending != 0) {
    pending_workers_.wait(pending, std::memory_order_acquire);
    pending = pending_workers_.load(std::memory_order_acquire);
  }
}

int online_cores() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

std::shared_ptr<ThreadPool> shared_thread_pool(int threads, bool pin) {
  static std::mutex mutex;
  static std::map<std::pair<int, bool>, std::weak_ptr<ThreadPool>> pools;
  if (threads < 1) threads = 1;
  const std::lock_guard<std::mutex> lock(mutex);
  std::weak_ptr<ThreadPool>& slot = pools[{threads, pin}];
  std::shared_ptr<ThreadPool> pool = slot.lock();
  if (pool == nullptr) {
    pool = std::make_shared<ThreadPool>(threads, pin);
    slot = pool;
  }
  return pool;
}

}  // namespace colibri
