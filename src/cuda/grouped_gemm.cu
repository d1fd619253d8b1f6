// Dispatch from a named config to its instantiation (no CUTLASS here).
#include "cuda/check.h"
#include "cuda/grouped_gemm.h"

namespace moekit::cuda {

void grouped_fp8_gemm(plan::GemmConfig config, const GroupedGemmLaunch& l, void* stream) {
  switch (config) {
    case plan::GemmConfig::kSwapAB128x32: return grouped_fp8_gemm_instance<plan::GemmConfig::kSwapAB128x32>(l, stream);
    case plan::GemmConfig::kSwapAB128x64: return grouped_fp8_gemm_instance<plan::GemmConfig::kSwapAB128x64>(l, stream);
    case plan::GemmConfig::kPingpong64x256:
      return grouped_fp8_gemm_instance<plan::GemmConfig::kPingpong64x256>(l, stream);
    case plan::GemmConfig::kCooperative128x128:
      return grouped_fp8_gemm_instance<plan::GemmConfig::kCooperative128x128>(l, stream);
  }
  MOEKIT_CUDA_REQUIRE(false, "unknown GEMM config " + std::to_string(static_cast<int>(config)));
}

}  // namespace moekit::cuda
