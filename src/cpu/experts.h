// The CPU experts: W1 -> activation -> FP8 quantization -> W2 with fp32 accumulation and bf16
// output, for both activation formats, touching valid rows only. Their workspace comes from the
// same declarations `moekit plan` prints (plan/experts_workspace.h). Also the local experts'
// seeded random weights and a float64 reference of one (token, expert) row for checks.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/numerics.h"
#include "cpu/thread_pool.h"
#include "moekit/problem.h"
#include "plan/experts_workspace.h"

namespace moekit::cpu {

// Local experts' FP8 weights: W1 (E_local, N, K) and W2 (E_local, K, I), K contiguous, with scales
// laid out as cpu/quant.h says for (N, K) and (K, I) per expert.
struct ExpertWeights {
  std::int64_t E_local = 0, N = 0, K = 0, I = 0;
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  std::vector<fp8_t> w1, w2;
  std::vector<float> w1_scales, w2_scales;
  std::int64_t w1_scale_stride = 0, w2_scale_stride = 0;  // scales per expert
};

// Global expert g = first_expert + e is drawn from its own stream (seed, g), so every layout of the
// same model sees the same expert. W1 ~ N(0, 1/K), W2 ~ N(0, 1/I): outputs of order one.
ExpertWeights make_random_weights(const MoeProblem& problem, std::int64_t first_expert, std::uint64_t seed,
                                  ThreadPool& pool);

// BatchedExperts: a1q (E_local, M, K) with scales (plan::activation_scale_shape(quant, {E_local, M},
// K, true)), expert_num_tokens (E_local) -> output (E_local, M, K) bf16, rows < m_e only.
// m_e outside [0, M] raises moekit::Error before anything is written.
void batched_experts(const MoeProblem& problem, const ExpertWeights& weights, const fp8_t* a1q, const float* a1q_scale,
                     const std::int32_t* expert_num_tokens, bf16_t* output, const plan::BatchedFp8Workspace& ws,
                     ThreadPool& pool);

// Standard: a1q (T, K) with scales (activation_scale_shape(quant, {T}, K, false)), topk_ids (T, topk)
// holding local expert ids (or -1: not here), topk_weights (T, topk), T <= M -> output (T, K) bf16:
// out[t] = bf16(sum over slots k in order of w[t,k] * y[t,k]) with fp32 accumulation.
void standard_experts(const MoeProblem& problem, const ExpertWeights& weights, std::int64_t T, const fp8_t* a1q,
                      const float* a1q_scale, const std::int32_t* topk_ids, const float* topk_weights, bf16_t* output,
                      const plan::StandardFp8Workspace& ws, ThreadPool& pool);

// out[t] = bf16(sum over slots k in order of w[t,k] * y(t,k)) with fp32 accumulation and one
// rounding: the one combine formula of both formats, so their outputs agree bit for bit. Row
// y(t,k) is rows + row_of[t*topk + k] * K (row_of == nullptr: row t*topk + k; -1: slot skipped).
void combine_topk(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights, const bf16_t* rows,
                  const std::int64_t* row_of, bf16_t* output, ThreadPool& pool);

// float64 reference of one row through expert e on the same quantized operands: dequantized a1q row
// -> W1 (rounded to bf16, as the recipe stores w1_out) -> activation -> the same FP8 requantization
// of the activation (mirrored in double) -> W2. a1q_row_scale points at this row's scales
// (per-tensor: the one scale). Per-tensor activation scales span all rows, which one row cannot
// know: pass the tensor's act scale there (the kernels' amax is checked by the quant tests).
void expert_row_ref(const MoeProblem& problem, const ExpertWeights& weights, std::int64_t e, const fp8_t* a1q_row,
                    const float* a1q_row_scale, double* y, float per_tensor_act_scale = 0.0f);

}  // namespace moekit::cpu
