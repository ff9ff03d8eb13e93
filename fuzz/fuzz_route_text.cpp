// libFuzzer target: the `.route` text parser, with and without q4 weights,
// and the routing.bin encoder on whatever it accepts.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "moe/routing.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // First byte picks the expert count and mode, so both q4 and plain
  // weights and small/large expert counts are reached.
  const int32_t n_experts = 1 + data[0] % 64;
  const bool q4 = (data[0] & 0x80) != 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    colibri::Routing r = colibri::parse_route_text(text, "fuzz.route", n_experts, q4);
    const bool compact = r.n_experts <= 4 && r.top_k == 2;
    const auto blob = colibri::encode_routing(r, compact, colibri::WeightEncoding::kF16, "fuzz.route");
    colibri::decode_routing(blob.data(), blob.size(), n_experts, "fuzz.route");
  } catch (const colibri::Error&) {
  }
  return 0;
}
