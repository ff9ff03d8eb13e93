// AVX2 integer dot-product kernels (quant_dot.h), built with -mavx2 -mfma
// -mf16c; qdot_scalar.cpp is the reference. The structure of
// qdot_avx512.cpp with 256-bit vectors and without VNNI: vpmaddubsw
// (unsigned weight codes x signed activations into int16 pairs) and
// vpmaddwd (times the integer sub-block scales, or ones, into int32).
//
// K formats: one ymm of codes per 32-element sub-block (q6_k: two
// 16-element ones), its scale broadcast over the ymm's words, so a
// super-block's products sum in int32 before one float FMA per token.
// q8_0 / q4_0: 8 blocks at a time transposed so that dword j holds codes of
// block j (the activations once per call into a stack buffer), the block
// scales applied lane-wise. q8_0 uses the sign trick (|w| x sign(w) * a,
// _mm256_sign_epi8): the +128 bias of the VNNI kernels would overflow
// vpmaddubsw's int16 pairs.
//
// Everything lives in an anonymous namespace and no inline function of a
// shared header is called: this object must not emit symbols with vague
// linkage (tests/isa_linkage.sh).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/quant_dot.h"
#include "kernels/x86_intrinsics.h"
#include "util/quant_blocks.h"

namespace colibri::kernels {
namespace {

// Bytes ahead of the current block that each row prefetches into L2 and
// into L1 (measured: a single-core stream from DRAM needs both).
constexpr size_t kPrefetchFar = 4096;
constexpr size_t kPrefetchNear = 1024;
constexpr int kMaxTokens = 4;
constexpr size_t kChunkBytes = 128 * 1024;

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

template <size_t kBytes>
inline void prefetch_block(const uint8_t* p) {
  for (size_t o = 0; o < kBytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchFar + o), _MM_HINT_T1);
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

// The rule of qdot_scalar.cpp with the same float operations (exact
// division, round to nearest even), so the bits agree.
template <int kBlock>
void quantize(const float* x, size_t n_valid, size_t n, void* out) {
  constexpr int kVecs = kBlock / 8;
  const size_t nb = n / kBlock;
  auto* o = static_cast<uint8_t*>(out);
  const __m256 lo = _mm256_set1_ps(-127.0f);
  const __m256 hi = _mm256_set1_ps(127.0f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (size_t b = 0; b < nb; ++b) {
    __m256 v[kVecs];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < kVecs; ++i) {
      const size_t s = b * kBlock + 8 * static_cast<size_t>(i);
      if (s + 8 <= n_valid) {
        v[i] = _mm256_loadu_ps(x + s);
      } else if (s < n_valid) {
        alignas(32) float tmp[8] = {};
        std::memcpy(tmp, x + s, (n_valid - s) * sizeof(float));
        v[i] = _mm256_load_ps(tmp);
      } else {
        v[i] = _mm256_setzero_ps();
      }
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], absmask));
    }
    const float d = hmax_ps(amax) / 127.0f;
    float* dst_d;
    int8_t* qs;
    if (kBlock == kQK32) {
      auto* a = reinterpret_cast<ActBlock32*>(o + b * sizeof(ActBlock32));
      dst_d = &a->d;
      qs = a->qs;
    } else {
      auto* a = reinterpret_cast<ActBlockK*>(o + b * sizeof(ActBlockK));
      dst_d = &a->d;
      qs = a->qs;
    }
    *dst_d = d;
    int32_t sums[kBlock / 16];  // per 16 elements
    if (d == 0.0f) {
      std::memset(qs, 0, kBlock);
      for (int i = 0; i < kBlock / 16; ++i) sums[i] = 0;
    } else {
      const __m256 vd = _mm256_set1_ps(d);
      for (int i = 0; i < kVecs; i += 4) {
        __m256i q[4];
        for (int j = 0; j < 4; ++j) {
          __m256 f = _mm256_round_ps(_mm256_div_ps(v[i + j], vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          f = _mm256_min_ps(_mm256_max_ps(f, lo), hi);
          q[j] = _mm256_cvtps_epi32(f);
        }
        sums[i / 2] = hsum_epi32(_mm256_add_epi32(q[0], q[1]));
        sums[i / 2 + 1] = hsum_epi32(_mm256_add_epi32(q[2], q[3]));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + 8 * i), _mm256_permutevar8x32_epi32(p, perm));
      }
    }
    if (kBlock == kQK32) {
      reinterpret_cast<ActBlock32*>(o + b * sizeof(ActBlock32))->sum = sums[0] + sums[1];
    } else {
      auto* a = reinterpret_cast<ActBlockK*>(o + b * sizeof(ActBlockK));
      for (int i = 0; i < 16; ++i) a->bsums[i] = static_cast<int16_t>(sums[i]);
    }
  }
}

// ---------------------------------------------------------------- K formats

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
  __m256i mins;    // [m0, m0, m1, m1, ...]
  __m256i q6[4];   // q6_K: words 2i | 2i+1 of 8 words over the two lanes
};

const KConsts& kconsts() {
  static const KConsts consts = [] {
    KConsts k;
    alignas(32) int8_t m[32];
    for (int i = 0; i < 32; ++i) m[i] = (i % 2 == 0) ? static_cast<int8_t>(8 + i / 4) : static_cast<int8_t>(-128);
    k.mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
    for (int i = 0; i < 4; ++i) {
      alignas(32) int8_t q[32];
      for (int b = 0; b < 32; ++b) {
        const int word = b < 16 ? 2 * i : 2 * i + 1;
        q[b] = static_cast<int8_t>(2 * word + (b % 2));
      }
      k.q6[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(q));
    }
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

// Sub-block J (32 elements) of a q4_K / q5_K super-block against NT tokens.
template <bool kFive, int J, int NT>
inline void qk45_sub(const uint8_t* qs, __m256i qh, const uint32_t* sc_pairs, const uint8_t* const* aq,
                     __m256i* acc) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (J / 2)));
  __m256i w = (J % 2 == 0) ? _mm256_and_si256(raw, m4) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  if constexpr (kFive) w = _mm256_or_si256(w, q5_high<J>(qh));
  // [sc, sc] from memory: vpbroadcastd, a plain load.
  const __m256i sc = _mm256_set1_epi32(static_cast<int>(sc_pairs[J]));
  for (int t = 0; t < NT; ++t) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq[t] + 32 * J));
    acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), sc));
  }
}

template <bool kFive, int NT>
void qk45_row(const uint8_t* row, const uint8_t* const* act, size_t nsb, const KConsts& k, float* res) {
  constexpr size_t kBytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  __m256 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm256_setzero_ps();
  for (size_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * kBytes;
    prefetch_block<kBytes>(blk);
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
    const __m128i scm = unpack_scales_k4(scales);
    const __m256i scb = _mm256_broadcastsi128_si256(scm);
    // The scales as dwords [sc_j, sc_j], through memory for the broadcasts.
    const __m128i sw = _mm_cvtepu8_epi16(scm);
    alignas(32) uint32_t sc_pairs[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(sc_pairs), _mm_unpacklo_epi16(sw, sw));
    _mm_store_si128(reinterpret_cast<__m128i*>(sc_pairs + 4), _mm_unpackhi_epi16(sw, sw));
    asm("" : "+m"(sc_pairs));
    const uint8_t* aq[NT];
    for (int t = 0; t < NT; ++t) aq[t] = reinterpret_cast<const uint8_t*>((reinterpret_cast<const ActBlockK*>(act[t]) + s)->qs);
    __m256i acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_si256();
    qk45_sub<kFive, 0, NT>(qs, qh, sc_pairs, aq, acc);
    qk45_sub<kFive, 1, NT>(qs, qh, sc_pairs, aq, acc);
    qk45_sub<kFive, 2, NT>(qs, qh, sc_pairs, aq, acc);
    qk45_sub<kFive, 3, NT>(qs, qh, sc_pairs, aq, acc);
    qk45_sub<kFive, 4, NT>(qs, qh, sc_pairs, aq, acc);
    qk45_sub<kFive, 5, NT>(qs, qh, sc_pairs, aq, acc);
    qk45_sub<kFive, 6, NT>(qs, qh, sc_pairs, aq, acc);
    qk45_sub<kFive, 7, NT>(qs, qh, sc_pairs, aq, acc);
    const __m256i mins = _mm256_shuffle_epi8(scb, k.mins);
    const __m256 vd = _mm256_set1_ps(h2f(d16));
    const __m256 vdmin = _mm256_set1_ps(h2f(dmin16));
    for (int t = 0; t < NT; ++t) {
      const auto* a = reinterpret_cast<const ActBlockK*>(act[t]) + s;
      const __m256i ms = _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->bsums)));
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[t]), vd);
      v = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), vdmin, v);
      facc[t] = _mm256_fmadd_ps(v, _mm256_set1_ps(a->d), facc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = hsum_ps(facc[t]);
}

template <int NT>
void q6k_row(const uint8_t* row, const uint8_t* const* act, size_t nsb, const KConsts& k, float* res) {
  __m256 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i m30 = _mm256_set1_epi8(0x30);
  for (size_t s = 0; s < nsb; ++s) {
    const auto* b = reinterpret_cast<const BlockQ6K*>(row) + s;
    prefetch_block<sizeof(BlockQ6K)>(reinterpret_cast<const uint8_t*>(b));
    const uint8_t* aq[NT];
    for (int t = 0; t < NT; ++t) aq[t] = reinterpret_cast<const uint8_t*>((reinterpret_cast<const ActBlockK*>(act[t]) + s)->qs);
    __m256i acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h));
      const __m256i scb = _mm256_broadcastsi128_si256(
          _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->scales + 8 * h))));
      __m256i c[4];
      c[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
      c[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
      c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
      c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
      for (int i = 0; i < 4; ++i) {
        const __m256i sc = _mm256_shuffle_epi8(scb, k.q6[i]);
        for (int t = 0; t < NT; ++t) {
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq[t] + 128 * h + 32 * i));
          acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(c[i], a), sc));
        }
      }
    }
    const __m256i negsc = _mm256_mullo_epi16(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales))), _mm256_set1_epi16(-32));
    const __m256 vd = _mm256_set1_ps(h2f(b->d));
    for (int t = 0; t < NT; ++t) {
      const auto* a = reinterpret_cast<const ActBlockK*>(act[t]) + s;
      const __m256i comp = _mm256_madd_epi16(negsc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->bsums)));
      const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(acc[t], comp));
      facc[t] = _mm256_fmadd_ps(_mm256_mul_ps(p, _mm256_set1_ps(a->d)), vd, facc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = hsum_ps(facc[t]);
}

enum class Kind { kQ4K, kQ5K, kQ6K };

template <Kind K, int NT>
void k_row(const uint8_t* row, const uint8_t* const* act, size_t nsb, const KConsts& k, float* res) {
  if constexpr (K == Kind::kQ6K) {
    q6k_row<NT>(row, act, nsb, k, res);
  } else {
    qk45_row<K == Kind::kQ5K, NT>(row, act, nsb, k, res);
  }
}

inline size_t chunk_rows(size_t row_bytes) {
  const size_t r = row_bytes == 0 ? 1 : kChunkBytes / row_bytes;
  return r < 1 ? 1 : r;
}

template <Kind K>
void dot_rows_k(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const KConsts& k = kconsts();
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  const size_t chunk = chunk_rows(row_bytes);
  for (size_t r0 = 0; r0 < static_cast<size_t>(rows); r0 += chunk) {
    const size_t r1 = min_size(static_cast<size_t>(rows), r0 + chunk);
    for (int32_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
      const int nt = tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens;
      const uint8_t* ap[kMaxTokens];
      for (int t = 0; t < nt; ++t) ap[t] = ab + static_cast<size_t>(t0 + t) * act_bytes;
      for (size_t r = r0; r < r1; ++r) {
        const uint8_t* row = wb + r * row_bytes;
        float res[kMaxTokens];
        switch (nt) {
          case 1:
            k_row<K, 1>(row, ap, nsb, k, res);
            break;
          case 2:
            k_row<K, 2>(row, ap, nsb, k, res);
            break;
          case 3:
            k_row<K, 3>(row, ap, nsb, k, res);
            break;
          default:
            k_row<K, 4>(row, ap, nsb, k, res);
            break;
        }
        for (int t = 0; t < nt; ++t) out[static_cast<size_t>(t0 + t) * ld_out + r] = res[t];
      }
    }
  }
}

// ---------------------------------------------------------------- q8_0 / q4_0

// One token's activations for 8 blocks, transposed: dword j of a[k] holds
// qs[4k .. 4k+3] of block j; d and off (-offset * sum) lane j likewise.
struct Group8 {
  __m256i a[8];
  __m256 d;
  __m256i off;
};
static_assert(sizeof(Group8) == 320);

constexpr size_t kGroupBuffer = 144;  // 46 KB

// Loads 16 bytes at p + j * kStride for j < 8 and transposes them: dword j
// of out[k] is dword k of row j.
template <size_t kStride>
inline void transpose8(const uint8_t* p, __m256i* out) {
  __m256i z[4];
  for (int i = 0; i < 4; ++i) {
    z[i] = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * kStride))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (i + 4) * kStride)), 1);
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

template <int kOffset>
void prepare_groups(const ActBlock32* a, size_t nb, size_t g0, size_t ng, Group8* out, size_t stride) {
  for (size_t g = 0; g < ng; ++g) {
    const size_t b0 = (g0 + g) * 8;
    const size_t cnt = min_size(8, nb - b0);
    ActBlock32 tail[8];
    const ActBlock32* src = a + b0;
    if (cnt < 8) {
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, src, cnt * sizeof(ActBlock32));
      src = tail;
    }
    Group8& G = out[g * stride];
    const auto* p = reinterpret_cast<const uint8_t*>(src);
    transpose8<sizeof(ActBlock32)>(p + offsetof(ActBlock32, qs), G.a);
    transpose8<sizeof(ActBlock32)>(p + offsetof(ActBlock32, qs) + 16, G.a + 4);
    alignas(32) float d[8];
    alignas(32) int32_t off[8];
    for (int j = 0; j < 8; ++j) {
      d[j] = src[j].d;
      off[j] = -kOffset * src[j].sum;
    }
    G.d = _mm256_load_ps(d);
    G.off = _mm256_load_si256(reinterpret_cast<const __m256i*>(off));
  }
}

// 8 blocks of a q8_0 / q4_0 row at blk against NT tokens' groups.
template <bool kQ8, int NT>
inline void group32(const uint8_t* blk, const Group8* G, __m256* facc) {
  constexpr size_t kBytes = kQ8 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = G[t].off;
  if constexpr (kQ8) {
    for (int h = 0; h < 2; ++h) {
      __m256i wv[4];
      transpose8<kBytes>(blk + 2 + 16 * h, wv);
      for (int i = 0; i < 4; ++i) {
        const __m256i u = _mm256_abs_epi8(wv[i]);
        for (int t = 0; t < NT; ++t) {
          const __m256i a = _mm256_sign_epi8(G[t].a[4 * h + i], wv[i]);
          acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), ones));
        }
      }
    }
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i tv[4];
    transpose8<kBytes>(blk + 2, tv);
    // The int16 pair sums of all 8 products stay below 8 * 2 * 15 * 127.
    __m256i s16[NT];
    for (int t = 0; t < NT; ++t) s16[t] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i lo = _mm256_and_si256(tv[i], m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(tv[i], 4), m4);
      for (int t = 0; t < NT; ++t) {
        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(lo, G[t].a[i]));
        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(hi, G[t].a[i + 4]));
      }
    }
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(s16[t], ones));
  }
  constexpr int kB = static_cast<int>(kBytes);
  const __m256i idx = _mm256_setr_epi32(0, kB, 2 * kB, 3 * kB, 4 * kB, 5 * kB, 6 * kB, 7 * kB);
  const __m256i g = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk), idx, 1);
  const __m256i packed = _mm256_shuffle_epi8(
      g, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -128, -128, -128, -128, -128, -128, -128, -128, 0, 1, 4, 5, 8, 9,
                          12, 13, -128, -128, -128, -128, -128, -128, -128, -128));
  const __m256 dw = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
  for (int t = 0; t < NT; ++t) {
    facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), _mm256_mul_ps(dw, G[t].d), facc[t]);
  }
}

template <bool kQ8, int NT>
void q32_row(const uint8_t* row, size_t g0, size_t ng, size_t nb, const Group8* groups, float* res) {
  constexpr size_t kBytes = kQ8 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
  __m256 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm256_setzero_ps();
  for (size_t g = 0; g < ng; ++g) {
    const size_t b0 = (g0 + g) * 8;
    const uint8_t* blk = row + b0 * kBytes;
    if (b0 + 8 <= nb) {
      prefetch_block<8 * kBytes>(blk);
      group32<kQ8, NT>(blk, groups + g * NT, facc);
    } else {
      alignas(32) uint8_t tail[8 * kBytes];
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, blk, (nb - b0) * kBytes);
      group32<kQ8, NT>(tail, groups + g * NT, facc);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = hsum_ps(facc[t]);
}

template <bool kQ8>
void dot_rows_32(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                 size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nb = n / kQK32;
  if (nb == 0) return zero_out(rows, tokens, out, ld_out);
  const size_t ng_total = (nb + 7) / 8;
  Group8 buf[kGroupBuffer];
  for (int32_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const int nt = tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens;
    const size_t chunk_groups = kGroupBuffer / static_cast<size_t>(nt);
    for (size_t g0 = 0; g0 < ng_total; g0 += chunk_groups) {
      const size_t ng = min_size(chunk_groups, ng_total - g0);
      for (int t = 0; t < nt; ++t) {
        const auto* a = reinterpret_cast<const ActBlock32*>(ab + static_cast<size_t>(t0 + t) * act_bytes);
        prepare_groups<kQ8 ? 0 : 8>(a, nb, g0, ng, buf + t, static_cast<size_t>(nt));
      }
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        const uint8_t* row = wb + r * row_bytes;
        float res[kMaxTokens];
        switch (nt) {
          case 1:
            q32_row<kQ8, 1>(row, g0, ng, nb, buf, res);
            break;
          case 2:
            q32_row<kQ8, 2>(row, g0, ng, nb, buf, res);
            break;
          case 3:
            q32_row<kQ8, 3>(row, g0, ng, nb, buf, res);
            break;
          default:
            q32_row<kQ8, 4>(row, g0, ng, nb, buf, res);
            break;
        }
        for (int t = 0; t < nt; ++t) {
          float* o = out + static_cast<size_t>(t0 + t) * ld_out + r;
          *o = g0 == 0 ? res[t] : *o + res[t];
        }
      }
    }
  }
}

const QuantDotKernels kQ8_0 = {"q8_0-avx2", quantize<kQK32>, dot_rows_32<true>};
const QuantDotKernels kQ4_0 = {"q4_0-avx2", quantize<kQK32>, dot_rows_32<false>};
const QuantDotKernels kQ4_K = {"q4_k-avx2", quantize<kQKK>, dot_rows_k<Kind::kQ4K>};
const QuantDotKernels kQ5_K = {"q5_k-avx2", quantize<kQKK>, dot_rows_k<Kind::kQ5K>};
const QuantDotKernels kQ6_K = {"q6_k-avx2", quantize<kQKK>, dot_rows_k<Kind::kQ6K>};

}  // namespace

const QuantDotKernels* quant_dot_avx2(WeightType t) {
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
    default:
      return nullptr;
  }
}

}  // namespace colibri::kernels
