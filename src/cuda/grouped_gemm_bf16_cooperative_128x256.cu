// Grouped bf16 GEMM (no scales), config cooperative-128x256 (its tile, schedule and swap: the row of
// plan/gemm_config.h). One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {
MOEKIT_GROUPED_GEMM_SIXTEEN_BIT_INSTANCE(plan::GemmConfig::kCooperative128x256, kBf16)
}  // namespace moekit::cuda
