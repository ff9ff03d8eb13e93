// The formats whose codes lie in q2_K's 2-bit planes (Q2_K, Q3_K's low
// bits, TQ2_0; TQ1_0's trits put in the same lanes) on zmm for AVX512_VNNI
// CPUs (AVX-512 F/BW only besides). The AVX2-level kernels (qdot_avx2_impl.h,
// qdot_ternary_impl.h, EVEX ymm here before) unpacked half a super-block per
// ymm, transposed it, and converted, scaled and added one product vector
// per half and token: at decode (one token) the conversions and the
// per-half work, not the weights' bytes, bound them.
//
// Here the 64 code bytes of a super-block are one zmm, and each of the four
// code vectors is one vpshufd (dword v of every 128-bit lane, broadcast in
// it), one vpsrlvd by 0, 2, 4, 6 per dword and one and: dword lane 4Q + l
// of vector v holds the 2-bit field l of dword 4Q + v, that is activation
// block 4 (Q / 2) + l, values 16 (Q % 2) + 4 v .. + 3: the 16 values of
// sub-block s(k) = 8 (Q / 2) + 2 l + Q % 2 of the 16-value formats. Every
// lane so keeps one sub-block through the four vectors, and a token's four
// vpdpbusd add in int32 lane by lane; one conversion and one FMA per token
// and super-block apply the lane's weight scale times its activation scale
// (TQ: d; Q2_K, Q3_K: d times the sub-block's scale), one horizontal sum
// per row and token at the end.
//
// Offsets and mins: TQ's codes 0..3 are unsigned (x = d (t - 1), TQ2_0's 3
// as 2 as ggml reads it), the -1 the accumulator's start, minus the lane's
// 16 activations' sum; Q3_K's -4 (x = d sc (q - 4), q = the low bits + 4
// times hmask's) likewise, four times that. Q2_K's mins (x = d sc q -
// dmin m) are one more FMA per token and super-block: the lanes' dmin m
// against their 16 activations' sum times their scale, prepared once per
// call.
//
// The activations are rearranged once per call to the lanes' order with
// their scales, negated sums and scaled sums; four rows share the token's
// loads at one token, two up to 4 tokens.
//
// Everything lives in an anonymous namespace (tests/isa_linkage.sh).
#include <type_traits>

#include "kernels/qdot_avx2_impl.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "qdot_avx512_planes.cpp needs -mavx512f -mavx512bw -mavx512vnni"
#endif

namespace colibri::kernels {
namespace {

// A token's prepared super-block: 4 x 64 activation bytes in the code
// vectors' order (at 0), 16 floats (lane k: its block's activation scale),
// 16 int32 (lane k: minus its 16 activations' sum), 16 floats (lane k: that
// sum times the scale).
constexpr size_t kPrepScales = 256;
constexpr size_t kPrepInit = 320;
constexpr size_t kPrepScaledSums = 384;
constexpr size_t kPrepSb = 448;

// Lane k's sub-block s(k) (see the top): the order of the lanes' 16-value
// sums and scales.
inline __m512i sub_block_lanes() {
  return _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
}

// Super-block sb of a token's activation row, rearranged (kPrepSb). Lane
// k = 4 Q + l of vector v takes activation dword 32 (Q / 2) + 8 l + 4 (Q % 2)
// + v: the low two 128-bit lanes from the first 128 values, the high two
// from the second.
inline void prepare_sb(const uint8_t* act, size_t n, size_t sb, uint8_t* out) {
  const uint8_t* q = act + kQKK * sb;
  const __m512i c0 = _mm512_loadu_si512(q);
  const __m512i c1 = _mm512_loadu_si512(q + 64);
  const __m512i c2 = _mm512_loadu_si512(q + 128);
  const __m512i c3 = _mm512_loadu_si512(q + 192);
  const __m512i base = _mm512_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28, 0, 8, 16, 24, 4, 12, 20, 28);
  for (int v = 0; v < 4; ++v) {
    const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(v));
    const __m512i lo = _mm512_permutex2var_epi32(c0, idx, c1);
    const __m512i hi = _mm512_permutex2var_epi32(c2, idx, c3);
    _mm512_storeu_si512(out + 64 * static_cast<size_t>(v), _mm512_mask_blend_epi32(0xff00, lo, hi));
  }
  const __m256 da8 = _mm256_loadu_ps(reinterpret_cast<const float*>(act_d(act, n) + 32 * sb));
  const __m512 da = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7),
                                          _mm512_castps256_ps512(da8));
  _mm512_storeu_ps(out + kPrepScales, da);
  const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act_sums(act, n) + 32 * sb));
  const __m512i s = _mm512_permutexvar_epi32(sub_block_lanes(), _mm512_cvtepi16_epi32(sums));
  _mm512_storeu_si512(out + kPrepInit, _mm512_sub_epi32(_mm512_setzero_si512(), s));
  _mm512_storeu_ps(out + kPrepScaledSums, _mm512_mul_ps(_mm512_cvtepi32_ps(s), da));
}

// A super-block's four code vectors (see the top) and the lanes' weight
// scales: w (TQ: d in every lane) and, for Q2_K, m (the lanes' dmin m,
// against their scaled activation sums).
struct PlaneZ {
  __m512i x[4];
  __m512 w;
  __m512 m;
};

// The code vectors of q2_K's 64 layout bytes (Q2_K's and Q3_K's qs, TQ2_0's).
inline void unpack_planes(const uint8_t* qs, PlaneZ* z) {
  const __m512i q = _mm512_loadu_si512(qs);
  const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
  const __m512i m3 = _mm512_set1_epi8(3);
  z->x[0] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(q, _MM_PERM_AAAA), sh), m3);
  z->x[1] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(q, _MM_PERM_BBBB), sh), m3);
  z->x[2] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(q, _MM_PERM_CCCC), sh), m3);
  z->x[3] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(q, _MM_PERM_DDDD), sh), m3);
}

inline void unpack_tq2(const BlockTq2_0* b, PlaneZ* z) {
  unpack_planes(b->qs, z);
  z->w = _mm512_set1_ps(h2f(b->d));
}

// TQ1_0's codes in the same lanes: lane k of vector v takes its four bytes
// from dword src[k] + v of qs (lane 15: qh's, for every v) and their trit
// p[k] (lane 15: trit v), block by block as the format orders them (trits
// 0-4 of qs[0, 32) are blocks 0-4; trits 0-4 of qs[32, 48) blocks 5, 6 and
// the first half of 7; qh's trits 0-3 its second half). The power is a
// 16-bit multiply per byte parity (the low byte of a word product depends
// only on the low bytes), the trit [q > 85] + [q > 170] of q = 3^k b mod
// 256 (ggml's (3 q) >> 8).
inline void unpack_tq1(const BlockTq1_0* b, PlaneZ* z) {
  // qs and qh as 13 dwords; masked, so the last block reads no further.
  const __m512i raw = _mm512_maskz_loadu_epi32(0x1fff, b->qs);
  const __m512i src = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 8, 8, 8, 4, 8, 8, 12);
  const __m512i hi_bytes = _mm512_set1_epi16(static_cast<int16_t>(0xff00));
  const __m512i one = _mm512_set1_epi8(1);
  const __m512i two = _mm512_set1_epi8(2);
  constexpr int kP[4] = {1, 3, 9, 27};
  for (int v = 0; v < 4; ++v) {
    const int w = kP[v] * 0x10001;
    const __m512i pw = _mm512_setr_epi32(0x10001, 3 * 0x10001, 9 * 0x10001, 27 * 0x10001, 0x10001, 3 * 0x10001,
                                         9 * 0x10001, 27 * 0x10001, 81 * 0x10001, 0x10001, 9 * 0x10001, 81 * 0x10001,
                                         81 * 0x10001, 3 * 0x10001, 27 * 0x10001, w);
    const __m512i idx = _mm512_mask_add_epi32(src, 0x7fff, src, _mm512_set1_epi32(v));
    const __m512i g = _mm512_permutexvar_epi32(idx, raw);
    const __m512i lo = _mm512_mullo_epi16(g, pw);
    const __m512i hi = _mm512_mullo_epi16(_mm512_and_si512(g, hi_bytes), pw);
    const __m512i q = _mm512_mask_blend_epi8(0xaaaaaaaaaaaaaaaaull, lo, hi);
    const __mmask64 ge1 = _mm512_cmpgt_epu8_mask(q, _mm512_set1_epi8(85));
    const __mmask64 ge2 = _mm512_cmpgt_epu8_mask(q, _mm512_set1_epi8(static_cast<char>(170)));
    z->x[v] = _mm512_mask_mov_epi8(_mm512_maskz_mov_epi8(ge1, one), ge2, two);
  }
  z->w = _mm512_set1_ps(h2f(b->d));
}

// Q2_K: the 16 scale bytes (sc in the low nibble, m in the high) put in
// the lanes' order, times d and dmin.
inline void unpack_q2k(const BlockQ2K* b, PlaneZ* z) {
  unpack_planes(b->qs, z);
  const __m512i raw = _mm512_permutexvar_epi32(
      sub_block_lanes(), _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales))));
  const __m512i sc = _mm512_and_si512(raw, _mm512_set1_epi32(0x0f));
  const __m512i m = _mm512_srli_epi32(raw, 4);
  z->w = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(h2f(b->d)));
  z->m = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(h2f(b->dmin)));
}

// Q3_K: the low bits as Q2_K's, plus 4 where hmask's bit is set: value i of
// vector v's lane 4Q + l is element 128 (Q / 2) + 32 l + 16 (Q % 2) + 4 v + i,
// whose bit is bit 4 (Q / 2) + l of hmask[16 (Q % 2) + 4 v + i], that is of
// byte i of dword v of the 128-bit lane Q of hmask put twice.
inline void unpack_q3k(const BlockQ3K* b, PlaneZ* z) {
  unpack_planes(b->qs, z);
  const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->hmask)));
  const __m512i bit = _mm512_setr_epi32(0x01010101, 0x02020202, 0x04040404, 0x08080808, 0x01010101, 0x02020202,
                                        0x04040404, 0x08080808, 0x10101010, 0x20202020, 0x40404040,
                                        static_cast<int>(0x80808080), 0x10101010, 0x20202020, 0x40404040,
                                        static_cast<int>(0x80808080));
  const __m512i four = _mm512_set1_epi8(4);
  const __mmask64 h0 = _mm512_test_epi8_mask(_mm512_shuffle_epi32(hm, _MM_PERM_AAAA), bit);
  const __mmask64 h1 = _mm512_test_epi8_mask(_mm512_shuffle_epi32(hm, _MM_PERM_BBBB), bit);
  const __mmask64 h2 = _mm512_test_epi8_mask(_mm512_shuffle_epi32(hm, _MM_PERM_CCCC), bit);
  const __mmask64 h3 = _mm512_test_epi8_mask(_mm512_shuffle_epi32(hm, _MM_PERM_DDDD), bit);
  z->x[0] = _mm512_mask_add_epi8(z->x[0], h0, z->x[0], four);
  z->x[1] = _mm512_mask_add_epi8(z->x[1], h1, z->x[1], four);
  z->x[2] = _mm512_mask_add_epi8(z->x[2], h2, z->x[2], four);
  z->x[3] = _mm512_mask_add_epi8(z->x[3], h3, z->x[3], four);
  // The scales (sc - 32): lane k's sub-block s takes its low four bits from
  // byte s % 8 at bit 4 (s / 8), its high two from byte 8 + s % 4 at bit
  // 2 (s / 4) of the 12 packed bytes.
  const __m512i packed = _mm512_maskz_loadu_epi32(0x7, b->scales);
  const __m512i low_dword = _mm512_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1);
  const __m512i low_shift = _mm512_setr_epi32(0, 16, 0, 16, 8, 24, 8, 24, 4, 20, 4, 20, 12, 28, 12, 28);
  const __m512i high_shift = _mm512_setr_epi32(0, 16, 2, 18, 8, 24, 10, 26, 4, 20, 6, 22, 12, 28, 14, 30);
  const __m512i low = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(low_dword, packed), low_shift),
                                       _mm512_set1_epi32(0x0f));
  const __m512i high = _mm512_slli_epi32(
      _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_set1_epi32(2), packed), high_shift), 4);
  const __m512i sc = _mm512_sub_epi32(_mm512_ternarylogic_epi32(low, high, _mm512_set1_epi32(0x30), 0xf8),
                                      _mm512_set1_epi32(32));
  z->w = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(h2f(b->d)));
}

enum class Planes { kTq1, kTq2, kQ2K, kQ3K };

template <Planes F>
struct PlanesTraits;
template <>
struct PlanesTraits<Planes::kTq1> {
  using Block = BlockTq1_0;
  static void unpack(const Block* b, PlaneZ* z) { unpack_tq1(b, z); }
};
template <>
struct PlanesTraits<Planes::kTq2> {
  using Block = BlockTq2_0;
  static void unpack(const Block* b, PlaneZ* z) { unpack_tq2(b, z); }
};
template <>
struct PlanesTraits<Planes::kQ2K> {
  using Block = BlockQ2K;
  static void unpack(const Block* b, PlaneZ* z) { unpack_q2k(b, z); }
};
template <>
struct PlanesTraits<Planes::kQ3K> {
  using Block = BlockQ3K;
  static void unpack(const Block* b, PlaneZ* z) { unpack_q3k(b, z); }
};

// The formats with an offset start from minus the sums (Q3_K four times);
// Q2_K subtracts m times the scaled sums after the conversion.
template <Planes F>
constexpr bool kMins = F == Planes::kQ2K;

// NR rows (row_bytes apart) against NT prepared tokens over nsb
// super-blocks; res[r * NT + t].
template <Planes F, int NR, int NT>
void plane_rows_zmm(const uint8_t* row, size_t row_bytes, size_t nsb, const uint8_t* const* prep, float* res) {
  using Block = typename PlanesTraits<F>::Block;
  __m512 facc[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) facc[r][t] = _mm512_setzero_ps();
  }
  for (size_t s = 0; s < nsb; ++s) {
    PlaneZ z[NR];
    for (int r = 0; r < NR; ++r) {
      const auto* b = reinterpret_cast<const Block*>(row + static_cast<size_t>(r) * row_bytes) + s;
      prefetch_block<sizeof(Block)>(reinterpret_cast<const uint8_t*>(b));
      PlanesTraits<F>::unpack(b, &z[r]);
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* p = prep[t] + s * kPrepSb;
      __m512i a[4];
      for (int j = 0; j < 4; ++j) a[j] = _mm512_loadu_si512(p + 64 * j);
      __m512i init = _mm512_setzero_si512();
      if constexpr (F == Planes::kQ3K) {
        init = _mm512_slli_epi32(_mm512_loadu_si512(p + kPrepInit), 2);
      } else if constexpr (!kMins<F>) {
        init = _mm512_loadu_si512(p + kPrepInit);
      }
      const __m512 da = _mm512_loadu_ps(p + kPrepScales);
      for (int r = 0; r < NR; ++r) {
        __m512i acc = _mm512_dpbusd_epi32(init, z[r].x[0], a[0]);
        acc = _mm512_dpbusd_epi32(acc, z[r].x[1], a[1]);
        acc = _mm512_dpbusd_epi32(acc, z[r].x[2], a[2]);
        acc = _mm512_dpbusd_epi32(acc, z[r].x[3], a[3]);
        facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(z[r].w, da), facc[r][t]);
        if constexpr (kMins<F>) {
          facc[r][t] = _mm512_fnmadd_ps(z[r].m, _mm512_loadu_ps(p + kPrepScaledSums), facc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) res[r * NT + t] = _mm512_reduce_add_ps(facc[r][t]);
  }
}

// Tokens a pass: a row's unpacked super-block (six zmm) serves this many
// tokens' accumulators.
constexpr int kPassTokens = 8;

// Up to kPassTokens tokens a pass; per pass the super-blocks in column
// chunks whose prepared activations fit the stack buffer; per chunk every
// row, four at a time at one token and two up to 4 tokens (more would
// spill the accumulators and codes).
template <Planes F>
void dot_rows_planes_zmm(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes,
                         int32_t tokens, size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  if (nsb == 0) return zero_out(rows, tokens, out, ld_out);
  alignas(64) uint8_t buf[kActBufferBytes];
  for (int32_t t0 = 0; t0 < tokens; t0 += kPassTokens) {
    const int nt = tokens - t0 < kPassTokens ? tokens - t0 : kPassTokens;
    const size_t chunk = kActBufferBytes / (kPrepSb * static_cast<size_t>(nt));
    for (size_t c0 = 0; c0 < nsb; c0 += chunk) {
      const size_t cn = min_size(chunk, nsb - c0);
      const uint8_t* prep[kPassTokens];
      for (int t = 0; t < nt; ++t) {
        uint8_t* p = buf + static_cast<size_t>(t) * cn * kPrepSb;
        const uint8_t* a = ab + static_cast<size_t>(t0 + t) * act_bytes;
        for (size_t s = 0; s < cn; ++s) prepare_sb(a, n, c0 + s, p + s * kPrepSb);
        prep[t] = p;
      }
      const size_t nrows = static_cast<size_t>(rows);
      // The results of nr rows from r, res[i * nt + t].
      const auto store = [&](size_t r, int nr, const float* res) {
        for (int i = 0; i < nr; ++i) {
          for (int t = 0; t < nt; ++t) {
            float* o = out + static_cast<size_t>(t0 + t) * ld_out + r + static_cast<size_t>(i);
            const float v = res[i * nt + t];
            *o = c0 == 0 ? v : *o + v;
          }
        }
      };
      constexpr size_t kBlockBytes = sizeof(typename PlanesTraits<F>::Block);
      size_t r = 0;
      float res[4 * kPassTokens];
      if (nt == 1) {
        for (; r + 4 <= nrows; r += 4) {
          plane_rows_zmm<F, 4, 1>(wb + r * row_bytes + c0 * kBlockBytes, row_bytes, cn, prep, res);
          store(r, 4, res);
        }
      }
      if (nt <= 4) {
        for (; r + 2 <= nrows; r += 2) {
          const uint8_t* row = wb + r * row_bytes + c0 * kBlockBytes;
          with_token_count<4>(nt, [&]<int NT>() { plane_rows_zmm<F, 2, NT>(row, row_bytes, cn, prep, res); });
          store(r, 2, res);
        }
      }
      for (; r < nrows; ++r) {
        const uint8_t* row = wb + r * row_bytes + c0 * kBlockBytes;
        with_token_count<kPassTokens>(nt, [&]<int NT>() { plane_rows_zmm<F, 1, NT>(row, row_bytes, cn, prep, res); });
        store(r, 1, res);
      }
    }
  }
}

const QuantDotKernels kTq1_0 = {"tq1_0-avx512-vnni", quantize_act, dot_rows_planes_zmm<Planes::kTq1>};
const QuantDotKernels kTq2_0 = {"tq2_0-avx512-vnni", quantize_act, dot_rows_planes_zmm<Planes::kTq2>};
const QuantDotKernels kQ2_K = {"q2_k-avx512-vnni", quantize_act, dot_rows_planes_zmm<Planes::kQ2K>};
const QuantDotKernels kQ3_K = {"q3_k-avx512-vnni", quantize_act, dot_rows_planes_zmm<Planes::kQ3K>};

}  // namespace

// Compiled once per far prefetch hint (quant_dot.h).
namespace COLIBRI_QDOT_VARIANT {

const QuantDotKernels* quant_dot_avx512_planes(WeightType t) {
  switch (t) {
    case WeightType::kTQ1_0:
      return &kTq1_0;
    case WeightType::kTQ2_0:
      return &kTq2_0;
    case WeightType::kQ2_K:
      return &kQ2_K;
    case WeightType::kQ3_K:
      return &kQ3_K;
    default:
      return nullptr;
  }
}

}  // namespace COLIBRI_QDOT_VARIANT
}  // namespace colibri::kernels
