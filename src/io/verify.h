// Offline integrity check of a model directory: manifest, then each expert
// file's size and (where the manifest lists one) checksum.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include "util/error.h"

namespace colibri {

struct FileReport {
  std::string file;        // relative to the model directory
  uint64_t bytes = 0;
  bool has_checksum = false;
  bool ok = false;
  std::string problem;     // empty when ok
  double seconds = 0.0;    // time spent hashing
};

// Calls on_file for every expert file (if non-null), in layer/expert order,
// and continues past bad files. Throws Error for a bad manifest, or after
// visiting everything, for the first bad file (checksum mismatch ->
// Status::kChecksum, size -> Status::kFormat, missing -> Status::kIo).
void verify_model_dir(const std::string& dir, const std::function<void(const FileReport&)>& on_file);

}  // namespace colibri
