// One token's FP8 quantization by one block, shared by the single-GPU quantize-and-scatter
// (dispatch.cu) and the NCCL transports' pack kernel (nccl/ep.cu): the same arithmetic as
// cpu::quantize_activation, so every destination row's codes and scales equal the CPU's.
#pragma once

#include <cuda_bf16.h>

#include "cuda/reduce.cuh"
#include "moekit/types.h"
#include "numerics/fp8.h"

namespace moekit::cuda {

inline constexpr int kQuantThreads = 256;
inline constexpr int kQuantChunks = 4;  // K <= 256 threads x 8 values x 4 chunks = 8192

// A row of K values in registers, 8-value chunks per thread (kChunks x 8 x 256 threads >= K); the
// amax of each 1x128 group (16 threads = one half-warp hold a group) and of the thread's values.
// The quantize-and-scatter loads bf16 tokens; the experts' activation loads its activation values.
template <int kChunks>
struct QuantRowOf {
  float v[kChunks][8];
  float group_amax[kChunks];
  float amax_thread = 0.0f;

  __device__ __forceinline__ void load(const __nv_bfloat16* x, int K) {
    load_with(K, [&](int c0, float(&out)[8]) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + c0);
      const auto* b8 = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = __bfloat162float(b8[j]);
    });
  }

  // values(c0, out): the 8 values of columns [c0, c0 + 8), for each c0 < K this thread holds.
  template <class Values>
  __device__ __forceinline__ void load_with(int K, Values values) {
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      const int c0 = (ch * kQuantThreads + static_cast<int>(threadIdx.x)) * 8;
      float m = 0.0f;
      if (c0 < K) {
        values(c0, v[ch]);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[ch][j]));  // drops NaN, as the CPU's std::max does
      }
      amax_thread = fmaxf(amax_thread, m);
      for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
      group_amax[ch] = m;
    }
  }

  // The row's scale (per-token; every thread of the block must call it), unused for block128.
  __device__ __forceinline__ float token_scale(QuantScheme quant) const {
    return quant == QuantScheme::kBlock128 ? 0.0f : numerics::fp8_scale(block_max<kQuantThreads>(amax_thread));
  }

  // The row's FP8 codes and scales, computed once and kept in registers (a token stored to several
  // destinations is encoded once): per-tensor and per-token take `row_scale`, block128 each
  // group's own.
  struct Encoded {
    uint2 codes[kChunks];
    float scale[kChunks];
    float row_scale;
  };
  __device__ __forceinline__ Encoded encode(QuantScheme quant, float row_scale, int K) const {
    const bool block = quant == QuantScheme::kBlock128;
    Encoded e;
    e.row_scale = row_scale;
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      const int c0 = (ch * kQuantThreads + static_cast<int>(threadIdx.x)) * 8;
      e.scale[ch] = block ? numerics::fp8_scale(group_amax[ch]) : row_scale;
      if (c0 < K) e.codes[ch] = fp8x8(v[ch], e.scale[ch]);
    }
    return e;
  }

  // Codes to out[0, K) and the row's scales to scales[0, spr) (per-token writes its scale as
  // scales[0], block128 one per 1x128 group).
  __device__ __forceinline__ static void write(const Encoded& e, QuantScheme quant, int K, std::uint8_t* out,
                                               float* scales) {
    const bool block = quant == QuantScheme::kBlock128;
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      const int c0 = (ch * kQuantThreads + static_cast<int>(threadIdx.x)) * 8;
      if (c0 >= K) continue;
      *reinterpret_cast<uint2*>(out + c0) = e.codes[ch];
      if (block && c0 % kQuantBlock == 0) scales[c0 / kQuantBlock] = e.scale[ch];
    }
    if (quant == QuantScheme::kPerTokenPerChannel && threadIdx.x == 0) scales[0] = e.row_scale;
  }

  __device__ __forceinline__ void store(QuantScheme quant, float row_scale, int K, std::uint8_t* out,
                                        float* scales) const {
    write(encode(quant, row_scale, K), quant, K, out, scales);
  }
};
using QuantRow = QuantRowOf<kQuantChunks>;

}  // namespace moekit::cuda
