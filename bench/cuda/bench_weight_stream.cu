// Benchmark: how fast the experts' FP8 weights stream from HBM into shared memory by TMA the way the
// grouped GEMMs read them at small m_e (memory-bound: the weights are read once), for two layouts of
// the same bytes:
//   row-major (E_local * n, k), the layout every GEMM of moekit reads today: a tile is 128 weight
//     rows, its k-blocks 128 x 128-byte boxes whose rows lie k bytes apart (one 128-byte piece of
//     each DRAM page a box touches);
//   tiled: each 128 x 128 block stored contiguously (16 KB), a tile's k-blocks one after another;
//     the same TMA box lands in shared memory with the same swizzle, so a kernel reads it unchanged
//     but for its coordinates.
// The stream is the library's (ceilings::weight_stream_ms, src/ceilings/weight_stream.cu: one CTA
// per SM, one thread issuing TMA loads into a ring of stages, no math, tiles handed out as the
// persistent GEMMs do); optionally each k-block also loads the expert's token tile (m_e rows x 128
// bytes, from L2 after its first read), as the swapped GEMMs do at m_e <= 64. Prints GB/s (weights only)
// against the machine's copy ceiling and a plain read kernel measured in the same run, for
// DeepSeek-V3's W1 (16 x 4096 x 7168) and W2 (16 x 7168 x 2048).
// Run: ./bench_weight_stream [stages ...]  (ring depths to try, 1 to 6; default 4 6)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ceilings/ceilings.h"
#include "cuda/check.h"
#include "cuda/launch.h"

namespace {

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
  using moekit::ceilings::kMaxWeightStreamStages;
  std::vector<int> depths;
  for (int a = 1; a < argc; ++a) depths.push_back(std::atoi(argv[a]));
  if (depths.empty()) depths = {4, 6};
  for (int d : depths)
    if (d < 1 || d > kMaxWeightStreamStages) {
      std::fprintf(stderr, "bench_weight_stream: %d stages: give 1 to %d\n", d, kMaxWeightStreamStages);
      return 2;
    }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_weight_stream: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy_gbs = moekit::ceilings::copy_gbs(nullptr);
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
    moekit::ceilings::fill_random_bytes(w, static_cast<std::size_t>(bytes), 7, true);
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
    // Tokens: 64 rows an expert (the most a swapped 128x64 tile holds), boxes of 32 or 64 rows.
    void* tok = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&tok, static_cast<std::size_t>(s.experts * 64 * s.k)));
    moekit::ceilings::fill_random_bytes(tok, static_cast<std::size_t>(s.experts * 64 * s.k), 8, true);
    for (int stages : depths) {
      for (const int token_rows : {0, 32, 64}) {
        for (const bool t : {false, true}) {
          if (t && token_rows > 0) continue;
          const double ms = moekit::ceilings::weight_stream_ms({.weights = w,
                                                                .experts = s.experts,
                                                                .rows_per_expert = s.n,
                                                                .k = s.k,
                                                                .stages = stages,
                                                                .tiled = t,
                                                                .tokens = tok,
                                                                .token_rows = token_rows},
                                                               nullptr);
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
