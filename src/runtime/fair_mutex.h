// A first-come, first-served mutex for the engine's call lock.
//
// Calls on one model are serialised (each uses the whole thread pool), so
// with several callers every call waits in a queue. std::mutex does not
// keep order: a thread that just released it often takes it again before a
// sleeping waiter wakes, and one caller's tail latency grows without bound.
// Here waiters take tickets and are served in order, so a call waits for at
// most the calls that arrived before it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace colibri {

class FairMutex {
 public:
  void lock() {
    std::unique_lock<std::mutex> guard(mutex_);
    const uint64_t ticket = next_ticket_++;
    turn_.wait(guard, [&] { return now_serving_ == ticket; });
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      ++now_serving_;
    }
    // All waiters wake and the one holding the next ticket proceeds; with a
    // handful of callers that costs less than a per-waiter queue.
    turn_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable turn_;
  uint64_t next_ticket_ = 0;
  uint64_t now_serving_ = 0;
};

}  // namespace colibri
