// The experts recipe's regions, declared once for every device (plan/experts_recipe.h), in the
// dtypes of the problem's recipe (moekit/recipe.h). A recipe without activation scales (bf16)
// declares no scale regions at all, rather than empty ones: every reader asks the row first.
// Napkin math, DeepSeek-V3 DP 32, 16 local experts, M = 8192 (batched): w1_out 16 x 8192 x 4096
// bf16 = 1 GiB, act_q 256 MiB, act_scale 512 KiB. Standard, 256 tokens, top-8: 2048 rows; w1_out
// 16 MiB shares bytes with w2_out 28 MiB, a1q_permuted 14 MiB with act_q 4 MiB. bf16: act 512 MiB
// batched; a1q_permuted 28 MiB with act 8 MiB standard.
#include "plan/experts_recipe.h"

#include <fmt/format.h>

#include "moekit/check.h"
#include "moekit/recipe.h"
#include "numerics/scales.h"

namespace moekit::plan {

using numerics::activation_scale_shape;

const char* act_region(QuantScheme quant) {
  return recipe_info(quant).requantizes_intermediate ? "act_q" : "act";
}

void declare_batched_recipe(const MoeProblem& p, WorkspaceBuilder& b, bool w1_out) {
  const std::int64_t I = p.I();
  const RecipeInfo recipe = recipe_info(p.quant);
  if (w1_out)
    b.add({"w1_out",
           recipe.intermediate_dtype,
           {p.E_local, p.M, p.N},
           Stage::kGemm1,
           Stage::kActivation,
           "W1 GEMM output (gate|up), valid rows only are written"});
  b.add({act_region(p.quant),
         recipe.activation_dtype,
         {p.E_local, p.M, I},
         Stage::kActivation,
         Stage::kGemm2,
         recipe.requantizes_intermediate ? "activation output quantized to FP8: the A operand of the W2 GEMM"
                                         : "activation output in the operand dtype: the A operand of the W2 GEMM"});
  // M is global already: no num_dispatchers here.
  if (has_activation_scales(recipe))
    b.add({"act_scale", DType::kFp32, activation_scale_shape(p.quant, {p.E_local, p.M}, I, true), Stage::kActivation,
           Stage::kGemm2, "scales of act_q"});
}

void declare_standard_recipe(const MoeProblem& p, WorkspaceBuilder& b, bool w1_out) {
  const std::int64_t I = p.I();
  const std::int64_t rows = p.M * p.topk;  // every (token, slot) pair may land on a local expert
  const RecipeInfo recipe = recipe_info(p.quant);
  MOEKIT_CHECK(rows <= 0x7FFFFFFF,
               "the standard format holds M * topk = {} rows; at most 2^31 - 1: lower "
               "max_tokens_per_rank",
               rows);
  b.add({"expert_offsets",
         DType::kInt32,
         {p.E_local + 1},
         Stage::kPrepare,
         Stage::kGemm2,
         "first permuted row of each local expert"});
  b.add({"pair_row",
         DType::kInt32,
         {rows},
         Stage::kPrepare,
         Stage::kFinalize,
         "permuted row of each (token, slot), -1 for none: the finalize's unpermute map"});
  auto a1q_permuted = [&] {
    b.add({"a1q_permuted",
           recipe.activation_dtype,
           {rows, p.K},
           Stage::kPrepare,
           Stage::kGemm1,
           "tokens (the recipe's operand dtype) grouped by local expert"});
    if (has_activation_scales(recipe))
      b.add({"a1q_scale_permuted", DType::kFp32, activation_scale_shape(p.quant, {rows}, p.K, false), Stage::kPrepare,
             Stage::kGemm1, "scales of a1q_permuted"});
  };
  const Stage act_born = w1_out ? Stage::kActivation : Stage::kGemm1;  // the fused W1 writes act_q
  auto act_q = [&] {
    b.add({act_region(p.quant),
           recipe.activation_dtype,
           {rows, I},
           act_born,
           Stage::kGemm2,
           recipe.requantizes_intermediate ? "activation output quantized to FP8"
                                           : "activation output in the operand dtype"});
    if (has_activation_scales(recipe))
      b.add({"act_scale", DType::kFp32, activation_scale_shape(p.quant, {rows}, I, false), act_born, Stage::kGemm2,
             "scales of act_q"});
  };
  auto w2_out = [&] {
    b.add({"w2_out",
           recipe.output_dtype,
           {rows, p.K},
           Stage::kGemm2,
           Stage::kFinalize,
           "W2 GEMM output per (token, slot), reduced by the finalize's combine"});
  };
  if (w1_out) {
    b.begin_alias("gemm_in");
    a1q_permuted();
    b.next_alternative();
    act_q();
    b.end_alias();
    b.begin_alias("gemm_out");
    b.add({"w1_out",
           recipe.intermediate_dtype,
           {rows, p.N},
           Stage::kGemm1,
           Stage::kActivation,
           "W1 GEMM output (gate|up)"});
    b.next_alternative();
    w2_out();
    b.end_alias();
  } else {
    // The fused W1 reads a1q_permuted while it writes act_q: those two cannot share bytes; the
    // tokens die before W2 writes its output.
    act_q();
    b.begin_alias("gemm_in");
    a1q_permuted();
    b.next_alternative();
    w2_out();
    b.end_alias();
  }
}

std::string recipe_unsupported(std::string_view experts, Device device, const MoeProblem& p) {
  const RecipeInfo recipe = recipe_info(p.quant);
  if (device != Device::kCuda || recipe.cuda_experts) return {};
  return fmt::format(
      "{} ({}) has no kernels for the {} recipe (unquantized {} operands) yet: run it with --device cpu, or quantize "
      "to FP8 with --quant per-token or --quant block128",
      experts, device_name(device), recipe.name, dtype_name(recipe.activation_dtype));
}

std::string format_mismatch(std::string_view experts, ActivationFormat takes, const MoeProblem& p) {
  if (p.format == takes) return {};
  return fmt::format("{} takes the {} format, the problem is {}", experts, format_name(takes), format_name(p.format));
}

}  // namespace moekit::plan
