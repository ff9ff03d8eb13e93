// bf16 dot-product kernels for bf16 weights on CPUs with AVX512_BF16 (built
// with -mavx512f/bw/vl/dq/bf16 -mavx2 -mfma). Tables "avx512-bf16" (the
// activations rounded to bf16, described below; a bf16_compute prefill
// table) and "avx512-bf16-split" (the bf16 decode table: each activation
// split into hi = bf16(a) and lo = bf16(a - hi), both multiplied, so the
// error per product is below 2^-17 instead of 2^-9; experts with more than
// one token go to the fp32 "avx512" kernels, faster there).
//
// Same interface and semantics as kernels.h, except for one documented
// rounding (docs/PRECISION.md): the activations (x in gate_up, h in down)
// are rounded to bf16, round-to-nearest-even, so that vdpbf16ps can multiply
// them with the stored bf16 weights as they are. Products of two bf16 values
// are exact in fp32 and all sums are fp32, so the only extra error is the
// activation rounding: a relative error of at most 2^-8 per product (bf16
// keeps 8 significant bits; round-to-nearest is off by at most half an ulp).
//
// Why it pays: the weight rows are stored row-major, padded with zeros to 64
// bytes, which is exactly the "pairs along K" form vdpbf16ps consumes: one
// zmm load holds 32 consecutive bf16 weights of a row, and it meets 32
// consecutive bf16 activations of a token. One instruction does 32
// multiply-adds (an fp32 FMA does 16) and the weights need no widening.
//
// Structure, per call:
//   row chunk (~256 KB of weights, stays in L2 for all token blocks)
//     token block (up to 4 tokens)
//       K chunk (2048 elements): convert the block's activations to bf16 in a
//         stack buffer (zero padded to 32), then for groups of rows run the
//         register-blocked dot products, reduce the accumulators with a
//         transpose-and-add tree and add the sums to per-chunk fp32 partials
//       epilogue: silu(g)*u (vectorised exp) or the weighted scatter-add.
// No heap allocation; stack use is bounded (about 24 KB) whatever the shape.
//
// Reproducibility: every output element gets the same sequence of
// operations whatever row range or thread split it falls in (K chunks start
// at 0, each accumulator is reduced by the same tree, partials are added in
// K order), so results do not depend on the engine's partition.
//
// As in ffn_avx512.cpp, this translation unit must not emit any function
// with vague (COMDAT) linkage that a flag-less translation unit might also
// emit: everything lives in an anonymous namespace, the inline helpers of
// kernels.h are not called, no std:: templates are used.
#include "kernels/x86_intrinsics.h"

#include <cstddef>
#include <cstdint>

#include "kernels/avx512_common.h"
#include "kernels/kernels.h"

#define COLIBRI_UNROLL _Pragma("GCC unroll 16")

namespace colibri::kernels {
namespace {

constexpr int kLanes = 16;       // fp32 lanes per zmm
constexpr int kPairLanes = 32;   // bf16 elements per zmm
constexpr int kMaxTokens = 4;    // tokens per block: each weight vector feeds this many dot products
// Activation elements per K chunk: the bf16 copy of one token block's chunk
// is kMaxTokens * 4 KB = 16 KB and stays in L1 next to the weight streams.
constexpr int32_t kKChunk = 2048;
// Weight bytes per row chunk. Every token block runs over a chunk before the
// next one starts, so weights come from memory once per call; the chunk sits
// in L2. Bigger than the fp32 kernels' 64 KB so that each converted
// activation vector is used by more rows.
constexpr size_t kChunkBytes = 256 * 1024;
// Upper bound on the output rows of one chunk (f rows in gate_up, d rows in
// down): sizes the stack partials.
constexpr int32_t kMaxChunkRows = 256;
// Software prefetch distance within each weight row.
constexpr size_t kPrefetchBytes = 512;

static_assert(kKChunk % kPairLanes == 0, "K chunks must be whole vectors");

inline int32_t min_i32(int32_t a, int32_t b) { return a < b ? a : b; }

// Output rows per chunk for rows of `row_bytes`: a multiple of 4 (so the
// micro-kernels' row groups sit on the same grid whatever the caller's
// range), at least 4, at most kMaxChunkRows.
inline int32_t chunk_rows(size_t row_bytes) {
  size_t rows = row_bytes == 0 ? kMaxChunkRows : kChunkBytes / row_bytes;
  rows &= ~size_t{3};
  if (rows < 4) rows = 4;
  if (rows > static_cast<size_t>(kMaxChunkRows)) rows = kMaxChunkRows;
  return static_cast<int32_t>(rows);
}

// Lanes [0, remaining) of a 16-lane vector; none when remaining <= 0.
inline __mmask16 lane_mask(int32_t remaining) {
  if (remaining <= 0) return 0;
  return remaining >= kLanes ? static_cast<__mmask16>(0xffff)
                             : static_cast<__mmask16>((1u << remaining) - 1u);
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512i as_si(__m512bh v) { return reinterpret_cast<__m512i&>(v); }

// dst[0, padded) = bf16(src[0, len)), zeros after len; padded = len rounded
// up to 32. vcvtne2ps2bf16 rounds to nearest even (as float_to_bf16 does)
// and, like vdpbf16ps itself, treats denormals as zero. Activations are not
// padded in memory, so the tail is read with masked loads.
inline void to_bf16(const float* src, int32_t len, uint16_t* dst) {
  int32_t k = 0;
  for (; k + kPairLanes <= len; k += kPairLanes) {
    const __m512 lo = _mm512_loadu_ps(src + k);
    const __m512 hi = _mm512_loadu_ps(src + k + kLanes);
    _mm512_store_si512(dst + k, as_si(_mm512_cvtne2ps_pbh(hi, lo)));
  }
  if (k < len) {
    const int32_t rem = len - k;
    const __m512 lo = _mm512_maskz_loadu_ps(lane_mask(rem), src + k);
    const __m512 hi = _mm512_maskz_loadu_ps(lane_mask(rem - kLanes), src + k + kLanes);
    _mm512_store_si512(dst + k, as_si(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// The split form: hi = bf16(src), lo = bf16(src - hi), both zero padded as
// to_bf16 pads. hi + lo holds 16 of the 24 significant bits and the rest is
// below 2^-17 of |src|, so a product with a bf16 weight through both parts
// is fp32-grade (docs/PRECISION.md). src - hi is exact in f32.
inline void to_bf16_split(const float* src, int32_t len, uint16_t* hi, uint16_t* lo) {
  for (int32_t k = 0; k < len; k += kPairLanes) {
    const int32_t rem = len - k;
    const __m512 a = _mm512_maskz_loadu_ps(lane_mask(rem), src + k);
    const __m512 b = _mm512_maskz_loadu_ps(lane_mask(rem - kLanes), src + k + kLanes);
    const __m512i h = as_si(_mm512_cvtne2ps_pbh(b, a));
    // Back to f32: each bf16 is the top half of its f32.
    const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 hb =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    _mm512_store_si512(hi + k, h);
    _mm512_store_si512(lo + k, as_si(_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha))));
  }
}

// Sixteen horizontal sums at once: lane j of the result is the sum of the
// lanes of acc[j]. A transpose-and-add tree (45 shuffles/adds for 16 sums
// instead of ~5 per sum one at a time). Every accumulator goes through the
// same tree, ((l0+l8)+(l4+l12)) + ((l2+l10)+(l6+l14)) + (odd lanes alike),
// whatever its position, so a sum's bits do not depend on its neighbours.
inline __m512 reduce16(const __m512* acc) {
  __m512 s1[8];
  COLIBRI_UNROLL
  for (int j = 0; j < 8; ++j) {
    const __m512 a = acc[2 * j], b = acc[2 * j + 1];
    // [a.q0 a.q1 b.q0 b.q1] + [a.q2 a.q3 b.q2 b.q3]
    s1[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 s2[4];
  COLIBRI_UNROLL
  for (int j = 0; j < 4; ++j) {
    const __m512 c = s1[2 * j], d = s1[2 * j + 1];
    // quads: [acc 4j, acc 4j+1, acc 4j+2, acc 4j+3], 4 partial lanes each
    s2[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  __m512 s3[2];
  COLIBRI_UNROLL
  for (int j = 0; j < 2; ++j) {
    const __m512d e = _mm512_castps_pd(s2[2 * j]), f = _mm512_castps_pd(s2[2 * j + 1]);
    s3[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e, f)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(e, f)));
  }
  const __m512 s4 = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // s4 lane 4q+m holds acc[4m+q]; transpose back.
  const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(perm, s4);
}

// Dot products of R consecutive weight rows with NT bf16 activation rows
// over nvec vectors of 32 elements, stored to out[r*NT + t]. Weight rows and
// activation copies are both zero padded to whole vectors, so no masks.
// kSplit: each activation row is a hi part at xb + t*kKChunk and a lo part
// kLoOffset further, both multiplied into the same accumulator.
constexpr size_t kLoOffset = static_cast<size_t>(kMaxTokens) * kKChunk;

template <int R, int NT, bool kSplit>
inline void dot_bf16(const uint16_t* row0, size_t stride, const uint16_t* xb, int32_t nvec,
                     float* out) {
  static_assert(R * NT <= 16, "one reduce16 per micro-kernel");
  const uint16_t* rows[R];
  COLIBRI_UNROLL
  for (int r = 0; r < R; ++r) rows[r] = row0 + static_cast<size_t>(r) * stride;

  __m512 acc[16];
  COLIBRI_UNROLL
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();

  for (int32_t v = 0; v < nvec; ++v) {
    const size_t k = static_cast<size_t>(v) * kPairLanes;
    COLIBRI_UNROLL
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k) + kPrefetchBytes, _MM_HINT_T0);
    }
    __m512bh xv[NT], xlo[NT];
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) {
      xv[t] = as_bh(_mm512_load_si512(xb + static_cast<size_t>(t) * kKChunk + k));
      if constexpr (kSplit) xlo[t] = as_bh(_mm512_load_si512(xb + kLoOffset + static_cast<size_t>(t) * kKChunk + k));
    }
    COLIBRI_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512bh w = as_bh(_mm512_loadu_si512(rows[r] + k));
      COLIBRI_UNROLL
      for (int t = 0; t < NT; ++t) {
        acc[r * NT + t] = _mm512_dpbf16_ps(acc[r * NT + t], w, xv[t]);
        if constexpr (kSplit) acc[r * NT + t] = _mm512_dpbf16_ps(acc[r * NT + t], w, xlo[t]);
      }
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  COLIBRI_UNROLL
  for (int j = 0; j < R * NT; ++j) out[j] = sums[j];
}

// Token t's activations of one K chunk into the block buffer: rounded, or
// (kSplit) as hi and lo parts.
template <bool kSplit>
inline void convert(const float* src, int32_t len, uint16_t* xb, int32_t t) {
  uint16_t* row = xb + static_cast<size_t>(t) * kKChunk;
  if constexpr (kSplit) {
    to_bf16_split(src, len, row, row + kLoOffset);
  } else {
    to_bf16(src, len, row);
  }
}

// ---------------------------------------------------------------- gate_up

// Partials of one chunk: g[t][f - f0] and u[t][f - f0].
struct GateUpPartials {
  alignas(64) float g[kMaxTokens][kMaxChunkRows];
  alignas(64) float u[kMaxTokens][kMaxChunkRows];
};

// F rows f..f+F-1 (2F weight rows: gate f, up f, gate f+1, ...), one K chunk.
template <int F, int NT, bool kSplit>
inline void gate_up_step(const uint16_t* base, size_t stride, const uint16_t* xb, int32_t nvec,
                         int32_t f, int32_t f0, GateUpPartials& p) {
  float out[2 * F * NT];
  dot_bf16<2 * F, NT, kSplit>(base + static_cast<size_t>(2 * f) * stride, stride, xb, nvec, out);
  COLIBRI_UNROLL
  for (int r = 0; r < F; ++r) {
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) {
      // The caller zeroed rows [0, f1 - f0) of every token's partials; the
      // analyzer cannot follow that across the call.
      p.g[t][f - f0 + r] += out[(2 * r) * NT + t];  // NOLINT(clang-analyzer-core.uninitialized.Assign)
      p.u[t][f - f0 + r] += out[(2 * r + 1) * NT + t];
    }
  }
}

// f rows per micro-kernel: 2F weight rows x NT tokens <= 16 accumulators.
constexpr int gate_up_f(int nt) { return nt <= 2 ? 4 : 2; }

template <int NT, bool kSplit>
void gate_up_rows(const uint16_t* base, size_t stride, const uint16_t* xb, int32_t nvec,
                  int32_t f0, int32_t f1, GateUpPartials& p) {
  constexpr int kF = gate_up_f(NT);
  int32_t f = f0;
  for (; f1 - f >= kF; f += kF) gate_up_step<kF, NT, kSplit>(base, stride, xb, nvec, f, f0, p);
  if constexpr (kF > 2) {
    if (f1 - f >= 2) {
      gate_up_step<2, NT, kSplit>(base, stride, xb, nvec, f, f0, p);
      f += 2;
    }
  }
  for (; f < f1; ++f) gate_up_step<1, NT, kSplit>(base, stride, xb, nvec, f, f0, p);
}


// h[f] = silu(g[f]) * u[f] = g / (1 + exp(-g)) * u for f in [0, nf).
inline void silu_mul_store(const float* g, const float* u, int32_t nf, float* h) {
  for (int32_t j = 0; j < nf; j += kLanes) {
    const __mmask16 m = lane_mask(nf - j);
    const __m512 gv = _mm512_maskz_load_ps(m, g + j);
    const __m512 uv = _mm512_maskz_load_ps(m, u + j);
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_clamped(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
    _mm512_mask_storeu_ps(h + j, m, _mm512_mul_ps(_mm512_div_ps(gv, den), uv));
  }
}

template <bool kSplit>
void gate_up_bf16(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                  const int32_t* token_index, int32_t n, int32_t f_begin, int32_t f_end, float* h,
                  size_t ldh, KernelScratch* scratch) {
  if (s.weight_type != WeightType::kBF16) {
    // Only bf16 weights have a bf16 product; the others keep fp32.
    avx512_kernels().gate_up(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh, scratch);
    return;
  }
  if (kSplit && n > 1) {
    // Two products per weight per token keep up with widening the weights
    // only for one token (kernel bench, one thread: 1.0x at 1 token, 0.79x
    // at 2, 0.53x at 4 against "avx512"; docs/KERNELS.md). Chosen here, not
    // as an engine tier: the engine's first tier is also where it switches
    // to coarse prefill work items, which 2-4 token experts should not get.
    avx512_kernels().gate_up(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh, scratch);
    return;
  }
  if (n <= 0 || f_begin >= f_end) return;
  const uint16_t* base = static_cast<const uint16_t*>(gate_up);
  const size_t stride = s.gate_up_stride;
  const int32_t D = s.d_model;
  const int32_t chunk = chunk_rows(2 * stride * sizeof(uint16_t));

  alignas(64) uint16_t xb[(kSplit ? 2 : 1) * kLoOffset];
  GateUpPartials p;

  for (int32_t f0 = f_begin; f0 < f_end; f0 += chunk) {
    const int32_t f1 = f_end - f0 > chunk ? f0 + chunk : f_end;
    const int32_t nf = f1 - f0;
    for (int32_t i0 = 0; i0 < n; i0 += kMaxTokens) {
      const int32_t nt = min_i32(kMaxTokens, n - i0);
      const float* xs[kMaxTokens];
      for (int32_t t = 0; t < nt; ++t) {
        xs[t] = x + static_cast<size_t>(token_index[i0 + t]) * ldx;
        for (int32_t j = 0; j < nf; ++j) p.g[t][j] = p.u[t][j] = 0.0f;
      }
      for (int32_t k0 = 0; k0 < D; k0 += kKChunk) {
        const int32_t kc = min_i32(kKChunk, D - k0);
        const int32_t nvec = (kc + kPairLanes - 1) / kPairLanes;
        for (int32_t t = 0; t < nt; ++t) convert<kSplit>(xs[t] + k0, kc, xb, t);
        const uint16_t* wk = base + k0;
        switch (nt) {
          case 1:
            gate_up_rows<1, kSplit>(wk, stride, xb, nvec, f0, f1, p);
            break;
          case 2:
            gate_up_rows<2, kSplit>(wk, stride, xb, nvec, f0, f1, p);
            break;
          case 3:
            gate_up_rows<3, kSplit>(wk, stride, xb, nvec, f0, f1, p);
            break;
          default:
            gate_up_rows<4, kSplit>(wk, stride, xb, nvec, f0, f1, p);
            break;
        }
      }
      for (int32_t t = 0; t < nt; ++t) {
        silu_mul_store(p.g[t], p.u[t], nf, h + static_cast<size_t>(i0 + t) * ldh + static_cast<size_t>(f0));
      }
    }
  }
}

// ------------------------------------------------------------------- down

template <int R, int NT, bool kSplit>
inline void down_step(const uint16_t* base, size_t stride, const uint16_t* xb, int32_t nvec,
                      int32_t d, int32_t d0, float (*pd)[kMaxChunkRows]) {
  float out[R * NT];
  dot_bf16<R, NT, kSplit>(base + static_cast<size_t>(d) * stride, stride, xb, nvec, out);
  COLIBRI_UNROLL
  for (int r = 0; r < R; ++r) {
    COLIBRI_UNROLL
    // Zeroed by the caller for the chunk's rows (see down_bf16).
    for (int t = 0; t < NT; ++t) pd[t][d - d0 + r] += out[r * NT + t];  // NOLINT(clang-analyzer-core.uninitialized.Assign)
  }
}

constexpr int down_r(int nt) { return nt <= 2 ? 8 : 4; }

template <int NT, bool kSplit>
void down_rows(const uint16_t* base, size_t stride, const uint16_t* xb, int32_t nvec, int32_t d0,
               int32_t d1, float (*pd)[kMaxChunkRows]) {
  constexpr int kR = down_r(NT);
  int32_t d = d0;
  for (; d1 - d >= kR; d += kR) down_step<kR, NT, kSplit>(base, stride, xb, nvec, d, d0, pd);
  if constexpr (kR > 4) {
    if (d1 - d >= 4) {
      down_step<4, NT, kSplit>(base, stride, xb, nvec, d, d0, pd);
      d += 4;
    }
  }
  if (d1 - d >= 2) {
    down_step<2, NT, kSplit>(base, stride, xb, nvec, d, d0, pd);
    d += 2;
  }
  for (; d < d1; ++d) down_step<1, NT, kSplit>(base, stride, xb, nvec, d, d0, pd);
}

template <bool kSplit>
void down_bf16(const ExpertShape& s, const void* down, const float* h, size_t ldh,
               const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin,
               int32_t d_end, float* y, size_t ldy, KernelScratch* scratch) {
  if (s.weight_type != WeightType::kBF16) {
    avx512_kernels().down(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
    return;
  }
  if (kSplit && n > 1) {  // as in gate_up_bf16
    avx512_kernels().down(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
    return;
  }
  if (n <= 0 || d_begin >= d_end) return;
  const uint16_t* base = static_cast<const uint16_t*>(down);
  const size_t stride = s.down_stride;
  const int32_t F = s.d_ff;
  const int32_t chunk = chunk_rows(stride * sizeof(uint16_t));

  alignas(64) uint16_t xb[(kSplit ? 2 : 1) * kLoOffset];
  alignas(64) float pd[kMaxTokens][kMaxChunkRows];

  for (int32_t d0 = d_begin; d0 < d_end; d0 += chunk) {
    const int32_t d1 = d_end - d0 > chunk ? d0 + chunk : d_end;
    const int32_t nd = d1 - d0;
    // Token blocks in increasing order, tokens within a block in order: each
    // y element's additions happen in order of i, as the interface promises.
    for (int32_t i0 = 0; i0 < n; i0 += kMaxTokens) {
      const int32_t nt = min_i32(kMaxTokens, n - i0);
      for (int32_t t = 0; t < nt; ++t) {
        for (int32_t j = 0; j < nd; ++j) pd[t][j] = 0.0f;
      }
      for (int32_t k0 = 0; k0 < F; k0 += kKChunk) {
        const int32_t kc = min_i32(kKChunk, F - k0);
        const int32_t nvec = (kc + kPairLanes - 1) / kPairLanes;
        for (int32_t t = 0; t < nt; ++t) {
          convert<kSplit>(h + static_cast<size_t>(i0 + t) * ldh + static_cast<size_t>(k0), kc, xb, t);
        }
        const uint16_t* wk = base + k0;
        switch (nt) {
          case 1:
            down_rows<1, kSplit>(wk, stride, xb, nvec, d0, d1, pd);
            break;
          case 2:
            down_rows<2, kSplit>(wk, stride, xb, nvec, d0, d1, pd);
            break;
          case 3:
            down_rows<3, kSplit>(wk, stride, xb, nvec, d0, d1, pd);
            break;
          default:
            down_rows<4, kSplit>(wk, stride, xb, nvec, d0, d1, pd);
            break;
        }
      }
      for (int32_t t = 0; t < nt; ++t) {
        float* yr = y + static_cast<size_t>(token_index[i0 + t]) * ldy + static_cast<size_t>(d0);
        const __m512 wt = _mm512_set1_ps(weight[i0 + t]);
        for (int32_t j = 0; j < nd; j += kLanes) {
          const __mmask16 m = lane_mask(nd - j);
          // y += w * dot, rounded once per product and once per add, as the
          // other kernels do.
          const __m512 prod = _mm512_mul_ps(wt, _mm512_maskz_load_ps(m, pd[t] + j));
          _mm512_mask_storeu_ps(yr + j, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr + j), prod));
        }
      }
    }
  }
}

}  // namespace

const KernelTable& avx512_bf16_kernels() {
  static const KernelTable table{Isa::kAvx512, "avx512-bf16", gate_up_bf16<false>, down_bf16<false>};
  return table;
}

const KernelTable& avx512_bf16_split_kernels() {
  static const KernelTable table{Isa::kAvx512, "avx512-bf16-split", gate_up_bf16<true>, down_bf16<true>};
  return table;
}

}  // namespace colibri::kernels
