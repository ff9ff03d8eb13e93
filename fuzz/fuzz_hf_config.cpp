// libFuzzer target: a Hugging Face config.json, read by `colibri convert`.
#include <cstddef>
#include <cstdint>
#include <string>

#include "lib/hf_convert.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    colibri::parse_hf_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz/config.json");
  } catch (const colibri::Error&) {
  }
  return 0;
}
