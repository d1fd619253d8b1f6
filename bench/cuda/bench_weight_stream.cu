// Benchmark: how fast the experts' FP8 weights stream from HBM into shared memory by TMA the way the
// grouped GEMMs read them at small m_e (memory-bound: the weights are read once), for two layouts of
// the same bytes:
//   row-major (E_local * n, k), the layout every GEMM of moekit reads today: a tile is 128 weight
//     rows, its k-blocks 128 x 128-byte boxes whose rows lie k bytes apart (one 128-byte piece of
//     each DRAM page a box touches);
//   tiled: each 128 x 128 block stored contiguously (16 KB), a tile's k-blocks one after another;
//     the same TMA box lands in shared memory with the same swizzle, so a kernel reads it unchanged
//     but for its coordinates.
// One CTA per SM, one thread issuing TMA loads into a ring of stages (no math: the loads alone),
// tiles handed out as the persistent GEMMs do (tile = blockIdx.x, + gridDim.x, ...); optionally each
// k-block also loads the expert's token tile (m_e rows x 128 bytes, from L2 after its first read),
// as the swapped GEMMs do at m_e <= 64. Prints GB/s (weights only)
// against the machine's copy ceiling and a plain read kernel measured in the same run, for
// DeepSeek-V3's W1 (16 x 4096 x 7168) and W2 (16 x 7168 x 2048).
// Run: ./bench_weight_stream [stages ...]  (ring depths to try, 1 to 6; default 4 6)
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/block_gemm_sm90.cuh"
#include "cuda/check.h"
#include "cuda/launch.h"

namespace {

using moekit::cuda::detail::block_gemm_tensor_map;
using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

constexpr int kBox = 128;               // rows and bytes of one TMA box (a 128x128 FP8 block)
constexpr int kBoxBytes = kBox * kBox;  // 16 KB
constexpr int kMaxStages = 6;           // a stage holds a weight box and a token box (2 x 16 KB)

__global__ void __launch_bounds__(32, 1)
    stream_kernel(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap tokens_map, int tiles,
                  int tiles_per_expert, int k_blocks, bool tiled, int stages, int token_rows, unsigned* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ std::uint8_t raw[];
  auto* buf = reinterpret_cast<std::uint8_t*>((reinterpret_cast<std::uintptr_t>(raw) + 1023) & ~std::uintptr_t{1023});
  __shared__ std::uint64_t full[kMaxStages];
  if (threadIdx.x != 0) return;
  for (int i = 0; i < stages; ++i) TxBarrier::init(&full[i], 1);
  cutlass::arch::fence_barrier_init();
  const int my_tiles =
      tiles > static_cast<int>(blockIdx.x)
          ? (tiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x)
          : 0;
  const int loads = my_tiles * k_blocks;
  constexpr auto kHint = static_cast<std::uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  auto issue = [&](int j, int stage) {
    const int tile = static_cast<int>(blockIdx.x) + (j / k_blocks) * static_cast<int>(gridDim.x);
    const int kb = j % k_blocks;
    const int x = tiled ? 0 : kb * kBox;
    const int y = tiled ? (tile * k_blocks + kb) * kBox : tile * kBox;
    TxBarrier::arrive_and_expect_tx(&full[stage], kBoxBytes + token_rows * kBox);
    cute::SM90_TMA_LOAD_2D::copy(&map, &full[stage], kHint, buf + stage * 2 * kBoxBytes, x, y);
    if (token_rows > 0)
      cute::SM90_TMA_LOAD_2D::copy(&tokens_map, &full[stage], kHint, buf + stage * 2 * kBoxBytes + kBoxBytes, kb * kBox,
                                   (tile / tiles_per_expert) * token_rows);
  };
  for (int j = 0; j < min(stages, loads); ++j) issue(j, j);
  unsigned acc = 0;
  for (int j = 0; j < loads; ++j) {
    const int stage = j % stages;
    TxBarrier::wait(&full[stage], static_cast<std::uint32_t>((j / stages) & 1));
    acc += buf[stage * 2 * kBoxBytes + (j & 127)];
    if (j + stages < loads) issue(j + stages, stage);
  }
  if (acc == 0xFFFFFFFFu) *sink = acc;  // keeps the reads
#endif
}

// The read ceiling: every byte once, 16 bytes a thread a step.
__global__ void read_kernel(const uint4* __restrict__ p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> depths;
  for (int a = 1; a < argc; ++a) depths.push_back(std::atoi(argv[a]));
  if (depths.empty()) depths = {4, 6};
  for (int d : depths)
    if (d < 1 || d > kMaxStages) {
      std::fprintf(stderr, "bench_weight_stream: %d stages: give 1 to %d\n", d, kMaxStages);
      return 2;
    }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_weight_stream: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy_gbs = moekit::cuda::measure_copy_gbs(nullptr);
  std::printf("device %s, %d SMs; copy ceiling %.0f GB/s (read + write)\n", prop.name, prop.multiProcessorCount,
              copy_gbs);
  unsigned* sink = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&sink, 4));
  struct Shape {
    const char* name;
    std::int64_t experts, n, k;
  };
  for (const Shape s : {Shape{"W1 16 x 4096 x 7168", 16, 4096, 7168}, Shape{"W2 16 x 7168 x 2048", 16, 7168, 2048}}) {
    const std::int64_t bytes = s.experts * s.n * s.k;
    void* w = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&w, static_cast<std::size_t>(bytes)));
    moekit::cuda::fill_random_bytes(w, static_cast<std::size_t>(bytes), 7, true);
    const double read_ms = moekit::cuda::median_ms(
        20,
        [&] {
          read_kernel<<<prop.multiProcessorCount * 8, 512>>>(static_cast<const uint4*>(w),
                                                             static_cast<std::size_t>(bytes / 16), sink);
        },
        nullptr);
    const double read_gbs = bytes / (read_ms * 1e6);
    std::printf("%s: %.0f MB; plain read %.4f ms, %.0f GB/s (%.2f of copy)\n", s.name, bytes / 1e6, read_ms, read_gbs,
                read_gbs / copy_gbs);
    const int tiles = static_cast<int>(s.experts * s.n / kBox), k_blocks = static_cast<int>(s.k / kBox);
    const CUtensorMap row_major = block_gemm_tensor_map(w, s.experts * s.n, s.k, kBox, "row-major weights");
    const CUtensorMap tiled = block_gemm_tensor_map(w, bytes / kBox, kBox, kBox, "tiled weights");
    // Tokens: 64 rows an expert (the most a swapped 128x64 tile holds), boxes of 32 or 64 rows.
    void* tok = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&tok, static_cast<std::size_t>(s.experts * 64 * s.k)));
    moekit::cuda::fill_random_bytes(tok, static_cast<std::size_t>(s.experts * 64 * s.k), 8, true);
    for (int stages : depths) {
      const int smem = stages * 2 * kBoxBytes + 1024;
      MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      for (const int token_rows : {0, 32, 64}) {
        const CUtensorMap tokens = block_gemm_tensor_map(tok, s.experts * token_rows > 0 ? s.experts * token_rows : 1,
                                                         s.k, token_rows > 0 ? token_rows : 1, "tokens");
        for (const bool t : {false, true}) {
          if (t && token_rows > 0) continue;
          const double ms = moekit::cuda::median_ms(
              20,
              [&] {
                stream_kernel<<<prop.multiProcessorCount, 32, smem>>>(t ? tiled : row_major, tokens, tiles,
                                                                      static_cast<int>(s.n / kBox), k_blocks, t, stages,
                                                                      token_rows, sink);
              },
              nullptr);
          MOEKIT_CUDA_CHECK(cudaGetLastError());
          const double gbs = bytes / (ms * 1e6);
          std::printf(
              "  TMA %-9s %d stages, + %2d token rows a k-block: %.4f ms, %.0f GB/s (%.2f of copy, %.2f of "
              "read)\n",
              t ? "tiled" : "row-major", stages, token_rows, ms, gbs, gbs / copy_gbs, gbs / read_gbs);
        }
      }
    }
    MOEKIT_CUDA_CHECK(cudaFree(tok));
    MOEKIT_CUDA_CHECK(cudaFree(w));
  }
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  cudaFree(sink);
  return 0;
}
