// Writes model directories (format v1): used by `colibri gen`, the tests and
// conversion tools. Weights are given as float32 and rounded to the model's
// dtype (round to nearest even).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "util/error.h"
#include "util/router_desc.h"
#include "util/weight_format.h"

namespace colibri {

struct ModelWriteSpec {
  int32_t n_layers = 1;
  int32_t n_experts = 0;
  int32_t d_model = 0;
  int32_t d_ff = 0;
  WeightType dtype = WeightType::kF16;
  // Of the down matrices; used when dtype is a block format (the writer
  // quantises with the format's reference quantiser), else ignored. The
  // default, F16, means "the same as dtype".
  WeightType down_dtype = WeightType::kF16;
  bool checksums = true;
  // Format v2 parts; a model with neither is written as v1.
  RouterDesc router{};  // family NONE = no built-in router
  int32_t shared_d_ff = 0;         // 0 = no shared expert
  bool shared_gate = false;        // Qwen2-MoE's sigmoid gate on the shared expert
  // Format v4 (gpt-oss): the clamped SwiGLU and per-expert biases.
  bool clamped_swiglu = false;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  bool expert_bias = false;
  // Optional provenance, stored as the manifest's "source" object (ignored
  // when read): e.g. {"format": "hf", "model_type": "mixtral", "layers": [..]}.
  std::string source_json;
  // Formats read, not made (the grid i-quants: no quantiser without an
  // importance matrix): false refuses them (kUnsupported); write_random_model
  // sets it to write random codes with scales of the weights' magnitude.
  bool random_stand_in = false;
};

// Called once per file, in order, to fill float32 buffers that the writer
// rounds to the model's dtype (weights) or keeps in f32 (router, gate).
struct ModelFill {
  // 3*d_model*d_ff floats: gate [F][D], up [F][D], down [D][F], then with
  // spec.expert_bias 2*d_ff + d_model more: the biases of gate [F], up [F]
  // and down [D] (kept in f32). Required.
  std::function<void(int32_t layer, int32_t expert, float* w)> expert;
  // router [E][D]; bias [E] is non-null only for DeepSeek-V3 (fill with
  // e_score_correction_bias). Required when spec.router.family != NONE.
  std::function<void(int32_t layer, float* router, float* bias)> router;
  // 3*d_model*shared_d_ff floats, same layout as an expert; gate [D] is
  // non-null only when spec.shared_gate. Required when shared_d_ff > 0.
  std::function<void(int32_t layer, float* w, float* gate)> shared;
  // Optional, for sources whose weights are already in the model's types
  // (an FP8 checkpoint written as fp8_e4m3 keeps its codes and scales):
  // fills the expert file's gate, up and down matrices as stored bytes
  // and returns true, or returns false to take the float path above.
  // Not called for models with expert biases.
  std::function<bool(int32_t layer, int32_t expert, uint8_t* matrices)> expert_encoded;
  // The same for the shared expert; it also fills `gate` (non-null only
  // when spec.shared_gate) when it returns true.
  std::function<bool(int32_t layer, uint8_t* matrices, float* gate)> shared_encoded;
  // Optional: after each file, bytes written so far of `total`.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

// Writes the model directory: `dir` (and layer subfolders) are created as
// needed; one expert is in memory at a time; the manifest is written last,
// so a directory whose writing failed has no manifest.
void write_model_dir(const std::string& dir, const ModelWriteSpec& spec, const ModelFill& fill);

// v1 convenience: experts only.
void write_model_dir(const std::string& dir, const ModelWriteSpec& spec,
                     const std::function<void(int32_t layer, int32_t expert, float* w)>& fill);

// Random weights of realistic scale: uniform with variance 1/fan_in (gate and
// up: d_model, down: d_ff), biases uniform in [-0.5, 0.5), deterministic in
// (seed, layer, expert).
void write_random_model(const std::string& dir, const ModelWriteSpec& spec, uint64_t seed);

// Rewrites the model directory `in_dir` with its expert (and shared
// expert) weights in `dtype` / `down_dtype` (down_dtype only for block
// formats): each file read, its sizes and checksums checked, widened by its
// format's reference dequantiser and quantised again; router, gates,
// router rule and provenance copied. One expert in memory at a time.
// `progress`, when set, is told the fraction of experts done after each.
void requantize_model_dir(const std::string& in_dir, const std::string& out_dir, WeightType dtype,
                          WeightType down_dtype, const std::function<void(float)>& progress = {});

// The same values write_random_model writes, for one expert.
void random_expert_weights(const ModelWriteSpec& spec, uint64_t seed, int32_t layer, int32_t expert,
                           float* w);

// mkdir -p; throws Error(Status::kIo).
void make_directories(const std::string& dir);

}  // namespace colibri
