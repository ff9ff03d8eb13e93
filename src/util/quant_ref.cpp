// Bit-exactness with ggml and the gguf package depends on every product and
// sum being rounded on its own: a fused multiply-add (which GCC forms even
// across statements once FMA is enabled, as with COLIBRI_NATIVE) changes
// the last bit of dequantised values and can flip a rounding decision in
// the quantisers. CMakeLists.txt compiles this file with -ffp-contract=off.
#include "util/quant_ref.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "util/half.h"
#include "util/iq_grids.h"
#include "util/quant_blocks.h"

namespace colibri {

namespace {

constexpr int kSub32 = kQKK / 32;  // 32-element sub-blocks of a q4_K / q5_K super-block
constexpr int kSub16 = kQKK / 16;  // 16-element sub-blocks of a q6_K super-block

// ggml treats a group whose largest magnitude is below this as all zero.
constexpr float kGroupMaxEps = 1e-15f;

// Inputs of the K quantisers are clamped to this magnitude first. Beyond
// about 7e7 (q4_K) to 3e8 (q6_K) nothing is representable with an f16
// scale, so this loses nothing, while it keeps ggml's sums of squares and
// cubes finite (they overflow past ~1e12 and the scale search turns to NaN).
constexpr float kKInputLimit = 4294967296.0f;  // 2^32

// Round to nearest, ties to even, as ggml's nearest_int: adding 1.5 * 2^23
// leaves the rounded integer in the low mantissa bits. ggml asserts
// |v| <= 2^22 - 1; here larger values saturate there and NaN gives 0, so
// degenerate inputs cannot produce out-of-range integers.
int nearest_int(float v) {
  constexpr float kLimit = 4194303.0f;
  if (!(std::fabs(v) <= kLimit)) v = std::isnan(v) ? 0.0f : std::copysign(kLimit, v);
  const float biased = v + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &biased, sizeof bits);
  return (bits & 0x007fffff) - 0x00400000;
}

int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The smallest float that rounds to an infinite f16.
constexpr float kF16Overflow = 65520.0f;

// f16 scale fields saturate at the largest finite f16 instead of becoming
// infinite (ggml writes inf there, which dequantises to inf and, times a
// zero quant, NaN). Finite, non-NaN inputs only reach this.
uint16_t f16_scale(float f) {
  const uint16_t h = float_to_f16(f);
  if ((h & 0x7c00u) != 0x7c00u) return h;
  if ((h & 0x03ffu) != 0) return 0;  // NaN: no usable scale
  return static_cast<uint16_t>((h & 0x8000u) | 0x7bffu);
}

// ggml's get_scale_min_k4: sub-blocks 0-3 keep their 6-bit scale and min in
// the low bits of bytes j and j + 4; sub-blocks 4-7 split theirs into a low
// nibble in byte j + 4 and two high bits in the spare top bits of bytes
// j - 4 (scale) and j (min).
void unpack_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Inverse of unpack_scale_min for all eight sub-blocks at once.
void pack_scales_mins(const uint8_t* ls, const uint8_t* lm, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>((ls[j] & 63) | ((ls[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>((lm[j] & 63) | ((lm[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((ls[j + 4] & 0xf) | ((lm[j + 4] & 0xf) << 4));
  }
}

// ggml's make_qkx2_quants: fits x ~ scale * L - neg_min with L in
// [0, nmax] and a min no greater than 0, minimising the weighted squared
// error (the weighted absolute error with `mad`, as q2_K asks). It starts from the plain min/max mapping, then tries nstep + 1
// stretched grids (rmin + rdelta * k steps wider), solving the weighted
// least-squares scale and min for each grid's assignment. The float
// expressions keep ggml's operand order so the chosen grid is the same.
float fit_scale_min(const float* x, const float* w, int n, int nmax, float rmin, float rdelta, int nstep,
                    uint8_t* L, float* neg_min, bool mad = false) {
  float min = x[0];
  float max = x[0];
  float sum_w = w[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    const float wx = w[i] * x[i];
    sum_x += wx;
  }
  if (min > 0) min = 0;
  float iscale = static_cast<float>(nmax) / (max - min);
  // A range so narrow that its inverse overflows gives ggml L = 0 and a zero
  // scale by way of NaN arithmetic; take that result directly.
  if (max == min || !std::isfinite(iscale)) {
    std::memset(L, 0, static_cast<size_t>(n));
    *neg_min = -min;
    return 0.0f;
  }
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const float t = x[i] - min;
    L[i] = static_cast<uint8_t>(clamp_int(nearest_int(iscale * t), 0, nmax));
    const float fit = scale * L[i];
    const float diff = fit + min - x[i];
    const float e = mad ? std::fabs(diff) : diff * diff;
    best_error += w[i] * e;
  }
  uint8_t trial[32];
  for (int is = 0; is <= nstep; ++is) {
    const float step = rdelta * static_cast<float>(is);
    const float widened = rmin + step;
    iscale = (widened + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const float t = x[i] - min;
      const int l = clamp_int(nearest_int(iscale * t), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      const float wl = w[i] * static_cast<float>(l);
      sum_l += wl;
      const float wl2 = wl * static_cast<float>(l);
      sum_l2 += wl2;
      const float wlx = wl * x[i];
      sum_xl += wlx;
    }
    const float a = sum_w * sum_l2;
    const float b = sum_l * sum_l;
    const float D = a - b;
    if (!(D > 0)) continue;
    const float p = sum_w * sum_xl;
    const float q = sum_x * sum_l;
    float this_scale = (p - q) / D;
    const float r = sum_l2 * sum_x;
    const float s = sum_l * sum_xl;
    float this_min = (r - s) / D;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    float error = 0;
    for (int i = 0; i < n; ++i) {
      const float fit = this_scale * trial[i];
      const float diff = fit + this_min - x[i];
      const float e = mad ? std::fabs(diff) : diff * diff;
      error += w[i] * e;
    }
    if (error < best_error) {
      std::memcpy(L, trial, static_cast<size_t>(n));
      best_error = error;
      scale = this_scale;
      min = this_min;
    }
  }
  *neg_min = -min;
  return scale;
}

// Sums of one symmetric grid's assignment, weighted by x^2 (ggml's
// make_qx_quants with rmse_type 1).
struct SymmetricFit {
  float sumlx = 0;
  float suml2 = 0;
};

SymmetricFit symmetric_sums(const float* x, int n, int nmax, float iscale, int8_t* L) {
  SymmetricFit f;
  for (int i = 0; i < n; ++i) {
    const int l = clamp_int(nearest_int(iscale * x[i]), -nmax, nmax - 1);
    if (L != nullptr) L[i] = static_cast<int8_t>(l + nmax);
    const float w = x[i] * x[i];
    const float wx = w * x[i];
    const float wxl = wx * static_cast<float>(l);
    f.sumlx += wxl;
    const float wl = w * static_cast<float>(l);
    const float wl2 = wl * static_cast<float>(l);
    f.suml2 += wl2;
  }
  return f;
}

// ggml's make_qx_quants(rmse_type = 1, no importance weights): a signed
// scale with L in [0, 2 * nmax) (q = L - nmax), anchored so the largest
// magnitude maps to -nmax, then 18 slightly stretched or shrunk grids, each
// kept if its least-squares scale lowers the x^2-weighted error.
float fit_symmetric_scale(const float* x, int n, int nmax, int8_t* L) {
  float max = 0;
  float amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    std::memset(L, 0, static_cast<size_t>(n));
    return 0.0f;
  }
  float iscale = static_cast<float>(-nmax) / max;
  SymmetricFit f = symmetric_sums(x, n, nmax, iscale, L);
  float scale = f.suml2 != 0 ? f.sumlx / f.suml2 : 0.0f;
  float best = scale * f.sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    const float stretch = 0.1f * static_cast<float>(is);
    iscale = -(static_cast<float>(nmax) + stretch) / max;
    f = symmetric_sums(x, n, nmax, iscale, nullptr);
    const float gain = f.sumlx * f.sumlx;
    const float bar = best * f.suml2;
    if (f.suml2 > 0 && gain > bar) {
      symmetric_sums(x, n, nmax, iscale, L);
      scale = f.sumlx / f.suml2;
      best = scale * f.sumlx;
    }
  }
  return scale;
}

// Clamped copy of one super-block (see kKInputLimit).
void load_clamped(const float* src, float* x) {
  for (int i = 0; i < kQKK; ++i) {
    const float v = src[i];
    x[i] = v > kKInputLimit ? kKInputLimit : (v < -kKInputLimit ? -kKInputLimit : v);
  }
}

// The shared first half of q4_K and q5_K: per-sub-block scales and mins
// from fit_scale_min, quantised to 6 bits against the largest of each, then
// every weight re-quantised against the scales as stored (so L matches what
// the dequantiser will compute). Writes d, dmin and scales; L gets 0..nmax.
void quantize_k_scales(const float* x, int nmax, float rmin, float rdelta, int nstep, uint16_t* d_out,
                       uint16_t* dmin_out, uint8_t* scales_out, uint8_t* L) {
  float scales[kSub32];
  float mins[kSub32];
  float weights[32];
  float max_scale = 0;
  float max_min = 0;
  for (int j = 0; j < kSub32; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) {
      const float sq = xs[l] * xs[l];
      sum_x2 += sq;
    }
    // Weighting by magnitude plus the sub-block's RMS favours large weights
    // without ignoring the small ones.
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] = fit_scale_min(xs, weights, 32, nmax, rmin, rdelta, nstep, L + 32 * j, &mins[j]);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }

  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t ls[kSub32];
  uint8_t lm[kSub32];
  for (int j = 0; j < kSub32; ++j) {
    // The uint8_t conversion before the clamp is ggml's (a negative scale,
    // which its fit does not produce, would wrap and clamp to 63).
    const auto s = static_cast<uint8_t>(nearest_int(inv_scale * scales[j]));
    const auto m = static_cast<uint8_t>(nearest_int(inv_min * mins[j]));
    ls[j] = s < 63 ? s : 63;
    lm[j] = m < 63 ? m : 63;
  }
  *d_out = f16_scale(max_scale / 63.f);
  *dmin_out = f16_scale(max_min / 63.f);

  const float d_all = f16_to_float(*d_out);
  const float dmin_all = f16_to_float(*dmin_out);
  for (int j = 0; j < kSub32; ++j) {
    const float* xs = x + 32 * j;
    uint8_t* Ls = L + 32 * j;
    const float d = d_all * ls[j];
    const float dm = dmin_all * lm[j];
    // A zero scale keeps fit_scale_min's levels, as ggml does (they do not
    // matter to the values, only to the bytes).
    if (d != 0) {
      for (int i = 0; i < 32; ++i) {
        const float shifted = xs[i] + dm;
        Ls[i] = static_cast<uint8_t>(clamp_int(nearest_int(shifted / d), 0, nmax));
      }
    }
    // When d underflows in f16 (magnitudes around 1e-5 and below) while
    // dmin still rounds up to a step, every value of the sub-block becomes
    // -dmin * m, which for data around zero is far worse than nothing
    // (ggml's output has 2-3x the data's own norm as error there). Such a
    // sub-block is stored as zeros instead. Limited to d == 0, so every
    // super-block with a representable d keeps ggml's bytes.
    if (d_all == 0 && dm != 0) {
      double err = 0, energy = 0;
      for (int i = 0; i < 32; ++i) {
        const double e = static_cast<double>(-dm) - xs[i];
        err += e * e;
        energy += static_cast<double>(xs[i]) * xs[i];
      }
      if (err > energy) {
        ls[j] = 0;
        lm[j] = 0;
        std::memset(Ls, 0, 32);
      }
    }
  }
  pack_scales_mins(ls, lm, scales_out);
}

// The signed value of largest magnitude of a 32-element block, the first
// if tied (q4_0, q5_0). Starting from src[0] rather than ggml's 0.0f is
// gguf's argmax: the two differ only in the sign of a zero scale when
// src[0] is -0.0 and the block is all zeros.
float signed_extreme(const float* src) {
  float max = src[0];
  float amax = std::fabs(src[0]);
  for (int j = 1; j < kQK32; ++j) {
    if (std::fabs(src[j]) > amax) {
      amax = std::fabs(src[j]);
      max = src[j];
    }
  }
  return max;
}

}  // namespace

void dequantize_q8_0(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ8_0*>(src);
  for (size_t i = 0; i < n / kQK32; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int j = 0; j < kQK32; ++j) *dst++ = static_cast<float>(b->qs[j]) * d;
  }
}

void dequantize_q4_0(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ4_0*>(src);
  for (size_t i = 0; i < n / kQK32; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int j = 0; j < kQK32 / 2; ++j) {
      dst[j] = d * static_cast<float>((b->qs[j] & 0xf) - 8);
      dst[j + kQK32 / 2] = d * static_cast<float>((b->qs[j] >> 4) - 8);
    }
    dst += kQK32;
  }
}

void dequantize_q4_k(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ4K*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    const float dmin = f16_to_float(b->dmin);
    for (int j = 0; j < kSub32; ++j) {
      uint8_t sc, m;
      unpack_scale_min(b->scales, j, &sc, &m);
      const float d1 = d * sc;
      const float m1 = dmin * m;
      const uint8_t* q = b->qs + 32 * (j / 2);
      const int shift = (j & 1) * 4;
      for (int l = 0; l < 32; ++l) {
        const float scaled = d1 * static_cast<float>((q[l] >> shift) & 0xf);
        *dst++ = scaled - m1;
      }
    }
  }
}

void dequantize_q5_k(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ5K*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    const float dmin = f16_to_float(b->dmin);
    for (int j = 0; j < kSub32; ++j) {
      uint8_t sc, m;
      unpack_scale_min(b->scales, j, &sc, &m);
      const float d1 = d * sc;
      const float m1 = dmin * m;
      const uint8_t* q = b->qs + 32 * (j / 2);
      const int shift = (j & 1) * 4;
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> shift) & 0xf) | (((b->qh[l] >> j) & 1) << 4);
        const float scaled = d1 * static_cast<float>(v);
        *dst++ = scaled - m1;
      }
    }
  }
}

float mxfp4_scale(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void dequantize_mxfp4(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockMxfp4*>(src);
  for (size_t i = 0; i < n / kQK32; ++i, ++b) {
    const float d = mxfp4_scale(b->e);
    for (int j = 0; j < kQK32 / 2; ++j) {
      dst[j] = d * static_cast<float>(kMxfp4Values[b->qs[j] & 0xf]);
      dst[j + kQK32 / 2] = d * static_cast<float>(kMxfp4Values[b->qs[j] >> 4]);
    }
    dst += kQK32;
  }
}

void dequantize_q4_1(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ4_1*>(src);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const float d = f16_to_float(b->d);
    const float m = f16_to_float(b->m);
    for (int j = 0; j < kQK32 / 2; ++j) {
      const float lo = d * static_cast<float>(b->qs[j] & 0xf);
      const float hi = d * static_cast<float>(b->qs[j] >> 4);
      dst[j] = lo + m;
      dst[j + kQK32 / 2] = hi + m;
    }
  }
}

int q5_code(const uint8_t* qs, const uint8_t* qh, int j) {
  uint32_t h;
  std::memcpy(&h, qh, sizeof h);
  const int nibble = j < kQK32 / 2 ? qs[j] & 0xf : qs[j - kQK32 / 2] >> 4;
  return nibble | static_cast<int>(((h >> j) & 1u) << 4);
}

void dequantize_q5_0(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ5_0*>(src);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const float d = f16_to_float(b->d);
    for (int j = 0; j < kQK32; ++j) dst[j] = d * static_cast<float>(q5_code(b->qs, b->qh, j) - 16);
  }
}

void dequantize_q5_1(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ5_1*>(src);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const float d = f16_to_float(b->d);
    const float m = f16_to_float(b->m);
    for (int j = 0; j < kQK32; ++j) {
      const float scaled = d * static_cast<float>(q5_code(b->qs, b->qh, j));
      dst[j] = scaled + m;
    }
  }
}

void dequantize_iq4_nl(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq4Nl*>(src);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const float d = f16_to_float(b->d);
    for (int j = 0; j < kQK32 / 2; ++j) {
      dst[j] = d * static_cast<float>(kIq4nlValues[b->qs[j] & 0xf]);
      dst[j + kQK32 / 2] = d * static_cast<float>(kIq4nlValues[b->qs[j] >> 4]);
    }
  }
}

int iq4_xs_scale(const void* block, int j) {
  const auto* b = static_cast<const BlockIq4Xs*>(block);
  return ((b->scales_l[j / 2] >> (4 * (j % 2))) & 0xf) | (((b->scales_h >> (2 * j)) & 3) << 4);
}

void dequantize_iq4_xs(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq4Xs*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int j = 0; j < kQKK / 32; ++j, dst += 32) {
      const float dl = d * static_cast<float>(iq4_xs_scale(b, j) - 32);
      const uint8_t* qs = b->qs + 16 * j;
      for (int l = 0; l < 16; ++l) {
        dst[l] = dl * static_cast<float>(kIq4nlValues[qs[l] & 0xf]);
        dst[l + 16] = dl * static_cast<float>(kIq4nlValues[qs[l] >> 4]);
      }
    }
  }
}

void dequantize_q2_k(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ2K*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    const float dmin = f16_to_float(b->dmin);
    for (int s = 0; s < kSub16; ++s, dst += 16) {
      const float dl = d * static_cast<float>(b->scales[s] & 0xf);
      const float ml = dmin * static_cast<float>(b->scales[s] >> 4);
      const uint8_t* q = b->qs + 32 * (s / 8) + 16 * (s % 2);
      const int shift = 2 * ((s % 8) / 2);
      for (int l = 0; l < 16; ++l) {
        const float scaled = dl * static_cast<float>((q[l] >> shift) & 3);
        dst[l] = scaled - ml;
      }
    }
  }
}

void dequantize_iq2_xxs(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq2Xxs*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      uint32_t words[2];
      std::memcpy(words, b->qs + 4 * ib, sizeof words);
      const float ls = 0.5f + static_cast<float>(words[1] >> 28);
      const float db = d * ls * 0.25f;
      for (int g = 0; g < 4; ++g, dst += 8) {
        const uint64_t grid = kIqTables.iq2xxs_grid[(words[0] >> (8 * g)) & 0xff];
        const uint8_t signs = kIqTables.iq2_signs[(words[1] >> (7 * g)) & 127];
        for (int j = 0; j < 8; ++j) {
          const float v = db * static_cast<float>((grid >> (8 * j)) & 0xff);
          dst[j] = (signs >> j) & 1 ? -v : v;
        }
      }
    }
  }
}

void dequantize_iq3_xxs(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq3Xxs*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      uint32_t aux;
      std::memcpy(&aux, b->qs + kQKK / 4 + 4 * ib, sizeof aux);
      const float db = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
      for (int g = 0; g < 4; ++g) {
        const uint8_t signs = kIqTables.iq2_signs[(aux >> (7 * g)) & 127];
        for (int j = 0; j < 8; ++j, ++dst) {
          const uint32_t grid = kIqTables.iq3xxs_grid[b->qs[8 * ib + 2 * g + j / 4]];
          const float v = db * static_cast<float>((grid >> (8 * (j % 4))) & 0xff);
          *dst = (signs >> j) & 1 ? -v : v;
        }
      }
    }
  }
}

namespace {

// IQ1 grid point `index`'s value j (-1, 0 or 1).
float iq1_value(uint32_t index, int j) {
  return static_cast<float>(static_cast<int8_t>((kIqTables.iq1s_grid[index] >> (8 * j)) & 0xff));
}

}  // namespace

void dequantize_iq1_s(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq1S*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      const uint32_t qh = b->qh[ib];
      const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
      const float delta = (qh & 0x8000) != 0 ? -kIq1Delta : kIq1Delta;
      for (int l = 0; l < 4; ++l) {
        const uint32_t index = b->qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8);
        for (int j = 0; j < 8; ++j) *dst++ = dl * (iq1_value(index, j) + delta);
      }
    }
  }
}

uint16_t iq1_m_d(const uint8_t* scales) {
  uint16_t sc[4];
  std::memcpy(sc, scales, sizeof sc);
  return static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
}

void dequantize_iq1_m(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq1M*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    uint16_t sc[4];
    std::memcpy(sc, b->scales, sizeof sc);
    const float d = f16_to_float(iq1_m_d(b->scales));
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      for (int l = 0; l < 4; ++l) {
        const uint32_t s = (sc[ib / 2] >> (6 * (ib % 2) + 3 * (l / 2))) & 7;
        const float dl = d * static_cast<float>(2 * s + 1);
        const uint32_t nibble = (b->qh[2 * ib + l / 2] >> (4 * (l % 2))) & 0xf;
        const uint32_t index = b->qs[4 * ib + l] | ((nibble & 7) << 8);
        const float delta = (nibble & 8) != 0 ? -kIq1Delta : kIq1Delta;
        for (int j = 0; j < 8; ++j) *dst++ = dl * (iq1_value(index, j) + delta);
      }
    }
  }
}

void dequantize_iq2_xs(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq2Xs*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int k = 0; k < kQKK / 8; ++k, dst += 8) {
      const uint32_t ls = (b->scales[k / 4] >> (4 * ((k / 2) % 2))) & 0xf;
      const float db = d * (0.5f + static_cast<float>(ls)) * 0.25f;
      const uint64_t grid = kIqTables.iq2xs_grid[b->qs[k] & 511];
      const uint8_t signs = kIqTables.iq2_signs[b->qs[k] >> 9];
      for (int j = 0; j < 8; ++j) {
        const float v = db * static_cast<float>((grid >> (8 * j)) & 0xff);
        dst[j] = (signs >> j) & 1 ? -v : v;
      }
    }
  }
}

void dequantize_iq2_s(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq2S*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int k = 0; k < kQKK / 8; ++k, dst += 8) {
      const uint32_t ls = (b->scales[k / 4] >> (4 * ((k / 2) % 2))) & 0xf;
      const float db = d * (0.5f + static_cast<float>(ls)) * 0.25f;
      const uint32_t index = b->qs[k] | (((b->qh[k / 4] >> (2 * (k % 4))) & 3) << 8);
      const uint64_t grid = kIqTables.iq2s_grid[index];
      for (int j = 0; j < 8; ++j) {
        const float v = db * static_cast<float>((grid >> (8 * j)) & 0xff);
        dst[j] = (b->signs[k] >> j) & 1 ? -v : v;
      }
    }
  }
}

void dequantize_iq3_s(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockIq3S*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int k = 0; k < kQKK / 4; ++k, dst += 4) {
      const int s = (b->scales[k / 16] >> (4 * ((k / 8) % 2))) & 0xf;
      const float db = d * static_cast<float>(1 + 2 * s);
      const uint32_t grid = kIqTables.iq3s_grid[b->qs[k] | (((b->qh[k / 8] >> (k % 8)) & 1) << 8)];
      for (int j = 0; j < 4; ++j) {
        const float v = db * static_cast<float>((grid >> (8 * j)) & 0xff);
        dst[j] = (b->signs[k / 2] >> (4 * (k % 2) + j)) & 1 ? -v : v;
      }
    }
  }
}

void q3_k_scales(const uint8_t* packed, int8_t* out) {
  for (int s = 0; s < kSub16; ++s) {
    const int low = s < 8 ? packed[s] & 0xf : packed[s - 8] >> 4;
    const int high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
    out[s] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

void dequantize_q3_k(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ3K*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    int8_t sc[kSub16];
    q3_k_scales(b->scales, sc);
    for (int s = 0; s < kSub16; ++s, dst += 16) {
      const float dl = d * static_cast<float>(sc[s]);
      const int j = (s % 8) / 2;  // the bit pair in qs
      const uint8_t* q = b->qs + 32 * (s / 8) + 16 * (s % 2);
      const uint8_t* hm = b->hmask + 16 * (s % 2);
      const int bit = 4 * (s / 8) + j;
      for (int l = 0; l < 16; ++l) {
        const int v = ((q[l] >> (2 * j)) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4);
        dst[l] = dl * static_cast<float>(v);
      }
    }
  }
}

void dequantize_q6_k(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockQ6K*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    // Element e = 128 * h + 32 * k + l (half h, quarter k): low nibble in
    // ql[64 * h + 32 * (k & 1) + l], the low one for k < 2; high two bits
    // at bit 2 * k of qh[32 * h + l].
    for (int e = 0; e < kQKK; ++e) {
      const int h = e / 128, k = (e / 32) % 4, l = e % 32, sub = e / 16;
      const int lo = (b->ql[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0xf;
      const int hi = (b->qh[32 * h + l] >> (2 * k)) & 3;
      const float ds = d * static_cast<float>(b->scales[sub]);
      dst[e] = ds * static_cast<float>((lo | (hi << 4)) - 32);
    }
    dst += kQKK;
  }
}

int tq1_trit(uint8_t q, int k) {
  static constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
  const auto shifted = static_cast<uint8_t>(q * kPow3[k]);
  return (shifted * 3) >> 8;
}

void dequantize_tq1_0(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockTq1_0*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    // Element order: 5 trits x 32 bytes, 5 x 16 bytes, then 4 x 4 bytes.
    struct Run {
      const uint8_t* bytes;
      int width;
      int trits;
    };
    const Run runs[3] = {{b->qs, 32, 5}, {b->qs + 32, 16, 5}, {b->qh, 4, 4}};
    for (const Run& r : runs) {
      for (int k = 0; k < r.trits; ++k, dst += r.width) {
        for (int l = 0; l < r.width; ++l) dst[l] = static_cast<float>(tq1_trit(r.bytes[l], k) - 1) * d;
      }
    }
  }
}

void dequantize_tq2_0(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const BlockTq2_0*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = f16_to_float(b->d);
    for (int e = 0; e < kQKK; ++e) {
      const int code = (b->qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3;
      dst[e] = static_cast<float>(code - 1) * d;
    }
    dst += kQKK;
  }
}

void quantize_q8_0(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ8_0*>(dst);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, src += kQK32) {
    float amax = 0;
    for (int j = 0; j < kQK32; ++j) {
      const float a = std::fabs(src[j]);
      if (a > amax) amax = a;
    }
    float d = amax / 127;
    b->d = f16_scale(d);
    // Past the f16 range the stored scale saturates; quantise against it so
    // the largest weights clip instead of every weight shrinking.
    if (std::fabs(d) >= kF16Overflow) d = f16_to_float(b->d);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < kQK32; ++j) {
      // roundf rounds half away from zero, as ggml and gguf's np_roundf.
      // The clamp and NaN test only matter when 1 / d overflows (amax below
      // ~4e-37, stored d is 0 anyway) or d saturated.
      const float r = std::round(src[j] * id);
      b->qs[j] = static_cast<int8_t>(r != r ? 0 : (r > 127 ? 127 : (r < -127 ? -127 : r)));
    }
  }
}

void quantize_q4_0(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ4_0*>(dst);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, src += kQK32) {
    const float max = signed_extreme(src);
    // Negative d maps the extreme to level 0 (-8), leaving 15 levels (+7)
    // for the other side: one more level where the largest weight is.
    float d = max / -8;
    b->d = f16_scale(d);
    if (std::fabs(d) >= kF16Overflow) d = f16_to_float(b->d);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    auto level = [id](float x) {
      const float shifted = x * id;
      const float v = shifted + 8.5f;
      // Truncation of v >= 0 is rounding to nearest of the level.
      return static_cast<uint8_t>(!(v >= 0) ? 0 : (v >= 15 ? 15 : static_cast<int>(v)));
    };
    for (int j = 0; j < kQK32 / 2; ++j) {
      b->qs[j] = static_cast<uint8_t>(level(src[j]) | (level(src[j + kQK32 / 2]) << 4));
    }
  }
}

void quantize_q4_k(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ4K*>(dst);
  float x[kQKK];
  uint8_t L[kQKK];
  for (size_t i = 0; i < n / kQKK; ++i, ++b, src += kQKK) {
    load_clamped(src, x);
    quantize_k_scales(x, 15, -1.0f, 0.1f, 20, &b->d, &b->dmin, b->scales, L);
    for (int c = 0; c < kSub32 / 2; ++c) {
      for (int l = 0; l < 32; ++l) {
        b->qs[32 * c + l] = static_cast<uint8_t>(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
      }
    }
  }
}

void quantize_q5_k(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ5K*>(dst);
  float x[kQKK];
  uint8_t L[kQKK];
  for (size_t i = 0; i < n / kQKK; ++i, ++b, src += kQKK) {
    load_clamped(src, x);
    quantize_k_scales(x, 31, -0.5f, 0.1f, 15, &b->d, &b->dmin, b->scales, L);
    std::memset(b->qh, 0, sizeof b->qh);
    for (int c = 0; c < kSub32 / 2; ++c) {
      for (int l = 0; l < 32; ++l) {
        const int lo = L[64 * c + l];
        const int hi = L[64 * c + 32 + l];
        b->qs[32 * c + l] = static_cast<uint8_t>((lo & 0xf) | ((hi & 0xf) << 4));
        b->qh[l] = static_cast<uint8_t>(b->qh[l] | ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
      }
    }
  }
}

void quantize_q6_k(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ6K*>(dst);
  float x[kQKK];
  int8_t L[kQKK];
  float scales[kSub16];
  for (size_t i = 0; i < n / kQKK; ++i, ++b, src += kQKK) {
    load_clamped(src, x);
    float max_scale = 0;
    float max_abs_scale = 0;
    for (int j = 0; j < kSub16; ++j) {
      scales[j] = fit_symmetric_scale(x + 16 * j, 16, 32, L + 16 * j);
      const float a = std::fabs(scales[j]);
      if (a > max_abs_scale) {
        max_abs_scale = a;
        max_scale = scales[j];
      }
    }
    if (max_abs_scale < kGroupMaxEps) {
      std::memset(b, 0, sizeof *b);
      continue;
    }
    // The sub-block scales are signed 8-bit: the largest maps to -128, the
    // one extra level on the negative side.
    const float iscale = -128.f / max_scale;
    b->d = f16_scale(1 / iscale);
    for (int j = 0; j < kSub16; ++j) {
      b->scales[j] = static_cast<int8_t>(clamp_int(nearest_int(iscale * scales[j]), -128, 127));
    }
    const float d_all = f16_to_float(b->d);
    for (int j = 0; j < kSub16; ++j) {
      const float d = d_all * static_cast<float>(b->scales[j]);
      if (d == 0) continue;  // keeps fit_symmetric_scale's levels, as ggml
      for (int l = 0; l < 16; ++l) {
        L[16 * j + l] = static_cast<int8_t>(clamp_int(nearest_int(x[16 * j + l] / d), -32, 31) + 32);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const int8_t* q = L + 128 * h;
      for (int l = 0; l < 32; ++l) {
        b->ql[64 * h + l] = static_cast<uint8_t>((q[l] & 0xf) | ((q[l + 64] & 0xf) << 4));
        b->ql[64 * h + 32 + l] = static_cast<uint8_t>((q[l + 32] & 0xf) | ((q[l + 96] & 0xf) << 4));
        b->qh[32 * h + l] = static_cast<uint8_t>((q[l] >> 4) | ((q[l + 32] >> 4) << 2) | ((q[l + 64] >> 4) << 4) |
                                                 ((q[l + 96] >> 4) << 6));
      }
    }
  }
}

void quantize_mxfp4(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockMxfp4*>(dst);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, src += kQK32) {
    float amax = 0.0f;
    for (int j = 0; j < kQK32; ++j) amax = std::fmax(amax, std::fabs(src[j]));
    // ggml's shared exponent: floor(log2(amax)) - 2, so that amax / 2^(e - 128)
    // lies in [8, 16) and the largest code (12) is at most 1.5x off. Where
    // ggml's float-to-uint8 conversion is undefined (amax below 2^-125, or
    // not finite) the exponent is clamped to [0, 254].
    int e = 0;
    if (amax > 0.0f) {
      const float l = std::floor(std::log2(amax)) - 2 + 127;
      e = !(l >= 0.0f) ? 0 : (l > 254.0f ? 254 : static_cast<int>(l));
    }
    b->e = static_cast<uint8_t>(e);
    const float d = mxfp4_scale(b->e);
    // The nearest code, the first of equals (gguf's argmin over the table,
    // whose 0 and -0 entries both decode to 0: index 0 wins).
    auto level = [d](float x) {
      int best = 0;
      float best_err = std::fabs(d * static_cast<float>(kMxfp4Values[0]) - x);
      for (int c = 1; c < 16; ++c) {
        const float err = std::fabs(d * static_cast<float>(kMxfp4Values[c]) - x);
        if (err < best_err) {
          best_err = err;
          best = c;
        }
      }
      return static_cast<uint8_t>(best);
    };
    for (int j = 0; j < kQK32 / 2; ++j) {
      b->qs[j] = static_cast<uint8_t>(level(src[j]) | (level(src[j + kQK32 / 2]) << 4));
    }
  }
}

namespace {

// q4_1 / q5_1: levels 0..nmax between the block's minimum and maximum
// (gguf's quantize_blocks and ggml's quantize_row_q4_1_ref: the level is
// the truncation of (x - min) / d + 0.5, clipped).
template <class Block>
void quantize_min_max(const float* src, Block* b, int nmax, uint8_t* L) {
  float lo = src[0];
  float hi = src[0];
  for (int j = 1; j < kQK32; ++j) {
    lo = src[j] < lo ? src[j] : lo;
    hi = src[j] > hi ? src[j] : hi;
  }
  float d = (hi - lo) / static_cast<float>(nmax);
  b->d = f16_scale(d);
  b->m = f16_scale(lo);
  if (std::fabs(d) >= kF16Overflow) d = f16_to_float(b->d);
  const float id = d != 0 ? 1.0f / d : 0.0f;
  for (int j = 0; j < kQK32; ++j) {
    const float shifted = (src[j] - lo) * id;
    const float v = shifted + 0.5f;
    L[j] = static_cast<uint8_t>(!(v >= 0) ? 0 : (v >= static_cast<float>(nmax) ? nmax : static_cast<int>(v)));
  }
}

// Packs 32 five-bit levels into q5_0 / q5_1's nibbles and high bits.
void pack_q5(const uint8_t* L, uint8_t* qs, uint8_t* qh) {
  uint32_t h = 0;
  for (int j = 0; j < kQK32 / 2; ++j) {
    qs[j] = static_cast<uint8_t>((L[j] & 0xf) | ((L[j + kQK32 / 2] & 0xf) << 4));
  }
  for (int j = 0; j < kQK32; ++j) h |= static_cast<uint32_t>(L[j] >> 4) << j;
  std::memcpy(qh, &h, sizeof h);
}

// ggml's best_index_int8: the index of the level nearest x in the
// ascending table (the upper one of a tie).
int best_index_iq4(float x) {
  const int8_t* v = kIq4nlValues;
  if (x <= v[0]) return 0;
  if (x >= v[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (x < v[mid]) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return x - v[hi - 1] < v[hi] - x ? hi - 1 : hi;
}

// ggml's quantize_row_iq4_nl_impl without an importance matrix (weights
// x^2) and with seven trials each side: the scale of each 32-element block
// of x[0, super) that minimises the weighted error, then (iq4_xs, super =
// 256) the blocks' scales as 6-bit multiples of one f16 d. Writes d, the
// packed codes and, for iq4_xs, the scales.
void quantize_iq4(const float* x, int super, uint16_t* dh, uint8_t* q4, uint16_t* scales_h, uint8_t* scales_l) {
  constexpr int kTrials = 7;
  const int blocks = super / 32;
  float scales[kQKK / 32];
  uint8_t L[kQKK];
  std::memset(q4, 0, static_cast<size_t>(super) / 2);
  *dh = float_to_f16(0.0f);
  float max_scale = 0, amax_scale = 0;
  for (int ib = 0; ib < blocks; ++ib) {
    const float* xb = x + 32 * ib;
    uint8_t* Lb = L + 32 * ib;
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
      if (std::fabs(xb[j]) > amax) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    if (amax < kGroupMaxEps) {
      scales[ib] = 0;
      for (int j = 0; j < 32; ++j) Lb[j] = static_cast<uint8_t>(best_index_iq4(0.0f));
      continue;
    }
    float d = -max / kIq4nlValues[0];
    float id = 1 / d;
    float sumqx = 0, sumq2 = 0;
    for (int j = 0; j < 32; ++j) {
      const int l = best_index_iq4(id * xb[j]);
      Lb[j] = static_cast<uint8_t>(l);
      const float q = kIq4nlValues[l];
      const float w = xb[j] * xb[j];
      sumqx += w * q * xb[j];
      sumq2 += w * q * q;
    }
    d = sumqx / sumq2;
    float best = d * sumqx;
    for (int itry = -kTrials; itry <= kTrials; ++itry) {
      id = static_cast<float>(itry + kIq4nlValues[0]) / max;
      sumqx = sumq2 = 0;
      for (int j = 0; j < 32; ++j) {
        const float q = kIq4nlValues[best_index_iq4(id * xb[j])];
        const float w = xb[j] * xb[j];
        sumqx += w * q * xb[j];
        sumq2 += w * q * q;
      }
      if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
        d = sumqx / sumq2;
        best = d * sumqx;
      }
    }
    scales[ib] = d;
    if (std::fabs(d) > amax_scale) {
      amax_scale = std::fabs(d);
      max_scale = d;
    }
  }
  if (blocks > 1) {
    *scales_h = 0;
    const float d = -max_scale / 32;
    *dh = f16_scale(d);
    const float id = d != 0 ? 1 / d : 0.0f;
    for (int ib = 0; ib < blocks; ++ib) {
      const int l = clamp_int(nearest_int(id * scales[ib]), -32, 31);
      const float dl = d * static_cast<float>(l);
      const float idl = dl != 0 ? 1 / dl : 0.0f;
      for (int j = 0; j < 32; ++j) L[32 * ib + j] = static_cast<uint8_t>(best_index_iq4(idl * x[32 * ib + j]));
      const int u = l + 32;
      if (ib % 2 == 0) {
        scales_l[ib / 2] = static_cast<uint8_t>(u & 0xf);
      } else {
        scales_l[ib / 2] = static_cast<uint8_t>(scales_l[ib / 2] | ((u & 0xf) << 4));
      }
      *scales_h = static_cast<uint16_t>(*scales_h | ((u >> 4) << (2 * ib)));
    }
  } else {
    *dh = f16_scale(scales[0]);
    const float id = scales[0] != 0 ? 1 / scales[0] : 0.0f;
    for (int j = 0; j < 32; ++j) L[j] = static_cast<uint8_t>(best_index_iq4(id * x[j]));
  }
  for (int i = 0; i < super / 32; ++i) {
    for (int j = 0; j < 16; ++j) q4[16 * i + j] = static_cast<uint8_t>(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
  }
}

}  // namespace

void quantize_q4_1(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ4_1*>(dst);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, src += kQK32) {
    uint8_t L[kQK32];
    quantize_min_max(src, b, 15, L);
    for (int j = 0; j < kQK32 / 2; ++j) b->qs[j] = static_cast<uint8_t>(L[j] | (L[j + kQK32 / 2] << 4));
  }
}

void quantize_q5_1(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ5_1*>(dst);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, src += kQK32) {
    uint8_t L[kQK32];
    quantize_min_max(src, b, 31, L);
    pack_q5(L, b->qs, b->qh);
  }
}

void quantize_q5_0(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ5_0*>(dst);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, src += kQK32) {
    // As q4_0: the extreme maps to level 0.
    float d = signed_extreme(src) / -16;
    b->d = f16_scale(d);
    if (std::fabs(d) >= kF16Overflow) d = f16_to_float(b->d);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    uint8_t L[kQK32];
    for (int j = 0; j < kQK32; ++j) {
      const float shifted = src[j] * id;
      const float v = shifted + 16.5f;
      L[j] = static_cast<uint8_t>(!(v >= 0) ? 0 : (v >= 31 ? 31 : static_cast<int>(v)));
    }
    pack_q5(L, b->qs, b->qh);
  }
}

void quantize_iq4_nl(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockIq4Nl*>(dst);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, src += kQK32) quantize_iq4(src, kQK32, &b->d, b->qs, nullptr, nullptr);
}

void quantize_iq4_xs(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockIq4Xs*>(dst);
  for (size_t i = 0; i < n / kQKK; ++i, ++b, src += kQKK) {
    quantize_iq4(src, kQKK, &b->d, b->qs, &b->scales_h, b->scales_l);
  }
}

void quantize_q2_k(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ2K*>(dst);
  constexpr float kLevels = 15.f;  // 4-bit scales and mins
  for (size_t i = 0; i < n / kQKK; ++i, ++b, src += kQKK) {
    float x[kQKK];
    load_clamped(src, x);
    uint8_t L[kQKK];
    float scales[kSub16];
    float mins[kSub16];
    float weights[16];
    float max_scale = 0;
    float max_min = 0;
    for (int j = 0; j < kSub16; ++j) {
      for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
      scales[j] = fit_scale_min(x + 16 * j, weights, 16, 3, -0.5f, 0.1f, 15, L + 16 * j, &mins[j], true);
      if (scales[j] > max_scale) max_scale = scales[j];
      if (mins[j] > max_min) max_min = mins[j];
    }
    // ggml stores nearest_int's value as a byte unclamped; the fit keeps
    // every scale and min within [0, max], so it lies in 0..15.
    if (max_scale > 0) {
      const float iscale = kLevels / max_scale;
      for (int j = 0; j < kSub16; ++j) b->scales[j] = static_cast<uint8_t>(clamp_int(nearest_int(iscale * scales[j]), 0, 15));
      b->d = f16_scale(max_scale / kLevels);
    } else {
      std::memset(b->scales, 0, sizeof b->scales);
      b->d = float_to_f16(0.f);
    }
    if (max_min > 0) {
      const float iscale = kLevels / max_min;
      for (int j = 0; j < kSub16; ++j) {
        b->scales[j] = static_cast<uint8_t>(b->scales[j] | (clamp_int(nearest_int(iscale * mins[j]), 0, 15) << 4));
      }
      b->dmin = f16_scale(max_min / kLevels);
    } else {
      b->dmin = float_to_f16(0.f);
    }
    for (int j = 0; j < kSub16; ++j) {
      const float d = f16_to_float(b->d) * static_cast<float>(b->scales[j] & 0xf);
      if (d == 0) continue;
      const float dm = f16_to_float(b->dmin) * static_cast<float>(b->scales[j] >> 4);
      for (int l = 0; l < 16; ++l) {
        const float shifted = x[16 * j + l] + dm;
        L[16 * j + l] = static_cast<uint8_t>(clamp_int(nearest_int(shifted / d), 0, 3));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const uint8_t* q = L + 128 * h;
      for (int l = 0; l < 32; ++l) {
        b->qs[32 * h + l] = static_cast<uint8_t>(q[l] | (q[l + 32] << 2) | (q[l + 64] << 4) | (q[l + 96] << 6));
      }
    }
  }
}

namespace {

// ggml's make_q3_quants with its least-squares refinement: levels in
// [-nmax, nmax) anchored so the largest magnitude maps to -nmax, then up to
// five passes moving single levels while the x^2-weighted fit improves.
// L gets the levels + nmax; returns the scale.
float fit_q3_scale(const float* x, int n, int nmax, int8_t* L) {
  float max = 0;
  float amax = 0;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    std::memset(L, 0, static_cast<size_t>(n));
    return 0.0f;
  }
  const float iscale = static_cast<float>(-nmax) / max;
  float sumlx = 0;
  float suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = clamp_int(nearest_int(iscale * x[i]), -nmax, nmax - 1);
    L[i] = static_cast<int8_t>(l);
    const float w = x[i] * x[i];
    const float wx = w * x[i];
    sumlx += wx * static_cast<float>(l);
    const float wl = w * static_cast<float>(l);
    suml2 += wl * static_cast<float>(l);
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      const float wx = w * x[i];
      float slx = sumlx - wx * static_cast<float>(L[i]);
      if (!(slx > 0)) continue;
      const float wl = w * static_cast<float>(L[i]);
      float sl2 = suml2 - wl * static_cast<float>(L[i]);
      const float target = x[i] * sl2;
      const int l = clamp_int(nearest_int(target / slx), -nmax, nmax - 1);
      if (l == L[i]) continue;
      slx += wx * static_cast<float>(l);
      const float wnew = w * static_cast<float>(l);
      sl2 += wnew * static_cast<float>(l);
      const float lhs = slx * slx * suml2;
      const float rhs = sumlx * sumlx * sl2;
      if (sl2 > 0 && lhs > rhs) {
        L[i] = static_cast<int8_t>(l);
        sumlx = slx;
        suml2 = sl2;
        ++changed;
      }
    }
    if (changed == 0) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(L[i] + nmax);
  return suml2 > 0 ? sumlx / suml2 : 0.0f;
}

}  // namespace

void quantize_q3_k(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockQ3K*>(dst);
  for (size_t i = 0; i < n / kQKK; ++i, ++b, src += kQKK) {
    float x[kQKK];
    load_clamped(src, x);
    int8_t L[kQKK];
    float scales[kSub16];
    float max_scale = 0;
    float amax = 0;
    for (int j = 0; j < kSub16; ++j) {
      scales[j] = fit_q3_scale(x + 16 * j, 16, 4, L + 16 * j);
      if (std::fabs(scales[j]) > amax) {
        amax = std::fabs(scales[j]);
        max_scale = scales[j];
      }
    }
    std::memset(b->scales, 0, sizeof b->scales);
    if (max_scale != 0) {
      const float iscale = -32.f / max_scale;
      for (int j = 0; j < kSub16; ++j) {
        const int l = clamp_int(nearest_int(iscale * scales[j]), -32, 31) + 32;
        if (j < 8) {
          b->scales[j] = static_cast<uint8_t>(l & 0xf);
        } else {
          b->scales[j - 8] = static_cast<uint8_t>(b->scales[j - 8] | ((l & 0xf) << 4));
        }
        b->scales[8 + j % 4] = static_cast<uint8_t>(b->scales[8 + j % 4] | ((l >> 4) << (2 * (j / 4))));
      }
      b->d = f16_scale(1 / iscale);
    } else {
      b->d = float_to_f16(0.f);
    }
    int8_t sc[kSub16];
    q3_k_scales(b->scales, sc);
    for (int j = 0; j < kSub16; ++j) {
      const float d = f16_to_float(b->d) * static_cast<float>(sc[j]);
      if (d == 0) continue;
      for (int l = 0; l < 16; ++l) {
        L[16 * j + l] = static_cast<int8_t>(clamp_int(nearest_int(x[16 * j + l] / d), -4, 3) + 4);
      }
    }
    // The third bit: element e of a half goes to bit 4 h + e / 32 of
    // hmask[e % 32], the two low bits stay in L.
    std::memset(b->hmask, 0, sizeof b->hmask);
    for (int e = 0; e < kQKK; ++e) {
      if (L[e] > 3) {
        b->hmask[e % 32] = static_cast<uint8_t>(b->hmask[e % 32] | (1u << (e / 32)));
        L[e] = static_cast<int8_t>(L[e] - 4);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const int8_t* q = L + 128 * h;
      for (int l = 0; l < 32; ++l) {
        b->qs[32 * h + l] = static_cast<uint8_t>(q[l] | (q[l + 32] << 2) | (q[l + 64] << 4) | (q[l + 96] << 6));
      }
    }
  }
}


float e4m3_to_float(uint8_t code) {
  const int exponent = (code >> 3) & 15;
  const int mantissa = code & 7;
  if (exponent == 15 && mantissa == 7) {
    return std::copysign(std::numeric_limits<float>::quiet_NaN(), (code & 0x80) != 0 ? -1.0f : 1.0f);
  }
  // Subnormal: mantissa * 2^-9; normal: (8 + mantissa) * 2^(exponent - 10).
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

uint8_t float_to_e4m3(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  if (std::isnan(v)) return sign | 0x7f;
  const float a = std::fabs(v);
  if (a >= 448.0f) return sign | 0x7e;
  // The spacing of the codes around a: 2^-9 below 2^-6 (subnormals), else
  // an eighth of a's power of two. a / quantum is exact (a power of two),
  // and nearbyint rounds it to even in the default rounding mode.
  int e = 0;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): a's power of two is 2^(e - 1)
  const int quantum_exp = a < 0x1p-6f ? -9 : e - 1 - 3;
  const float steps = std::nearbyint(std::ldexp(a, -quantum_exp));  // (8 + m) or 16 after a carry
  const float r = std::ldexp(steps, quantum_exp);
  if (r >= 448.0f) return sign | 0x7e;
  if (r < 0x1p-6f) return sign | static_cast<uint8_t>(steps);  // subnormal (a carry to 8 is 2^-6's code, 0x08)
  int re = 0;
  std::frexp(r, &re);
  const int exponent = re - 1 + 7;
  const int mantissa = static_cast<int>(std::ldexp(r, -(re - 1) + 3)) - 8;
  return sign | static_cast<uint8_t>(exponent << 3 | mantissa);
}

// Blocks are read and written as bytes: rows of 132-byte blocks leave the
// float scale unaligned.
void dequantize_fp8_e4m3(const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const uint8_t*>(src);
  for (size_t i = 0; i < n / kQKFp8; ++i, b += sizeof(BlockFp8E4M3)) {
    float d;
    std::memcpy(&d, b + offsetof(BlockFp8E4M3, d), sizeof d);
    const uint8_t* qs = b + offsetof(BlockFp8E4M3, qs);
    for (int j = 0; j < kQKFp8; ++j) dst[j] = d * e4m3_to_float(qs[j]);
    dst += kQKFp8;
  }
}

void quantize_fp8_e4m3(const float* src, void* dst, size_t n) {
  auto* b = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < n / kQKFp8; ++i, b += sizeof(BlockFp8E4M3)) {
    float amax = 0.0f;
    for (int j = 0; j < kQKFp8; ++j) amax = std::fmax(amax, std::fabs(src[j]));
    const float d = amax / 448.0f;
    std::memcpy(b + offsetof(BlockFp8E4M3, d), &d, sizeof d);
    uint8_t* qs = b + offsetof(BlockFp8E4M3, qs);
    for (int j = 0; j < kQKFp8; ++j) qs[j] = d == 0.0f ? 0 : float_to_e4m3(src[j] / d);
    src += kQKFp8;
  }
}

namespace {

// The ternary formats' shared first step: d = max |x| as an f16 (past the
// f16 range the largest finite one: ggml writes inf there), and each
// weight's code round(x / d) + 1 in 0..2, rounding half away from zero as
// ggml's lroundf; a NaN weight, which ggml leaves undefined, reads as 0.
uint16_t ternary_codes(const float* x, uint8_t* t) {
  float amax = 0;
  for (int j = 0; j < kQKK; ++j) {
    const float a = std::fabs(x[j]);
    if (a > amax) amax = a;
  }
  const float id = amax != 0 ? 1.0f / amax : 0.0f;
  for (int j = 0; j < kQKK; ++j) {
    const float r = std::round(x[j] * id);
    t[j] = static_cast<uint8_t>(r != r ? 1 : (r > 1 ? 2 : (r < -1 ? 0 : static_cast<int>(r) + 1)));
  }
  return f16_scale(amax);
}

// Trits t[0], t[stride], .. (count of them, the first most significant) as
// one TQ1_0 byte: base 3 padded to five trits, scaled to ceil(v * 256 / 243).
uint8_t pack_trits(const uint8_t* t, int stride, int count) {
  unsigned v = 0;
  for (int k = 0; k < 5; ++k) v = 3 * v + (k < count ? t[k * stride] : 0u);
  return static_cast<uint8_t>((v * 256 + 242) / 243);
}

}  // namespace

void quantize_tq1_0(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockTq1_0*>(dst);
  for (size_t i = 0; i < n / kQKK; ++i, ++b, src += kQKK) {
    uint8_t t[kQKK];
    b->d = ternary_codes(src, t);
    for (int l = 0; l < 32; ++l) b->qs[l] = pack_trits(t + l, 32, 5);
    for (int l = 0; l < 16; ++l) b->qs[32 + l] = pack_trits(t + 160 + l, 16, 5);
    for (int l = 0; l < 4; ++l) b->qh[l] = pack_trits(t + 240 + l, 4, 4);
  }
}

void quantize_tq2_0(const float* src, void* dst, size_t n) {
  auto* b = static_cast<BlockTq2_0*>(dst);
  for (size_t i = 0; i < n / kQKK; ++i, ++b, src += kQKK) {
    uint8_t t[kQKK];
    b->d = ternary_codes(src, t);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* q = t + 128 * h;
      for (int l = 0; l < 32; ++l) {
        b->qs[32 * h + l] = static_cast<uint8_t>(q[l] | (q[l + 32] << 2) | (q[l + 64] << 4) | (q[l + 96] << 6));
      }
    }
  }
}

}  // namespace colibri
