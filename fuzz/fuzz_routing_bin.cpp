// libFuzzer target: the routing.bin decoder. Inputs are tried as they are
// and with a valid checksum patched in, so the fields behind the checksum
// are explored too, not only the checksum test.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "io/checksum.h"
#include "moe/routing.h"
#include "util/error.h"

namespace {

void decode(const uint8_t* data, size_t size) {
  try {
    colibri::decode_routing(data, size, 0, "fuzz.bin");
    colibri::decode_routing(data, size, 3, "fuzz.bin");
  } catch (const colibri::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  decode(data, size);
  if (size >= colibri::kRoutingHeaderBytes) {
    std::vector<uint8_t> fixed(data, data + size);
    const size_t payload = size - colibri::kRoutingHeaderBytes;
    // Header bytes [0, 32) and the payload are hashed; the sum sits at 32.
    std::vector<uint8_t> hashed(fixed.begin(), fixed.begin() + 32);
    hashed.insert(hashed.end(), fixed.begin() + colibri::kRoutingHeaderBytes, fixed.begin() + colibri::kRoutingHeaderBytes + payload);
    const uint64_t sum = colibri::xxh64(hashed.data(), hashed.size());
    for (int i = 0; i < 8; ++i) fixed[32 + i] = static_cast<uint8_t>(sum >> (8 * i));
    decode(fixed.data(), fixed.size());
  }
  return 0;
}
