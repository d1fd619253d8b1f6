// Redundant experts on the CPU (cpu/placement.h).
#include "cpu/placement.h"

namespace moekit::cpu {

void place_experts(std::int32_t* ids, std::int64_t num_tokens, std::int64_t topk, std::int64_t token_base,
                   const plan::PlacementTables& tables) {
  for (std::int64_t t = 0; t < num_tokens; ++t)
    for (std::int64_t k = 0; k < topk; ++k) {
      std::int32_t& id = ids[t * topk + k];
      id = plan::physical_expert(id, token_base + t, tables.replica_offsets, tables.replica_slots, tables.num_logical,
                                 tables.num_physical);
      if (tables.load != nullptr && id >= 0 && id < tables.num_physical) ++tables.load[id];
    }
}

}  // namespace moekit::cpu
