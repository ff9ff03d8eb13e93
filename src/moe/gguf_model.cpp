#include "moe/gguf_model.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>

#include "moe/router.h"
#include "util/error.h"
#include "util/half.h"

namespace colibri {

namespace {

// ggml types Colibri computes on, as weight types.
bool weight_type_of(uint32_t ggml, WeightType* out) {
  switch (ggml) {
    case ggml_type::kF32:
      *out = WeightType::kF32;
      return true;
    case ggml_type::kF16:
      *out = WeightType::kF16;
      return true;
    case ggml_type::kBF16:
      *out = WeightType::kBF16;
      return true;
    case ggml_type::kQ8_0:
      *out = WeightType::kQ8_0;
      return true;
    case ggml_type::kQ4_0:
      *out = WeightType::kQ4_0;
      return true;
    case ggml_type::kQ4_K:
      *out = WeightType::kQ4_K;
      return true;
    case ggml_type::kQ5_K:
      *out = WeightType::kQ5_K;
      return true;
    case ggml_type::kQ6_K:
      *out = WeightType::kQ6_K;
      return true;
    case ggml_type::kMXFP4:
      *out = WeightType::kMXFP4;
      return true;
    case ggml_type::kQ4_1:
      *out = WeightType::kQ4_1;
      return true;
    case ggml_type::kQ5_0:
      *out = WeightType::kQ5_0;
      return true;
    case ggml_type::kQ5_1:
      *out = WeightType::kQ5_1;
      return true;
    case ggml_type::kIQ4_NL:
      *out = WeightType::kIQ4_NL;
      return true;
    case ggml_type::kIQ4_XS:
      *out = WeightType::kIQ4_XS;
      return true;
    case ggml_type::kQ2_K:
      *out = WeightType::kQ2_K;
      return true;
    case ggml_type::kQ3_K:
      *out = WeightType::kQ3_K;
      return true;
    case ggml_type::kIQ2_XXS:
      *out = WeightType::kIQ2_XXS;
      return true;
    case ggml_type::kIQ3_XXS:
      *out = WeightType::kIQ3_XXS;
      return true;
    case ggml_type::kIQ1_S:
      *out = WeightType::kIQ1_S;
      return true;
    case ggml_type::kIQ1_M:
      *out = WeightType::kIQ1_M;
      return true;
    case ggml_type::kIQ2_XS:
      *out = WeightType::kIQ2_XS;
      return true;
    case ggml_type::kIQ2_S:
      *out = WeightType::kIQ2_S;
      return true;
    case ggml_type::kIQ3_S:
      *out = WeightType::kIQ3_S;
      return true;
    case ggml_type::kTQ1_0:
      *out = WeightType::kTQ1_0;
      return true;
    case ggml_type::kTQ2_0:
      *out = WeightType::kTQ2_0;
      return true;
    default:
      return false;
  }
}

// A split-set part number as llama.cpp writes it ("00002"); at most 9999.
std::string five_digits(uint64_t n) {
  char b[24];
  std::snprintf(b, sizeof b, "%05" PRIu64, n);
  return b;
}

// Splits "<prefix>-NNNNN-of-MMMMM.gguf" into its prefix and numbers.
bool split_name(const std::string& path, std::string* prefix, uint64_t* no, uint64_t* count) {
  static constexpr std::string_view kSuffix = ".gguf";
  constexpr size_t kTail = 1 + 5 + 4 + 5 + kSuffix.size();  // "-NNNNN-of-MMMMM.gguf"
  if (path.size() < kTail) return false;
  const std::string_view tail = std::string_view(path).substr(path.size() - kTail);
  auto digits = [](std::string_view s, uint64_t* out) {
    uint64_t v = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return false;
      v = v * 10 + static_cast<uint64_t>(c - '0');
    }
    *out = v;
    return true;
  };
  if (tail[0] != '-' || tail.substr(6, 4) != "-of-" || tail.substr(15) != kSuffix) return false;
  if (!digits(tail.substr(1, 5), no) || !digits(tail.substr(10, 5), count)) return false;
  *prefix = path.substr(0, path.size() - kTail);
  return true;
}

// The parts of a split set: "<prefix>-00001-of-0000N.gguf" and its
// siblings, or just `path`.
std::vector<GgufFile> open_parts(const std::string& path) {
  std::vector<GgufFile> files;
  files.push_back(GgufFile::open(path));
  const GgufFile& first = files.front();
  uint64_t count = 1;
  first.get_uint("split.count", &count);
  if (count <= 1) return files;
  uint64_t no = 0;
  first.get_uint("split.no", &no);
  if (count > 9999) fail(Status::kFormat, path + ": key split.count is " + std::to_string(count) + ", absurd");
  std::string prefix;
  uint64_t named_no = 0, named_count = 0;
  if (!split_name(path, &prefix, &named_no, &named_count) || no != 0 || named_no != 1 || named_count != count) {
    fail(Status::kInvalidArgument, path + ": part " + std::to_string(no + 1) + " of a split set of " +
                                       std::to_string(count) + "; open its first file, <name>-00001-of-" +
                                       five_digits(count) + ".gguf");
  }
  for (uint64_t i = 1; i < count; ++i) {
    const std::string part = prefix + "-" + five_digits(i + 1) + "-of-" + five_digits(count) + ".gguf";
    if (::access(part.c_str(), F_OK) != 0) {
      fail(Status::kIo, path + ": part " + std::to_string(i + 1) + " of " + std::to_string(count) + " (" + part +
                            ") is missing");
    }
    files.push_back(GgufFile::open(part));
    uint64_t part_no = 0, part_count = 0;
    if (!files.back().get_uint("split.no", &part_no) || part_no != i ||
        !files.back().get_uint("split.count", &part_count) || part_count != count) {
      fail(Status::kFormat, part + ": keys split.no / split.count do not say part " + std::to_string(i + 1) +
                                " of " + std::to_string(count));
    }
  }
  uint64_t stated = 0, total = 0;
  for (const GgufFile& f : files) total += f.tensors().size();
  if (first.get_uint("split.tensors.count", &stated) && stated != total) {
    fail(Status::kFormat, path + ": key split.tensors.count is " + std::to_string(stated) + " but the " +
                              std::to_string(count) + " parts hold " + std::to_string(total) + " tensors");
  }
  return files;
}

// Tensors by name across the parts of a split set.
class TensorIndex {
 public:
  explicit TensorIndex(const std::vector<GgufFile>& files) {
    for (const GgufFile& f : files) {
      for (const GgufTensor& t : f.tensors()) {
        if (!index_.emplace(t.name, Entry{&f, &t}).second) {
          fail(Status::kFormat, f.source() + ": duplicate tensor " + t.name + " (also in another part)");
        }
      }
    }
  }
  struct Entry {
    const GgufFile* file;
    const GgufTensor* tensor;
  };
  const Entry* find(const std::string& name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &it->second;
  }

 private:
  std::unordered_map<std::string, Entry> index_;
};

class Loader {
 public:
  Loader(GgufModel& out) : out_(out), first_(out.files.front()), index_(out.files) {}

  void run() {
    if (!first_.get_string("general.architecture", &out_.architecture)) {
      fail(Status::kFormat, first_.source() + ": key general.architecture is missing");
    }
    arch_ = out_.architecture;
    const int64_t blocks = required_count("block_count", 1 << 16);
    out_.block_count = static_cast<int32_t>(blocks);
    const int64_t d_model = required_count("embedding_length", kMaxDim);
    uint64_t experts = 0;
    if (!first_.get_uint(arch_ + ".expert_count", &experts) || experts == 0) {
      fail(Status::kUnsupported, first_.source() + ": architecture " + arch_ + " has no " + arch_ +
                                     ".expert_count: not a mixture-of-experts model");
    }
    if (experts > static_cast<uint64_t>(kMaxExperts)) bad_key("expert_count", "is absurd");
    const int64_t top_k = required_count("expert_used_count", experts);
    if (top_k == 0) bad_key("expert_used_count", "is 0");

    // Multi-token-prediction blocks (GLM-4-MoE's and DeepSeek's nextn
    // layers) follow the model's own blocks; llama.cpp's graph does not run
    // them, and packing their experts would cost a layer of memory for nothing.
    uint64_t nextn = 0;
    if (first_.get_uint(arch_ + ".nextn_predict_layers", &nextn) && nextn >= static_cast<uint64_t>(blocks)) {
      bad_key("nextn_predict_layers", "is " + std::to_string(nextn) + " of " + std::to_string(blocks) + " blocks");
    }
    out_.mtp_blocks = static_cast<int32_t>(nextn);

    // Which blocks have experts.
    for (int32_t b = 0; b < out_.block_count - out_.mtp_blocks; ++b) {
      const bool moe = index_.find(name(b, "ffn_gate_exps.weight")) != nullptr ||
                       index_.find(name(b, "ffn_gate_up_exps.weight")) != nullptr ||
                       index_.find(name(b, "ffn_down_exps.weight")) != nullptr;
      if (!moe) {
        if (!moe_blocks_.empty()) {
          fail(Status::kUnsupported, first_.source() + ": block " + std::to_string(b) +
                                         " has no expert tensors but blocks before it do; Colibri runs contiguous "
                                         "MoE blocks only");
        }
        out_.dense_blocks.push_back(b);
      } else {
        moe_blocks_.push_back(b);
      }
    }
    if (moe_blocks_.empty()) fail(Status::kFormat, first_.source() + ": no block has expert tensors (blk.N.ffn_*_exps)");
    uint64_t leading = 0;
    if (first_.get_uint(arch_ + ".leading_dense_block_count", &leading) &&
        leading != static_cast<uint64_t>(moe_blocks_.front())) {
      bad_key("leading_dense_block_count", "is " + std::to_string(leading) + " but block " +
                                                std::to_string(moe_blocks_.front()) + " is the first with experts");
    }
    out_.first_block = moe_blocks_.front();

    Manifest& m = out_.manifest;
    m.n_layers = static_cast<int32_t>(moe_blocks_.size());
    m.n_experts = static_cast<int32_t>(experts);
    m.d_model = static_cast<int32_t>(d_model);
    first_layer_types(m);
    m.router = router_rule(static_cast<int32_t>(top_k));
    if (gpt_oss()) {
      // llama.cpp's gpt-oss graph: ggml_swiglu_oai with gpt-oss's constants
      // (it reads none from the file), expert biases.
      m.activation = "clamped_swiglu";
      m.swiglu_alpha = 1.702f;
      m.swiglu_limit = 7.0f;
      m.expert_bias = true;
    }
    shared_expert(m);
    layer_types(m);
    m.version = std::max(m.minimum_version(), 2);
    m.source_json = "{\"gguf\": \"" + json_escape(out_.path) + "\", \"architecture\": \"" + json_escape(arch_) + "\"}";
    // The limits every model directory is held to.
    try {
      parse_manifest(manifest_to_json(m), first_.source());
    } catch (const Error& e) {
      fail(Status::kFormat, e.what());
    }
    validate_router(m.router, m.n_experts, first_.source() + ": router", Status::kFormat);
    out_.layer_tensors.resize(moe_blocks_.size());
    for (size_t l = 0; l < moe_blocks_.size(); ++l) out_.layers.push_back(layer(moe_blocks_[l], static_cast<int32_t>(l)));
  }

 private:
  GgufModel& out_;
  const GgufFile& first_;
  TensorIndex index_;
  std::string arch_;
  std::vector<int32_t> moe_blocks_;
  bool fused_ = false;
  uint32_t gate_type_ = 0, down_type_ = 0;

  bool gpt_oss() const { return arch_ == "gpt-oss"; }

  static std::string name(int32_t block, const char* what) {
    return "blk." + std::to_string(block) + "." + what;
  }
  static std::string json_escape(const std::string& s) {
    std::string r;
    for (char c : s) {
      if (c == '"' || c == '\\') r += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) r += c;
    }
    return r;
  }

  [[noreturn]] void bad_key(const std::string& key, const std::string& why) const {
    fail(Status::kFormat, first_.source() + ": key " + arch_ + "." + key + " " + why);
  }
  [[noreturn]] void bad_tensor(const GgufFile& f, const std::string& tensor, const std::string& why,
                               Status status = Status::kFormat) const {
    fail(status, f.source() + ": tensor " + tensor + " " + why);
  }

  int64_t required_count(const std::string& key, uint64_t max) const {
    uint64_t v = 0;
    if (!first_.get_uint(arch_ + "." + key, &v)) {
      fail(Status::kFormat, first_.source() + ": key " + arch_ + "." + key + " is missing");
    }
    if (v > max) bad_key(key, "is " + std::to_string(v) + ", absurd");
    return static_cast<int64_t>(v);
  }

  std::string dims(const GgufTensor& t) const {
    std::string s = "[";
    for (uint32_t d = 0; d < t.n_dims; ++d) s += (d ? ", " : "") + std::to_string(t.ne[d]);
    return s + "]";
  }

  // The tensor `tensor_name` with exactly the dimensions `ne` (ne[0]
  // first, as GGUF lists them).
  const TensorIndex::Entry& expect(const std::string& tensor_name, std::vector<uint64_t> ne) const {
    const TensorIndex::Entry* e = index_.find(tensor_name);
    if (e == nullptr) fail(Status::kFormat, first_.source() + ": tensor " + tensor_name + " is missing");
    const GgufTensor& t = *e->tensor;
    bool same = true;
    for (size_t d = 0; d < 4; ++d) same &= t.ne[d] == (d < ne.size() ? ne[d] : 1);
    if (!same) {
      std::string want = "[";
      for (size_t d = 0; d < ne.size(); ++d) want += (d ? ", " : "") + std::to_string(ne[d]);
      bad_tensor(*e->file, tensor_name, "has dimensions " + dims(t) + ", expected " + want + "]");
    }
    return *e;
  }

  WeightType weight_type(const TensorIndex::Entry& e) const {
    WeightType t;
    if (!weight_type_of(e.tensor->type, &t)) {
      bad_tensor(*e.file, e.tensor->name,
                 "is " + ggml_type_name(e.tensor->type) +
                     ", a type Colibri does not compute (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, "
                     "Q5_K, Q6_K, MXFP4, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0)",
                 Status::kUnsupported);
    }
    return t;
  }

  // Dimensions and types from the first MoE block; every block must agree.
  void first_layer_types(Manifest& m) {
    const int32_t b = moe_blocks_.front();
    fused_ = index_.find(name(b, "ffn_gate_up_exps.weight")) != nullptr;
    const TensorIndex::Entry* g =
        index_.find(name(b, fused_ ? "ffn_gate_up_exps.weight" : "ffn_gate_exps.weight"));
    if (g == nullptr) fail(Status::kFormat, first_.source() + ": tensor " + name(b, "ffn_gate_exps.weight") + " is missing");
    const GgufTensor& gt = *g->tensor;
    if (gt.n_dims != 3) bad_tensor(*g->file, gt.name, "has dimensions " + dims(gt) + ", expected [d_model, d_ff, n_experts]");
    const uint64_t rows = fused_ ? gt.ne[1] / 2 : gt.ne[1];
    if (fused_ && gt.ne[1] % 2 != 0) bad_tensor(*g->file, gt.name, "has an odd number of gate+up rows");
    if (rows > static_cast<uint64_t>(kMaxDim)) bad_tensor(*g->file, gt.name, "has absurd dimensions " + dims(gt));
    m.d_ff = static_cast<int32_t>(rows);
    expect(gt.name, {static_cast<uint64_t>(m.d_model), fused_ ? 2 * rows : rows, static_cast<uint64_t>(m.n_experts)});
    uint64_t stated = 0;
    const std::string ff_key = first_.find(arch_ + ".expert_feed_forward_length") != nullptr
                                   ? "expert_feed_forward_length"
                                   : "feed_forward_length";
    if (first_.get_uint(arch_ + "." + ff_key, &stated) && stated != rows) {
      bad_key(ff_key, "is " + std::to_string(stated) + " but " + gt.name + " has " + std::to_string(rows) +
                          " rows per expert");
    }
    gate_type_ = gt.type;
    m.dtype = weight_type(*g);
    if (!fused_) {
      const TensorIndex::Entry& up = expect(name(b, "ffn_up_exps.weight"), {static_cast<uint64_t>(m.d_model), rows,
                                                                           static_cast<uint64_t>(m.n_experts)});
      if (up.tensor->type != gate_type_) {
        bad_tensor(*up.file, up.tensor->name,
                   "is " + ggml_type_name(up.tensor->type) + " but " + gt.name + " is " + ggml_type_name(gate_type_) +
                       "; gate and up must share a type",
                   Status::kUnsupported);
      }
    }
    const TensorIndex::Entry& down = expect(name(b, "ffn_down_exps.weight"),
                                            {rows, static_cast<uint64_t>(m.d_model), static_cast<uint64_t>(m.n_experts)});
    down_type_ = down.tensor->type;
    m.down_dtype = weight_type(down);
    if (const std::string why = dtype_pair_problem(m.dtype, m.down_dtype); !why.empty()) {
      bad_tensor(*down.file, down.tensor->name, "is " + ggml_type_name(down_type_) + " with " + gt.name + " " +
                                                    ggml_type_name(gate_type_) + ": " + why,
                 Status::kUnsupported);
    }
    out_.expert_types = "gate/up " + ggml_type_name(gate_type_) + ", down " + ggml_type_name(down_type_);
  }

  // The architecture's router rule, from its metadata.
  RouterDesc router_rule(int32_t top_k) const {
    RouterDesc r;
    r.top_k = top_k;
    uint64_t gating = 1;  // llama.cpp: 1 softmax, 2 sigmoid
    const bool has_gating = first_.get_uint(arch_ + ".expert_gating_func", &gating);
    double scale = 1.0;
    const bool has_scale = first_.get_float(arch_ + ".expert_weights_scale", &scale);
    bool norm = false;
    const bool has_norm = first_.get_bool(arch_ + ".expert_weights_norm", &norm);
    uint64_t groups = 1, groups_used = 1;
    first_.get_uint(arch_ + ".expert_group_count", &groups);
    first_.get_uint(arch_ + ".expert_group_used_count", &groups_used);
    auto softmax_only = [&] {
      if (has_gating && gating != 1) bad_key("expert_gating_func", "is " + std::to_string(gating) + ", not softmax (1)");
      if (has_scale && scale != 1.0) bad_key("expert_weights_scale", "is " + std::to_string(scale) + ", not 1");
      if (groups > 1) bad_key("expert_group_count", "is " + std::to_string(groups) + "; " + arch_ + " has no groups");
    };
    if (arch_ == "llama" || arch_ == "mixtral") {
      // Softmax over the experts, top-k, renormalised (llama.cpp's llama
      // graph; Mixtral's softmax over the top-k logits is the same).
      softmax_only();
      r.family = RouterFamily::kMixtral;
      r.norm_topk_prob = 1;
    } else if (arch_ == "qwen2moe" || arch_ == "olmoe") {
      softmax_only();
      r.family = arch_ == "olmoe" ? RouterFamily::kOlmoe : RouterFamily::kQwen2Moe;
      r.norm_topk_prob = has_norm && norm ? 1 : 0;  // llama.cpp: not renormalised
    } else if (arch_ == "qwen3moe") {
      softmax_only();
      r.family = RouterFamily::kQwen3Moe;
      r.norm_topk_prob = has_norm && !norm ? 0 : 1;  // llama.cpp: renormalised
    } else if (arch_ == "deepseek2" || arch_ == "glm4moe") {
      // GLM-4-MoE's router is DeepSeek-V3's (sigmoid, selection bias, groups).
      if (arch_ == "glm4moe" && has_gating && gating != 2) {
        bad_key("expert_gating_func", "is " + std::to_string(gating) + ", not sigmoid (2)");
      }
      if (arch_ == "glm4moe") gating = 2;
      if (gating == 2) {
        r.family = RouterFamily::kDeepseekV3;
      } else if (gating == 1) {
        r.family = RouterFamily::kDeepseekV2;
        if (norm && scale != 1.0) {
          bad_key("expert_weights_scale",
                  "is " + std::to_string(scale) +
                      " with expert_weights_norm true and softmax gating: llama.cpp scales the renormalised "
                      "weights, DeepSeek-V2's rule (Colibri's) does one or the other");
        }
      } else {
        bad_key("expert_gating_func", "is " + std::to_string(gating) + ", not softmax (1) or sigmoid (2)");
      }
      r.norm_topk_prob = norm ? 1 : 0;
      r.routed_scaling_factor = static_cast<float>(scale);
      if (groups > static_cast<uint64_t>(kMaxExperts) || groups_used > groups) {
        bad_key("expert_group_used_count", "is " + std::to_string(groups_used) + " of " + std::to_string(groups) +
                                               " groups");
      }
      r.n_group = static_cast<int32_t>(groups < 1 ? 1 : groups);
      r.topk_group = static_cast<int32_t>(groups_used < 1 ? 1 : groups_used);
    } else if (gpt_oss()) {
      // llama.cpp: the top k of the biased logits, softmax over those k
      // (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT, fixed for gpt-oss).
      if (has_scale && scale != 1.0 && scale != 0.0) {
        bad_key("expert_weights_scale", "is " + std::to_string(scale) + "; gpt-oss weights are not scaled");
      }
      if (groups > 1) bad_key("expert_group_count", "is " + std::to_string(groups) + "; gpt-oss has no groups");
      r.family = RouterFamily::kGptOss;
      r.norm_topk_prob = 1;
    } else {
      fail(Status::kUnsupported, first_.source() + ": architecture " + arch_ +
                                     " is not one Colibri can route (llama/Mixtral, qwen2moe, qwen3moe, olmoe, "
                                     "deepseek2, glm4moe, gpt-oss)");
    }
    return r;
  }

  void shared_expert(Manifest& m) {
    const int32_t b = moe_blocks_.front();
    const TensorIndex::Entry* g = index_.find(name(b, "ffn_gate_shexp.weight"));
    if (g == nullptr) return;
    const GgufTensor& gt = *g->tensor;
    if (gt.n_dims != 2 || gt.ne[1] > static_cast<uint64_t>(kMaxDim)) {
      bad_tensor(*g->file, gt.name, "has dimensions " + dims(gt) + ", expected [d_model, shared d_ff]");
    }
    m.shared_d_ff = static_cast<int32_t>(gt.ne[1]);
    uint64_t stated = 0;
    if (first_.get_uint(arch_ + ".expert_shared_feed_forward_length", &stated) && stated != gt.ne[1]) {
      bad_key("expert_shared_feed_forward_length",
              "is " + std::to_string(stated) + " but " + gt.name + " has " + std::to_string(gt.ne[1]) + " rows");
    }
    expect(name(b, "ffn_down_shexp.weight"), {gt.ne[1], static_cast<uint64_t>(m.d_model)});
    m.shared_gate = index_.find(name(b, "ffn_gate_inp_shexp.weight")) != nullptr;
  }

  // A float vector or matrix (router, biases, gates) as f32: in place when
  // stored so, else widened into out_.converted.
  const float* floats(const TensorIndex::Entry& e) {
    const GgufTensor& t = *e.tensor;
    const uint8_t* p = e.file->data(t);
    const size_t n = static_cast<size_t>(t.ne[0] * t.rows());
    if (t.type == ggml_type::kF32) return reinterpret_cast<const float*>(p);
    if (t.type != ggml_type::kF16 && t.type != ggml_type::kBF16) {
      bad_tensor(*e.file, t.name, "is " + ggml_type_name(t.type) + "; Colibri reads it as F32, F16 or BF16",
                 Status::kUnsupported);
    }
    std::vector<float> wide(n);
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      wide[i] = t.type == ggml_type::kF16 ? f16_to_float(h) : bf16_to_float(h);
    }
    out_.converted.push_back(std::move(wide));
    return out_.converted.back().data();
  }

  // Each block's gate/up and down types (Q4_K_M changes the down type from
  // block to block): recorded in m.layer_dtypes when any block differs from
  // the first. Within a block gate and up share a type, and the shared
  // expert has the routed experts' types.
  void layer_types(Manifest& m) {
    const uint64_t D = static_cast<uint64_t>(m.d_model), F = static_cast<uint64_t>(m.d_ff);
    const uint64_t E = static_cast<uint64_t>(m.n_experts);
    std::vector<LayerTypes> types;
    std::vector<std::pair<uint32_t, uint32_t>> ggml;  // as stored, for messages
    bool uniform = true;
    for (const int32_t b : moe_blocks_) {
      uint32_t gate = 0;
      if (fused_) {
        gate = expect(name(b, "ffn_gate_up_exps.weight"), {D, 2 * F, E}).tensor->type;
      } else {
        const TensorIndex::Entry& g = expect(name(b, "ffn_gate_exps.weight"), {D, F, E});
        const TensorIndex::Entry& u = expect(name(b, "ffn_up_exps.weight"), {D, F, E});
        if (u.tensor->type != g.tensor->type) {
          bad_tensor(*u.file, u.tensor->name,
                     "is " + ggml_type_name(u.tensor->type) + " but " + g.tensor->name + " is " +
                         ggml_type_name(g.tensor->type) + "; gate and up must share a type",
                     Status::kUnsupported);
        }
        gate = g.tensor->type;
      }
      const TensorIndex::Entry& d = expect(name(b, "ffn_down_exps.weight"), {F, D, E});
      const TensorIndex::Entry& gate_entry =
          *index_.find(name(b, fused_ ? "ffn_gate_up_exps.weight" : "ffn_gate_exps.weight"));
      LayerTypes t{weight_type(gate_entry), weight_type(d)};
      if (const std::string why = dtype_pair_problem(t.dtype, t.down_dtype); !why.empty()) {
        bad_tensor(*d.file, d.tensor->name, "is " + ggml_type_name(d.tensor->type) + " with gate/up " +
                                                ggml_type_name(gate) + ": " + why,
                   Status::kUnsupported);
      }
      if (!types.empty() && !(t == types.front())) {
        uniform = false;
        if (!weight_format(t.dtype).quantized || !weight_format(t.down_dtype).quantized ||
            !weight_format(types.front().dtype).quantized || !weight_format(types.front().down_dtype).quantized) {
          bad_tensor(*d.file, d.tensor->name,
                     "block " + std::to_string(b) + " has gate/up " + ggml_type_name(gate) + ", down " +
                         ggml_type_name(d.tensor->type) + " but block " + std::to_string(moe_blocks_.front()) +
                         " has " + out_.expert_types + "; types may change from block to block for block formats only",
                     Status::kUnsupported);
        }
      }
      if (m.has_shared()) {
        const TensorIndex::Entry& sg = expect(name(b, "ffn_gate_shexp.weight"), {D, static_cast<uint64_t>(m.shared_d_ff)});
        const TensorIndex::Entry& su = expect(name(b, "ffn_up_shexp.weight"), {D, static_cast<uint64_t>(m.shared_d_ff)});
        const TensorIndex::Entry& sd =
            expect(name(b, "ffn_down_shexp.weight"), {static_cast<uint64_t>(m.shared_d_ff), D});
        for (const TensorIndex::Entry* e : {&sg, &su, &sd}) {
          const uint32_t want = e == &sd ? d.tensor->type : gate;
          if (e->tensor->type != want) {
            bad_tensor(*e->file, e->tensor->name,
                       "is " + ggml_type_name(e->tensor->type) + " but block " + std::to_string(b) +
                           "'s routed experts' " + (e == &sd ? "down" : "gate/up") + " is " + ggml_type_name(want) +
                           "; Colibri runs the shared expert in the routed experts' types",
                       Status::kUnsupported);
          }
        }
      }
      types.push_back(t);
      ggml.emplace_back(gate, d.tensor->type);
    }
    if (uniform) return;
    m.layer_dtypes = types;
    // "gate/up Q4_K, down Q6_K in blocks 1, 4, 7, Q4_K in blocks 2, 3, ...": every type with its blocks.
    auto list = [&](bool down) {
      std::vector<std::pair<uint32_t, std::string>> sets;
      for (size_t l = 0; l < ggml.size(); ++l) {
        const uint32_t t = down ? ggml[l].second : ggml[l].first;
        auto it = std::find_if(sets.begin(), sets.end(), [&](const auto& e) { return e.first == t; });
        const std::string block = std::to_string(moe_blocks_[l]);
        if (it == sets.end()) {
          sets.emplace_back(t, block);
        } else {
          it->second.append(", ").append(block);
        }
      }
      if (sets.size() == 1) return ggml_type_name(sets[0].first);
      std::string r;
      for (const auto& [t, blocks] : sets) {
        if (!r.empty()) r.append("; ");
        r.append(ggml_type_name(t)).append(" in blocks ").append(blocks);
      }
      return r;
    };
    out_.expert_types = "gate/up " + list(false) + ", down " + list(true);
  }

  LayerBuffers layer(int32_t b, int32_t l) {
    const Manifest& m = out_.manifest;
    auto& used = out_.layer_tensors[static_cast<size_t>(l)];
    const auto use = [&](const TensorIndex::Entry& e) { used.emplace_back(e.file, e.tensor); };
    const uint64_t D = static_cast<uint64_t>(m.d_model), F = static_cast<uint64_t>(m.d_ff);
    const uint64_t E = static_cast<uint64_t>(m.n_experts);
    const LayerTypes types = m.layer_types(l);  // checked by layer_types()
    LayerBuffers L;
    const uint8_t* gate = nullptr;
    const uint8_t* up = nullptr;
    const size_t gate_row = weight_row_bytes(types.dtype, static_cast<size_t>(D));
    size_t gate_step = 0;  // bytes from one expert's gate to the next's
    if (fused_) {
      const TensorIndex::Entry& gu = expect(name(b, "ffn_gate_up_exps.weight"), {D, 2 * F, E});
      use(gu);
      gate = gu.file->data(*gu.tensor);
      up = gate + F * gate_row;  // per expert: F gate rows, then F up rows
      gate_step = 2 * F * gate_row;
    } else {
      const TensorIndex::Entry& g = expect(name(b, "ffn_gate_exps.weight"), {D, F, E});
      const TensorIndex::Entry& u = expect(name(b, "ffn_up_exps.weight"), {D, F, E});
      use(g);
      use(u);
      gate = g.file->data(*g.tensor);
      up = u.file->data(*u.tensor);
      gate_step = F * gate_row;
    }
    const TensorIndex::Entry& d = expect(name(b, "ffn_down_exps.weight"), {F, D, E});
    use(d);
    const uint8_t* down = d.file->data(*d.tensor);
    const size_t down_step = static_cast<size_t>(D) * weight_row_bytes(types.down_dtype, static_cast<size_t>(F));
    L.experts.resize(static_cast<size_t>(E));
    for (size_t e = 0; e < E; ++e) {
      L.experts[e] = ExpertBuffers{gate + e * gate_step, up + e * gate_step, down + e * down_step};
    }
    if (m.expert_bias) {
      if (fused_) {
        fail(Status::kUnsupported, first_.source() + ": block " + std::to_string(b) +
                                       ": gpt-oss with fused ffn_gate_up_exps is not a layout llama.cpp writes");
      }
      const float* gb = floats(expect(name(b, "ffn_gate_exps.bias"), {F, E}));
      const float* ub = floats(expect(name(b, "ffn_up_exps.bias"), {F, E}));
      const float* db = floats(expect(name(b, "ffn_down_exps.bias"), {D, E}));
      for (size_t e = 0; e < E; ++e) {
        L.experts[e].gate_bias = gb + e * F;
        L.experts[e].up_bias = ub + e * F;
        L.experts[e].down_bias = db + e * D;
      }
    }
    L.router = floats(expect(name(b, "ffn_gate_inp.weight"), {D, E}));
    if (m.router_has_bias()) {
      // DeepSeek-V3's selection bias (optional), gpt-oss's logit bias.
      const TensorIndex::Entry* bias = index_.find(name(b, gpt_oss() ? "ffn_gate_inp.bias" : "exp_probs_b.bias"));
      if (bias != nullptr) {
        L.router_bias = floats(expect(bias->tensor->name, {E}));
      } else if (gpt_oss()) {
        fail(Status::kFormat, first_.source() + ": tensor " + name(b, "ffn_gate_inp.bias") + " is missing");
      }
    }
    if (m.has_shared()) {
      const uint64_t Fs = static_cast<uint64_t>(m.shared_d_ff);
      const TensorIndex::Entry& sg = expect(name(b, "ffn_gate_shexp.weight"), {D, Fs});
      const TensorIndex::Entry& su = expect(name(b, "ffn_up_shexp.weight"), {D, Fs});
      const TensorIndex::Entry& sd = expect(name(b, "ffn_down_shexp.weight"), {Fs, D});
      use(sg);
      use(su);
      use(sd);
      L.shared = ExpertBuffers{sg.file->data(*sg.tensor), su.file->data(*su.tensor), sd.file->data(*sd.tensor)};
      if (m.shared_gate) {
        const TensorIndex::Entry* gi = index_.find(name(b, "ffn_gate_inp_shexp.weight"));
        if (gi == nullptr) {
          fail(Status::kFormat, first_.source() + ": tensor " + name(b, "ffn_gate_inp_shexp.weight") +
                                    " is missing (block " + std::to_string(moe_blocks_.front()) + " has one)");
        }
        L.shared_gate = floats(expect(gi->tensor->name, gi->tensor->n_dims == 1 ? std::vector<uint64_t>{D}
                                                                                 : std::vector<uint64_t>{D, 1}));
      }
    }
    return L;
  }
};

}  // namespace

bool is_gguf_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char magic[4] = {};
  const bool gguf = ::read(fd, magic, 4) == 4 && std::memcmp(magic, "GGUF", 4) == 0;
  ::close(fd);
  return gguf;
}

GgufModel load_gguf_model(const std::string& path) {
  GgufModel out;
  out.path = path;
  out.files = open_parts(path);
  Loader(out).run();
  return out;
}

}  // namespace colibri
