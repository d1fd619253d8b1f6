// Grouped FP8 GEMM, config cooperative-128x256 (its tile, schedule and swap: the row of plan/gemm_config.h).
// One CUTLASS instantiation (DESIGN: one per .cu file; ~1.5 min and ~4 GB to compile).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {
MOEKIT_GROUPED_GEMM_INSTANCE(plan::GemmConfig::kCooperative128x256)
}  // namespace moekit::cuda
