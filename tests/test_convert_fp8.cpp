// FP8 checkpoints through convert --hf: block-scaled e4m3 experts
// (DeepSeek-V3's layout with a shared expert, per-expert tensors; a fused
// Qwen3 layout) become fp8_e4m3 files holding the checkpoint's codes and
// scales byte for byte, or any other type through their dequantised values;
// the converted models run against float64 on values decoded here,
// independently of the library's codec. Bad FP8 checkpoints are refused
// naming the field or tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "io/manifest.h"
#include "lib/hf_convert.h"
#include "reference.h"
#include "safetensors_writer.h"
#include "test_util.h"
#include "util/error.h"
#include "util/weight_format.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// e4m3 (OCP "fn": no infinities, 0x7f/0xff NaN) written out from its
// definition, not from the library.
double e4m3_value(uint8_t code) {
  const int sign = code >> 7, exp = (code >> 3) & 0xf, man = code & 7;
  if (exp == 15 && man == 7) return NAN;
  const double mag = exp == 0 ? man / 8.0 * std::ldexp(1.0, -6) : (1.0 + man / 8.0) * std::ldexp(1.0, exp - 7);
  return sign ? -mag : mag;
}

// One FP8 matrix: codes [rows][cols] and scales per br x bc tile.
struct Fp8Tensor {
  size_t rows = 0, cols = 0, br = 0, bc = 0;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  size_t tile_cols() const { return (cols + bc - 1) / bc; }
  float scale(size_t r, size_t c) const { return scales[r / br * tile_cols() + c / bc]; }
  // What the checkpoint means: code value times the tile's scale, rounded
  // once to float as every FP8 reader does.
  float value(size_t r, size_t c) const {
    return static_cast<float>(static_cast<float>(e4m3_value(codes[r * cols + c])) * scale(r, c));
  }
};

Fp8Tensor random_fp8(size_t rows, size_t cols, size_t br, size_t bc, uint32_t seed) {
  Fp8Tensor t{rows, cols, br, bc, {}, {}};
  std::mt19937 rng(seed);
  t.codes.resize(rows * cols);
  for (uint8_t& c : t.codes) {
    do c = static_cast<uint8_t>(rng()); while ((c & 0x7f) == 0x7f);  // no NaN codes: the layer must stay finite
  }
  std::uniform_real_distribution<float> s(0.5f / 448, 2.0f / 448);
  t.scales.resize((rows + br - 1) / br * t.tile_cols());
  for (float& v : t.scales) v = s(rng);
  return t;
}

std::string f32_bytes(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

// fp8_e4m3 rows as the model file must hold them: per 128 values the
// float scale then the codes, the last block zero-padded.
std::string expected_rows(const Fp8Tensor& t) {
  std::string out;
  const size_t blocks = (t.cols + 127) / 128;
  for (size_t r = 0; r < t.rows; ++r) {
    for (size_t b = 0; b < blocks; ++b) {
      const float d = t.scale(r, b * 128);
      out.append(reinterpret_cast<const char*>(&d), 4);
      for (size_t j = 0; j < 128; ++j) {
        const size_t c = b * 128 + j;
        out.push_back(c < t.cols ? static_cast<char>(t.codes[r * t.cols + c]) : '\0');
      }
    }
  }
  return out;
}

// An FP8 checkpoint of one architecture: config plus tensors; the experts'
// matrices kept as Fp8Tensor for the checks.
struct Fp8Checkpoint {
  json config;
  std::vector<colibri_test::StEntry> entries;
  std::map<std::string, Fp8Tensor> fp8;
  std::map<std::string, std::vector<float>> floats;
  uint32_t seed = 11;

  void add_fp8(const std::string& name, size_t rows, size_t cols, size_t br, size_t bc) {
    fp8[name] = random_fp8(rows, cols, br, bc, seed++);
    const Fp8Tensor& t = fp8[name];
    entries.push_back({name, "F8_E4M3", {rows, cols}, std::string(t.codes.begin(), t.codes.end())});
    entries.push_back({name + "_scale_inv", "F32", {rows / br + (rows % br != 0), t.tile_cols()}, f32_bytes(t.scales)});
  }
  // E stacked matrices [E][rows][cols] with scales [E][..][..].
  void add_fused_fp8(const std::string& name, size_t E, size_t rows, size_t cols, size_t br, size_t bc) {
    std::string codes, scales;
    for (size_t e = 0; e < E; ++e) {
      fp8[name + "#" + std::to_string(e)] = random_fp8(rows, cols, br, bc, seed++);
      const Fp8Tensor& t = fp8[name + "#" + std::to_string(e)];
      codes.append(t.codes.begin(), t.codes.end());
      scales += f32_bytes(t.scales);
    }
    const Fp8Tensor& t0 = fp8[name + "#0"];
    entries.push_back({name, "F8_E4M3", {E, rows, cols}, codes});
    entries.push_back({name + "_scale_inv", "F32", {E, rows / br + (rows % br != 0), t0.tile_cols()}, scales});
  }
  void add_float(const std::string& name, std::vector<uint64_t> shape, float scale = 0.5f) {
    size_t n = 1;
    for (uint64_t d : shape) n *= static_cast<size_t>(d);
    floats[name] = colibri_test::random_values(n, seed++, scale);
    entries.push_back({name, "F32", std::move(shape), f32_bytes(floats[name])});
  }
  void write(const std::string& dir) const {
    fs::create_directories(dir);
    colibri_test::write_bytes(dir + "/config.json", config.dump(2));
    colibri_test::write_bytes(dir + "/model.safetensors", colibri_test::safetensors_bytes(entries, {{"format", "pt"}}));
  }
};

// DeepSeek-V3: a dense first block, then MoE blocks of 4 experts and one
// shared expert; d_model 320 and expert width 136 end inside a 128 block
// and inside a tile; tiles of 64 x 128.
constexpr size_t kD = 320, kF = 136, kE = 4, kBr = 64, kBc = 128;

Fp8Checkpoint deepseek_v3() {
  Fp8Checkpoint ck;
  ck.config = {{"model_type", "deepseek_v3"}, {"hidden_size", kD}, {"num_hidden_layers", 2},
               {"num_experts_per_tok", 2}, {"n_routed_experts", kE}, {"moe_intermediate_size", kF},
               {"n_shared_experts", 1}, {"first_k_dense_replace", 1}, {"n_group", 2}, {"topk_group", 1},
               {"routed_scaling_factor", 2.0}, {"norm_topk_prob", true},
               {"quantization_config",
                {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                 {"weight_block_size", {kBr, kBc}}}}};
  const std::string b = "model.layers.1.mlp.";
  ck.add_float(b + "gate.weight", {kE, kD});
  ck.add_float(b + "gate.e_score_correction_bias", {kE}, 0.1f);
  for (size_t e = 0; e < kE; ++e) {
    const std::string x = b + "experts." + std::to_string(e) + ".";
    ck.add_fp8(x + "gate_proj.weight", kF, kD, kBr, kBc);
    ck.add_fp8(x + "up_proj.weight", kF, kD, kBr, kBc);
    ck.add_fp8(x + "down_proj.weight", kD, kF, kBr, kBc);
  }
  for (const char* p : {"gate_proj", "up_proj"}) ck.add_fp8(b + "shared_experts." + p + ".weight", kF, kD, kBr, kBc);
  ck.add_fp8(b + "shared_experts.down_proj.weight", kD, kF, kBr, kBc);
  ck.add_fp8("model.layers.0.mlp.gate_proj.weight", 256, kD, kBr, kBc);  // the dense block: ignored
  return ck;
}

colibri::HfConvertResult convert(const std::string& hf, const std::string& out,
                                 std::optional<colibri::WeightType> dtype = std::nullopt) {
  colibri::HfConvertOptions o;
  o.hf_dir = hf;
  o.out_dir = out;
  o.dtype = dtype;
  return colibri::convert_hf_checkpoint(o);
}

// gate, up [F][D] and down [D][F] of one expert as the checkpoint means them.
std::vector<double> expert_values(const Fp8Tensor& gate, const Fp8Tensor& up, const Fp8Tensor& down) {
  std::vector<double> w;
  for (const Fp8Tensor* t : {&gate, &up, &down}) {
    for (size_t r = 0; r < t->rows; ++r) {
      for (size_t c = 0; c < t->cols; ++c) w.push_back(t->value(r, c));
    }
  }
  return w;
}

// Runs `out`'s only layer with explicit routing and returns the relative
// L2 distance to the float64 layer of `experts` (and `shared`, if any).
double layer_error(const std::string& out, const std::vector<std::vector<double>>& experts,
                   const std::vector<double>& shared, size_t D, size_t F) {
  colibri_open_options_t options;
  colibri_open_options_default(&options);
  options.n_threads = 2;
  options.lock_memory = 0;
  colibri_model_t* model = nullptr;
  EXPECT_EQ(colibri_open(out.c_str(), &options, &model), COLIBRI_OK) << colibri_last_error();
  if (model == nullptr) return INFINITY;
  const int32_t T = 6, k = 2;
  const size_t E = experts.size();
  const std::vector<float> x = colibri_test::random_values(static_cast<size_t>(T) * D, 5, 1.0f);
  std::vector<int32_t> ids(static_cast<size_t>(T) * k);
  std::vector<float> wts(ids.size());
  std::vector<double> ref(x.size(), 0.0);
  for (size_t t = 0; t < static_cast<size_t>(T); ++t) {
    ids[t * k] = static_cast<int32_t>(t % E);
    ids[t * k + 1] = static_cast<int32_t>((t + 1) % E);
    wts[t * k] = 0.7f;
    wts[t * k + 1] = 0.3f;
    for (size_t j = 0; j < static_cast<size_t>(k); ++j) {
      const std::vector<double>& w = experts[static_cast<size_t>(ids[t * k + j])];
      const std::vector<double> y = colibri_test::swiglu_ffn(w, D, F, x.data() + t * D);
      for (size_t d = 0; d < D; ++d) ref[t * D + d] += wts[t * k + j] * y[d];
    }
    if (!shared.empty()) {
      const std::vector<double> y = colibri_test::swiglu_ffn(shared, D, F, x.data() + t * D);
      for (size_t d = 0; d < D; ++d) ref[t * D + d] += y[d];
    }
  }
  std::vector<float> y(x.size(), NAN);
  colibri_infer_t inf;
  colibri_infer_default(&inf);
  inf.layer = 0;
  inf.n_tokens = T;
  inf.input = x.data();
  inf.output = y.data();
  inf.top_k = k;
  inf.expert_ids = ids.data();
  inf.expert_weights = wts.data();
  EXPECT_EQ(colibri_infer(model, &inf), COLIBRI_OK) << colibri_last_error();
  colibri_free(model);
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (y[i] - ref[i]) * (y[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
}

TEST(ConvertFp8, DeepSeekV3KeepsCodesAndScalesAsStored) {
  const Fp8Checkpoint ck = deepseek_v3();
  colibri_test::TempDir tmp("convert_fp8");
  const std::string hf = tmp.path() + "/hf", out = tmp.path() + "/out";
  ck.write(hf);
  const colibri::HfConvertResult r = convert(hf, out);
  EXPECT_EQ(r.source_dtype, colibri::WeightType::kFP8_E4M3);
  EXPECT_EQ(r.dtype, colibri::WeightType::kFP8_E4M3);
  EXPECT_EQ(r.layers, (std::vector<int32_t>{1}));

  const colibri::Manifest m = colibri::load_manifest(out);
  EXPECT_EQ(m.dtype, colibri::WeightType::kFP8_E4M3);
  EXPECT_EQ(m.down_dtype, colibri::WeightType::kFP8_E4M3);
  ASSERT_EQ(m.shared_d_ff, static_cast<int32_t>(kF));
  const std::string b = "model.layers.1.mlp.";
  std::vector<std::vector<double>> experts;
  for (size_t e = 0; e < kE; ++e) {
    const std::string x = b + "experts." + std::to_string(e) + ".";
    const Fp8Tensor& g = ck.fp8.at(x + "gate_proj.weight");
    const Fp8Tensor& u = ck.fp8.at(x + "up_proj.weight");
    const Fp8Tensor& d = ck.fp8.at(x + "down_proj.weight");
    EXPECT_EQ(colibri_test::file_bytes(out + "/" + m.expert_file(0, static_cast<int32_t>(e))),
              expected_rows(g) + expected_rows(u) + expected_rows(d))
        << "expert " << e;
    experts.push_back(expert_values(g, u, d));
  }
  const std::string s = b + "shared_experts.";
  const Fp8Tensor& sg = ck.fp8.at(s + "gate_proj.weight");
  const Fp8Tensor& su = ck.fp8.at(s + "up_proj.weight");
  const Fp8Tensor& sd = ck.fp8.at(s + "down_proj.weight");
  EXPECT_EQ(colibri_test::file_bytes(out + "/" + m.shared_file(0)),
            expected_rows(sg) + expected_rows(su) + expected_rows(sd));
  EXPECT_EQ(colibri_verify_dir(out.c_str()), COLIBRI_OK) << colibri_last_error();
  // fp32 activations against fp32 products: float64 within rounding.
  EXPECT_LE(layer_error(out, experts, expert_values(sg, su, sd), kD, kF), 1e-5);
}

TEST(ConvertFp8, OtherTypesComeFromTheDequantisedValues) {
  const Fp8Checkpoint ck = deepseek_v3();
  colibri_test::TempDir tmp("convert_fp8");
  const std::string hf = tmp.path() + "/hf";
  ck.write(hf);
  const std::string b = "model.layers.1.mlp.experts.";
  for (colibri::WeightType t : {colibri::WeightType::kF32, colibri::WeightType::kQ8_0}) {
    SCOPED_TRACE(colibri::weight_format(t).name);
    const std::string out = tmp.path() + "/" + colibri::weight_format(t).name;
    EXPECT_EQ(convert(hf, out, t).dtype, t);
    const colibri::Manifest m = colibri::load_manifest(out);
    std::vector<std::vector<double>> experts;
    for (size_t e = 0; e < kE; ++e) {
      const std::string x = b + std::to_string(e) + ".";
      experts.push_back(expert_values(ck.fp8.at(x + "gate_proj.weight"), ck.fp8.at(x + "up_proj.weight"),
                                      ck.fp8.at(x + "down_proj.weight")));
      // The file holds the dequantised values rounded by the writer.
      std::vector<float> w(experts.back().begin(), experts.back().end());
      std::string want;
      for (const auto& [rows, cols, off] : {std::tuple{kF, kD, size_t{0}}, std::tuple{kF, kD, kF * kD},
                                            std::tuple{kD, kF, 2 * kF * kD}}) {
        std::vector<uint8_t> bytes(colibri::weight_row_bytes(t, cols) * rows);
        colibri::convert_rows_from_float(t, w.data() + off, rows, cols, bytes.data(), 1);
        want.append(bytes.begin(), bytes.end());
      }
      EXPECT_EQ(colibri_test::file_bytes(out + "/" + m.expert_file(0, static_cast<int32_t>(e))), want)
          << "expert " << e;
    }
    const std::string s = "model.layers.1.mlp.shared_experts.";
    const double err = layer_error(out, experts,
                                   expert_values(ck.fp8.at(s + "gate_proj.weight"), ck.fp8.at(s + "up_proj.weight"),
                                                 ck.fp8.at(s + "down_proj.weight")),
                                   kD, kF);
    EXPECT_LE(err, t == colibri::WeightType::kF32 ? 1e-5 : 2e-2);
  }
}

TEST(ConvertFp8, FusedQwen3Experts) {
  Fp8Checkpoint ck;
  constexpr size_t D = 256, F = 96, E = 3;
  ck.config = {{"model_type", "qwen3_moe"}, {"hidden_size", D}, {"num_hidden_layers", 1},
               {"num_experts_per_tok", 2}, {"num_experts", E}, {"moe_intermediate_size", F},
               {"norm_topk_prob", true},
               {"quantization_config", {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}}}};
  ck.add_float("model.layers.0.mlp.gate.weight", {E, D});
  ck.add_fused_fp8("model.layers.0.mlp.experts.gate_up_proj", E, 2 * F, D, 128, 128);
  ck.add_fused_fp8("model.layers.0.mlp.experts.down_proj", E, D, F, 128, 128);
  colibri_test::TempDir tmp("convert_fp8");
  const std::string hf = tmp.path() + "/hf", out = tmp.path() + "/out";
  ck.write(hf);
  EXPECT_EQ(convert(hf, out).fused_layers, 1);
  const colibri::Manifest m = colibri::load_manifest(out);
  std::vector<std::vector<double>> experts;
  for (size_t e = 0; e < E; ++e) {
    // gate_up's 2F rows in 128-row tiles: gate and up share the tile that
    // straddles row F.
    const Fp8Tensor& gu = ck.fp8.at("model.layers.0.mlp.experts.gate_up_proj#" + std::to_string(e));
    const Fp8Tensor& dn = ck.fp8.at("model.layers.0.mlp.experts.down_proj#" + std::to_string(e));
    EXPECT_EQ(colibri_test::file_bytes(out + "/" + m.expert_file(0, static_cast<int32_t>(e))),
              expected_rows(gu) + expected_rows(dn));
    std::vector<double> w;
    for (const Fp8Tensor* t : {&gu, &dn}) {
      for (size_t r = 0; r < t->rows; ++r) {
        for (size_t c = 0; c < t->cols; ++c) w.push_back(t->value(r, c));
      }
    }
    experts.push_back(w);
  }
  EXPECT_LE(layer_error(out, experts, {}, D, F), 1e-5);
}

// A conversion that must fail with every needle in its message.
void expect_refused(const Fp8Checkpoint& ck, colibri::Status status, const std::vector<std::string>& needles) {
  colibri_test::TempDir tmp("convert_fp8_bad");
  const std::string hf = tmp.path() + "/hf", out = tmp.path() + "/out";
  ck.write(hf);
  try {
    convert(hf, out);
    ADD_FAILURE() << "converted";
  } catch (const colibri::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    const std::string msg = e.what();
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "no \"" << n << "\" in: " << msg;
  }
  EXPECT_FALSE(fs::exists(out));
}

TEST(ConvertFp8, BadCheckpointsAreNamed) {
  const Fp8Checkpoint good = deepseek_v3();
  const std::string x = "model.layers.1.mlp.experts.2.up_proj.weight";
  auto with_quant = [&](const json& change) {
    Fp8Checkpoint ck = good;
    ck.config["quantization_config"].update(change);
    return ck;
  };
  expect_refused(with_quant({{"fmt", "e5m2"}}), colibri::Status::kUnsupported, {"quantization_config", "\"fmt\""});
  expect_refused(with_quant({{"activation_scheme", "static"}}), colibri::Status::kUnsupported, {"activation_scheme"});
  expect_refused(with_quant({{"weight_block_size", {128, 64}}}), colibri::Status::kFormat,
                 {"weight_block_size", "multiple of 128"});
  expect_refused(with_quant({{"weight_block_size", "128"}}), colibri::Status::kFormat, {"weight_block_size"});
  expect_refused(with_quant({{"quant_method", "gptq"}}), colibri::Status::kUnsupported, {"\"gptq\"", "quant_method"});
  Fp8Checkpoint ck = good;
  ck.config.erase("quantization_config");
  expect_refused(ck, colibri::Status::kFormat, {"F8_E4M3", "quantization_config"});

  ck = good;
  for (auto& e : ck.entries) {
    if (e.name == x + "_scale_inv") e.name = "unused_scale_inv";
  }
  expect_refused(ck, colibri::Status::kFormat, {x, "no \"" + x + "_scale_inv\""});
  ck = good;
  for (auto& e : ck.entries) {
    if (e.name == x + "_scale_inv") {
      e.shape = {1, 3};
      e.bytes = f32_bytes({1, 1, 1});
    }
  }
  expect_refused(ck, colibri::Status::kFormat, {x + "_scale_inv", "shape [1, 3], expected [3, 3]"});
  ck = good;
  for (auto& e : ck.entries) {
    if (e.name == x) e.dtype = "F8_E5M2";
  }
  expect_refused(ck, colibri::Status::kFormat, {x, "F8_E5M2"});
}

}  // namespace
