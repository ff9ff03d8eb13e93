// The MoE layers of a llama.cpp GGUF model, as Colibri runs them: the
// architecture's metadata mapped onto a Manifest (dimensions, weight types
// as stored, the built-in router rule) and each layer's tensors as buffers
// inside the mapped file, for the store to copy into its packed layout
// without requantising anything. docs/FORMAT.md says what is read.
//
// Layers: the GGUF blocks with expert tensors, which must be contiguous
// (blocks first_block .. first_block + n_layers - 1); Colibri's layer l is
// block first_block + l. Leading dense blocks (leading_dense_block_count,
// or blocks without expert tensors) are skipped and listed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/gguf.h"
#include "io/manifest.h"
#include "moe/weight_buffers.h"

namespace colibri {

struct GgufModel {
  std::string path;
  std::string architecture;  // general.architecture
  int32_t block_count = 0;
  int32_t first_block = 0;           // the GGUF block of Colibri layer 0
  std::vector<int32_t> dense_blocks;  // blocks without experts, skipped
  int32_t mtp_blocks = 0;             // trailing nextn_predict_layers blocks, skipped
  Manifest manifest;
  std::vector<LayerBuffers> layers;  // point into `files` and `converted`
  // ggml types of the routed experts' gate, up and down tensors, and of the
  // shared expert's (empty without one), as stored.
  std::string expert_types;
  std::vector<GgufFile> files;  // every part of a split set, mapped
  // Each layer's expert tensors, to release (GgufFile::release) once copied:
  // the open's memory then peaks at the packed experts plus about a layer.
  std::vector<std::vector<std::pair<const GgufFile*, const GgufTensor*>>> layer_tensors;
  void release_layer(int32_t layer) const {
    for (const auto& [file, tensor] : layer_tensors[static_cast<size_t>(layer)]) file->release(*tensor);
  }
  // Drops the pages of [p, p + n) (part of an expert tensor, copied).
  void release_bytes(const void* p, size_t n) const {
    for (const GgufFile& f : files) f.release(p, n);
  }
  std::vector<std::vector<float>> converted;  // f16 / bf16 routers and gates widened to f32
};

// Opens the GGUF file at `path` (or, for the first file of a split set,
// "<name>-00001-of-0000N.gguf", every part) and maps its MoE layers.
// Throws Error(kFormat) naming the file and the key or tensor that is
// malformed or inconsistent, Error(kUnsupported) for an architecture,
// router rule or tensor type Colibri cannot run (naming it), Error(kIo)
// when a part cannot be read.
GgufModel load_gguf_model(const std::string& path);

// True when `path` names a GGUF file (by its first four bytes "GGUF").
bool is_gguf_file(const std::string& path);

}  // namespace colibri
