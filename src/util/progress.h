// An open's progress, reported to the caller's callback (colibri_progress_fn)
// a bounded number of times, and a request to stop turned into
// Error(kCancelled), which unwinds the open and frees what it made.
#pragma once

#include <functional>
#include <string>
#include <utility>

#include "util/error.h"

namespace colibri {

class Progress {
 public:
  // Callbacks past this many steps would cost more than they show.
  static constexpr int kSteps = 200;

  explicit Progress(std::function<bool(float)> callback) : callback_(std::move(callback)) {}

  // `fraction` in [0, 1]: calls the callback when it has moved a step since
  // the last call, and always for 0 and 1 (once each).
  void report(float fraction) {
    if (!callback_) return;
    const int step = fraction >= 1.0f ? kSteps : static_cast<int>(fraction * kSteps);
    if (step <= last_step_) return;
    last_step_ = step;
    if (!callback_(fraction >= 1.0f ? 1.0f : fraction)) {
      fail(Status::kCancelled, "the open was cancelled by its progress callback at " +
                                   std::to_string(static_cast<int>(fraction * 100.0f)) + "%");
    }
  }

 private:
  std::function<bool(float)> callback_;
  int last_step_ = -1;
};

}  // namespace colibri
