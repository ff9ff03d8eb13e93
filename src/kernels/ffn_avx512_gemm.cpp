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
// no inline helpers from other headers (avx512_common.h is the exception:
// its helpers sit in an anonymous namespace too), no std templates, so no function of
// this ISA-flagged TU can be picked by the linker for a flag-less caller.
#include "kernels/x86_intrinsics.h"

#include <cstddef>
#include <cstdint>

#include "kernels/avx512_common.h"
#include "kernels/gemm.h"

namespace colibri::kernels {
namespace {

constexpr int kPanelRows = 16;

// The accumulator loops must be fully unrolled so the accumulators live in
// registers; GCC does not do that on its own for arrays of __m512.
#define COLIBRI_UNROLL _Pragma("GCC unroll 16")

// Two 16-row fp32 panels of K16 x 16 (KernelScratch slot 0).
size_t panel_bytes(int32_t K) {
  return 2 * ((static_cast<size_t>(K) + 15) / 16 * 16) * kPanelRows * sizeof(float);
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
                  size_t ldh, KernelScratch* scratch) {
  if (n <= 0 || f_begin >= f_end) return;
  const int32_t K = s.d_model;
  const size_t K16 = (static_cast<size_t>(K) + 15) / 16 * 16;
  float* G = static_cast<float*>(scratch_buffer(scratch, 0, panel_bytes(K)));
  if (G == nullptr) {
    // No memory for the panels (a few hundred KiB, allocated on a thread's
    // first call): the decode kernels need no scratch and give the same
    // sums up to rounding.
    avx512_kernels().gate_up(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh, scratch);
    return;
  }
  float* U = G + K16 * kPanelRows;
  const size_t elem = weight_format(s.weight_type).block_bytes;
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
               int32_t d_end, float* y, size_t ldy, KernelScratch* scratch) {
  if (n <= 0 || d_begin >= d_end) return;
  const int32_t K = s.d_ff;
  const size_t K16 = (static_cast<size_t>(K) + 15) / 16 * 16;
  float* A = static_cast<float*>(scratch_buffer(scratch, 0, panel_bytes(K)));
  if (A == nullptr) {
    avx512_kernels().down(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
    return;
  }
  float* B = A + K16 * kPanelRows;
  const size_t elem = weight_format(s.weight_type).block_bytes;
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

bool reserve_gemm(const ExpertShape& s, int32_t /*max_tokens*/, int32_t /*max_rows*/, KernelScratch* scratch) {
  return scratch->get(0, panel_bytes(s.d_model > s.d_ff ? s.d_model : s.d_ff)) != nullptr;
}

}  // namespace

const KernelTable& avx512_gemm_kernels() {
  static const KernelTable table{Isa::kAvx512, "avx512-gemm", gate_up_gemm, down_gemm, reserve_gemm};
  return table;
}

}  // namespace colibri::kernels
