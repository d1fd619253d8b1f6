// The single-GPU dispatch kernels: where each (token, slot) pair's row goes (row map), FP8
// quantization of the tokens fused with the scatter to those rows, the combine back, and the
// standard experts' permutation. Every row order and every value equals the CPU's: rows of one
// expert in (token, slot) order, the quantizer's division and rounding, the combine's fp32 sum in
// slot order; integer atomics only where the result does not depend on order.
// Napkin math, DeepSeek-V3, T = 512 tokens, top-8: the scatter writes 4096 rows x 7168 B = 29 MB
// (~10 us at ~3 TB/s) from 7 MB of bf16; the combine reads the same 4096 bf16 rows (59 MB, ~15 us).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <string>

#include "cuda/check.h"
#include "cuda/launch.h"
#include "cuda/pdl.cuh"
#include "cuda/quantize.cuh"
#include "cuda/reduce.cuh"
#include "cuda/row_map.cuh"
#include "cuda/sixteen_bit.cuh"
#include "cuda/status.cuh"
#include "numerics/activation.h"
#include "numerics/fp8.h"
#include "numerics/routing.h"
#include "numerics/scales.h"

namespace moekit::cuda {
namespace {

using numerics::DeviceMath;

// --- row map --------------------------------------------------------------------------------------

constexpr int kMapThreads = kRowMapTile;
constexpr int kMaxMapExperts = kMaxRowMapExperts;  // shared memory: 2 x E ints + 32 warps x E uint16

// Three kernels, tiles of 1024 pairs in order, one block per tile. Count: each tile's pairs per
// expert (integer atomics in shared memory: order-free). Scan (one block): per expert, the
// exclusive prefix of the tiles' counts (each tile's first rank), the totals, the counts and (when
// contiguous) the offsets. Rank: each tile ranks its pairs among the earlier pairs of their expert -
// the tiles before it (from the scan), the warps before (a per-expert prefix over warps), the lanes
// before (__match_any_sync) - so the rank is the CPU's (token, slot) order.

// Pair i's expert from the router's ids: -1 past the pairs; an id out of range (-1 is "none") is
// flagged (token, slot, id) and dropped as -1.
__device__ __forceinline__ int checked_expert(const std::int32_t* __restrict__ ids, int i, int num_pairs, int topk,
                                              int E, std::int32_t* status) {
  const int e = i < num_pairs ? ids[i] : -1;
  if (e >= -1 && e < E) return e;
  flag_status(status, kStatusBadExpertId, i / topk, i % topk, e);
  return -1;
}

__global__ void __launch_bounds__(kMapThreads)
    row_count_kernel(const std::int32_t* __restrict__ ids, int num_pairs, int E, std::int32_t* __restrict__ tile_base) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += kMapThreads) hist[e] = 0;
  __syncthreads();
  const int i = blockIdx.x * kMapThreads + static_cast<int>(threadIdx.x);
  if (i < num_pairs) {
    const int e = ids[i];
    if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kMapThreads) tile_base[blockIdx.x * E + e] = hist[e];
}

__global__ void __launch_bounds__(kMapThreads)
    row_scan_kernel(int tiles, int E, bool contiguous, std::int64_t capacity, std::int32_t* __restrict__ tile_base,
                    std::int32_t* __restrict__ counts, std::int32_t* __restrict__ offsets) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  using Scan = cub::BlockScan<int, kMapThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int e = static_cast<int>(threadIdx.x);  // E <= kMaxMapExperts <= kMapThreads
  int total = 0;
  if (e < E) {
    for (int t = 0; t < tiles; ++t) {
      const int c = tile_base[t * E + e];
      tile_base[t * E + e] = total;
      total += c;
    }
    counts[e] = static_cast<std::int32_t>(contiguous || total <= capacity ? total : capacity);
  }
  if (contiguous) {  // offsets = exclusive scan of the totals over experts
    int prefix = 0, sum = 0;
    Scan(scan).ExclusiveSum(e < E ? total : 0, prefix, sum);
    if (e < E) offsets[e] = prefix;
    if (e == 0) offsets[E] = sum;
  }
}

__global__ void __launch_bounds__(kMapThreads)
    row_rank_kernel(const std::int32_t* __restrict__ ids, int num_pairs, int topk, int E, bool contiguous,
                    std::int64_t capacity, const std::int32_t* __restrict__ tile_base,
                    const std::int32_t* __restrict__ offsets, std::int32_t* __restrict__ pair_row,
                    std::int32_t* __restrict__ status) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  extern __shared__ int smem[];
  const int i = blockIdx.x * kMapThreads + static_cast<int>(threadIdx.x);
  const int e = checked_expert(ids, i, num_pairs, topk, E, status);
  const int tile_rank = rank_in_tile(e, E, reinterpret_cast<unsigned short*>(smem), nullptr);
  if (i >= num_pairs) return;
  // Pairs of expert e before this one: earlier tiles, then earlier warps and lanes of this tile.
  pair_row[i] = e < 0 ? -1
                      : pair_row_of(e, tile_base[blockIdx.x * E + e] + tile_rank, contiguous,
                                    contiguous ? offsets[e] : 0, capacity, status);
}

// One block for a step of at most kRowMapOneBlockTiles tiles (decode): the three kernels' work in
// one launch. The block ranks its tiles in order with a running per-expert count (rank_in_tile's
// carry), which ends as the totals; then the counts, the offsets (contiguous) and every pair's row.
// Same ranks, rows, counts and flags as the three kernels.
__global__ void __launch_bounds__(kMapThreads)
    row_map_one_block_kernel(const std::int32_t* __restrict__ ids, int num_pairs, int topk, int E, bool contiguous,
                             std::int64_t capacity, std::int32_t* __restrict__ pair_row,
                             std::int32_t* __restrict__ counts, std::int32_t* __restrict__ offsets,
                             std::int32_t* __restrict__ status) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  using Scan = cub::BlockScan<int, kMapThreads>;
  __shared__ typename Scan::TempStorage scan;
  extern __shared__ int smem[];
  int* seen = smem;                                                    // E: the expert's pairs so far
  int* first_row = smem + E;                                           // E: the expert's first row (contiguous)
  auto* warp_first = reinterpret_cast<unsigned short*>(smem + 2 * E);  // the tile's ranking
  const int tid = static_cast<int>(threadIdx.x);
  for (int x = tid; x < E; x += kMapThreads) seen[x] = 0;
  __syncthreads();
  const int tiles = (num_pairs + kMapThreads - 1) / kMapThreads;  // <= kRowMapOneBlockTiles
  int expert[kRowMapOneBlockTiles], rank[kRowMapOneBlockTiles];
#pragma unroll
  for (int tile = 0; tile < kRowMapOneBlockTiles; ++tile) {
    if (tile >= tiles) break;  // the same for every thread: rank_in_tile's barriers stay uniform
    const int i = tile * kMapThreads + tid;
    const int e = checked_expert(ids, i, num_pairs, topk, E, status);
    expert[tile] = e;
    rank[tile] = rank_in_tile(e, E, warp_first, seen);  // synchronizes the block
  }
  // seen[] now holds the totals (rank_in_tile's last write was before its closing barrier).
  const int total = tid < E ? seen[tid] : 0;  // E <= kMaxMapExperts <= kMapThreads
  if (tid < E) counts[tid] = static_cast<std::int32_t>(contiguous || total <= capacity ? total : capacity);
  if (contiguous) {
    int prefix = 0, sum = 0;
    Scan(scan).ExclusiveSum(total, prefix, sum);
    if (tid < E) offsets[tid] = first_row[tid] = prefix;
    if (tid == 0) offsets[E] = sum;
    __syncthreads();
  }
#pragma unroll
  for (int tile = 0; tile < kRowMapOneBlockTiles; ++tile) {
    const int i = tile * kMapThreads + tid;
    if (tile >= tiles || i >= num_pairs) continue;
    const int e = expert[tile];
    pair_row[i] = e < 0 ? -1 : pair_row_of(e, rank[tile], contiguous, contiguous ? first_row[e] : 0, capacity, status);
  }
}

// --- quantize and scatter ------------------------------------------------------------------------

struct QuantArgs {
  QuantScheme quant;
  const __nv_bfloat16* hidden;
  int tokens, K, topk;
  const std::int32_t* pair_row;
  std::uint8_t* q;
  float* scales;
  std::uint32_t* amax;  // per-tensor: the tensor's amax as bits (non-negative floats order like their bits)
};

constexpr int kQuantDestinations = 8;  // destination rows read ahead, at once

// One block per token (grid-stride): the row in registers (cuda/quantize.cuh), its scale by
// fp8_scale, FP8 by division and satfinite RNE (cpu::quantize_activation's arithmetic), stores to
// every destination row. Pass 0 of per-tensor only raises the tensor's amax. The first
// kQuantDestinations destination rows are read before the token, so their loads wait with it.
__global__ void __launch_bounds__(kQuantThreads) quantize_kernel(QuantArgs a, int pass) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const bool per_tensor = numerics::activation_scale_per_tensor(a.quant);
  const int spr = static_cast<int>(numerics::activation_scales_per_row(a.quant, a.K));
  const int destinations = a.pair_row != nullptr ? a.topk : 1;
  for (int t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    std::int32_t dest[kQuantDestinations];
    auto read_destinations = [&](int k0) {
#pragma unroll
      for (int s = 0; s < kQuantDestinations; ++s) {
        const int k = k0 + s;
        dest[s] = k >= destinations       ? -1
                  : a.pair_row != nullptr ? a.pair_row[static_cast<std::int64_t>(t) * a.topk + k]
                                          : t;
      }
    };
    if (!(per_tensor && pass == 0)) read_destinations(0);
    QuantRow row;
    row.load(a.hidden + static_cast<std::int64_t>(t) * a.K, a.K);
    if (per_tensor && pass == 0) {
      const float amax = block_max<kQuantThreads>(row.amax_thread);
      if (threadIdx.x == 0) atomicMax(a.amax, __float_as_uint(amax));
      continue;
    }
    const float row_scale = per_tensor ? numerics::fp8_scale(__uint_as_float(*a.amax)) : row.token_scale(a.quant);
    const QuantRow::Encoded codes = row.encode(a.quant, row_scale, a.K);  // once for every destination
    for (int k0 = 0; k0 < destinations; k0 += kQuantDestinations) {
      if (k0 > 0) read_destinations(k0);
#pragma unroll
      for (int s = 0; s < kQuantDestinations; ++s) {
        const std::int64_t r = dest[s];
        if (r < 0) continue;
        QuantRow::write(codes, a.quant, a.K, a.q + r * a.K, a.scales + r * spr);
      }
    }
  }
}

// The unquantized recipes' "quantization": each token's bf16 row copied as it is to every
// destination row (16-byte copies, K % 8 == 0), or for fp16 rounded once to fp16 (kFp16), no scales:
// cpu::store_activation's copy.
template <bool kFp16>
__global__ void __launch_bounds__(kQuantThreads) copy_rows_kernel(QuantArgs a) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const int destinations = a.pair_row != nullptr ? a.topk : 1;
  const int vecs = a.K / 8;  // 8 bf16 values a uint4
  for (int t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    const uint4* src = reinterpret_cast<const uint4*>(a.hidden + static_cast<std::int64_t>(t) * a.K);
    for (int k = 0; k < destinations; ++k) {
      const std::int64_t r = a.pair_row != nullptr ? a.pair_row[static_cast<std::int64_t>(t) * a.topk + k] : t;
      if (r < 0) continue;
      uint4* dst = reinterpret_cast<uint4*>(a.q + r * a.K * 2);
      for (int v = threadIdx.x; v < vecs; v += kQuantThreads) dst[v] = kFp16 ? bf16_to_fp16_8(src[v]) : src[v];
    }
  }
}

__global__ void per_tensor_scale_kernel(const std::uint32_t* amax, float* scales, int count) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < count) scales[i] = numerics::fp8_scale(__uint_as_float(*amax));
}

// --- combine ----------------------------------------------------------------------------------------

constexpr int kCombineThreads = 128;
constexpr int kCombineSlots = 8;  // slots whose loads are in flight together

// One thread per 8 columns of a token: slots in order, numerics::combine_step (never fused), one
// bf16 rounding. The slots are read kCombineSlots at a time - their rows and weights, then their
// expert rows, all loads issued before the first sum - so a decode step waits on memory twice per 8
// slots, not twice per slot (measured: docs/PERF.md, "the decode step's small kernels").
template <class Row, class Out>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const std::int32_t* __restrict__ pair_row, const float* __restrict__ weights, int tokens, int topk,
                   int K, const Row* __restrict__ rows, Out* __restrict__ out, bool accumulate) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const int vecs = K / 8;
  const std::int64_t n = static_cast<std::int64_t>(tokens) * vecs;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(idx / vecs), c0 = static_cast<int>(idx % vecs) * 8;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (accumulate) {
      const uint4 prior = *reinterpret_cast<const uint4*>(out + static_cast<std::int64_t>(t) * K + c0);
      const auto* y = reinterpret_cast<const Out*>(&prior);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = to_float(y[j]);
    }
    const std::int64_t first = static_cast<std::int64_t>(t) * topk;
    for (int k0 = 0; k0 < topk; k0 += kCombineSlots) {
      std::int32_t row[kCombineSlots];
      float w[kCombineSlots];
      uint4 raw[kCombineSlots];
#pragma unroll
      for (int s = 0; s < kCombineSlots; ++s) {
        const bool slot = k0 + s < topk;
        row[s] = slot ? pair_row[first + k0 + s] : -1;
        w[s] = slot ? weights[first + k0 + s] : 0.0f;
      }
#pragma unroll
      for (int s = 0; s < kCombineSlots; ++s)
        if (row[s] >= 0) raw[s] = *reinterpret_cast<const uint4*>(rows + static_cast<std::int64_t>(row[s]) * K + c0);
#pragma unroll
      for (int s = 0; s < kCombineSlots; ++s) {
        if (row[s] < 0) continue;
        const auto* y = reinterpret_cast<const Row*>(&raw[s]);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = numerics::combine_step<DeviceMath>(acc[j], w[s], to_float(y[j]));
      }
    }
    uint4 packed;
    auto* o = reinterpret_cast<Out*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = from_float<Out>(acc[j]);
    *reinterpret_cast<uint4*>(out + static_cast<std::int64_t>(t) * K + c0) = packed;
  }
}

// --- permutation (standard experts) -------------------------------------------------------------------

// Rows of row_bytes (K FP8 codes: K bytes; K bf16 values: 2K), a multiple of 16; spr scales a row
// (0: an unquantized recipe, no scale pointers).
__global__ void permute_kernel(const std::int32_t* __restrict__ pair_row, int tokens, int topk, int row_bytes, int spr,
                               const std::uint8_t* __restrict__ a1q, const float* __restrict__ a1q_scale,
                               std::uint8_t* __restrict__ permuted, float* __restrict__ permuted_scale) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
    const uint4* src = reinterpret_cast<const uint4*>(a1q + static_cast<std::int64_t>(t) * row_bytes);
    for (int k = 0; k < topk; ++k) {
      const std::int32_t row = pair_row[static_cast<std::int64_t>(t) * topk + k];
      if (row < 0) continue;
      uint4* dst = reinterpret_cast<uint4*>(permuted + static_cast<std::int64_t>(row) * row_bytes);
      for (int v = threadIdx.x; v < row_bytes / 16; v += blockDim.x) dst[v] = src[v];
      for (int j = threadIdx.x; j < spr; j += blockDim.x)
        permuted_scale[static_cast<std::int64_t>(row) * spr + j] = a1q_scale[static_cast<std::int64_t>(t) * spr + j];
    }
  }
}

int grid_for(std::int64_t work, int cap) {
  return static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(work, cap)));
}

}  // namespace

void launch_row_map(const std::int32_t* ids, std::int64_t num_pairs, int topk, int num_experts, bool contiguous,
                    std::int64_t capacity, std::int32_t* pair_row, std::int32_t* counts, std::int32_t* offsets,
                    std::int32_t* tile_scratch, std::int32_t* status, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  MOEKIT_CUDA_REQUIRE(num_experts >= 1 && num_experts <= kMaxMapExperts,
                      "the CUDA row map takes 1 to 512 experts, got " + std::to_string(num_experts));
  MOEKIT_CUDA_REQUIRE(num_pairs <= 0x7FFFFFFF, "the CUDA row map takes < 2^31 (token, slot) pairs");
  const int tiles = static_cast<int>((num_pairs + kMapThreads - 1) / kMapThreads);
  const int n = static_cast<int>(num_pairs), E = num_experts;
  if (tiles <= kRowMapOneBlockTiles) {
    const std::size_t smem = 2 * E * sizeof(int) + row_map_tile_smem(E);
    launch_pdl(row_map_one_block_kernel, 1, kMapThreads, smem, stream, ids, n, topk, E, contiguous, capacity, pair_row,
               counts, offsets, status);
    MOEKIT_CUDA_CHECK_LAUNCH();
    return;
  }
  if (tiles > 0) {
    launch_pdl(row_count_kernel, tiles, kMapThreads, E * sizeof(int), stream, ids, n, E, tile_scratch);
    MOEKIT_CUDA_CHECK_LAUNCH();
  }
  launch_pdl(row_scan_kernel, 1, kMapThreads, 0, stream, tiles, E, contiguous, capacity, tile_scratch, counts, offsets);
  MOEKIT_CUDA_CHECK_LAUNCH();
  if (tiles > 0) {
    launch_pdl(row_rank_kernel, tiles, kMapThreads, row_map_tile_smem(E), stream, ids, n, topk, E, contiguous, capacity,
               tile_scratch, offsets, pair_row, status);
    MOEKIT_CUDA_CHECK_LAUNCH();
  }
}

void launch_quantize_tokens(const QuantizeLaunch& l, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  MOEKIT_CUDA_REQUIRE(l.K % 16 == 0 && l.K <= kQuantThreads * 8 * kQuantChunks,
                      "the CUDA dispatch takes rows of K a multiple of 16 and at most 8192 (its FP8 quantizer's "
                      "bound, which the bf16 row copy shares), got " +
                          std::to_string(l.K));
  const QuantArgs a{l.quant,
                    reinterpret_cast<const __nv_bfloat16*>(l.hidden),
                    static_cast<int>(l.tokens),
                    static_cast<int>(l.K),
                    l.topk,
                    l.pair_row,
                    l.q,
                    l.scales,
                    l.amax_scratch};
  const int grid = grid_for(l.tokens, 8192);
  const RecipeInfo recipe = recipe_info(l.quant);
  if (!has_activation_scales(recipe)) {  // bf16 tokens into a 16-bit recipe: rows copied (or converted), no scales
    MOEKIT_CUDA_REQUIRE(is_sixteen_bit(recipe.activation_dtype),
                        "the CUDA dispatch copies bf16 tokens into the " + std::string(recipe.name) +
                            " recipe's operands, which are " + std::string(dtype_name(recipe.activation_dtype)));
    if (l.tokens == 0) return;
    if (recipe.activation_dtype == DType::kFp16)
      launch_pdl(copy_rows_kernel<true>, grid, kQuantThreads, 0, stream, a);
    else
      launch_pdl(copy_rows_kernel<false>, grid, kQuantThreads, 0, stream, a);
    MOEKIT_CUDA_CHECK_LAUNCH();
    return;
  }
  if (numerics::activation_scale_per_tensor(l.quant)) {
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(l.amax_scratch, 0, sizeof(std::uint32_t), stream));
    if (l.tokens > 0) {
      launch_pdl(quantize_kernel, grid, kQuantThreads, 0, stream, a, 0);
      MOEKIT_CUDA_CHECK_LAUNCH();
    }
    launch_pdl(per_tensor_scale_kernel, static_cast<int>((l.scale_tensors + 127) / 128), 128, 0, stream, l.amax_scratch,
               l.scales, static_cast<int>(l.scale_tensors));
    MOEKIT_CUDA_CHECK_LAUNCH();
  }
  if (l.tokens == 0) return;
  launch_pdl(quantize_kernel, grid, kQuantThreads, 0, stream, a, 1);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void launch_combine(const std::int32_t* pair_row, const float* topk_weights, std::int64_t tokens, int topk,
                    std::int64_t K, const std::uint16_t* rows, std::uint16_t* output, void* stream, bool accumulate,
                    DType rows_dtype, DType output_dtype) {
  if (tokens == 0) return;
  MOEKIT_CUDA_REQUIRE(K % 8 == 0, "the CUDA combine takes K a multiple of 8");
  MOEKIT_CUDA_REQUIRE(is_sixteen_bit(rows_dtype) && is_sixteen_bit(output_dtype),
                      "the CUDA combine reads bf16 or fp16 rows into a bf16 or fp16 output; got rows " +
                          std::string(dtype_name(rows_dtype)) + ", output " + std::string(dtype_name(output_dtype)));
  const std::int64_t threads = tokens * (K / 8);
  const int grid = grid_for((threads + kCombineThreads - 1) / kCombineThreads, 65535);
  auto go = [&](auto row_tag, auto out_tag) {
    using Row = decltype(row_tag);
    using Out = decltype(out_tag);
    launch_pdl(combine_kernel<Row, Out>, grid, kCombineThreads, 0, static_cast<cudaStream_t>(stream), pair_row,
               topk_weights, static_cast<int>(tokens), topk, static_cast<int>(K), reinterpret_cast<const Row*>(rows),
               reinterpret_cast<Out*>(output), accumulate);
  };
  const bool rows16 = rows_dtype == DType::kFp16, out16 = output_dtype == DType::kFp16;
  if (rows16 && out16)
    go(__half{}, __half{});
  else if (rows16)
    go(__half{}, __nv_bfloat16{});
  else if (out16)
    go(__nv_bfloat16{}, __half{});
  else
    go(__nv_bfloat16{}, __nv_bfloat16{});
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void launch_permute_rows(const std::int32_t* pair_row, std::int64_t tokens, int topk, std::int64_t K, QuantScheme quant,
                         const std::uint8_t* a1q, const float* a1q_scale, std::uint8_t* permuted, float* permuted_scale,
                         void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (numerics::activation_scale_per_tensor(quant))  // one scale for all rows, the tensor's
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(permuted_scale, a1q_scale, sizeof(float), cudaMemcpyDeviceToDevice, stream));
  if (tokens == 0) return;
  MOEKIT_CUDA_REQUIRE(K % 16 == 0, "the CUDA permutation takes K a multiple of 16");
  // A row in the recipe's activation dtype: K FP8 codes or K bf16 values (2K bytes).
  const std::int64_t row_bytes = K * dtype_size(recipe_info(quant).activation_dtype);
  const std::int64_t spr = numerics::activation_scales_per_row(quant, K);
  MOEKIT_CUDA_REQUIRE(spr == 0 || (a1q_scale != nullptr && permuted_scale != nullptr),
                      "the CUDA permutation of a scaled recipe needs a1q_scale and a1q_scale_permuted");
  launch_pdl(permute_kernel, grid_for(tokens, 8192), 256, 0, stream, pair_row, static_cast<int>(tokens), topk,
             static_cast<int>(row_bytes), static_cast<int>(spr), a1q, a1q_scale, permuted, permuted_scale);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void clear_status_words(std::int32_t* device_status, void* stream) {
  MOEKIT_CUDA_CHECK(
      cudaMemsetAsync(device_status, 0, kStatusWords * sizeof(std::int32_t), static_cast<cudaStream_t>(stream)));
}

void read_status_words(const std::int32_t* device_status, std::int32_t* host, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  MOEKIT_CUDA_CHECK(
      cudaMemcpyAsync(host, device_status, kStatusWords * sizeof(std::int32_t), cudaMemcpyDeviceToHost, s));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace moekit::cuda
