// The launchers of the CUDA backend, as the host classes (src/cuda/*.cpp) call them: raw pointers,
// sizes and a stream (void*, a cudaStream_t), no CUDA or CUTLASS type. Defined in the .cu files, or
// in no_cuda.cpp (raising moekit::Error) when moekit is built without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/problem.h"
#include "moekit/weights.h"
#include "plan/gemm_config.h"

namespace moekit::cuda {

// Bytes of one group's grouped-GEMM arguments (problem shape, A/B/D and scale pointers, strides),
// written on the device from expert_num_tokens; the CUTLASS instances static_assert that theirs fit.
inline constexpr std::int64_t kGemmArgsBytesPerGroup = 128;
// CUTLASS's own workspace (tile-scheduler state). A bound: each launch checks get_workspace_size()
// against it and raises moekit::Error if a kernel ever asks for more.
inline constexpr std::int64_t kGemmScratchBytes = std::int64_t{1} << 20;
// Device-side error flags, read back after a step: [0] = 1 when a count was out of range, [1] its
// expert, [2] its value.
inline constexpr std::int64_t kStatusWords = 8;
inline constexpr int kStatusBadCount = 0;

// One step of the batched experts, every pointer on the device. The workspace pointers are the
// regions CudaBatchedExperts declared (cuda/batched_experts.cpp).
struct BatchedExpertsLaunch {
  MoeProblem problem;
  ExpertWeightsView weights;
  const std::uint8_t* a1q = nullptr;
  const float* a1q_scale = nullptr;
  const std::int32_t* expert_num_tokens = nullptr;
  std::uint16_t* output = nullptr;
  std::uint16_t* w1_out = nullptr;
  std::uint8_t* act_q = nullptr;
  float* act_scale = nullptr;
  std::byte* gemm_args_w1 = nullptr;
  std::byte* gemm_args_w2 = nullptr;
  std::byte* gemm_scratch = nullptr;
  std::int32_t* row_offsets = nullptr;  // (E_local + 1): first valid row of each expert, over valid rows only
  std::int32_t* status = nullptr;
  plan::ExpertsGemmConfigs configs{};
  int num_sms = 0;
};

// The stages: prepare (reads expert_num_tokens once, validates it, writes row_offsets and both
// GEMMs' arguments), W1 GEMM, activation + FP8, W2 GEMM. launch_batched_experts runs all four.
void launch_batched_experts(const BatchedExpertsLaunch& l, void* stream);
void launch_experts_prepare(const BatchedExpertsLaunch& l, void* stream);
void launch_experts_gemm(const BatchedExpertsLaunch& l, int which, void* stream);  // which: 1 (W1) or 2 (W2)
// kAuto picks the measured best for the problem (docs/PERF.md).
enum class ActivationKernel { kAuto, kGeneric, kRowPerBlock };
void launch_activation_quant(const BatchedExpertsLaunch& l, ActivationKernel kernel, void* stream);

// Synchronizes `stream`, reads the status words and raises moekit::Error naming the expert, its
// count and M if a count was out of range (that expert ran with 0 rows; nothing written past M).
void check_experts_status(const std::int32_t* status, std::int64_t M, void* stream);

int current_device_num_sms();

}  // namespace moekit::cuda
