// Routing compiler: `.route` text parsing, routing.bin encoding/decoding, and
// rejection of malformed or hostile input (docs/FORMAT.md).
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moe/routing.h"
#include "util/error.h"
#include "util/half.h"

namespace colibri {
namespace {

constexpr const char* kText = "t.route";
constexpr const char* kBin = "r.bin";

// Runs f, expects a colibri::Error and returns it (status COLIBRI_OK if none).
Error error_from(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  return Error(colibri::Status::kOk, "(no error thrown)");
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// Parses text that must fail with Status::kFormat at `line` (0: no line)
// with a message containing `needle`.
void expect_text_error(const std::string& text, uint64_t line, const std::string& needle,
                       int32_t n_experts = 8, bool q4 = false) {
  SCOPED_TRACE("text: " + text.substr(0, 80));
  const Error e = error_from([&] { parse_route_text(text, kText, n_experts, q4); });
  EXPECT_EQ(e.status(), colibri::Status::kFormat) << e.what();
  const std::string msg = e.what();
  const std::string prefix =
      std::string(kText) + (line > 0 ? ":" + std::to_string(line) + ": " : ": ");
  EXPECT_TRUE(starts_with(msg, prefix)) << msg;
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

void expect_bin_error(const std::vector<uint8_t>& blob, colibri::Status status,
                      const std::string& needle, int32_t model_experts = 0) {
  const Error e =
      error_from([&] { decode_routing(blob.data(), blob.size(), model_experts, kBin); });
  EXPECT_EQ(e.status(), status) << e.what();
  const std::string msg = e.what();
  EXPECT_TRUE(starts_with(msg, std::string(kBin) + ": ")) << msg;
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

uint64_t get_le(const std::vector<uint8_t>& b, size_t off, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | b[off + static_cast<size_t>(i)];
  return v;
}

void put_le(std::vector<uint8_t>& b, size_t off, int n, uint64_t v) {
  for (int i = 0; i < n; ++i) b[off + static_cast<size_t>(i)] = static_cast<uint8_t>(v >> (8 * i));
}

// Independent checksum: one-shot XXH64 over header[0,32) ++ payload.
uint64_t reference_checksum(const std::vector<uint8_t>& b) {
  std::vector<uint8_t> input(b.begin(), b.begin() + 32);
  input.insert(input.end(), b.begin() + 40, b.end());
  return XXH64(input.data(), input.size(), 0);
}

// Rewrites the checksum so that a deliberately edited blob reaches the checks
// behind it.
void reseal(std::vector<uint8_t>& b) { put_le(b, 32, 8, reference_checksum(b)); }

Routing make_routing(int32_t n_tokens, int32_t n_experts, int32_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  Routing r;
  r.n_tokens = n_tokens;
  r.n_experts = n_experts;
  r.top_k = k;
  std::vector<int32_t> all(static_cast<size_t>(n_experts));
  for (int32_t e = 0; e < n_experts; ++e) all[static_cast<size_t>(e)] = e;
  std::uniform_real_distribution<float> weight(-0.5f, 2.0f);
  for (int32_t t = 0; t < n_tokens; ++t) {
    // Partial Fisher-Yates: k distinct experts.
    for (int32_t j = 0; j < k; ++j) {
      std::uniform_int_distribution<int32_t> pick(j, n_experts - 1);
      std::swap(all[static_cast<size_t>(j)], all[static_cast<size_t>(pick(rng))]);
      r.ids.push_back(all[static_cast<size_t>(j)]);
      r.weights.push_back(weight(rng));
    }
  }
  return r;
}

std::string float_text(float f) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(f));
  return buf;
}

std::string row_text(const Routing& r, int32_t t) {
  std::string s = std::to_string(t);
  const size_t base = static_cast<size_t>(t) * static_cast<size_t>(r.top_k);
  for (int32_t j = 0; j < r.top_k; ++j)
    s += ", " + std::to_string(r.ids[base + static_cast<size_t>(j)]);
  for (int32_t j = 0; j < r.top_k; ++j)
    s += ", " + float_text(r.weights[base + static_cast<size_t>(j)]);
  return s;
}

std::string to_text(const Routing& r) {
  std::string s = "# token, experts..., weights...\n";
  for (int32_t t = 0; t < r.n_tokens; ++t) s += row_text(r, t) + "\n";
  return s;
}

void expect_same_ids(const Routing& a, const Routing& b) {
  EXPECT_EQ(a.n_tokens, b.n_tokens);
  EXPECT_EQ(a.n_experts, b.n_experts);
  EXPECT_EQ(a.top_k, b.top_k);
  EXPECT_EQ(a.ids, b.ids);
}

// Decoded routing must satisfy the format's invariants whatever the input was.
void expect_valid(const Routing& r) {
  ASSERT_EQ(r.ids.size(), static_cast<size_t>(r.n_tokens) * static_cast<size_t>(r.top_k));
  ASSERT_EQ(r.weights.size(), r.ids.size());
  for (int32_t t = 0; t < r.n_tokens; ++t) {
    const size_t base = static_cast<size_t>(t) * static_cast<size_t>(r.top_k);
    for (int32_t j = 0; j < r.top_k; ++j) {
      const int32_t id = r.ids[base + static_cast<size_t>(j)];
      ASSERT_GE(id, 0);
      ASSERT_LT(id, r.n_experts);
      ASSERT_TRUE(std::isfinite(r.weights[base + static_cast<size_t>(j)]));
      for (int32_t i = 0; i < j; ++i) ASSERT_NE(r.ids[base + static_cast<size_t>(i)], id);
    }
  }
}

std::vector<uint8_t> small_blob() {
  return encode_routing(make_routing(3, 8, 2, 7), false, WeightEncoding::kF32, kBin);
}

// ============================================================ round trips

TEST(RoutingRoundTrip, TextToBinF32IsExact) {
  const Routing src = make_routing(50, 8, 3, 1);
  const Routing parsed = parse_route_text(to_text(src), kText, 8, false);
  expect_same_ids(parsed, src);
  EXPECT_EQ(parsed.weights, src.weights);

  const std::vector<uint8_t> blob = encode_routing(parsed, false, WeightEncoding::kF32, kBin);
  ASSERT_EQ(blob.size(), 40u + 50u * 3u * (1u + 4u));
  const Routing back = decode_routing(blob.data(), blob.size(), 8, kBin);
  expect_same_ids(back, src);
  EXPECT_EQ(back.weights, src.weights);
  EXPECT_EQ(back.id_encoding, IdEncoding::kU8);
  EXPECT_EQ(back.weight_encoding, WeightEncoding::kF32);
}

TEST(RoutingRoundTrip, HeaderLayout) {
  const Routing r = make_routing(5, 8, 2, 2);
  const std::vector<uint8_t> b = encode_routing(r, false, WeightEncoding::kF32, kBin);
  ASSERT_EQ(b.size(), 40u + 5u * 2u * 5u);
  EXPECT_EQ(b[0], 0xc0);
  EXPECT_EQ(b[1], 0x6c);
  EXPECT_EQ(b[2], 0x31);
  EXPECT_EQ(b[3], 0x62);
  EXPECT_EQ(get_le(b, 4, 2), 1u);
  EXPECT_EQ(get_le(b, 6, 2), 40u);
  EXPECT_EQ(get_le(b, 8, 4), 5u);
  EXPECT_EQ(get_le(b, 12, 4), 8u);
  EXPECT_EQ(get_le(b, 16, 2), 2u);
  EXPECT_EQ(b[18], 1);  // u8 ids
  EXPECT_EQ(b[19], 1);  // f32 weights
  EXPECT_EQ(get_le(b, 20, 4), 0u);
  EXPECT_EQ(get_le(b, 24, 8), 50u);
  EXPECT_EQ(get_le(b, 32, 8), reference_checksum(b));
  // Payload: ids in token order, then weights as little-endian IEEE bits.
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(b[40 + i], static_cast<uint8_t>(r.ids[i]));
    EXPECT_EQ(get_le(b, 50 + 4 * i, 4), float_bits(r.weights[i]));
  }
  EXPECT_TRUE(has_routing_magic(b.data(), b.size()));
  EXPECT_FALSE(has_routing_magic(b.data(), 3));
  EXPECT_FALSE(has_routing_magic("0, 1", 4));
}

TEST(RoutingRoundTrip, F16WithinHalfPrecision) {
  const Routing src = make_routing(40, 16, 4, 3);
  const std::vector<uint8_t> blob = encode_routing(src, false, WeightEncoding::kF16, kBin);
  ASSERT_EQ(blob.size(), 40u + 40u * 4u * (1u + 2u));
  EXPECT_EQ(blob[19], 2);
  const Routing back = decode_routing(blob.data(), blob.size(), 16, kBin);
  expect_same_ids(back, src);
  EXPECT_EQ(back.weight_encoding, WeightEncoding::kF16);
  for (size_t i = 0; i < src.weights.size(); ++i) {
    const float w = src.weights[i];
    EXPECT_EQ(back.weights[i], f16_to_float(float_to_f16(w)));
    EXPECT_NEAR(back.weights[i], w, std::fabs(w) * (1.0f / 2048.0f) + 1e-7f);
  }
}

TEST(RoutingRoundTrip, U16IdsFor300Experts) {
  Routing src = make_routing(30, 300, 5, 4);
  src.ids[0] = 299;  // the widest id must survive
  src.ids[1] = 256;
  for (size_t j = 2; j < 5; ++j) src.ids[j] = static_cast<int32_t>(j);
  const Routing parsed = parse_route_text(to_text(src), kText, 300, false);
  expect_same_ids(parsed, src);
  EXPECT_EQ(parsed.id_encoding, IdEncoding::kU16);
  const std::vector<uint8_t> blob = encode_routing(parsed, false, WeightEncoding::kF32, kBin);
  ASSERT_EQ(blob.size(), 40u + 30u * 5u * (2u + 4u));
  EXPECT_EQ(blob[18], 2);
  EXPECT_EQ(get_le(blob, 40, 2), 299u);
  const Routing back = decode_routing(blob.data(), blob.size(), 300, kBin);
  expect_same_ids(back, src);
  EXPECT_EQ(back.weights, src.weights);
  EXPECT_EQ(back.id_encoding, IdEncoding::kU16);
}

TEST(RoutingRoundTrip, ExactlyTwoHundredFiftySixExpertsUseU8) {
  Routing src = make_routing(4, 256, 2, 5);
  src.ids[0] = 255;
  src.ids[1] = 0;
  const std::vector<uint8_t> blob = encode_routing(src, false, WeightEncoding::kF32, kBin);
  EXPECT_EQ(blob[18], 1);
  expect_same_ids(decode_routing(blob.data(), blob.size(), 0, kBin), src);
}

TEST(RoutingRoundTrip, CompactQuantisesToQ15) {
  const std::string text =
      "0, 1, 3, 0.6, 0.4\n"
      "1, 2, 0, 1.4, 0\n"     // clamps to q = 15
      "2, 3, 2, -0.3, 1\n"    // clamps to q = 0
      "3, 0, 1, 0.5, 0.5\n";  // 7.5 rounds away from zero: q = 8
  const Routing r = parse_route_text(text, kText, 4, false);
  const std::vector<uint8_t> blob = encode_routing(r, true, WeightEncoding::kF32, kBin);
  ASSERT_EQ(blob.size(), 40u + 4u);
  EXPECT_EQ(blob[18], 0);
  EXPECT_EQ(blob[19], 0);
  EXPECT_EQ(get_le(blob, 24, 8), 4u);
  EXPECT_EQ(blob[40], 1 | (3 << 2) | (9 << 4));
  EXPECT_EQ(blob[41], 2 | (0 << 2) | (15 << 4));
  EXPECT_EQ(blob[42], 3 | (2 << 2) | (0 << 4));
  EXPECT_EQ(blob[43], 0 | (1 << 2) | (8 << 4));

  const Routing back = decode_routing(blob.data(), blob.size(), 4, kBin);
  expect_same_ids(back, r);
  EXPECT_EQ(back.id_encoding, IdEncoding::kCompact);
  EXPECT_EQ(back.weight_encoding, WeightEncoding::kCompactQ4);
  const uint32_t q[] = {9, 15, 0, 8};
  for (size_t t = 0; t < 4; ++t) {
    EXPECT_EQ(back.weights[2 * t], static_cast<float>(q[t]) / 15.0f);
    EXPECT_EQ(back.weights[2 * t + 1], 1.0f - static_cast<float>(q[t]) / 15.0f);
  }
  // Re-encoding the decoded routing reproduces the bytes.
  EXPECT_EQ(encode_routing(back, true, WeightEncoding::kF32, kBin), blob);
}

TEST(RoutingRoundTrip, CompactNeedsFourExpertsAndTopTwo) {
  const Routing wide = make_routing(3, 8, 2, 6);
  Error e = error_from([&] { encode_routing(wide, true, WeightEncoding::kF32, kBin); });
  EXPECT_EQ(e.status(), colibri::Status::kInvalidArgument);
  EXPECT_TRUE(starts_with(e.what(), "r.bin: compact")) << e.what();
  EXPECT_NE(std::string(e.what()).find("n_experts is 8"), std::string::npos) << e.what();

  const Routing top3 = make_routing(3, 4, 3, 6);
  e = error_from([&] { encode_routing(top3, true, WeightEncoding::kF32, kBin); });
  EXPECT_EQ(e.status(), colibri::Status::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("top_k is 3"), std::string::npos) << e.what();
}

TEST(RoutingRoundTrip, Q4Weights) {
  const Routing r = parse_route_text("0, 1, 2, 15, 0\n1, 0, 3, 7, 8\n", kText, 4, true);
  ASSERT_EQ(r.weights.size(), 4u);
  EXPECT_EQ(r.weights[0], 1.0f);
  EXPECT_EQ(r.weights[1], 0.0f);
  EXPECT_EQ(r.weights[2], 7.0f / 15.0f);
  EXPECT_EQ(r.weights[3], 8.0f / 15.0f);
  // q4 codes survive the compact encoding exactly.
  const std::vector<uint8_t> blob = encode_routing(r, true, WeightEncoding::kF32, kBin);
  const Routing back = decode_routing(blob.data(), blob.size(), 4, kBin);
  EXPECT_EQ(back.weights[0], 1.0f);
  EXPECT_EQ(back.weights[2], 7.0f / 15.0f);
  EXPECT_EQ(back.weights[3], 1.0f - 7.0f / 15.0f);

  expect_text_error("0, 1, 2, 1.5, 0\n", 1, "'1.5' is not a q4 code", 4, true);
  expect_text_error("0, 1, 2, 3, 0\n1, 1, 2, 16, 0\n", 2, "'16' is not a q4 code", 4, true);
  expect_text_error("0, 1, 2, -1, 0\n", 1, "'-1' is not a q4 code", 4, true);
}

TEST(RoutingText, CrlfSpacesTabsAndComments) {
  const std::string text =
      "# exported by hand\r\n"
      "   \t# indented comment\r\n"
      "\r\n"
      "   \t \r\n"
      " 1 ,\t2, 3 , 0.25,0.75\t\r\n"
      "\t0,0,1,\t-0.5 ,  1.5\r\n"
      "# trailing comment";
  const Routing r = parse_route_text(text, kText, 4, false);
  ASSERT_EQ(r.n_tokens, 2);
  EXPECT_EQ(r.top_k, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(r.weights, (std::vector<float>{-0.5f, 1.5f, 0.25f, 0.75f}));
}

TEST(RoutingText, LastLineWithoutNewlineAndWeightSyntax) {
  const Routing r = parse_route_text("0, 0, 1, 1e-3, .5\n1, 1, 0, 2.5E+1, 7.\n2, 3, 2, -0, 1e-50",
                                     kText, 4, false);
  ASSERT_EQ(r.n_tokens, 3);
  EXPECT_EQ(r.weights[0], 1e-3f);
  EXPECT_EQ(r.weights[1], 0.5f);
  EXPECT_EQ(r.weights[2], 25.0f);
  EXPECT_EQ(r.weights[3], 7.0f);
  EXPECT_EQ(r.weights[4], 0.0f);
  EXPECT_EQ(r.weights[5], 0.0f);  // too small for float32: flushed to zero
}

TEST(RoutingText, ShuffledTokenOrder) {
  const Routing src = make_routing(100, 16, 2, 8);
  std::vector<std::string> lines;
  for (int32_t t = 0; t < src.n_tokens; ++t) lines.push_back(row_text(src, t));
  std::mt19937 rng(12345);
  std::shuffle(lines.begin(), lines.end(), rng);
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  const Routing r = parse_route_text(text, kText, 16, false);
  expect_same_ids(r, src);
  EXPECT_EQ(r.weights, src.weights);
}

TEST(RoutingText, LineLengthLimitIsExactlySixtyFourKiB) {
  std::string line = "0, 0, 1, 0.5, 0.5";
  line += std::string(65536 - line.size(), ' ');
  EXPECT_NO_THROW(parse_route_text(line + "\r\n", kText, 2, false));
  EXPECT_NO_THROW(parse_route_text(line, kText, 2, false));
  expect_text_error("# c\n" + line + " \n", 2, "longer than 65536", 2);
  expect_text_error("# c\n" + line + " ", 2, "longer than 65536", 2);
}

TEST(RoutingText, NegativeAndLargeWeightsAreLegal) {
  const Routing r = parse_route_text("0, 0, 1, -3.5, 1000\n", kText, 2, false);
  EXPECT_EQ(r.weights, (std::vector<float>{-3.5f, 1000.0f}));
}

// ============================================================ bad text

TEST(RoutingTextErrors, EmptyOrOnlyComments) {
  expect_text_error("", 0, "no data lines");
  expect_text_error("# nothing\n\n   \n# here\r\n", 0, "no data lines");
}

TEST(RoutingTextErrors, ColumnCounts) {
  expect_text_error("0\n", 1, "1 columns");
  expect_text_error("# c\n0, 1\n", 2, "2 columns");
  expect_text_error("0, 1, 2, 0.5\n", 1, "4 columns");
  expect_text_error("0, 1, 0.5\n\n1, 2, 3, 0.5, 0.5\n", 3, "5 columns, but line 1 has 3");
  expect_text_error("0, 1, 2, 0.5, 0.5\n1, 2, 0.5\n", 2, "3 columns, but line 1 has 5");
}

TEST(RoutingTextErrors, EmptyFields) {
  expect_text_error("0, , 2, 0.5, 0.5\n", 1, "empty field (column 2)");
  expect_text_error("0, 1, 2, 0.5, 0.5,\n", 1, "empty field (column 6)");
  expect_text_error(",0, 1, 0.5\n", 1, "empty field (column 1)");
}

TEST(RoutingTextErrors, NonNumericFields) {
  expect_text_error("x, 1, 0.5\n", 1, "token id 'x' is not an integer");
  expect_text_error("0, 1, 0.5\n1.0, 2, 0.5\n", 2, "token id '1.0' is not an integer");
  expect_text_error("+0, 1, 0.5\n", 1, "token id '+0' is not an integer");
  expect_text_error("0, a, 0.5\n", 1, "expert id 'a' is not an integer (column 2)");
  expect_text_error("0, 0x1, 0.5\n", 1, "expert id '0x1' is not an integer");
  expect_text_error("0, 1, abc\n", 1, "weight 'abc' is not a number (column 3)");
  expect_text_error("0, 1, 1e\n", 1, "weight '1e' is not a number");
  expect_text_error("0, 1, 0.5 0.5\n", 1, "weight '0.5 0.5' is not a number");
  expect_text_error("0, 1, \xff\xfe\n", 1, "weight '\\xff\\xfe' is not a number");
}

TEST(RoutingTextErrors, ExpertIdsOutOfRange) {
  expect_text_error("0, 9, 0.5\n", 1, "expert id 9 out of range [0, 8)");
  expect_text_error("0, 1, 0.5\n1, 8, 0.5\n", 2, "expert id 8 out of range [0, 8)");
  expect_text_error("0, -1, 0.5\n", 1, "expert id -1 out of range [0, 8)");
  expect_text_error("0, 99999999999999999999999, 0.5\n", 1, "out of range [0, 8)");
}

TEST(RoutingTextErrors, RepeatedExpertInLine) {
  expect_text_error("0, 1, 2, 0.5, 0.5\n1, 2, 2, 0.5, 0.5\n", 2,
                    "expert id 2 repeated (columns 2 and 3)");
  expect_text_error("0, 5, 1, 5, 0.3, 0.3, 0.4\n", 1, "expert id 5 repeated (columns 2 and 4)");
}

TEST(RoutingTextErrors, TopKAboveExpertCount) {
  expect_text_error("0, 0, 1, 2, 0.3, 0.3, 0.4\n", 1,
                    "top-k 3 (from 7 columns) exceeds n_experts 2", 2);
}

TEST(RoutingTextErrors, RepeatedTokenId) {
  expect_text_error("0, 1, 0.5\n# c\n1, 2, 0.5\n\n1, 3, 0.5\n", 5,
                    "token id 1 repeated (first on line 3)");
}

TEST(RoutingTextErrors, MissingTokenId) {
  expect_text_error("0, 1, 0.5\n1, 2, 0.5\n3, 3, 0.5\n", 3,
                    "token id 3 out of range [0, 3) (3 data lines, so token id 2 is missing)");
  expect_text_error("5, 1, 0.5\n", 1, "token id 0 is missing");
  // The first problem in file order is reported.
  expect_text_error("0, 1, 0.5\n7, 1, 0.5\n0, 1, 0.5\n", 2, "token id 7 out of range");
  expect_text_error("0, 1, 0.5\n0, 1, 0.5\n7, 1, 0.5\n", 2,
                    "token id 0 repeated (first on line 1)");
}

TEST(RoutingTextErrors, TokenIdSign) {
  expect_text_error("-1, 1, 0.5\n", 1, "token id -1 is negative");
  expect_text_error("-99999999999999999999999, 1, 0.5\n", 1, "is negative");
  expect_text_error("99999999999999999999999, 1, 0.5\n", 1, "too large");
  expect_text_error("268435456, 1, 0.5\n", 1, "too large");
}

TEST(RoutingTextErrors, NonFiniteWeights) {
  expect_text_error("0, 1, nan\n", 1, "weight 'nan' is not finite (column 3)");
  expect_text_error("0, 1, 0.5\n1, 1, -inf\n", 2, "weight '-inf' is not finite");
  expect_text_error("0, 1, infinity\n", 1, "is not finite");
  expect_text_error("0, 1, 2, 0.5, NAN(1)\n", 1, "is not finite (column 5)");
  expect_text_error("0, 1, 1e39\n", 1, "weight '1e39' out of float32 range");
  expect_text_error("0, 1, -1e400\n", 1, "out of float32 range");
}

TEST(RoutingTextErrors, MegabyteLine) {
  std::string text = "0, 1, 0.5\n";
  for (int i = 0; i < (1 << 19); ++i) text += "1,";
  text += "0.5\n";
  expect_text_error(text, 2, "line longer than 65536 bytes");
  // Same without any newline at all.
  expect_text_error(std::string(1 << 20, '7'), 1, "line longer than 65536 bytes");
}

TEST(RoutingTextErrors, BinaryGarbage) {
  expect_text_error(std::string("0, 1, 0.5\n1, 2, 0.5\n2, 3,\0 0.5\n", 31), 3,
                    "control character 0x00 at column 6");
  expect_text_error("0, 1, 0.5\n1, 2\r, 0.5\n", 2, "control character 0x0d at column 5");
  expect_text_error("# \x1b[31m\n", 1, "control character 0x1b");
  expect_text_error("0, 1, 0.5\x7f\n", 1, "control character 0x7f");
  // A routing.bin passed as text: its version field holds a control byte.
  const std::vector<uint8_t> blob = small_blob();
  expect_text_error(std::string(blob.begin(), blob.end()), 1, "control character 0x01 at column 5");
}

TEST(RoutingTextErrors, ExpertCountArgument) {
  for (const int32_t n : {0, -3, kMaxRoutingExperts + 1}) {
    const Error e = error_from([&] { parse_route_text("0, 0, 1\n", kText, n, false); });
    EXPECT_EQ(e.status(), colibri::Status::kInvalidArgument) << e.what();
    EXPECT_TRUE(starts_with(e.what(), "t.route: n_experts")) << e.what();
  }
  EXPECT_NO_THROW(parse_route_text("0, 65535, 1\n", kText, kMaxRoutingExperts, false));
}

TEST(RoutingTextErrors, DefaultSourceName) {
  const Error e = error_from([&] { parse_route_text("0, 9, 1\n", "", 8, false); });
  EXPECT_TRUE(starts_with(e.what(), "<route text>:1: ")) << e.what();
}

// Random edits of a valid file: each parse either succeeds with a valid
// routing or fails with a FORMAT error naming the source; never crashes.
TEST(RoutingTextErrors, RandomEditsFailCleanly) {
  const std::string base = to_text(make_routing(12, 6, 2, 9));
  const std::string alphabet = "0123456789,.-+eE \t\r\n#naif\0\x01\xff";
  std::mt19937 rng(2024);
  for (int iter = 0; iter < 3000; ++iter) {
    std::string text = base;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % text.size();
      const char c = alphabet[rng() % alphabet.size()];
      switch (rng() % 3) {
        case 0:
          text[at] = c;
          break;
        case 1:
          text.insert(text.begin() + static_cast<std::ptrdiff_t>(at), c);
          break;
        default:
          text.erase(at, 1);
          break;
      }
    }
    try {
      expect_valid(parse_route_text(text, kText, 6, false));
    } catch (const Error& err) {
      ASSERT_EQ(err.status(), colibri::Status::kFormat) << err.what();
      ASSERT_TRUE(starts_with(err.what(), "t.route:")) << err.what();
    }
  }
}

// ============================================================ encode arguments

TEST(RoutingEncodeErrors, InvalidRoutingIsRejected) {
  const Routing good = make_routing(3, 8, 2, 10);
  const auto expect_bad = [](const Routing& r, WeightEncoding enc, const std::string& needle) {
    const Error e = error_from([&] { encode_routing(r, false, enc, kBin); });
    EXPECT_EQ(e.status(), colibri::Status::kInvalidArgument) << e.what();
    EXPECT_TRUE(starts_with(e.what(), "r.bin: ")) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  };
  Routing r = good;
  r.ids.pop_back();
  expect_bad(r, WeightEncoding::kF32, "entries");
  r = good;
  r.ids[3] = 8;
  expect_bad(r, WeightEncoding::kF32, "token 1: expert id 8 out of range");
  r = good;
  r.ids[5] = r.ids[4];
  expect_bad(r, WeightEncoding::kF32, "token 2: expert id");
  r = good;
  r.weights[1] = std::numeric_limits<float>::quiet_NaN();
  expect_bad(r, WeightEncoding::kF32, "not finite");
  r = good;
  r.weights[2] = 1e5f;
  expect_bad(r, WeightEncoding::kF16, "does not fit in f16");
  expect_bad(good, WeightEncoding::kCompactQ4, "not a general-mode encoding");
  r = good;
  r.top_k = 0;
  expect_bad(r, WeightEncoding::kF32, "top_k 0");
  r = good;
  r.n_experts = 0;
  expect_bad(r, WeightEncoding::kF32, "n_experts 0");
  r = good;
  r.n_tokens = -1;
  expect_bad(r, WeightEncoding::kF32, "n_tokens -1");
}

// ============================================================ blobs

TEST(RoutingBlob, ZeroTokens) {
  Routing r;
  r.n_tokens = 0;
  r.n_experts = 8;
  r.top_k = 2;
  for (const bool compact : {false, true}) {
    if (compact) r.n_experts = 4;
    const std::vector<uint8_t> blob = encode_routing(r, compact, WeightEncoding::kF16, kBin);
    ASSERT_EQ(blob.size(), 40u);
    const Routing back = decode_routing(blob.data(), blob.size(), 0, kBin);
    EXPECT_EQ(back.n_tokens, 0);
    EXPECT_EQ(back.top_k, 2);
    EXPECT_TRUE(back.ids.empty());
    const RoutingHeader h = parse_routing_header(blob.data(), blob.size(), 8, kBin);
    decode_routing_payload(h, blob.data(), nullptr, nullptr, kBin);
  }
}

TEST(RoutingBlob, HeaderAndPayloadIntoCallerArrays) {
  const Routing src = make_routing(7, 300, 3, 11);
  const std::vector<uint8_t> blob = encode_routing(src, false, WeightEncoding::kF32, kBin);
  const RoutingHeader h = parse_routing_header(blob.data(), blob.size(), 512, kBin);
  EXPECT_EQ(h.n_tokens, 7);
  EXPECT_EQ(h.n_experts, 300);
  EXPECT_EQ(h.top_k, 3);
  EXPECT_EQ(h.id_encoding, IdEncoding::kU16);
  EXPECT_EQ(h.weight_encoding, WeightEncoding::kF32);
  EXPECT_EQ(h.payload_bytes, 7u * 3u * 6u);
  std::vector<int32_t> ids(21, -7);
  std::vector<float> weights(21, -7.0f);
  decode_routing_payload(h, blob.data(), ids.data(), weights.data(), kBin);
  EXPECT_EQ(ids, src.ids);
  EXPECT_EQ(weights, src.weights);
}

// A blob produced by someone else's writer (here assembled by hand) and a
// payload placed at an odd address both decode: nothing relies on alignment.
TEST(RoutingBlob, HandAssembledAndMisaligned) {
  std::vector<uint8_t> b(40 + 2 * 2 * 3, 0);
  std::memcpy(b.data(), "\xc0\x6c\x31\x62", 4);
  put_le(b, 4, 2, 1);
  put_le(b, 6, 2, 40);
  put_le(b, 8, 4, 2);   // tokens
  put_le(b, 12, 4, 4);  // experts
  put_le(b, 16, 2, 2);  // top_k
  b[18] = 1;
  b[19] = 2;  // f16
  put_le(b, 24, 8, 12);
  b[40] = 3;
  b[41] = 0;
  b[42] = 1;
  b[43] = 2;
  put_le(b, 44, 2, 0x3c00);  // 1.0
  put_le(b, 46, 2, 0xb800);  // -0.5
  put_le(b, 48, 2, 0x3555);  // ~1/3
  put_le(b, 50, 2, 0x0001);  // smallest subnormal
  reseal(b);
  std::vector<uint8_t> shifted(b.size() + 1);
  std::memcpy(shifted.data() + 1, b.data(), b.size());
  const Routing r = decode_routing(shifted.data() + 1, b.size(), 4, kBin);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 0, 1, 2}));
  EXPECT_EQ(r.weights[0], 1.0f);
  EXPECT_EQ(r.weights[1], -0.5f);
  EXPECT_EQ(r.weights[2], f16_to_float(0x3555));
  EXPECT_EQ(r.weights[3], std::ldexp(1.0f, -24));
}

TEST(RoutingBlob, LargeTopKIsLinear) {
  // k = 4096 of 65536 experts per token: a quadratic duplicate check would
  // make such (hostile-sized) inputs slow; the bitmap keeps this instant.
  const Routing src = make_routing(64, kMaxRoutingExperts, 4096, 12);
  const std::vector<uint8_t> blob = encode_routing(src, false, WeightEncoding::kF16, kBin);
  const Routing back = decode_routing(blob.data(), blob.size(), 0, kBin);
  EXPECT_EQ(back.ids, src.ids);
}

// ============================================================ bad blobs

TEST(RoutingBlobErrors, BadMagic) {
  std::vector<uint8_t> b = small_blob();
  b[0] = 'R';
  expect_bin_error(b, colibri::Status::kFormat, "not a routing.bin file: bad magic");
  const std::string text = "0, 1, 0.5\n";
  expect_bin_error(std::vector<uint8_t>(text.begin(), text.end()), colibri::Status::kFormat, "bad magic");
  expect_bin_error({0x00}, colibri::Status::kFormat, "bad magic");
}

TEST(RoutingBlobErrors, Truncated) {
  expect_bin_error({}, colibri::Status::kFormat, "truncated: 0 bytes");
  std::vector<uint8_t> b = small_blob();
  expect_bin_error(std::vector<uint8_t>(b.begin(), b.begin() + 39), colibri::Status::kFormat,
                   "truncated: 39 bytes, shorter than the 40-byte header");
  expect_bin_error(std::vector<uint8_t>(b.begin(), b.end() - 1), colibri::Status::kFormat,
                   "truncated: header promises 30 payload bytes but only 29 follow");
}

TEST(RoutingBlobErrors, TrailingBytes) {
  std::vector<uint8_t> b = small_blob();
  b.push_back(0);
  expect_bin_error(b, colibri::Status::kFormat, "1 unexpected bytes after the payload");
}

TEST(RoutingBlobErrors, VersionAndHeaderBytes) {
  std::vector<uint8_t> b = small_blob();
  put_le(b, 4, 2, 2);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "unknown version 2");
  b = small_blob();
  put_le(b, 6, 2, 48);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "header_bytes 48, expected 40");
}

TEST(RoutingBlobErrors, ChecksumMismatch) {
  std::vector<uint8_t> b = small_blob();
  b[45] ^= 0x10;
  expect_bin_error(b, colibri::Status::kChecksum, "checksum mismatch");
  b = small_blob();
  b[35] ^= 1;
  expect_bin_error(b, colibri::Status::kChecksum, "checksum mismatch");
}

TEST(RoutingBlobErrors, Flags) {
  std::vector<uint8_t> b = small_blob();
  put_le(b, 20, 4, 1);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "flags 1 must be 0");
}

TEST(RoutingBlobErrors, PayloadSizeDisagreesWithCounts) {
  std::vector<uint8_t> b = small_blob();  // 3 tokens x 2, u8 + f32 = 30 bytes
  b.push_back(0);
  put_le(b, 24, 8, 31);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat,
                   "payload_bytes 31 but 3 tokens x top_k 2 with u8 ids and f32 weights need 30");
  b = small_blob();
  put_le(b, 8, 4, 4);  // claims 4 tokens
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "need 40");
  b = small_blob();
  b[19] = 2;  // f16 would need 18 bytes
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "f16 weights need 18");
}

TEST(RoutingBlobErrors, HugeCountsDoNotOverflowOrAllocate) {
  std::vector<uint8_t> b = small_blob();
  put_le(b, 8, 4, 0xffffffffu);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "n_tokens 4294967295 exceeds the limit");
  b = small_blob();
  put_le(b, 8, 4, static_cast<uint64_t>(kMaxRoutingTokens));
  put_le(b, 12, 4, 65536);
  put_le(b, 16, 2, 65535);
  b[18] = 2;
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "payload_bytes 30 but 268435456 tokens");
  b = small_blob();
  put_le(b, 24, 8, ~uint64_t{0});
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "truncated: header promises 18446744073709551615");
}

TEST(RoutingBlobErrors, Encodings) {
  std::vector<uint8_t> b = small_blob();
  b[18] = 3;
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "unknown id_encoding 3");
  b = small_blob();
  b[19] = 9;
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "unknown weight_encoding 9");
  b = small_blob();
  b[18] = 0;
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "disagree");
  b = small_blob();
  b[18] = 2;  // u16 ids for 8 experts
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "id_encoding 2 does not match 8 experts");
  b = small_blob();
  b[18] = 0;
  b[19] = 0;  // compact, but 8 experts
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "compact encoding needs n_experts <= 4");
}

TEST(RoutingBlobErrors, TopK) {
  std::vector<uint8_t> b = small_blob();
  put_le(b, 16, 2, 0);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "top_k 0 out of range");
  b = small_blob();
  put_le(b, 16, 2, 9);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "top_k 9 out of range [1, n_experts 8]");
}

TEST(RoutingBlobErrors, ExpertCounts) {
  std::vector<uint8_t> b = small_blob();
  put_le(b, 12, 4, 0);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "n_experts 0 out of range");
  b = small_blob();
  put_le(b, 12, 4, 70000);
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "n_experts 70000 out of range [1, 65536]");

  const std::vector<uint8_t> for16 =
      encode_routing(make_routing(2, 16, 2, 13), false, WeightEncoding::kF32, kBin);
  expect_bin_error(for16, colibri::Status::kFormat, "routing is for 16 experts but the model has 8", 8);
  EXPECT_NO_THROW(decode_routing(for16.data(), for16.size(), 16, kBin));
  EXPECT_NO_THROW(decode_routing(for16.data(), for16.size(), 0, kBin));
}

TEST(RoutingBlobErrors, IdsInPayload) {
  std::vector<uint8_t> b = small_blob();  // ids at 40..45
  b[42] = 8;
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "token 1: expert id 8 out of range [0, 8)");
  b = small_blob();
  b[45] = b[44];
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat,
                   "token 2: expert id " + std::to_string(b[44]) + " appears twice");
  std::vector<uint8_t> wide =
      encode_routing(make_routing(2, 300, 2, 14), false, WeightEncoding::kF32, kBin);
  put_le(wide, 42, 2, 300);
  reseal(wide);
  expect_bin_error(wide, colibri::Status::kFormat, "token 0: expert id 300 out of range [0, 300)");
}

TEST(RoutingBlobErrors, NonFiniteWeights) {
  std::vector<uint8_t> b = small_blob();  // f32 weights at 46..69
  put_le(b, 46 + 4 * 3, 4, 0x7fc00000u);  // NaN: token 1, slot 1
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "token 1: weight in slot 1 is not finite");
  b = small_blob();
  put_le(b, 46, 4, 0xff800000u);  // -inf
  reseal(b);
  expect_bin_error(b, colibri::Status::kFormat, "token 0: weight in slot 0 is not finite");
  std::vector<uint8_t> half =
      encode_routing(make_routing(2, 8, 2, 15), false, WeightEncoding::kF16, kBin);
  put_le(half, 44 + 2 * 2, 2, 0x7c00);  // +inf: token 1, slot 0
  reseal(half);
  expect_bin_error(half, colibri::Status::kFormat, "token 1: weight in slot 0 is not finite");
}

TEST(RoutingBlobErrors, CompactIds) {
  Routing r = parse_route_text("0, 0, 1, 0.5, 0.5\n1, 2, 1, 0.5, 0.5\n", kText, 3, false);
  std::vector<uint8_t> b = encode_routing(r, true, WeightEncoding::kF32, kBin);
  std::vector<uint8_t> same = b;
  same[41] = static_cast<uint8_t>(2 | (2 << 2) | (5 << 4));
  reseal(same);
  expect_bin_error(same, colibri::Status::kFormat, "token 1: expert id 2 appears twice");
  std::vector<uint8_t> high = b;
  high[40] = static_cast<uint8_t>(0 | (3 << 2));  // id 3 with 3 experts
  reseal(high);
  expect_bin_error(high, colibri::Status::kFormat, "token 0: expert id 3 out of range [0, 3)");
}

TEST(RoutingBlobErrors, NullData) {
  const Error e = error_from([] { decode_routing(nullptr, 40, 0, kBin); });
  EXPECT_EQ(e.status(), colibri::Status::kInvalidArgument);
  expect_bin_error({}, colibri::Status::kFormat, "truncated");
  EXPECT_FALSE(has_routing_magic(nullptr, 10));
}

TEST(RoutingBlobErrors, DefaultSourceName) {
  const Error e = error_from([] { decode_routing("xx", 2, 0, ""); });
  EXPECT_TRUE(starts_with(e.what(), "<routing.bin>: ")) << e.what();
}

// Every single-bit flip of valid blobs is detected (checksum or header check).
TEST(RoutingBlobErrors, EveryBitFlipIsRejected) {
  const Routing compact_src =
      parse_route_text("0, 0, 1, 0.5, 0.5\n1, 3, 2, 0.2, 0.8\n", kText, 4, false);
  const std::vector<std::vector<uint8_t>> blobs = {
      small_blob(), encode_routing(compact_src, true, WeightEncoding::kF32, kBin),
      encode_routing(make_routing(2, 300, 2, 16), false, WeightEncoding::kF16, kBin)};
  for (const auto& good : blobs) {
    for (size_t i = 0; i < good.size(); ++i) {
      for (int bit = 0; bit < 8; ++bit) {
        std::vector<uint8_t> b = good;
        b[i] ^= static_cast<uint8_t>(1u << bit);
        const Error e = error_from([&] { decode_routing(b.data(), b.size(), 0, kBin); });
        ASSERT_TRUE(e.status() == colibri::Status::kChecksum || e.status() == colibri::Status::kFormat)
            << "byte " << i << " bit " << bit << ": " << e.what();
        ASSERT_TRUE(starts_with(e.what(), "r.bin: ")) << e.what();
      }
    }
  }
}

TEST(RoutingBlobErrors, EveryTruncationIsRejected) {
  for (const auto& good : {small_blob(), encode_routing(make_routing(3, 4, 2, 17), true,
                                                        WeightEncoding::kF32, kBin)}) {
    for (size_t n = 0; n < good.size(); ++n) {
      // A fresh exact-size copy, so ASan catches any read past the end.
      std::vector<uint8_t> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
      const Error e = error_from([&] { decode_routing(cut.data(), cut.size(), 0, kBin); });
      ASSERT_EQ(e.status(), colibri::Status::kFormat) << "length " << n << ": " << e.what();
      ASSERT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
    }
  }
}

// Random header and payload edits with a recomputed checksum reach every
// semantic check; decoding either yields a valid routing or a FORMAT error.
TEST(RoutingBlobErrors, ResealedRandomEditsFailCleanly) {
  const std::vector<std::vector<uint8_t>> seeds = {
      small_blob(), encode_routing(make_routing(4, 4, 2, 18), true, WeightEncoding::kF32, kBin),
      encode_routing(make_routing(3, 300, 3, 19), false, WeightEncoding::kF16, kBin)};
  std::mt19937 rng(777);
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<uint8_t> b = seeds[static_cast<size_t>(iter) % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      // Favour the count and encoding fields (bytes 8..31).
      const size_t at = (rng() % 2 == 0) ? 8 + rng() % 24 : rng() % b.size();
      if (at >= 32 && at < 40) continue;
      b[at] = static_cast<uint8_t>(rng() % 4 == 0 ? rng() % 5 : rng());
    }
    if (rng() % 4 == 0) b.resize(b.size() + rng() % 8);
    reseal(b);
    try {
      expect_valid(decode_routing(b.data(), b.size(), static_cast<int32_t>(rng() % 400), kBin));
    } catch (const Error& err) {
      ASSERT_EQ(err.status(), colibri::Status::kFormat) << err.what();
      ASSERT_TRUE(starts_with(err.what(), "r.bin: ")) << err.what();
    }
  }
}

}  // namespace
}  // namespace colibri
