// The one narrow interface between the MoE engine and the math.
//
// Kernels know nothing of models, routing or threads: they compute one slice
// of one expert's SwiGLU FFN for a list of tokens. The engine splits the work
// in two phases so that every weight byte is read once per call:
//   phase 1 (gate_up): h_i[f] = silu(gate_f . x_i) * (up_f . x_i)  for rows f in a range
//   phase 2 (down):    y_t[d] += w_i * (down_d . h_i)               for rows d in a range
// Token gather (x_i = x[token_index[i]]) and the weighted scatter-add are
// fused into the kernels' loads and stores.
//
// Weight layout (written by moe/expert_store, read here), per expert:
//   gate_up: 2*F rows; row 2f is gate row f, row 2f+1 is up row f, so one
//            pass streams both matrices. Each row holds D elements, padded
//            with zeros to `gate_up_stride` elements (a multiple of 64 bytes).
//   down:    D rows of F elements, padded with zeros to `down_stride`.
// Both blocks start 64-byte aligned. Element type: f32, f16 or bf16, as in
// the model files. Activations are f32 and products are summed in f32,
// except in the bf16 prefill tables ("amx-bf16", "avx512-bf16"), where
// activations are rounded to bf16 (see plan_kernels and
// docs/PRECISION.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "util/weight_format.h"

namespace colibri::kernels {

using colibri::WeightType;

class KernelScratch;

// Rows padded to this many bytes, so SIMD loads never need a tail mask on
// weights and every row starts on a cache line.
inline constexpr size_t kRowAlignBytes = 64;

// What phase 1 makes of an expert's gate and up products, and what phase 2
// adds before the routing weight. SwiGLU: h = silu(g) * u. kClampedSwiGLU
// (gpt-oss): g = min(g, limit), u = clamp(u, -limit, limit),
// h = (u + 1) * g * sigmoid(alpha * g). Either may carry biases, added to
// the products before the activation (gate_up_bias, [2F]: gate row f's at
// 2f, up row f's at 2f + 1, the rows' own order) and to down's products
// before the weighting (down_bias, [D]): y += w * (down . h + b).
enum class Activation : uint8_t { kSwiGLU = 0, kClampedSwiGLU = 1 };

struct Epilogue {
  Activation activation = Activation::kSwiGLU;
  float alpha = 1.702f;  // kClampedSwiGLU only
  float limit = 7.0f;    // kClampedSwiGLU only
  // The model's experts have biases. The kernels read the pointers below
  // (nullptr: none); the flag is what planning sees (plan_kernels runs on
  // a layer's shape, before any expert's pointers are known).
  bool biased = false;
  // One expert's biases, set per expert by the caller (the engine) on its
  // copy of the layer's shape.
  const float* gate_up_bias = nullptr;
  const float* down_bias = nullptr;
  // Plain SwiGLU without biases: what every table computes (see
  // KernelTable::any_epilogue).
  bool plain() const { return activation == Activation::kSwiGLU && !biased; }
};

// Phase 1's activation of row f (the scalar definition; the SIMD decode
// kernels have their own copy, ffn_decode_impl.h, for linkage reasons).
inline float apply_glu(const Epilogue& e, int32_t f, float g, float u) {
  if (e.gate_up_bias != nullptr) {
    g += e.gate_up_bias[2 * static_cast<size_t>(f)];
    u += e.gate_up_bias[2 * static_cast<size_t>(f) + 1];
  }
  if (e.activation == Activation::kSwiGLU) return g / (1.0f + std::exp(-g)) * u;
  g = std::min(g, e.limit);
  u = std::max(std::min(u, e.limit), -e.limit);
  return (u + 1.0f) * (g / (1.0f + std::exp(-e.alpha * g)));
}

struct ExpertShape {
  int32_t d_model = 0;
  int32_t d_ff = 0;
  WeightType weight_type = WeightType::kF32;  // of gate and up
  // Of down: the same for the float types; a block format may pair with
  // another (GGUF's Q4_K_M stores gate and up in q4_k, down in q6_k).
  WeightType down_type = WeightType::kF32;
  size_t gate_up_stride = 0;  // elements per gate/up row (>= d_model)
  size_t down_stride = 0;     // elements per down row (>= d_ff)
  Epilogue epilogue;
};

// `s` for the rows from gate/up row pair f0 and down row d0 on, for kernels
// that run an inner table on a slice of an expert (its biases shifted).
inline ExpertShape shifted_epilogue(ExpertShape s, int32_t f0, int32_t d0) {
  if (s.epilogue.gate_up_bias != nullptr) s.epilogue.gate_up_bias += 2 * static_cast<size_t>(f0);
  if (s.epilogue.down_bias != nullptr) s.epilogue.down_bias += static_cast<size_t>(d0);
  return s;
}

inline ExpertShape make_expert_shape(int32_t d_model, int32_t d_ff, WeightType t, WeightType down_t) {
  ExpertShape s;
  s.d_model = d_model;
  s.d_ff = d_ff;
  s.weight_type = t;
  s.down_type = down_t;
  s.gate_up_stride = padded_row_elements(t, static_cast<size_t>(d_model), kRowAlignBytes);
  s.down_stride = padded_row_elements(down_t, static_cast<size_t>(d_ff), kRowAlignBytes);
  return s;
}
inline ExpertShape make_expert_shape(int32_t d_model, int32_t d_ff, WeightType t) {
  return make_expert_shape(d_model, d_ff, t, t);
}

// Phase 1. For f in [f_begin, f_end) and i in [0, n):
//   h[i*ldh + f] = silu(g) * u,  g = gate_f . x_i,  u = up_f . x_i,
//   x_i = x + token_index[i]*ldx,  silu(g) = g / (1 + exp(-g)),
// or what shape.epilogue says instead (apply_glu).
//
// Every entry takes the caller's working memory, `scratch` (see
// KernelScratch), last; kernels that need none ignore it, and those that
// do fall back to scratch-free paths (the same results) when it is null or
// cannot grow.
using GateUpFn = void (*)(const ExpertShape& shape, const void* gate_up, const float* x,
                          size_t ldx, const int32_t* token_index, int32_t n, int32_t f_begin,
                          int32_t f_end, float* h, size_t ldh, KernelScratch* scratch);

// Phase 2. For d in [d_begin, d_end) and i in [0, n):
//   y[token_index[i]*ldy + d] += weight[i] * (down_d . h_i + b_d),  h_i = h + i*ldh,
// b = shape.epilogue.down_bias (0 without).
// Tokens are visited in order i = 0..n-1, so a caller that gives each thread
// disjoint d ranges gets results independent of the thread count.
using DownFn = void (*)(const ExpertShape& shape, const void* down, const float* h, size_t ldh,
                        const int32_t* token_index, const float* weight, int32_t n,
                        int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* scratch);

// Optional, for tables that first convert a phase's activations (x in
// phase 1, h in phase 2) into a layout of their own (the AMX tables' bf16
// tiles). The engine splits each phase into row blocks (phase 2: every
// block runs every active expert for its rows); with the conversion inside
// gate_up / down, every block of an expert repeats it, at a cost of the
// order of the products of a few dozen rows, so with many threads it would
// dominate. Tables with these entries get each expert's activations
// converted once, in parallel over experts, and read by all its blocks:
//   prepared_bytes(shape, phase, n): bytes `prepare` writes for n tokens
//     (0: this table does not prepare for `shape`; call gate_up / down).
//     For any split of n into parts, the parts' bytes sum to at most
//     prepared_bytes(n) plus prepared_bytes(1) per part.
//   prepare(shape, phase, act, ld, token_index, n, out): token i is row
//     token_index[i] of act (row i when token_index is null), rows ld
//     floats apart; `out` 64-byte aligned. Needs no scratch.
//   gate_up_prepared / down_prepared: exactly gate_up's / down's result
//     (same bits), reading `prepared` (the plain arguments serve the
//     no-scratch fallback).
enum class Phase : uint8_t { kGateUp = 1, kDown = 2 };
using PreparedBytesFn = size_t (*)(const ExpertShape& shape, Phase phase, int32_t n);
using PrepareFn = void (*)(const ExpertShape& shape, Phase phase, const float* act, size_t ld,
                           const int32_t* token_index, int32_t n, void* out);
using GateUpPreparedFn = void (*)(const ExpertShape& shape, const void* gate_up, const float* x, size_t ldx,
                                  const int32_t* token_index, const void* prepared, int32_t n, int32_t f_begin,
                                  int32_t f_end, float* h, size_t ldh, KernelScratch* scratch);
using DownPreparedFn = void (*)(const ExpertShape& shape, const void* down, const float* h, size_t ldh,
                                const void* prepared, const int32_t* token_index, const float* weight, int32_t n,
                                int32_t d_begin, int32_t d_end, float* y, size_t ldy, KernelScratch* scratch);

// Working memory of the prefill kernels: a few grow-only, 64-byte aligned
// buffers, passed explicitly to every kernel call. One call uses one
// scratch at a time, so callers running kernels in parallel give each
// thread its own: the engine owns one per pool thread, sizes them at open
// through KernelTable::reserve, and passes the one of the thread running
// each work item, so calls within the reserved size allocate nothing.
class KernelScratch {
 public:
  static constexpr int kSlots = 4;
  KernelScratch() = default;
  ~KernelScratch();
  KernelScratch(const KernelScratch&) = delete;
  KernelScratch& operator=(const KernelScratch&) = delete;
  // Buffer `slot` with room for at least `bytes`, growing it (the only
  // allocation) when it is smaller; nullptr if that allocation fails or
  // would pass the limit, and the buffer is then empty.
  void* get(int slot, size_t bytes);
  // Caps each buffer at `bytes` (default: no cap). Tests use 0 to make
  // every kernel take its no-scratch path.
  void set_limit(size_t bytes) { limit_ = bytes; }

 private:
  void* data_[kSlots] = {};
  size_t size_[kSlots] = {};
  size_t limit_ = ~size_t{0};
};

// scratch->get(slot, bytes), or nullptr when scratch is null: what the
// kernels ask, so that a null scratch takes their scratch-free paths.
void* scratch_buffer(KernelScratch* scratch, int slot, size_t bytes);

// Sizes `scratch` for calls of the table on experts of `shape` with up to
// `max_tokens` tokens and row ranges of up to `max_rows` rows; false if an
// allocation failed (the kernels then fall back to scratch-free paths).
using ReserveFn = bool (*)(const ExpertShape& shape, int32_t max_tokens, int32_t max_rows, KernelScratch* scratch);

// Instruction-set levels, lowest first. A level is usable when the CPU and
// the OS (XCR0) support it. kAmx is kAvx512 plus the AMX tiles for prefill
// (amx_available(): CPUID, XCR0 and Linux's permission); its decode kernels
// are kAvx512's. Being a level of its own, COLIBRI_ISA=avx512 runs an AMX
// machine without the tiles (benchmarks, tests of the FMA prefill tiers).
enum class Isa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

struct KernelTable {
  Isa isa = Isa::kScalar;
  const char* name = "scalar";
  GateUpFn gate_up = nullptr;
  DownFn down = nullptr;
  ReserveFn reserve = nullptr;  // tables that use KernelScratch; nullptr: none needed
  // All four or none (see PreparedBytesFn).
  PreparedBytesFn prepared_bytes = nullptr;
  PrepareFn prepare = nullptr;
  GateUpPreparedFn gate_up_prepared = nullptr;
  DownPreparedFn down_prepared = nullptr;
  // Computes every Epilogue (activations and biases); false: plain SwiGLU
  // only, and plan_kernels never gives it an expert with another.
  bool any_epilogue = false;
};

// Highest level this CPU and OS support (CPUID + XCR0), computed once.
Isa detect_isa();
// AVX512_BF16 (CPUID.(7,1):EAX[5]) usable: only ever true when detect_isa()
// is at least kAvx512, since the OS must also save the AVX-512 state.
bool cpu_has_avx512_bf16();
// AVX512_VNNI (CPUID.(7,0):ECX[11]) usable (vpdpbusd / vpdpwssd on zmm
// and, with AVX512VL, ymm): likewise only true when detect_isa() is at
// least kAvx512.
bool cpu_has_avx512_vnni();
// The CPU's vendor is AMD (or Hygon): CPUID leaf 0.
bool cpu_is_amd();
// CPUID leaf 1's display family (base family, plus the extended family where
// the base is 15: AMD Zen 3 and Zen 4 are 25, Zen 5 26); 0 when unknown.
uint32_t cpu_family();
// The CPU's brand string and CPUID family / model / stepping, e.g. "AMD EPYC
// 9R14 96-Core Processor (family 25 model 17 stepping 1)": what a kernel
// choice measured on this CPU is keyed by. Computed once.
std::string cpu_signature();
// Whether the integer-dot kernels' far prefetch (8 KiB ahead of the rows
// they read) is non-temporal (prefetchnta) rather than into L2 (prefetcht1);
// quant_dot.h hands out the compilation of the kernels with that hint. It is
// non-temporal on AMD Zen 5 (family 26) and later, L2 elsewhere, each by
// measurement of whole-model decode: on Zen 5, whose L3 is filled by L2
// evictions, weights streamed through L2 evict the rest of a process's
// working set (the next call's inputs, the interpreter between calls), and
// non-temporal lines leave it in place (steps 1.04-1.13x faster); on Zen 4
// (family 25) the same steps ran 1.05-1.19x faster with the L2 hint (its
// q8_0 projections from DRAM 1.15-1.3x). Intel's prefetchnta fills L1 only,
// where 8 KiB ahead of several rows may be evicted before use.
// COLIBRI_PREFETCH=nta or =l2 forces either. Computed once.
bool far_prefetch_nta();
// detect_isa(), lowered by the COLIBRI_ISA environment variable
// ("scalar", "avx2", "avx512", "amx") when set. Never raised above detect_isa().
Isa default_isa();
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);
// Parses "scalar" / "avx2" / "avx512" / "amx"; false if unknown.
bool parse_isa(const char* text, Isa* out);
// Kernels for `isa`; falls back to the highest supported level not above it
// (kAmx decodes with the kAvx512 table). These always compute in fp32
// (weights widened exactly to f32, activations f32).
const KernelTable& kernel_table(Isa isa);

// True when the bf16 dot-product tables ("avx512-bf16", "avx512-bf16-split") may run at `isa`:
// the level is at least avx512 and the CPU has AVX512_BF16.
bool bf16_compute_available(Isa isa);

// How many-token (prefill) calls may trade precision for speed.
enum class PrefillPrecision : uint8_t {
  // Large bf16 experts on AMX tiles with activations rounded to bf16 (whole
  // layers at 128 tokens in 0.37-0.55 of the fp32 kernels' time; held to
  // 5e-3 or PyTorch bf16's error, docs/PRECISION.md); everything else at
  // fp32 grade.
  kDefault = 0,
  // fp32-grade for every weight type (the open option exact_prefill).
  kExact = 1,
  // Any weights through bf16 products (the open option bf16_compute):
  // AMX bf16 tiles where usable; bf16 weights without AMX on the
  // "avx512-bf16" dot-product table.
  kBf16 = 2,
};

// A prefill (many tokens per expert) table and the tokens per expert from
// which it beats the tables below it (measured; docs/KERNELS.md).
struct PrefillTier {
  const KernelTable* table = nullptr;
  int32_t min_tokens = 0;
};
struct PrefillTiers {
  PrefillTier tier[2];  // ascending min_tokens
  int count = 0;        // 0: the decode table is best for every token count

  // The table for an expert with n tokens, `decode` below the first tier.
  const KernelTable& pick(int32_t n, const KernelTable& decode) const {
    for (int i = count - 1; i >= 0; --i) {
      if (n >= tier[i].min_tokens) return *tier[i].table;
    }
    return decode;
  }
};

// Experts smaller than this in d_model or d_ff never take a table that
// rounds activations to bf16: their few products do not average the
// roundings out (one rounded h scales a whole output row), so the error
// could pass the contract, and such experts are too small for the speed to
// matter. From here on the measured worst error over random layers is
// 3.9e-3 for bf16 weights (tests/test_precision.cpp, docs/PRECISION.md).
inline constexpr int32_t kBf16RoundingMinDim = 128;

// The tables that compute experts of `shape` at level `isa` (highest
// supported level <= isa) and `precision`: a decode table and the prefill
// tiers above it, from the registry (registry.cpp), the one place that
// knows which formats, instruction sets, token counts and precisions each
// table serves. Float formats decode at fp32 grade ("avx512-bf16-split"
// for bf16 weights on AVX512_BF16 CPUs) and fill in with the token lanes
// and the weight-panel GEMM or, on AMX, the bf16 / f16-split tiles as
// PrefillPrecision allows; block formats decode on the int8 tables
// (exact: "exact-dequant-<isa>") and on AMX prefill on "amx-bf16-dequant".
// Experts under kBf16RoundingMinDim never take a table that rounds
// activations to bf16.
struct KernelPlan {
  Isa isa = Isa::kScalar;  // the level asked for
  const KernelTable* decode = nullptr;
  PrefillTiers prefill;
  // The table for an expert with n tokens.
  const KernelTable& pick(int32_t n) const { return prefill.pick(n, *decode); }
};
KernelPlan plan_kernels(Isa isa, const ExpertShape& shape, PrefillPrecision precision);
// "decode int8-avx512-vnni, prefill amx-bf16-dequant from 24 <unit>".
std::string describe_plan(const KernelPlan& plan, const char* unit);

// The tables for block-quantised weights (ffn_quant.cpp) at the highest
// level <= isa: "int8-<isa>", activations quantised to int8 blocks and
// integer dot products (docs/PRECISION.md), or with `exact`
// "exact-dequant-<isa>": fp32 activations against the weights widened by
// the format's reference dequantiser, and the fp32 kernels.
const KernelTable& quant_kernels(Isa isa, bool exact);
// The same kernels named for fp8_e4m3 ("fp8-<isa>"): its codes are not
// integers, so they meet fp32 activations (fp32-grade, at every precision).
const KernelTable& fp8_kernels(Isa isa);

// h[f] = apply_glu(e, f0 + f, o[2f], o[2f + 1]) for f in [0, fn): the
// epilogue of kernels that leave each gate / up pair interleaved. The
// AVX-512 and AVX2 ones (ffn_avx512.cpp, ffn_avx2.cpp) take exp from a
// polynomial within about one ulp of std::exp; glu_pairs picks the one of
// the level `isa` (at most the CPU's), the scalar loop at the scalar level.
using GluPairsFn = void (*)(const Epilogue& e, int32_t f0, const float* o, int32_t fn, float* h);
GluPairsFn glu_pairs(Isa isa);
void glu_pairs_scalar(const Epilogue& e, int32_t f0, const float* o, int32_t fn, float* h);
#if defined(COLIBRI_HAVE_X86_KERNELS)
void glu_pairs_avx2(const Epilogue& e, int32_t f0, const float* o, int32_t fn, float* h);
void glu_pairs_avx512(const Epilogue& e, int32_t f0, const float* o, int32_t fn, float* h);
#endif

// Per-ISA tables (defined in ffn_<isa>.cpp).
const KernelTable& scalar_kernels();
#if defined(COLIBRI_HAVE_X86_KERNELS)
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
// bf16 weights with bf16-rounded activations via vdpbf16ps (ffn_avx512_bf16.cpp);
// f32/f16 weights passed to it go to avx512_kernels(). Its kernels may only
// run when cpu_has_avx512_bf16(); plan_kernels() checks that.
const KernelTable& avx512_bf16_kernels();
// The same with the activations split into hi + lo bf16 parts, two
// products each: fp32-grade (docs/PRECISION.md); the bf16 decode table.
const KernelTable& avx512_bf16_split_kernels();
// Block formats on AMX (ffn_quant.cpp): rows dequantised to bf16 in
// L2-sized chunks, then the "amx-bf16" tiles on them, activations rounded
// to bf16 (docs/PRECISION.md). Only where amx_available().
const KernelTable& quant_amx_bf16_kernels();
#endif

}  // namespace colibri::kernels
