// Byte layouts of the block-quantised weight formats, exactly as GGUF
// stores them (ggml's block_q8_0, block_q4_0, block_q4_1, block_q5_0,
// block_q5_1, block_q2_K, block_q3_K, block_q4_K, block_q5_K, block_q6_K, block_mxfp4,
// block_iq4_nl, block_iq4_xs, block_tq1_0, block_tq2_0), so model files, GGUF tensors and memory
// hold the same bytes.
// docs/FORMAT.md describes every field; weight_format.h owns the sizes.
#pragma once

#include <cstdint>

namespace colibri {

inline constexpr int kQK32 = 32;    // elements per q8_0 / q4_0 block
inline constexpr int kQKK = 256;    // elements per K-format super-block
inline constexpr int kKScaleBytes = 12;

// x[i] = d * qs[i]
struct BlockQ8_0 {
  uint16_t d;  // f16
  int8_t qs[kQK32];
};
// x[i] = d * ((qs[i] & 15) - 8), x[i + 16] = d * ((qs[i] >> 4) - 8), i < 16
struct BlockQ4_0 {
  uint16_t d;  // f16
  uint8_t qs[kQK32 / 2];
};
// x[i] = d * (qs[i] & 15) + m, x[i + 16] = d * (qs[i] >> 4) + m, i < 16
struct BlockQ4_1 {
  uint16_t d;  // f16
  uint16_t m;  // f16
  uint8_t qs[kQK32 / 2];
};
// As q4_0 with a fifth bit per weight: bit i of qh (little-endian) is the
// high bit of element i, so q = nibble + 16 * bit (0..31) and
// x = d * (q - 16).
struct BlockQ5_0 {
  uint16_t d;  // f16
  uint8_t qh[4];
  uint8_t qs[kQK32 / 2];
};
// q5_0's codes with q4_1's offset: x = d * q + m.
struct BlockQ5_1 {
  uint16_t d;  // f16
  uint16_t m;  // f16
  uint8_t qh[4];
  uint8_t qs[kQK32 / 2];
};
// 16 sub-blocks of 16 (ggml's dequantize_row_q2_K order: sub-block s of
// half h = s / 8 takes element l (< 16) from bits 2 * ((s % 8) / 2) of
// qs[32 h + 16 (s % 2) + l]); scales[s]: a 4-bit scale (low nibble) and
// min (high): x = d * sc * q - dmin * m, q 0..3.
struct BlockQ2K {
  uint8_t scales[kQKK / 16];
  uint8_t qs[kQKK / 4];
  uint16_t d;     // f16
  uint16_t dmin;  // f16
};
// q2_K's sub-blocks and two-bit codes with a third bit in hmask (bit
// 4 h + (s % 8) / 2 of hmask[16 (s % 2) + l], set: +4) and a signed 6-bit
// scale per sub-block (sc - 32, packed in 12 bytes: low nibbles in bytes
// 0-7, high bit pairs in bytes 8-11): x = d * (sc - 32) * (q - 4), q 0..7.
struct BlockQ3K {
  uint8_t hmask[kQKK / 8];
  uint8_t qs[kQKK / 4];
  uint8_t scales[12];
  uint16_t d;  // f16
};
// 8 sub-blocks of 32; sub-block j has a 6-bit scale sc_j and min m_j packed
// in `scales` (ggml's get_scale_min_k4): x = d * sc_j * q - dmin * m_j.
// qs: 4 chunks of 32 bytes; chunk c's low nibbles are sub-block 2c, its
// high nibbles sub-block 2c + 1.
struct BlockQ4K {
  uint16_t d;     // f16, scale of the scales
  uint16_t dmin;  // f16, scale of the mins
  uint8_t scales[kKScaleBytes];
  uint8_t qs[kQKK / 2];
};
// As Q4K, with a fifth bit per weight: bit j of qh[l] is the high bit of
// element l of sub-block j (q = nibble + 16 * bit, 0..31).
struct BlockQ5K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qh[kQKK / 8];
  uint8_t qs[kQKK / 2];
};
// 16 sub-blocks of 16, each with a signed 8-bit scale: x = d * sc * (q - 32),
// q 6 bits: low 4 in ql, high 2 in qh (ggml's dequantize_row_q6_K order).
struct BlockQ6K {
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  uint16_t d;  // f16
};

// MXFP4 (OCP microscaling, as gpt-oss stores its experts): 32 E2M1 codes
// with one shared E8M0 scale. x[i] = 2^(e - 128) * kMxfp4Values[qs[i] & 15],
// x[i + 16] = 2^(e - 128) * kMxfp4Values[qs[i] >> 4], i < 16: the table
// holds twice the E2M1 values, hence e - 128 rather than e - 127 (ggml's
// ggml_e8m0_to_fp32_half; e < 2 gives the subnormals 2^-128 and 2^-127).
struct BlockMxfp4 {
  uint8_t e;
  uint8_t qs[kQK32 / 2];
};
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// IQ4_NL: q4_0's layout with the nibbles indexing a non-uniform table of
// signed levels: x[i] = d * kIq4nlValues[qs[i] & 15],
// x[i + 16] = d * kIq4nlValues[qs[i] >> 4].
struct BlockIq4Nl {
  uint16_t d;  // f16
  uint8_t qs[kQK32 / 2];
};
inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};
// IQ4_XS: 8 IQ4_NL sub-blocks of 32 sharing one f16 d, each with a 6-bit
// scale ls_j (low 4 bits in nibble j % 2 of scales_l[j / 2], high 2 bits
// at bit 2j of scales_h): sub-block j is an IQ4_NL block with scale
// d * (ls_j - 32) and codes qs[16j .. 16j + 15].
struct BlockIq4Xs {
  uint16_t d;  // f16
  uint16_t scales_h;
  uint8_t scales_l[kQKK / 64];
  uint8_t qs[kQKK / 2];
};

// IQ2_XXS (2.0625 bits): per 32-element sub-block ib, two little-endian
// words at qs[4 ib]: the first holds 4 grid indices (a byte each, 8
// values each, iq_grids.h), the second 4 sign indices of 7 bits (bits
// 7g .. 7g + 6, through kIqTables.iq2_signs) and a 4-bit scale ls in bits
// 28-31: x = d * (0.5 + ls) / 4 * grid value * sign.
struct BlockIq2Xxs {
  uint16_t d;  // f16
  uint16_t qs[kQKK / 8];
};

// IQ3_XXS (3.0625 bits): 64 grid indices (a byte each, 4 magnitudes each,
// iq_grids.h), then per 32-element sub-block ib a little-endian word at
// qs[64 + 4 ib] as IQ2_XXS's second word (4 sign indices of 7 bits, each
// for 8 values, and a 4-bit scale ls): x = d * (0.5 + ls) / 2 * grid value
// * sign.
struct BlockIq3Xxs {
  uint16_t d;  // f16
  uint8_t qs[3 * kQKK / 8];
};

// IQ1_S (1.5625 bits): per 32-element sub-block ib, 4 grid indices of 11
// bits (low 8 in qs[4 ib + l], high 3 at bit 3l of qh[ib]), each naming 8
// values g from {-1, 0, 1}; qh[ib] bits 12-14 hold a 3-bit scale s and bit
// 15 the sign of the shift: x = d * (2 s + 1) * (g + delta), delta = -1/8
// when bit 15 is set, +1/8 otherwise.
struct BlockIq1S {
  uint16_t d;  // f16
  uint8_t qs[kQKK / 8];
  uint16_t qh[kQKK / 32];
};
inline constexpr float kIq1Delta = 0.125f;

// IQ1_M (1.75 bits): IQ1_S's grid without a block scale field. Per 32-element
// sub-block ib, qs[4 ib + l] (l < 4) are the low 8 bits of four grid
// indices; qh[2 ib + l / 2] holds, in nibble l % 2, the index's high 3 bits
// and (bit 3) the sign of that group of 8's shift. The f16 d is spread over
// the top nibbles of the four 16-bit words of scales (word k's bits 12-15
// are bits 4k .. 4k + 3 of d); the rest of word k holds four 3-bit scales,
// one per 16 elements (sub-block 2k + i / 2, half i % 2 at bit 3i):
// x = d * (2 s + 1) * (g + delta).
struct BlockIq1M {
  uint8_t qs[kQKK / 8];
  uint8_t qh[kQKK / 16];
  uint8_t scales[kQKK / 32];
};

// IQ2_XS (2.3125 bits): per 8 values a 16-bit word of qs: a 9-bit grid
// index (IQ2_XS's 512 points) and, in bits 9-15, a 7-bit sign index as
// IQ2_XXS's; per 16 values a 4-bit scale ls (nibble k % 2 of scales[k / 2]):
// x = d * (0.5 + ls) / 4 * magnitude * sign.
struct BlockIq2Xs {
  uint16_t d;  // f16
  uint16_t qs[kQKK / 8];
  uint8_t scales[kQKK / 32];
};

// IQ2_S (2.5625 bits): per 8 values k a 10-bit grid index (qs[k], high 2
// bits at bit 2 (k % 4) of qh[k / 4]; IQ2_S's 1024 points) and a sign byte
// signs[k] (bit j set: value j negative); scales as IQ2_XS.
struct BlockIq2S {
  uint16_t d;  // f16
  uint8_t qs[kQKK / 8];
  uint8_t signs[kQKK / 8];
  uint8_t qh[kQKK / 32];
  uint8_t scales[kQKK / 32];
};

// IQ3_S (3.4375 bits): per 4 values k a 9-bit grid index (qs[k], high bit
// at bit k % 8 of qh[k / 8]; 4 magnitudes from {1, 3, .., 15}), per 8
// values a sign byte, per 32 values a 4-bit scale s (nibble ib % 2 of
// scales[ib / 2]): x = d * (1 + 2 s) * magnitude * sign.
struct BlockIq3S {
  uint16_t d;  // f16
  uint8_t qs[kQKK / 4];
  uint8_t qh[kQKK / 32];
  uint8_t signs[kQKK / 8];
  uint8_t scales[kQKK / 64];
};

// FP8 e4m3 (OCP "E4M3FN": 1 sign, 4 exponent bits biased by 7, 3 mantissa
// bits; exponent 0 subnormal, 0x7f / 0xff NaN, no infinities, largest
// 448): 128 codes of a row under one float scale, x = d * e4m3(qs[i]).
// Hugging Face's FP8 checkpoints (DeepSeek-V3, Qwen3 FP8) scale 128 x 128
// tiles (`weight_scale_inv`); each row of a tile keeps the tile's scale,
// so a row of blocks holds its own scales like every other format (4 bytes
// per 128 weights). The scale comes first: one block is 132 bytes, and the
// kernels load its codes unaligned.
inline constexpr int kQKFp8 = 128;
struct BlockFp8E4M3 {
  float d;
  uint8_t qs[kQKFp8];
};

// TQ1_0 (1.6875 bits): ternary weights x = d * (t - 1), t in {0, 1, 2},
// packed in base 3, five to a byte with the first of them most significant
// and the byte stored as ceil(value * 256 / 243), so that trit k of byte q
// is ((uint8_t)(q * 3^k) * 3) >> 8 (ggml's block_tq1_0). qs[0, 32): element
// 32 k + l is trit k of qs[l]; qs[32, 48): element 160 + 16 k + l is trit k
// of qs[32 + l]; qh[4] (four trits a byte): element 240 + 4 k + l is trit k
// of qh[l].
struct BlockTq1_0 {
  uint8_t qs[48];
  uint8_t qh[4];
  uint16_t d;  // f16
};
// TQ2_0 (2.0625 bits): two-bit codes t, x = d * (t - 1) (3 reads as 2),
// q2_K's code order: element 128 h + 32 j + l is bits 2 j of qs[32 h + l]
// (ggml's block_tq2_0).
struct BlockTq2_0 {
  uint8_t qs[kQKK / 4];
  uint16_t d;  // f16
};

static_assert(sizeof(BlockTq1_0) == 54);
static_assert(sizeof(BlockTq2_0) == 66);
static_assert(sizeof(BlockFp8E4M3) == 132);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockIq2Xs) == 74);
static_assert(sizeof(BlockIq2S) == 82);
static_assert(sizeof(BlockIq3S) == 110);
static_assert(sizeof(BlockIq2Xxs) == 66);
static_assert(sizeof(BlockIq3Xxs) == 98);
static_assert(sizeof(BlockIq1S) == 50);
static_assert(sizeof(BlockIq1M) == 56);
static_assert(sizeof(BlockMxfp4) == 17);
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockIq4Nl) == 18);
static_assert(sizeof(BlockIq4Xs) == 136);
static_assert(sizeof(BlockQ4K) == 144);
static_assert(sizeof(BlockQ2K) == 84);
static_assert(sizeof(BlockQ3K) == 110);
static_assert(sizeof(BlockQ5K) == 176);
static_assert(sizeof(BlockQ6K) == 210);

}  // namespace colibri
