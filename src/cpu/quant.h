// FP8 quantization on the CPU for each scheme; fp32 scales with x ~= fp8_decode(q) * scale, the
// scale rule of numerics/fp8.h and the layouts of numerics/scales.h (the GEMMs read the same).
#pragma once

#include <cstdint>

#include "moekit/types.h"
#include "numerics/fp8.h"
#include "numerics/scales.h"

namespace moekit::cpu {

using namespace numerics;

// x: (rows, cols) with row stride ldx elements; q: row stride ldq bytes; scales:
// activation_scale_count(quant, rows, cols) floats.
void quantize_activation(QuantScheme quant, const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                         fp8_t* q, std::int64_t ldq, float* scales);
void quantize_activation(QuantScheme quant, const bf16_t* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                         fp8_t* q, std::int64_t ldq, float* scales);
// The rows a recipe's GEMM reads from bf16 or fp32 values: FP8 codes and scales for an FP8 recipe
// (quantize_activation, ldq in bytes), 16-bit values for an unquantized one (q holds the recipe's bf16
// or fp16, ldq in elements; scales untouched and may be null; bf16 input into bf16 is copied bit for
// bit, anything else rounded to nearest even; into fp16, magnitudes from 65520 up become inf, as
// torch's .half() and the model run in fp16). quantize_activation itself refuses an unquantized recipe.
void store_activation(QuantScheme quant, const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                      std::uint8_t* q, std::int64_t ldq, float* scales);
void store_activation(QuantScheme quant, const bf16_t* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                      std::uint8_t* q, std::int64_t ldq, float* scales);
// w: (n, k) contiguous, q: (n, k) contiguous.
void quantize_weight(QuantScheme quant, const float* w, std::int64_t n, std::int64_t k, fp8_t* q, float* scales);

// A weight (n, k) from fp32 in the recipe's weight dtype: FP8 codes + scales (quantize_weight), or
// 16-bit values rounded to nearest even (q holds n * k bf16 or fp16; scales untouched, may be null;
// a finite value past fp16's range is refused for fp16, naming it).
void store_weight(QuantScheme quant, const float* w, std::int64_t n, std::int64_t k, std::uint8_t* q, float* scales);

// Dequantized value of element (r, c) of an activation / weight, for references and tests.
double dequant_activation(QuantScheme quant, const fp8_t* q, std::int64_t ldq, const float* scales, std::int64_t cols,
                          std::int64_t r, std::int64_t c);
double dequant_weight(QuantScheme quant, const fp8_t* q, const float* scales, std::int64_t k, std::int64_t n_idx,
                      std::int64_t k_idx);

}  // namespace moekit::cpu
