// AVX-512 dequantisation of block-quantised rows straight to bf16
// (quant_dot.h, dequant_bf16_avx512), for the prefill tier that runs block
// formats on the AMX bf16 tiles (ffn_quant.cpp). Built with
// -mavx512f/bw/vl/dq -mavx512bf16 -mf16c and -ffp-contract=off: every value
// is the reference dequantiser's float (src/util/quant_ref.cpp, the same
// products and differences in the same order, never fused), then rounded to
// the nearest even bf16 as float_to_bf16 does (NaN kept quiet), so the bits
// equal float_to_bf16(reference) exactly; tests/test_quant_dot.cpp checks
// that on random blocks of every format. The 4- and 5-bit formats compute
// the 16 or 32 values a (sub-)block's codes can take once, as bf16, and
// look each code up (vpermw): about four instructions per 32 weights.
//
// Everything lives in an anonymous namespace and no inline function of a
// shared header is called (tests/isa_linkage.sh).
#include <cstddef>
#include <cstdint>

#include "kernels/quant_dot.h"
#include "kernels/x86_intrinsics.h"
#include "util/quant_blocks.h"

namespace colibri::kernels {
namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// 32 floats (lo: elements 0-15, hi: 16-31) to bf16 with vcvtne2ps2bf16:
// round to nearest even, NaNs quiet, as float_to_bf16 (dequantised values
// are never float subnormals, which the instruction would flush).
inline __m512i bf16x32(__m512 lo, __m512 hi) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)); }

inline void store32(uint16_t* dst, __m512i v) { _mm512_storeu_si512(dst, v); }

// A 16- or 32-entry table of bf16 values (code c -> entry c, in word c of
// the vector) and 32 codes (bytes, each below the table's size): the 32
// bf16 values, one vpermw.
inline __m512i lookup32(__m512i table, __m256i codes) {
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table);
}

inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

void dq_q8_0(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockQ8_0*>(src);
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const __m512 d = _mm512_set1_ps(h2f(b->d));
    const __m512 lo =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs + 16))));
    store32(dst, bf16x32(_mm512_mul_ps(lo, d), _mm512_mul_ps(hi, d)));
  }
}

void dq_q4_0(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockQ4_0*>(src);
  const __m128i m4 = _mm_set1_epi8(0x0f);
  // (q - 8) is exact in float; the entry is the reference's d * (q - 8).
  const __m512 centred = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f));
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const __m512 v = _mm512_mul_ps(_mm512_set1_ps(h2f(b->d)), centred);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    store32(dst, lookup32(bf16x32(v, v), codes));
  }
}

// mxfp4: a block's 16 values are 2^(e - 128) times small integers, exact
// in float and in bf16 (three significant bits at most, subnormal or
// infinite included), so each float's upper half is float_to_bf16's
// result without rounding; the reference's products, looked up per code.
void dq_mxfp4(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockMxfp4*>(src);
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m512 values = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)));
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const uint32_t bits = b->e < 2 ? uint32_t{0x00200000} << b->e : static_cast<uint32_t>(b->e - 1) << 23;
    const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(bits))), values);
    const __m512i table =
        _mm512_zextsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    store32(dst, lookup32(table, codes));
  }
}

// ggml's get_scale_min_k4: sub-block j's 6-bit scale and min.
inline void scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// q4_k (kFive false) and q5_k: sub-block j's codes are the low (j even) or
// high (j odd) nibbles of qs[32 * (j / 2) ..], plus for q5_k bit j of qh[l]
// times 16; the value of code c is (d * sc) * c - dmin * m, one table per
// sub-block.
template <bool kFive>
void dq_k45(const void* src, size_t n, uint16_t* dst) {
  constexpr size_t kBytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  const auto* base = static_cast<const uint8_t*>(src);
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m512 c_lo = iota16();
  const __m512 c_hi = _mm512_add_ps(c_lo, _mm512_set1_ps(16.0f));
  for (size_t i = 0; i < n / kQKK; ++i, dst += kQKK) {
    const uint8_t* blk = base + i * kBytes;
    uint16_t d16, dmin16;
    const uint8_t* scales;
    const uint8_t* qs;
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFive) {
      const auto* b = reinterpret_cast<const BlockQ5K*>(blk);
      d16 = b->d, dmin16 = b->dmin, scales = b->scales, qs = b->qs;
      qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh));
    } else {
      const auto* b = reinterpret_cast<const BlockQ4K*>(blk);
      d16 = b->d, dmin16 = b->dmin, scales = b->scales, qs = b->qs;
    }
    const float d = h2f(d16), dmin = h2f(dmin16);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min(scales, j, &sc, &m);
      const __m512 d1 = _mm512_set1_ps(d * static_cast<float>(sc));
      const __m512 m1 = _mm512_set1_ps(dmin * static_cast<float>(m));
      const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(d1, c_lo), m1);
      const __m512 hi = kFive ? _mm512_sub_ps(_mm512_mul_ps(d1, c_hi), m1) : lo;
      __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
      if (j & 1) c = _mm256_srli_epi16(c, 4);
      c = _mm256_and_si256(c, m4);
      if constexpr (kFive) {
        const __mmask32 set = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1u << j)));
        c = _mm256_mask_add_epi8(c, set, c, _mm256_set1_epi8(16));
      }
      store32(dst + 32 * j, lookup32(bf16x32(lo, hi), c));
    }
  }
}

// q6_k: element e = 128 h + 32 k + l: low nibble of ql[64 h + 32 (k & 1) + l]
// (shifted by 4 for k >= 2), high two bits 2k of qh[32 h + l]; value
// (d * scales[e / 16]) * (code - 32).
void dq_q6_k(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockQ6K*>(src);
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m128i m3 = _mm_set1_epi8(0x03);
  const __m512 off = _mm512_set1_ps(32.0f);
  for (size_t i = 0; i < n / kQKK; ++i, ++b, dst += kQKK) {
    const float d = h2f(b->d);
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; ++k) {
        __m512 v[2];
        for (int part = 0; part < 2; ++part) {
          const int l0 = 16 * part;
          __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->ql + 64 * h + 32 * (k & 1) + l0));
          if (k >= 2) lo = _mm_srli_epi16(lo, 4);
          lo = _mm_and_si128(lo, m4);
          __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qh + 32 * h + l0));
          hi = _mm_and_si128(_mm_srli_epi16(hi, 2 * k), m3);
          const __m128i code = _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
          const int sub = (128 * h + 32 * k + l0) / 16;  // the scale's index: 16 elements each
          const __m512 ds = _mm512_set1_ps(d * static_cast<float>(b->scales[sub]));
          v[part] = _mm512_mul_ps(ds, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(code)), off));
        }
        store32(dst + 128 * h + 32 * k, bf16x32(v[0], v[1]));
      }
    }
  }
}

}  // namespace

DequantBf16Fn dequant_bf16_avx512(WeightType t) {
  switch (t) {
    case WeightType::kQ8_0:
      return dq_q8_0;
    case WeightType::kQ4_0:
      return dq_q4_0;
    case WeightType::kQ4_K:
      return dq_k45<false>;
    case WeightType::kQ5_K:
      return dq_k45<true>;
    case WeightType::kQ6_K:
      return dq_q6_k;
    case WeightType::kMXFP4:
      return dq_mxfp4;
    default:
      return nullptr;
  }
}

}  // namespace colibri::kernels
