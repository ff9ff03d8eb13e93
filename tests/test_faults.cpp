// Resource faults: each leaves a working engine or a clear error, never a
// crash. Scenarios that change process-wide limits run in a forked child,
// which reports through its exit code (0 = as expected).
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "colibri.h"
#include "io/manifest.h"
#include "lib/model_writer.h"
#include "test_util.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define COLIBRI_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define COLIBRI_UNDER_SANITIZER 1
#endif
#endif

namespace {

constexpr int kTokens = 7;

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_.n_layers = 1;
    spec_.n_experts = 8;
    spec_.d_model = 256;
    spec_.d_ff = 512;  // 8 experts x 768 KiB f16: several MiB packed
    spec_.dtype = colibri::WeightType::kF16;
    colibri::write_random_model(dir_.path(), spec_, 3);
    x_.resize(static_cast<size_t>(kTokens) * 256);
    for (size_t i = 0; i < x_.size(); ++i) x_[i] = std::sin(0.1f * static_cast<float>(i));
    for (int t = 0; t < kTokens; ++t) {
      ids_.push_back(t % 8);
      ids_.push_back((t + 3) % 8);
      w_.push_back(0.7f);
      w_.push_back(0.3f);
    }
    colibri_model_t* model = nullptr;
    ASSERT_EQ(colibri_open(dir_.path().c_str(), nullptr, &model), COLIBRI_OK) << colibri_last_error();
    expected_ = run(model);
    colibri_free(model);
  }

  std::vector<float> run(colibri_model_t* model) const {
    std::vector<float> y(x_.size(), std::nanf(""));
    colibri_infer_t in;
    colibri_infer_default(&in);
    in.n_tokens = kTokens;
    in.input = x_.data();
    in.output = y.data();
    in.top_k = 2;
    in.expert_ids = ids_.data();
    in.expert_weights = w_.data();
    if (colibri_infer(model, &in) != COLIBRI_OK) y.assign(y.size(), std::nanf(""));
    return y;
  }

  bool same_as_expected(colibri_model_t* model) const {
    const std::vector<float> y = run(model);
    return std::memcmp(y.data(), expected_.data(), y.size() * sizeof(float)) == 0;
  }

  // Runs body in a forked child; returns its exit code (or 128 + signal).
  static int in_child(const std::function<int()>& body) {
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) _exit(body());
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  colibri::ModelWriteSpec spec_;
  colibri_test::TempDir dir_;
  std::vector<float> x_, w_, expected_;
  std::vector<int32_t> ids_;
};

// Drops CAP_IPC_LOCK (which lets root lock memory past RLIMIT_MEMLOCK) from
// this process's capability sets.
bool drop_ipc_lock_capability() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  const unsigned bit = CAP_IPC_LOCK;  // < 32
  data[0].effective &= ~(1u << bit);
  data[0].permitted &= ~(1u << bit);
  data[0].inheritable &= ~(1u << bit);
  return syscall(SYS_capset, &header, data) == 0;
}

TEST_F(FaultTest, MlockRefusedGivesAWarningAndAWorkingModel) {
#ifdef COLIBRI_UNDER_SANITIZER
  GTEST_SKIP() << "AddressSanitizer intercepts mlock and always reports success";
#endif
  const int code = in_child([&] {
    const rlimit zero{0, 0};
    if (setrlimit(RLIMIT_MEMLOCK, &zero) != 0) return 10;
    drop_ipc_lock_capability();  // best effort: not root, or no such capability
    colibri_model_t* model = nullptr;
    colibri_open_options_t o;
    colibri_open_options_default(&o);
    o.lock_memory = 1;
    if (colibri_open(dir_.path().c_str(), &o, &model) != COLIBRI_OK) return 11;
    colibri_stats_t st;
    colibri_stats(model, &st);
    const std::string warning = colibri_last_warning();
    const bool ok = same_as_expected(model);
    colibri_free(model);
    if (st.bytes_locked != 0) return 12;  // the limit is 0: nothing may be locked
    if (warning.find("mlock") == std::string::npos) return 13;
    return ok ? 0 : 14;
  });
  EXPECT_EQ(code, 0) << "10 setrlimit, 11 open failed, 12 locked anyway, 13 no warning, 14 wrong output";
}

TEST_F(FaultTest, TransparentHugePagesDisabled) {
  const int code = in_child([&] {
    if (prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0) return 10;
    colibri_model_t* model = nullptr;
    if (colibri_open(dir_.path().c_str(), nullptr, &model) != COLIBRI_OK) return 11;
    colibri_stats_t st;
    colibri_stats(model, &st);
    const bool ok = same_as_expected(model);
    colibri_free(model);
    if (st.huge_page_kind == COLIBRI_HUGE_PAGES_TRANSPARENT && st.bytes_huge_pages > 0) return 12;
    return ok ? 0 : 13;
  });
  EXPECT_EQ(code, 0) << "10 prctl, 11 open failed, 12 THP reported though disabled, 13 wrong output";
}

TEST_F(FaultTest, NoHugetlbfsPagesReserved) {
  std::ifstream f("/proc/sys/vm/nr_hugepages");
  long reserved = -1;
  f >> reserved;
  if (reserved != 0) GTEST_SKIP() << "this machine has hugetlbfs pages reserved";
  colibri_model_t* model = nullptr;
  ASSERT_EQ(colibri_open(dir_.path().c_str(), nullptr, &model), COLIBRI_OK) << colibri_last_error();
  colibri_stats_t st;
  ASSERT_EQ(colibri_stats(model, &st), COLIBRI_OK);
  EXPECT_NE(st.huge_page_kind, COLIBRI_HUGE_PAGES_HUGETLBFS);
  EXPECT_TRUE(same_as_expected(model));
  colibri_free(model);
}

TEST_F(FaultTest, FilesChangingAfterOpenCannotHurtTheModel) {
  colibri_model_t* model = nullptr;
  ASSERT_EQ(colibri_open(dir_.path().c_str(), nullptr, &model), COLIBRI_OK) << colibri_last_error();
  const colibri::Manifest m = colibri::load_manifest(dir_.path());
  // Shrink one expert file to nothing and scribble over another, in place.
  std::filesystem::resize_file(dir_.path() + "/" + m.expert_file(0, 0), 0);
  {
    std::fstream f(dir_.path() + "/" + m.expert_file(0, 3), std::ios::in | std::ios::out | std::ios::binary);
    const std::string junk(4096, '\x7f');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }
  EXPECT_TRUE(same_as_expected(model)) << "the running model read the changed files";
  colibri_free(model);
  // Opening again names the damage instead of computing with it.
  EXPECT_EQ(colibri_open(dir_.path().c_str(), nullptr, &model), COLIBRI_ERR_FORMAT);
  EXPECT_NE(std::string(colibri_last_error()).find("expert_00.bin"), std::string::npos) << colibri_last_error();
}

TEST_F(FaultTest, OutOfMemoryWhileOpening) {
#ifdef COLIBRI_UNDER_SANITIZER
  GTEST_SKIP() << "sanitizers reserve terabytes of address space; RLIMIT_AS cannot be tested under them";
#else
  // A model whose packed weights (~96 MiB) cannot fit in what is left of
  // the address space under the limit.
  colibri_test::TempDir big;
  colibri::ModelWriteSpec spec = spec_;
  spec.n_experts = 64;
  spec.d_model = 1024;
  spec.d_ff = 512;
  colibri::write_random_model(big.path(), spec, 1);
  const int code = in_child([&] {
    long pages = 0;
    std::ifstream statm("/proc/self/statm");
    statm >> pages;
    const rlim_t now = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
    const rlimit limit{now + (rlim_t{48} << 20), now + (rlim_t{48} << 20)};
    if (setrlimit(RLIMIT_AS, &limit) != 0) return 10;
    colibri_model_t* model = nullptr;
    const colibri_status_t st = colibri_open(big.path().c_str(), nullptr, &model);
    if (st == COLIBRI_OK) return 11;
    if (model != nullptr) return 12;
    if (st != COLIBRI_ERR_OUT_OF_MEMORY) {
      std::fprintf(stderr, "status %d: %s\n", static_cast<int>(st), colibri_last_error());
      return 13;
    }
    if (std::strlen(colibri_last_error()) == 0) return 14;
    // The small model still opens and works in what is left.
    if (colibri_open(dir_.path().c_str(), nullptr, &model) != COLIBRI_OK) return 15;
    const bool ok = same_as_expected(model);
    colibri_free(model);
    return ok ? 0 : 16;
  });
  EXPECT_EQ(code, 0) << "10 setrlimit, 11 opened anyway, 12 handle leaked, 13 wrong status, 14 no message, "
                        "15 small model failed after, 16 wrong output";
#endif
}

// The prefill kernels' working memory (transposed activations, weight
// panels, AMX tiles: up to a few MiB per thread) is sized at open for
// reserve_tokens, so a prefill call within that size allocates nothing: with
// every byte of the heap taken and the address space capped, it still runs
// the prefill kernels (bit for bit the result of an unconstrained run; their
// no-scratch fallback would round differently), from a thread that has
// never called before. The fallback itself is tested per kernel table in
// test_gemm and test_amx.
TEST_F(FaultTest, PrefillCallsWithinReserveAllocateNothing) {
#ifdef COLIBRI_UNDER_SANITIZER
  GTEST_SKIP() << "sanitizers reserve terabytes of address space; RLIMIT_AS cannot be tested under them";
#else
  constexpr int kT = 128, kExperts = 2, kD = 2048, kF = 256;  // 64 tokens per expert: prefill kernels (AMX ones where usable)
  // Reserving for 8x the call's tokens: the AMX kernels then plan shorter K
  // chunks at open than the call uses, so their weight panels are larger in
  // the call than at the reservation's token count.
  // The block formats' one table (int8 activations, prepared per expert)
  // serves every token count, from the same reservation.
  for (const auto& [dtype, reserve] : {std::pair{COLIBRI_DTYPE_F16, kT}, std::pair{COLIBRI_DTYPE_BF16, kT},
                                       std::pair{COLIBRI_DTYPE_F16, 8 * kT}, std::pair{COLIBRI_DTYPE_BF16, 8 * kT},
                                       std::pair{COLIBRI_DTYPE_Q4_K, kT}, std::pair{COLIBRI_DTYPE_Q8_0, kT}}) {
    SCOPED_TRACE(std::string(colibri_dtype_name(dtype)) + " reserve_tokens " + std::to_string(reserve));
    colibri_test::TempDir dir;
    colibri::ModelWriteSpec spec;
    spec.n_experts = kExperts;
    spec.d_model = kD;
    spec.d_ff = kF;
    spec.dtype = colibri_test::weight_type(dtype);
    colibri::write_random_model(dir.path(), spec, 11);
    std::vector<float> x(static_cast<size_t>(kT) * kD), w(kT, 1.0f);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
    std::vector<int32_t> ids(kT);
    for (int t = 0; t < kT; ++t) ids[static_cast<size_t>(t)] = t % kExperts;
    colibri_open_options_t o;
    colibri_open_options_default(&o);
    o.reserve_tokens = reserve;
    auto infer = [&](colibri_model_t* m, std::vector<float>* y) {
      std::fill(y->begin(), y->end(), std::nanf(""));
      colibri_infer_t in;
      colibri_infer_default(&in);
      in.n_tokens = kT;
      in.input = x.data();
      in.output = y->data();
      in.top_k = 1;
      in.expert_ids = ids.data();
      in.expert_weights = w.data();
      return colibri_infer(m, &in);
    };
    colibri_model_t* model = nullptr;
    ASSERT_EQ(colibri_open(dir.path().c_str(), &o, &model), COLIBRI_OK) << colibri_last_error();
    const std::string kernels = colibri_model_kernels(model);
    std::vector<float> expected(x.size());
    ASSERT_EQ(infer(model, &expected), COLIBRI_OK);
    colibri_free(model);
    const bool quantized = dtype >= COLIBRI_DTYPE_Q8_0;
    if (!quantized && kernels.find("prefill") == std::string::npos) {
      GTEST_SKIP() << "no prefill kernels here: " << kernels;
    }

    const int code = in_child([&] {
      colibri_model_t* m = nullptr;
      if (colibri_open(dir.path().c_str(), &o, &m) != COLIBRI_OK) return 10;
      std::vector<float> y(x.size());
      std::vector<void*> hoard;
      hoard.reserve(size_t{1} << 20);
      int result = 0;
      // A fresh thread (its stack mapped before the limit): a caller the
      // engine has never seen.
      std::thread caller([&] {
        long pages = 0;
        std::ifstream statm("/proc/self/statm");
        statm >> pages;
        const rlim_t now = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
        const rlimit limit{now, now};
        if (setrlimit(RLIMIT_AS, &limit) != 0) {
          result = 11;
          return;
        }
        // Take what the heap still has free.
        for (size_t size : {size_t{1} << 16, size_t{1} << 12, size_t{256}, size_t{16}}) {
          while (hoard.size() < hoard.capacity()) {
            void* p = std::malloc(size);
            if (p == nullptr) break;
            hoard.push_back(p);
          }
        }
        void* probe = std::malloc(64);
        if (probe != nullptr) {
          std::free(probe);
          result = 12;
          return;
        }
        if (infer(m, &y) != COLIBRI_OK) result = 13;
      });
      caller.join();
      for (void* p : hoard) std::free(p);
      colibri_free(m);
      if (result != 0) return result;
      return std::memcmp(y.data(), expected.data(), y.size() * sizeof(float)) == 0 ? 0 : 14;
    });
    EXPECT_EQ(code, 0) << "10 open, 11 setrlimit, 12 memory not exhausted, 13 infer failed, 14 not the prefill "
                          "kernels' result (scratch missing)";
  }
#endif
}

TEST_F(FaultTest, TwoProcessesOpenTheSameDirectoryAtOnce) {
  std::fflush(nullptr);
  pid_t pids[2];
  for (pid_t& pid : pids) {
    pid = fork();
    if (pid == 0) {
      int good = 0;
      for (int i = 0; i < 5; ++i) {
        colibri_model_t* model = nullptr;
        if (colibri_open(dir_.path().c_str(), nullptr, &model) != COLIBRI_OK) _exit(11);
        good += same_as_expected(model) ? 1 : 0;
        colibri_free(model);
      }
      _exit(good == 5 ? 0 : 12);
    }
  }
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
}

}  // namespace
