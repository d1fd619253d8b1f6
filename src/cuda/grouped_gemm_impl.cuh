// The CUTLASS 4.2 sm90 pointer-array grouped GEMMs (FP8; bf16 / fp16) behind grouped_gemm.h, as templates over a
// row of the config table (plan/gemm_config.h): its tile, schedule and swap come from the table.
// Each src/cuda/grouped_gemm_<config>.cu and grouped_gemm_block_<config>.cu instantiates one.
//   GroupedFp8Gemm: per-token / per-tensor scales in the epilogue (EVT): D = bf16(sb * (sa * acc))
//     with sa and sb broadcast per row / per column, or per group (per-tensor), from per-group
//     pointer arrays. Its main loop moves the tensor cores' FP8 partial sums into fp32 every 128
//     elements of K (Accumulation::kPrecise), or, kFastAccum, never (FP8FastAccum).
//   GroupedFp8BlockGemm: 1x128 / 128x128 block scales applied to each k-block's partial sums in the
//     main loop (CUTLASS's FP8 blockwise mainloop, cf. its example 68), D = bf16(acc).
//   GroupedSixteenBitGemm: bf16 or fp16 operands without scales (the configs' sixteen_bit rows),
//     fp32 sums over the whole K, D in the operands' dtype.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <string>

#include "cuda/check.h"
#include "cuda/grouped_gemm.h"
#include "cuda/launch_cache.h"
#include "cuda/pdl.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace moekit::cuda::detail {

using namespace cute;

// Whether CUTLASS's arguments of instance G have GroupedGemmArrays' layout (the device prepare step
// writes them without CUTLASS): the problem shape as 3 packed ints, each stride its one int64 leading
// dimension ((cap, k) tokens / (n, k) weights: k; D: n), swapped or not.
// Their sizes, at compile time: the shape 3 ints, each stride one int64.
template <class G>
constexpr bool packed_argument_sizes() {
  return sizeof(typename G::Shape3) == 3 * sizeof(int) && sizeof(typename G::StrideA) == 8 &&
         sizeof(typename G::StrideB) == 8 && sizeof(typename G::StrideD) == 8;
}
template <class G>
bool packed_layout_matches() {
  static_assert(packed_argument_sizes<G>(),
                "CUTLASS's problem shape is not 3 packed ints, or a stride not one int64: GroupedGemmArrays no "
                "longer matches them");
  const typename G::Shape3 s{7, 11, 13};
  const int ints[3] = {7, 11, 13};
  const int cap = 5, n = 48, k = 96;
  const typename G::StrideA sa =
      cutlass::make_cute_packed_stride(typename G::StrideA{}, G::kSwapAB ? make_shape(n, k, 1) : make_shape(cap, k, 1));
  const typename G::StrideB sb =
      cutlass::make_cute_packed_stride(typename G::StrideB{}, G::kSwapAB ? make_shape(cap, k, 1) : make_shape(n, k, 1));
  const typename G::StrideD sd = cutlass::make_cute_packed_stride(
      typename G::StrideD{}, G::kSwapAB ? make_shape(n, cap, 1) : make_shape(cap, n, 1));
  std::int64_t a = 0, b = 0, d = 0;
  std::memcpy(&a, &sa, 8);
  std::memcpy(&b, &sb, 8);
  std::memcpy(&d, &sd, 8);
  return std::memcmp(&s, ints, sizeof(ints)) == 0 && a == k && b == k && d == n;
}

template <plan::GemmConfig kConfig, bool kFastAccum = false>
struct GroupedFp8Gemm {
  static constexpr plan::GemmConfigInfo kInfo = plan::gemm_config_info(kConfig);
  static constexpr bool kSwapAB = kInfo.swap_ab;
  static constexpr bool kPingpong = kInfo.schedule == plan::GemmSchedule::kPingpong;
  using TileShape = Shape<Int<kInfo.tile_m>, Int<kInfo.tile_n>, Int<kInfo.tile_k>>;
  // Precise: CUTLASS's FP8 main loop adds the tensor cores' partial sums into an fp32 accumulator
  // every kPromotionMmas wgmma instructions of K = 32 each: 128 elements of K, as block128 does.
  static constexpr int kPromotionMmas = 4;
  static constexpr bool kFast = kFastAccum;
  static_assert(kInfo.tile_k % 32 == 0 && 128 % kInfo.tile_k == 0 && kPromotionMmas * 32 == 128,
                "a k-tile must hold whole wgmma K steps and divide the 128-element promotion interval");
  using KernelSchedule = cute::conditional_t<
      kFastAccum,
      cute::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum>,
      cute::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  using EpilogueSchedule = cute::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
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

  // The device prepare step writes GroupedGemmArrays without CUTLASS: shapes as 3 ints, each
  // stride as its one dynamic int64 (the leading dimension). packed_layout_matches checks the sizes
  // at compile time and the values once at run time.
  static bool layout_matches() { return packed_layout_matches<GroupedFp8Gemm>(); }
};

// The block-scaled epilogue: bf16 D, or fp32 D for the fused recipe's small experts (CUTLASS's TMA
// epilogue, 16-byte aligned). The fused W1 runs on moekit's own main loop (block_gemm_sm90.cuh).
template <class TileShape, class LayoutD, class EpilogueSchedule, class ElementD>
struct BlockEpilogue {
  static constexpr int kAlignD = 16 / static_cast<int>(sizeof(ElementD));
  using CollectiveOp = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, Shape<_1, _1, _1>,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  static constexpr int kSmemBytes = static_cast<int>(sizeof(typename CollectiveOp::SharedStorage));
};

// The block-scaled twin. The scale granularity follows the swap: unswapped, the kernel's A is the
// tokens (one scale per row and k-block: granularity 1 x 128) and its B the weights (128 x 128);
// swapped, the other way round. kFp32D: D in fp32 (plan::GemmConfigInfo::w1_fp32), else bf16.
template <plan::GemmConfig kConfig, bool kFp32D = false>
struct GroupedFp8BlockGemm {
  static constexpr plan::GemmConfigInfo kInfo = plan::gemm_config_info(kConfig);
  static constexpr bool kSwapAB = kInfo.swap_ab;
  static constexpr bool kPingpong = kInfo.schedule == plan::GemmSchedule::kPingpong;
  using TileShape = Shape<Int<kInfo.tile_m>, Int<kInfo.tile_n>, Int<kInfo.tile_k>>;
  using KernelSchedule =
      cute::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule = cute::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using ClusterShape = Shape<_1, _1, _1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cute::conditional_t<kFp32D, float, cutlass::bfloat16_t>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cute::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignAB = 16;
  static constexpr int kGranularityM = kSwapAB ? static_cast<int>(kQuantBlock) : 1;
  static constexpr int kGranularityN = kSwapAB ? 1 : static_cast<int>(kQuantBlock);
  using ScaleConfig =
      cutlass::detail::Sm90BlockwiseScaleConfig<kGranularityM, kGranularityN, static_cast<int>(kQuantBlock),
                                                cute::GMMA::Major::K, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static_assert(!kInfo.fused_w1 && kInfo.main_loop == plan::GemmMainLoop::kCutlass,
                "CUTLASS runs no fused W1 here: the fused W1 is moekit's main loop (block_gemm_sm90.cuh)");
  static_assert(!kFp32D || kInfo.w1_fp32, "an fp32-D instance of a config the table has none for (w1_fp32)");
  using Epilogue = BlockEpilogue<TileShape, LayoutD, EpilogueSchedule, ElementD>;
  using CollectiveEpilogue = typename Epilogue::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<Epilogue::kSmemBytes>, KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  static_assert(sizeof(LayoutSFA) == 5 * sizeof(int) && sizeof(LayoutSFB) == 5 * sizeof(int),
                "a CUTLASS block-scale layout is not five ints: write_block_scale_layout no longer matches it");

  // The per-token checks, plus write_block_scale_layout against CUTLASS's layouts for a problem
  // (m, n, k) = (5, 384, 320): tokens 5 rows x 3 k-blocks, weights 3 blocks x 3 k-blocks.
  static bool layout_matches() {
    static_assert(packed_argument_sizes<GroupedFp8BlockGemm>(),
                  "CUTLASS's problem shape is not 3 packed ints, or a stride not one int64: GroupedGemmArrays no "
                  "longer matches them");
    const int m = 5, n = 384, k = 320;
    const auto sfa = ScaleConfig::tile_atom_to_shape_SFA(make_shape(kSwapAB ? n : m, kSwapAB ? m : n, k, 1));
    const auto sfb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(kSwapAB ? n : m, kSwapAB ? m : n, k, 1));
    const LayoutSFA a = sfa;
    const LayoutSFB b = sfb;
    int want_tokens[5], want_weights[5];
    write_block_scale_layout(want_tokens, m, 3);
    write_block_scale_layout(want_weights, 3, 3);
    // The per-token checks of shapes and strides.
    return std::memcmp(&a, kSwapAB ? want_weights : want_tokens, sizeof(a)) == 0 &&
           std::memcmp(&b, kSwapAB ? want_tokens : want_weights, sizeof(b)) == 0 &&
           GroupedFp8Gemm<kConfig>::layout_matches();
  }
};

// The 16-bit twin (plan::GemmConfigInfo::sixteen_bit): bf16 or fp16 operands (Element), no scales,
// fp32 sums over the whole K, D in Element. The config's tile with a K tile of the same 128 bytes a
// row (plan::sixteen_bit_tile_k), CUTLASS's plain warp-specialized main loop (nothing to promote:
// the tensor cores' bf16 / fp16 products are summed in fp32).
template <plan::GemmConfig kConfig, class Element>
struct GroupedSixteenBitGemm {
  static constexpr plan::GemmConfigInfo kInfo = plan::gemm_config_info(kConfig);
  static constexpr bool kSwapAB = kInfo.swap_ab;
  static constexpr bool kPingpong = kInfo.schedule == plan::GemmSchedule::kPingpong;
  static_assert(kInfo.sixteen_bit && kInfo.main_loop == plan::GemmMainLoop::kCutlass && !kInfo.fused_w1,
                "a 16-bit instance of a config the table gives none (sixteen_bit)");
  static_assert(sizeof(Element) == 2, "16-bit operands: bf16 or fp16");
  using TileShape = Shape<Int<kInfo.tile_m>, Int<kInfo.tile_n>, Int<plan::sixteen_bit_tile_k(kInfo)>>;
  using KernelSchedule = cute::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using ClusterShape = Shape<_1, _1, _1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementA = Element;
  using ElementB = Element;
  using ElementD = Element;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cute::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignAB = 8;  // 8 elements = 16 bytes (TMA)
  using Epilogue = BlockEpilogue<TileShape, LayoutD, EpilogueSchedule, ElementD>;
  using CollectiveEpilogue = typename Epilogue::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB, LayoutB*, kAlignAB,
      float, TileShape, ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<Epilogue::kSmemBytes>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  static bool layout_matches() { return packed_layout_matches<GroupedSixteenBitGemm>(); }
};

// The persistent scheduler's tile order: the token tiles of one weight tile adjacent, so that the
// CTAs reading the same weights run together and share them through L2 (the weights of all experts
// are ~8x L2). Unswapped, the tokens are the kernel's M: along M (CUTLASS's grouped default);
// swapped, its N: along N (along M, a swapped kernel read its weights once per token tile).
template <class RasterOrder, bool kSwapAB>
constexpr RasterOrder raster_order() {
  return kSwapAB ? RasterOrder::AlongN : RasterOrder::AlongM;
}

// CUTLASS's device_kernel with programmatic dependent launch (cuda/pdl.cuh): CUTLASS 4.2's grouped
// (pointer-array) sm90 kernels make no grid-dependency calls, so this waits for the kernels before
// it first; the kernel body is CUTLASS's, unchanged, and the next kernel launches as its CTAs exit
// (no early trigger: pdl.cuh says why). A launch the step gives no expert (the rule's other row
// ranges) then starts its CTAs as the kernel before it drains, instead of after it, and exits right
// after its wait (docs/PERF.md).
template <class Operator>
__global__ void __launch_bounds__(Operator::MaxThreadsPerBlock, Operator::MinBlocksPerMultiprocessor)
    pdl_gemm_kernel(CUTLASS_GRID_CONSTANT typename Operator::Params const params) {
  pdl_wait();
  extern __shared__ char smem[];
  Operator op;
  op(params, smem);
}

// What a CUTLASS launch binds (launch_cache.h): everything CUTLASS's arguments are built from but
// the step's data, which its kernels read on the device (the shapes and pointers the prepare kernel
// writes into `args`). CUTLASS 4.2's grouped collectives and group scheduler keep no state in the
// scratch between launches (their initialize_workspace does nothing), so parameters initialized
// once serve every launch with the same key.
struct CutlassLaunchKey {
  const std::byte* args;
  const std::byte* scratch;
  std::int64_t n, k, scratch_bytes;
  int groups, num_sms, device, scales_per_row;
};

// The launch both scalings share: CUTLASS's scratch against the plan's gemm_scratch, then
// can_implement and initialize (once per CutlassLaunchKey: `make_arguments(device)` builds the
// arguments on the first launch only) and run (CUTLASS's kernel through pdl_gemm_kernel), each
// failure a moekit::Error naming `what`.
template <class Gemm, class MakeArguments>
void launch_gemm(const GroupedGemmLaunch& l, cudaStream_t stream, const char* what,
                 const MakeArguments& make_arguments) {
  using Kernel = typename Gemm::GemmKernel;
  using Params = typename Kernel::Params;
  static_assert(cute::size(typename Kernel::DispatchPolicy::ClusterShape{}) == 1,
                "pdl_gemm_kernel launches without a cluster, as CUTLASS launches 1x1x1 clusters");
  struct Bound {
    Params params;
    dim3 grid;
  };
  thread_local BoundCache<CutlassLaunchKey, Bound> cache;
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  const CutlassLaunchKey key{
      l.args, l.scratch, l.n, l.k, l.scratch_bytes, l.groups, l.num_sms, device, l.scales_per_row ? 1 : 0};
  const Bound* bound = cache.find(key);
  if (bound == nullptr) {
    const typename Gemm::Arguments arguments = make_arguments(device);
    const std::size_t need = Gemm::get_workspace_size(arguments);
    MOEKIT_CUDA_REQUIRE(static_cast<std::int64_t>(need) <= l.scratch_bytes,
                        std::string(what) + ": CUTLASS needs " + std::to_string(need) +
                            " bytes of workspace, the plan's gemm_scratch holds " + std::to_string(l.scratch_bytes) +
                            ": raise cuda::kGemmScratchBytes (and its contract test)");
    Gemm gemm;
    const cutlass::Status can = gemm.can_implement(arguments);
    MOEKIT_CUDA_REQUIRE(can == cutlass::Status::kSuccess,
                        std::string(what) + ": CUTLASS cannot run this problem: " + cutlassGetStatusString(can));
    const cutlass::Status init = gemm.initialize(arguments, l.scratch, stream);
    MOEKIT_CUDA_REQUIRE(init == cutlass::Status::kSuccess,
                        std::string(what) + ": initialize failed: " + cutlassGetStatusString(init));
    bound = &cache.bind(key, Bound{gemm.params(), Gemm::get_grid_shape(gemm.params())});
  }
  const auto kernel = pdl_gemm_kernel<Kernel>;
  static std::atomic<std::uint64_t> attribute_set{0};
  once_per_device(attribute_set, device, [&] {
    MOEKIT_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int{Kernel::SharedStorageSize}));
  });
  launch_pdl(kernel, bound->grid, Kernel::get_block_shape(), std::size_t{Kernel::SharedStorageSize}, stream,
             bound->params);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

template <class G>
void run_grouped_fp8_gemm(const GroupedGemmLaunch& l, cudaStream_t stream) {
  static const bool layout_ok = G::layout_matches();
  MOEKIT_CUDA_REQUIRE(layout_ok,
                      std::string("grouped_fp8_gemm ") + std::string(G::kInfo.name) +
                          ": CUTLASS's argument layout differs from GroupedGemmArrays (cuda/grouped_gemm.h)");
  MOEKIT_CUDA_REQUIRE(l.groups >= 1 && plan::supports(G::kInfo, l.n, l.k),
                      std::string("grouped_fp8_gemm: config ") + std::string(G::kInfo.name) + " does not run n = " +
                          std::to_string(l.n) + ", k = " + std::to_string(l.k) + " (see plan/gemm_config.h)");
  using Gemm = typename G::Gemm;
  launch_gemm<Gemm>(l, stream, "grouped_fp8_gemm", [&](int device) {
    const GroupedGemmArrays a = GroupedGemmArrays::at(l.args, l.groups);
    typename Gemm::Arguments arguments;
    // Evt arguments: (RowScale, (ColScale, AccFetch, MulCol), MulRow), children first.
    decltype(arguments.epilogue.thread) fusion{};
    auto& row_args = fusion.op_0;
    auto& col_args = fusion.op_1.op_0;
    row_args.ptr_row = a.ptr_row;
    row_args.dRow = {_0{}, l.scales_per_row, _0{}};
    col_args.ptr_col = a.ptr_col;
    col_args.dCol = {l.scales_per_row, _0{}, _0{}};
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = l.num_sms;
    arguments = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {l.groups, reinterpret_cast<typename G::Shape3*>(a.shapes), nullptr},  // shapes on the device only
        {reinterpret_cast<const typename G::ElementA**>(a.ptr_A), reinterpret_cast<typename G::StrideA*>(a.stride_A),
         reinterpret_cast<const typename G::ElementB**>(a.ptr_B), reinterpret_cast<typename G::StrideB*>(a.stride_B)},
        {fusion, nullptr, nullptr, reinterpret_cast<typename G::ElementD**>(a.ptr_D),
         reinterpret_cast<typename G::StrideD*>(a.stride_D)},
        hw};
    if constexpr (!G::kFast) {
      static_assert(
          requires { arguments.mainloop.mma_promotion_interval; },
          "the precise schedule did not select CUTLASS's promoting FP8 main loop");
      arguments.mainloop.mma_promotion_interval = G::kPromotionMmas;
    }
    arguments.scheduler.raster_order = raster_order<decltype(arguments.scheduler.raster_order), G::kSwapAB>();
    return arguments;
  });
}

template <class G>
void run_grouped_fp8_block_gemm(const GroupedGemmLaunch& l, cudaStream_t stream) {
  static const bool layout_ok = G::layout_matches();
  MOEKIT_CUDA_REQUIRE(layout_ok, std::string("grouped_fp8_gemm ") + std::string(G::kInfo.name) +
                                     " (block-scaled): CUTLASS's argument layout differs from GroupedGemmArrays "
                                     "(cuda/grouped_gemm.h)");
  MOEKIT_CUDA_REQUIRE(l.groups >= 1 && l.block_scaled && plan::supports(G::kInfo, l.n, l.k, QuantScheme::kBlock128),
                      std::string("grouped_fp8_gemm: config ") + std::string(G::kInfo.name) +
                          " (block-scaled) does not run n = " + std::to_string(l.n) + ", k = " + std::to_string(l.k) +
                          " (see plan/gemm_config.h)");
  using Gemm = typename G::Gemm;
  launch_gemm<Gemm>(l, stream, "grouped_fp8_gemm (block-scaled)", [&](int device) {
    const GroupedGemmArrays a = GroupedGemmArrays::at(l.args, l.groups);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = l.num_sms;
    typename Gemm::Arguments arguments;
    arguments.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    arguments.problem_shape = {l.groups, reinterpret_cast<typename G::Shape3*>(a.shapes), nullptr};
    arguments.mainloop = {reinterpret_cast<const typename G::ElementA**>(a.ptr_A),
                          reinterpret_cast<typename G::StrideA*>(a.stride_A),
                          reinterpret_cast<const typename G::ElementB**>(a.ptr_B),
                          reinterpret_cast<typename G::StrideB*>(a.stride_B),
                          a.ptr_col,
                          reinterpret_cast<typename G::LayoutSFA*>(a.layout_sfa),
                          a.ptr_row,
                          reinterpret_cast<typename G::LayoutSFB*>(a.layout_sfb)};
    arguments.epilogue = {{},
                          nullptr,
                          nullptr,
                          reinterpret_cast<typename G::ElementD**>(a.ptr_D),
                          reinterpret_cast<typename G::StrideD*>(a.stride_D)};
    arguments.epilogue.thread.alpha = 1.0f;
    arguments.epilogue.thread.beta = 0.0f;
    arguments.hw_info = hw;
    arguments.scheduler.raster_order = raster_order<decltype(arguments.scheduler.raster_order), G::kSwapAB>();
    return arguments;
  });
}

template <class G>
void run_grouped_sixteen_bit_gemm(const GroupedGemmLaunch& l, cudaStream_t stream) {
  static const bool layout_ok = G::layout_matches();
  MOEKIT_CUDA_REQUIRE(layout_ok,
                      std::string("grouped 16-bit GEMM ") + std::string(G::kInfo.name) +
                          ": CUTLASS's argument layout differs from GroupedGemmArrays (cuda/grouped_gemm.h)");
  MOEKIT_CUDA_REQUIRE(l.groups >= 1 && plan::supports_sixteen_bit(G::kInfo, l.n, l.k),
                      std::string("grouped 16-bit GEMM: config ") + std::string(G::kInfo.name) + " does not run n = " +
                          std::to_string(l.n) + ", k = " + std::to_string(l.k) + " (see plan/gemm_config.h)");
  using Gemm = typename G::Gemm;
  launch_gemm<Gemm>(l, stream, "grouped 16-bit GEMM", [&](int device) {
    const GroupedGemmArrays a = GroupedGemmArrays::at(l.args, l.groups);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = l.num_sms;
    typename Gemm::Arguments arguments;
    arguments.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    arguments.problem_shape = {l.groups, reinterpret_cast<typename G::Shape3*>(a.shapes), nullptr};
    arguments.mainloop = {
        reinterpret_cast<const typename G::ElementA**>(a.ptr_A), reinterpret_cast<typename G::StrideA*>(a.stride_A),
        reinterpret_cast<const typename G::ElementB**>(a.ptr_B), reinterpret_cast<typename G::StrideB*>(a.stride_B)};
    arguments.epilogue = {{},
                          nullptr,
                          nullptr,
                          reinterpret_cast<typename G::ElementD**>(a.ptr_D),
                          reinterpret_cast<typename G::StrideD*>(a.stride_D)};
    arguments.epilogue.thread.alpha = 1.0f;
    arguments.epilogue.thread.beta = 0.0f;
    arguments.hw_info = hw;
    arguments.scheduler.raster_order = raster_order<decltype(arguments.scheduler.raster_order), G::kSwapAB>();
    return arguments;
  });
}

}  // namespace moekit::cuda::detail

// The one line each grouped_gemm_<config>.cu holds, inside namespace moekit::cuda.
#define MOEKIT_GROUPED_GEMM_INSTANCE(CONFIG)                                                                 \
  template <>                                                                                                \
  void grouped_fp8_gemm_instance<CONFIG>(const GroupedGemmLaunch& launch, void* stream) {                    \
    detail::run_grouped_fp8_gemm<detail::GroupedFp8Gemm<CONFIG>>(launch, static_cast<cudaStream_t>(stream)); \
  }

// The one line each grouped_gemm_fast_<config>.cu holds.
#define MOEKIT_GROUPED_GEMM_FAST_INSTANCE(CONFIG)                                                                  \
  template <>                                                                                                      \
  void grouped_fp8_gemm_fast_instance<CONFIG>(const GroupedGemmLaunch& launch, void* stream) {                     \
    detail::run_grouped_fp8_gemm<detail::GroupedFp8Gemm<CONFIG, true>>(launch, static_cast<cudaStream_t>(stream)); \
  }

// The one line each grouped_gemm_block_<config>.cu holds.
#define MOEKIT_GROUPED_GEMM_BLOCK_INSTANCE(CONFIG)                                                              \
  template <>                                                                                                   \
  void grouped_fp8_gemm_block_instance<CONFIG>(const GroupedGemmLaunch& launch, void* stream) {                 \
    detail::run_grouped_fp8_block_gemm<detail::GroupedFp8BlockGemm<CONFIG>>(launch,                             \
                                                                            static_cast<cudaStream_t>(stream)); \
  }

// The one line each grouped_gemm_block_f32_<config>.cu holds.
#define MOEKIT_GROUPED_GEMM_BLOCK_F32_INSTANCE(CONFIG)                                                                \
  template <>                                                                                                         \
  void grouped_fp8_gemm_block_f32_instance<CONFIG>(const GroupedGemmLaunch& launch, void* stream) {                   \
    detail::run_grouped_fp8_block_gemm<detail::GroupedFp8BlockGemm<CONFIG, true>>(launch,                             \
                                                                                  static_cast<cudaStream_t>(stream)); \
  }

// The one line each grouped_gemm_bf16_<config>.cu / grouped_gemm_fp16_<config>.cu holds (DTYPE:
// kBf16 or kFp16).
#define MOEKIT_GROUPED_GEMM_SIXTEEN_BIT_INSTANCE(CONFIG, DTYPE)                                                 \
  template <>                                                                                                   \
  void grouped_sixteen_bit_gemm_instance<CONFIG, DType::DTYPE>(const GroupedGemmLaunch& launch, void* stream) { \
    using Element = cute::conditional_t<DType::DTYPE == DType::kBf16, cutlass::bfloat16_t, cutlass::half_t>;    \
    detail::run_grouped_sixteen_bit_gemm<detail::GroupedSixteenBitGemm<CONFIG, Element>>(                       \
        launch, static_cast<cudaStream_t>(stream));                                                             \
  }
