// Batched FP8 experts on Hopper. Napkin math for DeepSeek-V3, E_local = 16, m_e = 256:
// 2 * 16 * 256 * (4096*7168 + 7168*2048) = 361 GFLOP -> 0.29 ms at ~1250 TFLOP/s; weights
// 16 * 44 MiB = 704 MiB -> 0.18 ms at ~4 TB/s. The activation kernel touches only valid rows:
// 16 * 256 * (4096 * 2 + 2048) bytes = 42 MB, ~10 us.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <string>

#include "cuda/batched_experts.h"
#include "cuda/check.h"
#include "cuda/grouped_gemm.h"

namespace moekit::cuda {
namespace {

constexpr int kActThreads = 256;

// NOTES: __fdividef (rcp + mul) instead of IEEE division: the activation stage was ALU-bound
// (ncu: ALU 65% busy, 570 GB/s of 4.2 TB/s). It moves silu by an ulp or two against the host's
// x / (1 + exp(-x)), as expf already does; the tests bound the FP8 codes that flip.
__device__ __forceinline__ float silu(float x) {
  return __fdividef(x, 1.0f + expf(-x));
}

// The activation of output column c of one W1 row, exactly the CPU formulas (cpu/activation.h).
__device__ __forceinline__ float activation_at(Activation act, const __nv_bfloat16* row, int I, int c) {
  switch (act) {
    case Activation::kSilu: return silu(__bfloat162float(row[c])) * __bfloat162float(row[I + c]);
    case Activation::kGelu: {
      const float g = __bfloat162float(row[c]);
      return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * __bfloat162float(row[I + c]);
    }
    case Activation::kGeluTanh: {
      const float g = __bfloat162float(row[c]);
      const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      return 0.5f * g * (1.0f + tanhf(inner)) * __bfloat162float(row[I + c]);
    }
    case Activation::kSwigluOai: {
      const float g = fminf(__bfloat162float(row[2 * c]), 7.0f);
      const float u = fminf(fmaxf(__bfloat162float(row[2 * c + 1]), -7.0f), 7.0f);
      return (u + 1.0f) * g * (1.0f / (1.0f + expf(-1.702f * g)));
    }
    case Activation::kRelu2: {
      const float x = fmaxf(__bfloat162float(row[c]), 0.0f);
      return x * x;
    }
    case Activation::kSiluNoMul: return silu(__bfloat162float(row[c]));
  }
  return 0.0f;
}

__device__ __forceinline__ int valid_rows(const std::int32_t* expert_num_tokens, int e, int M) {
  const int m = expert_num_tokens[e];
  return (m >= 0 && m <= M) ? m : 0;  // out-of-range counts are flagged by the GEMM's argument kernel
}

__device__ float block_max(float v) {
  __shared__ float warp_max[kActThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  float m = warp_max[0];
  for (int w = 1; w < kActThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
  __syncthreads();
  return m;
}

// Row (e, r) of the i-th valid row, experts in order; false past the last valid row. O(E_local)
// reads of expert_num_tokens (cached), against the row's K-wide work.
__device__ __forceinline__ bool locate_row(const std::int32_t* expert_num_tokens, int E, int M, std::int64_t i, int& e,
                                           int& r) {
  for (e = 0; e < E; ++e) {
    const int m = valid_rows(expert_num_tokens, e, M);
    if (i < m) {
      r = static_cast<int>(i);
      return true;
    }
    i -= m;
  }
  return false;
}

// A persistent grid walks the valid rows only: its cost follows sum(m_e), not E_local * M.
// Per-token: amax of the row -> scale = amax / 448 -> FP8 of x / scale. Per-tensor: pass 0 only
// raises the expert's amax (as int bits: non-negative floats order like their bits); pass 1
// quantizes with amax / 448.
__global__ void __launch_bounds__(kActThreads)
    activation_quant_kernel(Activation act, int pass, bool per_tensor, const __nv_bfloat16* __restrict__ w1_out,
                            const std::int32_t* __restrict__ expert_num_tokens, int E, int M, int N, int I,
                            __nv_fp8_e4m3* __restrict__ act_q, float* __restrict__ act_scale,
                            unsigned int* __restrict__ expert_amax) {
  int e = 0, r = 0;
  for (std::int64_t i = blockIdx.x; locate_row(expert_num_tokens, E, M, i, e, r); i += gridDim.x) {
    const std::int64_t row_idx = static_cast<std::int64_t>(e) * M + r;
    const __nv_bfloat16* row = w1_out + row_idx * N;
    float amax = 0.0f;
    if (!per_tensor || pass == 0) {
      for (int c = threadIdx.x; c < I; c += kActThreads) amax = fmaxf(amax, fabsf(activation_at(act, row, I, c)));
      amax = block_max(amax);
      if (per_tensor) {
        if (threadIdx.x == 0) atomicMax(expert_amax + e, __float_as_uint(amax));
        continue;
      }
    } else {
      amax = __uint_as_float(expert_amax[e]);
    }
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;  // as cpu/quant.h: division, no reciprocal
    if (!per_tensor && threadIdx.x == 0) act_scale[row_idx] = scale;
    __nv_fp8_e4m3* out = act_q + row_idx * I;
    for (int c = threadIdx.x; c < I; c += kActThreads)
      out[c] = __nv_fp8_e4m3(activation_at(act, row, I, c) / scale);  // RNE, saturating to 448
  }
}

// Value of a halves-layout gated activation (gate g, up u) or a non-gated one (u unused): the
// formulas of activation_at, on registers.
__device__ __forceinline__ float act_value(Activation act, float g, float u) {
  switch (act) {
    case Activation::kSilu: return silu(g) * u;
    case Activation::kGelu: return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * u;
    case Activation::kGeluTanh: return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    case Activation::kRelu2: {
      const float x = fmaxf(g, 0.0f);
      return x * x;
    }
    case Activation::kSiluNoMul: return silu(g);
    default: return 0.0f;  // swigluoai (interleaved) takes the generic kernel
  }
}

// Per-token, one block per row: 16-byte loads of 8 gate and 8 up values per thread, the row's
// values kept in registers (kChunks x 8 per thread) between the amax and the quantization, 8-byte
// stores. NOTES: for I <= 256 * 8 * kChunks; swigluoai and per-tensor use activation_quant_kernel.
template <int kChunks>
__global__ void __launch_bounds__(kActThreads)
    activation_quant_row_per_block(Activation act, bool gated, const __nv_bfloat16* __restrict__ w1_out,
                                   const std::int32_t* __restrict__ expert_num_tokens, int E, int M, int N, int I,
                                   __nv_fp8_e4m3* __restrict__ act_q, float* __restrict__ act_scale) {
  int e = 0, r = 0;
  for (std::int64_t i = blockIdx.x; locate_row(expert_num_tokens, E, M, i, e, r); i += gridDim.x) {
    const std::int64_t row_idx = static_cast<std::int64_t>(e) * M + r;
    const __nv_bfloat16* row = w1_out + row_idx * N;
    float v[kChunks][8];
    float amax = 0.0f;
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      const int c0 = (ch * kActThreads + static_cast<int>(threadIdx.x)) * 8;
      if (c0 >= I) continue;
      const uint4 graw = *reinterpret_cast<const uint4*>(row + c0);
      const uint4 uraw = gated ? *reinterpret_cast<const uint4*>(row + I + c0) : graw;
      const auto* g8 = reinterpret_cast<const __nv_bfloat16*>(&graw);
      const auto* u8 = reinterpret_cast<const __nv_bfloat16*>(&uraw);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[ch][j] = act_value(act, __bfloat162float(g8[j]), __bfloat162float(u8[j]));
        amax = fmaxf(amax, fabsf(v[ch][j]));
      }
    }
    amax = block_max(amax);
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (threadIdx.x == 0) act_scale[row_idx] = scale;
    __nv_fp8_e4m3* out = act_q + row_idx * I;
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      const int c0 = (ch * kActThreads + static_cast<int>(threadIdx.x)) * 8;
      if (c0 >= I) continue;
      uint2 packed;
      auto* p16 = reinterpret_cast<__nv_fp8x2_storage_t*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        p16[j] = __nv_cvt_float2_to_fp8x2(make_float2(v[ch][2 * j] / scale, v[ch][2 * j + 1] / scale), __NV_SATFINITE,
                                          __NV_E4M3);
      *reinterpret_cast<uint2*>(out + c0) = packed;
    }
  }
}

__global__ void per_tensor_scales_kernel(const unsigned int* expert_amax, float* act_scale, int E_local) {
  const int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= E_local) return;
  const float amax = __uint_as_float(expert_amax[e]);
  act_scale[e] = amax > 0.0f ? amax / 448.0f : 1.0f;
}

}  // namespace

plan::GemmConfig default_gemm_config(const MoeProblem& p) {
  const std::int64_t rows = plan::expected_rows_per_expert(p.M, p.topk, p.E);
  // One config for both GEMMs: it must fit both n = N (W1) and n = K (W2).
  const plan::GemmConfig c1 = plan::select_gemm_config(rows, p.N, p.K);
  const plan::GemmConfig c2 = plan::select_gemm_config(rows, p.K, p.I());
  return c1 == c2 ? c1 : plan::GemmConfig::kCooperative128x128;
}

void activation_quant(const MoeProblem& p, const plan::BatchedFp8Workspace& ws, const std::int32_t* expert_num_tokens,
                      int num_sms, cudaStream_t stream, ActivationKernel kernel) {
  const bool per_tensor = p.quant == QuantScheme::kPerTensor;
  const int E = static_cast<int>(p.E_local), M = static_cast<int>(p.M), N = static_cast<int>(p.N),
            I = static_cast<int>(p.I());
  // Per-tensor accumulates each expert's amax in act_scale itself (as bits), then converts it in
  // place to the scale.
  auto* amax = reinterpret_cast<unsigned int*>(ws.act_scale);
  // Persistent grids of exactly one wave (ncu: a 1.33-wave grid left a partial wave idle): the
  // blocks that fit on every SM at once, each walking valid rows.
  auto one_wave = [&](const void* kernel) {
    int per_sm = 0;
    MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kActThreads, 0));
    return std::max(1, per_sm) * num_sms;
  };
  auto* w1_out = reinterpret_cast<const __nv_bfloat16*>(ws.w1_out);
  auto* act_q = reinterpret_cast<__nv_fp8_e4m3*>(ws.act_q);
  const bool vec_ok = !per_tensor && p.activation != Activation::kSwigluOai;
  if (kernel == ActivationKernel::kAuto)
    kernel = vec_ok && I <= kActThreads * 8 * 4 ? ActivationKernel::kRowPerBlock : ActivationKernel::kGeneric;
  MOEKIT_CUDA_REQUIRE(kernel == ActivationKernel::kGeneric || vec_ok,
                      "the vectorized activation kernels take per-token scales and halves-layout activations");
  const bool gated = is_gated(p.activation);
  if (per_tensor) {
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(ws.act_scale, 0, static_cast<std::size_t>(E) * sizeof(float), stream));
    const int grid = one_wave(reinterpret_cast<const void*>(activation_quant_kernel));
    activation_quant_kernel<<<grid, kActThreads, 0, stream>>>(p.activation, 0, true, w1_out, expert_num_tokens, E, M, N,
                                                              I, act_q, ws.act_scale, amax);
    MOEKIT_CUDA_CHECK_LAUNCH();
    activation_quant_kernel<<<grid, kActThreads, 0, stream>>>(p.activation, 1, true, w1_out, expert_num_tokens, E, M, N,
                                                              I, act_q, ws.act_scale, amax);
    MOEKIT_CUDA_CHECK_LAUNCH();
    per_tensor_scales_kernel<<<(E + 127) / 128, 128, 0, stream>>>(amax, ws.act_scale, E);
  } else if (kernel == ActivationKernel::kRowPerBlock) {
    MOEKIT_CUDA_REQUIRE(I <= kActThreads * 8 * 4,
                        "row-per-block activation kernel: I = " + std::to_string(I) + " exceeds 8192");
    const int chunks = (I + kActThreads * 8 - 1) / (kActThreads * 8);
    auto launch = [&](auto k) {
      k<<<one_wave(reinterpret_cast<const void*>(k)), kActThreads, 0, stream>>>(
          p.activation, gated, w1_out, expert_num_tokens, E, M, N, I, act_q, ws.act_scale);
    };
    if (chunks == 1)
      launch(activation_quant_row_per_block<1>);
    else if (chunks == 2)
      launch(activation_quant_row_per_block<2>);
    else
      launch(activation_quant_row_per_block<4>);
  } else {
    activation_quant_kernel<<<one_wave(reinterpret_cast<const void*>(activation_quant_kernel)), kActThreads, 0,
                              stream>>>(p.activation, 1, false, w1_out, expert_num_tokens, E, M, N, I, act_q,
                                        ws.act_scale, nullptr);
  }
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void batched_fp8_experts(const MoeProblem& p, const DeviceExpertWeights& w, const std::uint8_t* a1q,
                         const float* a1q_scale, const std::int32_t* expert_num_tokens, std::uint16_t* output,
                         const plan::BatchedFp8Workspace& ws, plan::GemmConfig config, int num_sms,
                         cudaStream_t stream) {
  MOEKIT_CUDA_REQUIRE(p.format == ActivationFormat::kBatchedExperts, "batched_fp8_experts needs the batched format");
  MOEKIT_CUDA_REQUIRE(p.quant != QuantScheme::kBlock128,
                      "block-wise 1x128/128x128 scales are not in the Hopper experts yet: use per-token or per-tensor");
  MOEKIT_CUDA_REQUIRE(p.M <= 0x7FFFFFFF && p.E_local <= 65535, "M and E_local must fit the launch grid");
  const bool per_tensor = p.quant == QuantScheme::kPerTensor;
  const int E = static_cast<int>(p.E_local);
  const std::int64_t args_bytes = p.E_local * plan::kGemmArgsBytesPerExpert;
  MOEKIT_CUDA_CHECK(cudaMemsetAsync(ws.status, 0, plan::kStatusWords * sizeof(std::int32_t), stream));

  // W1: (m_e x K) . (N x K)^T -> w1_out (m_e x N) bf16.
  GroupedGemmProblem g1;
  g1.groups = E;
  g1.n = p.N;
  g1.k = p.K;
  g1.rows = expert_num_tokens;
  g1.capacity = p.M;
  g1.A = a1q;
  g1.sa = a1q_scale;
  g1.sa_per_row = !per_tensor;
  g1.B = w.w1;
  g1.sb = w.w1_scales;
  g1.sb_per_col = !per_tensor;
  g1.D = ws.w1_out;
  grouped_fp8_gemm(config, g1, ws.gemm_args, ws.gemm_scratch, plan::kGemmScratchBytes, ws.status, num_sms, stream);

  activation_quant(p, ws, expert_num_tokens, num_sms, stream, ActivationKernel::kAuto);

  // W2: (m_e x I) . (K x I)^T -> output (m_e x K) bf16, straight into the experts' output.
  GroupedGemmProblem g2 = g1;
  g2.n = p.K;
  g2.k = p.I();
  g2.A = ws.act_q;
  g2.sa = ws.act_scale;
  g2.B = w.w2;
  g2.sb = w.w2_scales;
  g2.D = output;
  grouped_fp8_gemm(config, g2, ws.gemm_args + args_bytes, ws.gemm_scratch, plan::kGemmScratchBytes, ws.status, num_sms,
                   stream);
}

void check_status(const std::int32_t* status, cudaStream_t stream, std::int64_t M) {
  std::int32_t host[plan::kStatusWords] = {};
  MOEKIT_CUDA_CHECK(cudaMemcpyAsync(host, status, sizeof(host), cudaMemcpyDeviceToHost, stream));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  MOEKIT_CUDA_REQUIRE(host[kStatusBadRows] == 0,
                      "expert_num_tokens[" + std::to_string(host[kStatusBadRows + 1]) + "] = " +
                          std::to_string(host[kStatusBadRows + 2]) + " is outside [0, M = " + std::to_string(M) +
                          "]: that expert was skipped (nothing written past its buffer); fix the dispatch's counts");
}

}  // namespace moekit::cuda
