// Internal error type. Code below the C ABI throws colibri::Error on bad input
// or failed system calls; src/api catches it and turns it into a status code
// plus the thread-local message. Hot paths validate up front and never throw.
#pragma once

#include <stdexcept>
#include <string>

#include "colibri.h"

namespace colibri {

class Error : public std::runtime_error {
 public:
  Error(colibri_status_t status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  colibri_status_t status() const { return status_; }

 private:
  colibri_status_t status_;
};

[[noreturn]] inline void fail(colibri_status_t status, const std::string& message) {
  throw Error(status, message);
}

// "what: strerror(errno)" for failed system calls.
std::string errno_message(const std::string& what, int err);

}  // namespace colibri
