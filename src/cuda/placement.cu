// Redundant experts on the GPU (cuda/placement.h): a thread a (token, expert) pair.
#include "cuda/placement.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/check.h"
#include "cuda/pdl.cuh"

namespace moekit::cuda {
namespace {

__global__ void place_experts_kernel(std::int32_t* __restrict__ ids, std::int64_t num_pairs, int topk,
                                     std::int64_t token_base, plan::PlacementTables tables) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < num_pairs;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t slot = plan::physical_expert(ids[i], token_base + i / topk, tables.replica_offsets,
                                                    tables.replica_slots, tables.num_logical, tables.num_physical);
    ids[i] = slot;
    if (tables.load != nullptr && slot >= 0 && slot < tables.num_physical) atomicAdd(tables.load + slot, 1ull);
  }
}

}  // namespace

void launch_place_experts(std::int32_t* ids, std::int64_t num_tokens, std::int64_t topk, std::int64_t token_base,
                          const plan::PlacementTables& tables, void* stream) {
  const std::int64_t pairs = num_tokens * topk;
  if (pairs == 0) return;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>((pairs + kThreads - 1) / kThreads, 1024));
  launch_pdl(place_experts_kernel, blocks, kThreads, 0, static_cast<cudaStream_t>(stream), ids, pairs,
             static_cast<int>(topk), token_base, tables);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::cuda
