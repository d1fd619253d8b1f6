// FP8 quantization on the CPU for each scheme; fp32 scales with x ~= fp8_decode(q) * scale.
// Dynamic scales: scale = amax / 448 over the group (amax == 0 gives scale 1), q = fp8_encode(x / scale).
// Scale layouts (the GEMMs read the same):
//   activations (rows, cols):  kPerTensor: scales[0];  kPerTokenPerChannel: scales[r];
//                              kBlock128: scales[r * ceil(cols/128) + c/128]  (1x128 groups)
//   weights (n, k), k contiguous: kPerTensor: scales[0];  kPerTokenPerChannel: scales[n] (per channel);
//                              kBlock128: scales[(n/128) * ceil(k/128) + k/128]  (128x128 blocks)
#pragma once

#include <cstdint>

#include "cpu/numerics.h"
#include "moekit/types.h"

namespace moekit::cpu {

std::int64_t activation_scale_count(QuantScheme quant, std::int64_t rows, std::int64_t cols);
std::int64_t weight_scale_count(QuantScheme quant, std::int64_t n, std::int64_t k);
// Scales owned by each activation row: 1 per token, ceil(cols/128) per 1x128 groups, 0 per-tensor
// (its one scale belongs to the whole tensor).
std::int64_t activation_scales_per_row(QuantScheme quant, std::int64_t cols);

// x: (rows, cols) with row stride ldx elements; q: row stride ldq bytes.
void quantize_activation(QuantScheme quant, const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                         fp8_t* q, std::int64_t ldq, float* scales);
void quantize_activation(QuantScheme quant, const bf16_t* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                         fp8_t* q, std::int64_t ldq, float* scales);
// w: (n, k) contiguous, q: (n, k) contiguous.
void quantize_weight(QuantScheme quant, const float* w, std::int64_t n, std::int64_t k, fp8_t* q, float* scales);

// Dequantized value of element (r, c) of an activation / weight, for references and tests.
double dequant_activation(QuantScheme quant, const fp8_t* q, std::int64_t ldq, const float* scales, std::int64_t cols,
                          std::int64_t r, std::int64_t c);
double dequant_weight(QuantScheme quant, const fp8_t* q, const float* scales, std::int64_t k, std::int64_t n_idx,
                      std::int64_t k_idx);

}  // namespace moekit::cpu
