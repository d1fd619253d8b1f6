// The CPU expert pipeline (cpu/expert_pipeline.h).
#include "cpu/expert_pipeline.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/activation.h"
#include "cpu/quant.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "numerics/scales.h"

namespace moekit::cpu {

std::int64_t activation_bytes(const MoeProblem& p) {
  return dtype_size(recipe_info(p.quant).activation_dtype);
}

SixteenBitGemmArgs expert_sixteen_bit_gemm(const MoeProblem& p, const ExpertWeightsView& w, int which, std::int64_t e,
                                           std::int64_t m, const std::uint16_t* A, std::uint16_t* D) {
  const std::int64_t n = which == 1 ? p.N : p.K, k = which == 1 ? p.K : p.I();
  const RecipeInfo recipe = recipe_info(p.quant);
  MOEKIT_CHECK(recipe_info(w.quant).weight_dtype == recipe.weight_dtype,
               "expert_sixteen_bit_gemm: the weights are {} ({}), the problem's recipe is {} ({})", quant_name(w.quant),
               dtype_name(recipe_info(w.quant).weight_dtype), recipe.name, dtype_name(recipe.weight_dtype));
  // W1 writes the intermediate, W2 the experts' output rows: both the operand dtype in the 16-bit rows.
  MOEKIT_CHECK(recipe.intermediate_dtype == recipe.activation_dtype && recipe.output_dtype == recipe.activation_dtype,
               "expert_sixteen_bit_gemm: recipe {} stores its GEMMs' outputs in another dtype than its operands",
               recipe.name);
  SixteenBitGemmArgs g;
  g.dtype = recipe.activation_dtype;
  g.M = m;
  g.N = n;
  g.K = k;
  g.A = A;
  g.lda = k;
  g.B = reinterpret_cast<const std::uint16_t*>(which == 1 ? w.w1 : w.w2) + e * n * k;
  g.ldb = k;
  const float* bias = which == 1 ? w.w1_bias : w.w2_bias;
  g.bias = bias != nullptr ? bias + e * n : nullptr;
  g.D_16 = D;
  g.ldd = n;
  return g;
}

void run_expert_gemm(const MoeProblem& p, const ExpertWeightsView& w, int which, std::int64_t e, std::int64_t m,
                     const std::uint8_t* A, const float* a_scales, std::uint16_t* D, ThreadPool& pool) {
  if (has_activation_scales(recipe_info(p.quant)))
    fp8_gemm(expert_gemm(p, w, which, e, m, A, a_scales, D), pool);
  else
    sixteen_bit_gemm(expert_sixteen_bit_gemm(p, w, which, e, m, reinterpret_cast<const std::uint16_t*>(A), D), pool);
}

void expert_gemm_ref(const MoeProblem& p, const ExpertWeightsView& w, int which, std::int64_t e, std::int64_t m,
                     const std::uint8_t* A, const float* a_scales, double* D) {
  const std::int64_t n = which == 1 ? p.N : p.K;
  if (has_activation_scales(recipe_info(p.quant)))
    fp8_gemm_ref(expert_gemm(p, w, which, e, m, A, a_scales, nullptr), D, n);
  else
    sixteen_bit_gemm_ref(expert_sixteen_bit_gemm(p, w, which, e, m, reinterpret_cast<const std::uint16_t*>(A), nullptr),
                         D, n);
}

Fp8GemmArgs expert_gemm(const MoeProblem& p, const ExpertWeightsView& w, int which, std::int64_t e, std::int64_t m,
                        const fp8_t* A, const float* a_scales, bf16_t* D) {
  const std::int64_t n = which == 1 ? p.N : p.K, k = which == 1 ? p.K : p.I();
  Fp8GemmArgs g;
  g.M = m;
  g.N = n;
  g.K = k;
  g.quant = p.quant;
  g.A = A;
  g.lda = k;
  g.a_scales = a_scales;
  g.B = which == 1 ? w.w1 + e * n * k : w.w2 + e * n * k;
  g.ldb = k;
  g.b_scales = which == 1 ? w.w1_scale + e * w.w1_scale_stride() : w.w2_scale + e * w.w2_scale_stride();
  const float* bias = which == 1 ? w.w1_bias : w.w2_bias;
  g.bias = bias != nullptr ? bias + e * n : nullptr;
  g.D_bf16 = D;
  g.ldd = n;
  return g;
}

void activation_quant(const MoeProblem& p, const bf16_t* w1_out, std::int64_t m, std::uint8_t* act_q, float* act_scale,
                      ThreadPool& pool) {
  const std::int64_t N = p.N, I = p.I();
  if (m == 0) return;
  if (!recipe_info(p.quant).requantizes_intermediate) {
    // The activation's output in the recipe's operand dtype (bf16, fp16), rounded once: the W2 GEMM's input.
    pool.parallel_for(m, [&](std::int64_t r0, std::int64_t r1) {
      std::vector<float> buf(static_cast<std::size_t>(I));
      for (std::int64_t r = r0; r < r1; ++r) {
        activation_rows(p.activation, w1_out + r * N, 1, N, N, buf.data(), I, p.quant, p.swiglu);
        store_activation(p.quant, buf.data(), 1, I, I, act_q + r * I * activation_bytes(p), I, nullptr);
      }
    });
    return;
  }
  if (numerics::activation_scale_per_tensor(p.quant)) {
    std::vector<float> row(static_cast<std::size_t>(I));
    float amax = 0;
    // Pass 1: amax (recomputed in pass 2 instead of storing fp32 rows outside the plan).
    for (std::int64_t r = 0; r < m; ++r) {
      activation_rows(p.activation, w1_out + r * N, 1, N, N, row.data(), I, p.quant, p.swiglu);
      for (float x : row) amax = std::max(amax, std::fabs(x));
    }
    const float scale = fp8_scale(amax);
    act_scale[0] = scale;
    pool.parallel_for(m, [&](std::int64_t r0, std::int64_t r1) {
      std::vector<float> buf(static_cast<std::size_t>(I));
      for (std::int64_t r = r0; r < r1; ++r) {
        activation_rows(p.activation, w1_out + r * N, 1, N, N, buf.data(), I, p.quant, p.swiglu);
        for (std::int64_t c = 0; c < I; ++c) act_q[r * I + c] = fp8_encode(buf[static_cast<std::size_t>(c)] / scale);
      }
    });
    return;
  }
  const std::int64_t spr = activation_scales_per_row(p.quant, I);
  pool.parallel_for(m, [&](std::int64_t r0, std::int64_t r1) {
    std::vector<float> buf(static_cast<std::size_t>(I));
    for (std::int64_t r = r0; r < r1; ++r) {
      activation_rows(p.activation, w1_out + r * N, 1, N, N, buf.data(), I, p.quant, p.swiglu);
      quantize_activation(p.quant, buf.data(), 1, I, I, act_q + r * I, I, act_scale + r * spr);
    }
  });
}

void declare_fused_w1_rows(const MoeProblem& p, WorkspaceBuilder& b) {
  b.add({"w1_rows",
         DType::kFp32,
         {kFusedW1Rows, p.N},
         Stage::kGemm1,
         Stage::kActivation,
         "the fused W1's fp32 output rows, a chunk at a time, straight into the activation"});
}

void fused_w1_activation_quant(const MoeProblem& p, const ExpertWeightsView& w, std::int64_t e, std::int64_t m,
                               const fp8_t* a1q, const float* a1q_scale, float* w1_rows, fp8_t* act_q, float* act_scale,
                               ThreadPool& pool) {
  const std::int64_t N = p.N, K = p.K, I = p.I();
  const std::int64_t a_spr = activation_scales_per_row(p.quant, K), spr = activation_scales_per_row(p.quant, I);
  for (std::int64_t r0 = 0; r0 < m; r0 += kFusedW1Rows) {
    const std::int64_t rows = std::min(kFusedW1Rows, m - r0);
    Fp8GemmArgs g = expert_gemm(p, w, 1, e, rows, a1q + r0 * K, a1q_scale + r0 * a_spr, nullptr);
    g.D_f32 = w1_rows;
    fp8_gemm(g, pool);
    pool.parallel_for(rows, [&](std::int64_t i0, std::int64_t i1) {
      std::vector<float> buf(static_cast<std::size_t>(I));
      for (std::int64_t r = i0; r < i1; ++r) {
        activation_rows(p.activation, w1_rows + r * N, 1, N, N, buf.data(), I, p.quant, p.swiglu);
        quantize_activation(p.quant, buf.data(), 1, I, I, act_q + (r0 + r) * I, I, act_scale + (r0 + r) * spr);
      }
    });
  }
}

void expert_rows(const MoeProblem& p, const ExpertWeightsView& w, std::int64_t e, std::int64_t m,
                 const std::uint8_t* a1q, const float* a1q_scale, bf16_t* w1_out, float* w1_rows, std::uint8_t* act_q,
                 float* act_scale, bf16_t* out, ThreadPool& pool) {
  if (m == 0) return;
  if (w1_rows != nullptr) {
    fused_w1_activation_quant(p, w, e, m, a1q, a1q_scale, w1_rows, act_q, act_scale, pool);
  } else {
    run_expert_gemm(p, w, 1, e, m, a1q, a1q_scale, w1_out, pool);
    activation_quant(p, w1_out, m, act_q, act_scale, pool);
  }
  run_expert_gemm(p, w, 2, e, m, act_q, act_scale, out, pool);
}

}  // namespace moekit::cpu
