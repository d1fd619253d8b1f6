// Routing on the CPU, the kernels behind cpu::Router (the rules are moekit/router.h): route()
// scores in fp32 (what a GPU router kernel computes), route_ref() in fp64 with the same tie rules.
#pragma once

#include <cstdint>

#include "moekit/router.h"

namespace moekit::cpu {

// bias: (E) fp32 or nullptr (read only with correction_bias; nullptr = zeros).
void route(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
           std::int32_t* topk_ids, float* topk_weights);
// float64 reference with the same tie rules, for tests.
void route_ref(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
               std::int32_t* topk_ids, double* topk_weights);

}  // namespace moekit::cpu
