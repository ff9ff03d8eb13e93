// The integer dot-product kernels of the block formats (quant_dot.h): the
// scalar activation quantiser against its definition, every instruction
// set's quantiser bit for bit against the scalar one, the scalar dot
// products against float64 dots of independently decoded weights and
// dequantised activations, and every instruction set's dot products against
// the scalar ones (each table called directly, so both AVX2-level ones,
// plain and AVX-VNNI, whichever selection picks); strides, zero padding
// and the output entries written; which table selection picks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/amx.h"
#include "kernels/quant_dot.h"
#include "util/half.h"
#include "util/quant_ref.h"
#include "util/quant_blocks.h"
#include "util/weight_format.h"

namespace colibri {
// Test names and failure messages show the format's name.
void PrintTo(WeightType t, std::ostream* os) { *os << weight_format(t).name; }
}  // namespace colibri

namespace {

using colibri::WeightType;
using colibri::kernels::QuantDotKernels;

constexpr WeightType kTypes[] = {WeightType::kQ8_0,  WeightType::kQ4_0,  WeightType::kQ4_K,   WeightType::kQ5_K,
                                 WeightType::kQ6_K,  WeightType::kMXFP4, WeightType::kQ4_1,   WeightType::kQ5_0,
                                 WeightType::kQ5_1,  WeightType::kIQ4_NL, WeightType::kIQ4_XS, WeightType::kQ2_K,
                                 WeightType::kQ3_K,  WeightType::kIQ2_XXS, WeightType::kIQ3_XXS, WeightType::kIQ1_S,
                                 WeightType::kIQ1_M, WeightType::kIQ2_XS, WeightType::kIQ2_S, WeightType::kIQ3_S, WeightType::kFP8_E4M3,
                                 WeightType::kTQ1_0, WeightType::kTQ2_0};

// Formats whose dot products the AVX-512 level leaves to the AVX2 level's
// kernels (quant_dot_avx512 gives nullptr).
bool avx2_level_only(WeightType /*t*/) { return false; }

bool ymm_named_apart(WeightType t) {
  return t == WeightType::kQ8_0 || t == WeightType::kQ4_0 || t == WeightType::kMXFP4 || t == WeightType::kQ4_K ||
         t == WeightType::kQ5_K || t == WeightType::kQ6_K;
}

const char* type_name(WeightType t) { return colibri::weight_format(t).name; }

// FP8 takes fp32 activations (quant_dot.h): x and zeros, 4 bytes each.
bool is_fp8(WeightType t) { return t == WeightType::kFP8_E4M3; }

size_t block_elements(WeightType t) { return colibri::weight_format(t).block_elements; }
size_t block_bytes(WeightType t) { return colibri::weight_format(t).block_bytes; }

struct IsaKernels {
  std::string name;
  const QuantDotKernels* (*get)(WeightType);
  bool (*runs_here)();  // whether this CPU runs them
  // The suffix of its kernels' names where not `name`, and whether it has
  // kernels for every quantised format.
  std::string kernel_suffix;
  bool every_format = true;
};

bool always() { return true; }

#if defined(COLIBRI_HAVE_X86_KERNELS)
bool has_avx2() { return colibri::kernels::detect_isa() >= colibri::kernels::Isa::kAvx2; }
bool has_avx512_vnni() {
  return colibri::kernels::detect_isa() >= colibri::kernels::Isa::kAvx512 && colibri::kernels::cpu_has_avx512_vnni();
}
bool has_amx_int8() { return has_avx512_vnni() && colibri::kernels::amx_int8_available(); }
#endif

// The scalar reference first, then every instruction set's tables, each
// called directly (both AVX2-level ones, whichever selection would pick).
const std::vector<IsaKernels>& all_isa_kernels() {
  static const std::vector<IsaKernels> v = {
      {"scalar", colibri::kernels::quant_dot_scalar, always, "", true},
#if defined(COLIBRI_HAVE_X86_KERNELS)
      {"avx2", colibri::kernels::quant_dot_avx2, has_avx2, "", true},
      {"avx2-vnni", colibri::kernels::quant_dot_avx_vnni, colibri::kernels::cpu_has_avx_vnni, "", true},
      {"avx512-vnni", colibri::kernels::quant_dot_avx512, has_avx512_vnni, "", true},
      // The AVX2-level kernels with EVEX ymm, which the grid i-quants no
      // longer reach through selection but keep as the zmm kernels' baseline.
      {"avx512-vnni-ymm", colibri::kernels::quant_dot_avx512_ymm, has_avx512_vnni, "avx512-vnni", false},
      // The AVX-512 kernels with the many-token products on AMX-INT8 tiles,
      // for the formats scaled per 32.
      {"amx-int8", colibri::kernels::quant_dot_amx_int8, has_amx_int8, "", false},
#endif
  };
  return v;
}

// The scalar reference first, then each instruction set this CPU runs
// that has kernels for t.
std::vector<IsaKernels> isa_kernels(WeightType t) {
  std::vector<IsaKernels> v;
  for (const IsaKernels& k : all_isa_kernels()) {
    if (k.runs_here() && k.get(t) != nullptr) v.push_back(k);
  }
  return v;
}

// ---------------------------------------------------------------- inputs

uint16_t random_scale(std::mt19937& rng, float lo, float hi, bool allow_negative) {
  std::uniform_real_distribution<float> mag(lo, hi);
  float v = mag(rng);
  if (allow_negative && (rng() & 1u)) v = -v;
  return colibri::float_to_f16(v);
}

// `rows` rows of n elements at `row_bytes` apart: random code bytes, finite
// random f16 scales; the padding past each row is random too.
std::vector<uint8_t> random_weights(WeightType t, size_t n, int rows, size_t row_bytes, std::mt19937& rng) {
  std::vector<uint8_t> w(row_bytes * static_cast<size_t>(rows));
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  const size_t nb = n / block_elements(t);
  for (int r = 0; r < rows; ++r) {
    for (size_t b = 0; b < nb; ++b) {
      uint8_t* blk = w.data() + static_cast<size_t>(r) * row_bytes + b * block_bytes(t);
      uint16_t h[2];
      switch (t) {
        case WeightType::kQ8_0:
        case WeightType::kQ4_0:
        case WeightType::kQ5_0:
          h[0] = random_scale(rng, 1e-3f, 2e-2f, true);
          std::memcpy(blk, h, 2);
          break;
        case WeightType::kIQ4_NL:
          h[0] = random_scale(rng, 1e-4f, 2e-3f, true);
          std::memcpy(blk, h, 2);
          break;
        case WeightType::kIQ2_XXS:
        case WeightType::kIQ3_XXS:
        case WeightType::kIQ2_XS:
        case WeightType::kIQ2_S:
        case WeightType::kIQ3_S:
          // d over the 4-bit sub-scales and grid values up to 43 (62; random bytes).
          h[0] = random_scale(rng, 1e-4f, 1e-3f, true);
          std::memcpy(blk, h, 2);
          break;
        case WeightType::kIQ1_S:
          // d over the sub-scales 2 s + 1 <= 15 and values g +- 1/8 in [-9/8, 9/8].
          h[0] = random_scale(rng, 1e-3f, 4e-3f, true);
          std::memcpy(blk, h, 2);
          break;
        case WeightType::kIQ1_M: {
          // d's four nibbles in the top of the four scale words.
          h[0] = random_scale(rng, 1e-3f, 4e-3f, true);
          uint8_t* sc = blk + offsetof(colibri::BlockIq1M, scales);
          for (int k = 0; k < 4; ++k) {
            sc[2 * k + 1] = static_cast<uint8_t>((sc[2 * k + 1] & 0x0f) | (((h[0] >> (4 * k)) & 0xf) << 4));
          }
          break;
        }
        case WeightType::kIQ4_XS:
          // d over the 6-bit sub-scales (ls - 32 in -32 .. 31, random bytes).
          h[0] = random_scale(rng, 1e-5f, 1e-4f, true);
          std::memcpy(blk, h, 2);
          break;
        case WeightType::kQ2_K:
          h[0] = random_scale(rng, 1e-4f, 4e-3f, false);
          h[1] = random_scale(rng, 1e-4f, 4e-3f, (rng() & 7u) == 0);
          std::memcpy(blk + offsetof(colibri::BlockQ2K, d), h, 4);
          break;
        case WeightType::kQ3_K:
          h[0] = random_scale(rng, 1e-4f, 1e-3f, true);
          std::memcpy(blk + offsetof(colibri::BlockQ3K, d), h, 2);
          break;
        case WeightType::kQ4_1:
        case WeightType::kQ5_1:
          // d > 0 and a min of either sign, as the quantisers write them.
          h[0] = random_scale(rng, 1e-3f, 4e-3f, false);
          h[1] = random_scale(rng, 1e-2f, 4e-2f, true);
          std::memcpy(blk, h, 4);
          break;
        case WeightType::kQ4_K:
        case WeightType::kQ5_K:
          h[0] = random_scale(rng, 1e-4f, 4e-3f, false);
          h[1] = random_scale(rng, 1e-4f, 4e-3f, (rng() & 7u) == 0);
          std::memcpy(blk, h, 4);
          break;
        case WeightType::kQ6_K:
          h[0] = random_scale(rng, 1e-4f, 1e-3f, true);
          std::memcpy(blk + offsetof(colibri::BlockQ6K, d), h, 2);
          break;
        case WeightType::kTQ1_0:
        case WeightType::kTQ2_0:
          // The scale last; every code byte is valid (TQ2_0's code 3 reads as 2).
          h[0] = random_scale(rng, 1e-3f, 2e-2f, true);
          std::memcpy(blk + block_bytes(t) - 2, h, 2);
          break;
        case WeightType::kFP8_E4M3: {
          // Float scales of either sign over every code but the NaN ones
          // (NanCodesGiveNan covers those): normals, subnormals, both zeros.
          std::uniform_real_distribution<float> mag(1e-3f, 1e-1f);
          const float d = (rng() & 1u) ? -mag(rng) : mag(rng);
          std::memcpy(blk, &d, sizeof d);
          for (size_t i = sizeof d; i < block_bytes(t); ++i) {
            if ((blk[i] & 0x7f) == 0x7f) blk[i] = static_cast<uint8_t>(blk[i] - 1);
          }
          break;
        }
        case WeightType::kMXFP4:
          // Scales 2^-12 .. 2^-4, and now and then the subnormal ones (e < 2).
          blk[0] = (rng() % 16 == 0) ? static_cast<uint8_t>(rng() % 2) : static_cast<uint8_t>(116 + rng() % 9);
          break;
        default:
          break;
      }
    }
  }
  return w;
}

// Normal activations with outliers and a zero stretch (an all-zero block).
std::vector<float> random_acts(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = normal(rng);
    if (rng() % 61 == 0) x[i] *= 40.0f;
  }
  if (n >= 512) std::fill(x.begin() + 256, x.begin() + 256 + 256, 0.0f);
  return x;
}

// ---------------------------------------------------------------- independent decoding

void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One row's weights (ggml's dequantize_row_* loops, in double), and each
// weight's magnitude for the error bound: |w| for the one-scale formats,
// |d sc q| + |dmin m| for q4_K / q5_K, whose kernels round both parts.
void decode_row(WeightType t, const uint8_t* row, size_t n, double* w, double* mag) {
  const size_t nb = n / block_elements(t);
  for (size_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * block_bytes(t);
    double* y = w + b * block_elements(t);
    double* g = mag + b * block_elements(t);
    switch (t) {
      case WeightType::kQ8_0: {
        const auto* q = reinterpret_cast<const colibri::BlockQ8_0*>(blk);
        const double d = colibri::f16_to_float(q->d);
        for (int i = 0; i < 32; ++i) y[i] = d * q->qs[i];
        for (int i = 0; i < 32; ++i) g[i] = std::fabs(y[i]);
        break;
      }
      case WeightType::kQ4_0: {
        const auto* q = reinterpret_cast<const colibri::BlockQ4_0*>(blk);
        const double d = colibri::f16_to_float(q->d);
        for (int i = 0; i < 16; ++i) {
          y[i] = d * ((q->qs[i] & 0x0F) - 8);
          y[i + 16] = d * ((q->qs[i] >> 4) - 8);
        }
        for (int i = 0; i < 32; ++i) g[i] = std::fabs(y[i]);
        break;
      }
      case WeightType::kMXFP4: {
        // The OCP E2M1 values (sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2^(e - 127).
        static constexpr double kE2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
        auto value = [](int code) { return (code & 8) ? -kE2m1[code & 7] : kE2m1[code & 7]; };
        const double d = std::ldexp(1.0, static_cast<int>(blk[0]) - 127);
        for (int i = 0; i < 16; ++i) {
          y[i] = d * value(blk[1 + i] & 0x0F);
          y[i + 16] = d * value(blk[1 + i] >> 4);
        }
        for (int i = 0; i < 32; ++i) g[i] = std::fabs(y[i]);
        break;
      }
      case WeightType::kQ4_K:
      case WeightType::kQ5_K: {
        const bool five = t == WeightType::kQ5_K;
        uint16_t d16, dmin16;
        const uint8_t* scales;
        const uint8_t* ql;
        const uint8_t* qh = nullptr;
        if (five) {
          const auto* q = reinterpret_cast<const colibri::BlockQ5K*>(blk);
          d16 = q->d, dmin16 = q->dmin, scales = q->scales, ql = q->qs, qh = q->qh;
        } else {
          const auto* q = reinterpret_cast<const colibri::BlockQ4K*>(blk);
          d16 = q->d, dmin16 = q->dmin, scales = q->scales, ql = q->qs;
        }
        const double d = colibri::f16_to_float(d16);
        const double dmin = colibri::f16_to_float(dmin16);
        int is = 0;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < 256; j += 64) {
          int sc, m;
          scale_min_k4(is + 0, scales, &sc, &m);
          const double d1 = d * sc, m1 = dmin * m;
          scale_min_k4(is + 1, scales, &sc, &m);
          const double d2 = d * sc, m2 = dmin * m;
          for (int l = 0; l < 32; ++l) {
            const int q1 = (ql[l] & 0xF) + (five && (qh[l] & u1) ? 16 : 0);
            const int q2 = (ql[l] >> 4) + (five && (qh[l] & u2) ? 16 : 0);
            y[j + l] = d1 * q1 - m1;
            y[j + l + 32] = d2 * q2 - m2;
            g[j + l] = std::fabs(d1 * q1) + std::fabs(m1);
            g[j + l + 32] = std::fabs(d2 * q2) + std::fabs(m2);
          }
          ql += 32;
          is += 2;
          u1 = static_cast<uint8_t>(u1 << 2);
          u2 = static_cast<uint8_t>(u2 << 2);
        }
        break;
      }
      case WeightType::kQ6_K: {
        const auto* q = reinterpret_cast<const colibri::BlockQ6K*>(blk);
        const double d = colibri::f16_to_float(q->d);
        const uint8_t* ql = q->ql;
        const uint8_t* qh = q->qh;
        const int8_t* sc = q->scales;
        for (int h = 0; h < 256; h += 128) {
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[h + l + 0] = d * sc[is + 0] * q1;
            y[h + l + 32] = d * sc[is + 2] * q2;
            y[h + l + 64] = d * sc[is + 4] * q3;
            y[h + l + 96] = d * sc[is + 6] * q4;
          }
          ql += 64;
          qh += 32;
          sc += 8;
        }
        for (int i = 0; i < 256; ++i) g[i] = std::fabs(y[i]);
        break;
      }
      default: {
        // The reference dequantiser, itself checked bit for bit against the
        // gguf package's (python/tests/test_quant_formats.py); magnitudes
        // |d q| + |m| for the formats with a min, whose kernels round both parts.
        std::vector<float> f(block_elements(t));
        colibri::weight_format(t).to_float(blk, f.data(), f.size());
        for (size_t i = 0; i < f.size(); ++i) {
          // The min of element i's (sub-)block: q4_1 / q5_1's m, q2_K's dmin * m_s.
          double m = 0.0;
          if (t == WeightType::kQ4_1 || t == WeightType::kQ5_1) {
            m = colibri::f16_to_float(reinterpret_cast<const uint16_t*>(blk)[1]);
          } else if (t == WeightType::kQ2_K) {
            const auto* q = reinterpret_cast<const colibri::BlockQ2K*>(blk);
            m = -static_cast<double>(colibri::f16_to_float(q->dmin)) * (q->scales[i / 16] >> 4);
          }
          y[i] = f[i];
          g[i] = std::fabs(f[i] - m) + std::fabs(m);
        }
        break;
      }
    }
  }
}

// The activation row of n elements (quant_dot.h): qs[n], d[n / 32] (float),
// sums[n / 16] (int16).
const int8_t* act_qs(const uint8_t* act) { return reinterpret_cast<const int8_t*>(act); }
float act_d(const uint8_t* act, size_t n, size_t block) {
  float d;
  std::memcpy(&d, act + n + block * sizeof(float), sizeof d);
  return d;
}
int act_sum16(const uint8_t* act, size_t n, size_t h) {
  int16_t s;
  std::memcpy(&s, act + n + n / 8 + h * sizeof(int16_t), sizeof s);
  return s;
}

// One token's dequantised activations (d * q) from its row; FP8's floats.
void decode_act(WeightType t, const uint8_t* act, size_t n, double* x) {
  if (is_fp8(t)) {
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, act + i * sizeof(float), sizeof v);
      x[i] = v;
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<double>(act_d(act, n, i / 32)) * act_qs(act)[i];
}

// ---------------------------------------------------------------- activation quantiser

// The definition (quant_dot.h): per block of 32 (for every format)
// d = max|x| / 127, q = round-to-nearest-even(x / d) clamped to
// [-127, 127], q = 0 when d == 0, elements past n_valid zero; the sums of
// the quants per 16.
void check_quantized_act(const std::vector<float>& x, size_t n_valid, size_t n, const uint8_t* got,
                         const std::string& what) {
  for (size_t b = 0; b < n / 32; ++b) {
    float amax = 0.0f;
    for (size_t i = 0; i < 32; ++i) {
      const size_t k = b * 32 + i;
      const float v = k < n_valid ? x[k] : 0.0f;
      amax = std::max(amax, std::fabs(v));
    }
    const float d = amax / 127.0f;
    int q[32];
    for (size_t i = 0; i < 32; ++i) {
      const size_t k = b * 32 + i;
      const float v = k < n_valid ? x[k] : 0.0f;
      q[i] = d == 0.0f ? 0 : static_cast<int>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(v / d))));
    }
    ASSERT_EQ(colibri::float_bits(act_d(got, n, b)), colibri::float_bits(d)) << what << " block " << b << " d";
    for (size_t i = 0; i < 32; ++i) {
      ASSERT_EQ(act_qs(got)[32 * b + i], q[i]) << what << " block " << b << " q[" << i << "]";
    }
    for (size_t h = 0; h < 2; ++h) {
      int s = 0;
      for (size_t i = 0; i < 16; ++i) s += q[16 * h + i];
      ASSERT_EQ(act_sum16(got, n, 2 * b + h), s) << what << " block " << b << " sums[" << h << "]";
    }
  }
}

// FP8's activation row (quant_dot.h): x[0, n_valid) as they are, then
// zeros (+0.0f) up to n.
void check_copied_act(const std::vector<float>& x, size_t n_valid, size_t n, const uint8_t* got,
                      const std::string& what) {
  for (size_t k = 0; k < n; ++k) {
    float v;
    std::memcpy(&v, got + k * sizeof(float), sizeof v);
    ASSERT_EQ(colibri::float_bits(v), colibri::float_bits(k < n_valid ? x[k] : 0.0f)) << what << " element " << k;
  }
}

// The activation row as format t defines it.
void check_act(WeightType t, const std::vector<float>& x, size_t n_valid, size_t n, const uint8_t* got,
               const std::string& what) {
  if (is_fp8(t)) return check_copied_act(x, n_valid, n, got, what);
  check_quantized_act(x, n_valid, n, got, what);
}

TEST(QuantDot, TablesAndSizes) {
  using colibri::kernels::Isa;
  for (WeightType t : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
    EXPECT_FALSE(colibri::kernels::is_quantized(t));
    EXPECT_EQ(colibri::kernels::quant_dot_kernels(t, Isa::kAmx), nullptr);
    EXPECT_EQ(colibri::kernels::quant_dot_scalar(t), nullptr);
    EXPECT_EQ(colibri::kernels::act_row_bytes(t, 256), 0u);
  }
  for (WeightType t : kTypes) {
    EXPECT_TRUE(colibri::kernels::is_quantized(t));
    if (is_fp8(t)) {
      EXPECT_EQ(colibri::kernels::act_row_bytes(t, 2048), 2048 * sizeof(float));
      EXPECT_EQ(colibri::kernels::act_row_bytes(t, block_elements(t)), block_elements(t) * sizeof(float));
    } else {
      // qs[n], d[n / 32] (float), sums[n / 16] (int16).
      EXPECT_EQ(colibri::kernels::act_row_bytes(t, 2048), 2048 + 2048 / 32 * 4 + 2048 / 16 * 2);
      EXPECT_EQ(colibri::kernels::act_row_bytes(t, block_elements(t)), block_elements(t) * 5 / 4);
    }
    EXPECT_EQ(colibri::kernels::quant_dot_kernels(t, Isa::kScalar), colibri::kernels::quant_dot_scalar(t));
    // Every table's name, also of those this CPU cannot run.
    for (const IsaKernels& k : all_isa_kernels()) {
      const QuantDotKernels* q = k.get(t);
      if (avx2_level_only(t) && k.name == "avx512-vnni") {
        EXPECT_EQ(q, nullptr) << type_name(t) << " has an AVX-512 kernel: drop it from avx2_level_only";
        continue;
      }
      if (q == nullptr && !k.every_format) continue;
      ASSERT_NE(q, nullptr) << k.name;
      // The EVEX ymm tables of the formats whose zmm per-row kernels came
      // first are named apart from those ("-avx512-vnni-ymm").
      const bool apart = k.name == "avx512-vnni-ymm" && ymm_named_apart(t);
      EXPECT_EQ(std::string(q->name), std::string(type_name(t)) + "-" +
                                          (apart ? k.name : k.kernel_suffix.empty() ? k.name : k.kernel_suffix));
    }
#if defined(COLIBRI_HAVE_X86_KERNELS)
    const Isa isa = colibri::kernels::detect_isa();
    const bool avx512_vnni = isa >= Isa::kAvx512 && colibri::kernels::cpu_has_avx512_vnni();
    const bool avx_vnni = colibri::kernels::cpu_has_avx_vnni();
    // The AVX2-level table selection hands out: with vpdpbusd where the CPU
    // has it, VEX (AVX-VNNI) or else EVEX on ymm (AVX512_VNNI).
    const QuantDotKernels* ymm = avx512_vnni ? colibri::kernels::quant_dot_avx512_ymm(t) : nullptr;
    const QuantDotKernels* avx2_level = avx_vnni        ? colibri::kernels::quant_dot_avx_vnni(t)
                                        : ymm != nullptr ? ymm
                                                         : colibri::kernels::quant_dot_avx2(t);
    EXPECT_NE(colibri::kernels::quant_dot_avx2(t), colibri::kernels::quant_dot_avx_vnni(t));
    const QuantDotKernels* top = colibri::kernels::quant_dot_kernels(t, Isa::kAmx);
    // At the AMX level with AMX-INT8, the tile variants where a format has them.
    const QuantDotKernels* amx_int8 =
        avx512_vnni && colibri::kernels::amx_int8_available() ? colibri::kernels::quant_dot_amx_int8(t) : nullptr;
    if (amx_int8 != nullptr) {
      EXPECT_EQ(top, amx_int8);
      EXPECT_EQ(colibri::kernels::quant_dot_kernels(t, Isa::kAvx512), colibri::kernels::quant_dot_avx512(t));
    } else if (avx512_vnni && !avx2_level_only(t)) {
      EXPECT_EQ(top, colibri::kernels::quant_dot_avx512(t));
      EXPECT_EQ(colibri::kernels::quant_dot_kernels(t, Isa::kAvx512), colibri::kernels::quant_dot_avx512(t));
    } else if (isa >= Isa::kAvx2) {
      EXPECT_EQ(top, avx2_level);
      EXPECT_EQ(colibri::kernels::quant_dot_kernels(t, Isa::kAvx512), avx2_level);
    } else {
      EXPECT_EQ(top, colibri::kernels::quant_dot_scalar(t));
    }
    if (isa >= Isa::kAvx2) {
      EXPECT_EQ(colibri::kernels::quant_dot_kernels(t, Isa::kAvx2), avx2_level) << "avx_vnni " << avx_vnni;
    } else {
      EXPECT_FALSE(avx_vnni) << "AVX-VNNI without the AVX2 level";
    }
#endif
  }
}

// The AVX-VNNI bit (CPUID.(EAX=7,ECX=1):EAX bit 4) as Linux lists it.
TEST(QuantDot, AvxVnniDetectionMatchesTheKernel) {
#if defined(COLIBRI_HAVE_X86_KERNELS) && defined(__linux__)
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line) && line.rfind("flags", 0) != 0) {
  }
  if (line.rfind("flags", 0) != 0) GTEST_SKIP() << "no flags in /proc/cpuinfo";
  const bool listed = (line + " ").find(" avx_vnni ") != std::string::npos;
  const bool avx2 = colibri::kernels::detect_isa() >= colibri::kernels::Isa::kAvx2;
  EXPECT_EQ(colibri::kernels::cpu_has_avx_vnni(), listed && avx2) << "listed " << listed << ", avx2 " << avx2;
#else
  GTEST_SKIP() << "needs x86 kernels and /proc/cpuinfo";
#endif
}

TEST(QuantDot, QuantizeActivations) {
  std::mt19937 rng(1234);
  for (WeightType t : kTypes) {
    const auto isas = isa_kernels(t);
    const size_t be = block_elements(t);
    for (size_t n : {be, 2 * be, 4096 + be, size_t{512} * 7}) {
      if (n % be != 0) continue;
      for (size_t n_valid : {n, n - 1, n - 37, n - be / 2 - 3, size_t{0}}) {
        if (n_valid > n) continue;
        std::vector<float> x = random_acts(n_valid, rng);
        const size_t bytes = colibri::kernels::act_row_bytes(t, n);
        std::vector<uint8_t> ref(bytes, 0xa5);
        isas[0].get(t)->quantize_act(x.data(), n_valid, n, ref.data());
        const std::string what = std::string(type_name(t)) + " n=" + std::to_string(n) +
                                 " n_valid=" + std::to_string(n_valid);
        check_act(t, x, n_valid, n, ref.data(), "scalar " + what);
        if (!is_fp8(t)) {
          // One layout for every integer format: the same bytes as q8_0's.
          std::vector<uint8_t> q8(bytes, 0x3c);
          isas[0].get(WeightType::kQ8_0)->quantize_act(x.data(), n_valid, n, q8.data());
          ASSERT_EQ(0, std::memcmp(q8.data(), ref.data(), bytes)) << what << " vs q8_0";
        }
        for (size_t i = 1; i < isas.size(); ++i) {
          std::vector<uint8_t> got(bytes, 0x5a);
          isas[i].get(t)->quantize_act(x.data(), n_valid, n, got.data());
          ASSERT_EQ(0, std::memcmp(got.data(), ref.data(), bytes)) << isas[i].name << " " << what;
        }
      }
    }
  }
}

// Rounding edge cases: exact halves, values just past the scale, tiny and
// huge magnitudes.
TEST(QuantDot, QuantizeActivationsEdgeCases) {
  std::mt19937 rng(99);
  for (WeightType t : kTypes) {
    const auto isas = isa_kernels(t);
    const size_t n = 512;
    std::vector<std::vector<float>> cases;
    std::vector<float> halves(n);
    for (size_t i = 0; i < n; ++i) halves[i] = (static_cast<float>(i % 255) - 127.0f) + 0.5f;
    halves[0] = 127.0f;
    cases.push_back(halves);
    std::vector<float> tiny(n);
    for (size_t i = 0; i < n; ++i) tiny[i] = std::ldexp(static_cast<float>(static_cast<int>(rng() % 2001) - 1000), -140);
    cases.push_back(tiny);
    std::vector<float> huge(n);
    for (size_t i = 0; i < n; ++i) huge[i] = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) * 1e34f;
    cases.push_back(huge);
    std::vector<float> ints(n);
    for (size_t i = 0; i < n; ++i) ints[i] = static_cast<float>(static_cast<int>(rng() % 255) - 127);
    cases.push_back(ints);
    for (size_t c = 0; c < cases.size(); ++c) {
      const size_t bytes = colibri::kernels::act_row_bytes(t, n);
      std::vector<uint8_t> ref(bytes);
      isas[0].get(t)->quantize_act(cases[c].data(), n, n, ref.data());
      const std::string what = std::string(type_name(t)) + " case " + std::to_string(c);
      check_act(t, cases[c], n, n, ref.data(), "scalar " + what);
      for (size_t i = 1; i < isas.size(); ++i) {
        std::vector<uint8_t> got(bytes);
        isas[i].get(t)->quantize_act(cases[c].data(), n, n, got.data());
        ASSERT_EQ(0, std::memcmp(got.data(), ref.data(), bytes)) << isas[i].name << " " << what;
      }
    }
  }
}

// ---------------------------------------------------------------- dot products

constexpr uint32_t kPoison = 0x7fc0deadu;  // a quiet NaN

struct DotCase {
  size_t n;
  std::vector<int> rows;
  std::vector<int> tokens;
};

// The scalar kernels against float64, then `isa`'s (unless it is the
// scalar one) against the scalar ones.
void run_dot_cases(WeightType t, const IsaKernels& isa, const DotCase& c, std::mt19937& rng) {
  std::vector<IsaKernels> isas = {all_isa_kernels()[0]};
  if (isa.get != isas[0].get) isas.push_back(isa);
  const int max_rows = *std::max_element(c.rows.begin(), c.rows.end());
  const int max_tokens = *std::max_element(c.tokens.begin(), c.tokens.end());
  const size_t n = c.n;
  const size_t row_bytes = colibri::weight_row_bytes(t, n) + 6;  // padded: strides honoured
  const size_t act_bytes = colibri::kernels::act_row_bytes(t, n) + 20;
  const std::vector<uint8_t> w = random_weights(t, n, max_rows, row_bytes, rng);

  // Every token quantised by the scalar reference (the instruction sets'
  // quantisers are bit-identical, checked above); some with n_valid < n.
  std::vector<uint8_t> act(act_bytes * static_cast<size_t>(max_tokens), 0xcc);
  for (int i = 0; i < max_tokens; ++i) {
    const size_t n_valid = (i % 3 == 2 && n > 19) ? n - 19 : n;
    std::vector<float> x = random_acts(n_valid, rng);
    colibri::kernels::quant_dot_scalar(t)->quantize_act(x.data(), n_valid, n,
                                                        act.data() + static_cast<size_t>(i) * act_bytes);
  }

  // float64 references and error scales for every (row, token).
  std::vector<double> ref(static_cast<size_t>(max_rows * max_tokens));
  std::vector<double> scale(ref.size());
  {
    std::vector<double> wd(n), mag(n), xd(n);
    std::vector<std::vector<double>> xs(static_cast<size_t>(max_tokens));
    for (int i = 0; i < max_tokens; ++i) {
      xs[static_cast<size_t>(i)].resize(n);
      decode_act(t, act.data() + static_cast<size_t>(i) * act_bytes, n, xs[static_cast<size_t>(i)].data());
    }
    for (int r = 0; r < max_rows; ++r) {
      decode_row(t, w.data() + static_cast<size_t>(r) * row_bytes, n, wd.data(), mag.data());
      for (int i = 0; i < max_tokens; ++i) {
        double s = 0.0, m = 0.0;
        const std::vector<double>& x = xs[static_cast<size_t>(i)];
        for (size_t k = 0; k < n; ++k) {
          s += wd[k] * x[k];
          m += mag[k] * std::fabs(x[k]);
        }
        ref[static_cast<size_t>(i * max_rows + r)] = s;
        scale[static_cast<size_t>(i * max_rows + r)] = m;
      }
    }
  }

  for (int rows : c.rows) {
    for (int tokens : c.tokens) {
      const size_t ld_out = static_cast<size_t>(rows) + 3;
      std::vector<float> scalar_out;
      for (size_t k = 0; k < isas.size(); ++k) {
        const QuantDotKernels* q = isas[k].get(t);
        std::vector<float> out(ld_out * static_cast<size_t>(tokens));
        for (float& o : out) o = colibri::bits_float(kPoison);
        q->dot_rows(w.data(), row_bytes, rows, act.data(), act_bytes, tokens, n, out.data(), ld_out);
        const std::string what = std::string(q->name) + " n=" + std::to_string(n) + " rows=" + std::to_string(rows) +
                                 " tokens=" + std::to_string(tokens);
        for (int i = 0; i < tokens; ++i) {
          for (size_t r = 0; r < ld_out; ++r) {
            const float got = out[static_cast<size_t>(i) * ld_out + r];
            if (r >= static_cast<size_t>(rows)) {
              ASSERT_EQ(colibri::float_bits(got), kPoison) << what << ": wrote out[" << i << "][" << r << "]";
              continue;
            }
            const size_t idx = static_cast<size_t>(i * max_rows) + r;
            const double tol = 1e-5 * scale[idx] + 1e-30;
            ASSERT_TRUE(std::isfinite(got)) << what << " token " << i << " row " << r;
            if (k == 0) {
              ASSERT_LE(std::fabs(got - ref[idx]), tol)
                  << what << " token " << i << " row " << r << ": " << got << " vs float64 " << ref[idx];
            } else {
              const float s = scalar_out[static_cast<size_t>(i) * ld_out + r];
              ASSERT_LE(std::fabs(static_cast<double>(got) - s), tol)
                  << what << " token " << i << " row " << r << ": " << got << " vs scalar " << s;
            }
          }
        }
        if (k == 0) scalar_out = out;
      }
    }
  }
}

class QuantDotFormat : public testing::TestWithParam<WeightType> {};

// Per format and instruction set (an index into all_isa_kernels()), so that
// each table, both AVX2-level ones included, passes or skips by name.
class QuantDotIsa : public testing::TestWithParam<std::tuple<WeightType, size_t>> {};

TEST_P(QuantDotIsa, DotRows) {
  const WeightType t = std::get<0>(GetParam());
  const IsaKernels& isa = all_isa_kernels()[std::get<1>(GetParam())];
  if (!isa.runs_here()) GTEST_SKIP() << isa.name << " does not run on this CPU";
  if (isa.get(t) == nullptr) {
    if (!isa.every_format) GTEST_SKIP() << isa.name << " has no " << type_name(t) << " kernels";
    ASSERT_TRUE(avx2_level_only(t)) << isa.name << " lacks " << type_name(t);
    GTEST_SKIP() << isa.name << " has no " << type_name(t) << " kernels (the AVX2 level's serve it)";
  }
  std::mt19937 rng(77 + static_cast<unsigned>(t));
  const std::vector<int> rows = {1, 2, 3, 5, 16, 37};
  // Every pass width of the few-token kernels, and past 8 (q2_k, q3_k: 16)
  // the many-token ones (passes of up to 12 tokens, calls of up to 32, a
  // ragged last group of 16 tokens).
  const std::vector<int> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 14, 17};
  const std::vector<int> many_tokens = {9, 12, 13, 25, 32, 33, 47};
  std::vector<DotCase> cases = {
      {0, {3}, {1, 5}},  // no blocks: zeros
      {256, rows, tokens},
      {512, rows, tokens},
      {2048 + 256, rows, tokens},
      {768, {1, 3, 37}, {1, 2, 4}},
      {4096, {1, 7}, {1, 4, 5}},
      // Several column chunks of the kernels' stack buffers for the
      // transposed (q8_0, q4_0) or reordered (q4_k, q5_k) activations.
      {15104, {3}, {1, 2, 4, 5}},
      // Several vectors of 16 rows (and a rest) at many tokens; chunks of
      // the many-token kernels' decoded blocks and a ragged last chunk.
      {512, {16, 64, 70}, many_tokens},
      {2048 + 256, {48, 21}, many_tokens},
      {15104, {32}, {9, 40}},
  };
  if (block_elements(t) == colibri::kQK32) {
    // Partial groups of blocks: 1, 3, 7, 17, 25 and gpt-oss's 90 blocks
    // (read in place up to the row's last block).
    cases.push_back({32, rows, {1, 3, 5}});
    cases.push_back({96, rows, {1, 2, 4}});
    cases.push_back({224, rows, {1, 4, 5}});
    cases.push_back({2880, {1, 3, 37}, {1, 2, 4, 5}});
    cases.push_back({544, rows, {1, 4, 17}});
    cases.push_back({800, {2, 37}, {1, 3}});
    cases.push_back({2880, {16, 35}, {9, 20, 33}});
    cases.push_back({32, {16, 17}, {9, 13}});
  }
  for (const DotCase& c : cases) {
    SCOPED_TRACE("n=" + std::to_string(c.n));
    run_dot_cases(t, isa, c, rng);
    if (testing::Test::HasFatalFailure()) return;
  }
}

// FP8: every code's value exactly, on every instruction set. Row r holds
// code r (all 128 of its block, scale 0.375) for r < 256, and rows 256 ..
// 256 + 127 hold the 128 codes c, c + 1, ... from c = 2 (r - 256) (a mix
// of signs and exponents in one row). Every product and partial sum is
// exact (codes of at most 4 significant bits times small integers), so
// every output equals the float64 value to the bit, whatever the order of
// the sums. Tokens: a one-hot, all ones, and small random integers; rows
// in groups that leave every tail size, and token counts 1, 3, 7, 13.
TEST(QuantDotFp8, EveryCodeExactly) {
  const WeightType t = WeightType::kFP8_E4M3;
  const size_t n = colibri::kQKFp8;
  const int rows = 256 + 128;
  const size_t row_bytes = colibri::weight_row_bytes(t, n);
  std::vector<uint8_t> w(row_bytes * rows);
  const float d = 0.375f;
  for (int r = 0; r < rows; ++r) {
    uint8_t* blk = w.data() + static_cast<size_t>(r) * row_bytes;
    std::memcpy(blk, &d, sizeof d);
    for (size_t i = 0; i < n; ++i) {
      blk[sizeof d + i] = static_cast<uint8_t>(r < 256 ? r : 2 * (r - 256) + static_cast<int>(i));
    }
  }
  std::mt19937 rng(8);
  const int max_tokens = 13;
  const size_t act_bytes = colibri::kernels::act_row_bytes(t, n);
  std::vector<float> x(n * max_tokens);
  for (int i = 0; i < max_tokens; ++i) {
    for (size_t k = 0; k < n; ++k) {
      float v = static_cast<float>(static_cast<int>(rng() % 41) - 20);
      if (i % 3 == 0) v = k == static_cast<size_t>(i * 37) % n ? 1.0f : 0.0f;
      if (i % 3 == 1) v = 1.0f;
      x[static_cast<size_t>(i) * n + k] = v;
    }
  }
  std::vector<double> ref(static_cast<size_t>(rows) * max_tokens);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* codes = w.data() + static_cast<size_t>(r) * row_bytes + sizeof d;
    for (int i = 0; i < max_tokens; ++i) {
      double s = 0.0;
      for (size_t k = 0; k < n; ++k) {
        s += static_cast<double>(colibri::e4m3_to_float(codes[k])) * x[static_cast<size_t>(i) * n + k];
      }
      ref[static_cast<size_t>(i) * rows + r] = d * s;
    }
  }
  for (const IsaKernels& isa : isa_kernels(t)) {
    const QuantDotKernels* q = isa.get(t);
    std::vector<uint8_t> act(act_bytes * max_tokens);
    for (int i = 0; i < max_tokens; ++i) {
      q->quantize_act(x.data() + static_cast<size_t>(i) * n, n, n, act.data() + static_cast<size_t>(i) * act_bytes);
    }
    for (int tokens : {1, 3, 7, 13}) {
      std::vector<float> out(static_cast<size_t>(rows) * tokens);
      for (float& o : out) o = colibri::bits_float(0x7fc0deadu);
      q->dot_rows(w.data(), row_bytes, rows, act.data(), act_bytes, tokens, n, out.data(), rows);
      for (int i = 0; i < tokens; ++i) {
        for (int r = 0; r < rows; ++r) {
          const double want = ref[static_cast<size_t>(i) * rows + r];
          const float got = out[static_cast<size_t>(i) * rows + r];
          const std::string what = std::string(q->name) + " tokens=" + std::to_string(tokens) + " token " +
                                   std::to_string(i) + " row " + std::to_string(r);
          if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(got)) << what << ": " << got;
          } else {
            ASSERT_EQ(static_cast<double>(got), want) << what;
          }
        }
      }
    }
  }
}

// FP8's NaN codes (0x7f, 0xff) make their row's products NaN for every
// token, as the reference's NaN products do, wherever the code sits; the
// other rows of the call stay finite and agree with the scalar table.
TEST(QuantDotFp8, NanCodesGiveNan) {
  const WeightType t = WeightType::kFP8_E4M3;
  std::mt19937 rng(5);
  const size_t n = 3 * colibri::kQKFp8;
  const size_t row_bytes = colibri::weight_row_bytes(t, n);
  const size_t act_bytes = colibri::kernels::act_row_bytes(t, n);
  for (int rows : {1, 2, 3, 5, 7, 9}) {
    std::vector<uint8_t> w = random_weights(t, n, rows, row_bytes, rng);
    std::vector<bool> nan_row(static_cast<size_t>(rows), false);
    for (int r = 0; r < rows; ++r) {
      if (r % 2 == 1 && rows > 1) continue;
      const size_t b = rng() % 3;
      const size_t i = r == 0 ? 0 : (r == 2 ? colibri::kQKFp8 - 1 : rng() % colibri::kQKFp8);
      w[static_cast<size_t>(r) * row_bytes + b * block_bytes(t) + sizeof(float) + i] = (r / 2) % 2 ? 0xff : 0x7f;
      nan_row[static_cast<size_t>(r)] = true;
    }
    for (int tokens : {1, 2, 5, 9}) {
      std::vector<uint8_t> act(act_bytes * static_cast<size_t>(tokens));
      for (int i = 0; i < tokens; ++i) {
        std::vector<float> x = random_acts(n, rng);
        x[rng() % n] = 0.0f;
        colibri::kernels::quant_dot_scalar(t)->quantize_act(x.data(), n, n, act.data() + static_cast<size_t>(i) * act_bytes);
      }
      std::vector<float> scalar_out;
      for (const IsaKernels& isa : isa_kernels(t)) {
        const QuantDotKernels* q = isa.get(t);
        std::vector<float> out(static_cast<size_t>(rows * tokens), 0.0f);
        q->dot_rows(w.data(), row_bytes, rows, act.data(), act_bytes, tokens, n, out.data(), static_cast<size_t>(rows));
        for (int i = 0; i < tokens; ++i) {
          for (int r = 0; r < rows; ++r) {
            const size_t j = static_cast<size_t>(i * rows + r);
            const std::string what = std::string(q->name) + " rows=" + std::to_string(rows) +
                                     " tokens=" + std::to_string(tokens) + " token " + std::to_string(i) + " row " +
                                     std::to_string(r);
            if (nan_row[static_cast<size_t>(r)]) {
              ASSERT_TRUE(std::isnan(out[j])) << what << ": " << out[j];
            } else {
              ASSERT_TRUE(std::isfinite(out[j])) << what;
              if (!scalar_out.empty()) {
                ASSERT_NEAR(out[j], scalar_out[j], 1e-5 * (1.0 + std::fabs(scalar_out[j]))) << what;
              }
            }
          }
        }
        if (scalar_out.empty()) scalar_out = out;
      }
    }
  }
}

// Weights quantised from floats by the format's reference quantiser (the
// distributions real models have), checked against the reference
// dequantiser: this test's decoding agrees with WeightFormat::to_float, and
// every instruction set's products with float64 products of to_float's weights.
TEST_P(QuantDotFormat, ReferenceQuantisedWeights) {
  const WeightType t = GetParam();
  const colibri::WeightFormat& f = colibri::weight_format(t);
  if (f.from_float == nullptr) GTEST_SKIP() << type_name(t) << " is read, not made (DotRows covers it on random blocks)";
  std::mt19937 rng(4242 + static_cast<unsigned>(t));
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const size_t n = 2048 + 256;
  const int rows = 7;
  const int tokens = 3;
  const size_t row_bytes = colibri::weight_row_bytes(t, n) + 2;
  const size_t act_bytes = colibri::kernels::act_row_bytes(t, n);
  std::vector<uint8_t> w(row_bytes * rows);
  std::vector<float> row(n);
  for (int r = 0; r < rows; ++r) {
    for (float& v : row) v = normal(rng);
    f.from_float(row.data(), w.data() + static_cast<size_t>(r) * row_bytes, n);
  }
  std::vector<uint8_t> act(act_bytes * tokens);
  std::vector<std::vector<double>> xs(tokens, std::vector<double>(n));
  for (int i = 0; i < tokens; ++i) {
    const std::vector<float> x = random_acts(n, rng);
    colibri::kernels::quant_dot_scalar(t)->quantize_act(x.data(), n, n, act.data() + static_cast<size_t>(i) * act_bytes);
    decode_act(t, act.data() + static_cast<size_t>(i) * act_bytes, n, xs[static_cast<size_t>(i)].data());
  }
  std::vector<double> ref(rows * tokens), scale(rows * tokens);
  std::vector<float> wf(n);
  std::vector<double> wd(n), mag(n);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* wr = w.data() + static_cast<size_t>(r) * row_bytes;
    f.to_float(wr, wf.data(), n);
    decode_row(t, wr, n, wd.data(), mag.data());
    for (size_t k = 0; k < n; ++k) {
      ASSERT_LE(std::fabs(wf[k] - wd[k]), 1e-6 * mag[k] + 1e-30) << type_name(t) << " row " << r << " element " << k;
    }
    for (int i = 0; i < tokens; ++i) {
      double sdot = 0.0, m = 0.0;
      for (size_t k = 0; k < n; ++k) {
        sdot += static_cast<double>(wf[k]) * xs[static_cast<size_t>(i)][k];
        m += mag[k] * std::fabs(xs[static_cast<size_t>(i)][k]);
      }
      ref[static_cast<size_t>(i * rows + r)] = sdot;
      scale[static_cast<size_t>(i * rows + r)] = m;
    }
  }
  for (const IsaKernels& k : isa_kernels(t)) {
    std::vector<float> out(static_cast<size_t>(rows * tokens));
    k.get(t)->dot_rows(w.data(), row_bytes, rows, act.data(), act_bytes, tokens, n, out.data(), rows);
    for (size_t j = 0; j < out.size(); ++j) {
      ASSERT_LE(std::fabs(out[j] - ref[j]), 1e-5 * scale[j]) << k.get(t)->name << " output " << j;
    }
  }
}

// The AMX tier's dequantiser: every element's bf16 equals float_to_bf16 of
// the reference dequantiser's float, bit for bit, on rows quantised from
// random weights (random codes under finite scales for the formats that
// are read, not made) and on random raw blocks (odd scales, subnormal f16,
// NaN and infinite scales); the output past n stays untouched.
TEST_P(QuantDotFormat, DequantBf16MatchesReference) {
#if defined(COLIBRI_HAVE_X86_KERNELS)
  if (!colibri::kernels::cpu_has_avx512_bf16()) GTEST_SKIP() << "no AVX512_BF16";
  const WeightType t = GetParam();
  const colibri::WeightFormat& f = colibri::weight_format(t);
  const colibri::kernels::DequantBf16Fn dq = colibri::kernels::dequant_bf16_avx512(t);
  ASSERT_NE(dq, nullptr);
  std::mt19937 rng(777 + static_cast<unsigned>(t));
  std::normal_distribution<float> normal(0.0f, 0.05f);
  const size_t n = 8 * 256;
  const size_t bytes = colibri::weight_row_bytes(t, n);
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<uint8_t> w(bytes);
    if (trial < 3 && f.from_float == nullptr) {
      w = random_weights(t, n, 1, bytes, rng);  // read, not made: random codes, finite scales
    } else if (trial < 3) {
      std::vector<float> x(n);
      for (float& v : x) v = normal(rng) * (trial == 2 ? 1e4f : 1.0f);
      if (trial == 1) x[17] = 40.0f;  // an outlier: one large scale
      f.from_float(x.data(), w.data(), n);
    } else {
      for (uint8_t& b : w) b = static_cast<uint8_t>(rng());
    }
    std::vector<float> ref(n);
    f.to_float(w.data(), ref.data(), n);
    std::vector<uint16_t> got(n + 32, 0xdead);
    dq(w.data(), n, got.data());
    for (size_t k = 0; k < n; ++k) {
      ASSERT_EQ(got[k], colibri::float_to_bf16(ref[k])) << type_name(t) << " trial " << trial << " element " << k
                                                        << " reference " << ref[k];
    }
    for (size_t k = n; k < n + 32; ++k) ASSERT_EQ(got[k], 0xdead) << "wrote past n";
  }
#else
  GTEST_SKIP() << "no x86 kernels";
#endif
}

// FP8's bf16 dequantiser on every code under special scales: zeros, a
// float subnormal (products round in the subnormal range), the largest
// finite (products overflow), infinities and NaNs of both signs (NaN
// scale times NaN code included), each bit for bit against
// float_to_bf16 of the reference.
TEST(QuantDotFp8, DequantBf16EveryCodeAndScale) {
#if defined(COLIBRI_HAVE_X86_KERNELS)
  if (!colibri::kernels::cpu_has_avx512_bf16()) GTEST_SKIP() << "no AVX512_BF16";
  const WeightType t = WeightType::kFP8_E4M3;
  const colibri::kernels::DequantBf16Fn dq = colibri::kernels::dequant_bf16_avx512(t);
  ASSERT_NE(dq, nullptr);
  const uint32_t scales[] = {0x00000000u, 0x80000000u, 0x3f800000u, 0xbe3a5e35u, 0x00012345u, 0x80f00001u,
                             0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc01234u, 0x7f812345u,
                             0x3b800001u, 0x04000000u};
  const size_t n = 2 * colibri::kQKFp8 * (sizeof scales / sizeof scales[0]);
  std::vector<uint8_t> w(colibri::weight_row_bytes(t, n));
  for (size_t b = 0; b < n / colibri::kQKFp8; ++b) {
    uint8_t* blk = w.data() + b * block_bytes(t);
    const float d = colibri::bits_float(scales[b / 2]);
    std::memcpy(blk, &d, sizeof d);
    for (size_t i = 0; i < colibri::kQKFp8; ++i) blk[sizeof d + i] = static_cast<uint8_t>((b % 2) * 128 + i);
  }
  std::vector<float> ref(n);
  colibri::weight_format(t).to_float(w.data(), ref.data(), n);
  std::vector<uint16_t> got(n);
  dq(w.data(), n, got.data());
  for (size_t k = 0; k < n; ++k) {
    const uint32_t scale = scales[k / 256];
    const bool nan_scale = (scale & 0x7fffffffu) > 0x7f800000u;
    if (nan_scale && (k % 128) == 0x7f) {
      // NaN times NaN: which operand's NaN (and sign) comes out is the
      // multiply's operand order (x86 keeps the first), which the
      // compiler may swap; the format asks for a quiet NaN.
      EXPECT_EQ(got[k] & 0x7fc0u, 0x7fc0u) << "scale " << std::hex << scale << " code " << (k % 256);
      continue;
    }
    ASSERT_EQ(got[k], colibri::float_to_bf16(ref[k]))
        << "scale " << std::hex << scale << " code " << (k % 256) << " reference " << ref[k];
  }
#else
  GTEST_SKIP() << "no x86 kernels";
#endif
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantDotFormat, testing::ValuesIn(kTypes),
                         [](const testing::TestParamInfo<WeightType>& param_info) {
                           return std::string(type_name(param_info.param));
                         });

INSTANTIATE_TEST_SUITE_P(FormatsAndIsas, QuantDotIsa,
                         testing::Combine(testing::ValuesIn(kTypes),
                                          testing::Range(size_t{0}, all_isa_kernels().size())),
                         [](const testing::TestParamInfo<std::tuple<WeightType, size_t>>& param_info) {
                           std::string name = std::string(type_name(std::get<0>(param_info.param))) + "_" +
                                              all_isa_kernels()[std::get<1>(param_info.param)].name;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
