// The AVX2-level integer dot-product kernels (quant_dot.h), written once for
// the two translation units that compile them with their own flags:
// qdot_avx2.cpp (AVX2, FMA, F16C) and qdot_avxvnni.cpp (the same plus
// AVX-VNNI). qdot_scalar.cpp is the reference. Every product of weight
// codes and activations goes through the including file's Int8Dot trait (a
// class template argument), so the two differ only in how 32 bytes of
// unsigned codes times signed activations reach int32:
//
//   struct Int8Dot {
//     // Whether the u8 x s8 pair sums pass through saturating int16
//     // (vpmaddubsw); false when they go straight into int32 (vpdpbusd).
//     static constexpr bool kSaturatesInt16;
//     // acc + in each dword lane the sum over k < K of the four byte
//     // products u[k] x s[k] of that lane (u unsigned, at most kMaxCode;
//     // s signed in [-127, 127]).
//     template <int K, int kMaxCode>
//     static __m256i dot(__m256i acc, const __m256i* u, const __m256i* s);
//     // Tokens per pass over format t's weights (1 .. kMaxTokens): each
//     // code vector, once unpacked, meets that many tokens' activations.
//     static constexpr int max_tokens(WeightType t);
//   };
//
// K formats: each group of four 32-byte code vectors is transposed per
// 128-bit lane, so that every dword lane holds codes of one sub-block (two
// lanes per q4_k / q5_k sub-block, one per q6_k sub-block); the four
// vectors' products sum in int32 per lane, then per token and group one
// conversion, one multiply by the lanes' activation scales (one per 32
// elements) and one FMA with the lanes' d * sc. The offsets through the
// activations' sums: q6_k's -32 as the dot's starting value, q4_k / q5_k's
// mins one FMA of dmin * m_j with dx_j * (sum a)_j per super-block.
// q8_0 / q4_0 / mxfp4: 8 blocks at a time transposed so that dword j holds codes of
// block j (the activations once per call into a stack buffer), the block
// scales applied lane-wise; the offsets (q4_0's 8, q8_0's 128 where it is
// biased, mxfp4's 12: a byte table turns its nibbles into its values plus
// 12) times the blocks' activation sums are the dot's starting value.
// q8_0's signed codes: where the pair sums saturate in int16 the sign trick
// (|w| x sign(w) * a, _mm256_sign_epi8), since the 128 bias would overflow
// them (2 * 255 * 127 > 2^15); without that stage the codes are biased by
// 128 (xor 0x80), one operation per weight vector instead of one per
// weight vector and token.
//
// Each row is read once per pass of Dot::max_tokens tokens (its unpacked
// codes meet them all) and prefetched 4 KiB ahead into L2, 1 KiB into L1.
//
// Everything lives in an anonymous namespace and no inline function of a
// shared header is called: the objects including this must not emit
// symbols with vague linkage (tests/isa_linkage.sh).
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "qdot_avx2_impl.h needs -mavx2 -mfma -mf16c"
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/quant_dot.h"
#include "kernels/x86_intrinsics.h"
#include "util/iq_grids.h"
#include "util/quant_blocks.h"

namespace colibri::kernels {
namespace {

// Bytes ahead of the current block that each row prefetches into L2 and
// into L1 (measured: a single-core stream from DRAM needs both). 8 KiB
// into L2 rather than 4: on Zen 5, 2 threads, new experts every call, the
// zmm planes kernel's q3_K decode ran 1.2-1.3x and q2_K's 1.1-1.15x faster
// on DeepSeek-V3's and olmoe's experts (16 KiB no better); the AVX2 level
// and the grid i-quants even (colibri bench --tokens 1 --top-k 8).
constexpr size_t kPrefetchFar = 8192;
constexpr size_t kPrefetchNear = 1024;
// The most tokens a pass over the weights takes (Dot::max_tokens is one
// implementation's, at most this).
constexpr int kMaxTokens = 8;

// f.template operator()<NT>() for NT == nt (1 <= nt <= kMax): one
// instantiation of the per-row kernels per token count.
template <int kMax, int NT = 1, class F>
inline void with_token_count(int nt, const F& f) {
  if constexpr (NT < kMax) {
    if (nt != NT) return with_token_count<kMax, NT + 1>(nt, f);
  }
  f.template operator()<NT>();
}

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

template <size_t kBytes>
inline void prefetch_block(const uint8_t* p) {
  for (size_t o = 0; o < kBytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchFar + o), COLIBRI_FAR_PREFETCH_HINT);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchNear + o), _MM_HINT_T0);
  }
}

inline size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// The results for n == 0 (no blocks): zeros.
inline void zero_out(int32_t rows, int32_t tokens, float* out, size_t ld_out) {
  for (int32_t t = 0; t < tokens; ++t) {
    for (int32_t r = 0; r < rows; ++r) out[static_cast<size_t>(t) * ld_out + static_cast<size_t>(r)] = 0.0f;
  }
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0x4e));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0xb1));
  return _mm_cvtss_f32(m);
}

// ---------------------------------------------------------------- activations

// The activation row of n elements (quant_dot.h): qs[n] at 0, d[n / 32]
// (float) at n, sums[n / 16] (int16) at n + n / 8.
inline const uint8_t* act_d(const uint8_t* act, size_t n) { return act + n; }
inline const uint8_t* act_sums(const uint8_t* act, size_t n) { return act + n + n / 8; }

// The rule of qdot_scalar.cpp with the same float operations (exact
// division, round to nearest even), so the bits agree: per block of 32.
// max(|v|, amax) ignores NaNs as the scalar comparison does.
void quantize_act(const float* x, size_t n_valid, size_t n, void* out) {
  const size_t nb = n / kActBlock;
  auto* o = static_cast<uint8_t*>(out);
  const __m256 lo = _mm256_set1_ps(-127.0f);
  const __m256 hi = _mm256_set1_ps(127.0f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (size_t b = 0; b < nb; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const size_t s = b * kActBlock + 8 * static_cast<size_t>(i);
      if (s + 8 <= n_valid) {
        v[i] = _mm256_loadu_ps(x + s);
      } else if (s < n_valid) {
        alignas(32) float tmp[8] = {};
        std::memcpy(tmp, x + s, (n_valid - s) * sizeof(float));
        v[i] = _mm256_load_ps(tmp);
      } else {
        v[i] = _mm256_setzero_ps();
      }
      amax = _mm256_max_ps(_mm256_and_ps(v[i], absmask), amax);
    }
    const float d = hmax_ps(amax) / 127.0f;
    std::memcpy(o + n + b * sizeof(float), &d, sizeof d);
    int8_t* qs = reinterpret_cast<int8_t*>(o + b * kActBlock);
    int16_t sums[2] = {0, 0};
    if (d == 0.0f) {
      std::memset(qs, 0, kActBlock);
    } else {
      const __m256 vd = _mm256_set1_ps(d);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) {
        __m256 f = _mm256_round_ps(_mm256_div_ps(v[j], vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        f = _mm256_min_ps(_mm256_max_ps(f, lo), hi);
        q[j] = _mm256_cvtps_epi32(f);
      }
      sums[0] = static_cast<int16_t>(hsum_epi32(_mm256_add_epi32(q[0], q[1])));
      sums[1] = static_cast<int16_t>(hsum_epi32(_mm256_add_epi32(q[2], q[3])));
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs), _mm256_permutevar8x32_epi32(p, perm));
    }
    std::memcpy(o + n + n / 8 + 2 * b * sizeof(int16_t), sums, sizeof sums);
  }
}

// ---------------------------------------------------------------- K formats

// Four vectors whose 128-bit lanes each hold four dwords of one sub-block,
// transposed per lane: out[k] dword 4l + v = in[v] dword 4l + k. Dword lane
// 4l + v of every out[k] then holds data of the sub-block in in[v]'s lane
// l, so the products of out[0..3] sum each lane's sub-block apart from the
// others, and one vector of per-lane float factors applies the scales.
inline void transpose4x4(const __m256i* in, __m256i* out) {
  const __m256i t0 = _mm256_unpacklo_epi32(in[0], in[1]);
  const __m256i t1 = _mm256_unpackhi_epi32(in[0], in[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(in[2], in[3]);
  const __m256i t3 = _mm256_unpackhi_epi32(in[2], in[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The 8 six-bit scales (bytes 0-7) and mins (bytes 8-15) of a q4_K / q5_K
// super-block (ggml's get_scale_min_k4 for all j at once). `s` points at
// the 12 scale bytes; 4 more bytes of the block are read and ignored.
inline __m128i unpack_scales_k4(const uint8_t* s) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i a = _mm_shuffle_epi8(raw, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i low = _mm_and_si128(_mm_blend_epi32(a, _mm_srli_epi16(a, 4), 0x8),
                                    _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m128i b = _mm_shuffle_epi8(raw, _mm_setr_epi8(-128, -128, -128, -128, 0, 1, 2, 3, -128, -128, -128, -128, 4,
                                                        5, 6, 7));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30));
  return _mm_or_si128(low, high);
}

struct KConsts {
  // q4_K / q5_K: lane 4l + c holds sub-block 2c (low nibbles) or 2c + 1 (high).
  __m128i sc_lanes;      // pshufb of [sc0-7, m0-7]: bytes 0-7 the low lanes' scales, 8-15 the high lanes'
  __m256i dx_lo, dx_hi;  // vpermps of the 8 activation scales, likewise
  // q6_K: in half h, lane 4l + v holds sub-block 8h + 2v + l.
  __m128i q6_sc;         // pshufb: byte 8h + 4l + v <- scale 8h + 2v + l
  __m256i q6_lanes;      // vpermd: lane 4l + v <- sum 2v + l of the half
  __m256i q6_dx[2];      // vpermps: lane 4l + v <- activation block 4h + v
};

const KConsts& kconsts() {
  static const KConsts consts = [] {
    KConsts k;
    k.sc_lanes = _mm_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7);
    k.dx_lo = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    k.dx_hi = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
    k.q6_sc = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    k.q6_lanes = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    k.q6_dx[0] = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3);
    k.q6_dx[1] = _mm256_setr_epi32(4, 5, 6, 7, 4, 5, 6, 7);
    return k;
  }();
  return consts;
}

// The fifth bit of q5_K sub-block J (bit J of qh[l]) moved to bit 4.
template <int J>
inline __m256i q5_high(__m256i qh) {
  const __m256i m10 = _mm256_set1_epi8(0x10);
  if constexpr (J < 4) {
    return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - J), m10);
  } else if constexpr (J == 4) {
    return _mm256_and_si256(qh, m10);
  } else {
    return _mm256_and_si256(_mm256_srli_epi16(qh, J - 4), m10);
  }
}

// One token's activations for a chunk of super-blocks in the kernels'
// order (once per call, shared by all rows), per super-block:
//   qs:   its 256 quants as two groups of four transposed vectors (q4_K /
//         q5_K: sub-blocks 0, 2, 4, 6 then 1, 3, 5, 7; q6_K: the halves);
//   dx:   16 floats, lane 4l + v of each group: the scale of the
//         activation block that lane's products belong to;
//   q4_K / q5_K: s = 8 floats, dx_j * (sum of sub-block j's quants), for the mins;
//   q6_K: init = 16 int32, -32 * (sum of the quants of each lane's
//         sub-block), the codes' offset.
struct KPrep {
  int8_t* qs;
  float* dx;
  float* s;
  int32_t* init;
};

constexpr size_t kK45PrepBytes = 256 + 64 + 32;
constexpr size_t kQ6PrepBytes = 256 + 64 + 64;
constexpr size_t kActBufferBytes = 64 * 1024;

// The K formats: 32-element sub-blocks with a min (q4_K, q5_K), and
// 16-element ones: q6_K and q3_K with an offset (32, 4), q2_K with a min.
enum class Kind { kQ4K, kQ5K, kQ6K, kQ3K, kQ2K };

constexpr WeightType weight_type(Kind k) {
  switch (k) {
    case Kind::kQ4K:
      return WeightType::kQ4_K;
    case Kind::kQ5K:
      return WeightType::kQ5_K;
    case Kind::kQ6K:
      return WeightType::kQ6_K;
    case Kind::kQ3K:
      return WeightType::kQ3_K;
    case Kind::kQ2K:
      return WeightType::kQ2_K;
  }
  return WeightType::kQ6_K;
}

// q6_K's sub-block layout: 16 elements, four code vectors a half.
constexpr bool sixteen(Kind k) { return k == Kind::kQ6K || k == Kind::kQ3K || k == Kind::kQ2K; }

// Per token and super-block: q2_K keeps 16 floats, da * (sum a) per
// sub-block in `s` for its mins; q6_K / q3_K 16 int32 in `init` for their
// offsets; q4_K / q5_K 8 floats in `s`.
constexpr size_t prep_bytes(Kind k) { return sixteen(k) ? kQ6PrepBytes : kK45PrepBytes; }

template <Kind K>
void prepare_k(const uint8_t* act, size_t n, size_t sb0, size_t cn, const KPrep& p, const KConsts& k) {
  constexpr bool kQ6 = sixteen(K);
  const uint8_t* dsrc = act_d(act, n);
  const uint8_t* ssrc = act_sums(act, n);
  for (size_t i = 0; i < cn; ++i) {
    const size_t b = sb0 + i;
    const uint8_t* q = act + 256 * b;
    int8_t* qs = p.qs + 256 * i;
    for (int g = 0; g < 2; ++g) {
      __m256i v[4], t[4];
      for (int j = 0; j < 4; ++j) {
        const uint8_t* src = kQ6 ? q + 128 * g + 32 * j : q + 32 * (2 * j + g);
        v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      }
      transpose4x4(v, t);
      for (int j = 0; j < 4; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + 128 * g + 32 * j), t[j]);
    }
    const __m256 dx8 = _mm256_loadu_ps(reinterpret_cast<const float*>(dsrc + 32 * b));
    const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ssrc + 32 * b));
    float* dx = p.dx + 16 * i;
    if constexpr (kQ6) {
      for (int g = 0; g < 2; ++g) {
        _mm256_storeu_ps(dx + 8 * g, _mm256_permutevar8x32_ps(dx8, k.q6_dx[g]));
        const __m256i s_nat =
            _mm256_cvtepi16_epi32(g == 0 ? _mm256_castsi256_si128(s16) : _mm256_extracti128_si256(s16, 1));
        if constexpr (K == Kind::kQ2K) {
          // Natural order: sub-block 8g + v, activation block 4g + v / 2.
          const __m256 da = _mm256_permutevar8x32_ps(dx8, g == 0 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                                                 : _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
          _mm256_storeu_ps(p.s + 16 * i + 8 * g, _mm256_mul_ps(da, _mm256_cvtepi32_ps(s_nat)));
        } else {
          const __m256i s = _mm256_permutevar8x32_epi32(s_nat, k.q6_lanes);
          const __m256i off = K == Kind::kQ6K ? _mm256_slli_epi32(s, 5) : _mm256_slli_epi32(s, 2);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.init + 16 * i + 8 * g),
                              _mm256_sub_epi32(_mm256_setzero_si256(), off));
        }
      }
    } else {
      _mm256_storeu_ps(dx, _mm256_permutevar8x32_ps(dx8, k.dx_lo));
      _mm256_storeu_ps(dx + 8, _mm256_permutevar8x32_ps(dx8, k.dx_hi));
      const __m256 asum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
      _mm256_storeu_ps(p.s + 8 * i, _mm256_mul_ps(asum, dx8));
    }
  }
}

// Four transposed code vectors (x, codes up to kMaxCode) against group g
// (0, 1) of NT tokens' prepared quants of super-block s: the lanes' exact
// integer products converted, times the lanes' activation scales and `wf`
// (the lanes' weight scales) into facc.
template <class Dot, int kMaxCode, int NT>
inline void k45_group(const __m256i* x, const KPrep* prep, size_t s, int g, __m256 wf, __m256* facc) {
  for (int t = 0; t < NT; ++t) {
    const int8_t* a = prep[t].qs + 256 * s + 128 * g;
    __m256i av[4];
    for (int j = 0; j < 4; ++j) av[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * j));
    const __m256i d = Dot::template dot<4, kMaxCode>(_mm256_setzero_si256(), x, av);
    const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(prep[t].dx + 16 * s + 8 * g));
    facc[t] = _mm256_fmadd_ps(p, wf, facc[t]);
  }
}

// q4_K / q5_K super-blocks of one row against NT tokens. The four 32-byte
// chunks of codes are transposed (transpose4x4), so lane 4l + c holds codes
// of sub-block 2c in the low nibbles and of 2c + 1 in the high ones; per
// token and half two float multiplies and an FMA, the mins one more FMA.
template <class Dot, bool kFive, int NT>
void qk45_sbs(const uint8_t* row, size_t nsb, const KPrep* prep, const KConsts& k, __m256* facc_io) {
  constexpr size_t kBytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  constexpr int kMaxCode = kFive ? 31 : 15;
  __m256 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = facc_io[t];
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (size_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * kBytes;
    prefetch_block<kBytes>(blk);
    uint16_t d16, dmin16;
    const uint8_t* scales;
    const uint8_t* qs;
    if constexpr (kFive) {
      const auto* b = reinterpret_cast<const BlockQ5K*>(blk);
      d16 = b->d, dmin16 = b->dmin, scales = b->scales, qs = b->qs;
    } else {
      const auto* b = reinterpret_cast<const BlockQ4K*>(blk);
      d16 = b->d, dmin16 = b->dmin, scales = b->scales, qs = b->qs;
    }
    const __m128i scm = unpack_scales_k4(scales);
    const __m128i scl = _mm_shuffle_epi8(scm, k.sc_lanes);
    const __m256 vd = _mm256_set1_ps(h2f(d16));
    const __m256 wf_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scl)), vd);
    const __m256 wf_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scl, 8))), vd);
    const __m256 wm = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scm, 8))),
                                    _mm256_set1_ps(h2f(dmin16)));
    __m256i c[4], x[4];
    for (int j = 0; j < 4; ++j) c[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    if constexpr (kFive) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const BlockQ5K*>(blk)->qh));
      __m256i v[4];
      v[0] = _mm256_or_si256(_mm256_and_si256(c[0], m4), q5_high<0>(qh));
      v[1] = _mm256_or_si256(_mm256_and_si256(c[1], m4), q5_high<2>(qh));
      v[2] = _mm256_or_si256(_mm256_and_si256(c[2], m4), q5_high<4>(qh));
      v[3] = _mm256_or_si256(_mm256_and_si256(c[3], m4), q5_high<6>(qh));
      transpose4x4(v, x);
      k45_group<Dot, kMaxCode, NT>(x, prep, s, 0, wf_lo, facc);
      v[0] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c[0], 4), m4), q5_high<1>(qh));
      v[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c[1], 4), m4), q5_high<3>(qh));
      v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c[2], 4), m4), q5_high<5>(qh));
      v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c[3], 4), m4), q5_high<7>(qh));
      transpose4x4(v, x);
      k45_group<Dot, kMaxCode, NT>(x, prep, s, 1, wf_hi, facc);
    } else {
      __m256i tr[4];
      transpose4x4(c, tr);
      for (int j = 0; j < 4; ++j) x[j] = _mm256_and_si256(tr[j], m4);
      k45_group<Dot, kMaxCode, NT>(x, prep, s, 0, wf_lo, facc);
      for (int j = 0; j < 4; ++j) x[j] = _mm256_and_si256(_mm256_srli_epi16(tr[j], 4), m4);
      k45_group<Dot, kMaxCode, NT>(x, prep, s, 1, wf_hi, facc);
    }
    for (int t = 0; t < NT; ++t) facc[t] = _mm256_fnmadd_ps(wm, _mm256_loadu_ps(prep[t].s + 8 * s), facc[t]);
  }
  for (int t = 0; t < NT; ++t) facc_io[t] = facc[t];
}

// q6_K super-blocks of one row against NT tokens: per half the four code
// vectors (32 elements each, two 16-element sub-blocks in their 128-bit
// lanes) transposed, so lane 4l + v holds sub-block 8h + 2v + l; the
// products summed from -32 * (sum a) (the codes' offset), then one
// conversion, one multiply by the activation scales and one FMA with d * sc
// per token.
// q3_K's 16 sub-block scales (sc - 32, signed bytes) from its 12 packed
// bytes (`packed` = BlockQ3K::scales): low nibbles of bytes 0-7 (sub-blocks 0-7) and their high nibbles
// (8-15), two more bits of each from byte 8 + s % 4 at bit 2 (s / 4).
inline __m128i q3k_scales(const uint8_t* packed) {
  // One load from two bytes before the scales (the end of qs), which stays
  // inside the block; a copy to a 16-byte buffer stalled store forwarding.
  const __m128i r = _mm_srli_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed - 2)), 2);
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(r, m4), _mm_and_si128(_mm_srli_epi16(r, 4), m4));
  const __m128i hb = _mm_shuffle_epi8(r, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
  const __m128i m3 = _mm_set1_epi8(3);
  const __m128i q0 = _mm_and_si128(hb, m3);
  const __m128i q1 = _mm_and_si128(_mm_srli_epi16(hb, 2), m3);
  const __m128i q2 = _mm_and_si128(_mm_srli_epi16(hb, 4), m3);
  const __m128i q3 = _mm_and_si128(_mm_srli_epi16(hb, 6), m3);
  // Bytes 0-3 from q0, 4-7 from q1, 8-11 from q2, 12-15 from q3.
  const __m128i high = _mm_blend_epi32(_mm_blend_epi32(q0, q1, 0x2), _mm_blend_epi32(q2, q3, 0x8), 0xc);
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
}

// q6_K, q3_K and q2_K super-blocks of one row against NT tokens: per half
// the four code vectors (32 elements each, two 16-element sub-blocks in
// their 128-bit lanes) transposed, so lane 4l + v holds sub-block
// 8h + 2v + l; the products summed from the offset's -c * (sum a) (q6_K
// 32, q3_K 4, q2_K none), then one conversion, one multiply by the
// activation scales and one FMA with d * sc per token; q2_K's mins one
// more pair of FMAs per super-block.
template <class Dot, Kind K, int NT>
void q16_sbs(const uint8_t* row, size_t nsb, const KPrep* prep, const KConsts& k, __m256* facc_io) {
  constexpr size_t kBytes = K == Kind::kQ6K ? sizeof(BlockQ6K) : K == Kind::kQ3K ? sizeof(BlockQ3K) : sizeof(BlockQ2K);
  constexpr int kMaxCode = K == Kind::kQ6K ? 63 : K == Kind::kQ3K ? 7 : 3;
  __m256 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = facc_io[t];
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i m30 = _mm256_set1_epi8(0x30);
  const __m256i m3 = _mm256_set1_epi8(3);
  for (size_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * kBytes;
    prefetch_block<kBytes>(blk);
    __m128i sc16;
    uint16_t d16;
    if constexpr (K == Kind::kQ6K) {
      const auto* b = reinterpret_cast<const BlockQ6K*>(blk);
      sc16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
      d16 = b->d;
    } else if constexpr (K == Kind::kQ3K) {
      const auto* b = reinterpret_cast<const BlockQ3K*>(blk);
      sc16 = q3k_scales(b->scales);
      d16 = b->d;
    } else {
      const auto* b = reinterpret_cast<const BlockQ2K*>(blk);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
      sc16 = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
      d16 = b->d;
      // The mins: -dmin * m_s * (da * sum a)_s over the 16 sub-blocks.
      const __m128i mins = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
      const __m256 vdm = _mm256_set1_ps(h2f(b->dmin));
      const __m256 m_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)), vdm);
      const __m256 m_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8))), vdm);
      for (int t = 0; t < NT; ++t) {
        facc[t] = _mm256_fnmadd_ps(m_lo, _mm256_loadu_ps(prep[t].s + 16 * s), facc[t]);
        facc[t] = _mm256_fnmadd_ps(m_hi, _mm256_loadu_ps(prep[t].s + 16 * s + 8), facc[t]);
      }
    }
    const __m128i sc8 = _mm_shuffle_epi8(sc16, k.q6_sc);
    const __m256 vd = _mm256_set1_ps(h2f(d16));
    for (int h = 0; h < 2; ++h) {
      __m256i c[4], x[4];
      if constexpr (K == Kind::kQ6K) {
        const auto* b = reinterpret_cast<const BlockQ6K*>(blk);
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h));
        c[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        c[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
        c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
      } else {
        const uint8_t* qs =
            K == Kind::kQ3K ? reinterpret_cast<const BlockQ3K*>(blk)->qs : reinterpret_cast<const BlockQ2K*>(blk)->qs;
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * h));
        c[0] = _mm256_and_si256(q, m3);
        c[1] = _mm256_and_si256(_mm256_srli_epi16(q, 2), m3);
        c[2] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m3);
        c[3] = _mm256_and_si256(_mm256_srli_epi16(q, 6), m3);
        if constexpr (K == Kind::kQ3K) {
          // The third bit of pair j of half h: bit 4h + j of hmask, as 4.
          const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const BlockQ3K*>(blk)->hmask));
          const __m256i hs = h == 0 ? hm : _mm256_srli_epi16(hm, 4);
          const __m256i four = _mm256_set1_epi8(4);
          c[0] = _mm256_or_si256(c[0], _mm256_and_si256(_mm256_slli_epi16(hs, 2), four));
          c[1] = _mm256_or_si256(c[1], _mm256_and_si256(_mm256_slli_epi16(hs, 1), four));
          c[2] = _mm256_or_si256(c[2], _mm256_and_si256(hs, four));
          c[3] = _mm256_or_si256(c[3], _mm256_and_si256(_mm256_srli_epi16(hs, 1), four));
        }
      }
      transpose4x4(c, x);
      const __m256 wf =
          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h == 0 ? sc8 : _mm_srli_si128(sc8, 8))), vd);
      for (int t = 0; t < NT; ++t) {
        const int8_t* a = prep[t].qs + 256 * s + 128 * h;
        __m256i av[4];
        for (int j = 0; j < 4; ++j) av[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * j));
        const __m256i init =
            K == Kind::kQ2K ? _mm256_setzero_si256()
                            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(prep[t].init + 16 * s + 8 * h));
        const __m256i d = Dot::template dot<4, kMaxCode>(init, x, av);
        const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(prep[t].dx + 16 * s + 8 * h));
        facc[t] = _mm256_fmadd_ps(p, wf, facc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) facc_io[t] = facc[t];
}

template <class Dot, Kind K, int NT>
inline void k_sbs(const uint8_t* row, size_t nsb, const KPrep* prep, const KConsts& k, __m256* facc) {
  if constexpr (sixteen(K)) {
    q16_sbs<Dot, K, NT>(row, nsb, prep, k, facc);
  } else {
    qk45_sbs<Dot, K == Kind::kQ5K, NT>(row, nsb, prep, k, facc);
  }
}

// Up to kMaxTokens tokens at a time; per token group the super-blocks in
// column chunks whose prepared activations fit the stack buffer; per chunk
// every row.
template <class Dot, Kind K>
void dot_rows_k(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  constexpr size_t kBytes = K == Kind::kQ6K   ? sizeof(BlockQ6K)
                            : K == Kind::kQ3K ? sizeof(BlockQ3K)
                            : K == Kind::kQ2K ? sizeof(BlockQ2K)
                            : K == Kind::kQ5K ? sizeof(BlockQ5K)
                                              : sizeof(BlockQ4K);
  constexpr size_t kPrepBytes = prep_bytes(K);
  const KConsts& k = kconsts();
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  if (nsb == 0) return zero_out(rows, tokens, out, ld_out);
  alignas(64) uint8_t buf[kActBufferBytes];
  constexpr int kTokens = Dot::max_tokens(weight_type(K));
  static_assert(kTokens >= 1 && kTokens <= kMaxTokens);
  for (int32_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const int nt = tokens - t0 < kTokens ? tokens - t0 : kTokens;
    const size_t chunk = kActBufferBytes / (kPrepBytes * static_cast<size_t>(nt));
    for (size_t c0 = 0; c0 < nsb; c0 += chunk) {
      const size_t cn = min_size(chunk, nsb - c0);
      KPrep prep[kMaxTokens];
      uint8_t* q = buf;
      for (int t = 0; t < nt; ++t) {
        prep[t].qs = reinterpret_cast<int8_t*>(q);
        q += cn * 256;
        prep[t].dx = reinterpret_cast<float*>(q);
        q += cn * 64;
        if constexpr (K == Kind::kQ6K || K == Kind::kQ3K) {
          prep[t].init = reinterpret_cast<int32_t*>(q);
          q += cn * 64;
        } else {
          prep[t].s = reinterpret_cast<float*>(q);
          q += cn * (K == Kind::kQ2K ? 64 : 32);
        }
        prepare_k<K>(ab + static_cast<size_t>(t0 + t) * act_bytes, n, c0, cn, prep[t], k);
      }
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        const uint8_t* row = wb + r * row_bytes + c0 * kBytes;
        __m256 facc[kMaxTokens];
        for (int t = 0; t < kMaxTokens; ++t) facc[t] = _mm256_setzero_ps();
        with_token_count<kTokens>(nt, [&]<int NT>() { k_sbs<Dot, K, NT>(row, cn, prep, k, facc); });
        for (int t = 0; t < nt; ++t) {
          float* o = out + static_cast<size_t>(t0 + t) * ld_out + r;
          const float v = hsum_ps(facc[t]);
          *o = c0 == 0 ? v : *o + v;
        }
      }
    }
  }
}

// ---------------------------------------------------------------- q8_0 / q4_0

// One token's activations for 8 blocks, transposed: dword j of a[k] holds
// qs[4k .. 4k+3] of block j; d, off (-offset * sum) and ds (d * sum, for
// the formats with a min) lane j likewise.
struct Group8 {
  __m256i a[8];
  __m256 d;
  __m256i off;
  __m256 ds;
};
static_assert(sizeof(Group8) == 352);

constexpr size_t kGroupBuffer = 144;  // 50 KB

// Loads 16 bytes at p + min(j, last) * kStride for j < 8 and transposes
// them: dword j of out[k] is dword k of row min(j, last). A row's last
// partial group passes its last block as `last`, so nothing past the row
// is read.
template <size_t kStride>
inline void transpose8(const uint8_t* p, __m256i* out, size_t last = 7) {
  __m256i z[4];
  for (size_t i = 0; i < 4; ++i) {
    z[i] = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + min_size(i, last) * kStride))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + min_size(i + 4, last) * kStride)), 1);
  }
  const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]);
  const __m256i t1 = _mm256_unpackhi_epi32(z[0], z[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]);
  const __m256i t3 = _mm256_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// Groups [g0, g0 + ng) of one token's activation row (n elements) into
// out[g * stride].
template <int kOffset>
void prepare_groups(const uint8_t* act, size_t n, size_t g0, size_t ng, Group8* out, size_t stride) {
  const size_t nb = n / kQK32;
  for (size_t g = 0; g < ng; ++g) {
    const size_t b0 = (g0 + g) * 8;
    const size_t cnt = min_size(8, nb - b0);
    alignas(32) uint8_t tail[8 * kQK32];
    alignas(32) float d[8] = {};
    alignas(32) int16_t sums[16] = {};
    const uint8_t* qs = act + b0 * kQK32;
    if (cnt < 8) {
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, qs, cnt * kQK32);
      qs = tail;
    }
    std::memcpy(d, act_d(act, n) + b0 * sizeof(float), cnt * sizeof(float));
    std::memcpy(sums, act_sums(act, n) + 2 * b0 * sizeof(int16_t), 2 * cnt * sizeof(int16_t));
    Group8& G = out[g * stride];
    transpose8<kQK32>(qs, G.a);
    transpose8<kQK32>(qs + 16, G.a + 4);
    G.d = _mm256_load_ps(d);
    const __m256i s16 = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums));
    // -offset * (the two 16-element sums of each block).
    G.off = _mm256_madd_epi16(s16, _mm256_set1_epi16(static_cast<int16_t>(-kOffset)));
    G.ds = _mm256_mul_ps(G.d, _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1))));
  }
}

// The formats with blocks of 32 and one scale per block (iq4_xs: its
// super-block's eight sub-blocks of 32, each with its own scale, are one
// group of eight blocks here).
enum class Block32 { kQ8_0, kQ4_0, kMxfp4, kQ4_1, kQ5_0, kQ5_1, kIq4Nl, kIq4Xs };

// Where a format keeps what the kernels read: the stride from one block's
// codes to the next's, the bytes of a group of 8 blocks, the codes' offset
// in a block (in a group for iq4_xs), and q5_0 / q5_1's high bits.
struct Block32Layout {
  WeightType type;
  size_t stride;
  size_t group_bytes;
  size_t qs;
  size_t qh;          // 0: no fifth bit
  bool min;           // x = d * q + m, m an f16 at byte 2
  bool iq4;           // codes index kIq4nlValues
};

template <Block32 B>
constexpr Block32Layout block32_layout() {
  switch (B) {
    case Block32::kQ8_0:
      return {WeightType::kQ8_0, sizeof(BlockQ8_0), 8 * sizeof(BlockQ8_0), 2, 0, false, false};
    case Block32::kQ4_0:
      return {WeightType::kQ4_0, sizeof(BlockQ4_0), 8 * sizeof(BlockQ4_0), 2, 0, false, false};
    case Block32::kMxfp4:
      return {WeightType::kMXFP4, sizeof(BlockMxfp4), 8 * sizeof(BlockMxfp4), 1, 0, false, false};
    case Block32::kQ4_1:
      return {WeightType::kQ4_1, sizeof(BlockQ4_1), 8 * sizeof(BlockQ4_1), 4, 0, true, false};
    case Block32::kQ5_0:
      return {WeightType::kQ5_0, sizeof(BlockQ5_0), 8 * sizeof(BlockQ5_0), 6, 2, false, false};
    case Block32::kQ5_1:
      return {WeightType::kQ5_1, sizeof(BlockQ5_1), 8 * sizeof(BlockQ5_1), 8, 4, true, false};
    case Block32::kIq4Nl:
      return {WeightType::kIQ4_NL, sizeof(BlockIq4Nl), 8 * sizeof(BlockIq4Nl), 2, 0, false, true};
    case Block32::kIq4Xs:
      return {WeightType::kIQ4_XS, kQK32 / 2, sizeof(BlockIq4Xs), 8, 0, false, true};
  }
  return {};
}

template <Block32 B>
constexpr size_t block32_bytes() {
  return block32_layout<B>().stride;
}

// The unsigned codes the products take and the offset they carry (its
// multiple of the activation sums starts each dot): q8_0 as its trait
// needs (below), q4_0's nibbles (offset 8), q4_1 / q5_1's (0: their
// offset is the float min), q5_0's five bits (16), mxfp4's values biased
// by 12 through a byte table (codes 0..24), iq4's levels biased by 128
// (codes 1..241) where the products go straight into int32, and signed
// (offset 0, the sign trick) where they pass through int16.
template <class Dot, Block32 B>
constexpr int block32_offset() {
  switch (B) {
    case Block32::kQ8_0:
      return Dot::kSaturatesInt16 ? 0 : 128;
    case Block32::kQ4_0:
      return 8;
    case Block32::kMxfp4:
      return 12;
    case Block32::kQ5_0:
      return 16;
    case Block32::kIq4Nl:
    case Block32::kIq4Xs:
      return Dot::kSaturatesInt16 ? 0 : 128;
    default:
      return 0;
  }
}

template <class Dot, Block32 B>
constexpr int block32_max_code() {
  constexpr Block32Layout L = block32_layout<B>();
  if constexpr (B == Block32::kMxfp4) return 24;
  if constexpr (L.iq4) return Dot::kSaturatesInt16 ? 127 : 241;
  return L.qh != 0 ? 31 : 15;
}

// The nibbles as codes: through a byte table for mxfp4 and the iq4
// formats (signed levels where the trait saturates), as they are otherwise.
template <class Dot, Block32 B>
inline __m256i nibble_codes(__m256i nibbles) {
  if constexpr (B == Block32::kMxfp4) {
    const __m256i biased =
        _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24,
                         12, 11, 10, 9, 8, 6, 4, 0);
    return _mm256_shuffle_epi8(biased, nibbles);
  } else if constexpr (block32_layout<B>().iq4) {
    if constexpr (Dot::kSaturatesInt16) {
      const __m256i levels = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                                              113, -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                                              89, 113);
      return _mm256_shuffle_epi8(levels, nibbles);
    } else {
      // The levels + 128 as unsigned bytes.
      const __m256i biased = _mm256_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59,
                                              -39, -15, 1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75,
                                              -59, -39, -15);
      return _mm256_shuffle_epi8(biased, nibbles);
    }
  } else {
    return nibbles;
  }
}

// q5_0 / q5_1: the fifth bits (as 0x10) of the codes in the transposed
// nibble vector i (elements 4i .. 4i + 3 of each block, or 16 + those when
// `high`), from qh (dword j: block j's 32 bits): each dword's byte
// (4i + 16 * high) / 8 spread over its four bytes, bit 4 (i % 2) + k of byte k tested.
template <int I, bool kHigh>
inline __m256i q5_fifth_bits(__m256i qh) {
  constexpr char c = static_cast<char>(I / 2 + (kHigh ? 2 : 0));
  const __m256i spread = _mm256_setr_epi8(c, c, c, c, c + 4, c + 4, c + 4, c + 4, c + 8, c + 8, c + 8, c + 8, c + 12,
                                          c + 12, c + 12, c + 12, c, c, c, c, c + 4, c + 4, c + 4, c + 4, c + 8, c + 8,
                                          c + 8, c + 8, c + 12, c + 12, c + 12, c + 12);
  constexpr int b = 4 * (I % 2);
  const __m256i bit = _mm256_set1_epi32(static_cast<int>((1u << b) | (2u << b << 8) | (4u << b << 16) |
                                                         (8u << b << 24)));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// The 32-bit words at blk + min(j, last) * kStride + kAt, lane j.
template <size_t kStride, size_t kAt>
inline __m256i gather_words(const uint8_t* blk, size_t last) {
  alignas(32) uint32_t w[8];
  for (size_t j = 0; j < 8; ++j) std::memcpy(&w[j], blk + min_size(j, last) * kStride + kAt, 4);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
}

// The f16 values at blk + min(j, last) * kStride + kAt, lane j, as floats.
template <size_t kStride, size_t kAt>
inline __m256 gather_f16(const uint8_t* blk, size_t last) {
  uint64_t lo = 0, hi = 0;
  for (size_t j = 0; j < 4; ++j) {
    uint16_t a, b;
    std::memcpy(&a, blk + min_size(j, last) * kStride + kAt, 2);
    std::memcpy(&b, blk + min_size(j + 4, last) * kStride + kAt, 2);
    lo |= static_cast<uint64_t>(a) << (16 * j);
    hi |= static_cast<uint64_t>(b) << (16 * j);
  }
  return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}

// The scales of blocks min(j, last) at blk (stride kBytes), lane j.
template <Block32 B>
inline __m256 block_scales_of(const uint8_t* blk, size_t last) {
  constexpr size_t kB = block32_bytes<B>();
  if constexpr (B == Block32::kMxfp4) {
    // The 8 exponent bytes by scalar loads: a gather costs more on some
    // CPUs (Zen 3) than the bytes it fetches.
    uint64_t bytes = 0;
    for (size_t j = 0; j < 8; ++j) bytes |= static_cast<uint64_t>(blk[min_size(j, last) * kB]) << (8 * j);
    // 2^(e - 128) as float bits: (e - 1) << 23, or 0x00200000 << e (subnormal) for e < 2.
    const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
  } else if constexpr (B == Block32::kIq4Xs) {
    // One super-block: d * (ls_j - 32), ls_j from scales_l's nibble j % 2
    // of byte j / 2 and scales_h's bits 2j, 2j + 1.
    (void)last;
    const auto* sb = reinterpret_cast<const BlockIq4Xs*>(blk);
    uint32_t low;
    std::memcpy(&low, sb->scales_l, 4);
    const __m256i nib = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(low)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(0xf));
    const __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sb->scales_h),
                                                           _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                         _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(nib, _mm256_slli_epi32(top, 4)), _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(h2f(sb->d)));
  } else {
    // The 8 f16 scales likewise (every other format's d is its first field).
    return gather_f16<kB, 0>(blk, last);
  }
}

// The scales of the cnt (1 .. 8) blocks at blk (stride kBytes), lane j
// block j's; lanes from cnt on are zero.
template <Block32 B>
inline __m256 block_scales(const uint8_t* blk, size_t cnt) {
  const __m256 s = block_scales_of<B>(blk, cnt - 1);
  if (cnt == 8) return s;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cnt)), lane);
  return _mm256_and_ps(s, _mm256_castsi256_ps(live));
}

// The cnt (1 .. 8) blocks of a row at blk against NT tokens' groups (whose
// activations past cnt are zero).
template <class Dot, Block32 B, int NT>
inline void group32(const uint8_t* blk, size_t cnt, const Group8* G, __m256* facc) {
  constexpr size_t kBytes = block32_bytes<B>();
  constexpr Block32Layout kLayout = block32_layout<B>();
  __m256i acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = G[t].off;
  if constexpr (B == Block32::kQ8_0) {
    for (int h = 0; h < 2; ++h) {
      __m256i wv[4], u[4];
      transpose8<kBytes>(blk + 2 + 16 * h, wv, cnt - 1);
      if constexpr (Dot::kSaturatesInt16) {
        for (int i = 0; i < 4; ++i) u[i] = _mm256_abs_epi8(wv[i]);
        for (int t = 0; t < NT; ++t) {
          __m256i a[4];
          for (int i = 0; i < 4; ++i) a[i] = _mm256_sign_epi8(G[t].a[4 * h + i], wv[i]);
          acc[t] = Dot::template dot<4, 128>(acc[t], u, a);
        }
      } else {
        // w + 128; G.off holds -128 * (sum a).
        const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
        for (int i = 0; i < 4; ++i) u[i] = _mm256_xor_si256(wv[i], bias);
        for (int t = 0; t < NT; ++t) acc[t] = Dot::template dot<4, 255>(acc[t], u, G[t].a + 4 * h);
      }
    }
  } else {
    constexpr int kMaxCode = block32_max_code<Dot, B>();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i tv[4], u[8];
    transpose8<kBytes>(blk + kLayout.qs, tv, cnt - 1);
    // Dword j of a[i] (block j's quants 4i .. 4i + 3) meets the low
    // nibbles, of a[i + 4] the high ones.
    for (int i = 0; i < 4; ++i) {
      u[i] = _mm256_and_si256(tv[i], m4);
      u[i + 4] = _mm256_and_si256(_mm256_srli_epi16(tv[i], 4), m4);
    }
    if constexpr (kLayout.qh != 0) {
      const __m256i qh = gather_words<kBytes, kLayout.qh>(blk, cnt - 1);
      u[0] = _mm256_or_si256(u[0], q5_fifth_bits<0, false>(qh));
      u[1] = _mm256_or_si256(u[1], q5_fifth_bits<1, false>(qh));
      u[2] = _mm256_or_si256(u[2], q5_fifth_bits<2, false>(qh));
      u[3] = _mm256_or_si256(u[3], q5_fifth_bits<3, false>(qh));
      u[4] = _mm256_or_si256(u[4], q5_fifth_bits<0, true>(qh));
      u[5] = _mm256_or_si256(u[5], q5_fifth_bits<1, true>(qh));
      u[6] = _mm256_or_si256(u[6], q5_fifth_bits<2, true>(qh));
      u[7] = _mm256_or_si256(u[7], q5_fifth_bits<3, true>(qh));
    }
    for (int i = 0; i < 8; ++i) u[i] = nibble_codes<Dot, B>(u[i]);
    if constexpr (kLayout.iq4 && Dot::kSaturatesInt16) {
      // Signed levels: |w| times the activations carrying w's sign.
      __m256i w[8];
      for (int i = 0; i < 8; ++i) w[i] = _mm256_abs_epi8(u[i]);
      for (int t = 0; t < NT; ++t) {
        __m256i a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_sign_epi8(G[t].a[i], u[i]);
        acc[t] = Dot::template dot<8, kMaxCode>(acc[t], w, a);
      }
    } else if constexpr (NT == 1 && !Dot::kSaturatesInt16) {
      // One token: two chains of vpdpbusd, not one of eight waiting on each other.
      const __m256i lo = Dot::template dot<4, kMaxCode>(acc[0], u, G[0].a);
      acc[0] = _mm256_add_epi32(lo, Dot::template dot<4, kMaxCode>(_mm256_setzero_si256(), u + 4, G[0].a + 4));
    } else {
      for (int t = 0; t < NT; ++t) acc[t] = Dot::template dot<8, kMaxCode>(acc[t], u, G[t].a);
    }
  }
  const __m256 dw = block_scales<B>(blk, cnt);
  for (int t = 0; t < NT; ++t) {
    facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), _mm256_mul_ps(dw, G[t].d), facc[t]);
  }
  if constexpr (kLayout.min) {
    // + m * d_a * (sum a) per block, lanes past cnt zeroed as the scales are.
    __m256 mw = gather_f16<kBytes, 2>(blk, cnt - 1);
    if (cnt < 8) {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cnt)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      mw = _mm256_and_ps(mw, _mm256_castsi256_ps(live));
    }
    for (int t = 0; t < NT; ++t) facc[t] = _mm256_fmadd_ps(mw, G[t].ds, facc[t]);
  }
}

template <class Dot, Block32 B, int NT>
void q32_row(const uint8_t* row, size_t g0, size_t ng, size_t nb, const Group8* groups, float* res) {
  constexpr size_t kGroupBytes = block32_layout<B>().group_bytes;
  __m256 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm256_setzero_ps();
  for (size_t g = 0; g < ng; ++g) {
    const size_t b0 = (g0 + g) * 8;
    const uint8_t* blk = row + (g0 + g) * kGroupBytes;
    if (b0 + 8 <= nb) {
      prefetch_block<kGroupBytes>(blk);
      group32<Dot, B, NT>(blk, 8, groups + g * NT, facc);
    } else {
      // The row's last partial group in place (gpt-oss's 2880 elements end
      // in 2 blocks): its last block stands in for the missing ones, which
      // meet zero activations and zero scales. A zero-padded copy cost more
      // than the group itself.
      group32<Dot, B, NT>(blk, nb - b0, groups + g * NT, facc);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = hsum_ps(facc[t]);
}

template <class Dot, Block32 B>
void dot_rows_32(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                 size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nb = n / kQK32;
  if (nb == 0) return zero_out(rows, tokens, out, ld_out);
  const size_t ng_total = (nb + 7) / 8;
  constexpr int kOffset = block32_offset<Dot, B>();
  constexpr WeightType kType = block32_layout<B>().type;
  Group8 buf[kGroupBuffer];
  constexpr int kTokens = Dot::max_tokens(kType);
  static_assert(kTokens >= 1 && kTokens <= kMaxTokens);
  for (int32_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const int nt = tokens - t0 < kTokens ? tokens - t0 : kTokens;
    const size_t chunk_groups = kGroupBuffer / static_cast<size_t>(nt);
    for (size_t g0 = 0; g0 < ng_total; g0 += chunk_groups) {
      const size_t ng = min_size(chunk_groups, ng_total - g0);
      for (int t = 0; t < nt; ++t) {
        prepare_groups<kOffset>(ab + static_cast<size_t>(t0 + t) * act_bytes, n, g0, ng, buf + t,
                                static_cast<size_t>(nt));
      }
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        const uint8_t* row = wb + r * row_bytes;
        float res[kMaxTokens];
        with_token_count<kTokens>(nt, [&]<int NT>() { q32_row<Dot, B, NT>(row, g0, ng, nb, buf, res); });
        for (int t = 0; t < nt; ++t) {
          float* o = out + static_cast<size_t>(t0 + t) * ld_out + r;
          *o = g0 == 0 ? res[t] : *o + res[t];
        }
      }
    }
  }
}

// ---------------------------------------------------------------- grid i-quants

enum class Grid { kIq2Xxs, kIq3Xxs, kIq1S, kIq1M, kIq2Xs, kIq2S, kIq3S };

template <Grid G>
struct GridTraits;
template <>
struct GridTraits<Grid::kIq2Xxs> {
  using Block = BlockIq2Xxs;
  static constexpr WeightType kType = WeightType::kIQ2_XXS;
  static constexpr int kMaxCode = 43;
};
template <>
struct GridTraits<Grid::kIq3Xxs> {
  using Block = BlockIq3Xxs;
  static constexpr WeightType kType = WeightType::kIQ3_XXS;
  static constexpr int kMaxCode = 62;
};
template <>
struct GridTraits<Grid::kIq1S> {
  using Block = BlockIq1S;
  static constexpr WeightType kType = WeightType::kIQ1_S;
  static constexpr int kMaxCode = 9;
};
template <>
struct GridTraits<Grid::kIq1M> {
  using Block = BlockIq1M;
  static constexpr WeightType kType = WeightType::kIQ1_M;
  static constexpr int kMaxCode = 9;
};

template <>
struct GridTraits<Grid::kIq2Xs> {
  using Block = BlockIq2Xs;
  static constexpr WeightType kType = WeightType::kIQ2_XS;
  static constexpr int kMaxCode = 43;
};
template <>
struct GridTraits<Grid::kIq2S> {
  using Block = BlockIq2S;
  static constexpr WeightType kType = WeightType::kIQ2_S;
  static constexpr int kMaxCode = 43;
};
template <>
struct GridTraits<Grid::kIq3S> {
  using Block = BlockIq3S;
  static constexpr WeightType kType = WeightType::kIQ3_S;
  static constexpr int kMaxCode = 15;
};

// A 32-element sub-block of a grid format, unpacked: magnitudes (unsigned
// bytes), the signs to put on the activations (vpsignb: negative, zero or
// positive bytes) and the scale of each dword lane's products.
struct GridSub {
  __m256i mag;
  __m256i sign;
  __m256 scale;
};

inline long long bytes8(uint64_t v) { return static_cast<long long>(v); }

// The IQ2/IQ3 sign bytes of a word's four 7-bit sign indices, spread to
// -1 (negative) or +1 per value.
inline __m256i iq_signs(uint32_t word) {
  const uint64_t* signs = kIqTables.iq2_sign_bytes;
  return _mm256_setr_epi64x(bytes8(signs[word & 127]), bytes8(signs[(word >> 7) & 127]),
                            bytes8(signs[(word >> 14) & 127]), bytes8(signs[(word >> 21) & 127]));
}

// Four sign bytes (bit j of byte g set: value 8g + j negative) spread to -1
// or +1 per value.
inline __m256i sign_bits_pm1(const uint8_t* signs) {
  uint32_t word;
  std::memcpy(&word, signs, sizeof word);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(word)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bits = _mm256_set1_epi64x(bytes8(0x8040201008040201ull));
  return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits), _mm256_set1_epi8(1));
}

// The scales of IQ2_XS / IQ2_S sub-block ib: d * (0.5 + ls) / 4 per 16
// values (dword lanes 0-3 the first 16 values' products, 4-7 the second's).
inline __m256 iq2_half_scales(float d, uint8_t scales) {
  const float d1 = d * (0.5f + static_cast<float>(scales & 0xf)) * 0.25f;
  const float d2 = d * (0.5f + static_cast<float>(scales >> 4)) * 0.25f;
  return _mm256_setr_ps(d1, d1, d1, d1, d2, d2, d2, d2);
}

// IQ1: four grid points of {-1, 0, 1} (indices idx[l]) and their groups'
// shifts (+1 or -1 bytes): 8 g + shift, which is 8 times the weight over
// the scale and never zero; its magnitude and itself as the sign.
inline void iq1_sub(const uint32_t* idx, __m256i shift, GridSub* out) {
  const uint64_t* grid = kIqTables.iq1s_grid;
  const __m256i g =
      _mm256_setr_epi64x(bytes8(grid[idx[0]]), bytes8(grid[idx[1]]), bytes8(grid[idx[2]]), bytes8(grid[idx[3]]));
  const __m256i w = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), shift);
  out->mag = _mm256_abs_epi8(w);
  out->sign = w;
}

// Sub-block ib of super-block b (d: its decoded f16 scale where the format has one).
template <Grid G>
inline void grid_sub(const typename GridTraits<G>::Block* b, float d, int ib, GridSub* out) {
  if constexpr (G == Grid::kIq2Xxs) {
    const uint64_t* grid = kIqTables.iq2xxs_grid;
    uint32_t words[2];
    std::memcpy(words, b->qs + 4 * ib, sizeof words);
    out->mag = _mm256_setr_epi64x(bytes8(grid[words[0] & 0xff]), bytes8(grid[(words[0] >> 8) & 0xff]),
                                  bytes8(grid[(words[0] >> 16) & 0xff]), bytes8(grid[words[0] >> 24]));
    out->sign = iq_signs(words[1]);
    out->scale = _mm256_set1_ps(d * (0.5f + static_cast<float>(words[1] >> 28)) * 0.25f);
  } else if constexpr (G == Grid::kIq3Xxs) {
    const uint32_t* grid = kIqTables.iq3xxs_grid;
    const uint8_t* q = b->qs + 8 * ib;
    uint32_t aux;
    std::memcpy(&aux, b->qs + kQKK / 4 + 4 * ib, sizeof aux);
    out->mag = _mm256_setr_epi32(static_cast<int>(grid[q[0]]), static_cast<int>(grid[q[1]]),
                                 static_cast<int>(grid[q[2]]), static_cast<int>(grid[q[3]]),
                                 static_cast<int>(grid[q[4]]), static_cast<int>(grid[q[5]]),
                                 static_cast<int>(grid[q[6]]), static_cast<int>(grid[q[7]]));
    out->sign = iq_signs(aux);
    out->scale = _mm256_set1_ps(d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f);
  } else if constexpr (G == Grid::kIq2Xs) {
    const uint64_t* grid = kIqTables.iq2xs_grid;
    const uint64_t* signs = kIqTables.iq2_sign_bytes;
    const uint16_t* q = b->qs + 4 * ib;
    out->mag = _mm256_setr_epi64x(bytes8(grid[q[0] & 511]), bytes8(grid[q[1] & 511]), bytes8(grid[q[2] & 511]),
                                  bytes8(grid[q[3] & 511]));
    out->sign = _mm256_setr_epi64x(bytes8(signs[q[0] >> 9]), bytes8(signs[q[1] >> 9]), bytes8(signs[q[2] >> 9]),
                                   bytes8(signs[q[3] >> 9]));
    out->scale = iq2_half_scales(d, b->scales[ib]);
  } else if constexpr (G == Grid::kIq2S) {
    const uint64_t* grid = kIqTables.iq2s_grid;
    const uint8_t* q = b->qs + 4 * ib;
    const uint32_t qh = b->qh[ib];
    out->mag = _mm256_setr_epi64x(bytes8(grid[q[0] | ((qh << 8) & 0x300)]), bytes8(grid[q[1] | ((qh << 6) & 0x300)]),
                                  bytes8(grid[q[2] | ((qh << 4) & 0x300)]), bytes8(grid[q[3] | ((qh << 2) & 0x300)]));
    out->sign = sign_bits_pm1(b->signs + 4 * ib);
    out->scale = iq2_half_scales(d, b->scales[ib]);
  } else if constexpr (G == Grid::kIq3S) {
    const uint32_t* grid = kIqTables.iq3s_grid;
    const uint8_t* q = b->qs + 8 * ib;
    const uint32_t qh = b->qh[ib];
    out->mag = _mm256_setr_epi32(
        static_cast<int>(grid[q[0] | ((qh << 8) & 256)]), static_cast<int>(grid[q[1] | ((qh << 7) & 256)]),
        static_cast<int>(grid[q[2] | ((qh << 6) & 256)]), static_cast<int>(grid[q[3] | ((qh << 5) & 256)]),
        static_cast<int>(grid[q[4] | ((qh << 4) & 256)]), static_cast<int>(grid[q[5] | ((qh << 3) & 256)]),
        static_cast<int>(grid[q[6] | ((qh << 2) & 256)]), static_cast<int>(grid[q[7] | ((qh << 1) & 256)]));
    out->sign = sign_bits_pm1(b->signs + 4 * ib);
    const int s = (b->scales[ib / 2] >> (4 * (ib % 2))) & 0xf;
    out->scale = _mm256_set1_ps(d * static_cast<float>(1 + 2 * s));
  } else if constexpr (G == Grid::kIq1S) {
    const uint32_t qh = b->qh[ib];
    const uint8_t* q = b->qs + 4 * ib;
    const uint32_t idx[4] = {q[0] | ((qh << 8) & 0x700), q[1] | ((qh << 5) & 0x700), q[2] | ((qh << 2) & 0x700),
                             q[3] | ((qh >> 1) & 0x700)};
    iq1_sub(idx, _mm256_set1_epi8((qh & 0x8000) != 0 ? -1 : 1), out);
    out->scale = _mm256_set1_ps(d * static_cast<float>(2 * ((qh >> 12) & 7) + 1) * 0.125f);
  } else {
    const uint8_t* q = b->qs + 4 * ib;
    const uint32_t h0 = b->qh[2 * ib], h1 = b->qh[2 * ib + 1];
    const uint32_t idx[4] = {q[0] | ((h0 << 8) & 0x700), q[1] | ((h0 << 4) & 0x700), q[2] | ((h1 << 8) & 0x700),
                             q[3] | ((h1 << 4) & 0x700)};
    // Group g's shift sign is bit 3 + 4g of the two qh bytes as one word:
    // -1 bytes where set, +1 elsewhere.
    const __m256i bits = _mm256_setr_epi64x(bytes8(0x0008000800080008ull), bytes8(0x0080008000800080ull),
                                            bytes8(0x0800080008000800ull), bytes8(0x8000800080008000ull));
    const __m256i hw = _mm256_set1_epi16(static_cast<int16_t>(h0 | (h1 << 8)));
    const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(hw, bits), bits);
    iq1_sub(idx, _mm256_or_si256(set, _mm256_set1_epi8(1)), out);
    uint16_t sc;
    std::memcpy(&sc, b->scales + 2 * (ib / 2), sizeof sc);
    const uint32_t s = sc >> (6 * (ib % 2));
    const float d1 = d * static_cast<float>(2 * (s & 7) + 1) * 0.125f;
    const float d2 = d * static_cast<float>(2 * ((s >> 3) & 7) + 1) * 0.125f;
    // Dword lanes 0-3 hold the first 16 values' products, 4-7 the second's.
    out->scale = _mm256_setr_ps(d1, d1, d1, d1, d2, d2, d2, d2);
  }
}

// The f16 d of an IQ1_M super-block: the top nibbles of its four scale words.
inline float iq1m_d(const uint8_t* scales) {
  uint16_t sc[4];
  std::memcpy(sc, scales, sizeof sc);
  return h2f(static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                   (sc[3] & 0xf000)));
}

// Grid-format rows against up to Dot::max_tokens tokens a pass: per
// 32-element sub-block the grid points loaded by index into one vector of
// magnitudes, the signs put on the activations (vpsignb), one product
// vector per token converted and added with the lanes' scales times the
// token's; one horizontal sum per row and token at the end. The
// activations are read as quantised (no per-call preparation).
template <class Dot, Grid G, int NT>
void grid_row(const uint8_t* row, size_t nsb, const uint8_t* const* acts, size_t n, float* res) {
  using Traits = GridTraits<G>;
  __m256 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm256_setzero_ps();
  for (size_t s = 0; s < nsb; ++s) {
    const auto* b = reinterpret_cast<const typename Traits::Block*>(row) + s;
    prefetch_block<sizeof(typename Traits::Block)>(reinterpret_cast<const uint8_t*>(b));
    float d;
    if constexpr (G == Grid::kIq1M) {
      d = iq1m_d(b->scales);
    } else {
      d = h2f(b->d);
    }
    for (int ib = 0; ib < kQKK / 32; ++ib) {
      GridSub sub;
      grid_sub<G>(b, d, ib, &sub);
      const size_t blk = 8 * s + static_cast<size_t>(ib);
      for (int t = 0; t < NT; ++t) {
        const __m256i a =
            _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acts[t] + 32 * blk)), sub.sign);
        const __m256i p = Dot::template dot<1, Traits::kMaxCode>(_mm256_setzero_si256(), &sub.mag, &a);
        float da;
        std::memcpy(&da, act_d(acts[t], n) + blk * sizeof(float), sizeof da);
        facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sub.scale, _mm256_set1_ps(da)), facc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = hsum_ps(facc[t]);
}

template <class Dot, Grid G>
void dot_rows_grid(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                   size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  if (nsb == 0) return zero_out(rows, tokens, out, ld_out);
  constexpr int kTokens = Dot::max_tokens(GridTraits<G>::kType);
  static_assert(kTokens >= 1 && kTokens <= kMaxTokens);
  for (int32_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const int nt = tokens - t0 < kTokens ? tokens - t0 : kTokens;
    const uint8_t* acts[kMaxTokens];
    for (int t = 0; t < nt; ++t) acts[t] = ab + static_cast<size_t>(t0 + t) * act_bytes;
    for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
      const uint8_t* row = wb + r * row_bytes;
      float res[kMaxTokens];
      with_token_count<kTokens>(nt, [&]<int NT>() { grid_row<Dot, G, NT>(row, nsb, acts, n, res); });
      for (int t = 0; t < nt; ++t) out[static_cast<size_t>(t0 + t) * ld_out + r] = res[t];
    }
  }
}

}  // namespace
}  // namespace colibri::kernels
