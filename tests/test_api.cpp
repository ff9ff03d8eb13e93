// The C ABI's error behaviour: status codes, colibri_last_error() naming the
// file / field / line at fault, NULL handling, outputs left untouched on
// error; plus the positive checks of the inspection entry points.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "colibri.h"
#include "io/manifest.h"
#include "lib/model_writer.h"

#include "test_util.h"

namespace {

using nlohmann::json;

// A fresh directory, removed on destruction.
struct TempDir : colibri_test::TempDir {
  TempDir() : colibri_test::TempDir("colibri_api") {}
};

void write_file(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out.good()) << path;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Asserts the last error is non-empty and contains every needle.
::testing::AssertionResult error_names(std::initializer_list<std::string> needles) {
  const std::string err = colibri_last_error();
  if (err.empty()) return ::testing::AssertionFailure() << "colibri_last_error() is empty";
  for (const std::string& n : needles) {
    if (!contains(err, n)) {
      return ::testing::AssertionFailure() << "error \"" << err << "\" does not mention \"" << n << "\"";
    }
  }
  return ::testing::AssertionSuccess() << err;
}

constexpr int32_t kE = 4;
constexpr int32_t kD = 8;
constexpr int32_t kF = 16;
constexpr uint64_t kFileBytes = 3ull * kD * kF * 2;  // f16

class ApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    dir_ = tmp_.path() + "/model";
    colibri::ModelWriteSpec spec;
    spec.n_layers = 1;
    spec.n_experts = kE;
    spec.d_model = kD;
    spec.d_ff = kF;
    spec.dtype = colibri::WeightType::kF16;
    colibri::write_random_model(dir_, spec, 5);
    manifest_path_ = dir_ + "/colibri.json";
    manifest_ = json::parse(colibri_test::file_bytes(manifest_path_));
  }

  // Open with defaults but checksum verification as given; expects failure
  // with `want` and checks that *out_model was reset to NULL.
  colibri_status_t open_status(const std::string& dir) {
    colibri_model_t* m = reinterpret_cast<colibri_model_t*>(static_cast<uintptr_t>(0x1));
    const colibri_status_t st = colibri_open(dir.c_str(), nullptr, &m);
    if (st == COLIBRI_OK) {
      colibri_free(m);
    } else {
      EXPECT_EQ(m, nullptr) << "out_model not NULL after failure";
    }
    return st;
  }

  // A hand-edited manifest: without the checksum file, which would no
  // longer match (ManifestChecksum tests that case).
  void write_manifest(const json& doc) {
    write_file(manifest_path_, doc.dump(2));
    std::filesystem::remove(manifest_path_ + ".xxh64");
  }

  // Rewrites the manifest with one change and expects FORMAT naming `field`.
  void expect_manifest_rejected(const json& doc, std::initializer_list<std::string> needles,
                                colibri_status_t want = COLIBRI_ERR_FORMAT) {
    write_manifest(doc);
    EXPECT_EQ(open_status(dir_), want) << doc.dump();
    EXPECT_TRUE(error_names(needles)) << doc.dump();
    EXPECT_TRUE(error_names({"colibri.json"})) << doc.dump();
  }

  std::string expert_path(int e) const {
    char buf[32];
    std::snprintf(buf, sizeof buf, "/expert_%02d.bin", e);
    return dir_ + buf;
  }

  void flip_byte(const std::string& path, size_t at) {
    std::string bytes = colibri_test::file_bytes(path);
    ASSERT_LT(at, bytes.size());
    bytes[at] = static_cast<char>(bytes[at] ^ 0x5a);
    write_file(path, bytes);
  }

  colibri_model_t* open_ok(int32_t n_threads = 0) {
    colibri_open_options_t o;
    colibri_open_options_default(&o);
    o.n_threads = n_threads;
    colibri_model_t* m = nullptr;
    EXPECT_EQ(colibri_open(dir_.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
    return m;
  }

  TempDir tmp_;
  std::string dir_;
  std::string manifest_path_;
  json manifest_;
};

// ----------------------------------------------------------- open errors

TEST_F(ApiTest, MissingModelDirectory) {
  const std::string missing = tmp_.path() + "/no_such_model";
  EXPECT_EQ(open_status(missing), COLIBRI_ERR_IO);
  EXPECT_TRUE(error_names({"no_such_model"}));
}

// Messages live in a fixed per-thread buffer (no allocation on the error
// path); one longer than it is cut short and says so.
TEST_F(ApiTest, OverlongMessageIsCutShort) {
  const std::string path = "/nonexistent/" + std::string(6000, 'p');
  colibri_model_t* m = nullptr;
  EXPECT_NE(colibri_open(path.c_str(), nullptr, &m), COLIBRI_OK);
  EXPECT_EQ(m, nullptr);
  const std::string err = colibri_last_error();
  EXPECT_EQ(err.size(), 4095u);
  EXPECT_EQ(err.substr(err.size() - 3), "...");
  EXPECT_NE(err.find("/nonexistent/ppp"), std::string::npos) << err.substr(0, 200);
  // A later, shorter message replaces it whole.
  EXPECT_NE(colibri_open("/nonexistent/short", nullptr, &m), COLIBRI_OK);
  EXPECT_NE(std::string(colibri_last_error()).find("/nonexistent/short"), std::string::npos);
}

TEST_F(ApiTest, MissingManifest) {
  std::filesystem::remove(manifest_path_);
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_IO);
  EXPECT_TRUE(error_names({"colibri.json"}));
}

TEST_F(ApiTest, InvalidJson) {
  write_file(manifest_path_, "{ \"format\": \"colibri-moe\", \"version\": 1,, }");
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"colibri.json", "JSON"}));

  write_file(manifest_path_, "");
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"colibri.json"}));

  write_file(manifest_path_, "[1, 2, 3]");
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"colibri.json"}));
}

TEST_F(ApiTest, NumberTooLargeForADouble) {
  // nlohmann reports this as out_of_range, not parse_error (fuzz_manifest).
  std::string text = colibri_test::file_bytes(manifest_path_);
  const size_t at = text.find("\"d_ff\": ");
  ASSERT_NE(at, std::string::npos);
  text.insert(at, "\"unused\": 2e4708314, ");
  write_file(manifest_path_, text);
  std::filesystem::remove(manifest_path_ + ".xxh64");
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"colibri.json", "invalid JSON"}));
}

TEST_F(ApiTest, EachMissingField) {
  for (const char* field :
       {"format", "version", "n_layers", "n_experts", "d_model", "d_ff", "dtype", "activation"}) {
    SCOPED_TRACE(field);
    json doc = manifest_;
    ASSERT_TRUE(doc.contains(field));
    doc.erase(field);
    expect_manifest_rejected(doc, {field});
  }
}

TEST_F(ApiTest, UnknownDtypeAndActivation) {
  json doc = manifest_;
  doc["dtype"] = "f64";
  expect_manifest_rejected(doc, {"dtype", "f64"});
  doc["dtype"] = 16;
  expect_manifest_rejected(doc, {"dtype"});

  doc = manifest_;
  doc["activation"] = "gelu";
  expect_manifest_rejected(doc, {"activation", "gelu"});
}

TEST_F(ApiTest, BadDimensions) {
  for (const char* field : {"n_layers", "n_experts", "d_model", "d_ff"}) {
    SCOPED_TRACE(field);
    const json bad_values[] = {0,
                               -1,
                               -2147483648LL,
                               2.5,
                               8.0,
                               "8",
                               nullptr,
                               true,
                               json::array({8}),
                               int64_t{1} << 40,
                               int64_t{1} << 31,
                               std::numeric_limits<uint64_t>::max()};
    for (const json& v : bad_values) {
      json doc = manifest_;
      doc[field] = v;
      expect_manifest_rejected(doc, {field});
    }
  }
}

TEST_F(ApiTest, DimensionsWhoseProductIsTooLarge) {
  // Each dimension within its own limit, the model far beyond kMaxModelBytes.
  json doc = manifest_;
  doc["n_experts"] = 65536;
  doc["d_model"] = 1 << 20;
  doc["d_ff"] = 1 << 20;
  doc.erase("checksums");
  expect_manifest_rejected(doc, {"too large"});

  doc = manifest_;
  doc["n_layers"] = 4096;
  doc["n_experts"] = 4096;
  doc["d_model"] = 65536;
  doc["d_ff"] = 65536;
  doc.erase("checksums");
  expect_manifest_rejected(doc, {"too large"});

  // A single expert of 3 * 2^40 * 2 bytes is within the limit: the manifest
  // is accepted and the (small) file is then rejected by size, without any
  // attempt to allocate the model.
  doc = manifest_;
  doc["d_model"] = 1 << 20;
  doc["d_ff"] = 1 << 20;
  doc.erase("checksums");
  write_manifest(doc);
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"expert_00.bin", "truncated"}));
}

TEST_F(ApiTest, DimensionsWhoseProductOverflows64Bits) {
  // n_layers * n_experts * 3 * d_model * d_ff * 4 = 3 * 2^70 bytes: wraps to
  // 0 in uint64 arithmetic, so a careless size check passes. Must be
  // rejected by the manifest check, not later by a missing file.
  json doc = manifest_;
  doc["n_layers"] = 4096;
  doc["n_experts"] = 65536;
  doc["d_model"] = 1 << 20;
  doc["d_ff"] = 1 << 20;
  doc["dtype"] = "f32";
  doc.erase("checksums");
  expect_manifest_rejected(doc, {"too large"});
}

TEST_F(ApiTest, WrongFormatOrVersion) {
  json doc = manifest_;
  doc["format"] = "colibri-dense";
  expect_manifest_rejected(doc, {"format"});
  doc["format"] = 1;
  expect_manifest_rejected(doc, {"format"});

  doc = manifest_;
  doc["version"] = colibri::kManifestVersion + 1;
  expect_manifest_rejected(doc, {"version"});
  // Block formats need version 3.
  doc = manifest_;
  doc["dtype"] = "q8_0";
  expect_manifest_rejected(doc, {"dtype", "version"});
  // v2 parts in a v1 manifest.
  doc = manifest_;
  doc["router"] = {{"family", "mixtral"}, {"top_k", 2}};
  expect_manifest_rejected(doc, {"router", "version"});
  doc["version"] = 0;
  expect_manifest_rejected(doc, {"version"});
  doc["version"] = "1";
  expect_manifest_rejected(doc, {"version"});
  doc["version"] = 1.5;
  expect_manifest_rejected(doc, {"version"});
}

TEST_F(ApiTest, MissingExpertFile) {
  std::filesystem::remove(expert_path(2));
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_IO);
  EXPECT_TRUE(error_names({"expert_02.bin"}));
}

TEST_F(ApiTest, TruncatedExpertFile) {
  std::string bytes = colibri_test::file_bytes(expert_path(1));
  bytes.pop_back();
  write_file(expert_path(1), bytes);
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"expert_01.bin", "truncated"}));

  write_file(expert_path(1), "");
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"expert_01.bin"}));
}

TEST_F(ApiTest, OversizedExpertFile) {
  std::string bytes = colibri_test::file_bytes(expert_path(3));
  bytes.push_back('\0');
  write_file(expert_path(3), bytes);
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"expert_03.bin", "oversized"}));
}

TEST_F(ApiTest, ExpertPathIsADirectory) {
  std::filesystem::remove(expert_path(0));
  std::filesystem::create_directory(expert_path(0));
  EXPECT_NE(open_status(dir_), COLIBRI_OK);
  EXPECT_TRUE(error_names({"expert_00.bin"}));
}

TEST_F(ApiTest, ChecksumMismatch) {
  flip_byte(expert_path(3), 17);
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_CHECKSUM);
  EXPECT_TRUE(error_names({"expert_03.bin"}));

  EXPECT_EQ(colibri_verify_dir(dir_.c_str()), COLIBRI_ERR_CHECKSUM);
  EXPECT_TRUE(error_names({"expert_03.bin"}));

  // With verification off, the flipped byte is accepted.
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.verify_checksums = 0;
  colibri_model_t* m = nullptr;
  EXPECT_EQ(colibri_open(dir_.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  EXPECT_NE(m, nullptr);
  colibri_free(m);
}

TEST_F(ApiTest, MalformedChecksumString) {
  for (const json& bad : {json("xxh64:zz"), json("xxh64:0123"), json("md5:0123456789abcdef"),
                          json("xxh64:0123456789abcdef0"), json(""), json(12345)}) {
    SCOPED_TRACE(bad.dump());
    json doc = manifest_;
    doc["checksums"]["expert_00.bin"] = bad;
    expect_manifest_rejected(doc, {"checksums", "expert_00.bin"});
  }
  json doc = manifest_;
  doc["checksums"] = json::array();
  expect_manifest_rejected(doc, {"checksums"});
}

TEST_F(ApiTest, ChecksumKeyNamingForeignFile) {
  for (const char* key : {"../etc/passwd", "/etc/passwd", "expert_04.bin", "expert_2.bin",
                          "layer_00/expert_00.bin", "colibri.json", "expert_00.bin/"}) {
    SCOPED_TRACE(key);
    json doc = manifest_;
    doc["checksums"][key] = "xxh64:0123456789abcdef";
    expect_manifest_rejected(doc, {key});
  }
}

TEST_F(ApiTest, ManifestChecksumCatchesAnyFlippedByte) {
  // Every single-bit flip anywhere in colibri.json (even inside a field
  // readers ignore, or in a key name) is refused, naming colibri.json.
  const std::string good = colibri_test::file_bytes(manifest_path_);
  ASSERT_TRUE(std::filesystem::exists(manifest_path_ + ".xxh64"));
  for (size_t i = 0; i < good.size(); i += 7) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ (1 << (i % 8)));
    write_file(manifest_path_, bad);
    EXPECT_NE(open_status(dir_), COLIBRI_OK) << "flip at byte " << i;
    EXPECT_TRUE(error_names({"colibri.json"})) << "flip at byte " << i;
  }
  // A field nobody reads, changed: only the checksum can tell.
  json doc = json::parse(good);
  doc["comment"] = "edited";
  write_file(manifest_path_, doc.dump(2));
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_CHECKSUM);
  EXPECT_TRUE(error_names({"colibri.json", "checksum mismatch"}));
  // A malformed checksum file is named.
  write_file(manifest_path_, good);
  write_file(manifest_path_ + ".xxh64", "xxh64:nothex\n");
  EXPECT_EQ(open_status(dir_), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"colibri.json.xxh64"}));
  // verify_checksums = 0 skips it, as it skips the weight files'.
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.verify_checksums = 0;
  colibri_model_t* model = nullptr;
  EXPECT_EQ(colibri_open(dir_.c_str(), &o, &model), COLIBRI_OK) << colibri_last_error();
  colibri_free(model);
}

TEST_F(ApiTest, VerifyDir) {
  EXPECT_EQ(colibri_verify_dir(dir_.c_str()), COLIBRI_OK) << colibri_last_error();
  EXPECT_EQ(colibri_verify_dir((tmp_.path() + "/nothing_here").c_str()), COLIBRI_ERR_IO);
  EXPECT_TRUE(error_names({"nothing_here"}));
  flip_byte(expert_path(0), 0);
  EXPECT_EQ(colibri_verify_dir(dir_.c_str()), COLIBRI_ERR_CHECKSUM);
  EXPECT_TRUE(error_names({"expert_00.bin"}));
}

// ---------------------------------------------------------- infer errors

class InferErrorTest : public ApiTest {
 protected:
  void SetUp() override {
    ApiTest::SetUp();
    model_ = open_ok();
    ASSERT_NE(model_, nullptr);
    x_.assign(static_cast<size_t>(kT) * kD, 0.25f);
    y_.assign(x_.size(), std::numeric_limits<float>::quiet_NaN());
    for (int t = 0; t < kT; ++t) {
      ids_.push_back(t % kE);
      ids_.push_back((t + 1) % kE);
      w_.push_back(0.75f);
      w_.push_back(-0.5f);
    }
    colibri_infer_default(&in_);
    in_.n_tokens = kT;
    in_.input = x_.data();
    in_.output = y_.data();
    in_.top_k = 2;
    in_.expert_ids = ids_.data();
    in_.expert_weights = w_.data();
  }
  void TearDown() override { colibri_free(model_); }

  bool output_untouched() const {
    for (float v : y_) {
      if (!std::isnan(v)) return false;
    }
    return true;
  }

  static constexpr int kT = 6;
  colibri_model_t* model_ = nullptr;
  std::vector<float> x_, y_, w_;
  std::vector<int32_t> ids_;
  colibri_infer_t in_;
};

TEST_F(InferErrorTest, BaselineSucceeds) {
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_OK) << colibri_last_error();
  EXPECT_STREQ(colibri_last_error(), "");
  for (float v : y_) EXPECT_TRUE(std::isfinite(v));
}

TEST_F(InferErrorTest, LayerOutOfRange) {
  for (int32_t layer : {1, -1, 1000, std::numeric_limits<int32_t>::min()}) {
    in_.layer = layer;
    EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_ERR_INVALID_ARGUMENT) << layer;
    EXPECT_TRUE(error_names({"layer", std::to_string(layer)}));
    EXPECT_TRUE(output_untouched());
  }
}

TEST_F(InferErrorTest, NegativeTokenCount) {
  in_.n_tokens = -1;
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"n_tokens", "-1"}));
  in_.n_tokens = std::numeric_limits<int32_t>::min();
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"n_tokens"}));
  EXPECT_TRUE(output_untouched());
}

TEST_F(InferErrorTest, NegativeThreadCount) {
  in_.n_threads = -3;
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"n_threads"}));
  EXPECT_TRUE(output_untouched());
}

TEST_F(InferErrorTest, TopKOutOfRange) {
  for (int32_t k : {0, -1, kE + 1}) {
    in_.top_k = k;
    EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_ERR_INVALID_ARGUMENT) << k;
    EXPECT_TRUE(error_names({"top_k", std::to_string(k)}));
    EXPECT_TRUE(output_untouched());
  }
}

TEST_F(InferErrorTest, ExpertIdOutOfRange) {
  for (int32_t bad : {-2, kE, kE + 100, std::numeric_limits<int32_t>::min(),
                      std::numeric_limits<int32_t>::max()}) {
    SCOPED_TRACE(bad);
    std::vector<int32_t> ids = ids_;
    ids.back() = bad;  // last token, last slot: after everything valid
    in_.expert_ids = ids.data();
    EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(error_names({"expert_ids", std::to_string(bad)}));
    EXPECT_TRUE(output_untouched());
  }
}

TEST_F(InferErrorTest, OutputAliasingInput) {
  std::vector<float> xy = x_;
  in_.input = xy.data();
  in_.output = xy.data();
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"overlap"}));
}

TEST_F(InferErrorTest, NullPointers) {
  EXPECT_EQ(colibri_infer(nullptr, &in_), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"model"}));
  EXPECT_EQ(colibri_infer(model_, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"infer"}));

  colibri_infer_t in = in_;
  in.input = nullptr;
  EXPECT_EQ(colibri_infer(model_, &in), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"input"}));

  in = in_;
  in.output = nullptr;
  EXPECT_EQ(colibri_infer(model_, &in), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"output"}));

  in = in_;
  in.expert_ids = nullptr;
  EXPECT_EQ(colibri_infer(model_, &in), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"expert_ids"}));

  in = in_;
  in.expert_weights = nullptr;
  EXPECT_EQ(colibri_infer(model_, &in), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"expert_weights"}));
  EXPECT_TRUE(output_untouched());
}

std::string simple_route_text(int tokens, int n_experts) {
  std::string text;
  for (int t = 0; t < tokens; ++t) {
    text += std::to_string(t) + ", " + std::to_string(t % n_experts) + ", " +
            std::to_string((t + 1) % n_experts) + ", 0.5, 0.25\n";
  }
  return text;
}

std::vector<uint8_t> compile(const std::string& text, int32_t n_experts) {
  colibri_route_compile_options_t o;
  colibri_route_compile_options_default(&o);
  o.n_experts = n_experts;
  void* blob = nullptr;
  size_t size = 0;
  EXPECT_EQ(colibri_route_compile(text.data(), text.size(), "t.route", &o, &blob, &size), COLIBRI_OK)
      << colibri_last_error();
  std::vector<uint8_t> out(static_cast<const uint8_t*>(blob), static_cast<const uint8_t*>(blob) + size);
  colibri_buffer_free(blob);
  return out;
}

TEST_F(InferErrorTest, BlobTokenCountMismatch) {
  const std::vector<uint8_t> blob = compile(simple_route_text(kT - 1, kE), kE);
  ASSERT_FALSE(blob.empty());
  in_.routing_blob = blob.data();
  in_.routing_blob_size = blob.size();
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"token", std::to_string(kT - 1), std::to_string(kT)}));
  EXPECT_TRUE(output_untouched());

  // The right count works.
  const std::vector<uint8_t> good = compile(simple_route_text(kT, kE), kE);
  in_.routing_blob = good.data();
  in_.routing_blob_size = good.size();
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_OK) << colibri_last_error();
}

TEST_F(InferErrorTest, BlobForMoreExperts) {
  // Ids stay below the model's count; only the header's expert count is too big.
  const std::vector<uint8_t> blob = compile(simple_route_text(kT, kE), kE + 4);
  ASSERT_FALSE(blob.empty());
  in_.routing_blob = blob.data();
  in_.routing_blob_size = blob.size();
  const colibri_status_t st = colibri_infer(model_, &in_);
  EXPECT_TRUE(st == COLIBRI_ERR_FORMAT || st == COLIBRI_ERR_INVALID_ARGUMENT) << colibri_status_name(st);
  EXPECT_TRUE(error_names({std::to_string(kE + 4)}));
  EXPECT_TRUE(output_untouched());
}

TEST_F(InferErrorTest, CorruptBlob) {
  std::vector<uint8_t> blob = compile(simple_route_text(kT, kE), kE);
  ASSERT_GT(blob.size(), 8u);
  in_.routing_blob = blob.data();
  in_.routing_blob_size = blob.size() - 1;  // truncated
  EXPECT_NE(colibri_infer(model_, &in_), COLIBRI_OK);
  EXPECT_TRUE(error_names({"routing"}));
  blob.back() ^= 0xff;  // payload byte flipped
  in_.routing_blob_size = blob.size();
  EXPECT_NE(colibri_infer(model_, &in_), COLIBRI_OK);
  EXPECT_TRUE(error_names({"routing"}));
  blob[0] ^= 0xff;  // magic
  EXPECT_NE(colibri_infer(model_, &in_), COLIBRI_OK);
  EXPECT_TRUE(error_names({"routing"}));
  EXPECT_TRUE(output_untouched());
}

TEST_F(InferErrorTest, InferCallsCountsSuccessesOnly) {
  colibri_stats_t st;
  ASSERT_EQ(colibri_stats(model_, &st), COLIBRI_OK);
  EXPECT_EQ(st.infer_calls, 0u);
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_OK);
  in_.top_k = 0;
  EXPECT_NE(colibri_infer(model_, &in_), COLIBRI_OK);
  in_.top_k = 2;
  in_.layer = 5;
  EXPECT_NE(colibri_infer(model_, &in_), COLIBRI_OK);
  in_.layer = 0;
  EXPECT_EQ(colibri_infer(model_, &in_), COLIBRI_OK);
  ASSERT_EQ(colibri_stats(model_, &st), COLIBRI_OK);
  EXPECT_EQ(st.infer_calls, 2u);
}

// ---------------------------------------------------- NULL for every entry

TEST_F(ApiTest, NullArgumentsEverywhere) {
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  colibri_model_t* m = reinterpret_cast<colibri_model_t*>(static_cast<uintptr_t>(0x1));
  EXPECT_EQ(colibri_open(nullptr, &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"path"}));
  EXPECT_EQ(m, nullptr);
  EXPECT_EQ(colibri_open(dir_.c_str(), &o, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"out_model"}));
  EXPECT_EQ(colibri_init(nullptr), nullptr);
  EXPECT_STRNE(colibri_last_error(), "");

  colibri_model_info_t info;
  colibri_stats_t stats;
  EXPECT_EQ(colibri_model_info(nullptr, &info), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"model"}));
  EXPECT_EQ(colibri_stats(nullptr, &stats), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"model"}));
  m = open_ok();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(colibri_model_info(m, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"info"}));
  EXPECT_EQ(colibri_stats(m, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"stats"}));
  colibri_free(m);

  colibri_route_compile_options_t co;
  colibri_route_compile_options_default(&co);
  co.n_experts = kE;
  const std::string text = simple_route_text(2, kE);
  void* blob = reinterpret_cast<void*>(static_cast<uintptr_t>(0x1));
  size_t size = 77;
  EXPECT_EQ(colibri_route_compile(nullptr, 10, "x", &co, &blob, &size), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"text"}));
  EXPECT_EQ(blob, nullptr);
  EXPECT_EQ(colibri_route_compile(text.data(), text.size(), "x", nullptr, &blob, &size),
            COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"options"}));
  EXPECT_EQ(colibri_route_compile(text.data(), text.size(), "x", &co, nullptr, &size),
            COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"out_blob"}));
  EXPECT_EQ(colibri_route_compile(text.data(), text.size(), "x", &co, &blob, nullptr),
            COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"out_blob_size"}));
  // source_name may be NULL.
  EXPECT_EQ(colibri_route_compile(text.data(), text.size(), nullptr, &co, &blob, &size), COLIBRI_OK)
      << colibri_last_error();
  EXPECT_NE(blob, nullptr);

  const std::string route_path = tmp_.path() + "/r.route";
  write_file(route_path, text);
  const std::string bin_path = tmp_.path() + "/r.bin";
  EXPECT_EQ(colibri_route_compile_file(nullptr, bin_path.c_str(), &co), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"route_path"}));
  EXPECT_EQ(colibri_route_compile_file(route_path.c_str(), nullptr, &co), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"out_path"}));
  EXPECT_EQ(colibri_route_compile_file(route_path.c_str(), bin_path.c_str(), nullptr),
            COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"options"}));

  colibri_routing_t* r = reinterpret_cast<colibri_routing_t*>(static_cast<uintptr_t>(0x1));
  EXPECT_EQ(colibri_routing_decode(nullptr, size, kE, "x", &r), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"blob"}));
  EXPECT_EQ(r, nullptr);
  EXPECT_EQ(colibri_routing_decode(blob, size, kE, "x", nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"out_routing"}));
  // source_name may be NULL.
  EXPECT_EQ(colibri_routing_decode(blob, size, kE, nullptr, &r), COLIBRI_OK) << colibri_last_error();
  EXPECT_EQ(colibri_routing_n_tokens(r), 2);
  colibri_routing_free(r);
  colibri_buffer_free(blob);

  r = reinterpret_cast<colibri_routing_t*>(static_cast<uintptr_t>(0x1));
  EXPECT_EQ(colibri_routing_load(nullptr, kE, 0, &r), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"path"}));
  EXPECT_EQ(r, nullptr);
  EXPECT_EQ(colibri_routing_load(route_path.c_str(), kE, 0, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"out_routing"}));

  EXPECT_EQ(colibri_verify_dir(nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"path"}));

  // Accessors and frees tolerate NULL.
  colibri_free(nullptr);
  colibri_routing_free(nullptr);
  colibri_buffer_free(nullptr);
  colibri_open_options_default(nullptr);
  colibri_infer_default(nullptr);
  colibri_route_compile_options_default(nullptr);
  EXPECT_EQ(colibri_routing_n_tokens(nullptr), 0);
  EXPECT_EQ(colibri_routing_top_k(nullptr), 0);
  EXPECT_EQ(colibri_routing_expert_ids(nullptr), nullptr);
  EXPECT_EQ(colibri_routing_expert_weights(nullptr), nullptr);
}

TEST_F(ApiTest, RouteTextErrorNamesSourceAndLine) {
  colibri_route_compile_options_t co;
  colibri_route_compile_options_default(&co);
  co.n_experts = kE;
  const std::string text = "0, 0, 1, 0.5, 0.5\n1, 1, 2, 0.5, 0.5\n2, 3, 9, 0.5, 0.5\n";
  void* blob = nullptr;
  size_t size = 0;
  EXPECT_EQ(colibri_route_compile(text.data(), text.size(), "bad.route", &co, &blob, &size),
            COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"bad.route:3", "9"}));
  EXPECT_EQ(blob, nullptr);

  const std::string path = tmp_.path() + "/bad.route";
  write_file(path, text);
  colibri_routing_t* r = nullptr;
  EXPECT_EQ(colibri_routing_load(path.c_str(), kE, 0, &r), COLIBRI_ERR_FORMAT);
  EXPECT_TRUE(error_names({"bad.route:3"}));
  EXPECT_EQ(r, nullptr);
  EXPECT_EQ(colibri_routing_load((tmp_.path() + "/absent.route").c_str(), kE, 0, &r), COLIBRI_ERR_IO);
  EXPECT_TRUE(error_names({"absent.route"}));
}

// ------------------------------------------------------- positive checks

TEST(ApiDefaults, OpenOptionsDefault) {
  colibri_open_options_t o;
  std::memset(&o, 0x7f, sizeof o);
  colibri_open_options_default(&o);
  EXPECT_EQ(o.n_threads, 0);
  EXPECT_EQ(o.lock_memory, 1);
  EXPECT_EQ(o.huge_pages, 1);
  EXPECT_EQ(o.verify_checksums, 1);
  EXPECT_EQ(o.pin_threads, 0);

  colibri_infer_t in;
  std::memset(&in, 0x7f, sizeof in);
  colibri_infer_default(&in);
  EXPECT_EQ(in.layer, 0);
  EXPECT_EQ(in.n_tokens, 0);
  EXPECT_EQ(in.n_threads, 0);
  EXPECT_EQ(in.input, nullptr);
  EXPECT_EQ(in.routing_blob, nullptr);
  EXPECT_EQ(in.routing_blob_size, 0u);

  colibri_route_compile_options_t co;
  std::memset(&co, 0x7f, sizeof co);
  colibri_route_compile_options_default(&co);
  EXPECT_EQ(co.n_experts, 0);
  EXPECT_EQ(co.compact, 0);
  EXPECT_EQ(co.q4_weights, 0);
  EXPECT_EQ(co.weight_encoding, COLIBRI_ROUTE_WEIGHTS_F32);
}

TEST(ApiDefaults, NamesAndVersion) {
  EXPECT_STREQ(colibri_status_name(COLIBRI_OK), "ok");
  for (int s = 0; s <= 7; ++s) {
    const char* name = colibri_status_name(static_cast<colibri_status_t>(s));
    ASSERT_NE(name, nullptr);
    EXPECT_STRNE(name, "");
  }
  EXPECT_NE(colibri_status_name(static_cast<colibri_status_t>(99)), nullptr);
  EXPECT_STREQ(colibri_dtype_name(COLIBRI_DTYPE_F32), "f32");
  EXPECT_STREQ(colibri_dtype_name(COLIBRI_DTYPE_F16), "f16");
  EXPECT_STREQ(colibri_dtype_name(COLIBRI_DTYPE_BF16), "bf16");
  EXPECT_NE(colibri_dtype_name(static_cast<colibri_dtype_t>(42)), nullptr);
  const std::string isa = colibri_cpu_isa();
  EXPECT_TRUE(isa == "scalar" || isa == "avx2" || isa == "avx512" || isa == "amx") << isa;
  const std::string v = colibri_version();
  EXPECT_EQ(v, std::to_string(COLIBRI_VERSION_MAJOR) + "." + std::to_string(COLIBRI_VERSION_MINOR) + "." +
                   std::to_string(COLIBRI_VERSION_PATCH));
}

TEST_F(ApiTest, ModelInfoAndStats) {
  colibri_model_t* m = open_ok(1);
  ASSERT_NE(m, nullptr);
  colibri_model_info_t info;
  std::memset(&info, 0x7f, sizeof info);
  ASSERT_EQ(colibri_model_info(m, &info), COLIBRI_OK);
  EXPECT_EQ(info.n_layers, 1);
  EXPECT_EQ(info.n_experts, kE);
  EXPECT_EQ(info.d_model, kD);
  EXPECT_EQ(info.d_ff, kF);
  EXPECT_EQ(info.dtype, COLIBRI_DTYPE_F16);
  EXPECT_EQ(info.n_threads, 1);
  EXPECT_EQ(info.format_version, 1);

  colibri_stats_t st;
  ASSERT_EQ(colibri_stats(m, &st), COLIBRI_OK);
  EXPECT_EQ(st.bytes_files, kE * kFileBytes);
  EXPECT_GE(st.bytes_mapped, kE * kFileBytes);
  EXPECT_LE(st.bytes_locked, st.bytes_mapped);
  EXPECT_LE(st.bytes_huge_pages, st.bytes_mapped);
  EXPECT_GT(st.load_seconds, 0.0);
  EXPECT_GE(st.verify_seconds, 0.0);
  EXPECT_LE(st.verify_seconds, st.load_seconds);
  EXPECT_EQ(st.infer_calls, 0u);
  if (st.bytes_huge_pages == 0) {
    EXPECT_EQ(st.huge_page_kind, COLIBRI_HUGE_PAGES_NONE);
  }
  colibri_free(m);

  // Default n_threads: at least one.
  m = open_ok(0);
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(colibri_model_info(m, &info), COLIBRI_OK);
  EXPECT_GE(info.n_threads, 1);
  colibri_free(m);
}

TEST_F(ApiTest, MultiLayerModelInfo) {
  TempDir other;
  colibri::ModelWriteSpec spec;
  spec.n_layers = 3;
  spec.n_experts = 2;
  spec.d_model = 5;
  spec.d_ff = 3;
  spec.dtype = colibri::WeightType::kBF16;
  colibri::write_random_model(other.path(), spec, 9);
  colibri_model_t* m = nullptr;
  ASSERT_EQ(colibri_open(other.path().c_str(), nullptr, &m), COLIBRI_OK) << colibri_last_error();
  colibri_model_info_t info;
  ASSERT_EQ(colibri_model_info(m, &info), COLIBRI_OK);
  EXPECT_EQ(info.n_layers, 3);
  EXPECT_EQ(info.dtype, COLIBRI_DTYPE_BF16);
  colibri_stats_t st;
  ASSERT_EQ(colibri_stats(m, &st), COLIBRI_OK);
  EXPECT_EQ(st.bytes_files, 3ull * 2 * 3 * 5 * 3 * 2);
  colibri_free(m);

  // A missing file in a later layer is named with its layer folder.
  std::filesystem::remove(other.path() + "/layer_02/expert_01.bin");
  EXPECT_EQ(open_status(other.path()), COLIBRI_ERR_IO);
  EXPECT_TRUE(error_names({"layer_02/expert_01.bin"}));
}

TEST_F(ApiTest, LockMemoryLocksOrWarns) {
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.lock_memory = 1;
  colibri_model_t* m = nullptr;
  ASSERT_EQ(colibri_open(dir_.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  const std::string warning = colibri_last_warning();
  colibri_stats_t st;
  ASSERT_EQ(colibri_stats(m, &st), COLIBRI_OK);
  if (st.bytes_locked != st.bytes_mapped) {
    EXPECT_EQ(st.bytes_locked, 0u);
    EXPECT_FALSE(warning.empty()) << "not locked but no warning";
    EXPECT_TRUE(contains(warning, "mlock")) << warning;
  }
  std::printf("lock_memory=1: bytes_locked %llu of %llu; warning: \"%s\"\n",
              static_cast<unsigned long long>(st.bytes_locked),
              static_cast<unsigned long long>(st.bytes_mapped), warning.c_str());
  colibri_free(m);

  // lock_memory=0 locks nothing and warns about nothing.
  o.lock_memory = 0;
  ASSERT_EQ(colibri_open(dir_.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  ASSERT_EQ(colibri_stats(m, &st), COLIBRI_OK);
  EXPECT_EQ(st.bytes_locked, 0u);
  EXPECT_STREQ(colibri_last_warning(), "");
  colibri_free(m);
}

TEST_F(ApiTest, OpenWithoutHugePagesOrOptions) {
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.huge_pages = 0;
  o.lock_memory = 0;
  o.pin_threads = 1;
  colibri_model_t* m = nullptr;
  ASSERT_EQ(colibri_open(dir_.c_str(), &o, &m), COLIBRI_OK) << colibri_last_error();
  colibri_stats_t st;
  ASSERT_EQ(colibri_stats(m, &st), COLIBRI_OK);
  EXPECT_EQ(st.bytes_huge_pages, 0u);
  EXPECT_EQ(st.huge_page_kind, COLIBRI_HUGE_PAGES_NONE);
  colibri_free(m);

  // NULL options = defaults.
  ASSERT_EQ(colibri_open(dir_.c_str(), nullptr, &m), COLIBRI_OK) << colibri_last_error();
  colibri_free(m);

  o.n_threads = -1;
  EXPECT_EQ(colibri_open(dir_.c_str(), &o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names({"n_threads"}));
  EXPECT_EQ(m, nullptr);
}

TEST_F(ApiTest, InitAndFreeSeedEntryPoints) {
  colibri_model_t* m = colibri_init(dir_.c_str());
  ASSERT_NE(m, nullptr) << colibri_last_error();
  colibri_model_info_t info;
  ASSERT_EQ(colibri_model_info(m, &info), COLIBRI_OK);
  EXPECT_EQ(info.n_experts, kE);
  colibri_free(m);

  EXPECT_EQ(colibri_init((tmp_.path() + "/missing").c_str()), nullptr);
  EXPECT_TRUE(error_names({"missing"}));
}

TEST_F(ApiTest, ErrorClearedBySuccessAndThreadLocal) {
  EXPECT_EQ(open_status(tmp_.path() + "/missing"), COLIBRI_ERR_IO);
  const std::string main_error = colibri_last_error();
  ASSERT_FALSE(main_error.empty());
  std::string other_error = "unset";
  std::thread([&] { other_error = colibri_last_error(); }).join();
  EXPECT_EQ(other_error, "");
  EXPECT_EQ(colibri_last_error(), main_error);
  EXPECT_EQ(colibri_verify_dir(dir_.c_str()), COLIBRI_OK);
  EXPECT_STREQ(colibri_last_error(), "");
}

}  // namespace
