#include "moe/expert_store.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <algorithm>
#include <cstring>
#include <vector>

#include "io/checksum.h"
#include "io/mapped_file.h"
#include "util/error.h"

namespace colibri {

namespace {

// Copies `rows` rows of `cols` elements into rows of `stride` elements,
// zeroing the padding, with destination rows `dst_step` strides apart.
void copy_rows(const uint8_t* src, size_t rows, size_t cols, size_t stride, size_t dst_step, WeightType t,
               uint8_t* dst) {
  const size_t row_bytes = weight_row_bytes(t, cols);
  const size_t stride_bytes = weight_row_bytes(t, stride);
  const size_t pad_bytes = stride_bytes - row_bytes;
  for (size_t r = 0; r < rows; ++r) {
    uint8_t* out = dst + r * dst_step * stride_bytes;
    std::memcpy(out, src + r * row_bytes, row_bytes);
    if (pad_bytes != 0) std::memset(out + row_bytes, 0, pad_bytes);
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

size_t packed_gate_up_bytes(const kernels::ExpertShape& s) {
  return 2 * static_cast<size_t>(s.d_ff) * weight_row_bytes(s.weight_type, s.gate_up_stride);
}

size_t packed_bias_offset(const kernels::ExpertShape& s) {
  return packed_gate_up_bytes(s) + static_cast<size_t>(s.d_model) * weight_row_bytes(s.down_type, s.down_stride);
}

size_t packed_expert_bytes(const kernels::ExpertShape& s) {
  const size_t biases = s.epilogue.biased ? 2 * static_cast<size_t>(s.d_ff) + static_cast<size_t>(s.d_model) : 0;
  return packed_bias_offset(s) + biases * sizeof(float);
}

void pack_expert_parts(const ExpertParts& p, const kernels::ExpertShape& s, uint8_t* dst) {
  const size_t D = static_cast<size_t>(s.d_model);
  const size_t F = static_cast<size_t>(s.d_ff);
  // Gate row f -> packed row 2f, up row f -> packed row 2f+1.
  copy_rows(p.gate, F, D, s.gate_up_stride, 2, s.weight_type, dst);
  copy_rows(p.up, F, D, s.gate_up_stride, 2, s.weight_type, dst + weight_row_bytes(s.weight_type, s.gate_up_stride));
  copy_rows(p.down, D, F, s.down_stride, 1, s.down_type, dst + packed_gate_up_bytes(s));
  if (!s.epilogue.biased) return;
  // Biases in the rows' order: gate f at 2f, up f at 2f+1, then down's.
  // memcpy per value: the sources need not be aligned.
  float* bias = reinterpret_cast<float*>(dst + packed_bias_offset(s));
  const float zero = 0.0f;
  for (size_t f = 0; f < F; ++f) {
    std::memcpy(bias + 2 * f, p.gate_bias != nullptr ? p.gate_bias + 4 * f : reinterpret_cast<const uint8_t*>(&zero), 4);
    std::memcpy(bias + 2 * f + 1, p.up_bias != nullptr ? p.up_bias + 4 * f : reinterpret_cast<const uint8_t*>(&zero), 4);
  }
  if (p.down_bias != nullptr) {
    std::memcpy(bias + 2 * F, p.down_bias, D * sizeof(float));
  } else {
    std::fill(bias + 2 * F, bias + 2 * F + D, 0.0f);
  }
}

void pack_expert(const uint8_t* file_bytes, const kernels::ExpertShape& s, uint8_t* dst) {
  // gate and up [F][D], then down [D][F], then f32 biases gate [F], up [F], down [D].
  const size_t F = static_cast<size_t>(s.d_ff);
  const size_t FD = F * weight_row_bytes(s.weight_type, static_cast<size_t>(s.d_model));
  const size_t down_bytes = static_cast<size_t>(s.d_model) * weight_row_bytes(s.down_type, F);
  ExpertParts p{file_bytes, file_bytes + FD, file_bytes + 2 * FD};
  if (s.epilogue.biased) {
    p.gate_bias = file_bytes + 2 * FD + down_bytes;
    p.up_bias = p.gate_bias + 4 * F;
    p.down_bias = p.up_bias + 4 * F;
  }
  pack_expert_parts(p, s, dst);
}

kernels::Epilogue model_epilogue(const Manifest& m) {
  kernels::Epilogue e;
  if (m.clamped_swiglu()) {
    e.activation = kernels::Activation::kClampedSwiGLU;
    e.alpha = m.swiglu_alpha;
    e.limit = m.swiglu_limit;
  }
  e.biased = m.expert_bias;
  return e;
}

kernels::ExpertShape layer_expert_shape(const Manifest& m, int32_t layer) {
  const LayerTypes t = m.layer_types(layer);
  kernels::ExpertShape s = kernels::make_expert_shape(m.d_model, m.d_ff, t.dtype, t.down_dtype);
  s.epilogue = model_epilogue(m);
  return s;
}

size_t packed_expert_slot_bytes(const kernels::ExpertShape& shape) {
  // Every expert on a cache line (block-format rows are not multiples of one).
  const size_t bytes = packed_expert_bytes(shape);
  return (bytes + kernels::kRowAlignBytes - 1) / kernels::kRowAlignBytes * kernels::kRowAlignBytes;
}

namespace {

// Router rows [E][D] f32 into the "down" block of the router shape.
void pack_router(const uint8_t* rows, const kernels::ExpertShape& rs, uint8_t* dst) {
  copy_rows(rows, static_cast<size_t>(rs.d_model), static_cast<size_t>(rs.d_ff), rs.down_stride, 1, WeightType::kF32,
            dst);
}

void read_floats(const uint8_t* src, size_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }

}  // namespace

void ExpertStore::layout(const Manifest& m, const StoreOptions& options) {
  n_layers_ = m.n_layers;
  n_experts_ = m.n_experts;
  d_model_ = m.d_model;
  has_router_ = m.has_router();
  if (has_router_) {
    // d_model = E output rows, d_ff = D inputs: only the down block is used.
    router_shape_ = kernels::make_expert_shape(m.n_experts, m.d_model, kernels::WeightType::kF32);
    router_bytes_ = static_cast<size_t>(m.n_experts) * router_shape_.down_stride * 4;
    if (m.router_has_bias()) router_bias_.assign(static_cast<size_t>(m.n_layers) * m.n_experts, 0.0f);
  }
  if (m.has_shared() && m.shared_gate) shared_gate_.assign(static_cast<size_t>(m.n_layers) * m.d_model, 0.0f);
  layers_.resize(static_cast<size_t>(m.n_layers));
  uint64_t total = 0;  // the manifest's limits keep this far below 2^64
  for (int32_t l = 0; l < m.n_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    const LayerTypes t = m.layer_types(l);
    L.shape = layer_expert_shape(m, l);
    L.gate_up_bytes = packed_gate_up_bytes(L.shape);
    L.bias_offset = packed_bias_offset(L.shape);
    L.expert_bytes = packed_expert_slot_bytes(L.shape);
    if (m.has_shared()) {
      L.shared_shape = kernels::make_expert_shape(m.d_model, m.shared_d_ff, t.dtype, t.down_dtype);
      if (!options.skip_shared) L.shared_bytes = packed_expert_slot_bytes(L.shared_shape);
    }
    L.offset = static_cast<size_t>(total);
    L.packed_experts = 0;
    for (int32_t e = 0; e < m.n_experts && !options.defer_experts; ++e) {
      if (options.local_experts.empty() || options.local_experts[static_cast<size_t>(l) * m.n_experts + e] != 0) {
        ++L.packed_experts;
      }
    }
    total += static_cast<uint64_t>(L.expert_bytes) * L.packed_experts + router_bytes_ + L.shared_bytes;
  }
  region_ = WeightRegion(static_cast<size_t>(total), options.huge_pages);
  options_ = options;
  slots_.assign(static_cast<size_t>(m.n_layers) * static_cast<size_t>(m.n_experts), nullptr);
  for (int32_t l = 0; l < m.n_layers && !options.defer_experts; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    size_t at = 0;  // local experts sit side by side; the others have no slot
    for (int32_t e = 0; e < m.n_experts; ++e) {
      if (local(l, e)) slots_[slot(l, e)] = region_.data() + L.offset + at++ * L.expert_bytes;
    }
  }
}

void ExpertStore::expert_packed(const Manifest& m, const StoreOptions& options, int32_t layer, int32_t expert) {
  if (options.progress == nullptr) return;
  const double done = static_cast<double>(layer) * m.n_experts + expert + 1;
  options.progress->report(static_cast<float>(0.9 * done / (static_cast<double>(m.n_layers) * m.n_experts)));
}

WeightRegion ExpertStore::pack_replacement(int32_t layer, const uint8_t* file_bytes, std::string* warnings) const {
  const Layer& L = layers_[static_cast<size_t>(layer)];
  WeightRegion fresh(L.expert_bytes, options_.huge_pages);
  pack_expert(file_bytes, L.shape, fresh.data());
  if (options_.lock_memory) {
    std::string why;
    if (!fresh.lock(&why) && warnings != nullptr) *warnings = why;
  }
  return fresh;
}

WeightRegion ExpertStore::replace(int32_t layer, int32_t expert, WeightRegion&& fresh) {
  const size_t i = slot(layer, expert);
  slots_[i] = fresh.data();
  WeightRegion previous;
  auto it = replacements_.find(i);
  if (it != replacements_.end()) {
    previous = std::move(it->second);
    it->second = std::move(fresh);
  } else {
    replacements_.emplace(i, std::move(fresh));
  }
  return previous;
}

void ExpertStore::finish(const StoreOptions& options, std::string* warnings) {
  if (options.lock_memory) {
    std::string why;
    if (region_.lock(&why)) {
      stats_.bytes_locked = region_.size();
    } else if (warnings != nullptr) {
      if (!warnings->empty()) *warnings += "; ";
      *warnings += why;
    }
  }
  stats_.bytes_huge_pages = region_.measure_huge_pages();
}

ExpertStore::ExpertStore(const std::vector<LayerBuffers>& layers, const Manifest& m, const StoreOptions& options,
                         std::string* warnings, const std::function<void(int32_t layer)>& layer_packed,
                         const std::function<void(const void* data, size_t bytes)>& source_copied,
                         const ExpertFetch& fetch) {
  layout(m, options);
  for (int32_t l = 0; l < m.n_layers; ++l) {
    const LayerBuffers& lw = layers[static_cast<size_t>(l)];
    const kernels::ExpertShape& shape = this->shape(l);
    for (int32_t e = 0; e < m.n_experts && !options.defer_experts; ++e) {
      if (!local(l, e)) {  // another process computes it: never read
        expert_packed(m, options, l, e);
        continue;
      }
      const ExpertBuffers ew = lw.experts.empty() ? fetch(l, e) : lw.experts[static_cast<size_t>(e)];
      ExpertParts parts{static_cast<const uint8_t*>(ew.gate), static_cast<const uint8_t*>(ew.up),
                        static_cast<const uint8_t*>(ew.down)};
      parts.gate_bias = reinterpret_cast<const uint8_t*>(ew.gate_bias);
      parts.up_bias = reinterpret_cast<const uint8_t*>(ew.up_bias);
      parts.down_bias = reinterpret_cast<const uint8_t*>(ew.down_bias);
      pack_expert_parts(parts, shape, mutable_at(base(l, e)));
      expert_packed(m, options, l, e);
      stats_.bytes_files += m.expert_file_bytes(l);
      if (source_copied) {
        const size_t gate_up = static_cast<size_t>(shape.d_ff) *
                               weight_row_bytes(shape.weight_type, static_cast<size_t>(shape.d_model));
        source_copied(parts.gate, gate_up);
        source_copied(parts.up, gate_up);
        source_copied(parts.down, static_cast<size_t>(shape.d_model) *
                                      weight_row_bytes(shape.down_type, static_cast<size_t>(shape.d_ff)));
      }
    }
    if (has_router_) {
      pack_router(reinterpret_cast<const uint8_t*>(lw.router), router_shape_, mutable_at(router(l)));
      if (!router_bias_.empty() && lw.router_bias != nullptr) {
        std::memcpy(router_bias_.data() + static_cast<size_t>(l) * m.n_experts, lw.router_bias,
                    static_cast<size_t>(m.n_experts) * sizeof(float));
      }
    }
    if (m.has_shared() && !options.skip_shared) {
      pack_expert_parts({static_cast<const uint8_t*>(lw.shared.gate), static_cast<const uint8_t*>(lw.shared.up),
                         static_cast<const uint8_t*>(lw.shared.down)},
                        shared_shape(l), mutable_at(shared_gate_up(l)));
      if (!shared_gate_.empty()) {
        std::memcpy(shared_gate_.data() + static_cast<size_t>(l) * m.d_model, lw.shared_gate,
                    static_cast<size_t>(m.d_model) * sizeof(float));
      }
    }
    if (layer_packed) layer_packed(l);
  }
  finish(options, warnings);
}

ExpertStore::ExpertStore(const std::string& model_dir, const Manifest& m,
                         const StoreOptions& options, std::string* warnings) {
  // Every file the manifest implies, with its size: checked before memory
  // is committed, so a bad directory fails fast and names the first bad file.
  struct Part {
    std::string name;
    uint64_t bytes;
    int32_t layer;
  };
  std::vector<Part> parts;
  m.for_each_weight_file(
      [&](const std::string& name, uint64_t bytes, int32_t layer) { parts.push_back({name, bytes, layer}); });
  for (const Part& part : parts) {
    const std::string path = model_dir + "/" + part.name;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      fail(Status::kIo, errno_message(path + ": cannot open weight file", errno));
    }
    if (static_cast<uint64_t>(st.st_size) != part.bytes) {
      fail(Status::kFormat,
           path + ": " + (static_cast<uint64_t>(st.st_size) < part.bytes ? "truncated" : "oversized") +
               " weight file: " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(part.bytes) +
               (part.bytes == m.expert_file_bytes(part.layer)
                    ? " (gate, up [d_ff " + std::to_string(m.d_ff) + "][d_model " + std::to_string(m.d_model) +
                          "] and down, " + expert_types(m, part.layer) + ")"
                    : std::string()));
    }
  }

  layout(m, options);

  // Files are read (one at a time, into one reused buffer), not mapped: a
  // file truncated by someone else while we open it gives an error, where a
  // mapping would raise SIGBUS. After open the model never touches them.
  std::vector<uint8_t> buffer;
  struct Bytes {
    const std::vector<uint8_t>& b;
    const uint8_t* data() const { return b.data(); }
  };
  size_t next = 0;
  for (int32_t l = 0; l < m.n_layers; ++l) {
    auto open_checked = [&](const std::string& name) {
      const std::string path = model_dir + "/" + name;
      read_file_exact(path, parts[next].bytes, buffer);
      ++next;
      if (options.verify_checksums) {
        if (auto it = m.checksums.find(name); it != m.checksums.end()) {
          const auto t0 = std::chrono::steady_clock::now();
          const uint64_t actual = xxh64(buffer.data(), buffer.size());
          stats_.verify_seconds += seconds_since(t0);
          if (actual != it->second) {
            fail(Status::kChecksum, path + ": checksum mismatch: manifest says " + format_checksum(it->second) +
                                           ", file is " + format_checksum(actual));
          }
        }
      }
      stats_.bytes_files += buffer.size();
      return Bytes{buffer};
    };
    if (m.has_router()) {
      const Bytes file = open_checked(m.router_file(l));
      pack_router(file.data(), router_shape_, mutable_at(router(l)));
      if (!router_bias_.empty()) {
        read_floats(file.data() + static_cast<size_t>(m.n_experts) * m.d_model * 4, static_cast<size_t>(m.n_experts),
                    router_bias_.data() + static_cast<size_t>(l) * m.n_experts);
      }
    }
    for (int32_t e = 0; e < m.n_experts; ++e) {
      if (options.defer_experts || !local(l, e)) {
        ++next;  // read on demand by the cache and checked there, or another process's
        if (!options.defer_experts) expert_packed(m, options, l, e);
        continue;
      }
      const Bytes file = open_checked(m.expert_file(l, e));
      pack_expert(file.data(), shape(l), mutable_at(base(l, e)));
      expert_packed(m, options, l, e);
    }
    if (m.has_shared() && options.skip_shared) {
      next += m.shared_gate ? 2 : 1;  // another process's
    } else if (m.has_shared()) {
      const Bytes file = open_checked(m.shared_file(l));
      pack_expert(file.data(), shared_shape(l), mutable_at(shared_gate_up(l)));
      if (m.shared_gate) {
        const Bytes g = open_checked(m.shared_gate_file(l));
        read_floats(g.data(), static_cast<size_t>(m.d_model), shared_gate_.data() + static_cast<size_t>(l) * m.d_model);
      }
    }
  }
  finish(options, warnings);
}

}  // namespace colibri
