#include "moe/expert_store.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "io/checksum.h"
#include "io/mapped_file.h"
#include "util/error.h"

namespace colibri {

namespace {

kernels::WeightType weight_type_of(colibri_dtype_t dtype) {
  switch (dtype) {
    case COLIBRI_DTYPE_F32: return kernels::WeightType::kF32;
    case COLIBRI_DTYPE_F16: return kernels::WeightType::kF16;
    case COLIBRI_DTYPE_BF16: return kernels::WeightType::kBF16;
  }
  return kernels::WeightType::kF32;
}

// Copies `rows` rows of `cols` elements into rows of `stride` elements,
// zeroing the padding, with destination rows `dst_step` strides apart.
void copy_rows(const uint8_t* src, size_t rows, size_t cols, size_t stride, size_t dst_step,
               size_t elem, uint8_t* dst) {
  const size_t row_bytes = cols * elem;
  const size_t pad_bytes = (stride - cols) * elem;
  for (size_t r = 0; r < rows; ++r) {
    uint8_t* out = dst + r * dst_step * stride * elem;
    std::memcpy(out, src + r * row_bytes, row_bytes);
    if (pad_bytes != 0) std::memset(out + row_bytes, 0, pad_bytes);
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

size_t packed_gate_up_bytes(const kernels::ExpertShape& s) {
  return 2 * static_cast<size_t>(s.d_ff) * s.gate_up_stride * kernels::weight_type_size(s.weight_type);
}

size_t packed_expert_bytes(const kernels::ExpertShape& s) {
  return packed_gate_up_bytes(s) +
         static_cast<size_t>(s.d_model) * s.down_stride * kernels::weight_type_size(s.weight_type);
}

void pack_expert(const uint8_t* file_bytes, const kernels::ExpertShape& s, uint8_t* dst) {
  const size_t elem = kernels::weight_type_size(s.weight_type);
  const size_t D = static_cast<size_t>(s.d_model);
  const size_t F = static_cast<size_t>(s.d_ff);
  const uint8_t* gate = file_bytes;
  const uint8_t* up = gate + F * D * elem;
  const uint8_t* down = up + F * D * elem;
  // Gate row f -> packed row 2f, up row f -> packed row 2f+1.
  copy_rows(gate, F, D, s.gate_up_stride, 2, elem, dst);
  copy_rows(up, F, D, s.gate_up_stride, 2, elem, dst + s.gate_up_stride * elem);
  copy_rows(down, D, F, s.down_stride, 1, elem, dst + packed_gate_up_bytes(s));
}

ExpertStore::ExpertStore(const std::string& model_dir, const Manifest& m,
                         const StoreOptions& options, std::string* warnings)
    : shape_(kernels::make_expert_shape(m.d_model, m.d_ff, weight_type_of(m.dtype))),
      n_experts_(m.n_experts) {
  gate_up_bytes_ = packed_gate_up_bytes(shape_);
  expert_bytes_ = packed_expert_bytes(shape_);
  const uint64_t file_bytes = m.expert_file_bytes();

  // Check every file's presence and size before committing memory, so a bad
  // directory fails fast and names the first bad file.
  for (int32_t l = 0; l < m.n_layers; ++l) {
    for (int32_t e = 0; e < m.n_experts; ++e) {
      const std::string path = model_dir + "/" + m.expert_file(l, e);
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0) {
        fail(COLIBRI_ERR_IO, errno_message(path + ": cannot open expert file", errno));
      }
      if (static_cast<uint64_t>(st.st_size) != file_bytes) {
        fail(COLIBRI_ERR_FORMAT,
             path + ": " + (static_cast<uint64_t>(st.st_size) < file_bytes ? "truncated" : "oversized") +
                 " expert file: " + std::to_string(st.st_size) + " bytes, expected " +
                 std::to_string(file_bytes) + " (3 * d_model " + std::to_string(m.d_model) +
                 " * d_ff " + std::to_string(m.d_ff) + " * " + std::to_string(m.dtype_size()) + ")");
      }
    }
  }

  const uint64_t total = static_cast<uint64_t>(expert_bytes_) * static_cast<uint64_t>(m.n_experts) *
                         static_cast<uint64_t>(m.n_layers);
  region_ = WeightRegion(static_cast<size_t>(total), options.huge_pages);

  for (int32_t l = 0; l < m.n_layers; ++l) {
    for (int32_t e = 0; e < m.n_experts; ++e) {
      const std::string name = m.expert_file(l, e);
      const std::string path = model_dir + "/" + name;
      MappedFile file(path);
      // Re-check: the file may have changed since the stat above.
      if (file.size() != file_bytes) {
        fail(COLIBRI_ERR_FORMAT, path + ": expert file changed size while opening");
      }
      if (options.verify_checksums) {
        if (auto it = m.checksums.find(name); it != m.checksums.end()) {
          const auto t0 = std::chrono::steady_clock::now();
          const uint64_t actual = xxh64(file.data(), file.size());
          stats_.verify_seconds += seconds_since(t0);
          if (actual != it->second) {
            fail(COLIBRI_ERR_CHECKSUM, path + ": checksum mismatch: manifest says " +
                                           format_checksum(it->second) + ", file is " +
                                           format_checksum(actual));
          }
        }
      }
      pack_expert(file.data(), shape_, const_cast<uint8_t*>(base(l, e)));
      stats_.bytes_files += file.size();
    }
  }

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

}  // namespace colibri
