// TQ2_0 and TQ1_0 on zmm for AVX512_VNNI CPUs (AVX-512 F/BW only besides).
// The AVX2-level kernel (qdot_ternary_impl.h, EVEX ymm here before) unpacked
// half a super-block per ymm, transposed it, and converted, scaled and
// added one product vector per half and token: at decode (one token) the
// conversions and the per-half work, not the weights' bytes, bound it.
//
// Here the 64 code bytes of a super-block are one zmm, and each of the four
// code vectors is one vpshufd (dword v of every 128-bit lane, broadcast in
// it), one vpsrlvd by 0, 2, 4, 6 per dword and one and: dword lane 4Q + l
// of vector v holds the 2-bit field l of dword 4Q + v, that is activation
// block 4 (Q / 2) + l, values 16 (Q % 2) + 4 v .. + 3. Every lane so keeps
// one block through the four vectors, and a token's four vpdpbusd add in
// int32 lane by lane (16 values a lane); one conversion and one FMA per
// token and super-block apply d times the lane's activation scale, one
// horizontal sum per row and token at the end.
//
// Codes 0..3 are unsigned (x = d (t - 1), TQ2_0's 3 as 2 as ggml reads
// it); the -1 is the accumulator's start, minus the lane's 16 activations'
// sum. The activations are rearranged once per call to the lanes' order
// with their scales and negated sums; four rows share the token's loads
// at one token, two up to 4 tokens.
//
// TQ1_0's trits are put in the same lanes (unpack_tq1), so both formats
// share the activations' order and the per-token work.
//
// Everything lives in an anonymous namespace (tests/isa_linkage.sh).
#include <type_traits>

#include "kernels/qdot_avx2_impl.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "qdot_avx512_ternary.cpp needs -mavx512f -mavx512bw -mavx512vnni"
#endif

namespace colibri::kernels {
namespace {

// A token's prepared super-block: 4 x 64 activation bytes in the code
// vectors' order (at 0), 16 floats (lane k: its block's activation scale),
// 16 int32 (lane k: minus its 16 activations' sum).
constexpr size_t kPrepScales = 256;
constexpr size_t kPrepInit = 320;
constexpr size_t kPrepSb = 384;

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
  const __m256 da = _mm256_loadu_ps(reinterpret_cast<const float*>(act_d(act, n) + 32 * sb));
  _mm512_storeu_ps(out + kPrepScales,
                   _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7),
                                         _mm512_castps256_ps512(da)));
  const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act_sums(act, n) + 32 * sb));
  const __m512i s = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15),
                                             _mm512_cvtepi16_epi32(sums));
  _mm512_storeu_si512(out + kPrepInit, _mm512_sub_epi32(_mm512_setzero_si512(), s));
}

// A super-block's four code vectors (see the top) and its d.
struct TqZ {
  __m512i x[4];
  __m512 d;
};

inline void unpack_tq2(const BlockTq2_0* b, TqZ* z) {
  const __m512i q = _mm512_loadu_si512(b->qs);
  const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
  const __m512i m3 = _mm512_set1_epi8(3);
  z->x[0] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(q, _MM_PERM_AAAA), sh), m3);
  z->x[1] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(q, _MM_PERM_BBBB), sh), m3);
  z->x[2] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(q, _MM_PERM_CCCC), sh), m3);
  z->x[3] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(q, _MM_PERM_DDDD), sh), m3);
  z->d = _mm512_set1_ps(h2f(b->d));
}

// TQ1_0's codes in the same lanes: lane k of vector v takes its four bytes
// from dword src[k] + v of qs (lane 15: qh's, for every v) and their trit
// p[k] (lane 15: trit v), block by block as the format orders them (trits
// 0-4 of qs[0, 32) are blocks 0-4; trits 0-4 of qs[32, 48) blocks 5, 6 and
// the first half of 7; qh's trits 0-3 its second half). The power is a
// 16-bit multiply per byte parity (the low byte of a word product depends
// only on the low bytes), the trit [q > 85] + [q > 170] of q = 3^k b mod
// 256 (ggml's (3 q) >> 8).
inline void unpack_tq1(const BlockTq1_0* b, TqZ* z) {
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
  z->d = _mm512_set1_ps(h2f(b->d));
}

enum class Tq { k1, k2 };

template <Tq F>
using TqBlock = std::conditional_t<F == Tq::k1, BlockTq1_0, BlockTq2_0>;

template <Tq F>
inline void unpack(const TqBlock<F>* b, TqZ* z) {
  if constexpr (F == Tq::k1) {
    unpack_tq1(b, z);
  } else {
    unpack_tq2(b, z);
  }
}

// NR rows (row_bytes apart) against NT prepared tokens over nsb
// super-blocks; res[r * NT + t].
template <Tq F, int NR, int NT>
void tq_rows_zmm(const uint8_t* row, size_t row_bytes, size_t nsb, const uint8_t* const* prep, float* res) {
  __m512 facc[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) facc[r][t] = _mm512_setzero_ps();
  }
  for (size_t s = 0; s < nsb; ++s) {
    TqZ z[NR];
    for (int r = 0; r < NR; ++r) {
      const auto* b = reinterpret_cast<const TqBlock<F>*>(row + static_cast<size_t>(r) * row_bytes) + s;
      prefetch_block<sizeof(TqBlock<F>)>(reinterpret_cast<const uint8_t*>(b));
      unpack<F>(b, &z[r]);
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* p = prep[t] + s * kPrepSb;
      __m512i a[4];
      for (int j = 0; j < 4; ++j) a[j] = _mm512_loadu_si512(p + 64 * j);
      const __m512i init = _mm512_loadu_si512(p + kPrepInit);
      const __m512 da = _mm512_loadu_ps(p + kPrepScales);
      for (int r = 0; r < NR; ++r) {
        __m512i acc = _mm512_dpbusd_epi32(init, z[r].x[0], a[0]);
        acc = _mm512_dpbusd_epi32(acc, z[r].x[1], a[1]);
        acc = _mm512_dpbusd_epi32(acc, z[r].x[2], a[2]);
        acc = _mm512_dpbusd_epi32(acc, z[r].x[3], a[3]);
        facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(z[r].d, da), facc[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) res[r * NT + t] = _mm512_reduce_add_ps(facc[r][t]);
  }
}

// Up to kMaxTokens tokens a pass; per pass the super-blocks in column
// chunks whose prepared activations fit the stack buffer; per chunk every
// row, four at a time at one token and two up to 4 tokens (more would
// spill the accumulators and codes).
template <Tq F>
void dot_rows_tq_zmm(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes,
                      int32_t tokens, size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  if (nsb == 0) return zero_out(rows, tokens, out, ld_out);
  alignas(64) uint8_t buf[kActBufferBytes];
  for (int32_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const int nt = tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens;
    const size_t chunk = kActBufferBytes / (kPrepSb * static_cast<size_t>(nt));
    for (size_t c0 = 0; c0 < nsb; c0 += chunk) {
      const size_t cn = min_size(chunk, nsb - c0);
      const uint8_t* prep[kMaxTokens];
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
      size_t r = 0;
      float res[4 * kMaxTokens];
      if (nt == 1) {
        for (; r + 4 <= nrows; r += 4) {
          tq_rows_zmm<F, 4, 1>(wb + r * row_bytes + c0 * sizeof(TqBlock<F>), row_bytes, cn, prep, res);
          store(r, 4, res);
        }
      }
      if (nt <= 4) {
        for (; r + 2 <= nrows; r += 2) {
          const uint8_t* row = wb + r * row_bytes + c0 * sizeof(TqBlock<F>);
          with_token_count<4>(nt, [&]<int NT>() { tq_rows_zmm<F, 2, NT>(row, row_bytes, cn, prep, res); });
          store(r, 2, res);
        }
      }
      for (; r < nrows; ++r) {
        const uint8_t* row = wb + r * row_bytes + c0 * sizeof(TqBlock<F>);
        with_token_count<kMaxTokens>(nt, [&]<int NT>() { tq_rows_zmm<F, 1, NT>(row, row_bytes, cn, prep, res); });
        store(r, 1, res);
      }
    }
  }
}

const QuantDotKernels kTq1_0 = {"tq1_0-avx512-vnni", quantize_act, dot_rows_tq_zmm<Tq::k1>};
const QuantDotKernels kTq2_0 = {"tq2_0-avx512-vnni", quantize_act, dot_rows_tq_zmm<Tq::k2>};

}  // namespace

const QuantDotKernels* quant_dot_avx512_ternary(WeightType t) {
  switch (t) {
    case WeightType::kTQ1_0:
      return &kTq1_0;
    case WeightType::kTQ2_0:
      return &kTq2_0;
    default:
      return nullptr;
  }
}

}  // namespace colibri::kernels
