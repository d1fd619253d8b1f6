// numerics::DivideBy (the quantizers' x / scale without division's slow-path branch) against
// __fdiv_rn on the device: the same float, bit for bit, over the quantization domain |x| <= 448 scale
// (scales of every exponent in its fast range and at its edges, x of every magnitude, signed zeros,
// subnormals, NaN), the same FP8 code where x is so small that only the code is promised; and the
// slow path (scales outside the range, inf, NaN) equal to __fdiv_rn.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cuda/check.h"
#include "gpu_test_util.h"
#include "numerics/fp8.h"
#include "synthetic/random.h"

namespace {

__global__ void divide_kernel(const float* x, const float* s, int n, float* fast, float* ieee, std::uint8_t* fast_code,
                              std::uint8_t* ieee_code) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const moekit::numerics::DivideBy div(s[i]);
  fast[i] = div(x[i]);
  ieee[i] = __fdiv_rn(x[i], s[i]);
  fast_code[i] = __nv_fp8_e4m3(fast[i]).__x;
  ieee_code[i] = __nv_fp8_e4m3(ieee[i]).__x;
}

std::uint32_t bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

TEST(DivideBy, EqualsIeeeDivisionOnTheQuantizationDomain) {
  MOEKIT_REQUIRE_GPU();
  std::vector<float> x, s;
  moekit::synthetic::SplitMix rng{20261201};
  auto uniform = [&] { return static_cast<float>(rng.next() >> 40) / static_cast<float>(1 << 24); };
  // Scales: random mantissas at every exponent of the fast range, its edges, and outside it.
  std::vector<float> scales = {0x1p-64f,
                               0x1p64f,
                               1.0f,
                               1.0f / 448.0f,
                               std::nextafter(0x1p-64f, 0.0f),
                               std::nextafter(0x1p64f, INFINITY),
                               0x1p-100f,
                               0x1p-140f,
                               0x1p100f,
                               std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN()};
  for (int e = -64; e < 64; ++e)
    for (int j = 0; j < 4; ++j) scales.push_back(std::ldexp(1.0f + uniform(), e));
  for (const float sc : scales) {
    const float amax = std::isfinite(sc) ? 448.0f * sc : 1.0f;
    for (int j = 0; j < 4096; ++j) {
      // |x| / amax spread over 2^-0 .. 2^-40 (and below), either sign.
      float v = std::ldexp(uniform(), -static_cast<int>(rng.next() % 41)) * amax;
      if (rng.next() & 1) v = -v;
      x.push_back(v);
      s.push_back(sc);
    }
    for (const float v : {0.0f, -0.0f, amax, -amax, std::numeric_limits<float>::denorm_min(), -0x1p-130f, 0x1p-75f,
                          std::numeric_limits<float>::quiet_NaN()}) {
      x.push_back(v);
      s.push_back(sc);
    }
  }
  // x = inf over an infinite scale (an amax that overflowed): NaN either way.
  x.push_back(INFINITY);
  s.push_back(INFINITY);
  const int n = static_cast<int>(x.size());
  float *dx, *ds, *dfast, *dieee;
  std::uint8_t *dfc, *dic;
  MOEKIT_CUDA_CHECK(cudaMalloc(&dx, n * 4));
  MOEKIT_CUDA_CHECK(cudaMalloc(&ds, n * 4));
  MOEKIT_CUDA_CHECK(cudaMalloc(&dfast, n * 4));
  MOEKIT_CUDA_CHECK(cudaMalloc(&dieee, n * 4));
  MOEKIT_CUDA_CHECK(cudaMalloc(&dfc, n));
  MOEKIT_CUDA_CHECK(cudaMalloc(&dic, n));
  MOEKIT_CUDA_CHECK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
  MOEKIT_CUDA_CHECK(cudaMemcpy(ds, s.data(), n * 4, cudaMemcpyHostToDevice));
  divide_kernel<<<(n + 255) / 256, 256>>>(dx, ds, n, dfast, dieee, dfc, dic);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> fast(n), ieee(n);
  std::vector<std::uint8_t> fc(n), ic(n);
  MOEKIT_CUDA_CHECK(cudaMemcpy(fast.data(), dfast, n * 4, cudaMemcpyDeviceToHost));
  MOEKIT_CUDA_CHECK(cudaMemcpy(ieee.data(), dieee, n * 4, cudaMemcpyDeviceToHost));
  MOEKIT_CUDA_CHECK(cudaMemcpy(fc.data(), dfc, n, cudaMemcpyDeviceToHost));
  MOEKIT_CUDA_CHECK(cudaMemcpy(ic.data(), dic, n, cudaMemcpyDeviceToHost));
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(ds), static_cast<void*>(dfast), static_cast<void*>(dieee),
                  static_cast<void*>(dfc), static_cast<void*>(dic)})
    MOEKIT_CUDA_CHECK(cudaFree(p));
  int float_diffs = 0, code_diffs = 0, exact = 0;
  for (int i = 0; i < n; ++i) {
    const bool both_nan = std::isnan(fast[i]) && std::isnan(ieee[i]);
    if (fc[i] != ic[i] && !both_nan && ++code_diffs <= 5)
      ADD_FAILURE() << "FP8 code of " << x[i] << " / " << s[i] << ": " << int(fc[i]) << " vs " << int(ic[i]);
    // Bits are promised wherever the quotient can reach an FP8 code (|x| >= 2^-75 in the fast range).
    if (std::fabs(x[i]) < 0x1p-75f || both_nan) continue;
    ++exact;
    if (bits(fast[i]) != bits(ieee[i]) && ++float_diffs <= 5)
      ADD_FAILURE() << x[i] << " / " << s[i] << ": " << fast[i] << " vs " << ieee[i];
  }
  EXPECT_EQ(code_diffs, 0);
  EXPECT_EQ(float_diffs, 0);
  std::printf("DivideBy: %d quotients, %d compared bit for bit, all FP8 codes equal\n", n, exact);
}

}  // namespace
