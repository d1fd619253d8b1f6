// The CUTLASS 4.2 sm90 pointer-array grouped FP8 GEMM behind grouped_gemm.h, as a template that
// each src/cuda/grouped_gemm_<config>.cu instantiates once. Epilogue (EVT): D = bf16(sb * (sa *
// acc)) with sa and sb broadcast per row / per column, or per group (per-tensor), from per-group
// pointer arrays. Swap-A/B computes D^T = B . A^T so that the weights fill the 128-row side when
// experts hold few tokens; D^T column-major is D row-major, so the memory contract is the same.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cuda/check.h"
#include "cuda/grouped_gemm.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "plan/experts_workspace.h"

namespace moekit::cuda::detail {

using namespace cute;

template <class TileShape_, class KernelSchedule, class EpilogueSchedule, bool kSwapAB_>
struct GroupedFp8Gemm {
  static constexpr bool kSwapAB = kSwapAB_;
  using TileShape = TileShape_;
  using ClusterShape = Shape<_1, _1, _1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // (K, N) column-major = (N, K) row-major
  using LayoutD = cute::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignAB = 16;  // 16 FP8 elements = 16 bytes (TMA)
  static constexpr int kAlignD = 8;    // 8 bf16 = 16 bytes

  // Per-row (column vector over the kernel's M) and per-column (row vector over N) fp32 scales,
  // each a per-group pointer; the bool stride picks vector (true) or one scalar per group (false).
  // NOTES: alignment 1 (scalar loads): a group's scale vector starts at g * M floats, and M need
  // not be a multiple of 4; the scales are a few KB against MBs of operands.
  using ColScale = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float*, float, Stride<bool, _0, _0>, 1>;
  using RowScale = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float*, float, Stride<_0, bool, _0>, 1>;
  using MulCol = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                        cutlass::FloatRoundStyle::round_to_nearest>;
  using MulRow = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float,
                                                        cutlass::FloatRoundStyle::round_to_nearest>;
  using EvtCol = cutlass::epilogue::fusion::Sm90EVT<MulCol, ColScale, cutlass::epilogue::fusion::Sm90AccFetch>;
  using Evt = cutlass::epilogue::fusion::Sm90EVT<MulRow, RowScale, EvtCol>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule, Evt>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB, LayoutB*, kAlignAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The per-group argument arrays, laid out struct-of-arrays in the plan's gemm_args slice: slot
  // j of each array lives at args + j * groups * kSlot.
  static constexpr std::int64_t kSlot = 32;
  static_assert(sizeof(Shape3) <= kSlot && sizeof(StrideA) <= kSlot && sizeof(StrideB) <= kSlot &&
                    sizeof(StrideD) <= kSlot,
                "a per-group argument exceeds its 32-byte slot");
  static constexpr int kArrays = 8;  // shapes, A, B, D, col scales, row scales, stride_A, stride_B|stride_D
  static_assert(kArrays * kSlot <= plan::kGemmArgsBytesPerExpert,
                "per-group GEMM arguments exceed the plan's kGemmArgsBytesPerExpert");

  struct Arrays {
    Shape3* shapes;
    const ElementA** ptr_A;
    const ElementB** ptr_B;
    ElementD** ptr_D;
    const float** ptr_col;  // ColScale: per kernel-M row
    const float** ptr_row;  // RowScale: per kernel-N column
    StrideA* stride_A;
    StrideB* stride_B;
    StrideD* stride_D;
  };

  static Arrays arrays(std::byte* args, int groups) {
    auto at = [&](int j) { return args + static_cast<std::int64_t>(j) * groups * kSlot; };
    Arrays a;
    a.shapes = reinterpret_cast<Shape3*>(at(0));
    a.ptr_A = reinterpret_cast<const ElementA**>(at(1));
    a.ptr_B = reinterpret_cast<const ElementB**>(at(2));
    a.ptr_D = reinterpret_cast<ElementD**>(at(3));
    a.ptr_col = reinterpret_cast<const float**>(at(4));
    a.ptr_row = reinterpret_cast<const float**>(at(5));
    a.stride_A = reinterpret_cast<StrideA*>(at(6));
    // stride_B and stride_D share slot 7: each is <= 16 bytes and gets half of it.
    a.stride_B = reinterpret_cast<StrideB*>(at(7));
    a.stride_D = reinterpret_cast<StrideD*>(at(7) + static_cast<std::int64_t>(groups) * 16);
    return a;
  }
  static_assert(sizeof(StrideB) <= 16 && sizeof(StrideD) <= 16, "stride_B / stride_D exceed their half slot");
};

// One thread per group: the problem shape and pointers of group g, from its row count on the device.
template <class G>
__global__ void build_grouped_args(GroupedGemmProblem p, typename G::Arrays a, std::int32_t* status) {
  const int g = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (g >= p.groups) return;
  int m = p.rows[g];
  if (m < 0 || m > p.capacity) {
    // Never written past the buffer: the group runs with 0 rows, and the host raises the error.
    if (atomicCAS(status + kStatusBadRows, 0, 1) == 0) {
      status[kStatusBadRows + 1] = g;
      status[kStatusBadRows + 2] = m;
    }
    m = 0;
  }
  const int n = static_cast<int>(p.n), k = static_cast<int>(p.k), cap = static_cast<int>(p.capacity);
  const auto* tokens = reinterpret_cast<const typename G::ElementA*>(p.A + static_cast<std::int64_t>(g) * cap * k);
  const auto* weights = reinterpret_cast<const typename G::ElementB*>(p.B + static_cast<std::int64_t>(g) * n * k);
  const float* sa = p.sa_per_row ? p.sa + static_cast<std::int64_t>(g) * cap : p.sa + g;
  const float* sb = p.sb_per_col ? p.sb + static_cast<std::int64_t>(g) * n : p.sb + g;
  a.ptr_D[g] = reinterpret_cast<typename G::ElementD*>(p.D + static_cast<std::int64_t>(g) * cap * n);
  if constexpr (G::kSwapAB) {
    // Kernel problem (n, m, k): A = weights (n x k row-major), B = tokens (k x m column-major).
    a.shapes[g] = typename G::Shape3{n, m, k};
    a.ptr_A[g] = reinterpret_cast<const typename G::ElementA*>(weights);
    a.ptr_B[g] = reinterpret_cast<const typename G::ElementB*>(tokens);
    a.ptr_col[g] = sb;
    a.ptr_row[g] = sa;
    a.stride_A[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, make_shape(n, k, 1));
    a.stride_B[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, make_shape(cap, k, 1));
    a.stride_D[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, make_shape(n, cap, 1));
  } else {
    a.shapes[g] = typename G::Shape3{m, n, k};
    a.ptr_A[g] = tokens;
    a.ptr_B[g] = weights;
    a.ptr_col[g] = sa;
    a.ptr_row[g] = sb;
    a.stride_A[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, make_shape(cap, k, 1));
    a.stride_B[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, make_shape(n, k, 1));
    a.stride_D[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, make_shape(cap, n, 1));
  }
}

template <class G>
void run_grouped_fp8_gemm(const GroupedGemmProblem& p, std::byte* args, std::byte* scratch, std::int64_t scratch_bytes,
                          std::int32_t* status, int num_sms, cudaStream_t stream) {
  MOEKIT_CUDA_REQUIRE(p.groups >= 1 && p.n > 0 && p.k > 0 && p.capacity >= 0,
                      "grouped_fp8_gemm: groups, n and k must be positive");
  MOEKIT_CUDA_REQUIRE(p.n % 16 == 0 && p.k % 16 == 0, "grouped_fp8_gemm: n = " + std::to_string(p.n) +
                                                          " and k = " + std::to_string(p.k) +
                                                          " must be multiples of 16 (16-byte TMA rows)");
  const typename G::Arrays a = G::arrays(args, p.groups);
  build_grouped_args<G><<<(p.groups + 127) / 128, 128, 0, stream>>>(p, a, status);
  MOEKIT_CUDA_CHECK_LAUNCH();

  using Gemm = typename G::Gemm;
  typename Gemm::Arguments arguments;
  // Evt arguments: (RowScale, (ColScale, AccFetch, MulCol), MulRow), children first.
  decltype(arguments.epilogue.thread) fusion{};
  auto& row_args = fusion.op_0;
  auto& col_args = fusion.op_1.op_0;
  row_args.ptr_row = a.ptr_row;
  row_args.dRow = {_0{}, G::kSwapAB ? p.sa_per_row : p.sb_per_col, _0{}};
  col_args.ptr_col = a.ptr_col;
  col_args.dCol = {G::kSwapAB ? p.sb_per_col : p.sa_per_row, _0{}, _0{}};

  cutlass::KernelHardwareInfo hw;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&hw.device_id));
  hw.sm_count = num_sms;
  arguments = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                       {p.groups, a.shapes, nullptr},  // shapes on the device only
                                       {a.ptr_A, a.stride_A, a.ptr_B, a.stride_B},
                                       {fusion, nullptr, nullptr, a.ptr_D, a.stride_D},
                                       hw};
  const std::size_t need = Gemm::get_workspace_size(arguments);
  MOEKIT_CUDA_REQUIRE(static_cast<std::int64_t>(need) <= scratch_bytes,
                      "grouped_fp8_gemm: CUTLASS needs " + std::to_string(need) + " bytes of workspace, the plan's " +
                          "gemm_scratch holds " + std::to_string(scratch_bytes) +
                          ": raise plan::kGemmScratchBytes (and its contract test)");
  Gemm gemm;
  const cutlass::Status can = gemm.can_implement(arguments);
  MOEKIT_CUDA_REQUIRE(can == cutlass::Status::kSuccess,
                      std::string("grouped_fp8_gemm: CUTLASS cannot run this problem: ") + cutlassGetStatusString(can));
  const cutlass::Status init = gemm.initialize(arguments, scratch, stream);
  MOEKIT_CUDA_REQUIRE(init == cutlass::Status::kSuccess,
                      std::string("grouped_fp8_gemm: initialize failed: ") + cutlassGetStatusString(init));
  const cutlass::Status run = gemm.run(stream);
  MOEKIT_CUDA_REQUIRE(run == cutlass::Status::kSuccess,
                      std::string("grouped_fp8_gemm: run failed: ") + cutlassGetStatusString(run));
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::cuda::detail
