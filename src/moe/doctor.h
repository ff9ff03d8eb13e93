// What `colibri doctor` (and `python -m colibri.doctor`) reports before
// anyone asks why a model is slow: the CPU and the kernel level it runs,
// cores and a thread count, memory, huge pages, the mlock limit, NUMA
// nodes, the environment variables that change kernels, and for a model
// (a directory or a GGUF file, read without loading its weights) its
// experts' size against free memory and the kernels each expert shape
// takes; each problem found with the command that fixes it.
#pragma once

#include <string>

namespace colibri {

// The report as a JSON document: objects "cpu", "cores", "memory",
// "huge_pages", "memlock", "numa", "environment", "model" (null without a
// path) and "problems" (an array of {"problem", "fix"}). `threads`: what the
// model would be opened with (0 = one per online core). Throws
// colibri::Error for a model that cannot be read.
std::string doctor_report(const std::string& model_path, int threads);

}  // namespace colibri
