// Prefill (many tokens per expert) kernel tables. Same semantics as the
// KernelTable functions in kernels.h; they trade a per-call packing step for
// FMA-bound inner loops, so they only pay off above a token count per expert
// that the engine chooses (see docs/KERNELS.md).
#pragma once

#include "kernels/kernels.h"

namespace colibri::kernels {

#if defined(COLIBRI_HAVE_X86_KERNELS)
// fp32 compute for f32/f16/bf16 weights (ffn_avx512_gemm.cpp). Only call
// when the CPU supports AVX-512 (isa_supported(Isa::kAvx512)).
const KernelTable& avx512_gemm_kernels();
// fp32 compute, tokens in the vector lanes, weights broadcast as stored
// (ffn_avx512_tokens.cpp): for 16-64 tokens per expert. Same requirement.
const KernelTable& avx512_tokens_kernels();
#endif

}  // namespace colibri::kernels
