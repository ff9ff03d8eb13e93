// Routing traces (.ctrace, docs/FORMAT.md): the experts each call of each
// layer used, in call order, as colibri.routing records them from a
// transformers model or generates them synthetically. `colibri bench
// --trace` replays one against a model (the expert cache's workload).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace colibri {

struct TraceStep {
  int32_t layer = 0;
  int32_t n_tokens = 0;
  std::vector<int32_t> ids;  // [n_tokens][top_k], -1 = empty slot
};

struct RoutingTrace {
  int32_t n_layers = 0;
  int32_t n_experts = 0;
  int32_t top_k = 0;
  std::vector<TraceStep> steps;
};

// Reads and validates a trace; throws Error(kFormat) naming the file, the
// step and the field at fault, Error(kIo) when it cannot be read.
RoutingTrace read_routing_trace(const std::string& path);

}  // namespace colibri
