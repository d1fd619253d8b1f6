// The MoE activations on the CPU, from 16-bit W1 outputs to float, and their float64 reference; the
// formulas and the W1 row layouts are numerics/activation.h, shared with the CUDA kernels.
#pragma once

#include <cstdint>

#include "moekit/types.h"
#include "numerics/fp8.h"

namespace moekit::cpu {

using namespace numerics;

// in: rows of N 16-bit values (stride ld_in) in the recipe's intermediate dtype (bf16; fp16 for the
// fp16 recipe), in the W1 row layout of (act, quant) (numerics::w1_rows:
// block128 pairs gate and up per 128-row block); out: rows of activation_out_dim(act, N) floats
// (stride ld_out). swiglu: swigluoai's clamp and alpha (MoeProblem::swiglu; validate_swiglu).
void activation_rows(Activation act, const bf16_t* in, std::int64_t rows, std::int64_t N, std::int64_t ld_in,
                     float* out, std::int64_t ld_out, QuantScheme quant = QuantScheme::kPerTokenPerChannel,
                     SwigluOaiParams swiglu = {});
// The same from fp32 W1 outputs (the fused W1: plan::fuses_w1, no bf16 rounding in between).
void activation_rows(Activation act, const float* in, std::int64_t rows, std::int64_t N, std::int64_t ld_in, float* out,
                     std::int64_t ld_out, QuantScheme quant, SwigluOaiParams swiglu = {});
// float64 reference of one output row from one input row of N doubles.
void activation_row_ref(Activation act, const double* in, std::int64_t N, double* out,
                        QuantScheme quant = QuantScheme::kPerTokenPerChannel, SwigluOaiParams swiglu = {});

}  // namespace moekit::cpu
