// The Hopper GEMM config table and the one rule that chooses from it: pure functions of the problem,
// checked on the CPU.
#include <gtest/gtest.h>

#include "moekit/check.h"
#include "plan/gemm_config.h"

namespace moekit::plan {
namespace {

TEST(GemmConfig, TableRoundTripsAndCoversEveryConfig) {
  ASSERT_EQ(kNumGemmConfigs, 4);
  for (const auto& c : kGemmConfigs) {
    EXPECT_EQ(parse_gemm_config(c.name), c.id);
    EXPECT_EQ(gemm_config_info(c.id).name, c.name);
    EXPECT_EQ(c.tile_k, 128) << c.name;
    // Swap A/B puts the weights on the 128-row side and the tokens on tile_n.
    if (c.swap_ab) {
      EXPECT_EQ(c.tile_m, 128) << c.name;
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
    EXPECT_EQ(select_gemm_config(65, n, k), GemmConfig::kPingpong64x256);
    EXPECT_EQ(select_gemm_config(4096, n, k), GemmConfig::kPingpong64x256);
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

TEST(GemmConfig, EachGemmOfTheExpertsChoosesForItself) {
  // gpt-oss-120b: W1 n = 5760 (not a multiple of 256), W2 n = K = 2880 (not either).
  MoeProblem p;
  p.format = ActivationFormat::kBatchedExperts;
  p.K = 2880;
  p.N = 5760;
  p.activation = Activation::kSwigluOai;
  p.topk = 4;
  p.E = 128;
  p.E_local = 16;
  p.num_dispatchers = 8;
  p.max_tokens_per_rank = 256;
  p.M = 2048;
  // 256 tokens x 8 dispatchers x top-4 / 128 experts = 64 rows per expert.
  EXPECT_EQ(select_experts_gemm_configs(p, 256).w1, GemmConfig::kSwapAB128x64);
  EXPECT_EQ(select_experts_gemm_configs(p, 1024).w1, GemmConfig::kCooperative128x128);
  EXPECT_EQ(select_experts_gemm_configs(p, 1024).w2, GemmConfig::kCooperative128x128);
  // DeepSeek-V3-like: W1 n = 4096 and W2 n = 7168 are multiples of 256: pingpong for both.
  p.K = 7168;
  p.N = 4096;
  p.activation = Activation::kSilu;
  p.topk = 8;
  p.E = 256;
  const ExpertsGemmConfigs c = select_experts_gemm_configs(p, 1024);
  EXPECT_EQ(c.w1, GemmConfig::kPingpong64x256);
  EXPECT_EQ(c.w2, GemmConfig::kPingpong64x256);
  // The standard format counts this rank's tokens only.
  p.format = ActivationFormat::kStandard;
  EXPECT_EQ(select_experts_gemm_configs(p, 1024).w1, GemmConfig::kSwapAB128x32);
}

TEST(GemmConfig, ExpectedRowsPerExpert) {
  // DeepSeek-V3 DP 32, 256 tokens per rank: 8192 tokens, top-8 of 256 -> 256 rows per expert.
  EXPECT_EQ(expected_rows_per_expert(8192, 8, 256), 256);
  EXPECT_EQ(expected_rows_per_expert(256, 8, 256), 8);
  EXPECT_EQ(expected_rows_per_expert(1, 8, 256), 1);  // rounds up: never 0 for a non-empty layer
  EXPECT_EQ(expected_rows_per_expert(0, 8, 256), 0);
}

}  // namespace
}  // namespace moekit::plan
