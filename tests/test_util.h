// Helpers shared by the test files.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

#include "colibri.h"
#include "util/router_desc.h"
#include "util/weight_format.h"

namespace colibri_test {

// A whole file's bytes ("" when it cannot be read).
inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The internal weight type of a C ABI dtype (the same values), for tests
// that write models with the tools library and open them through the ABI.
inline colibri::WeightType weight_type(colibri_dtype_t d) { return static_cast<colibri::WeightType>(d); }
inline colibri_dtype_t c_dtype(colibri::WeightType t) { return static_cast<colibri_dtype_t>(t); }
// The C ABI's router description of an internal one (the same fields).
inline colibri_router_desc_t c_router_desc(const colibri::RouterDesc& r) {
  colibri_router_desc_t c;
  colibri_router_desc_default(&c);
  c.family = static_cast<colibri_router_family_t>(r.family);
  c.top_k = r.top_k;
  c.norm_topk_prob = r.norm_topk_prob;
  c.n_group = r.n_group;
  c.topk_group = r.topk_group;
  c.routed_scaling_factor = r.routed_scaling_factor;
  return c;
}

// A fresh directory under the test temp dir, removed with everything in it
// on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "colibri") {
    std::string base = testing::TempDir();
    if (base.empty()) base = "/tmp/";
    if (base.back() != '/') base += '/';
    std::string tmpl = base + prefix + "_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp(" << tmpl << ") failed";
      return;
    }
    path_ = buf.data();
  }
  ~TempDir() {
    if (!path_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Kernel choice by measurement switched on while it lives (the suite runs
// with COLIBRI_TUNE=0), its cache file under `cache_dir`; COLIBRI_TUNE and
// COLIBRI_CACHE_DIR restored after.
class KernelChoiceEnv {
 public:
  explicit KernelChoiceEnv(const std::string& cache_dir) {
    had_tune_ = ::getenv("COLIBRI_TUNE") != nullptr;
    if (had_tune_) saved_tune_ = ::getenv("COLIBRI_TUNE");
    ::unsetenv("COLIBRI_TUNE");
    ::setenv("COLIBRI_CACHE_DIR", cache_dir.c_str(), 1);
  }
  ~KernelChoiceEnv() {
    ::unsetenv("COLIBRI_CACHE_DIR");
    if (had_tune_) ::setenv("COLIBRI_TUNE", saved_tune_.c_str(), 1);
  }
  KernelChoiceEnv(const KernelChoiceEnv&) = delete;
  KernelChoiceEnv& operator=(const KernelChoiceEnv&) = delete;

 private:
  std::string saved_tune_;
  bool had_tune_ = false;
};

// A model handle freed on scope exit.
struct OpenedModel {
  colibri_model_t* model = nullptr;
  OpenedModel() = default;
  OpenedModel(const OpenedModel&) = delete;
  OpenedModel& operator=(const OpenedModel&) = delete;
  ~OpenedModel() { colibri_free(model); }
};

// colibri_open of `dir` without mlock or huge pages (tests open many
// models), exact_prefill as asked; nullptr after a test failure.
inline colibri_model_t* open_test_model(const std::string& dir, bool exact) {
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.lock_memory = 0;
  o.huge_pages = 0;
  o.exact_prefill = exact ? 1 : 0;
  colibri_model_t* m = nullptr;
  EXPECT_EQ(colibri_open(dir.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  return m;
}

}  // namespace colibri_test
