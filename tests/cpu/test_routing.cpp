// Routing on the CPU: route (fp32) against route_ref (fp64) for every preset, DeepSeek-V3's grouped
// rule against an independent brute force, the tie rules, and bad input rejected with the value named.
#include "cpu/routing.h"
#include "moekit/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "error_text.h"
#include "moekit/check.h"

namespace moekit::cpu {
namespace {

std::vector<float> normal(std::size_t n, float stddev, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// Exact (fp64) scores of one token: `score` feeds the weights, `choice` the selection.
struct Scores {
  std::vector<double> score, choice;
};

Scores scores_of(const RoutingConfig& cfg, const float* x, const float* bias) {
  const auto E = static_cast<std::size_t>(cfg.num_experts);
  Scores s{std::vector<double>(E), std::vector<double>(E)};
  if (cfg.scoring == Scoring::kSoftmax) {
    const double m = *std::max_element(x, x + E);
    double sum = 0;
    for (std::size_t e = 0; e < E; ++e) sum += s.score[e] = std::exp(x[e] - m);
    for (auto& p : s.score) p /= sum;
  } else {
    for (std::size_t e = 0; e < E; ++e) s.score[e] = sigmoid(x[e]);
  }
  for (std::size_t e = 0; e < E; ++e) s.choice[e] = s.score[e] + (bias != nullptr ? bias[e] : 0.0);
  return s;
}

// Indices of `v` restricted to `candidates`, best first, ties to the lower index.
std::vector<std::int32_t> ranked(const std::vector<double>& v, std::vector<std::int32_t> candidates) {
  std::stable_sort(candidates.begin(), candidates.end(), [&](std::int32_t a, std::int32_t b) {
    return v[static_cast<std::size_t>(a)] > v[static_cast<std::size_t>(b)];
  });
  return candidates;
}

std::vector<std::int32_t> iota(std::int64_t begin, std::int64_t end) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(end - begin));
  std::iota(v.begin(), v.end(), static_cast<std::int32_t>(begin));
  return v;
}

// Group scores (sum of the two largest c, or the largest) and the groups ranked by them, computed by
// sorting.
std::vector<std::int32_t> ranked_groups(const RoutingConfig& cfg, const std::vector<double>& c,
                                        std::vector<double>* group_score) {
  const std::int64_t size = cfg.num_experts / cfg.n_group;
  group_score->assign(static_cast<std::size_t>(cfg.n_group), 0.0);
  for (std::int64_t g = 0; g < cfg.n_group; ++g) {
    const auto r = ranked(c, iota(g * size, (g + 1) * size));
    (*group_score)[static_cast<std::size_t>(g)] =
        c[static_cast<std::size_t>(r[0])] +
        (cfg.group_score == GroupScore::kTop2Sum ? c[static_cast<std::size_t>(r[1])] : 0.0);
  }
  return ranked(*group_score, iota(0, cfg.n_group));
}

// True when fp32 rounding could legitimately flip the selection or its order: two ranked values
// within `eps` at a position that matters (inside the top-k, or at the k / k+1 boundary).
bool near_tie(const std::vector<double>& v, const std::vector<std::int32_t>& order, std::int64_t k, double eps) {
  for (std::size_t j = 0; j < static_cast<std::size_t>(k) && j + 1 < order.size(); ++j) {
    if (v[static_cast<std::size_t>(order[j])] - v[static_cast<std::size_t>(order[j + 1])] < eps) return true;
  }
  return false;
}

bool token_has_near_tie(const RoutingConfig& cfg, const float* x, const float* bias, double eps) {
  const Scores s = scores_of(cfg, x, cfg.correction_bias ? bias : nullptr);
  std::vector<std::int32_t> candidates = iota(0, cfg.num_experts);
  if (cfg.n_group > 1) {
    std::vector<double> gs;
    const auto groups = ranked_groups(cfg, s.choice, &gs);
    if (near_tie(gs, groups, cfg.topk_group, eps)) return true;
    const std::int64_t size = cfg.num_experts / cfg.n_group;
    candidates.clear();
    for (std::int64_t j = 0; j < cfg.topk_group; ++j) {
      const auto g = groups[static_cast<std::size_t>(j)];
      for (std::int64_t e = g * size; e < (g + 1) * size; ++e) candidates.push_back(static_cast<std::int32_t>(e));
    }
  }
  return near_tie(s.choice, ranked(s.choice, candidates), cfg.topk, eps);
}

struct Routed {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

Routed run_route(const RoutingConfig& cfg, const std::vector<float>& logits, std::int64_t T, const float* bias) {
  // Poisoned outputs: a slot route() forgets to write stays -1 / NaN and fails the checks.
  Routed r{std::vector<std::int32_t>(static_cast<std::size_t>(T * cfg.topk), -1),
           std::vector<float>(static_cast<std::size_t>(T * cfg.topk), std::numeric_limits<float>::quiet_NaN())};
  route(cfg, logits.data(), T, bias, r.ids.data(), r.weights.data());
  return r;
}

using moekit::testing::error_of;

// Every preset: fp32 route against the fp64 reference, ids exactly, weights to 1e-5 relative.
TEST(Routing, MatchesReferenceForEveryPreset) {
  constexpr std::int64_t T = 257;
  std::uint32_t seed = 1;
  for (const auto& name : model_preset_names()) {
    const RoutingConfig cfg = routing_config(load_model(name));
    const std::int64_t E = cfg.num_experts, K = cfg.topk;
    const auto logits = normal(static_cast<std::size_t>(T * E), 2.0f, seed++);
    const auto bias = normal(static_cast<std::size_t>(E), 0.1f, seed++);
    const float* b = cfg.correction_bias ? bias.data() : nullptr;

    const Routed r = run_route(cfg, logits, T, b);
    std::vector<std::int32_t> ref_ids(static_cast<std::size_t>(T * K), -1);
    std::vector<double> ref_w(static_cast<std::size_t>(T * K), std::nan(""));
    route_ref(cfg, logits.data(), T, b, ref_ids.data(), ref_w.data());

    std::int64_t skipped = 0;
    double max_rel = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      const auto row = static_cast<std::size_t>(t * K);
      const bool same = std::equal(r.ids.begin() + static_cast<std::ptrdiff_t>(row),
                                   r.ids.begin() + static_cast<std::ptrdiff_t>(row + static_cast<std::size_t>(K)),
                                   ref_ids.begin() + static_cast<std::ptrdiff_t>(row));
      if (!same) {
        EXPECT_TRUE(token_has_near_tie(cfg, logits.data() + t * E, b, 1e-6))
            << name << ": token " << t << " differs from the reference without a near tie";
        ++skipped;
        continue;
      }
      std::set<std::int32_t> distinct;
      double sum = 0;
      for (std::size_t k = row; k < row + static_cast<std::size_t>(K); ++k) {
        ASSERT_GE(r.ids[k], 0) << name << " token " << t;
        ASSERT_LT(r.ids[k], E) << name << " token " << t;
        distinct.insert(r.ids[k]);
        const double rel = std::abs(r.weights[k] - ref_w[k]) / std::abs(ref_w[k]);
        EXPECT_LT(rel, 1e-5) << name << " token " << t << " slot " << k - row;
        max_rel = std::max(max_rel, rel);
        sum += r.weights[k];
      }
      EXPECT_EQ(distinct.size(), static_cast<std::size_t>(K)) << name << " token " << t;
      if (cfg.renormalize) {
        const double expect = cfg.routed_scaling_factor;
        EXPECT_NEAR(sum, expect, 1e-5 * expect) << name << " token " << t;
      }
    }
    EXPECT_LT(skipped * 100, T) << name << ": too many near ties skipped";
    std::printf("%-16s E=%4lld topk=%lld %-8s tokens=%lld skipped=%lld max_rel_err=%.2e\n", name.c_str(),
                static_cast<long long>(E), static_cast<long long>(K), cfg.correction_bias ? "sigmoid" : "softmax",
                static_cast<long long>(T), static_cast<long long>(skipped), max_rel);
  }
}

// DeepSeek-V3's rule, checked by sorting: chosen experts lie in the 4 groups with the highest
// top-2 sums of c, are the top 8 of c inside them, and their weights sum to 2.5.
TEST(Routing, DeepSeekV3GroupedMatchesBruteForce) {
  const RoutingConfig cfg = routing_config(load_model("deepseek-v3"));
  ASSERT_TRUE(cfg.correction_bias);
  ASSERT_EQ(cfg.group_score, GroupScore::kTop2Sum);
  ASSERT_EQ(cfg.num_experts, 256);
  ASSERT_EQ(cfg.n_group, 8);
  ASSERT_EQ(cfg.topk_group, 4);
  ASSERT_EQ(cfg.topk, 8);
  ASSERT_DOUBLE_EQ(cfg.routed_scaling_factor, 2.5);
  constexpr std::int64_t T = 64, E = 256, K = 8, kGroupSize = 32;
  const auto logits = normal(T * E, 2.0f, 101);
  const auto bias = normal(E, 0.1f, 102);
  const Routed r = run_route(cfg, logits, T, bias.data());

  std::int64_t differs_from_ungrouped = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const float* x = logits.data() + t * E;
    const Scores s = scores_of(cfg, x, bias.data());
    std::vector<double> gs;
    const auto groups = ranked_groups(cfg, s.choice, &gs);
    const std::set<std::int32_t> best_groups(groups.begin(), groups.begin() + 4);

    std::vector<std::int32_t> candidates;
    for (std::int32_t e = 0; e < E; ++e)
      if (best_groups.count(static_cast<std::int32_t>(e / kGroupSize)) != 0) candidates.push_back(e);
    const auto expect = ranked(s.choice, candidates);
    const auto global = ranked(s.choice, iota(0, E));

    std::set<std::int32_t> used_groups;
    double wsum = 0, ssum = 0;
    for (std::int64_t k = 0; k < K; ++k) {
      const auto slot = static_cast<std::size_t>(t * K + k);
      const std::int32_t id = r.ids[slot];
      ssum += s.score[static_cast<std::size_t>(expect[static_cast<std::size_t>(k)])];
      used_groups.insert(id / static_cast<std::int32_t>(kGroupSize));
      EXPECT_EQ(id, expect[static_cast<std::size_t>(k)]) << "token " << t << " slot " << k;
      wsum += r.weights[slot];
    }
    for (std::int64_t k = 0; k < K; ++k) {
      const auto slot = static_cast<std::size_t>(t * K + k);
      const double w = s.score[static_cast<std::size_t>(r.ids[slot])] / ssum * 2.5;
      EXPECT_NEAR(r.weights[slot], w, 1e-5 * w) << "token " << t << " slot " << k;
    }
    EXPECT_LE(used_groups.size(), 4u) << "token " << t;
    for (const auto g : used_groups) EXPECT_EQ(best_groups.count(g), 1u) << "token " << t << " group " << g;
    EXPECT_NEAR(wsum, 2.5, 2.5e-5) << "token " << t;
    if (!std::equal(expect.begin(), expect.begin() + K, global.begin())) ++differs_from_ungrouped;
  }
  // The group limit must actually bite on random data, or this test checks nothing grouped.
  EXPECT_GT(differs_from_ungrouped, T / 4);
}

TEST(Routing, EqualLogitsPickTheLowestExperts) {
  for (const auto& name : model_preset_names()) {
    const RoutingConfig cfg = routing_config(load_model(name));
    const std::vector<float> logits(static_cast<std::size_t>(3 * cfg.num_experts), 0.5f);
    const Routed r = run_route(cfg, logits, 3, nullptr);
    for (std::int64_t t = 0; t < 3; ++t) {
      for (std::int64_t k = 0; k < cfg.topk; ++k) {
        EXPECT_EQ(r.ids[static_cast<std::size_t>(t * cfg.topk + k)], k) << name << " token " << t;
      }
    }
  }
}

TEST(Routing, EqualScoresGoToTheLowerExpert) {
  RoutingConfig cfg = routing_config(load_model("mixtral-8x7b"));
  cfg.topk = 3;
  std::vector<float> logits(8, 0.0f);
  logits[7] = 2.0f;
  logits[5] = 1.0f;
  logits[3] = 1.0f;
  const Routed r = run_route(cfg, logits, 1, nullptr);
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{7, 3, 5}));
  EXPECT_EQ(r.weights[1], r.weights[2]);
}

RoutingConfig small_grouped(std::int64_t topk_group, std::int64_t topk) {
  RoutingConfig cfg;
  cfg.num_experts = 16;
  cfg.topk = topk;
  cfg.scoring = Scoring::kSigmoid;
  cfg.correction_bias = true;
  cfg.n_group = 4;
  cfg.topk_group = topk_group;
  return cfg;
}

TEST(Routing, EqualGroupScoresGoToTheLowerGroup) {
  const RoutingConfig cfg = small_grouped(1, 2);
  std::vector<float> logits(16, -4.0f);
  logits[13] = logits[14] = 2.0f;  // group 3
  logits[5] = logits[6] = 2.0f;    // group 1, same score
  const Routed r = run_route(cfg, logits, 1, nullptr);
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{5, 6}));
}

TEST(Routing, GroupScoreIsTheSumOfItsTopTwo) {
  // Expert 0 is the single best, but group 2's two good experts outscore group 0's pair.
  const RoutingConfig cfg = small_grouped(1, 2);
  std::vector<float> logits(16, -4.0f);
  logits[0] = 5.0f;
  logits[9] = logits[10] = 3.0f;
  const Routed r = run_route(cfg, logits, 1, nullptr);
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{9, 10}));
}

// DeepSeek-V2's group_limited_greedy: softmax scores, a group scored by its largest one.
TEST(Routing, GroupScoreIsTheMaxUnderGroupLimitedGreedy) {
  RoutingConfig cfg = small_grouped(1, 2);
  cfg.scoring = Scoring::kSoftmax;
  cfg.correction_bias = false;
  cfg.group_score = GroupScore::kMax;
  cfg.renormalize = false;
  std::vector<float> logits(16, -4.0f);
  logits[0] = 3.0f;               // group 0 holds the single best expert: its group wins under max
  logits[9] = logits[10] = 2.5f;  // e^2.5 + e^2.5 > e^3: group 2 wins under the top-2 sum
  const Routed r = run_route(cfg, logits, 1, nullptr);
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{0, 1}));  // then the best of group 0's rest (ties: lower index)
  cfg.group_score = GroupScore::kTop2Sum;               // the same logits under DeepSeek-V3's rule pick group 2
  EXPECT_EQ(run_route(cfg, logits, 1, nullptr).ids, (std::vector<std::int32_t>{9, 10}));
}

// routed_scaling_factor applies under every scoring function (DeepSeek-V2: softmax, not
// renormalized, times 16).
TEST(Routing, ScalingFactorAppliesToSoftmaxRouters) {
  RoutingConfig cfg;
  cfg.num_experts = 8;
  cfg.topk = 2;
  cfg.renormalize = false;
  cfg.routed_scaling_factor = 16.0;
  const auto logits = normal(8, 1.0f, 11);
  const Routed r = run_route(cfg, logits, 1, nullptr);
  const Scores s = scores_of(cfg, logits.data(), nullptr);
  for (std::size_t k = 0; k < 2; ++k)
    EXPECT_NEAR(r.weights[k], 16.0 * s.score[static_cast<std::size_t>(r.ids[k])], 1e-5 * r.weights[k]);
}

TEST(Routing, BiasSteersSelectionButNotWeights) {
  RoutingConfig cfg = small_grouped(1, 1);
  cfg.num_experts = 4;
  cfg.n_group = 1;
  cfg.renormalize = false;
  cfg.routed_scaling_factor = 2.0;
  const std::vector<float> logits = {1.0f, 0.0f, 0.0f, 0.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 1.0f};
  const Routed r = run_route(cfg, logits, 1, bias.data());
  EXPECT_EQ(r.ids[0], 3);
  EXPECT_FLOAT_EQ(r.weights[0], 0.5f * 2.0f);  // sigmoid(0) * scaling, the bias left out
}

TEST(Routing, SoftmaxWithoutRenormalizationKeepsFullProbabilities) {
  RoutingConfig cfg = routing_config(load_model("qwen3-30b-a3b"));
  cfg.renormalize = false;
  constexpr std::int64_t T = 16;
  const std::int64_t E = cfg.num_experts, K = cfg.topk;
  const auto logits = normal(static_cast<std::size_t>(T * E), 2.0f, 7);
  const Routed r = run_route(cfg, logits, T, nullptr);
  for (std::int64_t t = 0; t < T; ++t) {
    const Scores s = scores_of(cfg, logits.data() + t * E, nullptr);
    const auto expect = ranked(s.score, iota(0, E));
    double sum = 0;
    for (std::int64_t k = 0; k < K; ++k) {
      const auto slot = static_cast<std::size_t>(t * K + k);
      const double p = s.score[static_cast<std::size_t>(expect[static_cast<std::size_t>(k)])];
      EXPECT_EQ(r.ids[slot], expect[static_cast<std::size_t>(k)]) << "token " << t;
      EXPECT_NEAR(r.weights[slot], p, 1e-5 * p) << "token " << t;
      sum += r.weights[slot];
    }
    EXPECT_LT(sum, 1.0) << "token " << t;
  }
}

TEST(Routing, NoTokensIsANoOp) {
  const RoutingConfig cfg = routing_config(load_model("deepseek-v3"));
  EXPECT_NO_THROW(route(cfg, nullptr, 0, nullptr, nullptr, nullptr));
  EXPECT_NO_THROW(route_ref(cfg, nullptr, 0, nullptr, nullptr, nullptr));
}

TEST(Routing, BadInputIsRejected) {
  const RoutingConfig cfg = routing_config(load_model("qwen3-30b-a3b"));
  auto logits = normal(static_cast<std::size_t>(32 * cfg.num_experts), 2.0f, 3);
  logits[static_cast<std::size_t>(17 * cfg.num_experts + 4)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int32_t> ids(static_cast<std::size_t>(32 * cfg.topk));
  std::vector<float> w(ids.size());
  std::vector<double> wd(ids.size());
  std::string msg = error_of([&] { route(cfg, logits.data(), 32, nullptr, ids.data(), w.data()); });
  EXPECT_NE(msg.find("token 17"), std::string::npos) << msg;
  msg = error_of([&] { route_ref(cfg, logits.data(), 32, nullptr, ids.data(), wd.data()); });
  EXPECT_NE(msg.find("token 17"), std::string::npos) << msg;

  msg = error_of([&] { route(cfg, nullptr, 4, nullptr, ids.data(), w.data()); });
  EXPECT_NE(msg.find("non-null logits"), std::string::npos) << msg;

  ModelConfig m = load_model("mixtral-8x7b");
  m.topk = 9;
  msg = error_of([&] { routing_config(m); });
  EXPECT_NE(msg.find("topk = 9"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_experts = 8"), std::string::npos) << msg;

  m = load_model("qwen3-30b-a3b");
  m.n_group = 3;
  msg = error_of([&] { routing_config(m); });
  EXPECT_NE(msg.find("n_group = 3"), std::string::npos) << msg;

  m = load_model("deepseek-v3");
  m.topk_group = 9;
  msg = error_of([&] { routing_config(m); });
  EXPECT_NE(msg.find("topk_group = 9"), std::string::npos) << msg;

  m = load_model("deepseek-v3");
  m.n_group = 7;
  msg = error_of([&] { routing_config(m); });
  EXPECT_NE(msg.find("n_group = 7"), std::string::npos) << msg;
}

}  // namespace
}  // namespace moekit::cpu
