// The fused W1 (block-scaled W1 GEMM -> activation -> 1x128 FP8 act_q / act_scale, no w1_out), config
// fused-w1-128x256: moekit's own main loop (cuda/block_gemm_sm90.cuh), a tile's two 128-column halves
// being gate block b and up block b (numerics::W1Rows::kBlockPairs).
#include "cuda/block_gemm_sm90.cuh"

namespace moekit::cuda {
template <>
void grouped_fp8_gemm_fused_w1_instance<plan::GemmConfig::kFusedW1Block128x256>(const GroupedGemmLaunch& launch,
                                                                                void* stream) {
  detail::run_block_gemm<plan::GemmConfig::kFusedW1Block128x256>(launch, static_cast<cudaStream_t>(stream));
}
}  // namespace moekit::cuda
