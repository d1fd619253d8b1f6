// Expert placements (moekit/placement.h): validation and the replica tables, the replica rule, and
// DeepSeek's EPLB on skewed loads (each slot count and rank count it must respect, and the
// imbalance it must lower).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include "moekit/check.h"
#include "moekit/model.h"
#include "moekit/placement.h"
#include "plan/placement_rule.h"

namespace moekit {
namespace {

template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Placement, TablesListEachExpertsSlotsAscending) {
  const ExpertPlacement pl = make_placement(3, {2, 0, 1, 0, 2, 0});
  EXPECT_EQ(pl.num_physical(), 6);
  EXPECT_EQ(pl.replica_offsets, (std::vector<std::int32_t>{0, 3, 4, 6}));
  EXPECT_EQ(pl.replica_slots, (std::vector<std::int32_t>{1, 3, 5, 2, 0, 4}));
  EXPECT_EQ(pl.replica_count(0), 3);
  EXPECT_EQ(pl.replica_count(1), 1);
  EXPECT_EQ(round_robin_placement(3, 5).physical_to_logical, (std::vector<std::int32_t>{0, 1, 2, 0, 1}));
}

TEST(Placement, BadMapsAreRefusedNamingTheSlotOrExpert) {
  expect_error([] { make_placement(3, {0, 1, 3}); }, "slot 2 holds expert 3, outside [0, 3)");
  expect_error([] { make_placement(3, {0, 1, 1, 0}); }, "logical expert 2 is in no slot of 4");
  expect_error([] { make_placement(3, {0, 1}); }, "2 slots cannot hold 3 logical experts");
  expect_error([] { make_placement(0, {}); }, "1 to 2^30 logical experts");
  expect_error([] { round_robin_placement(4, 3); }, "logical experts (4) <= slots (3)");
}

// Consecutive tokens, and one token on consecutive ranks, take consecutive replicas; -1 stays -1;
// an id outside the logical experts becomes num_physical (refused downstream), never a slot.
TEST(Placement, ReplicaRule) {
  const ExpertPlacement pl = make_placement(2, {0, 1, 0, 0});
  auto slot = [&](std::int32_t id, std::int64_t t) {
    return plan::physical_expert(id, t, pl.replica_offsets.data(), pl.replica_slots.data(), 2, 4);
  };
  EXPECT_EQ(slot(0, 0), 0);
  EXPECT_EQ(slot(0, 1), 2);
  EXPECT_EQ(slot(0, 2), 3);
  EXPECT_EQ(slot(0, 3), 0);
  EXPECT_EQ(slot(1, 7), 1);
  EXPECT_EQ(slot(-1, 0), -1);
  EXPECT_EQ(slot(2, 0), 4);
  EXPECT_EQ(slot(-5, 0), 4);
}

// Zipf-like loads (expert e's load ~ 1 / (1 + rank of e)^1.2, shuffled): EPLB keeps every logical
// expert, fills every rank with the same number of slots, replicates only the hot experts, and
// lowers the max / mean rank load well under the unreplicated layout's. Printed for the record.
TEST(Placement, EplbLowersTheRankImbalanceOfSkewedLoads) {
  struct Case {
    std::int64_t E, physical, groups, nodes, ranks;
  };
  for (const Case c : {Case{256, 512, 8, 4, 32}, Case{256, 288, 8, 4, 32}, Case{256, 320, 8, 1, 32},
                       Case{64, 80, 1, 1, 8}, Case{16, 32, 4, 2, 4}, Case{60, 64, 3, 2, 4}}) {
    std::mt19937_64 rng(7);
    std::vector<double> load(static_cast<std::size_t>(c.E));
    for (std::int64_t e = 0; e < c.E; ++e)
      load[static_cast<std::size_t>(e)] = 1e4 / std::pow(1.0 + static_cast<double>(e), 1.2);
    std::shuffle(load.begin(), load.end(), rng);
    const ExpertPlacement plain = round_robin_placement(c.E, c.E);
    const double before = rank_imbalance(plain, load, c.ranks);
    const ExpertPlacement pl = rebalance_experts(load, c.physical, c.groups, c.nodes, c.ranks);
    ASSERT_EQ(pl.num_physical(), c.physical);
    ASSERT_EQ(pl.num_logical, c.E);  // make_placement checked every expert has a slot
    const double after = rank_imbalance(pl, load, c.ranks);
    std::printf("E %3lld slots %3lld groups %lld nodes %lld ranks %2lld: max/mean rank load %.3f -> %.3f\n",
                static_cast<long long>(c.E), static_cast<long long>(c.physical), static_cast<long long>(c.groups),
                static_cast<long long>(c.nodes), static_cast<long long>(c.ranks), before, after);
    EXPECT_LT(after, before) << "E " << c.E << " slots " << c.physical;
    // The hottest expert has the most replicas; the coldest has one.
    const auto hot = std::max_element(load.begin(), load.end()) - load.begin();
    const auto cold = std::min_element(load.begin(), load.end()) - load.begin();
    std::int64_t most = 0;
    for (std::int64_t e = 0; e < c.E; ++e) most = std::max(most, pl.replica_count(e));
    if (c.nodes == 1) {
      EXPECT_EQ(pl.replica_count(hot), most);
    }
    EXPECT_EQ(pl.replica_count(cold), 1);
  }
  // 2x slots at DeepSeek-V3's layout (the report's case: 16 slots on each of 32 ranks), the hot
  // experts all in group 0: on one node the global policy evens the ranks out; over 4 nodes the
  // hierarchical one cannot move group 0's load off its node (each group stays on one node).
  std::vector<double> load(256);
  for (std::size_t e = 0; e < load.size(); ++e) load[e] = 1e4 / std::pow(1.0 + static_cast<double>(e), 1.2);
  const double one_node = rank_imbalance(rebalance_experts(load, 512, 8, 1, 32), load, 32);
  const double four_nodes = rank_imbalance(rebalance_experts(load, 512, 8, 4, 32), load, 32);
  std::printf("hot group 0, 512 slots on 32 ranks: one node %.3f, four nodes %.3f\n", one_node, four_nodes);
  EXPECT_LT(one_node, 1.10);
  EXPECT_LT(four_nodes, rank_imbalance(round_robin_placement(256, 256), load, 32));
}

// The hierarchical policy keeps each expert group on one node: its slots all lie on that node's
// ranks.
TEST(Placement, EplbKeepsGroupsOnTheirNode) {
  std::vector<double> load(64);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> u(0, 100);
  for (double& l : load) l = u(rng);
  const ExpertPlacement pl = rebalance_experts(load, 96, 8, 4, 16);  // 8 groups of 8, 4 nodes of 4 ranks
  const std::int64_t slots_per_node = 96 / 4;
  for (std::int64_t g = 0; g < 8; ++g) {
    std::int64_t node = -1;
    for (std::int64_t p = 0; p < 96; ++p)
      if (pl.physical_to_logical[static_cast<std::size_t>(p)] / 8 == g) {
        if (node < 0) node = p / slots_per_node;
        EXPECT_EQ(p / slots_per_node, node) << "group " << g << " slot " << p;
      }
  }
  // Uniform loads replicate nothing unevenly: every rank's load is the mean.
  const std::vector<double> flat(64, 1.0);
  EXPECT_NEAR(rank_imbalance(rebalance_experts(flat, 64, 8, 4, 16), flat, 16), 1.0, 1e-12);
}

TEST(Placement, EplbRefusesSizesThatDoNotDivide) {
  const std::vector<double> load(16, 1.0);
  expect_error([&] { rebalance_experts(load, 30, 4, 2, 4); }, "30 slots over 4 ranks on 2 nodes");
  expect_error([&] { rebalance_experts(load, 32, 5, 1, 4); }, "16 experts do not divide into 5 groups");
  expect_error([&] { rebalance_experts(load, 8, 4, 1, 4); }, "8 slots for 16 logical experts");
  std::vector<double> bad = load;
  bad[3] = -1;
  expect_error([&] { rebalance_experts(bad, 32, 4, 1, 4); }, "expert 3 has load -1");
}

TEST(DefaultPlacement, RoundRobinOnlyWhereSlotsOutnumberExperts) {
  EXPECT_FALSE(default_placement(8, 8).has_value());
  const auto d = default_placement(4, 6);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->physical_to_logical, round_robin_placement(4, 6).physical_to_logical);
  expect_error([] { default_placement(4, 3); }, "1 <= logical experts (4) <= slots (3)");
}

}  // namespace
}  // namespace moekit
