// The Hopper GEMM config choice is a pure function of the problem: checked on the CPU.
#include <gtest/gtest.h>

#include "moekit/check.h"
#include "plan/gemm_config.h"

namespace moekit::plan {
namespace {

TEST(GemmConfig, NamedListRoundTrips) {
  ASSERT_EQ(gemm_configs().size(), 4u);
  for (const auto& c : gemm_configs()) {
    EXPECT_EQ(parse_gemm_config(c.name), c.id);
    EXPECT_EQ(gemm_config_info(c.id).name, c.name);
    EXPECT_EQ(c.tile_k, 128) << c.name;
  }
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
    EXPECT_EQ(select_gemm_config(128, n, k), GemmConfig::kPingpong64x256);
    EXPECT_EQ(select_gemm_config(129, n, k), GemmConfig::kPingpong64x256);
    EXPECT_EQ(select_gemm_config(4096, n, k), GemmConfig::kPingpong64x256);
  }
  // n not a multiple of 256 (e.g. Qwen3-30B's W1, n = 1536 = 6 x 256 is fine; 1552 is not).
  EXPECT_EQ(select_gemm_config(65, 1552, 4096), GemmConfig::kCooperative128x128);
  EXPECT_EQ(select_gemm_config(2048, 1552, 4096), GemmConfig::kCooperative128x128);
  EXPECT_THROW(select_gemm_config(64, 1000, 4096), Error);
  EXPECT_THROW(select_gemm_config(-1, 1024, 4096), Error);
}

TEST(GemmConfig, ExpectedRowsPerExpert) {
  // DeepSeek-V3 DP 32, 256 tokens per rank: M = 8192, top-8 of 256 -> 256 rows per expert.
  EXPECT_EQ(expected_rows_per_expert(8192, 8, 256), 256);
  EXPECT_EQ(expected_rows_per_expert(256, 8, 256), 8);
  EXPECT_EQ(expected_rows_per_expert(1, 8, 256), 1);  // rounds up: never 0 for a non-empty layer
  EXPECT_EQ(expected_rows_per_expert(0, 8, 256), 0);
}

}  // namespace
}  // namespace moekit::plan
