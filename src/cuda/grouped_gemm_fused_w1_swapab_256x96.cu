// The fused W1 (block-scaled W1 GEMM -> activation -> 1x128 FP8 act_q / act_scale, no w1_out), config
// fused-w1-swapab-256x96 (its tile, schedule and swap: the row of plan/gemm_config.h; the epilogue:
// cuda/fused_w1_epilogue.cuh). One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {
MOEKIT_GROUPED_GEMM_FUSED_W1_INSTANCE(plan::GemmConfig::kFusedW1SwapAB256x96)
}  // namespace moekit::cuda
