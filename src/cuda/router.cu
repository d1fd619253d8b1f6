// The Router seam's kernel on the GPU: one warp per token. Scores with the device-independent exp
// of numerics/routing.h, the softmax sum and the weights' sums taken in index order by lane 0 (as
// the CPU does), selection by exact warp argmax (higher score, then lower index): ids and weights
// equal cpu::route's bit for bit. Napkin math: DeepSeek-V3 (E = 256, top-8), one warp reads 1 KiB
// of logits and does 256 exps, ~8 x 8 compares and 256 adds in order: a few us per token, tokens
// in parallel. Latency is what counts at decode sizes (one token: ncu 18.7 us when each lane read
// its 8 logits one after another, each a trip to memory; docs/PERF.md).
#include <cuda_runtime.h>

#include "cuda/check.h"
#include "cuda/launch.h"
#include "cuda/status.cuh"
#include "numerics/routing.h"

namespace moekit::cuda {
namespace {

using numerics::DeviceMath;

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxExperts = kMaxRouteExperts;
constexpr int kMaxGroups = 32;

struct Params {
  int E, topk, n_group, topk_group;
  bool softmax, renormalize, grouped;
  float scale;
};

// Index of the best candidate of this warp (higher value, then lower index); -1 when none.
__device__ __forceinline__ int warp_argmax(float v, int idx) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    const int oi = __shfl_xor_sync(0xFFFFFFFFu, idx, o);
    if (oi >= 0 && (idx < 0 || ov > v || (ov == v && oi < idx))) {
      v = ov;
      idx = oi;
    }
  }
  return idx;
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    route_kernel(Params p, const float* __restrict__ logits, int T, const float* __restrict__ bias,
                 std::int32_t* __restrict__ ids, float* __restrict__ weights, std::int32_t* __restrict__ status) {
  extern __shared__ float smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  float* score = smem + warp * 2 * p.E;  // p (softmax) or s (sigmoid): the weights' source
  float* choice = score + p.E;           // what selection ranks: p, or s + bias when grouped
  __shared__ unsigned int taken[kWarpsPerBlock][kMaxExperts / 32];
  __shared__ float group_score[kWarpsPerBlock][kMaxGroups];
  for (int t = blockIdx.x * kWarpsPerBlock + warp; t < T; t += gridDim.x * kWarpsPerBlock) {
    // The token's logits into shared memory first, the loads unrolled so that they are in flight
    // together: one memory latency a token, not E / 32 of them (18.7 us a DeepSeek-V3 token before).
    {
      const float* x = logits + static_cast<std::int64_t>(t) * p.E;
#pragma unroll 8
      for (int e = lane; e < p.E; e += 32) score[e] = x[e];
      __syncwarp();
    }
    const float* x = score;  // the logits until the scores overwrite them, element by element
    // A NaN logit: flagged, the token routed nowhere.
    int nan_at = -1;
    for (int e = lane; e < p.E; e += 32)
      if (x[e] != x[e] && nan_at < 0) nan_at = e;
    const unsigned nan_lanes = __ballot_sync(0xFFFFFFFFu, nan_at >= 0);
    bool skip = false;
    if (nan_lanes != 0) {
      const int first = __shfl_sync(0xFFFFFFFFu, nan_at, __ffs(nan_lanes) - 1);
      if (lane == 0) flag_status(status, kStatusNanLogit, t, first);
      skip = true;
    }
    if (!skip && p.softmax) {
      float m = -INFINITY;
      for (int e = lane; e < p.E; e += 32) m = fmaxf(m, x[e]);
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
      if (!isfinite(m)) {
        if (lane == 0) flag_status(status, kStatusNoFiniteMax, t);
        skip = true;
      } else {
        for (int e = lane; e < p.E; e += 32) score[e] = numerics::exp_f32<DeviceMath>(x[e] - m);
        __syncwarp();
        float sum = 0.0f;
        if (lane == 0)
          for (int e = 0; e < p.E; ++e) sum = DeviceMath::add(sum, score[e]);  // index order, as the CPU
        sum = __shfl_sync(0xFFFFFFFFu, sum, 0);
        for (int e = lane; e < p.E; e += 32) choice[e] = score[e] = DeviceMath::div_rn(score[e], sum);
      }
    } else if (!skip) {
      for (int e = lane; e < p.E; e += 32) {
        score[e] = numerics::sigmoid_f32<DeviceMath>(x[e]);
        choice[e] = p.grouped && bias != nullptr ? DeviceMath::add(score[e], bias[e]) : score[e];
      }
    }
    if (skip) {
      for (int k = lane; k < p.topk; k += 32) {
        ids[static_cast<std::int64_t>(t) * p.topk + k] = -1;
        weights[static_cast<std::int64_t>(t) * p.topk + k] = 0.0f;
      }
      continue;
    }
    // Candidates: every expert, or those of the topk_group best groups (group score: the sum of its
    // two largest choices).
    for (int i = lane; i < kMaxExperts / 32; i += 32) taken[warp][i] = 0u;
    __syncwarp();
    if (p.grouped && p.n_group > 1) {
      const int group_size = p.E / p.n_group;
      if (lane < p.n_group) {
        float first = -INFINITY, second = -INFINITY;
#pragma unroll 8
        for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
          const float v = choice[e];
          if (v > first) {
            second = first;
            first = v;
          } else if (v > second) {
            second = v;
          }
        }
        group_score[warp][lane] = group_size >= 2 ? DeviceMath::add(first, second) : first;
      }
      __syncwarp();
      unsigned chosen = 0u;
      for (int j = 0; j < p.topk_group; ++j) {
        const bool open = lane < p.n_group && !((chosen >> lane) & 1u);
        const int g = warp_argmax(open ? group_score[warp][lane] : 0.0f, open ? lane : -1);
        chosen |= 1u << g;
      }
      // Experts of groups not chosen are taken out of the running.
      for (int e = lane; e < p.E; e += 32)
        if (!((chosen >> (e / group_size)) & 1u)) atomicOr(&taken[warp][e / 32], 1u << (e % 32));
      __syncwarp();
    }
    // Each lane keeps its best candidate (its experts lane, lane + 32, ... in ascending order: ties
    // keep the lower index); after a pick only the lane that held the winner looks again.
    auto lane_best = [&](float& best, int& best_e) {
      best = 0.0f;
      best_e = -1;
      for (int e = lane; e < p.E; e += 32) {
        if ((taken[warp][e / 32] >> (e % 32)) & 1u) continue;
        if (best_e < 0 || choice[e] > best) {
          best = choice[e];
          best_e = e;
        }
      }
    };
    float best;
    int best_e;
    lane_best(best, best_e);
    int chosen_ids[32];  // topk <= 32 (checked on the host)
    for (int k = 0; k < p.topk; ++k) {
      const int e = warp_argmax(best, best_e);
      chosen_ids[k] = e;
      if (e < 0) continue;  // fewer candidates than topk (the host's checks rule it out)
      if (lane == 0) taken[warp][e / 32] |= 1u << (e % 32);
      __syncwarp();
      if (e % 32 == lane) lane_best(best, best_e);
    }
    // Weights: the uncorrected scores of the chosen experts; their sum in slot order (lane 0).
    if (lane == 0) {
      float w[32], sum = 0.0f;
      for (int k = 0; k < p.topk; ++k) {
        w[k] = chosen_ids[k] >= 0 ? score[chosen_ids[k]] : 0.0f;
        sum = DeviceMath::add(sum, w[k]);
      }
      if (p.renormalize) {
        // DeepSeek adds 1e-20 to the denominator; softmax probabilities sum to > 0 by construction.
        const float denom = p.grouped ? DeviceMath::add(sum, 1e-20f) : sum;
        for (int k = 0; k < p.topk; ++k) w[k] = DeviceMath::div_rn(w[k], denom);
      }
      if (p.grouped)
        for (int k = 0; k < p.topk; ++k) w[k] = DeviceMath::mul(w[k], p.scale);
      for (int k = 0; k < p.topk; ++k) {
        ids[static_cast<std::int64_t>(t) * p.topk + k] = chosen_ids[k];
        weights[static_cast<std::int64_t>(t) * p.topk + k] = w[k];
      }
    }
    __syncwarp();
  }
}

}  // namespace

void launch_route(const RoutingConfig& c, const float* logits, std::int64_t num_tokens, const float* bias,
                  std::int32_t* ids, float* weights, std::int32_t* status, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  MOEKIT_CUDA_REQUIRE(c.num_experts <= kMaxExperts && c.topk <= 32 && c.n_group <= kMaxGroups,
                      "the CUDA router takes E <= 1024, topk <= 32 and n_group <= 32");
  clear_status_words(status, stream);
  if (num_tokens == 0) return;
  const Params p{static_cast<int>(c.num_experts),
                 static_cast<int>(c.topk),
                 static_cast<int>(c.n_group),
                 static_cast<int>(c.topk_group),
                 c.scoring == Scoring::kSoftmax,
                 c.renormalize,
                 c.grouped,
                 static_cast<float>(c.routed_scaling_factor)};
  // 4 warps x 2 x 1024 floats = 32 KiB at most: under the default 48 KiB of dynamic shared memory.
  const std::size_t smem = static_cast<std::size_t>(kWarpsPerBlock) * 2 * c.num_experts * sizeof(float);
  const int blocks =
      static_cast<int>(std::min<std::int64_t>((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock, 65535));
  route_kernel<<<blocks, kWarpsPerBlock * 32, smem, stream>>>(p, logits, static_cast<int>(num_tokens), bias, ids,
                                                              weights, status);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::cuda
