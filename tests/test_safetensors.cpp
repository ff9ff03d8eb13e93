// The safetensors reader: valid files read back exactly; every malformed
// header (as a hostile or damaged checkpoint would have) is refused with a
// FORMAT error naming the file and the tensor, never a crash or a read
// outside the file.
#include <gtest/gtest.h>

#include <filesystem>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "lib/safetensors.h"
#include "safetensors_writer.h"
#include "test_util.h"
#include "util/error.h"
#include "util/half.h"

namespace {

using colibri::StDtype;
using colibri_test::encode_values;
using colibri_test::raw_safetensors;
using colibri_test::StEntry;

colibri::StHeader parse(const std::string& bytes) {
  return colibri::parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                    "x.safetensors");
}

// Parses `bytes`, expecting a FORMAT error whose message names the file and
// contains every needle.
void expect_format_error(const std::string& bytes, const std::vector<std::string>& needles) {
  try {
    parse(bytes);
    ADD_FAILURE() << "accepted";
  } catch (const colibri::Error& e) {
    EXPECT_EQ(e.status(), colibri::Status::kFormat) << e.what();
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("x.safetensors: ", 0), 0u) << msg;
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "no \"" << n << "\" in: " << msg;
  }
}

// Header text for one tensor entry.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":" + dtype + ",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
}

std::string one_tensor(const std::string& dtype, const std::string& shape, const std::string& offsets,
                       size_t data_bytes) {
  // Appended rather than "{" + ... : g++ 12 misreports that form under
  // -Werror=restrict.
  std::string header = "{";
  header += entry("t", dtype, shape, offsets);
  header += "}";
  return raw_safetensors(header, std::string(data_bytes, '\x11'));
}

TEST(Safetensors, ReadsEveryFloatDtypeExactly) {
  colibri_test::TempDir dir("st");
  const std::vector<float> f32 = colibri_test::random_values(12, 1, 3.0f);
  const std::vector<float> f16 = colibri_test::round_to("F16", colibri_test::random_values(6, 2));
  const std::vector<float> bf16 = colibri_test::round_to("BF16", colibri_test::random_values(10, 3, 100.0f));
  const std::vector<StEntry> entries = {
      {"model.a", "F32", {3, 4}, encode_values("F32", f32)},
      {"model.b", "F16", {6}, encode_values("F16", f16)},
      {"model.c", "BF16", {2, 5}, encode_values("BF16", bf16)},
      {"model.ids", "I64", {2}, std::string(16, '\x01')},
      {"model.scalar", "F32", {}, encode_values("F32", {2.5f})},
      {"model.empty", "BF16", {0, 7}, ""},
  };
  const std::string path = dir.path() + "/m.safetensors";
  colibri_test::write_bytes(path, colibri_test::safetensors_bytes(entries, {{"format", "pt"}}));

  const colibri::SafetensorsFile f(path);
  EXPECT_EQ(f.tensors().size(), entries.size());
  EXPECT_EQ(f.find("nope"), nullptr);
  const colibri::StTensor* a = f.find("model.a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, StDtype::kF32);
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(a->n_elements, 12u);
  EXPECT_EQ(a->n_bytes, 48u);

  std::vector<float> got(12);
  f.read_floats(*a, 0, 12, got.data());
  EXPECT_EQ(got, f32);
  f.read_floats(*a, 5, 3, got.data());  // a slice, as one expert of a fused tensor
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 3), std::vector<float>(f32.begin() + 5, f32.begin() + 8));
  f.read_floats(*f.find("model.b"), 0, 6, got.data());
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 6), f16);
  f.read_floats(*f.find("model.c"), 0, 10, got.data());
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 10), bf16);
  f.read_floats(*f.find("model.scalar"), 0, 1, got.data());
  EXPECT_EQ(got[0], 2.5f);
  EXPECT_EQ(f.find("model.scalar")->n_elements, 1u);
  EXPECT_EQ(f.find("model.empty")->n_elements, 0u);

  try {
    f.read_floats(*f.find("model.ids"), 0, 2, got.data());
    ADD_FAILURE() << "I64 converted";
  } catch (const colibri::Error& e) {
    EXPECT_EQ(e.status(), colibri::Status::kFormat);
    EXPECT_NE(std::string(e.what()).find("model.ids"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("I64"), std::string::npos) << e.what();
  }
}

// The file is read, not mapped: cut short after it was opened (someone
// rewriting the checkpoint mid-conversion), a read is an error, not SIGBUS.
TEST(Safetensors, FileTruncatedAfterOpenIsAnErrorNotACrash) {
  colibri_test::TempDir dir("st");
  const std::vector<float> values = colibri_test::random_values(4096, 5);
  const std::string path = dir.path() + "/m.safetensors";
  colibri_test::write_bytes(path, colibri_test::safetensors_bytes({{"w", "F32", {64, 64}, encode_values("F32", values)}}, {}));
  const colibri::SafetensorsFile f(path);
  const colibri::StTensor* w = f.find("w");
  ASSERT_NE(w, nullptr);
  std::vector<float> out(4096);
  f.read_floats(*w, 0, 4096, out.data());
  EXPECT_EQ(out, values);
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 5000);
  try {
    f.read_floats(*w, 0, 4096, out.data());
    FAIL() << "read past the new end of file succeeded";
  } catch (const colibri::Error& e) {
    EXPECT_EQ(e.status(), colibri::Status::kFormat);
    EXPECT_NE(std::string(e.what()).find("m.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, F32BitPatternsSurviveIncludingSpecials) {
  std::mt19937 rng(7);
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x00000001u, 0x7f800000u, 0xff800000u,
                                0x7fc00001u, 0x7f800001u, 0x3f800000u};
  for (int i = 0; i < 1000; ++i) bits.push_back(rng());
  std::string bytes;
  for (uint32_t u : bits) {
    for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<char>(u >> (8 * b)));
  }
  std::vector<float> out(bits.size());
  colibri::st_to_floats(StDtype::kF32, reinterpret_cast<const uint8_t*>(bytes.data()), bits.size(), out.data());
  for (size_t i = 0; i < bits.size(); ++i) EXPECT_EQ(colibri::float_bits(out[i]), bits[i]) << i;
}

TEST(Safetensors, EmptyHeaderAndPaddingAreValid) {
  EXPECT_TRUE(parse(raw_safetensors("{}")).tensors.empty());
  EXPECT_TRUE(parse(raw_safetensors("{}      ")).tensors.empty());
  EXPECT_TRUE(parse(raw_safetensors("{\"__metadata__\":{\"a\":\"b\"}}")).tensors.empty());
  const std::string header = "{" + entry("t", "\"F16\"", "[2]", "[0,4]") + "}  ";
  const colibri::StHeader h = parse(raw_safetensors(header, "abcd"));
  ASSERT_EQ(h.tensors.size(), 1u);
  EXPECT_EQ(h.data_start, 8 + header.size());
  EXPECT_EQ(h.tensors[0].offset, h.data_start);
  EXPECT_EQ(h.tensors[0].n_bytes, 4u);
}

TEST(Safetensors, RefusesBadLengths) {
  expect_format_error("", {"too short"});
  expect_format_error(std::string(7, '\0'), {"too short"});
  expect_format_error(colibri_test::le64(100) + "{}", {"header length 100", "past the end"});
  expect_format_error(colibri_test::le64(100'000'001) + "{}", {"exceeds the limit"});
  expect_format_error(colibri_test::le64(UINT64_MAX) + "{}", {"exceeds the limit"});
  expect_format_error(colibri_test::le64(0), {"not valid JSON"});
}

TEST(Safetensors, RefusesBadJson) {
  expect_format_error(raw_safetensors("{not json"), {"not valid JSON"});
  expect_format_error(raw_safetensors("{} trailing"), {"not valid JSON"});
  expect_format_error(raw_safetensors(std::string("{\"a\xff\":1}")), {"not valid JSON"});
  expect_format_error(raw_safetensors(std::string("{}\0\0\0", 5)), {"not valid JSON", "NUL byte at header offset 2"});
  expect_format_error(raw_safetensors(std::string("{\"a\":{}}\0{\"b\"", 13)), {"NUL byte"});
  for (const char* top : {"[1,2]", "\"text\"", "null", "42", "true"}) {
    expect_format_error(raw_safetensors(top), {"must be a JSON object"});
  }
  // Deep nesting must be refused, not recursed into until the stack ends.
  std::string deep(100000, '[');
  deep += std::string(100000, ']');
  expect_format_error(raw_safetensors(deep), {"must be a JSON object"});
  expect_format_error(raw_safetensors("{\"t\":" + deep + "}"), {"\"t\"", "must be an object"});
}

TEST(Safetensors, RefusesBadEntries) {
  expect_format_error(raw_safetensors("{\"t\":3}"), {"tensor \"t\"", "must be an object"});
  expect_format_error(raw_safetensors("{\"t\":{\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd"),
                      {"tensor \"t\"", "missing \"dtype\""});
  expect_format_error(raw_safetensors("{\"t\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", "abcd"),
                      {"tensor \"t\"", "missing \"shape\""});
  expect_format_error(raw_safetensors("{\"t\":{\"dtype\":\"F32\",\"shape\":[1]}}", "abcd"),
                      {"tensor \"t\"", "missing \"data_offsets\""});
  expect_format_error(raw_safetensors("{\"__metadata__\":[1]}"), {"__metadata__"});
  expect_format_error(raw_safetensors("{\"__metadata__\":{\"k\":1}}"), {"__metadata__", "\"k\""});
}

TEST(Safetensors, RefusesBadDtypes) {
  expect_format_error(one_tensor("\"F7\"", "[1]", "[0,4]", 4), {"tensor \"t\"", "unknown dtype \"F7\""});
  expect_format_error(one_tensor("\"f32\"", "[1]", "[0,4]", 4), {"tensor \"t\"", "unknown dtype"});
  expect_format_error(one_tensor("5", "[1]", "[0,4]", 4), {"tensor \"t\"", "unknown dtype 5"});
  expect_format_error(one_tensor("null", "[1]", "[0,4]", 4), {"tensor \"t\"", "unknown dtype"});
}

TEST(Safetensors, RefusesBadShapes) {
  expect_format_error(one_tensor("\"F32\"", "3", "[0,12]", 12), {"tensor \"t\"", "\"shape\" must be an array"});
  expect_format_error(one_tensor("\"F32\"", "[-1]", "[0,4]", 4), {"tensor \"t\"", "dimension -1"});
  expect_format_error(one_tensor("\"F32\"", "[1.5]", "[0,4]", 4), {"tensor \"t\"", "dimension 1.5"});
  expect_format_error(one_tensor("\"F32\"", "[\"2\"]", "[0,8]", 8), {"tensor \"t\"", "dimension \"2\""});
  expect_format_error(one_tensor("\"F32\"", "[1e30]", "[0,4]", 4), {"tensor \"t\"", "dimension"});
  expect_format_error(one_tensor("\"F32\"", "[99999999999999999999]", "[0,4]", 4), {"tensor \"t\"", "dimension"});
  // Products past 2^64 elements, or bytes past 2^64, with a zero or without.
  expect_format_error(one_tensor("\"F32\"", "[4294967296,4294967296,4294967296]", "[0,4]", 4),
                      {"tensor \"t\"", "overflows"});
  expect_format_error(one_tensor("\"F32\"", "[0,4294967296,4294967296,4294967296]", "[0,0]", 0),
                      {"tensor \"t\"", "overflows"});
  expect_format_error(one_tensor("\"F32\"", "[2305843009213693952,2]", "[0,4]", 4),
                      {"tensor \"t\"", "more than 2^64"});
  expect_format_error(one_tensor("\"F32\"", "[18446744073709551615]", "[0,4]", 4), {"tensor \"t\"", "more than 2^64"});
}

TEST(Safetensors, RefusesBadOffsets) {
  expect_format_error(one_tensor("\"F32\"", "[1]", "[0,4,8]", 8), {"tensor \"t\"", "data_offsets"});
  expect_format_error(one_tensor("\"F32\"", "[1]", "[4]", 8), {"tensor \"t\"", "data_offsets"});
  expect_format_error(one_tensor("\"F32\"", "[1]", "[-4,0]", 8), {"tensor \"t\"", "data_offsets"});
  expect_format_error(one_tensor("\"F32\"", "[1]", "[\"0\",4]", 8), {"tensor \"t\"", "data_offsets"});
  expect_format_error(one_tensor("\"F32\"", "[1]", "{\"a\":1}", 8), {"tensor \"t\"", "data_offsets"});
  expect_format_error(one_tensor("\"F32\"", "[1]", "[8,4]", 8), {"tensor \"t\"", "end before begin"});
  expect_format_error(one_tensor("\"F32\"", "[1]", "[4,8]", 7), {"tensor \"t\"", "past the end of the file"});
  expect_format_error(one_tensor("\"F32\"", "[1]", "[0,18446744073709551615]", 8), {"tensor \"t\"", "past the end"});
  expect_format_error(one_tensor("\"F32\"", "[2,2]", "[0,8]", 16), {"tensor \"t\"", "8 bytes", "needs 16"});
  expect_format_error(one_tensor("\"BF16\"", "[3]", "[0,8]", 8), {"tensor \"t\"", "needs 6"});
}

TEST(Safetensors, RefusesOverlapAndRepeatedNames) {
  const std::string data(16, '\0');
  expect_format_error(raw_safetensors("{" + entry("a", "\"F32\"", "[2]", "[0,8]") + "," +
                                      entry("b", "\"F32\"", "[2]", "[4,12]") + "}", data),
                      {"tensor \"b\"", "overlaps tensor \"a\""});
  expect_format_error(raw_safetensors("{" + entry("a", "\"F32\"", "[2]", "[8,16]") + "," +
                                      entry("b", "\"F32\"", "[2]", "[8,16]") + "}", data),
                      {"overlaps"});
  // A short tensor inside a long one, listed after it in offset order.
  expect_format_error(raw_safetensors("{" + entry("a", "\"F32\"", "[4]", "[0,16]") + "," +
                                      entry("b", "\"F32\"", "[1]", "[4,8]") + "," +
                                      entry("c", "\"F32\"", "[1]", "[8,12]") + "}", data),
                      {"overlaps tensor \"a\""});
  expect_format_error(raw_safetensors("{" + entry("a", "\"F32\"", "[2]", "[0,8]") + "," +
                                      entry("a", "\"F32\"", "[2]", "[8,16]") + "}", data),
                      {"tensor \"a\"", "more than once"});
  // Adjacent and zero-sized tensors are fine.
  EXPECT_EQ(parse(raw_safetensors("{" + entry("a", "\"F32\"", "[2]", "[0,8]") + "," +
                                  entry("z", "\"F32\"", "[0]", "[8,8]") + "," +
                                  entry("b", "\"F32\"", "[2]", "[8,16]") + "}", data))
                .tensors.size(),
            3u);
}

TEST(Safetensors, OpenErrorsNameThePath) {
  colibri_test::TempDir dir("st");
  for (const std::string& path : {dir.path() + "/missing.safetensors", dir.path()}) {
    try {
      colibri::SafetensorsFile f(path);
      ADD_FAILURE() << "opened " << path;
    } catch (const colibri::Error& e) {
      EXPECT_EQ(e.status(), colibri::Status::kIo);
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
  const std::string empty = dir.path() + "/empty.safetensors";
  colibri_test::write_bytes(empty, "");
  try {
    colibri::SafetensorsFile f(empty);
    ADD_FAILURE() << "opened an empty file";
  } catch (const colibri::Error& e) {
    EXPECT_EQ(e.status(), colibri::Status::kFormat);
    EXPECT_NE(std::string(e.what()).find(empty), std::string::npos) << e.what();
  }
}

// Whatever a parse accepts must be safe to read: inside the file, sized by
// its shape, no overlaps.
void check_invariants(const colibri::StHeader& h, size_t size) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const colibri::StTensor& t : h.tensors) {
    ASSERT_GE(t.offset, h.data_start);
    ASSERT_LE(t.offset, size);
    ASSERT_LE(t.n_bytes, size - t.offset);
    ASSERT_EQ(t.n_bytes, t.n_elements * colibri::st_dtype_size(t.dtype));
    ranges.emplace_back(t.offset, t.offset + t.n_bytes);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) ASSERT_GE(ranges[i].first, ranges[i - 1].second);
}

void parse_or_refuse(const std::string& bytes) {
  try {
    check_invariants(parse(bytes), bytes.size());
  } catch (const colibri::Error& e) {
    ASSERT_EQ(e.status(), colibri::Status::kFormat) << e.what();
  }
}

TEST(Safetensors, TruncationsAndMutationsNeverCrash) {
  const std::vector<StEntry> entries = {
      {"model.layers.0.w", "BF16", {4, 3}, encode_values("BF16", colibri_test::random_values(12, 4))},
      {"model.layers.1.w", "F32", {2}, encode_values("F32", {1.0f, -2.0f})},
      {"model.norm", "F16", {5}, encode_values("F16", colibri_test::random_values(5, 5))},
  };
  const std::string good = colibri_test::safetensors_bytes(entries, {{"k", "v"}});
  check_invariants(parse(good), good.size());
  for (size_t n = 0; n < good.size(); ++n) parse_or_refuse(good.substr(0, n));

  std::mt19937 rng(11);
  const std::string alphabet = "0123456789[]{},:\"-.eE \x00\xff";
  for (int iter = 0; iter < 20000; ++iter) {
    std::string bad = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      const size_t pos = rng() % bad.size();
      switch (rng() % 4) {
        case 0: bad[pos] = static_cast<char>(rng()); break;
        case 1: bad[pos] = alphabet[rng() % alphabet.size()]; break;
        case 2: bad.erase(pos, 1); break;
        default: bad.insert(pos, 1, alphabet[rng() % alphabet.size()]); break;
      }
    }
    SCOPED_TRACE(iter);
    parse_or_refuse(bad);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
