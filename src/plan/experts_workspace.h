// Workspace declarations of every experts implementation. Each declare_* function is the single
// source of truth for its backend: the planner calls it with a count-only builder, the runtime with
// a builder over the one allocation, and gets typed pointers back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "moekit/workspace.h"

namespace moekit::plan {

// Per GEMM and expert, the grouped-GEMM arguments built on the device from expert_num_tokens:
// problem shape, A/B/D pointers, scale pointers, strides. The CUDA launcher static_asserts that its
// argument block fits.
inline constexpr std::int64_t kGemmArgsBytesPerExpert = 256;
// CUTLASS's own workspace (tile-scheduler state). A bound: the CUDA runtime checks
// get_workspace_size() against it and raises moekit::Error if a kernel ever asks for more.
inline constexpr std::int64_t kGemmScratchBytes = std::int64_t{1} << 20;
// Device-side error flags (counts over capacity, ids out of range), read back after a step.
inline constexpr std::int64_t kStatusWords = 8;

// Scale tensor of an FP8 activation with `cols` columns whose leading dimensions are `rows`
// ({E_local, M} batched, {rows} standard). Per-tensor keeps one scale per leading tensor.
std::vector<std::int64_t> activation_scale_shape(QuantScheme quant, std::vector<std::int64_t> rows, std::int64_t cols,
                                                 bool batched);

struct BatchedFp8Workspace {
  std::uint16_t* w1_out = nullptr;  // bf16 (E_local, M, N)
  std::uint8_t* act_q = nullptr;    // fp8  (E_local, M, I)
  float* act_scale = nullptr;       // fp32 activation_scale_shape(quant, {E_local, M}, I)
  std::byte* gemm_args = nullptr;   // (2, E_local, kGemmArgsBytesPerExpert)
  std::byte* gemm_scratch = nullptr;
  std::int32_t* status = nullptr;
};
BatchedFp8Workspace declare_batched_fp8(const MoeProblem& problem, WorkspaceBuilder& builder);

struct StandardFp8Workspace {
  std::int64_t* expert_offsets = nullptr;  // (E_local + 1): first permuted row of each expert
  std::int32_t* permuted_src = nullptr;    // (M*topk): token*topk + slot of each permuted row
  std::uint8_t* a1q_permuted = nullptr;    // fp8 (M*topk, K)           alias: gemm_in
  float* a1q_scale_permuted = nullptr;     //                            alias: gemm_in
  std::uint8_t* act_q = nullptr;           // fp8 (M*topk, I)           alias: gemm_in
  float* act_scale = nullptr;              //                            alias: gemm_in
  std::uint16_t* w1_out = nullptr;         // bf16 (M*topk, N)          alias: gemm_out
  std::uint16_t* w2_out = nullptr;         // bf16 (M*topk, K)          alias: gemm_out
  std::byte* gemm_args = nullptr;
  std::byte* gemm_scratch = nullptr;
  std::int32_t* status = nullptr;
};
StandardFp8Workspace declare_standard_fp8(const MoeProblem& problem, WorkspaceBuilder& builder);

// The upstream batched CUTLASS FP8 formula, quoted for comparison (reference/000_*.txt).
void declare_upstream_batched_cutlass(const MoeProblem& problem, WorkspaceBuilder& builder, bool before_fix);

}  // namespace moekit::plan
