// Grouped FP8 GEMM, config pingpong-64x256: two consumer warpgroups alternate 64x256x128 tiles, one's
// epilogue overlapping the other's MMA. For mid-sized experts (32 < m_e <= 128).
// One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {

using Pingpong64x256 = detail::GroupedFp8Gemm<cute::Shape<cute::_64, cute::_256, cute::_128>,
                                              cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, false>;

void grouped_fp8_gemm_pingpong_64x256(const GroupedGemmProblem& p, std::byte* args, std::byte* scratch,
                                      std::int64_t scratch_bytes, std::int32_t* status, int num_sms,
                                      cudaStream_t stream) {
  detail::run_grouped_fp8_gemm<Pingpong64x256>(p, args, scratch, scratch_bytes, status, num_sms, stream);
}

}  // namespace moekit::cuda
