#include "lib/gguf_convert.h"

#include <sys/stat.h>

#include <cstring>
#include <vector>

#include "io/checksum.h"
#include "io/manifest.h"
#include "io/mapped_file.h"
#include "lib/model_writer.h"
#include "util/error.h"

namespace colibri {

namespace {

void append(std::vector<uint8_t>& out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}

// gate [F][D], up [F][D], down [D][F] of `layer` as stored, then the f32
// biases of gate, up and down when `biased`: the expert file's bytes.
std::vector<uint8_t> expert_file(const ExpertBuffers& w, const Manifest& m, int32_t layer, int32_t d_ff, bool biased) {
  const LayerTypes t = m.layer_types(layer);
  const size_t gate_bytes = static_cast<size_t>(d_ff) * weight_row_bytes(t.dtype, static_cast<size_t>(m.d_model));
  const size_t down_bytes = static_cast<size_t>(m.d_model) * weight_row_bytes(t.down_dtype, static_cast<size_t>(d_ff));
  std::vector<uint8_t> out;
  out.reserve(2 * gate_bytes + down_bytes + static_cast<size_t>(m.expert_bias_bytes()));
  append(out, w.gate, gate_bytes);
  append(out, w.up, gate_bytes);
  append(out, w.down, down_bytes);
  if (biased) {
    append(out, w.gate_bias, static_cast<size_t>(d_ff) * sizeof(float));
    append(out, w.up_bias, static_cast<size_t>(d_ff) * sizeof(float));
    append(out, w.down_bias, static_cast<size_t>(m.d_model) * sizeof(float));
  }
  return out;
}

}  // namespace

GgufConvertResult convert_gguf_model(const std::string& gguf_path, const std::string& out_dir,
                                     const std::function<void(float)>& progress) {
  GgufConvertResult r;
  r.model = load_gguf_model(gguf_path);
  struct stat st {};
  if (::stat((out_dir + "/" + kManifestName).c_str(), &st) == 0) {
    fail(Status::kInvalidArgument, out_dir + " already holds a model (" + kManifestName + ")");
  }
  Manifest m = r.model.manifest;
  const size_t D = static_cast<size_t>(m.d_model);
  const size_t E = static_cast<size_t>(m.n_experts);
  make_directories(out_dir);
  auto write_one = [&](const std::string& name, const std::vector<uint8_t>& bytes) {
    const size_t slash = name.rfind('/');
    if (slash != std::string::npos) make_directories(out_dir + "/" + name.substr(0, slash));
    write_file_atomic(out_dir + "/" + name, bytes.data(), bytes.size());
    m.checksums[name] = xxh64(bytes.data(), bytes.size());
    r.bytes_written += bytes.size();
  };
  for (int32_t l = 0; l < m.n_layers; ++l) {
    const LayerBuffers& L = r.model.layers[static_cast<size_t>(l)];
    if (m.has_router()) {
      std::vector<uint8_t> router;
      append(router, L.router, E * D * sizeof(float));
      if (m.router_has_bias()) {
        const std::vector<float> zeros(E, 0.0f);
        append(router, L.router_bias != nullptr ? L.router_bias : zeros.data(), E * sizeof(float));
      }
      write_one(m.router_file(l), router);
    }
    for (int32_t e = 0; e < m.n_experts; ++e) {
      write_one(m.expert_file(l, e), expert_file(L.experts[static_cast<size_t>(e)], m, l, m.d_ff, m.expert_bias));
      if (progress) {
        progress(static_cast<float>(static_cast<double>(l * m.n_experts + e + 1) /
                                    (static_cast<double>(m.n_layers) * m.n_experts)));
      }
    }
    if (m.has_shared()) {
      write_one(m.shared_file(l), expert_file(L.shared, m, l, m.shared_d_ff, false));
      if (m.shared_gate) {
        std::vector<uint8_t> gate;
        append(gate, L.shared_gate, D * sizeof(float));
        write_one(m.shared_gate_file(l), gate);
      }
    }
    r.model.release_layer(l);
  }
  write_manifest(out_dir, m);
  return r;
}

}  // namespace colibri
