// The block-swap-128x64 config: moekit's own swapped block-scaled main loop (block_gemm_swap_sm90.cuh).
#include "cuda/block_gemm_swap_sm90.cuh"

namespace moekit::cuda {
template <>
void grouped_fp8_gemm_block_instance<plan::GemmConfig::kBlockSwap128x64>(const GroupedGemmLaunch& launch,
                                                                         void* stream) {
  detail::run_block_gemm_swap<plan::GemmConfig::kBlockSwap128x64>(launch, static_cast<cudaStream_t>(stream));
}
}  // namespace moekit::cuda
