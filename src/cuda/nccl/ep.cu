// Expert parallelism across GPUs on NCCL (cuda/ep_launch.h): the NCCL group of a layer's ranks, the
// symmetric memory its workspace lives in, and the dispatch/combine kernels of both transports.
//
// One step, rank s of P (layouts: plan/ep_layout.h):
//   pack      each token quantized once to FP8 by one block (cuda/quantize.cuh: the CPU's codes)
//             and written as one record per destination rank (header, FP8 row, scales); the
//             unquantized recipe's (bf16) records carry the token's bf16 row and no scales.
//             Device-initiated: stored straight into the destination's window at [s][token]
//             through NCCL's LSA pointers, the header stamped with the step's epoch; then CTA b
//             signals CTA b of every peer (a release flag in its window) and waits for theirs,
//             with a timeout. No counts, no host. Reference: a plan kernel gives each token's
//             index among the tokens sent to each rank; records packed locally at [r][index];
//             counts, then records, exchanged with grouped ncclSend/ncclRecv (counts read on the host).
//   receive   the valid records' (source, token, slot) -> local expert list, the single-GPU row
//             map over it (rows of an expert in (source, token, slot) order: the order one GPU
//             gives the same global tokens), the fan-out copy into (E_local, M, K).
//   combine   the owner sums its slots of a record (fp32, slot order, numerics::combine_step) into
//             one partial per (token, rank) and stores it at the source; signal/wait as above; the
//             source adds the partials in rank order and rounds once to bf16.
// Flags and epochs live in persistent workspace regions (never poisoned, zeroed at attach), so a
// step replays from a CUDA graph with nothing baked in. A silent peer sets the status
// (kStatusPeerTimeout) after timeout_ns; the kernel ends and check_status aborts the communicator.
// Teardown: one more signal/wait (phase 2) before the window is unmapped, bounded the same way.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cub/block/block_scan.cuh>
#include <cuda/atomic>
#include <string>
#include <thread>
#include <vector>

#include "cuda/backend.h"
#include "cuda/check.h"
#include "cuda/ep_launch.h"
#include "cuda/launch.h"
#include "cuda/pdl.cuh"
#include "cuda/quantize.cuh"
#include "cuda/row_map.cuh"
#include "cuda/sixteen_bit.cuh"
#include "cuda/status.cuh"
#include "numerics/activation.h"
#include "numerics/routing.h"
#include "plan/ep_layout.h"

namespace moekit::cuda {

class NcclGroup {
 public:
  Communicator* comm = nullptr;
  ncclComm_t nccl = nullptr;
  int rank = 0, size = 1, device = 0;
  ncclWindow_t window = nullptr;
  void* window_base = nullptr;
  ncclDevComm dev{};
  bool has_dev = false;
  bool aborted = false;
  std::string abort_reason;
  // Reference tier, this step's counts: pinned, so that reading them never blocks the host past the
  // bounded wait (a copy to pageable memory would wait for a peer that may never come).
  std::int32_t* host_counts = nullptr;  // [0, kMaxEpRanks) sent, [kMaxEpRanks, 2 kMaxEpRanks) received
  // ncclCommAbort runs on its own thread: it stops this rank's NCCL kernels at once, but with several
  // ranks in one process it also waits for their communicators, which must not block the caller.
  std::thread aborter;
  // The device-initiated transport's flags, for the teardown handshake (set at attach).
  bool has_teardown = false;
  EpStep teardown;

  std::int32_t sent(int r) const { return host_counts[r]; }
  std::int32_t received(int r) const { return host_counts[plan::kMaxEpRanks + r]; }

  ~NcclGroup() {
    if (std::getenv("MOEKIT_EP_TRACE")) std::fprintf(stderr, "moekit ep: rank %d ends its communicator\n", rank);
    if (host_counts != nullptr) (void)cudaFreeHost(host_counts);
    if (aborter.joinable())
      aborter.join();
    else if (nccl != nullptr)
      (void)ncclCommDestroy(nccl);
  }
};

namespace {

using numerics::DeviceMath;
using plan::kEpCtas;

void nccl_check(ncclResult_t r, const char* call, const std::string& hint = "") {
  if (r == ncclSuccess) return;
  MOEKIT_CUDA_REQUIRE(false, std::string("NCCL call ") + call + " failed: " + ncclGetErrorString(r) + " (" +
                                 (ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "") + ")" +
                                 (hint.empty() ? "" : ": " + hint));
}

std::string version_text(int code) {
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z for 2.9+.
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

void require_live(const NcclGroup& g) {
  MOEKIT_CUDA_REQUIRE(!g.aborted, "the NCCL communicator of this layer was aborted (" + g.abort_reason +
                                      "); build a new layer on every rank to continue");
}

// --- device helpers --------------------------------------------------------------------------------

__device__ __forceinline__ std::uint64_t global_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Where a destination rank's copy of a window offset is: a peer's window through NCCL's LSA mapping.
struct Window {
  ncclWindow_t win = nullptr;
  int lsa_base = 0;  // world rank of LSA rank 0
  __device__ __forceinline__ std::byte* peer(std::int64_t offset, int rank) const {
    return static_cast<std::byte*>(ncclGetLsaPointer(win, static_cast<size_t>(offset), rank - lsa_base));
  }
};

// A flag's top bit: the signalling rank had broken (s.broken) when it signalled.
constexpr std::uint64_t kPoison = std::uint64_t{1} << 63;

// Records why this rank broke (the first cause wins) and flags the step's status.
__device__ void mark_broken(const EpStep& s, std::int32_t why, int phase, int peer, int cta) {
  if (atomicCAS(s.broken, 0, why) == 0) {
    s.broken[1] = phase;
    s.broken[2] = peer;
    s.broken[3] = cta;
    __threadfence_system();
  }
  flag_status(s.status, kStatusPeerTimeout, phase, peer, cta);
}

// CTA b stores `epoch` into flag [phase][my rank][b] of every peer (after its stores, released at
// system scope) and waits until its own flags [phase][r][b] reach `epoch` for every r. Fail-stop:
// a peer silent past timeout_ns, or one whose flag carries the poison bit, breaks this rank for good
// (s.broken, sticky); a broken rank poisons every later signal and stops waiting in dispatch and
// combine, so a late peer raises instead of adding a partial computed without its records. The
// teardown (phase 2) always waits, bounded, and a poisoned flag counts as arrival there: a peer
// that reached its teardown no longer writes into this rank's window.
__device__ void signal_and_wait(const EpStep& s, const Window& w, int phase) {
  __threadfence_system();
  __syncthreads();
  const int b = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
  std::uint64_t* my_epoch = s.epochs + phase * kEpCtas + b;
  const std::uint64_t epoch = *my_epoch + 1;
  if (tid < s.ranks) {
    const bool broken = ::cuda::atomic_ref<std::int32_t, ::cuda::thread_scope_system>(*s.broken).load(
                            ::cuda::memory_order_acquire) != 0;
    const std::int64_t slot = (static_cast<std::int64_t>(phase) * s.ranks + s.rank) * kEpCtas + b;
    auto* flag = reinterpret_cast<std::uint64_t*>(w.peer(s.flags_offset + slot * 8, tid));
    ::cuda::atomic_ref<std::uint64_t, ::cuda::thread_scope_system>(*flag).store(broken ? epoch | kPoison : epoch,
                                                                                ::cuda::memory_order_release);
    std::uint64_t* mine = s.flags + (static_cast<std::int64_t>(phase) * s.ranks + tid) * kEpCtas + b;
    ::cuda::atomic_ref<std::uint64_t, ::cuda::thread_scope_system> ref(*mine);
    const std::uint64_t start = global_ns();
    const bool teardown = phase == 2;
    if (broken && !teardown) {
      flag_status(s.status, kStatusPeerTimeout, phase, tid, b);  // this step's data is not trusted either
    } else {
      for (;;) {
        const std::uint64_t v = ref.load(::cuda::memory_order_acquire);
        if ((v & kPoison) != 0 && !teardown && tid != s.rank) {
          mark_broken(s, kEpBrokenByPeer, phase, tid, b);
          break;
        }
        if ((v & ~kPoison) >= epoch) break;
        if (global_ns() - start > static_cast<std::uint64_t>(s.timeout_ns)) {
          mark_broken(s, kEpBrokenTimeout, phase, tid, b);
          break;
        }
      }
    }
  }
  __syncthreads();
  if (tid == 0) *my_epoch = epoch;
}

// --- plan (reference tier): send indices ------------------------------------------------------------

constexpr int kPlanThreads = 1024;

__device__ __forceinline__ bool valid_id(const EpStep& s, std::int32_t id) {
  return id >= 0 && id < s.E_local * s.ranks;
}

__device__ __forceinline__ std::uint64_t destinations_of(const EpStep& s, std::int64_t t) {
  std::uint64_t mask = 0;
  for (int k = 0; k < s.topk; ++k) {
    const std::int32_t id = s.topk_ids[t * s.topk + k];
    if (valid_id(s, id)) mask |= std::uint64_t{1} << (id / s.E_local);
  }
  return mask;
}

// One block: thread i holds tokens [i * per, (i + 1) * per). Four destinations at a time, their
// counts packed in 16-bit lanes of one uint64, one exclusive block scan each: the index of a token
// among the tokens sent to rank r is the count of earlier tokens with r (token order).
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(EpStep s) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  using Scan = cub::BlockScan<unsigned long long, kPlanThreads>;
  __shared__ typename Scan::TempStorage temp;
  const std::int64_t per = (s.tokens + kPlanThreads - 1) / kPlanThreads;
  const std::int64_t t0 = threadIdx.x * per, t1 = std::min<std::int64_t>(s.tokens, t0 + per);
  for (int r0 = 0; r0 < s.ranks; r0 += 4) {
    unsigned long long local = 0;
    for (std::int64_t t = t0; t < t1; ++t) {
      const std::uint64_t m = destinations_of(s, t);
      for (int q = 0; q < 4 && r0 + q < s.ranks; ++q)
        if (m >> (r0 + q) & 1) local += 1ull << (16 * q);
    }
    unsigned long long prefix = 0, total = 0;
    Scan(temp).ExclusiveSum(local, prefix, total);
    __syncthreads();
    for (std::int64_t t = t0; t < t1; ++t) {
      const std::uint64_t m = destinations_of(s, t);
      for (int q = 0; q < 4 && r0 + q < s.ranks; ++q) {
        const bool has = m >> (r0 + q) & 1;
        s.send_index[t * s.ranks + r0 + q] = has ? static_cast<std::int32_t>(prefix >> (16 * q) & 0xFFFF) : -1;
        if (has) prefix += 1ull << (16 * q);
      }
    }
    if (threadIdx.x == 0)
      for (int q = 0; q < 4 && r0 + q < s.ranks; ++q)
        s.send_count[r0 + q] = static_cast<std::int32_t>(total >> (16 * q) & 0xFFFF);
  }
}

// --- pack: each token quantized once, one record per destination rank ------------------------------

__global__ void __launch_bounds__(kQuantThreads) pack_kernel(EpStep s, Window w, bool device_initiated) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  __shared__ std::int32_t ids[plan::kMaxEpTopk];
  __shared__ float weights[plan::kMaxEpTopk];
  const plan::EpRecord rl = plan::ep_record(s.quant, s.K, s.topk);
  const bool scaled = has_activation_scales(recipe_info(s.quant));
  const bool fp16 = recipe_info(s.quant).activation_dtype == DType::kFp16;
  const int tid = static_cast<int>(threadIdx.x), K = static_cast<int>(s.K);
  const auto epoch = device_initiated ? static_cast<std::int32_t>(s.epochs[blockIdx.x] + 1) : 0;
  for (std::int64_t t = blockIdx.x; t < s.tokens; t += gridDim.x) {
    if (tid < s.topk) {
      ids[tid] = s.topk_ids[t * s.topk + tid];
      weights[tid] = s.topk_weights[t * s.topk + tid];
      if (ids[tid] != -1 && !valid_id(s, ids[tid]))
        flag_status(s.status, kStatusBadExpertId, static_cast<int>(t), tid, ids[tid]);
    }
    __syncthreads();
    // FP8: the row encoded once for every rank. Unquantized: the token's own bf16 row is the record's
    // row (rl.row_bytes = 2K; fp16: converted), copied to each rank; no scales.
    const auto* hidden = reinterpret_cast<const __nv_bfloat16*>(s.hidden) + t * s.K;
    QuantRow::Encoded codes{};
    if (scaled) {
      QuantRow row;
      row.load(hidden, K);
      codes = row.encode(s.quant, row.token_scale(s.quant), K);
    }
    int ordinal = 0;
    std::uint64_t destinations = 0;
    for (int r = 0; r < s.ranks; ++r) {
      std::int32_t mask = 0;
      for (int k = 0; k < s.topk; ++k)
        if (valid_id(s, ids[k]) && ids[k] / s.E_local == r) mask |= 1 << k;
      if (mask == 0) continue;
      destinations |= std::uint64_t{1} << r;
      std::byte* rec =
          device_initiated
              ? w.peer(s.recv_offset + (static_cast<std::int64_t>(s.rank) * s.max_tokens + t) * rl.bytes, r)
              : s.send + (static_cast<std::int64_t>(r) * s.max_tokens + s.send_index[t * s.ranks + r]) * rl.bytes;
      auto* hdr = reinterpret_cast<std::int32_t*>(rec);
      if (tid < s.topk) {
        const bool here = mask >> tid & 1;
        hdr[plan::kEpHeaderExperts + tid] = here ? static_cast<std::int32_t>(ids[tid] - r * s.E_local) : -1;
        reinterpret_cast<float*>(hdr)[plan::ep_header_weight(s.topk) + tid] = here ? weights[tid] : 0.0f;
      }
      if (tid == 0) {
        hdr[plan::kEpHeaderToken] = static_cast<std::int32_t>(t);
        hdr[plan::kEpHeaderSlotMask] = mask;
        hdr[plan::kEpHeaderOrdinal] = ordinal;
        hdr[plan::kEpHeaderEpoch] = epoch;
      }
      if (scaled) {
        QuantRow::write(codes, s.quant, K, reinterpret_cast<std::uint8_t*>(rec + rl.row_offset),
                        reinterpret_cast<float*>(rec + rl.scale_offset));
      } else if (fp16) {  // the fp16 recipe: the bf16 row rounded once to fp16 (numerics::fp16_encode)
        const auto* src = reinterpret_cast<const uint4*>(hidden);
        auto* dst = reinterpret_cast<uint4*>(rec + rl.row_offset);
        for (std::int64_t v = tid; v < rl.row_bytes / 16; v += blockDim.x) dst[v] = bf16_to_fp16_8(src[v]);
      } else {
        const auto* src = reinterpret_cast<const uint4*>(hidden);
        auto* dst = reinterpret_cast<uint4*>(rec + rl.row_offset);
        for (std::int64_t v = tid; v < rl.row_bytes / 16; v += blockDim.x) dst[v] = src[v];
      }
      ++ordinal;
    }
    if (tid == 0) s.token_destinations[t] = static_cast<std::int64_t>(destinations);  // for the final sum
    __syncthreads();
  }
  if (device_initiated) signal_and_wait(s, w, 0);
}

// --- receive: slot list, row map, fan-out -------------------------------------------------------------

// Whether record j from `src` belongs to this step: its epoch (device-initiated), or j below the
// count the source sent (reference).
__device__ __forceinline__ bool record_valid(const EpStep& s, bool device_initiated, const std::int32_t* hdr, int src,
                                             std::int64_t j) {
  if (device_initiated) return hdr[plan::kEpHeaderEpoch] == static_cast<std::int32_t>(s.epochs[0]);
  const std::int32_t count = s.recv_count[src];
  return j < count && count <= s.max_tokens;
}

__global__ void recv_ids_kernel(EpStep s, bool device_initiated) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const plan::EpRecord rl = plan::ep_record(s.quant, s.K, s.topk);
  const std::int64_t n = s.ranks * s.max_tokens;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int src = static_cast<int>(i / s.max_tokens);
    const std::int64_t j = i % s.max_tokens;
    if (!device_initiated && j == 0 && (s.recv_count[src] < 0 || s.recv_count[src] > s.max_tokens))
      flag_status(s.status, kStatusBadRecord, src, -1, s.recv_count[src]);
    const auto* hdr = reinterpret_cast<const std::int32_t*>(s.recv + i * rl.bytes);
    const bool valid = record_valid(s, device_initiated, hdr, src, j);
    for (int k = 0; k < s.topk; ++k) {
      std::int32_t e = valid ? hdr[plan::kEpHeaderExperts + k] : -1;
      if (e < -1 || e >= s.E_local) {
        flag_status(s.status, kStatusBadRecord, src, static_cast<int>(j), e);
        e = -1;
      }
      s.recv_ids[i * s.topk + k] = e;
    }
  }
}

// Small steps (at most kSmallMapPairs received slots): recv_ids_kernel and the three-kernel row map
// in one block, three graph nodes fewer. Tiles of kRowMapTile slots in order; a slot's rank among its
// expert's slots = the expert's slots in earlier tiles (a running count) + earlier warps of its tile
// + earlier lanes (__match_any_sync): the row map's (record, slot) order, the same rows.
// Each tile costs the block more than a graph node costs (measured on 2 H200s, docs/PERF.md): hence
// two tiles at most.
constexpr int kSmallMapPairs = kRowMapOneBlockTiles * kRowMapTile;

__global__ void __launch_bounds__(kRowMapTile) recv_map_kernel(EpStep s, bool device_initiated) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  extern __shared__ int smem[];
  const int E = static_cast<int>(s.E_local);
  int* seen = smem;                                                // E: the expert's slots so far
  auto* warp_first = reinterpret_cast<unsigned short*>(smem + E);  // the tile's ranking (row_map.cuh)
  const int tid = static_cast<int>(threadIdx.x);
  const plan::EpRecord rl = plan::ep_record(s.quant, s.K, s.topk);
  const std::int64_t pairs = s.ranks * s.max_tokens * s.topk;
  for (int e = tid; e < E; e += kRowMapTile) seen[e] = 0;
  __syncthreads();
  for (std::int64_t t0 = 0; t0 < pairs; t0 += kRowMapTile) {
    const std::int64_t i = t0 + tid;
    int e = -1;
    if (i < pairs) {
      const std::int64_t record = i / s.topk;
      const int k = static_cast<int>(i % s.topk), src = static_cast<int>(record / s.max_tokens);
      const std::int64_t j = record % s.max_tokens;
      if (!device_initiated && j == 0 && k == 0 && (s.recv_count[src] < 0 || s.recv_count[src] > s.max_tokens))
        flag_status(s.status, kStatusBadRecord, src, -1, s.recv_count[src]);
      const auto* hdr = reinterpret_cast<const std::int32_t*>(s.recv + record * rl.bytes);
      e = record_valid(s, device_initiated, hdr, src, j) ? hdr[plan::kEpHeaderExperts + k] : -1;
      if (e < -1 || e >= E) {
        flag_status(s.status, kStatusBadRecord, src, static_cast<int>(j), e);
        e = -1;
      }
      s.recv_ids[i] = e;
    }
    const int rank_in_step = rank_in_tile(e, E, warp_first, seen);  // + the earlier tiles' (seen)
    if (i < pairs) s.pair_row[i] = pair_row_of(e, rank_in_step, false, 0, s.M, s.status);  // the batched format
  }
  for (int e = tid; e < E; e += kRowMapTile)
    s.expert_num_tokens[e] = static_cast<std::int32_t>(std::min<std::int64_t>(seen[e], s.M));
}

constexpr int kCopyThreads = 256;

__global__ void __launch_bounds__(kCopyThreads) fan_out_kernel(EpStep s) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const plan::EpRecord rl = plan::ep_record(s.quant, s.K, s.topk);
  const std::int64_t n = s.ranks * s.max_tokens;
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const std::byte* rec = s.recv + i * rl.bytes;
    for (int k = 0; k < s.topk; ++k) {
      const std::int32_t row = s.pair_row[i * s.topk + k];  // -1 for records not of this step
      if (row < 0) continue;
      // The record's row as it is: K FP8 codes or K bf16 values (rl.row_bytes, a multiple of 16).
      const auto* src = reinterpret_cast<const uint4*>(rec + rl.row_offset);
      auto* dst = reinterpret_cast<uint4*>(s.a1q + static_cast<std::int64_t>(row) * rl.row_bytes);
      for (std::int64_t v = threadIdx.x; v < rl.row_bytes / 16; v += blockDim.x) dst[v] = src[v];
      const auto* scales = reinterpret_cast<const float*>(rec + rl.scale_offset);
      for (std::int64_t q = threadIdx.x; q < rl.scales_per_row; q += blockDim.x)
        s.a1q_scale[static_cast<std::int64_t>(row) * rl.scales_per_row + q] = scales[q];
    }
  }
}

// --- combine ----------------------------------------------------------------------------------------

// The owner's partial of each record of this step: its slots in order, numerics::combine_step,
// fp32 (zeros when every slot was dropped); stored at the source (device-initiated) or into the local
// send buffer (reference).
__global__ void __launch_bounds__(kCopyThreads) partial_kernel(EpStep s, Window w, bool device_initiated) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const plan::EpRecord rl = plan::ep_record(s.quant, s.K, s.topk);
  const std::int64_t n = s.ranks * s.max_tokens;
  const std::int64_t dmax = plan::ep_max_destinations(s.topk, s.ranks);
  const bool fp16_rows = recipe_info(s.quant).output_dtype == DType::kFp16;  // the experts' output rows
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int src = static_cast<int>(i / s.max_tokens);
    const std::int64_t j = i % s.max_tokens;
    const auto* hdr = reinterpret_cast<const std::int32_t*>(s.recv + i * rl.bytes);
    if (!record_valid(s, device_initiated, hdr, src, j)) continue;
    const std::int64_t t = hdr[plan::kEpHeaderToken], ordinal = hdr[plan::kEpHeaderOrdinal];
    if (t < 0 || t >= s.max_tokens || ordinal < 0 || ordinal >= dmax) {
      if (threadIdx.x == 0) flag_status(s.status, kStatusBadRecord, src, static_cast<int>(j), static_cast<int>(t));
      continue;
    }
    const float* wts = reinterpret_cast<const float*>(hdr) + plan::ep_header_weight(s.topk);
    float* dst = device_initiated
                     ? reinterpret_cast<float*>(w.peer(s.combine_recv_offset + (t * dmax + ordinal) * s.K * 4, src))
                     : s.combine_send + i * s.K;
    for (std::int64_t c0 = threadIdx.x * 8; c0 < s.K; c0 += blockDim.x * 8) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < s.topk; ++k) {
        const std::int32_t row = s.pair_row[i * s.topk + k];
        if (row < 0) continue;
        const float wk = wts[k];
        const uint4 raw = *reinterpret_cast<const uint4*>(s.expert_output + static_cast<std::int64_t>(row) * s.K + c0);
        float y[8];
        if (fp16_rows) {
#pragma unroll
          for (int q = 0; q < 8; ++q) y[q] = to_float(reinterpret_cast<const __half*>(&raw)[q]);
        } else {
#pragma unroll
          for (int q = 0; q < 8; ++q) y[q] = to_float(reinterpret_cast<const __nv_bfloat16*>(&raw)[q]);
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = numerics::combine_step<DeviceMath>(acc[q], wk, y[q]);
      }
      reinterpret_cast<float4*>(dst + c0)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      reinterpret_cast<float4*>(dst + c0)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  }
  if (device_initiated) signal_and_wait(s, w, 1);
}

// The source: partials in rank order, one bf16 rounding. A token routed nowhere gets 0.
__global__ void __launch_bounds__(kCopyThreads) final_kernel(EpStep s, bool device_initiated) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const std::int64_t vecs = s.K / 8, n = s.tokens * vecs;
  const std::int64_t dmax = plan::ep_max_destinations(s.topk, s.ranks);
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = idx / vecs, c0 = idx % vecs * 8;
    const auto mask = static_cast<std::uint64_t>(s.token_destinations[t]);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int ordinal = 0;
    for (int r = 0; r < s.ranks; ++r) {
      if (!(mask >> r & 1)) continue;
      const float* p =
          s.combine_recv + (device_initiated
                                ? (t * dmax + ordinal) * s.K
                                : (static_cast<std::int64_t>(r) * s.max_tokens + s.send_index[t * s.ranks + r]) * s.K);
      const float4 a = reinterpret_cast<const float4*>(p + c0)[0], b = reinterpret_cast<const float4*>(p + c0)[1];
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = DeviceMath::add(acc[q], v[q]);
      ++ordinal;
    }
    uint4 packed;
    auto* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int q = 0; q < 8; ++q) o[q] = __float2bfloat16_rn(acc[q]);
    *reinterpret_cast<uint4*>(s.output + t * s.K + c0) = packed;
  }
}

// Teardown: every rank's kernels are done with the peers' windows (phase 2, one CTA).
__global__ void leave_kernel(EpStep s, Window w) {
  pdl_enter();  // launched plainly (teardown): a no-op, for lint.pdl_rule
  signal_and_wait(s, w, 2);
}

int grid_for(std::int64_t work, int cap) {
  return static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(work, cap)));
}

// The host waits for `stream` at most `timeout_ns`; past it the communicator is aborted.
void wait_bounded(NcclGroup& g, cudaStream_t stream, std::int64_t timeout_ns, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) MOEKIT_CUDA_CHECK(e);
    ncclResult_t async = ncclSuccess;
    (void)ncclCommGetAsyncError(g.nccl, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      abort_nccl_group(g, std::string(what) + ": NCCL reported " + ncclGetErrorString(async));
      require_live(g);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      abort_nccl_group(g, std::string(what) + ": a peer did not answer within " + std::to_string(timeout_ns / 1000000) +
                              " ms (it died, raised, or runs another step)");
      require_live(g);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Before a collective NCCL call that a failed rank would never make (and the others would wait in
// for ever): every rank learns whether any rank failed its local step; all raise. Returns normally
// only when every rank succeeded.
void agree(Communicator& comm, const std::string& local_error, const std::string& step) {
  const std::int64_t failed = comm.all_reduce_max(local_error.empty() ? std::int64_t{-1} : std::int64_t{comm.rank()});
  const std::string prefix = "moekit: ";  // an Error's text already carries it
  MOEKIT_CUDA_REQUIRE(local_error.empty(),
                      local_error.rfind(prefix, 0) == 0 ? local_error.substr(prefix.size()) : local_error);
  MOEKIT_CUDA_REQUIRE(failed < 0, step + ": rank " + std::to_string(failed) +
                                      " failed (its own error says why); every rank stops here");
}

// One grouped exchange with every rank: to rank r, send_units(r) units from send + r * segment; from
// rank r, recv_units(r) units into recv + r * segment (unit_bytes each). Callers check the counts
// before: nothing throws inside the open group but NCCL itself.
template <class SendUnits, class RecvUnits>
void exchange(NcclGroup& g, const void* send, void* recv, std::int64_t segment_bytes, std::int64_t unit_bytes,
              SendUnits send_units, RecvUnits recv_units, cudaStream_t stream, const std::string& what) {
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  for (int r = 0; r < g.size; ++r) {
    const std::int64_t at = r * segment_bytes;
    nccl_check(ncclSend(static_cast<const std::byte*>(send) + at, static_cast<size_t>(send_units(r) * unit_bytes),
                        ncclUint8, r, g.nccl, stream),
               ("ncclSend (" + what + ")").c_str());
    nccl_check(ncclRecv(static_cast<std::byte*>(recv) + at, static_cast<size_t>(recv_units(r) * unit_bytes), ncclUint8,
                        r, g.nccl, stream),
               ("ncclRecv (" + what + ")").c_str());
  }
  nccl_check(ncclGroupEnd(), ("ncclGroupEnd (" + what + ")").c_str());
}

Window window_of(const NcclGroup& g) {
  return {g.window, g.dev.rank - g.dev.lsaRank};
}

void check_step(const EpStep& s, NcclGroup& g, bool device_initiated, cudaStream_t stream) {
  require_live(g);
  if (!device_initiated) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    MOEKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    MOEKIT_CUDA_REQUIRE(capturing == cudaStreamCaptureStatusNone,
                        "nccl-reference reads the counts on the host and cannot be captured in a CUDA graph: use "
                        "--dispatch nccl");
  }
  MOEKIT_CUDA_REQUIRE(s.ranks == g.size && s.rank == g.rank,
                      "the NCCL group has " + std::to_string(g.size) + " ranks, the step " + std::to_string(s.ranks));
  MOEKIT_CUDA_REQUIRE(!device_initiated || (g.window != nullptr && g.has_dev),
                      "the device-initiated transport needs its workspace in symmetric memory "
                      "(PrepareFinalize::workspace_memory)");
}

class SymmetricMemory final : public Memory {
 public:
  explicit SymmetricMemory(std::shared_ptr<NcclGroup> group)
      : group_(std::move(group)), device_(make_device_memory()) {}
  Device device() const override { return Device::kCuda; }
  void* allocate(std::int64_t bytes, std::string_view what) override {
    NcclGroup& g = *group_;
    require_live(g);
    MOEKIT_CUDA_REQUIRE(g.window == nullptr, "one symmetric allocation per NCCL group (the layer's workspace)");
    void* p = nullptr;
    const ncclResult_t r = ncclMemAlloc(&p, static_cast<size_t>(bytes > 0 ? bytes : 4096));
    std::string error;
    if (r != ncclSuccess) {
      std::size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      error = std::string("ncclMemAlloc failed: ") + ncclGetErrorString(r) + " for " + std::to_string(bytes) +
              " bytes of symmetric memory (" + std::string(what) + "); " + std::to_string(free_bytes) +
              " bytes free on the GPU. `moekit plan` shows where the bytes go";
      p = nullptr;
    }
    try {
      agree(*g.comm, error, "symmetric memory for the layer's workspace");  // window registration is collective
    } catch (...) {
      if (p != nullptr) (void)ncclMemFree(p);
      throw;
    }
    nccl_check(ncclCommWindowRegister(g.nccl, p, static_cast<size_t>(bytes > 0 ? bytes : 4096), &g.window,
                                      NCCL_WIN_COLL_SYMMETRIC),
               "ncclCommWindowRegister");
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));
    nccl_check(ncclDevCommCreate(g.nccl, &reqs, &g.dev), "ncclDevCommCreate",
               "NCCL offers no symmetric memory here (all GPUs of a node must reach each other by CUDA P2P, "
               "NCCL_WIN_ENABLE and cuMem on); use --dispatch nccl-reference");
    g.has_dev = true;
    g.window_base = p;
    MOEKIT_CUDA_REQUIRE(g.dev.lsaSize == g.size,
                        "rank " + std::to_string(g.rank) + " reaches " + std::to_string(g.dev.lsaSize) + " of " +
                            std::to_string(g.size) +
                            " ranks by NVLink load/store; the GPU-initiated network path (GIN) for the others is not "
                            "built yet: use --dispatch nccl-reference across nodes");
    return p;
  }
  void deallocate(void* p) noexcept override {
    NcclGroup& g = *group_;
    if (p == nullptr) return;
    (void)cudaSetDevice(g.device);  // the layer may be destroyed from another thread (a Python GC)
    const bool trace = std::getenv("MOEKIT_EP_TRACE") != nullptr;
    if (trace) std::fprintf(stderr, "moekit ep: rank %d frees its window (aborted %d)\n", g.rank, g.aborted ? 1 : 0);
    if (!g.aborted) {
      // Peers may still store into this window: every rank's kernels finish first, agreed through
      // one more flag handshake, bounded by the step timeout (a silent peer: leak, never hang).
      bool ok = cudaDeviceSynchronize() == cudaSuccess;
      if (ok && g.has_teardown && g.window != nullptr) {
        ok = cudaMemset(g.teardown.status, 0, kStatusWords * 4) == cudaSuccess;
        leave_kernel<<<1, 64>>>(g.teardown, window_of(g));
        std::int32_t status = 0;
        ok = cudaGetLastError() == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess &&
             cudaMemcpy(&status, g.teardown.status, 4, cudaMemcpyDeviceToHost) == cudaSuccess && status == kStatusOk;
      }
      if (trace) std::fprintf(stderr, "moekit ep: rank %d teardown handshake %s\n", g.rank, ok ? "ok" : "failed");
      if (ok) {
        if (g.has_dev) (void)ncclDevCommDestroy(g.nccl, &g.dev);
        if (g.window != nullptr) (void)ncclCommWindowDeregister(g.nccl, g.window);
      } else {
        abort_nccl_group(g, "a peer did not reach the teardown of the layer");
      }
    }
    g.has_dev = false;
    g.window = nullptr;
    g.window_base = nullptr;
    if (!g.aborted) (void)ncclMemFree(p);
  }
  void fill(void* dst, std::uint8_t byte, std::int64_t bytes, Stream stream) override {
    device_->fill(dst, byte, bytes, stream);
  }
  void to_host(void* dst, const void* src, std::int64_t bytes, Stream stream) override {
    device_->to_host(dst, src, bytes, stream);
  }
  void from_host(void* dst, const void* src, std::int64_t bytes, Stream stream) override {
    device_->from_host(dst, src, bytes, stream);
  }
  void synchronize(Stream stream) override { device_->synchronize(stream); }

 private:
  std::shared_ptr<NcclGroup> group_;
  std::unique_ptr<Memory> device_;
};

}  // namespace

bool nccl_built() {
  return true;
}

std::string nccl_compiled_version() {
  return version_text(NCCL_VERSION_CODE);
}

std::shared_ptr<NcclGroup> make_nccl_group(Communicator& comm) {
  auto g = std::make_shared<NcclGroup>();
  g->comm = &comm;
  g->rank = comm.rank();
  g->size = comm.size();
  std::string error;
  try {
    int loaded = 0;
    nccl_check(ncclGetVersion(&loaded), "ncclGetVersion");
    MOEKIT_CUDA_REQUIRE(loaded == NCCL_VERSION_CODE,
                        "moekit's kernels inline NCCL " + version_text(NCCL_VERSION_CODE) +
                            "'s device API, but this process loaded NCCL " + version_text(loaded) +
                            ": put the matching libnccl.so.2 first on the library path (e.g. LD_LIBRARY_PATH=<python "
                            "site-packages>/nvidia/nccl/lib for the nvidia-nccl-cu13 wheel)");
    MOEKIT_CUDA_CHECK(cudaGetDevice(&g->device));
    MOEKIT_CUDA_CHECK(cudaMallocHost(&g->host_counts, 2 * plan::kMaxEpRanks * sizeof(std::int32_t)));
  } catch (const Error& e) {
    error = e.what();
  }
  agree(comm, error, "the NCCL communicator");  // ncclCommInitRank is collective
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (comm.rank() == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  comm.broadcast(&id, sizeof(id), 0);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  nccl_check(ncclCommInitRankConfig(&g->nccl, comm.size(), id, comm.rank(), &config), "ncclCommInitRankConfig",
             "rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + " on CUDA device " +
                 std::to_string(g->device) + " (each rank needs its own GPU)");
  return g;
}

std::unique_ptr<Memory> make_symmetric_memory(std::shared_ptr<NcclGroup> group) {
  return std::make_unique<SymmetricMemory>(std::move(group));
}

void connect_nccl_peers(NcclGroup& g, void* stream_ptr) {
  require_live(g);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  std::int32_t* word = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&word, 8));
  const auto one = [](int) { return std::int64_t{1}; };
  exchange(g, word, word + 1, 0, sizeof(std::int32_t), one, one, stream, "connect");
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  (void)cudaFree(word);
}

void set_ep_teardown(NcclGroup& group, const EpStep& step) {
  group.teardown = step;
  group.has_teardown = true;
}

void abort_nccl_group(NcclGroup& group, const std::string& why) {
  if (group.aborted) return;
  group.aborted = true;
  group.abort_reason = why;
  if (group.nccl != nullptr)
    group.aborter = std::thread([comm = group.nccl, rank = group.rank] {
      if (std::getenv("MOEKIT_EP_TRACE")) std::fprintf(stderr, "moekit ep: rank %d ncclCommAbort...\n", rank);
      (void)ncclCommAbort(comm);
      if (std::getenv("MOEKIT_EP_TRACE")) std::fprintf(stderr, "moekit ep: rank %d ncclCommAbort done\n", rank);
    });
  group.nccl = nullptr;
}

double measure_peer_gbs(NcclGroup& g, void* stream_ptr) {
  require_live(g);
  if (g.size < 2) return 0.0;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const std::size_t bytes = std::size_t{256} << 20;
  void *send = nullptr, *recv = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&send, bytes));
  MOEKIT_CUDA_CHECK(cudaMalloc(&recv, bytes));
  MOEKIT_CUDA_CHECK(cudaMemsetAsync(send, 1, bytes, stream));
  const int to = (g.rank + 1) % g.size, from = (g.rank + g.size - 1) % g.size;
  auto once = [&] {
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    nccl_check(ncclSend(send, bytes, ncclUint8, to, g.nccl, stream), "ncclSend");
    nccl_check(ncclRecv(recv, bytes, ncclUint8, from, g.nccl, stream), "ncclRecv");
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  };
  for (int i = 0; i < 3; ++i) once();
  cudaEvent_t a, b;
  MOEKIT_CUDA_CHECK(cudaEventCreate(&a));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&b));
  constexpr int kReps = 10;
  MOEKIT_CUDA_CHECK(cudaEventRecord(a, stream));
  for (int i = 0; i < kReps; ++i) once();
  MOEKIT_CUDA_CHECK(cudaEventRecord(b, stream));
  MOEKIT_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  (void)cudaFree(send);
  (void)cudaFree(recv);
  return static_cast<double>(bytes) * kReps / (static_cast<double>(ms) * 1e6);
}

void launch_ep_dispatch(const EpStep& s, NcclGroup& g, bool device_initiated, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  check_step(s, g, device_initiated, stream);
  const plan::EpRecord rl = plan::ep_record(s.quant, s.K, s.topk);
  const Window w = device_initiated ? window_of(g) : Window{};
  MOEKIT_CUDA_REQUIRE(
      s.K % 16 == 0 && s.K <= kQuantThreads * 8 * kQuantChunks,
      "the NCCL dispatch takes rows of K a multiple of 16 and at most 8192 (its FP8 quantizer's bound, which the "
      "bf16 row copy shares), got " +
          std::to_string(s.K));
  if (!device_initiated) {
    launch_pdl(plan_kernel, 1, kPlanThreads, 0, stream, s);
    MOEKIT_CUDA_CHECK_LAUNCH();
  }
  // Device-initiated: exactly kEpCtas CTAs (each signals its twin on every peer), even with 0 tokens.
  launch_pdl(pack_kernel, device_initiated ? kEpCtas : grid_for(s.tokens, 4 * kEpCtas), kQuantThreads, 0, stream, s, w,
             device_initiated);
  MOEKIT_CUDA_CHECK_LAUNCH();
  if (!device_initiated) {
    const auto one = [](int) { return std::int64_t{1}; };
    exchange(g, s.send_count, s.recv_count, sizeof(std::int32_t), sizeof(std::int32_t), one, one, stream, "counts");
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(g.host_counts, s.send_count, 4 * s.ranks, cudaMemcpyDeviceToHost, stream));
    MOEKIT_CUDA_CHECK(
        cudaMemcpyAsync(g.host_counts + plan::kMaxEpRanks, s.recv_count, 4 * s.ranks, cudaMemcpyDeviceToHost, stream));
    wait_bounded(g, stream, s.timeout_ns, "nccl-reference dispatch (counts)");
    for (int r = 0; r < s.ranks; ++r)  // all checked before the group opens: nothing throws inside it
      MOEKIT_CUDA_REQUIRE(g.received(r) >= 0 && g.received(r) <= s.max_tokens,
                          "nccl-reference: rank " + std::to_string(r) + " sends " + std::to_string(g.received(r)) +
                              " records, over max_tokens_per_rank = " + std::to_string(s.max_tokens));
    exchange(
        g, s.send, s.recv, s.max_tokens * rl.bytes, rl.bytes, [&g](int r) { return std::int64_t{g.sent(r)}; },
        [&g](int r) { return std::int64_t{g.received(r)}; }, stream, "records");
  }
  const std::int64_t records = s.ranks * s.max_tokens;
  if (records * s.topk <= kSmallMapPairs) {
    const std::size_t smem = s.E_local * sizeof(int) + row_map_tile_smem(static_cast<int>(s.E_local));
    launch_pdl(recv_map_kernel, 1, kRowMapTile, smem, stream, s, device_initiated);
    MOEKIT_CUDA_CHECK_LAUNCH();
  } else {
    launch_pdl(recv_ids_kernel, grid_for((records + 255) / 256, 1024), 256, 0, stream, s, device_initiated);
    MOEKIT_CUDA_CHECK_LAUNCH();
    launch_row_map(s.recv_ids, records * s.topk, static_cast<int>(s.topk), static_cast<int>(s.E_local), false, s.M,
                   s.pair_row, s.expert_num_tokens, nullptr, s.row_map_tiles, s.status, stream);
  }
  launch_pdl(fan_out_kernel, grid_for(records, 4096), kCopyThreads, 0, stream, s);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void launch_ep_combine(const EpStep& s, NcclGroup& g, bool device_initiated, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  check_step(s, g, device_initiated, stream);
  const Window w = device_initiated ? window_of(g) : Window{};
  const std::int64_t records = s.ranks * s.max_tokens;
  launch_pdl(partial_kernel, device_initiated ? kEpCtas : grid_for(records, 4096), kCopyThreads, 0, stream, s, w,
             device_initiated);
  MOEKIT_CUDA_CHECK_LAUNCH();
  if (!device_initiated) {
    // Each received record's partial goes back to its source; each token sent comes back once.
    exchange(
        g, s.combine_send, s.combine_recv, s.max_tokens * s.K * 4, s.K * 4,
        [&g](int r) { return std::int64_t{g.received(r)}; }, [&g](int r) { return std::int64_t{g.sent(r)}; }, stream,
        "partials");
  }
  const std::int64_t work = s.tokens * (s.K / 8);
  if (work > 0) {
    launch_pdl(final_kernel, grid_for((work + kCopyThreads - 1) / kCopyThreads, 4096), kCopyThreads, 0, stream, s,
               device_initiated);
    MOEKIT_CUDA_CHECK_LAUNCH();
  }
  if (!device_initiated) wait_bounded(g, stream, s.timeout_ns, "nccl-reference combine");
}

}  // namespace moekit::cuda
