// The regions of the experts recipe (W1 -> bf16 -> activation -> FP8 or bf16 -> W2) that every device's
// implementation of a format holds, declared once: the CPU and CUDA experts call these and add only
// what their own kernels need (GEMM arguments, scratch, status words).
#pragma once

#include <string>
#include <string_view>

#include "moekit/workspace.h"

namespace moekit::plan {

// Batched: w1_out (E_local, M, N) bf16, act_q (E_local, M, I) FP8, act_scale; a recipe that does
// not requantize (bf16) holds act (E_local, M, I) in its operand dtype and no scales. M is global
// already: nothing here multiplies it by num_dispatchers.
// w1_out = false: the W1 GEMM writes act_q / act_scale itself (the CUDA fused W1, plan::fuses_w1).
void declare_batched_recipe(const MoeProblem& problem, WorkspaceBuilder& builder, bool w1_out = true);

// Standard: expert_offsets, pair_row (the finalize's unpermute map), and the GEMM buffers aliased
// by lifetime: a1q_permuted (+ scales) with act_q (+ scales) in "gemm_in", w1_out with w2_out in
// "gemm_out"; M * topk rows (every (token, slot) may land on a local expert). Fused W1 (w1_out =
// false): act_q is born in W1, so a1q_permuted shares "gemm_in" with w2_out instead.
void declare_standard_recipe(const MoeProblem& problem, WorkspaceBuilder& builder, bool w1_out = true);

// The region the W2 GEMM reads: "act_q" where the recipe requantizes the activation, else "act".
const char* act_region(QuantScheme quant);

// Empty when `experts` on `device` has kernels for the problem's recipe (RecipeInfo::cuda_experts);
// otherwise the reason and what to run instead.
std::string recipe_unsupported(std::string_view experts, Device device, const MoeProblem& problem);

// Empty when `problem` is in the format `experts` takes; otherwise the reason.
std::string format_mismatch(std::string_view experts, ActivationFormat takes, const MoeProblem& problem);

// Why the CUDA experts refuse expert biases (MoeProblem::expert_bias) with the fused W1: its
// epilogue adds none (the unfused recipe adds W1's in the activation kernel, W2's after W2).
inline constexpr const char* kExpertBiasUnfusedOnly =
    "the model's experts have biases (gpt-oss: gate_up_proj_bias, down_proj_bias), which the CUDA experts add in "
    "the unfused recipe only: drop --fuse-w1 (fuse_w1=False)";

}  // namespace moekit::plan
