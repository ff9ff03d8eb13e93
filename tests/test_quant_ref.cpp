// Reference quantisers and dequantisers of the block formats (util/quant_ref):
// dequantisation of hand-built blocks (the field layouts), byte-exact
// agreement with ggml on fixed inputs (hashes taken from ggml's
// quantize_row_*_ref and dequantize_row_* built from its source), round-trip
// error bounds on several distributions, idempotence where the algorithm
// guarantees it, and degenerate inputs (zeros, underflow, values past the
// f16 range, infinities). Every call writes into poisoned buffers with guard
// bytes, so an unwritten or overrun byte fails. python/tests/
// test_quant_formats.py checks the same functions against the gguf package.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "util/half.h"
#include "util/quant_blocks.h"
#include "util/quant_ref.h"
#include "util/weight_format.h"

namespace colibri {
namespace {

struct Format {
  const char* name;
  WeightType type;
  size_t block;  // elements per block
  size_t bytes;  // bytes per block
  void (*quantize)(const float*, void*, size_t);
  void (*dequantize)(const void*, float*, size_t);
};

constexpr Format kQ8_0{"q8_0", WeightType::kQ8_0, kQK32, sizeof(BlockQ8_0), quantize_q8_0, dequantize_q8_0};
constexpr Format kQ4_0{"q4_0", WeightType::kQ4_0, kQK32, sizeof(BlockQ4_0), quantize_q4_0, dequantize_q4_0};
constexpr Format kQ4K{"q4_k", WeightType::kQ4_K, kQKK, sizeof(BlockQ4K), quantize_q4_k, dequantize_q4_k};
constexpr Format kQ5K{"q5_k", WeightType::kQ5_K, kQKK, sizeof(BlockQ5K), quantize_q5_k, dequantize_q5_k};
constexpr Format kQ6K{"q6_k", WeightType::kQ6_K, kQKK, sizeof(BlockQ6K), quantize_q6_k, dequantize_q6_k};
constexpr Format kMxfp4{"mxfp4", WeightType::kMXFP4, kQK32, sizeof(BlockMxfp4), quantize_mxfp4, dequantize_mxfp4};
constexpr Format kQ4_1{"q4_1", WeightType::kQ4_1, kQK32, sizeof(BlockQ4_1), quantize_q4_1, dequantize_q4_1};
constexpr Format kQ5_0{"q5_0", WeightType::kQ5_0, kQK32, sizeof(BlockQ5_0), quantize_q5_0, dequantize_q5_0};
constexpr Format kQ5_1{"q5_1", WeightType::kQ5_1, kQK32, sizeof(BlockQ5_1), quantize_q5_1, dequantize_q5_1};
constexpr Format kIq4Nl{"iq4_nl", WeightType::kIQ4_NL, kQK32, sizeof(BlockIq4Nl), quantize_iq4_nl,
                        dequantize_iq4_nl};
constexpr Format kIq4Xs{"iq4_xs", WeightType::kIQ4_XS, kQKK, sizeof(BlockIq4Xs), quantize_iq4_xs,
                        dequantize_iq4_xs};
constexpr Format kQ2K{"q2_k", WeightType::kQ2_K, kQKK, sizeof(BlockQ2K), quantize_q2_k, dequantize_q2_k};
constexpr Format kQ3K{"q3_k", WeightType::kQ3_K, kQKK, sizeof(BlockQ3K), quantize_q3_k, dequantize_q3_k};
constexpr Format kTq1_0{"tq1_0", WeightType::kTQ1_0, kQKK, sizeof(BlockTq1_0), quantize_tq1_0, dequantize_tq1_0};
constexpr Format kTq2_0{"tq2_0", WeightType::kTQ2_0, kQKK, sizeof(BlockTq2_0), quantize_tq2_0, dequantize_tq2_0};
const Format kFormats[] = {kQ8_0,  kQ4_0, kQ4K, kQ5K, kQ6K, kMxfp4,  kQ4_1,
                           kQ5_0,  kQ5_1, kIq4Nl, kIq4Xs, kQ2K, kQ3K, kTq1_0, kTq2_0};

constexpr size_t kGuard = 64;

// Quantises into two buffers poisoned differently (0xAB, 0x54), each with
// guard bytes behind it: both must come out equal (no byte left unwritten)
// and the guards intact (nothing written past n / block blocks).
std::vector<uint8_t> quantize(const Format& f, const std::vector<float>& x) {
  const size_t bytes = x.size() / f.block * f.bytes;
  std::vector<uint8_t> a(bytes + kGuard, 0xAB), b(bytes + kGuard, 0x54);
  f.quantize(x.data(), a.data(), x.size());
  f.quantize(x.data(), b.data(), x.size());
  for (size_t i = bytes; i < bytes + kGuard; ++i) {
    if (a[i] != 0xAB || b[i] != 0x54) {
      ADD_FAILURE() << f.name << ": quantize wrote past its " << bytes << " bytes (offset " << i << ")";
      break;
    }
  }
  a.resize(bytes);
  b.resize(bytes);
  EXPECT_EQ(a, b) << f.name << ": quantize left bytes unwritten";
  return a;
}

// As quantize: poisons are a quiet NaN and 0xABABABAB.
std::vector<float> dequantize(const Format& f, const std::vector<uint8_t>& q) {
  const size_t n = q.size() / f.bytes * f.block;
  const float poison_b = bits_float(0xABABABABu);
  std::vector<float> a(n + kGuard, std::numeric_limits<float>::quiet_NaN()), b(n + kGuard, poison_b);
  f.dequantize(q.data(), a.data(), n);
  f.dequantize(q.data(), b.data(), n);
  for (size_t i = n; i < n + kGuard; ++i) {
    if (!std::isnan(a[i]) || float_bits(b[i]) != 0xABABABABu) {
      ADD_FAILURE() << f.name << ": dequantize wrote past its " << n << " values (index " << i << ")";
      break;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (float_bits(a[i]) != float_bits(b[i])) {
      ADD_FAILURE() << f.name << ": dequantize left value " << i << " unwritten";
      break;
    }
  }
  a.resize(n);
  return a;
}

std::vector<float> round_trip(const Format& f, const std::vector<float>& x) { return dequantize(f, quantize(f, x)); }

double rel_l2(const std::vector<float>& y, const std::vector<float>& x) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double e = static_cast<double>(y[i]) - x[i];
    num += e * e;
    den += static_cast<double>(x[i]) * x[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool all_finite(const std::vector<float>& y) {
  for (float v : y) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

uint64_t fnv1a(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// A 64-bit LCG with exact float conversion: the same inputs on every
// platform and standard library (the golden hashes depend on them), unlike
// std:: distributions.
class Lcg {
 public:
  explicit Lcg(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    s_ = s_ * 6364136223846793005ull + 1442695040888963407ull;
    return s_;
  }
  // Uniform on [-1, 1) in steps of 2^-23.
  float uniform() { return static_cast<float>(static_cast<int32_t>(next() >> 40) - (1 << 23)) * 0x1p-23f; }

 private:
  uint64_t s_;
};

// ---------------------------------------------------------------------------
// The format table points at these functions.

TEST(QuantRef, WeightFormatTableUsesThem) {
  for (const Format& f : kFormats) {
    const WeightFormat& w = weight_format(f.type);
    EXPECT_EQ(w.block_elements, f.block) << f.name;
    EXPECT_EQ(w.block_bytes, f.bytes) << f.name;
    EXPECT_EQ(w.to_float, f.dequantize) << f.name;
    EXPECT_EQ(w.from_float, f.quantize) << f.name;
    EXPECT_STREQ(w.name, f.name);
  }
}

// Quantising on several threads gives the bytes one thread gives: rows not
// divisible by the thread count, rows padded to whole blocks, more threads
// than the work is split into.
TEST(QuantRef, ThreadedConversionIsBitIdentical) {
  const size_t rows = 49;
  const size_t n = 65600;  // not a multiple of 256: every row's last block is padded
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> w(rows * n);
  for (float& v : w) v = normal(rng);
  for (WeightType t : {WeightType::kQ8_0, WeightType::kQ4_K, WeightType::kQ6_K}) {
    const size_t bytes = rows * weight_row_bytes(t, n);
    std::vector<uint8_t> one(bytes, 0xa5);
    convert_rows_from_float(t, w.data(), rows, n, one.data(), 1);
    for (int threads : {2, 3, 64}) {
      std::vector<uint8_t> many(bytes, 0x5a);
      convert_rows_from_float(t, w.data(), rows, n, many.data(), threads);
      EXPECT_TRUE(many == one) << weight_format(t).name << " threads=" << threads;
    }
  }
}

// ---------------------------------------------------------------------------
// Dequantisation of hand-built blocks. Every expected value is a small
// integer times a power of two, exact in float whatever the operation order.

TEST(QuantRefLayout, Q8_0) {
  std::vector<uint8_t> raw(2 * sizeof(BlockQ8_0));
  auto* b = reinterpret_cast<BlockQ8_0*>(raw.data());
  b[0].d = float_to_f16(0.5f);
  b[1].d = float_to_f16(-2.0f);
  for (int j = 0; j < kQK32; ++j) {
    b[0].qs[j] = static_cast<int8_t>(8 * j - 128);
    b[1].qs[j] = static_cast<int8_t>(127 - j);
  }
  const std::vector<float> y = dequantize(kQ8_0, raw);
  for (int j = 0; j < kQK32; ++j) {
    EXPECT_EQ(y[j], 0.5f * static_cast<float>(8 * j - 128)) << j;
    EXPECT_EQ(y[kQK32 + j], -2.0f * static_cast<float>(127 - j)) << j;
  }
}

TEST(QuantRefLayout, Q4_0) {
  std::vector<uint8_t> raw(sizeof(BlockQ4_0));
  auto* b = reinterpret_cast<BlockQ4_0*>(raw.data());
  b->d = float_to_f16(2.0f);
  // Low nibbles are elements 0-15, high nibbles elements 16-31.
  for (int j = 0; j < 16; ++j) b->qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  const std::vector<float> y = dequantize(kQ4_0, raw);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 2.0f * static_cast<float>(j - 8)) << j;
    EXPECT_EQ(y[16 + j], 2.0f * static_cast<float>(7 - j)) << j;
  }
}

// Scales and mins with high bits set both in sub-blocks 0-3 (6-bit fields
// of bytes 0-7) and 4-7 (split between bytes 8-11 and the top bits of 0-7).
constexpr uint8_t kSc[8] = {1, 23, 45, 63, 17, 33, 50, 62};
constexpr uint8_t kMin[8] = {63, 5, 40, 16, 48, 3, 31, 60};

// The 12-byte scales field as quant_blocks.h describes it, written out by
// hand: byte j < 4 = sc_j | (sc_{j+4} >> 4) << 6, byte j + 4 = m_j |
// (m_{j+4} >> 4) << 6, byte j + 8 = (sc_{j+4} & 15) | (m_{j+4} & 15) << 4.
void pack_k_scales(uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(kSc[j] | ((kSc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(kMin[j] | ((kMin[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((kSc[j + 4] & 15) | ((kMin[j + 4] & 15) << 4));
  }
}

int k_nibble(int s, int l) { return (3 * l + 5 * s) & 15; }
int k_high_bit(int s, int l) { return (l + 2 * s) % 3 == 0 ? 1 : 0; }

TEST(QuantRefLayout, Q4K) {
  std::vector<uint8_t> raw(sizeof(BlockQ4K));
  auto* b = reinterpret_cast<BlockQ4K*>(raw.data());
  b->d = float_to_f16(0.25f);
  b->dmin = float_to_f16(0.5f);
  pack_k_scales(b->scales);
  // Chunk c of 32 bytes: low nibbles sub-block 2c, high nibbles 2c + 1.
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 32; ++l) b->qs[32 * (s / 2) + l] |= static_cast<uint8_t>(k_nibble(s, l) << (4 * (s % 2)));
  }
  const std::vector<float> y = dequantize(kQ4K, raw);
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 32; ++l) {
      const float expect = 0.25f * kSc[s] * static_cast<float>(k_nibble(s, l)) - 0.5f * kMin[s];
      ASSERT_EQ(y[32 * s + l], expect) << "sub-block " << s << " element " << l;
    }
  }
}

TEST(QuantRefLayout, Q5K) {
  std::vector<uint8_t> raw(sizeof(BlockQ5K));
  auto* b = reinterpret_cast<BlockQ5K*>(raw.data());
  b->d = float_to_f16(0.25f);
  b->dmin = float_to_f16(0.5f);
  pack_k_scales(b->scales);
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 32; ++l) {
      b->qs[32 * (s / 2) + l] |= static_cast<uint8_t>(k_nibble(s, l) << (4 * (s % 2)));
      b->qh[l] |= static_cast<uint8_t>(k_high_bit(s, l) << s);  // bit s: sub-block s
    }
  }
  const std::vector<float> y = dequantize(kQ5K, raw);
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 32; ++l) {
      const int q = k_nibble(s, l) + 16 * k_high_bit(s, l);
      const float expect = 0.25f * kSc[s] * static_cast<float>(q) - 0.5f * kMin[s];
      ASSERT_EQ(y[32 * s + l], expect) << "sub-block " << s << " element " << l;
    }
  }
}

TEST(QuantRefLayout, Q6K) {
  constexpr int8_t kScales[16] = {-128, -77, -1, 0, 1, 5, 33, 127, -64, 2, 3, -3, 100, -100, 64, 7};
  auto q6 = [](int e) { return (7 * e + e / 16) % 64; };
  std::vector<uint8_t> raw(sizeof(BlockQ6K));
  auto* b = reinterpret_cast<BlockQ6K*>(raw.data());
  b->d = float_to_f16(0.5f);
  std::memcpy(b->scales, kScales, sizeof kScales);
  // Element e = 128 h + 32 k + l: low nibble in ql[64 h + 32 (k % 2) + l]
  // (the high nibble for k >= 2), top two bits at bit 2 k of qh[32 h + l].
  for (int e = 0; e < kQKK; ++e) {
    const int h = e / 128, k = (e / 32) % 4, l = e % 32;
    b->ql[64 * h + 32 * (k % 2) + l] |= static_cast<uint8_t>((q6(e) & 15) << (4 * (k / 2)));
    b->qh[32 * h + l] |= static_cast<uint8_t>((q6(e) >> 4) << (2 * k));
  }
  const std::vector<float> y = dequantize(kQ6K, raw);
  for (int e = 0; e < kQKK; ++e) {
    const float expect = 0.5f * kScales[e / 16] * static_cast<float>(q6(e) - 32);
    ASSERT_EQ(y[e], expect) << "element " << e;
  }
}

// TQ1_0's bytes: every base-3 value v < 243 of five trits, stored as
// ceil(v * 256 / 243), gives back its trits most significant first.
TEST(QuantRefLayout, Tq1Trits) {
  for (int v = 0; v < 243; ++v) {
    const auto q = static_cast<uint8_t>((v * 256 + 242) / 243);
    int digits = v;
    for (int k = 4; k >= 0; --k, digits /= 3) ASSERT_EQ(tq1_trit(q, k), digits % 3) << "v " << v << " trit " << k;
  }
}

int tq_trit(int e) { return (7 * e + e / 5) % 3; }

TEST(QuantRefLayout, Tq1_0) {
  std::vector<uint8_t> raw(sizeof(BlockTq1_0));
  auto* b = reinterpret_cast<BlockTq1_0*>(raw.data());
  b->d = float_to_f16(-0.5f);
  // Byte l's trits, first most significant: elements l + 32 k (qs[0, 32)),
  // 160 + l + 16 k (qs[32, 48)), 240 + l + 4 k (qh, a fifth trit 0).
  auto pack = [](int first, int stride, int count) {
    int v = 0;
    for (int k = 0; k < 5; ++k) v = 3 * v + (k < count ? tq_trit(first + stride * k) : 0);
    return static_cast<uint8_t>((v * 256 + 242) / 243);
  };
  for (int l = 0; l < 32; ++l) b->qs[l] = pack(l, 32, 5);
  for (int l = 0; l < 16; ++l) b->qs[32 + l] = pack(160 + l, 16, 5);
  for (int l = 0; l < 4; ++l) b->qh[l] = pack(240 + l, 4, 4);
  const std::vector<float> y = dequantize(kTq1_0, raw);
  for (int e = 0; e < kQKK; ++e) ASSERT_EQ(y[e], -0.5f * static_cast<float>(tq_trit(e) - 1)) << "element " << e;
}

TEST(QuantRefLayout, Tq2_0) {
  auto code = [](int e) { return (5 * e + e / 7) % 4; };  // 3 included: it reads as 2
  std::vector<uint8_t> raw(sizeof(BlockTq2_0));
  auto* b = reinterpret_cast<BlockTq2_0*>(raw.data());
  b->d = float_to_f16(0.25f);
  for (int e = 0; e < kQKK; ++e) b->qs[32 * (e / 128) + e % 32] |= static_cast<uint8_t>(code(e) << (2 * ((e / 32) % 4)));
  const std::vector<float> y = dequantize(kTq2_0, raw);
  for (int e = 0; e < kQKK; ++e) ASSERT_EQ(y[e], 0.25f * static_cast<float>(code(e) - 1)) << "element " << e;
}

// ---------------------------------------------------------------------------
// Agreement with ggml. The hashes are FNV-1a of the bytes ggml's
// quantize_row_*_ref wrote for these inputs, and of the floats its
// dequantize_row_* produced from random blocks (ggml-org/ggml d99724f,
// ggml-quants.c built with -O2 -ffp-contract=off; the q8_0 / q4_0 bytes are
// also gguf 0.19.0's; the formats added since, from the ggml that
// llama-cpp-python 0.3.36 vendors, built the same way).

std::vector<float> golden_input(int which, size_t n) {
  Lcg g(static_cast<uint64_t>(which) + 1);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    const float v = g.uniform();
    switch (which) {
      case 0:
        x[i] = v;
        break;
      case 1:
        x[i] = v * v * v * 4.0f;  // heavy tails
        break;
      case 2:
        x[i] = -(std::fabs(v) + 0.25f);  // all negative
        break;
      default:
        x[i] = i % 61 == 0 ? (v < 0 ? -3.0f : 3.0f) : v * 0.05f;  // outliers
        break;
    }
  }
  return x;
}

TEST(QuantRefGgml, QuantizeBytes) {
  struct Golden {
    const Format* f;
    uint64_t hash[4];  // uniform, cubed, negative, outliers
  };
  const Golden kGolden[] = {
      {&kQ8_0, {0x062db304a5249ff2ull, 0xece172825d71b762ull, 0x6ba1d60b5179941bull, 0xcd7e4233a58df5b8ull}},
      {&kQ4_0, {0x4c635189703adebbull, 0xfc7a1002caee7c23ull, 0x892b3480bc4bf620ull, 0x79d0660268bc7030ull}},
      {&kQ4K, {0x95d2c8780eeb019bull, 0x77925fb0d4865a65ull, 0x2fddac47a330b141ull, 0xe5fb57991dbb6cd7ull}},
      {&kQ5K, {0x212a4d5a994a647aull, 0x8a5a54be531abd85ull, 0xbf062d66eba1ca3cull, 0xc99d4f5052d760b6ull}},
      {&kQ6K, {0xa21d51ab78932b75ull, 0x641c459e44c53beaull, 0xe6c3d84d79288ab9ull, 0x2b9561f7059a3d16ull}},
      // llama.cpp 0.3.36's vendored ggml (ggml 0.25.3), same build flags.
      {&kQ4_1, {0xd61d996cfbd2c319ull, 0xabc0050dda39378dull, 0x349acdae34f11aaaull, 0x94f481e325a2256cull}},
      {&kQ5_0, {0xdc1dc75288bd1d5aull, 0x189837a8f3b1a74dull, 0x4f0b05220c23c004ull, 0xcc3c0f3198acd8e8ull}},
      {&kQ5_1, {0xbf488d7345d6d350ull, 0xc52bbc7c79b3a13eull, 0xac1421dcf6f99c1cull, 0x7765a1605e22f638ull}},
      // iq4_nl: ggml's quantize_iq4_nl without an importance matrix (what
      // llama-quantize writes; its quantize_row_iq4_nl_ref skips the scale search).
      {&kIq4Nl, {0xde127e7b96dc1371ull, 0xfda40b588c415cfeull, 0xd751fb34dd24a3b9ull, 0x6fbfb9d08ca30eb5ull}},
      {&kIq4Xs, {0x4e7326014e008c15ull, 0xd03489bc0e4511b9ull, 0x568b18a94604ed98ull, 0x333ce1e8e22aa07aull}},
      {&kQ2K, {0x476f163ae9052cbfull, 0xfe99129eec52af9eull, 0xfc475c3514d36616ull, 0x5af20433247efd96ull}},
      {&kQ3K, {0xc2bcf38b5bbfc22full, 0x5818d38c15937a0bull, 0xc40600024401c7bfull, 0x598223549aafb800ull}},
      // The gguf package's TQ1_0 / TQ2_0 quantize_blocks (gguf 0.19.0,
      // NumPy ports of ggml's quantize_row_tq*_ref) on these inputs.
      {&kTq1_0, {0xf774bb1273562706ull, 0x78b63882e77c6652ull, 0xca104d2c8ac65b4aull, 0xdbe6bd6b7d577188ull}},
      {&kTq2_0, {0xb09713ba2ded283aull, 0xfdf1b73a6044b4daull, 0x1ca9a7d15eb689edull, 0xccd968f348d4e08eull}},
  };
  for (const Golden& g : kGolden) {
    for (int which = 0; which < 4; ++which) {
      const std::vector<uint8_t> q = quantize(*g.f, golden_input(which, 32 * kQKK));
      EXPECT_EQ(fnv1a(q.data(), q.size()), g.hash[which]) << g.f->name << " input " << which;
    }
  }
}

// Random bytes, with every f16 scale field made finite (an all-ones
// exponent loses its top bit).
std::vector<uint8_t> random_blocks(const Format& f, size_t blocks, uint64_t seed) {
  Lcg g(seed);
  std::vector<uint8_t> raw(blocks * f.bytes);
  for (uint8_t& byte : raw) byte = static_cast<uint8_t>(g.next() >> 56);
  std::vector<size_t> fields;  // the f16 scale fields of a block
  if (f.type == WeightType::kQ6_K) {
    fields = {offsetof(BlockQ6K, d)};
  } else if (f.type == WeightType::kQ3_K) {
    fields = {offsetof(BlockQ3K, d)};
  } else if (f.type == WeightType::kQ2_K) {
    fields = {offsetof(BlockQ2K, d), offsetof(BlockQ2K, dmin)};
  } else if (f.type == WeightType::kTQ1_0) {
    fields = {offsetof(BlockTq1_0, d)};
  } else if (f.type == WeightType::kTQ2_0) {
    fields = {offsetof(BlockTq2_0, d)};
  } else if (f.type == WeightType::kQ4_K || f.type == WeightType::kQ5_K || f.type == WeightType::kQ4_1 ||
             f.type == WeightType::kQ5_1) {
    fields = {0, 2};  // d, dmin / m
  } else {
    fields = {0};
  }
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t off : fields) {
      auto h = static_cast<uint16_t>(g.next() >> 48);
      if ((h & 0x7c00u) == 0x7c00u) h ^= 0x4000u;
      raw[b * f.bytes + off] = static_cast<uint8_t>(h & 0xff);
      raw[b * f.bytes + off + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
  return raw;
}

TEST(QuantRefGgml, DequantizeRandomBlocks) {
  struct Golden {
    const Format* f;
    uint64_t hash;
  };
  const Golden kGolden[] = {
      {&kQ8_0, 0xeb272a8693422c7eull}, {&kQ4_0, 0x8fa679c27d5c9561ull}, {&kQ4K, 0xf6d99785bb4c638eull},
      {&kQ5K, 0xc3dbcc0c40c4f726ull},  {&kQ6K, 0x8287abfcfa62b2d3ull},
      // llama.cpp 0.3.36's vendored ggml.
      {&kQ4_1, 0x874e7067f68900e3ull}, {&kQ5_0, 0xd2c88d2fabfa1c96ull}, {&kQ5_1, 0x0b764fd6fbe88b06ull},
      {&kIq4Nl, 0xd2be4bb2f1a3ca1cull}, {&kIq4Xs, 0x879f53c43ab3484bull}, {&kQ2K, 0x42ed37be6ebe4a68ull},
      {&kQ3K, 0xa2ff919f35d0c5fdull},
      // The gguf package's TQ1_0 / TQ2_0 dequantize_blocks (gguf 0.19.0).
      {&kTq1_0, 0x801178b520f96d2full}, {&kTq2_0, 0xf201435fb3210506ull},
  };
  for (const Golden& g : kGolden) {
    const std::vector<float> y = dequantize(*g.f, random_blocks(*g.f, 2048 / g.f->block, 11));
    EXPECT_EQ(fnv1a(y.data(), y.size() * sizeof(float)), g.hash) << g.f->name;
  }
  // The formats read, not made (no quantiser): their dequantiser alone.
  const Format iq2_xxs{"iq2_xxs", WeightType::kIQ2_XXS, kQKK, sizeof(BlockIq2Xxs), nullptr, dequantize_iq2_xxs};
  EXPECT_EQ(weight_format(WeightType::kIQ2_XXS).from_float, nullptr);
  EXPECT_EQ(weight_format(WeightType::kIQ2_XXS).to_float, dequantize_iq2_xxs);
  const std::vector<float> y = dequantize(iq2_xxs, random_blocks(iq2_xxs, 2048 / kQKK, 11));
  EXPECT_EQ(fnv1a(y.data(), y.size() * sizeof(float)), 0xe3b58efc1d8a69cdull) << "iq2_xxs";
  // These hashes are our dequantisers' own, pinned after
  // python/tests/test_quant_formats.py found them bit-identical to the gguf
  // package's on random blocks (not taken from ggml's C).
  const Format read_only[] = {
      {"iq3_xxs", WeightType::kIQ3_XXS, kQKK, sizeof(BlockIq3Xxs), nullptr, dequantize_iq3_xxs},
      {"iq1_s", WeightType::kIQ1_S, kQKK, sizeof(BlockIq1S), nullptr, dequantize_iq1_s},
      {"iq1_m", WeightType::kIQ1_M, kQKK, sizeof(BlockIq1M), nullptr, dequantize_iq1_m},
      {"iq2_xs", WeightType::kIQ2_XS, kQKK, sizeof(BlockIq2Xs), nullptr, dequantize_iq2_xs},
      {"iq2_s", WeightType::kIQ2_S, kQKK, sizeof(BlockIq2S), nullptr, dequantize_iq2_s},
      {"iq3_s", WeightType::kIQ3_S, kQKK, sizeof(BlockIq3S), nullptr, dequantize_iq3_s},
  };
  const uint64_t read_only_hashes[] = {0x225e1d094ad5571eull, 0xd669592fd7948c51ull, 0xaaaaf4eddf6b03acull,
                                       0x24e52f98ce0977b6ull, 0x72944609542c58d0ull, 0x62744073ea68e691ull};
  for (size_t i = 0; i < std::size(read_only); ++i) {
    const Format& f = read_only[i];
    EXPECT_EQ(weight_format(f.type).from_float, nullptr) << f.name;
    EXPECT_EQ(weight_format(f.type).to_float, f.dequantize) << f.name;
    const std::vector<float> z = dequantize(f, random_blocks(f, 2048 / kQKK, 11));
    EXPECT_EQ(fnv1a(z.data(), z.size() * sizeof(float)), read_only_hashes[i]) << f.name;
  }
}

// ---------------------------------------------------------------------------
// Round trips on random data. Bounds are about 1.5x the relative L2 errors
// measured with these seeds (libstdc++'s distributions).

enum class Dist { kNormal, kUniform, kHeavy, kNegative, kOutlier, kSmall, kLarge };
constexpr Dist kDists[] = {Dist::kNormal, Dist::kUniform,  Dist::kHeavy, Dist::kNegative,
                           Dist::kOutlier, Dist::kSmall, Dist::kLarge};
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal:
      return "normal";
    case Dist::kUniform:
      return "uniform";
    case Dist::kHeavy:
      return "student-t3";
    case Dist::kNegative:
      return "negative";
    case Dist::kOutlier:
      return "outlier";
    case Dist::kSmall:
      return "small(1e-3)";
    case Dist::kLarge:
      return "large(1e3)";
  }
  return "?";
}

std::vector<float> random_data(Dist d, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::student_t_distribution<float> heavy(3.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    switch (d) {
      case Dist::kNormal:
        x[i] = normal(rng);
        break;
      case Dist::kUniform:
        x[i] = uniform(rng);
        break;
      case Dist::kHeavy:
        x[i] = heavy(rng);
        break;
      case Dist::kNegative:
        x[i] = -std::fabs(normal(rng)) - 0.1f;
        break;
      case Dist::kOutlier:
        // One weight per 256 fifty times the spread of the others.
        x[i] = i % kQKK == 77 ? 1.0f : 0.02f * normal(rng);
        break;
      case Dist::kSmall:
        x[i] = 1e-3f * normal(rng);
        break;
      case Dist::kLarge:
        x[i] = 1e3f * normal(rng);
        break;
    }
  }
  return x;
}

// Indexed by format (kFormats order), then Dist.
constexpr double kRoundTripBound[15][7] = {
    // normal uniform heavy  negative outlier small  large
    {0.008, 0.0057, 0.017, 0.0078, 0.018, 0.0083, 0.008},  // q8_0
    {0.13, 0.098, 0.17, 0.126, 0.165, 0.13, 0.13},         // q4_0
    {0.107, 0.083, 0.118, 0.056, 0.147, 0.108, 0.107},     // q4_k
    {0.054, 0.042, 0.069, 0.029, 0.073, 0.056, 0.054},     // q5_k
    {0.0265, 0.02, 0.043, 0.0256, 0.05, 0.031, 0.0265},    // q6_k
    {0.17, 0.21, 0.22, 0.17, 0.17, 0.17, 0.17},             // mxfp4 (power-of-two scales, no 7-8x level)
    {0.082, 0.061, 0.097, 0.041, 0.116, 0.079, 0.078},     // q4_1
    {0.043, 0.032, 0.061, 0.041, 0.09, 0.043, 0.043},       // q5_0
    {0.04, 0.03, 0.051, 0.02, 0.053, 0.039, 0.038},         // q5_1
    {0.077, 0.065, 0.094, 0.073, 0.109, 0.077, 0.076},      // iq4_nl
    {0.078, 0.065, 0.099, 0.074, 0.112, 0.081, 0.077},      // iq4_xs
    {0.305, 0.24, 0.315, 0.17, 0.215, 0.305, 0.3},          // q2_k (four levels)
    {0.156, 0.128, 0.156, 0.149, 0.097, 0.157, 0.154},      // q3_k
    // The ternary formats at 1.05x (1.5x would pass all zeros): three
    // levels under one scale per 256, the same values in both.
    {0.85, 0.53, 0.63, 0.85, 0.32, 0.85, 0.84},             // tq1_0
    {0.85, 0.53, 0.63, 0.85, 0.32, 0.85, 0.84},             // tq2_0
};
static_assert(std::size(kRoundTripBound) == std::size(kFormats));

TEST(QuantRefRoundTrip, RandomData) {
  constexpr size_t kN = 64 * kQKK;
  for (size_t fi = 0; fi < std::size(kFormats); ++fi) {
    const Format& f = kFormats[fi];
    for (size_t di = 0; di < std::size(kDists); ++di) {
      const std::vector<float> x = random_data(kDists[di], kN, 1234 + static_cast<uint32_t>(di));
      const std::vector<float> y = round_trip(f, x);
      ASSERT_TRUE(all_finite(y)) << f.name << " " << dist_name(kDists[di]);
      const double err = rel_l2(y, x);
      EXPECT_LT(err, kRoundTripBound[fi][di]) << f.name << " " << dist_name(kDists[di]);
    }
  }
}

// Zero blocks, and zero sub-blocks inside non-zero blocks, come back as
// exact zeros, the rest within the normal-data bound.
TEST(QuantRefRoundTrip, ZeroBlocks) {
  for (const Format& f : kFormats) {
    std::vector<float> x = random_data(Dist::kNormal, 4 * kQKK, 99);
    std::fill(x.begin(), x.begin() + kQKK, 0.0f);                           // a whole super-block
    std::fill(x.begin() + kQKK + 32, x.begin() + kQKK + 64, 0.0f);          // a 32-element sub-block
    std::fill(x.begin() + 2 * kQKK + 16, x.begin() + 2 * kQKK + 32, 0.0f);  // a 16-element one
    const std::vector<float> y = round_trip(f, x);
    // Exact where the format's whole sub-block (the unit of a scale and
    // min) is zero; q4_K, q5_K, q4_1 and q5_1 have 32-element ones, a min
    // shared by the 16 zeros and 16 non-zeros, and the iq4 formats' levels
    // have no zero (only a zero scale gives one).
    const bool unit32 = f.type == WeightType::kQ4_K || f.type == WeightType::kQ5_K || f.type == WeightType::kQ4_1 ||
                        f.type == WeightType::kQ5_1 || f.type == WeightType::kIQ4_NL || f.type == WeightType::kIQ4_XS;
    const size_t sub = unit32 ? 32 : 16;
    for (size_t i = 0; i < x.size(); ++i) {
      const size_t start = i / sub * sub;
      if (std::all_of(x.begin() + start, x.begin() + start + sub, [](float v) { return v == 0.0f; })) {
        ASSERT_EQ(y[i], 0.0f) << f.name << " element " << i;
      }
    }
    EXPECT_LT(rel_l2(y, x), kRoundTripBound[&f - kFormats][0]) << f.name;
    // An all-zero input: every K format, q4_1 and q5_1 store all-zero
    // bytes; q8_0 a zero scale and zero quants; q4_0 the level 8 (zero) and
    // d = -0 (0 / -8); q5_0 likewise its level 16 (all high bits set);
    // iq4_nl a zero d and the level 8 (the smallest positive, 1); iq4_xs
    // d = -0 (-0 / 32), every sub-scale 32 (zero) and the level 8.
    const std::vector<uint8_t> q = quantize(f, std::vector<float>(kQKK, 0.0f));
    for (size_t b = 0; b < q.size() / f.bytes; ++b) {
      for (size_t i = 0; i < f.bytes; ++i) {
        uint8_t expect = 0;
        if (f.type == WeightType::kQ4_0) expect = i == 0 ? 0x00 : (i == 1 ? 0x80 : 0x88);
        if (f.type == WeightType::kQ5_0) expect = i == 1 ? 0x80 : (i >= 2 && i < 6 ? 0xff : 0x00);
        if (f.type == WeightType::kIQ4_NL) expect = i < 2 ? 0x00 : 0x88;
        if (f.type == WeightType::kIQ4_XS) expect = i == 0 ? 0x00 : i == 1 ? 0x80 : i < 4 ? 0xaa : i < 8 ? 0x00 : 0x88;
        // tq1_0: every trit 1, 11111 in base 3 (121) as ceil(121 * 256 /
        // 243) = 128, qh's 1111 and a 0 (120) as 127; tq2_0: codes 01.
        if (f.type == WeightType::kTQ1_0) expect = i < 48 ? 0x80 : i < 52 ? 0x7f : 0x00;
        if (f.type == WeightType::kTQ2_0) expect = i < 64 ? 0x55 : 0x00;
        ASSERT_EQ(q[b * f.bytes + i], expect) << f.name << " block " << b << " byte " << i;
      }
    }
  }
}

// MXFP4 blocks of values V[code] * 2^s whose largest magnitude is 8 or 12
// scales (the two top codes): the quantiser recovers 2^s and every code.
TEST(QuantRefRoundTrip, Mxfp4OnGridValuesAreExact) {
  std::mt19937 rng(17);
  std::vector<float> x(64 * kQK32);
  for (size_t b = 0; b < x.size() / kQK32; ++b) {
    const int s = static_cast<int>(rng() % 40) - 30;
    for (size_t i = 0; i < kQK32; ++i) {
      x[b * kQK32 + i] = std::ldexp(static_cast<float>(kMxfp4Values[rng() % 16]), s - 1);
    }
    x[b * kQK32 + rng() % kQK32] = std::ldexp((rng() & 1) ? 12.0f : -8.0f, s - 1);
  }
  const std::vector<float> y = round_trip(kMxfp4, x);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], x[i]) << "element " << i;
}

// FP8 e4m3: every code's value from its fields, every non-NaN code back
// from its value, ties to the even code, saturation at 448, NaN kept.
TEST(QuantRefFp8, E4M3CodesAndRounding) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float v = e4m3_to_float(code);
    const int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;
      EXPECT_EQ(float_to_e4m3(v), code) << c;
      continue;
    }
    const double want = (e == 0 ? m * std::ldexp(1.0, -9) : (8 + m) * std::ldexp(1.0, e - 10)) * ((c & 0x80) ? -1 : 1);
    EXPECT_EQ(static_cast<double>(v), want) << c;
    if (c != 0x80) {
      EXPECT_EQ(float_to_e4m3(v), code) << c;  // -0 is 0x80 too, but checked below
    }
  }
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);               // 1 + 1/16: tie, to 1.0 (even mantissa 0)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);               // 1 + 3/16: tie, to 1.25 (mantissa 2)
  EXPECT_EQ(float_to_e4m3(std::ldexp(2.5f, -9)), 0x02);  // subnormal tie 2.5 -> 2
  EXPECT_EQ(float_to_e4m3(std::ldexp(7.5f, -9)), 0x08);  // largest subnormal's tie carries to 2^-6
  EXPECT_EQ(float_to_e4m3(std::ldexp(0.5f, -9)), 0x00);  // half the smallest subnormal: to 0
  EXPECT_EQ(float_to_e4m3(460.0f), 0x7e);                // past 448: 448, never the NaN code
  EXPECT_EQ(float_to_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
}

// Values already on a q8_0 / q4_0 grid (the extreme level present, so the
// scale is recovered exactly) quantise to exactly those levels.
TEST(QuantRefRoundTrip, OnGridValuesAreExact) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> q8(-127, 127), q4(0, 15);
  std::vector<float> x8(8 * kQK32), x4(8 * kQK32);
  for (size_t b = 0; b < 8; ++b) {
    const float d = std::ldexp(1.0f, static_cast<int>(b) - 4);
    for (int j = 0; j < kQK32; ++j) {
      x8[b * kQK32 + j] = d * static_cast<float>(j == 3 ? (b % 2 ? -127 : 127) : q8(rng));
      // q4_0 stores d = max / -8: the largest magnitude is level 0 (-8).
      x4[b * kQK32 + j] = -d * static_cast<float>(j == 5 ? -8 : q4(rng) - 8);
    }
  }
  EXPECT_EQ(round_trip(kQ8_0, x8), x8);
  EXPECT_EQ(round_trip(kQ4_0, x4), x4);
  const std::vector<uint8_t> q = quantize(kQ8_0, x8);
  const auto* b8 = reinterpret_cast<const BlockQ8_0*>(q.data());
  EXPECT_EQ(b8[0].d, float_to_f16(0.0625f));
  EXPECT_EQ(b8[0].qs[3], 127);
  EXPECT_EQ(b8[1].qs[3], -127);
}

// Ties: q8_0 rounds half away from zero (roundf, gguf's np_roundf); q4_0
// truncates x / d + 8.5, i.e. rounds half up. With the extreme at 127
// (q8_0) or -8 (q4_0) the scale is exactly 1, so x / d is x.
TEST(QuantRefRoundTrip, Ties) {
  std::vector<float> x(kQK32, 0.0f);
  const float ties[] = {2.5f, -2.5f, 0.5f, -0.5f, 1.5f, -1.5f, 6.5f, -6.5f};
  x[0] = 127.0f;
  std::copy(std::begin(ties), std::end(ties), x.begin() + 1);
  const std::vector<uint8_t> q8 = quantize(kQ8_0, x);
  const auto* b8 = reinterpret_cast<const BlockQ8_0*>(q8.data());
  EXPECT_EQ(b8->d, float_to_f16(1.0f));
  const int8_t expect8[] = {127, 3, -3, 1, -1, 2, -2, 7, -7};
  for (int j = 0; j < 9; ++j) EXPECT_EQ(b8->qs[j], expect8[j]) << j;

  x[0] = -8.0f;
  const std::vector<uint8_t> q4 = quantize(kQ4_0, x);
  const auto* b4 = reinterpret_cast<const BlockQ4_0*>(q4.data());
  EXPECT_EQ(b4->d, float_to_f16(1.0f));
  const int expect4[] = {-8, 3, -2, 1, 0, 2, -1, 7, -6};  // level - 8
  for (int j = 0; j < 9; ++j) EXPECT_EQ((b4->qs[j] & 15) - 8, expect4[j]) << j;
}

// quantise(dequantise(quantise(x))) == quantise(x) for q8_0 and q4_0: the
// dequantised block's largest magnitude is exactly 127 d (resp. -8 d) with
// d an f16, so the same d and levels come back. The K formats re-fit their
// scales on the dequantised values and need not reproduce the bytes (up to
// half the q5_K blocks change); what holds is that the second pass is
// within the format's round-trip error of its input.
TEST(QuantRefRoundTrip, Idempotence) {
  for (size_t fi = 0; fi < std::size(kFormats); ++fi) {
    const Format& f = kFormats[fi];
    for (size_t di = 0; di < std::size(kDists); ++di) {
      const std::vector<float> x = random_data(kDists[di], 16 * kQKK, 77 + static_cast<uint32_t>(di));
      const std::vector<uint8_t> q1 = quantize(f, x);
      const std::vector<float> y1 = dequantize(f, q1);
      const std::vector<uint8_t> q2 = quantize(f, y1);
      // iq4_nl searches its scale as the K formats do; the ternary
      // formats' largest value is d itself, so d and the levels come back.
      const bool ternary = f.type == WeightType::kTQ1_0 || f.type == WeightType::kTQ2_0;
      if ((f.block == kQK32 && f.type != WeightType::kIQ4_NL) || ternary) {
        EXPECT_EQ(q2, q1) << f.name << " " << dist_name(kDists[di]);
      } else {
        EXPECT_LT(rel_l2(dequantize(f, q2), y1), kRoundTripBound[fi][di]) << f.name << " " << dist_name(kDists[di]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Degenerate magnitudes: whatever the input (finite or infinite, no NaN),
// every stored scale is finite and so is every dequantised value.

bool scales_finite(const Format& f, const std::vector<uint8_t>& q) {
  for (size_t b = 0; b < q.size() / f.bytes; ++b) {
    const uint8_t* p = q.data() + b * f.bytes;
    // The f16 fields: d first, and a second scale (dmin, m) where there is one.
    uint16_t h[2];
    int count = 1;
    if (f.type == WeightType::kQ6_K) {
      std::memcpy(&h[0], p + offsetof(BlockQ6K, d), 2);
    } else if (f.type == WeightType::kQ3_K) {
      std::memcpy(&h[0], p + offsetof(BlockQ3K, d), 2);
    } else if (f.type == WeightType::kQ2_K) {
      std::memcpy(h, p + offsetof(BlockQ2K, d), 4);
      count = 2;
    } else if (f.type == WeightType::kTQ1_0 || f.type == WeightType::kTQ2_0) {
      std::memcpy(&h[0], p + f.bytes - 2, 2);  // d last
    } else {
      std::memcpy(&h[0], p, 2);
      const bool two = f.type == WeightType::kQ4_K || f.type == WeightType::kQ5_K || f.type == WeightType::kQ4_1 ||
                       f.type == WeightType::kQ5_1;
      if (two) {
        std::memcpy(&h[1], p + 2, 2);
        count = 2;
      }
    }
    for (int i = 0; i < count; ++i) {
      if ((h[i] & 0x7c00u) == 0x7c00u) return false;
    }
  }
  return true;
}

TEST(QuantRefDegenerate, HugeValuesSaturate) {
  const float kInf = std::numeric_limits<float>::infinity();
  for (const Format& f : kFormats) {
    for (float scale : {1e6f, 1e9f, 1e20f, 1e38f}) {
      std::vector<float> x = random_data(Dist::kNormal, 4 * kQKK, 3);
      for (float& v : x) v *= scale;
      x[10] = std::numeric_limits<float>::max();
      x[300] = -kInf;
      x[700] = kInf;
      const std::vector<uint8_t> q = quantize(f, x);
      EXPECT_TRUE(scales_finite(f, q)) << f.name << " scale " << scale;
      const std::vector<float> y = dequantize(f, q);
      ASSERT_TRUE(all_finite(y)) << f.name << " scale " << scale;
    }
  }
  // Past the f16 range q8_0 and q4_0 keep the largest scale and clip the
  // largest weights, keeping their signs.
  std::vector<float> x(kQK32);
  for (int j = 0; j < kQK32; ++j) x[j] = (j % 2 ? -1.0f : 1.0f) * 1e9f * static_cast<float>(j + 1) / kQK32;
  for (const Format* f : {&kQ8_0, &kQ4_0}) {
    const std::vector<uint8_t> q = quantize(*f, x);
    uint16_t d;
    std::memcpy(&d, q.data(), 2);
    EXPECT_EQ(d & 0x7fffu, 0x7bffu) << f->name;
    const std::vector<float> y = dequantize(*f, q);
    for (int j = 8; j < kQK32; ++j) EXPECT_GT(y[j] * x[j], 0.0f) << f->name << " " << j;
  }
}

TEST(QuantRefDegenerate, TinyValuesNeverWorseThanZero) {
  for (const Format& f : kFormats) {
    for (float scale : {1e-5f, 3e-6f, 1e-6f, 1e-8f, 1e-20f, 1e-38f, 1e-42f}) {
      std::vector<float> x = random_data(Dist::kNormal, 8 * kQKK, 21);
      for (float& v : x) v *= scale;
      const std::vector<float> y = round_trip(f, x);
      ASSERT_TRUE(all_finite(y)) << f.name << " scale " << scale;
      // At these magnitudes the f16 scales underflow: the result may lose
      // everything, but never adds error beyond the data's own norm. Not so
      // for q4_1 / q5_1, whose levels ggml picks against the unrounded min
      // and scale: below f16's subnormals (6e-8) the stored min can round
      // to one subnormal step while every level rounds to 0. Their bytes
      // are llama.cpp's; the check keeps them finite.
      // Likewise the ternary formats, which round each weight against the
      // unrounded max |x|: where the stored d rounds up to f16's smallest
      // subnormal, the weights above half of max |x| take it.
      const bool min_format = f.type == WeightType::kQ4_1 || f.type == WeightType::kQ5_1 ||
                              f.type == WeightType::kTQ1_0 || f.type == WeightType::kTQ2_0;
      if (!(min_format && scale < 1e-6f)) {
        EXPECT_LE(rel_l2(y, x), 1.0) << f.name << " scale " << scale;
      }
    }
  }
}

// The constant-block cases of the K formats' min/max fit: a positive
// constant (min clipped to 0), a negative one (scale 0, all in the min).
// Near 1e-3 the K formats' f16 super-scale is subnormal (q6_K's d about
// 2.4e-7, steps of 6e-8), which is what limits them there.
TEST(QuantRefDegenerate, ConstantBlocks) {
  for (const Format& f : kFormats) {
    for (float c : {0.7f, -0.7f, -250.0f, 1e-3f, -1e-3f}) {
      const std::vector<float> x(2 * kQKK, c);
      // mxfp4's scale is a power of two and its top codes 8 and 12, so a
      // constant c lies in [8, 16) scales and comes back as 8 or 12 of them:
      // up to 25% off (16 -> 12), whatever c.
      const double bound = f.type == WeightType::kMXFP4 ? 0.25 : std::fabs(c) > 0.5f ? 5e-4 : 0.035;
      EXPECT_LT(rel_l2(round_trip(f, x), x), bound) << f.name << " " << c;
    }
  }
}

}  // namespace
}  // namespace colibri
