// AMX-BF16 prefill kernels: tables "amx-bf16" (one bf16 product per
// multiply-add) and "amx-f16-split" (f16 weights at fp32-grade precision,
// five bf16 products per multiply-add); see amx.h for the precision.
//
// Each phase is a small GEMM, C[rows][tokens] = W[rows][K] * X[tokens][K]^T,
// computed with tdpbf16ps on 16x16 fp32 accumulator tiles:
//   A tile = 16 weight rows x 32 K (bf16, row-major): exactly the layout the
//            expert store writes, so bf16 weights are loaded straight from
//            the model with the row stride (gate rows: every other row), no
//            packing at all. f16/f32 weights, and a partial last panel of any
//            type, are first converted into a zero-padded 16-row bf16 panel
//            of contiguous 1 KiB tiles, once per panel (and K chunk) for all
//            token blocks. The split table converts every f16 panel into two
//            (hi and lo parts).
//   B tile = 16 K pairs x 16 tokens x 2 (the "VNNI" layout tdpbf16ps wants
//            for its second operand): the gathered activations, rounded to
//            bf16 once per call into a per-thread buffer, one contiguous 1 KB
//            tile per (16-token block, 32-K step); K is zero-padded to 32 and
//            missing tokens of the last block are zero.
//            The split table packs three tiles per step (the activations'
//            three bf16 parts).
// Tiles: 0-3 accumulators, 4-5 weights, 6-7 activations: a 2x2 register
// blocking (gate/up or two down panels x two token blocks), so every loaded
// tile feeds two tdpbf16ps. The split table: 0-1 accumulators (gate and up,
// or two down panels, one token block), 2-5 the hi/lo weight tiles, 6-7 the
// activation parts; ten tdpbf16ps per seven loads. Each tile load sits right
// before its first product: the tile unit takes them in program order. Accumulators go to a per-thread buffer; the
// epilogue (silu(g)*u, or the weighted scatter-add into y with tokens in
// order) works on 16x16 blocks transposed in registers to token-major. For
// long K with many tokens, K is split into L2-sized chunks (see make_plan).
//
// Tried and dropped (slower on Emerald Rapids, single thread): software
// prefetch of the next panel (the hardware streams the row-major weights
// better on its own), packing bf16 weights into contiguous tiles when
// several token-block passes reuse them, and interleaving the two token
// blocks' activation tiles; K chunks of 8 or 16 steps for bf16 weights, so
// a unit's weight tiles stay in L1 across its token-block passes (seed shape,
// two threads, alternated call by call: 0.89x and 0.97x; the accumulator
// tiles are then stored and reloaded every chunk); the first token-block
// pass storing each in-place weight tile it loads into a contiguous panel
// (tilestored) for the later passes to read, with or without a software
// prefetch of the next step's tiles: layer (seed, two threads, weights from
// DRAM) 1.03-1.07x, kernel (one thread, expert in the LLC, 64-160 tokens)
// 0.88-1.00x, not kept. For the split table (no
// gain measured, in cache or with the weights streamed from memory, 16-256
// tokens): prefetching
// the next unit's f16 rows into L2 during this unit's tiles, converting the
// next unit's panels a slice per K step between this unit's tile products
// (double-buffered panels), and K sub-chunks sized for L1.
//
// Reproducibility: every output element is one tdpbf16ps chain over K in
// the same 32-element steps, whatever row range, thread, token block or K
// chunking it falls in, so results do not depend on the engine's partition.
//
// Tile configuration: loaded at the start of every kernel call and released
// at its end. Not cached per thread: other code on the same thread (oneDNN's
// AMX kernels under PyTorch, for one) releases the tiles after its own work,
// and a tile instruction after that faults (SIGILL). Releasing also spares
// the OS saving 8 KiB of tile state when the thread is switched out. The
// process must have been granted the tile state first; configure_tiles
// makes sure of that through amx_available() (a no-op after the first).
//
// Linkage rules as in ffn_avx512.cpp: everything in an anonymous namespace,
// no inline helpers from other headers (avx512_common.h is the exception:
// its helpers sit in an anonymous namespace too), no std templates, so no function of
// this ISA-flagged TU can be picked by the linker for a flag-less caller.
#include "kernels/x86_intrinsics.h"
#include <stdlib.h>
#include <string.h>

#include <cstddef>
#include <cstdint>

#include "kernels/amx.h"
#include "kernels/avx512_common.h"

namespace colibri::kernels {
namespace {

constexpr int kTile = 16;        // rows per tile, tokens per block, fp32 lanes
constexpr int kKStep = 32;       // bf16 elements of K per tile row
constexpr size_t kTileElems = static_cast<size_t>(kTile) * kKStep;  // bf16 per A/B tile
constexpr int kMaxPieces = 3;    // bf16 parts of one activation (split table)

#define COLIBRI_UNROLL _Pragma("GCC unroll 16")

// KernelScratch slots.
constexpr int kActSlot = 0;    // activations, bf16 VNNI tiles
constexpr int kPanelSlot = 1;  // converted / padded weight panels
constexpr int kAccSlot = 2;    // fp32 accumulator tiles kept between K chunks

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// All 8 tiles 16 rows x 64 bytes.
void configure_tiles() {
  // Makes sure the process asked Linux for the tile state (once per
  // process; a no-op after the first call). Callers must have checked that
  // it returns true: without AMX the tile instructions below fault.
  (void)amx_available();
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTile;
  }
  // Not _tile_loadconfig(): GCC 12 declares its operand as the first 8 bytes
  // only, so the stores to the rest of the struct could be dropped.
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// Pairs with configure_tiles; the memory clobber keeps the tile stores of
// the call before it.
void release_tiles() { __asm__ volatile("tilerelease" ::: "memory"); }

inline int32_t min_i32(int32_t a, int32_t b) { return a < b ? a : b; }

inline __mmask16 mask16(int32_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff)
                     : count <= 0 ? static_cast<__mmask16>(0)
                                  : static_cast<__mmask16>((1u << count) - 1u);
}

// 32 fp32 -> 32 bf16 (RNE; as every bf16 instruction, subnormals flush to 0),
// element order kept: lo in the low half.
inline __m512 to_bf16x32(__m512 lo, __m512 hi) {
  return _mm512_castsi512_ps((__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// The fp32 value of each bf16 in the low (half 0) or high (half 1) 16 of 32
// packed bf16: exact.
inline __m512 bf16_half_to_f32(__m512 packed, int half) {
  const __m256i h = half == 0 ? _mm512_castsi512_si256(_mm512_castps_si512(packed))
                              : _mm512_extracti64x4_epi64(_mm512_castps_si512(packed), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Splits 32 fp32 (lo, hi) into `pieces` packed bf16 vectors whose sum is the
// input: out[0] = bf16(v), out[1] = bf16(v - out[0]), out[2] = v - out[0] -
// out[1]. Each difference is exact in fp32, and after two bf16 roundings at
// most 24 - 2*8 significant bits remain, so out[2] is exact and three pieces
// hold every fp32 value (bar subnormals, which bf16 instructions flush).
inline void split_bf16x32(__m512 lo, __m512 hi, int pieces, __m512* out) {
  for (int p = 0; p < pieces; ++p) {
    out[p] = to_bf16x32(lo, hi);
    if (p + 1 < pieces) {
      lo = _mm512_sub_ps(lo, bf16_half_to_f32(out[p], 0));
      hi = _mm512_sub_ps(hi, bf16_half_to_f32(out[p], 1));
    }
  }
}

// One 16-token block of activations as S = Kp/32 steps of `pieces` B tiles:
// out[(s*pieces + p)*512 + kp*32 + t*2 + e] = piece p of act[t][s*32 + 2*kp
// + e] (pieces == 1: its bf16 rounding; 3: split_bf16x32), zero for k >= K or
// t >= count. A tile's row kp (64 bytes) holds K pair kp of all 16 tokens:
// the 16x16 transpose of the 32-bit pairs.
void pack_activations(const float* const* act, int32_t count, int32_t K, int32_t S, int pieces, uint16_t* out) {
  for (int32_t s = 0; s < S; ++s) {
    const int32_t k = s * kKStep;
    const __mmask16 m_lo = mask16(K - k);
    const __mmask16 m_hi = mask16(K - k - 16);
    __m512 r[kMaxPieces][16];
    for (int t = 0; t < 16; ++t) {
      __m512 split[kMaxPieces];
      if (t < count) {
        split_bf16x32(_mm512_maskz_loadu_ps(m_lo, act[t] + k), _mm512_maskz_loadu_ps(m_hi, act[t] + k + 16), pieces,
                      split);
      } else {
        for (int p = 0; p < pieces; ++p) split[p] = _mm512_setzero_ps();
      }
      for (int p = 0; p < pieces; ++p) r[p][t] = split[p];
    }
    for (int p = 0; p < pieces; ++p) {
      transpose16(r[p]);
      uint16_t* tile = out + (static_cast<size_t>(s) * pieces + p) * kTileElems;
      for (int i = 0; i < 16; ++i) _mm512_store_ps(tile + static_cast<size_t>(i) * kKStep, r[p][i]);
    }
  }
}

// Columns [k0, k0 + steps*32) of 16 weight rows as a bf16 panel of `steps`
// contiguous 1 KiB A tiles (tile s, row r at (s*16 + r)*32): with rows a
// whole panel width apart, a tile's 16 lines fell into one or two L1 sets
// (4 panels of 16 rows 1-4 KiB apart), and its loads missed. Rows r < valid converted (RNE)
// from `rows + r*stride` (stride in elements), others zero; columns >= K
// zero. bf16/f16 rows are padded to 64 bytes (32 elements) with zeros, so
// whole 32-element groups below round_up(K, 32) are readable; f32 rows only
// to 16 elements, so f32 loads are masked at K.
void convert_panel(const void* rows, size_t stride, WeightType wt, int32_t valid, int32_t K, int32_t k0,
                   int32_t steps, uint16_t* panel) {
  const size_t width = static_cast<size_t>(steps) * kKStep;
  for (int r = 0; r < kTile; ++r) {
    // Column k of row r at dst + k*16: step k/32's tile, its row r.
    uint16_t* dst = panel + static_cast<size_t>(r) * kKStep;
    if (r >= valid) {
      for (size_t k = 0; k < width; k += kKStep) _mm512_store_si512(dst + k * kTile, _mm512_setzero_si512());
      continue;
    }
    switch (wt) {
      case WeightType::kBF16: {
        const uint16_t* src = static_cast<const uint16_t*>(rows) + static_cast<size_t>(r) * stride + k0;
        for (size_t k = 0; k < width; k += kKStep) _mm512_store_si512(dst + k * kTile, _mm512_loadu_si512(src + k));
        break;
      }
      case WeightType::kF16: {
        const uint16_t* src = static_cast<const uint16_t*>(rows) + static_cast<size_t>(r) * stride + k0;
        for (size_t k = 0; k < width; k += kKStep) {
          const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
          const __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 16)));
          _mm512_store_ps(dst + k * kTile, to_bf16x32(lo, hi));
        }
        break;
      }
      case WeightType::kF32: {
        const float* src = static_cast<const float*>(rows) + static_cast<size_t>(r) * stride;
        for (int32_t k = k0; k < k0 + steps * kKStep; k += kKStep) {
          const __m512 lo = _mm512_maskz_loadu_ps(mask16(K - k), src + k);
          const __m512 hi = _mm512_maskz_loadu_ps(mask16(K - k - 16), src + k + 16);
          _mm512_store_ps(dst + static_cast<size_t>(k - k0) * kTile, to_bf16x32(lo, hi));
        }
        break;
      }
      default:  // block formats run the tables of ffn_quant.cpp
        break;
    }
  }
}

// Where the A tiles of one 16-row panel chunk come from: bf16 weights with
// all 16 rows in range are read in place; anything else is converted into
// `scratch`. data points at column k0.
struct Panel {
  const char* data;
  size_t stride_bytes;  // between a tile's rows
  size_t step_bytes;    // between consecutive K steps' tiles
};

Panel make_panel(const void* rows, size_t stride, WeightType wt, int32_t valid, int32_t K, int32_t k0,
                 int32_t steps, uint16_t* scratch) {
  if (wt == WeightType::kBF16 && valid == kTile) {
    return Panel{static_cast<const char*>(rows) + static_cast<size_t>(k0) * 2, stride * 2, kKStep * 2};
  }
  convert_panel(rows, stride, wt, valid, K, k0, steps, scratch);
  return Panel{reinterpret_cast<const char*>(scratch), kKStep * 2, kTileElems * 2};
}

// Columns [k0, k0 + steps*32) of 16 f16 weight rows as two bf16 panels in
// convert_panel's tile layout whose sum is the weights: hi = bf16(w) and
// lo = bf16(w - hi), both exact (an f16 significand has 11 bits; hi keeps 8
// and the rest fits in lo). Rows r >= valid are zero; f16 rows are padded
// to 32 elements with zeros, so whole 32-element groups are readable.
void split_panel_f16(const void* rows, size_t stride, int32_t valid, int32_t k0, int32_t steps, uint16_t* hi_panel,
                     uint16_t* lo_panel) {
  const size_t width = static_cast<size_t>(steps) * kKStep;
  for (int r = 0; r < kTile; ++r) {
    uint16_t* hi = hi_panel + static_cast<size_t>(r) * kKStep;
    uint16_t* lo = lo_panel + static_cast<size_t>(r) * kKStep;
    if (r >= valid) {
      for (size_t k = 0; k < width; k += kKStep) {
        _mm512_store_si512(hi + k * kTile, _mm512_setzero_si512());
        _mm512_store_si512(lo + k * kTile, _mm512_setzero_si512());
      }
      continue;
    }
    const uint16_t* src = static_cast<const uint16_t*>(rows) + static_cast<size_t>(r) * stride + k0;
    for (size_t k = 0; k < width; k += kKStep) {
      __m512 parts[2];
      split_bf16x32(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k))),
                    _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 16))), 2, parts);
      _mm512_store_ps(hi + k * kTile, parts[0]);
      _mm512_store_ps(lo + k * kTile, parts[1]);
    }
  }
}

// Accumulator tile 2*b + a (+)= A_a * B_b over `steps` K steps, for a < NA
// weight panels and b < NB token blocks, kept in c + (2*b + a) * 256 (16x16
// fp32, row = weight row, column = token): zeroed when `first`, else loaded
// from c; always stored back to c.
template <int NA, int NB>
void tile_gemm(Panel A0, Panel A1, const uint16_t* B0, const uint16_t* B1, int32_t steps, bool first, float* c) {
  // GCC 12's tileloadd asm has no memory operand: without this barrier the
  // compiler may sink the packing stores below the tile loads that read them.
  // (tilestored has a memory clobber, so later writes stay after it.)
  __asm__ volatile("" ::: "memory");
  if (first) {
    _tile_zero(0);
    if (NA > 1) _tile_zero(1);
    if (NB > 1) _tile_zero(2);
    if (NA > 1 && NB > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, c, 64);
    if (NA > 1) _tile_loadd(1, c + 256, 64);
    if (NB > 1) _tile_loadd(2, c + 512, 64);
    if (NA > 1 && NB > 1) _tile_loadd(3, c + 768, 64);
  }
  for (int32_t s = 0; s < steps; ++s) {
    const size_t kb = static_cast<size_t>(s) * kTileElems;
    // Each load right before the first product that needs it: the tile
    // unit takes these in order, and four loads ahead of four products ran
    // at a third of the rate (712 vs 2089-2210 GFLOP/s, tiles in L1).
    _tile_loadd(4, A0.data + s * A0.step_bytes, A0.stride_bytes);
    _tile_loadd(6, B0 + kb, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NA > 1) {
      _tile_loadd(5, A1.data + s * A1.step_bytes, A1.stride_bytes);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (NB > 1) {
      _tile_loadd(7, B1 + kb, 64);
      _tile_dpbf16ps(2, 4, 7);
      if (NA > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if (NA > 1) _tile_stored(1, c + 256, 64);
  if (NB > 1) _tile_stored(2, c + 512, 64);
  if (NA > 1 && NB > 1) _tile_stored(3, c + 768, 64);
}

// The split table's pass: accumulator tile a (+)= sum of the five products
// A_a,hi B_x1 + A_a,lo B_x1 + A_a,hi B_x2 + A_a,lo B_x2 + A_a,hi B_x3 over
// `steps` K steps, for a < NA panels and one token block whose three pieces
// lie in B (step s at B + s*3*512); kept in c + a*256 (zeroed when `first`,
// else loaded; always stored back). The dropped A_lo B_x3 is at most 2^-24
// of the product. One tile per accumulator suffices: tdpbf16ps on the same
// accumulator issues back to back (measured: one chain runs at the
// four-chain rate).
template <int NA>
void tile_gemm_split(Panel A0, Panel A0lo, Panel A1, Panel A1lo, const uint16_t* B, int32_t steps, bool first,
                     float* c) {
  __asm__ volatile("" ::: "memory");  // as in tile_gemm
  if (first) {
    _tile_zero(0);
    if (NA > 1) _tile_zero(1);
  } else {
    _tile_loadd(0, c, 64);
    if (NA > 1) _tile_loadd(1, c + 256, 64);
  }
  for (int32_t s = 0; s < steps; ++s) {
    // All four panels are converted, in the same layout.
    const size_t ka = static_cast<size_t>(s) * A0.step_bytes;
    const uint16_t* b = B + static_cast<size_t>(s) * 3 * kTileElems;
    // Loads interleaved with the products as in tile_gemm.
    _tile_loadd(2, A0.data + ka, A0.stride_bytes);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 2, 6);
    _tile_loadd(3, A0lo.data + ka, A0lo.stride_bytes);
    _tile_dpbf16ps(0, 3, 6);
    if (NA > 1) {
      _tile_loadd(4, A1.data + ka, A1.stride_bytes);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, A1lo.data + ka, A1lo.stride_bytes);
      _tile_dpbf16ps(1, 5, 6);
    }
    _tile_loadd(7, b + kTileElems, 64);
    _tile_dpbf16ps(0, 2, 7);
    _tile_dpbf16ps(0, 3, 7);
    if (NA > 1) {
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_loadd(6, b + 2 * kTileElems, 64);
    _tile_dpbf16ps(0, 2, 6);
    if (NA > 1) _tile_dpbf16ps(1, 4, 6);
  }
  _tile_stored(0, c, 64);
  if (NA > 1) _tile_stored(1, c + 256, 64);
}

// h[i0 + t][f .. f+valid) = silu(cg) * cu for t < count, from the 16x16
// (row, token) accumulators cg (gate) and cu (up).
//
// Whole aligned lines of h are written with streaming stores: each line is
// written once here and read only by phase 2, and with ordinary stores
// every line's read-for-ownership, when the block of h is larger than L2,
// stalled the tile pipeline behind it (the seed expert, 128 tokens: 10-12%
// of the bf16 and split tables' time, in-process A/B). Callers fence
// (finish_hidden) before another thread reads h.
void store_gate_up(const float* cg, const float* cu, int32_t i0, int32_t count, int32_t f, int32_t valid,
                   float* h, size_t ldh) {
  __m512 r[16];
  COLIBRI_UNROLL
  for (int i = 0; i < 16; ++i) r[i] = silu_mul(_mm512_load_ps(cg + i * 16), _mm512_load_ps(cu + i * 16));
  transpose16(r);
  const __mmask16 m = mask16(valid);
  for (int t = 0; t < count; ++t) {
    float* out = h + static_cast<size_t>(i0 + t) * ldh + f;
    if (valid == kTile && (reinterpret_cast<uintptr_t>(out) & 63) == 0) {
      _mm512_stream_ps(out, r[t]);
    } else {
      _mm512_mask_storeu_ps(out, m, r[t]);
    }
  }
}

// Orders store_gate_up's streaming stores before the stores that follow
// (the thread pool's completion flag): without it another thread could read
// h before they are visible.
void finish_hidden() { _mm_sfence(); }

// y[token_index[i0 + t]][d .. d+valid) += weight[i0 + t] * c[.][t], tokens
// in order, from the 16x16 (row, token) accumulator c.
void store_down(const float* c, const int32_t* token_index, const float* weight, int32_t i0, int32_t count,
                int32_t d, int32_t valid, float* y, size_t ldy) {
  __m512 r[16];
  COLIBRI_UNROLL
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + i * 16);
  transpose16(r);
  const __mmask16 m = mask16(valid);
  for (int t = 0; t < count; ++t) {
    float* out = y + static_cast<size_t>(token_index[i0 + t]) * ldy + d;
    const __m512 w = _mm512_set1_ps(weight[i0 + t]);
    _mm512_mask_storeu_ps(out, m, _mm512_fmadd_ps(w, r[t], _mm512_maskz_loadu_ps(m, out)));
  }
}

size_t elem_size(WeightType t) { return weight_format(t).block_bytes; }

// Cache blocking. The activations of all tokens are swept once per unit
// (16 f rows of gate+up, or 32 d rows of down); when they do not fit in L2
// next to the weights, K is split into chunks whose activations (all token
// blocks) take at most kActChunkBytes, and a group of units runs over one
// chunk before the next chunk starts, so each chunk's activations come from
// L3 once per group instead of once per unit. The accumulator tiles of the
// group's units stay in a per-thread buffer (at most kAccBytes) between
// chunks; storing and reloading fp32 tiles is exact, so results do not
// depend on the blocking.
constexpr size_t kActChunkBytes = size_t{768} << 10;
constexpr size_t kAccBytes = size_t{256} << 10;
constexpr int32_t kMinChunkSteps = 16;
constexpr int32_t kMaxGroupUnits = 8;
// The split table converts each unit's panels for a whole K chunk before its
// token blocks use them: four panels of 16 rows x 64 bytes per step. Capped
// at 32 steps (128 KiB of panels) they stay in L2 next to the activations,
// where a whole Mixtral row (128-448 steps) would take 0.5-1.8 MiB.
constexpr int32_t kSplitChunkSteps = 32;
// Accumulators of one tile_gemm pass: four 16x16 fp32 tiles.
constexpr size_t kPassAccBytes = 4 * 256 * sizeof(float);

// Per-call geometry and the thread's buffers.
struct Plan {
  int32_t S = 0;       // K steps of 32 (K zero-padded)
  int32_t nb = 0;      // 16-token blocks
  int32_t passes = 0;  // tile_gemm calls per unit and chunk: pairs of blocks, plus a lone last block
  int32_t CS = 0;      // K steps per chunk
  int32_t RG = 1;      // units per group
  bool split = false;  // the split table: hi/lo weight panels, three activation pieces
  int pieces = 1;      // B tiles per K step and token block
  size_t block_elems = 0;
  uint16_t* act = nullptr;
  uint16_t* panel = nullptr;
  float* acc = nullptr;
};

// The geometry of a call: steps, blocks, chunking (no buffers).
void plan_geometry(int32_t K, int32_t n, int32_t units, bool split, Plan* p) {
  p->split = split;
  p->pieces = split ? 3 : 1;
  p->S = (K + kKStep - 1) / kKStep;
  p->nb = (n + kTile - 1) / kTile;
  p->passes = (p->nb + 1) / 2;
  const size_t step_bytes = static_cast<size_t>(p->nb) * p->pieces * kTileElems * 2;
  p->CS = p->S;
  p->RG = 1;
  const int32_t max_chunk = split ? kSplitChunkSteps : p->S;
  if (static_cast<size_t>(p->S) * step_bytes > kActChunkBytes || p->S > max_chunk) {
    const size_t fit = kActChunkBytes / step_bytes;
    p->CS = min_i32(p->S, fit < static_cast<size_t>(kMinChunkSteps) ? kMinChunkSteps : static_cast<int32_t>(fit));
    p->CS = min_i32(p->CS, max_chunk);
    const size_t rg = kAccBytes / (static_cast<size_t>(p->passes) * kPassAccBytes);
    p->RG = rg < 1 ? 1 : rg > static_cast<size_t>(kMaxGroupUnits) ? kMaxGroupUnits : static_cast<int32_t>(rg);
    p->RG = min_i32(p->RG, units);
  }
  p->block_elems = static_cast<size_t>(p->S) * p->pieces * kTileElems;
}

// Bytes of the packed activations of n tokens over K (all token blocks).
size_t packed_activation_bytes(const Plan& p) { return static_cast<size_t>(p.nb) * p.block_elems * 2; }

// plan_geometry plus the thread's buffers: the activations' only when
// `own_activations` (not for prepared ones).
bool make_plan(int32_t K, int32_t n, int32_t units, bool split, bool own_activations, KernelScratch* scratch,
               Plan* p) {
  plan_geometry(K, n, units, split, p);
  if (own_activations) {
    p->act = static_cast<uint16_t*>(scratch_buffer(scratch, kActSlot, packed_activation_bytes(*p)));
    if (p->act == nullptr) return false;
  }
  const size_t panels = split ? 4 : 2;
  p->panel = static_cast<uint16_t*>(scratch_buffer(scratch, kPanelSlot, panels * kTile * p->CS * kKStep * 2));
  p->acc = static_cast<float*>(scratch_buffer(scratch, kAccSlot, static_cast<size_t>(p->RG) * p->passes * kPassAccBytes));
  return p->panel != nullptr && p->acc != nullptr;
}

// The A side of one unit for one K chunk: one or two 16-row panels (and
// their lo parts in the split table).
struct Unit {
  Panel a0, a1;
  Panel a0_lo, a1_lo;
  bool two;
};

// Panel `which` (0 or 1) of a unit for one K chunk: 16 rows from `rows`,
// `stride` elements apart, `valid` of them real; the split table's hi/lo
// pair, or make_panel's one. Each panel has its own part of `scratch`.
void make_unit_panel(const void* rows, size_t stride, WeightType wt, int32_t valid, int32_t K, int32_t k0,
                     int32_t steps, bool split, int which, uint16_t* scratch, Unit* un) {
  const size_t panel_elems = static_cast<size_t>(kTile) * steps * kKStep;
  Panel& main = which == 0 ? un->a0 : un->a1;
  Panel& low = which == 0 ? un->a0_lo : un->a1_lo;
  if (!split) {
    main = make_panel(rows, stride, wt, valid, K, k0, steps, scratch + which * panel_elems);
    low = Panel{nullptr, 0, 0};
    return;
  }
  uint16_t* hi = scratch + 2 * which * panel_elems;
  uint16_t* lo = hi + panel_elems;
  split_panel_f16(rows, stride, valid, k0, steps, hi, lo);
  main = Panel{reinterpret_cast<const char*>(hi), kKStep * 2, kTileElems * 2};
  low = Panel{reinterpret_cast<const char*>(lo), kKStep * 2, kTileElems * 2};
}

// The C = W X^T loop nest shared by both phases, over `units` units of the
// phase `ph`, which provides
//   Unit unit(u, k0, steps, split, scratch): the panels of unit u, columns [k0, k0 + steps*32)
//   void epilogue(u, b, blocks, c): consume the finished accumulators of
//     token blocks b .. b+blocks-1 (c: tile 2*j + a for block b+j, panel a).
// Units are visited in order within a group and token blocks in order
// within a unit.
template <class Phase>
void run_gemm(Phase& ph, const Plan& pl, int32_t units) {
  // Block b's accumulators at acc + b*512 in both tables (a pair's four
  // tiles are block b's two and block b+1's two).
  const size_t unit_acc = static_cast<size_t>(pl.passes) * 1024;
  for (int32_t g0 = 0; g0 < units; g0 += pl.RG) {
    const int32_t g1 = min_i32(units, g0 + pl.RG);
    for (int32_t c0 = 0; c0 < pl.S; c0 += pl.CS) {
      const int32_t cs = min_i32(pl.CS, pl.S - c0);
      const bool first = c0 == 0, last = c0 + cs == pl.S;
      for (int32_t u = g0; u < g1; ++u) {
        const Unit un = ph.unit(u, c0 * kKStep, cs, pl.split, pl.panel);
        float* acc = pl.acc + static_cast<size_t>(u - g0) * unit_acc;
        const uint16_t* Bc = pl.act + static_cast<size_t>(c0) * pl.pieces * kTileElems;
        if (pl.split) {
          for (int32_t b = 0; b < pl.nb; ++b) {
            float* c = acc + static_cast<size_t>(b) * 512;
            const uint16_t* B0 = Bc + static_cast<size_t>(b) * pl.block_elems;
            if (un.two) {
              tile_gemm_split<2>(un.a0, un.a0_lo, un.a1, un.a1_lo, B0, cs, first, c);
            } else {
              tile_gemm_split<1>(un.a0, un.a0_lo, un.a1, un.a1_lo, B0, cs, first, c);
            }
            if (last) ph.epilogue(u, b, 1, c);
          }
          continue;
        }
        int32_t b = 0;
        for (; b + 2 <= pl.nb; b += 2) {
          float* c = acc + static_cast<size_t>(b) * 512;
          const uint16_t* B0 = Bc + static_cast<size_t>(b) * pl.block_elems;
          if (un.two) {
            tile_gemm<2, 2>(un.a0, un.a1, B0, B0 + pl.block_elems, cs, first, c);
          } else {
            tile_gemm<1, 2>(un.a0, un.a1, B0, B0 + pl.block_elems, cs, first, c);
          }
          if (last) ph.epilogue(u, b, 2, c);
        }
        if (b < pl.nb) {
          float* c = acc + static_cast<size_t>(b) * 512;
          const uint16_t* B0 = Bc + static_cast<size_t>(b) * pl.block_elems;
          if (un.two) {
            tile_gemm<2, 1>(un.a0, un.a1, B0, nullptr, cs, first, c);
          } else {
            tile_gemm<1, 1>(un.a0, un.a1, B0, nullptr, cs, first, c);
          }
          if (last) ph.epilogue(u, b, 1, c);
        }
      }
    }
  }
}

// Gathers and packs the activations of n tokens: token i is row
// token_index[i] of `base` (row i when token_index is null), ld floats apart.
void pack_all(const Plan& pl, const float* base, size_t ld, const int32_t* token_index, int32_t n, int32_t K) {
  for (int32_t b = 0; b < pl.nb; ++b) {
    const int32_t i0 = b * kTile;
    const int32_t count = min_i32(kTile, n - i0);
    const float* act[kTile];
    for (int t = 0; t < count; ++t) {
      const size_t row = token_index != nullptr ? static_cast<size_t>(token_index[i0 + t]) : static_cast<size_t>(i0 + t);
      act[t] = base + row * ld;
    }
    pack_activations(act, count, K, pl.S, pl.pieces, pl.act + static_cast<size_t>(b) * pl.block_elems);
  }
}

// The call's activations: the prepared ones (KernelTable::prepare, the same
// layout; only read by the tile loads), or packed here into the plan's own.
void use_activations(Plan* pl, const void* prepared, const float* base, size_t ld, const int32_t* token_index,
                     int32_t n, int32_t K) {
  if (prepared != nullptr) {
    pl->act = static_cast<uint16_t*>(const_cast<void*>(prepared));
  } else {
    pack_all(*pl, base, ld, token_index, n, K);
  }
}

// Phase 1: unit u = f rows [f_begin + 16u, +16): the gate and up panels.
// Row 2f is gate row f, row 2f+1 up row f, so gate rows are every other
// row and a unit's gate and up rows are 2*valid consecutive rows.
struct GateUpPhase {
  const char* w;
  size_t row_bytes, stride;
  WeightType wt;
  int32_t K, f_begin, f_end, n;
  float* h;
  size_t ldh;

  int32_t valid(int32_t u) const { return min_i32(kTile, f_end - f_begin - u * kTile); }
  Unit unit(int32_t u, int32_t k0, int32_t steps, bool split, uint16_t* scratch) const {
    const char* gate = w + static_cast<size_t>(2 * (f_begin + u * kTile)) * row_bytes;
    Unit un;
    make_unit_panel(gate, 2 * stride, wt, valid(u), K, k0, steps, split, 0, scratch, &un);
    make_unit_panel(gate + row_bytes, 2 * stride, wt, valid(u), K, k0, steps, split, 1, scratch, &un);
    un.two = true;
    return un;
  }
  void epilogue(int32_t u, int32_t b, int32_t blocks, const float* c) const {
    const int32_t f = f_begin + u * kTile;
    for (int32_t j = 0; j < blocks; ++j) {
      const int32_t i0 = (b + j) * kTile;
      store_gate_up(c + 512 * j, c + 512 * j + 256, i0, min_i32(kTile, n - i0), f, valid(u), h, ldh);
    }
  }
};

// Phase 2: unit u = d rows [d_begin + 32u, +32): two panels (one for a last
// unit of at most 16 rows).
struct DownPhase {
  const char* w;
  size_t row_bytes, stride;
  WeightType wt;
  int32_t K, d_begin, d_end, n;
  const int32_t* token_index;
  const float* weight;
  float* y;
  size_t ldy;

  int32_t rows(int32_t u) const { return min_i32(2 * kTile, d_end - d_begin - u * 2 * kTile); }
  Unit unit(int32_t u, int32_t k0, int32_t steps, bool split, uint16_t* scratch) const {
    const int32_t d = d_begin + u * 2 * kTile;
    const char* r = w + static_cast<size_t>(d) * row_bytes;
    const int32_t nr = rows(u);
    Unit un;
    make_unit_panel(r, stride, wt, min_i32(kTile, nr), K, k0, steps, split, 0, scratch, &un);
    un.two = nr > kTile;
    if (un.two) {
      make_unit_panel(r + kTile * row_bytes, stride, wt, nr - kTile, K, k0, steps, split, 1, scratch, &un);
    } else {
      un.a1 = un.a1_lo = Panel{nullptr, 0, 0};
    }
    return un;
  }
  void epilogue(int32_t u, int32_t b, int32_t blocks, const float* c) const {
    const int32_t d = d_begin + u * 2 * kTile;
    const int32_t nr = rows(u);
    // Per panel, token block b before b + 1: each y row sees its tokens in order.
    for (int32_t a = 0; a < (nr > kTile ? 2 : 1); ++a) {
      for (int32_t j = 0; j < blocks; ++j) {
        const int32_t i0 = (b + j) * kTile;
        store_down(c + 512 * j + 256 * a, token_index, weight, i0, min_i32(kTile, n - i0), d + a * kTile,
                   min_i32(kTile, nr - a * kTile), y, ldy);
      }
    }
  }
};

// When the per-thread scratch cannot be allocated (out of memory on a
// thread's first prefill call): the fp32 decode kernels, which need none
// and are at least as accurate as either table.
const KernelTable& decode_fallback() { return avx512_kernels(); }

// `prepared`: the activations as prepare_tiles packed them, or null to
// pack them here.
void gate_up_tiles(bool split, const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                   const int32_t* token_index, const void* prepared, int32_t n, int32_t f_begin, int32_t f_end,
                   float* h, size_t ldh, KernelScratch* scratch) {
  if (n <= 0 || f_begin >= f_end) return;
  const int32_t units = (f_end - f_begin + kTile - 1) / kTile;
  Plan pl;
  if (!make_plan(s.d_model, n, units, split, prepared == nullptr, scratch, &pl)) {
    decode_fallback().gate_up(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh, scratch);
    return;
  }
  configure_tiles();
  use_activations(&pl, prepared, x, ldx, token_index, n, s.d_model);
  const size_t elem = elem_size(s.weight_type);
  GateUpPhase ph{static_cast<const char*>(gate_up), s.gate_up_stride * elem, s.gate_up_stride, s.weight_type,
                 s.d_model, f_begin, f_end, n, h, ldh};
  run_gemm(ph, pl, units);
  finish_hidden();
  release_tiles();
}

// `prepared`: the activations as prepare_tiles packed them, or null
// to pack them here.
void down_tiles(bool split, const ExpertShape& s, const void* down, const float* h, size_t ldh, const void* prepared,
                const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y,
                size_t ldy, KernelScratch* scratch) {
  if (n <= 0 || d_begin >= d_end) return;
  const int32_t units = (d_end - d_begin + 2 * kTile - 1) / (2 * kTile);
  Plan pl;
  if (!make_plan(s.d_ff, n, units, split, prepared == nullptr, scratch, &pl)) {
    decode_fallback().down(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
    return;
  }
  configure_tiles();
  use_activations(&pl, prepared, h, ldh, nullptr, n, s.d_ff);
  const size_t elem = elem_size(s.weight_type);
  DownPhase ph{static_cast<const char*>(down), s.down_stride * elem, s.down_stride, s.weight_type, s.d_ff, d_begin,
               d_end, n, token_index, weight, y, ldy};
  run_gemm(ph, pl, units);
  release_tiles();
}

// A phase's packed activations, made once per expert for all its row
// blocks (KernelTable::prepare): exactly what the kernels pack for
// themselves.
int32_t phase_k(const ExpertShape& s, Phase phase) { return phase == Phase::kGateUp ? s.d_model : s.d_ff; }

size_t prepared_bytes_tiles(bool split, const ExpertShape& s, Phase phase, int32_t n) {
  if (n <= 0) return 0;
  Plan pl;
  plan_geometry(phase_k(s, phase), n, 1, split, &pl);
  return packed_activation_bytes(pl);
}

void prepare_tiles(bool split, const ExpertShape& s, Phase phase, const float* act, size_t ld,
                   const int32_t* token_index, int32_t n, void* out) {
  if (n <= 0) return;
  Plan pl;
  plan_geometry(phase_k(s, phase), n, 1, split, &pl);
  pl.act = static_cast<uint16_t*>(out);
  pack_all(pl, act, ld, token_index, n, phase_k(s, phase));
}

// Both phases' plans for the largest calls: row ranges of max_rows (units
// of 16 f rows in phase 1, 32 d rows in phase 2), and up to max_tokens
// tokens. The activation and accumulator buffers grow with the tokens, but
// the panels shrink (more tokens, shorter K chunks) and are largest for one
// token (no chunking); the scratch only grows, so planning both ends
// reserves every call's size.
bool reserve_tiles(bool split, const ExpertShape& s, int32_t max_tokens, int32_t max_rows, KernelScratch* scratch) {
  if (max_tokens <= 0 || max_rows <= 0) return true;
  Plan pl;
  const int32_t up_units = (max_rows + kTile - 1) / kTile, down_units = (max_rows + 2 * kTile - 1) / (2 * kTile);
  const int32_t token_counts[2] = {max_tokens, 1};
  for (int32_t n : token_counts) {
    if (!make_plan(s.d_model, n, up_units, split, true, scratch, &pl) ||
        !make_plan(s.d_ff, n, down_units, split, true, scratch, &pl)) {
      return false;
    }
  }
  return true;
}

size_t prepared_bytes_amx(const ExpertShape& s, Phase phase, int32_t n) {
  return prepared_bytes_tiles(false, s, phase, n);
}

void prepare_amx(const ExpertShape& s, Phase phase, const float* act, size_t ld, const int32_t* token_index,
                 int32_t n, void* out) {
  prepare_tiles(false, s, phase, act, ld, token_index, n, out);
}

// `prepared` may be null (the plain entries below).
void gate_up_prepared_amx(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                          const int32_t* token_index, const void* prepared, int32_t n, int32_t f_begin, int32_t f_end,
                          float* h, size_t ldh, KernelScratch* scratch) {
  gate_up_tiles(false, s, gate_up, x, ldx, token_index, prepared, n, f_begin, f_end, h, ldh, scratch);
}

void down_prepared_amx(const ExpertShape& s, const void* down, const float* h, size_t ldh, const void* prepared,
                       const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin, int32_t d_end,
                       float* y, size_t ldy, KernelScratch* scratch) {
  down_tiles(false, s, down, h, ldh, prepared, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
}

void gate_up_amx(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx, const int32_t* token_index,
                 int32_t n, int32_t f_begin, int32_t f_end, float* h, size_t ldh, KernelScratch* scratch) {
  gate_up_prepared_amx(s, gate_up, x, ldx, token_index, nullptr, n, f_begin, f_end, h, ldh, scratch);
}

void down_amx(const ExpertShape& s, const void* down, const float* h, size_t ldh, const int32_t* token_index,
              const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* scratch) {
  down_prepared_amx(s, down, h, ldh, nullptr, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
}

bool reserve_amx(const ExpertShape& s, int32_t max_tokens, int32_t max_rows, KernelScratch* scratch) {
  return reserve_tiles(false, s, max_tokens, max_rows, scratch);
}

// The split table takes f16 weights only (its panels split f16); anything
// else goes to the fp32 kernels, whose precision it matches, and which
// prepare nothing.
size_t prepared_bytes_split(const ExpertShape& s, Phase phase, int32_t n) {
  return s.weight_type == WeightType::kF16 ? prepared_bytes_tiles(true, s, phase, n) : 0;
}

void prepare_split(const ExpertShape& s, Phase phase, const float* act, size_t ld, const int32_t* token_index,
                   int32_t n, void* out) {
  if (s.weight_type == WeightType::kF16) prepare_tiles(true, s, phase, act, ld, token_index, n, out);
}

// `prepared` may be null (the plain entries below).
void gate_up_prepared_split(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                            const int32_t* token_index, const void* prepared, int32_t n, int32_t f_begin,
                            int32_t f_end, float* h, size_t ldh, KernelScratch* scratch) {
  if (s.weight_type != WeightType::kF16) {
    avx512_kernels().gate_up(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh, scratch);
    return;
  }
  gate_up_tiles(true, s, gate_up, x, ldx, token_index, prepared, n, f_begin, f_end, h, ldh, scratch);
}

void down_prepared_split(const ExpertShape& s, const void* down, const float* h, size_t ldh, const void* prepared,
                         const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin, int32_t d_end,
                         float* y, size_t ldy, KernelScratch* scratch) {
  if (s.weight_type != WeightType::kF16) {
    avx512_kernels().down(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
    return;
  }
  down_tiles(true, s, down, h, ldh, prepared, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
}

void gate_up_split(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx, const int32_t* token_index,
                   int32_t n, int32_t f_begin, int32_t f_end, float* h, size_t ldh, KernelScratch* scratch) {
  gate_up_prepared_split(s, gate_up, x, ldx, token_index, nullptr, n, f_begin, f_end, h, ldh, scratch);
}

void down_split(const ExpertShape& s, const void* down, const float* h, size_t ldh, const int32_t* token_index,
                const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* scratch) {
  down_prepared_split(s, down, h, ldh, nullptr, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
}

bool reserve_split(const ExpertShape& s, int32_t max_tokens, int32_t max_rows, KernelScratch* scratch) {
  return s.weight_type != WeightType::kF16 || reserve_tiles(true, s, max_tokens, max_rows, scratch);
}

}  // namespace

const KernelTable& amx_bf16_kernels() {
  static const KernelTable table{Isa::kAmx,         "amx-bf16",  gate_up_amx,          down_amx, reserve_amx,
                                 prepared_bytes_amx, prepare_amx, gate_up_prepared_amx, down_prepared_amx};
  return table;
}

const KernelTable& amx_f16_split_kernels() {
  static const KernelTable table{Isa::kAmx,           "amx-f16-split", gate_up_split,          down_split,
                                 reserve_split,        prepared_bytes_split, prepare_split, gate_up_prepared_split,
                                 down_prepared_split};
  return table;
}

}  // namespace colibri::kernels
