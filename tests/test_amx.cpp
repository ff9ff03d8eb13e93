// The AMX-BF16 prefill kernels ("amx-bf16") against float64 references, on
// the same packed layout, shapes and checks as test_gemm.cpp: odd sizes,
// partial row ranges, gathered and repeated tokens, poisoned outputs.
//
// Two references:
//  - "rounded": computed in float64 on the bf16-rounded weights and the
//    bf16-rounded activations (x for gate_up, h for down), i.e. on exactly
//    the values the tiles multiply. Products of two bf16 values are exact in
//    fp32, so what is left is the fp32 accumulation inside tdpbf16ps (at most
//    K roundings of 2^-24 relative each on a running sum bounded by
//    sum|terms|: max(1e-5, K 2^-24) * sum|terms|), the final fma into y
//    (2^-23 relative) and the exp approximation of silu (~1e-6 relative).
//  - "unrounded": the exact weights and activations. Each product then also
//    carries the bf16 rounding: one rounding (2^-8 relative, RNE on an 8-bit
//    significand) for bf16 weights, two (2^-7 + 2^-16) for f16/f32 weights.
// The split table ("amx-f16-split", f16 weights at fp32-grade precision) is
// checked against the unrounded reference with the fp32 summation bound
// (K 2^-24, without acc_rel's floor) over its 5K accumulated terms (each an exact product of two bf16 parts, summing
// to at most (1 + 2^-8)^2 sum|w x|) plus the dropped lo*x3 part (<= 2^-24 of
// each product).
// Errors in g and u propagate through silu(g)*u with |silu'| <= 1.1:
//   |silu(g')u' - silu(g)u| <= 1.1 e_g (|u| + e_u) + |silu(g)| e_u.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/amx.h"
#include "kernel_scratch.h"
#include "util/half.h"

namespace {

using colibri::kernels::ExpertShape;
using colibri::kernels::KernelTable;
using colibri::kernels::WeightType;

struct Packed {
  ExpertShape s;
  std::vector<uint8_t> gate_up, down;

  void put(std::vector<uint8_t>& buf, size_t idx, float v) const {
    if (s.weight_type == WeightType::kF32) {
      std::memcpy(&buf[idx * 4], &v, 4);
    } else {
      const uint16_t h = s.weight_type == WeightType::kF16 ? colibri::float_to_f16(v) : colibri::float_to_bf16(v);
      std::memcpy(&buf[idx * 2], &h, 2);
    }
  }
  float get(const std::vector<uint8_t>& buf, size_t idx) const {
    if (s.weight_type == WeightType::kF32) {
      float v;
      std::memcpy(&v, &buf[idx * 4], 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, &buf[idx * 2], 2);
    return s.weight_type == WeightType::kF16 ? colibri::f16_to_float(h) : colibri::bf16_to_float(h);
  }
};

Packed make_packed(int D, int F, WeightType wt, std::mt19937& rng) {
  Packed p;
  p.s = colibri::kernels::make_expert_shape(D, F, wt);
  const size_t es = colibri::weight_format(wt).block_bytes;
  // Exactly sized, padding zero as the loader writes it.
  p.gate_up.assign(2 * static_cast<size_t>(F) * p.s.gate_up_stride * es, 0);
  p.down.assign(static_cast<size_t>(D) * p.s.down_stride * es, 0);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int r = 0; r < 2 * F; ++r)
    for (int k = 0; k < D; ++k) p.put(p.gate_up, r * p.s.gate_up_stride + k, u(rng));
  for (int r = 0; r < D; ++r)
    for (int k = 0; k < F; ++k) p.put(p.down, r * p.s.down_stride + k, u(rng));
  return p;
}

const char* type_name(WeightType t) {
  return t == WeightType::kF32 ? "f32" : t == WeightType::kF16 ? "f16" : "bf16";
}

double bf16_round(float v) { return colibri::bf16_to_float(colibri::float_to_bf16(v)); }

// Relative error bound per product against the unrounded reference.
double product_rel(WeightType wt) {
  const double u = std::ldexp(1.0, -8);
  return wt == WeightType::kBF16 ? u : 2 * u + u * u;
}

// fp32 accumulation error, relative to sum|terms|: at most K roundings of
// 2^-24 on a running sum bounded by sum|terms|; 1e-5 covers K <= 167.
double acc_rel(int K) { return std::max(1e-5, K * std::ldexp(1.0, -24)); }

// Which reference a table is held to (see the top of the file).
enum class Ref { kRounded, kUnrounded, kSplit };

// Error bound relative to sum|terms| of a K-long dot product.
double dot_rel(Ref ref, WeightType wt, int K) {
  switch (ref) {
    case Ref::kRounded:
      return acc_rel(K);
    case Ref::kUnrounded:
      return product_rel(wt) + acc_rel(K) * (1 + product_rel(wt));
    case Ref::kSplit:
      // No 1e-5 floor here: the bound must be tight enough that dropping
      // the x3 part (2^-16 of a product) fails for short K.
      return std::ldexp(1.0, -24) + (5 * K + 1) * std::ldexp(1.0, -24) * 1.01;
  }
  return 0;
}

struct Worst {
  double ratio = 0;
  std::string where;
  void see(double r, const std::string& what) {
    if (!(r <= ratio)) {
      ratio = r;
      where = what;
    }
  }
};

// One gate_up call over [fb, fe) into NaN-poisoned h, checked element-wise.
// rounded: reference on bf16-rounded weights and x.
void check_gate_up(const KernelTable& k, const Packed& p, const std::vector<float>& x, const std::vector<int32_t>& idx,
                   int n, int fb, int fe, Ref ref_kind, const std::string& label, Worst* overall,
                   colibri::kernels::KernelScratch* scratch = colibri_test::thread_scratch()) {
  const bool rounded = ref_kind == Ref::kRounded;
  const int D = p.s.d_model, F = p.s.d_ff;
  const size_t ldh = static_cast<size_t>(F) + 3;
  std::vector<float> h(static_cast<size_t>(n) * ldh, NAN);
  k.gate_up(p.s, p.gate_up.data(), x.data(), static_cast<size_t>(D), idx.data(), n, fb, fe, h.data(), ldh, scratch);
  const double rel = dot_rel(ref_kind, p.s.weight_type, D);
  Worst worst;
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
        double wg = p.get(p.gate_up, 2 * f * p.s.gate_up_stride + c);
        double wu = p.get(p.gate_up, (2 * f + 1) * p.s.gate_up_stride + c);
        double xv = xi[c];
        if (rounded) {
          wg = bf16_round(static_cast<float>(wg));
          wu = bf16_round(static_cast<float>(wu));
          xv = bf16_round(xi[c]);
        }
        g += wg * xv;
        up += wu * xv;
        mag_g += std::fabs(wg * xv);
        mag_u += std::fabs(wu * xv);
      }
      const double silu = g / (1.0 + std::exp(-g));
      const double ref = silu * up;
      const double e_g = rel * mag_g, e_u = rel * mag_u;
      const double tol = 1.1 * e_g * (std::fabs(up) + e_u) + std::fabs(silu) * e_u + 1e-6 * std::fabs(ref) + 1e-30;
      worst.see(std::fabs(got - ref) / tol, label + " h[" + std::to_string(i) + "][" + std::to_string(f) + "] got " +
                                                std::to_string(got) + " ref " + std::to_string(ref));
    }
  }
  EXPECT_LE(worst.ratio, 1.0) << "worst gate_up element: " << worst.where;
  overall->see(worst.ratio, worst.where);
}

// One down call over [db, de) into prefilled y, checked element-wise; y
// outside the range must be untouched.
void check_down(const KernelTable& k, const Packed& p, const std::vector<float>& h, size_t ldh,
                const std::vector<int32_t>& idx, const std::vector<float>& w, int n, int T, int db, int de,
                Ref ref_kind, std::mt19937& rng, const std::string& label, Worst* overall,
                colibri::kernels::KernelScratch* scratch = colibri_test::thread_scratch()) {
  const bool rounded = ref_kind == Ref::kRounded;
  const int D = p.s.d_model, F = p.s.d_ff;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> y(static_cast<size_t>(T) * D);
  for (float& v : y) v = u(rng);
  const std::vector<float> y0 = y;
  k.down(p.s, p.down.data(), h.data(), ldh, idx.data(), w.data(), n, db, de, y.data(), static_cast<size_t>(D), scratch);
  const double rel = dot_rel(ref_kind, p.s.weight_type, F);
  std::vector<double> ref(y0.begin(), y0.end()), tol(y0.size(), 1e-30);
  for (int i = 0; i < n; ++i) {
    for (int d = db; d < de; ++d) {
      double acc = 0, m = 0;
      for (int f = 0; f < F; ++f) {
        double wd = p.get(p.down, static_cast<size_t>(d) * p.s.down_stride + f);
        double hv = h[static_cast<size_t>(i) * ldh + f];
        if (rounded) {
          wd = bf16_round(static_cast<float>(wd));
          hv = bf16_round(h[static_cast<size_t>(i) * ldh + f]);
        }
        acc += wd * hv;
        m += std::fabs(wd * hv);
      }
      const size_t o = static_cast<size_t>(idx[static_cast<size_t>(i)]) * D + d;
      const double wi = w[static_cast<size_t>(i)];
      ref[o] += wi * acc;
      // The dot's error scaled by |w|, plus one fp32 rounding of the fma.
      tol[o] += rel * std::fabs(wi) * m + std::ldexp(std::fabs(ref[o]) + std::fabs(wi * acc), -23);
    }
  }
  Worst worst;
  for (size_t o = 0; o < y.size(); ++o) {
    const int d = static_cast<int>(o % static_cast<size_t>(D));
    if (d < db || d >= de) {
      ASSERT_EQ(y[o], y0[o]) << "y[" << o << "] touched outside the range";
      continue;
    }
    worst.see(std::fabs(y[o] - ref[o]) / tol[o],
              label + " y[" + std::to_string(o) + "] got " + std::to_string(y[o]) + " ref " + std::to_string(ref[o]));
  }
  EXPECT_LE(worst.ratio, 1.0) << "worst down element: " << worst.where;
  overall->see(worst.ratio, worst.where);
}

class AmxKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!colibri::kernels::amx_available()) GTEST_SKIP() << "no usable AMX-BF16 (CPU, XCR0 or Linux permission)";
  }
};

#if defined(COLIBRI_HAVE_X86_KERNELS)

TEST(AmxTable, Name) {
  const KernelTable& k = colibri::kernels::amx_bf16_kernels();
  EXPECT_STREQ(k.name, "amx-bf16");
  EXPECT_NE(k.gate_up, nullptr);
  EXPECT_NE(k.down, nullptr);
  EXPECT_STREQ(colibri::kernels::amx_f16_split_kernels().name, "amx-f16-split");
}

// The tables and the reference each is held to in the tests below that do
// not compare against the rounded reference.
struct TableCase {
  const KernelTable* k;
  Ref ref;
};
std::vector<TableCase> all_tables() {
  return {{&colibri::kernels::amx_bf16_kernels(), Ref::kUnrounded},
          {&colibri::kernels::amx_f16_split_kernels(), Ref::kSplit}};
}

// All shapes of test_gemm.cpp plus sizes that exercise the tile grid: K on
// and off multiples of 32, more than two 16-token blocks (pairs + a single
// block), row ranges with a partial last panel and a lone last panel.
// The split table gets every weight type too: f32 and bf16 go to the fp32
// kernels, which meet the same bound.
void run_shapes(const KernelTable& k, Ref ref, colibri::kernels::KernelScratch* scratch = colibri_test::thread_scratch()) {
  const bool rounded = ref == Ref::kRounded;
  std::mt19937 rng(rounded ? 20261130 : 20261201);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Worst gate_up_worst, down_worst;
  for (WeightType wt : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
    for (int D : {1, 7, 16, 33, 64, 100, 129}) {
      for (int F : {1, 5, 17, 48, 100}) {
        for (int n : {1, 3, 8, 9, 21, 40}) {
          const std::string label = std::string(type_name(wt)) + " D=" + std::to_string(D) +
                                    " F=" + std::to_string(F) + " n=" + std::to_string(n);
          SCOPED_TRACE(label);
          const Packed p = make_packed(D, F, wt, rng);
          const int T = n + 3;
          std::vector<float> x(static_cast<size_t>(T) * D);
          for (float& v : x) v = u(rng);
          std::vector<int32_t> idx(static_cast<size_t>(n));
          for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = (i * 7 + 2) % T;  // gathered, some repeated
          const int fb = F > 4 ? 1 : 0, fe = F > 4 ? F - 1 : F;
          check_gate_up(k, p, x, idx, n, fb, fe, ref, label, &gate_up_worst, scratch);

          const size_t ldh = static_cast<size_t>(F) + 3;
          std::vector<float> h(static_cast<size_t>(n) * ldh);
          for (float& v : h) v = u(rng);
          std::vector<float> w(static_cast<size_t>(n));
          for (float& v : w) v = u(rng);
          const int db = D > 4 ? 2 : 0, de = D > 4 ? D - 1 : D;
          check_down(k, p, h, ldh, idx, w, n, T, db, de, ref, rng, label, &down_worst, scratch);
        }
      }
    }
  }
  std::printf("[ worst    ] %s, %s reference, error / tolerance: gate_up %.3g (%s), down %.3g (%s)\n", k.name,
              rounded ? "rounded" : "unrounded", gate_up_worst.ratio, gate_up_worst.where.c_str(), down_worst.ratio,
              down_worst.where.c_str());
}

TEST_F(AmxKernels, MatchRoundedFloat64Reference) { run_shapes(colibri::kernels::amx_bf16_kernels(), Ref::kRounded); }

TEST_F(AmxKernels, MatchUnroundedFloat64Reference) {
  run_shapes(colibri::kernels::amx_bf16_kernels(), Ref::kUnrounded);
}

TEST_F(AmxKernels, SplitMatchesFloat64ReferenceAtFp32Bound) {
  run_shapes(colibri::kernels::amx_f16_split_kernels(), Ref::kSplit);
}

// With no working memory to be had, the kernels fall back to the decode
// kernels (bf16 dot products for bf16 weights, fp32 otherwise), which stay
// within the same bound; they must not return with the output unwritten.
TEST_F(AmxKernels, NoScratchFallsBackToDecodeKernels) {
  colibri::kernels::KernelScratch none;
  none.set_limit(0);
  for (const TableCase& t : all_tables()) run_shapes(*t.k, t.ref, &none);
}

// Each table on the weight types it computes on the tiles, held to its
// tightest reference: the rounded one for amx-bf16, the fp32 bound for the
// split table.
struct TiledCase {
  const KernelTable* k;
  Ref ref;
  WeightType wt;
};
std::vector<TiledCase> tiled_cases(std::initializer_list<WeightType> bf16_table_types) {
  std::vector<TiledCase> cases;
  for (WeightType wt : bf16_table_types) cases.push_back({&colibri::kernels::amx_bf16_kernels(), Ref::kRounded, wt});
  cases.push_back({&colibri::kernels::amx_f16_split_kernels(), Ref::kSplit, WeightType::kF16});
  return cases;
}

// A model-sized slice: long K (many tile steps), 5 token blocks.
TEST_F(AmxKernels, LargerShape) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const TiledCase& tc : tiled_cases({WeightType::kBF16, WeightType::kF32})) {
    const KernelTable& k = *tc.k;
    const WeightType wt = tc.wt;
    SCOPED_TRACE(std::string(k.name) + " " + type_name(wt));
    const int D = 520, F = 1000, n = 70, T = 90;
    const Packed p = make_packed(D, F, wt, rng);
    std::vector<float> x(static_cast<size_t>(T) * D);
    for (float& v : x) v = u(rng);
    std::vector<int32_t> idx(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = (i * 13 + 5) % T;
    Worst gw, dw;
    check_gate_up(k, p, x, idx, n, 3, 250, tc.ref, "large", &gw);
    const size_t ldh = static_cast<size_t>(F);
    std::vector<float> h(static_cast<size_t>(n) * ldh);
    for (float& v : h) v = u(rng);
    std::vector<float> w(static_cast<size_t>(n));
    for (float& v : w) v = u(rng);
    check_down(k, p, h, ldh, idx, w, n, T, 5, 517, tc.ref, rng, "large", &dw);
  }
}

// Long K with many tokens: the kernels then split K into chunks (the
// activations of all token blocks per chunk <= 768 KB), run groups of up to
// 8 row units (16 gate/up rows, 32 down rows) over each chunk and keep their
// accumulators in memory between chunks. n = 129 (9 blocks) at K = 4096
// gives chunks of 85 + 43 steps and, with 10 units in range, groups of 8 + 2;
// n = 1030 (65 blocks) at K = 600 gives the 16-step minimum (16 + 3) with
// one unit per group. Against the rounded reference, and bit-identical to an
// unchunked call on a prefix of the tokens (storing and reloading fp32 tiles
// is exact).
TEST_F(AmxKernels, ChunkedK) {
  colibri::kernels::KernelScratch* const scratch = colibri_test::thread_scratch();
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  struct Case {
    int D, F, n, fe, de;  // h rows [1, fe) and y columns [2, de) checked
  };
  for (const TiledCase& tc : tiled_cases({WeightType::kBF16, WeightType::kF16})) {
    const KernelTable& k = *tc.k;
    const WeightType wt = tc.wt;
    for (Case cs : {Case{4096, 150, 129, 149, 19}, Case{300, 4096, 129, 21, 298}, Case{600, 600, 1030, 21, 19}}) {
      const std::string label = std::string(k.name) + " " + type_name(wt) + " D=" + std::to_string(cs.D) +
                                " F=" + std::to_string(cs.F) + " n=" + std::to_string(cs.n);
      SCOPED_TRACE(label);
      const int D = cs.D, F = cs.F, n = cs.n, T = n + 5;
      const Packed p = make_packed(D, F, wt, rng);
      std::vector<float> x(static_cast<size_t>(T) * D);
      for (float& v : x) v = u(rng);
      std::vector<int32_t> idx(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = (i * 7 + 3) % T;
      Worst gw, dw;
      const int fe = cs.fe;
      check_gate_up(k, p, x, idx, n, 1, fe, tc.ref, label, &gw);
      const size_t ldh = static_cast<size_t>(F);
      std::vector<float> h(static_cast<size_t>(n) * ldh);
      for (float& v : h) v = u(rng);
      std::vector<float> w(static_cast<size_t>(n));
      for (float& v : w) v = u(rng);
      const int de = cs.de;
      check_down(k, p, h, ldh, idx, w, n, T, 2, de, tc.ref, rng, label, &dw);

      const int m = 31;  // 2 blocks: one chunk
      std::vector<float> h_all(static_cast<size_t>(n) * ldh), h_few(static_cast<size_t>(m) * ldh);
      k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, 0, fe, h_all.data(), ldh, scratch);
      k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), m, 0, fe, h_few.data(), ldh, scratch);
      for (int i = 0; i < m; ++i) {
        ASSERT_EQ(std::memcmp(&h_all[static_cast<size_t>(i) * ldh], &h_few[static_cast<size_t>(i) * ldh],
                              static_cast<size_t>(fe) * sizeof(float)),
                  0)
            << "gate_up token " << i;
      }
      // down: distinct tokens so each y row gets exactly one contribution.
      std::vector<int32_t> ident(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) ident[static_cast<size_t>(i)] = i;
      std::vector<float> y_all(static_cast<size_t>(n) * D, 0.0f), y_few(static_cast<size_t>(m) * D, 0.0f);
      k.down(p.s, p.down.data(), h.data(), ldh, ident.data(), w.data(), n, 0, de, y_all.data(), D, scratch);
      k.down(p.s, p.down.data(), h.data(), ldh, ident.data(), w.data(), m, 0, de, y_few.data(), D, scratch);
      ASSERT_EQ(std::memcmp(y_all.data(), y_few.data(), y_few.size() * sizeof(float)), 0);
    }
  }
}

// Each output element is one tdpbf16ps chain over K whatever the row range,
// token block or thread: splitting the rows (also across threads, each with
// its own tile configuration and buffers) must give identical bits.
TEST_F(AmxKernels, IndependentOfPartitionAndThreads) {
  colibri::kernels::KernelScratch* const scratch = colibri_test::thread_scratch();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const TiledCase& tc : tiled_cases({WeightType::kBF16, WeightType::kF16, WeightType::kF32})) {
    const KernelTable& k = *tc.k;
    const WeightType wt = tc.wt;
    SCOPED_TRACE(std::string(k.name) + " " + type_name(wt));
    const int D = 200, F = 300, n = 37, T = 41;
    const Packed p = make_packed(D, F, wt, rng);
    std::vector<float> x(static_cast<size_t>(T) * D);
    for (float& v : x) v = u(rng);
    std::vector<int32_t> idx(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = (i * 5 + 1) % T;
    const size_t ldh = static_cast<size_t>(F);
    std::vector<float> h_full(static_cast<size_t>(n) * ldh), h_split(h_full.size());
    k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, 0, F, h_full.data(), ldh, scratch);
    {
      std::thread a([&] { k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, 0, 7, h_split.data(), ldh, colibri_test::thread_scratch()); });
      std::thread b([&] { k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, 7, 141, h_split.data(), ldh, colibri_test::thread_scratch()); });
      k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, 141, F, h_split.data(), ldh, scratch);
      a.join();
      b.join();
    }
    ASSERT_EQ(std::memcmp(h_full.data(), h_split.data(), h_full.size() * sizeof(float)), 0);

    std::vector<float> w(static_cast<size_t>(n));
    for (float& v : w) v = u(rng);
    std::vector<float> y_full(static_cast<size_t>(T) * D);
    for (float& v : y_full) v = u(rng);
    std::vector<float> y_split = y_full;
    k.down(p.s, p.down.data(), h_full.data(), ldh, idx.data(), w.data(), n, 0, D, y_full.data(), D, scratch);
    {
      std::thread a([&] { k.down(p.s, p.down.data(), h_full.data(), ldh, idx.data(), w.data(), n, 0, 19, y_split.data(), D, colibri_test::thread_scratch()); });
      std::thread b([&] { k.down(p.s, p.down.data(), h_full.data(), ldh, idx.data(), w.data(), n, 19, 100, y_split.data(), D, colibri_test::thread_scratch()); });
      k.down(p.s, p.down.data(), h_full.data(), ldh, idx.data(), w.data(), n, 100, D, y_split.data(), D, scratch);
      a.join();
      b.join();
    }
    ASSERT_EQ(std::memcmp(y_full.data(), y_split.data(), y_full.size() * sizeof(float)), 0);
  }
}

// Either phase with its activations prepared once per expert (`prepare`,
// as the engine runs it) gives the plain kernel's bits exactly, for every
// row range; with no scratch it falls back to the decode kernels on the
// plain arguments, as the plain kernel does.
TEST_F(AmxKernels, PreparedMatchesPlain) {
  colibri::kernels::KernelScratch* const scratch = colibri_test::thread_scratch();
  using colibri::kernels::Phase;
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const TiledCase& tc : tiled_cases({WeightType::kBF16, WeightType::kF16, WeightType::kF32})) {
    const KernelTable& k = *tc.k;
    ASSERT_NE(k.prepared_bytes, nullptr);
    ASSERT_NE(k.prepare, nullptr);
    ASSERT_NE(k.gate_up_prepared, nullptr);
    ASSERT_NE(k.down_prepared, nullptr);
    // D and F not multiples of 32 (zero-padded K), n from one token to
    // several blocks, and chunked K (n = 129 at 4096).
    struct Case {
      int D, F, n;
    };
    for (Case cs : {Case{70, 200, 1}, Case{70, 200, 37}, Case{48, 4096, 129}, Case{4096, 48, 129}}) {
      const std::string label = std::string(k.name) + " " + type_name(tc.wt) + " D=" + std::to_string(cs.D) +
                                " F=" + std::to_string(cs.F) + " n=" + std::to_string(cs.n);
      SCOPED_TRACE(label);
      const int D = cs.D, F = cs.F, n = cs.n, T = n + 3;
      const Packed p = make_packed(D, F, tc.wt, rng);
      std::vector<float> x(static_cast<size_t>(T) * D);
      for (float& v : x) v = u(rng);
      const size_t ldh = static_cast<size_t>(F) + 5;
      std::vector<float> h(static_cast<size_t>(n) * ldh);
      for (float& v : h) v = u(rng);
      std::vector<int32_t> idx(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = (i * 5 + 2) % T;
      std::vector<float> w(static_cast<size_t>(n));
      for (float& v : w) v = u(rng);
      // Poisoned (NaN bytes): every byte the kernels read must have been written.
      auto prepared_for = [&](Phase phase, const float* act, size_t ld, const int32_t* index,
                              std::vector<uint8_t>* storage) {
        const size_t bytes = k.prepared_bytes(p.s, phase, n);
        EXPECT_GT(bytes, 0u);
        EXPECT_EQ(bytes % 64, 0u);
        storage->assign(bytes + 64, 0xff);
        void* out = storage->data() + (64 - reinterpret_cast<uintptr_t>(storage->data()) % 64) % 64;
        k.prepare(p.s, phase, act, ld, index, n, out);
        return static_cast<const void*>(out);
      };
      std::vector<uint8_t> up_storage, down_storage;
      const void* up = prepared_for(Phase::kGateUp, x.data(), static_cast<size_t>(D), idx.data(), &up_storage);
      const void* down = prepared_for(Phase::kDown, h.data(), ldh, nullptr, &down_storage);

      const std::pair<int, int> f_ranges[] = {{0, F}, {3, 35}, {40, F}};
      std::vector<float> h_plain(static_cast<size_t>(n) * ldh, NAN), h_prep = h_plain;
      for (const auto& r : f_ranges) {
        k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, r.first, r.second, h_plain.data(), ldh, scratch);
        k.gate_up_prepared(p.s, p.gate_up.data(), x.data(), D, idx.data(), up, n, r.first, r.second, h_prep.data(),
                           ldh, scratch);
      }
      ASSERT_EQ(std::memcmp(h_plain.data(), h_prep.data(), h_plain.size() * sizeof(float)), 0);

      std::vector<float> y0(static_cast<size_t>(T) * D);
      for (float& v : y0) v = u(rng);
      std::vector<float> y_plain = y0, y_prep = y0;
      const std::pair<int, int> d_ranges[] = {{0, D}, {3, 35}, {40, D}};
      for (const auto& r : d_ranges) {
        k.down(p.s, p.down.data(), h.data(), ldh, idx.data(), w.data(), n, r.first, r.second, y_plain.data(), D, scratch);
        k.down_prepared(p.s, p.down.data(), h.data(), ldh, down, idx.data(), w.data(), n, r.first, r.second,
                        y_prep.data(), D, scratch);
      }
      ASSERT_EQ(std::memcmp(y_plain.data(), y_prep.data(), y_plain.size() * sizeof(float)), 0);

      colibri::kernels::KernelScratch none;
      none.set_limit(0);
      std::vector<float> hf_plain(static_cast<size_t>(n) * ldh, NAN), hf_prep = hf_plain;
      k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, 0, F, hf_plain.data(), ldh, &none);
      k.gate_up_prepared(p.s, p.gate_up.data(), x.data(), D, idx.data(), up, n, 0, F, hf_prep.data(), ldh, &none);
      ASSERT_EQ(std::memcmp(hf_plain.data(), hf_prep.data(), hf_plain.size() * sizeof(float)), 0);
      std::vector<float> yf_plain = y0, yf_prep = y0;
      k.down(p.s, p.down.data(), h.data(), ldh, idx.data(), w.data(), n, 0, D, yf_plain.data(), D, &none);
      k.down_prepared(p.s, p.down.data(), h.data(), ldh, down, idx.data(), w.data(), n, 0, D, yf_prep.data(), D, &none);
      ASSERT_EQ(std::memcmp(yf_plain.data(), yf_prep.data(), yf_plain.size() * sizeof(float)), 0);
    }
  }
  // The split table prepares nothing for the weights it hands to the fp32
  // kernels.
  const KernelTable& split = colibri::kernels::amx_f16_split_kernels();
  const ExpertShape bf16 = colibri::kernels::make_expert_shape(64, 64, WeightType::kBF16);
  EXPECT_EQ(split.prepared_bytes(bf16, Phase::kGateUp, 32), 0u);
  EXPECT_EQ(split.prepared_bytes(bf16, Phase::kDown, 32), 0u);
}

#endif

// Other code on the caller's thread may release the tiles between our calls
// (oneDNN's AMX kernels do, under PyTorch): the next call must configure
// them again instead of faulting with SIGILL.
TEST_F(AmxKernels, SurvivesTilesReleasedByOtherCode) {
  colibri::kernels::KernelScratch* const scratch = colibri_test::thread_scratch();
  const KernelTable& k = colibri::kernels::amx_bf16_kernels();
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int D = 64, F = 48, n = 20;
  const Packed p = make_packed(D, F, WeightType::kBF16, rng);
  std::vector<float> x(static_cast<size_t>(n) * D);
  for (float& v : x) v = u(rng);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = i;
  std::vector<float> h1(static_cast<size_t>(n) * F), h2(h1.size(), std::nanf(""));
  k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, 0, F, h1.data(), F, scratch);
  __asm__ volatile("tilerelease" ::: "memory");
  k.gate_up(p.s, p.gate_up.data(), x.data(), D, idx.data(), n, 0, F, h2.data(), F, scratch);
  EXPECT_EQ(std::memcmp(h1.data(), h2.data(), h1.size() * sizeof(float)), 0);
  __asm__ volatile("tilerelease" ::: "memory");
  std::vector<float> w(static_cast<size_t>(n), 0.5f), y(x.size(), 0.0f);
  k.down(p.s, p.down.data(), h1.data(), F, idx.data(), w.data(), n, 0, D, y.data(), D, scratch);
  for (float v : y) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
