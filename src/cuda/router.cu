// The Router seam's kernels on the GPU. Up to cuda::kRouteBlockPerTokenMax tokens (decode), one block
// per token, one thread per expert; beyond, one warp per token (throughput). Scores with the
// device-independent exp of numerics/routing.h, the softmax sum and the weights' sums taken in
// index order by one thread (as the CPU does), selection by exact argmax (higher score, then lower
// index): ids and weights equal cpu::route's bit for bit. Latency is what counts at decode sizes:
// each phase of the block kernel is a few dependent steps of parallel work (one score a thread;
// each group's top two by shared-memory max reductions; the chosen groups and the top-k by ranks:
// each candidate counts the candidates above it, independent comparisons instead of a chain of
// argmax reductions; a thread a slot for the weights). The warp kernel alone runs thousands of
// dependent warp instructions for a DeepSeek-V3 token (docs/PERF.md).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>

#include "cuda/check.h"
#include "cuda/launch.h"
#include "cuda/pdl.cuh"
#include "cuda/status.cuh"
#include "numerics/routing.h"

namespace moekit::cuda {
namespace {

using numerics::DeviceMath;

constexpr int kMaxExperts = kMaxRouteExperts;
constexpr int kMaxWarps = kMaxExperts / 32;
constexpr int kMaxGroups = 32;
constexpr int kMaxTopk = 32;

struct Params {
  int E, topk, n_group, topk_group;
  bool softmax, renormalize, correction_bias, group_max;
  float epsilon, scale;
};

// A float's rank as an unsigned key: a > b as floats iff key(a) > key(b), and -0 ties with +0 as
// they compare equal. The choices are never NaN (logits are checked, the bias must be finite).
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned b = __float_as_uint(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

// A candidate's selection key: higher value first, then lower index; unique per index, and above 0
// (0 stands for no candidate). The block kernel ranks these.
__device__ __forceinline__ unsigned long long rank_key(float v, int idx) {
  return (static_cast<unsigned long long>(order_key(v)) << 32) | (0xFFFFFFFFu - static_cast<unsigned>(idx));
}

// Index of the best candidate of this warp (higher value, then lower index); -1 when none (idx <
// 0). Two warp reductions (REDUX): the highest key, then the lowest index holding it.
__device__ __forceinline__ int warp_argmax(float v, int idx) {
  const unsigned key = idx >= 0 ? order_key(v) : 0u;
  const unsigned best = __reduce_max_sync(0xFFFFFFFFu, key);
  const int i = __reduce_min_sync(0xFFFFFFFFu, idx >= 0 && key == best ? idx : INT_MAX);
  return i == INT_MAX ? -1 : i;
}

// A token's weights are the uncorrected scores of the chosen experts, normalized by their sum taken
// in slot order (as the CPU does). A chosen id of -1 (fewer candidates than topk, which the host's
// checks rule out) weighs 0.
__device__ __forceinline__ float chosen_score(const int* chosen, const float* score, int k) {
  return chosen[k] >= 0 ? score[chosen[k]] : 0.0f;
}
__device__ __forceinline__ float slot_sum(const Params& p, const int* chosen, const float* score) {
  float sum = 0.0f;
  for (int k = 0; k < p.topk; ++k) sum = DeviceMath::add(sum, chosen_score(chosen, score, k));
  return sum;
}
// Slot k's weight from its score and the slots' sum.
__device__ __forceinline__ float slot_weight(const Params& p, float w, float sum) {
  // DeepSeek-V3 and GLM add 1e-20 to the denominator (epsilon); a scale of 1 is exact.
  if (p.renormalize) w = DeviceMath::div_rn(w, p.epsilon > 0.0f ? DeviceMath::add(sum, p.epsilon) : sum);
  return DeviceMath::mul(w, p.scale);
}

// Token t's ids and weights, by one thread (the warp kernel).
__device__ void write_token(const Params& p, const int* chosen, const float* score, int t, std::int32_t* ids,
                            float* weights) {
  const float sum = slot_sum(p, chosen, score);
  for (int k = 0; k < p.topk; ++k) {
    ids[static_cast<std::int64_t>(t) * p.topk + k] = chosen[k];
    weights[static_cast<std::int64_t>(t) * p.topk + k] = slot_weight(p, chosen_score(chosen, score, k), sum);
  }
}

// Many tokens: a warp a token (the kernel before the block-a-token one; its throughput is higher
// when the blocks of one token each would take several waves).
constexpr int kWarpsPerBlock = 4;
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    route_warp_kernel(Params p, const float* __restrict__ logits, int T, const float* __restrict__ bias,
                      std::int32_t* __restrict__ ids, float* __restrict__ weights, std::int32_t* __restrict__ status) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  extern __shared__ float smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  float* score = smem + warp * 2 * p.E;  // p (softmax) or s (sigmoid): the weights' source
  float* choice = score + p.E;           // what selection ranks: s, or s + bias (correction_bias)
  __shared__ unsigned int taken[kWarpsPerBlock][kMaxExperts / 32];
  __shared__ float group_score[kWarpsPerBlock][kMaxGroups];
  for (int t = blockIdx.x * kWarpsPerBlock + warp; t < T; t += gridDim.x * kWarpsPerBlock) {
    const float* x = logits + static_cast<std::int64_t>(t) * p.E;
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
        choice[e] = p.correction_bias && bias != nullptr ? DeviceMath::add(score[e], bias[e]) : score[e];
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
    // two largest choices, or its largest).
    for (int i = lane; i < kMaxExperts / 32; i += 32) taken[warp][i] = 0u;
    __syncwarp();
    if (p.n_group > 1) {
      const int group_size = p.E / p.n_group;
      if (lane < p.n_group) {
        float first = -INFINITY, second = -INFINITY;
        for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
          const float v = choice[e];
          if (v > first) {
            second = first;
            first = v;
          } else if (v > second) {
            second = v;
          }
        }
        group_score[warp][lane] = !p.group_max && group_size >= 2 ? DeviceMath::add(first, second) : first;
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
    int chosen_ids[kMaxTopk];  // topk <= 32 (checked on the host)
    for (int k = 0; k < p.topk; ++k) {
      float best = 0.0f;
      int best_e = -1;
      for (int e = lane; e < p.E; e += 32) {
        if ((taken[warp][e / 32] >> (e % 32)) & 1u) continue;
        if (best_e < 0 || choice[e] > best) {  // ascending e per lane: ties keep the lower index
          best = choice[e];
          best_e = e;
        }
      }
      const int e = warp_argmax(best, best_e);
      chosen_ids[k] = e;
      if (lane == 0) taken[warp][e / 32] |= 1u << (e % 32);
      __syncwarp();
    }
    if (lane == 0) write_token(p, chosen_ids, score, t, ids, weights);
    __syncwarp();
  }
}

struct Shared {
  float score[kMaxExperts];   // p (softmax) or s (sigmoid): the weights' source
  float choice[kMaxExperts];  // what selection ranks: s, or s + bias (correction_bias)
  float group_score[kMaxGroups];
  float warp_max[kMaxWarps];
  // Selection keys (rank_key): each expert's, then each warp's top-k (0: none), by warp and rank.
  unsigned long long key[kMaxExperts];
  unsigned long long candidate[kMaxWarps * kMaxTopk];
  int chosen[kMaxTopk];
  unsigned long long group_first[kMaxGroups], group_second[kMaxGroups];  // (key, ~index) of each group's top 2
  int first_nan;
  float max, sum;
  unsigned groups;  // the chosen groups' bits
};

__global__ void __launch_bounds__(kMaxExperts)
    route_kernel(Params p, const float* __restrict__ logits, int T, const float* __restrict__ bias,
                 std::int32_t* __restrict__ ids, float* __restrict__ weights, std::int32_t* __restrict__ status) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  __shared__ Shared sh;
  const int e = static_cast<int>(threadIdx.x);  // this thread's expert (e >= E: a placeholder)
  const int warp = e / 32, lane = e % 32, warps = static_cast<int>(blockDim.x) / 32;
  const bool mine = e < p.E;
  for (int t = static_cast<int>(blockIdx.x); t < T; t += static_cast<int>(gridDim.x)) {
    const float x = mine ? logits[static_cast<std::int64_t>(t) * p.E + e] : 0.0f;
    if (e == 0) sh.first_nan = p.E;
    __syncthreads();
    // A NaN logit: flagged (the first one), the token routed nowhere.
    if (mine && x != x) atomicMin(&sh.first_nan, e);
    __syncthreads();
    bool skip = sh.first_nan < p.E;
    if (skip && e == 0) flag_status(status, kStatusNanLogit, t, sh.first_nan);
    if (!skip && p.softmax) {
      float m = mine ? x : -INFINITY;
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
      if (lane == 0) sh.warp_max[warp] = m;
      __syncthreads();
      if (e == 0) {
        float all = -INFINITY;
        for (int w = 0; w < warps; ++w) all = fmaxf(all, sh.warp_max[w]);
        sh.max = all;
      }
      __syncthreads();
      m = sh.max;
      if (!isfinite(m)) {
        if (e == 0) flag_status(status, kStatusNoFiniteMax, t);
        skip = true;
      } else {
        if (mine) sh.score[e] = numerics::exp_f32<DeviceMath>(x - m);
        __syncthreads();
        if (e == 0) {
          float sum = 0.0f;
          for (int i = 0; i < p.E; ++i) sum = DeviceMath::add(sum, sh.score[i]);  // index order, as the CPU
          sh.sum = sum;
        }
        __syncthreads();
        if (mine) sh.choice[e] = sh.score[e] = DeviceMath::div_rn(sh.score[e], sh.sum);
      }
    } else if (!skip && mine) {
      sh.score[e] = numerics::sigmoid_f32<DeviceMath>(x);
      sh.choice[e] = p.correction_bias && bias != nullptr ? DeviceMath::add(sh.score[e], bias[e]) : sh.score[e];
    }
    if (skip) {  // uniform across the block
      if (e < p.topk) {
        ids[static_cast<std::int64_t>(t) * p.topk + e] = -1;
        weights[static_cast<std::int64_t>(t) * p.topk + e] = 0.0f;
      }
      __syncthreads();
      continue;
    }
    __syncthreads();
    // Candidates: every expert, or those of the topk_group best groups (group score: the sum of its
    // two largest choices, or its largest), chosen by warp 0.
    bool open = mine;
    if (p.n_group > 1) {
      // Each group's two largest choices, by two shared-memory max reductions over unique 64-bit
      // keys (value, then lower index): the largest, then the largest of the others.
      const int group_size = p.E / p.n_group, g = mine ? e / group_size : 0;
      const unsigned long long key = mine ? (static_cast<unsigned long long>(order_key(sh.choice[e])) << 32) |
                                                (0xFFFFFFFFu - static_cast<unsigned>(e))
                                          : 0ull;
      if (e < p.n_group) sh.group_first[e] = sh.group_second[e] = 0ull;
      __syncthreads();
      if (mine) atomicMax(&sh.group_first[g], key);
      __syncthreads();
      if (mine && key != sh.group_first[g]) atomicMax(&sh.group_second[g], key);
      __syncthreads();
      if (e < p.n_group) {
        const float first = sh.choice[0xFFFFFFFFu - static_cast<unsigned>(sh.group_first[e] & 0xFFFFFFFFu)];
        const float second =
            group_size >= 2 ? sh.choice[0xFFFFFFFFu - static_cast<unsigned>(sh.group_second[e] & 0xFFFFFFFFu)] : first;
        sh.group_score[e] = !p.group_max && group_size >= 2 ? DeviceMath::add(first, second) : first;
      }
      __syncthreads();
      if (warp == 0) {  // a group is chosen when fewer than topk_group groups rank above it
        const unsigned long long gkey = lane < p.n_group ? rank_key(sh.group_score[lane], lane) : 0ull;
        int above = 0;
        for (int j = 0; j < p.n_group; ++j) above += rank_key(sh.group_score[j], j) > gkey;
        const unsigned chosen = __ballot_sync(0xFFFFFFFFu, lane < p.n_group && above < p.topk_group);
        if (lane == 0) sh.groups = chosen;
      }
      __syncthreads();
      open = mine && ((sh.groups >> (e / group_size)) & 1u);
    }
    // The top-k by ranks, in two rounds of independent comparisons (no chain of dependent argmax
    // reductions): each open expert's rank among its warp's 32 (the experts above it), the warp's
    // top-k as candidates; then each candidate's rank among all candidates, which is its slot. Keys
    // are unique and order as the CPU's selection does (higher choice, then lower index), so the
    // slots are the CPU's.
    const unsigned long long key = open ? rank_key(sh.choice[e], e) : 0ull;
    sh.key[e] = key;
    for (int c = e; c < warps * p.topk; c += static_cast<int>(blockDim.x)) sh.candidate[c] = 0ull;
    if (e < p.topk) sh.chosen[e] = -1;
    __syncthreads();
    if (open) {
      int above = 0;
      for (int j = 0; j < 32; ++j) above += sh.key[warp * 32 + j] > key;
      if (above < p.topk) sh.candidate[warp * p.topk + above] = key;
    }
    __syncthreads();
    for (int c = e; c < warps * p.topk; c += static_cast<int>(blockDim.x)) {
      const unsigned long long ck = sh.candidate[c];
      if (ck == 0ull) continue;
      int above = 0;
      for (int j = 0; j < warps * p.topk; ++j) above += sh.candidate[j] > ck;
      if (above < p.topk) sh.chosen[above] = static_cast<int>(0xFFFFFFFFu - static_cast<unsigned>(ck & 0xFFFFFFFFu));
    }
    __syncthreads();
    if (e == 0) sh.sum = slot_sum(p, sh.chosen, sh.score);
    __syncthreads();
    if (e < p.topk) {  // a thread a slot
      ids[static_cast<std::int64_t>(t) * p.topk + e] = sh.chosen[e];
      weights[static_cast<std::int64_t>(t) * p.topk + e] = slot_weight(p, chosen_score(sh.chosen, sh.score, e), sh.sum);
    }
    __syncthreads();  // the next token reuses the shared arrays
  }
}

// Router::route_shared: a warp a token; lane l sums columns l, l + 32, ... in order, the xor
// butterfly adds the lanes as numerics::shared_gate_reduce does.
__global__ void route_shared_kernel(const __nv_bfloat16* __restrict__ hidden, int tokens, int K,
                                    const __nv_bfloat16* __restrict__ gate, std::int32_t* __restrict__ ids,
                                    float* __restrict__ weights) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const int lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  for (int t = blockIdx.x * warps + threadIdx.x / 32; t < tokens; t += gridDim.x * warps) {
    float w = 1.0f;
    if (gate != nullptr) {
      const __nv_bfloat16* h = hidden + static_cast<std::int64_t>(t) * K;
      float acc = 0.0f;
      for (int c = lane; c < K; c += 32)
        acc = numerics::shared_gate_lane<DeviceMath>(acc, __bfloat162float(h[c]), __bfloat162float(gate[c]));
      for (int offset = 16; offset > 0; offset /= 2)
        acc = DeviceMath::add(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, offset));
      w = numerics::sigmoid_f32<DeviceMath>(acc);
    }
    if (lane == 0) {
      ids[t] = 0;
      weights[t] = w;
    }
  }
}

}  // namespace

void launch_route_shared(const std::uint16_t* hidden, std::int64_t num_tokens, std::int64_t K,
                         const std::uint16_t* gate, std::int32_t* ids, float* weights, void* stream) {
  if (num_tokens == 0) return;
  constexpr int kWarps = 8;
  const int blocks = static_cast<int>(std::min<std::int64_t>((num_tokens + kWarps - 1) / kWarps, 8192));
  launch_pdl(route_shared_kernel, blocks, kWarps * 32, 0, static_cast<cudaStream_t>(stream),
             reinterpret_cast<const __nv_bfloat16*>(hidden), static_cast<int>(num_tokens), static_cast<int>(K),
             reinterpret_cast<const __nv_bfloat16*>(gate), ids, weights);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void launch_route(const RoutingConfig& c, const float* logits, std::int64_t num_tokens, const float* bias,
                  std::int32_t* ids, float* weights, std::int32_t* status, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  MOEKIT_CUDA_REQUIRE(c.num_experts <= kMaxExperts && c.topk <= 32 && c.n_group <= kMaxGroups,
                      "the CUDA router takes E <= 1024, topk <= 32 and n_group <= 32");
  if (num_tokens == 0) return;
  const Params p{static_cast<int>(c.num_experts),
                 static_cast<int>(c.topk),
                 static_cast<int>(c.n_group),
                 static_cast<int>(c.topk_group),
                 c.scoring == Scoring::kSoftmax,
                 c.renormalize,
                 c.correction_bias,
                 c.group_score == GroupScore::kMax,
                 static_cast<float>(c.renormalize_epsilon),
                 static_cast<float>(c.routed_scaling_factor)};
  if (num_tokens > kRouteBlockPerTokenMax) {
    // 4 warps x 2 x 1024 floats = 32 KiB at most: under the default 48 KiB of dynamic shared memory.
    const std::size_t smem = static_cast<std::size_t>(kWarpsPerBlock) * 2 * c.num_experts * sizeof(float);
    const int blocks =
        static_cast<int>(std::min<std::int64_t>((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock, 65535));
    launch_pdl(route_warp_kernel, blocks, kWarpsPerBlock * 32, smem, stream, p, logits, static_cast<int>(num_tokens),
               bias, ids, weights, status);
  } else {
    // A block a token, a thread an expert.
    const int threads = (static_cast<int>(c.num_experts) + 31) / 32 * 32;
    launch_pdl(route_kernel, static_cast<int>(num_tokens), threads, 0, stream, p, logits, static_cast<int>(num_tokens),
               bias, ids, weights, status);
  }
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::cuda
