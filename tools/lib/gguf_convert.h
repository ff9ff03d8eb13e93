// colibri convert --gguf: a GGUF file's MoE layers (moe/gguf_model.h) as a
// Colibri model directory, every weight byte as the GGUF stores it (no
// requantisation), with checksums, for users who want verify and hot swap.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "moe/gguf_model.h"

namespace colibri {

struct GgufConvertResult {
  GgufModel model;  // what was read (its files still mapped)
  uint64_t bytes_written = 0;
};

// Writes `out_dir` (created; must not hold a model) from the GGUF at
// `gguf_path` (or the first file of a split set). Throws Error naming the
// file, key or tensor at fault; the manifest is written last, so a failed
// conversion leaves no model behind.
// `progress`, when set, is told the fraction of experts written after each.
GgufConvertResult convert_gguf_model(const std::string& gguf_path, const std::string& out_dir,
                                     const std::function<void(float)>& progress = {});

}  // namespace colibri
