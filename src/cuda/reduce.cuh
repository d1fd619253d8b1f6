// Block-wide reductions shared by the CUDA kernels.
#pragma once

namespace moekit::cuda {

// The max of v over a block of kThreads threads, on every thread (exact: max does not round).
// Every thread of the block must call it.
template <int kThreads>
__device__ float block_max(float v) {
  __shared__ float warp_max[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  float m = warp_max[0];
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
  __syncthreads();
  return m;
}

}  // namespace moekit::cuda
