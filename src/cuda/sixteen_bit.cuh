// The unquantized recipes' 16-bit values on the device: bf16 and fp16 to and from fp32, rounded to
// nearest even (numerics/fp8.h's host conversions give the same bits), and 8 of them a 16-byte load.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "moekit/types.h"

namespace moekit::cuda {

__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// 8 bf16 values (a 16-byte vector) rounded once each to fp16 (the fp16 recipe's tokens from the
// layer's bf16 hidden states; past 65504: inf, as numerics::fp16_encode).
__device__ __forceinline__ uint4 bf16_to_fp16_8(uint4 v) {
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(&v);
  uint4 out;
  auto* o = reinterpret_cast<__half*>(&out);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = __float2half_rn(__bfloat162float(in[j]));
  return out;
}

// f(T{}) with T the device type of `dtype` (bf16 or fp16): one instantiation per dtype.
template <class F>
void with_sixteen_bit(DType dtype, const F& f) {
  if (dtype == DType::kFp16)
    f(__half{});
  else
    f(__nv_bfloat16{});
}

}  // namespace moekit::cuda
