// Routing on the CPU, the kernels behind cpu::Router (the rules are moekit/router.h): route()
// scores in fp32 (what a GPU router kernel computes), route_ref() in fp64 with the same tie rules.
#pragma once

#include <cstdint>

#include "moekit/router.h"

namespace moekit::cpu {

// bias: (E) fp32 or nullptr (read only with correction_bias; nullptr = zeros).
// Router::route_shared: ids 0, weights 1 or sigmoid(hidden[t] . gate) (numerics::shared_gate_*).
void route_shared(const std::uint16_t* hidden, std::int64_t num_tokens, std::int64_t K, const std::uint16_t* gate,
                  std::int32_t* topk_ids, float* topk_weights);
void route(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
           std::int32_t* topk_ids, float* topk_weights);
// float64 reference with the same tie rules, for tests.
void route_ref(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
               std::int32_t* topk_ids, double* topk_weights);

}  // namespace moekit::cpu
