// Expert placements (moekit/placement.h): validation, the replica tables, the default round-robin
// layout and DeepSeek's EPLB rebalancing.
#include "moekit/placement.h"

#include <algorithm>
#include <numeric>

#include "moekit/check.h"

namespace moekit {

ExpertPlacement make_placement(std::int64_t num_logical, std::vector<std::int32_t> physical_to_logical) {
  const auto num_physical = static_cast<std::int64_t>(physical_to_logical.size());
  MOEKIT_CHECK(num_logical >= 1 && num_logical <= (std::int64_t{1} << 30),
               "an expert placement needs 1 to 2^30 logical experts, got {}", num_logical);
  MOEKIT_CHECK(
      num_physical >= num_logical && num_physical <= (std::int64_t{1} << 30),
      "an expert placement of {} slots cannot hold {} logical experts (every expert needs a slot; at most 2^30)",
      num_physical, num_logical);
  ExpertPlacement pl;
  pl.num_logical = num_logical;
  std::vector<std::int32_t> replica_count(static_cast<std::size_t>(num_logical), 0);
  for (std::int64_t p = 0; p < num_physical; ++p) {
    const std::int32_t e = physical_to_logical[static_cast<std::size_t>(p)];
    MOEKIT_CHECK(e >= 0 && e < num_logical, "expert placement: slot {} holds expert {}, outside [0, {})", p, e,
                 num_logical);
    ++replica_count[static_cast<std::size_t>(e)];
  }
  for (std::int64_t e = 0; e < num_logical; ++e)
    MOEKIT_CHECK(replica_count[static_cast<std::size_t>(e)] > 0,
                 "expert placement: logical expert {} is in no slot of {}: every expert needs at least one", e,
                 num_physical);
  pl.replica_offsets.assign(static_cast<std::size_t>(num_logical + 1), 0);
  for (std::int64_t e = 0; e < num_logical; ++e)
    pl.replica_offsets[static_cast<std::size_t>(e + 1)] =
        pl.replica_offsets[static_cast<std::size_t>(e)] + replica_count[static_cast<std::size_t>(e)];
  pl.replica_slots.assign(static_cast<std::size_t>(num_physical), -1);
  std::vector<std::int32_t> filled(pl.replica_offsets.begin(), pl.replica_offsets.end() - 1);
  for (std::int64_t p = 0; p < num_physical; ++p) {  // ascending slots per expert
    const auto e = static_cast<std::size_t>(physical_to_logical[static_cast<std::size_t>(p)]);
    pl.replica_slots[static_cast<std::size_t>(filled[e]++)] = static_cast<std::int32_t>(p);
  }
  pl.physical_to_logical = std::move(physical_to_logical);
  return pl;
}

ExpertPlacement round_robin_placement(std::int64_t num_logical, std::int64_t num_physical) {
  MOEKIT_CHECK(num_logical >= 1 && num_physical >= num_logical,
               "a round-robin placement needs 1 <= logical experts ({}) <= slots ({})", num_logical, num_physical);
  std::vector<std::int32_t> map(static_cast<std::size_t>(num_physical));
  for (std::int64_t p = 0; p < num_physical; ++p)
    map[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(p % num_logical);
  return make_placement(num_logical, std::move(map));
}

std::optional<ExpertPlacement> default_placement(std::int64_t num_logical, std::int64_t num_physical) {
  if (num_physical == num_logical) return std::nullopt;
  return round_robin_placement(num_logical, num_physical);
}

std::vector<double> logical_load(const ExpertPlacement& placement, std::span<const std::int64_t> physical_counts) {
  MOEKIT_CHECK(static_cast<std::int64_t>(physical_counts.size()) == placement.num_physical(),
               "logical_load: {} counts for a placement of {} slots", physical_counts.size(), placement.num_physical());
  std::vector<double> load(static_cast<std::size_t>(placement.num_logical), 0.0);
  for (std::size_t p = 0; p < physical_counts.size(); ++p)
    load[static_cast<std::size_t>(placement.physical_to_logical[p])] += static_cast<double>(physical_counts[p]);
  return load;
}

double rank_imbalance(const ExpertPlacement& placement, std::span<const double> load, std::int64_t num_ranks) {
  const std::int64_t P = placement.num_physical();
  MOEKIT_CHECK(static_cast<std::int64_t>(load.size()) == placement.num_logical,
               "rank_imbalance: {} loads for {} logical experts", load.size(), placement.num_logical);
  MOEKIT_CHECK(num_ranks >= 1 && P % num_ranks == 0, "rank_imbalance: {} slots do not divide over {} ranks", P,
               num_ranks);
  std::vector<double> rank(static_cast<std::size_t>(num_ranks), 0.0);
  for (std::int64_t p = 0; p < P; ++p) {
    const auto e = static_cast<std::size_t>(placement.physical_to_logical[static_cast<std::size_t>(p)]);
    rank[static_cast<std::size_t>(p / (P / num_ranks))] +=
        load[e] / static_cast<double>(placement.replica_count(static_cast<std::int64_t>(e)));
  }
  const double mean = std::accumulate(rank.begin(), rank.end(), 0.0) / static_cast<double>(num_ranks);
  return mean > 0 ? *std::max_element(rank.begin(), rank.end()) / mean : 1.0;
}

namespace {

// Greedy balanced packing: `weight.size()` items into num_packs packs of weight.size() / num_packs
// items each; items by descending weight (ties to the lower index), each onto the lightest pack
// that is not full (ties to the lower pack). Returns each item's pack and its position there.
struct Packing {
  std::vector<std::int64_t> pack, position;
};
Packing balanced_packing(std::span<const double> weight, std::int64_t num_packs) {
  const auto n = static_cast<std::int64_t>(weight.size());
  const std::int64_t per_pack = n / num_packs;
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return weight[static_cast<std::size_t>(a)] > weight[static_cast<std::size_t>(b)];
  });
  Packing out{std::vector<std::int64_t>(static_cast<std::size_t>(n)),
              std::vector<std::int64_t>(static_cast<std::size_t>(n))};
  std::vector<double> load(static_cast<std::size_t>(num_packs), 0.0);
  std::vector<std::int64_t> items(static_cast<std::size_t>(num_packs), 0);
  for (const std::int64_t i : order) {
    std::int64_t best = -1;
    for (std::int64_t k = 0; k < num_packs; ++k)
      if (items[static_cast<std::size_t>(k)] < per_pack &&
          (best < 0 || load[static_cast<std::size_t>(k)] < load[static_cast<std::size_t>(best)]))
        best = k;
    out.pack[static_cast<std::size_t>(i)] = best;
    out.position[static_cast<std::size_t>(i)] = items[static_cast<std::size_t>(best)]++;
    load[static_cast<std::size_t>(best)] += weight[static_cast<std::size_t>(i)];
  }
  return out;
}

// num_slots slots for the experts of `weight`: one each, then every extra slot to the expert with
// the highest weight per replica (ties to the lower index). Returns each slot's expert; the count
// of each expert's replicas in `count`.
std::vector<std::int64_t> replicate_experts(std::span<const double> weight, std::int64_t num_slots,
                                            std::vector<std::int64_t>& count) {
  const auto n = static_cast<std::int64_t>(weight.size());
  std::vector<std::int64_t> slot_expert(static_cast<std::size_t>(num_slots));
  std::iota(slot_expert.begin(), slot_expert.begin() + n, 0);
  count.assign(static_cast<std::size_t>(n), 1);
  for (std::int64_t s = n; s < num_slots; ++s) {
    std::int64_t best = 0;
    for (std::int64_t e = 1; e < n; ++e)
      if (weight[static_cast<std::size_t>(e)] / static_cast<double>(count[static_cast<std::size_t>(e)]) >
          weight[static_cast<std::size_t>(best)] / static_cast<double>(count[static_cast<std::size_t>(best)]))
        best = e;
    slot_expert[static_cast<std::size_t>(s)] = best;
    ++count[static_cast<std::size_t>(best)];
  }
  return slot_expert;
}

}  // namespace

ExpertPlacement rebalance_experts(std::span<const double> load, std::int64_t num_physical, std::int64_t num_groups,
                                  std::int64_t num_nodes, std::int64_t num_ranks) {
  const auto E = static_cast<std::int64_t>(load.size());
  MOEKIT_CHECK(E >= 1 && num_physical >= E,
               "rebalance_experts: {} slots for {} logical experts (need slots >= experts >= 1)", num_physical, E);
  MOEKIT_CHECK(
      num_ranks >= 1 && num_nodes >= 1 && num_ranks % num_nodes == 0 && num_physical % num_ranks == 0,
      "rebalance_experts: {} slots over {} ranks on {} nodes: ranks must divide over nodes and slots over ranks",
      num_physical, num_ranks, num_nodes);
  MOEKIT_CHECK(num_groups >= 1 && E % num_groups == 0, "rebalance_experts: {} experts do not divide into {} groups", E,
               num_groups);
  for (std::int64_t e = 0; e < E; ++e)
    MOEKIT_CHECK(load[static_cast<std::size_t>(e)] >= 0, "rebalance_experts: expert {} has load {} (must be >= 0)", e,
                 load[static_cast<std::size_t>(e)]);
  if (num_groups % num_nodes != 0) num_groups = num_nodes = 1;  // global balancing
  const std::int64_t group_size = E / num_groups, groups_per_node = num_groups / num_nodes;
  const std::int64_t experts_per_node = E / num_nodes, slots_per_node = num_physical / num_nodes;
  const std::int64_t ranks_per_node = num_ranks / num_nodes, slots_per_rank = num_physical / num_ranks;
  MOEKIT_CHECK(slots_per_node >= experts_per_node,
               "rebalance_experts: {} slots per node cannot hold the node's {} experts", slots_per_node,
               experts_per_node);

  // 1. Groups onto nodes. node_experts[n] lists node n's logical experts in group order.
  std::vector<double> group_load(static_cast<std::size_t>(num_groups), 0.0);
  for (std::int64_t e = 0; e < E; ++e)
    group_load[static_cast<std::size_t>(e / group_size)] += load[static_cast<std::size_t>(e)];
  const Packing groups = balanced_packing(group_load, num_nodes);
  std::vector<std::int64_t> node_expert(
      static_cast<std::size_t>(E));  // node n's experts at [n * experts_per_node, ...)
  for (std::int64_t g = 0; g < num_groups; ++g) {
    const std::int64_t base =
        (groups.pack[static_cast<std::size_t>(g)] * groups_per_node + groups.position[static_cast<std::size_t>(g)]) *
        group_size;
    for (std::int64_t j = 0; j < group_size; ++j) node_expert[static_cast<std::size_t>(base + j)] = g * group_size + j;
  }

  std::vector<std::int32_t> physical_to_logical(static_cast<std::size_t>(num_physical));
  for (std::int64_t n = 0; n < num_nodes; ++n) {
    // 2. The node's slots: one per expert, the extra ones to the hottest per replica.
    std::vector<double> w(static_cast<std::size_t>(experts_per_node));
    for (std::int64_t j = 0; j < experts_per_node; ++j)
      w[static_cast<std::size_t>(j)] =
          load[static_cast<std::size_t>(node_expert[static_cast<std::size_t>(n * experts_per_node + j)])];
    std::vector<std::int64_t> count;
    const std::vector<std::int64_t> slot_expert = replicate_experts(w, slots_per_node, count);
    // 3. The node's slots onto its ranks by load per replica.
    std::vector<double> slot_load(static_cast<std::size_t>(slots_per_node));
    for (std::int64_t s = 0; s < slots_per_node; ++s) {
      const auto j = static_cast<std::size_t>(slot_expert[static_cast<std::size_t>(s)]);
      slot_load[static_cast<std::size_t>(s)] = w[j] / static_cast<double>(count[j]);
    }
    const Packing ranks = balanced_packing(slot_load, ranks_per_node);
    for (std::int64_t s = 0; s < slots_per_node; ++s) {
      const std::int64_t p = (n * ranks_per_node + ranks.pack[static_cast<std::size_t>(s)]) * slots_per_rank +
                             ranks.position[static_cast<std::size_t>(s)];
      physical_to_logical[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(
          node_expert[static_cast<std::size_t>(n * experts_per_node + slot_expert[static_cast<std::size_t>(s)])]);
    }
  }
  return make_placement(E, std::move(physical_to_logical));
}

}  // namespace moekit
