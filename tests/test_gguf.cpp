// The GGUF parser: valid files read back exactly; every malformed file (as
// a damaged download or a hostile file would be) is refused with a FORMAT
// error naming the file and the key or tensor, never a crash or a read
// outside the bytes.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gguf_writer.h"
#include "io/gguf.h"
#include "util/error.h"

namespace {

using colibri::GgufFile;
using colibri::GgufType;
using colibri_test::GgufSpec;

colibri::GgufFile parse(const std::vector<uint8_t>& bytes) {
  return GgufFile::parse(bytes.data(), bytes.size(), "x.gguf");
}

void expect_format_error(const std::vector<uint8_t>& bytes, const std::vector<std::string>& needles) {
  try {
    parse(bytes);
    ADD_FAILURE() << "accepted";
  } catch (const colibri::Error& e) {
    EXPECT_EQ(e.status(), colibri::Status::kFormat) << e.what();
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("x.gguf: ", 0), 0u) << msg;
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}

std::vector<uint8_t> random_bytes(size_t n, std::mt19937& rng) {
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// A small valid file: metadata of every scalar kind, an array, and three
// tensors (f32, q8_0 3-D, q4_k).
GgufSpec valid_spec() {
  std::mt19937 rng(7);
  GgufSpec s;
  s.add_string("general.architecture", "qwen3moe");
  s.add_u32("qwen3moe.block_count", 2);
  s.add_f32("qwen3moe.rope.freq_base", 1e6f);
  s.add_bool("qwen3moe.expert_weights_norm", true);
  s.add_scalar<int32_t>("test.negative", 5, -3);
  s.add_scalar<uint64_t>("test.u64", 10, 1ull << 40);
  {
    colibri_test::GgufBytes b;
    b.put<uint32_t>(4);  // uint32 elements
    b.put<uint64_t>(3);
    for (uint32_t v : {10u, 20u, 30u}) b.put<uint32_t>(v);
    s.kvs.push_back({"test.array", 9, b.bytes});
  }
  {
    colibri_test::GgufBytes b;
    b.put<uint32_t>(8);  // string elements
    b.put<uint64_t>(2);
    b.put_string("a");
    b.put_string("bc");
    s.kvs.push_back({"tokenizer.ggml.tokens", 9, b.bytes});
  }
  s.add_tensor("blk.0.ffn_gate_inp.weight", {64, 8}, colibri::ggml_type::kF32, random_bytes(64 * 8 * 4, rng));
  s.add_tensor("blk.0.ffn_up_exps.weight", {64, 16, 8}, colibri::ggml_type::kQ8_0,
               random_bytes(2 * 34 * 16 * 8, rng));
  s.add_tensor("blk.0.ffn_down_exps.weight", {256, 2}, colibri::ggml_type::kQ4_K, random_bytes(2 * 144, rng));
  return s;
}

TEST(Gguf, ValidFileReadsBack) {
  const GgufSpec spec = valid_spec();
  const std::vector<uint8_t> bytes = spec.build();
  const GgufFile g = parse(bytes);
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.alignment(), 32u);
  EXPECT_EQ(g.data_offset() % 32, 0u);
  ASSERT_EQ(g.keys().size(), spec.kvs.size());
  for (size_t i = 0; i < spec.kvs.size(); ++i) EXPECT_EQ(g.keys()[i], spec.kvs[i].key);
  std::string arch;
  ASSERT_TRUE(g.get_string("general.architecture", &arch));
  EXPECT_EQ(arch, "qwen3moe");
  uint64_t blocks = 0;
  ASSERT_TRUE(g.get_uint("qwen3moe.block_count", &blocks));
  EXPECT_EQ(blocks, 2u);
  double base = 0;
  ASSERT_TRUE(g.get_float("qwen3moe.rope.freq_base", &base));
  EXPECT_EQ(base, 1e6);
  bool norm = false;
  ASSERT_TRUE(g.get_bool("qwen3moe.expert_weights_norm", &norm));
  EXPECT_TRUE(norm);
  uint64_t big = 0;
  ASSERT_TRUE(g.get_uint("test.u64", &big));
  EXPECT_EQ(big, 1ull << 40);
  EXPECT_FALSE(g.get_uint("absent.key", &big));
  // Wrong kinds are errors naming the key.
  EXPECT_THROW(g.get_uint("test.negative", &big), colibri::Error);
  EXPECT_THROW(g.get_string("qwen3moe.block_count", &arch), colibri::Error);
  EXPECT_THROW(g.get_uint("general.architecture", &big), colibri::Error);
  const colibri::GgufValue* arr = g.find("test.array");
  ASSERT_NE(arr, nullptr);
  EXPECT_EQ(arr->type, GgufType::kArray);
  EXPECT_EQ(arr->element_type, GgufType::kUint32);
  EXPECT_EQ(arr->numbers, (std::vector<double>{10, 20, 30}));
  EXPECT_EQ(g.find("tokenizer.ggml.tokens")->count, 2u);

  ASSERT_EQ(g.tensors().size(), 3u);
  uint64_t data_at = g.data_offset();
  for (const GgufSpec::Tensor& want : spec.tensors) {
    const colibri::GgufTensor* t = g.tensor(want.name);
    ASSERT_NE(t, nullptr) << want.name;
    EXPECT_EQ(t->type, want.type);
    EXPECT_EQ(t->n_dims, want.ne.size());
    for (size_t d = 0; d < want.ne.size(); ++d) EXPECT_EQ(t->ne[d], want.ne[d]);
    EXPECT_EQ(t->bytes, want.data.size());
    EXPECT_EQ(t->offset, data_at);
    EXPECT_EQ(std::memcmp(g.data(*t), want.data.data(), want.data.size()), 0) << want.name;
    data_at += (want.data.size() + 31) / 32 * 32;
  }
  EXPECT_EQ(g.tensor("blk.0.ffn_up_exps.weight")->rows(), 16u * 8u);
  EXPECT_EQ(g.tensor("nope"), nullptr);
}

TEST(Gguf, AlignmentKeyMovesTheData) {
  GgufSpec spec = valid_spec();
  spec.alignment = 64;
  spec.add_u32("general.alignment", 64);
  const std::vector<uint8_t> bytes = spec.build();
  const GgufFile g = parse(bytes);
  EXPECT_EQ(g.alignment(), 64u);
  EXPECT_EQ(g.data_offset() % 64, 0u);
  for (const GgufSpec::Tensor& want : spec.tensors) {
    EXPECT_EQ(std::memcmp(g.data(*g.tensor(want.name)), want.data.data(), want.data.size()), 0);
  }
}

TEST(Gguf, HeaderErrors) {
  std::vector<uint8_t> bytes = valid_spec().build();
  auto with = [&](size_t at, const std::vector<uint8_t>& patch) {
    std::vector<uint8_t> b = bytes;
    std::copy(patch.begin(), patch.end(), b.begin() + static_cast<std::ptrdiff_t>(at));
    return b;
  };
  expect_format_error(with(0, {'G', 'G', 'U', 'G'}), {"not a GGUF file"});
  expect_format_error(std::vector<uint8_t>{'G', 'G'}, {"not a GGUF file"});
  expect_format_error(with(4, {4, 0, 0, 0}), {"unknown GGUF version 4"});
  expect_format_error(with(4, {1, 0, 0, 0}), {"version 1"});
  expect_format_error(with(4, {0, 0, 0, 3}), {"big-endian"});
  // Counts: tensor count at byte 8, key/value count at 16.
  expect_format_error(with(8, {0, 0, 0, 0, 0, 1, 0, 0}), {"tensor count", "absurd"});
  expect_format_error(with(16, {0, 0, 0, 0, 0, 1, 0, 0}), {"key/value count", "absurd"});
  expect_format_error(with(16, {0, 0, 1, 0, 0, 0, 0, 0}), {"key/value pairs cannot fit"});
  expect_format_error(with(8, {0, 0, 1, 0, 0, 0, 0, 0}), {"tensors cannot fit"});
}

// Every prefix of a valid file short of its data fails cleanly (truncated
// header, key/value table, tensor table), and so does one that stops inside
// the last tensor's data.
TEST(Gguf, EveryTruncationIsAnError) {
  const std::vector<uint8_t> bytes = valid_spec().build();
  const GgufFile whole = parse(bytes);
  for (size_t n = 0; n < whole.data_offset(); ++n) {
    const std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(parse(cut), colibri::Error) << "prefix of " << n << " bytes";
  }
  std::vector<uint8_t> short_data(bytes.begin(), bytes.end() - 40);
  expect_format_error(short_data, {"tensor blk.0.ffn_down_exps.weight", "outside the file"});
}

TEST(Gguf, MetadataErrors) {
  {
    GgufSpec s = valid_spec();
    s.add_u32("qwen3moe.block_count", 3);
    expect_format_error(s.build(), {"duplicate key qwen3moe.block_count"});
  }
  {
    GgufSpec s = valid_spec();
    s.kvs.push_back({"bad.type", 13, {0, 0, 0, 0}});
    expect_format_error(s.build(), {"key bad.type", "unknown value type 13"});
  }
  {
    GgufSpec s = valid_spec();
    s.kvs.push_back({"bad.bool", 7, {2}});
    expect_format_error(s.build(), {"key bad.bool", "not 0 or 1"});
  }
  {
    // A string whose length runs past the end.
    GgufSpec s = valid_spec();
    colibri_test::GgufBytes b;
    b.put<uint64_t>(1ull << 50);
    s.kvs.push_back({"bad.string", 8, b.bytes});
    expect_format_error(s.build(), {"key bad.string", "runs past the end"});
  }
  {
    // An array whose count runs past the end, and one that overflows.
    for (uint64_t count : {uint64_t{1} << 40, ~uint64_t{0} / 2}) {
      GgufSpec s = valid_spec();
      colibri_test::GgufBytes b;
      b.put<uint32_t>(4);
      b.put<uint64_t>(count);
      s.kvs.push_back({"bad.array", 9, b.bytes});
      expect_format_error(s.build(), {"key bad.array", "run past the end"});
    }
    GgufSpec s = valid_spec();
    colibri_test::GgufBytes b;
    b.put<uint32_t>(8);
    b.put<uint64_t>(1ull << 40);
    s.kvs.push_back({"bad.strings", 9, b.bytes});
    expect_format_error(s.build(), {"key bad.strings", "cannot fit"});
  }
  {
    GgufSpec s = valid_spec();
    s.add_f32("general.alignment", 32.0f);
    expect_format_error(s.build(), {"general.alignment", "not uint32"});
    GgufSpec t = valid_spec();
    t.add_u32("general.alignment", 48);
    expect_format_error(t.build(), {"general.alignment", "not a power of two"});
  }
}

TEST(Gguf, TensorErrors) {
  std::mt19937 rng(9);
  auto spec_with = [&](const std::string& name, std::vector<uint64_t> ne, uint32_t type, size_t bytes) {
    GgufSpec s = valid_spec();
    s.add_tensor(name, std::move(ne), type, random_bytes(bytes, rng));
    return s;
  };
  expect_format_error(spec_with("blk.0.ffn_gate_inp.weight", {4}, 0, 16).build(),
                      {"duplicate tensor blk.0.ffn_gate_inp.weight"});
  expect_format_error(spec_with("t.unknown", {4}, 99, 16).build(), {"tensor t.unknown", "unknown tensor type 99"});
  expect_format_error(spec_with("t.removed", {32}, 4, 32).build(), {"tensor t.removed", "unknown tensor type 4"});
  expect_format_error(spec_with("t.blocks", {100, 2}, colibri::ggml_type::kQ4_K, 288).build(),
                      {"tensor t.blocks", "not whole Q4_K blocks of 256"});
  expect_format_error(spec_with("t.zero", {4, 0}, 0, 0).build(), {"tensor t.zero", "dimension 1 is 0"});
  expect_format_error(spec_with("t.dims", {1, 1, 1, 1, 1}, 0, 4).build(), {"tensor t.dims", "5 dimensions"});
  expect_format_error(spec_with("t.huge", {1ull << 32, 1ull << 32}, 0, 4).build(),
                      {"tensor t.huge", "multiply past"});
  expect_format_error(spec_with(std::string(64, 'n'), {4}, 0, 16).build(), {"longer than 63"});
  // Data claimed past the end (the writer lays out only the bytes given).
  expect_format_error(spec_with("t.big", {1024}, 0, 16).build(), {"tensor t.big", "outside the file"});
  {
    // A misaligned offset, and two tensors over the same bytes.
    std::vector<uint8_t> bytes = valid_spec().build();
    const GgufFile g = parse(bytes);
    const colibri::GgufTensor& last = g.tensors().back();
    // The offset field is the 8 bytes before the next tensor's name, or
    // before the data section's padding for the last one: find it by value.
    const uint64_t rel = last.offset - g.data_offset();
    size_t at = 0;
    for (size_t i = 24; i + 8 <= g.data_offset(); ++i) {
      uint64_t v;
      std::memcpy(&v, bytes.data() + i, 8);
      if (v == rel) at = i;
    }
    ASSERT_NE(at, 0u);
    std::vector<uint8_t> misaligned = bytes;
    const uint64_t off = rel + 4;
    std::memcpy(misaligned.data() + at, &off, 8);
    expect_format_error(misaligned, {"tensor blk.0.ffn_down_exps.weight", "not a multiple of the alignment 32"});
    std::vector<uint8_t> overlap = bytes;
    const uint64_t zero = 0;
    std::memcpy(overlap.data() + at, &zero, 8);
    expect_format_error(overlap, {"overlap"});
  }
}

// Random corruption of a valid file: refused or accepted, never a crash or
// a tensor outside the bytes (the fuzz target goes further).
TEST(Gguf, RandomCorruptionNeverEscapesTheBytes) {
  const std::vector<uint8_t> bytes = valid_spec().build();
  std::mt19937 rng(11);
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> b = bytes;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % 200] = static_cast<uint8_t>(rng());
    try {
      const GgufFile g = parse(b);
      for (const colibri::GgufTensor& t : g.tensors()) {
        ASSERT_LE(t.offset + t.bytes, b.size());
        ASSERT_GE(t.offset, g.data_offset());
      }
    } catch (const colibri::Error& e) {
      ASSERT_EQ(e.status(), colibri::Status::kFormat);
    }
  }
}

}  // namespace
