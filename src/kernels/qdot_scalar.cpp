// Scalar reference of the integer dot-product kernels (quant_dot.h): the
// activation quantiser every instruction set must match bit for bit, and
// dot products written plainly from the block semantics of quant_blocks.h
// (decode each weight's integer code, integer products per (sub-)block and
// activation block of 32, then the float scales), which the SIMD versions
// are checked against.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/quant_dot.h"
#include "util/half.h"
#include "util/iq_grids.h"
#include "util/quant_blocks.h"
#include "util/quant_ref.h"

namespace colibri::kernels {
namespace {

// ---------------------------------------------------------------- activations

// The activation row of n elements (quant_dot.h): qs[n], then d[n / 32],
// then sums[n / 16]; memcpy for the scales and sums (no alignment).
struct ActRow {
  const int8_t* qs;
  const uint8_t* d;
  const uint8_t* sums;
};

ActRow act_row(const void* act, size_t n) {
  const auto* p = static_cast<const uint8_t*>(act);
  return {reinterpret_cast<const int8_t*>(p), p + n, p + n + n / 8};
}

float act_d(const ActRow& a, size_t block) {
  float d;
  std::memcpy(&d, a.d + block * sizeof(float), sizeof d);
  return d;
}

// The sum of the 16 quants from element 16 * h.
int32_t act_sum16(const ActRow& a, size_t h) {
  int16_t s;
  std::memcpy(&s, a.sums + h * sizeof(int16_t), sizeof s);
  return s;
}

// The quantisation rule (the SIMD versions compute exactly these float
// operations), per block of 32: amax = max |x|, d = amax / 127,
// q = nearbyint(x / d) clamped to [-127, 127] (a NaN quotient gives -127),
// all q = 0 when d == 0. Elements at or past n_valid are zero.
void quantize_act(const float* x, size_t n_valid, size_t n, void* out) {
  auto* base = static_cast<uint8_t*>(out);
  auto* qs = reinterpret_cast<int8_t*>(base);
  for (size_t b = 0; b < n / kActBlock; ++b) {
    float v[kActBlock];
    float amax = 0.0f;
    for (int i = 0; i < kActBlock; ++i) {
      const size_t k = b * kActBlock + static_cast<size_t>(i);
      v[i] = k < n_valid ? x[k] : 0.0f;
      const float a = std::fabs(v[i]);
      amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f;
    std::memcpy(base + n + b * sizeof(float), &d, sizeof d);
    int8_t* q = qs + b * kActBlock;
    for (int i = 0; i < kActBlock; ++i) {
      if (d == 0.0f) {
        q[i] = 0;
        continue;
      }
      float r = std::nearbyint(v[i] / d);
      r = r > -127.0f ? r : -127.0f;
      r = r < 127.0f ? r : 127.0f;
      q[i] = static_cast<int8_t>(static_cast<int>(r));
    }
    for (int h = 0; h < 2; ++h) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += q[16 * h + i];
      const auto s16 = static_cast<int16_t>(s);
      std::memcpy(base + n + n / 8 + (2 * b + static_cast<size_t>(h)) * sizeof(int16_t), &s16, sizeof s16);
    }
  }
}

// ---------------------------------------------------------------- dot products

// One weight row against one token's activation row.

float dot_q8_0(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockQ8_0*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQK32; ++b) {
    int32_t isum = 0;
    for (int i = 0; i < kQK32; ++i) isum += static_cast<int32_t>(w[b].qs[i]) * a.qs[kQK32 * b + i];
    acc += f16_to_float(w[b].d) * act_d(a, b) * static_cast<float>(isum);
  }
  return acc;
}

float dot_q4_0(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockQ4_0*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQK32; ++b) {
    const int8_t* q = a.qs + kQK32 * b;
    int32_t isum = 0;
    for (int i = 0; i < kQK32 / 2; ++i) {
      const int lo = (w[b].qs[i] & 15) - 8;
      const int hi = (w[b].qs[i] >> 4) - 8;
      isum += lo * q[i] + hi * q[i + 16];
    }
    acc += f16_to_float(w[b].d) * act_d(a, b) * static_cast<float>(isum);
  }
  return acc;
}

// MXFP4's codes are exact integers (twice the E2M1 values) and its scale a
// power of two, so the integer product per block is exact as for q4_0.
float dot_mxfp4(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockMxfp4*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQK32; ++b) {
    const int8_t* q = a.qs + kQK32 * b;
    int32_t isum = 0;
    for (int i = 0; i < kQK32 / 2; ++i) {
      isum += kMxfp4Values[w[b].qs[i] & 15] * q[i] + kMxfp4Values[w[b].qs[i] >> 4] * q[i + 16];
    }
    acc += mxfp4_scale(w[b].e) * act_d(a, b) * static_cast<float>(isum);
  }
  return acc;
}

// q4_1 / q5_1: x = d * q + m, so a block's product is
// da * (d * (q . a) + m * (sum a)).
template <class Block>
float dot_min_32(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const Block*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQK32; ++b) {
    const int8_t* q = a.qs + kQK32 * b;
    int32_t isum = 0;
    for (int i = 0; i < kQK32; ++i) {
      int code;
      if constexpr (sizeof(Block) == sizeof(BlockQ4_1)) {
        code = i < 16 ? (w[b].qs[i] & 15) : (w[b].qs[i - 16] >> 4);
      } else {
        code = q5_code(w[b].qs, w[b].qh, i);
      }
      isum += code * q[i];
    }
    const int32_t asum = act_sum16(a, 2 * b) + act_sum16(a, 2 * b + 1);
    acc += act_d(a, b) * (f16_to_float(w[b].d) * static_cast<float>(isum) +
                          f16_to_float(w[b].m) * static_cast<float>(asum));
  }
  return acc;
}

float dot_q5_0(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockQ5_0*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQK32; ++b) {
    const int8_t* q = a.qs + kQK32 * b;
    int32_t isum = 0;
    for (int i = 0; i < kQK32; ++i) isum += (q5_code(w[b].qs, w[b].qh, i) - 16) * q[i];
    acc += f16_to_float(w[b].d) * act_d(a, b) * static_cast<float>(isum);
  }
  return acc;
}

// 32 IQ4_NL codes (16 bytes: low nibbles elements 0-15, high 16-31) against
// one activation block: the exact integer product of the table's levels.
int32_t iq4_block_dot(const uint8_t* qs, const int8_t* q) {
  int32_t isum = 0;
  for (int i = 0; i < 16; ++i) {
    isum += kIq4nlValues[qs[i] & 15] * q[i] + kIq4nlValues[qs[i] >> 4] * q[i + 16];
  }
  return isum;
}

float dot_iq4_nl(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockIq4Nl*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQK32; ++b) {
    acc += f16_to_float(w[b].d) * act_d(a, b) * static_cast<float>(iq4_block_dot(w[b].qs, a.qs + kQK32 * b));
  }
  return acc;
}

// IQ4_XS: sub-block j of super-block b is activation block 8b + j, with
// the weight scale d * (ls_j - 32).
float dot_iq4_xs(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockIq4Xs*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const float d = f16_to_float(w[b].d);
    for (int j = 0; j < kQKK / 32; ++j) {
      const size_t ab = 8 * b + static_cast<size_t>(j);
      const float dl = d * static_cast<float>(iq4_xs_scale(&w[b], j) - 32);
      acc += dl * act_d(a, ab) * static_cast<float>(iq4_block_dot(w[b].qs + 16 * j, a.qs + kActBlock * ab));
    }
  }
  return acc;
}

// ggml's get_scale_min_k4.
void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// q4_K and q5_K: x = d * sc_j * q - dmin * m_j; sub-block j (32 elements)
// is activation block 8b + j, so its product is
// da_j * (d * sc_j * (q . a)_j - dmin * m_j * (sum a)_j).
template <bool kFive>
float dot_qk45(const void* row, const void* act, size_t n) {
  const ActRow a = act_row(act, n);
  const auto* base = static_cast<const uint8_t*>(row);
  const size_t block_bytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const uint8_t* blk = base + b * block_bytes;
    uint16_t d16 = 0, dmin16 = 0;
    const uint8_t* scales;
    const uint8_t* qs;
    const uint8_t* qh = nullptr;
    if (kFive) {
      const auto* w = reinterpret_cast<const BlockQ5K*>(blk);
      d16 = w->d;
      dmin16 = w->dmin;
      scales = w->scales;
      qs = w->qs;
      qh = w->qh;
    } else {
      const auto* w = reinterpret_cast<const BlockQ4K*>(blk);
      d16 = w->d;
      dmin16 = w->dmin;
      scales = w->scales;
      qs = w->qs;
    }
    const float d = f16_to_float(d16);
    const float dmin = f16_to_float(dmin16);
    for (int j = 0; j < 8; ++j) {
      int sc = 0, m = 0;
      scale_min_k4(j, scales, &sc, &m);
      const size_t ab = 8 * b + static_cast<size_t>(j);
      const int8_t* aq = a.qs + kActBlock * ab;
      const uint8_t* chunk = qs + 32 * (j / 2);
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) {
        int q = (j % 2 == 0) ? (chunk[l] & 15) : (chunk[l] >> 4);
        if (kFive) q += ((qh[l] >> j) & 1) << 4;
        dot += q * aq[l];
      }
      const int32_t asum = act_sum16(a, 2 * ab) + act_sum16(a, 2 * ab + 1);
      acc += act_d(a, ab) * (d * static_cast<float>(sc * dot) - dmin * static_cast<float>(m * asum));
    }
  }
  return acc;
}

// q6_K: x = d * sc * (q - 32), in ggml's dequantize_row_q6_K order; the two
// 16-element sub-blocks of activation block 8b + j are summed in integers
// with their scales: d * da_j * sum_s sc_s * ((q . a)_s - 32 (sum a)_s).
float dot_q6_k(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockQ6K*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    int q[kQKK];
    const uint8_t* ql = w[b].ql;
    const uint8_t* qh = w[b].qh;
    for (int half = 0; half < 2; ++half) {
      int* y = q + 128 * half;
      for (int l = 0; l < 32; ++l) {
        y[l + 0] = (ql[l + 0] & 0xf) | (((qh[l] >> 0) & 3) << 4);
        y[l + 32] = (ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4);
        y[l + 64] = (ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4);
        y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
      ql += 64;
      qh += 32;
    }
    const float d = f16_to_float(w[b].d);
    const int8_t* aq = a.qs + kQKK * b;
    for (int j = 0; j < 8; ++j) {
      int32_t isum = 0;
      for (int s = 2 * j; s < 2 * j + 2; ++s) {
        int32_t dot = 0;
        for (int l = 0; l < 16; ++l) dot += q[16 * s + l] * aq[16 * s + l];
        isum += w[b].scales[s] * (dot - 32 * act_sum16(a, 16 * b + static_cast<size_t>(s)));
      }
      acc += d * act_d(a, 8 * b + static_cast<size_t>(j)) * static_cast<float>(isum);
    }
  }
  return acc;
}

// q2_K and q3_K: sub-block s (16 elements) of super-block b is half
// h = s / 8, bit pair j = (s % 8) / 2, elements 16 (s % 2) + l of the
// half's 32 code bytes (quant_blocks.h); it lies in activation block
// 8b + s / 2, whose scale multiplies its integer products.
int q23_code(const uint8_t* qs, const uint8_t* hmask, int s, int l) {
  const int j = (s % 8) / 2;
  const int low = (qs[32 * (s / 8) + 16 * (s % 2) + l] >> (2 * j)) & 3;
  if (hmask == nullptr) return low;
  return low | (((hmask[16 * (s % 2) + l] >> (4 * (s / 8) + j)) & 1) << 2);
}

// q2_K: da * (d * sc_s * (q . a)_s - dmin * m_s * (sum a)_s) per sub-block.
float dot_q2_k(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockQ2K*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const float d = f16_to_float(w[b].d);
    const float dmin = f16_to_float(w[b].dmin);
    const int8_t* aq = a.qs + kQKK * b;
    for (int s = 0; s < 16; ++s) {
      int32_t dot = 0;
      for (int l = 0; l < 16; ++l) dot += q23_code(w[b].qs, nullptr, s, l) * aq[16 * s + l];
      const int32_t asum = act_sum16(a, 16 * b + static_cast<size_t>(s));
      const float da = act_d(a, 8 * b + static_cast<size_t>(s / 2));
      acc += da * (d * static_cast<float>((w[b].scales[s] & 15) * dot) -
                   dmin * static_cast<float>((w[b].scales[s] >> 4) * asum));
    }
  }
  return acc;
}

// q3_K: d * da * sum_s (sc_s - 32) * ((q . a)_s - 4 (sum a)_s), q 0..7.
float dot_q3_k(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockQ3K*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    int8_t sc[16];
    q3_k_scales(w[b].scales, sc);
    const float d = f16_to_float(w[b].d);
    const int8_t* aq = a.qs + kQKK * b;
    for (int j = 0; j < 8; ++j) {
      int32_t isum = 0;
      for (int s = 2 * j; s < 2 * j + 2; ++s) {
        int32_t dot = 0;
        for (int l = 0; l < 16; ++l) dot += q23_code(w[b].qs, w[b].hmask, s, l) * aq[16 * s + l];
        isum += sc[s] * (dot - 4 * act_sum16(a, 16 * b + static_cast<size_t>(s)));
      }
      acc += d * act_d(a, 8 * b + static_cast<size_t>(j)) * static_cast<float>(isum);
    }
  }
  return acc;
}

// IQ2_XXS: per sub-block of 32 (activation block 8b + ib) the signed grid
// values' integer product, times d * (0.5 + ls) / 4 and the activation scale.
float dot_iq2_xxs(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockIq2Xxs*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const float d = f16_to_float(w[b].d);
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      uint32_t words[2];
      std::memcpy(words, w[b].qs + 4 * ib, sizeof words);
      const int8_t* aq = a.qs + kQKK * b + 32 * static_cast<size_t>(ib);
      int32_t isum = 0;
      for (int g = 0; g < 4; ++g) {
        const uint64_t grid = kIqTables.iq2xxs_grid[(words[0] >> (8 * g)) & 0xff];
        const uint8_t signs = kIqTables.iq2_signs[(words[1] >> (7 * g)) & 127];
        for (int j = 0; j < 8; ++j) {
          const int v = static_cast<int>((grid >> (8 * j)) & 0xff);
          isum += ((signs >> j) & 1 ? -v : v) * aq[8 * g + j];
        }
      }
      const float scale = d * (0.5f + static_cast<float>(words[1] >> 28)) * 0.25f;
      acc += scale * act_d(a, 8 * b + static_cast<size_t>(ib)) * static_cast<float>(isum);
    }
  }
  return acc;
}

// IQ3_XXS: as IQ2_XXS with 4-value grid points and a scale
// d * (0.5 + ls) / 2.
float dot_iq3_xxs(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockIq3Xxs*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const float d = f16_to_float(w[b].d);
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      uint32_t aux;
      std::memcpy(&aux, w[b].qs + kQKK / 4 + 4 * ib, sizeof aux);
      const int8_t* aq = a.qs + kQKK * b + 32 * static_cast<size_t>(ib);
      int32_t isum = 0;
      for (int g = 0; g < 4; ++g) {
        const uint8_t signs = kIqTables.iq2_signs[(aux >> (7 * g)) & 127];
        for (int j = 0; j < 8; ++j) {
          const uint32_t grid = kIqTables.iq3xxs_grid[w[b].qs[8 * ib + 2 * g + j / 4]];
          const int v = static_cast<int>((grid >> (8 * (j % 4))) & 0xff);
          isum += ((signs >> j) & 1 ? -v : v) * aq[8 * g + j];
        }
      }
      const float scale = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
      acc += scale * act_d(a, 8 * b + static_cast<size_t>(ib)) * static_cast<float>(isum);
    }
  }
  return acc;
}

// IQ1: a group of 8 values g + delta (g in {-1, 0, 1}, delta = +-1/8) is
// (8 g +- 1) / 8, so 8 times the weights are small integers and the dot
// product stays in integers; the group's products with the activations.
int32_t iq1_group_dot(uint32_t index, bool negative_shift, const int8_t* aq) {
  const uint64_t grid = kIqTables.iq1s_grid[index];
  const int shift = negative_shift ? -1 : 1;
  int32_t isum = 0;
  for (int j = 0; j < 8; ++j) {
    const int byte = static_cast<int>((grid >> (8 * j)) & 0xff);
    const int g = byte - ((byte & 0x80) << 1);  // the int8 value
    isum += (8 * g + shift) * aq[j];
  }
  return isum;
}

float dot_iq1_s(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockIq1S*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const float d = f16_to_float(w[b].d);
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      const uint32_t qh = w[b].qh[ib];
      const int8_t* aq = a.qs + kQKK * b + 32 * static_cast<size_t>(ib);
      int32_t isum = 0;
      for (int l = 0; l < 4; ++l) {
        isum += iq1_group_dot(w[b].qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8), (qh & 0x8000) != 0, aq + 8 * l);
      }
      const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
      acc += dl * kIq1Delta * act_d(a, 8 * b + static_cast<size_t>(ib)) * static_cast<float>(isum);
    }
  }
  return acc;
}

float dot_iq1_m(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockIq1M*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    uint16_t sc[4];
    std::memcpy(sc, w[b].scales, sizeof sc);
    const float d = f16_to_float(iq1_m_d(w[b].scales));
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      const int8_t* aq = a.qs + kQKK * b + 32 * static_cast<size_t>(ib);
      float sub = 0.0f;
      for (int half = 0; half < 2; ++half) {
        int32_t isum = 0;
        for (int l = 2 * half; l < 2 * half + 2; ++l) {
          const uint32_t nibble = (w[b].qh[2 * ib + l / 2] >> (4 * (l % 2))) & 0xf;
          isum += iq1_group_dot(w[b].qs[4 * ib + l] | ((nibble & 7) << 8), (nibble & 8) != 0, aq + 8 * l);
        }
        const uint32_t s = (sc[ib / 2] >> (6 * (ib % 2) + 3 * half)) & 7;
        sub += static_cast<float>(2 * s + 1) * static_cast<float>(isum);
      }
      acc += d * kIq1Delta * act_d(a, 8 * b + static_cast<size_t>(ib)) * sub;
    }
  }
  return acc;
}

// 8 grid magnitudes (the bytes of `grid`), negated where `signs` has a
// bit set, against 8 activations.
int32_t signed_dot8(uint64_t grid, uint32_t signs, const int8_t* aq) {
  int32_t isum = 0;
  for (int j = 0; j < 8; ++j) {
    const int v = static_cast<int>((grid >> (8 * j)) & 0xff);
    isum += ((signs >> j) & 1 ? -v : v) * aq[j];
  }
  return isum;
}

// IQ2_XS and IQ2_S: per 16 values a scale d * (0.5 + ls) / 4 on two signed
// grid points' products.
template <class Block>
float dot_iq2_xs_s(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const Block*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const float d = f16_to_float(w[b].d);
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      const int8_t* aq = a.qs + kQKK * b + 32 * static_cast<size_t>(ib);
      float sub = 0.0f;
      for (int half = 0; half < 2; ++half) {
        int32_t isum = 0;
        for (int l = 2 * half; l < 2 * half + 2; ++l) {
          const int k = 4 * ib + l;
          if constexpr (std::is_same_v<Block, BlockIq2Xs>) {
            isum += signed_dot8(kIqTables.iq2xs_grid[w[b].qs[k] & 511], kIqTables.iq2_signs[w[b].qs[k] >> 9],
                                aq + 8 * l);
          } else {
            const uint32_t index = w[b].qs[k] | (((w[b].qh[ib] >> (2 * l)) & 3) << 8);
            isum += signed_dot8(kIqTables.iq2s_grid[index], w[b].signs[k], aq + 8 * l);
          }
        }
        const uint32_t ls = (w[b].scales[ib] >> (4 * half)) & 0xf;
        sub += d * (0.5f + static_cast<float>(ls)) * 0.25f * static_cast<float>(isum);
      }
      acc += act_d(a, 8 * b + static_cast<size_t>(ib)) * sub;
    }
  }
  return acc;
}

// IQ3_S: pairs of 4-value grid points under one sign byte, a scale
// d * (1 + 2 s) per 32 values.
float dot_iq3_s(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const BlockIq3S*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const float d = f16_to_float(w[b].d);
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      const int8_t* aq = a.qs + kQKK * b + 32 * static_cast<size_t>(ib);
      int32_t isum = 0;
      for (int g = 0; g < 4; ++g) {
        uint64_t grid = 0;
        for (int m = 0; m < 2; ++m) {
          const int k = 8 * ib + 2 * g + m;
          const uint32_t index = w[b].qs[k] | (((w[b].qh[ib] >> (2 * g + m)) & 1) << 8);
          grid |= static_cast<uint64_t>(kIqTables.iq3s_grid[index]) << (32 * m);
        }
        isum += signed_dot8(grid, w[b].signs[4 * ib + g], aq + 8 * g);
      }
      const int s = (w[b].scales[ib / 2] >> (4 * (ib % 2))) & 0xf;
      acc += d * static_cast<float>(1 + 2 * s) * act_d(a, 8 * b + static_cast<size_t>(ib)) * static_cast<float>(isum);
    }
  }
  return acc;
}

// ---------------------------------------------------------------- ternary

// TQ1_0 / TQ2_0: codes t of 0..2 (TQ2_0's 3 too) with x = d * (t - 1), so
// per activation block d * da * ((t . a) - (sum a)), the sums from the
// activation row. tq_code(block, e) is element e's code.
int tq1_code(const BlockTq1_0& b, int e) {
  if (e < 160) return tq1_trit(b.qs[e % 32], e / 32);
  if (e < 240) return tq1_trit(b.qs[32 + (e - 160) % 16], (e - 160) / 16);
  return tq1_trit(b.qh[(e - 240) % 4], (e - 240) / 4);
}
int tq2_code(const BlockTq2_0& b, int e) { return (b.qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3; }

template <class Block, int (*Code)(const Block&, int)>
float dot_ternary(const void* row, const void* act, size_t n) {
  const auto* w = static_cast<const Block*>(row);
  const ActRow a = act_row(act, n);
  float acc = 0.0f;
  for (size_t b = 0; b < n / kQKK; ++b) {
    const float d = f16_to_float(w[b].d);
    const int8_t* aq = a.qs + kQKK * b;
    for (int j = 0; j < kQKK / kActBlock; ++j) {
      int32_t dot = 0;
      for (int l = 0; l < kActBlock; ++l) dot += Code(w[b], kActBlock * j + l) * aq[kActBlock * j + l];
      const size_t h = 16 * b + 2 * static_cast<size_t>(j);
      dot -= act_sum16(a, h) + act_sum16(a, h + 1);
      acc += d * act_d(a, 8 * b + static_cast<size_t>(j)) * static_cast<float>(dot);
    }
  }
  return acc;
}

// ---------------------------------------------------------------- fp8_e4m3

// FP8 weights take fp32 activations (quant_dot.h): x[0, n_valid), zeros to n.
void copy_act_f32(const float* x, size_t n_valid, size_t n, void* out) {
  auto* o = static_cast<float*>(out);
  if (n_valid > 0) std::memcpy(o, x, n_valid * sizeof(float));  // x may be null when nothing is valid
  for (size_t i = n_valid; i < n; ++i) o[i] = 0.0f;
}

// Per block: the codes' exact values times the activations summed in
// float, then d times that sum added to the row's total.
float dot_fp8_e4m3(const void* row, const void* act, size_t n) {
  const auto* b = static_cast<const uint8_t*>(row);  // bytes: the float scale is unaligned in a row
  const auto* a = static_cast<const float*>(act);
  float total = 0.0f;
  for (size_t i = 0; i < n / kQKFp8; ++i, b += sizeof(BlockFp8E4M3), a += kQKFp8) {
    float d;
    std::memcpy(&d, b + offsetof(BlockFp8E4M3, d), sizeof d);
    const uint8_t* qs = b + offsetof(BlockFp8E4M3, qs);
    float s = 0.0f;
    for (int j = 0; j < kQKFp8; ++j) s += e4m3_to_float(qs[j]) * a[j];
    total += d * s;
  }
  return total;
}

template <float (*Dot)(const void*, const void*, size_t)>
void dot_rows(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
              size_t n, float* out, size_t ld_out) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  for (int32_t t = 0; t < tokens; ++t) {
    for (int32_t r = 0; r < rows; ++r) {
      out[static_cast<size_t>(t) * ld_out + static_cast<size_t>(r)] =
          Dot(wb + static_cast<size_t>(r) * row_bytes, ab + static_cast<size_t>(t) * act_bytes, n);
    }
  }
}

constexpr QuantDotKernels kQ8_0 = {"q8_0-scalar", quantize_act, dot_rows<dot_q8_0>};
constexpr QuantDotKernels kQ4_0 = {"q4_0-scalar", quantize_act, dot_rows<dot_q4_0>};
constexpr QuantDotKernels kQ4_K = {"q4_k-scalar", quantize_act, dot_rows<dot_qk45<false>>};
constexpr QuantDotKernels kQ5_K = {"q5_k-scalar", quantize_act, dot_rows<dot_qk45<true>>};
constexpr QuantDotKernels kQ6_K = {"q6_k-scalar", quantize_act, dot_rows<dot_q6_k>};
constexpr QuantDotKernels kMxfp4 = {"mxfp4-scalar", quantize_act, dot_rows<dot_mxfp4>};
constexpr QuantDotKernels kQ4_1 = {"q4_1-scalar", quantize_act, dot_rows<dot_min_32<BlockQ4_1>>};
constexpr QuantDotKernels kQ5_0 = {"q5_0-scalar", quantize_act, dot_rows<dot_q5_0>};
constexpr QuantDotKernels kQ5_1 = {"q5_1-scalar", quantize_act, dot_rows<dot_min_32<BlockQ5_1>>};
constexpr QuantDotKernels kIq4Nl = {"iq4_nl-scalar", quantize_act, dot_rows<dot_iq4_nl>};
constexpr QuantDotKernels kIq4Xs = {"iq4_xs-scalar", quantize_act, dot_rows<dot_iq4_xs>};
constexpr QuantDotKernels kQ2_K = {"q2_k-scalar", quantize_act, dot_rows<dot_q2_k>};
constexpr QuantDotKernels kQ3_K = {"q3_k-scalar", quantize_act, dot_rows<dot_q3_k>};
constexpr QuantDotKernels kIq2Xxs = {"iq2_xxs-scalar", quantize_act, dot_rows<dot_iq2_xxs>};
constexpr QuantDotKernels kIq3Xxs = {"iq3_xxs-scalar", quantize_act, dot_rows<dot_iq3_xxs>};
constexpr QuantDotKernels kIq1S = {"iq1_s-scalar", quantize_act, dot_rows<dot_iq1_s>};
constexpr QuantDotKernels kIq1M = {"iq1_m-scalar", quantize_act, dot_rows<dot_iq1_m>};
constexpr QuantDotKernels kIq2Xs = {"iq2_xs-scalar", quantize_act, dot_rows<dot_iq2_xs_s<BlockIq2Xs>>};
constexpr QuantDotKernels kIq2S = {"iq2_s-scalar", quantize_act, dot_rows<dot_iq2_xs_s<BlockIq2S>>};
constexpr QuantDotKernels kIq3S = {"iq3_s-scalar", quantize_act, dot_rows<dot_iq3_s>};
constexpr QuantDotKernels kFp8E4M3 = {"fp8_e4m3-scalar", copy_act_f32, dot_rows<dot_fp8_e4m3>};
constexpr QuantDotKernels kTq1_0 = {"tq1_0-scalar", quantize_act, dot_rows<dot_ternary<BlockTq1_0, tq1_code>>};
constexpr QuantDotKernels kTq2_0 = {"tq2_0-scalar", quantize_act, dot_rows<dot_ternary<BlockTq2_0, tq2_code>>};

}  // namespace

const QuantDotKernels* quant_dot_scalar(WeightType t) {
  switch (t) {
    case WeightType::kQ8_0:
      return &kQ8_0;
    case WeightType::kQ4_0:
      return &kQ4_0;
    case WeightType::kQ4_K:
      return &kQ4_K;
    case WeightType::kQ5_K:
      return &kQ5_K;
    case WeightType::kQ6_K:
      return &kQ6_K;
    case WeightType::kMXFP4:
      return &kMxfp4;
    case WeightType::kQ4_1:
      return &kQ4_1;
    case WeightType::kQ5_0:
      return &kQ5_0;
    case WeightType::kQ5_1:
      return &kQ5_1;
    case WeightType::kIQ4_NL:
      return &kIq4Nl;
    case WeightType::kIQ4_XS:
      return &kIq4Xs;
    case WeightType::kQ2_K:
      return &kQ2_K;
    case WeightType::kQ3_K:
      return &kQ3_K;
    case WeightType::kIQ2_XXS:
      return &kIq2Xxs;
    case WeightType::kIQ3_XXS:
      return &kIq3Xxs;
    case WeightType::kIQ1_S:
      return &kIq1S;
    case WeightType::kIQ1_M:
      return &kIq1M;
    case WeightType::kIQ2_XS:
      return &kIq2Xs;
    case WeightType::kIQ2_S:
      return &kIq2S;
    case WeightType::kIQ3_S:
      return &kIq3S;
    case WeightType::kFP8_E4M3:
      return &kFp8E4M3;
    case WeightType::kTQ1_0:
      return &kTq1_0;
    case WeightType::kTQ2_0:
      return &kTq2_0;
    default:
      return nullptr;
  }
}

}  // namespace colibri::kernels
