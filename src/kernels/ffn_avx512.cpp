// AVX-512 kernels (built with -mavx512f/bw/vl/dq/bf16 -mavx2 -mfma -mf16c).
// Semantics are exactly those of kernels.h; ffn_scalar.cpp is the reference.
//
// This translation unit must not emit any function with vague (COMDAT)
// linkage that another, flag-less translation unit might also emit: the
// linker keeps one arbitrary copy, and if it kept this one a CPU without
// AVX-512 would run it. Hence everything here lives in an anonymous
// namespace, nothing calls the inline helpers of kernels.h, no std::
// templates are used, and exp comes from libm's expf (std::exp(float) is an
// inline function that a -O0 build would emit here).
#include "kernels/x86_intrinsics.h"
#include <math.h>

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

#define COLIBRI_UNROLL _Pragma("GCC unroll 16")

namespace colibri::kernels {
namespace {

constexpr int kLanes = 16;
// Software prefetch distance within each weight row. The hardware prefetcher
// tracks only so many streams; the blocked loops walk up to 8 rows at once.
constexpr size_t kPrefetchBytes = 512;
// Tokens per block: each weight vector loaded is reused for this many tokens.
constexpr int kMaxTokens = 4;
// Weight bytes per chunk of rows. Every token block of the call runs over a
// chunk before the next chunk starts, so weights come from memory once per
// call while the chunk sits in L2 and the current token block's activations
// sit in L1.
constexpr size_t kChunkBytes = 64 * 1024;

inline int32_t chunk_rows(size_t row_bytes) {
  const size_t rows = row_bytes == 0 ? 0 : (kChunkBytes / row_bytes) & ~size_t{3};
  return rows < 4 ? 4 : rows > (1u << 20) ? (1 << 20) : static_cast<int32_t>(rows);
}

// Rows per micro-kernel call for a block of NT tokens. AVX-512 has 32
// registers, so up to 16 accumulators fit next to the NT activation vectors;
// more rows per token block means fewer activation loads per FMA.
constexpr int gate_up_rows(int nt) { return nt <= 2 ? 4 : 2; }  // x2 rows (gate, up)
constexpr int down_rows(int) { return 4; }

template <WeightType T>
struct Weights;

template <>
struct Weights<WeightType::kF32> {
  using Elem = float;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
};

template <>
struct Weights<WeightType::kF16> {
  using Elem = uint16_t;
  static __m512 load(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

template <>
struct Weights<WeightType::kBF16> {
  using Elem = uint16_t;
  // bf16 is the top half of an f32, so widening is exact: zero-extend, shift.
  static __m512 load(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
};

inline int32_t min_i32(int32_t a, int32_t b) { return a < b ? a : b; }

// Lanes [0, remaining) of the last activation vector; activations are not
// padded, so this is what keeps x/h reads inside the caller's buffer.
inline __mmask16 tail_mask(int32_t remaining) {
  return remaining >= kLanes ? static_cast<__mmask16>(0xffff)
                             : static_cast<__mmask16>((1u << remaining) - 1u);
}

inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

// Four horizontal sums at once: three hadds share the shuffle work that four
// separate reductions would repeat.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b);
  const __m256 cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

template <int N>
inline void reduce_store(const __m512* acc, float* out) {
  int j = 0;
  COLIBRI_UNROLL
  for (; j + 4 <= N; j += 4) {
    _mm_storeu_ps(out + j, hsum4(fold(acc[j]), fold(acc[j + 1]), fold(acc[j + 2]), fold(acc[j + 3])));
  }
  COLIBRI_UNROLL
  for (; j < N; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}

// Dot products of R consecutive weight rows with NT activation vectors:
// out[r*NT + t] = row_r . a_t over `len` elements. Every weight vector is
// loaded (and converted) once and used for all NT tokens; every activation
// vector is loaded once and used for all R rows.
template <WeightType T, int R, int NT>
void dot_block(const typename Weights<T>::Elem* row0, size_t stride, const float* const* a,
               int32_t len, float* out) {
  using W = Weights<T>;
  using Elem = typename W::Elem;
  constexpr int kPerLine = static_cast<int>(kRowAlignBytes / sizeof(Elem));
  constexpr int kVecPerLine = kPerLine / kLanes;

  const Elem* rows[R];
  COLIBRI_UNROLL
  for (int r = 0; r < R; ++r) rows[r] = row0 + static_cast<size_t>(r) * stride;
  const float* act[NT];
  COLIBRI_UNROLL
  for (int t = 0; t < NT; ++t) act[t] = a[t];

  __m512 acc[R * NT];
  COLIBRI_UNROLL
  for (int j = 0; j < R * NT; ++j) acc[j] = _mm512_setzero_ps();

  int32_t k = 0;
  for (; k + kPerLine <= len; k += kPerLine) {
    COLIBRI_UNROLL
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k) + kPrefetchBytes, _MM_HINT_T0);
    }
    COLIBRI_UNROLL
    for (int v = 0; v < kVecPerLine; ++v) {
      const int32_t kk = k + v * kLanes;
      __m512 xv[NT];
      COLIBRI_UNROLL
      for (int t = 0; t < NT; ++t) xv[t] = _mm512_loadu_ps(act[t] + kk);
      COLIBRI_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512 w = W::load(rows[r] + kk);
        COLIBRI_UNROLL
        for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_fmadd_ps(w, xv[t], acc[r * NT + t]);
      }
    }
  }
  // Last, partial cache line. Weight loads stay full width (rows are zero
  // padded to the line); activation loads are masked.
  COLIBRI_UNROLL
  for (int v = 0; v < kVecPerLine; ++v) {
    const int32_t kk = k + v * kLanes;
    if (kk >= len) break;
    const __mmask16 m = tail_mask(len - kk);
    __m512 xv[NT];
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_maskz_loadu_ps(m, act[t] + kk);
    COLIBRI_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 w = W::load(rows[r] + kk);
      COLIBRI_UNROLL
      for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_fmadd_ps(w, xv[t], acc[r * NT + t]);
    }
  }
  reduce_store<R * NT>(acc, out);
}

inline float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// Rows f in [f, f + F) for one block of NT tokens. Gate and up rows of the
// same f are adjacent in memory, so 2*F consecutive rows of the micro-kernel
// are (gate f, up f, gate f+1, up f+1, ...).
template <WeightType T, int F, int NT>
void gate_up_step(const typename Weights<T>::Elem* base, size_t stride, const float* const* xs,
                  int32_t d_model, int32_t f, float* h, size_t ldh) {
  float out[2 * F * NT];
  dot_block<T, 2 * F, NT>(base + static_cast<size_t>(2 * f) * stride, stride, xs, d_model, out);
  COLIBRI_UNROLL
  for (int r = 0; r < F; ++r) {
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) {
      h[static_cast<size_t>(t) * ldh + static_cast<size_t>(f + r)] =
          silu_mul(out[(2 * r) * NT + t], out[(2 * r + 1) * NT + t]);
    }
  }
}

template <WeightType T, int NT>
void gate_up_tokens(const typename Weights<T>::Elem* base, size_t stride, const float* const* xs,
                    int32_t d_model, int32_t f, int32_t f_stop, float* h, size_t ldh) {
  constexpr int kF = gate_up_rows(NT);
  for (; f_stop - f >= kF; f += kF) gate_up_step<T, kF, NT>(base, stride, xs, d_model, f, h, ldh);
  if constexpr (kF > 2) {
    if (f_stop - f >= 2) {
      gate_up_step<T, 2, NT>(base, stride, xs, d_model, f, h, ldh);
      f += 2;
    }
  }
  for (; f < f_stop; ++f) gate_up_step<T, 1, NT>(base, stride, xs, d_model, f, h, ldh);
}

template <WeightType T>
void gate_up_impl(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                  const int32_t* token_index, int32_t n, int32_t f_begin, int32_t f_end, float* h,
                  size_t ldh) {
  using Elem = typename Weights<T>::Elem;
  const Elem* base = static_cast<const Elem*>(gate_up);
  const size_t stride = s.gate_up_stride;
  const int32_t chunk = chunk_rows(2 * stride * sizeof(Elem));
  for (int32_t f0 = f_begin; f0 < f_end; f0 += chunk) {
    const int32_t f1 = f_end - f0 > chunk ? f0 + chunk : f_end;
    for (int32_t i0 = 0; i0 < n; i0 += kMaxTokens) {
      const int32_t nt = min_i32(kMaxTokens, n - i0);
      const float* xs[kMaxTokens];
      for (int32_t t = 0; t < nt; ++t) xs[t] = x + static_cast<size_t>(token_index[i0 + t]) * ldx;
      float* hb = h + static_cast<size_t>(i0) * ldh;
      switch (nt) {
        case 1:
          gate_up_tokens<T, 1>(base, stride, xs, s.d_model, f0, f1, hb, ldh);
          break;
        case 2:
          gate_up_tokens<T, 2>(base, stride, xs, s.d_model, f0, f1, hb, ldh);
          break;
        case 3:
          gate_up_tokens<T, 3>(base, stride, xs, s.d_model, f0, f1, hb, ldh);
          break;
        default:
          gate_up_tokens<T, 4>(base, stride, xs, s.d_model, f0, f1, hb, ldh);
          break;
      }
    }
  }
}

// Rows d in [d, d + R) for tokens i0 .. i0+NT-1, then the weighted
// scatter-add. For each d the tokens are added in increasing i, as the
// interface promises.
template <WeightType T, int R, int NT>
void down_step(const typename Weights<T>::Elem* base, size_t stride, const float* const* hs,
               int32_t d_ff, int32_t d, const int32_t* token_index, const float* weight, float* y,
               size_t ldy) {
  float out[R * NT];
  dot_block<T, R, NT>(base + static_cast<size_t>(d) * stride, stride, hs, d_ff, out);
  COLIBRI_UNROLL
  for (int r = 0; r < R; ++r) {
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) {
      y[static_cast<size_t>(token_index[t]) * ldy + static_cast<size_t>(d + r)] +=
          weight[t] * out[r * NT + t];
    }
  }
}

template <WeightType T, int NT>
void down_tokens(const typename Weights<T>::Elem* base, size_t stride, const float* const* hs,
                 int32_t d_ff, int32_t d, int32_t d_stop, const int32_t* token_index,
                 const float* weight, float* y, size_t ldy) {
  constexpr int kR = down_rows(NT);
  for (; d_stop - d >= kR; d += kR) {
    down_step<T, kR, NT>(base, stride, hs, d_ff, d, token_index, weight, y, ldy);
  }
  if constexpr (kR > 2) {
    if (d_stop - d >= 2) {
      down_step<T, 2, NT>(base, stride, hs, d_ff, d, token_index, weight, y, ldy);
      d += 2;
    }
  }
  for (; d < d_stop; ++d) down_step<T, 1, NT>(base, stride, hs, d_ff, d, token_index, weight, y, ldy);
}

template <WeightType T>
void down_impl(const ExpertShape& s, const void* down, const float* h, size_t ldh,
               const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin,
               int32_t d_end, float* y, size_t ldy) {
  using Elem = typename Weights<T>::Elem;
  const Elem* base = static_cast<const Elem*>(down);
  const size_t stride = s.down_stride;
  const int32_t chunk = chunk_rows(stride * sizeof(Elem));
  for (int32_t d0 = d_begin; d0 < d_end; d0 += chunk) {
    const int32_t d1 = d_end - d0 > chunk ? d0 + chunk : d_end;
    // Token blocks in increasing order: together with the in-block order
    // this makes each y element's additions happen in order of i.
    for (int32_t i0 = 0; i0 < n; i0 += kMaxTokens) {
      const int32_t nt = min_i32(kMaxTokens, n - i0);
      const float* hs[kMaxTokens];
      for (int32_t t = 0; t < nt; ++t) hs[t] = h + static_cast<size_t>(i0 + t) * ldh;
      const int32_t* ti = token_index + i0;
      const float* wt = weight + i0;
      switch (nt) {
        case 1:
          down_tokens<T, 1>(base, stride, hs, s.d_ff, d0, d1, ti, wt, y, ldy);
          break;
        case 2:
          down_tokens<T, 2>(base, stride, hs, s.d_ff, d0, d1, ti, wt, y, ldy);
          break;
        case 3:
          down_tokens<T, 3>(base, stride, hs, s.d_ff, d0, d1, ti, wt, y, ldy);
          break;
        default:
          down_tokens<T, 4>(base, stride, hs, s.d_ff, d0, d1, ti, wt, y, ldy);
          break;
      }
    }
  }
}

void gate_up_avx512(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                    const int32_t* token_index, int32_t n, int32_t f_begin, int32_t f_end, float* h,
                    size_t ldh) {
  switch (s.weight_type) {
    case WeightType::kF32:
      gate_up_impl<WeightType::kF32>(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh);
      return;
    case WeightType::kF16:
      gate_up_impl<WeightType::kF16>(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh);
      return;
    case WeightType::kBF16:
      gate_up_impl<WeightType::kBF16>(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh);
      return;
    default:  // block formats run the tables of ffn_quant.cpp
      break;
  }
}

void down_avx512(const ExpertShape& s, const void* down, const float* h, size_t ldh,
                 const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin,
                 int32_t d_end, float* y, size_t ldy) {
  switch (s.weight_type) {
    case WeightType::kF32:
      down_impl<WeightType::kF32>(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy);
      return;
    case WeightType::kF16:
      down_impl<WeightType::kF16>(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy);
      return;
    case WeightType::kBF16:
      down_impl<WeightType::kBF16>(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy);
      return;
    default:  // block formats run the tables of ffn_quant.cpp
      break;
  }
}

}  // namespace

const KernelTable& avx512_kernels() {
  static const KernelTable table{Isa::kAvx512, "avx512", gate_up_avx512, down_avx512};
  return table;
}

}  // namespace colibri::kernels
