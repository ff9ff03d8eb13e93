#include "lib/model_writer.h"

#include <sys/stat.h>

#include <cerrno>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "io/checksum.h"
#include "io/manifest.h"
#include "io/mapped_file.h"
#include "util/error.h"
#include "util/half.h"

namespace colibri {

namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1).
float uniform_pm1(uint64_t& state) {
  return static_cast<float>(static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-52 - 1.0);
}

// The formats read, not made (no from_float: the grid i-quants, whose
// quantisers need an importance matrix): the mean magnitude of a value per
// unit of the block scale d, with random codes (iq2_xxs: grid values about
// 20 times sub-scales (0.5 + ls) / 4 about 2; iq3_xxs: about 30 times
// (0.5 + ls) / 2 about 4; iq1: |g +- 1/8| about 0.6 times 2 s + 1 about 8).
float stand_in_magnitude_per_d(WeightType t) {
  switch (t) {
    case WeightType::kIQ2_XXS:
    case WeightType::kIQ2_XS:
    case WeightType::kIQ2_S:
      return 40.0f;
    case WeightType::kIQ3_XXS:
    case WeightType::kIQ3_S:
      return 120.0f;
    case WeightType::kIQ1_S:
    case WeightType::kIQ1_M:
      return 5.0f;
    default:
      fail(Status::kUnsupported, std::string(weight_format(t).name) + " has no random stand-in");
  }
}

// rows x n floats as a format read, not made: random codes, and per block
// the scale that gives values of the block's floats' mean magnitude, so a
// random model of that type has the size, layout and value range of a real
// one (for benchmarks and tests; the values are not an approximation of w).
void encode_stand_in(WeightType t, const float* w, size_t rows, size_t n, uint8_t* out) {
  const WeightFormat& f = weight_format(t);
  const size_t blocks = weight_row_bytes(t, n) / f.block_bytes;
  for (size_t r = 0; r < rows; ++r) {
    // Codes deterministic in the row's floats (so experts differ).
    uint32_t first, middle;
    std::memcpy(&first, w + r * n, sizeof first);
    std::memcpy(&middle, w + r * n + n / 2, sizeof middle);
    uint64_t state = (static_cast<uint64_t>(first) << 32 | middle) ^ (0x5eed0000ull + static_cast<uint64_t>(t));
    for (size_t b = 0; b < blocks; ++b) {
      uint8_t* blk = out + (r * blocks + b) * f.block_bytes;
      for (size_t i = 0; i < f.block_bytes; ++i) blk[i] = static_cast<uint8_t>(splitmix64(state));
      double sum = 0.0;
      const size_t begin = b * f.block_elements;
      const size_t end = std::min(n, begin + f.block_elements);
      for (size_t i = begin; i < end; ++i) sum += std::fabs(w[r * n + i]);
      const double mean = end > begin ? sum / static_cast<double>(end - begin) : 0.0;
      const uint16_t d = float_to_f16(static_cast<float>(mean) / stand_in_magnitude_per_d(t));
      if (t == WeightType::kIQ1_M) {
        // d's four nibbles in the top of the four 16-bit scale words (the block's last 8 bytes).
        uint8_t* scales = blk + f.block_bytes - 8;
        for (int k = 0; k < 4; ++k) {
          scales[2 * k + 1] = static_cast<uint8_t>((scales[2 * k + 1] & 0x0f) | (((d >> (4 * k)) & 0xf) << 4));
        }
      } else {
        std::memcpy(blk, &d, sizeof d);  // the f16 d leads the block
      }
    }
  }
}

void encode_rows(WeightType t, const float* w, size_t rows, size_t n, uint8_t* out, bool stand_in) {
  if (stand_in && weight_format(t).from_float == nullptr) return encode_stand_in(t, w, rows, n, out);
  convert_rows_from_float(t, w, rows, n, out, conversion_threads());
}

// n elements of one row in `dtype`'s file encoding (little-endian, as the
// x86-64 hosts Colibri runs on store it).
std::vector<uint8_t> encode_weights(const float* w, size_t n, WeightType t) {
  std::vector<uint8_t> out(weight_row_bytes(t, n));
  encode_rows(t, w, 1, n, out.data(), false);
  return out;
}

// Bytes of an expert's gate, up and down matrices in the manifest's types.
uint64_t expert_matrix_bytes(const Manifest& m, int32_t d_ff) {
  return 2 * Manifest::matrix_bytes(m.weight_type(), d_ff, m.d_model) +
         Manifest::matrix_bytes(m.down_weight_type(), m.d_model, d_ff);
}

// An expert's gate, up [F][D] and down [D][F] in the manifest's types, rows
// of whole blocks, then its f32 biases when `biased`.
std::vector<uint8_t> encode_expert(const float* w, const Manifest& m, int32_t d_ff, bool biased, bool stand_in) {
  const size_t D = static_cast<size_t>(m.d_model);
  const size_t F = static_cast<size_t>(d_ff);
  const uint64_t gate_bytes = Manifest::matrix_bytes(m.weight_type(), d_ff, m.d_model);
  const uint64_t matrices = expert_matrix_bytes(m, d_ff);
  const size_t biases = biased ? 2 * F + D : 0;
  std::vector<uint8_t> out(matrices + biases * sizeof(float));
  encode_rows(m.weight_type(), w, 2 * F, D, out.data(), stand_in);
  encode_rows(m.down_weight_type(), w + 2 * F * D, D, F, out.data() + 2 * gate_bytes, stand_in);
  if (biased) std::memcpy(out.data() + matrices, w + 3 * F * D, biases * sizeof(float));
  return out;
}

}  // namespace

void make_directories(const std::string& dir) {
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    partial = dir.substr(0, pos);
    if (partial.empty()) continue;
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      fail(Status::kIo, errno_message(partial + ": cannot create directory", errno));
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    fail(Status::kIo, dir + ": not a directory");
  }
}

void write_model_dir(const std::string& dir, const ModelWriteSpec& spec, const ModelFill& fill) {
  Manifest m;
  m.n_layers = spec.n_layers;
  m.n_experts = spec.n_experts;
  m.d_model = spec.d_model;
  m.d_ff = spec.d_ff;
  m.dtype = spec.dtype;
  m.down_dtype = spec.dtype;
  if (m.quantized()) {
    m.down_dtype = spec.down_dtype == WeightType::kF16 ? spec.dtype : spec.down_dtype;
    if (const std::string why = dtype_pair_problem(m.dtype, m.down_dtype); !why.empty()) {
      fail(Status::kInvalidArgument, "model being written: " + why);
    }
  }
  m.router = spec.router;
  m.shared_d_ff = spec.shared_d_ff;
  m.shared_gate = spec.shared_d_ff > 0 && spec.shared_gate;
  if (spec.clamped_swiglu) {
    m.activation = "clamped_swiglu";
    m.swiglu_alpha = spec.swiglu_alpha;
    m.swiglu_limit = spec.swiglu_limit;
  }
  m.expert_bias = spec.expert_bias;
  m.version = m.minimum_version();
  if (!spec.source_json.empty()) {
    if (!nlohmann::json::accept(spec.source_json)) {
      fail(Status::kInvalidArgument, "model being written: source_json is not valid JSON");
    }
    if (m.version == 1) m.version = 2;
    m.source_json = spec.source_json;
  }
  if (!fill.expert) fail(Status::kInvalidArgument, "model being written: no expert fill function");
  if (m.has_router() && !fill.router) fail(Status::kInvalidArgument, "model being written: no router fill function");
  if (m.has_shared() && !fill.shared) fail(Status::kInvalidArgument, "model being written: no shared fill function");
  // Round-trip through the parser's checks, so we never write a manifest we
  // would refuse to read.
  parse_manifest(manifest_to_json(m), "model being written");

  uint64_t total = static_cast<uint64_t>(m.n_layers) *
                   (static_cast<uint64_t>(m.n_experts) * m.expert_file_bytes(0) +
                    (m.has_router() ? m.router_file_bytes() : 0) + (m.has_shared() ? m.shared_file_bytes(0) : 0) +
                    (m.shared_gate ? m.shared_gate_file_bytes() : 0));
  uint64_t done = 0;
  auto write_one = [&](const std::string& name, const std::vector<uint8_t>& bytes) {
    write_file_atomic(dir + "/" + name, bytes.data(), bytes.size());
    if (spec.checksums) m.checksums[name] = xxh64(bytes.data(), bytes.size());
    done += bytes.size();
    if (fill.progress) fill.progress(done, total);
  };

  make_directories(dir);
  const size_t D = static_cast<size_t>(spec.d_model);
  const size_t E = static_cast<size_t>(spec.n_experts);
  std::vector<float> w(3 * D * static_cast<size_t>(std::max(spec.d_ff, m.shared_d_ff)) +
                       (m.expert_bias ? 2 * static_cast<size_t>(spec.d_ff) + D : 0));
  std::vector<float> router;
  if (m.has_router()) router.assign(E * D + (m.router_has_bias() ? E : 0), 0.0f);
  std::vector<float> gate(m.shared_gate ? D : 0);
  std::vector<uint8_t> encoded;
  for (int32_t l = 0; l < spec.n_layers; ++l) {
    if (spec.n_layers > 1) {
      const std::string first = m.expert_file(l, 0);
      make_directories(dir + "/" + first.substr(0, first.find('/')));
    }
    if (m.has_router()) {
      std::fill(router.begin(), router.end(), 0.0f);
      fill.router(l, router.data(), m.router_has_bias() ? router.data() + E * D : nullptr);
      write_one(m.router_file(l), encode_weights(router.data(), router.size(), WeightType::kF32));
    }
    for (int32_t e = 0; e < spec.n_experts; ++e) {
      if (fill.expert_encoded && !m.expert_bias) {
        encoded.resize(expert_matrix_bytes(m, spec.d_ff));
        if (fill.expert_encoded(l, e, encoded.data())) {
          write_one(m.expert_file(l, e), encoded);
          continue;
        }
      }
      fill.expert(l, e, w.data());
      write_one(m.expert_file(l, e), encode_expert(w.data(), m, spec.d_ff, m.expert_bias, spec.random_stand_in));
    }
    if (m.has_shared()) {
      encoded.resize(expert_matrix_bytes(m, m.shared_d_ff));
      if (fill.shared_encoded && fill.shared_encoded(l, encoded.data(), m.shared_gate ? gate.data() : nullptr)) {
        write_one(m.shared_file(l), encoded);
      } else {
        fill.shared(l, w.data(), m.shared_gate ? gate.data() : nullptr);
        write_one(m.shared_file(l), encode_expert(w.data(), m, m.shared_d_ff, false, spec.random_stand_in));
      }
      if (m.shared_gate) write_one(m.shared_gate_file(l), encode_weights(gate.data(), D, WeightType::kF32));
    }
  }
  write_manifest(dir, m);
}

void write_model_dir(const std::string& dir, const ModelWriteSpec& spec,
                     const std::function<void(int32_t, int32_t, float*)>& fill) {
  ModelFill f;
  f.expert = fill;
  write_model_dir(dir, spec, f);
}

namespace {

// A weight file of the model at `dir`, its size and checksum checked.
MappedFile open_weight_file(const std::string& dir, const Manifest& m, int32_t layer, const std::string& name,
                            uint64_t bytes) {
  MappedFile f(dir + "/" + name);
  if (f.size() != bytes) {
    fail(Status::kFormat, f.path() + ": " + std::to_string(f.size()) + " bytes, expected " + std::to_string(bytes) +
                                 " (" + expert_types(m, layer) + ")");
  }
  if (auto it = m.checksums.find(name); it != m.checksums.end() && xxh64(f.data(), f.size()) != it->second) {
    fail(Status::kChecksum, f.path() + ": checksum mismatch: manifest says " + format_checksum(it->second));
  }
  return f;
}

// An expert file (gate, up [F][D], down [D][F], biases when `biased`) of
// `layer` widened to floats.
void widen_expert(const MappedFile& f, const Manifest& m, int32_t layer, int32_t d_ff, bool biased, float* w) {
  const size_t D = static_cast<size_t>(m.d_model), F = static_cast<size_t>(d_ff);
  const LayerTypes t = m.layer_types(layer);
  const uint64_t gate_bytes = Manifest::matrix_bytes(t.dtype, d_ff, m.d_model);
  const uint64_t down_bytes = Manifest::matrix_bytes(t.down_dtype, m.d_model, d_ff);
  convert_rows_to_float(t.dtype, f.data(), 2 * F, D, w);
  convert_rows_to_float(t.down_dtype, f.data() + 2 * gate_bytes, D, F, w + 2 * F * D);
  if (biased) std::memcpy(w + 3 * F * D, f.data() + 2 * gate_bytes + down_bytes, (2 * F + D) * sizeof(float));
}

}  // namespace

void requantize_model_dir(const std::string& in_dir, const std::string& out_dir, WeightType dtype,
                          WeightType down_dtype, const std::function<void(float)>& progress) {
  verify_manifest_checksum(in_dir);
  const Manifest in = load_manifest(in_dir);
  ModelWriteSpec spec;
  spec.n_layers = in.n_layers;
  spec.n_experts = in.n_experts;
  spec.d_model = in.d_model;
  spec.d_ff = in.d_ff;
  spec.dtype = dtype;
  spec.down_dtype = down_dtype;
  spec.router = in.router;
  spec.shared_d_ff = in.shared_d_ff;
  spec.shared_gate = in.shared_gate;
  spec.clamped_swiglu = in.clamped_swiglu();
  spec.swiglu_alpha = in.swiglu_alpha;
  spec.swiglu_limit = in.swiglu_limit;
  spec.expert_bias = in.expert_bias;
  spec.source_json = in.source_json;
  const size_t D = static_cast<size_t>(in.d_model);
  const size_t E = static_cast<size_t>(in.n_experts);
  ModelFill fill;
  fill.expert = [&](int32_t l, int32_t e, float* w) {
    widen_expert(open_weight_file(in_dir, in, l, in.expert_file(l, e), in.expert_file_bytes(l)), in, l, in.d_ff,
                 in.expert_bias, w);
    if (progress) progress(static_cast<float>(static_cast<double>(l * in.n_experts + e + 1) / (E * in.n_layers)));
  };
  fill.router = [&](int32_t l, float* router, float* bias) {
    const MappedFile f = open_weight_file(in_dir, in, l, in.router_file(l), in.router_file_bytes());
    std::memcpy(router, f.data(), E * D * sizeof(float));
    if (bias != nullptr) std::memcpy(bias, f.data() + E * D * sizeof(float), E * sizeof(float));
  };
  fill.shared = [&](int32_t l, float* w, float* gate) {
    widen_expert(open_weight_file(in_dir, in, l, in.shared_file(l), in.shared_file_bytes(l)), in, l, in.shared_d_ff,
                 false, w);
    if (gate != nullptr) {
      const MappedFile g = open_weight_file(in_dir, in, l, in.shared_gate_file(l), in.shared_gate_file_bytes());
      std::memcpy(gate, g.data(), D * sizeof(float));
    }
  };
  write_model_dir(out_dir, spec, fill);
}

void random_expert_weights(const ModelWriteSpec& spec, uint64_t seed, int32_t layer,
                           int32_t expert, float* w) {
  uint64_t state = seed * 0x100000001b3ull ^ (static_cast<uint64_t>(layer) << 32) ^
                   static_cast<uint64_t>(expert) * 0x9e3779b97f4a7c15ull;
  const size_t DF = static_cast<size_t>(spec.d_model) * static_cast<size_t>(spec.d_ff);
  // Uniform on [-a, a] has variance a^2/3; a = sqrt(3/fan_in) gives 1/fan_in.
  const float a_in = std::sqrt(3.0f / static_cast<float>(spec.d_model));
  const float a_ff = std::sqrt(3.0f / static_cast<float>(spec.d_ff));
  for (size_t i = 0; i < 2 * DF; ++i) w[i] = a_in * uniform_pm1(state);
  for (size_t i = 2 * DF; i < 3 * DF; ++i) w[i] = a_ff * uniform_pm1(state);
  if (spec.expert_bias) {
    const size_t biases = 2 * static_cast<size_t>(spec.d_ff) + static_cast<size_t>(spec.d_model);
    for (size_t i = 0; i < biases; ++i) w[3 * DF + i] = 0.5f * uniform_pm1(state);
  }
}

void write_random_model(const std::string& dir, const ModelWriteSpec& spec, uint64_t seed) {
  ModelFill f;
  f.expert = [&](int32_t l, int32_t e, float* w) { random_expert_weights(spec, seed, l, e, w); };
  // Router, bias and shared gate at the scale of an nn.Linear of fan-in
  // d_model, from streams no expert uses.
  const float a_in = std::sqrt(3.0f / static_cast<float>(spec.d_model));
  f.router = [&](int32_t l, float* router, float* bias) {
    uint64_t state = seed * 0x100000001b3ull ^ (static_cast<uint64_t>(l) << 32) ^ 0x5eedf00dull;
    const size_t n = static_cast<size_t>(spec.n_experts) * static_cast<size_t>(spec.d_model);
    for (size_t i = 0; i < n; ++i) router[i] = a_in * uniform_pm1(state);
    if (bias != nullptr) {
      for (int32_t e = 0; e < spec.n_experts; ++e) bias[e] = 0.1f * uniform_pm1(state);
    }
  };
  f.shared = [&](int32_t l, float* w, float* gate) {
    ModelWriteSpec shared = spec;
    shared.d_ff = spec.shared_d_ff;
    random_expert_weights(shared, seed ^ 0xa5a5a5a5ull, l, spec.n_experts, w);
    if (gate != nullptr) {
      uint64_t state = seed * 0x100000001b3ull ^ (static_cast<uint64_t>(l) << 32) ^ 0x6a7eull;
      for (int32_t d = 0; d < spec.d_model; ++d) gate[d] = a_in * uniform_pm1(state);
    }
  };
  ModelWriteSpec random = spec;
  random.random_stand_in = true;
  write_model_dir(dir, random, f);
}

}  // namespace colibri
