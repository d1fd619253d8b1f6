// One expert's pipeline on the CPU, shared by both formats: W1 GEMM into bf16 -> activation fused
// with FP8 quantization (or, for a recipe that does not requantize (bf16), stored in bf16) -> W2 GEMM; or, for the
// fused W1 (plan::fuses_w1, the recipe every device follows for block128 with block-paired W1 rows), W1 into fp32 rows
// that go straight into the activation, kFusedW1Rows rows at a time, no w1_out. Napkin math per (token, expert) row,
// DeepSeek-V3 shapes: 2*(N*K + K*I) = 2*(4096*7168 + 7168*2048) = 88 MFLOP; the weights (44 MiB per expert in FP8) are
// read once per expert per step, so cost follows the valid rows, never M.
#pragma once

#include <cstdint>

#include "cpu/gemm.h"
#include "cpu/thread_pool.h"
#include "moekit/problem.h"
#include "moekit/weights.h"
#include "moekit/workspace.h"

namespace moekit::cpu {

// GEMM arguments of A (m x k) against expert e's W1 (which = 1) or W2 (which = 2) into D (ldd = n),
// for an FP8 recipe.
Fp8GemmArgs expert_gemm(const MoeProblem& p, const ExpertWeightsView& w, int which, std::int64_t e, std::int64_t m,
                        const fp8_t* A, const float* a_scales, bf16_t* D);
// The same for an unquantized recipe (bf16 or fp16 A, weights and D, no scales).
SixteenBitGemmArgs expert_sixteen_bit_gemm(const MoeProblem& p, const ExpertWeightsView& w, int which, std::int64_t e,
                                           std::int64_t m, const std::uint16_t* A, std::uint16_t* D);
// Runs that GEMM in the recipe's operand type (RecipeInfo::activation_dtype): A holds m rows of k
// elements of it (FP8 codes with a_scales, or 16-bit values and a_scales unused); D in the recipe's
// intermediate dtype (W1) or output dtype (W2).
void run_expert_gemm(const MoeProblem& p, const ExpertWeightsView& w, int which, std::int64_t e, std::int64_t m,
                     const std::uint8_t* A, const float* a_scales, std::uint16_t* D, ThreadPool& pool);
// Its float64 reference into D (m x n doubles).
void expert_gemm_ref(const MoeProblem& p, const ExpertWeightsView& w, int which, std::int64_t e, std::int64_t m,
                     const std::uint8_t* A, const float* a_scales, double* D);

// Bytes of one element of the GEMMs' A operands (a1q, act_q / act) in `p`'s recipe.
std::int64_t activation_bytes(const MoeProblem& p);

// Activation of m rows of w1_out into the W2 GEMM's input: FP8 codes in act_q / act_scale (row-local
// for per-token and 1x128 groups; per-tensor takes one amax over all m rows first), or 16-bit values
// (bf16, fp16) in act (act_scale unused) where the recipe does not requantize.
void activation_quant(const MoeProblem& p, const bf16_t* w1_out, std::int64_t m, std::uint8_t* act_q, float* act_scale,
                      ThreadPool& pool);

// Rows of the fused W1's fp32 buffer (the CPU experts' region "w1_rows", kFusedW1Rows x N fp32).
inline constexpr std::int64_t kFusedW1Rows = 64;

// The fused W1's fp32 rows, "w1_rows" (kFusedW1Rows, N): 1 MiB at DeepSeek-V3's N = 4096.
void declare_fused_w1_rows(const MoeProblem& p, WorkspaceBuilder& b);

// The fused W1 of expert e over m contiguous rows: W1 into fp32 `w1_rows` (kFusedW1Rows x N), the
// activation from it and the FP8 quantization into act_q / act_scale.
void fused_w1_activation_quant(const MoeProblem& p, const ExpertWeightsView& w, std::int64_t e, std::int64_t m,
                               const fp8_t* a1q, const float* a1q_scale, float* w1_rows, fp8_t* act_q, float* act_scale,
                               ThreadPool& pool);

// Expert e over m contiguous rows: W1 -> activation + quant -> W2 into `out` (ldd = K). w1_out for
// the unfused recipe, w1_rows for the fused one (exactly one non-null).
// a1q and act_q hold the recipe's operand type (activation_bytes a element).
void expert_rows(const MoeProblem& p, const ExpertWeightsView& w, std::int64_t e, std::int64_t m,
                 const std::uint8_t* a1q, const float* a1q_scale, bf16_t* w1_out, float* w1_rows, std::uint8_t* act_q,
                 float* act_scale, bf16_t* out, ThreadPool& pool);

}  // namespace moekit::cpu
