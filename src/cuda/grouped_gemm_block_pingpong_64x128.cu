// Grouped FP8 GEMM with 1x128 / 128x128 block scales, config pingpong-64x128 (its tile, schedule and swap: the row
// of plan/gemm_config.h). One CUTLASS instantiation (DESIGN: one per .cu file; ~1.5 min and ~4 GB to compile).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {
MOEKIT_GROUPED_GEMM_BLOCK_INSTANCE(plan::GemmConfig::kPingpong64x128)
}  // namespace moekit::cuda
