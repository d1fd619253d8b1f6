// The MoE activations on the CPU. Gated ones read a W1 output row of N = 2*I columns and write I:
//   silu:      silu(g) * u           gelu: gelu_erf(g) * u       gelu_tanh: gelu_tanh(g) * u
//   with g = x[0:I] (gate) and u = x[I:2I] (up);
//   swigluoai (gpt-oss): g = x[2i], u = x[2i+1] (interleaved); g = min(g, 7), u = clamp(u, -7, 7);
//              out = (u + 1) * g * sigmoid(1.702 * g)
// Non-gated ones map N columns to N: relu2: max(x, 0)^2; silu_no_mul: silu(x).
#pragma once

#include <cstdint>

#include "cpu/numerics.h"
#include "moekit/types.h"

namespace moekit::cpu {

// in: rows of N bf16 values (stride ld_in); out: rows of activation_out_dim(act, N) floats (stride ld_out).
void activation_rows(Activation act, const bf16_t* in, std::int64_t rows, std::int64_t N, std::int64_t ld_in,
                     float* out, std::int64_t ld_out);
// float64 reference of one output row from one input row of N doubles.
void activation_row_ref(Activation act, const double* in, std::int64_t N, double* out);

}  // namespace moekit::cpu
