// Grouped FP8 GEMM on Hopper, one group per local expert, its per-group arguments built on the
// device (no host synchronization, so a step can be captured in a CUDA graph):
//   D[g] (m_g x n) = bf16((A[g] (m_g x k) . B[g]^T) * sa[g][row] * sb[g][col])
// or, 16-bit (GroupedGemmLaunch::operand bf16 / fp16), D[g] = A[g] . B[g]^T without scales.
// A row-major (lda = k), B (n x k) row-major (a weight, k contiguous), D row-major (ldd = n); fp32
// accumulation. With swap A/B the kernel computes D^T = B . A^T (weights on its 128-row side); D^T
// column-major is D row-major, so the memory contract is the same.
// Block-scaled (QuantScheme::kBlock128): the scales multiply each 128-deep k-block's partial sum in
// the main loop, D[g] = bf16(sum_kb (A_kb . B_kb^T) * sa[row][kb] * sb[col/128][kb]), sa per 1x128
// group of a token row, sb per 128x128 weight block (numerics/scales.h, k-blocks contiguous: the
// kernel reads them K-major where they lie, nothing re-packs them). No CUTLASS type appears here:
// src/cuda/grouped_gemm_<config>.cu instantiate the kernel for each row of the config table and
// check that CUTLASS's argument types have the layout below.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/launch.h"
#include "plan/gemm_config.h"

namespace moekit::cuda {

// The per-group argument arrays of one GEMM, struct-of-arrays inside its gemm_args region: eight
// 8-byte arrays (pointers; strides, the leading dimension of each operand), the problem shapes,
// three ints (m, n, k) per group as the kernel sees them (swapped: (n, m, k)), then, block-scaled
// only, the layouts of the kernel's A and B scales (BlockScaleLayout, five ints per group).
struct GroupedGemmArrays {
  const void** ptr_A;
  const void** ptr_B;
  void** ptr_D;
  const float** ptr_col;  // scales along the kernel's M (rows of its A)
  const float** ptr_row;  // scales along the kernel's N (columns of its D)
  std::int64_t* stride_A;
  std::int64_t* stride_B;
  std::int64_t* stride_D;
  int* shapes;
  int* layout_sfa;  // block-scaled: the scales of the kernel's A (ptr_col), then of its B (ptr_row)
  int* layout_sfb;

  static constexpr std::int64_t kBytesPerGroup = 8 * 8 + 3 * 4 + 2 * 5 * 4;
  static_assert(kBytesPerGroup <= kGemmArgsBytesPerGroup, "grouped GEMM arguments exceed kGemmArgsBytesPerGroup");

#if defined(__CUDACC__)
  __host__ __device__
#endif
      static GroupedGemmArrays
      at(std::byte* region, int groups) {
    auto array = [&](int j) { return region + static_cast<std::int64_t>(j) * groups * 8; };
    GroupedGemmArrays a;
    a.ptr_A = reinterpret_cast<const void**>(array(0));
    a.ptr_B = reinterpret_cast<const void**>(array(1));
    a.ptr_D = reinterpret_cast<void**>(array(2));
    a.ptr_col = reinterpret_cast<const float**>(array(3));
    a.ptr_row = reinterpret_cast<const float**>(array(4));
    a.stride_A = reinterpret_cast<std::int64_t*>(array(5));
    a.stride_B = reinterpret_cast<std::int64_t*>(array(6));
    a.stride_D = reinterpret_cast<std::int64_t*>(array(7));
    a.shapes = reinterpret_cast<int*>(array(8));
    a.layout_sfa = a.shapes + 3 * groups;
    a.layout_sfb = a.layout_sfa + 5 * groups;
    return a;
  }
};

// The block-scaled kernel's layout of one operand's scales, as five ints: (units, k-blocks, 1) and
// strides (k-blocks, units * k-blocks). `units` are the operand's rows (tokens: one scale per 1x128
// group of a row) or its 128-row blocks (weights: one per 128x128 block); a unit's k-block scales
// are contiguous (K-major). This is CUTLASS's Sm90BlockwiseScaleConfig layout with K-major scales,
// checked against CUTLASS's own at run time (grouped_gemm_impl.cuh).
#if defined(__CUDACC__)
__host__ __device__
#endif
    inline void
    write_block_scale_layout(int* out, int units, int k_blocks) {
  out[0] = units;
  out[1] = k_blocks;
  out[2] = 1;
  out[3] = k_blocks;
  out[4] = units * k_blocks;
}

// Runs one grouped GEMM whose arguments are already in `args` (a GroupedGemmArrays region of
// `groups` groups). `scales_per_row`: sa and sb are vectors (per token / per channel) or one scalar
// per group (per-tensor). Raises moekit::Error when CUTLASS asks for more scratch than the plan
// reserved or cannot run the problem.
struct GroupedGemmLaunch {
  // The fused W1's epilogue (plan::GemmConfigInfo::fused_w1, block128): instead of D it writes the
  // activation of each 1x128 output group as FP8 codes act_q[row][c] and its scale
  // act_scale[row][c / 128]; group g's rows start at row_offsets[g] (contiguous) or g * M.
  struct FusedW1 {
    std::uint8_t* act_q = nullptr;
    float* act_scale = nullptr;
    const std::int32_t* row_offsets = nullptr;  // null: batched, g * M
    std::int64_t M = 0;
    int I = 0;
    Activation activation = Activation::kSilu;
  };
  // The tensors every group's A (tokens) and B (weights) lie in, rows of k FP8 each: moekit's own
  // main loop (plan::GemmMainLoop::kMoekit) addresses them through one TMA descriptor each, a
  // group's first row being its pointer's offset there. CUTLASS's kernels take the pointers alone.
  // output: the tensor D lies in, row for row with the tokens (group g's D row r at the token row of
  // its A row r, n bf16 a row; the experts' w1_out and output), or null: moekit's main loop then
  // writes D through the pointers only (without it, no TMA store).
  struct Tensors {
    const void* tokens = nullptr;
    std::int64_t token_rows = 0;
    const void* weights = nullptr;
    std::int64_t weight_rows = 0;
    void* output = nullptr;
  };
  std::byte* args = nullptr;
  int groups = 0;
  std::int64_t n = 0, k = 0;  // the logical GEMM's (checked against the config table)
  bool scales_per_row = true;
  bool block_scaled = false;  // kBlock128: the arrays' layout_sfa / layout_sfb are written
  std::byte* scratch = nullptr;
  std::int64_t scratch_bytes = 0;
  int num_sms = 0;
  // D is fp32, not bf16 (block-scaled, plan::GemmConfigInfo::w1_fp32): the fused recipe's W1 of
  // its small experts, into w1_small, where the activation kernel reads it.
  bool d_fp32 = false;
  // Per-token / per-tensor only: the whole K loop in the tensor cores' FP8 accumulation
  // (Accumulation::kFast), else promoted to fp32 every 128 elements of K.
  bool fast_accumulation = false;
  // The A and B operands: FP8 codes with the scales above, or bf16 / fp16 without scales (the
  // config's 16-bit instances, plan::GemmConfigInfo::sixteen_bit): D[g] = (A[g] . B[g]^T) summed in
  // fp32 over the whole K, in the operands' dtype; ptr_col, ptr_row and the scale flags unread.
  DType operand = DType::kFp8E4m3;
  FusedW1 fused{};
  Tensors tensors{};
};
void grouped_fp8_gemm(plan::GemmConfig config, const GroupedGemmLaunch& launch, void* stream);

// One entry point per config and scaling (one CUTLASS instantiation per .cu file).
template <plan::GemmConfig kConfig>
void grouped_fp8_gemm_instance(const GroupedGemmLaunch& launch, void* stream);
template <plan::GemmConfig kConfig>
void grouped_fp8_gemm_fast_instance(const GroupedGemmLaunch& launch, void* stream);
template <plan::GemmConfig kConfig>
void grouped_fp8_gemm_block_instance(const GroupedGemmLaunch& launch, void* stream);
template <plan::GemmConfig kConfig>
void grouped_fp8_gemm_block_f32_instance(const GroupedGemmLaunch& launch, void* stream);
template <plan::GemmConfig kConfig>
void grouped_fp8_gemm_fused_w1_instance(const GroupedGemmLaunch& launch, void* stream);
// kOperand: DType::kBf16 or DType::kFp16 (grouped_gemm_bf16_<config>.cu, grouped_gemm_fp16_<config>.cu).
template <plan::GemmConfig kConfig, DType kOperand>
void grouped_sixteen_bit_gemm_instance(const GroupedGemmLaunch& launch, void* stream);

}  // namespace moekit::cuda
