// The Hopper batched FP8 experts: a1q (E_local, M, K) FP8 with its scales and expert_num_tokens in
// device memory -> output (E_local, M, K) bf16, valid rows only:
//   grouped FP8 GEMM with W1 -> activation fused with FP8 quantization -> grouped FP8 GEMM with W2
//   written straight into the output.
// Everything runs on the device from expert_num_tokens: no host synchronization, capturable in a
// CUDA graph. Padding rows are never read into a result and never written. The workspace pointers
// come from plan::declare_batched_fp8 over one device allocation (the `moekit plan` regions).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/problem.h"
#include "plan/experts_workspace.h"
#include "plan/gemm_config.h"

namespace moekit::cuda {

// Device copies of cpu::ExpertWeights (same layouts): W1 (E_local, N, K), W2 (E_local, K, I), and
// their scales (per-channel: (E_local, N) and (E_local, K); per-tensor: (E_local)).
struct DeviceExpertWeights {
  const std::uint8_t* w1 = nullptr;
  const float* w1_scales = nullptr;
  const std::uint8_t* w2 = nullptr;
  const float* w2_scales = nullptr;
};

// Runs the experts on `stream`. `num_sms` comes from the device (cudaDeviceProp). `config`: the
// grouped GEMM tile config for both GEMMs (plan::select_gemm_config picks one from the problem).
// Raises moekit::Error for what the host can see (quant scheme, shapes); counts over M are flagged
// on the device in ws.status: call check_status after the step.
void batched_fp8_experts(const MoeProblem& problem, const DeviceExpertWeights& weights, const std::uint8_t* a1q,
                         const float* a1q_scale, const std::int32_t* expert_num_tokens, std::uint16_t* output,
                         const plan::BatchedFp8Workspace& ws, plan::GemmConfig config, int num_sms,
                         cudaStream_t stream);

// The activation + FP8 quantization stage alone (valid rows only), for benchmarks and tests:
// kAuto picks the measured best for the problem (docs/PERF.md).
// (A warp-per-row variant measured slower at every m_e and was removed: docs/PERF.md v3.)
enum class ActivationKernel { kAuto, kGeneric, kRowPerBlock };
void activation_quant(const MoeProblem& problem, const plan::BatchedFp8Workspace& ws,
                      const std::int32_t* expert_num_tokens, int num_sms, cudaStream_t stream,
                      ActivationKernel kernel = ActivationKernel::kAuto);

// The config the experts use by default for a problem: from the expected rows per expert.
plan::GemmConfig default_gemm_config(const MoeProblem& problem);

// Synchronizes `stream`, reads the status words and raises moekit::Error naming the expert, its
// count and M if a count was out of range (that expert ran with 0 rows; nothing was written past M).
void check_status(const std::int32_t* status, cudaStream_t stream, std::int64_t M);

}  // namespace moekit::cuda
