// The replica rule of redundant experts (moekit/placement.h), one source for every device's step
// and the tests: the pair (token, expert e) of this rank goes to e's replica
// (token + rank) mod replica_count[e]. Consecutive tokens of a rank, and the same token index on
// consecutive ranks (a decode step's one token per rank), take consecutive replicas.
#pragma once

#include <cstdint>

#include "numerics/host_device.h"

namespace moekit::plan {

// The slot of logical expert `id` for the token whose index in the call plus the rank is
// token_plus_rank, from ExpertPlacement's tables. -1 (a token the router could not route) stays -1;
// an id outside [0, num_logical) becomes num_physical, which the dispatch refuses and reports,
// never another expert.
MOEKIT_HD inline std::int32_t physical_expert(std::int32_t id, std::int64_t token_plus_rank,
                                              const std::int32_t* replica_offsets, const std::int32_t* replica_slots,
                                              std::int64_t num_logical, std::int64_t num_physical) {
  if (id == -1) return -1;
  if (id < 0 || id >= num_logical) return static_cast<std::int32_t>(num_physical);
  const std::int32_t first = replica_offsets[id], count = replica_offsets[id + 1] - first;
  return replica_slots[first + static_cast<std::int32_t>(token_plus_rank % count)];
}

// A layer's placement tables and load counts where the step reads them (host or device memory).
struct PlacementTables {
  const std::int32_t* replica_offsets = nullptr;  // (num_logical + 1)
  const std::int32_t* replica_slots = nullptr;    // (num_physical)
  std::int64_t num_logical = 0, num_physical = 0;
  unsigned long long* load = nullptr;  // (num_physical) pairs sent to each slot, accumulated
};

}  // namespace moekit::plan
