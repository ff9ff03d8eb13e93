// AMX-BF16 prefill kernels (Sapphire Rapids and later): the expert's SwiGLU
// FFN for many tokens as bf16 tile matrix products (tdpbf16ps) with fp32
// accumulation in the tiles. Same semantics as KernelTable::gate_up / down in
// kernels.h, computed through bf16: weights of any type (f32, f16, bf16) are
// rounded to bf16 (round to nearest even) when a tile is formed, and the
// activations (x in gate_up, h in down) are rounded to bf16 (RNE) too. For
// bf16 weights that is the natural path (only the activations round, as in
// the "avx512-bf16" table); for f16/f32 weights it also rounds the weights,
// so the engine should only pick it for them when the user opts in.
// Like every bf16 instruction, tdpbf16ps treats bf16 subnormal inputs as zero
// and flushes subnormal results.
#pragma once

#include "kernels/kernels.h"

namespace colibri::kernels {

// True when the AMX kernels may run in this process: CPUID reports AMX-TILE
// and AMX-BF16, the OS enables the tile state in XCR0 (bits 17, 18), Linux
// granted this process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM),
// and the AVX-512 level with AVX512_BF16 is usable (the kernels' packing and
// epilogues use it). Computed once (thread-safe); the permission request is
// part of that first call, so call this before any amx_bf16_kernels() entry.
// Always false off x86-64 Linux.
bool amx_available();

#if defined(COLIBRI_HAVE_X86_KERNELS)
// Table "amx-bf16" (isa kAvx512), for f32, f16 and bf16 weights. Its kernels
// may only run when amx_available() returned true. Each thread loads its tile
// configuration on its first call and keeps it (never released), so the
// calling threads must not use AMX tiles with another configuration.
const KernelTable& amx_bf16_kernels();
#endif

}  // namespace colibri::kernels
