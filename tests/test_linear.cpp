// Linear layers (y = x W^T + b, moe/linear.h and the C ABI's colibri_linear_*)
// against float64 on the weights as stored (dequantised by the format's
// reference), for every weight format, every instruction-set level this CPU
// has, token counts that reach every prefill tier, row counts off the
// kernels' micro-tiles, with and without bias, outputs poisoned with NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "kernels/kernels.h"
#include "moe/linear.h"
#include "test_util.h"
#include "util/error.h"
#include "util/weight_format.h"

namespace {

using colibri::WeightType;
namespace kernels = colibri::kernels;

struct Matrix {
  std::vector<uint8_t> stored;  // rows as the format stores them
  std::vector<float> values;    // what they dequantise to
};

Matrix random_matrix(WeightType t, int32_t rows, int32_t cols, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> w(static_cast<size_t>(rows) * static_cast<size_t>(cols));
  for (float& v : w) v = normal(rng);
  Matrix m;
  m.stored.resize(colibri::weight_row_bytes(t, static_cast<size_t>(cols)) * static_cast<size_t>(rows));
  colibri::convert_rows_from_float(t, w.data(), static_cast<size_t>(rows), static_cast<size_t>(cols), m.stored.data());
  m.values.resize(w.size());
  colibri::convert_rows_to_float(t, m.stored.data(), static_cast<size_t>(rows), static_cast<size_t>(cols),
                                 m.values.data());
  return m;
}

double relative_l2(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The contract of docs/PRECISION.md for the table that runs.
double tolerance(WeightType t, bool exact) {
  if (colibri::weight_format(t).quantized) return exact ? 1e-5 : 2e-2;
  return t == WeightType::kF32 ? 1e-5 : 5e-3;
}

std::vector<kernels::Isa> levels() {
  std::vector<kernels::Isa> out;
  for (kernels::Isa isa : {kernels::Isa::kScalar, kernels::Isa::kAvx2, kernels::Isa::kAvx512, kernels::Isa::kAmx}) {
    if (kernels::isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

constexpr WeightType kTypes[] = {WeightType::kF32,  WeightType::kF16,  WeightType::kBF16,
                                 WeightType::kQ8_0, WeightType::kQ4_0, WeightType::kQ4_K,
                                 WeightType::kQ5_K, WeightType::kQ6_K, WeightType::kMXFP4};

TEST(Linear, EveryFormatLevelAndTokenCountAgainstFloat64) {
  std::mt19937 rng(7);
  // 200 rows: not a multiple of 16 or of a row block; 512 columns: two
  // K-format blocks, large enough for the bf16-rounding tiers.
  const int32_t out = 200, in = 512;
  for (WeightType t : kTypes) {
    const Matrix w = random_matrix(t, out, in, rng);
    std::vector<float> bias(static_cast<size_t>(out));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& b : bias) b = normal(rng);
    for (kernels::Isa isa : levels()) {
      for (bool exact : {false, true}) {
        for (bool with_bias : {false, true}) {
          colibri::LinearOptions o;
          o.exact = exact;
          o.isa = static_cast<int>(isa);
          o.threads = 2;
          colibri::Linear lin(t, out, in, w.stored.data(), w.stored.size(), with_bias ? bias.data() : nullptr, o,
                              "test", nullptr);
          for (int32_t T : {1, 3, 17, 130}) {
            std::vector<float> x(static_cast<size_t>(T) * in);
            for (float& v : x) v = normal(rng);
            std::vector<double> ref(static_cast<size_t>(T) * out);
            for (int32_t i = 0; i < T; ++i) {
              for (int32_t o2 = 0; o2 < out; ++o2) {
                double acc = with_bias ? bias[static_cast<size_t>(o2)] : 0.0;
                for (int32_t k = 0; k < in; ++k) {
                  acc += static_cast<double>(x[static_cast<size_t>(i) * in + k]) *
                         w.values[static_cast<size_t>(o2) * in + k];
                }
                ref[static_cast<size_t>(i) * out + o2] = acc;
              }
            }
            std::vector<float> y(ref.size(), std::numeric_limits<float>::quiet_NaN());
            lin.forward(T, x.data(), static_cast<size_t>(in), y.data(), static_cast<size_t>(out));
            const double err = relative_l2(y, ref);
            EXPECT_LE(err, tolerance(t, exact))
                << colibri::weight_format(t).name << " at " << kernels::isa_name(isa) << (exact ? " exact" : "")
                << (with_bias ? " with bias" : "") << ", T=" << T << " (" << lin.kernels_description() << ")";
          }
        }
      }
    }
  }
}

TEST(Linear, GroupsAreIndependentMatricesAgainstFloat64) {
  // DeepSeek's per-head attn_k_b (G = heads, 512 x 128) and attn_v_b
  // (128 x 512) shapes, smaller: each group's slice of x meets only its own
  // matrix and bias, at every level, in both precisions, at token counts of
  // the decode, few-token and many-token kernels; a row block never
  // straddles two groups (96 rows a group, 16 groups).
  std::mt19937 rng(13);
  const int32_t G = 16;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (WeightType t : {WeightType::kQ8_0, WeightType::kQ4_0, WeightType::kF32, WeightType::kBF16}) {
    for (auto [out, in] : {std::pair<int32_t, int32_t>{96, 128}, std::pair<int32_t, int32_t>{32, 512}}) {
      const Matrix w = random_matrix(t, G * out, in, rng);
      std::vector<float> bias(static_cast<size_t>(G * out));
      for (float& b : bias) b = normal(rng);
      for (kernels::Isa isa : levels()) {
        for (bool exact : {false, true}) {
          colibri::LinearOptions o;
          o.exact = exact;
          o.isa = static_cast<int>(isa);
          o.threads = 2;
          const bool with_bias = exact;
          colibri::Linear lin(t, out, in, w.stored.data(), w.stored.size(), with_bias ? bias.data() : nullptr, o,
                              "grouped", nullptr, G);
          ASSERT_EQ(lin.groups(), G);
          for (int32_t T : {1, 5, 40}) {
            const size_t ldx = static_cast<size_t>(G * in) + 3, ldy = static_cast<size_t>(G * out) + 5;
            std::vector<float> x(static_cast<size_t>(T) * ldx);
            for (float& v : x) v = normal(rng);
            std::vector<float> y(static_cast<size_t>(T) * ldy, std::numeric_limits<float>::quiet_NaN());
            lin.forward(T, x.data(), ldx, y.data(), ldy);
            std::vector<double> ref;
            std::vector<float> got;
            for (int32_t i = 0; i < T; ++i) {
              for (int32_t g = 0; g < G; ++g) {
                for (int32_t r = 0; r < out; ++r) {
                  const size_t row = static_cast<size_t>(g * out + r);
                  double acc = with_bias ? bias[row] : 0.0;
                  for (int32_t k = 0; k < in; ++k) {
                    acc += static_cast<double>(x[static_cast<size_t>(i) * ldx + static_cast<size_t>(g * in + k)]) *
                           w.values[row * static_cast<size_t>(in) + static_cast<size_t>(k)];
                  }
                  ref.push_back(acc);
                  got.push_back(y[static_cast<size_t>(i) * ldy + row]);
                }
              }
              // The padding past each y row is never written.
              for (size_t p = static_cast<size_t>(G * out); p < ldy; ++p) {
                EXPECT_TRUE(std::isnan(y[static_cast<size_t>(i) * ldy + p]));
              }
            }
            EXPECT_LE(relative_l2(got, ref), tolerance(t, exact))
                << colibri::weight_format(t).name << " " << out << "x" << in << " at " << kernels::isa_name(isa)
                << (exact ? " exact" : "") << ", T=" << T << " (" << lin.kernels_description() << ")";
          }
        }
      }
    }
  }
  // Bad group counts and sizes are refused with the layer's name.
  const Matrix w = random_matrix(WeightType::kQ8_0, 4 * 32, 64, rng);
  colibri::LinearOptions o;
  try {
    colibri::Linear bad(WeightType::kQ8_0, 32, 64, w.stored.data(), w.stored.size(), nullptr, o, "kb", nullptr, 0);
    ADD_FAILURE() << "groups 0 accepted";
  } catch (const colibri::Error& e) {
    EXPECT_NE(std::string(e.what()).find("kb: groups must be"), std::string::npos) << e.what();
  }
  try {
    colibri::Linear bad(WeightType::kQ8_0, 32, 64, w.stored.data(), w.stored.size(), nullptr, o, "kb", nullptr, 3);
    ADD_FAILURE() << "a weight of 4 groups accepted as 3";
  } catch (const colibri::Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 q8_0 matrices of 32 x 64 take"), std::string::npos) << e.what();
  }
}

TEST(Linear, RowsPaddedToTheStrideAndThreadCountsAgree) {
  // in_features off the 64-byte row alignment (f32 rows of 100 elements
  // pad to 112): the padding must not leak into the products, and results
  // must not depend on the thread count.
  std::mt19937 rng(11);
  const Matrix w = random_matrix(WeightType::kF32, 37, 100, rng);
  std::vector<float> x(5 * 100);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x) v = normal(rng);
  std::vector<float> y1(5 * 37, std::numeric_limits<float>::quiet_NaN()), y2 = y1;
  colibri::LinearOptions o;
  o.threads = 1;
  colibri::Linear a(WeightType::kF32, 37, 100, w.stored.data(), w.stored.size(), nullptr, o, "a", nullptr);
  o.threads = 2;
  colibri::Linear b(WeightType::kF32, 37, 100, w.stored.data(), w.stored.size(), nullptr, o, "b", nullptr);
  a.forward(5, x.data(), 100, y1.data(), 37);
  b.forward(5, x.data(), 100, y2.data(), 37);
  EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)));
  for (int32_t i = 0; i < 5; ++i) {
    for (int32_t r = 0; r < 37; ++r) {
      double acc = 0.0;
      for (int32_t k = 0; k < 100; ++k) acc += static_cast<double>(x[i * 100 + k]) * w.values[r * 100 + k];
      EXPECT_NEAR(y1[i * 37 + r], acc, 1e-4 * (1.0 + std::fabs(acc)));
    }
  }
}

// Kernels chosen by measurement (kernel_choice.h): where more than one
// level computes a block format, create times each level's tables on the
// layer's own rows and keeps the fastest, remembered in the cache file under
// a "linear" key; whatever it picks matches float64, and a remembered choice
// of either level is taken as written and computes right too.
class LinearChoice : public ::testing::Test {
 protected:
  void SetUp() override {
    env_ = std::make_unique<colibri_test::KernelChoiceEnv>(cache_.path());
    file_ = cache_.path() + "/kernels.tsv";
    std::mt19937 rng(21);
    w_ = random_matrix(WeightType::kQ8_0, kOut, kIn, rng);
    if (std::getenv("COLIBRI_ISA") != nullptr) {
      EXPECT_EQ(create(true).find("measure"), std::string::npos);
      EXPECT_FALSE(std::filesystem::exists(file_));
      GTEST_SKIP() << "COLIBRI_ISA forces a level";
    }
    const std::string isa = colibri_cpu_isa();
    if (isa != "avx512" && isa != "amx") GTEST_SKIP() << "one instruction-set level (" << isa << "): no choice";
  }
  void TearDown() override { env_.reset(); }
  // Creates the layer through the C ABI, checks it against float64 at 1, 3,
  // 17 and 130 tokens, and returns colibri_linear_kernels.
  std::string create(bool fixed = false) {
    colibri_linear_desc_t d;
    colibri_linear_desc_default(&d);
    d.dtype = COLIBRI_DTYPE_Q8_0;
    d.out_features = kOut;
    d.in_features = kIn;
    d.weight = w_.stored.data();
    d.weight_size = w_.stored.size();
    d.n_threads = 2;
    d.fixed_kernels = fixed ? 1 : 0;
    colibri_linear_t* lin = nullptr;
    EXPECT_EQ(COLIBRI_OK, colibri_linear_create(&d, &lin)) << colibri_last_error();
    if (lin == nullptr) return "";
    const std::string k = colibri_linear_kernels(lin);
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int32_t T : {1, 3, 17, 130}) {
      std::vector<float> x(static_cast<size_t>(T) * kIn);
      for (float& v : x) v = normal(rng);
      std::vector<double> ref(static_cast<size_t>(T) * kOut);
      for (int32_t i = 0; i < T; ++i) {
        for (int32_t o = 0; o < kOut; ++o) {
          double acc = 0.0;
          for (int32_t c = 0; c < kIn; ++c) {
            acc += static_cast<double>(x[static_cast<size_t>(i) * kIn + c]) *
                   w_.values[static_cast<size_t>(o) * kIn + c];
          }
          ref[static_cast<size_t>(i) * kOut + o] = acc;
        }
      }
      std::vector<float> y(ref.size(), std::numeric_limits<float>::quiet_NaN());
      EXPECT_EQ(COLIBRI_OK, colibri_linear_forward(lin, T, x.data(), y.data()));
      EXPECT_LE(relative_l2(y, ref), tolerance(WeightType::kQ8_0, false)) << "T=" << T << " " << k;
    }
    colibri_linear_free(lin);
    return k;
  }

  static constexpr int32_t kOut = 200, kIn = 512;
  colibri_test::TempDir cache_{"colibri_linear_choice"};
  std::string file_;
  Matrix w_;
  std::unique_ptr<colibri_test::KernelChoiceEnv> env_;
};

TEST_F(LinearChoice, MeasuredOnceRememberedAndEitherLevelComputesRight) {
  const std::string first = create();
  EXPECT_NE(first.find("(chosen by measurement: measured now, 1 token int8-"), std::string::npos) << first;
  EXPECT_NE(first.find("16 tokens"), std::string::npos) << first;
  const std::string text = colibri_test::file_bytes(file_);
  ASSERT_EQ(text.rfind("# colibri kernel choices v1\n", 0), 0u) << text;
  EXPECT_NE(text.find("q8_0/q8_0 200x512|linear|tables"), std::string::npos) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;
  const std::string second = create();
  EXPECT_NE(second.find("measured earlier (" + file_ + ")"), std::string::npos) << second;
  EXPECT_EQ(colibri_test::file_bytes(file_), text);
  // fixed_kernels: the registry's tables, nothing timed or remembered.
  EXPECT_EQ(create(true).find("measure"), std::string::npos);
  // A remembered line is taken as written: each level's decode tables, the
  // other's for many tokens.
  const size_t key_end = text.find('\t', text.find("|linear|"));
  ASSERT_NE(key_end, std::string::npos) << text;
  const size_t timings = text.find('\t', text.find('\t', key_end + 1) + 1);
  for (const char* decode : {"avx2", "avx512"}) {
    const std::string many = std::string(decode) == "avx2" ? "avx512" : "avx2";
    const std::string edited = text.substr(0, key_end) + "\t" + decode + "\t" + many + text.substr(timings);
    std::FILE* f = std::fopen(file_.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(edited.data(), 1, edited.size(), f);
    std::fclose(f);
    const std::string k = create();
    EXPECT_EQ(k.rfind(std::string("decode int8-") + decode, 0), 0u) << k;
    EXPECT_NE(k.find("prefill int8-" + many), std::string::npos) << k;
    EXPECT_NE(k.find("measured earlier"), std::string::npos) << k;
  }
}

TEST(LinearAbi, CreateForwardAndErrors) {
  std::mt19937 rng(3);
  const Matrix w = random_matrix(WeightType::kQ8_0, 64, 256, rng);
  colibri_linear_desc_t d;
  colibri_linear_desc_default(&d);
  d.dtype = COLIBRI_DTYPE_Q8_0;
  d.out_features = 64;
  d.in_features = 256;
  d.weight = w.stored.data();
  d.weight_size = w.stored.size();
  d.name = "blk.0.attn_q.weight";
  colibri_linear_t* lin = nullptr;
  ASSERT_EQ(COLIBRI_OK, colibri_linear_create(&d, &lin)) << colibri_last_error();
  EXPECT_NE(std::string(colibri_linear_kernels(lin)).find("decode int8"), std::string::npos);
  EXPECT_GE(colibri_linear_bytes(lin), w.stored.size());
  std::vector<float> x(2 * 256, 0.5f), y(2 * 64, std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(COLIBRI_OK, colibri_linear_forward(lin, 2, x.data(), y.data()));
  for (float v : y) EXPECT_TRUE(std::isfinite(v));
  // y over x is refused, and so is a NULL pointer or negative count.
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_linear_forward(lin, 1, x.data(), x.data() + 8));
  EXPECT_NE(std::string(colibri_last_error()).find("overlaps"), std::string::npos);
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_linear_forward(lin, 1, nullptr, y.data()));
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_linear_forward(lin, -1, x.data(), y.data()));
  EXPECT_EQ(COLIBRI_OK, colibri_linear_forward(lin, 0, nullptr, nullptr));
  colibri_linear_free(lin);

  // A size that does not match the shape names the tensor and both sizes.
  d.weight_size -= 1;
  lin = reinterpret_cast<colibri_linear_t*>(&d);
  EXPECT_EQ(COLIBRI_ERR_FORMAT, colibri_linear_create(&d, &lin));
  EXPECT_EQ(lin, nullptr);
  EXPECT_NE(std::string(colibri_last_error()).find("blk.0.attn_q.weight"), std::string::npos) << colibri_last_error();
  d.weight_size += 1;
  // Columns off the block, an unknown dtype, a zero shape.
  d.in_features = 250;
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_linear_create(&d, &lin));
  EXPECT_NE(std::string(colibri_last_error()).find("multiple"), std::string::npos) << colibri_last_error();
  d.in_features = 256;
  d.dtype = static_cast<colibri_dtype_t>(99);
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_linear_create(&d, &lin));
  d.dtype = COLIBRI_DTYPE_Q8_0;
  d.out_features = 0;
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_linear_create(&d, &lin));
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_linear_create(nullptr, &lin));
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_linear_create(&d, nullptr));
  colibri_linear_free(nullptr);
  EXPECT_STREQ("", colibri_linear_kernels(nullptr));
}

}  // namespace

namespace {

TEST(RmsNormAbi, MatchesFloat64InPlaceAndRefusesBadArguments) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int32_t dim : {1, 7, 128, 2048}) {
    const int32_t rows = 3;
    std::vector<float> x(static_cast<size_t>(rows) * dim), w(static_cast<size_t>(dim));
    for (float& v : x) v = normal(rng);
    for (float& v : w) v = 1.0f + 0.1f * normal(rng);
    std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_EQ(COLIBRI_OK, colibri_rms_norm(x.data(), w.data(), rows, dim, 1e-6f, y.data())) << colibri_last_error();
    for (int32_t r = 0; r < rows; ++r) {
      double ss = 0.0;
      for (int32_t i = 0; i < dim; ++i) ss += static_cast<double>(x[r * dim + i]) * x[r * dim + i];
      const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
      for (int32_t i = 0; i < dim; ++i) {
        const double want = w[i] * x[r * dim + i] * inv;
        EXPECT_NEAR(y[r * dim + i], want, 1e-6 * (1.0 + std::fabs(want))) << dim;
      }
    }
    std::vector<float> z = x;  // in place gives the same bits
    ASSERT_EQ(COLIBRI_OK, colibri_rms_norm(z.data(), w.data(), rows, dim, 1e-6f, z.data()));
    EXPECT_EQ(0, std::memcmp(z.data(), y.data(), y.size() * sizeof(float)));
  }
  std::vector<float> x(64, 1.0f), w(32, 1.0f);
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_rms_norm(x.data(), w.data(), 1, 32, 1e-6f, x.data() + 8));
  EXPECT_NE(std::string(colibri_last_error()).find("overlaps"), std::string::npos);
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_rms_norm(x.data(), nullptr, 1, 32, 1e-6f, x.data()));
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_rms_norm(x.data(), w.data(), 1, 0, 1e-6f, x.data()));
  EXPECT_EQ(COLIBRI_ERR_INVALID_ARGUMENT, colibri_rms_norm(x.data(), w.data(), 1, 32, -1.0f, x.data()));
  EXPECT_EQ(COLIBRI_OK, colibri_rms_norm(nullptr, nullptr, 0, 32, 1e-6f, nullptr));
}

}  // namespace
