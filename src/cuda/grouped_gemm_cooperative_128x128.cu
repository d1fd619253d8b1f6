// Grouped FP8 GEMM, config cooperative-128x128: both consumer warpgroups on one 128x128x128 tile.
// For experts with many rows (m_e > 128). One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {

using Cooperative128x128 =
    detail::GroupedFp8Gemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                           cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, false>;

void grouped_fp8_gemm_cooperative_128x128(const GroupedGemmProblem& p, std::byte* args, std::byte* scratch,
                                          std::int64_t scratch_bytes, std::int32_t* status, int num_sms,
                                          cudaStream_t stream) {
  detail::run_grouped_fp8_gemm<Cooperative128x128>(p, args, scratch, scratch_bytes, status, num_sms, stream);
}

}  // namespace moekit::cuda
