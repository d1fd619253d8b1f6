// moekit's own block-scaled grouped FP8 GEMM for small m_e, swapped (sm_90a): the weights on the
// kernel's 128-row side, the tokens on its kTN = 32 or 64 columns, so a tile of an expert with m_e
// <= kTN rows does no MMA on padding and reads each weight byte once:
//   D[g]^T (n x m_g) = sum_kb (W_kb . A_kb^T) * sb[row / 128][kb] * sa[col][kb], written as D[g]
//   (m_g x n) row-major, the same memory contract as every config (grouped_gemm.h).
// A tile's 128 weight rows are one 128x128 weight block, so its weight scale is one number a
// k-block; the token scales are one per column. At small m_e the GEMM is memory-bound: the weights
// stream once (bench_weight_stream: TMA alone reaches the read ceiling with 4+ stages), and the
// consumers' work a k-block (4 wgmma m64 x kTN x 32 a warpgroup, the wait, kTN / 2 promotion FMAs a
// thread) is a fraction of a k-block's 16 KB arrival time, so a deep ring keeps the loads in flight.
// Structure as block_gemm_sm90.cuh: one CTA per SM, a producer thread streaming the weight box
// (128 x 128 B) and the token box (kTN x 128 B) of each k-block into a ring, two consumer warpgroups
// of 64 weight rows each. Epilogue: each warpgroup stages its 64 output columns (128 bytes of every
// token row) in shared memory and writes whole 128-byte rows; token rows past the group are never
// written. The tokens of one weight tile adjacent in the tile order (an expert's token tiles share
// the weight tile through L2).
// Measured (H200, DeepSeek-V3, E_local = 16, each GEMM replayed alone; docs/PERF.md): 3-14% behind
// CUTLASS's swapab configs, whose W1 is already near TMA's streaming rate; so opt-in. The consumers'
// per-k-block scalar work (the scale ring below) is what is left to take out.
#pragma once

#include "cuda/block_gemm_sm90.cuh"

namespace moekit::cuda::detail {

template <int kTN>
struct BlockGemmSwap {
  static_assert(kTN == 32 || kTN == 64, "swapped tiles of 32 or 64 tokens");
  static constexpr int kTileM = 128, kTileK = static_cast<int>(kQuantBlock);
  static constexpr int kStages = kTN == 64 ? 8 : 10;  // the ring's bytes in flight (~190 KB)
  static constexpr int kThreads = 384;
  static constexpr int kMaxGroups = 1024;
  static constexpr int kABytes = kTileM * kTileK;  // weights
  static constexpr int kBBytes = kTN * kTileK;     // tokens
  static constexpr int kConsumerWarps = 8;
  static constexpr int kAcc = kTN / 2;  // fp32 accumulators a thread (64 rows x kTN per warpgroup)
  static constexpr int kStageRowBytes = 128 + 16;
  // The scales a k-block needs (kTN token scales, the weight block's), copied kScaleAhead k-blocks
  // ahead into a ring of kScaleSlots per consumer warp.
  static constexpr int kScaleAhead = 3, kScaleSlots = kScaleAhead + 1, kScaleSlot = kTN + 4;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;

  struct alignas(1024) Smem {
    std::uint8_t a[kStages][kABytes];
    std::uint8_t b[kStages][kBBytes];
    std::uint64_t full[kStages];
    std::uint64_t empty[kStages];
    int tile_start[kMaxGroups + 1];
    alignas(16) std::uint8_t out[2][kTN * kStageRowBytes];  // each warpgroup's kTN token rows x 64 columns
    float scales[kConsumerWarps][kScaleSlots][kScaleSlot];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "BlockGemmSwap's stages exceed Hopper's 227 KB of shared memory a CTA");
  static_assert(kBBytes % 1024 == 0, "every token stage 1024-byte aligned (the wgmma descriptors' base)");
};

#if defined(__CUDACC__)

// A 4-byte asynchronous copy global -> shared (cp.async; completes with the thread's wait_group).
__device__ __forceinline__ void block_gemm_cp_async4(float* dst, const float* src) {
  const auto d = static_cast<std::uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}

template <int kTN, int... kI>
__device__ __forceinline__ void block_gemm_swap_wgmma(std::uint64_t da, std::uint64_t db, float (&d)[kTN / 2],
                                                      bool accumulate, std::integer_sequence<int, kI...>) {
  const auto scale = accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero;
  if constexpr (kTN == 64)
    cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>::fma(da, db, d[kI]..., scale);
  else
    cute::SM90::GMMA::MMA_64x32x32_F32E4M3E4M3_SS_TN<>::fma(da, db, d[kI]..., scale);
}

// The tile's group, weight tile (mt) and token tile (nt): token tiles of one weight tile adjacent.
template <int kTN>
__device__ __forceinline__ BlockGemmTile block_gemm_swap_locate(const int* tile_start, const int* shapes, int groups,
                                                                int tile) {
  const int lo = block_gemm_group_of(tile_start, groups, tile);
  const int local = tile - tile_start[lo];
  const int token_tiles = (shapes[3 * lo + 1] + kTN - 1) / kTN;
  return {lo, local / token_tiles, local % token_tiles};
}

template <int kTN>
__global__ void __launch_bounds__(BlockGemmSwap<kTN>::kThreads, 1)
    block_gemm_swap_kernel(const __grid_constant__ CUtensorMap tma_w, const __grid_constant__ CUtensorMap tma_t,
                           const BlockGemm::Params p) {
  pdl_wait();  // cuda/pdl.cuh: before any global memory access
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using BG = BlockGemmSwap<kTN>;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ std::uint8_t smem_raw[];
  auto& s = *reinterpret_cast<typename BG::Smem*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) &
                                                  ~std::uintptr_t{1023});
  // Kernel problem (n, m, k) per group: shapes[3g] = n (weight rows), shapes[3g + 1] = m (tokens).
  const int weight_tiles = (p.n + BG::kTileM - 1) / BG::kTileM;

  block_gemm_setup<BG::kStages, BG::kConsumerWarps>(s.tile_start, s.full, s.empty, p.groups, [&](int g) {
    return (p.args.shapes[3 * g + 1] + kTN - 1) / kTN * weight_tiles;
  });
  __syncthreads();
  const int total = s.tile_start[p.groups];
  const int warp_group = static_cast<int>(threadIdx.x) / 128;

  if (warp_group == 0) {
    // --- producer: one thread streams each k-block's weight box and token box ---
    cutlass::arch::warpgroup_reg_dealloc<BG::kProducerRegs>();
    if (threadIdx.x != 0) return;
    constexpr auto kHint = static_cast<std::uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
    int stage = 0;
    std::uint32_t phase = 0;
    for (int tile = static_cast<int>(blockIdx.x); tile < total; tile += static_cast<int>(gridDim.x)) {
      const BlockGemmTile t = block_gemm_swap_locate<kTN>(s.tile_start, p.args.shapes, p.groups, tile);
      const auto w_row =
          static_cast<int>((static_cast<const std::uint8_t*>(p.args.ptr_A[t.g]) - p.b_base) / p.k) + t.mt * BG::kTileM;
      const auto t_row =
          static_cast<int>((static_cast<const std::uint8_t*>(p.args.ptr_B[t.g]) - p.a_base) / p.k) + t.nt * kTN;
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        Barrier::wait(&s.empty[stage], phase ^ 1);
        TxBarrier::arrive_and_expect_tx(&s.full[stage], BG::kABytes + BG::kBBytes);
        cute::SM90_TMA_LOAD_2D::copy(&tma_w, &s.full[stage], kHint, s.a[stage], kb * BG::kTileK, w_row);
        cute::SM90_TMA_LOAD_2D::copy(&tma_t, &s.full[stage], kHint, s.b[stage], kb * BG::kTileK, t_row);
        if (++stage == BG::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  // --- consumers: 64 weight rows x kTN tokens each ---
  cutlass::arch::warpgroup_reg_alloc<BG::kConsumerRegs>();
  const int wg = __shfl_sync(0xFFFFFFFFu, warp_group - 1, 0);
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid % 32;
  constexpr int kCols = kTN / 4;  // distinct token columns a thread holds: 8 i + 2 (lane % 4) + {0, 1}
  int stage = 0;
  std::uint32_t phase = 0;
  float acc[BG::kAcc];
  float tmp[BG::kAcc];
  const std::uint32_t a_desc0 = block_gemm_desc_lo(s.a[0] + wg * 64 * BG::kTileK), b_desc0 = block_gemm_desc_lo(s.b[0]);
  const int n_blocks = (p.n + BG::kTileM - 1) / BG::kTileM;
  // The scales: the weight block's (ptr_col: per 128-row block and k-block) and the token columns'
  // (ptr_row: per token and k-block); columns past the group read its last token's (finite, never
  // written out). Each warp copies a k-block's kTN token scales and its weight scale (lane L:
  // columns L and L + 32, lane 0 the weight's) into its ring in shared memory by cp.async,
  // kScaleAhead k-blocks ahead of their use, across tiles (the next tile's first k-blocks load
  // under this tile's last): no register ever waits on a load. NOTES (H200, m_e = 64): scales loaded
  // into registers one k-block ahead left the loop waiting on them (10% of its samples at a
  // register move; W1 0.157 ms against CUTLASS's 0.138); the ring restarted at each tile: W1 0.140,
  // W2 0.091 against 0.084 (each tile's first scales exposed, 16 k-blocks a W2 tile).
  float* ring = s.scales[wg * 4 + warp][0];
  struct ScaleCursor {
    int tile, kb;
    const float *sw, *st0, *st1;
  } load{static_cast<int>(blockIdx.x), 0, nullptr, nullptr, nullptr};
  auto aim = [&](ScaleCursor& c) {  // the cursor's pointers for its tile
    if (c.tile >= total) return;
    const BlockGemmTile t = block_gemm_swap_locate<kTN>(s.tile_start, p.args.shapes, p.groups, c.tile);
    const int m = p.args.shapes[3 * t.g + 1];
    c.sw = p.args.ptr_col[t.g] + static_cast<std::int64_t>(min(t.mt, n_blocks - 1)) * p.k_blocks;
    c.st0 = p.args.ptr_row[t.g] + static_cast<std::int64_t>(min(t.nt * kTN + lane, m - 1)) * p.k_blocks;
    c.st1 = p.args.ptr_row[t.g] + static_cast<std::int64_t>(min(t.nt * kTN + lane + 32, m - 1)) * p.k_blocks;
  };
  aim(load);
  std::uint32_t loaded = 0, used = 0;  // k-blocks copied into and read from the ring, over all tiles
  auto copy_scales = [&] {             // one cp.async group a call, empty past the last tile
    if (load.tile < total) {
      float* slot = ring + (loaded % BG::kScaleSlots) * BG::kScaleSlot;
      block_gemm_cp_async4(slot + lane, load.st0 + load.kb);
      if constexpr (kTN == 64) block_gemm_cp_async4(slot + lane + 32, load.st1 + load.kb);
      if (lane == 0) block_gemm_cp_async4(slot + kTN, load.sw + load.kb);
      if (++load.kb == p.k_blocks) {
        load.kb = 0;
        load.tile += static_cast<int>(gridDim.x);
        aim(load);
      }
    }
    ++loaded;
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
#pragma unroll
  for (int d = 0; d < BG::kScaleAhead; ++d) copy_scales();
  for (int tile = static_cast<int>(blockIdx.x); tile < total; tile += static_cast<int>(gridDim.x)) {
    const BlockGemmTile t = block_gemm_swap_locate<kTN>(s.tile_start, p.args.shapes, p.groups, tile);
    const int m = p.args.shapes[3 * t.g + 1];
#pragma unroll
    for (int i = 0; i < BG::kAcc; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      __syncwarp();  // every lane is done with the slot this copy refills
      copy_scales();
      asm volatile("cp.async.wait_group %0;\n" ::"n"(BG::kScaleAhead) : "memory");
      __syncwarp();  // every lane's copies of this k-block landed
      float sc[kCols];
      const float* slot = ring + (used++ % BG::kScaleSlots) * BG::kScaleSlot;
      const float w = slot[kTN];
#pragma unroll
      for (int c = 0; c < kCols; ++c) sc[c] = slot[8 * (c / 2) + 2 * (lane % 4) + (c % 2)];
      TxBarrier::wait(&s.full[stage], phase);
      const std::uint32_t da = a_desc0 + stage * (BG::kABytes >> 4);
      const std::uint32_t db = b_desc0 + stage * (BG::kBBytes >> 4);
#pragma unroll
      for (int i = 0; i < BG::kAcc; ++i) cute::warpgroup_fence_operand(tmp[i]);
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < BG::kTileK / 32; ++ks)
        block_gemm_swap_wgmma<kTN>(block_gemm_desc(da + 2 * ks), block_gemm_desc(db + 2 * ks), tmp, ks > 0,
                                   std::make_integer_sequence<int, BG::kAcc>{});
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < BG::kAcc; ++i) cute::warpgroup_fence_operand(tmp[i]);
      __syncwarp();
      if (lane == 0) Barrier::arrive(&s.empty[stage]);
#pragma unroll
      for (int c = 0; c < kCols; ++c) sc[c] *= w;
        // Accumulator i = 4 j + q: rows r0 (q < 2) and r0 + 8, column 8 j + 2 (lane % 4) + q % 2.
#pragma unroll
      for (int j = 0; j < BG::kAcc / 4; ++j) {
        acc[4 * j] += tmp[4 * j] * sc[2 * j];
        acc[4 * j + 1] += tmp[4 * j + 1] * sc[2 * j + 1];
        acc[4 * j + 2] += tmp[4 * j + 2] * sc[2 * j];
        acc[4 * j + 3] += tmp[4 * j + 3] * sc[2 * j + 1];
      }
      if (++stage == BG::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }

    // --- epilogue: the warpgroup's 64 columns of each token row (128 bytes), staged, whole rows ---
    std::uint8_t* staged = s.out[wg];
    const int r0 = warp * 16 + lane / 4;  // the thread's weight rows r0 and r0 + 8 of the warpgroup's 64
#pragma unroll
    for (int j = 0; j < BG::kAcc / 4; ++j) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int col = 8 * j + 2 * (lane % 4) + q;  // the token row of the tile
        std::uint8_t* row = staged + col * BG::kStageRowBytes;
        *reinterpret_cast<__nv_bfloat16*>(row + 2 * r0) = __float2bfloat16_rn(acc[4 * j + q]);
        *reinterpret_cast<__nv_bfloat16*>(row + 2 * (r0 + 8)) = __float2bfloat16_rn(acc[4 * j + 2 + q]);
      }
    }
    cutlass::arch::NamedBarrier::sync(128, 1 + wg);    // the warpgroup's rows are staged
    const int token0 = t.nt * kTN + warp * (kTN / 4);  // the warp writes kTN / 4 token rows
    if (token0 < m) {
      auto* D = static_cast<std::uint8_t*>(p.args.ptr_D[t.g]);
      const std::int64_t ld_bytes = 2 * p.args.stride_D[t.g];
      const int col0 = t.mt * BG::kTileM + wg * 64;
      if (col0 < p.n)
        block_gemm_flush(staged + warp * (kTN / 4) * BG::kStageRowBytes, lane, D + token0 * ld_bytes + 2 * col0,
                         ld_bytes, min(m - token0, kTN / 4));
    }
    cutlass::arch::NamedBarrier::sync(128, 1 + wg);  // the stage is free for the next tile
  }
#endif
}

// The launch of a swapped config row whose main loop is moekit's.
template <plan::GemmConfig kConfig>
void run_block_gemm_swap(const GroupedGemmLaunch& l, cudaStream_t stream) {
  static constexpr plan::GemmConfigInfo info = plan::gemm_config_info(kConfig);
  constexpr int kTN = info.tile_n;
  using BG = BlockGemmSwap<kTN>;
  static_assert(info.main_loop == plan::GemmMainLoop::kMoekit && info.swap_ab && !info.fused_w1 &&
                    info.tile_m == BG::kTileM && info.tile_k == BG::kTileK && info.n_multiple % BG::kTileM == 0,
                "the config row does not describe moekit's swapped block GEMM (plan/gemm_config.h)");
  const std::string name = "grouped_fp8_gemm: config " + std::string(info.name);
  MOEKIT_CUDA_REQUIRE(
      l.block_scaled && plan::supports(info, l.n, l.k, QuantScheme::kBlock128),
      name + " does not run n = " + std::to_string(l.n) + ", k = " + std::to_string(l.k) + " (see plan/gemm_config.h)");
  block_gemm_require_tensors(l, name, BG::kMaxGroups);
  block_gemm_require_sm90(name);
  const BlockGemm::Params p = block_gemm_params(l);
  const CUtensorMap tw =
      block_gemm_tensor_map(l.tensors.weights, l.tensors.weight_rows, l.k, BG::kTileM, "the weights");
  const CUtensorMap tt = block_gemm_tensor_map(l.tensors.tokens, l.tensors.token_rows, l.k, kTN, "the tokens");
  const auto kernel = block_gemm_swap_kernel<kTN>;
  MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, BG::kSmemBytes));
  launch_pdl(kernel, l.num_sms, BG::kThreads, BG::kSmemBytes, stream, tw, tt, p);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

#endif  // __CUDACC__

}  // namespace moekit::cuda::detail
