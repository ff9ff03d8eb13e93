#include "io/checksum.h"

#include <xxhash.h>

#include <cstdio>

namespace colibri {

uint64_t xxh64(const void* data, size_t size) { return XXH64(data, size, 0); }

std::string format_checksum(uint64_t hash) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "xxh64:%016llx", static_cast<unsigned long long>(hash));
  return buf;
}

std::optional<uint64_t> parse_checksum(std::string_view text) {
  constexpr std::string_view prefix = "xxh64:";
  if (text.size() != prefix.size() + 16 || text.substr(0, prefix.size()) != prefix) return {};
  uint64_t value = 0;
  for (char c : text.substr(prefix.size())) {
    int digit;
    if (c >= '0' && c <= '9') digit = c - '0';
    else if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    else return {};
    value = value << 4 | static_cast<uint64_t>(digit);
  }
  return value;
}

}  // namespace colibri
