// Block-quantised models end to end through the C ABI: model directories
// written in every block format (and the q4_k / q6_k mix), opened, run with
// random and skewed routing, T = 1 and more, empty experts and tails, and
// compared with a float64 reference on the dequantised weights (the
// formats' reference dequantisers, checked against the gguf package in
// python/tests/test_quant_formats.py).
//   int8 activations (default):      relative L2 <= 2e-2
//   exact option (exact_prefill=1):  relative L2 <= 1e-5
// Registered once per instruction set through COLIBRI_ISA.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "io/manifest.h"
#include "lib/model_writer.h"
#include "lib/float64_reference.h"
#include "util/weight_format.h"

#include "test_util.h"

namespace {

constexpr double kInt8Tolerance = 2e-2;
constexpr double kExactTolerance = 1e-5;

struct Case {
  const char* name;
  colibri_dtype_t dtype;
  colibri_dtype_t down_dtype;
};

const Case kCases[] = {
    {"q8_0", COLIBRI_DTYPE_Q8_0, COLIBRI_DTYPE_Q8_0}, {"q4_0", COLIBRI_DTYPE_Q4_0, COLIBRI_DTYPE_Q4_0},
    {"q4_k", COLIBRI_DTYPE_Q4_K, COLIBRI_DTYPE_Q4_K}, {"q5_k", COLIBRI_DTYPE_Q5_K, COLIBRI_DTYPE_Q5_K},
    {"q6_k", COLIBRI_DTYPE_Q6_K, COLIBRI_DTYPE_Q6_K}, {"q4_k_m", COLIBRI_DTYPE_Q4_K, COLIBRI_DTYPE_Q6_K},
    {"mxfp4", COLIBRI_DTYPE_MXFP4, COLIBRI_DTYPE_MXFP4}, {"q4_1", COLIBRI_DTYPE_Q4_1, COLIBRI_DTYPE_Q4_1},
    {"q5_0", COLIBRI_DTYPE_Q5_0, COLIBRI_DTYPE_Q5_0},    {"q5_1", COLIBRI_DTYPE_Q5_1, COLIBRI_DTYPE_Q5_1},
    {"iq4_nl", COLIBRI_DTYPE_IQ4_NL, COLIBRI_DTYPE_IQ4_NL}, {"iq4_xs", COLIBRI_DTYPE_IQ4_XS, COLIBRI_DTYPE_IQ4_XS},
    // A dynamic mix: iq4_xs gate/up with q5_0 down.
    {"iq4_xs_q5_0", COLIBRI_DTYPE_IQ4_XS, COLIBRI_DTYPE_Q5_0}, {"q2_k", COLIBRI_DTYPE_Q2_K, COLIBRI_DTYPE_Q2_K},
    {"q3_k", COLIBRI_DTYPE_Q3_K, COLIBRI_DTYPE_Q3_K},
    // llama.cpp's Q2_K mix: q2_K gate/up with q3_K or q4_K down.
    {"q2_k_q3_k", COLIBRI_DTYPE_Q2_K, COLIBRI_DTYPE_Q3_K},
    // The grid i-quants (read, not made: write_random_model's random codes),
    // as llama.cpp's IQ1_S / IQ1_M / IQ2_XXS mixes pair them.
    {"iq1_s_iq3_xxs", COLIBRI_DTYPE_IQ1_S, COLIBRI_DTYPE_IQ3_XXS},
    {"iq1_m_iq2_xxs", COLIBRI_DTYPE_IQ1_M, COLIBRI_DTYPE_IQ2_XXS},
    {"iq2_xxs_q3_k", COLIBRI_DTYPE_IQ2_XXS, COLIBRI_DTYPE_Q3_K},
    {"iq2_xs_iq3_s", COLIBRI_DTYPE_IQ2_XS, COLIBRI_DTYPE_IQ3_S},
    {"iq2_s_iq3_s", COLIBRI_DTYPE_IQ2_S, COLIBRI_DTYPE_IQ3_S},
    // FP8: exact codes against fp32 activations, so fp32-grade by default
    // too (but for the AMX bf16 tier's calls).
    {"fp8_e4m3", COLIBRI_DTYPE_FP8_E4M3, COLIBRI_DTYPE_FP8_E4M3},
    // The ternary formats, alone and with a finer down (as a BitNet-style
    // model quantised to TQ1_0 keeps some layers in Q4_K / Q8_0).
    {"tq1_0", COLIBRI_DTYPE_TQ1_0, COLIBRI_DTYPE_TQ1_0}, {"tq2_0", COLIBRI_DTYPE_TQ2_0, COLIBRI_DTYPE_TQ2_0},
    {"tq1_0_q4_k", COLIBRI_DTYPE_TQ1_0, COLIBRI_DTYPE_Q4_K}, {"tq2_0_tq1_0", COLIBRI_DTYPE_TQ2_0, COLIBRI_DTYPE_TQ1_0},
};

using Opened = colibri_test::OpenedModel;
using colibri_test::open_test_model;

// Random routing over E experts, k slots per token; `skew` sends most
// tokens to expert 0 and leaves some slots empty (-1).
void make_routing(int32_t T, int32_t k, int32_t E, bool skew, std::mt19937& rng, std::vector<int32_t>* ids,
                  std::vector<float>* w) {
  ids->assign(static_cast<size_t>(T) * k, -1);
  w->assign(static_cast<size_t>(T) * k, 0.0f);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int32_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    if (skew) std::swap(perm[0], *std::find(perm.begin(), perm.end(), 0));
    for (int32_t j = 0; j < k; ++j) {
      if (skew && j == k - 1 && t % 3 == 0) continue;  // an empty slot
      (*ids)[static_cast<size_t>(t) * k + j] = perm[static_cast<size_t>(j)];
      (*w)[static_cast<size_t>(t) * k + j] = u(rng);
    }
  }
}

double run_and_compare(colibri_model_t* model, const std::string& dir, int32_t layer, int32_t T, int32_t k,
                       int32_t E, int32_t D, bool skew, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * D);
  for (float& v : x) v = nd(rng);
  x[0] = 12.0f;  // an outlier in one block: int8 scales must follow it
  std::vector<int32_t> ids;
  std::vector<float> w;
  make_routing(T, k, E, skew, rng, &ids, &w);
  std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
  colibri_infer_t call;
  colibri_infer_default(&call);
  call.layer = layer;
  call.n_tokens = T;
  call.input = x.data();
  call.output = y.data();
  call.top_k = k;
  call.expert_ids = ids.data();
  call.expert_weights = w.data();
  EXPECT_EQ(colibri_infer(model, &call), COLIBRI_OK) << colibri_last_error();
  const std::vector<double> ref = colibri::reference_layer(dir, layer, T, x.data(), k, ids.data(), w.data());
  return colibri::relative_l2(y.data(), ref);
}

class QuantModel : public ::testing::TestWithParam<Case> {};

// d_model 320 is not a multiple of 256, d_ff 200 not of 32: every row ends
// in a zero-padded block (for the K formats, most of one).
TEST_P(QuantModel, MatchesReferenceOnDequantisedWeights) {
  const Case c = GetParam();
  colibri_test::TempDir tmp("colibri_quant");
  colibri::ModelWriteSpec spec;
  spec.n_layers = 2;
  spec.n_experts = 8;
  spec.d_model = 320;
  spec.d_ff = 200;
  spec.dtype = colibri_test::weight_type(c.dtype);
  spec.down_dtype = colibri_test::weight_type(c.down_dtype);
  colibri::write_random_model(tmp.path(), spec, 7);
  for (bool exact : {false, true}) {
    Opened m;
    m.model = open_test_model(tmp.path(), exact);
    ASSERT_NE(m.model, nullptr);
    colibri_model_info_t info;
    ASSERT_EQ(colibri_model_info(m.model, &info), COLIBRI_OK);
    EXPECT_EQ(info.dtype, c.dtype);
    EXPECT_EQ(info.down_dtype, c.down_dtype);
    const bool amx = std::string(colibri_cpu_isa()) == "amx";
    const double tol = exact || (c.dtype == COLIBRI_DTYPE_FP8_E4M3 && !amx) ? kExactTolerance : kInt8Tolerance;
    // On AMX machines the T=130 calls (about 32 tokens per expert) take
    // the bf16 tiles on dequantised rows; every other call the int8 kernels.
    const bool amx_tier = std::string(colibri_model_kernels(m.model)).find("amx-bf16-dequant") != std::string::npos;
    EXPECT_EQ(amx_tier, !exact && amx) << colibri_model_kernels(m.model);
    double worst = 0.0, worst_many = 0.0;
    uint32_t seed = 1;
    for (int32_t T : {1, 3, 17, 130}) {
      for (bool skew : {false, true}) {
        const int32_t layer = static_cast<int32_t>(seed % 2);
        const double err = run_and_compare(m.model, tmp.path(), layer, T, 2, spec.n_experts, spec.d_model, skew, seed++);
        EXPECT_LE(err, tol) << c.name << (exact ? " exact" : " int8") << " T=" << T << " skew=" << skew << " "
                            << colibri_model_kernels(m.model);
        worst = std::max(worst, err);
        if (T == 130) worst_many = std::max(worst_many, err);
      }
    }
    std::printf("%-7s %-5s worst relative L2 %.3g, at T=130 %.3g (%s)\n", c.name, exact ? "exact" : "int8", worst,
                worst_many, colibri_model_kernels(m.model));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantModel, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& p) { return std::string(p.param.name); });

// Real widths (whole blocks, several super-blocks per row), one layer.
TEST(QuantModelWide, Q4KMixAtWholeBlocks) {
  colibri_test::TempDir tmp("colibri_quant");
  colibri::ModelWriteSpec spec;
  spec.n_experts = 4;
  spec.d_model = 1024;
  spec.d_ff = 512;
  spec.dtype = colibri::WeightType::kQ4_K;
  spec.down_dtype = colibri::WeightType::kQ6_K;
  colibri::write_random_model(tmp.path(), spec, 11);
  Opened m;
  m.model = open_test_model(tmp.path(), false);
  ASSERT_NE(m.model, nullptr);
  for (int32_t T : {1, 2, 64}) {
    EXPECT_LE(run_and_compare(m.model, tmp.path(), 0, T, 2, spec.n_experts, spec.d_model, false, 100 + T),
              kInt8Tolerance);
  }
}

// The expert files hold rows of whole blocks; a file of the float size is
// refused naming the types.
TEST(QuantModelFiles, SizesAndMessages) {
  colibri_test::TempDir tmp("colibri_quant");
  colibri::ModelWriteSpec spec;
  spec.n_experts = 2;
  spec.d_model = 64;
  spec.d_ff = 40;
  spec.dtype = colibri::WeightType::kQ4_0;
  colibri::write_random_model(tmp.path(), spec, 3);
  const colibri::Manifest man = colibri::load_manifest(tmp.path());
  EXPECT_EQ(man.version, 3);
  // gate, up: 40 rows of 2 blocks; down: 64 rows of 2 blocks (40 -> 64).
  EXPECT_EQ(man.expert_file_bytes(0), uint64_t{2 * 40 * 2 * 18 + 64 * 2 * 18});
  EXPECT_EQ(colibri_dtype_row_bytes(COLIBRI_DTYPE_Q4_0, 40), size_t{36});
  EXPECT_EQ(colibri_dtype_row_bytes(COLIBRI_DTYPE_Q4_K, 1), size_t{144});
  EXPECT_EQ(colibri_dtype_row_bytes(static_cast<colibri_dtype_t>(99), 8), size_t{0});
  {
    FILE* f = std::fopen((tmp.path() + "/expert_01.bin").c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(::ftruncate(fileno(f), 100), 0);
    std::fclose(f);
  }
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  colibri_model_t* m = nullptr;
  EXPECT_EQ(colibri_open(tmp.path().c_str(), &o, &m), COLIBRI_ERR_FORMAT);
  EXPECT_EQ(m, nullptr);
  const std::string msg = colibri_last_error();
  EXPECT_NE(msg.find("expert_01.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("q4_0"), std::string::npos) << msg;
}

TEST(QuantModelFiles, ManifestRules) {
  const std::string base = R"({"format": "colibri-moe", "n_layers": 1, "n_experts": 2, "d_model": 64, "d_ff": 32,
                               "activation": "swiglu", )";
  auto parse = [&](const std::string& rest) { return colibri::parse_manifest(base + rest, "m.json"); };
  EXPECT_EQ(parse(R"("version": 3, "dtype": "q4_k", "down_dtype": "q6_k"})").down_dtype, colibri::WeightType::kQ6_K);
  EXPECT_EQ(parse(R"("version": 3, "dtype": "q8_0"})").down_dtype, colibri::WeightType::kQ8_0);
  // `rest` completes `head` into a manifest that must be refused naming `field`.
  auto refused_after = [](const std::string& head, const std::string& rest, const char* field) {
    try {
      colibri::parse_manifest(head + rest, "m.json");
      ADD_FAILURE() << "accepted: " << rest;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  auto refused = [&](const std::string& rest, const char* field) { refused_after(base, rest, field); };
  refused(R"("version": 2, "dtype": "q4_k"})", "version");
  refused(R"("version": 3, "dtype": "f16", "down_dtype": "q4_k"})", "down_dtype");
  refused(R"("version": 3, "dtype": "q4_k", "down_dtype": "bf16"})", "down_dtype");
  refused(R"("version": 3, "dtype": "q7_k"})", "dtype");
  refused(R"("version": 5, "dtype": "q4_k"})", "version");

  // Per-layer types (layer_dtypes): n_layers entries of block formats, the
  // first equal to dtype / down_dtype; sizes follow each layer's types.
  const std::string two = R"({"format": "colibri-moe", "n_layers": 2, "n_experts": 2, "d_model": 256, "d_ff": 256,
                               "activation": "swiglu", "version": 3, "dtype": "q4_k", "down_dtype": "q6_k", )";
  auto parse2 = [&](const std::string& rest) { return colibri::parse_manifest(two + rest, "m.json"); };
  const colibri::Manifest mixed = parse2(R"("layer_dtypes": [["q4_k", "q6_k"], ["q4_k", "q4_k"]]})");
  ASSERT_EQ(mixed.layer_dtypes.size(), 2u);
  EXPECT_EQ(mixed.layer_types(1).down_dtype, colibri::WeightType::kQ4_K);
  EXPECT_EQ(mixed.expert_file_bytes(0), uint64_t{2 * 256 * 144 + 256 * 210});
  EXPECT_EQ(mixed.expert_file_bytes(1), uint64_t{3 * 256 * 144});
  EXPECT_EQ(mixed.max_expert_file_bytes(), mixed.expert_file_bytes(0));
  // Written back and read again: the same types.
  const colibri::Manifest again = colibri::parse_manifest(colibri::manifest_to_json(mixed), "again.json");
  EXPECT_TRUE(again.layer_dtypes[1] == mixed.layer_dtypes[1]);
  auto refused2 = [&](const std::string& rest, const char* what) { refused_after(two, rest, what); };
  refused2(R"("layer_dtypes": [["q4_k", "q6_k"]]})", "n_layers (2) entries");
  refused2(R"("layer_dtypes": [["q4_k", "q4_k"], ["q4_k", "q6_k"]]})", "must equal dtype / down_dtype");
  refused2(R"("layer_dtypes": [["q4_k", "q6_k"], ["bf16", "bf16"]]})", "must name block formats");
  refused2(R"("layer_dtypes": [["q4_k", "q6_k"], ["q4_k"]]})", "[dtype, down_dtype]");
  refused2(R"("layer_dtypes": [["q4_k", "q6_k"], ["q4_k", "q9_k"]]})", "[dtype, down_dtype]");
}

// The conversion entry points round-trip and check their arguments.
TEST(QuantApi, QuantizeDequantize) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t rows = 3, n = 300;  // not a multiple of 256: a padded block
  std::vector<float> x(rows * n);
  for (float& v : x) v = nd(rng);
  for (colibri_dtype_t d : {COLIBRI_DTYPE_Q8_0, COLIBRI_DTYPE_Q4_0, COLIBRI_DTYPE_Q4_K, COLIBRI_DTYPE_Q5_K,
                            COLIBRI_DTYPE_Q6_K, COLIBRI_DTYPE_BF16}) {
    const size_t bytes = rows * colibri_dtype_row_bytes(d, n);
    std::vector<uint8_t> q(bytes, 0xAB);
    ASSERT_EQ(colibri_quantize(d, x.data(), rows, n, q.data(), bytes), COLIBRI_OK) << colibri_last_error();
    std::vector<float> back(rows * n, std::numeric_limits<float>::quiet_NaN());
    ASSERT_EQ(colibri_dequantize(d, q.data(), bytes, rows, n, back.data()), COLIBRI_OK) << colibri_last_error();
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      num += (back[i] - x[i]) * static_cast<double>(back[i] - x[i]);
      den += x[i] * static_cast<double>(x[i]);
    }
    EXPECT_LT(std::sqrt(num / den), 0.12) << colibri_dtype_name(d);
    EXPECT_EQ(colibri_quantize(d, x.data(), rows, n, q.data(), bytes - 1), COLIBRI_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(colibri_last_error()).find("bytes"), std::string::npos);
    EXPECT_EQ(colibri_dequantize(d, q.data(), bytes + 1, rows, n, back.data()), COLIBRI_ERR_INVALID_ARGUMENT);
  }
  EXPECT_EQ(colibri_quantize(static_cast<colibri_dtype_t>(42), x.data(), 1, 32, x.data(), 1000),
            COLIBRI_ERR_INVALID_ARGUMENT);
}

}  // namespace

// Kernels chosen by measurement (src/moe/kernel_choice.h): measured once,
// remembered in the cache file, the remembered choice computing right
// whichever levels it names, the file keyed so another CPU or library
// version never reuses a line, a corrupted file ignored with a warning, and
// nothing measured where the option or the environment says no.
class KernelChoice : public ::testing::Test {
 protected:
  // 2 layers of 8 experts, 320 x 200.
  static void write_model(const std::string& dir, colibri::WeightType type, colibri::WeightType down, uint32_t seed) {
    colibri::ModelWriteSpec spec;
    spec.n_layers = 2;
    spec.n_experts = 8;
    spec.d_model = 320;
    spec.d_ff = 200;
    spec.dtype = type;
    spec.down_dtype = down;
    colibri::write_random_model(dir, spec, seed);
  }
  // The cache text with the levels of the line holding `what` replaced.
  static std::string with_levels(const std::string& text, const std::string& what, const std::string& decode,
                                 const std::string& many) {
    const size_t line = text.find(what);
    EXPECT_NE(line, std::string::npos) << what << " in " << text;
    if (line == std::string::npos) return text;
    const size_t key_end = text.find('\t', line);
    const size_t timings = text.find('\t', text.find('\t', key_end + 1) + 1);
    return text.substr(0, key_end) + "\t" + decode + "\t" + many + text.substr(timings);
  }

  void SetUp() override {
    write_model(model_.path(), colibri::WeightType::kQ4_K, colibri::WeightType::kQ6_K, 11);
    env_ = std::make_unique<colibri_test::KernelChoiceEnv>(cache_.path() + "/sub");
    file_ = cache_.path() + "/sub/kernels.tsv";
    if (std::getenv("COLIBRI_ISA") != nullptr) {
      // A forced level: nothing is measured (checked here), nothing to choose.
      EXPECT_EQ(kernels_of_new_model().find("measure"), std::string::npos);
      EXPECT_FALSE(std::filesystem::exists(file_));
      GTEST_SKIP() << "COLIBRI_ISA forces a level";
    }
    const std::string isa = colibri_cpu_isa();
    if (isa != "avx512" && isa != "amx") GTEST_SKIP() << "one instruction-set level (" << isa << "): no choice";
  }
  void TearDown() override { env_.reset(); }
  std::string kernels_of_new_model(colibri_model_t** out = nullptr) {
    colibri_model_t* m = open_test_model(model_.path(), false);
    std::string k = m != nullptr ? colibri_model_kernels(m) : "";
    if (out != nullptr) {
      *out = m;
    } else {
      colibri_free(m);
    }
    return k;
  }
  static void write_file(const std::string& path, const std::string& text) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }

  colibri_test::TempDir model_{"colibri_choice_model"};
  colibri_test::TempDir cache_{"colibri_choice_cache"};
  std::string file_;
  std::unique_ptr<colibri_test::KernelChoiceEnv> env_;
};

TEST_F(KernelChoice, MeasuredOnceThenRemembered) {
  const std::string first = kernels_of_new_model();
  EXPECT_NE(first.find("chosen by measurement: q4_k/q6_k 320x200: measured now"), std::string::npos) << first;
  EXPECT_NE(first.find("1 token/expert"), std::string::npos) << first;
  const std::string text = colibri_test::file_bytes(file_);
  ASSERT_EQ(text.rfind("# colibri kernel choices v1\n", 0), 0u) << text;
  // Both layers share a shape: one line, keyed by the CPU and the library.
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;
  EXPECT_NE(text.find(std::string("colibri ") + colibri_version() + "|"), std::string::npos) << text;
  const std::string second = kernels_of_new_model();
  EXPECT_NE(second.find("measured earlier (" + file_ + ")"), std::string::npos) << second;
  EXPECT_EQ(colibri_test::file_bytes(file_), text);
}

// Whatever levels a remembered line names, the composed plan (one level's
// decode tables, another's from 5 tokens per expert, the registry's AMX
// tier above) matches the float64 reference at every token count.
TEST_F(KernelChoice, RememberedChoicesComputeRight) {
  kernels_of_new_model();
  const std::string text = colibri_test::file_bytes(file_);
  std::vector<std::string> levels = {"avx2", "avx512"};
  if (std::string(colibri_cpu_isa()) == "amx") levels.push_back("amx");
  for (const std::string& decode : levels) {
    for (const std::string& many : levels) {
      write_file(file_, with_levels(text, "q4_k/q6_k", decode, many));
      colibri_model_t* raw = nullptr;
      const std::string k = kernels_of_new_model(&raw);
      Opened m;
      m.model = raw;
      ASSERT_NE(m.model, nullptr);
      EXPECT_NE(k.find("measured earlier"), std::string::npos) << k;
      EXPECT_EQ(k.rfind("decode int8-" + decode, 0), 0u) << decode << "/" << many << ": " << k;
      if (many != decode) {
        EXPECT_NE(k.find("prefill int8-" + many), std::string::npos) << decode << "/" << many << ": " << k;
        EXPECT_NE(k.find(" from 5 tokens/expert"), std::string::npos) << decode << "/" << many << ": " << k;
      }
      uint32_t seed = 100;
      for (int32_t T : {1, 3, 17, 130}) {
        const double err = run_and_compare(m.model, model_.path(), static_cast<int32_t>(seed % 2), T, 2, 8, 320,
                                           false, seed);
        ++seed;
        EXPECT_LE(err, kInt8Tolerance) << decode << "/" << many << " T=" << T << " " << k;
      }
    }
  }
}

// q2_k's AMX tier starts at 10 tokens per expert, below the many-token
// measurement's 16: a remembered avx512 choice for many tokens runs up to
// 16 and the AMX tier from 17, and both compute right.
TEST_F(KernelChoice, RegistryTierBelowTheMeasurementMovesAboveIt) {
  if (std::string(colibri_cpu_isa()) != "amx") GTEST_SKIP() << "no AMX tier below 16 tokens here";
  colibri_test::TempDir q2("colibri_choice_q2k");
  write_model(q2.path(), colibri::WeightType::kQ2_K, colibri::WeightType::kQ2_K, 13);
  colibri_free(open_test_model(q2.path(), false));
  write_file(file_, with_levels(colibri_test::file_bytes(file_), "q2_k/q2_k", "avx512", "avx512"));
  Opened m;
  m.model = open_test_model(q2.path(), false);
  ASSERT_NE(m.model, nullptr);
  const std::string k = colibri_model_kernels(m.model);
  EXPECT_EQ(k.rfind("decode int8-avx512-vnni, prefill int8-avx512-vnni from 5 tokens/expert, amx-bf16-dequant "
                    "from 17 tokens/expert", 0),
            0u)
      << k;
  uint32_t seed = 200;
  for (int32_t T : {1, 17, 40, 130}) {
    const double err = run_and_compare(m.model, q2.path(), static_cast<int32_t>(seed % 2), T, 2, 8, 320, false, seed);
    ++seed;
    EXPECT_LE(err, kInt8Tolerance) << "T=" << T << " " << k;
  }
}

TEST_F(KernelChoice, AnotherCpuOrVersionIsNotReused) {
  kernels_of_new_model();
  const std::string text = colibri_test::file_bytes(file_);
  const std::string version = std::string("colibri ") + colibri_version() + "|";
  std::string other = text;
  other.replace(other.find(version), version.size(), "colibri 0.0.0-other|");
  const size_t cpu = other.find('|') + 1;
  other.insert(cpu, "Another CPU ");
  write_file(file_, other);
  const std::string k = kernels_of_new_model();
  EXPECT_NE(k.find("measured now"), std::string::npos) << k;
  const std::string after = colibri_test::file_bytes(file_);
  EXPECT_EQ(std::count(after.begin(), after.end(), '\n'), 3) << after;  // the other line kept, ours added
  EXPECT_NE(after.find("colibri 0.0.0-other|Another CPU "), std::string::npos) << after;
}

TEST_F(KernelChoice, CorruptedCacheIsIgnoredWithAWarning) {
  std::filesystem::create_directories(cache_.path() + "/sub");
  for (const std::string& bad : {std::string("not a cache\n"),
                                std::string("# colibri kernel choices v1\nkey\tavx512\tsse9\tx\n"),
                                std::string("# colibri kernel choices v1\ntruncated line\n")}) {
    write_file(file_, bad);
    colibri_model_t* raw = nullptr;
    const std::string k = kernels_of_new_model(&raw);
    ASSERT_NE(raw, nullptr);
    const std::string warning = colibri_last_warning();
    colibri_free(raw);
    EXPECT_NE(warning.find("kernel choice cache " + file_), std::string::npos) << warning;
    EXPECT_NE(warning.find("ignored"), std::string::npos) << warning;
    EXPECT_NE(k.find("measured now"), std::string::npos) << k;
    EXPECT_EQ(colibri_test::file_bytes(file_).rfind("# colibri kernel choices v1\ncolibri ", 0), 0u);
  }
}

TEST_F(KernelChoice, OffByOptionOrEnvironment) {
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  EXPECT_EQ(o.tune_kernels, 1);
  o.lock_memory = 0;
  o.huge_pages = 0;
  o.tune_kernels = 0;
  Opened m;
  ASSERT_EQ(colibri_open(model_.path().c_str(), &o, &m.model), COLIBRI_OK) << colibri_last_error();
  EXPECT_EQ(std::string(colibri_model_kernels(m.model)).find("measure"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(file_));
  ::setenv("COLIBRI_TUNE", "0", 1);
  EXPECT_EQ(kernels_of_new_model().find("measure"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(file_));
  ::unsetenv("COLIBRI_TUNE");
  // Without a cache directory it still measures, and remembers nothing.
  ::unsetenv("COLIBRI_CACHE_DIR");
  const char* home = std::getenv("HOME");
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const std::string saved_home = home != nullptr ? home : "", saved_xdg = xdg != nullptr ? xdg : "";
  ::unsetenv("HOME");
  ::unsetenv("XDG_CACHE_HOME");
  // (measured now, or reused from an earlier test's measurement in this process)
  EXPECT_NE(kernels_of_new_model().find("chosen by measurement"), std::string::npos);
  // A second open in this process reuses that measurement (a model opened
  // block by block measures each shape once).
  EXPECT_NE(kernels_of_new_model().find("measured earlier in this process"), std::string::npos);
  if (home != nullptr) ::setenv("HOME", saved_home.c_str(), 1);
  if (xdg != nullptr) ::setenv("XDG_CACHE_HOME", saved_xdg.c_str(), 1);
}
