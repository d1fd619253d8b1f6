// Dispatch from a named config to its instantiation (no CUTLASS here).
#include "cuda/check.h"
#include "cuda/grouped_gemm.h"

namespace moekit::cuda {

void grouped_fp8_gemm(plan::GemmConfig config, const GroupedGemmProblem& p, std::byte* args, std::byte* scratch,
                      std::int64_t scratch_bytes, std::int32_t* status, int num_sms, cudaStream_t stream) {
  switch (config) {
    case plan::GemmConfig::kSwapAB128x32:
      return grouped_fp8_gemm_swapab_128x32(p, args, scratch, scratch_bytes, status, num_sms, stream);
    case plan::GemmConfig::kSwapAB128x64:
      return grouped_fp8_gemm_swapab_128x64(p, args, scratch, scratch_bytes, status, num_sms, stream);
    case plan::GemmConfig::kPingpong64x256:
      MOEKIT_CUDA_REQUIRE(p.n % 256 == 0, "pingpong-64x256 needs n % 256 == 0, got n = " + std::to_string(p.n));
      return grouped_fp8_gemm_pingpong_64x256(p, args, scratch, scratch_bytes, status, num_sms, stream);
    case plan::GemmConfig::kCooperative128x128:
      return grouped_fp8_gemm_cooperative_128x128(p, args, scratch, scratch_bytes, status, num_sms, stream);
  }
  MOEKIT_CUDA_REQUIRE(false, "unknown GEMM config " + std::to_string(static_cast<int>(config)));
}

}  // namespace moekit::cuda
