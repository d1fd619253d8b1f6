// The float64 layer reference (check/reference.h). Napkin math: 2 * (N*K + K*I) double MACs per
// (token, expert) row, 88 M for DeepSeek-V3: ~30 ms a row on one core, spread over the pool.
#include "check/reference.h"

#include <algorithm>
#include <cmath>

#include "cpu/activation.h"
#include "cpu/expert_pipeline.h"
#include "cpu/gemm.h"
#include "cpu/quant.h"
#include "cpu/routing.h"
#include "moekit/check.h"
#include "numerics/scales.h"
#include "plan/gemm_config.h"

namespace moekit::check {

using namespace numerics;

double LayerError::relative() const {
  return norm_sq > 0 ? std::sqrt(err_sq / norm_sq) : 0.0;
}

void activation_ref(const MoeProblem& p, const ExpertWeightsView& w, const std::uint8_t* a1q_row,
                    const float* a1q_row_scale, double* act) {
  std::vector<double> h(static_cast<std::size_t>(p.N));
  cpu::expert_gemm_ref(p, w, 1, 0, 1, a1q_row, a1q_row_scale, h.data());
  // The recipe stores the W1 output in its intermediate dtype (w1_out: bf16, fp16 for fp16); mirror
  // that rounding so the reference measures the kernels, not the recipe's choice of intermediate
  // precision. The fused W1 (plan::fuses_w1) feeds its fp32 output to the activation: no rounding there.
  const bool fp16_w1_out = recipe_info(p.quant).intermediate_dtype == DType::kFp16;
  if (!plan::fuses_w1(p))
    for (auto& x : h) x = static_cast<double>(decode16(encode16(static_cast<float>(x), fp16_w1_out), fp16_w1_out));
  cpu::activation_row_ref(p.activation, h.data(), p.N, act, p.quant, p.swiglu);
}

void w2_ref(const MoeProblem& p, const ExpertWeightsView& w, const double* act, float per_tensor_scale, double* y) {
  const std::int64_t I = p.I();
  if (!recipe_info(p.quant).requantizes_intermediate) {
    // The recipe stores the activation's output in its operand dtype (region act) and W2 reads it as it is.
    const bool fp16 = recipe_info(p.quant).activation_dtype == DType::kFp16;
    std::vector<std::uint16_t> a(static_cast<std::size_t>(I));
    for (std::int64_t c = 0; c < I; ++c) a[static_cast<std::size_t>(c)] = encode16(static_cast<float>(act[c]), fp16);
    cpu::expert_gemm_ref(p, w, 2, 0, 1, reinterpret_cast<const std::uint8_t*>(a.data()), nullptr, y);
    return;
  }
  const std::int64_t spr = std::max<std::int64_t>(activation_scales_per_row(p.quant, I), 1);
  const std::int64_t group = numerics::activation_scale_group(p.quant, I);
  std::vector<fp8_t> q(static_cast<std::size_t>(I));
  std::vector<float> scales(static_cast<std::size_t>(spr));
  for (std::int64_t g = 0; g < spr; ++g) {
    const std::int64_t c0 = g * group, c1 = std::min(I, c0 + group);
    double amax = 0;
    for (std::int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(act[c]));
    const float scale =
        numerics::activation_scale_per_tensor(p.quant) ? per_tensor_scale : fp8_scale(static_cast<float>(amax));
    scales[static_cast<std::size_t>(g)] = scale;
    for (std::int64_t c = c0; c < c1; ++c)
      q[static_cast<std::size_t>(c)] = fp8_encode(static_cast<float>(act[c] / scale));
  }
  cpu::fp8_gemm_ref(cpu::expert_gemm(p, w, 2, 0, 1, q.data(), scales.data(), nullptr), y, p.K);
}

LayerReference::LayerReference(const ModelConfig& model, const MoeProblem& problem, const float* routing_bias,
                               WeightsOf weights_of, cpu::ThreadPool& pool)
    : problem_(problem), routing_(routing_config(model)), weights_of_(std::move(weights_of)), pool_(pool) {
  if (routing_bias != nullptr) bias_.assign(routing_bias, routing_bias + problem.E);
}

void LayerReference::add(const std::uint16_t* hidden, const float* logits, std::int64_t T, std::int64_t chunk,
                         const std::uint16_t* output) {
  MOEKIT_CHECK(chunk >= 1, "LayerReference: chunk = {} must be >= 1", chunk);
  for (std::int64_t t0 = 0; t0 < T; t0 += chunk) {
    const std::int64_t tc = std::min(chunk, T - t0);
    add_chunk(hidden + t0 * problem_.K, logits + t0 * problem_.E, tc, output + t0 * problem_.K);
  }
}

void LayerReference::set_shared(const MoeProblem& shared, const ExpertWeightsView& weights, const std::uint16_t* gate) {
  MOEKIT_CHECK(shared.E == 1 && shared.topk == 1 && shared.K == problem_.K && shared.quant == problem_.quant,
               "LayerReference: {} is not the shared experts of {}", shared.describe(), problem_.describe());
  shared_ = shared;
  shared_weights_ = weights;
  shared_gate_ = gate;
}

std::vector<double> LayerReference::expert_rows(const MoeProblem& p, std::int64_t T,
                                                const std::vector<std::int32_t>& ids,
                                                const std::vector<ExpertWeightsView>& expert_of,
                                                const std::vector<std::uint8_t>& q, const std::vector<float>& qs) {
  const std::int64_t K = p.K, I = p.I(), topk = p.topk;
  const std::int64_t spr = activation_scales_per_row(p.quant, K), ab = cpu::activation_bytes(p);
  std::vector<double> act(static_cast<std::size_t>(T * topk * I));
  pool_.parallel_for(T * topk, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const std::int64_t t = i / topk;
      activation_ref(p, expert_of[static_cast<std::size_t>(i)], q.data() + t * K * ab,
                     numerics::activation_scale_per_tensor(p.quant) ? qs.data() : qs.data() + t * spr,
                     act.data() + i * I);
    }
  });
  // Per-tensor activation scales: one tensor per expert (batched) or one for the chunk (standard).
  std::vector<float> tensor_scale(static_cast<std::size_t>(T * topk), 1.0f);
  if (numerics::activation_scale_per_tensor(p.quant)) {
    const bool batched = p.format == ActivationFormat::kBatchedExperts;
    std::vector<double> amax(static_cast<std::size_t>(batched ? p.E : 1), 0.0);
    for (std::int64_t i = 0; i < T * topk; ++i) {
      double& m = amax[static_cast<std::size_t>(batched ? ids[static_cast<std::size_t>(i)] : 0)];
      for (std::int64_t c = 0; c < I; ++c) m = std::max(m, std::fabs(act[static_cast<std::size_t>(i * I + c)]));
    }
    for (std::int64_t i = 0; i < T * topk; ++i)
      tensor_scale[static_cast<std::size_t>(i)] =
          fp8_scale(static_cast<float>(amax[static_cast<std::size_t>(batched ? ids[static_cast<std::size_t>(i)] : 0)]));
  }
  std::vector<double> y(static_cast<std::size_t>(T * topk * K));
  pool_.parallel_for(T * topk, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i)
      w2_ref(p, expert_of[static_cast<std::size_t>(i)], act.data() + i * I, tensor_scale[static_cast<std::size_t>(i)],
             y.data() + i * K);
  });
  return y;
}

void LayerReference::add_chunk(const std::uint16_t* hidden, const float* logits, std::int64_t T,
                               const std::uint16_t* output) {
  const MoeProblem& p = problem_;
  const std::int64_t K = p.K, topk = p.topk;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * topk));
  std::vector<float> weights(static_cast<std::size_t>(T * topk));
  cpu::route(routing_, logits, T, bias_.empty() ? nullptr : bias_.data(), ids.data(), weights.data());
  // The tokens as the experts read them: FP8 codes and scales, or the tokens in the 16-bit operand dtype.
  std::vector<std::uint8_t> q(static_cast<std::size_t>(T * K * cpu::activation_bytes(p)));
  std::vector<float> qs(static_cast<std::size_t>(std::max<std::int64_t>(activation_scale_count(p.quant, T, K), 1)));
  cpu::store_activation(p.quant, hidden, T, K, K, q.data(), K, qs.data());

  // The weights views are fetched up front (the bank may generate an expert: not from the pool's threads).
  std::vector<ExpertWeightsView> expert_of(static_cast<std::size_t>(T * topk));
  for (std::int64_t i = 0; i < T * topk; ++i)
    expert_of[static_cast<std::size_t>(i)] = weights_of_(ids[static_cast<std::size_t>(i)]);
  const std::vector<double> y = expert_rows(p, T, ids, expert_of, q, qs);
  // The shared experts see the same quantized tokens (one scheme, the same chunk).
  std::vector<double> y_shared;
  std::vector<std::int32_t> shared_ids(static_cast<std::size_t>(shared_ ? T : 0));
  std::vector<float> shared_weight(shared_ids.size());
  if (shared_) {
    cpu::route_shared(hidden, T, K, shared_gate_, shared_ids.data(), shared_weight.data());
    y_shared =
        expert_rows(*shared_, T, shared_ids, std::vector<ExpertWeightsView>(shared_ids.size(), shared_weights_), q, qs);
  }
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t c = 0; c < K; ++c) {
      double ref = 0;
      for (std::int64_t k = 0; k < topk; ++k)
        ref += static_cast<double>(weights[static_cast<std::size_t>(t * topk + k)]) *
               y[static_cast<std::size_t>((t * topk + k) * K + c)];
      if (shared_)
        ref += static_cast<double>(shared_weight[static_cast<std::size_t>(t)]) *
               y_shared[static_cast<std::size_t>(t * K + c)];
      const double out = static_cast<double>(bf16_decode(output[t * K + c]));
      if (std::isnan(out)) ++error_.nan_outputs;
      error_.err_sq += (out - ref) * (out - ref);
      error_.norm_sq += ref * ref;
    }
  }
}

}  // namespace moekit::check
