// IEEE binary16 and bfloat16 <-> float32 conversions in portable C++.
// These are the reference conversions: the scalar kernels, the loader and the
// routing format use them; SIMD kernels must agree with them bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace colibri {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: value = mant * 2^-24, exact in float.
    const float mag = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return bits_float(float_bits(mag) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even, overflow to infinity, NaN stays NaN.
inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65536
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in f16: scale so the integer part is the
    // f16 mantissa, letting the FPU do round-to-nearest-even.
    const float mag = bits_float(abs) * 16777216.0f;  // 2^24
    const float rounded = mag + 8388608.0f - 8388608.0f;  // round to integer (RNE)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15
  return static_cast<uint16_t>(sign | (r >> 13));
}

}  // namespace colibri
