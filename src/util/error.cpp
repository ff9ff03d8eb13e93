#include "util/error.h"

#include <cstring>

namespace colibri {

std::string errno_message(const std::string& what, int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* text = strerror_r(err, buf, sizeof buf);
  return what + ": " + text;
}

}  // namespace colibri
