// moekit's own block-scaled grouped FP8 GEMM whose promotion overlaps its own warpgroup's MMAs
// (sm_90a): a 128 x 128 (tokens x weight rows) tile, one weight block, so one weight scale a
// k-block. block_gemm_sm90.cuh's warpgroups wait for each k-block's wgmmas and then promote, and
// rely on the other warpgroup to keep the tensor cores busy meanwhile; measured, that hides little
// (the promotion costs its GEMMs 22-25%: docs/PERF.md). Here a consumer warpgroup holds two sets of
// 64 temporaries (64 accumulators + 2 x 64 = 192 registers a thread) and runs its k-blocks in
// chunks of kChunk: k-block j + 1's wgmmas are issued into one set before k-block j's set is waited
// for and promoted, so the tensor cores work through the promotion of every k-block but a chunk's
// last. A chunk ends with every wgmma waited for: nothing is in flight across the loop's back edge
// (ptxas serializes every wgmma of a kernel that leaves one in flight there, C7514).
//   D[g] (m_g x n) = bf16(sum_kb (A_kb . B_kb^T) * sa[row][kb] * sb[col / 128][kb])
// Structure as block_gemm_sm90.cuh: a persistent grid of one CTA per SM, a producer thread streaming
// the A (128 x 128 B) and B (128 x 128 B) k-blocks by TMA into a ring of kStages, two consumer
// warpgroups of 64 token rows x 128 columns, the token tiles of one weight tile adjacent in the tile
// order, each warp's 16 rows staged in shared memory and written as whole 128-byte rows.
#pragma once

#include "cuda/block_gemm_sm90.cuh"

namespace moekit::cuda::detail {

struct BlockGemmPipe {
  static constexpr int kTileM = 128, kTileN = 128, kTileK = static_cast<int>(kQuantBlock);
  static constexpr int kStages = 6;
  static constexpr int kChunk = 4;  // k-blocks a chunk: all but the last promotion overlap an MMA
  static constexpr int kThreads = 384;
  static constexpr int kMaxGroups = 1024;
  static constexpr int kABytes = kTileM * kTileK;
  static constexpr int kBBytes = kTileN * kTileK;
  static constexpr int kConsumerWarps = 8;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;

  struct alignas(1024) Smem {
    std::uint8_t a[kStages][kABytes];
    std::uint8_t b[kStages][kBBytes];
    std::uint64_t full[kStages];
    std::uint64_t empty[kStages];
    int tile_start[kMaxGroups + 1];
    alignas(16) std::uint8_t out[kConsumerWarps][BlockGemm::kStageRows * BlockGemm::kStageRowBytes];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "BlockGemmPipe's stages exceed Hopper's 227 KB of shared memory a CTA");
};

#if defined(__CUDACC__)

// A consumer thread's position in the ring (stage, phase), advanced a k-block at a time.
struct BlockGemmRing {
  int stage = 0;
  std::uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == BlockGemmPipe::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// 4 wgmma m64n128k32 of one k-block into t (overwritten), committed as one group.
__device__ __forceinline__ void block_gemm_pipe_issue(std::uint32_t da, std::uint32_t db, float (&t)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(t[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < BlockGemmPipe::kTileK / 32; ++ks)
    block_gemm_wgmma(block_gemm_desc(da + 2 * ks), block_gemm_desc(db + 2 * ks), t, ks > 0,
                     std::make_integer_sequence<int, 64>{});
  cute::warpgroup_commit_batch();
}

// kN k-blocks from kb on: k-block j + 1 issued before k-block j is waited for and promoted.
template <int kN>
__device__ __forceinline__ void block_gemm_pipe_chunk(BlockGemmPipe::Smem& s, BlockGemmRing& issue, BlockGemmRing& done,
                                                      std::uint32_t a_desc0, std::uint32_t b_desc0, const float* sa0,
                                                      const float* sa1, const float* sb, int kb, int lane,
                                                      float (&acc)[64], float (&t0)[64], float (&t1)[64]) {
  using BG = BlockGemmPipe;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  float s0[kN], s1[kN];  // the chunk's promotion scales, loaded under its first MMAs
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float b = __ldg(sb + kb + j);
    s0[j] = __ldg(sa0 + kb + j) * b;
    s1[j] = __ldg(sa1 + kb + j) * b;
  }
  const auto issue_next = [&](float(&t)[64]) {
    TxBarrier::wait(&s.full[issue.stage], issue.phase);
    block_gemm_pipe_issue(a_desc0 + issue.stage * (BG::kABytes >> 4), b_desc0 + issue.stage * (BG::kBBytes >> 4), t);
    issue.advance();
  };
  const auto promote = [&](float(&t)[64], float a, float b) {
#pragma unroll
    for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(t[i]);
    __syncwarp();
    if (lane == 0) Barrier::arrive(&s.empty[done.stage]);  // the stage is read
    done.advance();
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      acc[4 * i] += t[4 * i] * a;
      acc[4 * i + 1] += t[4 * i + 1] * a;
      acc[4 * i + 2] += t[4 * i + 2] * b;
      acc[4 * i + 3] += t[4 * i + 3] * b;
    }
  };
  issue_next(t0);
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    if (j + 1 < kN) {
      if (j % 2 == 0)
        issue_next(t1);
      else
        issue_next(t0);
      cute::warpgroup_wait<1>();  // k-block j's group is done, j + 1's runs on
    } else {
      cute::warpgroup_wait<0>();
    }
    if (j % 2 == 0)
      promote(t0, s0[j], s1[j]);
    else
      promote(t1, s0[j], s1[j]);
  }
}

__global__ void __launch_bounds__(BlockGemmPipe::kThreads, 1)
    block_gemm_pipe_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                           const BlockGemm::Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using BG = BlockGemmPipe;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ std::uint8_t smem_raw[];
  auto& s = *reinterpret_cast<BG::Smem*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  const int n_tiles = (p.n + BG::kTileN - 1) / BG::kTileN;
  const auto locate = [&](int tile) {
    const int g = block_gemm_group_of(s.tile_start, p.groups, tile);
    const int local = tile - s.tile_start[g];
    const int m_tiles = (p.args.shapes[3 * g] + BG::kTileM - 1) / BG::kTileM;
    return BlockGemmTile{g, local % m_tiles, local / m_tiles};
  };

  block_gemm_setup<BG::kStages, BG::kConsumerWarps>(s.tile_start, s.full, s.empty, p.groups, [&](int g) {
    return (p.args.shapes[3 * g] + BG::kTileM - 1) / BG::kTileM * n_tiles;
  });
  __syncthreads();
  const int total = s.tile_start[p.groups];
  const int warp_group = static_cast<int>(threadIdx.x) / 128;

  if (warp_group == 0) {
    // --- producer: one thread streams k-blocks by TMA ---
    cutlass::arch::warpgroup_reg_dealloc<BG::kProducerRegs>();
    if (threadIdx.x != 0) return;
    constexpr auto kHint = static_cast<std::uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
    BlockGemmRing ring;
    for (int tile = static_cast<int>(blockIdx.x); tile < total; tile += static_cast<int>(gridDim.x)) {
      const BlockGemmTile t = locate(tile);
      const auto a_row =
          static_cast<int>((static_cast<const std::uint8_t*>(p.args.ptr_A[t.g]) - p.a_base) / p.k) + t.mt * BG::kTileM;
      const auto b_row =
          static_cast<int>((static_cast<const std::uint8_t*>(p.args.ptr_B[t.g]) - p.b_base) / p.k) + t.nt * BG::kTileN;
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        Barrier::wait(&s.empty[ring.stage], ring.phase ^ 1);
        TxBarrier::arrive_and_expect_tx(&s.full[ring.stage], BG::kABytes + BG::kBBytes);
        cute::SM90_TMA_LOAD_2D::copy(&tma_a, &s.full[ring.stage], kHint, s.a[ring.stage], kb * BG::kTileK, a_row);
        cute::SM90_TMA_LOAD_2D::copy(&tma_b, &s.full[ring.stage], kHint, s.b[ring.stage], kb * BG::kTileK, b_row);
        ring.advance();
      }
    }
    return;
  }

  // --- consumers: 64 token rows x 128 columns each ---
  cutlass::arch::warpgroup_reg_alloc<BG::kConsumerRegs>();
  const int wg = __shfl_sync(0xFFFFFFFFu, warp_group - 1, 0);  // warp-uniform to the compiler
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int row_in_tile = wg * 64 + warp * 16 + lane / 4;  // and + 8
  BlockGemmRing issue, done;
  float acc[64], t0[64], t1[64];
  const std::uint32_t a_desc0 = block_gemm_desc_lo(s.a[0] + wg * 64 * BG::kTileK), b_desc0 = block_gemm_desc_lo(s.b[0]);
  for (int tile = static_cast<int>(blockIdx.x); tile < total; tile += static_cast<int>(gridDim.x)) {
    const BlockGemmTile t = locate(tile);
    const int m = p.args.shapes[3 * t.g];
    const int r0 = t.mt * BG::kTileM + row_in_tile;
    // Scales of rows past the group: its last row's (finite; those rows are never written).
    const float* sa0 = p.args.ptr_col[t.g] + static_cast<std::int64_t>(min(r0, m - 1)) * p.k_blocks;
    const float* sa1 = p.args.ptr_col[t.g] + static_cast<std::int64_t>(min(r0 + 8, m - 1)) * p.k_blocks;
    const float* sb = p.args.ptr_row[t.g] + static_cast<std::int64_t>(t.nt) * p.k_blocks;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    int kb = 0;
    for (; kb + BG::kChunk <= p.k_blocks; kb += BG::kChunk)
      block_gemm_pipe_chunk<BG::kChunk>(s, issue, done, a_desc0, b_desc0, sa0, sa1, sb, kb, lane, acc, t0, t1);
    for (; kb < p.k_blocks; ++kb)
      block_gemm_pipe_chunk<1>(s, issue, done, a_desc0, b_desc0, sa0, sa1, sb, kb, lane, acc, t0, t1);

    // --- epilogue: the warp's 16 rows x 128 columns, a 64-column quarter (128 bytes a row) at a time ---
    const int warp_row0 = t.mt * BG::kTileM + wg * 64 + warp * 16;
    if (warp_row0 >= m) continue;
    std::uint8_t* staged = s.out[wg * 4 + warp];
    auto* D = static_cast<std::uint8_t*>(p.args.ptr_D[t.g]);
    const std::int64_t ld_bytes = 2 * p.args.stride_D[t.g];
    std::uint8_t* out0 = staged + (lane / 4) * BlockGemm::kStageRowBytes + 4 * (lane % 4);
    std::uint8_t* out1 = out0 + 8 * BlockGemm::kStageRowBytes;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int col0 = t.nt * BG::kTileN + q * 64;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = 8 * q + j;
        *reinterpret_cast<__nv_bfloat162*>(out0 + 16 * j) = __floats2bfloat162_rn(acc[4 * i], acc[4 * i + 1]);
        *reinterpret_cast<__nv_bfloat162*>(out1 + 16 * j) = __floats2bfloat162_rn(acc[4 * i + 2], acc[4 * i + 3]);
      }
      block_gemm_flush(staged, lane, D + warp_row0 * ld_bytes + 2 * col0, ld_bytes, min(m - warp_row0, 16));
    }
  }
#endif
}

// The launch of the config row whose main loop is this one (its tile: checked).
template <plan::GemmConfig kConfig>
void run_block_gemm_pipe(const GroupedGemmLaunch& l, cudaStream_t stream) {
  using BG = BlockGemmPipe;
  static constexpr plan::GemmConfigInfo info = plan::gemm_config_info(kConfig);
  static_assert(info.main_loop == plan::GemmMainLoop::kMoekit && !info.swap_ab && !info.fused_w1 &&
                    info.tile_m == BG::kTileM && info.tile_n == BG::kTileN && info.tile_k == BG::kTileK &&
                    info.n_multiple % BG::kTileN == 0,
                "the config row does not describe moekit's pipelined block GEMM (plan/gemm_config.h)");
  const std::string name = "grouped_fp8_gemm: config " + std::string(info.name);
  MOEKIT_CUDA_REQUIRE(
      l.block_scaled && plan::supports(info, l.n, l.k, QuantScheme::kBlock128),
      name + " does not run n = " + std::to_string(l.n) + ", k = " + std::to_string(l.k) + " (see plan/gemm_config.h)");
  block_gemm_require_tensors(l, name, BG::kMaxGroups);
  block_gemm_require_sm90(name);
  const BlockGemm::Params p = block_gemm_params(l);
  const CUtensorMap ta = block_gemm_tensor_map(l.tensors.tokens, l.tensors.token_rows, l.k, BG::kTileM, "the tokens");
  const CUtensorMap tb =
      block_gemm_tensor_map(l.tensors.weights, l.tensors.weight_rows, l.k, BG::kTileN, "the weights");
  MOEKIT_CUDA_CHECK(
      cudaFuncSetAttribute(block_gemm_pipe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, BG::kSmemBytes));
  block_gemm_pipe_kernel<<<l.num_sms, BG::kThreads, BG::kSmemBytes, stream>>>(ta, tb, p);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

#endif  // __CUDACC__

}  // namespace moekit::cuda::detail
