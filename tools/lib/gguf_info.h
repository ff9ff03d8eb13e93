// What a GGUF file holds, tensor by tensor, for `colibri info`: the files
// people download mix types from tensor to tensor and layer to layer.
#pragma once

#include <string>

namespace colibri {

// The tensor types of the GGUF file at `path` (one file of a split set:
// that file's tensors): per ggml type the count of tensors and their bytes,
// then per block ("blk.N", runs of blocks with the same types merged) the
// type of each of its tensors; with `every_tensor`, every tensor's type,
// shape and bytes instead of the per-block lines. Throws Error naming the
// file when it cannot be read or parsed.
std::string gguf_tensor_types(const std::string& path, bool every_tensor);

}  // namespace colibri
