// moekit's own block-scaled grouped FP8 GEMM for Hopper (sm_90a), behind grouped_gemm.h: a 128 x 256
// (tokens x weight rows) tile whose main loop promotes each 128-deep k-block's partial sums one
// 128-column half at a time, so 128 fp32 accumulators and 64 temporaries are live per thread, not
// 2 x 128 (CUTLASS 4.2's blockwise main loop keeps the whole tile's temporaries: a 256-wide tile
// spills there, and its fp8_accumulation.hpp does not compile two weight blocks on the N side).
//   D[g] (m_g x n) = bf16(sum_kb (A_kb . B_kb^T) * sa[row][kb] * sb[col / 128][kb])
// or, fused W1 (plan::GemmConfigInfo::fused_w1), the activation of each 1x128 output group as FP8
// codes act_q and their scale act_scale, no D: under numerics::W1Rows::kBlockPairs the tile's 256
// weight rows are gate block b then up block b, so in wgmma's accumulator layout a thread holds a
// gate value (half 0) and its up value (half 1) at the same register index.
//
// Structure: a persistent grid of one CTA per SM, 384 threads. Warpgroup 0 (one thread) streams
// the A (128 x 128 B) and B (256 x 128 B) k-blocks by TMA into a ring of kStages stages (and, bf16
// D, a second thread stores D's whole 128- or 64-row boxes by TMA: block_gemm_tma_rows); warpgroups
// 1 and 2 each own 64 token rows x 256 columns: per k-block and half, 4 wgmma m64n128k32 into 64
// temporaries, wait, then acc += tmp * sa[row] * sb[half]. The two consumer warpgroups interleave,
// one promoting while the other's wgmmas run. Tiles: expert by expert, the token tiles of one
// weight tile adjacent (CTAs that read the same weights run together and share them through L2).
// Half pairs: a half tile (a group's last token tile when it holds 1-64 of its rows: a ragged
// expert's, or a whole expert of <= 64 rows) runs pingpong with its neighbour: the half tiles of
// weight tiles nt and nt + 1 make one work item, warpgroup w computing the 64 rows x 256 columns of
// nt + w on every other stage (A loaded as 64 rows), so an item costs about one full tile. Without
// them an expert of 257-320 rows runs three full tiles' time for its 2.0-2.5 tiles of rows
// (docs/PERF.md). The fused W1 is one kernel an activation (kAct): with every activation's epilogue
// in one kernel its consumers spilled inside the k-loop once it carried pairs (full tiles 14-18%
// slower); with one they do not, and pairs took its W1 -19% / -11% at m_e = 150 / 300 (+5% at 1000,
// where every tile is full).
// Clusters (plan::GemmConfigInfo::cluster = 2): CTAs run in pairs whose rings carry the same
// k-blocks; a stage is handed back to both CTAs' producers (16 arrivals), so either may multicast
// into it. For two full token tiles of one weight tile (a shared item) each CTA loads its A and half
// the weight tile, multicast into both: half the L2 reads of the weights. A group's odd last tile and
// its half items run one a CTA with their own weights; the shorter of a pair's items pads its ring
// (block_gemm_items.h). Measured (docs/PERF.md): the layer at T = 8192 2.41x -> 1.96x its floor,
// the GEMMs alone at m_e 200-1024 within noise of unclustered.
// Operands are addressed through one 2-D TMA descriptor each over the tensor every group lies in
// (GroupedGemmLaunch::tensors): a group's first row is its pointer's offset in that tensor. Rows a
// tile reads past its group are never written (the epilogue masks rows >= m and columns >= n).
// Napkin math (DeepSeek-V3 W1, m_e = 256, E_local = 16): 16 x 2 x 16 = 512 tiles of 56 k-blocks;
// a k-block is 8 wgmma (2 x 128 x 256 x 128 x 2 = 16.8 MFLOP) over 48 KB of shared memory.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

#include "cuda/block_gemm_items.h"
#include "cuda/check.h"
#include "cuda/grouped_gemm.h"
#include "cuda/launch_cache.h"
#include "cuda/pdl.cuh"
#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "numerics/activation.h"
#include "numerics/fp8.h"

namespace moekit::cuda::detail {

struct BlockGemm {
  static constexpr int kTileM = kBlockTileM, kTileN = 256, kTileK = static_cast<int>(kQuantBlock);
  static constexpr int kHalfN = 128;  // one weight block: the promotion's unit
  static constexpr int kStages = 4;
  static constexpr int kHalfTileRows = kBlockHalfTileRows;  // block_gemm_items.h
  static constexpr int kThreads = 384;                      // producer warpgroup + 2 consumer warpgroups
  static constexpr int kMaxGroups = 1024;                   // the tile table lives in shared memory
  static constexpr int kABytes = kTileM * kTileK;           // FP8: one byte an element
  static constexpr int kHalfABytes = kHalfTileRows * kTileK;
  static constexpr int kBBytes = kTileN * kTileK;
  static constexpr int kConsumerWarps = 8;
  // The epilogue stages 16 rows x 128 bytes a consumer warp (a quarter tile of bf16, an output group
  // of FP8 codes) and writes them 16 bytes a lane, whole rows; a staged row is 128 bytes + 16 of
  // padding, so a thread's writes at rows lane / 4 and lane / 4 + 8 fall in 32 distinct banks.
  static constexpr int kStageRows = 16, kStageRowBytes = 128 + 16;
  // Registers: 24 for the producer, 240 for the consumers: 128 x 24 + 256 x 240 = 384 x 168, what the
  // CTA is launched with (setmaxnreg only moves registers between its warpgroups: asking for more
  // than it holds, e.g. a 32-register producer, never returns and the kernel hangs).
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "setmaxnreg would wait forever");
  static_assert(kTileK == 128, "a TMA box row of 128 FP8 = one 128-byte swizzle row");
  static_assert(kTileM == 2 * 64 && kTileN == 2 * kHalfN, "two 64-row consumer warpgroups, two 128-column halves");
  static_assert(kHalfTileRows == 64, "a half tile is one warpgroup's 64 rows");

  struct alignas(1024) Smem {
    std::uint8_t a[kStages][kABytes];  // 128-byte swizzled, 1024-byte aligned (the wgmma descriptors' base)
    std::uint8_t b[kStages][kBBytes];
    std::uint64_t full[kStages];   // TMA bytes landed
    std::uint64_t empty[kStages];  // the 8 consumer warps are done reading
    std::uint64_t staged;          // a tile's D rows are staged for their TMA store (8 consumer warps)
    int tile_start[kMaxGroups + 1];
    alignas(16) std::uint8_t out[kConsumerWarps][kStageRows * kStageRowBytes];  // each warp's own
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;  // + the alignment of the dynamic base
  static_assert(kSmemBytes <= 227 * 1024, "BlockGemm's stages exceed Hopper's 227 KB of shared memory a CTA");

  struct Params {
    GroupedGemmArrays args;
    int groups = 0, n = 0, k = 0, k_blocks = 0;
    const std::uint8_t* a_base = nullptr;  // the tensors the groups' A and B lie in
    const std::uint8_t* b_base = nullptr;
    GroupedGemmLaunch::FusedW1 fused{};  // act_q null: write D
    bool tma_store = false;              // D by TMA where block_gemm_tma_rows says
  };
  // D stored by TMA (block_gemm_tma_rows): 4 quarters of 128 rows x 64 columns (128-byte swizzled
  // boxes) in the shared memory of the tile's last two k-block stages (block_gemm_quarter).
  static constexpr int kQuarterBytes = kTileM * 128;
  static_assert(kABytes == kQuarterBytes && kBBytes == 2 * kQuarterBytes, "a stage holds three D quarters");
  static constexpr int kMinKBlocksForTmaStore = kStages;  // see block_gemm_tma_rows
};

#if defined(__CUDACC__)

// A K-major operand of 8-row x 128-byte swizzle atoms: the smem matrix descriptor of wgmma. Its high
// word is constant (the 1024-byte stride between 8-row groups in 16-byte units; layout 1 = 128-byte
// swizzle); its low word is the 16-byte start address (14 bits: below 256 KB nothing carries out)
// and the leading byte offset 1. So moving along the operand is a 32-bit add on the low word:
// +2 a 32-byte k-step inside the swizzle row, + bytes / 16 a stage or a half.
__device__ __forceinline__ std::uint32_t block_gemm_desc_lo(const void* smem) {
  const auto addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  return ((addr & 0x3FFFF) >> 4) | (1u << 16);
}
__device__ __forceinline__ std::uint64_t block_gemm_desc(std::uint32_t lo) {
  constexpr std::uint32_t kHi = (1024 >> 4) | (1u << (62 - 32));
  return (static_cast<std::uint64_t>(kHi) << 32) | lo;
}

template <int... kI>
__device__ __forceinline__ void block_gemm_wgmma(std::uint64_t da, std::uint64_t db, float (&d)[64], bool accumulate,
                                                 std::integer_sequence<int, kI...>) {
  cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>::fma(
      da, db, d[kI]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

struct BlockGemmTile {
  int g, mt, nt;
};

// Warp 0 writes the tile table, tile_start[g] = the first tile of group g (an exclusive prefix of
// tiles_of(g) over the groups, tile_start[groups] = every tile; the unswapped kernel's entries are
// work items, block_gemm_items.h); its lane 0 initializes the ring's
// barriers. Every moekit block-GEMM kernel starts here, then __syncthreads().
template <int kStages, int kConsumerWarps, class TilesOf>
__device__ __forceinline__ void block_gemm_setup(int* tile_start, std::uint64_t* full, std::uint64_t* empty, int groups,
                                                 const TilesOf& tiles_of) {
  if (threadIdx.x >= 32) return;
  const int lane = static_cast<int>(threadIdx.x);
  int carry = 0;
  for (int base = 0; base < groups; base += 32) {
    const int g = base + lane;
    const int t = g < groups ? tiles_of(g) : 0;
    int incl = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
      if (lane >= o) incl += v;
    }
    if (g < groups) tile_start[g] = carry + incl - t;
    carry += __shfl_sync(0xFFFFFFFFu, incl, 31);
  }
  if (lane == 0) {
    tile_start[groups] = carry;
    for (int i = 0; i < kStages; ++i) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[i], 1);
      cutlass::arch::ClusterBarrier::init(&empty[i], kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
}

// The tile's group: the last group whose first tile is <= tile (empty groups share their
// successor's start, so the last such group is the one holding the tile).
__device__ __forceinline__ int block_gemm_group_of(const int* tile_start, int groups, int tile) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_start[mid] <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Ring position q (the k-blocks the ring has carried before) -> its stage, and the phase its
// barriers are in on that pass.
struct RingSlot {
  int stage;
  std::uint32_t phase;
};
template <int kStages>
__device__ __forceinline__ RingSlot ring_slot(int q) {
  static_assert((kStages & (kStages - 1)) == 0, "ring position -> stage is a mask");
  return {q & (kStages - 1), static_cast<std::uint32_t>(q / kStages) & 1u};
}

// Item `item` of the tile table (block_gemm_items.h).
__device__ __forceinline__ BlockGemmItem block_gemm_item(const int* tile_start, const int* shapes, int groups,
                                                         int n_tiles, int item) {
  const int g = block_gemm_group_of(tile_start, groups, item);
  return block_gemm_group_item(g, shapes[3 * g], n_tiles, item - tile_start[g]);
}

// The rows of item `it` (a group of m rows) whose D is stored by TMA: 128 for a full tile, 64 for a
// tile holding 65-127 of the group's rows (the first warpgroup's rows; the second writes its own by
// the regular epilogue, masked), 0 otherwise (half tiles, and when the launch gave no D tensor:
// Params::tma_store; k_blocks >= kStages). The tile's consumers keep the stages of its last two
// k-blocks (no arrive on `empty`), stage those rows of bf16 D there as the store's 128-byte-swizzled
// boxes (block_gemm_quarter) and arrive on `staged`; warp 1 of the producer warpgroup issues the
// stores, waits until TMA has read the boxes and hands both stages back (8 arrivals each, as the
// consumers would have), while the consumers run the next item. The regular epilogue's 16-byte row
// stores held the consumers ~6 K cycles a tile, 16-18% of W2's time (16 k-blocks a tile;
// docs/PERF.md). k_blocks >= kStages: the next item cannot reach its epilogue before these stages are
// back (it needs them), so `staged` completes one phase per such item, in item order.
__device__ __forceinline__ int block_gemm_tma_rows(const BlockGemm::Params& p, const BlockGemmItem& it, int m) {
  return block_gemm_tma_rows(m, it, p.tma_store);  // block_gemm_items.h
}
// The first token row of item `it` in the tensor the groups' tokens lie in (Params::a_base): its
// A rows' TMA coordinate, and its D rows' (GroupedGemmLaunch::Tensors::output is row for row).
__device__ __forceinline__ int block_gemm_token_row(const BlockGemm::Params& p, const BlockGemmItem& it) {
  return static_cast<int>((static_cast<const std::uint8_t*>(p.args.ptr_A[it.g]) - p.a_base) / p.k) +
         it.mt * BlockGemm::kTileM;
}
// Quarter q (columns 64q .. 64q + 63 of the tile) of a TMA-stored D: the last k-block's stage s_last
// (its A, then its B's two halves) and the A of the one before, s_prev.
__device__ __forceinline__ std::uint8_t* block_gemm_quarter(BlockGemm::Smem& s, int s_last, int s_prev, int q) {
  return q == 0 ? s.a[s_last] : q == 3 ? s.a[s_prev] : s.b[s_last] + (q - 1) * BlockGemm::kQuarterBytes;
}

// Writes a warp's staged rows (BlockGemm::Smem::out) to dst + row * ld_bytes, 128 bytes a row, the
// first `rows` of 16: a lane copies 16 bytes, 8 lanes a row (whole 32-byte sectors, where the
// uncoalesced 2- and 4-byte stores from the accumulator layout wrote half sectors). A destination
// that is not 16-byte aligned takes 4-byte copies (the layouts moekit builds are aligned).
__device__ __forceinline__ void block_gemm_flush(const std::uint8_t* stage, int lane, std::uint8_t* dst,
                                                 std::int64_t ld_bytes, int rows) {
  __syncwarp();
  const bool aligned = ((reinterpret_cast<std::uintptr_t>(dst) | static_cast<std::uintptr_t>(ld_bytes)) & 15) == 0;
#pragma unroll
  for (int j = 0; j < BlockGemm::kStageRows / 4; ++j) {
    const int row = 4 * j + lane / 8, c = lane % 8;
    if (row >= rows) continue;
    const std::uint8_t* src = stage + row * BlockGemm::kStageRowBytes + 16 * c;
    std::uint8_t* out = dst + row * ld_bytes + 16 * c;
    if (aligned) {
      *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int w = 0; w < 4; ++w)
        reinterpret_cast<std::uint32_t*>(out)[w] = reinterpret_cast<const std::uint32_t*>(src)[w];
    }
  }
  __syncwarp();  // the stage is free for the warp's next rows
}

// The fused W1's 1x128 quantization of one output group held as wgmma accumulators: a thread holds
// rows r0 and r0 + 8 at columns 8i + 2(lane % 4) + {0, 1}; a row's 128 values are 32 of a thread and
// the 4 lanes of equal lane / 4 (2 shuffles). scale = fp8_scale(amax); codes RNE-saturated x / scale,
// as the activation kernel's. The codes go through the warp's stage (rows warp_row0 .. + 16 of the
// group; rows >= m are not written).
__device__ __forceinline__ void block_gemm_quant_group(const float (&v)[64], int lane, int r0, int m, int warp_row0,
                                                       std::uint8_t* stage, std::int64_t act_row0, int I, int col0,
                                                       const GroupedGemmLaunch::FusedW1& f) {
  float amax0 = 0.0f, amax1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    amax0 = fmaxf(amax0, fmaxf(fabsf(v[4 * i]), fabsf(v[4 * i + 1])));
    amax1 = fmaxf(amax1, fmaxf(fabsf(v[4 * i + 2]), fabsf(v[4 * i + 3])));
  }
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    amax0 = fmaxf(amax0, __shfl_xor_sync(0xFFFFFFFFu, amax0, o));
    amax1 = fmaxf(amax1, __shfl_xor_sync(0xFFFFFFFFu, amax1, o));
  }
  const int spr = I / static_cast<int>(kQuantBlock);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + 8 * half;
    const float scale = numerics::fp8_scale(half == 0 ? amax0 : amax1);
    std::uint8_t* out = stage + (lane / 4 + 8 * half) * BlockGemm::kStageRowBytes + 2 * (lane % 4);
    // One range test for the row's 32 values (DivideBy::with_quotient): straight-line, they overlap.
    numerics::DivideBy(scale).with_quotient([&](const auto& quotient) {
#pragma unroll
      for (int i = 0; i < 16; ++i)  // RNE-saturated codes of a column pair, the lower column in the low byte
        *reinterpret_cast<__nv_fp8x2_storage_t*>(out + 8 * i) = __nv_cvt_float2_to_fp8x2(
            make_float2(quotient(v[4 * i + 2 * half]), quotient(v[4 * i + 2 * half + 1])), __NV_SATFINITE, __NV_E4M3);
    });
    if (r < m && lane % 4 == 0) f.act_scale[(act_row0 + r) * spr + col0 / static_cast<int>(kQuantBlock)] = scale;
  }
  block_gemm_flush(stage, lane, f.act_q + (act_row0 + warp_row0) * I + col0, I, min(m - warp_row0, 16));
}

// The fused W1's epilogue for one activation, a compile-time constant: the activation's switch folds
// away. NOTES: with the switch inside the 64-value unrolled loop the kernel was 15x larger (61 K
// SASS lines, every activation inlined 64 times) and its W1 ran 1.9x the unfused W1's time.
template <Activation kAct>
__device__ __forceinline__ void block_gemm_fused_epilogue(float (&acc)[2][64], int lane, int r0, int m, int warp_row0,
                                                          std::uint8_t* stage, std::int64_t act_row0, int nt,
                                                          const GroupedGemmLaunch::FusedW1& f) {
  using numerics::activation_value;
  using numerics::DeviceMath;
  // No swigluoai parameters: swigluoai never runs fused (its interleaved rows pair no whole group;
  // refused below), and the other activations ignore them.
  static_assert(kAct != Activation::kSwigluOai, "swigluoai never runs the fused W1 (its rows pair no whole group)");
  constexpr SwigluOaiParams kUnused{};
  constexpr int kHalfN = BlockGemm::kHalfN;
  if constexpr (numerics::w1_rows(kAct, QuantScheme::kBlock128) == numerics::W1Rows::kBlockPairs) {
    // Output group nt: gate in half 0, up in half 1.
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[0][i] = activation_value<float, DeviceMath>(kAct, acc[0][i], acc[1][i], kUnused);
    block_gemm_quant_group(acc[0], lane, r0, m, warp_row0, stage, act_row0, f.I, nt * kHalfN, f);
  } else {
    // Output groups 2 nt and 2 nt + 1 (the second past I when I = 128 mod 256).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col0 = (2 * nt + h) * kHalfN;
      if (col0 >= f.I) continue;
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = activation_value<float, DeviceMath>(kAct, acc[h][i], 0.0f, kUnused);
      block_gemm_quant_group(acc[h], lane, r0, m, warp_row0, stage, act_row0, f.I, col0, f);
    }
  }
}

// Item `item` of the kernel's table: a BlockGemmItem (its slots: its tiles), or, clustered
// (kCluster > 1), CTA `rank`'s part of the cluster's (block_gemm_cluster_item).
template <int kCluster>
__device__ __forceinline__ BlockGemmClusterItem block_gemm_kernel_item(const int* tile_start, const int* shapes,
                                                                       int groups, int n_tiles, int item, int rank) {
  if constexpr (kCluster == 1) {
    const BlockGemmItem it = block_gemm_item(tile_start, shapes, groups, n_tiles, item);
    return {it, false, it.tiles};
  } else {
    const int g = block_gemm_group_of(tile_start, groups, item);
    return block_gemm_cluster_item(g, shapes[3 * g], n_tiles, item - tile_start[g], rank);
  }
}

// Hands a stage back `times` times (once a consumer warp, or for it): to this CTA's producer, or,
// clustered, to every CTA's of the cluster (each one's multicast writes into every CTA's stage).
template <int kCluster>
__device__ __forceinline__ void block_gemm_release(std::uint64_t* empty, int times) {
  for (int t = 0; t < times; ++t) {
    if constexpr (kCluster == 1) {
      cutlass::arch::ClusterBarrier::arrive(empty);
    } else {
#pragma unroll
      for (int c = 0; c < kCluster; ++c) cutlass::arch::ClusterBarrier::arrive(empty, c, 1u);
    }
  }
}

// kAct: the fused W1's activation (its epilogue's only one); unused without kFused. kCluster: CTAs a
// cluster, sharing each weight tile (tma_b_share: 256 / kCluster rows a box, multicast); 1 plain.
template <bool kFused, Activation kAct, int kCluster>
__global__ void __launch_bounds__(BlockGemm::kThreads, 1)
    block_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_a64,
                      const __grid_constant__ CUtensorMap tma_b, const __grid_constant__ CUtensorMap tma_b_share,
                      const __grid_constant__ CUtensorMap tma_d, const __grid_constant__ CUtensorMap tma_d64,
                      const BlockGemm::Params p) {
  pdl_wait();  // cuda/pdl.cuh: before any global memory access (the tile table reads the shapes)
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using BG = BlockGemm;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ std::uint8_t smem_raw[];
  auto& s = *reinterpret_cast<BG::Smem*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  const int n_tiles = (p.n + BG::kTileN - 1) / BG::kTileN;

  // --- the tile table (warp 0) and the barriers (thread 0) ---
  static_assert(kCluster == 1 || kCluster == kBlockCluster, "block_gemm_cluster_item deals clusters of 2 CTAs");
  const int rank = kCluster == 1 ? 0 : static_cast<int>(cute::block_rank_in_cluster());
  const int first_item = static_cast<int>(blockIdx.x) / kCluster, items_stride = static_cast<int>(gridDim.x) / kCluster;
  block_gemm_setup<BG::kStages, BG::kConsumerWarps * kCluster>(s.tile_start, s.full, s.empty, p.groups, [&](int g) {
    if constexpr (kCluster == 1)
      return block_gemm_items_of(p.args.shapes[3 * g], n_tiles);
    else
      return block_gemm_cluster_items_of(p.args.shapes[3 * g], n_tiles);
  });
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterBarrier::init(&s.staged, BG::kConsumerWarps);
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (kCluster == 1)
    __syncthreads();
  else
    cute::cluster_sync();  // every CTA's barriers are initialized before a multicast or remote arrival
  const int total = s.tile_start[p.groups];
  const int warp_group = static_cast<int>(threadIdx.x) / 128;

  if (warp_group == 0) {
    // --- producer: one thread streams k-blocks by TMA ---
    cutlass::arch::warpgroup_reg_dealloc<BG::kProducerRegs>();
    if (threadIdx.x == 32 && p.tma_store) {
      // --- storer: the TMA stores of D (block_gemm_tma_rows), in item order ---
      int ring = 0;
      std::uint32_t staged_phase = 0;
      for (int item = first_item; item < total; item += items_stride) {
        const BlockGemmClusterItem ci =
            block_gemm_kernel_item<kCluster>(s.tile_start, p.args.shapes, p.groups, n_tiles, item, rank);
        const BlockGemmItem& it = ci.it;
        ring += ci.slots * p.k_blocks;  // its own k-blocks last (pad slots first)
        const int tma_rows = block_gemm_tma_rows(p, it, p.args.shapes[3 * it.g]);
        if (tma_rows == 0) continue;
        const int s_last = ring_slot<BG::kStages>(ring - 1).stage, s_prev = ring_slot<BG::kStages>(ring - 2).stage;
        const int row = block_gemm_token_row(p, it);
        Barrier::wait(&s.staged, staged_phase);
        staged_phase ^= 1u;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int col = it.nt * BG::kTileN + q * 64;
          if (col < p.n)
            cute::SM90_TMA_STORE_2D::copy(tma_rows == BG::kTileM ? &tma_d : &tma_d64,
                                          block_gemm_quarter(s, s_last, s_prev, q), col, row);
        }
        cute::tma_store_arrive();
        cute::tma_store_wait<0>();  // the boxes are read: the stages are free
        block_gemm_release<kCluster>(&s.empty[s_prev], BG::kConsumerWarps);
        block_gemm_release<kCluster>(&s.empty[s_last], BG::kConsumerWarps);
      }
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // written before the CTA exits
      return;
    }
    if (threadIdx.x != 0) return;
    constexpr auto kHint = static_cast<std::uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
    int stage = 0;
    std::uint32_t phase = 0;
    const auto next_stage = [&] {
      if (++stage == BG::kStages) {
        stage = 0;
        phase ^= 1;
      }
    };
    for (int item = first_item; item < total; item += items_stride) {
      const BlockGemmClusterItem ci =
          block_gemm_kernel_item<kCluster>(s.tile_start, p.args.shapes, p.groups, n_tiles, item, rank);
      const BlockGemmItem& it = ci.it;
      if constexpr (kCluster > 1) {
        // Pad slots (the partner's item is longer): a stage that carries nothing, handed over empty.
#pragma unroll 1
        for (int j = it.tiles * p.k_blocks; j < ci.slots * p.k_blocks; ++j) {
          Barrier::wait(&s.empty[stage], phase ^ 1);
          Barrier::arrive(&s.full[stage]);
          next_stage();
        }
        if (it.tiles == 0) continue;
      }
      if (ci.shared) {
        // Shared: this CTA's A and half the weight tile, multicast into both CTAs (each expects the
        // whole tile).
        constexpr int kShareRows = BG::kTileN / kCluster, kShareBytes = kShareRows * BG::kTileK;
        constexpr auto kAll = static_cast<std::uint16_t>((1u << kCluster) - 1);
        const int a_row = block_gemm_token_row(p, it);
        const auto b_row = static_cast<int>((static_cast<const std::uint8_t*>(p.args.ptr_B[it.g]) - p.b_base) / p.k) +
                           it.nt * BG::kTileN + rank * kShareRows;
#pragma unroll 1
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          const int col = kb * BG::kTileK;
          Barrier::wait(&s.empty[stage], phase ^ 1);
          TxBarrier::arrive_and_expect_tx(&s.full[stage], BG::kABytes + BG::kBBytes);
          cute::SM90_TMA_LOAD_2D::copy(&tma_a, &s.full[stage], kHint, s.a[stage], col, a_row);
          cute::SM90_TMA_LOAD_MULTICAST_2D::copy(&tma_b_share, &s.full[stage], kAll, kHint,
                                                 s.b[stage] + rank * kShareBytes, col, b_row);
          next_stage();
        }
        continue;
      }
      const bool half = it.half;
      const int a_row = block_gemm_token_row(p, it);
      const auto b_row = static_cast<int>((static_cast<const std::uint8_t*>(p.args.ptr_B[it.g]) - p.b_base) / p.k) +
                         it.nt * BG::kTileN;
      // A half pair's stages alternate between its weight tiles: k-block kb of nt, then of nt + 1
      // (one loop over both: the producer's 24 registers spilled with two).
      const CUtensorMap* map_a = half ? &tma_a64 : &tma_a;
      const int bytes = (half ? BG::kHalfABytes : BG::kABytes) + BG::kBBytes, pair = it.tiles - 1;
#pragma unroll 1
      for (int j = 0; j < p.k_blocks << pair; ++j) {
        const int kb = j >> pair, col = kb * BG::kTileK;
        Barrier::wait(&s.empty[stage], phase ^ 1);
        TxBarrier::arrive_and_expect_tx(&s.full[stage], bytes);
        cute::SM90_TMA_LOAD_2D::copy(map_a, &s.full[stage], kHint, s.a[stage], col, a_row);
        cute::SM90_TMA_LOAD_2D::copy(&tma_b, &s.full[stage], kHint, s.b[stage], col, b_row + (j & pair) * BG::kTileN);
        next_stage();
      }
    }
    if constexpr (kCluster > 1) {
      // The CTA stays until every CTA of the cluster has handed back each stage (their arrivals land
      // in this CTA's barriers): a wait on each stage's last phase.
      for (int i = 0; i < BG::kStages; ++i) {
        Barrier::wait(&s.empty[stage], phase ^ 1);
        next_stage();
      }
    }
    return;
  }

  // --- consumers: 64 token rows x 256 columns each ---
  cutlass::arch::warpgroup_reg_alloc<BG::kConsumerRegs>();
  const int wg = __shfl_sync(0xFFFFFFFFu, warp_group - 1, 0);  // warp-uniform to the compiler
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int n_blocks = (p.n + BG::kHalfN - 1) / BG::kHalfN;
  // The ring's position: ring, the k-blocks the ring has carried before the item (ring_slot), each
  // tile's start from it.
  int ring = 0, stage = 0;
  std::uint32_t phase = 0;
  float acc[2][64];
  float tmp[64];
  const std::uint32_t a_desc_base = block_gemm_desc_lo(s.a[0]), b_desc0 = block_gemm_desc_lo(s.b[0]);
  for (int item = first_item; item < total; item += items_stride) {
    const BlockGemmClusterItem ci =
        block_gemm_kernel_item<kCluster>(s.tile_start, p.args.shapes, p.groups, n_tiles, item, rank);
    const BlockGemmItem& it = ci.it;
    const int m = p.args.shapes[3 * it.g];
    // A full tile: the warpgroup's 64 rows of it, every stage. A half pair: warpgroup wg runs the
    // half tile of weight tile nt + wg alone (the tile's 64 rows) on the item's stages wg, wg + 2,
    // ..., and hands each back for both warpgroups (step = 2 arrivals a warp). A lone half tile
    // (tiles = 1): warpgroup 1 only waits for each of its stages and hands it back.
    const bool half = __shfl_sync(0xFFFFFFFFu, static_cast<int>(it.half), 0) != 0;
    // Clustered, the item's pad slots come first (block_gemm_cluster_item): each waited for and handed back.
    const int pad = (ci.slots - it.tiles) * p.k_blocks;
    const int base = ring + pad, first = base + (half ? wg : 0), step = half ? it.tiles : 1;
    const bool by_tma = !kFused && block_gemm_tma_rows(p, it, m) > 0;  // its last two stages kept
    const auto pass = [&](int from, int to) {
      for (int q = from; q < to; ++q) {
        const auto [q_stage, q_phase] = ring_slot<BG::kStages>(q);
        TxBarrier::wait(&s.full[q_stage], q_phase);
        __syncwarp();
        if (lane == 0) block_gemm_release<kCluster>(&s.empty[q_stage], 1);
      }
    };
    pass(ring, base);
    ring += ci.slots * p.k_blocks;
    if (it.tiles == 0) continue;
    if (half && wg >= it.tiles) {
      pass(base, base + p.k_blocks);
      continue;
    }
    const int nt = it.nt + (half ? wg : 0);
    const int row0 = it.mt * BG::kTileM + (half ? 0 : wg * 64);  // the warpgroup's first row of the group
    const int r0 = row0 + warp * 16 + lane / 4;                  // and r0 + 8
    const std::uint32_t a_desc0 = a_desc_base + (half ? 0 : wg * (64 * BG::kTileK >> 4));
    // Scales of rows past the group: its last row's (finite; those rows are never written).
    // The four scale streams advance one float a k-block: pointers stepped in the loop, not rebuilt
    // from 64-bit offsets each k-block (NOTES: rebuilt, one offset spilled and was reloaded from local
    // memory every k-block in the clustered build).
    const float* sa0 = p.args.ptr_col[it.g] + static_cast<std::int64_t>(min(r0, m - 1)) * p.k_blocks;
    const float* sa1 = p.args.ptr_col[it.g] + static_cast<std::int64_t>(min(r0 + 8, m - 1)) * p.k_blocks;
    const float* sb0 = p.args.ptr_row[it.g] + static_cast<std::int64_t>(min(2 * nt, n_blocks - 1)) * p.k_blocks;
    const float* sb1 = p.args.ptr_row[it.g] + static_cast<std::int64_t>(min(2 * nt + 1, n_blocks - 1)) * p.k_blocks;
    const RingSlot slot = ring_slot<BG::kStages>(first);
    stage = slot.stage;
    phase = slot.phase;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[0][i] = acc[1][i] = 0.0f;
    float na0 = __ldg(sa0), na1 = __ldg(sa1), nb0 = __ldg(sb0), nb1 = __ldg(sb1);
    // NOTES: the promotion is this loop's main cost (docs/PERF.md: against a build whose MMAs
    // accumulate unscaled). 64-column quarters in two sets of 32 temporaries, each issued before the
    // previous one is promoted, measured no faster; a wgmma left in flight across this loop's back
    // edge makes ptxas serialize every wgmma of the kernel (C7514).
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      const float a0 = na0, a1 = na1, b0 = nb0, b1 = nb1;
      if (kb + 1 < p.k_blocks) {  // the next k-block's scales load under this one's MMAs
        na0 = __ldg(++sa0);
        na1 = __ldg(++sa1);
        nb0 = __ldg(++sb0);
        nb1 = __ldg(++sb1);
      }
      TxBarrier::wait(&s.full[stage], phase);
      // NOTES: ptxas builds these descriptors in vector registers and moves them to uniform ones for
      // every wgmma (32 R2UR a k-block). Built uniform (shuffled from lane 0) measured no better
      // with half pairs (docs/PERF.md).
      const std::uint32_t da = a_desc0 + stage * (BG::kABytes >> 4);
      const std::uint32_t db0 = b_desc0 + stage * (BG::kBBytes >> 4);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::uint32_t db = db0 + h * (BG::kHalfN * BG::kTileK >> 4);
#pragma unroll
        for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(tmp[i]);
        cute::warpgroup_arrive();
#pragma unroll
        for (int ks = 0; ks < BG::kTileK / 32; ++ks)
          block_gemm_wgmma(block_gemm_desc(da + 2 * ks), block_gemm_desc(db + 2 * ks), tmp, ks > 0,
                           std::make_integer_sequence<int, 64>{});
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
#pragma unroll
        for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(tmp[i]);
        if (h == 1) {  // the stage is read: hand it back to the producer (for both warpgroups in a half pair)
          __syncwarp();
          if (lane == 0 && !(by_tma && kb >= p.k_blocks - 2)) block_gemm_release<kCluster>(&s.empty[stage], step);
        }
        const float sb = h == 0 ? b0 : b1;
        const float s0 = a0 * sb, s1 = a1 * sb;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          acc[h][4 * i] += tmp[4 * i] * s0;
          acc[h][4 * i + 1] += tmp[4 * i + 1] * s0;
          acc[h][4 * i + 2] += tmp[4 * i + 2] * s1;
          acc[h][4 * i + 3] += tmp[4 * i + 3] * s1;
        }
      }
      stage += step;  // step <= 2 < kStages: one wrap at most
      if (stage >= BG::kStages) {
        stage -= BG::kStages;
        phase ^= 1u;
      }
    }

    if (by_tma) {
      // --- epilogue by TMA: the rows staged in the tile's last two stages, the storer writes them ---
      const int s_last = ring_slot<BG::kStages>(base + p.k_blocks - 1).stage;
      const int s_prev = ring_slot<BG::kStages>(base + p.k_blocks - 2).stage;
      asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' wgmmas have read the stages
      // 65-127 rows: the first warpgroup's 64 go by TMA, the second's by the regular epilogue below.
      const bool partial = m - it.mt * BG::kTileM < BG::kTileM;
      if (!partial || wg == 0) {
        // Row rt of the tile (and rt + 8; rt % 8 = lane / 4): 16-byte chunk c of a 128-byte box row at
        // chunk c ^ (row % 8), the 128-byte swizzle; a thread's 4 bytes at 4 (lane % 4) in it.
        // NOTES: the offsets are built here, per item (the empty asm keeps ptxas from hoisting the 8
        // swizzled offsets out of the item loop, where they spilled into the k-loop).
        int x16 = 16 * (lane / 4), off = (wg * 64 + warp * 16 + lane / 4) * 128 + 4 * (lane % 4);
        asm volatile("" : "+r"(x16), "+r"(off));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            std::uint8_t* box = block_gemm_quarter(s, s_last, s_prev, 2 * h + i / 8) + (off ^ (16 * (i % 8)) ^ x16);
            *reinterpret_cast<__nv_bfloat162*>(box) = __floats2bfloat162_rn(acc[h][4 * i], acc[h][4 * i + 1]);
            *reinterpret_cast<__nv_bfloat162*>(box + 8 * 128) =
                __floats2bfloat162_rn(acc[h][4 * i + 2], acc[h][4 * i + 3]);
          }
        }
        cute::tma_store_fence();  // the staged rows are visible to TMA
      }
      __syncwarp();
      if (lane == 0) Barrier::arrive(&s.staged);
      if (!partial || wg == 0) continue;
    }

    // --- epilogue: the warp's 16 rows (warp_row0 of the group on), staged, whole rows written ---
    const int warp_row0 = row0 + warp * 16;
    if (warp_row0 >= m) continue;                 // the warp's rows are all past the group
    std::uint8_t* staged = s.out[wg * 4 + warp];  // the warp's rows in shared memory
    if constexpr (kFused) {
      const GroupedGemmLaunch::FusedW1& f = p.fused;
      const std::int64_t act_row0 =
          f.row_offsets != nullptr ? f.row_offsets[it.g] : static_cast<std::int64_t>(it.g) * f.M;
      block_gemm_fused_epilogue<kAct>(acc, lane, r0, m, warp_row0, staged, act_row0, nt, f);
    } else {
      // bf16 D a quarter tile (64 columns = 128 bytes a row) at a time; n % 128 == 0 (n_multiple).
      auto* D = static_cast<std::uint8_t*>(p.args.ptr_D[it.g]);
      const std::int64_t ld_bytes = 2 * p.args.stride_D[it.g];
      std::uint8_t* out0 = staged + (lane / 4) * BG::kStageRowBytes + 4 * (lane % 4);
      std::uint8_t* out1 = out0 + 8 * BG::kStageRowBytes;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int col0 = nt * BG::kTileN + h * BG::kHalfN + q * 64;
          if (col0 >= p.n) continue;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int i = 8 * q + j;
            *reinterpret_cast<__nv_bfloat162*>(out0 + 16 * j) = __floats2bfloat162_rn(acc[h][4 * i], acc[h][4 * i + 1]);
            *reinterpret_cast<__nv_bfloat162*>(out1 + 16 * j) =
                __floats2bfloat162_rn(acc[h][4 * i + 2], acc[h][4 * i + 3]);
          }
          block_gemm_flush(staged, lane, D + warp_row0 * ld_bytes + 2 * col0, ld_bytes, min(m - warp_row0, 16));
        }
      }
    }
  }
#endif
}

// cuTensorMapEncodeTiled through the runtime (no -lcuda): fetched once.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query{};
    MOEKIT_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &query));
    MOEKIT_CUDA_REQUIRE(query == cudaDriverEntryPointSuccess && fn != nullptr,
                        "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs driver >= 12.0)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A row-major FP8 (rows x k) tensor as TMA boxes of box_rows x 128 bytes, 128-byte swizzled.
inline CUtensorMap block_gemm_tensor_map(const void* base, std::int64_t rows, std::int64_t k, int box_rows,
                                         const char* what) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(BlockGemm::kTileK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box,
                           elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOEKIT_CUDA_REQUIRE(r == CUDA_SUCCESS, std::string("block GEMM: cuTensorMapEncodeTiled failed for ") + what + " (" +
                                             std::to_string(rows) + " x " + std::to_string(k) + " FP8, error " +
                                             std::to_string(static_cast<int>(r)) +
                                             "): the base must be 16-byte aligned and k a multiple of 16");
  return map;
}

// D (rows x n bf16, row-major) as TMA store boxes of box_rows x 64 columns (128 bytes), 128-byte
// swizzled: the D quarters of block_gemm_tma_rows.
inline CUtensorMap block_gemm_output_map(void* base, std::int64_t rows, std::int64_t n, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(2 * n)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box,
                                          elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOEKIT_CUDA_REQUIRE(r == CUDA_SUCCESS, "block GEMM: cuTensorMapEncodeTiled failed for D (" + std::to_string(rows) +
                                             " x " + std::to_string(n) + " bf16, error " +
                                             std::to_string(static_cast<int>(r)) +
                                             "): the base must be 16-byte aligned and n a multiple of 8");
  return map;
}

// What every moekit block-GEMM launch needs of the launch: at most max_groups groups (the tile
// table lives in shared memory) and the tensors the groups lie in (one TMA descriptor each).
inline void block_gemm_require_tensors(const GroupedGemmLaunch& l, std::string_view name, int max_groups) {
  MOEKIT_CUDA_REQUIRE(l.groups >= 1 && l.groups <= max_groups, std::string(name) + ": " + std::to_string(l.groups) +
                                                                   " groups, at most " + std::to_string(max_groups) +
                                                                   " (its tile table is in shared memory)");
  MOEKIT_CUDA_REQUIRE(l.tensors.tokens != nullptr && l.tensors.weights != nullptr && l.tensors.token_rows > 0 &&
                          l.tensors.weight_rows > 0 && l.tensors.token_rows < (std::int64_t{1} << 31) &&
                          l.tensors.weight_rows < (std::int64_t{1} << 31),
                      std::string(name) +
                          ": moekit's own main loop needs the tensors the groups lie in "
                          "(GroupedGemmLaunch::tensors, fewer than 2^31 rows each)");
}

// The kernels' bodies exist for sm_90a only (wgmma, TMA, setmaxnreg): elsewhere they would do nothing.
// Checked once per device (launch_cache.h): a device's architecture does not change.
inline void block_gemm_require_sm90(std::string_view name, int device) {
  static std::atomic<std::uint64_t> checked{0};
  once_per_device(checked, device, [&] {
    int major = 0, minor = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    MOEKIT_CUDA_REQUIRE(major == 9 && minor == 0, std::string(name) +
                                                      ": moekit's block GEMM runs on Hopper (sm_90a); device " +
                                                      std::to_string(device) + " is sm_" + std::to_string(major) +
                                                      std::to_string(minor) + ": force a CUTLASS config");
  });
}
inline void block_gemm_require_sm90(std::string_view name) {
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  block_gemm_require_sm90(name, device);
}

// The kernels' parameters from the launch (no fused W1).
inline BlockGemm::Params block_gemm_params(const GroupedGemmLaunch& l) {
  BlockGemm::Params p;
  p.args = GroupedGemmArrays::at(l.args, l.groups);
  p.groups = l.groups;
  p.n = static_cast<int>(l.n);
  p.k = static_cast<int>(l.k);
  p.k_blocks = static_cast<int>((l.k + BlockGemm::kTileK - 1) / BlockGemm::kTileK);
  p.a_base = static_cast<const std::uint8_t*>(l.tensors.tokens);
  p.b_base = static_cast<const std::uint8_t*>(l.tensors.weights);
  return p;
}

// What a block-GEMM launch binds (launch_cache.h): the five TMA descriptors, from the tensors the
// groups lie in and the GEMM's n and k (the step's rows and offsets are read on the device).
struct BlockGemmMapsKey {
  const void* tokens;
  const void* weights;
  const void* output;
  std::int64_t token_rows, weight_rows, n, k;
};
struct BlockGemmMaps {
  CUtensorMap a, a64, b, b_share, d, d64;  // b_share: half a weight tile a box (a 2-CTA cluster's share)
  bool tma_store;                          // BlockGemm::Params::tma_store
};

// The descriptors of a launch, encoded on its key's first launch (a few us of host work each).
template <bool kFused>
const BlockGemmMaps& block_gemm_maps(const GroupedGemmLaunch& l) {
  using BG = BlockGemm;
  thread_local BoundCache<BlockGemmMapsKey, BlockGemmMaps> cache;
  const GroupedGemmLaunch::Tensors& t = l.tensors;
  const BlockGemmMapsKey key{t.tokens, t.weights, t.output, t.token_rows, t.weight_rows, l.n, l.k};
  if (const BlockGemmMaps* bound = cache.find(key)) return *bound;
  BlockGemmMaps m;
  m.a = block_gemm_tensor_map(t.tokens, t.token_rows, l.k, BG::kTileM, "the tokens");
  m.a64 = block_gemm_tensor_map(t.tokens, t.token_rows, l.k, BG::kHalfTileRows, "the tokens");
  m.b = block_gemm_tensor_map(t.weights, t.weight_rows, l.k, BG::kTileN, "the weights");
  m.b_share = block_gemm_tensor_map(t.weights, t.weight_rows, l.k, BG::kTileN / 2, "the weights");
  // D by TMA (block_gemm_tma_rows) when the launch names D's tensor; MOEKIT_BLOCK_TMA_STORE=0 writes
  // every tile by the regular epilogue (an A/B switch for benchmarks, tools/ab-env.sh).
  static const bool tma_store_allowed = [] {
    const char* v = std::getenv("MOEKIT_BLOCK_TMA_STORE");
    return !(v != nullptr && std::string_view(v) == "0");
  }();
  const std::int64_t k_blocks = (l.k + BG::kTileK - 1) / BG::kTileK;
  m.tma_store = !kFused && tma_store_allowed && t.output != nullptr && k_blocks >= BG::kMinKBlocksForTmaStore;
  m.d = m.tma_store ? block_gemm_output_map(t.output, t.token_rows, l.n, BG::kTileM) : m.b;
  m.d64 = m.tma_store ? block_gemm_output_map(t.output, t.token_rows, l.n, BG::kHalfTileRows) : m.b;
  return cache.bind(key, m);
}

// The dynamic shared memory of a kernel, set once per device (launch_cache.h).
template <bool kFused, Activation kAct, int kCluster>
void block_gemm_set_smem(int device) {
  static std::atomic<std::uint64_t> done{0};
  once_per_device(done, device, [] {
    MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(block_gemm_kernel<kFused, kAct, kCluster>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, BlockGemm::kSmemBytes));
  });
}

// The clusters of 2 the device holds at once with one kernel an SM (a GPC with an odd count of SMs
// leaves one out): the clustered grid is twice that, so every cluster is resident and the static
// round-robin of items has no second wave. Asked once per device while the launch cache is on (at
// most 64 devices: launch_cache.h).
template <bool kFused, Activation kAct>
int block_gemm_cluster_grid(int device, int num_sms) {
  static std::atomic<int> clusters[64] = {};
  const bool cached = launch_cache_enabled() && device >= 0 && device < 64;
  int n = cached ? clusters[device].load(std::memory_order_acquire) : 0;
  if (n == 0) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kBlockCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    int sms = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    config.gridDim = dim3(sms / kBlockCluster * kBlockCluster);
    config.blockDim = dim3(BlockGemm::kThreads);
    config.dynamicSmemBytes = BlockGemm::kSmemBytes;
    config.attrs = attr;
    config.numAttrs = 1;
    MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, block_gemm_kernel<kFused, kAct, kBlockCluster>, &config));
    n = std::max(n, 0) + 1;  // stored + 1: 0 is "not asked yet"
    if (cached) clusters[device].store(n, std::memory_order_release);
  }
  return std::min((n - 1) * kBlockCluster, num_sms / kBlockCluster * kBlockCluster);
}

// The launch of a config row whose main loop is moekit's (its tile is this kernel's: checked).
template <plan::GemmConfig kConfig>
void run_block_gemm(const GroupedGemmLaunch& l, cudaStream_t stream) {
  using BG = BlockGemm;
  static constexpr plan::GemmConfigInfo info = plan::gemm_config_info(kConfig);
  static constexpr bool kFused = info.fused_w1;
  static_assert(info.main_loop == plan::GemmMainLoop::kMoekit && !info.swap_ab && info.tile_m == BG::kTileM &&
                    info.tile_n == BG::kTileN && info.tile_k == BG::kTileK && info.n_multiple % BG::kHalfN == 0,
                "the config row does not describe moekit's block GEMM (plan/gemm_config.h)");
  static_assert(info.cluster == 1 || info.cluster == kBlockCluster, "block_gemm_cluster_item deals clusters of 2");
  const auto name = [] { return "grouped_fp8_gemm: config " + std::string(info.name); };
  MOEKIT_CUDA_REQUIRE(l.block_scaled && plan::supports(info, l.n, l.k, QuantScheme::kBlock128, kFused),
                      name() + " does not run n = " + std::to_string(l.n) + ", k = " + std::to_string(l.k) +
                          " (see plan/gemm_config.h)");
  block_gemm_require_tensors(l, info.name, BG::kMaxGroups);
  if constexpr (kFused)
    MOEKIT_CUDA_REQUIRE(l.fused.act_q != nullptr && l.fused.act_scale != nullptr && l.fused.I > 0 &&
                            l.fused.I % static_cast<int>(kQuantBlock) == 0 &&
                            l.fused.activation != Activation::kSwigluOai,
                        name() + " (fused W1): act_q, act_scale, I = " + std::to_string(l.fused.I) +
                            " (a multiple of 128) and an activation whose W1 rows pair whole groups (not "
                            "swigluoai) are needed");
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  block_gemm_require_sm90(info.name, device);
  BG::Params p = block_gemm_params(l);
  if constexpr (kFused) p.fused = l.fused;
  const BlockGemmMaps& maps = block_gemm_maps<kFused>(l);
  p.tma_store = maps.tma_store;
  // The row's cluster (plan/gemm_config.h); MOEKIT_BLOCK_CLUSTER=1 runs it unclustered (an A/B switch
  // for benchmarks, tools/ab-env.sh).
  static const int cluster = [] {
    const char* v = std::getenv("MOEKIT_BLOCK_CLUSTER");
    return v != nullptr && std::string_view(v) == "1" ? 1 : info.cluster;
  }();
  const auto launch = [&]<Activation kAct>() {
    int grid = 0;  // clustered: twice the clusters the device holds at once
    if (cluster == kBlockCluster) {
      block_gemm_set_smem<kFused, kAct, kBlockCluster>(device);
      grid = block_gemm_cluster_grid<kFused, kAct>(device, l.num_sms);
    }
    if (grid > 0) {
      launch_pdl_clustered(block_gemm_kernel<kFused, kAct, kBlockCluster>, dim3(grid), BG::kThreads, BG::kSmemBytes,
                           stream, kBlockCluster, maps.a, maps.a64, maps.b, maps.b_share, maps.d, maps.d64, p);
    } else {
      block_gemm_set_smem<kFused, kAct, 1>(device);
      launch_pdl(block_gemm_kernel<kFused, kAct, 1>, l.num_sms, BG::kThreads, BG::kSmemBytes, stream, maps.a, maps.a64,
                 maps.b, maps.b_share, maps.d, maps.d64, p);
    }
    MOEKIT_CUDA_CHECK_LAUNCH();
  };
  if constexpr (kFused) {
    // One kernel an activation (see the top); swigluoai was refused above.
    numerics::with_activation(l.fused.activation, [&]<Activation kAct>() {
      if constexpr (kAct != Activation::kSwigluOai) launch.template operator()<kAct>();
    });
  } else {
    launch.template operator()<Activation::kSilu>();  // (the activation is unused)
  }
}

#endif  // __CUDACC__

}  // namespace moekit::cuda::detail
