#include "lib/gguf_info.h"

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "io/gguf.h"

namespace colibri {

namespace {

std::string bytes_label(uint64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024.0 * 1024.0) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024.0 * 1024.0));
  } else if (b >= 1024.0 * 1024.0) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024.0));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  }
  return buf;
}

// "blk.12.ffn_down_exps.weight" -> block 12 and "ffn_down_exps"; false for
// tensors outside the blocks (token_embd, output, ...).
bool block_tensor(const std::string& name, long* block, std::string* role) {
  if (name.rfind("blk.", 0) != 0) return false;
  const size_t dot = name.find('.', 4);
  if (dot == std::string::npos || dot == 4) return false;
  const std::string digits = name.substr(4, dot - 4);
  if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) return false;
  *block = std::stol(digits);
  std::string rest = name.substr(dot + 1);
  const std::string suffix = ".weight";
  if (rest.size() > suffix.size() && rest.compare(rest.size() - suffix.size(), suffix.size(), suffix) == 0) {
    rest.resize(rest.size() - suffix.size());
  }
  *role = rest;
  return true;
}

std::string shape_label(const GgufTensor& t) {
  std::string s = "[";
  for (uint32_t d = 0; d < t.n_dims; ++d) {
    if (d > 0) s += ", ";
    s += std::to_string(t.ne[d]);
  }
  return s + "]";
}

}  // namespace

std::string gguf_tensor_types(const std::string& path, bool every_tensor) {
  const GgufFile g = GgufFile::open(path);
  std::string out;
  char line[256];
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_type;  // count, bytes
  for (const GgufTensor& t : g.tensors()) {
    auto& e = by_type[ggml_type_name(t.type)];
    ++e.first;
    e.second += t.bytes;
  }
  out += "tensor types\n";
  for (const auto& [type, e] : by_type) {
    std::snprintf(line, sizeof line, "  %-8s %6llu tensors  %s\n", type.c_str(), static_cast<unsigned long long>(e.first),
                  bytes_label(e.second).c_str());
    out += line;
  }
  if (every_tensor) {
    out += "tensors\n";
    for (const GgufTensor& t : g.tensors()) {
      std::snprintf(line, sizeof line, "  %-36s %-8s %-24s %s\n", t.name.c_str(), ggml_type_name(t.type).c_str(),
                    shape_label(t).c_str(), bytes_label(t.bytes).c_str());
      out += line;
    }
    return out;
  }
  // Per block, "role type" in file order; runs of blocks with the same list merged.
  std::map<long, std::string> blocks;
  std::string others;
  for (const GgufTensor& t : g.tensors()) {
    long block = 0;
    std::string role;
    const std::string entry = ggml_type_name(t.type);
    if (block_tensor(t.name, &block, &role)) {
      std::string& list = blocks[block];
      list += (list.empty() ? "" : ", ") + role + " " + entry;
    } else {
      others += (others.empty() ? "" : ", ") + t.name + " " + entry;
    }
  }
  if (!others.empty()) out += "  outside the blocks: " + others + "\n";
  for (auto it = blocks.begin(); it != blocks.end();) {
    auto last = it;
    auto next = std::next(it);
    while (next != blocks.end() && next->first == last->first + 1 && next->second == it->second) last = next++;
    const std::string range = it->first == last->first ? "blk." + std::to_string(it->first)
                                                        : "blk." + std::to_string(it->first) + "-" +
                                                              std::to_string(last->first);
    out += "  " + range + ": " + it->second + "\n";
    it = next;
  }
  return out;
}

}  // namespace colibri
