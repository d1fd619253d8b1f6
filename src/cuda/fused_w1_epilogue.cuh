// The fused W1 epilogue (plan::GemmConfigInfo::fused_w1): the block-scaled W1 GEMM's accumulators
// -> the gated (or plain) activation -> its 1x128 FP8 quantization, written as act_q and act_scale:
// no bf16 w1_out and no activation kernel. An operator-style CUTLASS epilogue (the interface of
// CUTLASS's own no-smem epilogues), run through cutlass::epilogue::collective::detail::
// Sm90TmaWarpSpecializedAdapter in the pointer-array cooperative kernel.
//
// The tile is swapped: the kernel's M is 256 W1 rows (one gate block and its up block under
// numerics::W1Rows::kBlockPairs, or two output groups of a non-gated activation), its N tokens. The
// cooperative kernel's two consumer warpgroups each own 64-row slices at MMA_M = 0 and 1, 128 rows
// apart, so a thread holds W1 row r and row r + 128 of the same token in registers: the gate value
// and its up value (gated), or a value of each output group (non-gated). In wgmma's accumulator
// layout a value v = (c2, r2, j) of warp w, lane t sits at token 8j + 2(t % 4) + c2 and row
// 16w + 8 r2 + t / 4: a token's 128 rows are 2 values of a thread, the 8 lanes t / 4 = 0..7 (3
// shuffles) and the 8 warps (shared memory). Coordinates come from CuTe's partition of the tile, so
// only the reduction's grouping relies on that layout (the GPU tests compare every code and scale).
// Numerics: the activation reads the fp32 accumulators (the unfused path rounds W1's output to bf16
// first), scale = fp8_scale(amax) per group, codes RNE-saturated as the activation kernel's.
#pragma once

#include <cuda_fp8.h>

#include "cuda/grouped_gemm.h"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "numerics/activation.h"
#include "numerics/fp8.h"

namespace moekit::cuda::detail {

template <class TileShape, int kThreads>
class FusedW1Epilogue {
 public:
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kGroup = static_cast<int>(kQuantBlock);
  static_assert(kTileM == 2 * kGroup, "the fused W1 tile holds 256 W1 rows: a gate block and its up block");
  static_assert(kTileN % 8 == 0 && kThreads == 256, "two consumer warpgroups, 8-token wgmma column groups");

  // What CUTLASS's kernel and adapter read of an epilogue.
  struct ThreadEpilogueOp {};
  using DispatchPolicy = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using ElementC = std::uint8_t;
  using ElementD = std::uint8_t;
  using StrideC = cute::Stride<std::int64_t, cute::Int<1>, cute::Int<0>>*;
  using StrideD = StrideC;
  using InternalStrideC = cute::remove_pointer_t<StrideC>;
  using InternalStrideD = InternalStrideC;
  using Arguments = GroupedGemmLaunch::FusedW1;
  using Params = Arguments;

  // Each warp's per-token amax of each output group (2 for a non-gated tile).
  struct SharedStorage {
    float amax[2][kWarps][kTileN];
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static std::size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.act_q != nullptr && args.act_scale != nullptr && args.I > 0 && args.I % kGroup == 0;
  }

  CUTLASS_HOST_DEVICE explicit FusedW1Epilogue(Params const& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma,
                                 ResidueMNK residue_mnk, int thread_idx, char* smem_buf) {
    using namespace cute;
    static_assert(size<1>(FrgLayout{}) == 2 && size<2>(FrgLayout{}) == 1,
                  "fused W1: a thread's accumulators span MMA_M = 2 (rows r and r + 128) and one MMA_N");
    constexpr int kValues = size<0>(FrgLayout{});  // (2, 2, kTileN / 8): 2 tokens x 2 rows x column groups
    static_assert(kValues == kTileN / 2, "fused W1: unexpected wgmma accumulator layout");
    auto& smem = *reinterpret_cast<SharedStorage*>(smem_buf);

    const int m_tile = static_cast<int>(get<0>(blk_coord_mnkl));
    const int n_tile = static_cast<int>(get<1>(blk_coord_mnkl));  // the tile's first token: n_tile * kTileN
    const int group = static_cast<int>(get<3>(blk_coord_mnkl));   // the expert
    const int rows_left = static_cast<int>(get<0>(residue_mnk));  // W1 rows of this tile that exist
    const int tokens_left = static_cast<int>(get<1>(residue_mnk));
    const int lane = thread_idx % 32, warp = thread_idx / 32;
    const numerics::W1Rows rows = numerics::w1_rows(params_.activation, QuantScheme::kBlock128);
    const bool gated = rows == numerics::W1Rows::kBlockPairs;
    const int groups = gated ? 1 : 2;
    const std::int64_t row0 =
        params_.row_offsets != nullptr ? params_.row_offsets[group] : static_cast<std::int64_t>(group) * params_.M;
    const int I = params_.I;
    const int spr = I / kGroup;

    Tensor cD = make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{}));
    Tensor tCcD = tiled_mma.get_slice(thread_idx).partition_C(cD);

    // Activation values: [output group][value].
    float a[2][kValues];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kValues; ++v) {
      if (gated) {
        a[0][v] =
            numerics::activation_value<float, numerics::DeviceMath>(params_.activation, acc(v, 0, 0), acc(v, 1, 0));
        a[1][v] = 0.0f;
      } else {
        a[0][v] = numerics::activation_value<float, numerics::DeviceMath>(params_.activation, acc(v, 0, 0), 0.0f);
        a[1][v] = numerics::activation_value<float, numerics::DeviceMath>(params_.activation, acc(v, 1, 0), 0.0f);
      }
    }

    // Per-token amax: the thread's 2 rows, the 8 lanes of equal t % 4, then the warps.
    cutlass::arch::NamedBarrier::sync(kThreads, 0);  // the previous tile's readers are done
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      if (h >= groups) break;
      CUTLASS_PRAGMA_UNROLL
      for (int cj = 0; cj < kValues / 2; ++cj) {  // (c2, j): value index c2 + 4j, its second row + 2
        const int v = (cj % 2) + 4 * (cj / 2);
        float m = fmaxf(fabsf(a[h][v]), fabsf(a[h][v + 2]));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));
        if (lane < 4) smem.amax[h][warp][static_cast<int>(get<1>(tCcD(v, 0, 0)))] = m;
      }
    }
    cutlass::arch::NamedBarrier::sync(kThreads, 0);

    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      if (h >= groups) break;
      const int out_col0 = gated ? kGroup * m_tile : 2 * kGroup * m_tile + kGroup * h;
      if (h * kGroup >= rows_left) break;  // non-gated I = 128 (mod 256): no second group here
      CUTLASS_PRAGMA_UNROLL
      for (int cj = 0; cj < kValues / 2; ++cj) {
        const int v = (cj % 2) + 4 * (cj / 2);
        const int n = static_cast<int>(get<1>(tCcD(v, 0, 0)));
        if (n >= tokens_left) continue;
        float amax = 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, smem.amax[h][w][n]);
        const float scale = numerics::fp8_scale(amax);
        const std::int64_t row = row0 + static_cast<std::int64_t>(n_tile) * kTileN + n;
        std::uint8_t* out = params_.act_q + row * I + out_col0;
        CUTLASS_PRAGMA_UNROLL
        for (int r2 = 0; r2 < 2; ++r2) {
          const int m = static_cast<int>(get<0>(tCcD(v + 2 * r2, h, 0))) - kGroup * h;  // row in the group
          const __nv_fp8_e4m3 q(a[h][v + 2 * r2] / scale);
          out[m] = q.__x;
          if (m == 0) params_.act_scale[row * spr + out_col0 / kGroup] = scale;
        }
      }
    }
  }

 private:
  Params params_;
};

}  // namespace moekit::cuda::detail
