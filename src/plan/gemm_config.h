// The short, named list of grouped FP8 GEMM tile configurations of the Hopper experts, and the pure
// function that picks one from the problem. One CUTLASS instantiation per config, one .cu file each
// (src/cuda/grouped_gemm_<name>.cu). Printable, unit-tested on the CPU.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace moekit::plan {

enum class GemmConfig : std::uint8_t {
  kSwapAB128x32,        // D^T = W x A^T: weights fill the 128-row side, m_e <= 32
  kSwapAB128x64,        // the same with 64-token tiles: 32 < m_e <= 64
  kPingpong64x256,      // two consumer warpgroups alternate 64x256 tiles: m_e > 64
  kCooperative128x128,  // both warpgroups on one 128x128 tile: m_e > 64 when n % 256 != 0
};

struct GemmConfigInfo {
  GemmConfig id;
  std::string_view name;
  int tile_m, tile_n, tile_k;  // CTA tile in the kernel's own (possibly swapped) M, N, K
  bool swap_ab;
  std::string_view why;
};

const std::vector<GemmConfigInfo>& gemm_configs();
const GemmConfigInfo& gemm_config_info(GemmConfig config);
GemmConfig parse_gemm_config(std::string_view name);

// Picks the config for GEMMs of shape (rows per expert, n, k). `expected_rows` is what one expert is
// expected to receive: the host never reads expert_num_tokens (that would need a synchronization),
// so it is M * topk / E for uniform routing.
GemmConfig select_gemm_config(std::int64_t expected_rows, std::int64_t n, std::int64_t k);
std::int64_t expected_rows_per_expert(std::int64_t M, std::int64_t topk, std::int64_t E);

}  // namespace moekit::plan
