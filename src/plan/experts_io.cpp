// The experts' input and output buffers of each format: what every prepare/finalize of the format
// declares and fills, the same for every experts implementation of the format.
#include "moekit/check.h"
#include "moekit/prepare_finalize.h"
#include "moekit/recipe.h"
#include "numerics/scales.h"

namespace moekit {

// A recipe without activation scales (bf16, fp16) declares no a1q_scale (not an empty one): the prepares
// and experts read the row's activation_scales before they ask for it.
void declare_experts_io(const MoeProblem& p, WorkspaceBuilder& b) {
  const RecipeInfo recipe = recipe_info(p.quant);
  const DType a1q_dtype = recipe.activation_dtype;
  const bool scaled = has_activation_scales(recipe);
  if (p.format == ActivationFormat::kBatchedExperts) {
    b.add({"a1q",
           a1q_dtype,
           {p.E_local, p.M, p.K},
           Stage::kPrepare,
           Stage::kGemm1,
           "dispatched tokens (the recipe's operand dtype), M rows per local expert, rows >= expert_num_tokens[e] are "
           "padding"});
    if (scaled)
      b.add({"a1q_scale", DType::kFp32, numerics::activation_scale_shape(p.quant, {p.E_local, p.M}, p.K, true),
             Stage::kPrepare, Stage::kGemm1, "scales of a1q"});
    b.add({"expert_num_tokens",
           DType::kInt32,
           {p.E_local},
           Stage::kPrepare,
           Stage::kFinalize,
           "valid rows m_e of each local expert, on the experts' device"});
    b.add({"expert_output",
           recipe.output_dtype,
           {p.E_local, p.M, p.K},
           Stage::kGemm2,
           Stage::kFinalize,
           "experts' output (E_local, M, K): valid rows are the result, the rest padding"});
    return;
  }
  b.add({"a1q",
         a1q_dtype,
         {p.M, p.K},
         Stage::kPrepare,
         Stage::kGemm1,
         "tokens (the recipe's operand dtype) in token order"});
  if (scaled)
    b.add({"a1q_scale", DType::kFp32, numerics::activation_scale_shape(p.quant, {p.M}, p.K, false), Stage::kPrepare,
           Stage::kGemm1, "scales of a1q"});
}

}  // namespace moekit
