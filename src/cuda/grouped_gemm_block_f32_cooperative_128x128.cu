// Grouped FP8 GEMM with 1x128 / 128x128 block scales and an fp32 D, config cooperative-128x128 (its tile and
// schedule: the row of plan/gemm_config.h): the fused recipe's W1 for its experts of <= 128 rows (w1_fp32_rows).
// One CUTLASS instantiation (DESIGN: one per .cu file; ~1.5 min and ~4 GB to compile).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {
MOEKIT_GROUPED_GEMM_BLOCK_F32_INSTANCE(plan::GemmConfig::kCooperative128x128)
}  // namespace moekit::cuda
