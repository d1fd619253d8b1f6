// Grouped fp16 GEMM (no scales), config swapab-128x64 (its tile, schedule and swap: the row of plan/gemm_config.h).
// One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {
MOEKIT_GROUPED_GEMM_SIXTEEN_BIT_INSTANCE(plan::GemmConfig::kSwapAB128x64, kFp16)
}  // namespace moekit::cuda
