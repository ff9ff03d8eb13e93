// The C ABI's open options and caller-memory model descriptions, mapped to
// the internal types (moe/model.h, moe/weight_buffers.h).
#pragma once

#include <vector>

#include "colibri.h"
#include "io/manifest.h"
#include "moe/model.h"
#include "moe/weight_buffers.h"

namespace colibri::api {

OpenOptions open_options(const colibri_open_options_t& o);

struct MemoryModel {
  Manifest manifest;
  std::vector<LayerBuffers> layers;  // experts empty when `fetch` supplies them
  ExpertFetch fetch;
};

// Validates `desc` as colibri_open_memory promises (the manifest's limits
// first, so no loop walks past what the caller could have allocated, then
// every pointer the model needs); throws Error(kInvalidArgument) naming the
// field.
MemoryModel memory_model(const colibri_model_desc_t& desc);

}  // namespace colibri::api
