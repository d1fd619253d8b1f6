// Routing on the CPU: router logits (T, E) -> topk_ids (T, topk) int32 and topk_weights (T, topk)
// fp32, experts listed by descending selection score; ties go to the lower expert index.
//   softmax:   p = softmax(logits); pick topk largest p; weights = p (divided by their sum when
//              renormalize; Mixtral, Qwen3, gpt-oss renormalize).
//   grouped (DeepSeek-V3 noaux_tc): s = sigmoid(logits); c = s + e_score_correction_bias;
//              group score = sum of its 2 largest c; keep the topk_group best groups (of n_group);
//              pick the topk largest c inside them; weights = s of those (not c), divided by their
//              sum when renormalize, times routed_scaling_factor.
#pragma once

#include <cstdint>

#include "moekit/model.h"

namespace moekit::cpu {

struct RoutingConfig {
  std::int64_t num_experts = 0;
  std::int64_t topk = 0;
  Scoring scoring = Scoring::kSoftmax;
  bool renormalize = true;
  bool grouped = false;  // DeepSeek-V3 style grouped top-k with a correction bias
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
};

RoutingConfig routing_config(const ModelConfig& model);  // validates, raises moekit::Error

// bias: (E) fp32 or nullptr (grouped only; nullptr = zeros).
void route(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
           std::int32_t* topk_ids, float* topk_weights);
// float64 reference with the same tie rules, for tests.
void route_ref(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
               std::int32_t* topk_ids, double* topk_weights);

}  // namespace moekit::cpu
