// AVX-512 fp32 decode kernels (built with -mavx512f/bw/vl/dq/bf16 -mavx2
// -mfma -mf16c): the kernels of ffn_decode_impl.h on 16-lane vectors.
// Semantics are exactly those of kernels.h; ffn_scalar.cpp is the reference.
//
// This translation unit must not emit any function with vague (COMDAT)
// linkage that another, flag-less translation unit might also emit: the
// linker keeps one arbitrary copy, and if it kept this one a CPU without
// AVX-512 would run it. The traits live in an anonymous namespace, which
// gives every instantiation of the shared kernels internal linkage.
#include "kernels/ffn_decode_impl.h"
#include "kernels/x86_intrinsics.h"

namespace colibri::kernels {
namespace {

struct Avx512 {
  static constexpr int kLanes = 16;
  using Vec = __m512;
  using Mask = __mmask16;

  // AVX-512 has 32 registers, so up to 16 accumulators fit next to the NT
  // activation vectors; more rows per token block means fewer activation
  // loads per FMA.
  static constexpr int gate_up_rows(int nt) { return nt <= 2 ? 4 : 2; }  // x2 rows (gate, up)
  static constexpr int down_rows(int) { return 4; }

  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec loadu(const float* p) { return _mm512_loadu_ps(p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Mask tail_mask(int32_t remaining) {
    return remaining >= kLanes ? static_cast<Mask>(0xffff) : static_cast<Mask>((1u << remaining) - 1u);
  }
  static Vec load_masked(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }

  template <WeightType T>
  static Vec load_weights(const typename ffn_decode::ElemOf<T>::Type* p) {
    if constexpr (T == WeightType::kF32) {
      return _mm512_loadu_ps(p);
    } else if constexpr (T == WeightType::kF16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
      // bf16 is the top half of an f32, so widening is exact: zero-extend, shift.
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
  }

  static __m256 fold(Vec v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
  // Four horizontal sums at once: three hadds share the shuffle work that
  // four separate reductions would repeat.
  static __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_hadd_ps(a, b);
    const __m256 cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
  template <int N>
  static void reduce_store(const Vec* acc, float* out) {
    int j = 0;
    COLIBRI_UNROLL
    for (; j + 4 <= N; j += 4) {
      _mm_storeu_ps(out + j, hsum4(fold(acc[j]), fold(acc[j + 1]), fold(acc[j + 2]), fold(acc[j + 3])));
    }
    COLIBRI_UNROLL
    for (; j < N; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
  }
};

}  // namespace

const KernelTable& avx512_kernels() {
  static const KernelTable table = [] {
    KernelTable t{Isa::kAvx512, "avx512", ffn_decode::gate_up<Avx512>, ffn_decode::down<Avx512>};
    t.any_epilogue = true;
    return t;
  }();
  return table;
}

}  // namespace colibri::kernels
