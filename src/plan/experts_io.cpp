// The experts' input and output buffers of each format: what every prepare/finalize of the format
// declares and fills, the same for every experts implementation of the format.
#include "moekit/check.h"
#include "moekit/prepare_finalize.h"
#include "moekit/recipe.h"
#include "numerics/scales.h"

namespace moekit {

void declare_experts_io(const MoeProblem& p, WorkspaceBuilder& b) {
  const DType a1q_dtype = recipe_info(p.quant).activation_dtype;
  if (p.format == ActivationFormat::kBatchedExperts) {
    b.add({"a1q",
           a1q_dtype,
           {p.E_local, p.M, p.K},
           Stage::kPrepare,
           Stage::kGemm1,
           "dispatched FP8 tokens, M rows per local expert, rows >= expert_num_tokens[e] are padding"});
    b.add({"a1q_scale", DType::kFp32, numerics::activation_scale_shape(p.quant, {p.E_local, p.M}, p.K, true),
           Stage::kPrepare, Stage::kGemm1, "scales of a1q"});
    b.add({"expert_num_tokens",
           DType::kInt32,
           {p.E_local},
           Stage::kPrepare,
           Stage::kFinalize,
           "valid rows m_e of each local expert, on the experts' device"});
    b.add({"expert_output",
           DType::kBf16,
           {p.E_local, p.M, p.K},
           Stage::kGemm2,
           Stage::kFinalize,
           "experts' output (E_local, M, K): valid rows are the result, the rest padding"});
    return;
  }
  b.add({"a1q", a1q_dtype, {p.M, p.K}, Stage::kPrepare, Stage::kGemm1, "FP8 tokens in token order"});
  b.add({"a1q_scale", DType::kFp32, numerics::activation_scale_shape(p.quant, {p.M}, p.K, false), Stage::kPrepare,
         Stage::kGemm1, "scales of a1q"});
}

}  // namespace moekit
