// The AVX2-level integer dot-product kernels of the ternary formats TQ1_0
// and TQ2_0 (quant_dot.h), included after qdot_avx2_impl.h by the three
// files that compile it with their Int8Dot trait: qdot_avx2.cpp
// (vpmaddubsw), qdot_avxvnni.cpp (VEX vpdpbusd) and qdot_avx512vl.cpp (EVEX
// vpdpbusd on ymm, for the AVX-512 level).
//
// Both formats decode to codes t in 0..2 (TQ2_0's 3 to 3) with x = d (t -
// 1), and in both the code vectors come out in activation order: eight
// vectors of 32 codes a super-block, vector j holding activation block j.
// That is q6_K's order (quant_blocks.h), so q6_K's prepared activations
// serve: per half the four code vectors transposed per 128-bit lane (lane
// 4l + v: sub-block 8h + 2v + l), products from the unsigned codes, the -1
// through the activations' sums as the dot's starting value (q6_K's -32
// (sum a) divided by 32), then per token and half one conversion, one
// multiply by the activation scales and one FMA with the super-block's d.
//
// TQ1_0's base-3 bytes: trit k of byte q is (q 3^k mod 256) * 3 >> 8,
// which is 0, 1 or 2 as q 3^k mod 256 lies below 86, below 171, or above.
// The powers come from byte additions (3v = v + v + v wraps as the byte
// product does), and the two thresholds from signed compares of the bytes
// biased by 128, a bias that tripling keeps (3 (v + 128) = 3v + 128 mod
// 256): one xor per loaded vector, two adds per power, four operations per
// vector of trits.
//
// Everything lives in an anonymous namespace (tests/isa_linkage.sh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/qdot_avx2_impl.h"
#include "util/quant_blocks.h"

namespace colibri::kernels {
namespace {

enum class Ternary { kTq1, kTq2 };

template <Ternary T>
constexpr size_t ternary_block_bytes() {
  return T == Ternary::kTq1 ? sizeof(BlockTq1_0) : sizeof(BlockTq2_0);
}

// 3v per byte (mod 256).
inline __m256i times3(__m256i v) { return _mm256_add_epi8(_mm256_add_epi8(v, v), v); }

// The trit (0..2) of each byte b, given b ^ 0x80: [b > 85] + [b > 170].
inline __m256i trits_biased(__m256i s) {
  const __m256i ge1 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8(85 - 128));
  const __m256i ge2 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8(170 - 128));
  return _mm256_sub_epi8(_mm256_sub_epi8(_mm256_setzero_si256(), ge1), ge2);
}

// The 256 codes of a super-block at blk, c[j] = activation block j's.
template <Ternary T>
inline void ternary_codes(const uint8_t* blk, __m256i* c) {
  if constexpr (T == Ternary::kTq2) {
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + offsetof(BlockTq2_0, qs) + 32 * h));
      c[4 * h] = _mm256_and_si256(q, m3);
      c[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 2), m3);
      c[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m3);
      c[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(q, 6), m3);
    }
  } else {
    const __m256i bias = _mm256_set1_epi8(-128);
    // qs[0, 32): trit k is block k.
    __m256i s = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)), bias);
    c[0] = trits_biased(s);
    for (int k = 1; k < 5; ++k) {
      s = times3(s);
      c[k] = trits_biased(s);
    }
    // qs[32, 48) in both lanes, the high lane one power ahead: trits 0 | 1
    // (block 5), 2 | 3 (block 6), then 4 in the low lane of block 7.
    const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32));
    __m256i u = _mm256_xor_si256(_mm256_broadcastsi128_si256(r), bias);
    u = _mm256_blend_epi32(u, times3(u), 0xf0);
    c[5] = trits_biased(u);
    u = times3(times3(u));
    c[6] = trits_biased(u);
    u = times3(times3(u));
    // qh: block 7's high lane, dword k holding the four bytes times 3^k.
    uint32_t qh;
    std::memcpy(&qh, blk + offsetof(BlockTq1_0, qh), sizeof qh);
    const __m256i h0 = _mm256_xor_si256(_mm256_set1_epi32(static_cast<int32_t>(qh)), bias);
    const __m256i h1 = times3(h0);
    const __m256i h2 = times3(h1);
    const __m256i h3 = times3(h2);
    const __m256i hq = _mm256_blend_epi32(_mm256_blend_epi32(h0, h1, 0x22), _mm256_blend_epi32(h2, h3, 0x88), 0xcc);
    c[7] = trits_biased(_mm256_blend_epi32(u, hq, 0xf0));
  }
}

// nsb super-blocks of one row against NT tokens' q6_K-prepared activations
// (init: -(sum a) per lane).
template <class Dot, Ternary T, int NT>
void ternary_sbs(const uint8_t* row, size_t nsb, const KPrep* prep, __m256* facc_io) {
  constexpr size_t kBytes = ternary_block_bytes<T>();
  __m256 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = facc_io[t];
  for (size_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * kBytes;
    prefetch_block<kBytes>(blk);
    __m256i c[8];
    ternary_codes<T>(blk, c);
    uint16_t d16;
    std::memcpy(&d16, blk + kBytes - sizeof d16, sizeof d16);
    const __m256 vd = _mm256_set1_ps(h2f(d16));
    for (int h = 0; h < 2; ++h) {
      __m256i x[4];
      transpose4x4(c + 4 * h, x);
      for (int t = 0; t < NT; ++t) {
        const int8_t* a = prep[t].qs + 256 * s + 128 * h;
        __m256i av[4];
        for (int j = 0; j < 4; ++j) av[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * j));
        const __m256i init = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(prep[t].init + 16 * s + 8 * h));
        const __m256i d = Dot::template dot<4, 3>(init, x, av);
        const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(prep[t].dx + 16 * s + 8 * h));
        facc[t] = _mm256_fmadd_ps(p, vd, facc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) facc_io[t] = facc[t];
}

// dot_rows_k's passes (tokens, column chunks of prepared activations,
// rows) over ternary_sbs.
template <class Dot, Ternary T>
void dot_rows_ternary(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes,
                      int32_t tokens, size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  constexpr size_t kBytes = ternary_block_bytes<T>();
  const KConsts& k = kconsts();
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  if (nsb == 0) return zero_out(rows, tokens, out, ld_out);
  alignas(64) uint8_t buf[kActBufferBytes];
  // TQ1_0 takes the trait's tokens a pass (its unpacking is the larger
  // cost); TQ2_0's cheap codes q6_K's 4 (8 spilled: about 1.3x slower at
  // 8 tokens on Zen 5, CPU time).
  constexpr int kTokens = Dot::max_tokens(T == Ternary::kTq1 ? WeightType::kTQ1_0 : WeightType::kQ6_K);
  static_assert(kTokens >= 1 && kTokens <= kMaxTokens);
  for (int32_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const int nt = tokens - t0 < kTokens ? tokens - t0 : kTokens;
    const size_t chunk = kActBufferBytes / (kQ6PrepBytes * static_cast<size_t>(nt));
    for (size_t c0 = 0; c0 < nsb; c0 += chunk) {
      const size_t cn = min_size(chunk, nsb - c0);
      KPrep prep[kMaxTokens];
      uint8_t* q = buf;
      for (int t = 0; t < nt; ++t) {
        prep[t].qs = reinterpret_cast<int8_t*>(q);
        prep[t].dx = reinterpret_cast<float*>(q + cn * 256);
        prep[t].init = reinterpret_cast<int32_t*>(q + cn * (256 + 64));
        q += cn * kQ6PrepBytes;
        prepare_k<Kind::kQ6K>(ab + static_cast<size_t>(t0 + t) * act_bytes, n, c0, cn, prep[t], k);
        // -32 (sum a) is a multiple of 32: the division is exact.
        for (size_t i = 0; i < 16 * cn; ++i) prep[t].init[i] /= 32;
      }
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        const uint8_t* row = wb + r * row_bytes + c0 * kBytes;
        __m256 facc[kMaxTokens];
        for (int t = 0; t < kMaxTokens; ++t) facc[t] = _mm256_setzero_ps();
        with_token_count<kTokens>(nt, [&]<int NT>() { ternary_sbs<Dot, T, NT>(row, cn, prep, facc); });
        for (int t = 0; t < nt; ++t) {
          float* o = out + static_cast<size_t>(t0 + t) * ld_out + r;
          const float v = hsum_ps(facc[t]);
          *o = c0 == 0 ? v : *o + v;
        }
      }
    }
  }
}

}  // namespace
}  // namespace colibri::kernels
