// FP8 e4m3fn, bf16 and fp16: the limits and the scale rule every device shares, and the host conversions,
// bit-exact with CUDA's (__nv_cvt_float_to_fp8 with __NV_SATFINITE and __NV_E4M3; __float2bfloat16_rn;
// __float2half_rn, NaN aside: any NaN is a NaN).
//   fp16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; largest finite 65504; subnormals k * 2^-24;
//   encoding rounds to nearest even and overflows to inf from 65520 up (IEEE, as torch's .half()).
//   e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; NaN is S.1111.111;
//   largest finite 448 = 2^8 * 1.75; smallest normal 2^-6; subnormals k * 2^-9.
//   Encoding rounds to nearest, ties to even, and saturates every finite or infinite |x| > 448 to
//   +-448. NaN encodes as 0x7F with the input's sign bit.
// Dynamic scales: scale = amax / 448 over the group (amax == 0 gives scale 1), q = fp8(x / scale).
#pragma once

#include <cstdint>

#include "numerics/host_device.h"

#if !defined(__CUDA_ARCH__)
#include <array>
#include <bit>
#include <cmath>
#endif
#if defined(__CUDACC__)
#include <cuda_runtime.h>  // the device intrinsics DivideBy uses
#endif

namespace moekit::numerics {

using fp8_t = std::uint8_t;    // e4m3fn bits
using bf16_t = std::uint16_t;  // bfloat16 bits
using fp16_t = std::uint16_t;  // IEEE binary16 bits

inline constexpr float kFp16Max = 65504.0f;

inline constexpr float kFp8Max = 448.0f;

// The scale of a group whose largest magnitude is amax. NOTES: amax == 0 (an all-zero group, e.g. a
// padding row) gets scale 1 so that x / scale stays 0 instead of 0 / 0 = NaN; its codes are all
// zero and dequantize to zero whatever the scale. A division, not a reciprocal: both devices round
// amax / 448 the same way.
MOEKIT_HD inline float fp8_scale(float amax) {
  return amax > 0.0f ? amax / kFp8Max : 1.0f;
}

#if !defined(__CUDA_ARCH__)
// --- host conversions ---------------------------------------------------------------------------

constexpr float fp8_decode_slow(fp8_t code) {
  const bool neg = (code & 0x80) != 0;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return neg ? -__builtin_nanf("") : __builtin_nanf("");
  // Subnormal: mantissa * 2^-9; normal: (8 + mantissa) * 2^(exponent - 10).
  float magnitude = exponent == 0 ? static_cast<float>(mantissa) / 512.0f : static_cast<float>(8 + mantissa);
  if (exponent != 0) {
    int e = exponent - 10;
    for (; e > 0; --e) magnitude *= 2.0f;
    for (; e < 0; ++e) magnitude *= 0.5f;
  }
  return neg ? -magnitude : magnitude;
}

inline const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[static_cast<std::size_t>(i)] = fp8_decode_slow(static_cast<fp8_t>(i));
    return t;
  }();
  return table;
}

inline float fp8_decode(fp8_t code) {
  return fp8_table()[code];
}

inline fp8_t fp8_encode(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<fp8_t>((bits >> 24) & 0x80);
  const std::uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return static_cast<fp8_t>(sign | 0x7F);   // NaN
  if (abs_bits >= 0x43E00000u) return static_cast<fp8_t>(sign | 0x7E);  // |x| >= 448 (and inf): saturate
  const int exp32 = static_cast<int>(abs_bits >> 23);                   // biased float exponent
  if (exp32 >= 121) {
    // Normal e4m3 range |x| >= 2^-6: keep 3 of 23 mantissa bits, round to nearest even. A carry
    // out of the mantissa bumps the exponent, which is exactly the next binade's first code.
    const std::uint32_t mant = abs_bits & 0x7FFFFFu;
    std::uint32_t code = (static_cast<std::uint32_t>(exp32 - 120) << 3) | (mant >> 20);
    const std::uint32_t rest = mant & 0xFFFFFu;
    if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;
    // 448 < |x| < 464 rounds to 448 above; the guard at 0x43E00000 covers the rest.
    return static_cast<fp8_t>(sign | code);
  }
  // Subnormal range: k * 2^-9 with k in [0, 8]; x * 2^9 is exact, nearbyint rounds ties to even.
  const float scaled = std::bit_cast<float>(abs_bits) * 512.0f;
  const auto k = static_cast<std::uint32_t>(std::nearbyint(scaled));
  return static_cast<fp8_t>(sign | k);  // k == 8 is the smallest normal code 0x08
}

inline float bf16_decode(bf16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

inline bf16_t bf16_encode(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<bf16_t>((bits >> 16) | 0x40u);  // quiet NaN
  const std::uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<bf16_t>((bits + rounding) >> 16);
}

inline float fp16_decode(fp16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t em = h & 0x7FFFu;                                                        // exponent and mantissa
  if (em >= 0x7C00u) return std::bit_cast<float>(sign | 0x7F800000u | ((em & 0x3FFu) << 13));  // inf, NaN
  if (em >= 0x0400u) return std::bit_cast<float>(sign | ((em << 13) + 0x38000000u));           // normal: bias 15 -> 127
  const float magnitude = static_cast<float>(em) * 0x1p-24f;                                   // subnormal, exact
  return sign != 0 ? -magnitude : magnitude;
}

inline fp16_t fp16_encode(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<fp16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return static_cast<fp16_t>(sign | 0x7E00u);   // quiet NaN
  if (abs_bits >= 0x477FF000u) return static_cast<fp16_t>(sign | 0x7C00u);  // |x| >= 65520 (and inf): inf
  const int exp32 = static_cast<int>(abs_bits >> 23);
  if (exp32 >= 113) {
    // Normal fp16 range |x| >= 2^-14: keep 10 of 23 mantissa bits, round to nearest even; a carry
    // bumps the exponent (65504 < |x| < 65520 rounds down to 65504, the guard above takes the rest).
    const std::uint32_t mant = abs_bits & 0x7FFFFFu;
    std::uint32_t code = (static_cast<std::uint32_t>(exp32 - 112) << 10) | (mant >> 13);
    const std::uint32_t rest = mant & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (code & 1u))) ++code;
    return static_cast<fp16_t>(sign | code);
  }
  // Subnormal range: k * 2^-24, k in [0, 1024]; x * 2^24 is exact, nearbyint rounds ties to even.
  const auto k = static_cast<std::uint32_t>(std::nearbyint(std::bit_cast<float>(abs_bits) * 0x1p24f));
  return static_cast<fp16_t>(sign | k);  // k == 1024 is the smallest normal code 0x0400
}

// Whether a finite x rounds past fp16's largest finite value (|x| >= 65520: fp16_encode gives inf).
inline bool fp16_overflows(float x) {
  return std::isfinite(x) && (fp16_encode(x) & 0x7C00u) == 0x7C00u;
}

// A 16-bit value of an unquantized recipe's operand dtype: fp16 where `fp16`, else bf16.
inline float decode16(std::uint16_t x, bool fp16) {
  return fp16 ? fp16_decode(x) : bf16_decode(x);
}
inline std::uint16_t encode16(float x, bool fp16) {
  return fp16 ? fp16_encode(x) : bf16_encode(x);
}
#endif

#if defined(__CUDACC__)
// x / scale rounded exactly as IEEE division (__fdiv_rn), for the many x of a group over its one
// scale: the correctly rounded reciprocal r once a group, then per x Markstein's correction (q = x r,
// e = x - q scale exact by FMA, q + e r: the correctly rounded quotient while every intermediate is a
// normal number), without division's per-call range check and branch into its slow path (which keep
// the divisions of an unrolled group from overlapping). Scales outside [2^-64, 2^64] and NaN take
// __fdiv_rn itself. Inside, an x small enough to make e subnormal (|x| < 2^-75) has a quotient below
// 2^-11, whose FP8 code is 0 whatever its last bits; the sign is x's, as division's (-0 stays -0).
struct DivideBy {
  float scale, r;
  bool fast;
  __device__ __forceinline__ explicit DivideBy(float s) : scale(s), r(0.0f), fast(s >= 0x1p-64f && s <= 0x1p64f) {
#if defined(__CUDA_ARCH__)  // (the host pass of nvcc declares no __frcp_rn)
    r = __frcp_rn(s);
#endif
  }
  // One quotient. Many x over the one scale: with_quotient.
  __device__ __forceinline__ float operator()(float x) const {
    return fast ? fast_quotient(x) : __fdiv_rn(x, scale);
  }
  // f(quotient), quotient(x) = x / scale as above, with `fast` tested once for every x that f divides:
  // fast_quotient straight-line, else __fdiv_rn. operator() on each of a group's values kept a branch
  // and a reconvergence region around each, and their divisions from overlapping (the fused W1 ran 5%
  // slower so: docs/PERF.md).
  template <class F>
  __device__ __forceinline__ void with_quotient(const F& f) const {
    if (fast)
      f([*this](float x) { return fast_quotient(x); });
    else
      f([s = scale](float x) { return __fdiv_rn(x, s); });
  }
  // The quotient when `fast` holds, no branch.
  __device__ __forceinline__ float fast_quotient(float x) const {
    const float q = __fmul_rn(x, r);
    return copysignf(__fmaf_rn(__fmaf_rn(-q, scale, x), r, q), x);
  }
};
#endif

}  // namespace moekit::numerics
