// Kernel tests: every ISA this machine can run, every weight type, awkward
// sizes, gathered tokens and partial row ranges, checked against a float64
// reference computed from the stored (rounded) weights. Buffers are sized
// exactly, so an over-read of the unpadded activations shows up under ASan.
// The bf16-compute table ("avx512-bf16", activations rounded to bf16) runs
// the same tests where the CPU has AVX512_BF16, with a tolerance derived
// from that rounding (see kBf16ActEps) and a second, tight check against a
// reference that rounds the activations the same way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernel_scratch.h"
#include "kernels/amx.h"
#include "kernels/kernels.h"
#include "kernels/quant_dot.h"
#include "util/half.h"

namespace colibri::kernels {
namespace {

constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx};
constexpr WeightType kAllTypes[] = {WeightType::kF32, WeightType::kF16, WeightType::kBF16};

// A kernel table under test: each ISA level's fp32 table, the bf16-compute
// table and its split (fp32-grade) form (ISA level avx512, need AVX512_BF16).
enum class Variant : uint8_t { kScalar, kAvx2, kAvx512, kAvx512Bf16, kAvx512Bf16Split };
constexpr Variant kAllVariants[] = {Variant::kScalar, Variant::kAvx2, Variant::kAvx512, Variant::kAvx512Bf16,
                                    Variant::kAvx512Bf16Split};

Isa variant_isa(Variant v) {
  switch (v) {
    case Variant::kScalar:
      return Isa::kScalar;
    case Variant::kAvx2:
      return Isa::kAvx2;
    case Variant::kAvx512:
    case Variant::kAvx512Bf16:
    case Variant::kAvx512Bf16Split:
      return Isa::kAvx512;
  }
  return Isa::kScalar;
}

const char* variant_name(Variant v) {
  if (v == Variant::kAvx512Bf16) return "avx512bf16";
  if (v == Variant::kAvx512Bf16Split) return "avx512bf16split";
  return isa_name(variant_isa(v));
}
void PrintTo(Variant v, std::ostream* os) { *os << variant_name(v); }

const char* type_name(WeightType t) {
  switch (t) {
    case WeightType::kF32:
      return "f32";
    case WeightType::kF16:
      return "f16";
    case WeightType::kBF16:
      return "bf16";
    default:  // block formats run the tables of ffn_quant.cpp
      break;
  }
  return "?";
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// A packed weight block as expert_store would write it, plus the decoded
// values the reference uses (so rounding to f16/bf16 is not counted as error).
struct PackedMatrix {
  std::unique_ptr<uint8_t, FreeDeleter> bytes;
  std::vector<double> values;  // rows x cols, unpadded
  size_t rows = 0;
  size_t cols = 0;
  size_t stride = 0;  // elements
  const void* data() const { return bytes.get(); }
};

// Nonzero values of either sign: a kernel that skips an element or reads the
// wrong one cannot hide behind a zero.
float random_nonzero(std::mt19937_64& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> mag(0.05f, 1.0f);
  std::bernoulli_distribution neg(0.5);
  const float v = mag(rng) * scale;
  return neg(rng) ? -v : v;
}

PackedMatrix make_matrix(size_t rows, size_t cols, WeightType t, std::mt19937_64& rng) {
  PackedMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.stride = padded_row_elements(t, cols, kRowAlignBytes);
  const size_t elem = weight_format(t).block_bytes;
  const size_t bytes = rows * m.stride * elem;
  EXPECT_EQ(m.stride * elem % kRowAlignBytes, 0u);
  m.bytes.reset(static_cast<uint8_t*>(std::aligned_alloc(kRowAlignBytes, std::max<size_t>(bytes, kRowAlignBytes))));
  std::memset(m.bytes.get(), 0, bytes);  // padding must be zero
  m.values.resize(rows * cols);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) {
      const float v = random_nonzero(rng);
      const size_t at = r * m.stride + c;
      double stored = 0.0;
      switch (t) {
        case WeightType::kF32:
          reinterpret_cast<float*>(m.bytes.get())[at] = v;
          stored = v;
          break;
        case WeightType::kF16: {
          const uint16_t b = float_to_f16(v);
          reinterpret_cast<uint16_t*>(m.bytes.get())[at] = b;
          stored = f16_to_float(b);
          break;
        }
        case WeightType::kBF16: {
          const uint16_t b = float_to_bf16(v);
          reinterpret_cast<uint16_t*>(m.bytes.get())[at] = b;
          stored = bf16_to_float(b);
          break;
        }
        default:  // block formats run the tables of ffn_quant.cpp
          break;
      }
      EXPECT_NE(stored, 0.0);
      m.values[r * cols + c] = stored;
    }
  }
  return m;
}

// A random non-empty sub-range of [0, size); never the whole range when a
// proper one exists, so both ends of the kernels' row loops are exercised.
void random_range(int32_t size, std::mt19937_64& rng, int32_t* begin, int32_t* end) {
  if (size <= 1) {
    *begin = 0;
    *end = size;
    return;
  }
  std::uniform_int_distribution<int32_t> lo(0, size / 3);
  std::uniform_int_distribution<int32_t> hi(size - size / 3, size);
  *begin = lo(rng);
  *end = hi(rng);
  if (*begin == 0 && *end == size) {
    if (rng() & 1) {
      *begin = 1;
    } else {
      *end = size - 1;
    }
  }
  if (*begin >= *end) *end = *begin + 1;
}

// token_index: distinct rows of an activation matrix with `rows` rows, in a
// shuffled order, always including the last row so that reading past the end
// of a gathered row runs off the end of the allocation.
std::vector<int32_t> random_gather(int32_t n, int32_t rows, std::mt19937_64& rng) {
  std::vector<int32_t> all(static_cast<size_t>(rows));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end() - 1, rng);
  std::vector<int32_t> idx(all.begin(), all.begin() + (n - 1));
  idx.push_back(rows - 1);
  std::shuffle(idx.begin(), idx.end(), rng);
  return idx;
}

// Error allowance of one dot product, relative to S = sum_j |w_j a_j|.
//
// fp32 activations: the fp32 sums of the SIMD and scalar kernels stay within
// kF32DotEps * S at the lengths tested (the accumulation error of the
// kernels' blocked sums).
//
// bf16 activations (avx512-bf16 with bf16 weights): each activation is
// rounded to bf16 (8 significant bits, round to nearest even), so
// a^_j = a_j (1 + d_j) with |d_j| <= u = 2^-8 (half of 2^-7, the spacing of
// bf16 values in [1, 2)). A product of two bf16 values is exact in fp32
// (8 + 8 <= 24 bits), so the products carry exactly that error and the fp32
// sums add their own:
//   |got - ref| <= |sum_j w_j a_j d_j| + kF32DotEps * sum_j |w_j a^_j|
//              <= 2^-8 S + kF32DotEps (1 + 2^-8) S.
// (Denormal activations and weights are flushed to zero by the hardware; the
// tests' values are far from that range.)
constexpr double kF32DotEps = 1e-5;
constexpr double kBf16ActEps = 0.00390625 /* 2^-8 */ + kF32DotEps * (1.0 + 0.00390625);

// Activations as the kernel multiplies them.
enum class Act { kF32, kBf16 };

double act_value(float a, Act act) {
  return act == Act::kBf16 ? static_cast<double>(bf16_to_float(float_to_bf16(a))) : a;
}

// Tracks the element with the largest error relative to its tolerance.
struct Worst {
  double ratio = 0.0;
  std::string where;
  void update(double got, double ref, double tol, const std::string& label) {
    const double err = std::fabs(got - ref);
    const double r = std::isfinite(got) ? err / tol : std::numeric_limits<double>::infinity();
    if (r > ratio || (!std::isfinite(r) && where.empty())) {
      ratio = r;
      std::ostringstream os;
      os.precision(9);
      os << label << " got=" << got << " ref=" << ref << " err=" << err << " tol=" << tol;
      where = os.str();
    }
  }
};

struct Case {
  int32_t d_model;
  int32_t d_ff;
  int32_t n;
};

std::string describe(const KernelTable& k, WeightType t, const Case& c) {
  std::ostringstream os;
  os << k.name << " " << type_name(t) << " D=" << c.d_model << " F=" << c.d_ff << " n=" << c.n;
  return os.str();
}

// The bf16-compute table rounds activations only for bf16 weights; other
// weight types passed to it take the fp32 path.
bool is_bf16_compute(const KernelTable& k) { return std::strcmp(k.name, "avx512-bf16") == 0; }
Act act_of(const KernelTable& k, WeightType t) {
  return is_bf16_compute(k) && t == WeightType::kBF16 ? Act::kBf16 : Act::kF32;
}

// Bound on |silu(g^) u^ - silu(g) u| given |g^ - g| <= eg, |u^ - u| <= eu:
//   <= |silu(g^) - silu(g)| |u^| + |silu(g)| |u^ - u|
//   <= 1.1 eg (|u| + eu) + |silu(g)| eu        (|silu'| < 1.1 everywhere).
// The last terms cover exp and the final float roundings.
double silu_mul_tol(double eg, double eu, double u, double silu, double ref) {
  return 1.1 * eg * (std::fabs(u) + eu) + std::fabs(silu) * eu + 1e-6 * std::fabs(ref) + 1e-30;
}

void check_gate_up(const KernelTable& k, WeightType t, const Case& c, std::mt19937_64& rng) {
  const Act act = act_of(k, t);
  const ExpertShape s = make_expert_shape(c.d_model, c.d_ff, t);
  const PackedMatrix w = make_matrix(2 * static_cast<size_t>(c.d_ff), static_cast<size_t>(c.d_model), t, rng);
  ASSERT_EQ(w.stride, s.gate_up_stride);

  const int32_t x_rows = c.n + 3;
  const size_t ldx = static_cast<size_t>(c.d_model) + (rng() % 2 ? 5 : 0);
  std::vector<float> x((static_cast<size_t>(x_rows) - 1) * ldx + static_cast<size_t>(c.d_model));
  for (float& v : x) v = random_nonzero(rng);
  const std::vector<int32_t> tok = random_gather(c.n, x_rows, rng);

  int32_t f_begin = 0, f_end = 0;
  random_range(c.d_ff, rng, &f_begin, &f_end);
  const size_t ldh = static_cast<size_t>(c.d_ff) + (rng() % 2 ? 3 : 0);
  const size_t h_size = (static_cast<size_t>(c.n) - 1) * ldh + static_cast<size_t>(c.d_ff);
  std::vector<float> h(h_size, std::numeric_limits<float>::quiet_NaN());

  k.gate_up(s, w.data(), x.data(), ldx, tok.data(), c.n, f_begin, f_end, h.data(), ldh, colibri_test::thread_scratch());

  // worst: against the exact float64 result, with the tolerance of the
  // kernel's arithmetic. worst_rounded (bf16 activations only): against a
  // reference that rounds x to bf16 as the kernel does, with the fp32
  // tolerance; that one catches a skipped or misplaced element, which the
  // wide 2^-8 bound could hide for long rows.
  Worst worst, worst_rounded;
  size_t bad_untouched = 0;
  std::string first_bad;
  std::vector<double> xr(static_cast<size_t>(c.d_model));
  for (int32_t i = 0; i < c.n; ++i) {
    const float* xi = x.data() + static_cast<size_t>(tok[static_cast<size_t>(i)]) * ldx;
    for (size_t j = 0; j < xr.size(); ++j) xr[j] = act_value(xi[j], act);
    for (size_t col = 0; col < ldh && static_cast<size_t>(i) * ldh + col < h_size; ++col) {
      const float got = h[static_cast<size_t>(i) * ldh + col];
      const int32_t f = static_cast<int32_t>(col);
      if (f < f_begin || f >= f_end) {
        if (!std::isnan(got) && bad_untouched++ == 0) {
          first_bad = "token " + std::to_string(i) + " col " + std::to_string(col);
        }
        continue;
      }
      const double* gr = &w.values[static_cast<size_t>(2 * f) * w.cols];
      const double* ur = gr + w.cols;
      double g = 0, u = 0, sg = 0, su = 0, g_r = 0, u_r = 0, sg_r = 0, su_r = 0;
      for (size_t j = 0; j < w.cols; ++j) {
        g += gr[j] * xi[j];
        u += ur[j] * xi[j];
        sg += std::fabs(gr[j] * xi[j]);
        su += std::fabs(ur[j] * xi[j]);
        g_r += gr[j] * xr[j];
        u_r += ur[j] * xr[j];
        sg_r += std::fabs(gr[j] * xr[j]);
        su_r += std::fabs(ur[j] * xr[j]);
      }
      const double silu = g / (1.0 + std::exp(-g));
      const double ref = silu * u;
      const double eps = act == Act::kBf16 ? kBf16ActEps : kF32DotEps;
      const std::string label = "token " + std::to_string(i) + " f " + std::to_string(f);
      worst.update(got, ref, silu_mul_tol(eps * sg, eps * su, u, silu, ref), label);
      if (act == Act::kBf16) {
        const double silu_r = g_r / (1.0 + std::exp(-g_r));
        const double ref_r = silu_r * u_r;
        worst_rounded.update(got, ref_r,
                             silu_mul_tol(kF32DotEps * sg_r, kF32DotEps * su_r, u_r, silu_r, ref_r),
                             label);
      }
    }
  }
  EXPECT_EQ(bad_untouched, 0u) << describe(k, t, c) << ": gate_up wrote outside [" << f_begin << ","
                               << f_end << "), first at " << first_bad;
  EXPECT_LE(worst.ratio, 1.0) << describe(k, t, c) << " f=[" << f_begin << "," << f_end
                              << "): worst " << worst.where;
  EXPECT_LE(worst_rounded.ratio, 1.0) << describe(k, t, c) << " f=[" << f_begin << "," << f_end
                                      << "), activations rounded to bf16 in the reference: worst "
                                      << worst_rounded.where;
}

void check_down(const KernelTable& k, WeightType t, const Case& c, std::mt19937_64& rng,
                const std::vector<int32_t>* fixed_tokens = nullptr) {
  const Act act = act_of(k, t);
  const double eps = act == Act::kBf16 ? kBf16ActEps : kF32DotEps;
  const ExpertShape s = make_expert_shape(c.d_model, c.d_ff, t);
  const PackedMatrix w = make_matrix(static_cast<size_t>(c.d_model), static_cast<size_t>(c.d_ff), t, rng);
  ASSERT_EQ(w.stride, s.down_stride);

  const size_t ldh = static_cast<size_t>(c.d_ff) + (rng() % 2 ? 3 : 0);
  std::vector<float> h((static_cast<size_t>(c.n) - 1) * ldh + static_cast<size_t>(c.d_ff));
  for (float& v : h) v = random_nonzero(rng);
  std::vector<float> weight(static_cast<size_t>(c.n));
  for (float& v : weight) v = random_nonzero(rng);

  const int32_t y_rows = c.n + 3;
  std::vector<int32_t> tok = fixed_tokens ? *fixed_tokens : random_gather(c.n, y_rows, rng);
  const size_t ldy = static_cast<size_t>(c.d_model) + (rng() % 2 ? 2 : 0);
  std::vector<float> y((static_cast<size_t>(y_rows) - 1) * ldy + static_cast<size_t>(c.d_model));
  for (float& v : y) v = random_nonzero(rng, 4.0f);
  const std::vector<float> y_before = y;

  int32_t d_begin = 0, d_end = 0;
  random_range(c.d_model, rng, &d_begin, &d_end);

  k.down(s, w.data(), h.data(), ldh, tok.data(), weight.data(), c.n, d_begin, d_end, y.data(), ldy, colibri_test::thread_scratch());

  // Expected y and its tolerance, built in float64 in the kernel's order:
  // ref/tol from the exact h with the kernel's dot-product allowance eps;
  // ref_r/tol_r (bf16 activations only) from h rounded to bf16 as the
  // kernel does, with the fp32 allowance.
  std::vector<double> ref(y.size()), ref_r(y.size());
  std::vector<double> tol(y.size(), 0.0), tol_r(y.size(), 0.0);
  std::vector<bool> touched(y.size(), false);
  for (size_t e = 0; e < y.size(); ++e) ref[e] = ref_r[e] = y_before[e];
  std::vector<double> hr(static_cast<size_t>(c.d_ff));
  for (int32_t i = 0; i < c.n; ++i) {
    const float* hi = h.data() + static_cast<size_t>(i) * ldh;
    for (size_t j = 0; j < hr.size(); ++j) hr[j] = act_value(hi[j], act);
    const double wi = weight[static_cast<size_t>(i)];
    for (int32_t d = d_begin; d < d_end; ++d) {
      const double* row = &w.values[static_cast<size_t>(d) * w.cols];
      double dot = 0, sum_abs = 0, dot_r = 0, sum_abs_r = 0;
      for (size_t j = 0; j < w.cols; ++j) {
        dot += row[j] * hi[j];
        sum_abs += std::fabs(row[j] * hi[j]);
        dot_r += row[j] * hr[j];
        sum_abs_r += std::fabs(row[j] * hr[j]);
      }
      const size_t e = static_cast<size_t>(tok[static_cast<size_t>(i)]) * ldy + static_cast<size_t>(d);
      const double contrib = wi * dot, contrib_r = wi * dot_r;
      ref[e] += contrib;
      ref_r[e] += contrib_r;
      // Dot-product error, then the product and the add each round once.
      constexpr double kRound = 2.0 * std::numeric_limits<float>::epsilon();
      tol[e] += eps * std::fabs(wi) * sum_abs + kRound * (std::fabs(ref[e]) + std::fabs(contrib));
      tol_r[e] += kF32DotEps * std::fabs(wi) * sum_abs_r +
                  kRound * (std::fabs(ref_r[e]) + std::fabs(contrib_r));
      touched[e] = true;
    }
  }

  Worst worst, worst_rounded;
  size_t bad_untouched = 0;
  std::string first_bad;
  for (size_t e = 0; e < y.size(); ++e) {
    if (!touched[e]) {
      if (std::memcmp(&y[e], &y_before[e], sizeof(float)) != 0 && bad_untouched++ == 0) {
        first_bad = "row " + std::to_string(e / ldy) + " col " + std::to_string(e % ldy);
      }
      continue;
    }
    const std::string label = "row " + std::to_string(e / ldy) + " d " + std::to_string(e % ldy);
    worst.update(y[e], ref[e], tol[e] + 1e-30, label);
    if (act == Act::kBf16) worst_rounded.update(y[e], ref_r[e], tol_r[e] + 1e-30, label);
  }
  EXPECT_EQ(bad_untouched, 0u) << describe(k, t, c) << ": down wrote outside [" << d_begin << ","
                               << d_end << ") or to an unlisted token, first at " << first_bad;
  EXPECT_LE(worst.ratio, 1.0) << describe(k, t, c) << " d=[" << d_begin << "," << d_end
                              << "): worst " << worst.where;
  EXPECT_LE(worst_rounded.ratio, 1.0) << describe(k, t, c) << " d=[" << d_begin << "," << d_end
                                      << "), activations rounded to bf16 in the reference: worst "
                                      << worst_rounded.where;
}

}  // namespace

// Readable parameters in gtest's failure lines (found by ADL, so outside the
// anonymous namespace).
void PrintTo(Isa isa, std::ostream* os) { *os << isa_name(isa); }
void PrintTo(WeightType t, std::ostream* os) { *os << type_name(t); }

namespace {

class KernelTest : public ::testing::TestWithParam<std::tuple<Variant, WeightType>> {
 protected:
  void SetUp() override {
    variant_ = std::get<0>(GetParam());
    isa_ = variant_isa(variant_);
    type_ = std::get<1>(GetParam());
    if (!isa_supported(isa_)) GTEST_SKIP() << isa_name(isa_) << " not supported on this CPU";
    if (variant_ == Variant::kAvx512Bf16 || variant_ == Variant::kAvx512Bf16Split) {
      if (!bf16_compute_available(isa_)) GTEST_SKIP() << "AVX512_BF16 not supported on this CPU";
      // The bf16_compute prefill table for bf16 weights without AMX, and the
      // bf16 decode table (held to the fp32 tolerance); f32/f16 weights
      // given to them must take the fp32 path.
      table_ = variant_ == Variant::kAvx512Bf16 ? &avx512_bf16_kernels() : &avx512_bf16_split_kernels();
      if (variant_ == Variant::kAvx512Bf16Split) {
        ASSERT_EQ(table_, plan_kernels(isa_, make_expert_shape(256, 256, WeightType::kBF16), PrefillPrecision::kDefault).decode);
      }
    } else {
      table_ = &kernel_table(isa_);
    }
    ASSERT_EQ(table_->isa, isa_);
    ASSERT_NE(table_->gate_up, nullptr);
    ASSERT_NE(table_->down, nullptr);
  }
  uint64_t seed(uint64_t salt) const {
    return salt * 1000003u + static_cast<uint64_t>(variant_) * 31u + static_cast<uint64_t>(type_);
  }

  Variant variant_ = Variant::kScalar;
  Isa isa_ = Isa::kScalar;
  WeightType type_ = WeightType::kF32;
  const KernelTable* table_ = nullptr;
};

// 50: the last partial vector pair of a 16-bit row (32 elements per cache
// line) reaches into its second half (50 % 32 = 18).
constexpr int32_t kSizes[] = {1, 7, 16, 50, 100, 129, 256};
constexpr int32_t kTokenCounts[] = {1, 2, 3, 5, 8};

TEST_P(KernelTest, GateUpSmallShapes) {
  std::mt19937_64 rng(seed(1));
  for (int32_t d : kSizes) {
    for (int32_t f : kSizes) {
      for (int32_t n : kTokenCounts) {
        check_gate_up(*table_, type_, Case{d, f, n}, rng);
        if (HasFailure()) return;  // one shape's report is enough
      }
    }
  }
}

TEST_P(KernelTest, DownSmallShapes) {
  std::mt19937_64 rng(seed(2));
  for (int32_t d : kSizes) {
    for (int32_t f : kSizes) {
      for (int32_t n : kTokenCounts) {
        check_down(*table_, type_, Case{d, f, n}, rng);
        if (HasFailure()) return;
      }
    }
  }
}

TEST_P(KernelTest, RealisticShape) {
  std::mt19937_64 rng(seed(3));
  for (int32_t n : {1, 5, 8}) {
    check_gate_up(*table_, type_, Case{1024, 512, n}, rng);
    check_down(*table_, type_, Case{1024, 512, n}, rng);
  }
}

// Rows longer than the kernels' K chunks (the bf16 kernels convert 2048
// activations at a time and carry fp32 partial sums across chunks), with a
// last chunk of 54 (one whole vector pair and a partial one reaching into its
// second half), and enough rows for several row chunks.
TEST_P(KernelTest, LongRows) {
  std::mt19937_64 rng(seed(6));
  for (int32_t n : {1, 6}) {
    check_gate_up(*table_, type_, Case{4150, 67, n}, rng);
    check_down(*table_, type_, Case{67, 4150, n}, rng);
    if (HasFailure()) return;
  }
}

// The interface allows the same output row twice; the adds accumulate.
TEST_P(KernelTest, DownRepeatedTokens) {
  std::mt19937_64 rng(seed(4));
  const std::vector<int32_t> tok = {3, 1, 3, 0, 1, 3};
  for (int32_t d : {7, 129}) check_down(*table_, type_, Case{d, 100, 6}, rng, &tok);
}

TEST_P(KernelTest, EmptyRangesTouchNothing) {
  std::mt19937_64 rng(seed(5));
  const ExpertShape s = make_expert_shape(33, 20, type_);
  const PackedMatrix gu = make_matrix(40, 33, type_, rng);
  const PackedMatrix dn = make_matrix(33, 20, type_, rng);
  std::vector<float> x(33, 1.0f);
  std::vector<float> h(20, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> y(33, 2.0f);
  const int32_t tok = 0;
  const float wt = 1.0f;
  table_->gate_up(s, gu.data(), x.data(), 33, &tok, 1, 5, 5, h.data(), 20, colibri_test::thread_scratch());
  for (float v : h) EXPECT_TRUE(std::isnan(v));
  table_->gate_up(s, gu.data(), x.data(), 33, &tok, 0, 0, 20, h.data(), 20, colibri_test::thread_scratch());
  for (float v : h) EXPECT_TRUE(std::isnan(v));
  std::vector<float> hv(20, 1.0f);
  table_->down(s, dn.data(), hv.data(), 20, &tok, &wt, 1, 9, 9, y.data(), 33, colibri_test::thread_scratch());
  table_->down(s, dn.data(), hv.data(), 20, &tok, &wt, 0, 0, 33, y.data(), 33, colibri_test::thread_scratch());
  for (float v : y) EXPECT_EQ(v, 2.0f);
}

std::string param_name(const ::testing::TestParamInfo<KernelTest::ParamType>& p) {
  return std::string(variant_name(std::get<0>(p.param))) + "_" + type_name(std::get<1>(p.param));
}

INSTANTIATE_TEST_SUITE_P(AllIsasAndTypes, KernelTest,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::ValuesIn(kAllTypes)),
                         param_name);

TEST(IsaTest, DetectionIsConsistent) {
  const Isa detected = detect_isa();
  EXPECT_EQ(detect_isa(), detected);  // cached, stable
  EXPECT_LE(default_isa(), detected);
  EXPECT_TRUE(isa_supported(Isa::kScalar));
  EXPECT_TRUE(isa_supported(detected));
  for (Isa isa : kAllIsas) EXPECT_EQ(isa_supported(isa), isa <= detected) << isa_name(isa);
  if (cpu_has_avx512_bf16()) {
    EXPECT_GE(detected, Isa::kAvx512);
  }
  // The AMX level is exactly "AVX-512 and the tiles may run".
  EXPECT_EQ(detected == Isa::kAmx, colibri::kernels::amx_available());
  if (detected == Isa::kAmx) {
    EXPECT_TRUE(cpu_has_avx512_bf16());
  }
}

TEST(IsaTest, DefaultHonoursEnvironment) {
  // default_isa() is cached at first use, so this checks whatever the test
  // process was started with rather than setting the variable here.
  const Isa detected = detect_isa();
  Isa requested = detected;
  const char* env = std::getenv("COLIBRI_ISA");
  const Isa expected = parse_isa(env, &requested) ? std::min(requested, detected) : detected;
  EXPECT_EQ(default_isa(), expected) << "COLIBRI_ISA=" << (env ? env : "(unset)");
}

TEST(IsaTest, ParseAndName) {
  for (Isa isa : kAllIsas) {
    Isa parsed = Isa::kScalar;
    EXPECT_TRUE(parse_isa(isa_name(isa), &parsed)) << isa_name(isa);
    EXPECT_EQ(parsed, isa);
  }
  Isa out = Isa::kAvx2;
  EXPECT_TRUE(parse_isa("AVX512", &out));
  EXPECT_EQ(out, Isa::kAvx512);
  for (const char* bad : {"", "sse", "avx", "avx5120", "avx2 ", "scalar2"}) {
    Isa unchanged = Isa::kAvx2;
    EXPECT_FALSE(parse_isa(bad, &unchanged)) << '"' << bad << '"';
    EXPECT_EQ(unchanged, Isa::kAvx2);
  }
  EXPECT_FALSE(parse_isa(nullptr, &out));
  EXPECT_STREQ(isa_name(Isa::kScalar), "scalar");
  EXPECT_STREQ(isa_name(Isa::kAvx2), "avx2");
  EXPECT_STREQ(isa_name(Isa::kAvx512), "avx512");
  EXPECT_STREQ(isa_name(Isa::kAmx), "amx");
  EXPECT_TRUE(parse_isa("AMX", &out));
  EXPECT_EQ(out, Isa::kAmx);
}

// The decode table a level gets: the highest vector level at or below it
// (the AMX level decodes with the AVX-512 kernels; its tiles are prefill's).
Isa expected_decode_isa(Isa isa) {
  const Isa level = std::min(isa, detect_isa());
  return std::min(level, Isa::kAvx512);
}

TEST(IsaTest, KernelTableFallsBack) {
  const Isa detected = detect_isa();
  for (Isa isa : kAllIsas) {
    const KernelTable& k = kernel_table(isa);
    EXPECT_EQ(k.isa, expected_decode_isa(isa)) << isa_name(isa);
    EXPECT_LE(k.isa, detected);
    EXPECT_STREQ(k.name, isa_name(k.isa));
    EXPECT_NE(k.gate_up, nullptr);
    EXPECT_NE(k.down, nullptr);
  }
  EXPECT_EQ(&kernel_table(Isa::kScalar), &scalar_kernels());
}

// Every weight type decodes with the fp32 table of the level (decode is
// bound by reading the weights, so it keeps fp32 grade); the bf16
// dot-product table is usable exactly at avx512 and above on AVX512_BF16
// CPUs, and COLIBRI_ISA=avx2/scalar (a lower level) selects the lower kernels.
TEST(IsaTest, DecodeTableIsFp32ForEveryWeightType) {
  const Isa detected = detect_isa();
  EXPECT_EQ(bf16_compute_available(Isa::kAvx512), cpu_has_avx512_bf16());
  EXPECT_FALSE(bf16_compute_available(Isa::kAvx2));
  EXPECT_FALSE(bf16_compute_available(Isa::kScalar));
  for (Isa isa : kAllIsas) {
    const KernelTable& k = kernel_table(isa);
    EXPECT_EQ(k.isa, expected_decode_isa(isa)) << isa_name(isa);
    EXPECT_LE(k.isa, detected);
    EXPECT_STRNE(k.name, "avx512-bf16");
  }
}

}  // namespace
}  // namespace colibri::kernels

namespace colibri {
namespace {

// The format table is the only place that knows element sizes: check each
// entry against the encodings it names, on random values.
TEST(WeightFormatTest, FloatFormatsRoundTripAndSizes) {
  std::mt19937_64 rng(41);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> x(37), back(37, -777.0f);
  for (float& v : x) v = dist(rng);
  struct Want {
    WeightType t;
    const char* name;
    uint32_t bytes;
  };
  for (const Want w : {Want{WeightType::kF32, "f32", 4}, Want{WeightType::kF16, "f16", 2},
                       Want{WeightType::kBF16, "bf16", 2}}) {
    const WeightFormat& f = weight_format(w.t);
    EXPECT_EQ(f.type, w.t);
    EXPECT_STREQ(f.name, w.name);
    EXPECT_EQ(f.block_elements, 1u);
    EXPECT_EQ(f.block_bytes, w.bytes);
    EXPECT_EQ(weight_row_bytes(w.t, 37), 37u * w.bytes);
    const size_t padded = padded_row_elements(w.t, 37, 64);
    EXPECT_EQ(padded, (37u * w.bytes + 63) / 64 * 64 / w.bytes);  // whole 64-byte lines
    EXPECT_EQ(weight_row_bytes(w.t, padded) % 64, 0u);
    std::vector<uint8_t> enc(weight_row_bytes(w.t, x.size()), 0xAB);
    f.from_float(x.data(), enc.data(), x.size());
    f.to_float(enc.data(), back.data(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      float want = x[i];
      uint16_t h = 0;
      if (w.t == WeightType::kF16) want = f16_to_float(float_to_f16(x[i]));
      if (w.t == WeightType::kBF16) want = bf16_to_float(float_to_bf16(x[i]));
      if (w.t != WeightType::kF32) std::memcpy(&h, enc.data() + 2 * i, 2);
      ASSERT_EQ(back[i], want) << w.name << " element " << i;
      if (w.t == WeightType::kF16) {
        ASSERT_EQ(h, float_to_f16(x[i]));
      }
      if (w.t == WeightType::kBF16) {
        ASSERT_EQ(h, float_to_bf16(x[i]));
      }
    }
  }
}

}  // namespace
}  // namespace colibri

// The far prefetch hint: COLIBRI_PREFETCH when it says nta or l2, else
// non-temporal on AMD Zen 5 (family 26) and later only (kernels.h);
// quant_dot.h's entries hand out that compilation of the integer-dot kernels.
TEST(CpuFeatures, FarPrefetchHintFollowsTheOverrideElseTheVendorAndFamily) {
  const char* forced = std::getenv("COLIBRI_PREFETCH");
  bool expected = colibri::kernels::cpu_is_amd() && colibri::kernels::cpu_family() >= 26;
  if (forced != nullptr && std::strcmp(forced, "nta") == 0) expected = true;
  if (forced != nullptr && std::strcmp(forced, "l2") == 0) expected = false;
  EXPECT_EQ(colibri::kernels::far_prefetch_nta(), expected);
#if defined(__x86_64__)
  // The vendor string itself, read independently of cpu_features.cpp.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0u), "c"(0u));
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  const bool amd = std::strcmp(vendor, "AuthenticAMD") == 0 || std::strcmp(vendor, "HygonGenuine") == 0;
  EXPECT_EQ(colibri::kernels::cpu_is_amd(), amd) << vendor;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1u), "c"(0u));
  const unsigned base = (eax >> 8) & 0xfu;
  EXPECT_EQ(colibri::kernels::cpu_family(), base == 0xfu ? base + ((eax >> 20) & 0xffu) : base) << std::hex << eax;
#endif
#if defined(COLIBRI_HAVE_X86_KERNELS)
  using colibri::WeightType;
  namespace k = colibri::kernels;
  if (k::detect_isa() >= k::Isa::kAvx2) {
    const k::QuantDotKernels* picked = k::quant_dot_avx2(WeightType::kQ4_0);
    EXPECT_EQ(picked, expected ? k::far_nta::quant_dot_avx2(WeightType::kQ4_0)
                               : k::far_l2::quant_dot_avx2(WeightType::kQ4_0));
    EXPECT_NE(k::far_nta::quant_dot_avx2(WeightType::kQ4_0), k::far_l2::quant_dot_avx2(WeightType::kQ4_0));
  }
#endif
}
