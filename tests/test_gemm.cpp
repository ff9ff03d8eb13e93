// The prefill (GEMM) kernels against a float64 reference, on the same
// packed layout and semantics as the decode kernels: odd sizes, partial row
// ranges, gathered and repeated tokens, poisoned outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernel_scratch.h"
#include "kernels/amx.h"
#include "kernels/gemm.h"
#include "util/half.h"
#include "util/quant_blocks.h"
#include "util/quant_ref.h"
#include "util/weight_format.h"

namespace {

using colibri::kernels::ExpertShape;
using colibri::kernels::KernelTable;
using colibri::kernels::WeightType;

struct Packed {
  ExpertShape s;
  std::vector<uint8_t> gate_up, down;

  size_t row_bytes(size_t stride) const { return colibri::weight_row_bytes(s.weight_type, stride); }
  // Element k of row r of a matrix of `stride` elements a row. fp8_e4m3
  // blocks are written whole by make_packed (codes and scale), so put only
  // serves the float formats.
  void put(std::vector<uint8_t>& buf, size_t stride, size_t r, size_t k, float v) const {
    uint8_t* at = &buf[r * row_bytes(stride)];
    if (s.weight_type == WeightType::kF32) {
      std::memcpy(at + k * 4, &v, 4);
    } else {
      const uint16_t h = s.weight_type == WeightType::kF16 ? colibri::float_to_f16(v) : colibri::float_to_bf16(v);
      std::memcpy(at + k * 2, &h, 2);
    }
  }
  double get(const std::vector<uint8_t>& buf, size_t stride, size_t r, size_t k) const {
    const uint8_t* at = &buf[r * row_bytes(stride)];
    if (s.weight_type == WeightType::kFP8_E4M3) {
      // The reference dequantiser's value: code times the block's d, rounded once.
      const uint8_t* blk = at + k / colibri::kQKFp8 * sizeof(colibri::BlockFp8E4M3);
      float d;
      std::memcpy(&d, blk + offsetof(colibri::BlockFp8E4M3, d), sizeof d);
      return colibri::e4m3_to_float(blk[offsetof(colibri::BlockFp8E4M3, qs) + k % colibri::kQKFp8]) * d;
    }
    if (s.weight_type == WeightType::kF32) {
      float v;
      std::memcpy(&v, at + k * 4, 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, at + k * 2, 2);
    return s.weight_type == WeightType::kF16 ? colibri::f16_to_float(h) : colibri::bf16_to_float(h);
  }
};

// fp8_e4m3 rows of n valid elements: random codes (no NaN) with scales of
// 0.5-2 / 448 (values up to about 2), zero codes past n.
void fill_fp8_rows(uint8_t* rows, size_t count, size_t row_bytes, size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> scale(0.5f / 448, 2.0f / 448);
  const size_t blocks = row_bytes / sizeof(colibri::BlockFp8E4M3);
  for (size_t r = 0; r < count; ++r) {
    for (size_t b = 0; b < blocks; ++b) {
      colibri::BlockFp8E4M3 blk{};
      blk.d = scale(rng);
      for (size_t j = 0; j < colibri::kQKFp8 && b * colibri::kQKFp8 + j < n; ++j) {
        do blk.qs[j] = static_cast<uint8_t>(rng()); while ((blk.qs[j] & 0x7f) == 0x7f);
      }
      std::memcpy(rows + r * row_bytes + b * sizeof blk, &blk, sizeof blk);
    }
  }
}

Packed make_packed(int D, int F, WeightType wt, std::mt19937& rng) {
  Packed p;
  p.s = colibri::kernels::make_expert_shape(D, F, wt);
  // Exactly sized, padding zero as the loader writes it.
  p.gate_up.assign(2 * static_cast<size_t>(F) * p.row_bytes(p.s.gate_up_stride), 0);
  p.down.assign(static_cast<size_t>(D) * p.row_bytes(p.s.down_stride), 0);
  if (wt == WeightType::kFP8_E4M3) {
    fill_fp8_rows(p.gate_up.data(), 2 * static_cast<size_t>(F), p.row_bytes(p.s.gate_up_stride), static_cast<size_t>(D), rng);
    fill_fp8_rows(p.down.data(), static_cast<size_t>(D), p.row_bytes(p.s.down_stride), static_cast<size_t>(F), rng);
    return p;
  }
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int r = 0; r < 2 * F; ++r)
    for (int k = 0; k < D; ++k) p.put(p.gate_up, p.s.gate_up_stride, static_cast<size_t>(r), static_cast<size_t>(k), u(rng));
  for (int r = 0; r < D; ++r)
    for (int k = 0; k < F; ++k) p.put(p.down, p.s.down_stride, static_cast<size_t>(r), static_cast<size_t>(k), u(rng));
  return p;
}

const char* type_name(WeightType t) {
  return colibri::weight_format(t).name;
}

class GemmKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!colibri::kernels::isa_supported(colibri::kernels::Isa::kAvx512)) {
      GTEST_SKIP() << "CPU without AVX-512";
    }
  }
};

// One expert of D x F, n tokens gathered from n + 3 (some repeated): both
// phases over partial row ranges against float64, outputs poisoned.
void check_table(const KernelTable& k, WeightType wt, int D, int F, int n, std::mt19937& rng,
                 colibri::kernels::KernelScratch* scratch = colibri_test::thread_scratch()) {
          SCOPED_TRACE(std::string(k.name) + " " + type_name(wt) + " D=" + std::to_string(D) +
                       " F=" + std::to_string(F) + " n=" + std::to_string(n));
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          const Packed p = make_packed(D, F, wt, rng);
          const int T = n + 3;
          std::vector<float> x(static_cast<size_t>(T) * D);
          for (float& v : x) v = u(rng);
          std::vector<int32_t> idx(static_cast<size_t>(n));
          for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = (i * 7 + 2) % T;  // gathered, some repeated

          // gate_up over a partial row range; outside must stay NaN.
          const size_t ldh = static_cast<size_t>(F) + 3;
          std::vector<float> h(static_cast<size_t>(n) * ldh, NAN);
          const int fb = F > 4 ? 1 : 0, fe = F > 4 ? F - 1 : F;
          k.gate_up(p.s, p.gate_up.data(), x.data(), static_cast<size_t>(D), idx.data(), n, fb, fe, h.data(), ldh, scratch);
          double worst = 0;
          std::string where;
          for (int i = 0; i < n; ++i) {
            for (size_t f = 0; f < ldh; ++f) {
              const float got = h[static_cast<size_t>(i) * ldh + f];
              if (static_cast<int>(f) < fb || static_cast<int>(f) >= fe) {
                ASSERT_TRUE(std::isnan(got)) << "h[" << i << "][" << f << "] written outside the range";
                continue;
              }
              double g = 0, up = 0, mag_g = 0, mag_u = 0;
              const float* xi = x.data() + static_cast<size_t>(idx[static_cast<size_t>(i)]) * D;
              for (int c = 0; c < D; ++c) {
                const double wg = p.get(p.gate_up, p.s.gate_up_stride, 2 * f, static_cast<size_t>(c));
                const double wu = p.get(p.gate_up, p.s.gate_up_stride, 2 * f + 1, static_cast<size_t>(c));
                g += wg * xi[c];
                up += wu * xi[c];
                mag_g += std::fabs(wg * xi[c]);
                mag_u += std::fabs(wu * xi[c]);
              }
              const double s = 1.0 / (1.0 + std::exp(-g));
              const double ref = g * s * up;
              // fp32 sums: each dot is off by <= ~1e-6 * sum|terms|; that
              // error propagates through silu(g)*u with slopes |u|(s + g s(1-s))
              // and |silu(g)|; plus the exp approximation (~1e-6 relative).
              const double tol = 2e-6 * (mag_g * std::fabs(up) * (s + std::fabs(g) * s * (1 - s)) +
                                         mag_u * std::fabs(g * s)) +
                                 1e-6 * std::fabs(ref) + 1e-30;
              const double ratio = std::fabs(got - ref) / tol;
              if (!(ratio <= worst)) {
                worst = ratio;
                where = "h[" + std::to_string(i) + "][" + std::to_string(f) + "] got " + std::to_string(got) +
                        " ref " + std::to_string(ref);
              }
            }
          }
          EXPECT_LE(worst, 1.0) << "worst gate_up element: " << where;

          // down over a partial range into prefilled y; untouched elsewhere.
          for (float& v : h) v = u(rng);
          std::vector<float> w(static_cast<size_t>(n));
          for (float& v : w) v = u(rng);
          std::vector<float> y(static_cast<size_t>(T) * D);
          for (float& v : y) v = u(rng);
          const std::vector<float> y0 = y;
          const int db = D > 4 ? 2 : 0, de = D > 4 ? D - 1 : D;
          k.down(p.s, p.down.data(), h.data(), ldh, idx.data(), w.data(), n, db, de, y.data(), static_cast<size_t>(D), scratch);
          std::vector<double> ref(y0.begin(), y0.end()), mag(y0.size(), 0.0);
          for (int i = 0; i < n; ++i) {
            for (int d = db; d < de; ++d) {
              double acc = 0, m = 0;
              for (int f = 0; f < F; ++f) {
                const double term = p.get(p.down, p.s.down_stride, static_cast<size_t>(d), static_cast<size_t>(f)) *
                                    h[static_cast<size_t>(i) * ldh + f];
                acc += term;
                m += std::fabs(term);
              }
              const size_t o = static_cast<size_t>(idx[static_cast<size_t>(i)]) * D + d;
              ref[o] += w[static_cast<size_t>(i)] * acc;
              mag[o] += std::fabs(w[static_cast<size_t>(i)]) * m + std::fabs(ref[o]);
            }
          }
          worst = 0;
          for (size_t o = 0; o < y.size(); ++o) {
            const int d = static_cast<int>(o % static_cast<size_t>(D));
            if (d < db || d >= de) {
              ASSERT_EQ(y[o], y0[o]) << "y[" << o << "] touched outside the range";
              continue;
            }
            const double ratio = std::fabs(y[o] - ref[o]) / (2e-6 * mag[o] + 1e-30);
            if (!(ratio <= worst)) {
              worst = ratio;
              where = "y[" + std::to_string(o) + "] got " + std::to_string(y[o]) + " ref " + std::to_string(ref[o]);
            }
          }
          EXPECT_LE(worst, 1.0) << "worst down element: " << where;
}

#if defined(COLIBRI_HAVE_X86_KERNELS)
// Which table an expert with n tokens gets: decode below the first tier,
// then the highest tier reached; bf16 weights only ever go to AMX.
TEST_F(GemmKernels, PrefillTiersPickByTokensPerExpert) {
  using colibri::kernels::Isa;
  constexpr auto kDefault = colibri::kernels::PrefillPrecision::kDefault;
  constexpr auto kExact = colibri::kernels::PrefillPrecision::kExact;
  constexpr auto kBf16 = colibri::kernels::PrefillPrecision::kBf16;
  // Experts big enough for every table (the rounding tables need both
  // dimensions >= kBf16RoundingMinDim).
  const auto big = [](WeightType wt) { return colibri::kernels::make_expert_shape(4096, 1024, wt); };
  const KernelTable& decode = colibri::kernels::kernel_table(Isa::kAvx512);
  // f32 weights: token lanes, then the panel GEMM.
  const colibri::kernels::PrefillTiers f32 = colibri::kernels::plan_kernels(Isa::kAvx512, big(WeightType::kF32), kDefault).prefill;
  ASSERT_EQ(f32.count, 2);
  EXPECT_EQ(&f32.pick(1, decode), &decode);
  EXPECT_EQ(&f32.pick(f32.tier[0].min_tokens - 1, decode), &decode);
  EXPECT_EQ(&f32.pick(f32.tier[0].min_tokens, decode), &colibri::kernels::avx512_tokens_kernels());
  EXPECT_EQ(&f32.pick(f32.tier[1].min_tokens - 1, decode), &colibri::kernels::avx512_tokens_kernels());
  EXPECT_EQ(&f32.pick(f32.tier[1].min_tokens, decode), &colibri::kernels::avx512_gemm_kernels());
  EXPECT_EQ(&f32.pick(100000, decode), &colibri::kernels::avx512_gemm_kernels());
  EXPECT_LT(f32.tier[0].min_tokens, f32.tier[1].min_tokens);

  // f16 weights: token lanes, then the fp32-grade AMX split table where
  // AMX is usable, else the panel GEMM; never the bf16-rounding AMX table
  // unless asked for.
  // The AMX level (only where the tiles may run) is the only one that
  // hands experts to the AMX tables; asking for it elsewhere falls back.
  const bool amx = colibri::kernels::isa_supported(Isa::kAmx);
  EXPECT_EQ(amx, colibri::kernels::amx_available());
  for (const Isa level : {Isa::kAvx512, Isa::kAmx}) {
    SCOPED_TRACE(colibri::kernels::isa_name(level));
    const bool tiles = level == Isa::kAmx && amx;
    const colibri::kernels::PrefillTiers f16 = colibri::kernels::plan_kernels(level, big(WeightType::kF16), kDefault).prefill;
    ASSERT_EQ(f16.count, 2);
    EXPECT_EQ(&f16.pick(f16.tier[0].min_tokens, decode), &colibri::kernels::avx512_tokens_kernels());
    const KernelTable& f16_large =
        tiles ? colibri::kernels::amx_f16_split_kernels() : colibri::kernels::avx512_gemm_kernels();
    EXPECT_EQ(&f16.pick(f16.tier[1].min_tokens - 1, decode), &colibri::kernels::avx512_tokens_kernels());
    EXPECT_EQ(&f16.pick(f16.tier[1].min_tokens, decode), &f16_large);
    EXPECT_EQ(&f16.pick(100000, decode), &f16_large);

    const colibri::kernels::PrefillTiers f16_bf16 = colibri::kernels::plan_kernels(level, big(WeightType::kF16), kBf16).prefill;
    const colibri::kernels::PrefillTiers bf16 = colibri::kernels::plan_kernels(level, big(WeightType::kBF16), kDefault).prefill;
    if (tiles) {
      ASSERT_EQ(f16_bf16.count, 1);
      EXPECT_STREQ(f16_bf16.tier[0].table->name, "amx-bf16");
      ASSERT_EQ(bf16.count, 1);
      EXPECT_STREQ(bf16.tier[0].table->name, "amx-bf16");
    } else {
      // bf16_compute without tiles keeps the fp32 prefill tables for f16.
      ASSERT_EQ(f16_bf16.count, 2);
      EXPECT_EQ(f16_bf16.tier[1].table, &colibri::kernels::avx512_gemm_kernels());
      // bf16 weights without tiles: the fp32 tables by default, the bf16
      // dot-product table only when asked for (and AVX512_BF16 exists).
      ASSERT_EQ(bf16.count, 2);
      EXPECT_EQ(bf16.tier[0].table, &colibri::kernels::avx512_tokens_kernels());
      EXPECT_EQ(bf16.tier[1].table, &colibri::kernels::avx512_gemm_kernels());
      const colibri::kernels::PrefillTiers bf16_asked =
          colibri::kernels::plan_kernels(level, big(WeightType::kBF16), kBf16).prefill;
      if (colibri::kernels::cpu_has_avx512_bf16()) {
        ASSERT_EQ(bf16_asked.count, 1);
        EXPECT_STREQ(bf16_asked.tier[0].table->name, "avx512-bf16");
      } else {
        EXPECT_EQ(bf16_asked.count, 2);
      }
    }
    // exact_prefill: never a table that rounds activations.
    for (const WeightType wt : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
      const colibri::kernels::PrefillTiers exact = colibri::kernels::plan_kernels(level, big(wt), kExact).prefill;
      ASSERT_EQ(exact.count, 2);
      for (int i = 0; i < exact.count; ++i) {
        EXPECT_STRNE(exact.tier[i].table->name, "amx-bf16");
        EXPECT_STRNE(exact.tier[i].table->name, "avx512-bf16");
      }
    }
  }

  // Small experts never round activations, whatever the option.
  for (const Isa level : {Isa::kAvx512, Isa::kAmx}) {
    for (const auto precision : {kDefault, kBf16}) {
      for (const WeightType wt : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
        const int32_t small = colibri::kernels::kBf16RoundingMinDim - 1;
        for (const auto& shape : {colibri::kernels::make_expert_shape(small, 4096, wt),
                                  colibri::kernels::make_expert_shape(4096, small, wt)}) {
          const colibri::kernels::PrefillTiers t = colibri::kernels::plan_kernels(level, shape, precision).prefill;
          for (int i = 0; i < t.count; ++i) {
            EXPECT_STRNE(t.tier[i].table->name, "amx-bf16");
            EXPECT_STRNE(t.tier[i].table->name, "avx512-bf16");
          }
        }
      }
    }
  }

  // Below AVX-512 there are no prefill tables at all.
  EXPECT_EQ(colibri::kernels::plan_kernels(Isa::kAvx2, big(WeightType::kF16), kDefault).prefill.count, 0);
  EXPECT_EQ(colibri::kernels::plan_kernels(Isa::kScalar, big(WeightType::kBF16), kBf16).prefill.count, 0);
}

// Every plan of the registry, for every format, level, precision and a big
// and a small expert: a decode table of the format's kind (block formats
// only ever run the block-format tables, float formats never do), at a
// level the CPU has and not above the one asked for; tiers in ascending
// token counts above the decode range; no table that rounds activations
// with exact, or on an expert under kBf16RoundingMinDim.
TEST(KernelRegistry, EveryPlanFitsItsFormatLevelAndPrecision) {
  namespace k = colibri::kernels;
  const auto starts_with = [](const char* s, const char* prefix) {
    return std::strncmp(s, prefix, std::strlen(prefix)) == 0;
  };
  const auto block_table = [&](const KernelTable& t) {
    return starts_with(t.name, "int8-") || starts_with(t.name, "fp8-") || starts_with(t.name, "exact-dequant-") ||
           std::strcmp(t.name, "amx-bf16-dequant") == 0;
  };
  const auto rounds = [](const KernelTable& t) {
    return std::strcmp(t.name, "amx-bf16") == 0 || std::strcmp(t.name, "avx512-bf16") == 0 ||
           std::strcmp(t.name, "amx-bf16-dequant") == 0;
  };
  for (int type = 0; type < colibri::kWeightTypeCount; ++type) {
    const auto wt = static_cast<WeightType>(type);
    const bool block = colibri::weight_format(wt).quantized;
    // q4_k_m's pairing for q4_k, the same type otherwise.
    const WeightType down = wt == WeightType::kQ4_K ? WeightType::kQ6_K : wt;
    for (const k::Isa isa : {k::Isa::kScalar, k::Isa::kAvx2, k::Isa::kAvx512, k::Isa::kAmx}) {
      for (const auto precision :
           {k::PrefillPrecision::kDefault, k::PrefillPrecision::kExact, k::PrefillPrecision::kBf16}) {
        for (const int32_t dim : {k::kBf16RoundingMinDim - 32, 4096}) {
          const ExpertShape shape = k::make_expert_shape(dim, dim, wt, down);
          SCOPED_TRACE(std::string(colibri::weight_format(wt).name) + " " + k::isa_name(isa) + " precision " +
                       std::to_string(static_cast<int>(precision)) + " dim " + std::to_string(dim));
          const k::KernelPlan plan = k::plan_kernels(isa, shape, precision);
          ASSERT_NE(plan.decode, nullptr);
          EXPECT_EQ(plan.isa, isa);
          const bool exact = precision == k::PrefillPrecision::kExact;
          const bool may_round = !exact && dim >= k::kBf16RoundingMinDim;
          // fp8_e4m3: exact codes against fp32 activations in its own
          // kernels, so exact keeps them; its prefill widens blocks to fp32
          // in the token-lane table.
          const bool fp8 = wt == WeightType::kFP8_E4M3;
          EXPECT_EQ(block_table(*plan.decode), block);
          EXPECT_FALSE(rounds(*plan.decode));
          if (block) {
            EXPECT_EQ(starts_with(plan.decode->name, "exact-dequant-"), exact && !fp8);
            EXPECT_EQ(starts_with(plan.decode->name, "fp8-"), fp8);
          }
          int32_t below = 1;
          for (int i = 0; i < plan.prefill.count; ++i) {
            const KernelTable& t = *plan.prefill.tier[i].table;
            EXPECT_GT(plan.prefill.tier[i].min_tokens, below);
            below = plan.prefill.tier[i].min_tokens;
            EXPECT_EQ(block_table(t) || (fp8 && std::strcmp(t.name, "avx512-tokens") == 0), block) << t.name;
            EXPECT_LE(t.isa, isa) << t.name;
            EXPECT_TRUE(k::isa_supported(t.isa)) << t.name;
            if (!may_round) {
              EXPECT_FALSE(rounds(t)) << t.name;
            }
          }
          EXPECT_LE(plan.decode->isa, isa);
          EXPECT_TRUE(k::isa_supported(plan.decode->isa));
        }
      }
    }
  }
}

TEST_F(GemmKernels, PanelGemmMatchesFloat64Reference) {
  std::mt19937 rng(20261130);
  for (WeightType wt : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
    for (int D : {1, 7, 16, 33, 100, 129}) {
      for (int F : {1, 5, 17, 48, 100}) {
        for (int n : {1, 3, 8, 9, 21}) check_table(colibri::kernels::avx512_gemm_kernels(), wt, D, F, n, rng);
      }
    }
  }
}

// Token counts cover each lane layout (4 and 8 tokens per vector with pairs
// and quads of k, 1-5 vectors; 3 vectors of 16) and groups split at 48; D and F cross
// the 128-k weight chunk and the row blocks' tails (rows moved back to end
// at the range end).
TEST_F(GemmKernels, TokenLanesMatchFloat64Reference) {
  std::mt19937 rng(20261201);
  for (WeightType wt : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
    for (int D : {1, 7, 33, 129, 300}) {
      for (int F : {1, 5, 17, 48, 140}) {
        for (int n : {1, 2, 4, 5, 8, 9, 13, 16, 21, 30, 33, 37, 40, 41, 50, 64, 70, 88}) {
          check_table(colibri::kernels::avx512_tokens_kernels(), wt, D, F, n, rng);
        }
      }
    }
  }
}

// fp8_e4m3 rows widened in the token-lane kernel's 128-k chunks (one block
// each): rows ending inside a block, K crossing chunks and spans, every
// lane layout; then a NaN code, which must reach exactly its row's outputs.
TEST_F(GemmKernels, TokenLanesTakeFp8Blocks) {
  std::mt19937 rng(20261206);
  const KernelTable& k = colibri::kernels::avx512_tokens_kernels();
  for (int D : {7, 128, 300}) {
    for (int F : {5, 140}) {
      for (int n : {5, 8, 13, 33, 50}) check_table(k, WeightType::kFP8_E4M3, D, F, n, rng);
    }
  }
  check_table(k, WeightType::kFP8_E4M3, 200, 11000, 40, rng);  // phase 2 in K spans

  Packed p = make_packed(300, 20, WeightType::kFP8_E4M3, rng);
  const size_t gu_row = p.row_bytes(p.s.gate_up_stride);
  // Gate row of f = 3, element 260 (third block): code 0xff (-NaN).
  p.gate_up[6 * gu_row + 2 * sizeof(colibri::BlockFp8E4M3) + offsetof(colibri::BlockFp8E4M3, qs) + 4] = 0xff;
  const int n = 9;
  std::vector<float> x(static_cast<size_t>(n) * 300, 0.25f);
  std::vector<int32_t> idx(n);
  for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = i;
  std::vector<float> h(static_cast<size_t>(n) * 20, NAN);
  k.gate_up(p.s, p.gate_up.data(), x.data(), 300, idx.data(), n, 0, 20, h.data(), 20, colibri_test::thread_scratch());
  for (int i = 0; i < n; ++i) {
    for (int f = 0; f < 20; ++f) {
      EXPECT_EQ(std::isnan(h[static_cast<size_t>(i) * 20 + f]), f == 3) << "token " << i << " f " << f;
    }
  }
}

// With no working memory to be had, both prefill tables fall back to the
// decode kernels; they must not return with the output unwritten.
TEST_F(GemmKernels, NoScratchFallsBackToDecodeKernels) {
  // A scratch that cannot grow, and none at all.
  colibri::kernels::KernelScratch none;
  none.set_limit(0);
  std::mt19937 rng(20261203);
  for (const KernelTable* k : {&colibri::kernels::avx512_tokens_kernels(), &colibri::kernels::avx512_gemm_kernels()}) {
    for (WeightType wt : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
      for (int n : {8, 21, 70}) {
        check_table(*k, wt, 129, 48, n, rng, &none);
        check_table(*k, wt, 129, 48, n, rng, nullptr);
      }
    }
  }
  for (int n : {8, 21}) {
    check_table(colibri::kernels::avx512_tokens_kernels(), WeightType::kFP8_E4M3, 129, 48, n, rng, &none);
  }
}

// d_ff and d_model large enough that a token group's transposed activations
// would pass the kernel's L2 budget: phase 2 walks K in spans (2 and 3
// here), phase 1 takes smaller token groups.
TEST_F(GemmKernels, TokenLanesLongKMatchesFloat64Reference) {
  std::mt19937 rng(20261202);
  check_table(colibri::kernels::avx512_tokens_kernels(), WeightType::kF16, 5, 8200, 70, rng);
  check_table(colibri::kernels::avx512_tokens_kernels(), WeightType::kBF16, 3, 11000, 40, rng);
  check_table(colibri::kernels::avx512_tokens_kernels(), WeightType::kF32, 9000, 3, 40, rng);
  // Phase 2 in several K spans over many row blocks of the 40-token layout
  // (5 accumulator vectors per row kept across spans).
  check_table(colibri::kernels::avx512_tokens_kernels(), WeightType::kF16, 300, 11000, 40, rng);
}
#endif

}  // namespace
