// AVX2 fp32 decode kernels (built with -mavx2 -mfma -mf16c): the kernels of
// ffn_decode_impl.h on 8-lane vectors with half AVX-512's registers.
// Semantics are exactly those of kernels.h; ffn_scalar.cpp is the reference.
//
// This translation unit must not emit any function with vague (COMDAT)
// linkage that another, flag-less translation unit might also emit: the
// linker keeps one arbitrary copy, and if it kept this one a CPU without
// AVX2 would run it. The traits live in an anonymous namespace, which gives
// every instantiation of the shared kernels internal linkage.
#include "kernels/avx2_common.h"
#include "kernels/ffn_decode_impl.h"
#include "kernels/x86_intrinsics.h"

namespace colibri::kernels {
namespace {

struct Avx2 {
  static constexpr int kLanes = 8;
  using Vec = __m256;
  using Mask = __m256i;

  // With 16 registers, 8 accumulators plus NT activation vectors and a
  // weight vector is the most that fits without spilling; for one token the
  // extra rows give the independent FMA chains that hide FMA latency.
  static constexpr int gate_up_rows(int nt) { return nt == 1 ? 4 : nt == 2 ? 2 : 1; }  // x2 rows (gate, up)
  static constexpr int down_rows(int nt) { return nt <= 2 ? 4 : 2; }

  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec loadu(const float* p) { return _mm256_loadu_ps(p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Mask tail_mask(int32_t remaining) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(remaining), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // vmaskmovps does not fault on masked-out lanes, even across a page end.
  static Vec load_masked(Mask m, const float* p) { return _mm256_maskload_ps(p, m); }

  template <WeightType T>
  static Vec load_weights(const typename ffn_decode::ElemOf<T>::Type* p) {
    if constexpr (T == WeightType::kF32) {
      return _mm256_loadu_ps(p);
    } else if constexpr (T == WeightType::kF16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      // bf16 is the top half of an f32, so widening is exact: zero-extend, shift.
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
  }

  static float hsum(Vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Four horizontal sums at once: three hadds share the shuffle work that
  // four separate reductions would repeat.
  static __m128 hsum4(Vec a, Vec b, Vec c, Vec d) {
    const __m256 ab = _mm256_hadd_ps(a, b);
    const __m256 cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
  template <int N>
  static void reduce_store(const Vec* acc, float* out) {
    int j = 0;
    COLIBRI_UNROLL
    for (; j + 4 <= N; j += 4) _mm_storeu_ps(out + j, hsum4(acc[j], acc[j + 1], acc[j + 2], acc[j + 3]));
    COLIBRI_UNROLL
    for (; j < N; ++j) out[j] = hsum(acc[j]);
  }
};

// The first c (1 .. 8) of 8 gate / up pairs as apply_glu computes them
// (lanes past c: zero inputs), as glu16 of ffn_avx512.cpp.
inline __m256 glu8(const Epilogue& e, const float* o, const float* bias, int c) {
  const __m256i lo = Avx2::tail_mask(c >= 4 ? 8 : 2 * c);
  const __m256i hi = Avx2::tail_mask(c > 4 ? 2 * c - 8 : 0);
  __m256 a = _mm256_maskload_ps(o, lo);
  __m256 b = _mm256_maskload_ps(o + 8, hi);
  if (bias != nullptr) {
    a = _mm256_add_ps(a, _mm256_maskload_ps(bias, lo));
    b = _mm256_add_ps(b, _mm256_maskload_ps(bias + 8, hi));
  }
  // Per 128-bit lane [a0 a2 b0 b2 | a4 a6 b4 b6], then the middle qwords swapped.
  __m256 g = _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))), 0xd8));
  __m256 u = _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))), 0xd8));
  const __m256 one = _mm256_set1_ps(1.0f);
  if (e.activation == Activation::kSwiGLU) {
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return _mm256_mul_ps(s, u);
  }
  // vminps / vmaxps return the second operand when either is NaN, as
  // std::min / std::max keep a NaN first argument.
  const __m256 limit = _mm256_set1_ps(e.limit);
  g = _mm256_min_ps(limit, g);
  u = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), limit), _mm256_min_ps(limit, u));
  const __m256 ea = exp_ps(_mm256_mul_ps(_mm256_set1_ps(-e.alpha), g));
  return _mm256_mul_ps(_mm256_add_ps(u, one), _mm256_div_ps(g, _mm256_add_ps(one, ea)));
}

}  // namespace

void glu_pairs_avx2(const Epilogue& e, int32_t f0, const float* o, int32_t fn, float* h) {
  const float* bias = e.gate_up_bias != nullptr ? e.gate_up_bias + 2 * static_cast<size_t>(f0) : nullptr;
  int32_t f = 0;
  for (; f + 8 <= fn; f += 8) {
    _mm256_storeu_ps(h + f, glu8(e, o + 2 * f, bias != nullptr ? bias + 2 * f : nullptr, 8));
  }
  if (f < fn) {
    _mm256_maskstore_ps(h + f, Avx2::tail_mask(fn - f), glu8(e, o + 2 * f, bias != nullptr ? bias + 2 * f : nullptr, fn - f));
  }
}

const KernelTable& avx2_kernels() {
  static const KernelTable table = [] {
    KernelTable t{Isa::kAvx2, "avx2", ffn_decode::gate_up<Avx2>, ffn_decode::down<Avx2>};
    t.any_epilogue = true;
    return t;
  }();
  return table;
}

}  // namespace colibri::kernels
