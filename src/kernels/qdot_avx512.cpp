// AVX-512 VNNI integer dot-product kernels (quant_dot.h), built with
// -mavx512f/bw/vl/dq -mavx512vnni -mavx2 -mfma -mf16c; qdot_scalar.cpp is
// the reference. Only called when cpu_has_avx512_vnni().
//
// K formats (q4_k, q5_k, q6_k): a super-block's codes are unpacked into
// four zmm of unsigned bytes; vpdpbusd multiplies them by the signed int8
// activations into dwords of four products (each dword within one
// sub-block, sums below 2^15), vpackssdw packs two such vectors into words
// and vpdpwssd multiplies the words by the integer sub-block scales and
// sums into int32, so a super-block costs one int32 -> float conversion and
// one FMA per token. The offsets go through the activations' sums: q4_k /
// q5_k's mins with vpmaddwd / vpdpwssd (four super-blocks in one vector),
// q6_k's -32 as one more vpdpwssd. q4_k / q5_k run four super-blocks per
// step (their scales unpacked together) against activations rearranged
// once per call (a stack buffer) into the order of the code vectors.
//
// q8_0 / q4_0 (a float scale per 32 weights): 16 blocks at a time are
// transposed so that dword j of each zmm holds four codes of block j; eight
// vpdpbusd then leave block j's whole integer product in lane j, and the
// 16 block scales multiply lane-wise (no horizontal sums). The activations
// are transposed the same way once per call into a stack buffer. q8_0's
// signed weights are made unsigned by adding 128 (xor 0x80), q4_0's codes
// are 0..15; the offsets (128, 8) times the blocks' activation sums are
// subtracted in the same lanes.
//
// Weight rows are prefetched far ahead into L2 and nearer into L1: with
// one token the kernels stream weights from DRAM at close to a plain read
// loop's rate (about 90% on the machine measured).
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

#define COLIBRI_UNROLL _Pragma("GCC unroll 16")

namespace colibri::kernels {
namespace {

// Bytes ahead of the current block that each row prefetches into L2 and
// into L1 (measured: a single-core stream from DRAM needs both).
constexpr size_t kPrefetchFar = 4096;
constexpr size_t kPrefetchNear = 1024;
// Tokens per pass over the weights.
constexpr int kMaxTokens = 4;
// Rows per chunk when several token blocks pass over it (kept in L2).
constexpr size_t kChunkBytes = 128 * 1024;

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// The results for n == 0 (no blocks): zeros.
inline void zero_out(int32_t rows, int32_t tokens, float* out, size_t ld_out) {
  for (int32_t t = 0; t < tokens; ++t) {
    for (int32_t r = 0; r < rows; ++r) out[static_cast<size_t>(t) * ld_out + static_cast<size_t>(r)] = 0.0f;
  }
}

// ---------------------------------------------------------------- activations

// The rule of qdot_scalar.cpp with the same float operations (exact
// division, round to nearest even), so the bits agree.
template <int kBlock>
void quantize(const float* x, size_t n_valid, size_t n, void* out) {
  constexpr int kVecs = kBlock / 16;
  const size_t nb = n / kBlock;
  auto* o = static_cast<uint8_t*>(out);
  const __m512 lo = _mm512_set1_ps(-127.0f);
  const __m512 hi = _mm512_set1_ps(127.0f);
  for (size_t b = 0; b < nb; ++b) {
    __m512 v[kVecs];
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < kVecs; ++i) {
      const size_t s = b * kBlock + 16 * static_cast<size_t>(i);
      if (s + 16 <= n_valid) {
        v[i] = _mm512_loadu_ps(x + s);
      } else if (s < n_valid) {
        v[i] = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n_valid - s)) - 1u), x + s);
      } else {
        v[i] = _mm512_setzero_ps();
      }
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
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
    int32_t sums[kVecs];
    if (d == 0.0f) {
      std::memset(qs, 0, kBlock);
      for (int i = 0; i < kVecs; ++i) sums[i] = 0;
    } else {
      const __m512 vd = _mm512_set1_ps(d);
      for (int i = 0; i < kVecs; ++i) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v[i], vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
        const __m512i qi = _mm512_cvtps_epi32(q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16 * i), _mm512_cvtepi32_epi8(qi));
        sums[i] = _mm512_reduce_add_epi32(qi);
      }
    }
    if (kBlock == kQK32) {
      reinterpret_cast<ActBlock32*>(o + b * sizeof(ActBlock32))->sum = sums[0] + sums[1];
    } else {
      auto* a = reinterpret_cast<ActBlockK*>(o + b * sizeof(ActBlockK));
      for (int i = 0; i < kVecs; ++i) a->bsums[i] = static_cast<int16_t>(sums[i]);
    }
  }
}

// ---------------------------------------------------------------- K formats

// A pshufb control or mask: lanes 0-1 from std_lane, lanes 2-3 from swp_lane.
inline __m512i lanes4(const int8_t (&std_lane)[16], const int8_t (&swp_lane)[16]) {
  alignas(64) int8_t c[64];
  for (int i = 0; i < 64; ++i) c[i] = i < 32 ? std_lane[i % 16] : swp_lane[i % 16];
  return _mm512_load_si512(c);
}

struct KConsts {
  // q4_K / q5_K scale unpacking (unpack_scales_k4).
  __m512i unpack_a, unpack_b, unpack_mask;
  // pshufb controls spreading a super-block's scales (broadcast to every
  // 128-bit lane) as words over the packed products of code vectors 0|1 and
  // 2|3 (see qk45_quads); [0]: scales in bytes 0-7, [1]: in bytes 8-15.
  __m512i scw01[2], scw23[2];
  __m512i q5bits[4];         // q5_K: the qh bit of each code vector, per 256-bit half
  __m512i sh42, sh02;        // q6_K: per-half shift counts
  // q6_K: vpermw indices spreading the 16 scale words over the packed
  // products of half 0 and half 1.
  __m512i q6[2];
  __m512i mins_factor;       // lanes of [d da, dmin da] x 4 super-blocks against the mins
};

const KConsts& kconsts() {
  static const KConsts consts = [] {
    KConsts k;
    // Super-blocks 0 and 1 of a quad unpack to [sc0-7, m0-7], 2 and 3 to
    // [m0-7, sc0-7] (so that the mins of all four meet the activation sums
    // in distinct dwords, qk45_quads).
    constexpr int8_t kZ = -128;
    const int8_t a_std[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11};
    const int8_t a_swp[16] = {4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11};
    const int8_t b_std[16] = {kZ, kZ, kZ, kZ, 0, 1, 2, 3, kZ, kZ, kZ, kZ, 4, 5, 6, 7};
    const int8_t b_swp[16] = {kZ, kZ, kZ, kZ, 4, 5, 6, 7, kZ, kZ, kZ, kZ, 0, 1, 2, 3};
    const int8_t m[16] = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15};
    k.unpack_a = lanes4(a_std, a_swp);
    k.unpack_b = lanes4(b_std, b_swp);
    k.unpack_mask = lanes4(m, m);
    // Lane L, words 0-3: the scale of code vector 2v's sub-block in lane L;
    // words 4-7: vector 2v+1's. Vector 0 holds sub-blocks 0 | 2 (lanes 0-1 | 2-3),
    // 1: 1 | 3, 2: 4 | 6, 3: 5 | 7.
    alignas(64) int8_t c[64];
    for (int base = 0; base < 2; ++base) {
      for (int v = 0; v < 2; ++v) {
        for (int i = 0; i < 64; ++i) {
          const int lane = i / 16, word = (i % 16) / 2;
          const int first = 4 * v + (lane < 2 ? 0 : 2);
          c[i] = (i % 2 == 0) ? static_cast<int8_t>(8 * base + (word < 4 ? first : first + 1)) : kZ;
        }
        (v == 0 ? k.scw01 : k.scw23)[base] = _mm512_load_si512(c);
      }
    }
    constexpr int kBits[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int v = 0; v < 4; ++v) {
      for (int i = 0; i < 64; ++i) c[i] = static_cast<int8_t>(1u << kBits[v][i / 32]);
      k.q5bits[v] = _mm512_load_si512(c);
    }
    alignas(64) int16_t s[32];
    for (int w = 0; w < 32; ++w) s[w] = w < 16 ? 4 : 2;
    k.sh42 = _mm512_load_si512(s);
    for (int w = 0; w < 32; ++w) s[w] = w < 16 ? 0 : 2;
    k.sh02 = _mm512_load_si512(s);
    // q6_K half h, lane L: words 0-3 sub-block 8h + L, words 4-7 sub-block 8h + 4 + L.
    for (int h = 0; h < 2; ++h) {
      for (int w = 0; w < 32; ++w) s[w] = static_cast<int16_t>(8 * h + (w / 8) + (w % 8 < 4 ? 0 : 4));
      k.q6[h] = _mm512_load_si512(s);
    }
    // The mins products: dwords 0-3 super-block 2, 4-7 block 0, 8-11 block 3, 12-15 block 1.
    k.mins_factor = _mm512_setr_epi32(5, 5, 5, 5, 1, 1, 1, 1, 7, 7, 7, 7, 3, 3, 3, 3);
    return k;
  }();
  return consts;
}

// The 8 six-bit scales and mins of four q4_K / q5_K super-blocks, one per
// 128-bit lane (ggml's get_scale_min_k4 for all j at once): lanes 0-1 as
// [sc0-7, m0-7], lanes 2-3 as [m0-7, sc0-7]. `raw` holds each one's 12
// scale bytes and 4 ignored ones.
inline __m512i unpack_scales_k4(__m512i raw, const KConsts& k) {
  // Low parts: sc0-3 = s[0-3] & 63, sc4-7 = s[8-11] & 15, m0-3 = s[4-7] & 63, m4-7 = s[8-11] >> 4.
  const __m512i a = _mm512_shuffle_epi8(raw, k.unpack_a);
  const __m512i low = _mm512_mask_blend_epi32(0x2288, a, _mm512_srli_epi16(a, 4));
  // High parts of sc4-7 and m4-7: the top two bits of s[0-3] and s[4-7].
  const __m512i b = _mm512_shuffle_epi8(raw, k.unpack_b);
  const __m512i high = _mm512_and_si512(_mm512_srli_epi16(b, 2), _mm512_set1_epi8(0x30));
  return _mm512_ternarylogic_epi32(low, high, k.unpack_mask, 0xec);  // (low & mask) | high
}

// One token's activations for a chunk of q4_K / q5_K super-blocks, laid out
// for the kernel (once per call, shared by all rows): each super-block's
// quants in the order of the weights' code vectors (sub-blocks 0, 2, 1, 3,
// 4, 6, 5, 7); per super-block 16 words holding its eight 32-element sums
// where its mins lie in the unpacked scale words (words 8-15 for blocks 0
// and 1 of a quad, 0-7 for blocks 2 and 3), zeros elsewhere; and per quad
// [d0, d0, d1, d1, d2, d2, d3, d3]. The chunk is padded with zero
// super-blocks to whole quads.
struct KPrep {
  int8_t* qs;    // [quads * 4][256]
  int16_t* bsx;  // [quads * 4][16]
  float* da8;    // [quads][8]
};

constexpr size_t kPrepBytesPerBlock = 256 + 32 + 8;
constexpr size_t kActBufferBytes = 64 * 1024;

void prepare_k45(const ActBlockK* a, size_t sb0, size_t nsb, size_t quads, const KPrep& p) {
  constexpr int kSrc[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (size_t i = 0; i < 4 * quads; ++i) {
    int8_t* qs = p.qs + 256 * i;
    int16_t* bsx = p.bsx + 16 * i;
    std::memset(bsx, 0, 32);
    float d = 0.0f;
    if (i < nsb) {
      const ActBlockK& b = a[sb0 + i];
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + 32 * j),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * kSrc[j])));
      }
      const int at = i % 4 < 2 ? 8 : 0;
      for (int j = 0; j < 8; ++j) bsx[at + j] = static_cast<int16_t>(b.bsums[2 * j] + b.bsums[2 * j + 1]);
      d = b.d;
    } else {
      std::memset(qs, 0, 256);
    }
    p.da8[2 * i] = d;
    p.da8[2 * i + 1] = d;
  }
}

// The code vectors of one q4_K / q5_K super-block: sub-blocks 0|2, 1|3, 4|6, 5|7.
template <bool kFive>
inline void codes_k45(const uint8_t* blk, const KConsts& k, __m512i* w) {
  const uint8_t* qs = kFive ? reinterpret_cast<const BlockQ5K*>(blk)->qs : reinterpret_cast<const BlockQ4K*>(blk)->qs;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i q0 = _mm512_loadu_si512(qs);
  const __m512i q1 = _mm512_loadu_si512(qs + 64);
  w[0] = _mm512_and_si512(q0, m4);
  w[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
  w[2] = _mm512_and_si512(q1, m4);
  w[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
  if constexpr (kFive) {
    // Bit j of qh[l] is bit 4 of sub-block j's element l.
    const __m512i qh = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const BlockQ5K*>(blk)->qh)));
    const __m512i m10 = _mm512_set1_epi8(0x10);
    for (int v = 0; v < 4; ++v) w[v] = _mm512_mask_add_epi8(w[v], _mm512_test_epi8_mask(qh, k.q5bits[v]), w[v], m10);
  }
}

template <size_t kBytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (size_t o = 0; o < kBytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchFar + o), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchNear + o), _MM_HINT_T0);
  }
}

// Forces `v` through memory, so that broadcasts of its elements become
// embedded-broadcast memory operands instead of shuffles.
template <typename T>
inline void through_memory(T& v) {
  asm("" : "+m"(v));
}

// Quads of q4_K / q5_K super-blocks of one row against NT tokens.
//
// Products: vpdpbusd of each code vector (sub-blocks 0|2, 1|3, 4|6, 5|7)
// with the matching quants leaves 4-product sums in dwords, eight per
// sub-block (below 2^15: 4 * 31 * 127); vpackssdw packs vectors 0 and 1
// (and 2 and 3) into words, so each 128-bit lane holds four words of one
// sub-block and four of another, and vpdpwssd multiplies them by the
// sub-blocks' scales, spread by one pshufb per packed vector. One int32 ->
// float conversion and FMA per super-block and token; the mins of all four
// super-blocks in one vector.
// kPrefetch: false for a copy of the row's tail on the stack.
template <bool kFive, int NT, bool kPrefetch = true>
void qk45_quads(const uint8_t* row, size_t quads, const KPrep* prep, const KConsts& k, __m512* facc_io) {
  constexpr size_t kBytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  __m512 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = facc_io[t];
  for (size_t q = 0; q < quads; ++q) {
    const uint8_t* blk = row + 4 * q * kBytes;
    if constexpr (kPrefetch) prefetch_ahead<4 * kBytes>(blk);
    // The four super-blocks' scales and mins (16 bytes each) ...
    __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
    raw = _mm512_mask_broadcast_i32x4(raw, 0x00f0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBytes + 4)));
    raw = _mm512_mask_broadcast_i32x4(raw, 0x0f00,
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * kBytes + 4)));
    raw = _mm512_mask_broadcast_i32x4(raw, 0xf000,
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 3 * kBytes + 4)));
    alignas(64) uint8_t unpacked[64];
    _mm512_store_si512(unpacked, unpack_scales_k4(raw, k));
    through_memory(unpacked);
    const __m512i sm01 = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(unpacked)));
    const __m512i sm23 = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(unpacked + 32)));
    // ... and [d, dmin] x 4.
    uint32_t dd[4];
    for (int i = 0; i < 4; ++i) std::memcpy(&dd[i], blk + i * kBytes, 4);
    const __m256 ddf = _mm256_cvtph_ps(
        _mm_set_epi64x(static_cast<long long>(dd[2] | static_cast<uint64_t>(dd[3]) << 32),
                       static_cast<long long>(dd[0] | static_cast<uint64_t>(dd[1]) << 32)));
    __m512i acc[4][NT];
    for (int i = 0; i < 4; ++i) {
      __m512i w[4];
      codes_k45<kFive>(blk + i * kBytes, k, w);
      const __m512i b = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(unpacked + 16 * i)));
      const __m512i sc01 = _mm512_shuffle_epi8(b, k.scw01[i / 2]);
      const __m512i sc23 = _mm512_shuffle_epi8(b, k.scw23[i / 2]);
      for (int t = 0; t < NT; ++t) {
        const int8_t* aq = prep[t].qs + (4 * q + i) * 256;
        const __m512i z = _mm512_setzero_si512();
        const __m512i d0 = _mm512_dpbusd_epi32(z, w[0], _mm512_loadu_si512(aq));
        const __m512i d1 = _mm512_dpbusd_epi32(z, w[1], _mm512_loadu_si512(aq + 64));
        const __m512i d2 = _mm512_dpbusd_epi32(z, w[2], _mm512_loadu_si512(aq + 128));
        const __m512i d3 = _mm512_dpbusd_epi32(z, w[3], _mm512_loadu_si512(aq + 192));
        acc[i][t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(z, _mm512_packs_epi32(d0, d1), sc01),
                                        _mm512_packs_epi32(d2, d3), sc23);
      }
    }
    for (int t = 0; t < NT; ++t) {
      // [d da, dmin da] x 4 through memory, for the FMAs' broadcasts.
      const __m256 y = _mm256_mul_ps(ddf, _mm256_loadu_ps(prep[t].da8 + 8 * q));
      alignas(32) float ys[8];
      _mm256_store_ps(ys, y);
      through_memory(ys);
      __m512 f = facc[t];
      for (int i = 0; i < 4; ++i) f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][t]), _mm512_set1_ps(ys[2 * i]), f);
      const int16_t* bs = prep[t].bsx + 64 * q;
      const __m512i mins = _mm512_dpwssd_epi32(_mm512_madd_epi16(sm01, _mm512_loadu_si512(bs)), sm23,
                                               _mm512_loadu_si512(bs + 32));
      facc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins),
                                 _mm512_permutexvar_ps(k.mins_factor, _mm512_castps256_ps512(y)), f);
    }
  }
  for (int t = 0; t < NT; ++t) facc_io[t] = facc[t];
}

template <bool kFive, bool kPrefetch>
void qk45_quads_nt(int nt, const uint8_t* row, size_t quads, const KPrep* prep, const KConsts& k, __m512* facc) {
  switch (nt) {
    case 1:
      qk45_quads<kFive, 1, kPrefetch>(row, quads, prep, k, facc);
      break;
    case 2:
      qk45_quads<kFive, 2, kPrefetch>(row, quads, prep, k, facc);
      break;
    case 3:
      qk45_quads<kFive, 3, kPrefetch>(row, quads, prep, k, facc);
      break;
    default:
      qk45_quads<kFive, 4, kPrefetch>(row, quads, prep, k, facc);
      break;
  }
}

template <bool kFive>
void dot_rows_k45(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                  size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  constexpr size_t kBytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  const KConsts& k = kconsts();
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  if (nsb == 0) return zero_out(rows, tokens, out, ld_out);
  alignas(64) uint8_t buf[kActBufferBytes];
  for (int32_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const int nt = tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens;
    // Super-blocks per column chunk: whole quads whose prepared activations fit.
    const size_t chunk = kActBufferBytes / (kPrepBytesPerBlock * static_cast<size_t>(nt)) & ~size_t{3};
    for (size_t c0 = 0; c0 < nsb; c0 += chunk) {
      const size_t cn = min_size(chunk, nsb - c0);
      const size_t quads = (cn + 3) / 4;
      KPrep prep[kMaxTokens];
      uint8_t* q = buf;
      for (int t = 0; t < nt; ++t) {
        prep[t].qs = reinterpret_cast<int8_t*>(q);
        q += quads * 4 * 256;
        prep[t].bsx = reinterpret_cast<int16_t*>(q);
        q += quads * 4 * 32;
        prep[t].da8 = reinterpret_cast<float*>(q);
        q += quads * 32;
        prepare_k45(reinterpret_cast<const ActBlockK*>(ab + static_cast<size_t>(t0 + t) * act_bytes), c0, cn, quads,
                    prep[t]);
      }
      const size_t full = cn / 4;
      const size_t rest = cn % 4;
      KPrep last[kMaxTokens];
      for (int t = 0; t < nt; ++t) {
        last[t].qs = prep[t].qs + full * 4 * 256;
        last[t].bsx = prep[t].bsx + full * 4 * 16;
        last[t].da8 = prep[t].da8 + full * 8;
      }
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        const uint8_t* row = wb + r * row_bytes + c0 * kBytes;
        __m512 facc[kMaxTokens];
        for (int t = 0; t < kMaxTokens; ++t) facc[t] = _mm512_setzero_ps();
        qk45_quads_nt<kFive, true>(nt, row, full, prep, k, facc);
        if (rest != 0) {
          // The last super-blocks, with zero ones to a whole quad.
          alignas(64) uint8_t tail[4 * kBytes];
          std::memset(tail, 0, sizeof tail);
          std::memcpy(tail, row + full * 4 * kBytes, rest * kBytes);
          qk45_quads_nt<kFive, false>(nt, tail, 1, last, k, facc);
        }
        for (int t = 0; t < nt; ++t) {
          float* o = out + static_cast<size_t>(t0 + t) * ld_out + r;
          const float v = _mm512_reduce_add_ps(facc[t]);
          *o = c0 == 0 ? v : *o + v;
        }
      }
    }
  }
}

// One q6_K row against NT tokens: the products as in qk45_quads (codes
// below 64: the 4-product sums stay below 2^15), the -32 offset as one
// vpdpwssd of the bsums with -32 times the scales.
template <int NT>
void q6k_row(const uint8_t* row, const uint8_t* const* act, size_t nsb, const KConsts& k, float* res) {
  __m512 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i m30 = _mm512_set1_epi8(0x30);
  for (size_t s = 0; s < nsb; ++s) {
    const auto* b = reinterpret_cast<const BlockQ6K*>(row) + s;
    prefetch_ahead<sizeof(BlockQ6K)>(reinterpret_cast<const uint8_t*>(b));
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
    const __m512i scz = _mm512_castsi256_si512(sc16);
    const __m512i sc0 = _mm512_permutexvar_epi16(k.q6[0], scz);
    const __m512i sc1 = _mm512_permutexvar_epi16(k.q6[1], scz);
    const __m512i negsc = _mm512_zextsi256_si512(_mm256_mullo_epi16(sc16, _mm256_set1_epi16(-32)));
    __m512i e[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(b->ql + 64 * h);
      const __m512i qh =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h)));
      // Elements 0-31 / 32-63 of the half: low nibbles, qh bits 0-1 / 2-3.
      e[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(l, m4), _mm512_sllv_epi16(qh, k.sh42), m30, 0xf8);
      // Elements 64-95 / 96-127: high nibbles, qh bits 4-5 / 6-7.
      e[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                               _mm512_srlv_epi16(qh, k.sh02), m30, 0xf8);
    }
    const float d = h2f(b->d);
    for (int t = 0; t < NT; ++t) {
      const auto* a = reinterpret_cast<const ActBlockK*>(act[t]) + s;
      const int8_t* aq = a->qs;
      const __m512i z = _mm512_setzero_si512();
      const __m512i d0 = _mm512_dpbusd_epi32(z, e[0], _mm512_loadu_si512(aq));
      const __m512i d1 = _mm512_dpbusd_epi32(z, e[1], _mm512_loadu_si512(aq + 64));
      const __m512i d2 = _mm512_dpbusd_epi32(z, e[2], _mm512_loadu_si512(aq + 128));
      const __m512i d3 = _mm512_dpbusd_epi32(z, e[3], _mm512_loadu_si512(aq + 192));
      // The codes' offset: -32 * sum_s sc_s * bsums_s.
      __m512i acc = _mm512_dpwssd_epi32(
          z, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->bsums))), negsc);
      acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(d0, d1), sc0);
      acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(d2, d3), sc1);
      float dda = d * a->d;
      through_memory(dda);
      facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(dda), facc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(facc[t]);
}

inline size_t chunk_rows(size_t row_bytes) {
  const size_t r = row_bytes == 0 ? 1 : kChunkBytes / row_bytes;
  return r < 1 ? 1 : r;
}

void dot_rows_q6k(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
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
            q6k_row<1>(row, ap, nsb, k, res);
            break;
          case 2:
            q6k_row<2>(row, ap, nsb, k, res);
            break;
          case 3:
            q6k_row<3>(row, ap, nsb, k, res);
            break;
          default:
            q6k_row<4>(row, ap, nsb, k, res);
            break;
        }
        for (int t = 0; t < nt; ++t) out[static_cast<size_t>(t0 + t) * ld_out + r] = res[t];
      }
    }
  }
}

// ---------------------------------------------------------------- q8_0 / q4_0

// One token's activations for 16 blocks, transposed: dword j of a[k] holds
// qs[4k .. 4k+3] of block j; d and off (-offset * sum) lane j likewise.
struct Group16 {
  __m512i a[8];
  __m512 d;
  __m512i off;
};
static_assert(sizeof(Group16) == 640);

// Stack buffer of transposed activations: tokens x groups per column chunk.
constexpr size_t kGroupBuffer = 72;  // 46 KB

// Loads 16 bytes at p + j * kStride for j < 16 and transposes them:
// dword j of out[k] is dword k of row j.
template <size_t kStride>
inline void transpose16(const uint8_t* p, __m512i* out) {
  __m512i z[4];
  // Masked broadcasts from memory rather than inserts: they run on either
  // vector port, and the unpacks below already load the shuffle port.
  COLIBRI_UNROLL
  for (int i = 0; i < 4; ++i) {
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * kStride)));
    v = _mm512_mask_broadcast_i32x4(v, 0x00f0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (i + 4) * kStride)));
    v = _mm512_mask_broadcast_i32x4(v, 0x0f00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (i + 8) * kStride)));
    v = _mm512_mask_broadcast_i32x4(v, 0xf000, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (i + 12) * kStride)));
    z[i] = v;
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]);
  const __m512i t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]);
  const __m512i t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Groups [g0, g0 + ng) of one token's blocks (nb in all) into out[g * stride].
template <int kOffset>
void prepare_groups(const ActBlock32* a, size_t nb, size_t g0, size_t ng, Group16* out, size_t stride) {
  for (size_t g = 0; g < ng; ++g) {
    const size_t b0 = (g0 + g) * 16;
    const size_t cnt = min_size(16, nb - b0);
    ActBlock32 tail[16];
    const ActBlock32* src = a + b0;
    if (cnt < 16) {
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, src, cnt * sizeof(ActBlock32));
      src = tail;
    }
    Group16& G = out[g * stride];
    const auto* p = reinterpret_cast<const uint8_t*>(src);
    transpose16<sizeof(ActBlock32)>(p + offsetof(ActBlock32, qs), G.a);
    transpose16<sizeof(ActBlock32)>(p + offsetof(ActBlock32, qs) + 16, G.a + 4);
    alignas(64) float d[16];
    alignas(64) int32_t off[16];
    for (int j = 0; j < 16; ++j) {
      d[j] = src[j].d;
      off[j] = -kOffset * src[j].sum;
    }
    G.d = _mm512_load_ps(d);
    G.off = _mm512_load_si512(off);
  }
}

// 16 blocks of a q8_0 / q4_0 row at blk against NT tokens' groups.
template <bool kQ8, int NT>
inline void group32(const uint8_t* blk, const Group16* G, __m512* facc) {
  constexpr size_t kBytes = kQ8 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
  __m512i v[8];
  if constexpr (kQ8) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    transpose16<kBytes>(blk + 2, v);
    transpose16<kBytes>(blk + 18, v + 4);
    for (int i = 0; i < 8; ++i) v[i] = _mm512_xor_si512(v[i], bias);  // q + 128
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i t[4];
    transpose16<kBytes>(blk + 2, t);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm512_and_si512(t[i], m4);
      v[i + 4] = _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m4);
    }
  }
  // The 16 f16 scales: dword j at byte j * kBytes holds block j's d in its low half.
  constexpr int kB = static_cast<int>(kBytes);
  const __m512i idx = _mm512_setr_epi32(0, kB, 2 * kB, 3 * kB, 4 * kB, 5 * kB, 6 * kB, 7 * kB, 8 * kB, 9 * kB,
                                        10 * kB, 11 * kB, 12 * kB, 13 * kB, 14 * kB, 15 * kB);
  const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(idx, blk, 1)));
  for (int t = 0; t < NT; ++t) {
    const Group16& g = G[t];
    __m512i acc0 = _mm512_dpbusd_epi32(g.off, v[0], g.a[0]);
    __m512i acc1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[1], g.a[1]);
    acc0 = _mm512_dpbusd_epi32(acc0, v[2], g.a[2]);
    acc1 = _mm512_dpbusd_epi32(acc1, v[3], g.a[3]);
    acc0 = _mm512_dpbusd_epi32(acc0, v[4], g.a[4]);
    acc1 = _mm512_dpbusd_epi32(acc1, v[5], g.a[5]);
    acc0 = _mm512_dpbusd_epi32(acc0, v[6], g.a[6]);
    acc1 = _mm512_dpbusd_epi32(acc1, v[7], g.a[7]);
    const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(acc0, acc1));
    facc[t] = _mm512_fmadd_ps(p, _mm512_mul_ps(dw, g.d), facc[t]);
  }
}

// Groups [g0, g0 + ng) of one row; the last may be partial (tail blocks).
template <bool kQ8, int NT>
void q32_row(const uint8_t* row, size_t g0, size_t ng, size_t nb, const Group16* groups, float* res) {
  constexpr size_t kBytes = kQ8 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
  __m512 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm512_setzero_ps();
  for (size_t g = 0; g < ng; ++g) {
    const size_t b0 = (g0 + g) * 16;
    const uint8_t* blk = row + b0 * kBytes;
    if (b0 + 16 <= nb) {
      prefetch_ahead<16 * kBytes>(blk);
      group32<kQ8, NT>(blk, groups + g * NT, facc);
    } else {
      alignas(64) uint8_t tail[16 * kBytes];
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, blk, (nb - b0) * kBytes);
      group32<kQ8, NT>(tail, groups + g * NT, facc);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(facc[t]);
}

template <bool kQ8>
void dot_rows_32(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                 size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nb = n / kQK32;
  if (nb == 0) return zero_out(rows, tokens, out, ld_out);
  const size_t ng_total = (nb + 15) / 16;
  Group16 buf[kGroupBuffer];
  for (int32_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const int nt = tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens;
    const size_t chunk_groups = kGroupBuffer / static_cast<size_t>(nt);
    for (size_t g0 = 0; g0 < ng_total; g0 += chunk_groups) {
      const size_t ng = min_size(chunk_groups, ng_total - g0);
      for (int t = 0; t < nt; ++t) {
        const auto* a = reinterpret_cast<const ActBlock32*>(ab + static_cast<size_t>(t0 + t) * act_bytes);
        prepare_groups<kQ8 ? 128 : 8>(a, nb, g0, ng, buf + t, static_cast<size_t>(nt));
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

const QuantDotKernels kQ8_0 = {"q8_0-avx512-vnni", quantize<kQK32>, dot_rows_32<true>};
const QuantDotKernels kQ4_0 = {"q4_0-avx512-vnni", quantize<kQK32>, dot_rows_32<false>};
const QuantDotKernels kQ4_K = {"q4_k-avx512-vnni", quantize<kQKK>, dot_rows_k45<false>};
const QuantDotKernels kQ5_K = {"q5_k-avx512-vnni", quantize<kQKK>, dot_rows_k45<true>};
const QuantDotKernels kQ6_K = {"q6_k-avx512-vnni", quantize<kQKK>, dot_rows_q6k};

}  // namespace

const QuantDotKernels* quant_dot_avx512(WeightType t) {
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
