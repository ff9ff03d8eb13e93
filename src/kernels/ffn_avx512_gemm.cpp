// AVX-512 prefill kernels: many tokens per expert, so the work is a small
// GEMM and the limit is FMA throughput, not memory.
//
// The decode kernels compute dot products along rows and reduce each
// (row, token) pair horizontally; with many tokens those reductions and the
// per-block weight conversions cost more than the FMAs. Here each block of
// 16 weight rows is first widened to fp32 and transposed into a K-major
// panel (panel[k][16]) held in L2, then a register-blocked micro-kernel
// walks k: one panel load, one broadcast per token, one FMA per (panel,
// token). 16 accumulators stay in registers for the whole K loop and are
// stored once, contiguous, into h or y. Packing costs O(16*K) per block and
// is spread over all the expert's tokens.
//
// Same linkage rules as ffn_avx512.cpp: everything in an anonymous namespace,
// no inline helpers from other headers, no std templates, so no function of
// this ISA-flagged TU can be picked by the linker for a flag-less caller.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#include <stdlib.h>

#include <cstddef>
#include <cstdint>

#include "kernels/gemm.h"

namespace colibri::kernels {
namespace {

constexpr int kPanelRows = 16;

// The accumulator loops must be fully unrolled so the accumulators live in
// registers; GCC does not do that on its own for arrays of __m512.
#define COLIBRI_UNROLL _Pragma("GCC unroll 16")

// Grow-only per-thread panel buffer. Allocated on a thread's first prefill
// call (or when a wider model appears); later calls reuse it, so the hot
// path allocates nothing in steady state.
struct PanelBuffer {
  float* data = nullptr;
  size_t floats = 0;
  ~PanelBuffer() { free(data); }
  float* get(size_t n) {
    if (n > floats) {
      free(data);
      // 64-byte aligned, size rounded to the alignment as aligned_alloc wants.
      data = static_cast<float*>(aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
      floats = data != nullptr ? n : 0;
    }
    return data;
  }
};
thread_local PanelBuffer t_panels;

// Loads 16 consecutive weights of one row as fp32.
inline __m512 load16(const void* row, size_t k, WeightType t) {
  switch (t) {
    case WeightType::kF32:
      return _mm512_loadu_ps(static_cast<const float*>(row) + k);
    case WeightType::kF16:
      return _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + k)));
    case WeightType::kBF16: {
      const __m512i wide = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + k)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
  }
  return _mm512_setzero_ps();
}

// In-register transpose of a 16x16 fp32 block: r[i] holds row i on entry
// and column i on exit.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r now holds, per 128-bit lane, 4x4 transposed sub-blocks; combine lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// panel[k*16 + r] = W[row0 + r][k] for r < valid (zeros for r >= valid),
// k in [0, K). Rows are padded to 64 bytes with zeros, so reading a whole
// 16-element group past K inside a row is safe; K is rounded up to 16 and the
// extra panel entries are zero because the padding is.
void pack_panel(const void* w, size_t stride, size_t elem, int32_t row0, int32_t valid, int32_t K,
                WeightType t, float* panel) {
  const int32_t K16 = (K + 15) / 16 * 16;
  for (int32_t k = 0; k < K16; k += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) {
      if (i < valid) {
        const void* row = static_cast<const char*>(w) + (static_cast<size_t>(row0 + i) * stride) * elem;
        r[i] = load16(row, static_cast<size_t>(k), t);
      } else {
        r[i] = _mm512_setzero_ps();
      }
    }
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_store_ps(panel + static_cast<size_t>(k + i) * 16, r[i]);
  }
}

constexpr int kMaxNT = 8;

// exp(x) for 16 lanes: 2^(x log2 e) split into an integer power, applied
// with vscalefps (which saturates to 0 / inf instead of wrapping), and a
// degree-6 polynomial for 2^f on f in [-0.5, 0.5] (relative error ~2e-7, the
// level of fp32 rounding). A scalar expf per element cost as much as the
// FMAs themselves for d_model around 1024.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  // Taylor coefficients of 2^f = e^(f ln 2).
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u = g / (1 + exp(-g)) * u. For g very negative exp(-g) is inf
// and the quotient is -0, the limit.
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

// acc_a[j] += Pa[k] * x_j[k] and acc_b[j] += Pb[k] * x_j[k] over k < K for
// NT tokens. Pb may equal nullptr (one panel). x_j = act[j].
template <int NT, bool kTwoPanels>
inline void micro_kernel(const float* Pa, const float* Pb, const float* const* act, int32_t K,
                         __m512* acc_a, __m512* acc_b) {
  COLIBRI_UNROLL
  for (int j = 0; j < NT; ++j) {
    acc_a[j] = _mm512_setzero_ps();
    if (kTwoPanels) acc_b[j] = _mm512_setzero_ps();
  }
  const float* a_ptr[kMaxNT];
  COLIBRI_UNROLL
  for (int j = 0; j < NT; ++j) a_ptr[j] = act[j];
  for (int32_t k = 0; k < K; ++k) {
    const __m512 a = _mm512_load_ps(Pa + static_cast<size_t>(k) * 16);
    __m512 b = _mm512_setzero_ps();
    if (kTwoPanels) b = _mm512_load_ps(Pb + static_cast<size_t>(k) * 16);
    COLIBRI_UNROLL
    for (int j = 0; j < NT; ++j) {
      const __m512 x = _mm512_set1_ps(a_ptr[j][k]);
      acc_a[j] = _mm512_fmadd_ps(a, x, acc_a[j]);
      if (kTwoPanels) acc_b[j] = _mm512_fmadd_ps(b, x, acc_b[j]);
    }
  }
}

constexpr int kTokens = 8;  // 2 panels x 8 tokens = 16 accumulators

// h[i][f..f+16) = silu(gate . x_i) * (up . x_i) for NT tokens starting at i0.
template <int NT>
void gate_up_block(const float* G, const float* U, const float* x, size_t ldx, const int32_t* token_index,
                   int32_t i0, int32_t K, int32_t f, int32_t valid, float* h, size_t ldh) {
  const float* act[kTokens];
  COLIBRI_UNROLL
  for (int j = 0; j < NT; ++j) act[j] = x + static_cast<size_t>(token_index[i0 + j]) * ldx;
  __m512 g[kTokens], u[kTokens];
  micro_kernel<NT, true>(G, U, act, K, g, u);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  COLIBRI_UNROLL
  for (int j = 0; j < NT; ++j) {
    _mm512_mask_storeu_ps(h + static_cast<size_t>(i0 + j) * ldh + f, mask, silu_mul(g[j], u[j]));
  }
}

void gate_up_gemm(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                  const int32_t* token_index, int32_t n, int32_t f_begin, int32_t f_end, float* h,
                  size_t ldh) {
  if (n <= 0 || f_begin >= f_end) return;
  const int32_t K = s.d_model;
  const size_t K16 = static_cast<size_t>((K + 15) / 16 * 16);
  float* G = t_panels.get(2 * K16 * kPanelRows);
  if (G == nullptr) return;  // cannot happen in practice; the engine pre-warms
  float* U = G + K16 * kPanelRows;
  const size_t elem = s.weight_type == WeightType::kF32 ? 4 : 2;
  // Packed rows: 2f is gate row f, 2f+1 is up row f, so gate rows are every
  // other row: stride 2 * gate_up_stride from row 0, up from row 1.
  const char* gate0 = static_cast<const char*>(gate_up);
  const char* up0 = gate0 + s.gate_up_stride * elem;
  const size_t pair_stride = 2 * s.gate_up_stride;
  for (int32_t f = f_begin; f < f_end; f += kPanelRows) {
    const int32_t valid = f_end - f < kPanelRows ? f_end - f : kPanelRows;
    pack_panel(gate0, pair_stride, elem, f, valid, K, s.weight_type, G);
    pack_panel(up0, pair_stride, elem, f, valid, K, s.weight_type, U);
    int32_t i = 0;
    for (; i + kTokens <= n; i += kTokens) gate_up_block<kTokens>(G, U, x, ldx, token_index, i, K, f, valid, h, ldh);
    switch (n - i) {
      case 7: gate_up_block<7>(G, U, x, ldx, token_index, i, K, f, valid, h, ldh); break;
      case 6: gate_up_block<6>(G, U, x, ldx, token_index, i, K, f, valid, h, ldh); break;
      case 5: gate_up_block<5>(G, U, x, ldx, token_index, i, K, f, valid, h, ldh); break;
      case 4: gate_up_block<4>(G, U, x, ldx, token_index, i, K, f, valid, h, ldh); break;
      case 3: gate_up_block<3>(G, U, x, ldx, token_index, i, K, f, valid, h, ldh); break;
      case 2: gate_up_block<2>(G, U, x, ldx, token_index, i, K, f, valid, h, ldh); break;
      case 1: gate_up_block<1>(G, U, x, ldx, token_index, i, K, f, valid, h, ldh); break;
      default: break;
    }
  }
}

// y[token_index[i]][d..] += weight[i] * (down . h_i) for NT tokens from i0,
// two 16-row panels (rows d .. d+32), valid_a/valid_b rows in each.
template <int NT>
void down_block(const float* A, const float* B, bool two, const float* h, size_t ldh,
                const int32_t* token_index, const float* weight, int32_t i0, int32_t K, int32_t d,
                int32_t valid_a, int32_t valid_b, float* y, size_t ldy) {
  const float* act[kTokens];
  COLIBRI_UNROLL
  for (int j = 0; j < NT; ++j) act[j] = h + static_cast<size_t>(i0 + j) * ldh;
  __m512 a[kTokens], b[kTokens];
  if (two) {
    micro_kernel<NT, true>(A, B, act, K, a, b);
  } else {
    micro_kernel<NT, false>(A, nullptr, act, K, a, b);
  }
  const __mmask16 mask_a = static_cast<__mmask16>((1u << valid_a) - 1u);
  const __mmask16 mask_b = static_cast<__mmask16>((1u << valid_b) - 1u);
  // Tokens in order, so repeated tokens accumulate in a fixed order.
  for (int j = 0; j < NT; ++j) {
    float* out = y + static_cast<size_t>(token_index[i0 + j]) * ldy + d;
    const __m512 w = _mm512_set1_ps(weight[i0 + j]);
    _mm512_mask_storeu_ps(out, mask_a, _mm512_fmadd_ps(w, a[j], _mm512_maskz_loadu_ps(mask_a, out)));
    if (two) {
      _mm512_mask_storeu_ps(out + 16, mask_b,
                            _mm512_fmadd_ps(w, b[j], _mm512_maskz_loadu_ps(mask_b, out + 16)));
    }
  }
}

void down_gemm(const ExpertShape& s, const void* down, const float* h, size_t ldh,
               const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin,
               int32_t d_end, float* y, size_t ldy) {
  if (n <= 0 || d_begin >= d_end) return;
  const int32_t K = s.d_ff;
  const size_t K16 = static_cast<size_t>((K + 15) / 16 * 16);
  float* A = t_panels.get(2 * K16 * kPanelRows);
  if (A == nullptr) return;
  float* B = A + K16 * kPanelRows;
  const size_t elem = s.weight_type == WeightType::kF32 ? 4 : 2;
  for (int32_t d = d_begin; d < d_end; d += 2 * kPanelRows) {
    const int32_t left = d_end - d;
    const int32_t valid_a = left < kPanelRows ? left : kPanelRows;
    const int32_t valid_b = left - valid_a < kPanelRows ? left - valid_a : kPanelRows;
    const bool two = valid_b > 0;
    pack_panel(down, s.down_stride, elem, d, valid_a, K, s.weight_type, A);
    if (two) pack_panel(down, s.down_stride, elem, d + kPanelRows, valid_b, K, s.weight_type, B);
    int32_t i = 0;
    for (; i + kTokens <= n; i += kTokens) {
      down_block<kTokens>(A, B, two, h, ldh, token_index, weight, i, K, d, valid_a, valid_b, y, ldy);
    }
    switch (n - i) {
      case 7: down_block<7>(A, B, two, h, ldh, token_index, weight, i, K, d, valid_a, valid_b, y, ldy); break;
      case 6: down_block<6>(A, B, two, h, ldh, token_index, weight, i, K, d, valid_a, valid_b, y, ldy); break;
      case 5: down_block<5>(A, B, two, h, ldh, token_index, weight, i, K, d, valid_a, valid_b, y, ldy); break;
      case 4: down_block<4>(A, B, two, h, ldh, token_index, weight, i, K, d, valid_a, valid_b, y, ldy); break;
      case 3: down_block<3>(A, B, two, h, ldh, token_index, weight, i, K, d, valid_a, valid_b, y, ldy); break;
      case 2: down_block<2>(A, B, two, h, ldh, token_index, weight, i, K, d, valid_a, valid_b, y, ldy); break;
      case 1: down_block<1>(A, B, two, h, ldh, token_index, weight, i, K, d, valid_a, valid_b, y, ldy); break;
      default: break;
    }
  }
}

}  // namespace

const KernelTable& avx512_gemm_kernels() {
  static const KernelTable table{Isa::kAvx512, "avx512-gemm", gate_up_gemm, down_gemm};
  return table;
}

}  // namespace colibri::kernels
