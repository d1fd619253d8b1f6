// Grouped FP8 GEMM on Hopper, one group per local expert, sized on the device from the experts'
// row counts (no host synchronization, so a step can be captured in a CUDA graph):
//   D[g] (m_g x n) = bf16((A[g] (m_g x k) . B[g]^T) * sa[g][row] * sb[g][col])
// A row-major (lda = k), B (n x k) row-major (a weight, k contiguous), D row-major (ldd = n); fp32
// accumulation. Rows >= m_g of A are never read into a result and rows >= m_g of D never written.
// No CUTLASS type appears here; src/cuda/grouped_gemm_<config>.cu instantiate it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "plan/gemm_config.h"

namespace moekit::cuda {

struct GroupedGemmProblem {
  int groups = 0;
  std::int64_t n = 0, k = 0;
  const std::int32_t* rows = nullptr;  // device: m_g; outside [0, capacity] -> 0 rows and a status flag
  std::int64_t capacity = 0;           // rows each group's A and D hold (M)
  const std::uint8_t* A = nullptr;     // fp8 e4m3, group g at A + g * capacity * k
  const float* sa = nullptr;           // per row (g * capacity + row) or per group (g) when !sa_per_row
  bool sa_per_row = true;
  const std::uint8_t* B = nullptr;  // fp8 e4m3, group g at B + g * n * k
  const float* sb = nullptr;        // per column (g * n + col) or per group (g) when !sb_per_col
  bool sb_per_col = true;
  std::uint16_t* D = nullptr;  // bf16, group g at D + g * capacity * n
};

// Status words (the plan's `status` region): [0] = 1 when a row count was out of range, [1] = its
// group, [2] = its value. Cleared by the caller before a step, read after it.
inline constexpr int kStatusBadRows = 0;

// `args` is this GEMM's slice of the plan's gemm_args region (groups * kGemmArgsBytesPerExpert
// bytes); `scratch` is the plan's gemm_scratch region. Raises moekit::Error when CUTLASS asks for
// more scratch than the plan reserved or cannot run the problem.
void grouped_fp8_gemm(plan::GemmConfig config, const GroupedGemmProblem& problem, std::byte* args, std::byte* scratch,
                      std::int64_t scratch_bytes, std::int32_t* status, int num_sms, cudaStream_t stream);

// One entry point per config (one CUTLASS instantiation per .cu file).
void grouped_fp8_gemm_swapab_128x32(const GroupedGemmProblem&, std::byte*, std::byte*, std::int64_t, std::int32_t*, int,
                                    cudaStream_t);
void grouped_fp8_gemm_swapab_128x64(const GroupedGemmProblem&, std::byte*, std::byte*, std::int64_t, std::int32_t*, int,
                                    cudaStream_t);
void grouped_fp8_gemm_pingpong_64x256(const GroupedGemmProblem&, std::byte*, std::byte*, std::int64_t, std::int32_t*,
                                      int, cudaStream_t);
void grouped_fp8_gemm_cooperative_128x128(const GroupedGemmProblem&, std::byte*, std::byte*, std::int64_t,
                                          std::int32_t*, int, cudaStream_t);

}  // namespace moekit::cuda
