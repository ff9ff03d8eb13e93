// Inner loops of colibri_probe. Each ISA level lives in its own translation
// unit compiled with only that level's flags (never -march=native), so the
// binary runs anywhere and probe.cpp picks a level at run time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace colibri_probe {

struct Kernels {
  const char* name;
  int vector_bits;
  int fma_accumulators;
  // Sums n_streams arrays of n floats each, walking them side by side so the
  // core keeps several independent prefetch streams in flight, as a kernel
  // reading gate and up rows of several experts would. n is a multiple of 64.
  // Returns the sum so the loads cannot be optimised away.
  float (*read)(const float* const* streams, int n_streams, size_t n);
  // a[i] = b[i] + s * c[i]; n is a multiple of 64, pointers 64-byte aligned.
  // nontemporal = streaming stores (no read-for-ownership of a).
  void (*triad)(float* a, const float* b, const float* c, float s, size_t n, bool nontemporal);
  // iters rounds of fma_accumulators independent register-only FMAs.
  float (*fma)(uint64_t iters);
};

Kernels generic_kernels();
#if defined(COLIBRI_PROBE_X86)
Kernels avx2_kernels();
Kernels avx512_kernels();
// iters rounds of 16 independent vdpbf16ps zmm (64 FLOP each). Only call when
// CPUID says AVX512_BF16.
float bf16_dot_avx512(uint64_t iters);
constexpr int kBf16Accumulators = 16;
// AMX: asks Linux for the tile state (false if refused); then iters rounds
// of 4 tdpbf16ps on full 16x32 tiles, 16384 FLOP each. Only call when CPUID
// says AMX-TILE and AMX-BF16 and XCR0 has the tile state enabled.
// int8 dot products (bench/probe_int8.cpp), iters rounds of
// kInt8Accumulators independent instructions each: vpdpbusd zmm (128 ops:
// 64 byte pairs) when CPUID says AVX512_VNNI; vpmaddubsw + vpmaddwd +
// vpaddd on ymm (64 ops) when it says AVX2.
constexpr int kInt8Accumulators = 16;
float int8_dot_avx512_vnni(uint64_t iters);
float int8_dot_avx2(uint64_t iters);
bool amx_enable();
float amx_bf16_dot(uint64_t iters);
constexpr double kAmxFlopPerIter = 4.0 * 16 * 16 * 32 * 2;
#endif

}  // namespace colibri_probe
