// The Hopper GEMM config table and the one rule that chooses from it: pure functions of the problem,
// checked on the CPU.
#include <gtest/gtest.h>

#include "moekit/check.h"
#include "plan/gemm_config.h"

namespace moekit::plan {
namespace {

TEST(GemmConfig, TableRoundTripsAndCoversEveryConfig) {
  ASSERT_EQ(kNumGemmConfigs, 7);
  for (const auto& c : kGemmConfigs) {
    EXPECT_EQ(parse_gemm_config(c.name), c.id);
    EXPECT_EQ(gemm_config_info(c.id).name, c.name);
    EXPECT_EQ(c.tile_k, 128) << c.name;
    // Swap A/B puts the weights on the 128-row side and the tokens on tile_n; a fused W1 holds a
    // gate block and its up block: 256 weight rows (the N side of moekit's own main loop, unswapped),
    // cooperative, block-scaled only.
    if (c.swap_ab) {
      EXPECT_EQ(c.tile_m, 128) << c.name;
    }
    if (c.fused_w1) {
      EXPECT_TRUE(!c.swap_ab && c.tile_n == 256) << c.name;
      EXPECT_TRUE(c.schedule == GemmSchedule::kCooperative && !c.token_scaled && !c.block_scaled) << c.name;
      EXPECT_TRUE(c.name.starts_with("fused-w1")) << c.name;
    }
    // moekit's main loop is one shape, block-scaled, columns in whole 128-wide weight blocks: 128
    // tokens x 256 weight rows, unswapped (cuda/block_gemm_sm90.cuh).
    if (c.main_loop == GemmMainLoop::kMoekit) {
      EXPECT_TRUE(!c.token_scaled && c.n_multiple == 128 && c.tile_m == 128 && !c.swap_ab && c.tile_n == 256) << c.name;
    } else {
      EXPECT_FALSE(c.fused_w1) << c.name;  // the fused W1 is moekit's main loop alone
    }
    // The fused recipe's small experts: CUTLASS's swapped block-scaled tiles of at most 64 tokens.
    if (c.w1_fp32) {
      EXPECT_TRUE(c.swap_ab && c.block_scaled && c.main_loop == GemmMainLoop::kCutlass && c.max_rows > 0 &&
                  c.max_rows <= fused_w1_small_rows())
          << c.name;
    }
    EXPECT_EQ(c.schedule == GemmSchedule::kPingpong, c.name.starts_with("pingpong")) << c.name;
  }
  for (int i = 0; i < kNumGemmConfigs; ++i) EXPECT_EQ(&gemm_config_info(static_cast<GemmConfig>(i)), &kGemmConfigs[i]);
  EXPECT_THROW(parse_gemm_config("huge-512x512"), Error);
}

TEST(GemmConfig, SelectionFollowsRowsPerExpert) {
  // DeepSeek-V3 W1 (n = 4096, k = 7168) and W2 (n = 7168, k = 2048).
  for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{4096, 7168}, {7168, 2048}}) {
    EXPECT_EQ(select_gemm_config(0, n, k), GemmConfig::kSwapAB128x32);
    EXPECT_EQ(select_gemm_config(8, n, k), GemmConfig::kSwapAB128x32);
    EXPECT_EQ(select_gemm_config(32, n, k), GemmConfig::kSwapAB128x32);
    EXPECT_EQ(select_gemm_config(33, n, k), GemmConfig::kSwapAB128x64);
    EXPECT_EQ(select_gemm_config(64, n, k), GemmConfig::kSwapAB128x64);
    // Precise accumulation (the default) past 64 rows: cooperative (pingpong-64x256 spills there);
    // fast accumulation: pingpong.
    EXPECT_EQ(select_gemm_config(65, n, k), GemmConfig::kCooperative128x128);
    EXPECT_EQ(select_gemm_config(4096, n, k), GemmConfig::kCooperative128x128);
    const auto fast = Accumulation::kFast;
    EXPECT_EQ(select_gemm_config(64, n, k, QuantScheme::kPerTokenPerChannel, fast), GemmConfig::kSwapAB128x64);
    EXPECT_EQ(select_gemm_config(65, n, k, QuantScheme::kPerTokenPerChannel, fast), GemmConfig::kPingpong64x256);
    EXPECT_EQ(select_gemm_config(4096, n, k, QuantScheme::kPerTokenPerChannel, fast), GemmConfig::kPingpong64x256);
  }
  // n not a multiple of 256 (Qwen3-30B's W1 n = 1536 = 6 x 256 is fine; 1552 is not).
  EXPECT_EQ(select_gemm_config(65, 1552, 4096), GemmConfig::kCooperative128x128);
  EXPECT_EQ(select_gemm_config(2048, 1552, 4096), GemmConfig::kCooperative128x128);
  EXPECT_FALSE(supports(gemm_config_info(GemmConfig::kPingpong64x256), 1552, 4096));
  EXPECT_TRUE(supports(gemm_config_info(GemmConfig::kCooperative128x128), 1552, 4096));
  EXPECT_THROW(select_gemm_config(64, 1000, 4096), Error);
  EXPECT_THROW(select_gemm_config(64, 1024, 4100), Error);
  EXPECT_THROW(select_gemm_config(-1, 1024, 4096), Error);
}

TEST(GemmConfig, LaunchesCoverTheRowsAStepCanHold) {
  // DeepSeek-V3's W1: the rule's three ranges; a step of at most 20 rows per expert needs the first.
  const GemmLaunches all =
      plan_gemm_launches(4096, 7168, 8192, QuantScheme::kPerTokenPerChannel, false, Accumulation::kFast);
  ASSERT_EQ(all.count, 3);
  EXPECT_EQ(all.config[0], GemmConfig::kSwapAB128x32);
  EXPECT_EQ(all.config[1], GemmConfig::kSwapAB128x64);
  EXPECT_EQ(all.config[2], GemmConfig::kPingpong64x256);
  EXPECT_EQ(plan_gemm_launches(4096, 7168, 8192).config[2], GemmConfig::kCooperative128x128);  // precise
  EXPECT_EQ(all.lo[0], 0);
  EXPECT_EQ(all.hi[0], 32);
  EXPECT_EQ(all.lo[1], 33);
  EXPECT_EQ(all.hi[1], 64);
  EXPECT_EQ(all.lo[2], 65);
  // Each row count lands in exactly one launch, the one select_gemm_config picks.
  for (std::int64_t rows = 0; rows <= 300; ++rows) {
    int hits = 0;
    for (int j = 0; j < all.count; ++j)
      if (rows >= all.lo[j] && rows <= all.hi[j]) {
        ++hits;
        EXPECT_EQ(all.config[j],
                  select_gemm_config(rows, 4096, 7168, QuantScheme::kPerTokenPerChannel, Accumulation::kFast))
            << rows;
      }
    EXPECT_EQ(hits, 1) << rows;
  }
  EXPECT_EQ(plan_gemm_launches(4096, 7168, 20).count, 1);
  EXPECT_EQ(plan_gemm_launches(4096, 7168, 0).count, 1);
  EXPECT_EQ(plan_gemm_launches(4096, 7168, 64).count, 2);
  // gpt-oss-120b's W1 (n = 5760: not a multiple of 256): cooperative takes the large experts.
  const GemmLaunches oss = plan_gemm_launches(5760, 2880, 1000);
  ASSERT_EQ(oss.count, 3);
  EXPECT_EQ(oss.config[2], GemmConfig::kCooperative128x128);
  EXPECT_EQ(describe(oss),
            "swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64), cooperative-128x128 (m_e > 64; a last tile of <= 64 "
            "rows apart)");
  EXPECT_EQ(single_launch(GemmConfig::kPingpong64x256).count, 1);
  // Its ragged experts' last <= 64 rows leave for the swapped launches (ragged_tail_rows); no other
  // launch splits, nor a lone launch (nowhere for the tail to go).
  EXPECT_EQ(oss.tail_tile[0], 0);
  EXPECT_EQ(oss.tail_tile[1], 0);
  EXPECT_EQ(oss.tail_tile[2], 128);
  for (int j = 0; j < all.count; ++j) EXPECT_EQ(all.tail_tile[j], 0) << "pingpong-64x256's 64-row tiles: no split";
  EXPECT_EQ(single_launch(GemmConfig::kCooperative128x128).tail_tile[0], 0);
  EXPECT_EQ(plan_gemm_launches(5760, 2880, 64).count, 2);  // no cooperative launch: nothing to split
  // Block-scaled: pingpong-64x256 has no block-scaled instance, cooperative-128x128 takes m_e > 64.
  const GemmLaunches block = plan_gemm_launches(4096, 7168, 1000, QuantScheme::kBlock128);
  EXPECT_EQ(describe(block),
            "swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64), cooperative-128x128 (m_e > 64; a last tile of <= 64 "
            "rows apart)");
  EXPECT_FALSE(supports(gemm_config_info(GemmConfig::kPingpong64x256), 4096, 7168, QuantScheme::kBlock128));
  EXPECT_TRUE(supports(gemm_config_info(GemmConfig::kPingpong64x256), 4096, 7168));
  EXPECT_EQ(select_gemm_config(65, 4096, 7168, QuantScheme::kBlock128), GemmConfig::kCooperative128x128);
  // Block-scaled GEMMs of k <= 2048 (DeepSeek-V3's W2): block-128x256 takes m_e > 64; k = 2064 is
  // past its max_k, cooperative-128x128 again. Per-token: it has no instance, cooperative (pingpong, fast).
  EXPECT_EQ(describe(plan_gemm_launches(7168, 2048, 1000, QuantScheme::kBlock128)),
            "swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64), block-128x256 (m_e > 64)");
  EXPECT_EQ(select_gemm_config(65, 7168, 2048, QuantScheme::kBlock128), GemmConfig::kBlock128x256);
  EXPECT_EQ(select_gemm_config(65, 7168, 2064, QuantScheme::kBlock128), GemmConfig::kCooperative128x128);
  EXPECT_EQ(select_gemm_config(64, 7168, 2048, QuantScheme::kBlock128), GemmConfig::kSwapAB128x64);
  EXPECT_EQ(select_gemm_config(65, 7168, 2048), GemmConfig::kCooperative128x128);
  EXPECT_EQ(select_gemm_config(65, 7168, 2048, QuantScheme::kPerTokenPerChannel, Accumulation::kFast),
            GemmConfig::kPingpong64x256);
  EXPECT_TRUE(chosen_for_k(gemm_config_info(GemmConfig::kCooperative128x128), 1 << 20));
  EXPECT_FALSE(chosen_for_k(gemm_config_info(GemmConfig::kBlock128x256), 2049));
  // eligible = runs it and its max_k admits k: block-128x256 runs k = 2064, the rule does not choose it.
  const GemmConfigInfo& block256 = gemm_config_info(GemmConfig::kBlock128x256);
  EXPECT_TRUE(supports(block256, 7168, 2064, QuantScheme::kBlock128));
  EXPECT_FALSE(eligible(block256, 7168, 2064, QuantScheme::kBlock128));
  EXPECT_TRUE(eligible(block256, 7168, 2048, QuantScheme::kBlock128));
  EXPECT_FALSE(eligible(block256, 7168, 2048));  // per-token: no instance
  EXPECT_THROW(plan_gemm_launches(1000, 4096, 10), Error);
}

// The one rule of a ragged expert's tail: the last token tile's rows when at most half a tile and a
// whole tile precedes it.
TEST(GemmConfig, RaggedTailRows) {
  EXPECT_EQ(ragged_tail_rows(129, 128), 1);
  EXPECT_EQ(ragged_tail_rows(192, 128), 64);
  EXPECT_EQ(ragged_tail_rows(193, 128), 0);  // 65 rows: more than half a tile stays
  EXPECT_EQ(ragged_tail_rows(300, 128), 44);
  EXPECT_EQ(ragged_tail_rows(320, 128), 64);
  EXPECT_EQ(ragged_tail_rows(128, 128), 0);  // whole tiles
  EXPECT_EQ(ragged_tail_rows(1024, 128), 0);
  EXPECT_EQ(ragged_tail_rows(100, 128), 0);  // no whole tile before it
  EXPECT_EQ(ragged_tail_rows(0, 128), 0);
  EXPECT_EQ(ragged_tail_rows(300, 0), 0);  // a launch that does not split
}

// The fused W1: asked for (fuse_w1), block128 with an activation whose 256-row tiles hold whole
// output groups.
TEST(GemmConfig, FusedW1) {
  MoeProblem p;
  p.format = ActivationFormat::kBatchedExperts;
  p.quant = QuantScheme::kBlock128;
  p.activation = Activation::kSilu;
  p.K = 7168;
  p.N = 4096;
  p.M = 8192;
  p.max_tokens_per_rank = 256;
  p.num_dispatchers = 32;
  p.E_local = 16;
  EXPECT_FALSE(fuses_w1(p));  // not the default: measured slower (docs/PERF.md)
  const ExpertsGemmPlan unfused = plan_experts_gemms(p, 256);
  EXPECT_FALSE(unfused.fused_w1);
  EXPECT_THROW(single_config(GemmConfig::kFusedW1Block128x256, p), Error);
  p.fuse_w1 = true;
  EXPECT_TRUE(fuses_w1(p));
  const ExpertsGemmPlan g = plan_experts_gemms(p, 256);
  EXPECT_TRUE(g.fused_w1);
  // The experts of <= 64 rows run CUTLASS's swapped tiles into w1_small (fp32), the rest the fused W1.
  EXPECT_EQ(fused_w1_small_rows(), 64);
  EXPECT_TRUE(g.w1_small);
  EXPECT_FALSE(unfused.w1_small);
  EXPECT_EQ(describe(g.w1), "swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64), fused-w1-128x256 (m_e > 64)");
  // Steps of at most 64 rows an expert launch no fused W1 at all.
  EXPECT_EQ(describe(plan_experts_gemms(p, 2).w1), "swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64)");
  // W2 (k = I = 2048) on block-128x256 past 64 rows in both recipes; the unfused W1 (k = 7168) on cooperative.
  EXPECT_EQ(describe(g.w2), "swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64), block-128x256 (m_e > 64)");
  EXPECT_EQ(describe(unfused.w2), describe(g.w2));
  EXPECT_EQ(describe(unfused.w1),
            "swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64), cooperative-128x128 (m_e > 64; a last tile of <= 64 "
            "rows apart)");
  // A forced fused config runs W1 only; W2 keeps the rule.
  const ExpertsGemmPlan forced = single_config(GemmConfig::kFusedW1Block128x256, p);
  EXPECT_TRUE(forced.fused_w1);
  EXPECT_FALSE(forced.w1_small);  // every expert on the fused W1
  // The activation kernel runs unfused, and fused for w1_small's experts; never after the fused W1 alone.
  EXPECT_TRUE(runs_activation_kernel(unfused));
  EXPECT_TRUE(runs_activation_kernel(g));
  EXPECT_FALSE(runs_activation_kernel(forced));
  EXPECT_EQ(forced.w1.count, 1);
  EXPECT_EQ(describe(forced.w2), describe(g.w2));
  EXPECT_THROW(single_config(GemmConfig::kCooperative128x128, p), Error);  // the recipe fuses
  // Fused configs never run a plain GEMM, plain configs never the fused W1.
  EXPECT_FALSE(supports(gemm_config_info(GemmConfig::kFusedW1Block128x256), 4096, 7168, QuantScheme::kBlock128));
  EXPECT_FALSE(supports(gemm_config_info(GemmConfig::kCooperative128x128), 4096, 7168, QuantScheme::kBlock128, true));
  EXPECT_TRUE(supports(gemm_config_info(GemmConfig::kSwapAB128x64), 4096, 7168, QuantScheme::kBlock128, true));
  EXPECT_FALSE(
      supports(gemm_config_info(GemmConfig::kFusedW1Block128x256), 4096, 7168, QuantScheme::kPerTokenPerChannel, true));
  // Non-gated and other schemes; swigluoai's interleaved rows stay unfused.
  p.activation = Activation::kRelu2;
  p.N = 2048;
  EXPECT_TRUE(fuses_w1(p));
  p.activation = Activation::kSwigluOai;
  p.N = 4096;
  EXPECT_FALSE(fuses_w1(p));
  EXPECT_THROW(single_config(GemmConfig::kFusedW1Block128x256, p), Error);
  p.activation = Activation::kSilu;
  p.quant = QuantScheme::kPerTokenPerChannel;
  EXPECT_FALSE(fuses_w1(p));
  EXPECT_FALSE(plan_experts_gemms(p, 256).fused_w1);
  // validate_problem refuses what cannot fuse, naming the fix.
  p.topk = 8;
  p.E = 256;
  p.max_tokens_per_rank = 8192;
  p.num_dispatchers = 1;
  EXPECT_THROW(validate_problem(p), Error);
  p.quant = QuantScheme::kBlock128;
  EXPECT_NO_THROW(validate_problem(p));
  p.activation = Activation::kSwigluOai;
  EXPECT_THROW(validate_problem(p), Error);
}

// A batched problem of `dispatchers` x `max_tokens_per_rank` rows an expert (M), for the row rules.
MoeProblem batched(std::int64_t dispatchers, std::int64_t max_tokens_per_rank) {
  MoeProblem p;
  p.format = ActivationFormat::kBatchedExperts;
  p.num_dispatchers = dispatchers;
  p.max_tokens_per_rank = max_tokens_per_rank;
  p.M = dispatchers * max_tokens_per_rank;
  return p;
}

TEST(GemmConfig, MaxRowsPerExpert) {
  MoeProblem p = batched(8, 256);
  // Each token picks an expert at most once: 8 dispatchers x T tokens, at most M.
  EXPECT_EQ(max_rows_per_expert(p, 4), 32);
  EXPECT_EQ(max_rows_per_expert(p, 256), 2048);
  p.format = ActivationFormat::kStandard;
  p.M = 256;
  EXPECT_EQ(max_rows_per_expert(p, 100), 100);
}

// The tokens per dispatcher a step is planned for: one dispatcher's own; with several, the declared
// most of any rank, else max_tokens_per_rank; a declaration outside [own tokens, max] is an error.
TEST(GemmConfig, StepTokensPerRank) {
  MoeProblem p = batched(32, 256);
  EXPECT_EQ(step_tokens_per_rank(p, 1, 0), 256);  // not known: every rank may feed max_tokens_per_rank
  EXPECT_EQ(step_tokens_per_rank(p, 1, 2), 2);
  EXPECT_EQ(step_tokens_per_rank(p, 0, 2), 2);
  EXPECT_EQ(step_tokens_per_rank(p, 2, 2), 2);
  EXPECT_EQ(step_tokens_per_rank(p, 256, 256), 256);
  // DeepSeek-V3 DP 32 decode, 2 tokens a rank: 64 rows an expert at most, so the launches of the
  // ranges above 64 rows are not planned (today's table: two of three ranges).
  const MoeProblem per_token = [&] {
    MoeProblem q = p;
    q.K = 7168;
    q.N = 4096;
    q.topk = 8;
    q.E = 256;
    q.E_local = 8;
    return q;
  }();
  EXPECT_EQ(plan_experts_gemms(per_token, step_tokens_per_rank(per_token, 2, 2)).w1.count, 2);
  EXPECT_EQ(plan_experts_gemms(per_token, step_tokens_per_rank(per_token, 1, 1)).w1.count, 1);
  EXPECT_EQ(plan_experts_gemms(per_token, step_tokens_per_rank(per_token, 2, 0)).w1.count,
            plan_experts_gemms(per_token, 256).w1.count);
  for (const std::int64_t bad : {-1, 1, 257}) {
    try {
      step_tokens_per_rank(p, 2, bad);
      ADD_FAILURE() << "max_tokens_any_rank = " << bad << " was accepted for a rank of 2 tokens";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_tokens_any_rank = " + std::to_string(bad)), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("max_tokens_per_rank = 256"), std::string::npos) << e.what();
    }
  }
  // One dispatcher: its own tokens bound every expert, declared or not.
  p.num_dispatchers = 1;
  p.M = 256;
  EXPECT_EQ(step_tokens_per_rank(p, 5, 0), 5);
  EXPECT_EQ(step_tokens_per_rank(p, 5, 9), 5);
  EXPECT_EQ(step_tokens_per_rank(p, 0, 0), 256);  // 0 tokens: not known (the rule before the hint)
  const std::string msg = over_step_bound_message("batched-fp8 (cuda)", 3, 70, 64);
  EXPECT_NE(msg.find("expert 3 received 70 rows, more than the 64"), std::string::npos) << msg;
}

}  // namespace
}  // namespace moekit::plan
