// Internal error type. Code below the C ABI throws colibri::Error on bad input
// or failed system calls; src/api catches it and turns it into the C ABI's
// status code (the same values, colibri_status_t) plus the thread-local
// message. Hot paths validate up front and never throw.
#pragma once

#include <stdexcept>
#include <string>

namespace colibri {

// What went wrong; src/api/ maps each to the colibri_status_t of the same value.
enum class Status : int {
  kOk = 0,
  kInvalidArgument = 1,  // NULL pointer, bad size, out-of-range index
  kIo = 2,               // file missing, unreadable, unwritable
  kFormat = 3,           // malformed manifest, routing or weight file
  kChecksum = 4,         // checksum mismatch
  kOutOfMemory = 5,
  kUnsupported = 6,  // valid but not supported by this build
  kInternal = 7,
  kCancelled = 8,  // a progress callback asked to stop
};

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

[[noreturn]] inline void fail(Status status, const std::string& message) {
  throw Error(status, message);
}

// "what: strerror(errno)" for failed system calls.
std::string errno_message(const std::string& what, int err);

}  // namespace colibri
