// The launchers of the CUDA backend, as the host classes (src/cuda/*.cpp) call them: raw pointers,
// sizes and a stream (void*, a cudaStream_t), no CUDA or CUTLASS type. Defined in the .cu files, or
// in no_cuda.cpp (raising moekit::Error) when moekit is built without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>

#include "moekit/problem.h"
#include "moekit/router.h"
#include "moekit/weights.h"
#include "plan/gemm_config.h"

namespace moekit::cuda {

// Bytes of one group's grouped-GEMM arguments (problem shape, A/B/D and scale pointers, strides),
// written on the device from expert_num_tokens; the CUTLASS instances static_assert that theirs fit.
inline constexpr std::int64_t kGemmArgsBytesPerGroup = 128;
// CUTLASS's own workspace (tile-scheduler state). A bound: each launch checks get_workspace_size()
// against it and raises moekit::Error if a kernel ever asks for more.
inline constexpr std::int64_t kGemmScratchBytes = std::int64_t{1} << 20;
// Device-side error flags of a seam (its status region, persistent: zero when the workspace is built),
// read back after a step: [0] the first error's code (the first to set it wins), [1..3] its values.
// Kernels never stop on an error: the offending token, pair or expert is dropped (nothing is written
// out of bounds) and the host raises moekit::Error after the step (check_status in the seams). No
// step clears them: a flag raised in any step (or graph replay) stays until check_status reads it,
// and reading an error clears it. (Clearing them at each step's start cost three graph nodes, ~4 us of
// a decode step, and lost the flags of steps nobody checked: docs/PERF.md.)
inline constexpr std::int64_t kStatusWords = 8;
enum StatusCode : std::int32_t {
  kStatusOk = 0,
  kStatusBadCount = 1,       // expert, expert_num_tokens[expert]: outside [0, M]
  kStatusBadExpertId = 2,    // token, slot, id: outside [0, E) (and not -1)
  kStatusNanLogit = 3,       // token, expert
  kStatusNoFiniteMax = 4,    // token: every logit -inf, or one +inf, under softmax
  kStatusOverCapacity = 5,   // expert, its rows: more than M (a token chose the expert twice)
  kStatusPeerTimeout = 6,    // phase (0 dispatch, 1 combine), peer rank, CTA: a peer never signalled
  kStatusBadRecord = 7,      // source rank, record (-1: its count), value: a received record is corrupt
  kStatusOverStepBound = 8,  // expert, its rows, the step's bound: more rows than the step was planned for
};
// Synchronizes `stream`, reads the status words at `device_status` and raises moekit::Error for the
// first error they hold, naming `who` and the limits (M rows per expert, E experts); the words are
// zeroed before it raises.
void check_status_words(std::int32_t* device_status, const char* who, std::int64_t M, std::int64_t E, void* stream);
void read_status_words(const std::int32_t* device_status, std::int32_t* host, void* stream);  // synchronizes
void clear_status_words(std::int32_t* device_status, void* stream);

// One step of the FP8 experts, every pointer on the device: the regions the batched or standard
// experts declared (cuda/batched_experts.cpp, cuda/standard_experts.cpp). Batched: expert g's rows
// start at g * M. Contiguous (standard): at row_offsets[g], the prefix of the counts.
struct BatchedExpertsLaunch {
  MoeProblem problem;
  ExpertWeightsView weights;
  bool contiguous = false;
  const std::uint8_t* a1q = nullptr;  // batched a1q, or the standard experts' a1q_permuted (FP8 or bf16 bytes)
  const float* a1q_scale = nullptr;   // null without activation scales
  const std::int32_t* expert_num_tokens = nullptr;  // counts per local expert
  std::uint16_t* output = nullptr;                  // batched expert_output, or the standard experts' w2_out
  std::uint16_t* w1_out = nullptr;                  // null in the fused recipe
  float* w1_small = nullptr;                        // the fused recipe's small experts' fp32 W1 rows (gemms.w1_small)
  std::uint8_t* act_q = nullptr;                    // act_q (FP8 codes), or the 16-bit recipe's bf16 act as bytes
  float* act_scale = nullptr;                       // null without activation scales
  std::byte* gemm_args_w1 = nullptr;
  std::byte* gemm_args_w2 = nullptr;
  std::byte* gemm_scratch = nullptr;
  std::int32_t* row_offsets = nullptr;  // (E_local + 1): first valid row of each expert, over valid rows only
  std::int32_t* status = nullptr;
  plan::ExpertsGemmPlan gemms{};
  // The most rows an expert may hold in this step (plan::max_rows_per_expert of the step's tokens):
  // the launches of `gemms` cover no more. An expert past it runs with 0 rows and is flagged
  // (kStatusOverStepBound). Default: no bound past the expert's capacity.
  std::int64_t max_rows = std::numeric_limits<std::int64_t>::max();
  int num_sms = 0;
};

// The stages: prepare (reads expert_num_tokens once, validates it, writes row_offsets and both
// GEMMs' arguments), W1 GEMM, activation + FP8, W2 GEMM. launch_batched_experts runs all four, or
// three when gemms.fused_w1 and no expert runs into w1_small (the W1 GEMM's epilogue writes act_q /
// act_scale; w1_out is null). With gemms.w1_small the activation runs on w1_small's experts only.
void launch_batched_experts(const BatchedExpertsLaunch& l, void* stream);
void launch_experts_prepare(const BatchedExpertsLaunch& l, void* stream);
void launch_experts_gemm(const BatchedExpertsLaunch& l, int which, void* stream);  // which: 1 (W1) or 2 (W2)
// kAuto picks the measured best for the problem (docs/PERF.md).
enum class ActivationKernel { kAuto, kGeneric, kRowPerBlock };
void launch_activation_quant(const BatchedExpertsLaunch& l, ActivationKernel kernel, void* stream);

int current_device_num_sms();

// --- streams, events, graphs and the machine's ceilings, for benchmarks (runtime.cu) ---------------

void* create_stream();
void destroy_stream(void* stream);
// A CUDA graph captured from what `enqueue` puts on `stream`, replayed as one launch.
class Graph {
 public:
  Graph(const std::function<void(void*)>& enqueue, void* stream);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void replay(void* stream);

 private:
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(void* stream);
  float ms_since(const Event& start) const;  // synchronizes this event
 private:
  void* event_ = nullptr;
};
// The median time of `fn` (what it enqueues on `stream`) over `reps` runs after 3 warm-up runs.
double median_ms(int reps, const std::function<void()>& fn, void* stream);

// --- routing and dispatch (router.cu, dispatch.cu) ---------------------------------------------------

// The Router seam's kernel: one warp per token, the CPU's arithmetic in the CPU's order
// (numerics/routing.h), so ids and weights equal cpu::route's bit for bit. A NaN logit (or no finite
// maximum under softmax) flags the status and routes the token nowhere (ids -1, weights 0).
void launch_route(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
                  std::int32_t* topk_ids, float* topk_weights, std::int32_t* status, void* stream);
// Router::route_shared: a warp a token, numerics::shared_gate_*'s order (the CPU's bits).
void launch_route_shared(const std::uint16_t* hidden, std::int64_t num_tokens, std::int64_t K,
                         const std::uint16_t* gate, std::int32_t* topk_ids, float* topk_weights, void* stream);
inline constexpr int kMaxRouteExperts = 1024;  // the router kernels: a thread an expert at most
// Up to this many tokens the router runs a block a token (latency), more a warp a token
// (throughput); measured, the two cross near 700 tokens, where either is a negligible share of the
// layer's step (docs/PERF.md). Tests cover both.
inline constexpr std::int64_t kRouteBlockPerTokenMax = 512;

// Where each (token, slot) pair's row goes, in the CPU's order: rows of one expert in (token, slot)
// order. ids (num_pairs = tokens * topk) are in [0, num_experts) or -1 (none). Batched
// (contiguous == false): row = e * capacity + rank, counts[e] = min(rows, capacity) (a pair past
// capacity is flagged and dropped). Contiguous: row = offsets[e] + rank, offsets (num_experts + 1).
// pair_row[i] = -1 for a dropped or absent pair. Tiles of 1024 pairs ranked in parallel, integer
// atomics only where order cannot matter: deterministic. tile_scratch holds
// row_map_scratch_ints(num_pairs, num_experts) ints (a workspace region).
void launch_row_map(const std::int32_t* ids, std::int64_t num_pairs, int topk, int num_experts, bool contiguous,
                    std::int64_t capacity, std::int32_t* pair_row, std::int32_t* counts, std::int32_t* offsets,
                    std::int32_t* tile_scratch, std::int32_t* status, void* stream);
inline constexpr int kRowMapTile = 1024;  // pairs per block of the row map
inline std::int64_t row_map_scratch_ints(std::int64_t max_pairs, std::int64_t num_experts) {
  return (max_pairs > 0 ? (max_pairs + kRowMapTile - 1) / kRowMapTile : 1) * num_experts;
}
inline constexpr int kMaxRowMapExperts = 512;  // the row map's shared memory: 36 bytes x 2 x E

// FP8 quantization of hidden (tokens, K) bf16, bit-identical to cpu::quantize_activation, each
// token's row written to every row pair_row names for it (tokens * topk entries, -1 skipped), or to
// row t when pair_row is null. Scales per destination row (numerics/scales.h); per-tensor: one
// scale over all tokens, written to scale_tensors entries (E_local batched, 1 standard); amax_scratch
// is one uint32 of device memory. An unquantized recipe (bf16): each row copied as it is into q
// (2K bytes a row), no scales (scales and amax_scratch unread).
struct QuantizeLaunch {
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  const std::uint16_t* hidden = nullptr;
  std::int64_t tokens = 0, K = 0;
  int topk = 1;
  const std::int32_t* pair_row = nullptr;
  std::uint8_t* q = nullptr;
  float* scales = nullptr;
  std::int64_t scale_tensors = 1;
  std::uint32_t* amax_scratch = nullptr;
};
void launch_quantize_tokens(const QuantizeLaunch& l, void* stream);

// out[t] = bf16(sum over slots k in order of w[t,k] * rows[pair_row[t*topk+k]]) in fp32, one
// rounding (numerics::combine_step): bit-identical to cpu::combine_topk (accumulate: the sum starts
// from out[t]'s own values). rows in rows_dtype (the recipe's output dtype), out in output_dtype:
// bf16 or fp16 each.
void launch_combine(const std::int32_t* pair_row, const float* topk_weights, std::int64_t tokens, int topk,
                    std::int64_t K, const std::uint16_t* rows, std::uint16_t* output, void* stream,
                    bool accumulate = false, DType rows_dtype = DType::kBf16, DType output_dtype = DType::kBf16);

// The standard experts' permutation: a1q row t (and its scales) to every row pair_row names for it;
// rows of K elements of the recipe's activation dtype (FP8: K bytes, bf16: 2K), no scales without them.
void launch_permute_rows(const std::int32_t* pair_row, std::int64_t tokens, int topk, std::int64_t K, QuantScheme quant,
                         const std::uint8_t* a1q, const float* a1q_scale, std::uint8_t* permuted, float* permuted_scale,
                         void* stream);

}  // namespace moekit::cuda
