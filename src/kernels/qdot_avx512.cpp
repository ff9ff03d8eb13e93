// AVX-512 VNNI integer dot-product kernels (quant_dot.h), built with
// -mavx512f/bw/vl/dq -mavx512vnni -mavx2 -mfma -mf16c; qdot_scalar.cpp is
// the reference. Only called when cpu_has_avx512_vnni().
//
// K formats (q4_k, q5_k, q6_k), against activations with a float scale per
// 32: a super-block's codes are unpacked into four zmm of unsigned bytes
// and transposed per 128-bit lane (transpose4x4, or for q4_k one vpermt2d
// per vector), so that every dword lane always holds codes of the same
// sub-block; four vpdpbusd against the activations, rearranged the same
// way once per call (a stack buffer), then leave in each lane an exact
// integer product of its sub-block alone, and per token and super-block
// one int32 -> float conversion, one multiply by the lanes' activation
// scales and one FMA with the lanes' d * sc finish it (the 32-element
// blocks' float multiply-adds, sixteen lanes at once). The offsets go
// through the activations' sums: q6_k's -32 as vpdpbusd's starting value,
// q4_k / q5_k's mins as one FMA of dmin * m_j with dx_j * (sum a)_j per two
// super-blocks. q4_k / q5_k run four super-blocks per step (their scales
// unpacked together).
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
// fp8_e4m3 (fp32 activations): qdot_fp8_impl.h's kernel on zmm, the
// codes widened exactly through f16, 4 rows x 4 tokens a pass.
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
#include <utility>

#include "kernels/quant_dot.h"
#include "kernels/qdot_fp8_impl.h"
#include "kernels/x86_intrinsics.h"
#include "util/quant_blocks.h"

#define COLIBRI_UNROLL _Pragma("GCC unroll 16")

namespace colibri::kernels {
namespace {

// Bytes ahead of the current block that each row prefetches into L2 and
// into L1 (measured: a single-core stream from DRAM needs both). 8 KiB
// for L2: q4_K decode on Zen 5 read 46-49 GB/s on 2 threads against 44-46
// at 4 KiB, and 45-47 at 12 or 16 KiB (colibri bench --tokens 1, olmoe and
// qwen3-moe shapes, binaries interleaved).
constexpr size_t kPrefetchFar = 8192;
constexpr size_t kPrefetchNear = 1024;
// Tokens per pass over the weights: each code vector, once unpacked, meets
// up to eight tokens (the accumulators and codes still fit the 32 zmm).
constexpr int kMaxTokens = 8;

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// The results for n == 0 (no blocks): zeros.
inline void zero_out(int32_t rows, int32_t tokens, float* out, size_t ld_out) {
  for (int32_t t = 0; t < tokens; ++t) {
    for (int32_t r = 0; r < rows; ++r) out[static_cast<size_t>(t) * ld_out + static_cast<size_t>(r)] = 0.0f;
  }
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
  const __m512 lo = _mm512_set1_ps(-127.0f);
  const __m512 hi = _mm512_set1_ps(127.0f);
  for (size_t b = 0; b < nb; ++b) {
    __m512 v[2];
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < 2; ++i) {
      const size_t s = b * kActBlock + 16 * static_cast<size_t>(i);
      if (s + 16 <= n_valid) {
        v[i] = _mm512_loadu_ps(x + s);
      } else if (s < n_valid) {
        v[i] = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n_valid - s)) - 1u), x + s);
      } else {
        v[i] = _mm512_setzero_ps();
      }
      amax = _mm512_max_ps(_mm512_abs_ps(v[i]), amax);
    }
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    std::memcpy(o + n + b * sizeof(float), &d, sizeof d);
    int8_t* qs = reinterpret_cast<int8_t*>(o + b * kActBlock);
    int16_t sums[2] = {0, 0};
    if (d == 0.0f) {
      std::memset(qs, 0, kActBlock);
    } else {
      const __m512 vd = _mm512_set1_ps(d);
      for (int i = 0; i < 2; ++i) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v[i], vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
        const __m512i qi = _mm512_cvtps_epi32(q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16 * i), _mm512_cvtepi32_epi8(qi));
        sums[i] = static_cast<int16_t>(_mm512_reduce_add_epi32(qi));
      }
    }
    std::memcpy(o + n + n / 8 + 2 * b * sizeof(int16_t), sums, sizeof sums);
  }
}

// ---------------------------------------------------------------- K formats

// Four vectors whose 128-bit lanes each hold four dwords of one sub-block,
// transposed per lane: out[k] dword 4L + v = in[v] dword 4L + k. Dword lane
// 4L + v of every out[k] then holds data of the sub-block in in[v]'s lane
// L, so vpdpbusd over out[0..3] sums each lane's sub-block apart from the
// others, and one vector of per-lane float factors applies the scales.
inline void transpose4x4(const __m512i* in, __m512i* out) {
  const __m512i t0 = _mm512_unpacklo_epi32(in[0], in[1]);
  const __m512i t1 = _mm512_unpackhi_epi32(in[0], in[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(in[2], in[3]);
  const __m512i t3 = _mm512_unpackhi_epi32(in[2], in[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

struct KConsts {
  // q4_K / q5_K scale unpacking (unpack_scales_k4).
  __m512i unpack_a, unpack_b, unpack_mask;
  __m512i dd_lanes;          // vpermd: the four super-blocks' [d, dmin] into the low 128 bits
  __m512i q4_r[4];           // q4_K: vpermt2d of the two code vectors into lane order (codes_q4k_lanes)
  __m512i q4_nib;            // q4_K: the low nibbles in even lanes, the high ones (times 16) in odd lanes
  __m512i sc_lanes;          // pshufb: byte 4L + v = scale of the sub-block of lane 4L + v (k45_sub)
  __m512i mins_q;            // vpermq: the four super-blocks' mins into the low 256 bits
  __m512i dx_lanes;          // vpermps: the activation scale of each lane's sub-block
  __m512i dmin01, dmin23;    // vpermps: [dmin_0 x 8, dmin_1 x 8], [dmin_2 x 8, dmin_3 x 8]
  __m512i q5bits[4];         // q5_K: the qh bit of each code vector, per 256-bit half
  __m512i sh42, sh02;        // q6_K: per-half shift counts
  __m512i q6_lanes;          // q6_K: vpermd, lane 4L + v <- sub-block 4v + L
  __m512i q6_dx;             // q6_K: vpermps, lane 4L + v <- activation block (4v + L) / 2
  __m128i q6_sc;             // q6_K: pshufb, byte 4L + v <- scale 4v + L
};

// The sub-block of q4_K / q5_K lane 4L + v (v: code vector, L: 128-bit
// lane): code vector v holds sub-blocks (0|2, 1|3, 4|6, 5|7)[v] in its
// 256-bit halves.
constexpr int k45_sub(int lane) {
  constexpr int kLow[4] = {0, 1, 4, 5};
  return kLow[lane % 4] + ((lane / 4) >= 2 ? 2 : 0);
}

const KConsts& kconsts() {
  static const KConsts consts = [] {
    KConsts k;
    // Every 128-bit lane ([d, dmin, 12 scale bytes]) unpacks to [sc0-7, m0-7].
    constexpr int8_t kZ = -128;
    alignas(64) int8_t c[64];
    const int8_t a[16] = {4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15};
    const int8_t b[16] = {kZ, kZ, kZ, kZ, 4, 5, 6, 7, kZ, kZ, kZ, kZ, 8, 9, 10, 11};
    const int8_t m[16] = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15};
    for (int i = 0; i < 64; ++i) c[i] = a[i % 16];
    k.unpack_a = _mm512_load_si512(c);
    for (int i = 0; i < 64; ++i) c[i] = b[i % 16];
    k.unpack_b = _mm512_load_si512(c);
    for (int i = 0; i < 64; ++i) c[i] = m[i % 16];
    k.unpack_mask = _mm512_load_si512(c);
    for (int i = 0; i < 64; ++i) c[i] = static_cast<int8_t>(k45_sub(i % 16));
    k.sc_lanes = _mm512_load_si512(c);
    k.mins_q = _mm512_setr_epi64(1, 3, 5, 7, 1, 3, 5, 7);
    k.dd_lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
    alignas(64) int32_t l[16];
    // Lane 4L + v of transposed vector j: dword 4L + j of code vector v,
    // whose bytes are those of q0 (v < 2) or q1 (v >= 2).
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 16; ++i) l[i] = (i % 4 < 2 ? 0 : 16) + 4 * (i / 4) + j;
      k.q4_r[j] = _mm512_load_si512(l);
    }
    for (int i = 0; i < 16; ++i) l[i] = i % 2 == 0 ? 0x0f0f0f0f : static_cast<int32_t>(0xf0f0f0f0u);
    k.q4_nib = _mm512_load_si512(l);
    for (int i = 0; i < 16; ++i) l[i] = k45_sub(i);
    k.dx_lanes = _mm512_load_si512(l);
    for (int i = 0; i < 16; ++i) l[i] = i < 8 ? 1 : 3;
    k.dmin01 = _mm512_load_si512(l);
    for (int i = 0; i < 16; ++i) l[i] = i < 8 ? 5 : 7;
    k.dmin23 = _mm512_load_si512(l);
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
    // q6_K: code vector v holds sub-blocks 4v .. 4v + 3, one per 128-bit lane.
    for (int i = 0; i < 16; ++i) l[i] = 4 * (i % 4) + i / 4;
    k.q6_lanes = _mm512_load_si512(l);
    for (int i = 0; i < 16; ++i) l[i] = (4 * (i % 4) + i / 4) / 2;
    k.q6_dx = _mm512_load_si512(l);
    alignas(16) int8_t q[16];
    for (int i = 0; i < 16; ++i) q[i] = static_cast<int8_t>(4 * (i % 4) + i / 4);
    k.q6_sc = _mm_load_si128(reinterpret_cast<const __m128i*>(q));
    return k;
  }();
  return consts;
}

// The 8 six-bit scales and mins of four q4_K / q5_K super-blocks, one per
// 128-bit lane as [sc0-7, m0-7] (ggml's get_scale_min_k4 for all j at
// once). `raw` holds each one's first 16 bytes: d, dmin, the 12 scale bytes.
inline __m512i unpack_scales_k4(__m512i raw, const KConsts& k) {
  // Low parts (s = the scale bytes, from byte 4): sc0-3 = s[0-3] & 63,
  // sc4-7 = s[8-11] & 15, m0-3 = s[4-7] & 63, m4-7 = s[8-11] >> 4.
  const __m512i a = _mm512_shuffle_epi8(raw, k.unpack_a);
  const __m512i low = _mm512_mask_blend_epi32(0x8888, a, _mm512_srli_epi16(a, 4));
  // High parts of sc4-7 and m4-7: the top two bits of s[0-3] and s[4-7].
  const __m512i b = _mm512_shuffle_epi8(raw, k.unpack_b);
  const __m512i high = _mm512_and_si512(_mm512_srli_epi16(b, 2), _mm512_set1_epi8(0x30));
  return _mm512_ternarylogic_epi32(low, high, k.unpack_mask, 0xec);  // (low & mask) | high
}

// One token's activations for a chunk of super-blocks in the kernels'
// order (once per call, shared by all rows), per super-block:
//   qs:   its 256 quants transposed as the code vectors are (transpose4x4);
//   dx:   16 floats, lane 4L + v: the scale of the activation block that
//         lane's products belong to;
//   q4_K / q5_K: s = 8 floats, dx_j * (sum of sub-block j's quants), for the mins;
//   q6_K: init = 16 int32, -32 * (sum of the quants of lane 4L + v's
//         sub-block), the codes' offset as vpdpbusd's starting value.
// q4_K / q5_K chunks are padded with zero super-blocks to whole quads.
struct KPrep {
  int8_t* qs;
  float* dx;
  float* s;
  int32_t* init;
};

constexpr size_t kK45PrepBytes = 256 + 64 + 32;
constexpr size_t kQ6PrepBytes = 256 + 64 + 64;
constexpr size_t kActBufferBytes = 64 * 1024;

inline __m512i concat256(const uint8_t* lo, const uint8_t* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

enum class Kind { kQ4K, kQ5K, kQ6K };

template <Kind K>
void prepare_k(const uint8_t* act, size_t n, size_t sb0, size_t cn, size_t padded, const KPrep& p, const KConsts& k) {
  constexpr bool kQ6 = K == Kind::kQ6K;
  const uint8_t* dsrc = act_d(act, n);
  const uint8_t* ssrc = act_sums(act, n);
  for (size_t i = 0; i < padded; ++i) {
    int8_t* qs = p.qs + 256 * i;
    if (i >= cn) {
      std::memset(qs, 0, 256);
      std::memset(p.dx + 16 * i, 0, 64);
      if constexpr (kQ6) {
        std::memset(p.init + 16 * i, 0, 64);
      } else {
        std::memset(p.s + 8 * i, 0, 32);
      }
      continue;
    }
    const size_t b = sb0 + i;
    const uint8_t* q = act + 256 * b;
    __m512i v[4];
    if constexpr (kQ6) {
      for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(q + 64 * j);
    } else {
      // As the code vectors: sub-blocks 0|2, 1|3, 4|6, 5|7.
      v[0] = concat256(q, q + 64);
      v[1] = concat256(q + 32, q + 96);
      v[2] = concat256(q + 128, q + 192);
      v[3] = concat256(q + 160, q + 224);
    }
    __m512i t[4];
    transpose4x4(v, t);
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(qs + 64 * j, t[j]);
    const __m256 dx8 = _mm256_loadu_ps(reinterpret_cast<const float*>(dsrc + 32 * b));
    const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ssrc + 32 * b));
    if constexpr (kQ6) {
      _mm512_storeu_ps(p.dx + 16 * i, _mm512_permutexvar_ps(k.q6_dx, _mm512_castps256_ps512(dx8)));
      const __m512i s = _mm512_permutexvar_epi32(k.q6_lanes, _mm512_cvtepi16_epi32(s16));
      _mm512_storeu_si512(p.init + 16 * i, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 5)));
    } else {
      __m512 dx = _mm512_permutexvar_ps(k.dx_lanes, _mm512_castps256_ps512(dx8));
      // q4_K's odd lanes hold 16 times the codes (codes_q4k_lanes).
      if constexpr (K == Kind::kQ4K) dx = _mm512_mask_mul_ps(dx, 0xaaaa, dx, _mm512_set1_ps(0.0625f));
      _mm512_storeu_ps(p.dx + 16 * i, dx);
      const __m256 asum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
      _mm256_storeu_ps(p.s + 8 * i, _mm256_mul_ps(asum, dx8));
    }
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

// The q4_K code vectors of codes_k45 already transposed (transpose4x4):
// out[j] dword 4L + v = code vector v's dword 4L + j, the low (v even) or
// high (v odd) nibbles of dword 4L + j of q0 (v < 2) or q1 (v >= 2), so one
// vpermt2d and one AND per vector instead of nibble shifts and eight
// unpacks. The high nibbles stay in place, 16 times the codes (at most 240,
// still unsigned bytes; vpdpbusd does not saturate): the activation scales
// of the odd lanes carry the 1/16 (prepare_k).
inline void codes_q4k_lanes(const uint8_t* blk, const KConsts& k, __m512i* out) {
  const uint8_t* qs = reinterpret_cast<const BlockQ4K*>(blk)->qs;
  const __m512i q0 = _mm512_loadu_si512(qs);
  const __m512i q1 = _mm512_loadu_si512(qs + 64);
  for (int j = 0; j < 4; ++j) out[j] = _mm512_and_si512(_mm512_permutex2var_epi32(q0, k.q4_r[j], q1), k.q4_nib);
}

template <size_t kBytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (size_t o = 0; o < kBytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchFar + o), COLIBRI_FAR_PREFETCH_HINT);
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
// Each super-block's four code vectors are transposed (transpose4x4), so
// that dword lane 4L + v always holds four codes of sub-block
// k45_sub(4L + v) (two lanes per sub-block); four vpdpbusd then leave in
// each lane a partial product of its sub-block (below 2^16: 16 * 31 * 127).
// Per token and super-block one conversion, one multiply by the lanes'
// activation scales and one FMA with the lanes' d * sc; the mins of two
// super-blocks as one FMA of dmin * m_j with dx_j * (sum a)_j.
template <bool kFive, int NT, bool kTail>
__attribute__((always_inline)) inline void qk45_quad(const uint8_t* blk, size_t q, size_t valid, const KPrep* prep,
                                                     const KConsts& k, __m512* facc) {
  constexpr size_t kBytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  if constexpr (!kTail) valid = 4;
  prefetch_ahead<4 * kBytes>(blk);
  // The four super-blocks' d, dmin, scales and mins (16 bytes each) ...
  const uint8_t* hdr[4];
  for (size_t i = 0; i < 4; ++i) hdr[i] = blk + (kTail ? min_size(i, valid - 1) : i) * kBytes;
  __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr[0])));
  raw = _mm512_mask_broadcast_i32x4(raw, 0x00f0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr[1])));
  raw = _mm512_mask_broadcast_i32x4(raw, 0x0f00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr[2])));
  raw = _mm512_mask_broadcast_i32x4(raw, 0xf000, _mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr[3])));
  const __m512i u = unpack_scales_k4(raw, k);
  // ... the scales spread over each super-block's lanes, the mins of all four in order ...
  alignas(64) uint8_t sc[64];
  alignas(32) uint8_t mins[32];
  _mm512_store_si512(sc, _mm512_shuffle_epi8(u, k.sc_lanes));
  _mm256_store_si256(reinterpret_cast<__m256i*>(mins), _mm512_castsi512_si256(_mm512_permutexvar_epi64(k.mins_q, u)));
  through_memory(sc);
  through_memory(mins);
  // ... and [d, dmin] x 4.
  const __m256 ddf = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(k.dd_lanes, raw)));
  alignas(32) float ys[8];
  _mm256_store_ps(ys, ddf);
  through_memory(ys);
  COLIBRI_UNROLL
  for (int i = 0; i < 4; ++i) {
    if (kTail && i >= static_cast<int>(valid)) break;
    __m512i x[4];
    if constexpr (kFive) {
      __m512i w[4];
      codes_k45<true>(blk + i * kBytes, k, w);
      transpose4x4(w, x);
    } else {
      codes_q4k_lanes(blk + i * kBytes, k, x);
    }
    const __m512 wf = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sc + 16 * i)))),
        _mm512_set1_ps(ys[2 * i]));
    const size_t sb = 4 * q + static_cast<size_t>(i);
    for (int t = 0; t < NT; ++t) {
      const int8_t* aq = prep[t].qs + 256 * sb;
      __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x[0], _mm512_loadu_si512(aq));
      acc = _mm512_dpbusd_epi32(acc, x[1], _mm512_loadu_si512(aq + 64));
      acc = _mm512_dpbusd_epi32(acc, x[2], _mm512_loadu_si512(aq + 128));
      acc = _mm512_dpbusd_epi32(acc, x[3], _mm512_loadu_si512(aq + 192));
      const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_loadu_ps(prep[t].dx + 16 * sb));
      facc[t] = _mm512_fmadd_ps(p, wf, facc[t]);
    }
  }
  // The mins: lanes [dmin m_0-7 of super-block 0, of 1] and [2, 3].
  const __m512 ddz = _mm512_castps256_ps512(ddf);
  const __m512 wm01 = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(mins)))),
      _mm512_permutexvar_ps(k.dmin01, ddz));
  const __m512 wm23 = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(mins + 16)))),
      _mm512_permutexvar_ps(k.dmin23, ddz));
  for (int t = 0; t < NT; ++t) {
    const float* s = prep[t].s + 32 * q;
    facc[t] = _mm512_fnmadd_ps(wm01, _mm512_loadu_ps(s), facc[t]);
    facc[t] = _mm512_fnmadd_ps(wm23, _mm512_loadu_ps(s + 16), facc[t]);
  }
}

// The row holds nsb super-blocks: whole quads, then a last partial quad
// (the row's tail) read in place: its missing super-blocks repeat the last
// real one's header (finite scales) and meet zero prepared activations, so
// they add exactly zero, and no block past the row is read.
template <bool kFive, int NT>
void qk45_quads(const uint8_t* row, size_t nsb, const KPrep* prep, const KConsts& k, __m512* facc_io) {
  constexpr size_t kBytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  __m512 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = facc_io[t];
  const size_t full = nsb / 4;
  for (size_t q = 0; q < full; ++q) qk45_quad<kFive, NT, false>(row + 4 * q * kBytes, q, 4, prep, k, facc);
  if (nsb % 4 != 0) qk45_quad<kFive, NT, true>(row + 4 * full * kBytes, full, nsb % 4, prep, k, facc);
  for (int t = 0; t < NT; ++t) facc_io[t] = facc[t];
}

// q6_K super-blocks of one row against NT tokens: the code vectors (64
// elements each, sub-blocks 4v .. 4v + 3 in their 128-bit lanes)
// transposed as for qk45_quads, so lane 4L + v holds sub-block 4v + L;
// four vpdpbusd from -32 * (sum a) of each lane's sub-block (the codes'
// offset) leave its whole product, then one conversion, one multiply by
// the activation scales and one FMA with d * sc per token.
template <int NT>
void q6k_sbs(const uint8_t* row, size_t nsb, const KPrep* prep, const KConsts& k, __m512* facc_io) {
  __m512 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = facc_io[t];
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i m30 = _mm512_set1_epi8(0x30);
  for (size_t s = 0; s < nsb; ++s) {
    const auto* b = reinterpret_cast<const BlockQ6K*>(row) + s;
    prefetch_ahead<sizeof(BlockQ6K)>(reinterpret_cast<const uint8_t*>(b));
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
    __m512i x[4];
    transpose4x4(e, x);
    const __m128i sc8 = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)), k.q6_sc);
    const __m512 wf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), _mm512_set1_ps(h2f(b->d)));
    for (int t = 0; t < NT; ++t) {
      const int8_t* aq = prep[t].qs + 256 * s;
      __m512i acc = _mm512_loadu_si512(prep[t].init + 16 * s);
      acc = _mm512_dpbusd_epi32(acc, x[0], _mm512_loadu_si512(aq));
      acc = _mm512_dpbusd_epi32(acc, x[1], _mm512_loadu_si512(aq + 64));
      acc = _mm512_dpbusd_epi32(acc, x[2], _mm512_loadu_si512(aq + 128));
      acc = _mm512_dpbusd_epi32(acc, x[3], _mm512_loadu_si512(aq + 192));
      const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_loadu_ps(prep[t].dx + 16 * s));
      facc[t] = _mm512_fmadd_ps(p, wf, facc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) facc_io[t] = facc[t];
}

template <Kind K, int NT>
inline void k_sbs(const uint8_t* row, size_t nsb, const KPrep* prep, const KConsts& k, __m512* facc) {
  if constexpr (K == Kind::kQ6K) {
    q6k_sbs<NT>(row, nsb, prep, k, facc);
  } else {
    qk45_quads<K == Kind::kQ5K, NT>(row, nsb, prep, k, facc);
  }
}

// The kernels for 1 .. kMaxTokens tokens, by token count - 1.
using KRowFn = void (*)(const uint8_t*, size_t, const KPrep*, const KConsts&, __m512*);
struct KRowFns {
  KRowFn fn[kMaxTokens];
};
template <Kind K, int... I>
constexpr KRowFns k_row_fns(std::integer_sequence<int, I...>) {
  return {{&k_sbs<K, I + 1>...}};
}

// The many-token kernel (below): runs whole vectors of 16 rows of a call
// with more than kMaxTokens tokens and returns how many rows it did.
enum class GemmFormat {
  kQ8_0, kQ4_0, kMXFP4, kQ4K, kQ5K, kQ6K, kIQ4NL, kIQ4XS, kQ3K, kQ2K,
  // The grid i-quants, unpacked by qdot_avx512_grid.cpp's code.
  kIQ2XXS, kIQ3XXS, kIQ3S, kIQ1S, kIQ2XS, kIQ2S, kIQ1M
};
template <GemmFormat F, int kAbove = kMaxTokens, bool kTiles = false>
int32_t gemm_rows(const uint8_t* wb, size_t row_bytes, int32_t rows, const uint8_t* ab, size_t act_bytes,
                  int32_t tokens, size_t n, float* out, size_t ld_out);

// Up to kMaxTokens tokens at a time; per token group the super-blocks in
// column chunks whose prepared activations fit the stack buffer; per chunk
// every row.
template <Kind K, bool kTiles = false>
void dot_rows_k(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  constexpr bool kQ6 = K == Kind::kQ6K;
  constexpr size_t kBytes = kQ6 ? sizeof(BlockQ6K) : K == Kind::kQ5K ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
  constexpr size_t kPrepBytes = kQ6 ? kQ6PrepBytes : kK45PrepBytes;
  constexpr size_t kGroup = kQ6 ? 1 : 4;  // super-blocks per kernel step
  static constexpr auto kRowFns = k_row_fns<K>(std::make_integer_sequence<int, kMaxTokens>());
  const KConsts& k = kconsts();
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  if (nsb == 0) return zero_out(rows, tokens, out, ld_out);
  constexpr GemmFormat kGemm = kQ6 ? GemmFormat::kQ6K : K == Kind::kQ5K ? GemmFormat::kQ5K : GemmFormat::kQ4K;
  const int32_t done = gemm_rows<kGemm, kMaxTokens, kTiles>(wb, row_bytes, rows, ab, act_bytes, tokens, n, out, ld_out);
  if (done == rows) return;
  wb += static_cast<size_t>(done) * row_bytes;
  out += done;
  rows -= done;
  alignas(64) uint8_t buf[kActBufferBytes];
  for (int32_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const int nt = tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens;
    // Super-blocks per column chunk: whole groups whose prepared activations fit.
    const size_t chunk = kActBufferBytes / (kPrepBytes * static_cast<size_t>(nt)) / kGroup * kGroup;
    for (size_t c0 = 0; c0 < nsb; c0 += chunk) {
      const size_t cn = min_size(chunk, nsb - c0);
      const size_t padded = (cn + kGroup - 1) / kGroup * kGroup;
      KPrep prep[kMaxTokens];
      uint8_t* q = buf;
      for (int t = 0; t < nt; ++t) {
        prep[t].qs = reinterpret_cast<int8_t*>(q);
        q += padded * 256;
        prep[t].dx = reinterpret_cast<float*>(q);
        q += padded * 64;
        if constexpr (kQ6) {
          prep[t].init = reinterpret_cast<int32_t*>(q);
          q += padded * 64;
        } else {
          prep[t].s = reinterpret_cast<float*>(q);
          q += padded * 32;
        }
        prepare_k<K>(ab + static_cast<size_t>(t0 + t) * act_bytes, n, c0, cn, padded, prep[t], k);
      }
      const KRowFn row_fn = kRowFns.fn[nt - 1];
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        const uint8_t* row = wb + r * row_bytes + c0 * kBytes;
        __m512 facc[kMaxTokens];
        for (int t = 0; t < kMaxTokens; ++t) facc[t] = _mm512_setzero_ps();
        row_fn(row, cn, prep, k, facc);
        for (int t = 0; t < nt; ++t) {
          float* o = out + static_cast<size_t>(t0 + t) * ld_out + r;
          const float v = _mm512_reduce_add_ps(facc[t]);
          *o = c0 == 0 ? v : *o + v;
        }
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

// Loads 16 bytes at p + min(j, valid - 1) * stride for j < 16 and
// transposes them: dword j of out[k] is dword k of row j (rows past `valid`
// repeat the last, and nothing past it is read).
__attribute__((always_inline)) inline void transpose16_rows(const uint8_t* p, size_t stride, __m512i* out, size_t valid = 16) {
  const auto at = [&](size_t j) { return reinterpret_cast<const __m128i*>(p + min_size(j, valid - 1) * stride); };
  __m512i z[4];
  // Masked broadcasts from memory rather than inserts: they run on either
  // vector port, and the unpacks below already load the shuffle port.
  COLIBRI_UNROLL
  for (size_t i = 0; i < 4; ++i) {
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(at(i)));
    v = _mm512_mask_broadcast_i32x4(v, 0x00f0, _mm_loadu_si128(at(i + 4)));
    v = _mm512_mask_broadcast_i32x4(v, 0x0f00, _mm_loadu_si128(at(i + 8)));
    v = _mm512_mask_broadcast_i32x4(v, 0xf000, _mm_loadu_si128(at(i + 12)));
    z[i] = v;
  }
  transpose4x4(z, out);
}

// transpose16_rows at a stride known at compile time (a row's blocks). Kept
// apart: routing the one-token kernels through the runtime-stride version
// measured 10% slower for q8_0 (41.5 against 45.9 GOP/s, colibri_qdot_bench).
// Loads 16 bytes at p + j * kStride for j < 16 and transposes them:
// dword j of out[k] is dword k of row j. With kTail, rows j >= cnt repeat
// row cnt - 1 (nothing past it is read).
template <size_t kStride, bool kTail = false>
inline void transpose16(const uint8_t* p, __m512i* out, size_t cnt = 16) {
  const auto at = [&](int j) {
    const size_t r = kTail ? min_size(static_cast<size_t>(j), cnt - 1) : static_cast<size_t>(j);
    return reinterpret_cast<const __m128i*>(p + r * kStride);
  };
  __m512i z[4];
  // Masked broadcasts from memory rather than inserts: they run on either
  // vector port, and the unpacks below already load the shuffle port.
  COLIBRI_UNROLL
  for (int i = 0; i < 4; ++i) {
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(at(i)));
    v = _mm512_mask_broadcast_i32x4(v, 0x00f0, _mm_loadu_si128(at(i + 4)));
    v = _mm512_mask_broadcast_i32x4(v, 0x0f00, _mm_loadu_si128(at(i + 8)));
    v = _mm512_mask_broadcast_i32x4(v, 0xf000, _mm_loadu_si128(at(i + 12)));
    z[i] = v;
  }
  transpose4x4(z, out);
}

// Groups [g0, g0 + ng) of one token's activation row (n elements, nb
// blocks) into out[g * stride].
template <int kOffset>
void prepare_groups(const uint8_t* act, size_t n, size_t g0, size_t ng, Group16* out, size_t stride) {
  const size_t nb = n / kQK32;
  for (size_t g = 0; g < ng; ++g) {
    const size_t b0 = (g0 + g) * 16;
    const size_t cnt = min_size(16, nb - b0);
    alignas(64) uint8_t tail[16 * kQK32];
    const uint8_t* qs = act + b0 * kQK32;
    if (cnt < 16) {
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, qs, cnt * kQK32);
      qs = tail;
    }
    Group16& G = out[g * stride];
    transpose16<kQK32>(qs, G.a);
    transpose16<kQK32>(qs + 16, G.a + 4);
    const auto m = static_cast<__mmask16>(cnt < 16 ? (1u << cnt) - 1u : 0xffffu);
    const auto m2 = static_cast<__mmask32>(cnt < 16 ? (1u << (2 * cnt)) - 1u : 0xffffffffu);
    G.d = _mm512_maskz_loadu_ps(m, act_d(act, n) + b0 * sizeof(float));
    // -offset * (the two 16-element sums of each block).
    G.off = _mm512_madd_epi16(_mm512_maskz_loadu_epi16(m2, act_sums(act, n) + 2 * b0 * sizeof(int16_t)),
                              _mm512_set1_epi16(static_cast<int16_t>(-kOffset)));
  }
}

// 16 blocks of a q8_0 / q4_0 row at blk against NT tokens' groups. With
// kTail only the first cnt blocks exist: the others' codes repeat a real
// block, their scales are zero, and their activations are zero too, so
// they add exactly zero.
template <bool kQ8, int NT, bool kTail = false>
inline void group32(const uint8_t* blk, const Group16* G, __m512* facc, size_t cnt = 16) {
  constexpr size_t kBytes = kQ8 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
  __m512i v[8];
  if constexpr (kQ8) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    transpose16<kBytes, kTail>(blk + 2, v, cnt);
    transpose16<kBytes, kTail>(blk + 18, v + 4, cnt);
    for (int i = 0; i < 8; ++i) v[i] = _mm512_xor_si512(v[i], bias);  // q + 128
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i t[4];
    transpose16<kBytes, kTail>(blk + 2, t, cnt);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm512_and_si512(t[i], m4);
      v[i + 4] = _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m4);
    }
  }
  // The 16 f16 scales: the low half of each block's first dword, by the
  // codes' transpose (its other three outputs unused, so not computed)
  // rather than vpgatherdd: one-token q4_0 ran 1.25x faster on Zen 5 (126
  // against 100 GOP/s, colibri_qdot_bench 2048x1024), q8_0 1.02x. A tail's
  // missing blocks get scale zero.
  __m512i head[4];
  transpose16<kBytes, kTail>(blk, head, cnt);
  const __m512i dbits = kTail ? _mm512_maskz_mov_epi32(static_cast<__mmask16>((1u << cnt) - 1u), head[0]) : head[0];
  const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dbits));
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
    prefetch_ahead<16 * kBytes>(blk);
    if (b0 + 16 <= nb) {
      group32<kQ8, NT>(blk, groups + g * NT, facc);
    } else {
      group32<kQ8, NT, true>(blk, groups + g * NT, facc, nb - b0);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(facc[t]);
}

using Q32RowFn = void (*)(const uint8_t*, size_t, size_t, size_t, const Group16*, float*);
struct Q32RowFns {
  Q32RowFn fn[kMaxTokens];
};
template <bool kQ8, int... I>
constexpr Q32RowFns q32_row_fns(std::integer_sequence<int, I...>) {
  return {{&q32_row<kQ8, I + 1>...}};
}

// ------------------------------------------------------- many tokens

// Past kMaxTokens tokens the kernels above would decode every row once per
// pass of 8 and stream each token's rearranged activations (64 bytes per
// vpdpbusd) through L1. Here lanes are rows instead: a zmm holds four
// codes of one activation block (32 elements) for 16 rows, each token's
// four activation codes are a 4-byte embedded broadcast, and a pass of up
// to 12 tokens shares every weight vector, so nothing needs a horizontal
// sum and the activations no transpose per row. 16 rows x one chunk
// (8 activation blocks: a K format's super-block) are decoded once into an
// L1 buffer for all of the call's tokens (up to kGemmMaxCallTokens).
constexpr size_t kGemmBlocks = 8;  // activation blocks per column chunk
constexpr int kGemmMaxCallTokens = 32;

// The chunk's activations, token-minor (token t of a 16-token group at
// index t): qa[(b * 8 + q) * tap + t] token t's codes 4q .. 4q + 3 of block
// b (signed); da its block scale; for q8_0 / q4_0 i0 = -offset * (its sum
// over the block); for q4_K / q5_K ds = da * (that sum); for q6_K i0 / i1 =
// -32 * (the sums of the block's two halves), q3_K -4 times them; for q2_K
// ds / ds1 = da * (those sums).
struct GemmActs {
  alignas(64) int32_t qa[kGemmBlocks * 8 * kGemmMaxCallTokens];
  alignas(64) float da[kGemmBlocks * kGemmMaxCallTokens];
  alignas(64) float ds[kGemmBlocks * kGemmMaxCallTokens];
  alignas(64) float ds1[kGemmBlocks * kGemmMaxCallTokens];
  alignas(64) int32_t i0[kGemmBlocks * kGemmMaxCallTokens];
  alignas(64) int32_t i1[kGemmBlocks * kGemmMaxCallTokens];
};

// 16 rows x one chunk: v[b * 8 + q] lane r = row r's codes 4q .. 4q + 3 of
// activation block b, unsigned. ws[b] (q6_K: ws[2b], ws[2b + 1] for the two
// halves) the rows' scales of that block, wm[b] (q4_K / q5_K; q2_K wm[2b],
// wm[2b + 1]) their mins.
struct GemmWeights {
  __m512i v[kGemmBlocks * 8];
  __m512 ws[2 * kGemmBlocks];
  __m512 wm[2 * kGemmBlocks];
};

constexpr WeightType gemm_grid_type(GemmFormat f) {
  switch (f) {
    case GemmFormat::kIQ2XXS:
      return WeightType::kIQ2_XXS;
    case GemmFormat::kIQ3XXS:
      return WeightType::kIQ3_XXS;
    case GemmFormat::kIQ3S:
      return WeightType::kIQ3_S;
    case GemmFormat::kIQ1S:
      return WeightType::kIQ1_S;
    case GemmFormat::kIQ2XS:
      return WeightType::kIQ2_XS;
    case GemmFormat::kIQ2S:
      return WeightType::kIQ2_S;
    case GemmFormat::kIQ1M:
      return WeightType::kIQ1_M;
    default:
      return WeightType::kF32;  // not a grid format
  }
}
constexpr bool gemm_grid(GemmFormat f) { return gemm_grid_type(f) != WeightType::kF32; }
// Scaled per 16 values: two int32 accumulators per token and block.
constexpr bool gemm_halves(GemmFormat f) {
  return f == GemmFormat::kQ6K || f == GemmFormat::kQ3K || f == GemmFormat::kQ2K || f == GemmFormat::kIQ2XS ||
         f == GemmFormat::kIQ2S || f == GemmFormat::kIQ1M;
}
// One scale per 32 values and a constant code offset.
constexpr bool gemm_block32(GemmFormat f) {
  return f == GemmFormat::kQ8_0 || f == GemmFormat::kQ4_0 || f == GemmFormat::kMXFP4 || f == GemmFormat::kIQ4NL ||
         f == GemmFormat::kIQ4XS || (gemm_grid(f) && !gemm_halves(f));
}
// The formats whose prepared activations and passes are another's: the
// grid formats scaled per 32 prepare and run as iq4_xs (codes + 128, scales
// per 32), those scaled per 16 as iq2_xs.
constexpr GemmFormat gemm_acts_as(GemmFormat f) {
  return !gemm_grid(f) ? f : gemm_halves(f) ? GemmFormat::kIQ2XS : GemmFormat::kIQ4XS;
}
// The pass of the formats with halves and a code offset is q3_K's.
constexpr GemmFormat gemm_pass_as(GemmFormat f) {
  return gemm_grid(f) && gemm_halves(f) ? GemmFormat::kQ3K : gemm_acts_as(f);
}
static_assert(kGridCodeOffset == 128, "prepare_gemm_acts gives the grid formats iq4_xs's offset");

template <GemmFormat F>
constexpr size_t gemm_block_bytes() {
  switch (F) {
    case GemmFormat::kQ8_0:
      return sizeof(BlockQ8_0);
    case GemmFormat::kQ4_0:
      return sizeof(BlockQ4_0);
    case GemmFormat::kMXFP4:
      return sizeof(BlockMxfp4);
    case GemmFormat::kQ4K:
      return sizeof(BlockQ4K);
    case GemmFormat::kQ5K:
      return sizeof(BlockQ5K);
    case GemmFormat::kQ6K:
      return sizeof(BlockQ6K);
    case GemmFormat::kIQ4NL:
      return sizeof(BlockIq4Nl);
    case GemmFormat::kIQ4XS:
      return sizeof(BlockIq4Xs);
    case GemmFormat::kQ3K:
      return sizeof(BlockQ3K);
    case GemmFormat::kQ2K:
      return sizeof(BlockQ2K);
    case GemmFormat::kIQ2XXS:
      return sizeof(BlockIq2Xxs);
    case GemmFormat::kIQ3XXS:
      return sizeof(BlockIq3Xxs);
    case GemmFormat::kIQ3S:
      return sizeof(BlockIq3S);
    case GemmFormat::kIQ1S:
      return sizeof(BlockIq1S);
    case GemmFormat::kIQ2XS:
      return sizeof(BlockIq2Xs);
    case GemmFormat::kIQ2S:
      return sizeof(BlockIq2S);
    case GemmFormat::kIQ1M:
      return sizeof(BlockIq1M);
  }
  return 0;
}

// Byte i (0..3) of every dword of x, as int32 lanes.
inline __m512i dword_byte_u(__m512i x, int i) {
  return _mm512_and_si512(_mm512_srli_epi32(x, 8 * i), _mm512_set1_epi32(0xff));
}

template <GemmFormat F>
void prepare_gemm_acts(const uint8_t* ab, size_t act_bytes, size_t ta, size_t tap, size_t n, size_t b0, size_t nbc,
                       GemmActs& A) {
  // The codes' offsets: q8_0's bias, q4_0's 8, mxfp4's table values + 12,
  // the iq4 formats' levels + 128.
  constexpr int kOffset = F == GemmFormat::kQ8_0 || F == GemmFormat::kIQ4NL || F == GemmFormat::kIQ4XS ? 128
                          : F == GemmFormat::kMXFP4                                                    ? 12
                                                                                                       : 8;
  // One scale per activation block and an offset (iq4_xs's scales are per
  // sub-block of 32, its activation blocks likewise).
  constexpr bool kBlock32 = gemm_block32(F);
  for (size_t t0 = 0; t0 < ta; t0 += 16) {
    const uint8_t* a0 = ab + t0 * act_bytes;
    const size_t valid = min_size(16, ta - t0);
    for (size_t b = 0; b < nbc; ++b) {
      __m512i x[8];
      const size_t off = (b0 + b) * kQK32;
      transpose16_rows(a0 + off, act_bytes, x, valid);
      transpose16_rows(a0 + off + 16, act_bytes, x + 4, valid);
      for (size_t q = 0; q < 8; ++q) _mm512_store_si512(A.qa + (b * 8 + q) * tap + t0, x[q]);
    }
    size_t b = 0;
    for (; b + 4 <= nbc; b += 4) {
      __m512i d[4], s2[4];
      transpose16_rows(act_d(a0, n) + (b0 + b) * sizeof(float), act_bytes, d, valid);
      transpose16_rows(act_sums(a0, n) + 2 * (b0 + b) * sizeof(int16_t), act_bytes, s2, valid);
      for (size_t i = 0; i < 4; ++i) {
        const size_t at = (b + i) * tap + t0;
        _mm512_store_si512(A.da + at, d[i]);
        if constexpr (kBlock32) {
          _mm512_store_si512(A.i0 + at, _mm512_madd_epi16(s2[i], _mm512_set1_epi16(-kOffset)));
        } else if constexpr (F == GemmFormat::kQ2K) {
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s2[i], 16), 16));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(s2[i], 16));
          _mm512_store_ps(A.ds + at, _mm512_mul_ps(_mm512_castsi512_ps(d[i]), lo));
          _mm512_store_ps(A.ds1 + at, _mm512_mul_ps(_mm512_castsi512_ps(d[i]), hi));
        } else if constexpr (F == GemmFormat::kQ6K || F == GemmFormat::kQ3K || F == GemmFormat::kIQ2XS) {
          // -32 (q6_K), -4 (q3_K) or -128 (the grid formats scaled per 16)
          // times the sums of the block's two halves.
          constexpr unsigned kShift = F == GemmFormat::kQ6K ? 5 : F == GemmFormat::kQ3K ? 2 : 7;
          const __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(s2[i], 16), 16);
          const __m512i hi = _mm512_srai_epi32(s2[i], 16);
          _mm512_store_si512(A.i0 + at, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(lo, kShift)));
          _mm512_store_si512(A.i1 + at, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(hi, kShift)));
        } else {
          const __m512 sum = _mm512_cvtepi32_ps(_mm512_madd_epi16(s2[i], _mm512_set1_epi16(1)));
          _mm512_store_ps(A.ds + at, _mm512_mul_ps(_mm512_castsi512_ps(d[i]), sum));
        }
      }
    }
    for (; b < nbc; ++b) {  // a 32-block format's last blocks (past them the row ends)
      for (size_t t = 0; t < valid; ++t) {
        const uint8_t* a = a0 + t * act_bytes;
        const size_t blk = b0 + b;
        int16_t s2[2];
        std::memcpy(s2, act_sums(a, n) + 2 * blk * sizeof(int16_t), sizeof s2);
        const size_t at = b * tap + t0 + t;
        A.i0[at] = -kOffset * (static_cast<int32_t>(s2[0]) + static_cast<int32_t>(s2[1]));
        std::memcpy(&A.da[at], act_d(a, n) + blk * sizeof(float), sizeof(float));
      }
    }
  }
}

// Dword k of the 16 bytes at p + j * row_bytes in lane j (a field of the 16
// rows' block headers): the transpose's loads (the other dwords are not
// computed) rather than vpgatherdd, which is slow on AMD: on Zen 5 at 16
// tokens q8_0 ran 389 against 366 GOP/s, iq4_xs 443 against 422
// (colibri_qdot_bench 2048x1024); the qwen3-moe iq4_xs layer at T=128
// 1.02-1.03x faster.
template <int K>
inline __m512i rows_dword(const uint8_t* p, size_t row_bytes) {
  __m512i x[4];
  transpose16_rows(p, row_bytes, x);
  return x[K];
}

// Chunk c (activation blocks 8c .. 8c + nbc) of 16 rows, row 0 at `rows`.
template <GemmFormat F>
void decode_gemm_weights(const uint8_t* rows, size_t row_bytes, size_t c, size_t nbc, GemmWeights& W) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  if constexpr (F == GemmFormat::kQ8_0 || F == GemmFormat::kQ4_0) {
    constexpr bool kQ8 = F == GemmFormat::kQ8_0;
    constexpr size_t kBytes = kQ8 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
    for (size_t b = 0; b < nbc; ++b) {
      const uint8_t* blk = rows + (kGemmBlocks * c + b) * kBytes;
      __m512i* v = W.v + 8 * b;
      if constexpr (kQ8) {
        const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
        transpose16_rows(blk + 2, row_bytes, v);
        transpose16_rows(blk + 18, row_bytes, v + 4);
        for (int i = 0; i < 8; ++i) v[i] = _mm512_xor_si512(v[i], bias);  // q + 128
      } else {
        __m512i t[4];
        transpose16_rows(blk + 2, row_bytes, t);
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm512_and_si512(t[i], m4);
          v[i + 4] = _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m4);
        }
      }
      W.ws[b] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(rows_dword<0>(blk, row_bytes)));
    }
  } else if constexpr (F == GemmFormat::kMXFP4) {
    // Nibbles looked up as their E2M1 values (doubled, as the table holds
    // them) plus 12; the E8M0 exponent as the float 2^(e - 128)
    // (mxfp4_scale: subnormal for e < 2).
    alignas(16) static constexpr int8_t lut[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
    static_assert([] {
      for (int i = 0; i < 16; ++i) {
        if (lut[i] != kMxfp4Values[i] + 12) return false;
      }
      return true;
    }());
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(lut)));
    for (size_t b = 0; b < nbc; ++b) {
      const uint8_t* blk = rows + (kGemmBlocks * c + b) * sizeof(BlockMxfp4);
      __m512i* v = W.v + 8 * b;
      __m512i t[4];
      transpose16_rows(blk + offsetof(BlockMxfp4, qs), row_bytes, t);
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm512_shuffle_epi8(table, _mm512_and_si512(t[i], m4));
        v[i + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m4));
      }
      const __m512i e = _mm512_and_si512(rows_dword<0>(blk, row_bytes), _mm512_set1_epi32(0xff));
      const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
      const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
      const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
      W.ws[b] = _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, sub));
    }
  } else if constexpr (F == GemmFormat::kIQ4NL || F == GemmFormat::kIQ4XS) {
    // The nibbles looked up as the levels + 128 (codes 1..241, offset 128).
    alignas(16) static constexpr uint8_t lut[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
    static_assert([] {
      for (int i = 0; i < 16; ++i) {
        if (lut[i] != kIq4nlValues[i] + 128) return false;
      }
      return true;
    }());
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(lut)));
    if constexpr (F == GemmFormat::kIQ4NL) {
      for (size_t b = 0; b < nbc; ++b) {
        const uint8_t* blk = rows + (kGemmBlocks * c + b) * sizeof(BlockIq4Nl);
        __m512i* v = W.v + 8 * b;
        __m512i t[4];
        transpose16_rows(blk + offsetof(BlockIq4Nl, qs), row_bytes, t);
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm512_shuffle_epi8(table, _mm512_and_si512(t[i], m4));
          v[i + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m4));
        }
        W.ws[b] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(rows_dword<0>(blk, row_bytes)));
      }
    } else {
      // Chunk c is super-block c: sub-block b's codes at qs + 16 b, its
      // scale d * (ls_b - 32) from scales_l's nibble b % 2 of byte b / 2
      // and scales_h's bits 2b, 2b + 1.
      const uint8_t* blk = rows + c * sizeof(BlockIq4Xs);
      for (size_t b = 0; b < kGemmBlocks; ++b) {
        __m512i* v = W.v + 8 * b;
        __m512i t[4];
        transpose16_rows(blk + offsetof(BlockIq4Xs, qs) + 16 * b, row_bytes, t);
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm512_shuffle_epi8(table, _mm512_and_si512(t[i], m4));
          v[i + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m4));
        }
      }
      __m512i hdr[4];
      transpose16_rows(blk, row_bytes, hdr);
      const __m512i head = hdr[0];  // d | scales_h << 16
      const __m512i low = hdr[1];   // scales_l
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
      const __m512i high = _mm512_srli_epi32(head, 16);
      for (int b = 0; b < 8; ++b) {
        const __m512i ls = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi32(low, static_cast<unsigned>(4 * b)), _mm512_set1_epi32(0xf)),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, static_cast<unsigned>(2 * b)), _mm512_set1_epi32(3)), 4));
        W.ws[b] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
      }
    }
  } else if constexpr (F == GemmFormat::kQ4K || F == GemmFormat::kQ5K) {
    constexpr bool kFive = F == GemmFormat::kQ5K;
    constexpr size_t kBytes = kFive ? sizeof(BlockQ5K) : sizeof(BlockQ4K);
    constexpr size_t kQs = kFive ? offsetof(BlockQ5K, qs) : offsetof(BlockQ4K, qs);
    const uint8_t* blk = rows + c * kBytes;
    // Sub-blocks 2j and 2j + 1: the low and high nibbles of qs[32j .. 32j + 31].
    for (size_t j = 0; j < 4; ++j) {
      __m512i x[8];
      transpose16_rows(blk + kQs + 32 * j, row_bytes, x);
      transpose16_rows(blk + kQs + 32 * j + 16, row_bytes, x + 4);
      for (size_t q = 0; q < 8; ++q) {
        W.v[(2 * j) * 8 + q] = _mm512_and_si512(x[q], m4);
        W.v[(2 * j + 1) * 8 + q] = _mm512_and_si512(_mm512_srli_epi16(x[q], 4), m4);
      }
    }
    if constexpr (kFive) {
      // Bit s of qh[l] is the fifth bit of sub-block s's element l.
      __m512i h[8];
      transpose16_rows(blk + offsetof(BlockQ5K, qh), row_bytes, h);
      transpose16_rows(blk + offsetof(BlockQ5K, qh) + 16, row_bytes, h + 4);
      const __m512i m10 = _mm512_set1_epi8(0x10);
      for (size_t sb = 0; sb < 8; ++sb) {
        const __m512i bit = _mm512_set1_epi8(static_cast<char>(1u << sb));
        for (size_t q = 0; q < 8; ++q) {
          __m512i& v = W.v[sb * 8 + q];
          v = _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(h[q], bit), v, m10);
        }
      }
    }
    // Scales and mins: four rows' headers per unpack_scales_k4, then the
    // 16 rows' [sc0-7, m0-7] transposed to one dword lane per row.
    const KConsts& k = kconsts();
    alignas(64) uint8_t u[16 * 16];
    for (size_t r4 = 0; r4 < 4; ++r4) {
      const uint8_t* h0 = blk + 4 * r4 * row_bytes;
      __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h0)));
      raw = _mm512_mask_broadcast_i32x4(raw, 0x00f0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(h0 + row_bytes)));
      raw = _mm512_mask_broadcast_i32x4(raw, 0x0f00,
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(h0 + 2 * row_bytes)));
      raw = _mm512_mask_broadcast_i32x4(raw, 0xf000,
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(h0 + 3 * row_bytes)));
      _mm512_store_si512(u + 64 * r4, unpack_scales_k4(raw, k));
    }
    __m512i sm[4];
    transpose16_rows(u, 16, sm);
    const __m512i dd = rows_dword<0>(blk, row_bytes);  // [d, dmin] per row
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
    for (int sb = 0; sb < 8; ++sb) {
      W.ws[sb] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(dword_byte_u(sm[sb / 4], sb % 4)));
      W.wm[sb] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(dword_byte_u(sm[2 + sb / 4], sb % 4)));
    }
  } else if constexpr (F == GemmFormat::kQ2K) {
    // q2_K: block 4h + j, element l: bits 2j, 2j + 1 of qs[32h + l];
    // sub-block s's scale d * (scales[s] & 15) and min dmin * (scales[s] >> 4).
    const uint8_t* blk = rows + c * sizeof(BlockQ2K);
    const __m512i m3 = _mm512_set1_epi8(0x03);
    for (size_t half = 0; half < 2; ++half) {
      __m512i q[8];
      transpose16_rows(blk + offsetof(BlockQ2K, qs) + 32 * half, row_bytes, q);
      transpose16_rows(blk + offsetof(BlockQ2K, qs) + 32 * half + 16, row_bytes, q + 4);
      for (unsigned j = 0; j < 4; ++j) {
        for (size_t i = 0; i < 8; ++i) {
          W.v[(4 * half + j) * 8 + i] = _mm512_and_si512(_mm512_srli_epi16(q[i], 2 * j), m3);
        }
      }
    }
    __m512i sc[4];
    transpose16_rows(blk + offsetof(BlockQ2K, scales), row_bytes, sc);
    // [d, dmin] per row: the last dword of the block's last 16 bytes.
    static_assert(offsetof(BlockQ2K, d) + 4 == sizeof(BlockQ2K));
    const __m512i dd = rows_dword<3>(blk + sizeof(BlockQ2K) - 16, row_bytes);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
    for (int sb = 0; sb < 16; ++sb) {
      const __m512i b = dword_byte_u(sc[sb / 4], sb % 4);
      W.ws[sb] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xf))));
      W.wm[sb] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
    }
  } else if constexpr (F == GemmFormat::kQ3K) {
    // q3_K: block 4h + j, element l: bits 2j, 2j + 1 of qs[32h + l] and
    // bit 4h + j of hmask[l] (as 4).
    const uint8_t* blk = rows + c * sizeof(BlockQ3K);
    const __m512i m3 = _mm512_set1_epi8(0x03);
    const __m512i four = _mm512_set1_epi8(0x04);
    __m512i hm[8];
    transpose16_rows(blk + offsetof(BlockQ3K, hmask), row_bytes, hm);
    transpose16_rows(blk + offsetof(BlockQ3K, hmask) + 16, row_bytes, hm + 4);
    for (size_t half = 0; half < 2; ++half) {
      __m512i q[8];
      transpose16_rows(blk + offsetof(BlockQ3K, qs) + 32 * half, row_bytes, q);
      transpose16_rows(blk + offsetof(BlockQ3K, qs) + 32 * half + 16, row_bytes, q + 4);
      for (unsigned j = 0; j < 4; ++j) {
        const unsigned bit = 4 * static_cast<unsigned>(half) + j;
        for (size_t i = 0; i < 8; ++i) {
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(q[i], 2 * j), m3);
          const __m512i hi = _mm512_and_si512(bit >= 2 ? _mm512_srli_epi16(hm[i], bit - 2) : _mm512_slli_epi16(hm[i], 2 - bit), four);
          W.v[(4 * half + j) * 8 + i] = _mm512_or_si512(lo, hi);
        }
      }
    }
    // The 16 signed scales sc_s - 32 of each row, from the 12 packed bytes
    // read as a 16-byte window that starts 2 bytes before them (inside the
    // block): low nibbles of bytes 2..9 (s < 8) or their high nibbles
    // (s >= 8), two more bits from byte 10 + s % 4 at bit 2 (s / 4).
    __m512i win[4];
    transpose16_rows(blk + offsetof(BlockQ3K, scales) - 2, row_bytes, win);
    // d: the window's last two bytes.
    static_assert(offsetof(BlockQ3K, scales) - 2 + 16 == sizeof(BlockQ3K));
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(win[3], 16)));
    const auto byte = [&](int i) { return dword_byte_u(win[i / 4], i % 4); };
    for (int sb = 0; sb < 16; ++sb) {
      const __m512i nib = sb < 8 ? _mm512_and_si512(byte(2 + sb), _mm512_set1_epi32(0xf))
                                 : _mm512_srli_epi32(byte(sb - 6), 4);
      const __m512i top = _mm512_and_si512(_mm512_srli_epi32(byte(10 + sb % 4), static_cast<unsigned>(2 * (sb / 4))),
                                           _mm512_set1_epi32(3));
      const __m512i sc = _mm512_sub_epi32(_mm512_or_si512(nib, _mm512_slli_epi32(top, 4)), _mm512_set1_epi32(32));
      W.ws[sb] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    }
  } else if constexpr (gemm_grid(F)) {
    // Unpacked row by row by the grid kernel's code, in its order: dword k
    // of a row is the quad 2 (k / 16) + k % 2 of sub-block (k % 16) / 2.
    alignas(64) uint8_t codes[16 * 256];
    alignas(64) float scales[16 * 16];
    COLIBRI_QDOT_VARIANT::unpack_grid_rows16_avx512(gemm_grid_type(F), rows + c * gemm_block_bytes<F>(), row_bytes, codes, scales);
    for (size_t k4 = 0; k4 < 16; ++k4) {
      __m512i x[4];
      transpose16_rows(codes + 16 * k4, 256, x);
      for (size_t i = 0; i < 4; ++i) {
        const size_t k = 4 * k4 + i;
        W.v[(k % 16) / 2 * 8 + 2 * (k / 16) + k % 2] = x[i];
      }
    }
    __m512i s[16];
    for (size_t i = 0; i < 4; ++i) transpose16_rows(reinterpret_cast<const uint8_t*>(scales) + 16 * i, 64, s + 4 * i);
    for (size_t i = 0; i < 16; ++i) {
      if (gemm_halves(F)) {
        W.ws[i] = _mm512_castsi512_ps(s[i]);
      } else if (i % 2 == 0) {
        W.ws[i / 2] = _mm512_castsi512_ps(s[i]);
      }
    }
  } else {
    // q6_K: block 4n + c, element l: the low (c < 2) or high nibble of
    // ql[64n + 32 (c & 1) + l] and bits 2c, 2c + 1 of qh[32n + l].
    const uint8_t* blk = rows + c * sizeof(BlockQ6K);
    const __m512i m3 = _mm512_set1_epi8(0x03);
    for (size_t half = 0; half < 2; ++half) {
      __m512i l[2][8], h[8];
      for (size_t odd = 0; odd < 2; ++odd) {
        transpose16_rows(blk + 64 * half + 32 * odd, row_bytes, l[odd]);
        transpose16_rows(blk + 64 * half + 32 * odd + 16, row_bytes, l[odd] + 4);
      }
      transpose16_rows(blk + offsetof(BlockQ6K, qh) + 32 * half, row_bytes, h);
      transpose16_rows(blk + offsetof(BlockQ6K, qh) + 32 * half + 16, row_bytes, h + 4);
      for (int cc = 0; cc < 4; ++cc) {
        for (size_t q = 0; q < 8; ++q) {
          const __m512i lo = cc < 2 ? _mm512_and_si512(l[cc & 1][q], m4)
                                    : _mm512_and_si512(_mm512_srli_epi16(l[cc & 1][q], 4), m4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(h[q], static_cast<unsigned>(2 * cc)), m3);
          W.v[(4 * half + static_cast<size_t>(cc)) * 8 + q] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
        }
      }
    }
    __m512i sc[4];
    transpose16_rows(blk + offsetof(BlockQ6K, scales), row_bytes, sc);
    // d: the high half of the last dword of the block's last 16 bytes.
    static_assert(offsetof(BlockQ6K, d) + 2 == sizeof(BlockQ6K));
    const __m512 d = _mm512_cvtph_ps(
        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rows_dword<3>(blk + sizeof(BlockQ6K) - 16, row_bytes), 16)));
    for (int i = 0; i < 16; ++i) {
      const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(sc[i / 4], 24 - 8 * (i % 4)), 24);
      W.ws[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));
    }
  }
}

// vpdpbusd with the token's quad as an embedded broadcast: GCC otherwise
// emits a separate vpbroadcastd for each.
__attribute__((always_inline)) inline void dpbusd_bcast(__m512i& acc, __m512i w, const int32_t* a) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*a));
}

// One pass: NT tokens (t at qa + t, ...) against nbc blocks of W.
template <GemmFormat F, int NT>
void gemm_pass(const GemmWeights& W, size_t nbc, const GemmActs& A, size_t t0, size_t tap, __m512* facc) {
  for (size_t b = 0; b < nbc; ++b) {
    const size_t at = b * tap + t0;
    if constexpr (gemm_halves(F)) {
      __m512i lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) {
        lo[t] = F == GemmFormat::kQ2K ? _mm512_setzero_si512() : _mm512_set1_epi32(A.i0[at + static_cast<size_t>(t)]);
        hi[t] = F == GemmFormat::kQ2K ? _mm512_setzero_si512() : _mm512_set1_epi32(A.i1[at + static_cast<size_t>(t)]);
      }
      COLIBRI_UNROLL
      for (size_t q = 0; q < 8; ++q) {
        const __m512i w = W.v[b * 8 + q];
        const int32_t* a = A.qa + (b * 8 + q) * tap + t0;
        for (int t = 0; t < NT; ++t) dpbusd_bcast(q < 4 ? lo[t] : hi[t], w, a + t);
      }
      for (int t = 0; t < NT; ++t) {
        const __m512 da = _mm512_set1_ps(A.da[at + static_cast<size_t>(t)]);
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[t]), _mm512_mul_ps(W.ws[2 * b], da), facc[t]);
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[t]), _mm512_mul_ps(W.ws[2 * b + 1], da), facc[t]);
        if constexpr (F == GemmFormat::kQ2K) {
          facc[t] = _mm512_fnmadd_ps(W.wm[2 * b], _mm512_set1_ps(A.ds[at + static_cast<size_t>(t)]), facc[t]);
          facc[t] = _mm512_fnmadd_ps(W.wm[2 * b + 1], _mm512_set1_ps(A.ds1[at + static_cast<size_t>(t)]), facc[t]);
        }
      }
    } else {
      constexpr bool kInit = gemm_block32(F);
      __m512i acc[NT];
      for (int t = 0; t < NT; ++t) {
        acc[t] = kInit ? _mm512_set1_epi32(A.i0[at + static_cast<size_t>(t)]) : _mm512_setzero_si512();
      }
      COLIBRI_UNROLL
      for (size_t q = 0; q < 8; ++q) {
        const __m512i w = W.v[b * 8 + q];
        const int32_t* a = A.qa + (b * 8 + q) * tap + t0;
        for (int t = 0; t < NT; ++t) dpbusd_bcast(acc[t], w, a + t);
      }
      for (int t = 0; t < NT; ++t) {
        const __m512 scale = _mm512_mul_ps(W.ws[b], _mm512_set1_ps(A.da[at + static_cast<size_t>(t)]));
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), scale, facc[t]);
        if constexpr (!kInit) facc[t] = _mm512_fnmadd_ps(W.wm[b], _mm512_set1_ps(A.ds[at + static_cast<size_t>(t)]), facc[t]);
      }
    }
  }
}

// Tokens per pass: int and float accumulators in registers (q6_K keeps two
// int accumulators per token, one per half block).
template <GemmFormat F>
constexpr int gemm_pass_tokens() {
  return gemm_halves(F) ? 8 : 12;
}

template <GemmFormat F>
using GemmPassFn = void (*)(const GemmWeights&, size_t, const GemmActs&, size_t, size_t, __m512*);
template <GemmFormat F>
struct GemmPassFns {
  GemmPassFn<F> fn[gemm_pass_tokens<F>()];
};
template <GemmFormat F, int... I>
constexpr GemmPassFns<F> gemm_pass_fns(std::integer_sequence<int, I...>) {
  return {{&gemm_pass<F, I + 1>...}};
}


// AMX-INT8 (the `-amx-int8` tables, AMX CPUs): the many-token kernel's
// decoded weights are already the B operand of tdpbsud: v[b * 8 + q] lane r
// = row r's codes 4q .. 4q + 3 of block b (unsigned), so the 8 vectors of
// block b are a B tile of 8 K-quads x 16 rows, as the decode stores them.
// The activations (signed int8) are the A tile: 16 tokens x the 32 codes
// of block b, packed per chunk. C[token][row] is the block's integer
// product, which the same scaling as gemm_pass turns into floats (one
// conversion, a multiply and an FMA per token, 16 rows and block, in place
// of the eight vpdpbusd there). The formats scaled per 16 (two products a
// block) keep the vpdpbusd passes. Tile instructions as inline assembly:
// this object is not built with -mamx-*; the tiles are configured at the
// start of every gemm_rows16 call and released at its end (ffn_amx.cpp
// says why).
struct alignas(64) AmxInt8Config {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0, 1 accumulators, 2, 4 activations, 3, 5 weights (two blocks in flight).
void amx_int8_configure() {
  AmxInt8Config cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  cfg.colsb[0] = cfg.colsb[1] = 64;  // C: 16 tokens x 16 int32
  cfg.rows[0] = cfg.rows[1] = 16;
  cfg.colsb[2] = cfg.colsb[4] = 32;  // A: 16 tokens x 32 int8
  cfg.rows[2] = cfg.rows[4] = 16;
  cfg.colsb[3] = cfg.colsb[5] = 64;  // B: 8 K-quads x 16 rows x 4 uint8
  cfg.rows[3] = cfg.rows[5] = 8;
  // Not _tile_loadconfig() (ffn_amx.cpp says why).
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}
void amx_int8_release() { __asm__ volatile("tilerelease" ::: "memory"); }

// Activations of chunk (blocks b0 .. b0 + nbc) for token blocks of 16:
// pack[(tb * kGemmBlocks + b) * 512 + t * 32 + k], zero past the tokens.
struct alignas(64) AmxActs {
  int8_t q[2 * kGemmBlocks * 512];
};
void amx_pack_acts(const uint8_t* ab, size_t act_bytes, size_t ta, size_t b0, size_t nbc, AmxActs& P) {
  const size_t ntb = (ta + 15) / 16;
  for (size_t tb = 0; tb < ntb; ++tb) {
    for (size_t t = 0; t < 16; ++t) {
      const size_t tok = tb * 16 + t;
      for (size_t b = 0; b < nbc; ++b) {
        int8_t* dst = P.q + (tb * kGemmBlocks + b) * 512 + t * 32;
        if (tok < ta) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + tok * act_bytes + (b0 + b) * kQK32)));
        } else {
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst), _mm256_setzero_si256());
        }
      }
    }
  }
}

// The integer products of nbc blocks for one block of 16 tokens, C tiles
// stored to c[b] (c[b][t * 16 + r]: token t, row r); consecutive blocks
// alternate between two sets of tiles so the tile unit need not wait for a
// store before the next product.
inline void amx_int8_products(const GemmWeights& W, size_t nbc, const int8_t* acts, int32_t (*c)[256]) {
  size_t b = 0;
  for (; b + 2 <= nbc; b += 2) {
    __asm__ volatile(
        "tileloadd (%0,%2,1), %%tmm3\n\t"
        "tileloadd (%1,%3,1), %%tmm2\n\t"
        "tilezero %%tmm0\n\t"
        "tileloadd (%4,%2,1), %%tmm5\n\t"
        "tileloadd (%5,%3,1), %%tmm4\n\t"
        "tilezero %%tmm1\n\t"
        "tdpbsud %%tmm3, %%tmm2, %%tmm0\n\t"
        "tdpbsud %%tmm5, %%tmm4, %%tmm1\n\t"
        "tilestored %%tmm0, (%6,%2,1)\n\t"
        "tilestored %%tmm1, (%7,%2,1)" ::"r"(W.v + 8 * b),
        "r"(acts + b * 512), "r"(size_t{64}), "r"(size_t{32}), "r"(W.v + 8 * (b + 1)), "r"(acts + (b + 1) * 512),
        "r"(c[b]), "r"(c[b + 1])
        : "memory");
  }
  if (b < nbc) {
    __asm__ volatile(
        "tileloadd (%0,%2,1), %%tmm3\n\t"
        "tileloadd (%1,%3,1), %%tmm2\n\t"
        "tilezero %%tmm0\n\t"
        "tdpbsud %%tmm3, %%tmm2, %%tmm0\n\t"
        "tilestored %%tmm0, (%4,%2,1)" ::"r"(W.v + 8 * b),
        "r"(acts + b * 512), "r"(size_t{64}), "r"(size_t{32}), "r"(c[b])
        : "memory");
  }
}

// The blocks' products scaled into NT tokens' accumulators (in registers).
template <GemmFormat F, int NT>
void amx_int8_scale(const int32_t (*c)[256], size_t nbc, const GemmWeights& W, const GemmActs& A, size_t t0,
                    size_t tap, __m512* facc) {
  constexpr bool kInit = gemm_block32(F);
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = facc[t];
  for (size_t b = 0; b < nbc; ++b) {
    const size_t at = b * tap + t0;
    const __m512 ws = W.ws[b];
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) {
      __m512i ci = _mm512_load_si512(c[b] + t * 16);
      if constexpr (kInit) ci = _mm512_add_epi32(ci, _mm512_set1_epi32(A.i0[at + static_cast<size_t>(t)]));
      const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(A.da[at + static_cast<size_t>(t)]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ci), scale, acc[t]);
      if constexpr (!kInit) acc[t] = _mm512_fnmadd_ps(W.wm[b], _mm512_set1_ps(A.ds[at + static_cast<size_t>(t)]), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) facc[t] = acc[t];
}

template <GemmFormat F>
using AmxScaleFn = void (*)(const int32_t (*)[256], size_t, const GemmWeights&, const GemmActs&, size_t, size_t, __m512*);
template <GemmFormat F>
struct AmxScaleFns {
  AmxScaleFn<F> fn[16];
};
template <GemmFormat F, int... I>
constexpr AmxScaleFns<F> amx_scale_fns(std::integer_sequence<int, I...>) {
  return {{&amx_int8_scale<F, I + 1>...}};
}

template <GemmFormat F>
void amx_int8_blocks(const GemmWeights& W, size_t nbc, const AmxActs& P, const GemmActs& A, size_t ta, size_t tap,
                     __m512* facc) {
  static constexpr auto kScale = amx_scale_fns<F>(std::make_integer_sequence<int, 16>());
  alignas(64) int32_t c[kGemmBlocks][256];
  for (size_t t0 = 0, tb = 0; t0 < ta; t0 += 16, ++tb) {
    const size_t nt = min_size(16, ta - t0);
    amx_int8_products(W, nbc, P.q + tb * kGemmBlocks * 512, c);
    kScale.fn[nt - 1](c, nbc, W, A, t0, tap, facc + t0);
  }
}

// rows / 16 whole vectors of rows (the caller runs the rest) against
// tokens <= kGemmMaxCallTokens; n elements a row.
template <GemmFormat F, bool kTiles>
void gemm_rows16(const uint8_t* wb, size_t row_bytes, int32_t rows, const uint8_t* ab, size_t act_bytes,
                 int32_t tokens, size_t n, float* out, size_t ld_out) {
  constexpr bool kK = F == GemmFormat::kQ4K || F == GemmFormat::kQ5K || F == GemmFormat::kQ6K ||
                      F == GemmFormat::kIQ4XS || F == GemmFormat::kQ3K || F == GemmFormat::kQ2K || gemm_grid(F);
  // Bytes of one chunk of a row: 8 blocks of 32, or one super-block.
  constexpr size_t kChunkBytes = kK ? gemm_block_bytes<F>() : kGemmBlocks * gemm_block_bytes<F>();
  constexpr GemmFormat kPassAs = gemm_pass_as(F);
  constexpr int kPassTokens = gemm_pass_tokens<kPassAs>();
  static constexpr auto kPass = gemm_pass_fns<kPassAs>(std::make_integer_sequence<int, kPassTokens>());
  const size_t nb = n / kQK32;
  const auto ta = static_cast<size_t>(tokens);
  const size_t tap = (ta + 15) / 16 * 16;  // the token stride of the prepared activations
  const size_t nrv = static_cast<size_t>(rows) / 16;
  GemmActs A;
  GemmWeights W;
  alignas(64) __m512 facc[4 * kGemmMaxCallTokens];  // per vector of rows and token, across chunks
  // Tiles from 9 tokens: at 6-8 (half-empty A tiles) they ran even with
  // the vpdpbusd passes or slower (Sapphire Rapids, colibri_qdot_bench:
  // iq4_xs at 6 tokens 151-153 against 168-171 GOP/s), at 12-32 1.03-1.35x
  // faster.
  constexpr bool kAmx = kTiles && !gemm_halves(kPassAs);
  const bool tiles = kAmx && ta > 8;
  AmxActs P;
  if (tiles) amx_int8_configure();
  for (size_t rv0 = 0; rv0 < nrv; rv0 += 4) {
    const size_t nv = min_size(4, nrv - rv0);
    for (size_t i = 0; i < nv * ta; ++i) facc[i] = _mm512_setzero_ps();
    for (size_t c = 0, b0 = 0; b0 < nb; ++c, b0 += kGemmBlocks) {
      const size_t nbc = min_size(kGemmBlocks, nb - b0);
      prepare_gemm_acts<gemm_acts_as(F)>(ab, act_bytes, ta, tap, n, b0, nbc, A);
      if (tiles) amx_pack_acts(ab, act_bytes, ta, b0, nbc, P);
      for (size_t v = 0; v < nv; ++v) {
        const uint8_t* rows16 = wb + (rv0 + v) * 16 * row_bytes;
        decode_gemm_weights<F>(rows16, row_bytes, c, nbc, W);
        // The next chunk of these rows into L2 while this one computes; at
        // the last, the first chunk of the rows 64 further on (the next
        // group's here, or the caller's next call's: ffn_quant.cpp runs 64
        // rows a call). Without the latter every group started from DRAM:
        // on Zen 5 the T=128 layers ran 1.08-1.28x slower (colibri bench,
        // olmoe iq4_xs 21.0 against 18.1 ms, iq2_xxs 24.2 against 21.7,
        // qwen3-moe iq4_xs 23.1-26.6 against 18.1-20.4).
        {
          const bool last = b0 + kGemmBlocks >= nb;
          const size_t at = last ? 0 : (c + 1) * kChunkBytes;
          const size_t len = min_size(kChunkBytes, row_bytes - at);
          // As an integer: the rows 64 on may lie past the weights (a
          // prefetch does not fault; a pointer past the array is undefined).
          const uintptr_t base = reinterpret_cast<uintptr_t>(rows16) + (last ? 64 * row_bytes : 0) + at;
          for (size_t j = 0; j < 16; ++j) {
            for (size_t o = 0; o < len; o += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(base + j * row_bytes + o), COLIBRI_FAR_PREFETCH_HINT);
            }
          }
        }
        if constexpr (kAmx) {
          if (tiles) {
            amx_int8_blocks<kPassAs>(W, nbc, P, A, ta, tap, facc + v * ta);
            continue;
          }
        }
        // Passes of at most kPassTokens, as even as possible.
        const size_t passes = (ta + kPassTokens - 1) / kPassTokens;
        for (size_t p = 0, t0 = 0; p < passes; ++p) {
          const size_t nt = (ta - t0) / (passes - p);
          kPass.fn[nt - 1](W, nbc, A, t0, tap, facc + v * ta + t0);
          t0 += nt;
        }
      }
    }
    for (size_t v = 0; v < nv; ++v) {
      for (size_t t = 0; t < ta; ++t) _mm512_storeu_ps(out + t * ld_out + (rv0 + v) * 16, facc[v * ta + t]);
    }
  }
  if (tiles) amx_int8_release();
}

// gemm_rows16 over a call's tokens, 32 at a time, for calls of more than
// kAbove tokens.
template <GemmFormat F, int kAbove, bool kTiles>
int32_t gemm_rows(const uint8_t* wb, size_t row_bytes, int32_t rows, const uint8_t* ab, size_t act_bytes,
                  int32_t tokens, size_t n, float* out, size_t ld_out) {
  if (tokens <= kAbove || rows < 16) return 0;
  for (int32_t t0 = 0; t0 < tokens; t0 += kGemmMaxCallTokens) {
    const int32_t tn = tokens - t0 < kGemmMaxCallTokens ? tokens - t0 : kGemmMaxCallTokens;
    gemm_rows16<F, kTiles>(wb, row_bytes, rows, ab + static_cast<size_t>(t0) * act_bytes, act_bytes, tn, n,
                   out + static_cast<size_t>(t0) * ld_out, ld_out);
  }
  return rows / 16 * 16;
}

template <bool kQ8, bool kTiles = false>
void dot_rows_32(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                 size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nb = n / kQK32;
  if (nb == 0) return zero_out(rows, tokens, out, ld_out);
  // Whole vectors of 16 rows of a many-token call, then the rest below.
  const int32_t done = gemm_rows<kQ8 ? GemmFormat::kQ8_0 : GemmFormat::kQ4_0, kMaxTokens, kTiles>(
      wb, row_bytes, rows, ab, act_bytes, tokens, n, out, ld_out);
  if (done == rows) return;
  wb += static_cast<size_t>(done) * row_bytes;
  out += done;
  rows -= done;
  const size_t ng_total = (nb + 15) / 16;
  static constexpr auto kRowFns = q32_row_fns<kQ8>(std::make_integer_sequence<int, kMaxTokens>());
  Group16 buf[kGroupBuffer];
  for (int32_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const int nt = tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens;
    const size_t chunk_groups = kGroupBuffer / static_cast<size_t>(nt);
    for (size_t g0 = 0; g0 < ng_total; g0 += chunk_groups) {
      const size_t ng = min_size(chunk_groups, ng_total - g0);
      for (int t = 0; t < nt; ++t) {
        prepare_groups<kQ8 ? 128 : 8>(ab + static_cast<size_t>(t0 + t) * act_bytes, n, g0, ng, buf + t,
                                      static_cast<size_t>(nt));
      }
      const Q32RowFn row_fn = kRowFns.fn[nt - 1];
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        const uint8_t* row = wb + r * row_bytes;
        float res[kMaxTokens];
        row_fn(row, g0, ng, nb, buf, res);
        for (int t = 0; t < nt; ++t) {
          float* o = out + static_cast<size_t>(t0 + t) * ld_out + r;
          *o = g0 == 0 ? res[t] : *o + res[t];
        }
      }
    }
  }
}

const QuantDotKernels kQ8_0 = {"q8_0-avx512-vnni", quantize_act, dot_rows_32<true>};
const QuantDotKernels kQ4_0 = {"q4_0-avx512-vnni", quantize_act, dot_rows_32<false>};
// mxfp4: the many-token kernel here above 5 tokens; fewer tokens (and the
// rows past the last whole 16) take the AVX2 level's kernels, which decode
// a gpt-oss-20b layer faster than an AVX-512 port of the transposed
// block-32 kernel did on Zen 4 (2.08-2.10 against 2.74-2.84 ms,
// docs/KERNELS.md). On Zen 5 at 6-8 tokens the many-token kernel ran
// 263-314 GOP/s against their 167-188 (colibri_qdot_bench, 2048x1024), at 5
// even.
template <bool kTiles = false>
void dot_rows_mxfp4(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes, int32_t tokens,
                    size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const int32_t done = n / kQK32 == 0 ? 0 : gemm_rows<GemmFormat::kMXFP4, 5, kTiles>(wb, row_bytes, rows, static_cast<const uint8_t*>(act),
                                                                         act_bytes, tokens, n, out, ld_out);
  if (done == rows) return;
  quant_dot_kernels(WeightType::kMXFP4, Isa::kAvx2)
      ->dot_rows(wb + static_cast<size_t>(done) * row_bytes, row_bytes, rows - done, act, act_bytes, tokens, n,
                 out + done, ld_out);
}

const QuantDotKernels kQ4_K = {"q4_k-avx512-vnni", quantize_act, dot_rows_k<Kind::kQ4K>};
const QuantDotKernels kQ5_K = {"q5_k-avx512-vnni", quantize_act, dot_rows_k<Kind::kQ5K>};
const QuantDotKernels kQ6_K = {"q6_k-avx512-vnni", quantize_act, dot_rows_k<Kind::kQ6K>};
const QuantDotKernels kMxfp4 = {"mxfp4-avx512-vnni", quantize_act, dot_rows_mxfp4<>};

// iq4_nl, iq4_xs, q3_k, q2_k and the grid i-quants: the many-token kernel
// here; fewer tokens (and the rows past the last whole 16) take the `Few`
// level's kernels: the AVX2-level ones with EVEX vpdpbusd
// (qdot_avx512vl.cpp) for the iq4 formats up to 8 tokens, the zmm ones of
// qdot_avx512_planes.cpp for q3_k and q2_k up to 16 (on Zen 5 at 16 tokens,
// passes of 8 there ran 1.1-1.2x the many-token kernel's GOP/s:
// colibri_qdot_bench, 2048x1024), those of qdot_avx512_grid.cpp for the grid
// formats up to 8 (at 16 tokens the many-token kernel ran iq2_xxs at 333
// against 229 GOP/s, iq1_s at 279 against 200, iq3_xxs at 225 against 115).
// Where the many-token kernel already wins below 8 tokens it takes those
// calls too (Zen 5, GOP/s, many-token against few-token kernel): iq4_xs
// from 5 (264 / 253; 6: 294 / 184), iq4_nl from 6 (264 / 184; 5: 233 /
// 242), iq3_xxs from 5 (88 / 85; 8: 132 / 110), iq3_s from 6 (101 / 96).
// For the other formats the few-token kernels are as fast at 8 tokens
// or faster (q4_k 316 / 303, q6_k 282 / 273, iq1_s 192 / 178).
using FewTokenTables = const QuantDotKernels* (*)(WeightType);
template <GemmFormat F, WeightType T, FewTokenTables Few, int kFewMaxTokens, bool kTiles = false>
void dot_rows_gemm_or_few(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes,
                          int32_t tokens, size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const int32_t done = n / kQK32 == 0 ? 0
                                      : gemm_rows<F, kFewMaxTokens, kTiles>(wb, row_bytes, rows, static_cast<const uint8_t*>(act),
                                                                    act_bytes, tokens, n, out, ld_out);
  if (done == rows) return;
  Few(T)->dot_rows(wb + static_cast<size_t>(done) * row_bytes, row_bytes, rows - done, act, act_bytes, tokens, n,
                   out + done, ld_out);
}

const QuantDotKernels kIq4Nl = {
    "iq4_nl-avx512-vnni", quantize_act,
    dot_rows_gemm_or_few<GemmFormat::kIQ4NL, WeightType::kIQ4_NL, COLIBRI_QDOT_VARIANT::quant_dot_avx512_ymm, 5>};
const QuantDotKernels kIq4Xs = {
    "iq4_xs-avx512-vnni", quantize_act,
    dot_rows_gemm_or_few<GemmFormat::kIQ4XS, WeightType::kIQ4_XS, COLIBRI_QDOT_VARIANT::quant_dot_avx512_ymm, 4>};
const QuantDotKernels kQ3_K = {"q3_k-avx512-vnni", quantize_act,
                               dot_rows_gemm_or_few<GemmFormat::kQ3K, WeightType::kQ3_K, COLIBRI_QDOT_VARIANT::quant_dot_avx512_planes, 16>};
const QuantDotKernels kQ2_K = {"q2_k-avx512-vnni", quantize_act,
                               dot_rows_gemm_or_few<GemmFormat::kQ2K, WeightType::kQ2_K, COLIBRI_QDOT_VARIANT::quant_dot_avx512_planes, 16>};
template <GemmFormat F, int kFewMaxTokens = kMaxTokens, bool kTiles = false>
constexpr QuantDotKernels grid_kernels(const char* name) {
  return {name, quantize_act,
          dot_rows_gemm_or_few<F, gemm_grid_type(F), COLIBRI_QDOT_VARIANT::quant_dot_avx512_grid, kFewMaxTokens, kTiles>};
}
const QuantDotKernels kIq2Xxs = grid_kernels<GemmFormat::kIQ2XXS>("iq2_xxs-avx512-vnni");
const QuantDotKernels kIq3Xxs = grid_kernels<GemmFormat::kIQ3XXS, 4>("iq3_xxs-avx512-vnni");
const QuantDotKernels kIq3S = grid_kernels<GemmFormat::kIQ3S, 5>("iq3_s-avx512-vnni");
const QuantDotKernels kIq1S = grid_kernels<GemmFormat::kIQ1S>("iq1_s-avx512-vnni");
const QuantDotKernels kIq2Xs = grid_kernels<GemmFormat::kIQ2XS>("iq2_xs-avx512-vnni");
const QuantDotKernels kIq2S = grid_kernels<GemmFormat::kIQ2S>("iq2_s-avx512-vnni");
const QuantDotKernels kIq1M = grid_kernels<GemmFormat::kIQ1M>("iq1_m-avx512-vnni");
const QuantDotKernels kFp8E4M3 = {"fp8_e4m3-avx512-vnni", fp8::copy_act, fp8::dot_rows<Fp8Zmm>};

// The same kernels with the many-token kernel's products on AMX-INT8 tiles,
// for the formats scaled per 32 (the others have no -amx-int8 table).
const QuantDotKernels kQ8_0Amx = {"q8_0-amx-int8", quantize_act, dot_rows_32<true, true>};
const QuantDotKernels kQ4_0Amx = {"q4_0-amx-int8", quantize_act, dot_rows_32<false, true>};
const QuantDotKernels kQ4_KAmx = {"q4_k-amx-int8", quantize_act, dot_rows_k<Kind::kQ4K, true>};
const QuantDotKernels kQ5_KAmx = {"q5_k-amx-int8", quantize_act, dot_rows_k<Kind::kQ5K, true>};
const QuantDotKernels kMxfp4Amx = {"mxfp4-amx-int8", quantize_act, dot_rows_mxfp4<true>};
const QuantDotKernels kIq4NlAmx = {
    "iq4_nl-amx-int8", quantize_act,
    dot_rows_gemm_or_few<GemmFormat::kIQ4NL, WeightType::kIQ4_NL, COLIBRI_QDOT_VARIANT::quant_dot_avx512_ymm, 5, true>};
const QuantDotKernels kIq4XsAmx = {
    "iq4_xs-amx-int8", quantize_act,
    dot_rows_gemm_or_few<GemmFormat::kIQ4XS, WeightType::kIQ4_XS, COLIBRI_QDOT_VARIANT::quant_dot_avx512_ymm, 4, true>};
const QuantDotKernels kIq2XxsAmx = grid_kernels<GemmFormat::kIQ2XXS, kMaxTokens, true>("iq2_xxs-amx-int8");
const QuantDotKernels kIq3XxsAmx = grid_kernels<GemmFormat::kIQ3XXS, 4, true>("iq3_xxs-amx-int8");
const QuantDotKernels kIq3SAmx = grid_kernels<GemmFormat::kIQ3S, 5, true>("iq3_s-amx-int8");
const QuantDotKernels kIq1SAmx = grid_kernels<GemmFormat::kIQ1S, kMaxTokens, true>("iq1_s-amx-int8");

}  // namespace

// Compiled once per far prefetch hint (quant_dot.h).
namespace COLIBRI_QDOT_VARIANT {

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
    case WeightType::kMXFP4:
      return &kMxfp4;
    case WeightType::kIQ4_NL:
      return &kIq4Nl;
    case WeightType::kIQ4_XS:
      return &kIq4Xs;
    case WeightType::kQ3_K:
      return &kQ3_K;
    case WeightType::kQ2_K:
      return &kQ2_K;
    case WeightType::kFP8_E4M3:
      return &kFp8E4M3;
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
    case WeightType::kTQ1_0:
    case WeightType::kTQ2_0:
      return quant_dot_avx512_planes(t);
    default:
      return quant_dot_avx512_ymm(t);
  }
}

const QuantDotKernels* quant_dot_amx_int8(WeightType t) {
  switch (t) {
    case WeightType::kQ8_0:
      return &kQ8_0Amx;
    case WeightType::kQ4_0:
      return &kQ4_0Amx;
    case WeightType::kQ4_K:
      return &kQ4_KAmx;
    case WeightType::kQ5_K:
      return &kQ5_KAmx;
    case WeightType::kMXFP4:
      return &kMxfp4Amx;
    case WeightType::kIQ4_NL:
      return &kIq4NlAmx;
    case WeightType::kIQ4_XS:
      return &kIq4XsAmx;
    case WeightType::kIQ2_XXS:
      return &kIq2XxsAmx;
    case WeightType::kIQ3_XXS:
      return &kIq3XxsAmx;
    case WeightType::kIQ3_S:
      return &kIq3SAmx;
    case WeightType::kIQ1_S:
      return &kIq1SAmx;
    default:
      return nullptr;
  }
}

}  // namespace COLIBRI_QDOT_VARIANT
}  // namespace colibri::kernels
