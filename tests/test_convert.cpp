// Hugging Face checkpoint conversion: small checkpoints in each family's
// tensor naming (per-expert and fused expert layouts, one file and sharded)
// are converted and the model checked file by file against the source
// values, then opened and run against the float64 reference. Bad input of
// every kind is refused with a message naming the file, tensor or field, and
// leaves no output directory behind. The CLI is exercised at the end.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "lib/hf_convert.h"
#include "io/manifest.h"
#include "reference.h"
#include "safetensors_writer.h"
#include "test_util.h"
#include "util/error.h"
#include "util/half.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int kD = 16;  // hidden_size in every case

struct Tensor {
  std::string dtype;
  std::vector<uint64_t> shape;
  std::vector<float> values;  // exactly what the checkpoint stores
  std::string raw;            // when set, stored instead of values (bad dtypes)
};

// A checkpoint under construction: config.json plus named tensors.
struct Checkpoint {
  json config;
  std::map<std::string, Tensor> tensors;
  uint32_t seed = 1;

  void add(const std::string& name, const std::string& dtype, std::vector<uint64_t> shape, float scale = 0.5f) {
    size_t n = 1;
    for (uint64_t d : shape) n *= static_cast<size_t>(d);
    tensors[name] = {dtype, std::move(shape),
                     colibri_test::round_to(dtype, colibri_test::random_values(n, seed++, scale)), ""};
  }
  const std::vector<float>& values(const std::string& name) const {
    const auto it = tensors.find(name);
    if (it == tensors.end()) throw std::runtime_error("test checkpoint has no tensor " + name);
    return it->second.values;
  }

  // One model.safetensors, or `shards` files with an index (tensors dealt
  // round-robin, so one layer's tensors spread over several shards).
  void write(const std::string& dir, int shards = 1) const {
    fs::create_directories(dir);
    colibri_test::write_bytes(dir + "/config.json", config.dump(2));
    std::vector<std::vector<colibri_test::StEntry>> files(static_cast<size_t>(shards));
    json weight_map = json::object();
    size_t i = 0;
    for (const auto& [name, t] : tensors) {
      const size_t s = i++ % static_cast<size_t>(shards);
      files[s].push_back({name, t.dtype, t.shape, t.raw.empty() ? colibri_test::encode_values(t.dtype, t.values) : t.raw});
      weight_map[name] = shard_name(s, shards);
    }
    if (shards == 1) {
      colibri_test::write_bytes(dir + "/model.safetensors", colibri_test::safetensors_bytes(files[0], {{"format", "pt"}}));
      return;
    }
    for (size_t s = 0; s < files.size(); ++s) {
      colibri_test::write_bytes(dir + "/" + shard_name(s, shards), colibri_test::safetensors_bytes(files[s]));
    }
    colibri_test::write_bytes(dir + "/model.safetensors.index.json",
                              json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2));
  }
  static std::string shard_name(size_t s, int n) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05d.safetensors", s + 1, n);
    return buf;
  }
};

// One family case: its config and how its tensors are named and laid out,
// plus what the converted model must say.
struct Case {
  std::string label;
  json config;
  std::string dtype = "BF16";      // of the expert tensors
  std::string router_dtype = "BF16";
  std::string block = "mlp";       // "block_sparse_moe" for classic Mixtral
  bool mixtral_proj = false;       // w1/w3/w2
  bool fused = false;
  bool fused_suffix = false;       // fused tensors named with ".weight"
  int shards = 1;
  std::vector<int32_t> moe_layers;
  colibri::RouterFamily family = colibri::RouterFamily::kNone;
  int32_t n_experts = 4, d_ff = 8, top_k = 2, norm = 0, n_group = 1, topk_group = 1;
  float scale = 1.0f;
  int32_t shared_d_ff = 0;
  bool shared_gate = false;   // Qwen2-MoE
  bool deepseek_shared = false;
  bool bias = false;          // DeepSeek-V3
};

// gtest prints parameters of failed tests; the label says it all.
void PrintTo(const Case& c, std::ostream* os) { *os << c.label; }

std::string layer_block(const Case& c, int32_t i) { return "model.layers." + std::to_string(i) + "." + c.block; }

const char* const kProj[3] = {"gate_proj", "up_proj", "down_proj"};
const char* const kMixtralProj[3] = {"w1", "w3", "w2"};

Checkpoint build(const Case& c) {
  Checkpoint ck;
  ck.config = c.config;
  const uint64_t E = static_cast<uint64_t>(c.n_experts), D = kD, F = static_cast<uint64_t>(c.d_ff);
  const int32_t L = c.config.at("num_hidden_layers").get<int32_t>();
  // Tensors the converter must ignore.
  ck.add("model.embed_tokens.weight", c.dtype, {32, D});
  ck.add("lm_head.weight", c.dtype, {32, D});
  ck.add("model.norm.weight", c.dtype, {D});
  for (int32_t i = 0; i < L; ++i) {
    const std::string layer = "model.layers." + std::to_string(i) + ".";
    ck.add(layer + "self_attn.q_proj.weight", c.dtype, {D, D});
    ck.add(layer + "input_layernorm.weight", c.dtype, {D});
    if (std::find(c.moe_layers.begin(), c.moe_layers.end(), i) == c.moe_layers.end()) {
      for (const char* p : kProj) ck.add(layer + "mlp." + p + ".weight", c.dtype, {p[0] == 'd' ? D : 24, p[0] == 'd' ? 24 : D});
      continue;
    }
    const std::string b = layer_block(c, i);
    ck.add(b + ".gate.weight", c.router_dtype, {E, D});
    if (c.bias) ck.add(b + ".gate.e_score_correction_bias", "F32", {E}, 0.2f);
    if (c.fused) {
      const std::string sfx = c.fused_suffix ? ".weight" : "";
      ck.add(b + ".experts.gate_up_proj" + sfx, c.dtype, {E, 2 * F, D});
      ck.add(b + ".experts.down_proj" + sfx, c.dtype, {E, D, F});
    } else {
      const char* const* proj = c.mixtral_proj ? kMixtralProj : kProj;
      for (uint64_t e = 0; e < E; ++e) {
        const std::string x = b + ".experts." + std::to_string(e) + ".";
        ck.add(x + proj[0] + ".weight", c.dtype, {F, D});
        ck.add(x + proj[1] + ".weight", c.dtype, {F, D});
        ck.add(x + proj[2] + ".weight", c.dtype, {D, F});
      }
    }
    if (c.shared_d_ff > 0) {
      const uint64_t S = static_cast<uint64_t>(c.shared_d_ff);
      const std::string s = b + (c.deepseek_shared ? ".shared_experts." : ".shared_expert.");
      ck.add(s + "gate_proj.weight", c.dtype, {S, D});
      ck.add(s + "up_proj.weight", c.dtype, {S, D});
      ck.add(s + "down_proj.weight", c.dtype, {D, S});
      if (c.shared_gate) ck.add(b + ".shared_expert_gate.weight", c.dtype, {1, D});
    }
  }
  return ck;
}

// Expert e of HF layer i as the expert file lays it out: gate, up, down.
std::vector<float> expert_values(const Checkpoint& ck, const Case& c, int32_t i, int32_t e) {
  const std::string b = layer_block(c, i);
  const size_t DF = static_cast<size_t>(kD) * static_cast<size_t>(c.d_ff);
  std::vector<float> w;
  if (c.fused) {
    const std::string sfx = c.fused_suffix ? ".weight" : "";
    const std::vector<float>& gu = ck.values(b + ".experts.gate_up_proj" + sfx);
    const std::vector<float>& dn = ck.values(b + ".experts.down_proj" + sfx);
    w.assign(gu.begin() + static_cast<ptrdiff_t>(2 * DF * e), gu.begin() + static_cast<ptrdiff_t>(2 * DF * (e + 1)));
    w.insert(w.end(), dn.begin() + static_cast<ptrdiff_t>(DF * e), dn.begin() + static_cast<ptrdiff_t>(DF * (e + 1)));
    return w;
  }
  const char* const* proj = c.mixtral_proj ? kMixtralProj : kProj;
  for (int k = 0; k < 3; ++k) {
    const std::vector<float>& v = ck.values(b + ".experts." + std::to_string(e) + "." + proj[k] + ".weight");
    w.insert(w.end(), v.begin(), v.end());
  }
  return w;
}

std::vector<float> shared_values(const Checkpoint& ck, const Case& c, int32_t i) {
  const std::string s = layer_block(c, i) + (c.deepseek_shared ? ".shared_experts." : ".shared_expert.");
  std::vector<float> w;
  for (const char* p : kProj) {
    const std::vector<float>& v = ck.values(s + p + ".weight");
    w.insert(w.end(), v.begin(), v.end());
  }
  return w;
}

std::string st_name(colibri::WeightType d) {
  return d == colibri::WeightType::kF32 ? "F32" : d == colibri::WeightType::kF16 ? "F16" : "BF16";
}

std::vector<double> decode(const std::string& bytes, colibri::WeightType d) {
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  std::vector<double> out;
  if (d == colibri::WeightType::kF32) {
    for (size_t i = 0; i + 4 <= bytes.size(); i += 4) {
      out.push_back(colibri::bits_float(static_cast<uint32_t>(b[i]) | static_cast<uint32_t>(b[i + 1]) << 8 |
                                        static_cast<uint32_t>(b[i + 2]) << 16 | static_cast<uint32_t>(b[i + 3]) << 24));
    }
    return out;
  }
  for (size_t i = 0; i + 2 <= bytes.size(); i += 2) {
    const uint16_t h = static_cast<uint16_t>(b[i] | b[i + 1] << 8);
    out.push_back(d == colibri::WeightType::kF16 ? colibri::f16_to_float(h) : colibri::bf16_to_float(h));
  }
  return out;
}

bool no_partial_left(const std::string& out) {
  const fs::path p(out);
  for (const auto& entry : fs::directory_iterator(p.parent_path())) {
    if (entry.path().filename().string().rfind(p.filename().string() + ".partial", 0) == 0) return false;
  }
  return true;
}

colibri::HfConvertResult convert(const std::string& hf, const std::string& out,
                                 std::optional<colibri::WeightType> dtype = std::nullopt) {
  colibri::HfConvertOptions o;
  o.hf_dir = hf;
  o.out_dir = out;
  o.dtype = dtype;
  return colibri::convert_hf_checkpoint(o);
}

// Everything the converted model at `out` must hold, checked byte by byte
// against the checkpoint, then by running it.
void check_model(const std::string& out, const Checkpoint& ck, const Case& c, colibri::WeightType dtype,
                 const std::vector<int32_t>& hf_layers) {
  const colibri::Manifest m = colibri::load_manifest(out);
  ASSERT_EQ(m.n_layers, static_cast<int32_t>(hf_layers.size()));
  EXPECT_EQ(m.version, 2);
  EXPECT_EQ(m.n_experts, c.n_experts);
  EXPECT_EQ(m.d_model, kD);
  EXPECT_EQ(m.d_ff, c.d_ff);
  EXPECT_EQ(m.dtype, dtype);
  EXPECT_EQ(m.router.family, c.family);
  EXPECT_EQ(m.router.top_k, c.top_k);
  EXPECT_EQ(m.router.norm_topk_prob, c.norm);
  EXPECT_EQ(m.router.n_group, c.n_group);
  EXPECT_EQ(m.router.topk_group, c.topk_group);
  EXPECT_EQ(m.router.routed_scaling_factor, c.scale);
  EXPECT_EQ(m.shared_d_ff, c.shared_d_ff);
  EXPECT_EQ(m.shared_gate, c.shared_gate);
  const json source = json::parse(m.source_json);
  EXPECT_EQ(source.at("format"), "hf");
  EXPECT_EQ(source.at("model_type"), c.config.at("model_type"));
  EXPECT_EQ(source.at("layers").get<std::vector<int32_t>>(), hf_layers);
  EXPECT_EQ(m.checksums.size(),
            hf_layers.size() * (static_cast<size_t>(c.n_experts) + 1 + (c.shared_d_ff > 0) + c.shared_gate));

  const std::string out_dtype = st_name(dtype);
  for (size_t j = 0; j < hf_layers.size(); ++j) {
    const int32_t hf = hf_layers[j], l = static_cast<int32_t>(j);
    SCOPED_TRACE("HF layer " + std::to_string(hf));
    const std::string b = layer_block(c, hf);
    for (int32_t e = 0; e < c.n_experts; ++e) {
      EXPECT_EQ(colibri_test::file_bytes(out + "/" + m.expert_file(l, e)),
                colibri_test::encode_values(out_dtype, expert_values(ck, c, hf, e)))
          << "expert " << e;
    }
    std::vector<float> router = ck.values(b + ".gate.weight");
    if (c.bias) {
      const std::vector<float>& bias = ck.values(b + ".gate.e_score_correction_bias");
      router.insert(router.end(), bias.begin(), bias.end());
    }
    EXPECT_EQ(colibri_test::file_bytes(out + "/" + m.router_file(l)), colibri_test::encode_values("F32", router));
    if (c.shared_d_ff > 0) {
      EXPECT_EQ(colibri_test::file_bytes(out + "/" + m.shared_file(l)),
                colibri_test::encode_values(out_dtype, shared_values(ck, c, hf)));
    }
    EXPECT_EQ(fs::exists(out + "/" + m.shared_gate_file(l)), c.shared_gate);
    if (c.shared_gate) {
      EXPECT_EQ(colibri_test::file_bytes(out + "/" + m.shared_gate_file(l)),
                colibri_test::encode_values("F32", ck.values(b + ".shared_expert_gate.weight")));
    }
  }
  EXPECT_EQ(colibri_verify_dir(out.c_str()), COLIBRI_OK) << colibri_last_error();

  // The model opens and computes what its files say: explicit routing on
  // the last layer against the float64 reference, shared expert included.
  colibri_open_options_t options;
  colibri_open_options_default(&options);
  options.n_threads = 2;
  options.lock_memory = 0;
  colibri_model_t* model = nullptr;
  ASSERT_EQ(colibri_open(out.c_str(), &options, &model), COLIBRI_OK) << colibri_last_error();
  colibri_model_info_t info;
  ASSERT_EQ(colibri_model_info(model, &info), COLIBRI_OK);
  EXPECT_EQ(info.n_layers, static_cast<int32_t>(hf_layers.size()));
  EXPECT_EQ(static_cast<int>(info.router_family), static_cast<int>(c.family));
  EXPECT_EQ(info.router_top_k, c.top_k);
  EXPECT_EQ(info.shared_d_ff, c.shared_d_ff);

  const int32_t T = 5, k = 2, layer = m.n_layers - 1;
  const std::vector<float> x = colibri_test::random_values(static_cast<size_t>(T) * kD, 99);
  std::vector<int32_t> ids(static_cast<size_t>(T) * k);
  std::vector<float> wts(ids.size());
  for (int32_t t = 0; t < T; ++t) {
    ids[static_cast<size_t>(t) * k] = t % c.n_experts;
    ids[static_cast<size_t>(t) * k + 1] = (t + 1 + t / c.n_experts) % c.n_experts;
    if (ids[static_cast<size_t>(t) * k + 1] == ids[static_cast<size_t>(t) * k]) ids[static_cast<size_t>(t) * k + 1] = -1;
    wts[static_cast<size_t>(t) * k] = 0.75f;
    wts[static_cast<size_t>(t) * k + 1] = 0.25f - 0.125f * static_cast<float>(t);
  }
  std::vector<double> ref = colibri_test::reference_layer(out, layer, T, x.data(), k, ids.data(), wts.data());
  if (c.shared_d_ff > 0) {
    const std::vector<double> sw = decode(colibri_test::file_bytes(out + "/" + m.shared_file(layer)), dtype);
    std::vector<double> gate;
    if (c.shared_gate) {
      gate = decode(colibri_test::file_bytes(out + "/" + m.shared_gate_file(layer)), colibri::WeightType::kF32);
    }
    for (int32_t t = 0; t < T; ++t) {
      const float* xt = x.data() + static_cast<size_t>(t) * kD;
      double s = 1.0;
      if (c.shared_gate) {
        double g = 0;
        for (int d = 0; d < kD; ++d) g += gate[static_cast<size_t>(d)] * xt[d];
        s = 1.0 / (1.0 + std::exp(-g));
      }
      const std::vector<double> y = colibri_test::swiglu_ffn(sw, kD, static_cast<size_t>(c.shared_d_ff), xt);
      for (int d = 0; d < kD; ++d) ref[static_cast<size_t>(t) * kD + d] += s * y[static_cast<size_t>(d)];
    }
  }
  std::vector<float> y(x.size(), NAN);
  colibri_infer_t inf;
  colibri_infer_default(&inf);
  inf.layer = layer;
  inf.n_tokens = T;
  inf.input = x.data();
  inf.output = y.data();
  inf.top_k = k;
  inf.expert_ids = ids.data();
  inf.expert_weights = wts.data();
  ASSERT_EQ(colibri_infer(model, &inf), COLIBRI_OK) << colibri_last_error();
  EXPECT_LE(colibri_test::relative_l2(y.data(), ref), dtype == colibri::WeightType::kF32 ? 1e-5 : 5e-3);

  // Mixtral's rule is simple enough to restate here: this checks the router
  // file's orientation ([E][D], not transposed) through the engine.
  if (c.family == colibri::RouterFamily::kMixtral) {
    const std::vector<float>& gw = ck.values(layer_block(c, hf_layers.back()) + ".gate.weight");
    const size_t E = static_cast<size_t>(c.n_experts), K = static_cast<size_t>(c.top_k);
    std::vector<int32_t> rid(static_cast<size_t>(T) * K);
    std::vector<float> rw(rid.size());
    ASSERT_EQ(colibri_route(model, layer, T, x.data(), rid.data(), rw.data()), COLIBRI_OK) << colibri_last_error();
    for (size_t t = 0; t < static_cast<size_t>(T); ++t) {
      std::vector<double> logits(E);
      for (size_t e = 0; e < E; ++e) {
        for (size_t d = 0; d < kD; ++d) logits[e] += static_cast<double>(gw[e * kD + d]) * x[t * kD + d];
      }
      std::vector<int32_t> order(E);
      for (size_t e = 0; e < E; ++e) order[e] = static_cast<int32_t>(e);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
      });
      double sum = 0;
      for (size_t j = 0; j < K; ++j) sum += std::exp(logits[static_cast<size_t>(order[j])]);
      for (size_t j = 0; j < K; ++j) {
        EXPECT_EQ(rid[t * K + j], order[j]) << "token " << t;
        EXPECT_NEAR(rw[t * K + j], std::exp(logits[static_cast<size_t>(order[j])]) / sum, 1e-5) << "token " << t;
      }
    }
  }
  colibri_free(model);
}

json base_config(const std::string& model_type, int32_t layers) {
  return {{"model_type", model_type}, {"hidden_size", kD}, {"num_hidden_layers", layers},
          {"num_experts_per_tok", 2}, {"torch_dtype", "bfloat16"}, {"vocab_size", 32}};
}

Case mixtral_case() {
  Case c;
  c.label = "mixtral";
  c.config = base_config("mixtral", 3);
  c.config["num_local_experts"] = 4;
  c.config["intermediate_size"] = 8;
  c.block = "block_sparse_moe";
  c.mixtral_proj = true;
  c.moe_layers = {0, 1, 2};
  c.family = colibri::RouterFamily::kMixtral;
  c.norm = 1;
  return c;
}

std::vector<Case> family_cases() {
  std::vector<Case> cases;
  cases.push_back(mixtral_case());
  {
    Case c = mixtral_case();  // newer transformers: "mlp" block, fused experts
    c.label = "mixtral_fused_f16_sharded";
    c.block = "mlp";
    c.fused = true;
    c.dtype = "F16";
    c.router_dtype = "F32";
    c.shards = 2;
    cases.push_back(c);
  }
  {
    Case c;
    c.label = "qwen2_moe";
    c.config = base_config("qwen2_moe", 4);
    c.config.update({{"num_experts", 4}, {"moe_intermediate_size", 8}, {"intermediate_size", 24},
                     {"shared_expert_intermediate_size", 12}, {"decoder_sparse_step", 1}, {"mlp_only_layers", {2}}});
    c.moe_layers = {0, 1, 3};
    c.family = colibri::RouterFamily::kQwen2Moe;
    c.shared_d_ff = 12;
    c.shared_gate = true;
    cases.push_back(c);
  }
  {
    Case c = cases.back();
    c.label = "qwen2_moe_fused_f32_step2";
    c.config["decoder_sparse_step"] = 2;
    c.config["mlp_only_layers"] = json::array();
    c.config["norm_topk_prob"] = true;
    c.norm = 1;
    c.moe_layers = {1, 3};
    c.fused = true;
    c.fused_suffix = true;
    c.dtype = "F32";
    cases.push_back(c);
  }
  {
    Case c;
    c.label = "qwen3_moe_f16";
    c.config = base_config("qwen3_moe", 3);
    c.config.update({{"num_experts", 4}, {"moe_intermediate_size", 8}, {"intermediate_size", 24},
                     {"norm_topk_prob", true}, {"mlp_only_layers", {0}}});
    c.dtype = "F16";
    c.moe_layers = {1, 2};
    c.family = colibri::RouterFamily::kQwen3Moe;
    c.norm = 1;
    cases.push_back(c);
  }
  {
    Case c = cases.back();
    c.label = "qwen3_moe_fused";
    c.dtype = "BF16";
    c.fused = true;
    cases.push_back(c);
  }
  {
    Case c;
    c.label = "olmoe";
    c.config = base_config("olmoe", 2);
    c.config.update({{"num_experts", 4}, {"intermediate_size", 8}});
    c.moe_layers = {0, 1};
    c.family = colibri::RouterFamily::kOlmoe;
    cases.push_back(c);
  }
  {
    Case c;
    c.label = "deepseek_v2";
    c.config = base_config("deepseek_v2", 3);
    c.config.update({{"n_routed_experts", 8}, {"moe_intermediate_size", 8}, {"intermediate_size", 24},
                     {"n_shared_experts", 2}, {"first_k_dense_replace", 1}, {"moe_layer_freq", 1},
                     {"topk_method", "group_limited_greedy"}, {"n_group", 4}, {"topk_group", 2},
                     {"routed_scaling_factor", 2.5}, {"scoring_func", "softmax"}});
    c.n_experts = 8;
    c.moe_layers = {1, 2};
    c.family = colibri::RouterFamily::kDeepseekV2;
    c.n_group = 4;
    c.topk_group = 2;
    c.scale = 2.5f;
    c.shared_d_ff = 16;
    c.deepseek_shared = true;
    cases.push_back(c);
  }
  {
    Case c;
    c.label = "deepseek_v3_fused_sharded";
    c.config = base_config("deepseek_v3", 5);
    c.config.update({{"n_routed_experts", 8}, {"moe_intermediate_size", 8}, {"intermediate_size", 24},
                     {"n_shared_experts", 1}, {"first_k_dense_replace", 1}, {"moe_layer_freq", 2},
                     {"topk_method", "noaux_tc"}, {"n_group", 4}, {"topk_group", 2}, {"n_shared_experts", 1},
                     {"routed_scaling_factor", 2.5}, {"scoring_func", "sigmoid"}});
    c.n_experts = 8;
    c.moe_layers = {2, 4};
    c.family = colibri::RouterFamily::kDeepseekV3;
    c.norm = 1;  // V3's default
    c.n_group = 4;
    c.topk_group = 2;
    c.scale = 2.5f;
    c.shared_d_ff = 8;
    c.deepseek_shared = true;
    c.bias = true;
    c.fused = true;
    c.router_dtype = "F32";
    c.shards = 3;
    cases.push_back(c);
  }
  {
    Case c = cases.back();
    c.label = "deepseek_v3_per_expert";
    c.fused = false;
    c.shards = 1;
    cases.push_back(c);
  }
  return cases;
}

colibri::WeightType weight_type_of_st(const std::string& st) {
  return st == "F32" ? colibri::WeightType::kF32 : st == "F16" ? colibri::WeightType::kF16 : colibri::WeightType::kBF16;
}

class FamilyTest : public ::testing::TestWithParam<Case> {};

TEST_P(FamilyTest, ConvertsEveryMoeLayerExactly) {
  const Case& c = GetParam();
  colibri_test::TempDir tmp("convert");
  const Checkpoint ck = build(c);
  ck.write(tmp.path() + "/hf", c.shards);
  const std::string out = tmp.path() + "/model";
  std::vector<colibri::HfConvertProgress> seen;
  colibri::HfConvertOptions o;
  o.hf_dir = tmp.path() + "/hf";
  o.out_dir = out;
  o.progress = [&](const colibri::HfConvertProgress& p) { seen.push_back(p); };
  const colibri::HfConvertResult r = colibri::convert_hf_checkpoint(o);
  EXPECT_EQ(r.layers, c.moe_layers);
  EXPECT_EQ(r.dtype, weight_type_of_st(c.dtype));  // default: the checkpoint's
  EXPECT_EQ(r.fused_layers, c.fused ? static_cast<int32_t>(c.moe_layers.size()) : 0);
  EXPECT_EQ(r.n_shards, c.shards);
  ASSERT_FALSE(seen.empty());
  for (size_t i = 1; i < seen.size(); ++i) {
    EXPECT_GT(seen[i].bytes_done, seen[i - 1].bytes_done);
    EXPECT_GE(seen[i].layers_done, seen[i - 1].layers_done);
  }
  EXPECT_EQ(seen.back().bytes_done, seen.back().bytes_total);
  EXPECT_EQ(seen.back().layers_done, static_cast<int32_t>(c.moe_layers.size()));
  EXPECT_EQ(seen.back().layers_total, static_cast<int32_t>(c.moe_layers.size()));
  EXPECT_EQ(r.bytes_written, seen.back().bytes_total);
  EXPECT_TRUE(no_partial_left(out));
  check_model(out, ck, c, r.dtype, c.moe_layers);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyTest, ::testing::ValuesIn(family_cases()),
                         [](const ::testing::TestParamInfo<Case>& p) { return p.param.label; });

TEST(Convert, DtypeOverrideRoundsLikeTheWriter) {
  const Case c = mixtral_case();
  colibri_test::TempDir tmp("convert");
  const Checkpoint ck = build(c);
  ck.write(tmp.path() + "/hf");
  for (colibri::WeightType d : {colibri::WeightType::kF32, colibri::WeightType::kF16, colibri::WeightType::kBF16}) {
    SCOPED_TRACE(colibri::weight_format(d).name);
    const std::string out = tmp.path() + "/m_" + colibri::weight_format(d).name;
    EXPECT_EQ(convert(tmp.path() + "/hf", out, d).dtype, d);
    check_model(out, ck, c, d, c.moe_layers);
  }
}

TEST(Convert, LayerRangeSelectsMoeLayers) {
  Case c = family_cases()[2];  // qwen2_moe: MoE layers 0, 1, 3
  colibri_test::TempDir tmp("convert");
  const Checkpoint ck = build(c);
  const std::string hf = tmp.path() + "/hf";
  ck.write(hf);
  colibri::HfConvertOptions o;
  o.hf_dir = hf;
  o.out_dir = tmp.path() + "/a";
  o.first_layer = 1;
  o.last_layer = 3;
  EXPECT_EQ(colibri::convert_hf_checkpoint(o).layers, (std::vector<int32_t>{1, 3}));
  check_model(o.out_dir, ck, c, colibri::WeightType::kBF16, {1, 3});

  o.out_dir = tmp.path() + "/b";
  o.first_layer = o.last_layer = 3;
  EXPECT_EQ(colibri::convert_hf_checkpoint(o).layers, (std::vector<int32_t>{3}));
  check_model(o.out_dir, ck, c, colibri::WeightType::kBF16, {3});  // one layer: files at the top

  for (const auto& [first, last, needle] : {std::tuple{2, 2, "no MoE layer"}, std::tuple{1, 4, "4 decoder layers"},
                                            std::tuple{3, 1, "not a range"}}) {
    o.out_dir = tmp.path() + "/c";
    o.first_layer = first;
    o.last_layer = last;
    try {
      colibri::convert_hf_checkpoint(o);
      ADD_FAILURE() << first << "-" << last << " accepted";
    } catch (const colibri::Error& e) {
      EXPECT_EQ(e.status(), colibri::Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(o.out_dir));
  }
}

TEST(Convert, ConfigDefaultsAndLayerRules) {
  json q = base_config("qwen2_moe", 8);
  q.update({{"num_experts", 4}, {"moe_intermediate_size", 8}, {"shared_expert_intermediate_size", 4},
            {"decoder_sparse_step", 2}, {"mlp_only_layers", {3, 5, 99}}});
  colibri::HfMoeConfig c = colibri::parse_hf_config(q.dump(), "config.json");
  EXPECT_EQ(c.moe_layers, (std::vector<int32_t>{1, 7}));
  EXPECT_EQ(c.router.norm_topk_prob, 0);
  EXPECT_EQ(c.shared_d_ff, 4);
  EXPECT_TRUE(c.shared_gate);

  json v3 = base_config("deepseek_v3", 6);
  v3.update({{"n_routed_experts", 8}, {"moe_intermediate_size", 8}, {"n_group", 4}, {"topk_group", 2},
             {"first_k_dense_replace", 3}, {"n_shared_experts", nullptr}});
  c = colibri::parse_hf_config(v3.dump(), "config.json");
  EXPECT_EQ(c.moe_layers, (std::vector<int32_t>{3, 4, 5}));
  EXPECT_EQ(c.router.norm_topk_prob, 1);  // V3 default
  EXPECT_EQ(c.router.n_group, 4);         // noaux_tc is V3's default method
  EXPECT_EQ(c.shared_d_ff, 0);            // null: no shared expert
  EXPECT_EQ(c.router.routed_scaling_factor, 1.0f);

  json v2 = base_config("deepseek_v2", 4);
  v2.update({{"n_routed_experts", 8}, {"moe_intermediate_size", 8}, {"n_group", 4}, {"topk_group", 2},
             {"topk_method", "greedy"}, {"n_shared_experts", 2}, {"moe_layer_freq", 2}});
  c = colibri::parse_hf_config(v2.dump(), "config.json");
  EXPECT_EQ(c.moe_layers, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(c.router.norm_topk_prob, 0);
  EXPECT_EQ(c.router.n_group, 1);  // greedy ignores the groups
  EXPECT_EQ(c.router.topk_group, 1);
  EXPECT_EQ(c.shared_d_ff, 16);

  json mx = base_config("mixtral", 2);
  mx.update({{"num_local_experts", 8}, {"intermediate_size", 32}, {"norm_topk_prob", false}});
  c = colibri::parse_hf_config(mx.dump(), "config.json");
  EXPECT_EQ(c.router.norm_topk_prob, 1);  // Mixtral always renormalises
  EXPECT_EQ(c.router.family, colibri::RouterFamily::kMixtral);
}

void expect_config_error(const json& config, colibri::Status status, const std::vector<std::string>& needles) {
  SCOPED_TRACE(config.dump());
  try {
    colibri::parse_hf_config(config.dump(), "hf/config.json");
    ADD_FAILURE() << "accepted";
  } catch (const colibri::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("hf/config.json: ", 0), 0u) << msg;
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "no \"" << n << "\" in: " << msg;
  }
}

TEST(Convert, BadConfigsNameTheField) {
  json mx = base_config("mixtral", 2);
  mx.update({{"num_local_experts", 4}, {"intermediate_size", 8}});
  for (const char* field : {"num_local_experts", "intermediate_size", "hidden_size", "num_hidden_layers",
                            "num_experts_per_tok"}) {
    json bad = mx;
    bad.erase(field);
    expect_config_error(bad, colibri::Status::kFormat, {"missing field \"" + std::string(field) + "\"", "mixtral"});
  }
  json bad = mx;
  bad["num_experts_per_tok"] = 5;
  expect_config_error(bad, colibri::Status::kFormat, {"\"num_experts_per_tok\"", "out of range [1, 4]"});
  bad = mx;
  bad["hidden_size"] = "16";
  expect_config_error(bad, colibri::Status::kFormat, {"\"hidden_size\""});
  bad = mx;
  bad["num_local_experts"] = 1e30;
  expect_config_error(bad, colibri::Status::kFormat, {"\"num_local_experts\""});
  bad = mx;
  bad["intermediate_size"] = -8;
  expect_config_error(bad, colibri::Status::kFormat, {"\"intermediate_size\""});
  bad = mx;
  bad["model_type"] = "llama";
  expect_config_error(bad, colibri::Status::kUnsupported,
                      {"\"llama\"", "mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3"});
  bad.erase("model_type");
  expect_config_error(bad, colibri::Status::kFormat, {"model_type"});
  expect_config_error(json::array(), colibri::Status::kFormat, {"object"});

  json q2 = base_config("qwen2_moe", 2);
  q2.update({{"num_experts", 4}, {"moe_intermediate_size", 8}});
  expect_config_error(q2, colibri::Status::kFormat, {"shared_expert_intermediate_size"});
  q2["shared_expert_intermediate_size"] = 8;
  q2["mlp_only_layers"] = {0, 1};
  expect_config_error(q2, colibri::Status::kFormat, {"no MoE layer"});
  q2["mlp_only_layers"] = "none";
  expect_config_error(q2, colibri::Status::kFormat, {"\"mlp_only_layers\""});
  q2["mlp_only_layers"] = json::array();
  q2["norm_topk_prob"] = "yes";
  expect_config_error(q2, colibri::Status::kFormat, {"\"norm_topk_prob\""});

  json v3 = base_config("deepseek_v3", 2);
  v3.update({{"n_routed_experts", 8}, {"moe_intermediate_size", 8}, {"n_group", 3}, {"topk_group", 2}});
  expect_config_error(v3, colibri::Status::kFormat, {"\"n_group\"", "does not divide"});
  v3["n_group"] = 4;
  v3["topk_group"] = 5;
  expect_config_error(v3, colibri::Status::kFormat, {"\"topk_group\""});
  v3["topk_group"] = 2;
  v3["scoring_func"] = "softmax";
  expect_config_error(v3, colibri::Status::kUnsupported, {"\"scoring_func\"", "softmax"});
  v3.erase("scoring_func");
  v3["topk_method"] = "group_limited_greedy";
  expect_config_error(v3, colibri::Status::kUnsupported, {"\"topk_method\"", "noaux_tc"});
  v3["topk_method"] = "noaux_tc";
  v3["routed_scaling_factor"] = -1;
  expect_config_error(v3, colibri::Status::kFormat, {"\"routed_scaling_factor\""});
  v3.erase("n_routed_experts");
  expect_config_error(v3, colibri::Status::kFormat, {"missing field \"n_routed_experts\""});
}

// A conversion that must fail: status, every needle in the message, and no
// output directory (final or temporary) left behind.
void expect_convert_error(const std::string& hf, const std::string& out, colibri::Status status,
                          const std::vector<std::string>& needles) {
  try {
    convert(hf, out);
    ADD_FAILURE() << "converted";
  } catch (const colibri::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    const std::string msg = e.what();
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "no \"" << n << "\" in: " << msg;
  }
  EXPECT_TRUE(no_partial_left(out));
}

class BadCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = mixtral_case();
    ck_ = build(c_);
    hf_ = tmp_.path() + "/hf";
    out_ = tmp_.path() + "/out";
  }
  // Writes the (modified) checkpoint and expects conversion to fail.
  void expect_error(colibri::Status status, const std::vector<std::string>& needles, int shards = 1) {
    fs::remove_all(hf_);
    ck_.write(hf_, shards);
    expect_convert_error(hf_, out_, status, needles);
    EXPECT_FALSE(fs::exists(out_));
  }
  static std::string expert(int layer, int e, const char* w) {
    return "model.layers." + std::to_string(layer) + ".block_sparse_moe.experts." + std::to_string(e) + "." + w + ".weight";
  }

  colibri_test::TempDir tmp_{"convert_bad"};
  Case c_;
  Checkpoint ck_;
  std::string hf_, out_;
};

TEST_F(BadCheckpointTest, WrongShape) {
  ck_.tensors[expert(1, 2, "w3")].shape = {8, 17};
  ck_.tensors[expert(1, 2, "w3")].values.resize(8 * 17);
  expect_error(colibri::Status::kFormat, {"model.safetensors", expert(1, 2, "w3"), "shape [8, 17], expected [8, 16]"});
}

TEST_F(BadCheckpointTest, WrongRouterShape) {
  Tensor& t = ck_.tensors["model.layers.2.block_sparse_moe.gate.weight"];
  t.shape = {kD, 4};  // transposed
  expect_error(colibri::Status::kFormat, {"model.layers.2.block_sparse_moe.gate.weight", "expected [4, 16]"});
}

TEST_F(BadCheckpointTest, WrongDtype) {
  Tensor& t = ck_.tensors[expert(0, 1, "w2")];
  t.dtype = "I32";
  t.raw = std::string(t.values.size() * 4, '\0');
  expect_error(colibri::Status::kFormat, {expert(0, 1, "w2"), "dtype I32 is not supported"});
  t.dtype = "F8_E4M3";
  t.raw = std::string(t.values.size(), '\0');
  expect_error(colibri::Status::kFormat, {expert(0, 1, "w2"), "F8_E4M3", "quantization_config"});
}

TEST_F(BadCheckpointTest, MissingExpertTensor) {
  ck_.tensors.erase(expert(2, 3, "w2"));
  expect_error(colibri::Status::kFormat, {"model.safetensors", "missing tensor \"" + expert(2, 3, "w2") + "\""});
  ck_ = build(c_);
  for (const char* w : {"w1", "w2", "w3"}) ck_.tensors.erase(expert(1, 0, w));
  expect_error(colibri::Status::kFormat, {expert(1, 0, "w1"), "gate_up_proj"});
}

TEST_F(BadCheckpointTest, MissingTensorInShardedCheckpoint) {
  ck_.tensors.erase("model.layers.1.block_sparse_moe.gate.weight");
  expect_error(colibri::Status::kFormat, {"model.safetensors.index.json", "model.layers.1.block_sparse_moe.gate.weight"}, 3);
}

TEST_F(BadCheckpointTest, BothLayoutsInOneLayer) {
  ck_.add("model.layers.1.block_sparse_moe.experts.gate_up_proj", "BF16", {4, 16, kD});
  expect_error(colibri::Status::kFormat, {"layer 1", "both per-expert", "fused"});
}

TEST_F(BadCheckpointTest, TruncatedShard) {
  ck_.write(hf_, 2);
  const std::string shard = hf_ + "/" + Checkpoint::shard_name(1, 2);
  fs::resize_file(shard, fs::file_size(shard) - 100);
  expect_convert_error(hf_, out_, colibri::Status::kFormat, {Checkpoint::shard_name(1, 2), "past the end", "truncated"});
  fs::resize_file(shard, 5);
  expect_convert_error(hf_, out_, colibri::Status::kFormat, {Checkpoint::shard_name(1, 2), "too short"});
  EXPECT_FALSE(fs::exists(out_));
}

TEST_F(BadCheckpointTest, BadIndex) {
  ck_.write(hf_, 2);
  const std::string index = hf_ + "/model.safetensors.index.json";
  json doc = json::parse(colibri_test::file_bytes(index));
  const std::string victim = expert(0, 0, "w1");

  json bad = doc;
  bad["weight_map"][victim] = "../elsewhere.safetensors";
  colibri_test::write_bytes(index, bad.dump());
  expect_convert_error(hf_, out_, colibri::Status::kFormat, {index, victim, "not a file name"});

  bad = doc;
  bad["weight_map"][victim] = "model-00009-of-00009.safetensors";
  colibri_test::write_bytes(index, bad.dump());
  expect_convert_error(hf_, out_, colibri::Status::kIo, {"model-00009-of-00009.safetensors", "cannot open"});

  bad = doc;  // listed in the other shard than the one that has it
  const std::string other = doc["weight_map"][victim] == Checkpoint::shard_name(0, 2) ? Checkpoint::shard_name(1, 2)
                                                                                     : Checkpoint::shard_name(0, 2);
  bad["weight_map"][victim] = other;
  colibri_test::write_bytes(index, bad.dump());
  expect_convert_error(hf_, out_, colibri::Status::kFormat, {victim, other, "no such tensor"});

  colibri_test::write_bytes(index, json{{"metadata", json::object()}}.dump());
  expect_convert_error(hf_, out_, colibri::Status::kFormat, {index, "weight_map"});
  colibri_test::write_bytes(index, "{\"weight_map\": ");
  expect_convert_error(hf_, out_, colibri::Status::kFormat, {index, "invalid JSON"});
  EXPECT_FALSE(fs::exists(out_));
}

TEST_F(BadCheckpointTest, MissingFiles) {
  ck_.write(hf_);
  fs::remove(hf_ + "/model.safetensors");
  expect_convert_error(hf_, out_, colibri::Status::kIo, {hf_, "no model.safetensors or model.safetensors.index.json"});
  fs::remove(hf_ + "/config.json");
  expect_convert_error(hf_, out_, colibri::Status::kIo, {hf_ + "/config.json"});
  EXPECT_FALSE(fs::exists(out_));
}

TEST_F(BadCheckpointTest, ConfigWithoutMoeFieldsAndUnsupportedArchitecture) {
  ck_.config.erase("num_local_experts");
  expect_error(colibri::Status::kFormat, {"config.json", "num_local_experts"});
  ck_.config = c_.config;
  ck_.config["model_type"] = "jamba";
  expect_error(colibri::Status::kUnsupported, {"jamba", "supported: mixtral"});
}

TEST_F(BadCheckpointTest, FamilySpecificTensors) {
  std::vector<Case> cases = family_cases();
  const Case& q2 = cases[2];
  c_ = q2;
  ck_ = build(q2);
  ck_.tensors.erase("model.layers.3.mlp.shared_expert_gate.weight");
  expect_error(colibri::Status::kFormat, {"model.layers.3.mlp.shared_expert_gate.weight"});
  ck_ = build(q2);
  ck_.tensors["model.layers.0.mlp.shared_expert.down_proj.weight"].shape = {12, kD};
  expect_error(colibri::Status::kFormat, {"model.layers.0.mlp.shared_expert.down_proj.weight", "expected [16, 12]"});

  const Case& v3 = cases[8];  // fused experts
  ASSERT_TRUE(v3.fused);
  ck_ = build(v3);
  ck_.tensors.erase("model.layers.4.mlp.gate.e_score_correction_bias");
  expect_error(colibri::Status::kFormat, {"model.layers.4.mlp.gate.e_score_correction_bias"});
  ck_ = build(v3);
  ck_.tensors["model.layers.2.mlp.experts.down_proj"].shape = {8, 8, kD};  // [E, F, D]: transposed
  expect_error(colibri::Status::kFormat, {"model.layers.2.mlp.experts.down_proj", "expected [8, 16, 8]"});
  ck_ = build(v3);
  ck_.tensors.erase("model.layers.2.mlp.experts.down_proj");
  expect_error(colibri::Status::kFormat, {"missing tensor \"model.layers.2.mlp.experts.down_proj\""});
}

TEST_F(BadCheckpointTest, OutputDirectoryRules) {
  ck_.write(hf_);
  fs::create_directories(out_);
  colibri_test::write_bytes(out_ + "/keep.txt", "mine");
  expect_convert_error(hf_, out_, colibri::Status::kIo, {out_, "not empty", "refusing"});
  EXPECT_EQ(colibri_test::file_bytes(out_ + "/keep.txt"), "mine");

  const std::string file = tmp_.path() + "/afile";
  colibri_test::write_bytes(file, "x");
  expect_convert_error(hf_, file, colibri::Status::kIo, {file, "not a directory"});

  // An empty directory is taken over; a trailing slash changes nothing.
  const std::string empty = tmp_.path() + "/empty";
  fs::create_directories(empty);
  convert(hf_, empty + "/");
  check_model(empty, ck_, c_, colibri::WeightType::kBF16, c_.moe_layers);
  EXPECT_TRUE(no_partial_left(empty));
}

TEST_F(BadCheckpointTest, FailureWhileWritingRemovesEverything) {
  ck_.write(hf_);
  colibri::HfConvertOptions o;
  o.hf_dir = hf_;
  o.out_dir = out_;
  int calls = 0;
  o.progress = [&](const colibri::HfConvertProgress& p) {
    if (++calls == 5) throw colibri::Error(colibri::Status::kIo, "disk full (simulated)");
  };
  try {
    colibri::convert_hf_checkpoint(o);
    ADD_FAILURE() << "converted";
  } catch (const colibri::Error& e) {
    EXPECT_NE(std::string(e.what()).find("simulated"), std::string::npos);
  }
  EXPECT_EQ(calls, 5);
  EXPECT_FALSE(fs::exists(out_));
  EXPECT_TRUE(no_partial_left(out_));
}

// ------------------------------------------------------------- gpt-oss

// The gpt-oss checkpoint layout: mlp.router (weight, bias); experts'
// gate_up_proj_blocks/_scales [E, 2F, D/32, 16] / [E, 2F, D/32] (rows
// interleaved, even gate), down_proj_blocks/_scales, and biases.
struct GptOssCheckpoint {
  Checkpoint ck;
  int32_t E = 4, D = 64, F = 32, k = 2, layers = 2;
  bool mxfp4 = true;
  std::map<std::string, std::string> raw;  // U8 tensors' bytes

  void build() {
    ck.config = {{"model_type", "gpt_oss"}, {"num_hidden_layers", layers}, {"hidden_size", D},
                 {"intermediate_size", F},  {"num_local_experts", E},       {"num_experts_per_tok", k},
                 {"swiglu_limit", 7.0}};
    std::mt19937 rng(77);
    for (int32_t l = 0; l < layers; ++l) {
      const std::string b = "model.layers." + std::to_string(l) + ".mlp.";
      ck.add(b + "router.weight", "BF16", {uint64_t(E), uint64_t(D)});
      ck.add(b + "router.bias", "BF16", {uint64_t(E)});
      ck.add(b + "experts.gate_up_proj_bias", "BF16", {uint64_t(E), uint64_t(2 * F)}, 3.0f);
      ck.add(b + "experts.down_proj_bias", "BF16", {uint64_t(E), uint64_t(D)}, 1.0f);
      if (mxfp4) {
        auto u8 = [&](const std::string& name, std::vector<uint64_t> shape, bool scale) {
          size_t n = 1;
          for (uint64_t d : shape) n *= d;
          std::string bytes(n, '\0');
          // Scales around 2^-5 (weights of a few tenths), codes uniform.
          for (char& c : bytes) c = static_cast<char>(scale ? 120 + rng() % 5 : rng() % 256);
          ck.tensors[name] = {"U8", std::move(shape), {}, bytes};
        };
        u8(b + "experts.gate_up_proj_blocks", {uint64_t(E), uint64_t(2 * F), uint64_t(D / 32), 16}, false);
        u8(b + "experts.gate_up_proj_scales", {uint64_t(E), uint64_t(2 * F), uint64_t(D / 32)}, true);
        u8(b + "experts.down_proj_blocks", {uint64_t(E), uint64_t(D), uint64_t(F / 32), 16}, false);
        u8(b + "experts.down_proj_scales", {uint64_t(E), uint64_t(D), uint64_t(F / 32)}, true);
      } else {
        ck.add(b + "experts.gate_up_proj", "BF16", {uint64_t(E), uint64_t(D), uint64_t(2 * F)}, 0.3f);
        ck.add(b + "experts.down_proj", "BF16", {uint64_t(E), uint64_t(F), uint64_t(D)}, 0.3f);
      }
    }
  }

  // An independent reading of the checkpoint (transformers' dequantisation
  // and GptOssExperts' forward), in float64: W_gate_up [2F][D] of expert e.
  std::vector<double> gate_up(int32_t l, int32_t e) const {
    const std::string b = "model.layers." + std::to_string(l) + ".mlp.experts.";
    std::vector<double> w(static_cast<size_t>(2 * F) * D);
    if (!mxfp4) {
      const std::vector<float>& v = ck.values(b + "gate_up_proj");  // [E][D][2F]
      for (int32_t r = 0; r < 2 * F; ++r)
        for (int32_t d = 0; d < D; ++d) w[size_t(r) * D + d] = v[(size_t(e) * D + d) * 2 * F + r];
      return w;
    }
    return decode(ck.tensors.at(b + "gate_up_proj_blocks").raw, ck.tensors.at(b + "gate_up_proj_scales").raw, e,
                  2 * F, D);
  }
  std::vector<double> down(int32_t l, int32_t e) const {
    const std::string b = "model.layers." + std::to_string(l) + ".mlp.experts.";
    std::vector<double> w(static_cast<size_t>(D) * F);
    if (!mxfp4) {
      const std::vector<float>& v = ck.values(b + "down_proj");  // [E][F][D]
      for (int32_t d = 0; d < D; ++d)
        for (int32_t f = 0; f < F; ++f) w[size_t(d) * F + f] = v[(size_t(e) * F + f) * D + d];
      return w;
    }
    return decode(ck.tensors.at(b + "down_proj_blocks").raw, ck.tensors.at(b + "down_proj_scales").raw, e, D, F);
  }
  static std::vector<double> decode(const std::string& blocks, const std::string& scales, int32_t e, int32_t rows,
                                    int32_t n) {
    static const double kLut[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
    std::vector<double> w(static_cast<size_t>(rows) * n);
    for (int32_t r = 0; r < rows; ++r) {
      for (int32_t i = 0; i < n; ++i) {
        const size_t row = size_t(e) * rows + r;
        const auto byte = static_cast<uint8_t>(blocks[row * n / 2 + i / 2]);
        const int nib = i % 2 ? byte >> 4 : byte & 15;
        const int exp = static_cast<uint8_t>(scales[row * n / 32 + i / 32]) - 127;
        w[size_t(r) * n + i] = std::ldexp(kLut[nib], exp);
      }
    }
    return w;
  }

  std::vector<double> layer(int32_t l, int32_t T, const float* x, const int32_t* ids, const float* wts) const {
    const std::string b = "model.layers." + std::to_string(l) + ".mlp.experts.";
    const std::vector<float>& gub = ck.values(b + "gate_up_proj_bias");
    const std::vector<float>& db = ck.values(b + "down_proj_bias");
    std::vector<double> y(size_t(T) * D, 0.0);
    for (int32_t t = 0; t < T; ++t) {
      for (int32_t j = 0; j < k; ++j) {
        const int32_t e = ids[t * k + j];
        const std::vector<double> gu = gate_up(l, e), dn = down(l, e);
        std::vector<double> h(static_cast<size_t>(F));
        for (int32_t f = 0; f < F; ++f) {
          double g = gub[size_t(e) * 2 * F + 2 * f], u = gub[size_t(e) * 2 * F + 2 * f + 1];
          for (int32_t d = 0; d < D; ++d) {
            g += gu[size_t(2 * f) * D + d] * x[t * D + d];
            u += gu[size_t(2 * f + 1) * D + d] * x[t * D + d];
          }
          g = std::min(g, 7.0);
          u = std::max(-7.0, std::min(u, 7.0));
          h[f] = (u + 1) * g / (1 + std::exp(-1.702 * g));
        }
        for (int32_t d = 0; d < D; ++d) {
          double acc = db[size_t(e) * D + d];
          for (int32_t f = 0; f < F; ++f) acc += dn[size_t(d) * F + f] * h[f];
          y[size_t(t) * D + d] += wts[t * k + j] * acc;
        }
      }
    }
    return y;
  }
};

TEST(ConvertGptOss, Mxfp4AndBf16CheckpointsRunAsTheCheckpointSays) {
  for (bool mxfp4 : {true, false}) {
    SCOPED_TRACE(mxfp4 ? "mxfp4" : "bf16");
    colibri_test::TempDir tmp("convert_gpt_oss");
    GptOssCheckpoint g;
    g.mxfp4 = mxfp4;
    g.build();
    const std::string hf = tmp.path() + "/hf", out = tmp.path() + "/model";
    g.ck.write(hf, mxfp4 ? 1 : 2);
    colibri::HfConvertOptions o;
    o.hf_dir = hf;
    o.out_dir = out;
    const colibri::HfConvertResult r = colibri::convert_hf_checkpoint(o);
    EXPECT_EQ(r.dtype, mxfp4 ? colibri::WeightType::kMXFP4 : colibri::WeightType::kBF16);
    const colibri::Manifest m = colibri::load_manifest(out);
    EXPECT_TRUE(m.clamped_swiglu() && m.expert_bias);
    EXPECT_EQ(m.router.family, colibri::RouterFamily::kGptOss);
    EXPECT_EQ(m.version, 4);

    colibri_test::OpenedModel model;
    model.model = colibri_test::open_test_model(out, true);
    ASSERT_NE(model.model, nullptr);
    const int32_t T = 5;
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 6.0f);
    std::vector<float> x(size_t(T) * g.D);
    for (float& v : x) v = nd(rng);
    std::vector<int32_t> ids(size_t(T) * g.k);
    std::vector<float> w(ids.size());
    for (int32_t t = 0; t < T; ++t) {
      ids[size_t(t) * g.k] = t % g.E;
      ids[size_t(t) * g.k + 1] = (t + 1 + t / 2) % g.E;
      w[size_t(t) * g.k] = 0.7f;
      w[size_t(t) * g.k + 1] = 0.3f;
    }
    for (int32_t l = 0; l < g.layers; ++l) {
      std::vector<float> y(x.size(), std::nanf(""));
      colibri_infer_t in;
      colibri_infer_default(&in);
      in.layer = l;
      in.n_tokens = T;
      in.input = x.data();
      in.output = y.data();
      in.top_k = g.k;
      in.expert_ids = ids.data();
      in.expert_weights = w.data();
      ASSERT_EQ(colibri_infer(model.model, &in), COLIBRI_OK) << colibri_last_error();
      const std::vector<double> want = g.layer(l, T, x.data(), ids.data(), w.data());
      EXPECT_LE(colibri_test::relative_l2(y.data(), want), 1e-5) << "layer " << l;
      // MXFP4 values are kept exactly: the model's own float64 reference
      // (its files dequantised) is the checkpoint's to rounding.
      const std::vector<double> own = colibri_test::reference_layer(out, l, T, x.data(), g.k, ids.data(), w.data());
      std::vector<float> own_f(own.begin(), own.end());
      EXPECT_LE(colibri_test::relative_l2(own_f.data(), want), 1e-7) << "layer " << l;
    }
  }
}

TEST(ConvertGptOss, BadTensorsAreNamed) {
  colibri_test::TempDir tmp("convert_gpt_oss");
  auto refused = [&](const std::function<void(GptOssCheckpoint&)>& edit, const std::vector<std::string>& needles) {
    GptOssCheckpoint g;
    g.build();
    edit(g);
    const std::string hf = tmp.path() + "/hf", out = tmp.path() + "/out";
    fs::remove_all(hf);
    g.ck.write(hf);
    colibri::HfConvertOptions o;
    o.hf_dir = hf;
    o.out_dir = out;
    try {
      colibri::convert_hf_checkpoint(o);
      ADD_FAILURE() << "accepted";
    } catch (const colibri::Error& e) {
      for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(out));
  };
  refused([](GptOssCheckpoint& g) { g.ck.tensors.erase("model.layers.1.mlp.experts.down_proj_scales"); },
          {"model.layers.1.mlp.experts.down_proj_scales"});
  refused([](GptOssCheckpoint& g) { g.ck.tensors.erase("model.layers.0.mlp.router.bias"); }, {"router.bias"});
  refused([](GptOssCheckpoint& g) { g.ck.tensors["model.layers.0.mlp.experts.gate_up_proj_scales"].shape = {4, 64, 1}; },
          {"gate_up_proj_scales", "shape"});
  refused([](GptOssCheckpoint& g) { g.ck.tensors["model.layers.0.mlp.experts.down_proj_blocks"].dtype = "I8"; },
          {"down_proj_blocks", "U8"});
  refused([](GptOssCheckpoint& g) { g.ck.config["swiglu_limit"] = -1; }, {"swiglu_limit"});
}

// ------------------------------------------------------------------ CLI

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

RunResult run_cli(const std::string& dir, const std::string& args) {
  const std::string out = dir + "/stdout.txt", err = dir + "/stderr.txt";
  const int status = std::system((std::string(COLIBRI_CLI_PATH) + " " + args + " >" + out + " 2>" + err).c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = colibri_test::file_bytes(out);
  r.err = colibri_test::file_bytes(err);
  return r;
}

TEST(ConvertCli, ConvertsWithSummaryAndOptionalProgress) {
  colibri_test::TempDir tmp("convert_cli");
  const Case c = mixtral_case();
  const Checkpoint ck = build(c);
  const std::string hf = tmp.path() + "/hf";
  ck.write(hf);

  RunResult r = run_cli(tmp.path(), "convert --hf " + hf + " --out " + tmp.path() + "/m1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << "no progress bar when stderr is not a terminal: " << r.err;
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << "one summary line: " << r.out;
  for (const char* needle : {"converted", "mixtral", "3 MoE layer(s)", "HF 0-2", "4 experts", "d_model 16",
                             "d_ff 8", "top-2", "bf16"}) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << " not in: " << r.out;
  }
  check_model(tmp.path() + "/m1", ck, c, colibri::WeightType::kBF16, c.moe_layers);

  r = run_cli(tmp.path(), "convert --hf " + hf + " --out " + tmp.path() + "/m2 --progress --layers 1-2 --dtype f32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("layers 2/2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("100%"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("HF 1-2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("f32 from bf16"), std::string::npos) << r.out;
  check_model(tmp.path() + "/m2", ck, c, colibri::WeightType::kF32, {1, 2});

  EXPECT_EQ(run_cli(tmp.path(), "convert --help").exit_code, 0);
}

TEST(ConvertCli, ErrorsAreOneLineAndLeaveNothing) {
  colibri_test::TempDir tmp("convert_cli");
  Case c = mixtral_case();
  Checkpoint ck = build(c);
  const std::string hf = tmp.path() + "/hf";
  ck.write(hf);
  const std::string out = tmp.path() + "/m";

  auto expect_failure = [&](const std::string& args, const std::string& needle) {
    SCOPED_TRACE(args);
    RunResult r = run_cli(tmp.path(), args);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line expected: " << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_FALSE(fs::exists(out));
    EXPECT_TRUE(no_partial_left(out));
  };
  expect_failure("convert --hf " + hf + " --out " + out + " --layers 2-x", "--layers");
  expect_failure("convert --hf " + hf + " --out " + out + " --layers 0-7", "3 decoder layers");
  RunResult bad_dtype = run_cli(tmp.path(), "convert --hf " + hf + " --out " + out + " --dtype f8");
  EXPECT_NE(bad_dtype.exit_code, 0);  // refused by CLI11, in its own words
  EXPECT_NE(bad_dtype.err.find("--dtype"), std::string::npos) << bad_dtype.err;
  EXPECT_FALSE(fs::exists(out));
  expect_failure("convert --hf " + tmp.path() + "/nope --out " + out, "nope/config.json");
  ck.tensors.erase("model.layers.2.block_sparse_moe.experts.1.w3.weight");
  ck.write(hf);
  expect_failure("convert --progress --hf " + hf + " --out " + out, "model.layers.2.block_sparse_moe.experts.1.w3.weight");
  ck.config["model_type"] = "llama";
  ck.write(hf);
  expect_failure("convert --hf " + hf + " --out " + out, "supported: mixtral");

  // A non-empty --out is refused and left as it was.
  fs::create_directories(out);
  colibri_test::write_bytes(out + "/x", "x");
  RunResult r = run_cli(tmp.path(), "convert --hf " + hf + " --out " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("refusing"), std::string::npos) << r.err;
  EXPECT_EQ(colibri_test::file_bytes(out + "/x"), "x");
}

}  // namespace
