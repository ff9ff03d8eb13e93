// Conversion of Hugging Face MoE checkpoints (config.json + safetensors
// shards) into a Colibri model directory: every MoE layer's experts, router
// and shared expert. Families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
// DeepSeek-V2 and -V3, with per-expert or fused expert tensors, and
// gpt-oss (MXFP4 blocks and scales, whose values are kept exactly when the
// output is mxfp4, or bf16; with the experts' and the router's biases).
//
// Shards are memory-mapped and read one expert at a time, so memory stays
// at a few experts' worth whatever the checkpoint's size. The output is
// written to `<out>.partial-<pid>` and renamed into place only on success;
// on failure nothing that looks like a model is left behind.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "util/error.h"
#include "util/router_desc.h"
#include "util/weight_format.h"

namespace colibri {

// What config.json says about the MoE part of a model, resolved for its
// family (defaults applied, layer rule evaluated).
struct HfMoeConfig {
  std::string model_type;
  int32_t n_hidden_layers = 0;
  int32_t n_experts = 0;
  int32_t d_model = 0;
  int32_t d_ff = 0;
  int32_t shared_d_ff = 0;   // 0 = no shared expert
  bool shared_gate = false;  // Qwen2-MoE
  // gpt-oss: the clamped SwiGLU and expert biases.
  bool clamped_swiglu = false;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  bool expert_bias = false;
  RouterDesc router{};
  std::vector<int32_t> moe_layers;  // HF decoder layer indices, ascending
  // quantization_config.quant_method "fp8": the weight_block_size of the
  // scale tiles (weight_scale_inv); 0 when the checkpoint is not FP8.
  int32_t fp8_block_rows = 0;
  int32_t fp8_block_cols = 0;
};

// "mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3, gpt_oss".
std::string hf_supported_model_types();

// Parses config.json text; `source` names it in errors. Throws
// Error(Status::kFormat) naming the field at fault, or
// Error(Status::kUnsupported) for a model_type or setting Colibri cannot
// run.
HfMoeConfig parse_hf_config(const std::string& text, const std::string& source);

struct HfConvertProgress {
  uint64_t bytes_done = 0;  // written so far
  uint64_t bytes_total = 0;
  int32_t layers_done = 0;  // complete layers
  int32_t layers_total = 0;
};

struct HfConvertOptions {
  std::string hf_dir;   // holds config.json and the safetensors file(s)
  std::string out_dir;  // must not exist, or be an empty directory
  // Default: the dtype of the checkpoint's expert tensors.
  std::optional<WeightType> dtype;
  // Of the down matrices when dtype is a block format (default: dtype).
  std::optional<WeightType> down_dtype;
  // HF decoder layer indices, inclusive; the MoE layers inside are
  // converted. Default: all.
  std::optional<int32_t> first_layer, last_layer;
  bool checksums = true;
  // Called after each file written; may throw to abort (the partial output
  // is then removed).
  std::function<void(const HfConvertProgress&)> progress;
};

struct HfConvertResult {
  HfMoeConfig config;
  std::vector<int32_t> layers;  // HF indices converted; Colibri layer j = layers[j]
  WeightType dtype = WeightType::kF16;  // of the written model
  WeightType down_dtype = WeightType::kF16;  // of its down matrices
  WeightType source_dtype = WeightType::kF16;  // of the first expert tensor
  int32_t fused_layers = 0;  // layers whose experts came as fused tensors
  int32_t n_shards = 0;
  uint64_t bytes_written = 0;
};

// Reads, checks every needed tensor (names, dtypes, shapes) before writing
// anything, then writes. Throws Error: Status::kFormat for bad input
// (naming the file and tensor or field), Status::kIo for files that
// cannot be read or written and for an existing, non-empty out_dir,
// Status::kUnsupported for an unknown architecture, Status::kInvalidArgument
// for a layer range that selects nothing.
HfConvertResult convert_hf_checkpoint(const HfConvertOptions& options);

}  // namespace colibri
