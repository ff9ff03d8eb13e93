// Hot expert swap: inference on several threads while another thread swaps
// one expert back and forth; every output must be the layer with the old
// expert or with the new one, never a mix. Also run under ThreadSanitizer
// (scripts/test.sh) and LeakSanitizer (the ASan build).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "colibri.h"
#include "io/checksum.h"
#include "io/manifest.h"
#include "io/mapped_file.h"
#include "lib/model_writer.h"
#include "reference.h"
#include "test_util.h"

namespace {

using colibri_test::relative_l2;

std::string read_bytes(const std::string& path) { return colibri::read_small_file(path, size_t{1} << 30); }

class SwapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_.n_layers = 2;
    spec_.n_experts = 8;
    spec_.d_model = 64;
    spec_.d_ff = 96;
    spec_.dtype = colibri::WeightType::kF32;
    colibri::write_random_model(dir_a_.path(), spec_, 1);
    // Version B of expert 3 of layer 1: another seed's weights.
    colibri::write_random_model(dir_b_.path(), spec_, 2);
    const colibri::Manifest m = colibri::load_manifest(dir_a_.path());
    old_bytes_ = read_bytes(dir_a_.path() + "/" + m.expert_file(1, 3));
    new_file_ = dir_b_.path() + "/" + m.expert_file(1, 3);
    new_bytes_ = read_bytes(new_file_);
    // A model directory that is A with expert 3 of layer 1 from B: the
    // reference for "new".
    std::filesystem::copy(dir_a_.path(), dir_ab_.path(), std::filesystem::copy_options::recursive |
                                                           std::filesystem::copy_options::overwrite_existing);
    std::filesystem::copy_file(new_file_, dir_ab_.path() + "/" + m.expert_file(1, 3),
                               std::filesystem::copy_options::overwrite_existing);

    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    x_.resize(static_cast<size_t>(kTokens) * 64);
    for (float& v : x_) v = nd(rng);
    // Every token uses expert 3 and one other.
    for (int t = 0; t < kTokens; ++t) {
      ids_.push_back(3);
      ids_.push_back((t + 4) % 8);
      w_.push_back(0.6f);
      w_.push_back(0.4f);
    }
    ref_old_ = colibri_test::reference_layer(dir_a_.path(), 1, kTokens, x_.data(), 2, ids_.data(), w_.data());
    ref_new_ = colibri_test::reference_layer(dir_ab_.path(), 1, kTokens, x_.data(), 2, ids_.data(), w_.data());
    ASSERT_GT(relative_l2_d(ref_old_, ref_new_), 0.1) << "the two versions must be told apart";
    ASSERT_EQ(colibri_open(dir_a_.path().c_str(), nullptr, &model_), COLIBRI_OK) << colibri_last_error();
  }
  void TearDown() override { colibri_free(model_); }

  static double relative_l2_d(const std::vector<double>& a, const std::vector<double>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (a[i] - b[i]) * (a[i] - b[i]);
      den += b[i] * b[i];
    }
    return std::sqrt(num / den);
  }

  // 0 = old, 1 = new, -1 = neither.
  int classify(const std::vector<float>& y) const {
    if (relative_l2(y.data(), ref_old_) <= 1e-5) return 0;
    if (relative_l2(y.data(), ref_new_) <= 1e-5) return 1;
    return -1;
  }

  colibri_status_t infer(std::vector<float>& y) {
    colibri_infer_t in;
    colibri_infer_default(&in);
    in.layer = 1;
    in.n_tokens = kTokens;
    in.input = x_.data();
    in.output = y.data();
    in.top_k = 2;
    in.expert_ids = ids_.data();
    in.expert_weights = w_.data();
    return colibri_infer(model_, &in);
  }

  colibri_swap_source_t memory_source(const std::string& bytes) const {
    colibri_swap_source_t s;
    colibri_swap_source_default(&s);
    s.data = bytes.data();
    s.size = bytes.size();
    s.dtype = COLIBRI_DTYPE_F32;
    s.has_checksum = 1;
    s.checksum = colibri::xxh64(bytes.data(), bytes.size());
    return s;
  }

  static constexpr int kTokens = 5;
  colibri::ModelWriteSpec spec_;
  colibri_test::TempDir dir_a_, dir_b_, dir_ab_;
  std::string old_bytes_, new_bytes_, new_file_;
  std::vector<float> x_, w_;
  std::vector<int32_t> ids_;
  std::vector<double> ref_old_, ref_new_;
  colibri_model_t* model_ = nullptr;
};

TEST_F(SwapTest, EveryCallSeesTheWholeOldOrTheWholeNewExpert) {
  constexpr int kCallers = 3;
  constexpr int kSwaps = 2000;
  std::atomic<bool> stop{false};
  std::atomic<int> wrong{0}, failed{0};
  std::atomic<long> seen[2] = {0, 0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&] {
      std::vector<float> y(x_.size());
      while (!stop.load()) {
        std::fill(y.begin(), y.end(), std::nanf(""));
        if (infer(y) != COLIBRI_OK) {
          failed.fetch_add(1);
          continue;
        }
        const int v = classify(y);
        if (v < 0) {
          wrong.fetch_add(1);
        } else {
          seen[v].fetch_add(1);
        }
      }
    });
  }
  const colibri_swap_source_t to_new = memory_source(new_bytes_), to_old = memory_source(old_bytes_);
  int swap_errors = 0;
  for (int i = 0; i < kSwaps; ++i) {
    colibri_swap_source_t s = i % 2 == 0 ? to_new : to_old;
    if (i % 10 == 4) {  // now and then from the file, without a checksum
      colibri_swap_source_default(&s);
      s.path = new_file_.c_str();
    }
    if (colibri_swap_expert(model_, 1, 3, &s) != COLIBRI_OK) ++swap_errors;
    if (i % 64 == 0) std::this_thread::yield();
  }
  stop.store(true);
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(swap_errors, 0) << colibri_last_error();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0) << "an output matched neither version";
  EXPECT_GT(seen[0].load() + seen[1].load(), 0);
  colibri_stats_t st;
  ASSERT_EQ(colibri_stats(model_, &st), COLIBRI_OK);
  EXPECT_EQ(st.expert_swaps, static_cast<uint64_t>(kSwaps));
  // The last swap (i = kSwaps-1, odd) restored the old expert.
  std::vector<float> y(x_.size());
  ASSERT_EQ(infer(y), COLIBRI_OK);
  EXPECT_EQ(classify(y), 0);
}

TEST_F(SwapTest, FailedSwapsLeaveTheOldExpertServing) {
  std::vector<float> y(x_.size());
  auto expect_refused = [&](colibri_swap_source_t s, int32_t layer, int32_t expert, colibri_status_t status,
                            const char* needle) {
    EXPECT_EQ(colibri_swap_expert(model_, layer, expert, &s), status) << needle;
    EXPECT_NE(std::string(colibri_last_error()).find(needle), std::string::npos)
        << "want '" << needle << "' in: " << colibri_last_error();
    std::fill(y.begin(), y.end(), std::nanf(""));
    ASSERT_EQ(infer(y), COLIBRI_OK);
    EXPECT_EQ(classify(y), 0) << needle;
  };
  colibri_swap_source_t s = memory_source(new_bytes_);
  s.checksum ^= 1;
  expect_refused(s, 1, 3, COLIBRI_ERR_CHECKSUM, "checksum");
  s = memory_source(new_bytes_);
  s.size -= 4;
  s.has_checksum = 0;
  expect_refused(s, 1, 3, COLIBRI_ERR_FORMAT, "bytes, expected");
  s = memory_source(new_bytes_);
  s.dtype = COLIBRI_DTYPE_F16;
  expect_refused(s, 1, 3, COLIBRI_ERR_INVALID_ARGUMENT, "dtype");
  s = memory_source(new_bytes_);
  expect_refused(s, 2, 3, COLIBRI_ERR_INVALID_ARGUMENT, "layer 2");
  expect_refused(s, 1, 8, COLIBRI_ERR_INVALID_ARGUMENT, "expert 8");
  colibri_swap_source_default(&s);
  expect_refused(s, 1, 3, COLIBRI_ERR_INVALID_ARGUMENT, "neither path nor data");
  s.path = "/nonexistent/expert.bin";
  expect_refused(s, 1, 3, COLIBRI_ERR_IO, "/nonexistent/expert.bin");
  // A truncated file, and one too long, are named.
  colibri_test::TempDir tmp;
  const std::string short_file = tmp.path() + "/short.bin";
  colibri::write_file_atomic(short_file, new_bytes_.data(), new_bytes_.size() - 1);
  s.path = short_file.c_str();
  expect_refused(s, 1, 3, COLIBRI_ERR_FORMAT, "short.bin");
  const std::string long_file = tmp.path() + "/long.bin";
  const std::string longer = new_bytes_ + "x";
  colibri::write_file_atomic(long_file, longer.data(), longer.size());
  s.path = long_file.c_str();
  expect_refused(s, 1, 3, COLIBRI_ERR_FORMAT, "long.bin");
  EXPECT_EQ(colibri_swap_expert(nullptr, 1, 3, &s), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(colibri_swap_expert(model_, 1, 3, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);

  // And a good swap after all that takes effect.
  s = memory_source(new_bytes_);
  ASSERT_EQ(colibri_swap_expert(model_, 1, 3, &s), COLIBRI_OK) << colibri_last_error();
  ASSERT_EQ(infer(y), COLIBRI_OK);
  EXPECT_EQ(classify(y), 1);
}

}  // namespace
