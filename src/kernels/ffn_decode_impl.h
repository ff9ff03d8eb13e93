// The fp32 decode kernels of kernels.h (GateUpFn / DownFn for f32, f16 and
// bf16 weights), written once over a vector-traits type V and instantiated
// by each instruction set's translation unit (ffn_avx2.cpp, ffn_avx512.cpp)
// with its own traits. ffn_scalar.cpp is the reference.
//
// Structure: rows are walked in chunks of kChunkBytes, so that all token
// blocks of a call run over a chunk while it sits in L2 and weights come
// from memory once per call; within a chunk, blocks of up to kMaxTokens
// tokens meet micro-kernels of R rows (V::gate_up_rows / V::down_rows,
// what fits the register file), each weight vector loaded and widened once
// for all the block's tokens.
//
// V provides:
//   kLanes                     floats per vector
//   Vec, Mask                  vector and tail-mask types
//   zero(), loadu(p), fmadd(a, b, c)
//   tail_mask(remaining)       lanes [0, remaining) of a vector
//   load_masked(m, p)          masked activation load that never faults on
//                              masked-out lanes (activations are unpadded)
//   load_weights<T>(p)         kLanes weights of type T widened to f32
//   reduce_store<N>(acc, out)  out[j] = horizontal sum of acc[j], j < N
//   gate_up_rows(nt), down_rows(nt)   rows per micro-kernel call
//
// Linkage: every function here is a template with V among its parameters.
// Each ISA file defines its V in an anonymous namespace, so every
// instantiation has internal linkage and no ISA object can emit a symbol
// another object could bind to (tests/isa_linkage.sh). For the same reason
// nothing here calls a non-template inline function of a shared header,
// uses std:: templates, or std::exp (libm's expf instead).
#pragma once

#include <math.h>

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"
#include "kernels/x86_intrinsics.h"

#define COLIBRI_UNROLL _Pragma("GCC unroll 16")

namespace colibri::kernels::ffn_decode {

// Software prefetch distance within each weight row. The hardware prefetcher
// tracks only so many streams; the blocked loops walk up to 8 rows at once.
inline constexpr size_t kPrefetchBytes = 512;
// Tokens per block: each weight vector loaded is reused for this many tokens.
inline constexpr int kMaxTokens = 4;
// Weight bytes per chunk of rows (see the top of this file).
inline constexpr size_t kChunkBytes = 64 * 1024;

template <WeightType T>
struct ElemOf {
  using Type = uint16_t;  // f16, bf16
};
template <>
struct ElemOf<WeightType::kF32> {
  using Type = float;
};

template <class V>
int32_t chunk_rows(size_t row_bytes) {
  const size_t rows = row_bytes == 0 ? 0 : (kChunkBytes / row_bytes) & ~size_t{3};
  return rows < 4 ? 4 : rows > (1u << 20) ? (1 << 20) : static_cast<int32_t>(rows);
}

template <class V>
int32_t min_tokens(int32_t a, int32_t b) {
  return a < b ? a : b;
}

// kernels.h's apply_glu, as a template (see Linkage above).
template <class V>
float glu(const Epilogue& e, int32_t f, float g, float u) {
  if (e.gate_up_bias != nullptr) {
    g += e.gate_up_bias[2 * static_cast<size_t>(f)];
    u += e.gate_up_bias[2 * static_cast<size_t>(f) + 1];
  }
  if (e.activation == Activation::kSwiGLU) return g / (1.0f + expf(-g)) * u;
  g = fminf(g, e.limit);
  u = fmaxf(fminf(u, e.limit), -e.limit);
  return (u + 1.0f) * (g / (1.0f + expf(-e.alpha * g)));
}

// Dot products of R consecutive weight rows with NT activation vectors:
// out[r*NT + t] = row_r . a_t over `len` elements. Every weight vector is
// loaded (and converted) once and used for all NT tokens; every activation
// vector is loaded once and used for all R rows.
template <class V, WeightType T, int R, int NT>
void dot_block(const typename ElemOf<T>::Type* row0, size_t stride, const float* const* a, int32_t len,
               float* out) {
  using Elem = typename ElemOf<T>::Type;
  using Vec = typename V::Vec;
  constexpr int kPerLine = static_cast<int>(kRowAlignBytes / sizeof(Elem));
  constexpr int kVecPerLine = kPerLine / V::kLanes;

  const Elem* rows[R];
  COLIBRI_UNROLL
  for (int r = 0; r < R; ++r) rows[r] = row0 + static_cast<size_t>(r) * stride;
  const float* act[NT];
  COLIBRI_UNROLL
  for (int t = 0; t < NT; ++t) act[t] = a[t];

  Vec acc[R * NT];
  COLIBRI_UNROLL
  for (int j = 0; j < R * NT; ++j) acc[j] = V::zero();

  int32_t k = 0;
  for (; k + kPerLine <= len; k += kPerLine) {
    COLIBRI_UNROLL
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k) + kPrefetchBytes, _MM_HINT_T0);
    }
    COLIBRI_UNROLL
    for (int v = 0; v < kVecPerLine; ++v) {
      const int32_t kk = k + v * V::kLanes;
      Vec xv[NT];
      COLIBRI_UNROLL
      for (int t = 0; t < NT; ++t) xv[t] = V::loadu(act[t] + kk);
      COLIBRI_UNROLL
      for (int r = 0; r < R; ++r) {
        const Vec w = V::template load_weights<T>(rows[r] + kk);
        COLIBRI_UNROLL
        for (int t = 0; t < NT; ++t) acc[r * NT + t] = V::fmadd(w, xv[t], acc[r * NT + t]);
      }
    }
  }
  // Last, partial cache line. Weight loads stay full width (rows are zero
  // padded to the line); activation loads are masked.
  COLIBRI_UNROLL
  for (int v = 0; v < kVecPerLine; ++v) {
    const int32_t kk = k + v * V::kLanes;
    if (kk >= len) break;
    const typename V::Mask m = V::tail_mask(len - kk);
    Vec xv[NT];
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) xv[t] = V::load_masked(m, act[t] + kk);
    COLIBRI_UNROLL
    for (int r = 0; r < R; ++r) {
      const Vec w = V::template load_weights<T>(rows[r] + kk);
      COLIBRI_UNROLL
      for (int t = 0; t < NT; ++t) acc[r * NT + t] = V::fmadd(w, xv[t], acc[r * NT + t]);
    }
  }
  V::template reduce_store<R * NT>(acc, out);
}

// Rows f in [f, f + F) for one block of NT tokens. Gate and up rows of the
// same f are adjacent in memory, so 2*F consecutive rows of the micro-kernel
// are (gate f, up f, gate f+1, up f+1, ...).
template <class V, WeightType T, int F, int NT>
void gate_up_step(const Epilogue& ep, const typename ElemOf<T>::Type* base, size_t stride, const float* const* xs,
                  int32_t d_model, int32_t f, float* h, size_t ldh) {
  float out[2 * F * NT];
  dot_block<V, T, 2 * F, NT>(base + static_cast<size_t>(2 * f) * stride, stride, xs, d_model, out);
  COLIBRI_UNROLL
  for (int r = 0; r < F; ++r) {
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) {
      h[static_cast<size_t>(t) * ldh + static_cast<size_t>(f + r)] =
          glu<V>(ep, f + r, out[(2 * r) * NT + t], out[(2 * r + 1) * NT + t]);
    }
  }
}

template <class V, WeightType T, int NT>
void gate_up_tokens(const Epilogue& ep, const typename ElemOf<T>::Type* base, size_t stride, const float* const* xs,
                    int32_t d_model, int32_t f, int32_t f_stop, float* h, size_t ldh) {
  constexpr int kF = V::gate_up_rows(NT);
  for (; f_stop - f >= kF; f += kF) gate_up_step<V, T, kF, NT>(ep, base, stride, xs, d_model, f, h, ldh);
  if constexpr (kF > 2) {
    if (f_stop - f >= 2) {
      gate_up_step<V, T, 2, NT>(ep, base, stride, xs, d_model, f, h, ldh);
      f += 2;
    }
  }
  for (; f < f_stop; ++f) gate_up_step<V, T, 1, NT>(ep, base, stride, xs, d_model, f, h, ldh);
}

template <class V, WeightType T>
void gate_up_typed(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx, const int32_t* token_index,
                   int32_t n, int32_t f_begin, int32_t f_end, float* h, size_t ldh) {
  using Elem = typename ElemOf<T>::Type;
  const Elem* base = static_cast<const Elem*>(gate_up);
  const size_t stride = s.gate_up_stride;
  const int32_t chunk = chunk_rows<V>(2 * stride * sizeof(Elem));
  for (int32_t f0 = f_begin; f0 < f_end; f0 += chunk) {
    const int32_t f1 = f_end - f0 > chunk ? f0 + chunk : f_end;
    for (int32_t i0 = 0; i0 < n; i0 += kMaxTokens) {
      const int32_t nt = min_tokens<V>(kMaxTokens, n - i0);
      const float* xs[kMaxTokens];
      for (int32_t t = 0; t < nt; ++t) xs[t] = x + static_cast<size_t>(token_index[i0 + t]) * ldx;
      float* hb = h + static_cast<size_t>(i0) * ldh;
      switch (nt) {
        case 1:
          gate_up_tokens<V, T, 1>(s.epilogue, base, stride, xs, s.d_model, f0, f1, hb, ldh);
          break;
        case 2:
          gate_up_tokens<V, T, 2>(s.epilogue, base, stride, xs, s.d_model, f0, f1, hb, ldh);
          break;
        case 3:
          gate_up_tokens<V, T, 3>(s.epilogue, base, stride, xs, s.d_model, f0, f1, hb, ldh);
          break;
        default:
          gate_up_tokens<V, T, 4>(s.epilogue, base, stride, xs, s.d_model, f0, f1, hb, ldh);
          break;
      }
    }
  }
}

// Rows d in [d, d + R) for tokens i0 .. i0+NT-1, then the weighted
// scatter-add. For each d the tokens are added in increasing i, as the
// interface promises.
template <class V, WeightType T, int R, int NT>
void down_step(const float* bias, const typename ElemOf<T>::Type* base, size_t stride, const float* const* hs,
               int32_t d_ff, int32_t d, const int32_t* token_index, const float* weight, float* y, size_t ldy) {
  float out[R * NT];
  dot_block<V, T, R, NT>(base + static_cast<size_t>(d) * stride, stride, hs, d_ff, out);
  if (bias != nullptr) {
    COLIBRI_UNROLL
    for (int r = 0; r < R; ++r) {
      COLIBRI_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] += bias[d + r];
    }
  }
  COLIBRI_UNROLL
  for (int r = 0; r < R; ++r) {
    COLIBRI_UNROLL
    for (int t = 0; t < NT; ++t) {
      y[static_cast<size_t>(token_index[t]) * ldy + static_cast<size_t>(d + r)] += weight[t] * out[r * NT + t];
    }
  }
}

template <class V, WeightType T, int NT>
void down_tokens(const float* bias, const typename ElemOf<T>::Type* base, size_t stride, const float* const* hs,
                 int32_t d_ff, int32_t d, int32_t d_stop, const int32_t* token_index, const float* weight, float* y,
                 size_t ldy) {
  constexpr int kR = V::down_rows(NT);
  for (; d_stop - d >= kR; d += kR) {
    down_step<V, T, kR, NT>(bias, base, stride, hs, d_ff, d, token_index, weight, y, ldy);
  }
  if constexpr (kR > 2) {
    if (d_stop - d >= 2) {
      down_step<V, T, 2, NT>(bias, base, stride, hs, d_ff, d, token_index, weight, y, ldy);
      d += 2;
    }
  }
  for (; d < d_stop; ++d) down_step<V, T, 1, NT>(bias, base, stride, hs, d_ff, d, token_index, weight, y, ldy);
}

template <class V, WeightType T>
void down_typed(const ExpertShape& s, const void* down, const float* h, size_t ldh, const int32_t* token_index,
                const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y, size_t ldy) {
  using Elem = typename ElemOf<T>::Type;
  const Elem* base = static_cast<const Elem*>(down);
  const size_t stride = s.down_stride;
  const int32_t chunk = chunk_rows<V>(stride * sizeof(Elem));
  for (int32_t d0 = d_begin; d0 < d_end; d0 += chunk) {
    const int32_t d1 = d_end - d0 > chunk ? d0 + chunk : d_end;
    // Token blocks in increasing order: together with the in-block order
    // this makes each y element's additions happen in order of i.
    for (int32_t i0 = 0; i0 < n; i0 += kMaxTokens) {
      const int32_t nt = min_tokens<V>(kMaxTokens, n - i0);
      const float* hs[kMaxTokens];
      for (int32_t t = 0; t < nt; ++t) hs[t] = h + static_cast<size_t>(i0 + t) * ldh;
      const int32_t* ti = token_index + i0;
      const float* wt = weight + i0;
      switch (nt) {
        case 1:
          down_tokens<V, T, 1>(s.epilogue.down_bias, base, stride, hs, s.d_ff, d0, d1, ti, wt, y, ldy);
          break;
        case 2:
          down_tokens<V, T, 2>(s.epilogue.down_bias, base, stride, hs, s.d_ff, d0, d1, ti, wt, y, ldy);
          break;
        case 3:
          down_tokens<V, T, 3>(s.epilogue.down_bias, base, stride, hs, s.d_ff, d0, d1, ti, wt, y, ldy);
          break;
        default:
          down_tokens<V, T, 4>(s.epilogue.down_bias, base, stride, hs, s.d_ff, d0, d1, ti, wt, y, ldy);
          break;
      }
    }
  }
}

// The GateUpFn / DownFn of an ISA's table: the 16- and 32-bit float types.
// Block formats never reach these (ffn_quant.cpp runs them).
template <class V>
void gate_up(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx, const int32_t* token_index,
             int32_t n, int32_t f_begin, int32_t f_end, float* h, size_t ldh, KernelScratch* /*scratch*/) {
  switch (s.weight_type) {
    case WeightType::kF32:
      gate_up_typed<V, WeightType::kF32>(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh);
      return;
    case WeightType::kF16:
      gate_up_typed<V, WeightType::kF16>(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh);
      return;
    case WeightType::kBF16:
      gate_up_typed<V, WeightType::kBF16>(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh);
      return;
    default:
      return;
  }
}

template <class V>
void down(const ExpertShape& s, const void* down, const float* h, size_t ldh, const int32_t* token_index,
          const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* /*scratch*/) {
  switch (s.weight_type) {
    case WeightType::kF32:
      down_typed<V, WeightType::kF32>(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy);
      return;
    case WeightType::kF16:
      down_typed<V, WeightType::kF16>(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy);
      return;
    case WeightType::kBF16:
      down_typed<V, WeightType::kBF16>(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy);
      return;
    default:
      return;
  }
}

}  // namespace colibri::kernels::ffn_decode
