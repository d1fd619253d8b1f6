// Grouped FP8 GEMM, config swapab-128x64: D^T = W . A^T with the weights on the 128-row side and up to 64 tokens
// per tile. For 32 < m_e <= 64: the weights are read once per token tile, as with 128x32 at m_e <= 32.
// One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {

using SwapAB128x64 = detail::GroupedFp8Gemm<cute::Shape<cute::_128, cute::_64, cute::_128>,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                                            cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, true>;

void grouped_fp8_gemm_swapab_128x64(const GroupedGemmProblem& p, std::byte* args, std::byte* scratch,
                                    std::int64_t scratch_bytes, std::int32_t* status, int num_sms,
                                    cudaStream_t stream) {
  detail::run_grouped_fp8_gemm<SwapAB128x64>(p, args, scratch, scratch_bytes, status, num_sms, stream);
}

}  // namespace moekit::cuda
