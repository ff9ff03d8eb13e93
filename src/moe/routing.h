// Routing: per token, top-k expert ids and weights.
//  - `.route` text (human-written or exported from PyTorch) -> Routing
//  - Routing <-> routing.bin bytes (docs/FORMAT.md)
// All parsers treat their input as hostile: every error throws colibri::Error
// naming the source and, for text, the line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "util/error.h"

namespace colibri {

inline constexpr uint8_t kRoutingMagic[4] = {0xc0, 0x6c, 0x31, 0x62};
inline constexpr uint16_t kRoutingVersion = 1;
inline constexpr size_t kRoutingHeaderBytes = 40;
// Upper bounds that keep every size computation far from overflow.
inline constexpr int64_t kMaxRoutingTokens = int64_t{1} << 28;
inline constexpr int32_t kMaxRoutingExperts = 65536;

enum class IdEncoding : uint8_t { kCompact = 0, kU8 = 1, kU16 = 2 };
enum class WeightEncoding : uint8_t { kCompactQ4 = 0, kF32 = 1, kF16 = 2 };

struct Routing {
  int32_t n_tokens = 0;
  int32_t n_experts = 0;
  int32_t top_k = 0;
  IdEncoding id_encoding = IdEncoding::kU8;      // how it was / will be stored
  WeightEncoding weight_encoding = WeightEncoding::kF32;
  std::vector<int32_t> ids;     // [n_tokens][top_k], token order
  std::vector<float> weights;   // [n_tokens][top_k]
};

// Parses `.route` text. n_experts bounds the ids. q4_weights: weights are
// integer codes 0..15 meaning q/15. Throws Error(Status::kFormat, "<source>:<line>: ...").
Routing parse_route_text(std::string_view text, std::string_view source, int32_t n_experts,
                         bool q4_weights);

// Serialises to routing.bin. compact requires n_experts <= 4 and top_k == 2;
// compact weights are quantised to q/15 (first expert) and 1 - q/15.
std::vector<uint8_t> encode_routing(const Routing& routing, bool compact,
                                    WeightEncoding general_weights, std::string_view source);

// Validated view of a routing.bin header, for decoding without allocating.
struct RoutingHeader {
  int32_t n_tokens = 0;
  int32_t n_experts = 0;
  int32_t top_k = 0;
  IdEncoding id_encoding = IdEncoding::kU8;
  WeightEncoding weight_encoding = WeightEncoding::kF32;
  uint64_t payload_bytes = 0;
};

bool has_routing_magic(const void* data, size_t size);

// Checks magic, version, sizes, checksum and (if model_experts > 0) that the
// file's expert count does not exceed the model's. Does not allocate.
RoutingHeader parse_routing_header(const void* data, size_t size, int32_t model_experts,
                                   std::string_view source);

// Writes ids/weights ([n_tokens][top_k] each) from a blob already accepted by
// parse_routing_header; validates every id against header.n_experts and
// distinctness per token. Does not allocate.
void decode_routing_payload(const RoutingHeader& header, const void* data, int32_t* ids,
                            float* weights, std::string_view source);

// parse_routing_header + decode_routing_payload into a Routing.
Routing decode_routing(const void* data, size_t size, int32_t model_experts,
                       std::string_view source);

}  // namespace colibri
