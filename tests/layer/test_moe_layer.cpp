// The whole layer on the CPU backend, through its seams: outputs bit-identical however the global
// tokens are spread over a number of ranks and chunks, within fp32 association of one rank (bit-
// identical where a token's experts live on one rank), repeatable, standard == batched, edge cases (a rank with 0
// tokens, 1 token, every token to one expert so m_e == M, topk == E_local, chunked steps), checked
// mode (guard bands, NaN poisoning) and the float64 reference within the recipe's tolerance, the
// workspace equal to the plan, and bad input.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>

#include "cpu/routing.h"
#include "cuda/backend.h"
#include "layer_test_util.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "moekit/registry.h"

namespace moekit {
namespace {

using testing::run_layout;
using testing::tiny_model;

// bf16 output rounding (2^-9 relative) plus rare one-ulp FP8 requantization flips where fp32 and
// float64 W1 sums round differently: measured ~2.4e-3 on these shapes; 1e-2 leaves margin and still
// fails on any real indexing or scaling bug (those give O(1) errors).
constexpr double kRelTolerance = 1e-2;
// The unquantized recipe (bf16): the reference rounds W1's output and the activation's to bf16 as
// the recipe stores them, leaving bf16 roundings the reference does not mirror: each expert's output
// row (~1.6e-3 RMS, tests/backend_ops) before the weighted sum over the top-k and the shared expert,
// where terms of both signs partly cancel, and the layer's output once more; measured 2.7e-3 at
// DeepSeek-V3's shapes (moekit run --check). 6e-3 keeps margin and is still far below an FP8
// recipe's error or a bug's O(1).
constexpr double kRelToleranceBf16 = 6e-3;
double tolerance(QuantScheme quant) {
  return has_activation_scales(recipe_info(quant)) ? kRelTolerance : kRelToleranceBf16;
}
constexpr std::uint64_t kSeed = 7;

LayerOptions options(QuantScheme quant, bool checked = false) {
  LayerOptions o;
  o.quant = quant;
  o.checked = checked;
  o.num_threads = 1;
  return o;
}

synthetic::Tokens tokens(const ModelConfig& m, std::int64_t n, std::uint64_t seed) {
  return synthetic::make_tokens(m.hidden_size, m.num_experts, 0, n, seed);
}

class LayerAcrossRanks : public ::testing::TestWithParam<std::tuple<bool, QuantScheme>> {};

// Which of the global tokens have every expert on one rank of `ranks` (E / ranks experts each).
std::vector<bool> tokens_on_one_rank(const ModelConfig& m, const synthetic::Tokens& g, std::int64_t n, int ranks) {
  const std::vector<float> bias =
      m.has_score_correction_bias ? synthetic::make_routing_bias(m.num_experts, kSeed) : std::vector<float>{};
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n * m.topk));
  std::vector<float> w(ids.size());
  cpu::route(routing_config(m), g.logits.data(), n, bias.empty() ? nullptr : bias.data(), ids.data(), w.data());
  std::vector<bool> one(static_cast<std::size_t>(n), true);
  const std::int64_t E_local = m.num_experts / ranks;
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t k = 1; k < m.topk; ++k)
      if (ids[static_cast<std::size_t>(t * m.topk + k)] / E_local !=
          ids[static_cast<std::size_t>(t * m.topk)] / E_local)
        one[static_cast<std::size_t>(t)] = false;
  return one;
}

TEST_P(LayerAcrossRanks, SameOutputsHoweverTokensAreSpread) {
  const auto [grouped, quant] = GetParam();
  const ModelConfig m = tiny_model(grouped);
  const synthetic::Tokens g = tokens(m, 32, 11);
  const auto one = run_layout(m, g, {32}, 1, 32, options(quant), kSeed);
  const auto four = run_layout(m, g, {8, 8, 8, 8}, 4, 8, options(quant), kSeed);
  // Uneven: a rank with 0 tokens, one with 1, chunked steps (max_tokens_per_rank 4 < 15 tokens):
  // the owners' partials do not depend on where a token came from.
  const auto uneven = run_layout(m, g, {0, 1, 16, 15}, 4, 4, options(quant), kSeed);
  EXPECT_EQ(four.output, uneven.output) << m.name << " " << quant_name(quant);
  // Against one rank: within fp32 association; bit-identical for tokens on one rank.
  EXPECT_LT(testing::relative_difference(four.output, one.output), testing::kRanksVsOneRank);
  const auto on_one = tokens_on_one_rank(m, g, 32, 4);
  for (std::int64_t t = 0; t < 32; ++t) {
    if (!on_one[static_cast<std::size_t>(t)]) continue;
    EXPECT_TRUE(std::equal(four.output.begin() + t * m.hidden_size, four.output.begin() + (t + 1) * m.hidden_size,
                           one.output.begin() + t * m.hidden_size))
        << m.name << " token " << t;
  }
  // Repeated steps on the same layer, and checked mode, change nothing.
  const auto again = run_layout(m, g, {8, 8, 8, 8}, 4, 8, options(quant, true), kSeed, 2, true);
  EXPECT_EQ(four.output, again.output) << m.name << " " << quant_name(quant);
  EXPECT_LT(again.error.relative(), tolerance(quant)) << m.name << " " << quant_name(quant);
  EXPECT_GT(again.error.norm_sq, 0.0);
  EXPECT_EQ(again.error.nan_outputs, 0);
}

INSTANTIATE_TEST_SUITE_P(Quant, LayerAcrossRanks,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128,
                                                              QuantScheme::kBf16)),
                         [](const auto& param_info) {
                           const QuantScheme q = std::get<1>(param_info.param);
                           return std::string(std::get<0>(param_info.param) ? "grouped_" : "softmax_") +
                                  (q == QuantScheme::kBlock128 ? "block128"
                                   : q == QuantScheme::kBf16   ? "bf16"
                                                               : "per_token");
                         });

TEST(Layer, StandardEqualsBatchedOnOneRank) {
  const ModelConfig m = tiny_model(false);
  const synthetic::Tokens g = tokens(m, 20, 3);
  for (QuantScheme q : all_quant_schemes()) {
    LayerOptions b = options(q, true), s = options(q, true);
    s.experts = "standard-fp8";
    const auto rb = run_layout(m, g, {20}, 1, 20, b, kSeed, 1, true);
    const auto rs = run_layout(m, g, {20}, 1, 20, s, kSeed, 1, true);
    // Per-tensor activation scales span different tensors in the two formats (one per expert in
    // the batched buffer, one for all permuted rows in the standard one): equal only in tolerance.
    if (q != QuantScheme::kPerTensor) {
      EXPECT_EQ(rb.output, rs.output) << quant_name(q);
    }
    EXPECT_LT(rb.error.relative(), tolerance(q)) << quant_name(q);
    EXPECT_LT(rs.error.relative(), tolerance(q)) << quant_name(q);
    // Standard with pure data parallelism (ep = 1, every rank all experts) agrees too.
    if (q != QuantScheme::kPerTensor) {
      const auto rs2 = run_layout(m, g, {12, 8}, 1, 12, s, kSeed);
      EXPECT_EQ(rb.output, rs2.output) << quant_name(q);
    }
  }
}

// The fused W1 (fuse_w1, block128's default): W1's fp32 output into the activation, no w1_out.
// Against float64 (which follows the same recipe), the unfused recipe (asked for: one bf16 rounding
// apart) and itself across formats and rank layouts; the experts' workspace is w1_out smaller.
TEST(Layer, FusedW1) {
  const ModelConfig m = tiny_model(true);
  const synthetic::Tokens g = tokens(m, 24, 13);
  LayerOptions fused = options(QuantScheme::kBlock128, true), unfused = options(QuantScheme::kBlock128, true);
  fused.fuse_w1 = true;
  unfused.fuse_w1 = false;
  const auto f1 = run_layout(m, g, {24}, 1, 24, fused, kSeed, 1, true);
  // Not asked either way: fused, block128's default.
  EXPECT_EQ(run_layout(m, g, {24}, 1, 24, options(QuantScheme::kBlock128, true), kSeed, 1, true).output, f1.output);
  const auto u1 = run_layout(m, g, {24}, 1, 24, unfused, kSeed, 1, true);
  EXPECT_LT(f1.error.relative(), kRelTolerance);
  EXPECT_EQ(f1.error.nan_outputs, 0);
  // The recipes are one bf16 rounding of W1's output apart: FP8 codes flip where it crosses a
  // boundary, measured 1.4e-2 here (the device-vs-CPU bound, 3e-2, is for the same kind of flips).
  EXPECT_LT(testing::relative_difference(f1.output, u1.output), 3e-2);
  EXPECT_NE(f1.output, u1.output);  // the recipes differ (one bf16 rounding of W1's output)
  const std::int64_t w1_out = 16 * 24 * (2 * m.moe_intermediate_size) * 2;  // E_local x M x N bf16
  EXPECT_EQ(u1.experts_workspace_bytes - f1.experts_workspace_bytes, w1_out - 64 * 2 * m.moe_intermediate_size * 4);
  LayerOptions standard = fused;
  standard.experts = "standard-fp8";
  EXPECT_EQ(run_layout(m, g, {24}, 1, 24, standard, kSeed, 1, true).output, f1.output);
  const auto f4 = run_layout(m, g, {6, 6, 6, 6}, 4, 6, fused, kSeed, 1, true);
  EXPECT_LT(testing::relative_difference(f4.output, f1.output), testing::kRanksVsOneRank);
  EXPECT_LT(f4.error.relative(), kRelTolerance);
  // What cannot fuse is refused, naming the fix.
  LayerOptions per_token = options(QuantScheme::kPerTokenPerChannel);
  per_token.fuse_w1 = true;
  try {
    run_layout(m, g, {24}, 1, 24, per_token, kSeed);
    ADD_FAILURE() << "fuse_w1 with per-token was not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--fuse-w1"), std::string::npos) << e.what();
  }
}

TEST(Layer, EveryTokenToOneExpertFillsCapacity) {
  ModelConfig m = tiny_model(false);
  synthetic::Tokens g = tokens(m, 16, 5);
  for (std::int64_t t = 0; t < 16; ++t) g.logits[static_cast<std::size_t>(t * m.num_experts + 5)] = 50.0f;
  // Every token's top-4 among experts 4..7 (rank 1 of 4): expert 5 receives all 16 rows (m_e == M)
  // and every token's experts live on one rank: the same reduction order as one rank, the same bits.
  for (std::int64_t t = 0; t < 16; ++t)
    for (std::int64_t e = 4; e < 8; ++e) g.logits[static_cast<std::size_t>(t * m.num_experts + e)] += 40.0f;
  const auto four =
      run_layout(m, g, {4, 4, 4, 4}, 4, 4, options(QuantScheme::kPerTokenPerChannel, true), kSeed, 1, true);
  const auto one = run_layout(m, g, {16}, 1, 16, options(QuantScheme::kPerTokenPerChannel), kSeed);
  EXPECT_EQ(one.output, four.output);
  EXPECT_LT(four.error.relative(), kRelTolerance);
}

TEST(Layer, TopkEqualsLocalExperts) {
  ModelConfig m = tiny_model(false);  // E = 16, ep = 4: E_local = 4 = topk
  const synthetic::Tokens g = tokens(m, 12, 9);
  const auto four = run_layout(m, g, {3, 3, 3, 3}, 4, 3, options(QuantScheme::kBlock128, true), kSeed);
  const auto one = run_layout(m, g, {12}, 1, 12, options(QuantScheme::kBlock128), kSeed);
  EXPECT_LT(testing::relative_difference(four.output, one.output), testing::kRanksVsOneRank);
}

TEST(Layer, WorkspaceIsThePlan) {
  const ModelConfig m = tiny_model(true);
  const synthetic::Tokens g = tokens(m, 8, 1);
  const auto r = run_layout(m, g, {4, 4}, 2, 4, options(QuantScheme::kPerTokenPerChannel), kSeed);
  const MoeProblem p =
      make_problem(m, ParallelConfig{2, 2, 4, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kPerTokenPerChannel);
  const WorkspacePlan plan =
      plan_layer(p, find_experts("batched-fp8", Device::kCpu), 2, 0, {}, shared_experts_problem(m, p));
  EXPECT_EQ(r.workspace_bytes, plan.total_bytes);
  EXPECT_EQ(r.experts_workspace_bytes, plan.section_bytes("experts"));
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no moekit::Error (expected: " << needle << ")";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Ranks that planned different layers (here: checked mode, i.e. guard bands, on one rank only)
// would store at different offsets in each other's buffers: every rank raises before allocating.
TEST(LayerBadInput, RanksWithDifferentPlansRaiseOnEveryRank) {
  const ModelConfig m = tiny_model(false);
  std::atomic<int> raised{0};
  run_in_process(2, [&](Communicator& comm) {
    const ParallelConfig par{2, 2, 4, 0};
    const LayerOptions opt = options(QuantScheme::kPerTokenPerChannel, comm.rank() == 1);
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, opt.quant);
    cpu::ThreadPool pool(1);
    const auto w = synthetic::make_expert_weights(p, first_local_expert(par, p, comm.rank()), kSeed, pool);
    try {
      MoeLayer layer(m, par, opt, {w.view(), nullptr}, comm);
    } catch (const Error& e) {
      if (std::string(e.what()).find("planned a different layer") != std::string::npos) ++raised;
    }
  });
  EXPECT_EQ(raised.load(), 2);
}

TEST(LayerBadInput, Construction) {
  const ModelConfig m = tiny_model(false);
  const MoeProblem p =
      make_problem(m, ParallelConfig{2, 2, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  cpu::ThreadPool pool(1);
  const auto w = synthetic::make_expert_weights(p, 0, 1, pool);
  const LayerWeights lw{w.view(), nullptr};
  auto build = [&](const ParallelConfig& par, const LayerOptions& o, int ranks, const LayerWeights& weights) {
    run_in_process(ranks, [&](Communicator& c) { MoeLayer l(m, par, o, weights, c); });
  };
  expect_error([&] { build({4, 4, 8, 0}, options(QuantScheme::kBlock128), 2, lw); }, "dp = 4");
  LayerOptions s = options(QuantScheme::kBlock128);
  s.experts = "standard-fp8";
  expect_error([&] { build({2, 2, 8, 0}, s, 2, lw); }, "the standard format runs with ep == 1");
  expect_error([&] { build({2, 2, 8, 0}, options(QuantScheme::kPerTensor), 2, lw); }, "per-tensor");
  expect_error([&] { build({1, 1, 0, 0}, options(QuantScheme::kBlock128), 1, lw); }, "max_tokens_per_rank = 0");
  // Weights that are not the problem's: quant, shapes, device; and a missing routing bias.
  expect_error([&] { build({2, 2, 8, 0}, options(QuantScheme::kPerTokenPerChannel), 2, lw); }, "quantized block128");
  LayerWeights half = lw;
  half.experts.E_local = 4;
  expect_error([&] { build({2, 2, 8, 0}, options(QuantScheme::kBlock128), 2, half); }, "E_local = 4");
  // Host weights for a GPU layer; without a GPU (or without CUDA in the build) the runtime itself is
  // refused first, saying which.
  LayerOptions gpu = options(QuantScheme::kBlock128);
  gpu.device = Device::kCuda;
  expect_error([&] { build({2, 2, 8, 0}, gpu, 2, lw); }, cuda::available() ? "cuda" : "CUDA");
  const ModelConfig grouped = tiny_model(true);
  expect_error(
      [&] {
        run_in_process(2, [&](Communicator& c) {
          MoeLayer l(grouped, {2, 2, 8, 0}, options(QuantScheme::kBlock128), lw, c);
        });
      },
      "e_score_correction_bias");
  LayerOptions unknown = options(QuantScheme::kBlock128);
  unknown.experts = "magic-fp8";
  expect_error([&] { build({2, 2, 8, 0}, unknown, 2, lw); }, "no experts 'magic-fp8'");
}

// enqueue's max_tokens_any_rank over 2 ranks of 3 and 8 tokens: declared as 8 on both, the step's
// outputs are forward()'s exactly; declared as 3 on rank 0 only (less than rank 1 feeds), rank 0's
// expert 0 (every token's first choice) receives 11 rows where it planned for 3 x 2: the step still
// completes on both ranks (no rank left in the collective finalize) and rank 0's check_status raises,
// naming the expert and the bound; a declaration under the rank's own tokens is refused at once.
TEST(LayerBadInput, MaxTokensAnyRankBoundsTheStep) {
  const ModelConfig m = tiny_model(false);
  const std::int64_t K = m.hidden_size, E = m.num_experts;
  synthetic::Tokens g = tokens(m, 11, 5);
  for (std::int64_t t = 0; t < 11; ++t) g.logits[static_cast<std::size_t>(t * E)] = 30.0f;  // expert 0 first
  const std::vector<std::int64_t> offset = {0, 3}, count = {3, 8};
  const std::vector<std::uint16_t> expected =
      run_layout(m, g, {3, 8}, 2, 8, options(QuantScheme::kBlock128), kSeed).output;
  std::vector<std::uint16_t> declared(expected.size()), under(expected.size());
  std::vector<std::string> raised(2);
  std::atomic<int> refused{0};
  run_in_process(2, [&](Communicator& comm) {
    const int r = comm.rank();
    const ParallelConfig par{2, 2, 8, 0};
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
    cpu::ThreadPool pool(1);
    const auto w = synthetic::make_expert_weights(p, first_local_expert(par, p, r), kSeed, pool);
    MoeLayer layer(m, par, options(QuantScheme::kBlock128), {w.view(), nullptr}, comm);
    const std::int64_t o = offset[static_cast<std::size_t>(r)], n = count[static_cast<std::size_t>(r)];
    const std::uint16_t* h = g.hidden.data() + o * K;
    const float* l = g.logits.data() + o * E;
    layer.enqueue(h, l, n, declared.data() + o * K, nullptr, {}, 8);
    layer.check_status();
    layer.enqueue(h, l, n, under.data() + o * K, nullptr, {}, r == 0 ? 3 : 8);
    try {
      layer.check_status();
    } catch (const Error& e) {
      raised[static_cast<std::size_t>(r)] = e.what();
    }
    try {
      layer.enqueue(h, l, n, under.data() + o * K, nullptr, {}, n - 1);
    } catch (const Error& e) {
      if (std::string(e.what()).find("max_tokens_any_rank = " + std::to_string(n - 1)) != std::string::npos) ++refused;
    }
  });
  EXPECT_TRUE(declared == expected) << "declaring the step's most tokens changed its outputs";
  EXPECT_NE(raised[0].find("expert 0 received 11 rows, more than the 6"), std::string::npos) << raised[0];
  EXPECT_EQ(raised[1], "");
  EXPECT_EQ(refused.load(), 2);
}

TEST(LayerBadInput, NaNLogitNamesTheToken) {
  const ModelConfig m = tiny_model(false);
  synthetic::Tokens g = tokens(m, 4, 1);
  g.logits[static_cast<std::size_t>(2 * m.num_experts + 3)] = std::nanf("");
  expect_error([&] { run_layout(m, g, {4}, 1, 4, options(QuantScheme::kBlock128), kSeed); }, "token 2");
}

// A Qwen2-MoE-style model: softmax routing and one gated shared expert twice the routed ones' size.
ModelConfig tiny_gated_shared() {
  ModelConfig m = tiny_model(false);
  m.name = "tiny-gated-shared";
  m.num_shared_experts = 1;
  m.shared_intermediate_size = 2 * m.moe_intermediate_size;
  m.shared_expert_gate = true;
  return m;
}

// Shared experts in the step (DeepSeek's ungated one, Qwen2-MoE's gated one), every scheme, both
// formats, chunked: the float64 reference with them and, with LayerOptions::shared_experts = false,
// without them; the two outputs differ by the shared experts' share, which is not small.
TEST(SharedExperts, MatchTheReferenceInEveryScheme) {
  for (const ModelConfig& m : {tiny_model(true), tiny_gated_shared()}) {
    const synthetic::Tokens g = tokens(m, 20, 9);
    for (QuantScheme q : all_quant_schemes()) {
      for (const char* experts : {"batched-fp8", "standard-fp8"}) {
        LayerOptions with = options(q, true), without = options(q, true);
        with.experts = without.experts = experts;
        without.shared_experts = false;
        const auto a = run_layout(m, g, {20}, 1, 8, with, kSeed, 1, true);
        const auto b = run_layout(m, g, {20}, 1, 8, without, kSeed, 1, true);
        const std::string where = fmt::format("{} {} {}", m.name, quant_name(q), experts);
        EXPECT_LT(a.error.relative(), tolerance(q)) << where;
        EXPECT_LT(b.error.relative(), tolerance(q)) << where;
        EXPECT_EQ(a.error.nan_outputs + b.error.nan_outputs, 0) << where;
        EXPECT_GT(testing::relative_difference(b.output, a.output), 0.1) << where;
        EXPECT_GT(a.workspace_bytes, b.workspace_bytes) << where;
      }
    }
  }
}

// The shared experts' step is one section of the layer's one workspace, planned by
// plan_shared_experts and bound under its prefix; across ranks every rank holds its own copy.
// gpt-oss-style expert biases (W1's and W2's, added in fp32 before each bf16 store) in the bf16
// recipe, both formats, over 2 ranks and chunks: the float64 reference with them, and they matter.
TEST(Layer, Bf16WithExpertBiases) {
  ModelConfig m = tiny_model(false);
  m.activation = Activation::kSwigluOai;
  m.expert_bias = true;
  ModelConfig plain = m;
  plain.expert_bias = false;
  const synthetic::Tokens g = tokens(m, 20, 17);
  for (const char* experts : {"batched-fp8", "standard-fp8"}) {
    LayerOptions o = options(QuantScheme::kBf16, true);
    o.experts = experts;
    const bool standard = std::string_view(experts) == "standard-fp8";
    const auto with = run_layout(m, g, {12, 8}, standard ? 1 : 2, 6, o, kSeed, 1, true);
    const auto without = run_layout(plain, g, {12, 8}, standard ? 1 : 2, 6, o, kSeed, 1, true);
    EXPECT_LT(with.error.relative(), kRelToleranceBf16) << experts;
    EXPECT_LT(without.error.relative(), kRelToleranceBf16) << experts;
    EXPECT_EQ(with.error.nan_outputs, 0) << experts;
    EXPECT_GT(testing::relative_difference(without.output, with.output), 0.05) << experts;
  }
}

TEST(SharedExperts, PlannedAsOneSectionOfTheWorkspace) {
  const ModelConfig m = tiny_gated_shared();
  const ParallelConfig par{1, 1, 16, 0};
  const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  cpu::ThreadPool pool(1);
  const auto w = synthetic::make_expert_weights(p, 0, kSeed, pool);
  const auto shared = synthetic::make_shared_experts(m, p, kSeed, pool);
  ASSERT_TRUE(shared.problem.has_value());
  EXPECT_EQ(shared.problem->N, 2 * m.shared_intermediate_size);
  EXPECT_EQ(shared.problem->M, 16);
  EXPECT_EQ(shared.problem->format, ActivationFormat::kStandard);
  LayerWeights lw{w.view(), nullptr};
  shared.set(lw);
  run_in_process(1, [&](Communicator& comm) {
    MoeLayer layer(m, par, options(QuantScheme::kBlock128, true), lw, comm);
    const WorkspacePlan& plan = layer.plan();
    const WorkspacePlan alone = plan_shared_experts(*shared.problem, Device::kCpu);
    EXPECT_EQ(plan.section(kSharedExpertsSection).owner, alone.name);
    EXPECT_GE(plan.section_bytes(kSharedExpertsSection), alone.total_bytes);
    for (const Region& r : alone.regions) {
      const Region* placed = plan.find_region(std::string(kSharedExpertsPrefix) + r.name);
      ASSERT_NE(placed, nullptr) << r.name;
      EXPECT_EQ(placed->offset - plan.section(kSharedExpertsSection).offset, r.offset) << r.name;
    }
    EXPECT_EQ(layer.plan().total_bytes,
              plan_layer(p, find_experts("batched-fp8", Device::kCpu), 1, 0, "", shared.problem).total_bytes);
    EXPECT_GT(layer.allocated_workspace_bytes(), plan.total_bytes);  // checked: guard bands
  });
}

TEST(SharedExperts, BadWeightsAreRefusedByName) {
  const ModelConfig gated = tiny_gated_shared(), deepseek = tiny_model(true), none = tiny_model(false);
  const ParallelConfig par{1, 1, 8, 0};
  cpu::ThreadPool pool(1);
  auto build = [&](const ModelConfig& m, const LayerOptions& o, const LayerWeights& lw) {
    run_in_process(1, [&](Communicator& c) { MoeLayer l(m, par, o, lw, c); });
  };
  const MoeProblem p = make_problem(gated, par, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  const auto w = synthetic::make_expert_weights(p, 0, kSeed, pool);
  const auto shared = synthetic::make_shared_experts(gated, p, kSeed, pool);
  const std::vector<float> bias = synthetic::make_routing_bias(deepseek.num_experts, kSeed);
  const LayerOptions o = options(QuantScheme::kBlock128);
  LayerWeights routed_only{w.view(), nullptr}, full = routed_only;
  shared.set(full);
  expect_error([&] { build(gated, o, routed_only); }, "has shared experts (shared_intermediate_size = 256)");
  expect_error([&] { build(none, o, full); }, "has none");
  LayerOptions off = o;
  off.shared_experts = false;
  expect_error([&] { build(gated, off, full); }, "LayerOptions::shared_experts is false");
  build(gated, off, routed_only);  // the routed experts alone
  LayerWeights no_gate = full;
  no_gate.shared_expert_gate = nullptr;
  expect_error([&] { build(gated, o, no_gate); }, "pass 256 bf16 values as LayerWeights::shared_expert_gate");
  // DeepSeek's shared expert has no gate, and is routed-size (N = 256): the gated model's (N = 512)
  // is refused by shape.
  LayerWeights wrong{w.view(), bias.data()};
  shared.set(wrong);
  wrong.shared_expert_gate = nullptr;
  expect_error([&] { build(deepseek, o, wrong); }, "shared experts' weights");
  LayerWeights extra_gate = wrong;
  extra_gate.shared_experts = w.view().expert(0);
  extra_gate.shared_expert_gate = shared.gate.data();
  expect_error([&] { build(deepseek, o, extra_gate); }, "has no shared expert gate");
}

}  // namespace
}  // namespace moekit
