// The MoE activations on the CPU (float, from bf16 W1 outputs) and their float64 reference.
// One formula per activation, written once as a template so the float kernel and the double
// reference cannot drift apart; they differ only in the precision they evaluate it in.
#include "cpu/activation.h"

#include <algorithm>
#include <cmath>

#include "moekit/check.h"

namespace moekit::cpu {
namespace {

template <typename T>
T silu(T x) {
  return x / (T(1) + std::exp(-x));
}

template <typename T>
T gelu_erf(T x) {
  return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440)));  // x / sqrt(2)
}

template <typename T>
T gelu_tanh(T x) {
  const T k_sqrt_2_over_pi = T(0.79788456080286535588);
  return T(0.5) * x * (T(1) + std::tanh(k_sqrt_2_over_pi * (x + T(0.044715) * x * x * x)));
}

// gpt-oss's clamped SwiGLU: the gate is clamped above only, the up projection on both sides.
template <typename T>
T swiglu_oai(T gate, T up) {
  const T g = std::min(gate, T(7));
  const T u = std::clamp(up, T(-7), T(7));
  return (u + T(1)) * (g / (T(1) + std::exp(T(-1.702) * g)));  // g * sigmoid(1.702 g)
}

template <typename T>
T relu2(T x) {
  const T r = std::max(x, T(0));
  return r * r;
}

// One output row of width out_dim from one input row; load(i) reads input column i as T.
template <typename T, typename Load>
void activation_row(Activation act, std::int64_t out_dim, Load load, T* out) {
  const std::int64_t I = out_dim;  // for gated activations: gate at [0, I), up at [I, 2I)
  switch (act) {
    case Activation::kSilu:
      for (std::int64_t i = 0; i < I; ++i) out[i] = silu(load(i)) * load(I + i);
      return;
    case Activation::kGelu:
      for (std::int64_t i = 0; i < I; ++i) out[i] = gelu_erf(load(i)) * load(I + i);
      return;
    case Activation::kGeluTanh:
      for (std::int64_t i = 0; i < I; ++i) out[i] = gelu_tanh(load(i)) * load(I + i);
      return;
    case Activation::kSwigluOai:
      for (std::int64_t i = 0; i < I; ++i) out[i] = swiglu_oai(load(2 * i), load(2 * i + 1));
      return;
    case Activation::kRelu2:
      for (std::int64_t i = 0; i < out_dim; ++i) out[i] = relu2(load(i));
      return;
    case Activation::kSiluNoMul:
      for (std::int64_t i = 0; i < out_dim; ++i) out[i] = silu(load(i));
      return;
  }
  MOEKIT_FAIL("activation: unknown activation {}", static_cast<int>(act));
}

}  // namespace

void activation_rows(Activation act, const bf16_t* in, std::int64_t rows, std::int64_t N, std::int64_t ld_in,
                     float* out, std::int64_t ld_out) {
  const std::int64_t out_dim = activation_out_dim(act, N);  // checks N > 0, and N even when gated
  MOEKIT_CHECK(rows >= 0, "activation_rows: rows = {} must be >= 0", rows);
  MOEKIT_CHECK(ld_in >= N, "activation_rows: input stride ld_in = {} is below N = {}; pass ld_in >= N", ld_in, N);
  MOEKIT_CHECK(ld_out >= out_dim,
               "activation_rows: output stride ld_out = {} is below the output width {} ({} of N = {})", ld_out,
               out_dim, activation_name(act), N);
  MOEKIT_CHECK(rows == 0 || (in != nullptr && out != nullptr), "activation_rows: null in or out with rows = {}", rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    const bf16_t* row = in + r * ld_in;
    activation_row<float>(
        act, out_dim, [row](std::int64_t i) { return bf16_decode(row[i]); }, out + r * ld_out);
  }
}

void activation_row_ref(Activation act, const double* in, std::int64_t N, double* out) {
  const std::int64_t out_dim = activation_out_dim(act, N);
  MOEKIT_CHECK(in != nullptr && out != nullptr, "activation_row_ref: null in or out");
  activation_row<double>(
      act, out_dim, [in](std::int64_t i) { return in[i]; }, out);
}

}  // namespace moekit::cpu
