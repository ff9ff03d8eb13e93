// FP8 e4m3 dot products (quant_dot.h: fp32 activations, weights converted
// exactly, fp32 products and sums), written once over a vector trait for
// the files that compile it with their own flags: qdot_avx2.cpp and
// qdot_avxvnni.cpp (Fp8Ymm) and qdot_avx512.cpp (Fp8Zmm).
//
// Conversion: each code is sign-extended to 16 bits and shifted left by 7,
// which puts its exponent and mantissa in an f16's bits 13..7 and its sign
// in bits 15 and 14; clearing bit 14 leaves the f16 whose value is exactly
// e4m3(code) * 2^-8, normals and subnormals alike (f16's exponent bias 15
// against e4m3's 7, and its subnormal spacing 2^-24 against 2^-9 * 2^-8),
// and vcvtph2ps widens it exactly, whatever MXCSR's DAZ says. The 2^8
// comes back once per output. The NaN codes (magnitude 0x7f) would read
// as 480: each row's codes also go through a byte max of (code & 0x7f), two
// operations per vector of bytes instead of a compare and blend per vector
// of words, and a row that has one gives NaN for every token, as the
// reference's NaN products do.
//
// Loop: a pass takes R rows x T tokens; per block each row's codes are
// converted once and feed T FMAs. Small passes (R x T up to
// kMaxBlockSums: decode) sum each block apart and add it times the
// block's scale to the running total, one FMA per block instead of a
// multiply per weight vector (1.2x at one token); larger ones multiply
// the converted weights by the scale once for the T tokens and accumulate
// straight into the totals, which leaves the registers to the R x T
// accumulators. Below four (row, token) chains each splits in 2 or 4, so
// one row's decode is not bound by the FMA latency. Rows go in groups of
// R, each group's weights read once per pass of T tokens (from L1 after
// the first). No software prefetch: with 132-byte blocks over R rows it
// measured no faster than the hardware prefetchers alone, often slower.
//
// Everything lives in an anonymous namespace and no inline function of a
// shared header is called (tests/isa_linkage.sh).
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "qdot_fp8_impl.h needs -mavx2 -mfma -mf16c"
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/quant_dot.h"
#include "kernels/x86_intrinsics.h"
#include "util/quant_blocks.h"

namespace colibri::kernels {
namespace {
namespace fp8 {

// The scalar table's copy_act_f32: x[0, n_valid), then zeros up to n.
void copy_act(const float* x, size_t n_valid, size_t n, void* out) {
  auto* o = static_cast<float*>(out);
  if (n_valid > 0) std::memcpy(o, x, n_valid * sizeof(float));
  if (n > n_valid) std::memset(o + n_valid, 0, (n - n_valid) * sizeof(float));
}

constexpr size_t kBlockBytes = sizeof(BlockFp8E4M3);
constexpr size_t kCodesAt = offsetof(BlockFp8E4M3, qs);
inline float block_scale(const uint8_t* blk) {
  float d;
  std::memcpy(&d, blk, sizeof d);
  return d;
}

}  // namespace fp8

// 8 fp32 lanes; 16 codes a conversion.
struct Fp8Ymm {
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  // Measured on Zen 5 (R x T of 2x4 against 3x4, 4x2, 2x6, 4x4): 16 ymm
  // hold the 8 accumulators (16 with the block sums of 2x2), the
  // converted pair, the scales and the constants.
  static constexpr int kMaxRows = 2;
  static constexpr int kMaxTokens = 4;
  static constexpr int kMaxBlockSums = 4;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // 16 codes at p: e4m3 * 2^-8 of codes 0-7 and 8-15.
  static void convert(const uint8_t* p, F* lo, F* hi) {
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  static I nan_init() { return _mm256_setzero_si256(); }
  // The byte max of (code & 0x7f) over a block's 128 codes at p.
  static I nan_scan(I m, const uint8_t* p) {
    const __m256i low7 = _mm256_set1_epi8(0x7f);
    for (int i = 0; i < 4; ++i) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i));
      m = _mm256_max_epu8(m, _mm256_and_si256(c, low7));
    }
    return m;
  }
  static bool any_nan(I m) { return _mm256_movemask_epi8(_mm256_cmpeq_epi8(m, _mm256_set1_epi8(0x7f))) != 0; }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 fp32 lanes; 32 codes a conversion.
struct Fp8Zmm {
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  // Measured on Zen 5 (4x4 against 4x5, 3x6, 5x4, 2x8, 4x6): 16
  // accumulators (16 with the block sums of 4x2) in 32 zmm; more tokens a
  // pass spill and ran 10-25% slower at 32 tokens.
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxTokens = 4;
  static constexpr int kMaxBlockSums = 8;

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const uint8_t* p) { return _mm512_loadu_ps(p); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  // 32 codes at p: e4m3 * 2^-8 of codes 0-15 and 16-31.
  static void convert(const uint8_t* p, F* lo, F* hi) {
    const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(s, 7), _mm512_set1_epi16(static_cast<int16_t>(0xbfff)));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
  static I nan_init() { return _mm512_setzero_si512(); }
  static I nan_scan(I m, const uint8_t* p) {
    const __m512i low7 = _mm512_set1_epi8(0x7f);
    for (int i = 0; i < 2; ++i) {
      m = _mm512_max_epu8(m, _mm512_and_si512(_mm512_loadu_si512(p + 64 * i), low7));
    }
    return m;
  }
  static bool any_nan(I m) { return _mm512_cmpeq_epi8_mask(m, _mm512_set1_epi8(0x7f)) != 0; }
};
#endif

namespace fp8 {

// out[t * ld_out + r] for R rows at w (row_bytes apart) and T tokens' fp32
// activations at act (act_bytes apart), nb blocks each.
template <class V, int R, int T>
void pass(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_bytes, size_t nb, float* out,
          size_t ld_out) {
  using F = typename V::F;
  constexpr int L = V::kLanes;
  constexpr int kVecs = kQKFp8 / L;
  constexpr bool kBlockSums = R * T <= V::kMaxBlockSums;
  // Chains per (row, token) in a block's sums.
  constexpr int S = R * T >= 4 ? 1 : (R * T >= 2 ? 2 : 4);
  static_assert(kVecs % 2 == 0 && kVecs % S == 0 && (kBlockSums || S == 1));
  F acc[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) acc[r][t] = V::zero();
  }
  typename V::I nan[R];
  for (int r = 0; r < R; ++r) nan[r] = V::nan_init();
  for (size_t b = 0; b < nb; ++b) {
    const uint8_t* blk[R];
    F d[R];
    for (int r = 0; r < R; ++r) {
      blk[r] = w + static_cast<size_t>(r) * row_bytes + b * kBlockBytes;
      d[r] = V::set1(block_scale(blk[r]));
    }
    const uint8_t* a = act + b * kQKFp8 * sizeof(float);
    if constexpr (kBlockSums) {
      F bacc[R][T][S];
      for (int r = 0; r < R; ++r) {
        for (int t = 0; t < T; ++t) {
          for (int s = 0; s < S; ++s) bacc[r][t][s] = V::zero();
        }
      }
#pragma GCC unroll 16
      for (int k = 0; k < kVecs; k += 2) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          F lo, hi;
          V::convert(blk[r] + kCodesAt + static_cast<size_t>(k) * L, &lo, &hi);
#pragma GCC unroll 8
          for (int t = 0; t < T; ++t) {
            const uint8_t* at = a + static_cast<size_t>(t) * act_bytes + static_cast<size_t>(k) * L * sizeof(float);
            bacc[r][t][k % S] = V::fma(lo, V::load(at), bacc[r][t][k % S]);
            bacc[r][t][(k + 1) % S] = V::fma(hi, V::load(at + L * sizeof(float)), bacc[r][t][(k + 1) % S]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int t = 0; t < T; ++t) {
          F sum = bacc[r][t][0];
          for (int s = 1; s < S; ++s) sum = V::add(sum, bacc[r][t][s]);
          acc[r][t] = V::fma(sum, d[r], acc[r][t]);
        }
      }
    } else {
#pragma GCC unroll 16
      for (int k = 0; k < kVecs; k += 2) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          F lo, hi;
          V::convert(blk[r] + kCodesAt + static_cast<size_t>(k) * L, &lo, &hi);
          lo = V::mul(lo, d[r]);
          hi = V::mul(hi, d[r]);
#pragma GCC unroll 8
          for (int t = 0; t < T; ++t) {
            const uint8_t* at = a + static_cast<size_t>(t) * act_bytes + static_cast<size_t>(k) * L * sizeof(float);
            acc[r][t] = V::fma(lo, V::load(at), acc[r][t]);
            acc[r][t] = V::fma(hi, V::load(at + L * sizeof(float)), acc[r][t]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) nan[r] = V::nan_scan(nan[r], blk[r] + kCodesAt);
  }
  for (int r = 0; r < R; ++r) {
    const bool has_nan = V::any_nan(nan[r]);
    for (int t = 0; t < T; ++t) {
      // NaN with the quiet bit, as a NaN product would leave it.
      out[static_cast<size_t>(t) * ld_out + static_cast<size_t>(r)] =
          has_nan ? __builtin_nanf("") : V::hsum(acc[r][t]) * 256.0f;
    }
  }
}

// pass<V, R, T> for the given counts (1 <= r <= V::kMaxRows, 1 <= t <= V::kMaxTokens).
template <class V, int R = 1, int T = 1>
void pass_for(int r, int t, const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_bytes, size_t nb,
              float* out, size_t ld_out) {
  if constexpr (R < V::kMaxRows) {
    if (r != R) return pass_for<V, R + 1, 1>(r, t, w, row_bytes, act, act_bytes, nb, out, ld_out);
  }
  if constexpr (T < V::kMaxTokens) {
    if (t != T) return pass_for<V, R, T + 1>(r, t, w, row_bytes, act, act_bytes, nb, out, ld_out);
  }
  pass<V, R, T>(w, row_bytes, act, act_bytes, nb, out, ld_out);
}

// QuantDotKernels::dot_rows: groups of V::kMaxRows rows (the rest one
// smaller group), each over the tokens in passes of at most V::kMaxTokens,
// as even as possible.
template <class V>
void dot_rows(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
              size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nb = n / kQKFp8;
  const int passes = (tokens + V::kMaxTokens - 1) / V::kMaxTokens;
  for (int32_t r0 = 0; r0 < rows; r0 += V::kMaxRows) {
    const int nr = rows - r0 < V::kMaxRows ? rows - r0 : V::kMaxRows;
    int32_t t0 = 0;
    for (int p = 0; p < passes; ++p) {
      const int nt = (tokens - t0) / (passes - p);
      pass_for<V>(nr, nt, wb + static_cast<size_t>(r0) * row_bytes, row_bytes,
                  ab + static_cast<size_t>(t0) * act_bytes, act_bytes, nb,
                  out + static_cast<size_t>(t0) * ld_out + static_cast<size_t>(r0), ld_out);
      t0 += nt;
    }
  }
}

}  // namespace fp8
}  // namespace
}  // namespace colibri::kernels
