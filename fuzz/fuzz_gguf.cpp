// libFuzzer target: the GGUF parser (model files are untrusted input).
// Every accepted tensor must lie inside the input (all its bytes are read),
// and typed metadata lookups must either answer or throw Error.
#include <cstddef>
#include <cstdint>

#include "io/gguf.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const colibri::GgufFile g = colibri::GgufFile::parse(data, size, "fuzz.gguf");
    uint64_t sum = 0;
    for (const colibri::GgufTensor& t : g.tensors()) {
      if (t.offset < g.data_offset() || t.offset > size || t.bytes > size - t.offset) __builtin_trap();
      const uint8_t* p = g.data(t);
      for (uint64_t i = 0; i < t.bytes; i += 61) sum += p[i];
      if (t.bytes != 0) sum += p[t.bytes - 1];
    }
    for (const std::string& key : g.keys()) {
      uint64_t u = 0;
      double f = 0;
      bool b = false;
      std::string s;
      try {
        g.get_uint(key, &u);
      } catch (const colibri::Error&) {
      }
      try {
        g.get_float(key, &f);
      } catch (const colibri::Error&) {
      }
      try {
        g.get_bool(key, &b);
      } catch (const colibri::Error&) {
      }
      try {
        g.get_string(key, &s);
      } catch (const colibri::Error&) {
      }
      sum += u + s.size() + (b ? 1 : 0);
    }
    // Keeps the reads from being optimised away.
    static volatile uint64_t sink;
    sink = sum;
  } catch (const colibri::Error&) {
  }
  return 0;
}
