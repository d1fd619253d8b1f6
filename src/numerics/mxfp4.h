// MXFP4 (OCP Microscaling, as gpt-oss ships its experts): e2m1 values, two a byte (the lower nibble
// the first), and one e8m0 exponent for each 32 consecutive values of a row:
//   value = e2m1[nibble] * 2^(exponent - 127); exponent 255 is NaN (OCP MX v1.0).
// e2m1: 1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
#pragma once

#include <cstdint>

#include "numerics/host_device.h"

namespace moekit::numerics {

inline constexpr int kMxBlock = 32;       // values sharing one e8m0 exponent
inline constexpr int kMxBlockBytes = 16;  // their packed e2m1 codes
inline constexpr int kE8m0Bias = 127;     // 2^(code - 127)
inline constexpr std::uint8_t kE8m0NaN = 255;

// The e2m1 code's value (sign in bit 3).
MOEKIT_HD constexpr float e2m1_value(std::uint8_t nibble) {
  constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[nibble & 7u];
  return (nibble & 8u) != 0 ? -m : m;
}

// Element j of a packed row (two e2m1 codes a byte, the lower nibble the first).
MOEKIT_HD constexpr std::uint8_t e2m1_nibble(const std::uint8_t* packed, std::int64_t j) {
  const std::uint8_t byte = packed[j / 2];
  return static_cast<std::uint8_t>((j & 1) != 0 ? byte >> 4 : byte & 0x0Fu);
}

}  // namespace moekit::numerics
