// AVX-512 dequantisation of block-quantised rows straight to bf16
// (quant_dot.h, dequant_bf16_avx512), for the prefill tier that runs block
// formats on the AMX bf16 tiles (ffn_quant.cpp). Built with
// -mavx512f/bw/vl/dq -mavx512bf16 -mf16c and -ffp-contract=off: every value
// is the reference dequantiser's float (src/util/quant_ref.cpp, the same
// products and differences in the same order, never fused), then rounded to
// the nearest even bf16 as float_to_bf16 does (NaN kept quiet), so the bits
// equal float_to_bf16(reference) exactly; tests/test_quant_dot.cpp checks
// that on random blocks of every format. The 2- to 5-bit formats compute
// the 16 or 32 values a (sub-)block's codes can take once, as bf16, and
// look each code up (vpermw): about four instructions per 32 weights
// (q2_k and q3_k: one table for several sub-blocks). The others convert
// each code to float and multiply.
//
// Everything lives in an anonymous namespace and no inline function of a
// shared header is called (tests/isa_linkage.sh).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/quant_dot.h"
#include "kernels/x86_intrinsics.h"
#include "util/iq_grids.h"
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

// The 16 bytes of a 32-element 4-bit block as its 32 codes: low nibbles
// (elements 0-15), then high nibbles (16-31).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

// q5_0 / q5_1 codes: the nibbles plus 16 where bit j of qh (little-endian)
// is set.
inline __m256i codes_q5(const uint8_t* qs, const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, sizeof h);
  const __m256i c = nibbles32(qs);
  return _mm256_mask_add_epi8(c, static_cast<__mmask32>(h), c, _mm256_set1_epi8(16));
}

// q4_1: the value of code c is d * c + m (the product rounded first).
void dq_q4_1(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockQ4_1*>(src);
  const __m512 c = iota16();
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(h2f(b->d)), c), _mm512_set1_ps(h2f(b->m)));
    store32(dst, lookup32(bf16x32(v, v), nibbles32(b->qs)));
  }
}

// q5_0: code c (0..31) is d * (c - 16), one 32-entry table per block.
void dq_q5_0(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockQ5_0*>(src);
  const __m512 c_hi = iota16();  // codes 16-31, less 16
  const __m512 c_lo = _mm512_sub_ps(c_hi, _mm512_set1_ps(16.0f));
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const __m512 d = _mm512_set1_ps(h2f(b->d));
    store32(dst, lookup32(bf16x32(_mm512_mul_ps(d, c_lo), _mm512_mul_ps(d, c_hi)), codes_q5(b->qs, b->qh)));
  }
}

// q5_1: code c (0..31) is d * c + m.
void dq_q5_1(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockQ5_1*>(src);
  const __m512 c_lo = iota16();
  const __m512 c_hi = _mm512_add_ps(c_lo, _mm512_set1_ps(16.0f));
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const __m512 d = _mm512_set1_ps(h2f(b->d));
    const __m512 m = _mm512_set1_ps(h2f(b->m));
    const __m512 lo = _mm512_add_ps(_mm512_mul_ps(d, c_lo), m);
    const __m512 hi = _mm512_add_ps(_mm512_mul_ps(d, c_hi), m);
    store32(dst, lookup32(bf16x32(lo, hi), codes_q5(b->qs, b->qh)));
  }
}

// quant_blocks.h's kIq4nlValues, copied: that inline variable, read here,
// would be defined in this object with vague linkage (isa_linkage.sh).
constexpr int8_t kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

constexpr bool iq4nl_matches() {
  for (int i = 0; i < 16; ++i) {
    if (kIq4nl[i] != kIq4nlValues[i]) return false;
  }
  return true;
}
static_assert(iq4nl_matches(), "kIq4nl must equal kIq4nlValues");

inline __m512 iq4nl_levels() {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nl))));
}

// iq4_nl: code c is d * kIq4nlValues[c].
void dq_iq4_nl(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq4Nl*>(src);
  const __m512 levels = iq4nl_levels();
  for (size_t i = 0; i < n / kQK32; ++i, ++b, dst += kQK32) {
    const __m512 v = _mm512_mul_ps(_mm512_set1_ps(h2f(b->d)), levels);
    store32(dst, lookup32(bf16x32(v, v), nibbles32(b->qs)));
  }
}

// iq4_xs: sub-block j is an iq4_nl block of scale d * (ls_j - 32) (that
// product rounded first), codes qs[16 j ..].
void dq_iq4_xs(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq4Xs*>(src);
  const __m512 levels = iq4nl_levels();
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = h2f(b->d);
    for (int j = 0; j < kQKK / 32; ++j, dst += 32) {
      const int ls = ((b->scales_l[j / 2] >> (4 * (j % 2))) & 0xf) | (((b->scales_h >> (2 * j)) & 3) << 4);
      const __m512 v = _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(ls - 32)), levels);
      store32(dst, lookup32(bf16x32(v, v), nibbles32(b->qs + 16 * j)));
    }
  }
}

// q2_k: sub-block s's code c (0..3) is (d * sc_s) * c - dmin * m_s. One
// 32-entry table per half h holds its 8 sub-blocks' 4 values each (entry
// 4 (s % 8) + c); the 32 elements from bits 2k of qs[32 h ..] are
// sub-blocks 8 h + 2 k (first 16) and 8 h + 2 k + 1.
void dq_q2_k(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockQ2K*>(src);
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m256i m2 = _mm256_set1_epi8(0x03);
  const __m512 c = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // lane / 4
  const __m256i second = _mm256_set_m128i(_mm_set1_epi8(4), _mm_setzero_si128());  // elements 16-31: s + 1
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
    const __m512 dl =
        _mm512_mul_ps(_mm512_set1_ps(h2f(b->d)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(sc, m4))));
    const __m512 ml = _mm512_mul_ps(_mm512_set1_ps(h2f(b->dmin)),
                                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(sc, 4), m4))));
    for (int h = 0; h < 2; ++h, dst += 128) {
      __m512 v[2];
      for (int part = 0; part < 2; ++part) {
        const __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32(8 * h + 4 * part));
        v[part] = _mm512_sub_ps(_mm512_mul_ps(_mm512_permutexvar_ps(idx, dl), c), _mm512_permutexvar_ps(idx, ml));
      }
      const __m512i table = bf16x32(v[0], v[1]);
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * h));
      for (int k = 0; k < 4; ++k) {
        const __m256i code = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m2);
        const __m256i base = _mm256_add_epi8(second, _mm256_set1_epi8(static_cast<char>(8 * k)));  // 4 (s % 8)
        const __m256i entry = _mm256_add_epi8(code, base);
        store32(dst + 32 * k, lookup32(table, entry));
      }
    }
  }
}

// q3_k: sub-block s's code c = q + 4 * hbit (0..7) is (d * sc_s) * (c - 4),
// sc_s its signed 6-bit scale less 32. Sub-blocks 2 p and 2 p + 1 (p = 4 h
// + k) take bits 2k of qs[32 h ..] and bit 4 h + k of hmask[0 .. 31]: one
// 16-entry table for the pair (entry 8 (s % 2) + c).
void dq_q3_k(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockQ3K*>(src);
  const __m512 c = _mm512_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3);
  const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);  // lane / 8
  const __m256i m2 = _mm256_set1_epi8(0x03);
  const __m256i second = _mm256_set_m128i(_mm_set1_epi8(8), _mm_setzero_si128());
  const __m256i four = _mm256_set1_epi8(4);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    alignas(16) int8_t sc[16];
    for (int s = 0; s < 16; ++s) {
      const int low = s < 8 ? b->scales[s] & 0xf : b->scales[s - 8] >> 4;
      const int high = (b->scales[8 + s % 4] >> (2 * (s / 4))) & 3;
      sc[s] = static_cast<int8_t>((low | (high << 4)) - 32);
    }
    const __m512 dl = _mm512_mul_ps(
        _mm512_set1_ps(h2f(b->d)),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sc)))));
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->hmask));
    for (int h = 0; h < 2; ++h) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * h));
      for (int k = 0; k < 4; ++k, dst += 32) {
        const int p = 4 * h + k;
        const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(half, _mm512_set1_epi32(2 * p)), dl), c);
        __m256i code = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m2), second);
        const __mmask32 set = _mm256_test_epi8_mask(hm, _mm256_set1_epi8(static_cast<char>(1u << (4 * h + k))));
        code = _mm256_mask_add_epi8(code, set, code, four);
        store32(dst, lookup32(bf16x32(v, v), code));
      }
    }
  }
}

// 32 grid magnitudes (bytes; at most 8 levels, level k = byte >> kShift
// for the format's ordered levels) times db (db_hi for the last 16), value
// j negated where bit j of `signs` is set, as bf16: the (at most 16)
// products db * level are computed and rounded once, as the reference's
// db * v, and each value looked up (vpermw) and its sign bit flipped (the
// reference's -v, NaN included).
template <int kShift>
inline __m512i signed_grid32(__m512 db, __m256i mags, uint32_t signs, __m512 db_hi, __m512 levels) {
  const __m512 products = _mm512_mul_ps(_mm512_insertf32x8(db, _mm512_castps512_ps256(db_hi), 1), levels);
  const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(products, products));
  const __m256i level = _mm256_and_si256(_mm256_srli_epi16(mags, kShift), _mm256_set1_epi8(7));
  // The last 16 values look up lanes 8-15 (db_hi's products).
  const __m512i index = _mm512_add_epi16(_mm512_cvtepu8_epi16(level),
                                         _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(8), 1));
  const __m512i v = _mm512_permutexvar_epi16(index, table);
  return _mm512_mask_blend_epi16(signs, v, _mm512_xor_si512(v, _mm512_set1_epi16(static_cast<short>(0x8000))));
}

// The levels of the grid formats' magnitudes, twice (lanes 0-7, 8-15).
inline __m512 levels2(float a, float b, float c, float d, float e, float f, float g, float h) {
  return _mm512_setr_ps(a, b, c, d, e, f, g, h, a, b, c, d, e, f, g, h);
}
inline __m512 iq2_levels() { return levels2(8, 25, 43, 0, 0, 0, 0, 0); }         // byte >> 4: 0, 1, 2
inline __m512 iq3xxs_levels() { return levels2(4, 12, 20, 28, 36, 44, 52, 62); }  // byte >> 3
inline __m512 iq3s_levels() { return levels2(1, 3, 5, 7, 9, 11, 13, 15); }        // byte >> 1

// iq2_xxs: sub-block ib's scale db = d * (0.5 + ls) * 0.25 (left to right);
// element j of group g is db * grid byte j, negated where sign bit j is
// set (the sign bit flipped, as the reference's -v).
void dq_iq2_xxs(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq2Xxs*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = h2f(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib, dst += 32) {
      uint32_t words[2];
      std::memcpy(words, b->qs + 4 * ib, sizeof words);
      const float ls = 0.5f + static_cast<float>(words[1] >> 28);
      const __m512 db = _mm512_set1_ps(d * ls * 0.25f);
      long long grid[4];  // each group's 8 magnitudes, a byte each
      uint32_t signs = 0;
      for (int g = 0; g < 4; ++g) {
        grid[g] = static_cast<long long>(kIqTables.iq2xxs_grid[(words[0] >> (8 * g)) & 0xff]);
        signs |= uint32_t{kIqTables.iq2_signs[(words[1] >> (7 * g)) & 127]} << (8 * g);
      }
      const __m256i mags = _mm256_setr_epi64x(grid[0], grid[1], grid[2], grid[3]);
      store32(dst, signed_grid32<4>(db, mags, signs, db, iq2_levels()));
    }
  }
}

// iq3_xxs: as iq2_xxs with 4-value grid points, db = d * (0.5 + ls) * 0.5.
void dq_iq3_xxs(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq3Xxs*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = h2f(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib, dst += 32) {
      uint32_t aux;
      std::memcpy(&aux, b->qs + kQKK / 4 + 4 * ib, sizeof aux);
      const __m512 db = _mm512_set1_ps(d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f);
      int grid[8];  // each point's 4 magnitudes, a byte each
      for (int k = 0; k < 8; ++k) grid[k] = static_cast<int>(kIqTables.iq3xxs_grid[b->qs[8 * ib + k]]);
      uint32_t signs = 0;
      for (int g = 0; g < 4; ++g) signs |= uint32_t{kIqTables.iq2_signs[(aux >> (7 * g)) & 127]} << (8 * g);
      const __m256i mags = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grid));
      store32(dst, signed_grid32<3>(db, mags, signs, db, iq3xxs_levels()));
    }
  }
}

// iq2_xs / iq2_s: scales d * (0.5 + ls) * 0.25 per 16 values (the two
// nibbles of scales[ib]).
inline void iq2_half_scales(float d, uint8_t scales, __m512* lo, __m512* hi) {
  *lo = _mm512_set1_ps(d * (0.5f + static_cast<float>(scales & 0xf)) * 0.25f);
  *hi = _mm512_set1_ps(d * (0.5f + static_cast<float>(scales >> 4)) * 0.25f);
}

void dq_iq2_xs(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq2Xs*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = h2f(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib, dst += 32) {
      __m512 lo, hi;
      iq2_half_scales(d, b->scales[ib], &lo, &hi);
      long long grid[4];
      uint32_t signs = 0;
      for (int l = 0; l < 4; ++l) {
        const uint16_t q = b->qs[4 * ib + l];
        grid[l] = static_cast<long long>(kIqTables.iq2xs_grid[q & 511]);
        signs |= uint32_t{kIqTables.iq2_signs[q >> 9]} << (8 * l);
      }
      store32(dst, signed_grid32<4>(lo, _mm256_setr_epi64x(grid[0], grid[1], grid[2], grid[3]), signs, hi, iq2_levels()));
    }
  }
}

void dq_iq2_s(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq2S*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = h2f(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib, dst += 32) {
      __m512 lo, hi;
      iq2_half_scales(d, b->scales[ib], &lo, &hi);
      long long grid[4];
      for (int l = 0; l < 4; ++l) {
        const uint32_t index = b->qs[4 * ib + l] | (((b->qh[ib] >> (2 * l)) & 3) << 8);
        grid[l] = static_cast<long long>(kIqTables.iq2s_grid[index]);
      }
      uint32_t signs;
      std::memcpy(&signs, b->signs + 4 * ib, sizeof signs);
      store32(dst, signed_grid32<4>(lo, _mm256_setr_epi64x(grid[0], grid[1], grid[2], grid[3]), signs, hi, iq2_levels()));
    }
  }
}

void dq_iq3_s(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq3S*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = h2f(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib, dst += 32) {
      const int s = (b->scales[ib / 2] >> (4 * (ib % 2))) & 0xf;
      const __m512 db = _mm512_set1_ps(d * static_cast<float>(1 + 2 * s));
      int grid[8];
      for (int m = 0; m < 8; ++m) {
        grid[m] = static_cast<int>(kIqTables.iq3s_grid[b->qs[8 * ib + m] | (((b->qh[ib] >> m) & 1) << 8)]);
      }
      uint32_t signs;
      std::memcpy(&signs, b->signs + 4 * ib, sizeof signs);
      store32(dst, signed_grid32<1>(db, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grid)), signs, db,
                                      iq3s_levels()));
    }
  }
}

// iq1: 16 values dl * (g + delta) of two grid points (g in {-1, 0, 1} as
// int8 bytes), the reference's sum then product; delta is -1/8 for the
// values whose bit of `negative` (one per value) is set, +1/8 elsewhere: a
// blend, not a branch (the shift signs are random bits, one per 8 values
// in iq1_m).
inline __m512 iq1_values16(uint32_t idx0, uint32_t idx1, __mmask16 negative, float dl) {
  const __m128i g = _mm_set_epi64x(static_cast<long long>(kIqTables.iq1s_grid[idx1]),
                                   static_cast<long long>(kIqTables.iq1s_grid[idx0]));
  const __m512 delta = _mm512_mask_blend_ps(negative, _mm512_set1_ps(kIq1Delta), _mm512_set1_ps(-kIq1Delta));
  return _mm512_mul_ps(_mm512_set1_ps(dl), _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(g)), delta));
}

// All 16 lanes where `bit` is set, none where it is clear.
inline __mmask16 lanes_if(uint32_t bit) { return static_cast<__mmask16>(0u - static_cast<uint32_t>(bit != 0)); }

void dq_iq1_s(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq1S*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    const float d = h2f(b->d);
    for (int ib = 0; ib < kQKK / 32; ++ib, dst += 32) {
      const uint32_t qh = b->qh[ib];
      const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
      const __mmask16 negative = lanes_if(qh & 0x8000);
      uint32_t idx[4];
      for (int l = 0; l < 4; ++l) idx[l] = b->qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8);
      store32(dst, bf16x32(iq1_values16(idx[0], idx[1], negative, dl), iq1_values16(idx[2], idx[3], negative, dl)));
    }
  }
}

// iq1_m: per 16 values one dl, per 8 one delta; d from the scale words'
// top nibbles.
void dq_iq1_m(const void* src, size_t n, uint16_t* dst) {
  const auto* b = static_cast<const BlockIq1M*>(src);
  for (size_t i = 0; i < n / kQKK; ++i, ++b) {
    uint16_t sc[4];
    std::memcpy(sc, b->scales, sizeof sc);
    const auto d16 = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                           (sc[3] & 0xf000));
    const float d = h2f(d16);
    for (int ib = 0; ib < kQKK / 32; ++ib, dst += 32) {
      __m512 half[2];
      for (int h = 0; h < 2; ++h) {
        const uint32_t s = (sc[ib / 2] >> (6 * (ib % 2) + 3 * h)) & 7;
        const float dl = d * static_cast<float>(2 * s + 1);
        const uint32_t qh = b->qh[2 * ib + h];
        const uint32_t idx0 = b->qs[4 * ib + 2 * h] | ((qh & 7) << 8);
        const uint32_t idx1 = b->qs[4 * ib + 2 * h + 1] | (((qh >> 4) & 7) << 8);
        // Bit 3 is the first point's shift sign, bit 7 the second's.
        const auto negative = static_cast<__mmask16>((lanes_if(qh & 0x08) & 0x00ff) | (lanes_if(qh & 0x80) & 0xff00));
        half[h] = iq1_values16(idx0, idx1, negative, dl);
      }
      store32(dst, bf16x32(half[0], half[1]));
    }
  }
}

// fp8_e4m3: each code widened exactly (qdot_fp8_impl.h's f16 form times
// 2^8, the NaN codes replaced by the reference's quiet NaN with the code's
// sign), then the reference's product d * e4m3, rounded to bf16 in integer
// arithmetic: d is any float, so the products can be float subnormals,
// which vcvtne2ps2bf16 would flush.
inline __m512i fp8_bf16x16(__m512 d, __m256i h) {
  __m512 e = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  const __m512i bits = _mm512_castps_si512(e);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan_code = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x43f00000));  // 480
  e = _mm512_mask_mov_ps(e, nan_code,
                         _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(mag, bits), _mm512_set1_epi32(0x7fc00000))));
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(d, e));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 is_nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, is_nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040)));
  return r;
}

void dq_fp8_e4m3(const void* src, size_t n, uint16_t* dst) {
  const auto* blocks = static_cast<const uint8_t*>(src);
  for (size_t i = 0; i < n / kQKFp8; ++i, dst += kQKFp8) {
    const uint8_t* blk = blocks + i * sizeof(BlockFp8E4M3);
    float ds;
    std::memcpy(&ds, blk, sizeof ds);
    const __m512 d = _mm512_set1_ps(ds);
    for (int j = 0; j < kQKFp8; j += 32) {
      const __m512i s = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + offsetof(BlockFp8E4M3, qs) + j)));
      const __m512i h = _mm512_and_si512(_mm512_slli_epi16(s, 7), _mm512_set1_epi16(static_cast<int16_t>(0xbfff)));
      const __m512i lo = fp8_bf16x16(d, _mm512_castsi512_si256(h));
      const __m512i hi = fp8_bf16x16(d, _mm512_extracti64x4_epi64(h, 1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm512_cvtepi32_epi16(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j + 16), _mm512_cvtepi32_epi16(hi));
    }
  }
}

// tq1_0 / tq2_0: code c's value is the reference's (c - 1) * d, a 4-entry
// table. TQ1_0's trits as the reference takes them: the bytes widened to
// words, times 3^k (the low byte is the byte product mod 256), times 3,
// the high byte.
inline __m512 ternary_values(uint16_t d) { return _mm512_mul_ps(_mm512_sub_ps(iota16(), _mm512_set1_ps(1.0f)), _mm512_set1_ps(h2f(d))); }

inline __m512i tq1_trits(__m512i words, __m512i pow3) {
  const __m512i shifted = _mm512_and_si512(_mm512_mullo_epi16(words, pow3), _mm512_set1_epi16(0xff));
  return _mm512_srli_epi16(_mm512_mullo_epi16(shifted, _mm512_set1_epi16(3)), 8);
}

void dq_tq1_0(const void* src, size_t n, uint16_t* dst) {
  const auto* blk = static_cast<const uint8_t*>(src);
  // qs[32, 48) twice (word indices 0-15), then qh (16-19) four times.
  const __m512i pair = _mm512_setr_epi32(0x00010000, 0x00030002, 0x00050004, 0x00070006, 0x00090008, 0x000b000a,
                                         0x000d000c, 0x000f000e, 0x00010000, 0x00030002, 0x00050004, 0x00070006,
                                         0x00090008, 0x000b000a, 0x000d000c, 0x000f000e);
  const __m512i tail = _mm512_setr_epi32(0x00010000, 0x00030002, 0x00050004, 0x00070006, 0x00090008, 0x000b000a,
                                         0x000d000c, 0x000f000e, 0x00110010, 0x00130012, 0x00110010, 0x00130012,
                                         0x00110010, 0x00130012, 0x00110010, 0x00130012);
  const __m512i halves = _mm512_inserti64x4(_mm512_set1_epi16(1), _mm256_set1_epi16(3), 1);
  const __m512i tail_pow = _mm512_setr_epi32(0x00510051, 0x00510051, 0x00510051, 0x00510051, 0x00510051, 0x00510051,
                                             0x00510051, 0x00510051, 0x00010001, 0x00010001, 0x00030003, 0x00030003,
                                             0x00090009, 0x00090009, 0x001b001b, 0x001b001b);
  for (size_t i = 0; i < n / kQKK; ++i, blk += sizeof(BlockTq1_0), dst += kQKK) {
    uint16_t d;
    std::memcpy(&d, blk + offsetof(BlockTq1_0, d), sizeof d);
    const __m512 v = ternary_values(d);
    const __m512i table = bf16x32(v, v);
    const __m512i head = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    int pow3 = 1;
    for (int k = 0; k < 5; ++k, pow3 *= 3) {
      store32(dst + 32 * k, _mm512_permutexvar_epi16(tq1_trits(head, _mm512_set1_epi16(static_cast<int16_t>(pow3))), table));
    }
    // Bytes 32-51 (qs[32, 48), qh): a masked load stays inside the block.
    const __m512i rest = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(0xfffffu, blk + 32));
    const __m512i p = _mm512_permutexvar_epi16(pair, rest);
    store32(dst + 160, _mm512_permutexvar_epi16(tq1_trits(p, halves), table));
    store32(dst + 192, _mm512_permutexvar_epi16(tq1_trits(p, _mm512_mullo_epi16(halves, _mm512_set1_epi16(9))), table));
    store32(dst + 224, _mm512_permutexvar_epi16(tq1_trits(_mm512_permutexvar_epi16(tail, rest), tail_pow), table));
  }
}

void dq_tq2_0(const void* src, size_t n, uint16_t* dst) {
  const auto* blk = static_cast<const uint8_t*>(src);
  const __m256i m2 = _mm256_set1_epi8(0x03);
  for (size_t i = 0; i < n / kQKK; ++i, blk += sizeof(BlockTq2_0)) {
    uint16_t d;
    std::memcpy(&d, blk + offsetof(BlockTq2_0, d), sizeof d);
    const __m512 v = ternary_values(d);
    const __m512i table = bf16x32(v, v);
    for (int h = 0; h < 2; ++h) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * h));
      for (int k = 0; k < 4; ++k, dst += 32) {
        store32(dst, lookup32(table, _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m2)));
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
    case WeightType::kQ4_1:
      return dq_q4_1;
    case WeightType::kQ5_0:
      return dq_q5_0;
    case WeightType::kQ5_1:
      return dq_q5_1;
    case WeightType::kIQ4_NL:
      return dq_iq4_nl;
    case WeightType::kIQ4_XS:
      return dq_iq4_xs;
    case WeightType::kQ2_K:
      return dq_q2_k;
    case WeightType::kQ3_K:
      return dq_q3_k;
    case WeightType::kIQ2_XXS:
      return dq_iq2_xxs;
    case WeightType::kIQ3_XXS:
      return dq_iq3_xxs;
    case WeightType::kIQ1_S:
      return dq_iq1_s;
    case WeightType::kIQ1_M:
      return dq_iq1_m;
    case WeightType::kIQ2_XS:
      return dq_iq2_xs;
    case WeightType::kIQ2_S:
      return dq_iq2_s;
    case WeightType::kIQ3_S:
      return dq_iq3_s;
    case WeightType::kFP8_E4M3:
      return dq_fp8_e4m3;
    case WeightType::kTQ1_0:
      return dq_tq1_0;
    case WeightType::kTQ2_0:
      return dq_tq2_0;
    default:
      return nullptr;
  }
}

}  // namespace colibri::kernels
