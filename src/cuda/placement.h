// Redundant experts on the GPU: the router's logical expert ids become slot ids, in place, by the
// replica rule (plan/placement_rule.h), and each slot's pairs are counted (atomics: the counts,
// not their order, are the result). Mirrors cpu/placement.h: the same ids and counts.
#pragma once

#include <cstdint>

#include "plan/placement_rule.h"

namespace moekit::cuda {

// ids (num_tokens, topk) on the device; tables (and tables.load, when set) in device memory. Token
// t's pairs take the replica of token_base + t. Launched with PDL, capturable.
void launch_place_experts(std::int32_t* ids, std::int64_t num_tokens, std::int64_t topk, std::int64_t token_base,
                          const plan::PlacementTables& tables, void* stream);

}  // namespace moekit::cuda
