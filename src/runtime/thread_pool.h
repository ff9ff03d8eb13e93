// Persistent worker pool, one per thread count in a process (shared_thread_pool).
//
// One flat parallel-for: items are claimed from a shared atomic counter, so
// a thread that finishes early takes more work instead of idling. The caller
// participates as thread 0; workers 1..n-1 spin briefly after a job (the
// next call of a decode loop usually comes within microseconds) and then
// sleep on a futex, so an idle model burns no CPU. No allocation and no
// thread creation per job.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace colibri {

class ThreadPool {
 public:
  // n_threads counts the caller; at least 1. pin: worker i runs on the i-th
  // CPU of the process's affinity mask (best effort).
  ThreadPool(int n_threads, bool pin);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  using ItemFn = void (*)(void* context, int64_t item, int thread);

  // Runs fn(context, item, thread) for every item in [0, n_items) on at most
  // `threads` threads (0 or more than size() = all), and returns when all
  // are done. Jobs from different callers are serialised. fn must not throw.
  void run(int64_t n_items, int threads, ItemFn fn, void* context);

  template <typename F>
  void parallel_for(int64_t n_items, int threads, F&& f) {
    run(n_items, threads,
        [](void* ctx, int64_t item, int thread) { (*static_cast<F*>(ctx))(item, thread); },
        static_cast<void*>(&f));
  }

 private:
  void worker_main(int thread);
  void work(int thread);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex job_mutex_;  // one job at a time

  // Job description, written by the caller before bumping generation_.
  ItemFn fn_ = nullptr;
  void* context_ = nullptr;
  int64_t n_items_ = 0;
  int active_threads_ = 0;

  // Each on its own cache line: the counter is hammered by every thread, the
  // others are polled, and sharing a line would make them all contend.
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int64_t> next_item_{0};
  alignas(64) std::atomic<int> pending_workers_{0};
  alignas(64) std::atomic<bool> stop_{false};
};

// The process's pool of `threads` threads (pinned or not): every model and
// linear layer asking for the same count shares one, created on first use
// and destroyed with its last user. Jobs from different owners are
// serialised by run(), so sharing never oversubscribes the cores, and
// workers spinning for one model's next call serve the next linear layer's.
std::shared_ptr<ThreadPool> shared_thread_pool(int threads, bool pin);

// Online cores (sysconf), at least 1.
int online_cores();

}  // namespace colibri
