// How fast the experts' FP8 weights can be read once, measured: TMA alone streams a weight tensor
// the way moekit's grouped GEMMs read it (128-row tiles handed out to one CTA per SM, 128 x 128-byte
// boxes into a ring of stages), no math. At small m_e the GEMMs are bound by this read; the experts
// benchmark reports its steps against it ("one read of the weights"), bench_weight_stream compares
// layouts, ring depths and token loads with it (docs/PERF.md). Measured on the H200: 0.87-0.96 of
// the device-to-device copy ceiling (read + write bytes over time), above a plain 16-byte-load read.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ceilings/ceilings.h"
#include "cuda/block_gemm_sm90.cuh"
#include "cuda/check.h"
#include "cuda/launch.h"

namespace moekit::ceilings {

namespace {

using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
constexpr int kBox = kWeightStreamBox;  // rows and bytes of one TMA box (a 128x128 FP8 block)
constexpr int kBoxBytes = kBox * kBox;  // 16 KB

__global__ void __launch_bounds__(32, 1)
    weight_stream_kernel(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap tokens_map,
                         int tiles, int tiles_per_expert, int k_blocks, bool tiled, int stages, int token_rows,
                         unsigned* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ std::uint8_t raw[];
  auto* buf = reinterpret_cast<std::uint8_t*>((reinterpret_cast<std::uintptr_t>(raw) + 1023) & ~std::uintptr_t{1023});
  __shared__ std::uint64_t full[kMaxWeightStreamStages];
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

}  // namespace

double weight_stream_ms(const WeightStream& w, void* stream) {
  MOEKIT_CUDA_REQUIRE(w.weights != nullptr && w.experts > 0 && weight_stream_takes(w.rows_per_expert, w.k),
                      "weight_stream_ms: experts x rows_per_expert (a multiple of 128) x k (a multiple of "
                      "128) FP8 weights needed, got " +
                          std::to_string(w.experts) + " x " + std::to_string(w.rows_per_expert) + " x " +
                          std::to_string(w.k));
  MOEKIT_CUDA_REQUIRE(
      w.stages >= 1 && w.stages <= kMaxWeightStreamStages,
      "weight_stream_ms: " + std::to_string(w.stages) + " stages, give 1 to " + std::to_string(kMaxWeightStreamStages));
  MOEKIT_CUDA_REQUIRE(w.token_rows >= 0 && w.token_rows <= 256 && (w.token_rows == 0 || w.tokens != nullptr),
                      "weight_stream_ms: token_rows " + std::to_string(w.token_rows) + " (0 to 256, with tokens)");
  cuda::detail::block_gemm_require_sm90("weight_stream_ms (TMA)");
  int device = 0, sms = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const std::int64_t rows = w.experts * w.rows_per_expert, bytes = rows * w.k;
  const CUtensorMap map =
      w.tiled ? cuda::detail::block_gemm_tensor_map(w.weights, bytes / kBox, kBox, kBox, "tiled weights")
              : cuda::detail::block_gemm_tensor_map(w.weights, rows, w.k, kBox, "row-major weights");
  const CUtensorMap tokens = w.token_rows > 0 ? cuda::detail::block_gemm_tensor_map(w.tokens, w.experts * w.token_rows,
                                                                                    w.k, w.token_rows, "tokens")
                                              : map;
  unsigned* sink = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&sink, 4));
  const int smem = w.stages * 2 * kBoxBytes + 1024;
  MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(weight_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const auto s = static_cast<cudaStream_t>(stream);
  const double ms = cuda::median_ms(
      20,
      [&] {
        weight_stream_kernel<<<sms, 32, smem, s>>>(map, tokens, static_cast<int>(rows / kBox),
                                                   static_cast<int>(w.rows_per_expert / kBox),
                                                   static_cast<int>(w.k / kBox), w.tiled, w.stages, w.token_rows, sink);
        MOEKIT_CUDA_CHECK_LAUNCH();
      },
      stream);
  MOEKIT_CUDA_CHECK(cudaFree(sink));
  return ms;
}

}  // namespace moekit::ceilings
