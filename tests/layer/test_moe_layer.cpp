// The whole layer on the CPU backend: outputs bit-identical however the global tokens are spread
// over ranks and chunks, repeatable, standard == batched, edge cases (a rank with 0 tokens, 1 token,
// every token to one expert so m_e == M, topk == E_local, chunked steps), checked mode (guard bands,
// NaN poisoning) and the float64 reference within the recipe's tolerance, and bad input.
#include <gtest/gtest.h>

#include <cmath>

#include "layer_test_util.h"
#include "moekit/check.h"

namespace moekit {
namespace {

using testing::GlobalTokens;
using testing::make_tokens;
using testing::run_layout;
using testing::tiny_model;

// bf16 output rounding (2^-9 relative) plus rare one-ulp FP8 requantization flips where fp32 and
// float64 W1 sums round differently: measured ~2.4e-3 on these shapes; 1e-2 leaves margin and still
// fails on any real indexing or scaling bug (those give O(1) errors).
constexpr double kRelTolerance = 1e-2;

LayerOptions options(QuantScheme quant, bool checked = false) {
  LayerOptions o;
  o.quant = quant;
  o.checked = checked;
  o.reference = checked;
  o.seed = 7;
  o.num_threads = 1;
  return o;
}

class LayerAcrossRanks : public ::testing::TestWithParam<std::tuple<bool, QuantScheme>> {};

TEST_P(LayerAcrossRanks, BitIdenticalToOneRank) {
  const auto [grouped, quant] = GetParam();
  const ModelConfig m = tiny_model(grouped);
  const GlobalTokens g = make_tokens(m, 32, 11);
  const auto one = run_layout(m, g, {32}, 1, 32, options(quant));
  const auto four = run_layout(m, g, {8, 8, 8, 8}, 4, 8, options(quant));
  EXPECT_EQ(one.output, four.output) << m.name << " " << quant_name(quant);
  // Uneven: a rank with 0 tokens, one with 1, chunked steps (max_tokens_per_rank 4 < 15 tokens).
  const auto uneven = run_layout(m, g, {0, 1, 16, 15}, 4, 4, options(quant));
  EXPECT_EQ(one.output, uneven.output) << m.name << " " << quant_name(quant);
  // Repeated steps on the same layer, and checked mode, change nothing.
  const auto again = run_layout(m, g, {8, 8, 8, 8}, 4, 8, options(quant, true), 2);
  EXPECT_EQ(one.output, again.output) << m.name << " " << quant_name(quant);
  const double rel = std::sqrt(again.ref_err_sq / again.ref_norm_sq);
  EXPECT_LT(rel, kRelTolerance) << m.name << " " << quant_name(quant);
  EXPECT_GT(again.ref_norm_sq, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Quant, LayerAcrossRanks,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(QuantScheme::kPerTokenPerChannel,
                                                                                 QuantScheme::kBlock128)),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) ? "grouped_" : "softmax_") +
                                  (std::get<1>(param_info.param) == QuantScheme::kBlock128 ? "block128" : "per_token");
                         });

TEST(Layer, StandardEqualsBatchedOnOneRank) {
  const ModelConfig m = tiny_model(false);
  const GlobalTokens g = make_tokens(m, 20, 3);
  for (QuantScheme q : all_quant_schemes()) {
    LayerOptions b = options(q, true), s = options(q, true);
    s.format = ActivationFormat::kStandard;
    const auto rb = run_layout(m, g, {20}, 1, 20, b);
    const auto rs = run_layout(m, g, {20}, 1, 20, s);
    // Per-tensor activation scales span different tensors in the two formats (one per expert in
    // the batched buffer, one for all permuted rows in the standard one): equal only in tolerance.
    if (q != QuantScheme::kPerTensor) {
      EXPECT_EQ(rb.output, rs.output) << quant_name(q);
    }
    EXPECT_LT(std::sqrt(rb.ref_err_sq / rb.ref_norm_sq), kRelTolerance) << quant_name(q);
    EXPECT_LT(std::sqrt(rs.ref_err_sq / rs.ref_norm_sq), kRelTolerance) << quant_name(q);
    // Standard with pure data parallelism (ep = 1, every rank all experts) agrees too.
    if (q != QuantScheme::kPerTensor) {
      const auto rs2 = run_layout(m, g, {12, 8}, 1, 12, s);
      EXPECT_EQ(rb.output, rs2.output) << quant_name(q);
    }
  }
}

TEST(Layer, EveryTokenToOneExpertFillsCapacity) {
  ModelConfig m = tiny_model(false);
  GlobalTokens g = make_tokens(m, 16, 5);
  for (std::int64_t t = 0; t < 16; ++t) g.logits[static_cast<std::size_t>(t * m.num_experts + 5)] = 50.0f;
  // dp 4, 4 tokens each, max_tokens_per_rank 4: M = 16 and expert 5 receives all 16 rows (m_e == M).
  const auto four = run_layout(m, g, {4, 4, 4, 4}, 4, 4, options(QuantScheme::kPerTokenPerChannel, true));
  const auto one = run_layout(m, g, {16}, 1, 16, options(QuantScheme::kPerTokenPerChannel));
  EXPECT_EQ(one.output, four.output);
  EXPECT_LT(std::sqrt(four.ref_err_sq / four.ref_norm_sq), kRelTolerance);
}

TEST(Layer, TopkEqualsLocalExperts) {
  ModelConfig m = tiny_model(false);  // E = 16, ep = 4: E_local = 4 = topk
  const GlobalTokens g = make_tokens(m, 12, 9);
  const auto four = run_layout(m, g, {3, 3, 3, 3}, 4, 3, options(QuantScheme::kBlock128, true));
  const auto one = run_layout(m, g, {12}, 1, 12, options(QuantScheme::kBlock128));
  EXPECT_EQ(one.output, four.output);
}

TEST(Layer, WorkspaceIsThePlan) {
  const ModelConfig m = tiny_model(true);
  const GlobalTokens g = make_tokens(m, 8, 1);
  const auto r = run_layout(m, g, {4, 4}, 2, 4, options(QuantScheme::kPerTokenPerChannel));
  const MoeProblem p =
      make_problem(m, ParallelConfig{2, 2, 4, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kPerTokenPerChannel);
  EXPECT_EQ(r.workspace_bytes, plan_workspace("batched-fp8", p).total_bytes);
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no moekit::Error (expected: " << needle << ")";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(LayerBadInput, Construction) {
  const ModelConfig m = tiny_model(false);
  expect_error(
      [&] {
        run_in_process(2, [&](Communicator& c) { MoeLayer l(m, {4, 4, 8, 0}, options(QuantScheme::kBlock128), c); });
      },
      "dp = 4");
  LayerOptions s = options(QuantScheme::kBlock128);
  s.format = ActivationFormat::kStandard;
  expect_error([&] { run_in_process(2, [&](Communicator& c) {
                       MoeLayer l(m, {2, 2, 8, 0}, s, c);
                     }); },
               "standard format runs with ep == 1");
  expect_error(
      [&] {
        run_in_process(2, [&](Communicator& c) { MoeLayer l(m, {2, 2, 8, 0}, options(QuantScheme::kPerTensor), c); });
      },
      "per-tensor");
  expect_error(
      [&] {
        run_in_process(1, [&](Communicator& c) { MoeLayer l(m, {1, 1, 0, 0}, options(QuantScheme::kBlock128), c); });
      },
      "max_tokens_per_rank = 0");
}

TEST(LayerBadInput, NaNLogitNamesTheToken) {
  const ModelConfig m = tiny_model(false);
  GlobalTokens g = make_tokens(m, 4, 1);
  g.logits[static_cast<std::size_t>(2 * m.num_experts + 3)] = std::nanf("");
  expect_error([&] { run_layout(m, g, {4}, 1, 4, options(QuantScheme::kBlock128)); }, "token 2");
}

}  // namespace
}  // namespace moekit
