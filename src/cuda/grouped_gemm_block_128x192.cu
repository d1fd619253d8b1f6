// Grouped FP8 GEMM with 1x128 / 128x128 block scales, config block-128x192: moekit's own main loop
// (cuda/block_gemm_sm90.cuh; its tile: the row of plan/gemm_config.h), D = bf16.
#include "cuda/block_gemm_sm90.cuh"

namespace moekit::cuda {
template <>
void grouped_fp8_gemm_block_instance<plan::GemmConfig::kBlock128x192>(const GroupedGemmLaunch& launch, void* stream) {
  detail::run_block_gemm<plan::GemmConfig::kBlock128x192>(launch, static_cast<cudaStream_t>(stream));
}
}  // namespace moekit::cuda
