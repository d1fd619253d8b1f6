// Grouped FP8 GEMM with 1x128 / 128x128 block scales and an fp32 D, config swapab-128x64 (its tile, schedule and swap:
// the row of plan/gemm_config.h): the fused recipe's W1 for its small experts (w1_fp32). One CUTLASS instantiation
// (DESIGN: one per .cu file; ~1.5 min and ~4 GB to compile).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {
MOEKIT_GROUPED_GEMM_BLOCK_F32_INSTANCE(plan::GemmConfig::kSwapAB128x64)
}  // namespace moekit::cuda
