// ISA selection and kernel tables. Compiled without ISA flags: the per-ISA
// tables are only touched after detect_isa() says the level is usable, so no
// code from an AVX translation unit ever runs on a CPU that lacks it.
#include <cstdlib>

#include "kernels/kernels.h"

#include "kernels/amx.h"
#include "kernels/gemm.h"

namespace colibri::kernels {
namespace {

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

char ascii_lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

bool equals_ignore_case(const char* a, const char* b) {
  for (; *a != '\0' && *b != '\0'; ++a, ++b) {
    if (ascii_lower(*a) != ascii_lower(*b)) return false;
  }
  return *a == *b;
}

Isa compute_default_isa() {
  const Isa detected = detect_isa();
  Isa requested = detected;
  // An unknown value is ignored rather than fatal: this runs lazily from hot
  // setup paths that have no way to report it, and the detected level is
  // always a safe answer.
  if (!parse_isa(std::getenv("COLIBRI_ISA"), &requested)) return detected;
  return requested < detected ? requested : detected;
}

thread_local KernelScratch* t_bound_scratch = nullptr;

}  // namespace

KernelScratch::~KernelScratch() {
  for (void* p : data_) std::free(p);
}

void* KernelScratch::get(int slot, size_t bytes) {
  if (bytes > size_[slot]) {
    std::free(data_[slot]);
    // aligned_alloc wants a size that is a multiple of the alignment.
    data_[slot] = bytes <= limit_ ? std::aligned_alloc(64, (bytes + 63) / 64 * 64) : nullptr;
    size_[slot] = data_[slot] != nullptr ? bytes : 0;
  }
  return data_[slot];
}

KernelScratch& bound_scratch() {
  if (t_bound_scratch != nullptr) return *t_bound_scratch;
  thread_local KernelScratch own;
  return own;
}

ScratchScope::ScratchScope(KernelScratch* scratch) : previous_(t_bound_scratch) { t_bound_scratch = scratch; }

ScratchScope::~ScratchScope() { t_bound_scratch = previous_; }

Isa default_isa() {
  // Cached so every engine in the process agrees even if the environment is
  // modified later (getenv is also not safe against concurrent setenv).
  static const Isa isa = compute_default_isa();
  return isa;
}

bool isa_supported(Isa isa) { return isa <= detect_isa(); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAmx:
      return "amx";
  }
  return "unknown";
}

bool parse_isa(const char* text, Isa* out) {
  if (text == nullptr || out == nullptr) return false;
  static constexpr Isa kAll[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx};
  for (Isa isa : kAll) {
    if (equals_ignore_case(text, isa_name(isa))) {
      *out = isa;
      return true;
    }
  }
  return false;
}

const KernelTable& kernel_table(Isa isa) {
  // Levels are cumulative (detection only reports AVX-512 when AVX2 is also
  // usable), so the highest supported level <= isa is min(isa, detected).
  const Isa detected = detect_isa();
  const Isa level = isa < detected ? isa : detected;
#if defined(COLIBRI_HAVE_X86_KERNELS)
  switch (level) {
    case Isa::kAmx:  // the tiles only serve prefill (prefill_tiers_for)
    case Isa::kAvx512:
      return avx512_kernels();
    case Isa::kAvx2:
      return avx2_kernels();
    case Isa::kScalar:
      break;
  }
#else
  (void)level;
#endif
  return scalar_kernels();
}

bool bf16_compute_available(Isa isa) {
#if defined(COLIBRI_HAVE_X86_KERNELS)
  // cpu_has_avx512_bf16() implies detect_isa() >= kAvx512, so the level
  // check is what lets COLIBRI_ISA=avx2/scalar select the lower kernels.
  return isa >= Isa::kAvx512 && cpu_has_avx512_bf16();
#else
  (void)isa;
  return false;
#endif
}

const KernelTable& decode_table_for(Isa isa, WeightType wt) {
#if defined(COLIBRI_HAVE_X86_KERNELS)
  if (wt == WeightType::kBF16 && bf16_compute_available(isa)) return avx512_bf16_split_kernels();
#else
  (void)wt;
#endif
  return kernel_table(isa);
}

PrefillTiers prefill_tiers_for(Isa isa, const ExpertShape& shape, PrefillPrecision precision) {
  PrefillTiers tiers;
#if defined(COLIBRI_HAVE_X86_KERNELS)
  if (isa < Isa::kAvx512 || !isa_supported(Isa::kAvx512)) return tiers;
  const WeightType wt = shape.weight_type;
  const bool amx = isa >= Isa::kAmx && isa_supported(Isa::kAmx);
  const bool may_round = shape.d_model >= kBf16RoundingMinDim && shape.d_ff >= kBf16RoundingMinDim &&
                         (precision == PrefillPrecision::kBf16 ||
                          (precision == PrefillPrecision::kDefault && wt == WeightType::kBF16));
  if (may_round && amx) {
    tiers.tier[tiers.count++] = {&amx_bf16_kernels(), kAmxMinTokens};
    return tiers;
  }
  // bf16 weights without AMX take the fp32 kernels by default: on Emerald
  // Rapids the vdpbf16ps table runs at 0.56-0.83x the token-lane kernel at
  // 8-256 tokens per expert (docs/KERNELS.md), so rounding buys nothing.
  // It stays for users who ask for bf16 compute, for CPUs where that
  // instruction runs at full rate.
  if (may_round && precision == PrefillPrecision::kBf16 && wt == WeightType::kBF16 && bf16_compute_available(isa)) {
    tiers.tier[tiers.count++] = {&avx512_bf16_kernels(), kTokensMinTokens};
    return tiers;
  }
  tiers.tier[tiers.count++] = {&avx512_tokens_kernels(), kTokensMinTokens};
  if (wt == WeightType::kF16 && amx) {
    tiers.tier[tiers.count++] = {&amx_f16_split_kernels(), kSplitMinTokens};
    return tiers;
  }
  tiers.tier[tiers.count++] = {&avx512_gemm_kernels(), kGemmMinTokens};
#else
  (void)isa;
  (void)shape;
  (void)precision;
#endif
  return tiers;
}

}  // namespace colibri::kernels
