// Redundant experts on the CPU: the router's logical expert ids become slot ids, in place, by the
// replica rule (plan/placement_rule.h), and each slot's pairs are counted. Mirrors
// cuda/placement.h; both give the same ids and counts.
#pragma once

#include <cstdint>

#include "plan/placement_rule.h"

namespace moekit::cpu {

// ids (num_tokens, topk) of this rank's step; token t's pairs take the replica of
// token_base + t (token_base = the chunk's first token in the call + the rank). A pair that names a
// slot adds one to tables.load[slot] (when tables.load is set).
void place_experts(std::int32_t* ids, std::int64_t num_tokens, std::int64_t topk, std::int64_t token_base,
                   const plan::PlacementTables& tables);

}  // namespace moekit::cpu
