// The FFN tables for block-quantised weights: the two phases of kernels.h
// over the integer dot products of quant_dot.h.
//
// Default precision: each phase's activations (x for gate/up, h for down)
// are quantised to int8 blocks once per expert and call, by `prepare` when
// the engine runs it (once for all of an expert's row blocks) or at the
// start of gate_up / down otherwise, and every weight row is then read once
// for all of the expert's tokens. The exact tables instead widen each chunk
// of weight rows to f32 (the format's reference dequantiser) and run the
// fp32 kernels of the same level on it: the quantised model's output to
// fp32 rounding, at the cost of the widening.
//
// Compiled without ISA flags: it only calls the per-ISA code through the
// tables (quant_dot.h, kernels.h).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/amx.h"
#include "kernels/kernels.h"
#include "kernels/quant_dot.h"

namespace colibri::kernels {
namespace {

// Weight rows per dot_rows call, and tokens per pass over them: the partial
// results ([tokens][rows] floats) stay on the stack and in L1.
constexpr int32_t kChunkRows = 64;
constexpr int32_t kChunkTokens = 32;
constexpr size_t kAlign = 64;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct PhaseGeometry {
  const QuantDotKernels* ops;
  GluPairsFn glu;    // gate / up's epilogue
  size_t valid;      // activation elements: d_model (gate/up) or d_ff (down)
  size_t padded;     // the weight rows' elements (whole blocks)
  size_t row_bytes;  // bytes of one weight row
  size_t act_bytes;  // bytes of one token's activation blocks, rounded to kAlign
};

PhaseGeometry geometry(const ExpertShape& s, Phase phase, Isa isa) {
  const bool up = phase == Phase::kGateUp;
  const WeightType t = up ? s.weight_type : s.down_type;
  PhaseGeometry g;
  g.ops = quant_dot_kernels(t, isa);
  g.glu = glu_pairs(isa);
  g.valid = static_cast<size_t>(up ? s.d_model : s.d_ff);
  g.padded = up ? s.gate_up_stride : s.down_stride;
  g.row_bytes = weight_row_bytes(t, g.padded);
  g.act_bytes = round_up(act_row_bytes(t, g.padded), kAlign);
  return g;
}

size_t prepared_bytes_for(const ExpertShape& s, Phase phase, int32_t n, Isa isa) {
  return static_cast<size_t>(n) * geometry(s, phase, isa).act_bytes;
}

// Quantises token i = row token_index[i] (i when token_index is null) of act.
void quantize_tokens(const PhaseGeometry& g, const float* act, size_t ld, const int32_t* token_index, int32_t n,
                     uint8_t* out) {
  for (int32_t i = 0; i < n; ++i) {
    const size_t row = token_index != nullptr ? static_cast<size_t>(token_index[i]) : static_cast<size_t>(i);
    g.ops->quantize_act(act + row * ld, g.valid, g.padded, out + static_cast<size_t>(i) * g.act_bytes);
  }
}

void gate_up_from(const ExpertShape& s, const PhaseGeometry& g, const void* gate_up, const uint8_t* acts, int32_t n,
                  int32_t f_begin, int32_t f_end, float* h, size_t ldh) {
  const auto* w = static_cast<const uint8_t*>(gate_up);
  float out[kChunkTokens * kChunkRows];
  for (int32_t f0 = f_begin; f0 < f_end; f0 += kChunkRows / 2) {
    const int32_t fn = std::min(kChunkRows / 2, f_end - f0);
    for (int32_t t0 = 0; t0 < n; t0 += kChunkTokens) {
      const int32_t tn = std::min(kChunkTokens, n - t0);
      g.ops->dot_rows(w + static_cast<size_t>(2 * f0) * g.row_bytes, g.row_bytes, 2 * fn,
                      acts + static_cast<size_t>(t0) * g.act_bytes, g.act_bytes, tn, g.padded, out, kChunkRows);
      for (int32_t i = 0; i < tn; ++i) {
        g.glu(s.epilogue, f0, out + static_cast<size_t>(i) * kChunkRows, fn, h + static_cast<size_t>(t0 + i) * ldh + f0);
      }
    }
  }
}

void down_from(const ExpertShape& s, const PhaseGeometry& g, const void* down, const uint8_t* acts,
               const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y,
               size_t ldy) {
  const float* bias = s.epilogue.down_bias;
  const auto* w = static_cast<const uint8_t*>(down);
  float out[kChunkTokens * kChunkRows];
  for (int32_t d0 = d_begin; d0 < d_end; d0 += kChunkRows) {
    const int32_t dn = std::min(kChunkRows, d_end - d0);
    for (int32_t t0 = 0; t0 < n; t0 += kChunkTokens) {
      const int32_t tn = std::min(kChunkTokens, n - t0);
      g.ops->dot_rows(w + static_cast<size_t>(d0) * g.row_bytes, g.row_bytes, dn,
                      acts + static_cast<size_t>(t0) * g.act_bytes, g.act_bytes, tn, g.padded, out, kChunkRows);
      for (int32_t i = 0; i < tn; ++i) {
        const float* o = out + static_cast<size_t>(i) * kChunkRows;
        float* yi = y + static_cast<size_t>(token_index[t0 + i]) * ldy + d0;
        const float wi = weight[t0 + i];
        if (bias != nullptr) {
          for (int32_t d = 0; d < dn; ++d) yi[d] += wi * (o[d] + bias[d0 + d]);
        } else {
          for (int32_t d = 0; d < dn; ++d) yi[d] += wi * o[d];
        }
      }
    }
  }
}

// The unprepared entries quantise into the caller's scratch, or without
// one (null, or a failed allocation) one token at a time on the stack.
constexpr size_t kStackActBytes = 32 * 1024;

template <Isa L>
void gate_up_q(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx, const int32_t* token_index,
               int32_t n, int32_t f_begin, int32_t f_end, float* h, size_t ldh, KernelScratch* scratch) {
  const PhaseGeometry g = geometry(s, Phase::kGateUp, L);
  auto* acts = static_cast<uint8_t*>(scratch_buffer(scratch, 0, static_cast<size_t>(n) * g.act_bytes));
  if (acts != nullptr) {
    quantize_tokens(g, x, ldx, token_index, n, acts);
    gate_up_from(s, g, gate_up, acts, n, f_begin, f_end, h, ldh);
    return;
  }
  alignas(kAlign) uint8_t one[kStackActBytes];
  for (int32_t i = 0; i < n; ++i) {
    if (g.act_bytes > sizeof one) break;  // no memory at all for a row this wide: reserve() reported it
    quantize_tokens(g, x, ldx, token_index + i, 1, one);
    gate_up_from(s, g, gate_up, one, 1, f_begin, f_end, h + static_cast<size_t>(i) * ldh, ldh);
  }
}

template <Isa L>
void down_q(const ExpertShape& s, const void* down, const float* h, size_t ldh, const int32_t* token_index,
            const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* scratch) {
  const PhaseGeometry g = geometry(s, Phase::kDown, L);
  auto* acts = static_cast<uint8_t*>(scratch_buffer(scratch, 0, static_cast<size_t>(n) * g.act_bytes));
  if (acts != nullptr) {
    quantize_tokens(g, h, ldh, nullptr, n, acts);
    down_from(s, g, down, acts, token_index, weight, n, d_begin, d_end, y, ldy);
    return;
  }
  alignas(kAlign) uint8_t one[kStackActBytes];
  for (int32_t i = 0; i < n; ++i) {
    if (g.act_bytes > sizeof one) break;
    quantize_tokens(g, h + static_cast<size_t>(i) * ldh, ldh, nullptr, 1, one);
    down_from(s, g, down, one, token_index + i, weight + i, 1, d_begin, d_end, y, ldy);
  }
}

template <Isa L>
size_t prepared_bytes_q(const ExpertShape& s, Phase phase, int32_t n) {
  return prepared_bytes_for(s, phase, n, L);
}

template <Isa L>
void prepare_q(const ExpertShape& s, Phase phase, const float* act, size_t ld, const int32_t* token_index, int32_t n,
               void* out) {
  quantize_tokens(geometry(s, phase, L), act, ld, token_index, n, static_cast<uint8_t*>(out));
}

template <Isa L>
void gate_up_prepared_q(const ExpertShape& s, const void* gate_up, const float* /*x*/, size_t /*ldx*/,
                        const int32_t* /*token_index*/, const void* prepared, int32_t n, int32_t f_begin,
                        int32_t f_end, float* h, size_t ldh, KernelScratch* scratch) {
  gate_up_from(s, geometry(s, Phase::kGateUp, L), gate_up, static_cast<const uint8_t*>(prepared), n, f_begin, f_end,
               h, ldh);
}

template <Isa L>
void down_prepared_q(const ExpertShape& s, const void* down, const float* /*h*/, size_t /*ldh*/, const void* prepared,
                     const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin, int32_t d_end,
                     float* y, size_t ldy, KernelScratch* scratch) {
  down_from(s, geometry(s, Phase::kDown, L), down, static_cast<const uint8_t*>(prepared), token_index, weight, n,
            d_begin, d_end, y, ldy);
}

template <Isa L>
bool reserve_q(const ExpertShape& s, int32_t max_tokens, int32_t /*max_rows*/, KernelScratch* scratch) {
  const size_t bytes = std::max(prepared_bytes_for(s, Phase::kGateUp, max_tokens, L),
                                prepared_bytes_for(s, Phase::kDown, max_tokens, L));
  return scratch->get(0, bytes) != nullptr;
}

// ---------------------------------------------------------------- exact

// The f32 shape the widened rows of a chunk take: rows as long as the
// quantised ones' whole blocks (a multiple of 32 floats, so still on cache
// lines), the elements past the row's end zeroed (a K format's zero
// padding need not dequantise to exactly zero).
ExpertShape widened_shape(const ExpertShape& s) {
  ExpertShape w = make_expert_shape(s.d_model, s.d_ff, WeightType::kF32);
  w.gate_up_stride = std::max(w.gate_up_stride, s.gate_up_stride);
  w.down_stride = std::max(w.down_stride, s.down_stride);
  w.epilogue = s.epilogue;
  return w;
}

void widen_rows(WeightType t, const uint8_t* src, size_t row_bytes, size_t blocks_elements, size_t valid,
                int32_t rows, float* dst, size_t dst_stride) {
  const WeightFormat& f = weight_format(t);
  for (int32_t r = 0; r < rows; ++r) {
    float* out = dst + static_cast<size_t>(r) * dst_stride;
    f.to_float(src + static_cast<size_t>(r) * row_bytes, out, blocks_elements);
    std::fill(out + valid, out + dst_stride, 0.0f);
  }
}

template <Isa L>
void gate_up_exact(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx, const int32_t* token_index,
                   int32_t n, int32_t f_begin, int32_t f_end, float* h, size_t ldh, KernelScratch* scratch) {
  const ExpertShape ws = widened_shape(s);
  const size_t row_bytes = weight_row_bytes(s.weight_type, s.gate_up_stride);
  const size_t chunk_rows = 16;  // f rows: 32 weight rows
  auto* rows = static_cast<float*>(scratch_buffer(scratch, 1, 2 * chunk_rows * ws.gate_up_stride * sizeof(float)));
  if (rows == nullptr) return;  // reserve() failed and said so
  const KernelTable& f32 = kernel_table(L);
  for (int32_t f0 = f_begin; f0 < f_end; f0 += static_cast<int32_t>(chunk_rows)) {
    const int32_t fn = std::min(static_cast<int32_t>(chunk_rows), f_end - f0);
    widen_rows(s.weight_type, static_cast<const uint8_t*>(gate_up) + static_cast<size_t>(2 * f0) * row_bytes,
               row_bytes, s.gate_up_stride, static_cast<size_t>(s.d_model), 2 * fn, rows, ws.gate_up_stride);
    f32.gate_up(shifted_epilogue(ws, f0, 0), rows, x, ldx, token_index, n, 0, fn, h + f0, ldh, scratch);
  }
}

template <Isa L>
void down_exact(const ExpertShape& s, const void* down, const float* h, size_t ldh, const int32_t* token_index,
                const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* scratch) {
  const ExpertShape ws = widened_shape(s);
  const size_t row_bytes = weight_row_bytes(s.down_type, s.down_stride);
  const size_t chunk_rows = 32;
  auto* rows = static_cast<float*>(scratch_buffer(scratch, 1, chunk_rows * ws.down_stride * sizeof(float)));
  if (rows == nullptr) return;
  const KernelTable& f32 = kernel_table(L);
  for (int32_t d0 = d_begin; d0 < d_end; d0 += static_cast<int32_t>(chunk_rows)) {
    const int32_t dn = std::min(static_cast<int32_t>(chunk_rows), d_end - d0);
    widen_rows(s.down_type, static_cast<const uint8_t*>(down) + static_cast<size_t>(d0) * row_bytes, row_bytes,
               s.down_stride, static_cast<size_t>(s.d_ff), dn, rows, ws.down_stride);
    // The f32 kernel writes columns [0, dn) of y: shift y so they land at d0.
    f32.down(shifted_epilogue(ws, 0, d0), rows, h, ldh, token_index, weight, n, 0, dn, y + d0, ldy, scratch);
  }
}

template <Isa L>
bool reserve_exact(const ExpertShape& s, int32_t /*max_tokens*/, int32_t /*max_rows*/, KernelScratch* scratch) {
  const ExpertShape ws = widened_shape(s);
  const size_t bytes = std::max(32 * ws.gate_up_stride, 32 * ws.down_stride) * sizeof(float);
  return scratch->get(1, bytes) != nullptr;
}

// ---------------------------------------------------------------- AMX tier
#if defined(COLIBRI_HAVE_X86_KERNELS)

// Block formats on the AMX bf16 tiles (many tokens per expert): chunks of
// weight rows dequantised to bf16 (dequant_bf16_avx512: float_to_bf16 of
// the reference dequantiser's values) in a buffer that stays in L2, then
// the "amx-bf16" table's kernels on the chunk, their activations packed to
// bf16 once per expert (prepare). The dequantisation is paid once per call
// for all the expert's tokens; the products run at the tiles' rate.
constexpr size_t kAmxChunkBytes = 512 * 1024;
constexpr int kAmxChunkSlot = 3;  // the amx-bf16 kernels use slots 0-2

ExpertShape bf16_shape(const ExpertShape& s) {
  ExpertShape w = make_expert_shape(s.d_model, s.d_ff, WeightType::kBF16);
  w.gate_up_stride = std::max(w.gate_up_stride, s.gate_up_stride);
  w.down_stride = std::max(w.down_stride, s.down_stride);
  return w;
}

// Rows per chunk: a multiple of `unit` (the amx kernels' row unit), at
// least one unit, within kAmxChunkBytes of bf16.
int32_t amx_chunk_rows(size_t stride, int32_t unit) {
  const auto fit = static_cast<int32_t>(kAmxChunkBytes / (stride * 2));
  return std::max(unit, fit / unit * unit);
}

// rows x `blocks_elements` quantised elements to bf16 rows of dst_stride,
// elements from `valid` on zeroed (a K format's padding does not
// dequantise to zero, and the tiles read up to the next 32).
void dequant_rows_bf16(DequantBf16Fn dq, const uint8_t* src, size_t row_bytes, size_t blocks_elements, size_t valid,
                       int32_t rows, uint16_t* dst, size_t dst_stride) {
  // The rows stream from DRAM: each one asks for the row two ahead (the
  // hardware prefetchers alone leave the loop waiting on loads).
  constexpr int32_t kAhead = 2;
  for (int32_t r = 0; r < rows; ++r) {
    if (r + kAhead < rows) {
      const uint8_t* next = src + static_cast<size_t>(r + kAhead) * row_bytes;
      for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(next + o, 0, 3);
    }
    uint16_t* out = dst + static_cast<size_t>(r) * dst_stride;
    dq(src + static_cast<size_t>(r) * row_bytes, blocks_elements, out);
    std::fill(out + valid, out + dst_stride, uint16_t{0});
  }
}

size_t amx_chunk_bytes(const ExpertShape& s) {
  const ExpertShape ws = bf16_shape(s);
  const size_t up = static_cast<size_t>(2 * amx_chunk_rows(2 * ws.gate_up_stride, 16)) * ws.gate_up_stride;
  const size_t down = static_cast<size_t>(amx_chunk_rows(ws.down_stride, 32)) * ws.down_stride;
  return std::max(up, down) * sizeof(uint16_t);
}

void gate_up_prepared_amxq(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx,
                           const int32_t* token_index, const void* prepared, int32_t n, int32_t f_begin, int32_t f_end,
                           float* h, size_t ldh, KernelScratch* scratch) {
  const ExpertShape ws = bf16_shape(s);
  const KernelTable& amx = amx_bf16_kernels();
  auto* rows = static_cast<uint16_t*>(scratch_buffer(scratch, kAmxChunkSlot, amx_chunk_bytes(s)));
  if (rows == nullptr) {  // reserve() failed and said so: the int8 kernels need no chunk
    gate_up_q<Isa::kAvx512>(s, gate_up, x, ldx, token_index, n, f_begin, f_end, h, ldh, scratch);
    return;
  }
  const DequantBf16Fn dq = dequant_bf16_avx512(s.weight_type);
  const size_t row_bytes = weight_row_bytes(s.weight_type, s.gate_up_stride);
  const int32_t chunk = amx_chunk_rows(2 * ws.gate_up_stride, 16);  // f rows: 2x weight rows
  for (int32_t f0 = f_begin; f0 < f_end; f0 += chunk) {
    const int32_t fn = std::min(chunk, f_end - f0);
    dequant_rows_bf16(dq, static_cast<const uint8_t*>(gate_up) + static_cast<size_t>(2 * f0) * row_bytes, row_bytes,
                      s.gate_up_stride, static_cast<size_t>(s.d_model), 2 * fn, rows, ws.gate_up_stride);
    if (prepared != nullptr) {
      amx.gate_up_prepared(ws, rows, x, ldx, token_index, prepared, n, 0, fn, h + f0, ldh, scratch);
    } else {
      amx.gate_up(ws, rows, x, ldx, token_index, n, 0, fn, h + f0, ldh, scratch);
    }
  }
}

void down_prepared_amxq(const ExpertShape& s, const void* down, const float* h, size_t ldh, const void* prepared,
                        const int32_t* token_index, const float* weight, int32_t n, int32_t d_begin, int32_t d_end,
                        float* y, size_t ldy, KernelScratch* scratch) {
  const ExpertShape ws = bf16_shape(s);
  const KernelTable& amx = amx_bf16_kernels();
  auto* rows = static_cast<uint16_t*>(scratch_buffer(scratch, kAmxChunkSlot, amx_chunk_bytes(s)));
  if (rows == nullptr) {
    down_q<Isa::kAvx512>(s, down, h, ldh, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
    return;
  }
  const DequantBf16Fn dq = dequant_bf16_avx512(s.down_type);
  const size_t row_bytes = weight_row_bytes(s.down_type, s.down_stride);
  const int32_t chunk = amx_chunk_rows(ws.down_stride, 32);
  for (int32_t d0 = d_begin; d0 < d_end; d0 += chunk) {
    const int32_t dn = std::min(chunk, d_end - d0);
    dequant_rows_bf16(dq, static_cast<const uint8_t*>(down) + static_cast<size_t>(d0) * row_bytes, row_bytes,
                      s.down_stride, static_cast<size_t>(s.d_ff), dn, rows, ws.down_stride);
    // The kernel writes columns [0, dn) of y: shift y so they land at d0.
    if (prepared != nullptr) {
      amx.down_prepared(ws, rows, h, ldh, prepared, token_index, weight, n, 0, dn, y + d0, ldy, scratch);
    } else {
      amx.down(ws, rows, h, ldh, token_index, weight, n, 0, dn, y + d0, ldy, scratch);
    }
  }
}

void gate_up_amxq(const ExpertShape& s, const void* gate_up, const float* x, size_t ldx, const int32_t* token_index,
                  int32_t n, int32_t f_begin, int32_t f_end, float* h, size_t ldh, KernelScratch* scratch) {
  gate_up_prepared_amxq(s, gate_up, x, ldx, token_index, nullptr, n, f_begin, f_end, h, ldh, scratch);
}

void down_amxq(const ExpertShape& s, const void* down, const float* h, size_t ldh, const int32_t* token_index,
               const float* weight, int32_t n, int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* scratch) {
  down_prepared_amxq(s, down, h, ldh, nullptr, token_index, weight, n, d_begin, d_end, y, ldy, scratch);
}

size_t prepared_bytes_amxq(const ExpertShape& s, Phase phase, int32_t n) {
  return amx_bf16_kernels().prepared_bytes(bf16_shape(s), phase, n);
}

void prepare_amxq(const ExpertShape& s, Phase phase, const float* act, size_t ld, const int32_t* token_index,
                  int32_t n, void* out) {
  amx_bf16_kernels().prepare(bf16_shape(s), phase, act, ld, token_index, n, out);
}

bool reserve_amxq(const ExpertShape& s, int32_t max_tokens, int32_t max_rows, KernelScratch* scratch) {
  const bool amx = amx_bf16_kernels().reserve(bf16_shape(s), max_tokens, max_rows, scratch);
  return scratch->get(kAmxChunkSlot, amx_chunk_bytes(s)) != nullptr && amx &&
         reserve_q<Isa::kAvx512>(s, max_tokens, max_rows, scratch);
}

#endif  // COLIBRI_HAVE_X86_KERNELS

template <Isa L>
KernelTable quant_table(const char* name) {
  KernelTable t;
  t.isa = L;
  t.name = name;
  t.gate_up = gate_up_q<L>;
  t.down = down_q<L>;
  t.reserve = reserve_q<L>;
  t.prepared_bytes = prepared_bytes_q<L>;
  t.prepare = prepare_q<L>;
  t.gate_up_prepared = gate_up_prepared_q<L>;
  t.down_prepared = down_prepared_q<L>;
  t.any_epilogue = true;
  return t;
}

template <Isa L>
KernelTable exact_table(const char* name) {
  KernelTable t;
  t.isa = L;
  t.name = name;
  t.gate_up = gate_up_exact<L>;
  t.down = down_exact<L>;
  t.reserve = reserve_exact<L>;
  t.any_epilogue = true;
  return t;
}

}  // namespace

#if defined(COLIBRI_HAVE_X86_KERNELS)
const KernelTable& quant_amx_bf16_kernels() {
  static const KernelTable t = [] {
    KernelTable k;
    k.isa = Isa::kAmx;
    k.name = "amx-bf16-dequant";
    k.gate_up = gate_up_amxq;
    k.down = down_amxq;
    k.reserve = reserve_amxq;
    k.prepared_bytes = prepared_bytes_amxq;
    k.prepare = prepare_amxq;
    k.gate_up_prepared = gate_up_prepared_amxq;
    k.down_prepared = down_prepared_amxq;
    return k;
  }();
  return t;
}
#endif

namespace {

// The table of the highest level at most `isa` that this CPU runs; the
// int8 kernels' AVX-512 level also needs AVX512_VNNI.
const KernelTable& by_level(Isa isa, bool int8, const KernelTable& scalar, const KernelTable* avx2,
                            const KernelTable* avx512) {
  const Isa detected = detect_isa();
  const Isa level = isa < detected ? isa : detected;
  if (avx512 != nullptr && level >= Isa::kAvx512 && (!int8 || cpu_has_avx512_vnni())) return *avx512;
  if (avx2 != nullptr && level >= Isa::kAvx2) return *avx2;
  return scalar;
}

}  // namespace

const KernelTable& quant_kernels(Isa isa, bool exact) {
  if (exact) {
    static const KernelTable scalar = exact_table<Isa::kScalar>("exact-dequant-scalar");
#if defined(COLIBRI_HAVE_X86_KERNELS)
    static const KernelTable avx2 = exact_table<Isa::kAvx2>("exact-dequant-avx2");
    static const KernelTable avx512 = exact_table<Isa::kAvx512>("exact-dequant-avx512");
    return by_level(isa, false, scalar, &avx2, &avx512);
#else
    return by_level(isa, false, scalar, nullptr, nullptr);
#endif
  }
  static const KernelTable scalar = quant_table<Isa::kScalar>("int8-scalar");
#if defined(COLIBRI_HAVE_X86_KERNELS)
  // The AVX2 level's integer kernels take vpdpbusd where the CPU has AVX-VNNI (quant_dot_kernels).
  static const KernelTable avx2 = quant_table<Isa::kAvx2>(cpu_has_avx_vnni() ? "int8-avx2-vnni" : "int8-avx2");
  static const KernelTable avx512 = quant_table<Isa::kAvx512>("int8-avx512-vnni");
  // On AMX, the same with the many-token products on AMX-INT8 tiles
  // (quant_dot_amx_int8) for the formats that have them.
  static const KernelTable amx = quant_table<Isa::kAmx>("int8-amx");
  if (isa >= Isa::kAmx && detect_isa() >= Isa::kAmx && cpu_has_avx512_vnni() && amx_int8_available()) return amx;
  return by_level(isa, true, scalar, &avx2, &avx512);
#else
  return by_level(isa, true, scalar, nullptr, nullptr);
#endif
}

// The int8 tables' entries under fp8_e4m3's own names.
const KernelTable& fp8_kernels(Isa isa) {
  static const KernelTable scalar = quant_table<Isa::kScalar>("fp8-scalar");
#if defined(COLIBRI_HAVE_X86_KERNELS)
  static const KernelTable avx2 = quant_table<Isa::kAvx2>("fp8-avx2");
  static const KernelTable avx512 = quant_table<Isa::kAvx512>("fp8-avx512");
  return by_level(isa, true, scalar, &avx2, &avx512);
#else
  return by_level(isa, true, scalar, nullptr, nullptr);
#endif
}

}  // namespace colibri::kernels
