// The MoE activations, written once for every device and precision. Gated ones read a W1 output
// row of N = 2*I columns and write I:
//   silu:      silu(g) * u           gelu: gelu_erf(g) * u       gelu_tanh: gelu_tanh(g) * u
//   with g = x[c] (gate half) and u = x[I + c] (up half);
//   swigluoai (gpt-oss): g = x[2c], u = x[2c+1] (interleaved); g = min(g, L), u = clamp(u, -L, L);
//              out = (u + 1) * (g * sigmoid(a * g)), with L and a the problem's swiglu.limit and
//              swiglu.alpha (the config's swiglu_limit and swiglu_alpha)
// Non-gated ones map N columns to N: relu2: max(x, 0)^2; silu_no_mul: silu(x); gelu_no_mul: gelu_erf(x).
// `Math` supplies exp, erf, tanh, division, min and max: HostMath (std::, IEEE division) on the CPU
// and in the float64 reference, DeviceMath (expf, __fdividef, ...) in kernels. The float kernel and
// the double reference share these lines, so they differ only in the precision they evaluate in.
#pragma once

#include <cstdint>

#include "moekit/recipe.h"
#include "moekit/types.h"
#include "numerics/host_device.h"

#if !defined(__CUDA_ARCH__)
#include <algorithm>
#include <cmath>
#endif

namespace moekit::numerics {

#if !defined(__CUDA_ARCH__)
struct HostMath {
  template <class T>
  static T exp(T x) {
    return std::exp(x);
  }
  template <class T>
  static T erf(T x) {
    return std::erf(x);
  }
  template <class T>
  static T tanh(T x) {
    return std::tanh(x);
  }
  template <class T>
  static T div(T a, T b) {
    return a / b;
  }
  // b < a ? b : a and a < b ? b : a: a NaN `a` (the formulas pass the value first, the bound
  // second) comes back as it is, so a NaN stays NaN through relu2 and swigluoai's clamps, as
  // PyTorch's relu and clamp keep it. DeviceMath follows the same rule.
  template <class T>
  static T min(T a, T b) {
    return std::min(a, b);
  }
  template <class T>
  static T max(T a, T b) {
    return std::max(a, b);
  }
  // Never fused: the CPU backend is built with -ffp-contract=off, so a * b + c rounds twice.
  template <class T>
  static T mul(T a, T b) {
    return a * b;
  }
  template <class T>
  static T add(T a, T b) {
    return a + b;
  }
  static float div_rn(float a, float b) { return a / b; }                    // IEEE division
  static float fma(float a, float b, float c) { return std::fma(a, b, c); }  // one rounding
  static float rint(float x) { return std::rint(x); }                        // ties to even
  static float ldexp(float x, int e) { return std::ldexp(x, e); }
};
#endif

#if defined(__CUDACC__)
// NOTES: __fdividef (rcp + mul) instead of IEEE division: the activation stage was ALU-bound (ncu:
// ALU 65% busy, 570 GB/s of 4.2 TB/s; docs/PERF.md). It moves silu by an ulp or two against the
// host's division, as expf already does; the tests bound the FP8 codes that flip.
struct DeviceMath {
  static __device__ __forceinline__ float exp(float x) { return expf(x); }
  static __device__ __forceinline__ float erf(float x) { return erff(x); }
  static __device__ __forceinline__ float tanh(float x) { return tanhf(x); }
  static __device__ __forceinline__ float div(float a, float b) { return __fdividef(a, b); }
  // std::min / std::max's rule, not fminf / fmaxf: those return the other operand when one is NaN,
  // which made relu2(NaN) = 0 and swigluoai's clamped NaN gate 7 on the GPU (a NaN W1 output turned
  // into a finite activation) where the CPU and PyTorch give NaN (tests/cuda/test_activation_kernels).
  static __device__ __forceinline__ float min(float a, float b) { return b < a ? b : a; }
  static __device__ __forceinline__ float max(float a, float b) { return a < b ? b : a; }
  // __fmul_rn / __fadd_rn are never contracted into an FMA by nvcc: the CPU's two roundings.
  static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }  // IEEE division
  static __device__ __forceinline__ float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
  static __device__ __forceinline__ float rint(float x) { return rintf(x); }
  static __device__ __forceinline__ float ldexp(float x, int e) { return ldexpf(x, e); }
};
#endif

template <class T, class Math>
MOEKIT_HD inline T silu(T x) {
  return Math::div(x, T(1) + Math::exp(-x));
}

template <class T, class Math>
MOEKIT_HD inline T gelu_erf(T x) {
  return T(0.5) * x * (T(1) + Math::erf(x * T(0.70710678118654752440)));  // x / sqrt(2)
}

template <class T, class Math>
MOEKIT_HD inline T gelu_tanh(T x) {
  const T k_sqrt_2_over_pi = T(0.79788456080286535588);
  return T(0.5) * x * (T(1) + Math::tanh(k_sqrt_2_over_pi * (x + T(0.044715) * x * x * x)));
}

// gpt-oss's clamped SwiGLU: the gate is clamped above only, the up projection on both sides.
template <class T, class Math>
MOEKIT_HD inline T swiglu_oai(T gate, T up, T limit, T alpha) {
  const T g = Math::min(gate, limit);
  const T u = Math::max(Math::min(up, limit), -limit);
  return (u + T(1)) * Math::div(g, T(1) + Math::exp(-alpha * g));  // g * sigmoid(alpha g)
}

template <class T, class Math>
MOEKIT_HD inline T relu2(T x) {
  const T r = Math::max(x, T(0));
  return r * r;
}

// Output column c of the activation from its gate input g and up input u (u unused when non-gated);
// swiglu: swigluoai's clamp and alpha (MoeProblem::swiglu), unused by the others.
template <class T, class Math>
MOEKIT_HD inline T activation_value(Activation act, T g, T u, SwigluOaiParams swiglu) {
  switch (act) {
    case Activation::kSilu: return silu<T, Math>(g) * u;
    case Activation::kGelu: return gelu_erf<T, Math>(g) * u;
    case Activation::kGeluTanh: return gelu_tanh<T, Math>(g) * u;
    case Activation::kSwigluOai: return swiglu_oai<T, Math>(g, u, T(swiglu.limit), T(swiglu.alpha));
    case Activation::kRelu2: return relu2<T, Math>(g);
    case Activation::kSiluNoMul: return silu<T, Math>(g);
    case Activation::kGeluNoMul: return gelu_erf<T, Math>(g);
  }
  return T(0);
}

// f.template operator()<kAct>() with the runtime activation as a compile-time constant: kernels
// whose per-value loops take the activation as a template parameter (its switch folded away) are
// chosen through this one switch.
template <class F>
MOEKIT_HD inline void with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kSilu: return f.template operator()<Activation::kSilu>();
    case Activation::kGelu: return f.template operator()<Activation::kGelu>();
    case Activation::kGeluTanh: return f.template operator()<Activation::kGeluTanh>();
    case Activation::kSwigluOai: return f.template operator()<Activation::kSwigluOai>();
    case Activation::kRelu2: return f.template operator()<Activation::kRelu2>();
    case Activation::kSiluNoMul: return f.template operator()<Activation::kSiluNoMul>();
    case Activation::kGeluNoMul: return f.template operator()<Activation::kGeluNoMul>();
  }
}

// The W1 weight's row layout (= the columns of a W1 output row), one rule for every device:
//   kHalves       gate rows [0, I), up rows [I, 2I): silu, gelu, gelu_tanh (HF's gate_proj, up_proj);
//   kBlockPairs   the same under 128x128 weight blocks (block128): per 256 rows, gate rows [128b, 128b + 128)
//                 then up rows [128b, 128b + 128), so that one 256-row W1 tile holds a whole 1x128
//                 output group with its gate and up inputs (the fused W1 epilogue: no w1_out) and
//                 each 128x128 weight block keeps its scale (the blocks are only reordered:
//                 plan/weights.h's arrange_w1_block_pairs);
//   kInterleaved  gate/up pairs (2c, 2c + 1): swigluoai (gpt-oss);
//   kSingle       one row per output: the non-gated relu2, silu_no_mul, gelu_no_mul.
enum class W1Rows : std::uint8_t { kHalves, kBlockPairs, kInterleaved, kSingle };
MOEKIT_HD constexpr W1Rows w1_rows(Activation act, QuantScheme quant) {
  return act == Activation::kSwigluOai ? W1Rows::kInterleaved
         : (act == Activation::kRelu2 || act == Activation::kSiluNoMul || act == Activation::kGeluNoMul)
             ? W1Rows::kSingle
         : recipe_info(quant).weight_scales == WeightScales::kBlock128x128 ? W1Rows::kBlockPairs
                                                                           : W1Rows::kHalves;
}
// Where output column c finds its inputs in a W1 output row of the layout.
MOEKIT_HD constexpr std::int64_t gate_column(W1Rows rows, std::int64_t /*I*/, std::int64_t c) {
  return rows == W1Rows::kInterleaved  ? 2 * c
         : rows == W1Rows::kBlockPairs ? 2 * kQuantBlock * (c / kQuantBlock) + c % kQuantBlock
                                       : c;
}
MOEKIT_HD constexpr std::int64_t up_column(W1Rows rows, std::int64_t I, std::int64_t c) {
  return rows == W1Rows::kInterleaved  ? 2 * c + 1
         : rows == W1Rows::kSingle     ? c
         : rows == W1Rows::kBlockPairs ? gate_column(rows, I, c) + kQuantBlock
                                       : I + c;
}

}  // namespace moekit::numerics
