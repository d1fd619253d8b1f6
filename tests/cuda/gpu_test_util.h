// Helpers of the GPU tests: skip without a device, checked device buffers, the batched experts'
// inputs built on the host (random tokens quantized per scheme, NaN in every padding row).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/numerics.h"
#include "cpu/quant.h"
#include "cpu/random.h"
#include "cuda/check.h"
#include "cuda/device_info.h"
#include "moekit/problem.h"

#define MOEKIT_REQUIRE_GPU()                                                   \
  do {                                                                         \
    if (::moekit::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace moekit::testing {

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  std::size_t count = 0;
  explicit DeviceBuffer(std::size_t n) : count(n) {
    MOEKIT_CUDA_CHECK(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& host) {
    MOEKIT_CUDA_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count);
    MOEKIT_CUDA_CHECK(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

struct BatchedInputs {
  std::vector<std::uint8_t> a1q;  // (E_local, M, K), padding rows 0x7F (NaN)
  std::vector<float> a1q_scale;   // per plan shape, padding NaN
  std::vector<std::int32_t> expert_num_tokens;
};

// Tokens drawn per (expert, row) from the seed, quantized row by row (per-tensor: per expert).
inline BatchedInputs make_batched_inputs(const MoeProblem& p, const std::vector<std::int32_t>& counts,
                                         std::uint64_t seed) {
  BatchedInputs in;
  const std::int64_t K = p.K, M = p.M;
  in.expert_num_tokens = counts;
  in.a1q.assign(static_cast<std::size_t>(p.E_local * M * K), 0x7F);
  const std::int64_t spr = cpu::activation_scales_per_row(p.quant, K);
  const std::size_t scale_count =
      static_cast<std::size_t>(p.quant == QuantScheme::kPerTensor ? p.E_local : p.E_local * M * spr);
  in.a1q_scale.assign(scale_count, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> x;
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = std::clamp<std::int64_t>(counts[static_cast<std::size_t>(e)], 0, M);
    if (m == 0) continue;
    x.resize(static_cast<std::size_t>(m * K));
    cpu::SplitMix rng = cpu::stream(seed, 6, static_cast<std::uint64_t>(e));
    for (std::int64_t r = 0; r < m; ++r) {
      const float row_scale = 0.25f + static_cast<float>(r % 7);  // rows of different magnitudes
      for (std::int64_t c = 0; c < K; ++c) x[static_cast<std::size_t>(r * K + c)] = row_scale * rng.normal();
    }
    float* scales = p.quant == QuantScheme::kPerTensor ? in.a1q_scale.data() + e : in.a1q_scale.data() + e * M * spr;
    cpu::quantize_activation(p.quant, x.data(), m, K, K, in.a1q.data() + e * M * K, K, scales);
  }
  return in;
}

}  // namespace moekit::testing
