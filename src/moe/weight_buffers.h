// Expert weights that are already in memory, in the model files' layout
// (gate and up [d_ff][d_model], down [d_model][d_ff], in the manifest's
// types; router [n_experts][d_model], bias [n_experts], shared gate
// [d_model], f32): a caller's buffers (colibri_open_memory) or a mapped
// file's tensors. The store copies them into its packed region; nothing
// here is kept after open.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace colibri {

struct ExpertBuffers {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  // f32 [d_ff], [d_ff], [d_model] when the manifest says expert_bias (null: zeros).
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
};

// Experts handed over one at a time (colibri_open_memory's fetch_expert):
// called in (layer, expert) order; its buffers live until the next call.
using ExpertFetch = std::function<ExpertBuffers(int32_t layer, int32_t expert)>;

struct LayerBuffers {
  std::vector<ExpertBuffers> experts;  // [n_experts], or empty: an ExpertFetch supplies them
  const float* router = nullptr;       // when the manifest has a router
  const float* router_bias = nullptr;  // or null: zeros
  ExpertBuffers shared;                // when the manifest has a shared expert
  const float* shared_gate = nullptr;  // when the manifest says shared_gate
};

}  // namespace colibri
