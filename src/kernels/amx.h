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
// amx_available() and CPUID reports AMX-INT8 (tdpbsud, the -amx-int8
// integer tables of quant_dot.h). Computed once.
bool amx_int8_available();

#if defined(COLIBRI_HAVE_X86_KERNELS)
// Table "amx-bf16" (isa kAmx), for f32, f16 and bf16 weights. Its kernels
// may only run when amx_available() returned true. Each call loads its tile
// configuration and releases the tiles before it returns, so other AMX code
// on the same thread (oneDNN's, under PyTorch) neither disturbs it nor is
// disturbed.
const KernelTable& amx_bf16_kernels();

// Table "amx-f16-split" (isa kAmx): f16 weights at fp32-grade precision on
// the bf16 tiles. Each weight is split into two bf16 parts (hi = bf16(w), lo
// = w - hi, both exact) and each activation into three (x1 = bf16(x), x2 =
// bf16(x - x1), x3 = x - x1 - x2, exact), and five of the six products
// (all but lo*x3, below 2^-25 of the product) are summed in the fp32
// accumulator tiles: each product of two bf16 values is exact in fp32, so
// the error is the fp32 summation's, as in the fp32 kernels, over 5x the
// terms. Five tile products per multiply-add still run at about 2.6x the fp32
// FMA peak. Weights of other types are passed to the fp32 kernels
// (avx512_kernels). Same rules as amx_bf16_kernels for when it may run.
const KernelTable& amx_f16_split_kernels();
#endif

}  // namespace colibri::kernels
