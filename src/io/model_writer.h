// Writes model directories (format v1): used by `colibri gen`, the tests and
// conversion tools. Weights are given as float32 and rounded to the model's
// dtype (round to nearest even).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "colibri.h"

namespace colibri {

struct ModelWriteSpec {
  int32_t n_layers = 1;
  int32_t n_experts = 0;
  int32_t d_model = 0;
  int32_t d_ff = 0;
  colibri_dtype_t dtype = COLIBRI_DTYPE_F16;
  bool checksums = true;
};

// fill(layer, expert, w) writes 3*d_model*d_ff floats: gate [F][D], up [F][D],
// down [D][F]. Creates `dir` (and layer subfolders) as needed; the manifest
// is written last, so a directory whose writing failed has no manifest.
void write_model_dir(const std::string& dir, const ModelWriteSpec& spec,
                     const std::function<void(int32_t layer, int32_t expert, float* w)>& fill);

// Random weights of realistic scale: uniform with variance 1/fan_in (gate and
// up: d_model, down: d_ff), deterministic in (seed, layer, expert).
void write_random_model(const std::string& dir, const ModelWriteSpec& spec, uint64_t seed);

// The same values write_random_model writes, for one expert.
void random_expert_weights(const ModelWriteSpec& spec, uint64_t seed, int32_t layer, int32_t expert,
                           float* w);

// mkdir -p; throws Error(COLIBRI_ERR_IO).
void make_directories(const std::string& dir);

}  // namespace colibri
