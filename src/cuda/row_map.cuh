// The row map's per-tile ranking, shared by the single-GPU dispatch (dispatch.cu's row_rank_kernel)
// and the NCCL receive side (nccl/ep.cu's recv_map_kernel): a block of kRowMapTile threads holds one
// slot each (its expert, or -1 for none); a slot's rank among its expert's slots of the tile is the
// slots of earlier warps (their counts, exclusive-scanned over warps in shared memory) + earlier
// lanes of its warp (__match_any_sync). Slot order within the tile is thread order, so the rows
// follow (record, slot) order as the CPU's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.h"
#include "cuda/status.cuh"

namespace moekit::cuda {

inline constexpr int kRowMapWarps = kRowMapTile / 32;

// A step of at most this many tiles is mapped by one block walking its tiles in order (the
// single-GPU row map's one-block kernel, the NCCL receive map); more take the parallel kernels.
// Measured: one block pays ~1.4 us a tile, a graph node ~1 us (docs/PERF.md).
inline constexpr int kRowMapOneBlockTiles = 2;

// Shared memory of one tile's ranking: kRowMapWarps x E unsigned shorts.
constexpr std::size_t row_map_tile_smem(int E) {
  return static_cast<std::size_t>(kRowMapWarps) * static_cast<std::size_t>(E) * sizeof(unsigned short);
}

// Every thread of the block calls it (it synchronizes the block), with its slot's expert `e` (-1:
// none). Returns the slot's rank among the tile's slots of expert e (0 for e < 0). `carry` (E ints in
// shared memory, or null): a running per-expert count added to every rank and advanced by the tile,
// for a block that walks several tiles in order. `warp_first` is the kRowMapWarps x E scratch.
__device__ __forceinline__ int rank_in_tile(int e, int E, unsigned short* warp_first, int* carry) {
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  for (int j = tid; j < kRowMapWarps * E; j += kRowMapTile) warp_first[j] = 0;
  __syncthreads();
  const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
  const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && rank_in_warp == 0) warp_first[warp * E + e] = static_cast<unsigned short>(__popc(peers));
  __syncthreads();
  for (int x = tid; x < E; x += kRowMapTile) {  // per expert: the warps' counts -> their first ranks
    int acc = carry != nullptr ? carry[x] : 0;
    for (int w = 0; w < kRowMapWarps; ++w) {
      const int c = warp_first[w * E + x];
      warp_first[w * E + x] = static_cast<unsigned short>(acc);
      acc += c;
    }
    if (carry != nullptr) carry[x] = acc;
  }
  __syncthreads();
  const int rank = e >= 0 ? warp_first[warp * E + e] + rank_in_warp : 0;
  __syncthreads();  // warp_first is reused by the next tile
  return rank;
}

// The row of the pair ranked `rank` among its expert e's pairs (the CPU's rule for the standard
// and batched formats): -1 for no expert (e < 0); contiguous (standard format), the expert's first row + rank;
// else (batched) row e * capacity + rank within the expert's slab, -1 past it, the pair ranked
// exactly `capacity` raising kStatusOverCapacity (expert, rank + 1) once. The single-GPU row map's
// kernels and the NCCL receive map all take their rows here.
__device__ __forceinline__ std::int32_t pair_row_of(int e, std::int64_t rank, bool contiguous, std::int64_t first_row,
                                                    std::int64_t capacity, std::int32_t* status) {
  if (e < 0) return -1;
  if (contiguous) return static_cast<std::int32_t>(first_row + rank);
  if (rank < capacity) return static_cast<std::int32_t>(e * capacity + rank);
  if (rank == capacity) flag_status(status, kStatusOverCapacity, e, static_cast<int>(rank + 1));
  return -1;
}

}  // namespace moekit::cuda
