// The grid i-quants (iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s, iq1_m)
// on zmm for AVX512_VNNI CPUs (AVX-512 F/BW only besides). The AVX2-level kernel (qdot_avx2_impl.h)
// built each sub-block's magnitude vector from four scalar grid loads and
// vector inserts, its signs from four more, and converted and scaled one
// product vector per sub-block and token: bound by those instructions,
// not by the weights' bytes (about 3 GB/s of iq2_xxs a thread on Zen 5).
//
// Here a whole super-block is unpacked at once into four zmm of codes, in a
// transposed order: code vector j holds, in qword m, the 8 values 8j .. 8j + 7
// of sub-block m. Each vector holds 8 grid points (16 for the 4-value
// grids), their indices shifted out of the block's words by vector ops
// (IQ2_XXS's whole grid is looked up in registers), and the four products
// of a token add in int32 lane by lane, so that dword lanes 2m and 2m + 1
// hold sub-block m's dot product (or, for
// the formats scaled per 16 values, two accumulators, one per half). One
// conversion and one multiply-add per token and super-block then apply the
// sub-blocks' scales; one horizontal sum per row and token at the end.
//
// The activations are rearranged once per call to that order (their
// per-32 scales paired to the lanes as well), so the per-token work is four
// loads, four masked negations (the signs as a 64-bit mask per vector,
// computed from the sign indices' parity by vector ops instead of table
// loads) and four vpdpbusd.
//
// IQ1: 8 g + s (g from {-1, 0, 1}, s = +-1 per group) is put as the
// unsigned code 8 (g + 1) + s + 1 (0 .. 18) against the activations, and
// the 9 times their sums per 16 subtracted as the accumulator's start.
//
// Calls of more than 8 tokens run qdot_avx512.cpp's many-token kernel on
// whole vectors of 16 rows, which unpacks them with the same code
// (unpack_grid_rows16_avx512) once per call instead of once per 8 tokens.
//
// Everything else lives in an anonymous namespace (tests/isa_linkage.sh).
#include "kernels/qdot_avx2_impl.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "qdot_avx512_grid.cpp needs -mavx512f -mavx512bw -mavx512vnni"
#endif

namespace colibri::kernels {
namespace {

// A token's prepared super-block: 256 codes in the transposed order (at 0), 16
// floats (lanes 2m and 2m + 1: sub-block m's activation scale), 16 int32
// (lane 2m + h: the codes' sum over half h of sub-block m).
constexpr size_t kPrepScales = 256;
constexpr size_t kPrepSums = 320;
constexpr size_t kPrepSb = 384;

inline __m512i qword_pair(uint64_t even, uint64_t odd) {
  const auto e = static_cast<long long>(even);
  const auto o = static_cast<long long>(odd);
  return _mm512_set_epi64(o, e, o, e, o, e, o, e);
}

// vpshufb control filling every byte of qword m with byte `pos` of qword m.
inline __m512i bcast_ctrl(uint64_t pos) {
  constexpr uint64_t kOnes = 0x0101010101010101ull;
  return qword_pair(kOnes * pos, kOnes * (8 + pos));
}

// vpshufb control putting bytes k and k + 1 of qword m, zero-extended, in
// dword lanes 2m and 2m + 1 (the 4-value grids' indices).
inline __m512i idx_pair_ctrl(uint64_t k) {
  const uint64_t lo = 0x80808000ull | k;
  const uint64_t hi = 0x80808000ull | (k + 1);
  return qword_pair(lo | (hi << 32), (lo + 8) | ((hi + 8) << 32));
}

// Each dword lane pair (2m, 2m + 1) given the value of lane 2m.
inline __m512i dup_even(__m512i v) { return _mm512_shuffle_epi32(v, _MM_PERM_CCAA); }

// d * (lo + k * v) for the int32 lanes v.
inline __m512 affine(__m512i v, float lo, float k) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(k), _mm512_set1_ps(lo));
}

// The IQ2 sign bytes of bytes holding a 7-bit sign index each (bit 7
// ignored): bit 7 set where the other seven have odd parity, as ggml's
// ksigns_iq2xs. The shifts cross bytes, but bit 0 of each byte after the
// folds depends only on that byte's bits.
inline __m512i even_signs(__m512i x) {
  x = _mm512_and_si512(x, _mm512_set1_epi8(0x7f));
  __m512i p = _mm512_xor_si512(x, _mm512_srli_epi64(x, 4));
  p = _mm512_xor_si512(p, _mm512_srli_epi64(p, 2));
  p = _mm512_xor_si512(p, _mm512_srli_epi64(p, 1));
  return _mm512_ternarylogic_epi64(x, _mm512_slli_epi64(p, 7), _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);
}

// The four 7-bit fields of the low dword of each qword (bits 0, 7, 14, 21)
// to bytes 0-3 of that qword.
inline __m512i spread7(__m512i a) {
  const __m512i f0 = _mm512_and_si512(a, _mm512_set1_epi64(0x7f));
  const __m512i f1 = _mm512_and_si512(_mm512_slli_epi64(a, 1), _mm512_set1_epi64(0x7f00));
  const __m512i f2 = _mm512_and_si512(_mm512_slli_epi64(a, 2), _mm512_set1_epi64(0x7f0000));
  const __m512i f3 = _mm512_and_si512(_mm512_slli_epi64(a, 3), _mm512_set1_epi64(0x7f000000));
  return _mm512_or_si512(_mm512_or_si512(f0, f1), _mm512_or_si512(f2, f3));
}

// The negative values of code vector j: sign byte at byte pos of qword m,
// bit i for value i of the group.
inline __mmask64 sign_mask(__m512i sign_bytes, uint64_t pos) {
  return _mm512_test_epi8_mask(_mm512_shuffle_epi8(sign_bytes, bcast_ctrl(pos)),
                               _mm512_set1_epi64(static_cast<long long>(0x8040201008040201ull)));
}

// Grid points by index: the indices stored and read back as scalars, the
// points loaded one by one. vpgatherqq took about 2.4 times as long as these
// eight loads on Zen 5 (5.4 against 2.2 ns per 8 points in a loop of them).
inline __m512i gather_q(const uint64_t* table, __m512i idx) {
  alignas(64) uint64_t i[8];
  _mm512_store_si512(i, idx);
  const auto at = [&](int k) { return static_cast<long long>(table[i[k]]); };
  return _mm512_setr_epi64(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
}
inline __m512i gather_d(const uint32_t* table, __m512i idx) {
  alignas(64) uint32_t i[16];
  _mm512_store_si512(i, idx);
  const auto at = [&](int k) { return static_cast<int>(table[i[k]]); };
  return _mm512_setr_epi32(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10), at(11),
                           at(12), at(13), at(14), at(15));
}

// IQ2_XXS's 256 grid points as 16-bit codes, 2 bits a value (0, 1, 2 for
// 8, 25, 43), so that the whole grid fits 8 zmm and a super-block's 32
// points take 4 vpermi2w instead of 32 loads.
struct Iq2XxsCodes {
  uint16_t c[256];
};

const Iq2XxsCodes& iq2xxs_codes() {
  static const Iq2XxsCodes t = [] {
    Iq2XxsCodes r{};
    for (int e = 0; e < 256; ++e) {
      uint32_t v = 0;
      for (int i = 0; i < 8; ++i) {
        const auto byte = static_cast<uint8_t>(kIqTables.iq2xxs_grid[e] >> (8 * i));
        v |= (byte == 8 ? 0u : byte == 25 ? 1u : 2u) << (2 * i);
      }
      r.c[e] = static_cast<uint16_t>(v);
    }
    return r;
  }();
  return t;
}

// The grid codes of 32 word indices (0 .. 255) from the 8 table vectors.
inline __m512i lookup256(const __m512i* tab, __m512i idx) {
  const __mmask32 b6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x40));
  const __mmask32 b7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x80));
  const __m512i lo = _mm512_mask_blend_epi16(b6, _mm512_permutex2var_epi16(tab[0], idx, tab[1]),
                                             _mm512_permutex2var_epi16(tab[2], idx, tab[3]));
  const __m512i hi = _mm512_mask_blend_epi16(b6, _mm512_permutex2var_epi16(tab[4], idx, tab[5]),
                                             _mm512_permutex2var_epi16(tab[6], idx, tab[7]));
  return _mm512_mask_blend_epi16(b7, lo, hi);
}

// A super-block unpacked: the codes (unsigned), which products to negate,
// the per-lane weight scales (w1: of the second 16 values of each
// sub-block, for the formats scaled per 16).
struct GridZ {
  __m512i mag[4];
  __mmask64 neg[4];
  __m512 w0;
  __m512 w1;
};

template <Grid G>
constexpr bool kHalfScales = G == Grid::kIq2Xs || G == Grid::kIq2S || G == Grid::kIq1M;
template <Grid G>
constexpr bool kIq1 = G == Grid::kIq1S || G == Grid::kIq1M;

// The byte of qword m at bit offset `shift`, masked, as a qword index.
inline __m512i field(__m512i v, unsigned shift, long long mask) {
  return _mm512_and_si512(_mm512_srli_epi64(v, shift), _mm512_set1_epi64(mask));
}

// IQ1's codes 8 (g + 1) + s + 1 from the gathered g (int8 -1, 0, 1) and,
// per qword, s + 1 (0 or 2) in its low byte.
inline __m512i iq1_codes(__m512i g, __m512i s1) {
  const __m512i g8 = _mm512_slli_epi16(_mm512_add_epi8(g, _mm512_set1_epi8(1)), 3);  // bytes <= 16: no carry
  return _mm512_add_epi8(g8, _mm512_shuffle_epi8(s1, bcast_ctrl(0)));
}

// Per-16 scales (nibbles or 3-bit fields lo / hi of qword m) as w0 / w1.
inline void half_scales(__m512i lo, __m512i hi, float base, float step, GridZ* z) {
  z->w0 = affine(dup_even(lo), base, step);
  z->w1 = affine(dup_even(hi), base, step);
}

template <Grid G>
inline void unpack(const typename GridTraits<G>::Block* b, const __m512i* tab, GridZ* z) {
  if constexpr (G == Grid::kIq2Xxs) {
    const float d = h2f(b->d);
    const __m512i q = _mm512_loadu_si512(b->qs);
    // Word k of lane l: the index of group k % 4 of sub-block 2 l + k / 4.
    const __m512i idx = _mm512_shuffle_epi8(
        q, qword_pair(0x8003800280018000ull, 0x800b800a80098008ull));
    const __m512i codes = lookup256(tab, idx);
    for (unsigned j = 0; j < 4; ++j) {
      // Byte i of qword m: the code byte of group j of sub-block m holding value i.
      const uint64_t c = 0x0101010100000000ull + 0x0202020202020202ull * j;
      const __m512i x = _mm512_shuffle_epi8(codes, qword_pair(c, c + 0x0808080808080808ull));
      const __mmask64 one = _mm512_test_epi8_mask(x, _mm512_set1_epi64(0x4010040140100401ll));
      const __mmask64 two = _mm512_test_epi8_mask(x, _mm512_set1_epi64(static_cast<long long>(0x8020080280200802ull)));
      z->mag[j] = _mm512_mask_mov_epi8(_mm512_mask_mov_epi8(_mm512_set1_epi8(8), one, _mm512_set1_epi8(25)), two,
                                       _mm512_set1_epi8(43));
    }
    const __m512i s = even_signs(spread7(_mm512_srli_epi64(q, 32)));
    for (unsigned j = 0; j < 4; ++j) z->neg[j] = sign_mask(s, j);
    z->w0 = affine(dup_even(_mm512_srli_epi64(q, 60)), d * 0.125f, d * 0.25f);
  } else if constexpr (G == Grid::kIq3Xxs) {
    const float d = h2f(b->d);
    const __m512i q = _mm512_loadu_si512(b->qs);
    for (unsigned j = 0; j < 4; ++j) {
      z->mag[j] = gather_d(kIqTables.iq3xxs_grid, _mm512_shuffle_epi8(q, idx_pair_ctrl(2 * j)));
    }
    const __m512i aux = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + kQKK / 4)));
    const __m512i s = even_signs(spread7(aux));
    for (unsigned j = 0; j < 4; ++j) z->neg[j] = sign_mask(s, j);
    z->w0 = affine(dup_even(_mm512_srli_epi64(aux, 28)), d * 0.25f, d * 0.5f);
  } else if constexpr (G == Grid::kIq2Xs) {
    const float d = h2f(b->d);
    const __m512i q = _mm512_loadu_si512(b->qs);
    for (unsigned j = 0; j < 4; ++j) {
      z->mag[j] = gather_q(kIqTables.iq2xs_grid, field(q, 16 * j, 511));
    }
    const __m512i s = even_signs(_mm512_srli_epi16(q, 9));
    for (unsigned j = 0; j < 4; ++j) z->neg[j] = sign_mask(s, 2 * j);
    const __m512i sc = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->scales)));
    half_scales(_mm512_and_si512(sc, _mm512_set1_epi64(15)), _mm512_srli_epi64(sc, 4), d * 0.125f, d * 0.25f, z);
  } else if constexpr (G == Grid::kIq2S) {
    const float d = h2f(b->d);
    const __m512i q = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs)));
    const __m512i qh = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qh)));
    for (unsigned j = 0; j < 4; ++j) {
      const __m512i idx = _mm512_or_si512(field(q, 8 * j, 0xff), _mm512_slli_epi64(field(qh, 2 * j, 3), 8));
      z->mag[j] = gather_q(kIqTables.iq2s_grid, idx);
    }
    const __m512i s = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->signs)));
    for (unsigned j = 0; j < 4; ++j) z->neg[j] = sign_mask(s, j);
    const __m512i sc = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->scales)));
    half_scales(_mm512_and_si512(sc, _mm512_set1_epi64(15)), _mm512_srli_epi64(sc, 4), d * 0.125f, d * 0.25f, z);
  } else if constexpr (G == Grid::kIq3S) {
    const float d = h2f(b->d);
    const __m512i q = _mm512_loadu_si512(b->qs);
    const __m512i qh =
        dup_even(_mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qh))));
    for (unsigned j = 0; j < 4; ++j) {
      const __m512i hi = _mm512_and_si512(
          _mm512_srlv_epi32(qh, qword_pair((2ull * j) | ((2ull * j + 1) << 32), (2ull * j) | ((2ull * j + 1) << 32))),
          _mm512_set1_epi32(1));
      const __m512i idx = _mm512_or_si512(_mm512_shuffle_epi8(q, idx_pair_ctrl(2 * j)), _mm512_slli_epi32(hi, 8));
      z->mag[j] = gather_d(kIqTables.iq3s_grid, idx);
    }
    const __m512i s = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->signs)));
    for (unsigned j = 0; j < 4; ++j) z->neg[j] = sign_mask(s, j);
    uint32_t sc;
    std::memcpy(&sc, b->scales, sizeof sc);
    const __m512i ls = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(sc)),
                          _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28)),
        _mm512_set1_epi32(15));
    z->w0 = affine(ls, d, 2.0f * d);
  } else if constexpr (G == Grid::kIq1S) {
    const float d = h2f(b->d);
    const __m512i q = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs)));
    const __m512i qh = _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qh)));
    // s + 1: 0 where bit 15 (the shift's sign) is set, else 2.
    const __m512i s1 = _mm512_srli_epi64(_mm512_andnot_si512(qh, _mm512_set1_epi64(0x8000)), 14);
    for (unsigned j = 0; j < 4; ++j) {
      const __m512i idx = _mm512_or_si512(field(q, 8 * j, 0xff), _mm512_slli_epi64(field(qh, 3 * j, 7), 8));
      z->mag[j] = iq1_codes(gather_q(kIqTables.iq1s_grid, idx), s1);
    }
    z->w0 = affine(dup_even(field(qh, 12, 7)), d * 0.125f, d * 0.25f);
  } else {
    const __m512i q = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs)));
    const __m512i qh = _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qh)));
    for (unsigned j = 0; j < 4; ++j) {
      const __m512i idx = _mm512_or_si512(field(q, 8 * j, 0xff), _mm512_slli_epi64(field(qh, 4 * j, 7), 8));
      const __m512i s1 =
          _mm512_srli_epi64(_mm512_andnot_si512(qh, _mm512_set1_epi64(8ll << (4 * j))), 4 * j + 2);
      z->mag[j] = iq1_codes(gather_q(kIqTables.iq1s_grid, idx), s1);
    }
    const float d = iq1m_d(b->scales);
    uint64_t sc;
    std::memcpy(&sc, b->scales, sizeof sc);
    // Sub-block m's two 3-bit scales at bit 6 (m % 2) of word m / 2.
    const __m512i w = _mm512_srlv_epi64(_mm512_set1_epi64(static_cast<long long>(sc)),
                                        _mm512_setr_epi64(0, 6, 16, 22, 32, 38, 48, 54));
    half_scales(_mm512_and_si512(w, _mm512_set1_epi64(7)), field(w, 3, 7), d * 0.125f, d * 0.25f, z);
  }
}

// Super-block sb of a token's activation row, rearranged (kPrepSb).
inline void prepare_sb(const uint8_t* act, size_t n, size_t sb, uint8_t* out) {
  const uint8_t* q = act + kQKK * sb;
  const __m512i c0 = _mm512_loadu_si512(q);
  const __m512i c1 = _mm512_loadu_si512(q + 64);
  const __m512i c2 = _mm512_loadu_si512(q + 128);
  const __m512i c3 = _mm512_loadu_si512(q + 192);
  for (long long j = 0; j < 4; ++j) {
    // Qword m of the result is qword 4 m + j of the super-block.
    const __m512i idx = _mm512_setr_epi64(j, 4 + j, 8 + j, 12 + j, j, 4 + j, 8 + j, 12 + j);
    const __m512i lo = _mm512_permutex2var_epi64(c0, idx, c1);
    const __m512i hi = _mm512_permutex2var_epi64(c2, idx, c3);
    _mm512_storeu_si512(out + 64 * static_cast<size_t>(j), _mm512_shuffle_i64x2(lo, hi, 0x44));
  }
  const __m256 da = _mm256_loadu_ps(reinterpret_cast<const float*>(act_d(act, n) + 32 * sb));
  _mm512_storeu_ps(out + kPrepScales,
                   _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                         _mm512_castps256_ps512(da)));
  const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act_sums(act, n) + 32 * sb));
  _mm512_storeu_si512(out + kPrepSums, _mm512_cvtepi16_epi32(sums));
}

// Rows against NT prepared tokens over nsb super-blocks.
template <Grid G, int NT>
void grid_row_zmm(const uint8_t* row, size_t nsb, const uint8_t* const* prep, const __m512i* tab, float* res) {
  using Block = typename GridTraits<G>::Block;
  __m512 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm512_setzero_ps();
  for (size_t s = 0; s < nsb; ++s) {
    const auto* b = reinterpret_cast<const Block*>(row) + s;
    prefetch_block<sizeof(Block)>(reinterpret_cast<const uint8_t*>(b));
    GridZ z;
    unpack<G>(b, tab, &z);
    for (int t = 0; t < NT; ++t) {
      const uint8_t* p = prep[t] + s * kPrepSb;
      __m512i a[4];
      for (int j = 0; j < 4; ++j) {
        a[j] = _mm512_loadu_si512(p + 64 * j);
        if constexpr (!kIq1<G>) a[j] = _mm512_mask_sub_epi8(a[j], z.neg[j], _mm512_setzero_si512(), a[j]);
      }
      __m512i acc0 = _mm512_setzero_si512();
      __m512i acc1 = _mm512_setzero_si512();
      if constexpr (kIq1<G>) {
        // -9 times the sums: int16 pairs (sum, its sign extension) times (-9, 0).
        const __m512i init = _mm512_madd_epi16(_mm512_loadu_si512(p + kPrepSums), _mm512_set1_epi32(0xfff7));
        if constexpr (kHalfScales<G>) {
          acc0 = _mm512_maskz_mov_epi32(0x5555, init);
          acc1 = _mm512_maskz_mov_epi32(0xaaaa, init);
        } else {
          acc0 = init;
        }
      }
      acc0 = _mm512_dpbusd_epi32(acc0, z.mag[0], a[0]);
      acc1 = _mm512_dpbusd_epi32(acc1, z.mag[2], a[2]);
      acc0 = _mm512_dpbusd_epi32(acc0, z.mag[1], a[1]);
      acc1 = _mm512_dpbusd_epi32(acc1, z.mag[3], a[3]);
      const __m512 da = _mm512_loadu_ps(p + kPrepScales);
      if constexpr (kHalfScales<G>) {
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc0), _mm512_mul_ps(z.w0, da), facc[t]);
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc1), _mm512_mul_ps(z.w1, da), facc[t]);
      } else {
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc0, acc1)), _mm512_mul_ps(z.w0, da), facc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(facc[t]);
}

// Up to kMaxTokens tokens a pass; per pass the super-blocks in column
// chunks whose prepared activations fit the stack buffer; per chunk every
// row.
template <Grid G>
void dot_rows_grid_zmm(const void* w, size_t row_bytes, int32_t rows, const void* act, size_t act_bytes,
                       int32_t tokens, size_t n, float* out, size_t ld_out) {
  if (rows <= 0 || tokens <= 0) return;
  using Block = typename GridTraits<G>::Block;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const size_t nsb = n / kQKK;
  if (nsb == 0) return zero_out(rows, tokens, out, ld_out);
  __m512i tab[8];
  if constexpr (G == Grid::kIq2Xxs) {
    const uint16_t* c = iq2xxs_codes().c;
    for (int i = 0; i < 8; ++i) tab[i] = _mm512_loadu_si512(c + 32 * i);
  } else {
    for (__m512i& v : tab) v = _mm512_setzero_si512();
  }
  alignas(64) uint8_t buf[kActBufferBytes];
  for (int32_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const int nt = tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens;
    const size_t chunk = kActBufferBytes / (kPrepSb * static_cast<size_t>(nt));
    for (size_t c0 = 0; c0 < nsb; c0 += chunk) {
      const size_t cn = min_size(chunk, nsb - c0);
      const uint8_t* prep[kMaxTokens];
      for (int t = 0; t < nt; ++t) {
        uint8_t* p = buf + static_cast<size_t>(t) * cn * kPrepSb;
        const uint8_t* a = ab + static_cast<size_t>(t0 + t) * act_bytes;
        for (size_t s = 0; s < cn; ++s) prepare_sb(a, n, c0 + s, p + s * kPrepSb);
        prep[t] = p;
      }
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        const uint8_t* row = wb + r * row_bytes + c0 * sizeof(Block);
        float res[kMaxTokens];
        with_token_count<kMaxTokens>(nt, [&]<int NT>() { grid_row_zmm<G, NT>(row, cn, prep, tab, res); });
        for (int t = 0; t < nt; ++t) {
          float* o = out + static_cast<size_t>(t0 + t) * ld_out + r;
          *o = c0 == 0 ? res[t] : *o + res[t];
        }
      }
    }
  }
}

// 16 rows' super-block, unpacked for the many-token kernel (below).
template <Grid G>
void unpack_rows16(const uint8_t* blocks, size_t row_bytes, uint8_t* codes, float* scales) {
  using Block = typename GridTraits<G>::Block;
  __m512i tab[8];
  if constexpr (G == Grid::kIq2Xxs) {
    const uint16_t* c = iq2xxs_codes().c;
    for (int i = 0; i < 8; ++i) tab[i] = _mm512_loadu_si512(c + 32 * i);
  } else {
    for (__m512i& v : tab) v = _mm512_setzero_si512();
  }
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(kGridCodeOffset));
  for (size_t r = 0; r < 16; ++r) {
    GridZ z;
    unpack<G>(reinterpret_cast<const Block*>(blocks + r * row_bytes), tab, &z);
    for (size_t j = 0; j < 4; ++j) {
      __m512i v;
      if constexpr (kIq1<G>) {
        // The IQ1 codes are already the values + 9.
        v = _mm512_add_epi8(z.mag[j], _mm512_set1_epi8(static_cast<char>(kGridCodeOffset - 9)));
      } else {
        v = _mm512_mask_sub_epi8(_mm512_add_epi8(z.mag[j], bias), z.neg[j], bias, z.mag[j]);
      }
      _mm512_store_si512(codes + 256 * r + 64 * j, v);
    }
    // w0 and w1 hold each scale in both lanes of their pair.
    _mm512_store_ps(scales + 16 * r, kHalfScales<G> ? _mm512_mask_blend_ps(0xaaaa, z.w0, z.w1) : z.w0);
  }
}

const QuantDotKernels kIq2Xxs = {"iq2_xxs-avx512-vnni", quantize_act, dot_rows_grid_zmm<Grid::kIq2Xxs>};
const QuantDotKernels kIq3Xxs = {"iq3_xxs-avx512-vnni", quantize_act, dot_rows_grid_zmm<Grid::kIq3Xxs>};
const QuantDotKernels kIq1S = {"iq1_s-avx512-vnni", quantize_act, dot_rows_grid_zmm<Grid::kIq1S>};
const QuantDotKernels kIq1M = {"iq1_m-avx512-vnni", quantize_act, dot_rows_grid_zmm<Grid::kIq1M>};
const QuantDotKernels kIq2Xs = {"iq2_xs-avx512-vnni", quantize_act, dot_rows_grid_zmm<Grid::kIq2Xs>};
const QuantDotKernels kIq2S = {"iq2_s-avx512-vnni", quantize_act, dot_rows_grid_zmm<Grid::kIq2S>};
const QuantDotKernels kIq3S = {"iq3_s-avx512-vnni", quantize_act, dot_rows_grid_zmm<Grid::kIq3S>};

}  // namespace

// Compiled once per far prefetch hint (quant_dot.h).
namespace COLIBRI_QDOT_VARIANT {

void unpack_grid_rows16_avx512(WeightType t, const uint8_t* blocks, size_t row_bytes, uint8_t* codes, float* scales) {
  switch (t) {
    case WeightType::kIQ2_XXS:
      return unpack_rows16<Grid::kIq2Xxs>(blocks, row_bytes, codes, scales);
    case WeightType::kIQ3_XXS:
      return unpack_rows16<Grid::kIq3Xxs>(blocks, row_bytes, codes, scales);
    case WeightType::kIQ1_S:
      return unpack_rows16<Grid::kIq1S>(blocks, row_bytes, codes, scales);
    case WeightType::kIQ1_M:
      return unpack_rows16<Grid::kIq1M>(blocks, row_bytes, codes, scales);
    case WeightType::kIQ2_XS:
      return unpack_rows16<Grid::kIq2Xs>(blocks, row_bytes, codes, scales);
    case WeightType::kIQ2_S:
      return unpack_rows16<Grid::kIq2S>(blocks, row_bytes, codes, scales);
    case WeightType::kIQ3_S:
      return unpack_rows16<Grid::kIq3S>(blocks, row_bytes, codes, scales);
    default:
      return;
  }
}

const QuantDotKernels* quant_dot_avx512_grid(WeightType t) {
  switch (t) {
    case WeightType::kIQ2_XXS:
      return &kIq2Xxs;
    case WeightType::kIQ3_XXS:
      return &kIq3Xxs;
    case WeightType::kIQ1_S:
      return &kIq1S;
    case WeightType::kIQ1_M:
      return &kIq1M;
    case WeightType::kIQ2_XS:
      return &kIq2Xs;
    case WeightType::kIQ2_S:
      return &kIq2S;
    case WeightType::kIQ3_S:
      return &kIq3S;
    default:
      return nullptr;
  }
}

}  // namespace COLIBRI_QDOT_VARIANT
}  // namespace colibri::kernels
