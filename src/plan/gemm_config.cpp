// Tile configurations of the grouped FP8 GEMMs and the rule that chooses among them.
#include "plan/gemm_config.h"

#include "moekit/check.h"

namespace moekit::plan {

const std::vector<GemmConfigInfo>& gemm_configs() {
  static const std::vector<GemmConfigInfo> all = {
      {GemmConfig::kSwapAB128x32, "swapab-128x32", 128, 32, 128, true,
       "m_e <= 32: a 128-row token tile would be mostly padding; weights take the 128 side"},
      {GemmConfig::kSwapAB128x64, "swapab-128x64", 128, 64, 128, true,
       "32 < m_e <= 64: weights read once per 64-token tile (128x32 would read them twice)"},
      {GemmConfig::kPingpong64x256, "pingpong-64x256", 64, 256, 128, false,
       "m_e > 64, n % 256 == 0: pingpong overlaps one tile's epilogue with the other's MMA"},
      {GemmConfig::kCooperative128x128, "cooperative-128x128", 128, 128, 128, false,
       "m_e > 64 when n % 256 != 0: 128x128 tiles, both warpgroups on one tile"},
  };
  return all;
}

const GemmConfigInfo& gemm_config_info(GemmConfig config) {
  for (const auto& c : gemm_configs())
    if (c.id == config) return c;
  MOEKIT_FAIL("unknown GEMM config {}", static_cast<int>(config));
}

GemmConfig parse_gemm_config(std::string_view name) {
  std::string valid;
  for (const auto& c : gemm_configs()) {
    if (c.name == name) return c.id;
    valid += (valid.empty() ? "" : ", ") + std::string(c.name);
  }
  MOEKIT_FAIL("unknown GEMM config '{}': valid configs are {}", name, valid);
}

std::int64_t expected_rows_per_expert(std::int64_t M, std::int64_t topk, std::int64_t E) {
  MOEKIT_CHECK(M >= 0 && topk >= 1 && E >= 1, "expected_rows_per_expert: M = {}, topk = {}, E = {}", M, topk, E);
  // Uniform routing: M rows of capacity per expert hold T*D tokens, each picking topk of E experts.
  return (M * topk + E - 1) / E;
}

GemmConfig select_gemm_config(std::int64_t expected_rows, std::int64_t n, std::int64_t k) {
  MOEKIT_CHECK(expected_rows >= 0 && n >= 1 && k >= 1, "select_gemm_config: rows = {}, n = {}, k = {}", expected_rows,
               n, k);
  MOEKIT_CHECK(n % 16 == 0 && k % 16 == 0, "grouped FP8 GEMM needs n = {} and k = {} to be multiples of 16", n, k);
  if (expected_rows <= 32) return GemmConfig::kSwapAB128x32;
  if (expected_rows <= 64) return GemmConfig::kSwapAB128x64;
  // Measured on an H200 (docs/PERF.md, DeepSeek-V3 shapes, E_local = 16): pingpong-64x256 beat
  // cooperative-128x128 at m_e = 64, 256 and 1024 (0.430 vs 0.436 ms at 256, 1.49 vs 1.63 ms at
  // 1024). Its 256-wide tile needs n % 256 == 0 to avoid a ragged last column tile.
  if (n % 256 == 0) return GemmConfig::kPingpong64x256;
  return GemmConfig::kCooperative128x128;
}

}  // namespace moekit::plan
