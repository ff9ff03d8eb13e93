// AVX-512 prefill kernels with the tokens in the vector lanes.
//
// The panel GEMM (ffn_avx512_gemm.cpp) puts 16 weight rows in a vector and
// must transpose every 16x16 block of weights it reads, a cost paid once per
// call and spread over the expert's tokens: with 8-32 tokens per expert the
// shuffles, which compete with the FMAs for the same two ports, eat a large
// part of the time. Here the roles are swapped: the activations of up to 48
// tokens are transposed once per call (Xt, a small array in L2), the
// weights stay row-major as stored, and weights are broadcast from memory
// against vectors of tokens:
//
//   acc[r][v] += broadcast(W[r][k .. k+P)) * Xt[k/P][16v .. 16v+16)
//
// With P = 1 a vector holds 16 tokens at one k; with P = 2 or 4 it holds 8
// or 4 tokens at 2 or 4 consecutive k (summed at the end), so groups of 8 or
// 12 tokens fill their lanes too. f16/bf16 weights are widened into a small
// fp32 chunk in L1 first (a load, a convert and a store per 16 weights, no
// shuffles), because there is no broadcast-and-widen instruction. The
// register block is R rows x NV token vectors (24 accumulators), so each k
// step issues NV vector loads, R broadcasts and R*NV FMAs. Up to 4 tokens
// per expert the lanes and the widening are not paid back and the engine
// uses the decode kernels (docs/KERNELS.md).
//
// Results are sums over k in ascending order for every (row, token) (P
// interleaved partial sums when P > 1): independent of how rows are split
// between threads and of the K spans of phase 2.
//
// Same linkage rules as ffn_avx512.cpp: everything in an anonymous namespace.
#include "kernels/x86_intrinsics.h"

#include <cstddef>
#include <cstdint>

#include "kernels/avx512_common.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#include "util/quant_blocks.h"

namespace colibri::kernels {
namespace {

#define COLIBRI_UNROLL _Pragma("GCC unroll 32")

// Weights widened per chunk of this many k: R rows x 128 x 4 bytes stays in
// L1 next to the matching 128 x (16 NV) slice of Xt.
constexpr int kKc = 128;
// Tokens per group at most: 3 vectors of 16. Four (R = 6 rows per block)
// measured 10-15% slower in phase 1 than 3 (R = 8) on 1024x4096 and
// 2048x1024 experts, so 64 tokens run as 48 + 16.
constexpr int32_t kMaxGroup = 48;
// Keep Xt (K x group x 4 bytes) within about 1 MiB so it stays in L2 while
// every row block reads it; large K (d_ff of the down projection) gets
// smaller groups.
constexpr size_t kXtBudgetBytes = size_t{1} << 20;

// KernelScratch slots.
constexpr int kXtSlot = 0;    // transposed activations
constexpr int kWfSlot = 1;    // widened weight chunk
constexpr int kOutSlot = 2;   // phase 2 lane sums of one row block
constexpr int kPartSlot = 3;  // phase 2 accumulators across K spans

// Rows per register block for NV token vectors: R*NV = 24 accumulators
// (20 for NV = 5), leaving registers for NV activation vectors and the
// broadcast weight. R is even: phase 1 pairs gate and up rows.
template <int NV>
constexpr int block_rows() {
  return NV == 1 ? 24 : NV == 2 ? 12 : NV == 3 ? 8 : NV == 4 ? 6 : 4;
}
// Most accumulator vectors per row of a block (NV = 5: 4 rows x 5).
constexpr int kMaxVectorsPerRow = 5;


// Token groups are laid out for P k-steps per lane group: in vector v of a
// group, lane L holds token v*(16/P) + L/P at k = kb*P + L%P, for k-block kb
// (row kb of Xt, 16*NV floats). P = 1 is a plain transpose (16 tokens per
// vector); P = 2 and 4 put 8 or 4 tokens in a vector, so a group's lanes
// come in steps of 8 or 4 tokens instead of 16, and the weights are then
// broadcast as pairs or quads of consecutive k.

// r[j] (16 floats of token j) -> r[b] = k-block b of the 16/P tokens.
template <int P>
inline void interleave_blocks(__m512* r) {
  if (P == 1) {
    transpose16(r);
  } else if (P == 2) {
    // An 8x8 transpose of 64-bit (k-pair) elements.
    __m512d a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
      a[i] = _mm512_unpacklo_pd(_mm512_castps_pd(r[i]), _mm512_castps_pd(r[i + 1]));
      a[i + 1] = _mm512_unpackhi_pd(_mm512_castps_pd(r[i]), _mm512_castps_pd(r[i + 1]));
    }
    for (int i = 0; i < 8; i += 4) {
      b[i] = _mm512_shuffle_f64x2(a[i], a[i + 2], 0x88);
      b[i + 1] = _mm512_shuffle_f64x2(a[i], a[i + 2], 0xDD);
      b[i + 2] = _mm512_shuffle_f64x2(a[i + 1], a[i + 3], 0x88);
      b[i + 3] = _mm512_shuffle_f64x2(a[i + 1], a[i + 3], 0xDD);
    }
    // b[0]: pairs 0,4 of tokens 0-3; b[1]: 2,6; b[2]: 1,5; b[3]: 3,7 (b[4..7]: tokens 4-7).
    r[0] = _mm512_castpd_ps(_mm512_shuffle_f64x2(b[0], b[4], 0x88));
    r[4] = _mm512_castpd_ps(_mm512_shuffle_f64x2(b[0], b[4], 0xDD));
    r[2] = _mm512_castpd_ps(_mm512_shuffle_f64x2(b[1], b[5], 0x88));
    r[6] = _mm512_castpd_ps(_mm512_shuffle_f64x2(b[1], b[5], 0xDD));
    r[1] = _mm512_castpd_ps(_mm512_shuffle_f64x2(b[2], b[6], 0x88));
    r[5] = _mm512_castpd_ps(_mm512_shuffle_f64x2(b[2], b[6], 0xDD));
    r[3] = _mm512_castpd_ps(_mm512_shuffle_f64x2(b[3], b[7], 0x88));
    r[7] = _mm512_castpd_ps(_mm512_shuffle_f64x2(b[3], b[7], 0xDD));
  } else {
    // A 4x4 transpose of 128-bit (k-quad) elements.
    const __m512 t0 = _mm512_shuffle_f32x4(r[0], r[1], 0x44);
    const __m512 t1 = _mm512_shuffle_f32x4(r[0], r[1], 0xEE);
    const __m512 t2 = _mm512_shuffle_f32x4(r[2], r[3], 0x44);
    const __m512 t3 = _mm512_shuffle_f32x4(r[2], r[3], 0xEE);
    r[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
    r[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
    r[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
    r[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
  }
}

// Xt for `count` tokens from i0 in nv vectors; entries past K or past the
// group's tokens are zero. act_j = base + index(i0 + j) * ld, where index is
// token_index when given, else the identity.
template <int P>
void transpose_tokens(const float* base, size_t ld, const int32_t* token_index, int32_t i0, int32_t count,
                      int32_t K, int nv, float* xt) {
  constexpr int kPerVector = 16 / P;
  const size_t ldxt = static_cast<size_t>(nv) * 16;
  for (int v = 0; v < nv; ++v) {
    const float* rows[kPerVector];
    for (int j = 0; j < kPerVector; ++j) {
      const int32_t i = v * kPerVector + j;
      if (i < count) {
        const int32_t t = token_index != nullptr ? token_index[i0 + i] : i0 + i;
        rows[j] = base + static_cast<size_t>(t) * ld;
      } else {
        rows[j] = nullptr;
      }
    }
    for (int32_t k = 0; k < K; k += 16) {
      const __mmask16 mask =
          K - k >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
      __m512 r[16];
      for (int j = 0; j < kPerVector; ++j) {
        r[j] = rows[j] != nullptr ? _mm512_maskz_loadu_ps(mask, rows[j] + k) : _mm512_setzero_ps();
      }
      interleave_blocks<P>(r);
      for (int b = 0; b < kPerVector; ++b) {
        _mm512_store_ps(xt + static_cast<size_t>(k / P + b) * ldxt + v * 16, r[b]);
      }
    }
  }
}

// wf[r][kk] = W[row0 + r][kc + kk] as fp32, r < R, kk < kn (kn a multiple of
// 16), for weights of type T. Each row's next chunk (`next` bytes further on,
// or the same bytes of the rows R further down at the last chunk) is
// prefetched: a chunk is only 256 B of each of R rows, too short for the
// hardware prefetcher to follow, and without this the first touch of every
// chunk waited on L3 or DRAM while the FMA units idled (a third of the time
// at 8 tokens per expert). The type is a template argument and full chunks
// are unrolled: a switch per row and a compare per 16 weights cost 1-4% of
// the layer at 8-16 tokens per expert (qwen3-moe and olmoe T=128 f16,
// in-process A/B).
template <WeightType T>
inline void widen_row(const char* row, ptrdiff_t next, int32_t kn, float* out) {
  constexpr size_t elem = T == WeightType::kF32 ? 4 : 2;
  COLIBRI_UNROLL
  for (size_t b = 0; b < static_cast<size_t>(kn) * elem; b += 64) _mm_prefetch(row + next + b, _MM_HINT_T0);
  COLIBRI_UNROLL
  for (int32_t kk = 0; kk < kn; kk += 16) _mm512_store_ps(out + kk, load16(row, static_cast<size_t>(kk), T));
}

// fp8_e4m3 (128 codes and their float scale d per block; a chunk of kKc =
// 128 k is one block): each code widened exactly through its f16 form
// (qdot_fp8_impl.h: sign-extended, shifted, bit 14 cleared, converted:
// e4m3 * 2^-8), times 2^8, then times d, rounded once: the reference
// dequantiser's value, so this tier is as exact as the fp32 one. The NaN
// codes (magnitude 480 in that form) become the reference's quiet NaN.
static_assert(kKc == kQKFp8, "a k chunk must be one fp8_e4m3 block");
template <int R>
inline void widen_rows_fp8(const char* w, size_t row_bytes, int32_t row0, int32_t kc, int32_t kn, ptrdiff_t next,
                           float* wf) {
  const char* row = w + static_cast<size_t>(row0) * row_bytes + static_cast<size_t>(kc / kKc) * sizeof(BlockFp8E4M3);
  const __m512 two8 = _mm512_set1_ps(256.0f);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i nan_form = _mm512_set1_epi32(0x43f00000);  // 480.0f
  const __m512i quiet = _mm512_set1_epi32(0x7fc00000);
  for (int r = 0; r < R; ++r, row += row_bytes) {
    COLIBRI_UNROLL
    for (size_t b = 0; b < sizeof(BlockFp8E4M3); b += 64) _mm_prefetch(row + next + b, _MM_HINT_T0);
    float ds;
    __builtin_memcpy(&ds, row + offsetof(BlockFp8E4M3, d), sizeof ds);
    const __m512 d = _mm512_set1_ps(ds);
    const char* qs = row + offsetof(BlockFp8E4M3, qs);
    float* out = wf + r * kKc;
    for (int32_t kk = 0; kk < kn; kk += 16) {
      const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + kk)));
      const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
      __m512 e = _mm512_mul_ps(_mm512_cvtph_ps(h), two8);
      const __m512i bits = _mm512_castps_si512(e);
      const __m512i mag = _mm512_and_si512(bits, abs_mask);
      const __mmask16 nan_code = _mm512_cmpeq_epi32_mask(mag, nan_form);
      e = _mm512_mask_mov_ps(e, nan_code, _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(abs_mask, bits), quiet)));
      _mm512_store_ps(out + kk, _mm512_mul_ps(e, d));
    }
  }
}

// Bytes from a row's element 0 to its element k (a multiple of kKc for
// the block format).
inline size_t chunk_offset(WeightType t, int32_t k) {
  if (t == WeightType::kFP8_E4M3) return static_cast<size_t>(k / kKc) * sizeof(BlockFp8E4M3);
  return static_cast<size_t>(k) * (t == WeightType::kF32 ? 4 : 2);
}

template <int R, WeightType T>
inline void widen_rows(const char* w, size_t row_bytes, int32_t row0, int32_t kc, int32_t kn, ptrdiff_t next,
                       float* wf) {
  constexpr size_t elem = T == WeightType::kF32 ? 4 : 2;
  const char* row = w + static_cast<size_t>(row0) * row_bytes + static_cast<size_t>(kc) * elem;
  for (int r = 0; r < R; ++r, row += row_bytes) {
    // A constant count for full chunks, so both loops unroll completely.
    if (kn == kKc) {
      widen_row<T>(row, next, kKc, wf + r * kKc);
    } else {
      widen_row<T>(row, next, kn, wf + r * kKc);
    }
  }
}

// P consecutive weights of one row, repeated across the vector.
template <int P>
inline __m512 broadcast_weights(const float* at) {
  if (P == 1) return _mm512_set1_ps(*at);
  if (P == 2) {
    double pair;
    __builtin_memcpy(&pair, at, sizeof pair);
    return _mm512_castpd_ps(_mm512_set1_pd(pair));
  }
  return _mm512_broadcast_f32x4(_mm_loadu_ps(at));
}

// acc[r*NV + v] += wf[r][k..] (broadcast P at a time) * xt[k/P][16v ..], k < kn.
template <int R, int NV, int P>
inline void micro_kernel(const float* wf, const float* xt, int32_t kn, __m512* acc) {
  __m512 c[R * NV];
  COLIBRI_UNROLL
  for (int i = 0; i < R * NV; ++i) c[i] = acc[i];
  // Pointers stepped rather than indexed by k: the signed k / P index cost
  // about ten scalar uops a step, some on the FMA ports (8-12% of the loop's
  // time at P = 2 and 4 in a throwaway A/B; none at P = 1).
  const float* const xt_end = xt + static_cast<size_t>(kn / P) * (16 * NV);
  for (; xt < xt_end; xt += 16 * NV, wf += P) {
    __m512 x[NV];
    COLIBRI_UNROLL
    for (int v = 0; v < NV; ++v) x[v] = _mm512_load_ps(xt + 16 * v);
    COLIBRI_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 b = broadcast_weights<P>(wf + r * kKc);
      COLIBRI_UNROLL
      for (int v = 0; v < NV; ++v) c[r * NV + v] = _mm512_fmadd_ps(b, x[v], c[r * NV + v]);
    }
  }
  COLIBRI_UNROLL
  for (int i = 0; i < R * NV; ++i) acc[i] = c[i];
}

// Products of rows [row0, row0 + R) with the group's NV token vectors over
// k in [k_begin, k_end) (multiples of 16; xt holds k from k_begin), added to
// acc; lanes as in transpose_tokens (summed over each lane's P k-steps by
// lane_sums).
template <int R, int NV, int P>
void block_products(const char* w, size_t row_bytes, WeightType t, int32_t row0, int32_t k_begin, int32_t k_end,
                    const float* xt, float* wf, __m512* acc) {
  for (int32_t kc = k_begin; kc < k_end; kc += kKc) {
    const int32_t kn = k_end - kc < kKc ? k_end - kc : kKc;
    // Prefetch target: the next chunk of these rows, or the first chunk of
    // the next R rows (prefetches never fault, even past the matrix).
    const ptrdiff_t next =
        kc + kn < k_end ? static_cast<ptrdiff_t>(chunk_offset(t, kc + kn) - chunk_offset(t, kc))
                        : static_cast<ptrdiff_t>(R * row_bytes) -
                              static_cast<ptrdiff_t>(chunk_offset(t, kc) - chunk_offset(t, k_begin));
    switch (t) {
      case WeightType::kFP8_E4M3: widen_rows_fp8<R>(w, row_bytes, row0, kc, kn, next, wf); break;
      case WeightType::kF16: widen_rows<R, WeightType::kF16>(w, row_bytes, row0, kc, kn, next, wf); break;
      case WeightType::kBF16: widen_rows<R, WeightType::kBF16>(w, row_bytes, row0, kc, kn, next, wf); break;
      case WeightType::kF32: widen_rows<R, WeightType::kF32>(w, row_bytes, row0, kc, kn, next, wf); break;
      default:  // block formats run the tables of ffn_quant.cpp
        break;
    }
    micro_kernel<R, NV, P>(wf, xt + static_cast<size_t>((kc - k_begin) / P) * (16 * NV), kn, acc);
  }
}

template <int R, int NV, int P>
void full_products(const char* w, size_t row_bytes, WeightType t, int32_t row0, int32_t K16, const float* xt,
                   float* wf, __m512* acc) {
  for (int i = 0; i < R * NV; ++i) acc[i] = _mm512_setzero_ps();
  block_products<R, NV, P>(w, row_bytes, t, row0, 0, K16, xt, wf, acc);
}

// Adds each lane group of P lanes into its first lane (lane P*j holds token
// j's sum; the other lanes are left with partial sums and never used).
template <int P>
inline __m512 lane_sums(__m512 a) {
  if (P >= 2) a = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));  // swap neighbours
  if (P >= 4) a = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4E));  // swap pairs
  return a;
}

// Mask of the lanes P*j that hold one of `left` remaining tokens.
template <int P>
inline __mmask16 token_lanes(int32_t left) {
  constexpr int kPerVector = 16 / P;
  const int32_t n = left < kPerVector ? left : kPerVector;
  uint32_t m = 0;
  for (int32_t j = 0; j < n; ++j) m |= 1u << (j * P);
  return static_cast<__mmask16>(m);
}

// Phase 1 for one token group: packed rows 2f (gate) and 2f+1 (up).
template <int NV, int P>
void gate_up_group(const ExpertShape& s, const char* w, size_t row_bytes, const float* xt, int32_t i0, int32_t count,
                   int32_t f_begin, int32_t f_end, float* h, size_t ldh, float* wf) {
  constexpr int R = block_rows<NV>();
  constexpr int RF = R / 2;  // f values per block
  constexpr int kPerVector = 16 / P;
  const int32_t K16 = (s.d_model + 15) / 16 * 16;
  __m512 acc[R * NV];
  // Lane P*j of vector v stores to token v*(16/P) + j.
  const __m512i lane_offsets = _mm512_mullo_epi32(
      _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), P == 1 ? 0 : P == 2 ? 1 : 2),
      _mm512_set1_epi32(static_cast<int32_t>(ldh)));
  auto store = [&](const __m512* a, int nf, int skip, int32_t f0) {
    for (int j = skip; j < nf; ++j) {
      for (int v = 0; v < NV; ++v) {
        const int32_t left = count - v * kPerVector;
        if (left <= 0) break;
        const __m512 hv = silu_mul(lane_sums<P>(a[(2 * j) * NV + v]), lane_sums<P>(a[(2 * j + 1) * NV + v]));
        _mm512_mask_i32scatter_ps(h + static_cast<size_t>(i0 + v * kPerVector) * ldh + f0 + j, token_lanes<P>(left),
                                  lane_offsets, hv, 4);
      }
    }
  };
  const int32_t nf = f_end - f_begin;
  if (nf >= RF) {
    for (int32_t f = f_begin; f < f_end; f += RF) {
      // The last block is moved back to end at f_end; its first rows were
      // already stored by the previous block and are skipped.
      const int32_t f0 = f + RF <= f_end ? f : f_end - RF;
      full_products<R, NV, P>(w, row_bytes, s.weight_type, 2 * f0, K16, xt, wf, acc);
      store(acc, RF, f - f0, f0);
    }
  } else {
    for (int32_t f = f_begin; f < f_end; ++f) {
      full_products<2, NV, P>(w, row_bytes, s.weight_type, 2 * f, K16, xt, wf, acc);
      store(acc, 1, 0, f);
    }
  }
}

// Phase 2 for one token group: y[token] += weight * (down_d . h_token).
// d_ff can be long (14336 for Mixtral) and Xt for a whole group would not
// fit L2, so K is walked in spans of `k_span` (a multiple of kKc): each span's
// Xt is built once and every row block adds its span to accumulators kept in
// `part` (one R x NV block of vectors per row block); the sums still run
// over k in ascending order, so the result does not depend on the span.
template <int NV, int P>
void down_group(const ExpertShape& s, const char* w, size_t row_bytes, const float* h, size_t ldh,
                const int32_t* token_index, const float* weight, int32_t i0, int32_t count, int32_t d_begin,
                int32_t d_end, float* y, size_t ldy, int32_t k_span, float* xt, float* wf, float* out,
                __m512* part) {
  constexpr int R = block_rows<NV>();
  constexpr int kPerVector = 16 / P;
  const int32_t K = s.d_ff;
  const int32_t K16 = (K + 15) / 16 * 16;
  // out[r][lane]: lane sums; then added token by token, tokens in order, so
  // a token listed twice accumulates in a fixed order.
  auto store = [&](const __m512* a, int nr, int skip, int32_t d0) {
    for (int r = skip; r < nr; ++r) {
      for (int v = 0; v < NV; ++v) _mm512_store_ps(out + r * (16 * NV) + 16 * v, lane_sums<P>(a[r * NV + v]));
    }
    for (int32_t j = 0; j < count; ++j) {
      float* yt = y + static_cast<size_t>(token_index[i0 + j]) * ldy + d0;
      const float wj = weight[i0 + j];
      const int lane = (j / kPerVector) * 16 + (j % kPerVector) * P;
      for (int r = skip; r < nr; ++r) yt[r] += wj * out[r * (16 * NV) + lane];
    }
  };
  const int32_t nd = d_end - d_begin;
  const bool blocked = nd >= R;
  const int32_t blocks = blocked ? (nd + R - 1) / R : nd;
  const int block_vectors = blocked ? R * NV : NV;
  // With one span the accumulators need not outlive their block.
  const bool one_span = k_span >= K16;
  __m512 local[R * NV];
  for (int32_t k0 = 0; k0 < K16; k0 += k_span) {
    const int32_t k1 = K16 - k0 < k_span ? K16 : k0 + k_span;
    transpose_tokens<P>(h + k0, ldh, nullptr, i0, count, (K < k1 ? K : k1) - k0, NV, xt);
    const bool last = k1 == K16;
    for (int32_t b = 0; b < blocks; ++b) {
      __m512* acc = one_span ? local : part + static_cast<size_t>(b) * block_vectors;
      if (k0 == 0) {
        for (int i = 0; i < block_vectors; ++i) acc[i] = _mm512_setzero_ps();
      }
      if (blocked) {
        // The last block is moved back to end at d_end; its first rows were
        // already added by the previous block and are skipped.
        const int32_t d = d_begin + b * R;
        const int32_t d0 = d + R <= d_end ? d : d_end - R;
        block_products<R, NV, P>(w, row_bytes, s.weight_type, d0, k0, k1, xt, wf, acc);
        if (last) store(acc, R, d - d0, d0);
      } else {
        block_products<1, NV, P>(w, row_bytes, s.weight_type, d_begin + b, k0, k1, xt, wf, acc);
        if (last) store(acc, 1, 0, d_begin + b);
      }
    }
  }
}

// Tokens per group for a K-long activation: as many as keep Xt within the
// L2 budget, a multiple of 16 between 16 and kMaxGroup.
int32_t group_tokens(int32_t K16) {
  const size_t fit = kXtBudgetBytes / (static_cast<size_t>(K16) * sizeof(float)) / 16 * 16;
  return fit >= kMaxGroup ? kMaxGroup : fit < 16 ? 16 : static_cast<int32_t>(fit);
}

template <int N>
struct Int {
  static constexpr int value = N;
};

// Calls fn(Int<NV>, Int<P>) with the layout that wastes fewest lanes for a
// group of `count` (<= kMaxGroup) tokens: 4 tokens per vector up to 16 tokens, 8 up
// to 40, then 16. (33-40 tokens in three vectors of 16 left up to 15 of 48
// lanes idle; Mixtral's T=128 experts get 32 on average.)
template <typename Fn>
void with_layout(int32_t count, Fn&& fn) {
  if (count <= 16) {
    switch ((count + 3) / 4) {
      case 1: fn(Int<1>{}, Int<4>{}); return;
      case 2: fn(Int<2>{}, Int<4>{}); return;
      case 3: fn(Int<3>{}, Int<4>{}); return;
      default: fn(Int<4>{}, Int<4>{}); return;
    }
  }
  if (count <= 40) {
    switch ((count + 7) / 8) {
      case 3: fn(Int<3>{}, Int<2>{}); return;
      case 4: fn(Int<4>{}, Int<2>{}); return;
      default: fn(Int<5>{}, Int<2>{}); return;
    }
  }
  fn(Int<3>{}, Int<1>{});
}

// Scratch sizes.
constexpr size_t kWfBytes = size_t{24} * kKc * sizeof(float);
constexpr size_t kOutBytes = size_t{24} * 16 * sizeof(float);

size_t gate_up_xt_bytes(int32_t K16) {
  return static_cast<size_t>(K16) * static_cast<size_t>(group_tokens(K16)) * sizeof(float);
}

// Phase 2's K span: as long as keeps Xt for a full group within the L2 budget.
int32_t down_k_span(int32_t K16) {
  const int32_t fit = static_cast<int32_t>(kXtBudgetBytes / (kMaxGroup * sizeof(float)) / kKc * kKc);
  return K16 < fit ? K16 : fit;
}

size_t down_xt_bytes(int32_t K16) {
  return static_cast<size_t>(down_k_span(K16)) * kMaxGroup * sizeof(float);
}

// Accumulators of every row block of a phase 2 range: blocks * R * NV
// vectors, i.e. NV <= kMaxVectorsPerRow per row, for the rows rounded up to
// whole blocks (of at most 24 rows); NV per row when rows are single.
size_t part_bytes(int32_t rows) {
  return (static_cast<size_t>(rows) + 24) * kMaxVectorsPerRow * sizeof(__m512);
}

// The decode kernels of the expert's format (fp8_e4m3: its fp32-activation
// kernels), for when the scratch is missing.
const KernelTable& decode_table(const ExpertShape& s) {
  return s.weight_type == WeightType::kFP8_E4M3 ? fp8_kernels(Isa::kAvx512) : avx512_kernels();
}

bool reserve_tokens_kernels(const ExpertShape& s, int32_t /*max_tokens*/, int32_t max_rows, KernelScratch* scratch) {
  const int32_t Kg = (s.d_model + 15) / 16 * 16;
  const int32_t Kd = (s.d_ff + 15) / 16 * 16;
  const size_t xt = gate_up_xt_bytes(Kg) > down_xt_bytes(Kd) ? gate_up_xt_bytes(Kg) : down_xt_bytes(Kd);
  // Phase 2's row ranges are d_model rows at most.
  const int32_t down_rows = s.d_model < max_rows ? s.d_model : max_rows;
  return scratch->get(kXtSlot, xt) != nullptr && scratch->get(kWfSlot, kWfBytes) != nullptr &&
         scratch->get(kOutSlot, kOutBytes) != nullptr && scratch->get(kPartSlot, part_bytes(down_rows)) != nullptr;
}

void gate_up_tokens(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                    const int32_t* token_index, int32_t n, int32_t f_begin, int32_t f_end, float* h, size_t ldh, KernelScratch* scratch) {
  if (n <= 0 || f_begin >= f_end) return;
  const int32_t K16 = (s.d_model + 15) / 16 * 16;
  const int32_t group = group_tokens(K16);

  float* xt = static_cast<float*>(scratch_buffer(scratch, kXtSlot, gate_up_xt_bytes(K16)));
  float* wf = static_cast<float*>(scratch_buffer(scratch, kWfSlot, kWfBytes));
  if (xt == nullptr || wf == nullptr) {
    // Out of memory for a few hundred KiB of scratch: the decode kernels
    // need none and give the same sums up to rounding.
    decode_table(s).gate_up(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh, scratch);
    return;
  }
  const char* w = static_cast<const char*>(gate_up);
  const size_t row_bytes = weight_row_bytes(s.weight_type, s.gate_up_stride);
  for (int32_t i0 = 0; i0 < n; i0 += group) {
    const int32_t count = n - i0 < group ? n - i0 : group;
    with_layout(count, [&](auto nv_tag, auto p_tag) {
      constexpr int NV = decltype(nv_tag)::value;
      constexpr int P = decltype(p_tag)::value;
      transpose_tokens<P>(x, ldx, token_index, i0, count, s.d_model, NV, xt);
      gate_up_group<NV, P>(s, w, row_bytes, xt, i0, count, f_begin, f_end, h, ldh, wf);
    });
  }
}

void down_tokens(const ExpertShape& s, const void* down, const float* h, size_t ldh, const int32_t* token_index,
                 const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* scratch) {
  if (n <= 0 || d_begin >= d_end) return;
  const int32_t K16 = (s.d_ff + 15) / 16 * 16;
  const int32_t k_span = down_k_span(K16);

  float* xt = static_cast<float*>(scratch_buffer(scratch, kXtSlot, down_xt_bytes(K16)));
  float* wf = static_cast<float*>(scratch_buffer(scratch, kWfSlot, kWfBytes));
  float* out = static_cast<float*>(scratch_buffer(scratch, kOutSlot, kOutBytes));
  __m512* part = static_cast<__m512*>(scratch_buffer(scratch, kPartSlot, part_bytes(d_end - d_begin)));
  if (xt == nullptr || wf == nullptr || out == nullptr || part == nullptr) {
    decode_table(s).down(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
    return;
  }
  const char* w = static_cast<const char*>(down);
  const size_t row_bytes = weight_row_bytes(s.weight_type, s.down_stride);
  for (int32_t i0 = 0; i0 < n; i0 += kMaxGroup) {
    const int32_t count = n - i0 < kMaxGroup ? n - i0 : kMaxGroup;
    with_layout(count, [&](auto nv_tag, auto p_tag) {
      constexpr int NV = decltype(nv_tag)::value;
      constexpr int P = decltype(p_tag)::value;
      down_group<NV, P>(s, w, row_bytes, h, ldh, token_index, weight, i0, count, d_begin, d_end, y, ldy, k_span, xt,
                        wf, out, part);
    });
  }
}

}  // namespace

const KernelTable& avx512_tokens_kernels() {
  static const KernelTable table{Isa::kAvx512, "avx512-tokens", gate_up_tokens, down_tokens, reserve_tokens_kernels};
  return table;
}

}  // namespace colibri::kernels
