// AVX-512 fp32 decode kernels (built with -mavx512f/bw/vl/dq/bf16 -mavx2
// -mfma -mf16c): the kernels of ffn_decode_impl.h on 16-lane vectors.
// Semantics are exactly those of kernels.h; ffn_scalar.cpp is the reference.
//
// This translation unit must not emit any function with vague (COMDAT)
// linkage that another, flag-less translation unit might also emit: the
// linker keeps one arbitrary copy, and if it kept this one a CPU without
// AVX-512 would run it. The traits live in an anonymous namespace, which
// gives every instantiation of the shared kernels internal linkage.
#include "kernels/avx512_common.h"
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

// The first c (1 .. 16) of 16 gate / up pairs as apply_glu computes them
// (lanes past c: zero inputs). The clamps keep a NaN as std::min /
// std::max do: vminps / vmaxps return their second operand when either is
// NaN.
inline __m512 glu16(const Epilogue& e, const float* o, const float* bias, int c) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const auto lo = static_cast<__mmask16>(c >= 8 ? 0xffffu : (1u << (2 * c)) - 1u);
  const auto hi = static_cast<__mmask16>(c == 16 ? 0xffffu : c > 8 ? (1u << (2 * c - 16)) - 1u : 0u);
  __m512 a = _mm512_maskz_loadu_ps(lo, o);
  __m512 b = _mm512_maskz_loadu_ps(hi, o + 16);
  if (bias != nullptr) {
    a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(lo, bias));
    b = _mm512_add_ps(b, _mm512_maskz_loadu_ps(hi, bias + 16));
  }
  __m512 g = _mm512_permutex2var_ps(a, even, b);
  __m512 u = _mm512_permutex2var_ps(a, odd, b);
  const __m512 one = _mm512_set1_ps(1.0f);
  if (e.activation == Activation::kSwiGLU) {
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16_clamped(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return _mm512_mul_ps(s, u);
  }
  const __m512 limit = _mm512_set1_ps(e.limit);
  g = _mm512_min_ps(limit, g);
  u = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), limit), _mm512_min_ps(limit, u));
  const __m512 ea = exp16_clamped(_mm512_mul_ps(_mm512_set1_ps(-e.alpha), g));
  return _mm512_mul_ps(_mm512_add_ps(u, one), _mm512_div_ps(g, _mm512_add_ps(one, ea)));
}

}  // namespace

void glu_pairs_avx512(const Epilogue& e, int32_t f0, const float* o, int32_t fn, float* h) {
  const float* bias = e.gate_up_bias != nullptr ? e.gate_up_bias + 2 * static_cast<size_t>(f0) : nullptr;
  int32_t f = 0;
  for (; f + 16 <= fn; f += 16) {
    _mm512_storeu_ps(h + f, glu16(e, o + 2 * f, bias != nullptr ? bias + 2 * f : nullptr, 16));
  }
  if (f < fn) {
    const auto m = static_cast<__mmask16>((1u << (fn - f)) - 1u);
    _mm512_mask_storeu_ps(h + f, m, glu16(e, o + 2 * f, bias != nullptr ? bias + 2 * f : nullptr, fn - f));
  }
}

const KernelTable& avx512_kernels() {
  static const KernelTable table = [] {
    KernelTable t{Isa::kAvx512, "avx512", ffn_decode::gate_up<Avx512>, ffn_decode::down<Avx512>};
    t.any_epilogue = true;
    return t;
  }();
  return table;
}

}  // namespace colibri::kernels
