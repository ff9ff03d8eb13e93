// libFuzzer target: the safetensors header parser (checkpoints are
// untrusted input), and exact float conversion of whatever it accepts.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "lib/safetensors.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const colibri::StHeader h = colibri::parse_safetensors(data, size, "fuzz.safetensors");
    std::vector<float> out;
    for (const colibri::StTensor& t : h.tensors) {
      // Every accepted tensor must lie inside the input: read it all.
      if (t.offset + t.n_bytes > size) __builtin_trap();
      const bool floats = t.dtype == colibri::StDtype::kF32 || t.dtype == colibri::StDtype::kF16 ||
                          t.dtype == colibri::StDtype::kBF16;
      if (floats && t.n_elements <= 4096) {
        out.resize(static_cast<size_t>(t.n_elements));
        colibri::st_to_floats(t.dtype, data + t.offset, out.size(), out.data());
      }
    }
  } catch (const colibri::Error&) {
  }
  return 0;
}
