// Redundant experts (moekit/placement.h) in the runtime, on CPU ranks: a placement changes where a
// (token, expert) pair is computed, never what. One rank holding twice the slots gives the
// unreplicated layer's output bit for bit (batched and standard formats, per-token and block128);
// over 4 ranks every token whose pairs stay on one rank in both layouts is bit-identical, the rest
// within fp32 association of the ranks' partial sums. The per-slot load counts equal the replica
// rule applied to the router's choice; EPLB fed those counts lowers the ranks' max/mean load; a
// replaced placement runs at once; the report's structure (DeepSeek-V3 routing, DP 32, 16 local
// experts: 512 slots for 256 experts) runs on 32 CPU ranks with the plan's workspace. Bad
// placements are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cli/commands.h"
#include "cpu/routing.h"
#include "cuda/backend.h"
#include "cuda/launch.h"
#include "layer_test_util.h"
#include "moekit/check.h"
#include "moekit/placement.h"
#include "moekit/runtime.h"
#include "plan/model_presets.h"
#include "plan/placement_rule.h"
#include "test_names.h"

namespace moekit {
namespace {

using testing::Redundancy;
using testing::run_layout;
using testing::tiny_model;

constexpr std::uint64_t kSeed = 11;

LayerOptions options(QuantScheme quant, const std::string& experts = "batched-fp8") {
  LayerOptions o;
  o.quant = quant;
  o.experts = experts;
  o.checked = true;  // guard bands and NaN poisoning around every step
  return o;
}

// The router's logical choice of n global tokens (ids (n, topk)).
std::vector<std::int32_t> route(const ModelConfig& m, const synthetic::Tokens& g, std::int64_t n) {
  const std::vector<float> bias =
      m.has_score_correction_bias ? synthetic::make_routing_bias(m.num_experts, kSeed) : std::vector<float>{};
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n * m.topk));
  std::vector<float> w(ids.size());
  cpu::route(routing_config(m), g.logits.data(), n, bias.empty() ? nullptr : bias.data(), ids.data(), w.data());
  return ids;
}

// The slot of each pair when rank r feeds tokens [r * T, (r + 1) * T) in one call (the replica rule).
std::vector<std::int32_t> slots_of(const std::vector<std::int32_t>& ids, const ExpertPlacement& pl, std::int64_t topk,
                                   std::int64_t T) {
  std::vector<std::int32_t> out(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto t = static_cast<std::int64_t>(i) / topk;
    out[i] = plan::physical_expert(ids[i], t % T + t / T, pl.replica_offsets.data(), pl.replica_slots.data(),
                                   pl.num_logical, pl.num_physical());
  }
  return out;
}

std::int64_t differing_bits(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& b) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

using Case = std::tuple<QuantScheme, std::string>;
class RedundantOneRank : public ::testing::TestWithParam<Case> {};

// One rank, E_local = 2E (every expert twice): the batched scatter and the standard format both.
TEST_P(RedundantOneRank, TwiceTheSlotsBitForBit) {
  const auto [quant, experts] = GetParam();
  const ModelConfig m = tiny_model(true);
  const std::int64_t T = 45, E = m.num_experts;
  const auto g = synthetic::make_tokens(m.hidden_size, E, 0, T, kSeed);
  const auto none = run_layout(m, g, {T}, 1, 16, options(quant, experts), kSeed, 1, true);
  std::vector<std::vector<std::int64_t>> load;
  const auto twice = run_layout(m, g, {T}, 1, 16, options(quant, experts), kSeed, 1, true, {2 * E, nullptr, &load});
  EXPECT_EQ(differing_bits(twice.output, none.output), 0) << quant_name(quant) << " " << experts;
  EXPECT_LT(twice.error.relative(), 1e-2);
  // Every pair counted once, spread over both replicas (t + 0 mod 2 over 45 tokens, 3 chunks).
  ASSERT_EQ(load.size(), 1u);
  ASSERT_EQ(load[0].size(), static_cast<std::size_t>(2 * E));
  EXPECT_EQ(std::accumulate(load[0].begin(), load[0].end(), std::int64_t{0}), T * m.topk);
  const ExpertPlacement pl = round_robin_placement(E, 2 * E);
  std::vector<std::int64_t> expected(static_cast<std::size_t>(2 * E), 0);
  for (const std::int32_t s : slots_of(route(m, g, T), pl, m.topk, T)) ++expected[static_cast<std::size_t>(s)];
  EXPECT_EQ(load[0], expected);
}

INSTANTIATE_TEST_SUITE_P(Formats, RedundantOneRank,
                         ::testing::Combine(::testing::Values(QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128),
                                            ::testing::Values(std::string("batched-fp8"), std::string("standard-fp8"))),
                         [](const auto& param_info) {
                           return moekit::testing::test_name(std::string(quant_name(std::get<0>(param_info.param))) +
                                                             "_" + std::get<1>(param_info.param));
                         });

// Per-tensor: a replicated expert's rows are split over slabs that each take their own second
// scale (the W2 input's amax), so the output moves within the recipe's rounding, not bit for bit.
TEST(RedundantExperts, PerTensorWithinTheRecipe) {
  const ModelConfig m = tiny_model(false);
  const std::int64_t T = 40, E = m.num_experts;
  const auto g = synthetic::make_tokens(m.hidden_size, E, 0, T, kSeed);
  const auto none = run_layout(m, g, {T}, 1, 40, options(QuantScheme::kPerTensor), kSeed, 1, true);
  const auto twice =
      run_layout(m, g, {T}, 1, 40, options(QuantScheme::kPerTensor), kSeed, 1, true, {2 * E, nullptr, nullptr});
  EXPECT_LT(twice.error.relative(), 3e-2);
  EXPECT_LT(testing::relative_difference(twice.output, none.output), 3e-2);
}

// 4 ranks: twice the slots (round robin) and 1.25x (EPLB's placement of a skewed load), chunked;
// tokens whose pairs stay on one rank in both layouts are bit-identical.
TEST(RedundantExperts, FourRanksChangeWhereNotWhat) {
  ModelConfig m = tiny_model(false);
  m.topk = 2;  // so that many tokens have both pairs on one rank in both layouts
  const std::int64_t T = 41, E = m.num_experts, P = 4, topk = m.topk;
  const auto g = synthetic::make_tokens(m.hidden_size, E, 0, T * P, kSeed);
  const std::vector<std::int64_t> counts(P, T);
  for (const QuantScheme quant : {QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128}) {
    const auto none = run_layout(m, g, counts, P, 8, options(quant), kSeed, 1, true);
    std::vector<double> skew(static_cast<std::size_t>(E), 1.0);
    skew[3] = 9;
    skew[12] = 5;
    const ExpertPlacement eplb = rebalance_experts(skew, 20, 4, 1, P);
    for (const ExpertPlacement& pl : {round_robin_placement(E, 2 * E), eplb}) {
      const std::int64_t local = pl.num_physical() / P;
      std::vector<std::vector<std::int64_t>> load;
      const auto placed = run_layout(m, g, counts, P, 8, options(quant), kSeed, 1, true, {local, &pl, &load});
      const std::string what = fmt::format("{} with {} slots", quant_name(quant), pl.num_physical());
      EXPECT_LT(testing::relative_difference(placed.output, none.output), testing::kRanksVsOneRank) << what;
      EXPECT_LT(placed.error.relative(), 1e-2) << what;
      // Tokens whose pairs stay on one rank in both layouts sum the same values in the same order.
      const auto ids = route(m, g, T * P);
      const auto slots = slots_of(ids, pl, topk, T);
      const std::int64_t K = m.hidden_size, E_local = E / P;
      std::int64_t same = 0;
      for (std::int64_t t = 0; t < T * P; ++t) {
        bool one = true;
        for (std::int64_t k = 1; k < topk; ++k) {
          const auto i = static_cast<std::size_t>(t * topk);
          one = one && ids[i + k] / E_local == ids[i] / E_local && slots[i + k] / local == slots[i] / local;
        }
        if (!one) continue;
        ++same;
        for (std::int64_t c = 0; c < K; ++c)
          ASSERT_EQ(placed.output[static_cast<std::size_t>(t * K + c)],
                    none.output[static_cast<std::size_t>(t * K + c)])
              << what << ": token " << t << " column " << c;
      }
      EXPECT_GT(same, T * P / 20) << what;
      // The counts: the replica rule applied to the router's choice, rank by rank.
      ASSERT_EQ(load.size(), static_cast<std::size_t>(P));
      std::vector<std::int64_t> total(static_cast<std::size_t>(pl.num_physical()), 0), expected = total;
      for (const auto& rank_load : load)
        for (std::size_t s = 0; s < rank_load.size(); ++s) total[s] += rank_load[s];
      for (const std::int32_t s : slots) ++expected[static_cast<std::size_t>(s)];
      EXPECT_EQ(total, expected) << what;
    }
  }
}

// EPLB from measured counts: a skewed routing (two hot experts) measured on the round-robin 2x
// placement, rebalanced, run again: the ranks' max/mean load drops and the output stays.
TEST(RedundantExperts, EplbFromMeasuredLoadBalancesTheRanks) {
  ModelConfig m = tiny_model(false);
  const std::int64_t T = 64, E = m.num_experts, P = 4, slots = 2 * E;
  auto g = synthetic::make_tokens(m.hidden_size, E, 0, T * P, kSeed);
  for (std::int64_t t = 0; t < T * P; ++t) {  // experts 0 and 1 (both on rank 0) take most tokens
    g.logits[static_cast<std::size_t>(t * E + 0)] += 6;
    g.logits[static_cast<std::size_t>(t * E + 1)] += 5;
  }
  const std::vector<std::int64_t> counts(P, T);
  const LayerOptions opt = options(QuantScheme::kPerTokenPerChannel);
  const ExpertPlacement first = round_robin_placement(E, slots);
  auto measure = [&](const ExpertPlacement& pl, std::vector<std::uint16_t>* out) {
    std::vector<std::vector<std::int64_t>> load;
    const auto r = run_layout(m, g, counts, P, T, opt, kSeed, 1, false, {slots / P, &pl, &load});
    if (out) *out = r.output;
    std::vector<std::int64_t> sum(static_cast<std::size_t>(slots), 0);
    for (const auto& l : load)
      for (std::size_t s = 0; s < l.size(); ++s) sum[s] += l[s];
    std::vector<double> per_rank(static_cast<std::size_t>(P), 0);
    for (std::int64_t s = 0; s < slots; ++s)
      per_rank[static_cast<std::size_t>(s / (slots / P))] += static_cast<double>(sum[static_cast<std::size_t>(s)]);
    const double mean = std::accumulate(per_rank.begin(), per_rank.end(), 0.0) / static_cast<double>(P);
    return std::pair{sum, *std::max_element(per_rank.begin(), per_rank.end()) / mean};
  };
  std::vector<std::uint16_t> before_out, after_out;
  const auto [measured, before] = measure(first, &before_out);
  const std::vector<double> load = logical_load(first, measured);
  const ExpertPlacement better = rebalance_experts(load, slots, 1, 1, P);
  const auto [unused, after] = measure(better, &after_out);
  std::printf(
      "EPLB on measured counts (E %lld, %lld slots, %lld ranks, 2 hot experts): max/mean rank load %.3f -> "
      "%.3f\n",
      static_cast<long long>(E), static_cast<long long>(slots), static_cast<long long>(P), before, after);
  EXPECT_GT(before, 1.3);
  EXPECT_LT(after, 1.15);
  EXPECT_LT(testing::relative_difference(after_out, before_out), testing::kRanksVsOneRank);
}

// replace_layer: the new placement and its slots' weights run at once, from the same tables; the
// counts restart.
TEST(RedundantExperts, ReplaceLayerRunsTheNewPlacement) {
  const ModelConfig m = tiny_model(false);
  const std::int64_t T = 24, E = m.num_experts, slots = 24;
  const auto g = synthetic::make_tokens(m.hidden_size, E, 0, T, kSeed);
  const LayerOptions opt = options(QuantScheme::kPerTokenPerChannel);
  const auto none = run_layout(m, g, {T}, 1, T, opt, kSeed);
  run_in_process(1, [&](Communicator& comm) {
    const ParallelConfig par{1, 1, T, slots};
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, opt.quant);
    cpu::ThreadPool pool(1);
    const ExpertPlacement a = round_robin_placement(E, slots);
    std::vector<std::int32_t> map(static_cast<std::size_t>(slots));
    for (std::int64_t s = 0; s < slots; ++s) map[static_cast<std::size_t>(s)] = static_cast<std::int32_t>((s * 5) % E);
    const ExpertPlacement b = make_placement(E, map);
    const auto wa = synthetic::make_slot_weights(p, a, 0, kSeed, pool);
    const auto wb = synthetic::make_slot_weights(p, b, 0, kSeed, pool);
    MoeRuntime runtime(m, par, opt, comm);
    LayerWeights lw{wa.view(), nullptr};
    lw.placement = &a;
    const int layer = runtime.add_layer(lw);
    ASSERT_NE(runtime.placement(layer), nullptr);
    EXPECT_EQ(*runtime.placement(layer), a);
    std::vector<std::uint16_t> out(none.output.size());
    runtime.forward(layer, g.hidden.data(), g.logits.data(), T, out.data());
    EXPECT_EQ(out, none.output);
    lw = LayerWeights{wb.view(), nullptr};
    lw.placement = &b;
    runtime.replace_layer(layer, lw);
    EXPECT_EQ(*runtime.placement(layer), b);
    const auto zero = runtime.expert_load(layer);
    EXPECT_EQ(std::accumulate(zero.begin(), zero.end(), std::int64_t{0}), 0);
    std::fill(out.begin(), out.end(), std::uint16_t{0});
    runtime.forward(layer, g.hidden.data(), g.logits.data(), T, out.data());
    EXPECT_EQ(out, none.output);
    const auto load = runtime.expert_load(layer);
    EXPECT_EQ(std::accumulate(load.begin(), load.end(), std::int64_t{0}), T * m.topk);
    const auto cleared = runtime.expert_load(layer);  // reading clears
    EXPECT_EQ(std::accumulate(cleared.begin(), cleared.end(), std::int64_t{0}), 0);
  });
}

// The upstream report's structure: DeepSeek-V3's routing (256 experts, top-8, 8 groups of which 4,
// sigmoid with correction bias, a shared expert) at DP 32 with 16 local experts: 512 slots, every
// expert twice, on 32 CPU ranks. Reduced K and I keep it small; the structure (E, topk, groups,
// ranks, slots, the batched M = max_tokens_per_rank * 32) is the report's. The runtime allocates
// exactly the plan's workspace, and the output equals the unreplicated layer within fp32
// association of the ranks' partial sums.
TEST(RedundantExperts, ReportCaseStructureOn32CpuRanks) {
  // DeepSeek-V3's config.json (the preset built into the library, so the test runs from any
  // directory) with hidden_size and moe_intermediate_size 128, as `moekit plan --model PATH` reads it.
  const auto& presets = detail::model_presets();
  const auto preset = std::find_if(presets.begin(), presets.end(),
                                   [](const detail::ModelPreset& p) { return std::string(p.name) == "deepseek-v3"; });
  ASSERT_NE(preset, presets.end());
  nlohmann::json config = nlohmann::json::parse(preset->json);
  config["hidden_size"] = 128;
  config["moe_intermediate_size"] = 128;
  const std::string path = ::testing::TempDir() + "moekit-deepseek-v3-reduced.json";
  std::ofstream(path) << config.dump();
  const ModelConfig m = load_model(path);
  ASSERT_EQ(m.shared_intermediate_size, 128);
  const std::int64_t P = 32, T = 3, E = m.num_experts;
  ASSERT_EQ(E, 256);
  const auto g = synthetic::make_tokens(m.hidden_size, E, 0, T * P, kSeed);
  const std::vector<std::int64_t> counts(P, T);
  const LayerOptions opt = options(QuantScheme::kBlock128);
  const auto none = run_layout(m, g, counts, P, 4, opt, kSeed);
  std::vector<std::vector<std::int64_t>> load;
  const auto placed = run_layout(m, g, counts, P, 4, opt, kSeed, 1, true, {16, nullptr, &load});
  EXPECT_LT(testing::relative_difference(placed.output, none.output), testing::kRanksVsOneRank);
  EXPECT_LT(placed.error.relative(), 1e-2);
  std::int64_t pairs = 0;
  for (const auto& l : load) pairs += std::accumulate(l.begin(), l.end(), std::int64_t{0});
  EXPECT_EQ(pairs, T * P * m.topk);
  // What `moekit plan --model PATH --device cpu --dp 32 --ep 32 --max-tokens-per-rank 4 --local-experts
  // 16 --quant block128` prints is what each rank's runtime allocated.
  cli::PlanRequest req;
  req.model = path;
  req.parallel = {P, P, 4, 16};
  req.device = "cpu";
  req.quant = "block128";
  req.experts = {"batched-fp8"};
  const cli::PlanReport report = cli::make_plan_report(req);
  ASSERT_FALSE(report.entries.empty());
  const WorkspacePlan& plan = report.entries.front().plan;
  EXPECT_EQ(plan.problem.E_local, 16);
  EXPECT_EQ(plan.problem.M, 4 * P);
  EXPECT_EQ(placed.workspace_bytes, plan.total_bytes);
}

// Slot weights on the GPU at fixed addresses, rewritten in place for a new placement.
struct DeviceSlots {
  DeviceBuffer w1, w1_scale, w2, w2_scale;
  DeviceSlots(Memory& memory, const HostExpertWeights& w)
      : w1(memory, static_cast<std::int64_t>(w.w1.size()), "w1"),
        w1_scale(memory, static_cast<std::int64_t>(w.w1_scale.size() * 4), "w1_scale"),
        w2(memory, static_cast<std::int64_t>(w.w2.size()), "w2"),
        w2_scale(memory, static_cast<std::int64_t>(w.w2_scale.size() * 4), "w2_scale") {
    put(memory, w);
  }
  void put(Memory& memory, const HostExpertWeights& w) {
    memory.from_host(w1.get(), w.w1.data(), w1.bytes(), nullptr);
    memory.from_host(w1_scale.get(), w.w1_scale.data(), w1_scale.bytes(), nullptr);
    memory.from_host(w2.get(), w.w2.data(), w2.bytes(), nullptr);
    memory.from_host(w2_scale.get(), w.w2_scale.data(), w2_scale.bytes(), nullptr);
  }
  ExpertWeightsView view(const MoeProblem& p) const {
    return ExpertWeightsView::of(p, Device::kCuda, w1.as<std::uint8_t>(), w1_scale.as<float>(), w2.as<std::uint8_t>(),
                                 w2_scale.as<float>());
  }
};

// One GPU, E_local = 2E: where every expert's rows fit one GEMM config (m_e <= 32 at 24 tokens) the
// output equals the unreplicated layer's bit for bit, eagerly and from a CUDA graph, and after
// replace_layer rewrote the placement (and the slots' weights in place) under the captured graph;
// at 300 tokens, where experts cross GEMM configs, within the device's rounding. The counts equal
// the replica rule applied to the router's choice.
TEST(RedundantExpertsGpu, TwiceTheSlotsOnOneGpuAndAGraph) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig m = tiny_model(false);
  const std::int64_t K = m.hidden_size, E = m.num_experts;
  for (const QuantScheme quant : {QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128})
    for (const std::int64_t T : {24, 300}) {
      const std::string what = fmt::format("{} T = {}", quant_name(quant), T);
      LayerOptions opt = options(quant);
      opt.checked = false;
      opt.device = Device::kCuda;
      const auto memory = make_memory(Device::kCuda);
      DeviceCopies copies(*memory);
      const auto g = synthetic::make_tokens(K, E, 0, T, kSeed);
      const auto* hidden = copies.put(g.hidden, "hidden");
      const auto* logits = copies.put(g.logits, "logits");
      const std::int64_t bytes = T * K * 2;
      DeviceBuffer out(*memory, bytes, "output");
      auto host_out = [&] {
        std::vector<std::uint16_t> h(static_cast<std::size_t>(T * K));
        memory->to_host(h.data(), out.get(), bytes, nullptr);
        return h;
      };
      cpu::ThreadPool pool(2);
      run_in_process(1, [&](Communicator& comm) {
        const ParallelConfig none_par{1, 1, T, 0}, twice_par{1, 1, T, 2 * E};
        const MoeProblem pn = make_problem(m, none_par, ActivationFormat::kBatchedExperts, quant);
        const MoeProblem pt = make_problem(m, twice_par, ActivationFormat::kBatchedExperts, quant);
        const auto wn = synthetic::make_expert_weights(pn, 0, kSeed, pool);
        std::vector<std::uint16_t> none;
        {
          MoeRuntime runtime(m, none_par, opt, comm);
          const int layer = runtime.add_layer(LayerWeights{wn.view(copies), nullptr});
          runtime.forward(layer, hidden, logits, T, out.as<std::uint16_t>());
          none = host_out();
        }
        const ExpertPlacement a = round_robin_placement(E, 2 * E);
        std::vector<std::int32_t> map(static_cast<std::size_t>(2 * E));
        for (std::int64_t s = 0; s < 2 * E; ++s)
          map[static_cast<std::size_t>(s)] = static_cast<std::int32_t>((s * 7) % E);
        const ExpertPlacement b = make_placement(E, map);
        DeviceSlots slots(*memory, synthetic::make_slot_weights(pt, a, 0, kSeed, pool));
        MoeRuntime runtime(m, twice_par, opt, comm);
        LayerWeights lw{slots.view(pt), nullptr};
        lw.placement = &a;
        const int layer = runtime.add_layer(lw);
        memory->fill(out.get(), 0xFF, bytes, nullptr);
        runtime.forward(layer, hidden, logits, T, out.as<std::uint16_t>());
        const auto twice = host_out();
        std::vector<std::int64_t> expected(static_cast<std::size_t>(2 * E), 0);
        for (const std::int32_t s : slots_of(route(m, g, T), a, m.topk, T)) ++expected[static_cast<std::size_t>(s)];
        EXPECT_EQ(runtime.expert_load(layer), expected) << what;
        if (T > 32) {
          const double diff = testing::relative_difference(twice, none);
          std::printf("%s: 2x slots vs none on the GPU, relative difference %.3e\n", what.c_str(), diff);
          EXPECT_LT(diff, check::device_vs_cpu_tolerance(quant)) << what;
          return;
        }
        EXPECT_EQ(differing_bits(twice, none), 0) << what;
        void* stream = cuda::create_stream();
        {
          cuda::Graph graph([&](void* st) { runtime.enqueue(layer, hidden, logits, T, out.as<std::uint16_t>(), st); },
                            stream);
          memory->fill(out.get(), 0xFF, bytes, stream);
          graph.replay(stream);
          runtime.check_status(stream);
          EXPECT_EQ(host_out(), none) << what << ": graph";
          // A new placement under the captured graph: slot weights rewritten in place, tables by
          // replace_layer.
          memory->synchronize(stream);
          slots.put(*memory, synthetic::make_slot_weights(pt, b, 0, kSeed, pool));
          lw.placement = &b;
          runtime.replace_layer(layer, lw, stream);
          memory->fill(out.get(), 0xFF, bytes, stream);
          graph.replay(stream);
          runtime.check_status(stream);
          EXPECT_EQ(host_out(), none) << what << ": graph after replace_layer";
          std::vector<std::int64_t> expected_b(static_cast<std::size_t>(2 * E), 0);
          for (const std::int32_t s : slots_of(route(m, g, T), b, m.topk, T)) ++expected_b[static_cast<std::size_t>(s)];
          EXPECT_EQ(runtime.expert_load(layer, stream), expected_b) << what << ": graph after replace_layer";
        }
        cuda::destroy_stream(stream);
      });
    }
}

TEST(RedundantExperts, BadPlacementsAreRefusedByName) {
  const ModelConfig m = tiny_model(false);
  const std::int64_t E = m.num_experts;
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one naming '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // Slots fewer than E, or more than 4 replicas of every expert.
  expect_error(
      [&] {
        make_problem(m, {2, 2, 8, 7}, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
      },
      "fewer than the 16 experts");
  expect_error(
      [&] {
        make_problem(m, {1, 1, 8, 65}, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
      },
      "more than 4 replicas");
  run_in_process(1, [&](Communicator& comm) {
    const ParallelConfig par{1, 1, 8, 2 * E};
    const LayerOptions opt = options(QuantScheme::kPerTokenPerChannel);
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, opt.quant);
    cpu::ThreadPool pool(1);
    const ExpertPlacement rr = round_robin_placement(E, 2 * E);
    const auto w = synthetic::make_slot_weights(p, rr, 0, kSeed, pool);
    MoeRuntime runtime(m, par, opt, comm);
    LayerWeights lw{w.view(), nullptr};
    const ExpertPlacement small = round_robin_placement(E, E + 4);
    lw.placement = &small;
    expect_error([&] { runtime.add_layer(lw); }, "make it with 32 slots");
    ExpertPlacement lying = rr;  // replica tables that do not match the map are derived again
    lying.replica_slots[0] = 31;
    lw.placement = &lying;
    const int layer = runtime.add_layer(lw);
    EXPECT_EQ(*runtime.placement(layer), rr);
    ExpertPlacement missing = rr;  // expert 5 in no slot
    for (auto& e : missing.physical_to_logical)
      if (e == 5) e = 6;
    lw.placement = &missing;
    expect_error([&] { runtime.replace_layer(layer, lw); }, "expert 5");
    expect_error([&] { runtime.expert_load(3); }, "layer 3 is not registered");
  });
  run_in_process(1, [&](Communicator& comm) {  // no placement: nothing counted, and none to replace with
    const ParallelConfig par{1, 1, 8, 0};
    const LayerOptions opt = options(QuantScheme::kPerTokenPerChannel);
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, opt.quant);
    cpu::ThreadPool pool(1);
    const auto w = synthetic::make_expert_weights(p, 0, kSeed, pool);
    MoeRuntime runtime(m, par, opt, comm);
    LayerWeights lw{w.view(), nullptr};
    const int layer = runtime.add_layer(lw);
    EXPECT_EQ(runtime.placement(layer), nullptr);
    expect_error([&] { runtime.expert_load(layer); }, "round_robin_placement(E, E)");
    const ExpertPlacement identity = round_robin_placement(E, E);
    lw.placement = &identity;
    expect_error([&] { runtime.replace_layer(layer, lw); }, "a layer keeps whether it counts its load");
  });
}

}  // namespace
}  // namespace moekit
