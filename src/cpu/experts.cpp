// CPU experts for both formats. Napkin math per (token, expert) row, DeepSeek-V3 shapes:
// 2*(N*K + K*I) = 2*(4096*7168 + 7168*2048) = 88 MFLOP; the weights (44 MiB per expert in FP8)
// are read once per expert per step, so cost follows the valid rows, never M.
#include "cpu/experts.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/activation.h"
#include "cpu/gemm.h"
#include "cpu/quant.h"
#include "cpu/random.h"
#include "moekit/check.h"

namespace moekit::cpu {
namespace {

void fill_normal(std::vector<float>& v, SplitMix rng, float stddev) {
  for (auto& x : v) x = rng.normal() * stddev;
}

// Activation of m rows of w1_out and its FP8 quantization into act_q / act_scale (row-local for
// per-token and 1x128 groups; per-tensor takes one amax over the expert's valid rows first).
void activation_quant(const MoeProblem& p, const bf16_t* w1_out, std::int64_t m, fp8_t* act_q, float* act_scale,
                      ThreadPool& pool) {
  const std::int64_t N = p.N, I = p.I();
  if (m == 0) return;
  if (p.quant == QuantScheme::kPerTensor) {
    std::vector<float> amax_per_chunk(static_cast<std::size_t>(pool.num_threads()) + 1, 0.0f);
    std::vector<float> row(static_cast<std::size_t>(I));
    float amax = 0;
    // Pass 1: amax (recomputed in pass 2 instead of storing fp32 rows outside the plan).
    for (std::int64_t r = 0; r < m; ++r) {
      activation_rows(p.activation, w1_out + r * N, 1, N, N, row.data(), I);
      for (float x : row) amax = std::max(amax, std::fabs(x));
    }
    const float scale = amax > 0 ? amax / kFp8Max : 1.0f;
    act_scale[0] = scale;
    pool.parallel_for(m, [&](std::int64_t r0, std::int64_t r1) {
      std::vector<float> buf(static_cast<std::size_t>(I));
      for (std::int64_t r = r0; r < r1; ++r) {
        activation_rows(p.activation, w1_out + r * N, 1, N, N, buf.data(), I);
        for (std::int64_t c = 0; c < I; ++c) act_q[r * I + c] = fp8_encode(buf[static_cast<std::size_t>(c)] / scale);
      }
    });
    return;
  }
  const std::int64_t spr = activation_scales_per_row(p.quant, I);
  pool.parallel_for(m, [&](std::int64_t r0, std::int64_t r1) {
    std::vector<float> buf(static_cast<std::size_t>(I));
    for (std::int64_t r = r0; r < r1; ++r) {
      activation_rows(p.activation, w1_out + r * N, 1, N, N, buf.data(), I);
      quantize_activation(p.quant, buf.data(), 1, I, I, act_q + r * I, I, act_scale + r * spr);
    }
  });
}

Fp8GemmArgs gemm_args(const MoeProblem& p, std::int64_t m, std::int64_t n, std::int64_t k, const fp8_t* A,
                      const float* a_scales, const fp8_t* B, const float* b_scales, bf16_t* D) {
  Fp8GemmArgs g;
  g.M = m;
  g.N = n;
  g.K = k;
  g.quant = p.quant;
  g.A = A;
  g.lda = k;
  g.a_scales = a_scales;
  g.B = B;
  g.ldb = k;
  g.b_scales = b_scales;
  g.D_bf16 = D;
  g.ldd = n;
  return g;
}

// One expert's pipeline over m contiguous rows: W1 -> activation + quant -> W2 into `out`.
void expert_rows(const MoeProblem& p, const ExpertWeights& w, std::int64_t e, std::int64_t m, const fp8_t* a1q,
                 const float* a1q_scale, bf16_t* w1_out, fp8_t* act_q, float* act_scale, bf16_t* out,
                 ThreadPool& pool) {
  if (m == 0) return;
  const std::int64_t N = p.N, K = p.K, I = p.I();
  fp8_gemm(gemm_args(p, m, N, K, a1q, a1q_scale, w.w1.data() + e * N * K, w.w1_scales.data() + e * w.w1_scale_stride,
                     w1_out),
           pool);
  activation_quant(p, w1_out, m, act_q, act_scale, pool);
  fp8_gemm(
      gemm_args(p, m, K, I, act_q, act_scale, w.w2.data() + e * K * I, w.w2_scales.data() + e * w.w2_scale_stride, out),
      pool);
}

}  // namespace

ExpertWeights make_random_weights(const MoeProblem& p, std::int64_t first_expert, std::uint64_t seed,
                                  ThreadPool& pool) {
  ExpertWeights w;
  w.E_local = p.E_local;
  w.N = p.N;
  w.K = p.K;
  w.I = p.I();
  w.quant = p.quant;
  w.w1_scale_stride = weight_scale_count(p.quant, w.N, w.K);
  w.w2_scale_stride = weight_scale_count(p.quant, w.K, w.I);
  w.w1.resize(static_cast<std::size_t>(w.E_local * w.N * w.K));
  w.w2.resize(static_cast<std::size_t>(w.E_local * w.K * w.I));
  w.w1_scales.resize(static_cast<std::size_t>(w.E_local * w.w1_scale_stride));
  w.w2_scales.resize(static_cast<std::size_t>(w.E_local * w.w2_scale_stride));
  pool.parallel_for(w.E_local, [&](std::int64_t e0, std::int64_t e1) {
    std::vector<float> tmp;
    for (std::int64_t e = e0; e < e1; ++e) {
      const auto g = static_cast<std::uint64_t>(first_expert + e);
      tmp.resize(static_cast<std::size_t>(w.N * w.K));
      fill_normal(tmp, stream(seed, 1, g), 1.0f / std::sqrt(static_cast<float>(w.K)));
      quantize_weight(w.quant, tmp.data(), w.N, w.K, w.w1.data() + e * w.N * w.K,
                      w.w1_scales.data() + e * w.w1_scale_stride);
      tmp.resize(static_cast<std::size_t>(w.K * w.I));
      fill_normal(tmp, stream(seed, 2, g), 1.0f / std::sqrt(static_cast<float>(w.I)));
      quantize_weight(w.quant, tmp.data(), w.K, w.I, w.w2.data() + e * w.K * w.I,
                      w.w2_scales.data() + e * w.w2_scale_stride);
    }
  });
  return w;
}

void batched_experts(const MoeProblem& p, const ExpertWeights& w, const fp8_t* a1q, const float* a1q_scale,
                     const std::int32_t* expert_num_tokens, bf16_t* output, const plan::BatchedFp8Workspace& ws,
                     ThreadPool& pool) {
  MOEKIT_CHECK(p.format == ActivationFormat::kBatchedExperts, "batched_experts needs the batched format, got {}",
               format_name(p.format));
  MOEKIT_CHECK(w.E_local == p.E_local && w.N == p.N && w.K == p.K && w.quant == p.quant,
               "weights (E_local={}, N={}, K={}, quant={}) do not match the problem ({})", w.E_local, w.N, w.K,
               quant_name(w.quant), p.describe());
  // Validate every count before touching anything: a bad count must not write past the buffer.
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    MOEKIT_CHECK(expert_num_tokens[e] >= 0 && expert_num_tokens[e] <= p.M,
                 "expert_num_tokens[{}] = {} is outside [0, M = {}]: the dispatch overfilled expert {}", e,
                 expert_num_tokens[e], p.M, e);
  }
  const std::int64_t N = p.N, K = p.K, I = p.I(), M = p.M;
  const std::int64_t a_spr = activation_scales_per_row(p.quant, K), act_spr = activation_scales_per_row(p.quant, I);
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = expert_num_tokens[e];
    // Per-tensor: one scale per expert; otherwise the expert's rows' scales.
    const float* a_scale = p.quant == QuantScheme::kPerTensor ? a1q_scale + e : a1q_scale + e * M * a_spr;
    float* act_scale = p.quant == QuantScheme::kPerTensor ? ws.act_scale + e : ws.act_scale + e * M * act_spr;
    expert_rows(p, w, e, m, a1q + e * M * K, a_scale, ws.w1_out + e * M * N, ws.act_q + e * M * I, act_scale,
                output + e * M * K, pool);
  }
}

void standard_experts(const MoeProblem& p, const ExpertWeights& w, std::int64_t T, const fp8_t* a1q,
                      const float* a1q_scale, const std::int32_t* topk_ids, const float* topk_weights, bf16_t* output,
                      const plan::StandardFp8Workspace& ws, ThreadPool& pool) {
  MOEKIT_CHECK(p.format == ActivationFormat::kStandard, "standard_experts needs the standard format, got {}",
               format_name(p.format));
  MOEKIT_CHECK(T >= 0 && T <= p.M, "T = {} tokens exceed the capacity M = {}: chunk the step", T, p.M);
  const std::int64_t N = p.N, K = p.K, I = p.I(), topk = p.topk, E_local = p.E_local;
  for (std::int64_t i = 0; i < T * topk; ++i)
    MOEKIT_CHECK(topk_ids[i] >= -1 && topk_ids[i] < E_local,
                 "topk_ids[{}][{}] = {} is outside [-1, E_local = {}): ids must be local expert indices", i / topk,
                 i % topk, topk_ids[i], E_local);

  // Permute: rows grouped by expert, in (token, slot) order inside each expert.
  std::vector<std::int64_t> count(static_cast<std::size_t>(E_local), 0);
  for (std::int64_t i = 0; i < T * topk; ++i)
    if (topk_ids[i] >= 0) ++count[static_cast<std::size_t>(topk_ids[i])];
  ws.expert_offsets[0] = 0;
  for (std::int64_t e = 0; e < E_local; ++e)
    ws.expert_offsets[e + 1] = ws.expert_offsets[e] + count[static_cast<std::size_t>(e)];
  std::vector<std::int64_t> cursor(ws.expert_offsets, ws.expert_offsets + E_local);
  std::vector<std::int64_t> row_of(static_cast<std::size_t>(T * topk), -1);
  const std::int64_t a_spr = activation_scales_per_row(p.quant, K), act_spr = activation_scales_per_row(p.quant, I);
  for (std::int64_t i = 0; i < T * topk; ++i) {
    const std::int32_t e = topk_ids[i];
    if (e < 0) continue;
    const std::int64_t row = cursor[static_cast<std::size_t>(e)]++;
    row_of[static_cast<std::size_t>(i)] = row;
    ws.permuted_src[row] = static_cast<std::int32_t>(i);
    const std::int64_t t = i / topk;
    std::copy_n(a1q + t * K, K, ws.a1q_permuted + row * K);
    std::copy_n(a1q_scale + t * a_spr, a_spr, ws.a1q_scale_permuted + row * a_spr);
  }
  if (p.quant == QuantScheme::kPerTensor) ws.a1q_scale_permuted[0] = a1q_scale[0];

  // W1 per expert over its rows (reads a1q_permuted, which act_q overwrites only afterwards).
  for (std::int64_t e = 0; e < E_local; ++e) {
    const std::int64_t r0 = ws.expert_offsets[e], m = ws.expert_offsets[e + 1] - r0;
    if (m == 0) continue;
    const float* a_scale =
        p.quant == QuantScheme::kPerTensor ? ws.a1q_scale_permuted : ws.a1q_scale_permuted + r0 * a_spr;
    fp8_gemm(gemm_args(p, m, N, K, ws.a1q_permuted + r0 * K, a_scale, w.w1.data() + e * N * K,
                       w.w1_scales.data() + e * w.w1_scale_stride, ws.w1_out + r0 * N),
             pool);
  }
  // Activation + quant over all permuted rows at once: they form one tensor (per-tensor keeps one
  // scale for it; the other schemes are row-local). All of it precedes W2, because w2_out aliases
  // w1_out (declared in the plan: their lifetimes do not overlap).
  activation_quant(p, ws.w1_out, ws.expert_offsets[E_local], ws.act_q, ws.act_scale, pool);
  for (std::int64_t e = 0; e < E_local; ++e) {
    const std::int64_t r0 = ws.expert_offsets[e], m = ws.expert_offsets[e + 1] - r0;
    if (m == 0) continue;
    const float* act_scale = p.quant == QuantScheme::kPerTensor ? ws.act_scale : ws.act_scale + r0 * act_spr;
    fp8_gemm(gemm_args(p, m, K, I, ws.act_q + r0 * I, act_scale, w.w2.data() + e * K * I,
                       w.w2_scales.data() + e * w.w2_scale_stride, ws.w2_out + r0 * K),
             pool);
  }
  combine_topk(T, topk, K, topk_weights, ws.w2_out, row_of.data(), output, pool);
}

void combine_topk(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights, const bf16_t* rows,
                  const std::int64_t* row_of, bf16_t* output, ThreadPool& pool) {
  pool.parallel_for(T, [&](std::int64_t t0, std::int64_t t1) {
    std::vector<float> acc(static_cast<std::size_t>(K));
    for (std::int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int64_t k = 0; k < topk; ++k) {
        const std::int64_t row = row_of ? row_of[t * topk + k] : t * topk + k;
        if (row < 0) continue;
        const float wk = topk_weights[t * topk + k];
        const bf16_t* y = rows + row * K;
        for (std::int64_t c = 0; c < K; ++c) acc[static_cast<std::size_t>(c)] += wk * bf16_decode(y[c]);
      }
      for (std::int64_t c = 0; c < K; ++c) output[t * K + c] = bf16_encode(acc[static_cast<std::size_t>(c)]);
    }
  });
}

void expert_row_ref(const MoeProblem& p, const ExpertWeights& w, std::int64_t e, const fp8_t* a1q_row,
                    const float* a1q_row_scale, double* y, float per_tensor_act_scale) {
  const std::int64_t N = p.N, K = p.K, I = p.I();
  std::vector<double> h(static_cast<std::size_t>(N)), act(static_cast<std::size_t>(I));
  Fp8GemmArgs g1 = gemm_args(p, 1, N, K, a1q_row, a1q_row_scale, w.w1.data() + e * N * K,
                             w.w1_scales.data() + e * w.w1_scale_stride, nullptr);
  fp8_gemm_ref(g1, h.data(), N);
  // The recipe stores the W1 output in bf16 (w1_out); mirror that rounding so the reference
  // measures the kernels, not the recipe's choice of intermediate precision.
  for (auto& x : h) x = static_cast<double>(bf16_decode(bf16_encode(static_cast<float>(x))));
  activation_row_ref(p.activation, h.data(), N, act.data());
  // Mirror of the fast path's FP8 requantization, from double values.
  const std::int64_t spr = std::max<std::int64_t>(activation_scales_per_row(p.quant, I), 1);
  const std::int64_t group = p.quant == QuantScheme::kBlock128 ? kQuantBlock : I;
  std::vector<fp8_t> q(static_cast<std::size_t>(I));
  std::vector<float> scales(static_cast<std::size_t>(spr));
  for (std::int64_t gidx = 0; gidx < spr; ++gidx) {
    const std::int64_t c0 = gidx * group, c1 = std::min(I, c0 + group);
    double amax = 0;
    for (std::int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(act[static_cast<std::size_t>(c)]));
    float scale = amax > 0 ? static_cast<float>(amax) / kFp8Max : 1.0f;
    if (p.quant == QuantScheme::kPerTensor) {
      MOEKIT_CHECK(per_tensor_act_scale > 0, "expert_row_ref: per-tensor needs the tensor's activation scale");
      scale = per_tensor_act_scale;
    }
    scales[static_cast<std::size_t>(gidx)] = scale;
    for (std::int64_t c = c0; c < c1; ++c)
      q[static_cast<std::size_t>(c)] = fp8_encode(static_cast<float>(act[static_cast<std::size_t>(c)] / scale));
  }
  Fp8GemmArgs g2 = gemm_args(p, 1, K, I, q.data(), scales.data(), w.w2.data() + e * K * I,
                             w.w2_scales.data() + e * w.w2_scale_stride, nullptr);
  fp8_gemm_ref(g2, y, K);
}

}  // namespace moekit::cpu
