// The quantization recipes, one row each: what a QuantScheme means (its name, operand dtypes, scale
// shapes, the intermediate between the GEMMs, the fused W1, accumulation, tolerance). The planner,
// the numerics (src/numerics/scales.h), the CPU and CUDA code, the loader and Python (through the
// binding's names) read these facts here; kernels still switch on the scheme to pick an instance.
// Plain constexpr: nvcc's --expt-relaxed-constexpr lets device code call recipe_info() too.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "moekit/types.h"

namespace moekit {

// How an activation tensor (rows, cols) carries its fp32 scales (numerics/scales.h has the layouts).
enum class ActivationScales : std::uint8_t {
  kNone,        // unquantized (bf16, fp16): no scales, no scale regions
  kPerTensor,   // one for the whole tensor (one per expert in the batched format)
  kPerRow,      // one per token row
  kGroup1x128,  // one per 1x128 group of a row: ceil(cols / 128) a row
};
// How a weight (n, k), k contiguous, carries its fp32 scales.
enum class WeightScales : std::uint8_t {
  kNone,              // unquantized (bf16, fp16): no scales
  kPerTensor,         // one for the whole weight
  kPerOutputChannel,  // one per row n
  kBlock128x128,      // one per 128x128 block: ceil(n / 128) * ceil(k / 128)
};

struct RecipeInfo {
  QuantScheme scheme;
  const char* name;                    // the CLI, JSON and Python spelling (parse_quant, quant_name)
  DType activation_dtype;              // a1q and act_q (act): the GEMMs' A operands, as dispatched
  DType weight_dtype;                  // w1, w2
  ActivationScales activation_scales;  // a1q's and act_q's scales (kNone: no scale regions at all)
  WeightScales weight_scales;          // w1_scale, w2_scale (kNone: none)
  DType intermediate_dtype;            // w1_out: W1's output before the activation
  DType output_dtype;                  // the experts' output rows (W2's D: expert_output, w2_out), which the
                                       // combine reads; the layer's output is bf16 whatever the recipe
  bool requantizes_intermediate;       // the activation's output is quantized again (act_q + act_scale);
                                       // else it is stored in activation_dtype as region "act"
  bool needs_block_multiple;           // K and I must be multiples of kQuantBlock
  bool block_scaled_gemm;              // GEMMs on the block-scaled configs (GemmConfigInfo::block_scaled),
                                       // else on the token-scaled ones
  bool fused_w1;                       // a fused W1 (activation + requantization in W1's epilogue) exists
  bool fast_accumulation;              // Accumulation::kFast may run (the whole K loop in the tensor cores)
  bool cuda_experts;                   // the CUDA experts have kernels for it (else they refuse it at plan time)
  double device_vs_cpu_tolerance;      // relative ||device - cpu|| / ||cpu|| (check/reference.h says why)
};

// Whether a recipe quantizes (FP8 codes with fp32 scales) or runs its operands as they are.
constexpr bool has_activation_scales(const RecipeInfo& r) {
  return r.activation_scales != ActivationScales::kNone;
}
constexpr bool has_weight_scales(const RecipeInfo& r) {
  return r.weight_scales != WeightScales::kNone;
}

// NOTES: the rows are a switch, not an array that is indexed, so that device code (numerics/scales.h
// under nvcc) can read the row of a runtime scheme; kRecipes below is the same rows as an array.
constexpr RecipeInfo recipe_info(QuantScheme quant) {
  // Two correct implementations differ by ~1.5e-2 (an FP8 code of the activation flips where bf16
  // W1 outputs sit an ulp apart); one scale over a slab moves with its largest value: 3.3e-2.
  constexpr double kDeviceVsCpu = 3e-2, kDeviceVsCpuPerTensor = 5e-2;
  // Unquantized: the two devices round the same stored values (w1_out, act, the output) to bf16, so
  // they differ where their fp32 sums (in different orders) round to neighbouring bf16s: at most
  // the output's own rounding on each side (~1.6e-3 RMS each against float64) and, rarely, one
  // bf16 ulp (2^-7) of an intermediate. 8e-3 is over twice the sum of both; an indexing or layout
  // bug gives O(1).
  // fp16 rounds its own values finer (2^-11), and the layer's output is bf16 for both: the same bound.
  constexpr double kDeviceVsCpu16 = 8e-3;
  switch (quant) {
    case QuantScheme::kPerTensor:
      return {.scheme = QuantScheme::kPerTensor,
              .name = "per-tensor",
              .activation_dtype = DType::kFp8E4m3,
              .weight_dtype = DType::kFp8E4m3,
              .activation_scales = ActivationScales::kPerTensor,
              .weight_scales = WeightScales::kPerTensor,
              .intermediate_dtype = DType::kBf16,
              .output_dtype = DType::kBf16,
              .requantizes_intermediate = true,
              .needs_block_multiple = false,
              .block_scaled_gemm = false,
              .fused_w1 = false,
              .fast_accumulation = true,
              .cuda_experts = true,
              .device_vs_cpu_tolerance = kDeviceVsCpuPerTensor};
    case QuantScheme::kPerTokenPerChannel:
      return {.scheme = QuantScheme::kPerTokenPerChannel,
              .name = "per-token",
              .activation_dtype = DType::kFp8E4m3,
              .weight_dtype = DType::kFp8E4m3,
              .activation_scales = ActivationScales::kPerRow,
              .weight_scales = WeightScales::kPerOutputChannel,
              .intermediate_dtype = DType::kBf16,
              .output_dtype = DType::kBf16,
              .requantizes_intermediate = true,
              .needs_block_multiple = false,
              .block_scaled_gemm = false,
              .fused_w1 = false,
              .fast_accumulation = true,
              .cuda_experts = true,
              .device_vs_cpu_tolerance = kDeviceVsCpu};
    case QuantScheme::kBlock128:
      return {.scheme = QuantScheme::kBlock128,
              .name = "block128",
              .activation_dtype = DType::kFp8E4m3,
              .weight_dtype = DType::kFp8E4m3,
              .activation_scales = ActivationScales::kGroup1x128,
              .weight_scales = WeightScales::kBlock128x128,
              .intermediate_dtype = DType::kBf16,
              .output_dtype = DType::kBf16,
              .requantizes_intermediate = true,
              .needs_block_multiple = true,
              .block_scaled_gemm = true,
              .fused_w1 = true,
              .fast_accumulation = false,  // its sums move into fp32 at every k-block as they are scaled
              .cuda_experts = true,
              .device_vs_cpu_tolerance = kDeviceVsCpu};
    case QuantScheme::kBf16:
      // bf16 checkpoints' own precision: tokens and weights as stored, fp32 sums, the activation's
      // output stored in bf16 (no second quantization).
      return {.scheme = QuantScheme::kBf16,
              .name = "bf16",
              .activation_dtype = DType::kBf16,
              .weight_dtype = DType::kBf16,
              .activation_scales = ActivationScales::kNone,
              .weight_scales = WeightScales::kNone,
              .intermediate_dtype = DType::kBf16,
              .output_dtype = DType::kBf16,
              .requantizes_intermediate = false,
              .needs_block_multiple = false,
              .block_scaled_gemm = false,
              .fused_w1 = false,
              .fast_accumulation = false,  // no FP8 tensor-core sums to keep short
              .cuda_experts = true,        // the configs' 16-bit instances (plan::sixteen_bit_gemm)
              .device_vs_cpu_tolerance = kDeviceVsCpu16};
    case QuantScheme::kFp16:
      // fp16 checkpoints' own precision, bf16's row in fp16: W1's output, the activation's and the
      // experts' output rows are fp16 too (vLLM's fp16 path), and overflow past 65504 is inf, as in
      // the model run in fp16. The layer takes and gives bf16 hidden states (converted at prepare,
      // summed in fp32 at combine); the ops take and give fp16.
      return {.scheme = QuantScheme::kFp16,
              .name = "fp16",
              .activation_dtype = DType::kFp16,
              .weight_dtype = DType::kFp16,
              .activation_scales = ActivationScales::kNone,
              .weight_scales = WeightScales::kNone,
              .intermediate_dtype = DType::kFp16,
              .output_dtype = DType::kFp16,
              .requantizes_intermediate = false,
              .needs_block_multiple = false,
              .block_scaled_gemm = false,
              .fused_w1 = false,
              .fast_accumulation = false,
              .cuda_experts = true,  // the configs' fp16 instances
              .device_vs_cpu_tolerance = kDeviceVsCpu16};
  }
  // Not a scheme: no name (recipe_rows_complete below refuses a scheme without a row).
  return {.scheme = quant,
          .name = nullptr,
          .activation_dtype = DType::kFp8E4m3,
          .weight_dtype = DType::kFp8E4m3,
          .activation_scales = ActivationScales::kPerTensor,
          .weight_scales = WeightScales::kPerTensor,
          .intermediate_dtype = DType::kBf16,
          .output_dtype = DType::kBf16,
          .requantizes_intermediate = false,
          .needs_block_multiple = false,
          .block_scaled_gemm = false,
          .fused_w1 = false,
          .fast_accumulation = false,
          .cuda_experts = false,
          .device_vs_cpu_tolerance = 0.0};
}

// The recipe a checkpoint without a quantization_config runs unless the user names one (quant =
// "auto"): its own precision, by config.json's torch_dtype: fp16 for "float16" (its values loaded bit
// for bit), else bf16 (bf16 values bit for bit, fp32 rounded once); FP8 is asked for (per-token,
// block128), the weights quantized at load.
inline constexpr QuantScheme kUnquantizedCheckpointQuant = QuantScheme::kBf16;
constexpr QuantScheme unquantized_checkpoint_quant(std::string_view torch_dtype) {
  return torch_dtype == "float16" ? QuantScheme::kFp16 : kUnquantizedCheckpointQuant;
}
// The recipe planned for a checkpoint in a format moekit does not run (int4, FP8 in other blocks),
// named in the plan's note: per-token FP8, which any float weights convert into.
inline constexpr QuantScheme kUnrunFormatQuant = QuantScheme::kPerTokenPerChannel;

// Every recipe, in QuantScheme order (all_quant_schemes(), the CLI's list of names).
inline constexpr int kNumRecipes = 5;
constexpr std::array<RecipeInfo, kNumRecipes> make_recipe_table() {
  std::array<RecipeInfo, kNumRecipes> rows{};
  for (int i = 0; i < kNumRecipes; ++i) rows[i] = recipe_info(static_cast<QuantScheme>(i));
  return rows;
}
inline constexpr std::array<RecipeInfo, kNumRecipes> kRecipes = make_recipe_table();

constexpr bool recipe_rows_complete() {
  for (int i = 0; i < kNumRecipes; ++i)
    if (kRecipes[i].name == nullptr || static_cast<int>(kRecipes[i].scheme) != i) return false;
  return recipe_info(static_cast<QuantScheme>(kNumRecipes)).name == nullptr;
}
static_assert(recipe_rows_complete(),
              "every QuantScheme needs a row in recipe_info(), and kNumRecipes must count them all");

// The recipe that runs FP8 weights stored with `scales` as they are stored (a checkpoint's
// quantization_config -> its recipe; the loader then moves codes and scales without requantizing).
constexpr QuantScheme recipe_for_weight_scales(WeightScales scales) {
  for (const RecipeInfo& r : kRecipes)
    if (r.weight_scales == scales && r.weight_dtype == DType::kFp8E4m3) return r.scheme;
  return kUnrunFormatQuant;  // unreachable: every layout has a recipe (static_assert below)
}
constexpr bool every_weight_scales_has_a_recipe() {
  for (const WeightScales w : {WeightScales::kPerTensor, WeightScales::kPerOutputChannel, WeightScales::kBlock128x128})
    if (recipe_info(recipe_for_weight_scales(w)).weight_scales != w) return false;
  return true;
}
static_assert(every_weight_scales_has_a_recipe(),
              "every FP8 weight scale layout a checkpoint stores needs a recipe that runs it as stored");

}  // namespace moekit
