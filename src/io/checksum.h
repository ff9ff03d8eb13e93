// File checksums: "xxh64:<16 lowercase hex digits>" (XXH64, seed 0).
// xxHash because verification runs over every weight byte at open and must
// cost far less than reading the file; cryptographic strength is not needed
// to catch corruption and truncation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace colibri {

uint64_t xxh64(const void* data, size_t size);
std::string format_checksum(uint64_t hash);
// Parses "xxh64:<16 hex>"; nullopt if malformed.
std::optional<uint64_t> parse_checksum(std::string_view text);

}  // namespace colibri
