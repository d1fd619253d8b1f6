// Grouped FP8 GEMM, config swapab-128x32: D^T = W . A^T with the weights on the 128-row side and up to 32 tokens
// per tile. For experts with few rows (m_e <= 32): a 128-row token tile would be mostly padding.
// One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {

using SwapAB128x32 = detail::GroupedFp8Gemm<cute::Shape<cute::_128, cute::_32, cute::_128>,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                                            cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, true>;

void grouped_fp8_gemm_swapab_128x32(const GroupedGemmProblem& p, std::byte* args, std::byte* scratch,
                                    std::int64_t scratch_bytes, std::int32_t* status, int num_sms,
                                    cudaStream_t stream) {
  detail::run_grouped_fp8_gemm<SwapAB128x32>(p, args, scratch, scratch_bytes, status, num_sms, stream);
}

}  // namespace moekit::cuda
