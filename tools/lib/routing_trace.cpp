#include "lib/routing_trace.h"

#include <cstring>

#include "io/mapped_file.h"
#include "util/error.h"

namespace colibri {

namespace {

constexpr char kMagic[8] = {'C', 'L', 'B', 'T', 'R', 'A', 'C', 'E'};
constexpr size_t kHeaderBytes = 32;

uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);  // little-endian hosts only, as every format here
  return v;
}

}  // namespace

RoutingTrace read_routing_trace(const std::string& path) {
  const MappedFile f(path);
  const uint8_t* b = f.data();
  const size_t size = f.size();
  const auto bad = [&](const std::string& what) { fail(Status::kFormat, path + ": " + what); };
  if (size < kHeaderBytes) bad("not a routing trace: " + std::to_string(size) + " bytes, shorter than its header");
  if (std::memcmp(b, kMagic, 8) != 0) bad("not a routing trace (no CLBTRACE magic)");
  if (u32_at(b + 8) != 1) bad("trace version " + std::to_string(u32_at(b + 8)) + ", this build reads version 1");
  RoutingTrace t;
  t.n_layers = static_cast<int32_t>(u32_at(b + 12));
  t.n_experts = static_cast<int32_t>(u32_at(b + 16));
  t.top_k = static_cast<int32_t>(u32_at(b + 20));
  uint64_t n_steps;
  std::memcpy(&n_steps, b + 24, 8);
  if (t.n_layers < 1 || t.n_experts < 1 || t.top_k < 1 || t.top_k > t.n_experts) {
    bad("header: n_layers " + std::to_string(t.n_layers) + ", n_experts " + std::to_string(t.n_experts) +
        ", top_k " + std::to_string(t.top_k) + " (each >= 1, top_k <= n_experts)");
  }
  size_t at = kHeaderBytes;
  for (uint64_t s = 0; s < n_steps; ++s) {
    const std::string where = "step " + std::to_string(s) + ": ";
    if (size - at < 8) bad(where + "truncated record header");
    TraceStep step;
    step.layer = static_cast<int32_t>(u32_at(b + at));
    const uint32_t T = u32_at(b + at + 4);
    at += 8;
    if (step.layer < 0 || step.layer >= t.n_layers) {
      bad(where + "layer " + std::to_string(u32_at(b + at - 8)) + " out of range [0, " + std::to_string(t.n_layers) + ")");
    }
    const uint64_t n = static_cast<uint64_t>(T) * static_cast<uint64_t>(t.top_k);
    if ((size - at) / 4 < n) bad(where + "truncated ids (" + std::to_string(T) + " tokens)");
    step.n_tokens = static_cast<int32_t>(T);
    step.ids.resize(static_cast<size_t>(n));
    std::memcpy(step.ids.data(), b + at, static_cast<size_t>(n) * 4);
    at += static_cast<size_t>(n) * 4;
    for (size_t i = 0; i < step.ids.size(); ++i) {
      if (step.ids[i] < -1 || step.ids[i] >= t.n_experts) {
        bad(where + "id " + std::to_string(step.ids[i]) + " (token " + std::to_string(i / t.top_k) +
            ") out of range [-1, " + std::to_string(t.n_experts) + ")");
      }
    }
    t.steps.push_back(std::move(step));
  }
  if (at != size) bad(std::to_string(size - at) + " bytes after the last of " + std::to_string(n_steps) + " steps");
  return t;
}

}  // namespace colibri
