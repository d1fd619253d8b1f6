// Scale layouts of the FP8 operands, the one definition the planner, the CPU and CUDA kernels, the
// weights view, the tests and the benchmarks read (fp32 scales, x ~= fp8_decode(q) * scale), from
// each recipe's scale rules (moekit/recipe.h: ActivationScales, WeightScales):
//   activations (rows, cols):     kPerTensor: [0] (one per tensor);  kPerRow: [r];
//                                 kGroup1x128: [r * ceil(cols/128) + c/128]
//   weights (n, k), k contiguous: kPerTensor: [0];  kPerOutputChannel: [n];
//                                 kBlock128x128: [(n/128) * ceil(k/128) + k/128]
// A batched activation buffer (E_local, M, cols) keeps one tensor per expert: per-tensor holds
// E_local scales, the others E_local * M rows' worth. An unquantized recipe (kNone) has no scales:
// every count here is 0 and a shape {0}. Callers validate shapes first (problem.h).
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/recipe.h"
#include "moekit/types.h"
#include "numerics/host_device.h"

namespace moekit::numerics {

MOEKIT_HD constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// Whether an activation tensor carries one scale for all its rows (it then needs the tensor's amax
// before any row is coded).
MOEKIT_HD constexpr bool activation_scale_per_tensor(QuantScheme quant) {
  return recipe_info(quant).activation_scales == ActivationScales::kPerTensor;
}

// Columns of a row (of `cols`) that one activation scale covers: 128 for 1x128 groups, else the row.
MOEKIT_HD constexpr std::int64_t activation_scale_group(QuantScheme quant, std::int64_t cols) {
  return recipe_info(quant).activation_scales == ActivationScales::kGroup1x128 ? kQuantBlock : cols;
}

// Scales owned by each activation row: 1 per token, ceil(cols/128) for 1x128 groups, 0 per-tensor
// (its one scale belongs to the whole tensor) and 0 unquantized.
MOEKIT_HD constexpr std::int64_t activation_scales_per_row(QuantScheme quant, std::int64_t cols) {
  const ActivationScales rule = recipe_info(quant).activation_scales;
  return rule == ActivationScales::kPerTensor || rule == ActivationScales::kNone ? 0
         : rule == ActivationScales::kPerRow                                     ? 1
                                                                                 : ceil_div(cols, kQuantBlock);
}

// Scales of one activation tensor of `rows` rows.
MOEKIT_HD constexpr std::int64_t activation_scale_count(QuantScheme quant, std::int64_t rows, std::int64_t cols) {
  return recipe_info(quant).activation_scales == ActivationScales::kPerTensor
             ? 1
             : rows * activation_scales_per_row(quant, cols);
}

// Index of the scale of activation element (r, c).
MOEKIT_HD constexpr std::int64_t activation_scale_index(QuantScheme quant, std::int64_t r, std::int64_t c,
                                                        std::int64_t cols) {
  const ActivationScales rule = recipe_info(quant).activation_scales;
  return rule == ActivationScales::kPerTensor ? 0
         : rule == ActivationScales::kPerRow  ? r
                                              : r * ceil_div(cols, kQuantBlock) + c / kQuantBlock;
}

// Scales of one (n, k) weight.
MOEKIT_HD constexpr std::int64_t weight_scale_count(QuantScheme quant, std::int64_t n, std::int64_t k) {
  const WeightScales rule = recipe_info(quant).weight_scales;
  return rule == WeightScales::kNone               ? 0
         : rule == WeightScales::kPerTensor        ? 1
         : rule == WeightScales::kPerOutputChannel ? n
                                                   : ceil_div(n, kQuantBlock) * ceil_div(k, kQuantBlock);
}

// Index of the scale of weight element (n_idx, k_idx).
MOEKIT_HD constexpr std::int64_t weight_scale_index(QuantScheme quant, std::int64_t n_idx, std::int64_t k_idx,
                                                    std::int64_t k) {
  const WeightScales rule = recipe_info(quant).weight_scales;
  return rule == WeightScales::kPerTensor ? 0
         : rule == WeightScales::kPerOutputChannel
             ? n_idx
             : (n_idx / kQuantBlock) * ceil_div(k, kQuantBlock) + k_idx / kQuantBlock;
}

#if !defined(__CUDA_ARCH__)
// Shape of the scale tensor of an activation with `cols` columns whose leading dimensions are
// `rows` ({E_local, M} batched: one tensor per expert; {rows} standard: one tensor).
inline std::vector<std::int64_t> activation_scale_shape(QuantScheme quant, std::vector<std::int64_t> rows,
                                                        std::int64_t cols, bool batched) {
  switch (recipe_info(quant).activation_scales) {
    case ActivationScales::kNone: return {0};
    case ActivationScales::kPerTensor:
      return batched ? std::vector<std::int64_t>{rows.front()} : std::vector<std::int64_t>{1};
    case ActivationScales::kPerRow: return rows;
    case ActivationScales::kGroup1x128: rows.push_back(ceil_div(cols, kQuantBlock)); return rows;
  }
  return rows;
}
#endif

}  // namespace moekit::numerics
