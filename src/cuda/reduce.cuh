// Device helpers shared by the CUDA kernels: a block-wide max, and 8 values to FP8 by the
// quantizer's rule (division by the scale, round to nearest even, saturate to +-448).
#pragma once

#include <cuda_fp8.h>

#include "numerics/fp8.h"

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

// 8 values / scale -> 8 e4m3 codes in one 8-byte word, as cpu::quantize_activation encodes them.
// The quotients through numerics::DivideBy: IEEE division's bit for bit, without its per-call
// range check and slow-path branch (the activation kernel was instruction-bound on them: ncu,
// docs/PERF.md).
__device__ __forceinline__ uint2 fp8x8(const float (&v)[8], float scale) {
  uint2 packed;
  auto* p16 = reinterpret_cast<__nv_fp8x2_storage_t*>(&packed);
  float q[8];
  numerics::DivideBy(scale).with_quotient([&](const auto& quotient) {  // one range test for the 8 values
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = quotient(v[j]);
  });
#pragma unroll
  for (int j = 0; j < 4; ++j)
    p16[j] = __nv_cvt_float2_to_fp8x2(make_float2(q[2 * j], q[2 * j + 1]), __NV_SATFINITE, __NV_E4M3);
  return packed;
}

}  // namespace moekit::cuda
