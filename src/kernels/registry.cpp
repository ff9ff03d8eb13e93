// The kernel registry: which table computes experts of a given weight
// format, at a given instruction-set level and precision, for how many
// tokens per expert. The one place where formats, instruction sets, tiers
// and precisions meet; the engine only runs the plan it gets.
//
// Compiled without ISA flags: a row's table is only fetched once the row's
// level and CPU features are known to be usable, so no code of an AVX
// translation unit runs on a CPU that lacks it.
#include "kernels/amx.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#include "kernels/quant_dot.h"

namespace colibri::kernels {
namespace {

constexpr uint32_t type_bit(WeightType t) { return 1u << static_cast<unsigned>(t); }
constexpr uint32_t kFloatTypes = type_bit(WeightType::kF32) | type_bit(WeightType::kF16) | type_bit(WeightType::kBF16);
constexpr uint32_t kBlockTypes = type_bit(WeightType::kQ8_0) | type_bit(WeightType::kQ4_0) |
                                 type_bit(WeightType::kQ4_K) | type_bit(WeightType::kQ5_K) |
                                 type_bit(WeightType::kQ6_K) | type_bit(WeightType::kMXFP4) |
                                 type_bit(WeightType::kQ4_1) | type_bit(WeightType::kQ5_0) |
                                 type_bit(WeightType::kQ5_1) | type_bit(WeightType::kIQ4_NL) |
                                 type_bit(WeightType::kIQ4_XS) | type_bit(WeightType::kQ2_K) |
                                 type_bit(WeightType::kQ3_K) | type_bit(WeightType::kIQ2_XXS) |
                                 type_bit(WeightType::kIQ3_XXS) | type_bit(WeightType::kIQ1_S) |
                                 type_bit(WeightType::kIQ1_M) | type_bit(WeightType::kIQ2_XS) |
                                 type_bit(WeightType::kIQ2_S) | type_bit(WeightType::kIQ3_S) |
                                 type_bit(WeightType::kFP8_E4M3) |
                                 type_bit(WeightType::kTQ1_0) | type_bit(WeightType::kTQ2_0);

constexpr uint8_t precision_bit(PrefillPrecision p) { return static_cast<uint8_t>(1u << static_cast<unsigned>(p)); }
constexpr uint8_t kDefaultPrecision = precision_bit(PrefillPrecision::kDefault);
constexpr uint8_t kExactPrecision = precision_bit(PrefillPrecision::kExact);
constexpr uint8_t kBf16Precision = precision_bit(PrefillPrecision::kBf16);
constexpr uint8_t kRoundingPrecisions = kDefaultPrecision | kBf16Precision;
constexpr uint8_t kAnyPrecision = kDefaultPrecision | kExactPrecision | kBf16Precision;

// What a row needs of the CPU beyond its instruction-set level.
enum class Needs : uint8_t {
  kNothing,
  kAvx512Bf16,   // vdpbf16ps (cpu_has_avx512_bf16)
  kBf16Dequant,  // a bf16 dequantiser for the gate/up and the down format
};

// Tokens per expert from which each prefill table beats the ones below it,
// measured on the development machine with bench/kernel_bench.cpp and, for
// kTokensMinTokens, in whole layers (docs/KERNELS.md). Up to 4 tokens the
// decode kernels read and widen each weight once, with no per-call
// preparation; from 5 they run a second block of tokens over each chunk of
// rows (from L2, widened again). In whole layers (weights from DRAM, two
// threads) the token-lane kernel, which widens each weight once, is ahead
// from 5, though with one expert in the LLC it draws level only at 7. From
// kGemmMinTokens the panel GEMM, which packs each weight panel once for all
// of an expert's tokens, overtakes the token-lane kernel, which widens them
// once per group of 48 tokens.
constexpr int32_t kTokensMinTokens = 5;
constexpr int32_t kGemmMinTokens = 128;
constexpr int32_t kAmxMinTokens = 4;
// f16 weights on AMX at fp32-grade precision: the split table converts each
// weight panel into two bf16 panels before the tiles use it (no overlap with
// the tile work), a cost that only enough tokens per panel repay: against
// the token lanes 0.77-1.08x at 32 tokens, 0.95-1.38x at 48, 1.2-1.8x from
// 64 (colibri_kernel_bench, repetitions interleaved; docs/KERNELS.md), and
// slower in the Mixtral T=128 layer (about 32 tokens per expert).
constexpr int32_t kSplitMinTokens = 64;
// Block formats: the AMX tier (rows dequantised to bf16, then the tiles)
// against the int8 kernels, whose many-token kernel it has to beat. Whole
// layers on a Sapphire Rapids Xeon (docs/KERNELS.md): even at about 24
// tokens per expert for most formats, 1.03-1.2x slower at 16, 1.1-1.3x
// faster at 32; q3_k and mxfp4 even at 16; q2_k (the int8 side's weakest
// many-token pass) 1.4x faster already at 16 and even at 8. The tq formats
// (no many-token kernel) and fp8_e4m3 (fp32 FMAs) keep the earlier 10.
constexpr int32_t kQuantAmxMinTokens = 24;
constexpr int32_t kQuantAmxMinTokensMid = 16;
constexpr int32_t kQuantAmxMinTokensEarly = 10;
constexpr uint32_t kAmxEarlyTypes = type_bit(WeightType::kQ2_K) | type_bit(WeightType::kTQ1_0) |
                                    type_bit(WeightType::kTQ2_0) | type_bit(WeightType::kFP8_E4M3);
constexpr uint32_t kAmxMidTypes = kAmxEarlyTypes | type_bit(WeightType::kQ3_K) | type_bit(WeightType::kMXFP4);

using TableFn = const KernelTable& (*)(Isa isa);

// Conditions shared by decode and prefill rows.
struct Match {
  uint32_t formats;    // type_bit of the gate/up format (and of down's, for block formats)
  Isa min_isa;         // the level asked for and the CPU must both reach it
  Needs needs;
  uint8_t precisions;  // precision_bit of the PrefillPrecision values served
  // Only experts of at least kBf16RoundingMinDim in both dimensions: the
  // row rounds activations to bf16.
  bool rounds_activations;
  // The row's tables compute every Epilogue (KernelTable::any_epilogue);
  // others only serve plain SwiGLU experts.
  bool any_epilogue;
};

struct DecodeRow {
  Match match;
  TableFn table;
};

struct PrefillRow {
  Match match;
  int count;  // tiers, ascending min_tokens; 0: the decode table throughout
  struct {
    TableFn table;
    int32_t min_tokens;
  } tier[2];
};

const KernelTable& int8_table(Isa isa) { return quant_kernels(isa, false); }
const KernelTable& exact_dequant_table(Isa isa) { return quant_kernels(isa, true); }
const KernelTable& fp8_table(Isa isa) { return fp8_kernels(isa); }

// Decode (and the fallback below the first prefill tier): first match wins.
// Every row is fp32-grade except int8, the block formats' default.
constexpr DecodeRow kDecodeRows[] = {
    // fp8_e4m3's own kernels multiply its exact codes with fp32 activations:
    // fp32-grade already, so exact keeps them.
    {{type_bit(WeightType::kFP8_E4M3), Isa::kScalar, Needs::kNothing, kAnyPrecision, false, true}, fp8_table},
    {{kBlockTypes, Isa::kScalar, Needs::kNothing, kExactPrecision, false, true}, exact_dequant_table},
    {{kBlockTypes, Isa::kScalar, Needs::kNothing, kAnyPrecision, false, true}, int8_table},
#if defined(COLIBRI_HAVE_X86_KERNELS)
    // vdpbf16ps on the activations split into two bf16 parts: for one token
    // it reads as fast as widening the weights or faster (docs/PRECISION.md).
    {{type_bit(WeightType::kBF16), Isa::kAvx512, Needs::kAvx512Bf16, kAnyPrecision, false, false},
     [](Isa) -> const KernelTable& { return avx512_bf16_split_kernels(); }},
#endif
    {{kFloatTypes, Isa::kScalar, Needs::kNothing, kAnyPrecision, false, true}, kernel_table},
};

#if defined(COLIBRI_HAVE_X86_KERNELS)
const KernelTable& amx_bf16_table(Isa) { return amx_bf16_kernels(); }
const KernelTable& quant_amx_bf16_table(Isa) { return quant_amx_bf16_kernels(); }
const KernelTable& avx512_bf16_table(Isa) { return avx512_bf16_kernels(); }
const KernelTable& tokens_table(Isa) { return avx512_tokens_kernels(); }
const KernelTable& gemm_table(Isa) { return avx512_gemm_kernels(); }
const KernelTable& amx_f16_split_table(Isa) { return amx_f16_split_kernels(); }

// Prefill: first match wins; no match, no tier.
constexpr PrefillRow kPrefillRows[] = {
    // Block formats on AMX: rows dequantised to bf16 in L2-sized chunks, then
    // the tiles, from the count where they overtake the int8 kernels (an
    // expert mixing formats takes the later count of its two).
    {{kAmxEarlyTypes, Isa::kAmx, Needs::kBf16Dequant, kRoundingPrecisions, true, false}, 1,
     {{quant_amx_bf16_table, kQuantAmxMinTokensEarly}, {}}},
    {{kAmxMidTypes, Isa::kAmx, Needs::kBf16Dequant, kRoundingPrecisions, true, false}, 1,
     {{quant_amx_bf16_table, kQuantAmxMinTokensMid}, {}}},
    {{kBlockTypes, Isa::kAmx, Needs::kBf16Dequant, kRoundingPrecisions, true, false}, 1,
     {{quant_amx_bf16_table, kQuantAmxMinTokens}, {}}},
    // fp8_e4m3 elsewhere: its codes widened exactly to fp32 in the token-lane
    // kernel's chunks (one block a chunk), as exact as the fp32 tier.
    {{type_bit(WeightType::kFP8_E4M3), Isa::kAvx512, Needs::kNothing, kAnyPrecision, false, false}, 1,
     {{tokens_table, kTokensMinTokens}, {}}},
    // Block formats elsewhere, and exact: their decode table throughout.
    {{kBlockTypes, Isa::kScalar, Needs::kNothing, kAnyPrecision, false, true}, 0, {}},
    // bf16 weights round nothing but the activations on the tiles, by default.
    {{type_bit(WeightType::kBF16), Isa::kAmx, Needs::kNothing, kRoundingPrecisions, true, false}, 1,
     {{amx_bf16_table, kAmxMinTokens}, {}}},
    {{kFloatTypes, Isa::kAmx, Needs::kNothing, kBf16Precision, true, false}, 1, {{amx_bf16_table, kAmxMinTokens}, {}}},
    // Without AMX, bf16 products only when asked for: on Emerald Rapids the
    // vdpbf16ps table runs at 0.56-0.83x the token-lane kernel at 8-256
    // tokens per expert (docs/KERNELS.md); it stays for CPUs where that
    // instruction runs at full rate.
    {{type_bit(WeightType::kBF16), Isa::kAvx512, Needs::kAvx512Bf16, kBf16Precision, true, false}, 1,
     {{avx512_bf16_table, kTokensMinTokens}, {}}},
    {{type_bit(WeightType::kF16), Isa::kAmx, Needs::kNothing, kAnyPrecision, false, false}, 2,
     {{tokens_table, kTokensMinTokens}, {amx_f16_split_table, kSplitMinTokens}}},
    {{kFloatTypes, Isa::kAvx512, Needs::kNothing, kAnyPrecision, false, false}, 2,
     {{tokens_table, kTokensMinTokens}, {gemm_table, kGemmMinTokens}}},
};
#endif

bool matches(const Match& m, Isa isa, const ExpertShape& shape, PrefillPrecision precision) {
  const bool block = (type_bit(shape.weight_type) & kBlockTypes) != 0;
  if ((m.formats & type_bit(shape.weight_type)) == 0) return false;
  if (block && (m.formats & type_bit(shape.down_type)) == 0) return false;
  if ((m.precisions & precision_bit(precision)) == 0) return false;
  if (!m.any_epilogue && !shape.epilogue.plain()) return false;
  if (isa < m.min_isa || !isa_supported(m.min_isa)) return false;
  if (m.rounds_activations && (shape.d_model < kBf16RoundingMinDim || shape.d_ff < kBf16RoundingMinDim)) {
    return false;
  }
  switch (m.needs) {
    case Needs::kNothing:
      return true;
    case Needs::kAvx512Bf16:
      return bf16_compute_available(isa);
    case Needs::kBf16Dequant:
#if defined(COLIBRI_HAVE_X86_KERNELS)
      return dequant_bf16_avx512(shape.weight_type) != nullptr && dequant_bf16_avx512(shape.down_type) != nullptr;
#else
      return false;
#endif
  }
  return false;
}

}  // namespace

KernelPlan plan_kernels(Isa isa, const ExpertShape& shape, PrefillPrecision precision) {
  KernelPlan plan;
  plan.isa = isa;
  for (const DecodeRow& row : kDecodeRows) {
    if (matches(row.match, isa, shape, precision)) {
      plan.decode = &row.table(isa);
      break;
    }
  }
  if (plan.decode == nullptr) plan.decode = &kernel_table(isa);
#if defined(COLIBRI_HAVE_X86_KERNELS)
  for (const PrefillRow& row : kPrefillRows) {
    if (!matches(row.match, isa, shape, precision)) continue;
    for (int i = 0; i < row.count; ++i) {
      plan.prefill.tier[plan.prefill.count++] = {&row.tier[i].table(isa), row.tier[i].min_tokens};
    }
    break;
  }
#endif
  return plan;
}

std::string describe_plan(const KernelPlan& plan, const char* unit) {
  std::string d = std::string("decode ") + plan.decode->name;
  for (int i = 0; i < plan.prefill.count; ++i) {
    d += std::string(i == 0 ? ", prefill " : ", ") + plan.prefill.tier[i].table->name + " from " +
         std::to_string(plan.prefill.tier[i].min_tokens) + " " + unit;
  }
  return d;
}

}  // namespace colibri::kernels
