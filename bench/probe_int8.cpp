// int8 dot-product peaks of colibri_probe: what the block formats' integer
// kernels (src/kernels/qdot_*.cpp) multiply with. Compiled with -mavx2
// -mavx512f -mavx512vnni; each entry is only called after CPUID reported
// its instructions.
#include <immintrin.h>

#include <cstdint>

#include "probe_kernels.h"

namespace colibri_probe {

namespace {

// Not _mm512_reduce_add_epi32: keep to plain stores, as the bf16 probe does.
inline float hsum(__m512i v) {
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, v);
  float s = 0;
  for (int32_t x : lanes) s += static_cast<float>(x);
  return s;
}

inline float hsum(__m256i v) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  float s = 0;
  for (int32_t x : lanes) s += static_cast<float>(x);
  return s;
}

}  // namespace

float int8_dot_avx512_vnni(uint64_t iters) {
  // Each vpdpbusd multiplies 64 unsigned x signed byte pairs into 16 int32
  // lanes: 128 ops counted as 2 per pair, as a GEMM's are.
  const __m512i x = _mm512_set1_epi8(3);
  __m512i y = _mm512_set1_epi8(-2);
  __m512i a[kInt8Accumulators];
  for (int i = 0; i < kInt8Accumulators; ++i) a[i] = _mm512_set1_epi32(i);
  for (uint64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kInt8Accumulators; ++i) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
    __asm__ volatile("" : "+v"(y));  // a new operand each round: no hoisting
  }
  __m512i s = a[0];
  for (int i = 1; i < kInt8Accumulators; ++i) s = _mm512_add_epi32(s, a[i]);
  return hsum(s);
}

float int8_dot_avx2(uint64_t iters) {
  // vpmaddubsw + vpmaddwd + vpaddd: 32 byte pairs into 8 int32 lanes, 64 ops.
  const __m256i x = _mm256_set1_epi8(3);
  __m256i y = _mm256_set1_epi8(-2);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a[kInt8Accumulators];
  for (int i = 0; i < kInt8Accumulators; ++i) a[i] = _mm256_set1_epi32(i);
  for (uint64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kInt8Accumulators; ++i) {
      a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), ones));
    }
    __asm__ volatile("" : "+v"(y));
  }
  __m256i s = a[0];
  for (int i = 1; i < kInt8Accumulators; ++i) s = _mm256_add_epi32(s, a[i]);
  return hsum(s);
}

}  // namespace colibri_probe
