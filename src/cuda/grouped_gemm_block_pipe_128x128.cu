// Grouped FP8 GEMM with 1x128 / 128x128 block scales, config block-pipe-128x128: moekit's main loop
// whose promotion overlaps its own warpgroup's next MMAs (cuda/block_gemm_pipe_sm90.cuh), D = bf16.
#include "cuda/block_gemm_pipe_sm90.cuh"

namespace moekit::cuda {
template <>
void grouped_fp8_gemm_block_instance<plan::GemmConfig::kBlockPipe128x128>(const GroupedGemmLaunch& launch,
                                                                          void* stream) {
  detail::run_block_gemm_pipe<plan::GemmConfig::kBlockPipe128x128>(launch, static_cast<cudaStream_t>(stream));
}
}  // namespace moekit::cuda
