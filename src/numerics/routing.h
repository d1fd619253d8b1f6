// The routing arithmetic every device shares, so that a GPU router chooses exactly the CPU's experts
// with exactly its weights: a float exp built only from correctly rounded operations (+, *, fma,
// rint), identical bit for bit on any IEEE machine, unlike expf / std::exp whose last bit differs
// between libraries; the sigmoid and softmax scores from it; and the weights' normalization. The
// selection itself (higher score first, ties to the lower expert index) is exact on every device.
// A sum over experts or slots is always taken in index order by one thread: summation order is
// part of the result.
#pragma once

#include <cstdint>

#include "numerics/activation.h"
#include "numerics/host_device.h"

namespace moekit::numerics {

// exp(x) in float, within ~1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite, ln2 split in two
// floats), e^r by its degree-7 Taylor polynomial in Horner form with fma (truncation r^8/8! <
// 6e-9 relative), times 2^n (ldexp: exact, one rounding when the result is subnormal).
template <class Math>
MOEKIT_HD inline float exp_f32(float x) {
  if (!(x == x)) return x;                                               // NaN
  if (x > 88.72283935546875f) return x * 1e30f * 1e30f;                  // overflow to +inf (and +inf itself)
  if (x < -103.97208f) return 0.0f;                                      // below the smallest subnormal (and -inf)
  const float n = Math::rint(Math::mul(x, 1.44269502162933349609375f));  // x / ln2
  float r = Math::fma(n, -0.693145751953125f, x);                        // ln2_hi: exact product
  r = Math::fma(n, -1.428606765330187045e-06f, r);                       // ln2_lo
  float p = 1.0f / 5040.0f;
  p = Math::fma(p, r, 1.0f / 720.0f);
  p = Math::fma(p, r, 1.0f / 120.0f);
  p = Math::fma(p, r, 1.0f / 24.0f);
  p = Math::fma(p, r, 1.0f / 6.0f);
  p = Math::fma(p, r, 0.5f);
  p = Math::fma(p, r, 1.0f);
  p = Math::fma(p, r, 1.0f);
  return Math::ldexp(p, static_cast<int>(n));  // exact: one rounding at most, into subnormals
}

// The router's scores: sigmoid(x) = 1 / (1 + e^-x); softmax numerators e^(x - max).
template <class Math>
MOEKIT_HD inline float sigmoid_f32(float x) {
  return Math::div_rn(1.0f, Math::add(1.0f, exp_f32<Math>(-x)));
}

// One slot of the combine: acc + w * y, rounded after the product and after the sum (never fused).
template <class Math>
MOEKIT_HD inline float combine_step(float acc, float w, float y) {
  return Math::add(acc, Math::mul(w, y));
}

// The shared experts' gate (Qwen2-MoE's shared_expert_gate): weight sigmoid(h . g) of a token's
// hidden row h and the gate g, K bf16 values each, the dot in fp32 in one fixed order on every
// device: 32 lane partials (lane l sums columns l, l + 32, l + 64, ... by fma, in order), then a
// butterfly over the lanes (offsets 16, 8, 4, 2, 1: a warp's xor shuffles).
inline constexpr int kSharedGateLanes = 32;

template <class Math>
MOEKIT_HD inline float shared_gate_lane(float acc, float h, float g) {
  return Math::fma(h, g, acc);
}

// The butterfly on one thread: lanes[0] ends with what every lane of the warp holds.
template <class Math>
MOEKIT_HD inline float shared_gate_reduce(float (&lanes)[kSharedGateLanes]) {
  for (int offset = kSharedGateLanes / 2; offset > 0; offset /= 2) {
    float next[kSharedGateLanes];
    for (int l = 0; l < kSharedGateLanes; ++l) next[l] = Math::add(lanes[l], lanes[l ^ offset]);
    for (int l = 0; l < kSharedGateLanes; ++l) lanes[l] = next[l];
  }
  return lanes[0];
}

}  // namespace moekit::numerics
