// Grouped FP8 GEMM, config pingpong-64x256 with fast accumulation (Accumulation::kFast: the whole K loop in
// the tensor cores' FP8 accumulation). One CUTLASS instantiation (DESIGN: one per .cu file).
#include "cuda/grouped_gemm_impl.cuh"

namespace moekit::cuda {
MOEKIT_GROUPED_GEMM_FAST_INSTANCE(plan::GemmConfig::kPingpong64x256)
}  // namespace moekit::cuda
