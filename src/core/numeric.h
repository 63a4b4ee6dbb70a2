// Scalar conversions between float and the storage types (bf16, f16, fp8
// e4m3), and the FP8 scale rules of the cache formats. Portable C++ usable
// from host code and tests; vectorised kernels have their own fast paths but
// must agree with these bit for bit.
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace smla::numeric {

inline float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = static_cast<float>(man) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(v) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round to nearest even, overflow to inf, NaN stays NaN.
inline uint16_t float_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65536 -> inf
  if (a < 0x38800000u) {                        // below 2^-14: subnormal, units of 2^-24
    const float v = std::bit_cast<float>(a) * 0x1p24f;
    return sign | static_cast<uint16_t>(std::nearbyint(v));  // default rounding mode is to-nearest-even
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return sign | static_cast<uint16_t>((r - 0x38000000u) >> 13);
}

// FP8 e4m3 ("fn": no infinities, 0x7f/0xff are NaN, max 448).
inline float e4m3_to_float(uint8_t v) {
  const uint32_t sign = (v & 0x80u) ? 0x80000000u : 0u;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 0x7u;
  if (exp == 15 && man == 7) return std::bit_cast<float>(sign | 0x7fc00000u);
  float mag = exp == 0 ? static_cast<float>(man) * 0x1p-9f
                       : std::bit_cast<float>(((exp + 120u) << 23) | (man << 20));
  return sign ? -mag : mag;
}

// All 256 values, for table lookups in hot loops.
inline const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = e4m3_to_float(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

// Round to nearest even, saturating at +-448; NaN -> 0x7f.
inline uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= 448.f) return sign | 0x7e;
  if (a < 0x1p-6f) {  // subnormal range: units of 2^-9
    const int q = static_cast<int>(std::nearbyint(a * 0x1p9f));
    return sign | static_cast<uint8_t>(q);  // q == 8 is the smallest normal, encoded the same way
  }
  const uint32_t u = std::bit_cast<uint32_t>(a);
  const uint32_t r = u + 0x7ffffu + ((u >> 20) & 1u);  // round mantissa to 3 bits
  const uint32_t exp = (r >> 23) - 120u;
  const uint32_t man = (r >> 20) & 0x7u;
  if (exp > 15 || (exp == 15 && man == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((exp << 3) | man);
}

// Smallest power of two >= x, for normal x > 0. Exact on the bits: log2 in
// float can round just-above-a-power values down.
inline float pow2_ceil(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffu) == 0) return x;
  return std::bit_cast<float>((u & 0x7f800000u) + 0x800000u);
}

// Tile scale of the fp8_ds_mla latent cache (per 128 values).
inline float ds_mla_tile_scale(float amax) { return pow2_ceil(std::fmax(amax / 448.f, 1e-4f)); }
// Per-token scale of the FP8 index cache (ue8m0: power of two).
inline float index_key_scale(float amax) { return pow2_ceil(std::fmax(amax, 1e-4f) / 448.f); }

// The 128-point Walsh-Hadamard transform scaled by 128^-0.5 (orthogonal, its own inverse), in place, in fp32:
// out[i] = 128^-0.5 * sum_j (-1)^popcount(i & j) x[j], by butterflies of width 1, 2, ..., 64 (Sylvester order).
inline void hadamard128(float* x) {
  for (int width = 1; width < 128; width *= 2)
    for (int i = 0; i < 128; i += 2 * width)
      for (int j = i; j < i + width; ++j) {
        const float a = x[j], b = x[j + width];
        x[j] = a + b;
        x[j + width] = a - b;
      }
  for (int i = 0; i < 128; ++i) x[i] *= 0.08838834764831845f;  // 128^-0.5, as the model's kernels multiply
}

}  // namespace smla::numeric
