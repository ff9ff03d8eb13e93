// libFuzzer target: the model manifest (colibri.json, v1 and v2).
#include <cstddef>
#include <cstdint>
#include <string>

#include "io/manifest.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const colibri::Manifest m = colibri::parse_manifest(text, "fuzz.json");
    // Whatever is accepted must write back to a manifest that reads the same.
    const colibri::Manifest again = colibri::parse_manifest(colibri::manifest_to_json(m), "rewritten");
    if (again.n_experts != m.n_experts || again.d_ff != m.d_ff || again.router.family != m.router.family ||
        again.shared_d_ff != m.shared_d_ff || again.checksums != m.checksums) {
      __builtin_trap();
    }
    // Walking the file list of a model with millions of experts is slow,
    // not wrong; keep the walk to small models.
    if (static_cast<int64_t>(m.n_layers) * m.n_experts <= 4096) {
      uint64_t files = 0;
      m.for_each_weight_file([&](const std::string&, uint64_t, int32_t) { ++files; });
      if (files < static_cast<uint64_t>(m.n_layers) * static_cast<uint64_t>(m.n_experts)) __builtin_trap();
    }
  } catch (const colibri::Error&) {
  }
  return 0;
}
