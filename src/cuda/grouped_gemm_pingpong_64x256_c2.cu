// Grouped FP8 GEMM, config pingpong-64x256-c2: pingpong 64x256x128 tiles in 2x1 clusters, the two
// CTAs of a cluster on adjacent 64-row tiles of one expert sharing each weight tile by TMA
// multicast. One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {

using Pingpong64x256Cluster2 = detail::GroupedFp8Gemm<
    cute::Shape<cute::_64, cute::_256, cute::_128>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, false, cute::Shape<cute::_2, cute::_1, cute::_1>>;

void grouped_fp8_gemm_pingpong_64x256_c2(const GroupedGemmProblem& p, std::byte* args, std::byte* scratch,
                                         std::int64_t scratch_bytes, std::int32_t* status, int num_sms,
                                         cudaStream_t stream) {
  detail::run_grouped_fp8_gemm<Pingpong64x256Cluster2>(p, args, scratch, scratch_bytes, status, num_sms, stream);
}

}  // namespace moekit::cuda
