// Redundant experts (EPLB). With local_experts above E / ep the ranks hold E_physical = E_local * ep
// expert slots ("physical experts"): slot p lives on rank p / E_local as its local expert
// p % E_local and holds the weights of logical expert physical_to_logical[p]. Every logical expert
// has at least one slot; a hot expert has several, and its (token, expert) pairs are spread over
// them by the replica rule (plan/placement_rule.h), the same on every device:
//   replica = (token + rank) mod (e's replica count),  slot = e's replica-th slot, ascending
// with `token` the token's index in the forward call on this rank. A replica holds the same weights
// as its expert, so the placement changes where rows are computed, never what: the output equals
// the unreplicated layer's (batched format, per-token or block128 activation scales).
//
// Per-slot load counts, summed over ranks and replicas (logical_load), are the logical experts'
// loads that rebalance_experts (DeepSeek's EPLB) turns into a new placement.
// The runtime (moekit/runtime.h) runs a layer's placement (LayerWeights::placement; round robin by
// default where the ranks hold more slots than E): the router's ids become slot ids before the
// dispatch, each slot's pairs are counted (MoeRuntime::expert_load), and replace_layer installs a
// rebalanced placement where the step reads it (a captured CUDA graph replays it).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace moekit {

struct ExpertPlacement {
  std::int64_t num_logical = 0;
  std::vector<std::int32_t> physical_to_logical;  // (E_physical)
  // Derived by make_placement: logical expert e's slots, ascending, are
  // replica_slots[replica_offsets[e] .. replica_offsets[e + 1]) (sizes fixed by E and E_physical, so
  // a new placement of the same layer fits the same device tables).
  std::vector<std::int32_t> replica_offsets;  // (num_logical + 1)
  std::vector<std::int32_t> replica_slots;    // (E_physical)

  std::int64_t replica_count(std::int64_t e) const {
    return replica_offsets[static_cast<std::size_t>(e + 1)] - replica_offsets[static_cast<std::size_t>(e)];
  }
  std::int64_t num_physical() const { return static_cast<std::int64_t>(physical_to_logical.size()); }
  bool operator==(const ExpertPlacement&) const = default;
};

// Validates (every entry a logical expert in [0, num_logical), every logical expert in some slot)
// and derives the replica tables; raises moekit::Error naming the slot or the expert.
ExpertPlacement make_placement(std::int64_t num_logical, std::vector<std::int32_t> physical_to_logical);

// The default placement of num_physical >= num_logical slots: slot p holds expert p mod num_logical
// (the first num_logical slots are the unreplicated layout, the rest replicate experts 0, 1, ...).
ExpertPlacement round_robin_placement(std::int64_t num_logical, std::int64_t num_physical);

// The placement of a layer registered without one (MoeRuntime::add_layer, `moekit run`): the round
// robin where the slots outnumber the experts, none (slot = expert) where they are equal.
std::optional<ExpertPlacement> default_placement(std::int64_t num_logical, std::int64_t num_physical);

// The logical experts' loads from per-slot counts (summed over the ranks): load[e] = the sum of
// the counts of e's slots.
std::vector<double> logical_load(const ExpertPlacement& placement, std::span<const std::int64_t> physical_counts);

// max / mean of the per-rank load when each logical expert's load is split evenly over its replicas
// (what the replica rule approaches over many tokens), ranks holding num_physical / num_ranks slots.
double rank_imbalance(const ExpertPlacement& placement, std::span<const double> load, std::int64_t num_ranks);

// DeepSeek's EPLB (the algorithm published with DeepSeek-V3, implemented here from its
// description): given each logical expert's load, choose num_physical slots over num_ranks ranks.
// Hierarchical when num_groups (the router's expert groups, n_group) divides over num_nodes: the
// groups are packed onto nodes by load (each node the same number of groups), then within each
// node the hot experts get the extra slots (each extra slot to the expert with the highest load
// per replica), then the node's slots are packed onto its ranks by load per replica (each rank the
// same number of slots). Otherwise the same with one group and one node (global balancing).
// Packing is greedy: items by descending load (ties to the lower index) onto the least-loaded pack
// that is not full (ties to the lower pack). Raises moekit::Error for sizes that do not divide.
ExpertPlacement rebalance_experts(std::span<const double> load, std::int64_t num_physical, std::int64_t num_groups,
                                  std::int64_t num_nodes, std::int64_t num_ranks);

}  // namespace moekit
