// Models opened under a memory budget (max_resident): experts read on
// demand into a pool of slots. Every output must be bit-identical to the
// fully resident model's, for every budget from one expert up, with caller
// routing and the built-in router, skewed routing, calls needing more
// experts than the pool (streamed through it), several caller threads and hot swaps;
// files shortened or replaced under a running model give errors, never
// wrong weights. Each with both read engines (pread and io_uring). Also run
// under ThreadSanitizer (scripts/test.sh).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "colibri.h"
#include "io/expert_reader.h"
#include "io/manifest.h"
#include "io/mapped_file.h"
#include "lib/model_writer.h"
#include "moe/cache_policy.h"
#include "test_util.h"

namespace {

using colibri_test::TempDir;

constexpr int32_t kLayers = 3, kExperts = 12, kD = 64, kF = 96;

struct Routing {
  int32_t k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Distinct experts per token; skewed: most tokens draw from the first few.
Routing make_routing(int32_t T, int32_t k, bool skewed, std::mt19937& rng) {
  Routing r;
  r.k = k;
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  std::geometric_distribution<int32_t> hot(0.45);
  std::uniform_int_distribution<int32_t> any(0, kExperts - 1);
  for (int32_t t = 0; t < T; ++t) {
    std::vector<int32_t> chosen;
    while (static_cast<int32_t>(chosen.size()) < k) {
      const int32_t e = skewed ? std::min(hot(rng), kExperts - 1) : any(rng);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (const int32_t e : chosen) {
      r.ids.push_back(e);
      r.weights.push_back(u(rng));
    }
  }
  return r;
}

// The read engine of the running test (set by each fixture's SetUp).
int32_t g_io_engine = COLIBRI_IO_PREAD;

const char* engine_name(int32_t engine) { return engine == COLIBRI_IO_URING ? "io_uring" : "pread"; }

// Sets the engine of a test; false (the caller skips) where io_uring
// cannot run: no liburing in the build, or a kernel or sandbox that
// refuses it. The pread instance runs everywhere.
bool use_engine(int32_t engine, std::string* why) {
  g_io_engine = engine;
  return engine != COLIBRI_IO_URING || colibri::io_uring_usable(why);
}

colibri_open_options_t options(uint64_t budget_bytes = 0, float percent = 0.0f) {
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.io_engine = g_io_engine;
  o.lock_memory = 0;
  o.huge_pages = 0;
  o.max_resident_bytes = budget_bytes;
  o.max_resident_percent = percent;
  return o;
}

colibri_model_t* open_with(const std::string& dir, const colibri_open_options_t& o) {
  colibri_model_t* m = nullptr;
  EXPECT_EQ(colibri_open(dir.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  return m;
}

colibri_stats_t stats_of(colibri_model_t* m) {
  colibri_stats_t s;
  EXPECT_EQ(colibri_stats(m, &s), COLIBRI_OK);
  return s;
}

// One call; returns the status; output poisoned first.
colibri_status_t run(colibri_model_t* m, int32_t layer, const std::vector<float>& x, const Routing* r,
                     std::vector<float>* y) {
  const int32_t T = static_cast<int32_t>(x.size() / kD);
  y->assign(x.size(), std::numeric_limits<float>::quiet_NaN());
  colibri_infer_t a;
  colibri_infer_default(&a);
  a.layer = layer;
  a.n_tokens = T;
  a.input = x.data();
  a.output = y->data();
  if (r != nullptr) {
    a.top_k = r->k;
    a.expert_ids = r->ids.data();
    a.expert_weights = r->weights.data();
  }
  return colibri_infer(m, &a);
}

std::vector<float> random_input(int32_t T, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(T) * kD);
  for (float& v : x) v = nd(rng);
  return x;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class CacheModel : public ::testing::TestWithParam<std::tuple<colibri::WeightType, int32_t>> {
 protected:
  void SetUp() override {
    std::string why;
    if (!use_engine(std::get<1>(GetParam()), &why)) GTEST_SKIP() << "io_uring not usable here: " << why;
  }
  static colibri::WeightType dtype() { return std::get<0>(GetParam()); }
  void write(bool router, int32_t shared_d_ff = 0) {
    colibri::ModelWriteSpec spec;
    spec.n_layers = kLayers;
    spec.n_experts = kExperts;
    spec.d_model = kD;
    spec.d_ff = kF;
    spec.dtype = dtype();
    if (colibri::weight_format(spec.dtype).quantized) spec.down_dtype = spec.dtype;
    if (router) {
      spec.router.family = colibri::RouterFamily::kQwen3Moe;
      spec.router.top_k = 4;
      spec.router.norm_topk_prob = 1;
    }
    spec.shared_d_ff = shared_d_ff;
    colibri::write_random_model(dir_.path(), spec, 11);
    resident_ = open_with(dir_.path(), options());
    ASSERT_NE(resident_, nullptr);
    const colibri_stats_t s = stats_of(resident_);
    ASSERT_EQ(s.cache_slots, 0);
    // The bytes of one packed expert: a budget of 1 expert's bytes must
    // give one slot. Found from a 50% budget's pool.
    colibri_model_t* half = open_with(dir_.path(), options(0, 50.0f));
    ASSERT_NE(half, nullptr);
    const colibri_stats_t hs = stats_of(half);
    ASSERT_GT(hs.cache_slots, 0);
    slot_bytes_ = hs.resident_bytes / static_cast<uint64_t>(hs.cache_slots);
    experts_bytes_ = hs.experts_bytes;
    EXPECT_EQ(experts_bytes_, slot_bytes_ * kLayers * kExperts);
    colibri_free(half);
  }
  void TearDown() override { colibri_free(resident_); }

  TempDir dir_{"colibri_cache"};
  colibri_model_t* resident_ = nullptr;
  uint64_t slot_bytes_ = 0;
  uint64_t experts_bytes_ = 0;
};

// Every budget from one expert to all but one, caller routing: uniform and
// skewed, decode and calls touching every expert (waves when the pool is
// smaller), the same output bits as the resident model.
TEST_P(CacheModel, BitIdenticalForEveryBudget) {
  write(false, dtype() == colibri::WeightType::kF32 ? 48 : 0);
  std::mt19937 rng(3);
  struct Call {
    int32_t layer;
    std::vector<float> x;
    Routing r;
  };
  std::vector<Call> calls;
  for (int i = 0; i < 40; ++i) {
    const int32_t T = i % 10 == 9 ? 24 : (i % 3 == 0 ? 3 : 1);
    const int32_t k = i % 2 == 0 ? 2 : 4;
    calls.push_back({i % kLayers, random_input(T, rng), make_routing(T, k, i % 4 < 2, rng)});
  }
  std::vector<std::vector<float>> want(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    ASSERT_EQ(run(resident_, calls[i].layer, calls[i].x, &calls[i].r, &want[i]), COLIBRI_OK) << colibri_last_error();
  }
  for (const int32_t slots : {1, 2, 3, 4, 7, 12, 20, kLayers * kExperts - 1}) {
    SCOPED_TRACE("slots " + std::to_string(slots));
    colibri_model_t* m = open_with(dir_.path(), options(slot_bytes_ * static_cast<uint64_t>(slots) + 17));
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(stats_of(m).cache_slots, slots);
    uint64_t lookups = 0;
    for (size_t i = 0; i < calls.size(); ++i) {
      std::vector<float> y;
      ASSERT_EQ(run(m, calls[i].layer, calls[i].x, &calls[i].r, &y), COLIBRI_OK) << colibri_last_error();
      ASSERT_TRUE(bit_equal(y, want[i])) << "call " << i;
      std::vector<int32_t> distinct(calls[i].r.ids);
      std::sort(distinct.begin(), distinct.end());
      lookups += static_cast<uint64_t>(std::unique(distinct.begin(), distinct.end()) - distinct.begin());
    }
    const colibri_stats_t s = stats_of(m);
    EXPECT_EQ(s.cache_hits + s.cache_misses, lookups);
    EXPECT_GE(s.expert_reads, s.cache_misses);
    EXPECT_LE(s.resident_experts, static_cast<uint64_t>(slots));
    EXPECT_EQ(s.resident_bytes, slot_bytes_ * static_cast<uint64_t>(slots));
    const colibri::Manifest man = colibri::load_manifest(dir_.path());
    EXPECT_EQ(s.bytes_read, s.expert_reads * man.expert_file_bytes(0));
    EXPECT_EQ(s.expert_read_failures, 0u);
    EXPECT_EQ(s.uring_reads, g_io_engine == COLIBRI_IO_URING ? s.expert_reads : 0u);
    if (slots < kLayers * kExperts / 2) {
      EXPECT_GT(s.cache_evictions, 0u);
    }
    colibri_free(m);
  }
  // A budget the model fits in, in bytes or as 100%: no cache at all.
  for (const colibri_open_options_t& o : {options(experts_bytes_), options(0, 100.0f)}) {
    colibri_model_t* m = open_with(dir_.path(), o);
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(stats_of(m).cache_slots, 0);
    colibri_free(m);
  }
}

// The built-in router chooses (and speculates on the next layer), under
// budgets from one expert up; layers in order, as a decoder calls them.
TEST_P(CacheModel, BuiltInRouterAndSpeculation) {
  write(true);
  std::mt19937 rng(8);
  std::vector<std::vector<float>> xs;
  for (int i = 0; i < 8; ++i) xs.push_back(random_input(i == 5 ? 16 : 1, rng));
  std::vector<std::vector<float>> want;
  for (const auto& x : xs) {
    for (int32_t l = 0; l < kLayers; ++l) {
      want.emplace_back();
      ASSERT_EQ(run(resident_, l, x, nullptr, &want.back()), COLIBRI_OK) << colibri_last_error();
    }
  }
  for (const int32_t slots : {1, 4, 9, 30}) {
    for (const int speculate : {0, 1}) {
      SCOPED_TRACE("slots " + std::to_string(slots) + " speculate " + std::to_string(speculate));
      colibri_open_options_t o = options(slot_bytes_ * static_cast<uint64_t>(slots));
      o.speculate = speculate;
      colibri_model_t* m = open_with(dir_.path(), o);
      ASSERT_NE(m, nullptr);
      size_t i = 0;
      for (const auto& x : xs) {
        for (int32_t l = 0; l < kLayers; ++l) {
          std::vector<float> y;
          ASSERT_EQ(run(m, l, x, nullptr, &y), COLIBRI_OK) << colibri_last_error();
          ASSERT_TRUE(bit_equal(y, want[i++]));
        }
      }
      const colibri_stats_t s = stats_of(m);
      if (speculate == 0 || slots < 8) {
        // Off, or a guess (4 experts) larger than half the pool: none made.
        EXPECT_EQ(s.predicted, 0u);
      } else {
        // The next layer's router on the same input is exactly what that
        // layer's call computes: every prediction is right here.
        EXPECT_GT(s.predicted, 0u);
        EXPECT_EQ(s.predicted_used, s.predicted);
        EXPECT_GT(s.prefetch_reads, 0u);
      }
      colibri_free(m);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, CacheModel,
                         ::testing::Combine(::testing::Values(colibri::WeightType::kF32, colibri::WeightType::kBF16,
                                                              colibri::WeightType::kQ4_0, colibri::WeightType::kQ4_K,
                                                              colibri::WeightType::kMXFP4),
                                            ::testing::Values(COLIBRI_IO_PREAD, COLIBRI_IO_URING)),
                         [](const auto& p) {
                           return std::string(colibri::weight_format(std::get<0>(p.param)).name) + "_" +
                                  engine_name(std::get<1>(p.param));
                         });

class CacheF32 : public ::testing::TestWithParam<int32_t> {
 protected:
  void SetUp() override {
    std::string why;
    if (!use_engine(GetParam(), &why)) GTEST_SKIP() << "io_uring not usable here: " << why;
    spec_.n_layers = kLayers;
    spec_.n_experts = kExperts;
    spec_.d_model = kD;
    spec_.d_ff = kF;
    spec_.dtype = colibri::WeightType::kF32;
    colibri::write_random_model(dir_.path(), spec_, 21);
    const colibri::Manifest m = colibri::load_manifest(dir_.path());
    expert_bytes_ = m.expert_file_bytes(0);
    // Slot bytes: f32 rows of 64 and 96 floats are whole cache lines.
    slot_bytes_ = expert_bytes_;
  }
  std::string expert_path(int32_t layer, int32_t expert) const {
    return dir_.path() + "/" + colibri::load_manifest(dir_.path()).expert_file(layer, expert);
  }
  colibri::ModelWriteSpec spec_;
  TempDir dir_{"colibri_cache_f32"};
  uint64_t expert_bytes_ = 0;
  uint64_t slot_bytes_ = 0;
};

TEST_P(CacheF32, BadBudgetsAreRefused) {
  colibri_model_t* m = nullptr;
  colibri_open_options_t o = options(slot_bytes_ - 1);
  EXPECT_EQ(colibri_open(dir_.path().c_str(), &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(std::string(colibri_last_error()).find("holds no expert"), std::string::npos) << colibri_last_error();
  EXPECT_NE(std::string(colibri_last_error()).find(dir_.path()), std::string::npos) << colibri_last_error();
  o = options(0, 101.0f);
  EXPECT_EQ(colibri_open(dir_.path().c_str(), &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("max_resident_percent"), std::string::npos);
  o = options(slot_bytes_ * 4);
  o.eviction_policy = 7;
  EXPECT_EQ(colibri_open(dir_.path().c_str(), &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("eviction_policy"), std::string::npos);
  o = options(slot_bytes_ * 4);
  o.io_threads = -1;
  EXPECT_EQ(colibri_open(dir_.path().c_str(), &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
  o = options(slot_bytes_ * 4);
  o.io_engine = 2;
  EXPECT_EQ(colibri_open(dir_.path().c_str(), &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("io_engine"), std::string::npos) << colibri_last_error();
  EXPECT_EQ(m, nullptr);
}

TEST_P(CacheF32, PrefetchIsUsedAndChecked) {
  colibri_model_t* m = open_with(dir_.path(), options(slot_bytes_ * 6));
  ASSERT_NE(m, nullptr);
  const int32_t ids[] = {1, 5, -1, 7};
  int32_t started = -1;
  ASSERT_EQ(colibri_prefetch(m, 2, ids, 4, &started), COLIBRI_OK) << colibri_last_error();
  EXPECT_EQ(started, 3);
  // Asked again while resident or on their way: nothing new.
  ASSERT_EQ(colibri_prefetch(m, 2, ids, 4, &started), COLIBRI_OK);
  EXPECT_EQ(started, 0);
  std::mt19937 rng(1);
  const std::vector<float> x = random_input(1, rng);
  Routing r{3, {1, 5, 7}, {0.5f, 0.3f, 0.2f}};
  std::vector<float> y;
  ASSERT_EQ(run(m, 2, x, &r, &y), COLIBRI_OK) << colibri_last_error();
  colibri_stats_t s = stats_of(m);
  EXPECT_EQ(s.prefetch_reads, 3u);
  EXPECT_EQ(s.prefetch_used, 3u);
  EXPECT_EQ(s.cache_hits, 3u);
  EXPECT_EQ(s.cache_misses, 0u);
  // Bad arguments name what is wrong; nothing starts.
  const int32_t bad[] = {3, kExperts};
  EXPECT_EQ(colibri_prefetch(m, 0, bad, 2, &started), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("experts[1]"), std::string::npos) << colibri_last_error();
  EXPECT_EQ(started, 0);
  EXPECT_EQ(colibri_prefetch(m, kLayers, ids, 1, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(colibri_prefetch(m, 0, nullptr, 1, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(colibri_prefetch(nullptr, 0, ids, 1, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  colibri_free(m);
  // Without a budget it does nothing and succeeds.
  m = open_with(dir_.path(), options());
  ASSERT_EQ(colibri_prefetch(m, 0, ids, 2, &started), COLIBRI_OK);
  EXPECT_EQ(started, 0);
  colibri_free(m);
}

// A file shortened, then replaced by other bytes, under a running model:
// the call that needs it fails naming the file, others go on; once the
// file is back the same expert serves again, with the right bits.
TEST_P(CacheF32, FilesChangedUnderARunningModel) {
  for (const int verify : {1, 0}) {
    SCOPED_TRACE("verify_checksums " + std::to_string(verify));
    TempDir copy("colibri_cache_fault");
    std::filesystem::copy(dir_.path(), copy.path(), std::filesystem::copy_options::recursive |
                                                        std::filesystem::copy_options::overwrite_existing);
    colibri_model_t* resident = open_with(copy.path(), options());
    colibri_open_options_t o = options(slot_bytes_ * 2);
    o.verify_checksums = verify;
    colibri_model_t* m = open_with(copy.path(), o);
    ASSERT_NE(m, nullptr);
    std::mt19937 rng(4);
    const std::vector<float> x = random_input(2, rng);
    Routing uses3{1, {3, 3}, {1.0f, 0.5f}};
    Routing uses4{1, {4, 4}, {1.0f, 0.5f}};
    std::vector<float> want3, want4, y;
    ASSERT_EQ(run(resident, 1, x, &uses3, &want3), COLIBRI_OK);
    ASSERT_EQ(run(resident, 1, x, &uses4, &want4), COLIBRI_OK);
    const std::string path = copy.path() + "/" + colibri::load_manifest(copy.path()).expert_file(1, 3);
    const std::string original = colibri::read_small_file(path, size_t{1} << 30);
    ASSERT_EQ(run(m, 1, x, &uses3, &y), COLIBRI_OK);  // read once, resident
    ASSERT_TRUE(bit_equal(y, want3));
    // Evict it: two other experts fill the two slots.
    Routing others{2, {5, 6, 5, 6}, {0.5f, 0.5f, 0.5f, 0.5f}};
    ASSERT_EQ(run(m, 1, x, &others, &y), COLIBRI_OK);

    std::filesystem::resize_file(path, original.size() / 2);
    EXPECT_EQ(run(m, 1, x, &uses3, &y), COLIBRI_ERR_FORMAT);
    EXPECT_NE(std::string(colibri_last_error()).find(path), std::string::npos) << colibri_last_error();
    EXPECT_NE(std::string(colibri_last_error()).find("changed while the model is open"), std::string::npos)
        << colibri_last_error();
    ASSERT_EQ(run(m, 1, x, &uses4, &y), COLIBRI_OK) << "other experts keep serving";
    EXPECT_TRUE(bit_equal(y, want4));

    // Same size, other bytes, put in place by rename as a writer would.
    std::string changed = original;
    for (size_t i = 0; i < changed.size(); i += 64) changed[i] = static_cast<char>(changed[i] ^ 0x40);
    colibri::write_file_atomic(path, changed.data(), changed.size());
    ASSERT_EQ(run(m, 1, x, &uses4, &y), COLIBRI_OK);
    ASSERT_EQ(run(m, 1, x, &others, &y), COLIBRI_OK);  // 4 may be resident; make room
    const colibri_status_t st = run(m, 1, x, &uses3, &y);
    if (verify == 1) {
      EXPECT_EQ(st, COLIBRI_ERR_CHECKSUM);
      EXPECT_NE(std::string(colibri_last_error()).find(path), std::string::npos) << colibri_last_error();
    } else {
      // Without checksums the new bytes are what the file now says: the
      // price of turning verification off, stated in docs/CACHE.md.
      EXPECT_EQ(st, COLIBRI_OK);
      EXPECT_FALSE(bit_equal(y, want3));
    }
    colibri::write_file_atomic(path, original.data(), original.size());
    ASSERT_EQ(run(m, 1, x, &others, &y), COLIBRI_OK);  // evicts what verify 0 read
    ASSERT_EQ(run(m, 1, x, &uses3, &y), COLIBRI_OK) << colibri_last_error();
    EXPECT_TRUE(bit_equal(y, want3));
    EXPECT_GT(stats_of(m).expert_read_failures, 0u);
    colibri_free(m);
    colibri_free(resident);
  }
}

// Reads through the page cache (direct_io 0): the same bits, and no read
// counted as O_DIRECT. Also a model on tmpfs (/dev/shm), which refuses
// O_DIRECT on older kernels (the reader falls back to buffered reads) and
// takes it on newer ones: the same bits either way.
TEST_P(CacheF32, BufferedReadsGiveTheSameBits) {
  colibri_model_t* resident = open_with(dir_.path(), options());
  ASSERT_NE(resident, nullptr);
  std::mt19937 rng(6);
  std::vector<std::vector<float>> xs;
  std::vector<Routing> rs;
  std::vector<std::vector<float>> want;
  for (int i = 0; i < 12; ++i) {
    xs.push_back(random_input(i % 4 == 3 ? 6 : 1, rng));
    rs.push_back(make_routing(i % 4 == 3 ? 6 : 1, 3, i % 2 == 0, rng));
    want.emplace_back();
    ASSERT_EQ(run(resident, i % kLayers, xs.back(), &rs.back(), &want.back()), COLIBRI_OK) << colibri_last_error();
  }
  colibri_free(resident);
  auto check = [&](const std::string& dir, int direct_io, bool expect_buffered) {
    SCOPED_TRACE(dir + " direct_io " + std::to_string(direct_io));
    colibri_open_options_t o = options(slot_bytes_ * 4);
    o.direct_io = direct_io;
    colibri_model_t* m = open_with(dir, o);
    ASSERT_NE(m, nullptr);
    for (size_t i = 0; i < xs.size(); ++i) {
      std::vector<float> y;
      ASSERT_EQ(run(m, static_cast<int32_t>(i) % kLayers, xs[i], &rs[i], &y), COLIBRI_OK) << colibri_last_error();
      ASSERT_TRUE(bit_equal(y, want[i])) << "call " << i;
    }
    const colibri_stats_t s = stats_of(m);
    EXPECT_GT(s.expert_reads, 0u);
    if (expect_buffered) {
      EXPECT_EQ(s.direct_reads, 0u);
    }
    EXPECT_EQ(s.uring_reads, g_io_engine == COLIBRI_IO_URING ? s.expert_reads : 0u);
    colibri_free(m);
  };
  check(dir_.path(), 0, true);
  if (std::filesystem::is_directory("/dev/shm")) {
    const std::string shm = "/dev/shm/colibri_cache_" + std::to_string(::getpid()) + "_" + engine_name(g_io_engine);
    std::filesystem::remove_all(shm);
    std::filesystem::copy(dir_.path(), shm, std::filesystem::copy_options::recursive);
    check(shm, 1, false);
    std::filesystem::remove_all(shm);
  }
}

// Several callers and a hot swap of an expert meanwhile, under a budget
// smaller than one layer: every output is the layer with the old expert or
// with the new one, bit for bit.
TEST_P(CacheF32, CallersAndHotSwapsUnderABudget) {
  TempDir other("colibri_cache_b"), mixed("colibri_cache_ab");
  colibri::write_random_model(other.path(), spec_, 99);
  std::filesystem::copy(dir_.path(), mixed.path(), std::filesystem::copy_options::recursive |
                                                       std::filesystem::copy_options::overwrite_existing);
  const colibri::Manifest man = colibri::load_manifest(dir_.path());
  const std::string new_file = other.path() + "/" + man.expert_file(0, 2);
  std::filesystem::copy_file(new_file, mixed.path() + "/" + man.expert_file(0, 2),
                             std::filesystem::copy_options::overwrite_existing);
  const std::string old_bytes = colibri::read_small_file(dir_.path() + "/" + man.expert_file(0, 2), size_t{1} << 30);
  const std::string new_bytes = colibri::read_small_file(new_file, size_t{1} << 30);
  // The mixed directory's manifest still has the old checksum: open it
  // without verification for the reference.
  colibri_open_options_t plain = options();
  plain.verify_checksums = 0;
  colibri_model_t* ref_old = open_with(dir_.path(), options());
  colibri_model_t* ref_new = open_with(mixed.path(), plain);
  ASSERT_NE(ref_new, nullptr);

  constexpr int kCallers = 3, kRoutings = 6;
  std::mt19937 rng(12);
  std::vector<std::vector<float>> xs;
  std::vector<Routing> rs;
  std::vector<std::vector<float>> want_old(kRoutings), want_new(kRoutings);
  for (int i = 0; i < kRoutings; ++i) {
    xs.push_back(random_input(i == 0 ? 8 : 1, rng));
    Routing r = make_routing(i == 0 ? 8 : 1, 3, i % 2 == 0, rng);
    r.ids[0] = 2;  // every call uses the swapped expert
    if (r.ids[1] == 2) r.ids[1] = 9;
    if (r.ids[2] == 2) r.ids[2] = 10;
    rs.push_back(r);
    ASSERT_EQ(run(ref_old, 0, xs[i], &rs[i], &want_old[i]), COLIBRI_OK);
    ASSERT_EQ(run(ref_new, 0, xs[i], &rs[i], &want_new[i]), COLIBRI_OK);
    ASSERT_FALSE(bit_equal(want_old[i], want_new[i]));
  }
  colibri_model_t* m = open_with(dir_.path(), options(slot_bytes_ * 4));
  ASSERT_NE(m, nullptr);
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, calls{0}, failed{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      std::vector<float> y;
      for (int i = 0; !stop.load() || i < 30; ++i) {
        const int j = (i + c) % kRoutings;
        if (run(m, 0, xs[j], &rs[j], &y) != COLIBRI_OK) {
          ++failed;
          continue;
        }
        if (!bit_equal(y, want_old[j]) && !bit_equal(y, want_new[j])) ++bad;
        ++calls;
        if (i > 2000) break;
      }
    });
  }
  // Prefetches from yet another thread keep the cache churning.
  std::thread prefetcher([&] {
    for (int i = 0; !stop.load() && i < 2000; ++i) {
      const int32_t ids[] = {i % kExperts, (i * 7) % kExperts};
      (void)colibri_prefetch(m, i % kLayers, ids, 2, nullptr);
    }
  });
  for (int s = 0; s < 20; ++s) {
    const std::string& bytes = s % 2 == 0 ? new_bytes : old_bytes;
    colibri_swap_source_t src;
    colibri_swap_source_default(&src);
    src.data = bytes.data();
    src.size = bytes.size();
    src.dtype = COLIBRI_DTYPE_F32;
    ASSERT_EQ(colibri_swap_expert(m, 0, 2, &src), COLIBRI_OK) << colibri_last_error();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  stop = true;
  for (std::thread& t : callers) t.join();
  prefetcher.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(failed.load(), 0) << colibri_last_error();
  EXPECT_GT(calls.load(), 0);
  // The last swap put the old bytes back.
  std::vector<float> y;
  ASSERT_EQ(run(m, 0, xs[1], &rs[1], &y), COLIBRI_OK);
  EXPECT_TRUE(bit_equal(y, want_old[1]));
  EXPECT_EQ(stats_of(m).expert_swaps, 20u);
  colibri_free(m);
  colibri_free(ref_old);
  colibri_free(ref_new);
}

INSTANTIATE_TEST_SUITE_P(Engines, CacheF32, ::testing::Values(COLIBRI_IO_PREAD, COLIBRI_IO_URING),
                         [](const auto& p) { return std::string(engine_name(p.param)); });

TEST(CacheOpenMemory, BudgetIsRefused) {
  std::vector<float> w(static_cast<size_t>(3) * kD * kF, 0.01f);
  colibri_expert_weights_t ew;
  std::memset(&ew, 0, sizeof ew);
  ew.gate = w.data();
  ew.up = w.data() + static_cast<size_t>(kD) * kF;
  ew.down = w.data() + 2 * static_cast<size_t>(kD) * kF;
  colibri_layer_weights_t lw;
  std::memset(&lw, 0, sizeof lw);
  lw.experts = &ew;
  colibri_model_desc_t d;
  colibri_model_desc_default(&d);
  d.n_layers = 1;
  d.n_experts = 1;
  d.d_model = kD;
  d.d_ff = kF;
  d.dtype = COLIBRI_DTYPE_F32;
  d.layers = &lw;
  colibri_open_options_t o = options(1 << 20);
  colibri_model_t* m = nullptr;
  EXPECT_EQ(colibri_open_memory(&d, &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("max_resident"), std::string::npos) << colibri_last_error();
  EXPECT_EQ(m, nullptr);
}

// The eviction rules (moe/cache_policy.h) on hand-made sequences.
size_t simulate(colibri::EvictionPolicy p, size_t slots, const std::vector<size_t>& keys, double half_life = 0) {
  colibri::CachePolicy policy(p, 64, half_life > 0 ? half_life : 4.0 * static_cast<double>(slots));
  std::vector<size_t> resident;
  size_t hits = 0;
  for (const size_t k : keys) {
    policy.touch(k);
    if (std::find(resident.begin(), resident.end(), k) != resident.end()) {
      ++hits;
      continue;
    }
    if (resident.size() == slots) {
      auto victim = resident.begin();
      for (auto it = resident.begin(); it != resident.end(); ++it) {
        if (policy.before(*it, *victim)) victim = it;
      }
      resident.erase(victim);
    }
    resident.push_back(k);
  }
  return hits;
}

TEST(CachePolicy, LruAndDecayedFrequency) {
  using colibri::EvictionPolicy;
  // LRU: a b c a d (evicts b) b (evicts c) -> one hit (a).
  EXPECT_EQ(simulate(EvictionPolicy::kLru, 3, {0, 1, 2, 0, 3, 1}), 1u);
  // A hot key between scans of cold ones: LRU loses it to each scan, the
  // decayed frequency keeps it.
  std::vector<size_t> trace;
  for (int round = 0; round < 20; ++round) {
    trace.push_back(0);
    trace.push_back(0);
    for (size_t c = 0; c < 3; ++c) trace.push_back(1 + (static_cast<size_t>(round) * 3 + c) % 30);
  }
  const size_t lru = simulate(EvictionPolicy::kLru, 3, trace);
  const size_t freq = simulate(EvictionPolicy::kDecayedFrequency, 3, trace);
  EXPECT_EQ(lru, 20u);   // only the second 0 of each round
  EXPECT_EQ(freq, 39u);  // every 0 but the first
  // Decay: a key hot long ago loses to a recent one. Key 0 used 6 times,
  // then 1 and 2 alternate for a long while; with a short half-life 0's
  // score has decayed below theirs, and 3's miss evicts 0.
  colibri::CachePolicy p(EvictionPolicy::kDecayedFrequency, 8, 2.0);
  for (int i = 0; i < 6; ++i) p.touch(0);
  for (int i = 0; i < 20; ++i) p.touch(1 + static_cast<size_t>(i % 2));
  EXPECT_TRUE(p.before(0, 1));
  EXPECT_TRUE(p.before(0, 2));
  // Ties: equal scores fall back to the older last use, then the smaller key.
  colibri::CachePolicy q(EvictionPolicy::kDecayedFrequency, 8, 1e9);
  q.touch(5);
  q.touch(4);
  EXPECT_TRUE(q.before(5, 4) || !q.before(4, 5));
  colibri::CachePolicy r(EvictionPolicy::kLru, 8, 1.0);
  EXPECT_TRUE(r.before(2, 3));  // never used: by key
}

}  // namespace
