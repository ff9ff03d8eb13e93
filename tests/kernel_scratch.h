// Working memory for tests that call kernel tables directly: one
// KernelScratch per thread, as the engine keeps one per pool thread.
#pragma once

#include "kernels/kernels.h"

namespace colibri_test {

inline colibri::kernels::KernelScratch* thread_scratch() {
  thread_local colibri::kernels::KernelScratch scratch;
  return &scratch;
}

}  // namespace colibri_test
