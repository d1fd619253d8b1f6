// The MoE layer as a composition: Router -> PrepareFinalize.prepare -> Experts.run ->
// PrepareFinalize.finalize, on one stream, over one Workspace allocated once from the plan `moekit
// plan` prints. It owns nothing else: the weights are the caller's (a validated view), seeded
// synthetic ones come from src/synthetic/, and the float64 reference lives in src/check/.
// Steps larger than max_tokens_per_rank run in chunks (every rank runs as many chunks).
// A model's many MoE layers share one MoeRuntime (moekit/runtime.h); a MoeLayer is a runtime that
// holds one layer, for a single layer's use.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "moekit/communicator.h"
#include "moekit/memory.h"
#include "moekit/model.h"
#include "moekit/placement.h"
#include "moekit/problem.h"
#include "moekit/weights.h"
#include "moekit/workspace.h"

namespace moekit {

struct LayerOptions {
  Device device = Device::kCpu;
  std::string experts = "batched-fp8";  // a registry name: batched-fp8 or standard-fp8
  // The dispatch/combine, a registry name (e.g. nccl, nccl-reference); empty: the default for the
  // device, format and ep (moekit plan prints it).
  std::string prepare_finalize;
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  std::optional<Activation> activation;  // default: the model's
  // The fused W1 (no w1_out, MoeProblem::fuse_w1): nullopt, where it runs (fuse_w1_runs); true
  // where it cannot is an Error; false, the unfused recipe.
  std::optional<bool> fuse_w1;
  // The GPU GEMMs' sum over K (MoeProblem::accumulation): precise unless asked for fast.
  Accumulation accumulation = Accumulation::kPrecise;
  // Checked mode: guard bands around every region, workspace and outputs poisoned with NaN before
  // each step, guards and outputs verified after it.
  bool checked = false;
  std::int64_t guard_bytes = 4096;
  int num_threads = 1;  // CPU threads of this rank
  // The model's shared experts (ModelConfig::shared_intermediate_size) as part of the step: on a GPU
  // on a second stream beside routing, dispatch and the routed experts, their combine added to the
  // routed output last. false: the routed experts only, for an engine that runs the shared experts
  // itself (LayerWeights holds none then).
  bool shared_experts = true;
};

struct LayerWeights {
  LayerWeights() = default;
  LayerWeights(const ExpertWeightsView& routed, const float* correction_bias)
      : experts(routed), e_score_correction_bias(correction_bias) {}

  ExpertWeightsView experts;                       // this rank's E_local experts, on options.device
  const float* e_score_correction_bias = nullptr;  // (E) on options.device, when the model has one
  // The shared experts, every rank's full copy: one expert (E_local = 1) of shared_experts_problem
  // (N = 2 * shared_intermediate_size for gated activations) in the routed experts' layout and
  // scheme, on options.device, when the model has them and options.shared_experts.
  ExpertWeightsView shared_experts;
  // (K) bf16: Qwen2-MoE's shared_expert_gate (the shared output times sigmoid(hidden . gate)), when
  // the model has one.
  const std::uint16_t* shared_expert_gate = nullptr;
  // Redundant experts (moekit/placement.h): which logical expert each of the E_local * ep slots
  // holds; `experts` then holds this rank's slots [rank * E_local, (rank + 1) * E_local), each
  // with its logical expert's weights. Copied at registration. nullptr: the round-robin placement
  // where the ranks hold more slots than E (slot p holds expert p mod E), none otherwise (slot =
  // expert). A placement with as many slots as experts permutes them.
  const ExpertPlacement* placement = nullptr;
};

// Host time of forward()'s stages: on the CPU the stages themselves, on a GPU the time to enqueue
// them (the device time is measured by `moekit bench layer`).
struct StepStats {
  std::int64_t tokens = 0;  // this rank's tokens in the step
  std::int64_t chunks = 0;  // chunks (the same on every rank)
  double route_ms = 0, prepare_ms = 0, experts_ms = 0, finalize_ms = 0, total_ms = 0;
  double shared_ms = 0;  // the shared experts' route, prepare and experts (their combine is in finalize)
};

// First global expert of this rank: rank * E_local with expert parallelism, 0 with ep == 1.
std::int64_t first_local_expert(const ParallelConfig& parallel, const MoeProblem& problem, int rank);

class MoeLayer {
 public:
  MoeLayer(const ModelConfig& model, const ParallelConfig& parallel, const LayerOptions& options,
           const LayerWeights& weights, Communicator& comm);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // hidden (num_tokens, K) bf16 and router_logits (num_tokens, E) fp32 of this rank's tokens ->
  // output (num_tokens, K) bf16, all on options.device. Collective: every rank calls it (num_tokens
  // may be 0). Steps over max_tokens_per_rank run in chunks; each chunk's device flags are checked
  // (check_status) before the next, so forward() synchronizes the stream.
  void forward(const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens, std::uint16_t* output,
               Stream stream = nullptr);
  // One step of at most max_tokens_per_rank tokens, enqueued on `stream` with no host
  // synchronization on a GPU: capturable in a CUDA graph and replayable (the workspace's addresses
  // are fixed at construction; inputs and output must stay at the captured addresses). Follow it
  // (or each replay, or every few) with check_status(): a step's device flags persist until read, so
  // a check after several replays reports the first error any of them raised.
  // `observer` (optional) is called on the host as each stage is enqueued: "start" before the
  // router, then "route", "prepare", "experts", "finalize" after each (a benchmark records events).
  // The shared experts run beside the first three; "finalize" comes after their combine.
  // `max_tokens_any_rank` (optional, expert parallelism): the most tokens any rank feeds this step,
  // the same on every rank (data-parallel engines that pad their ranks to one batch size know it).
  // It bounds the rows an expert can receive, so a decode step launches only the GEMMs of small
  // experts (at DP 32 planned for max_tokens_per_rank, 4 empty launches: 12-14 us a step). 0: not
  // known (max_tokens_per_rank). A rank that feeds more raises an error here; an expert that
  // receives more rows than the bound allows is skipped and raised by check_status(). forward()
  // finds it itself (one all-reduce of the ranks' token counts, which it does anyway).
  using StageObserver = std::function<void(std::string_view stage, Stream stream)>;
  void enqueue(const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens, std::uint16_t* output,
               Stream stream = nullptr, const StageObserver& observer = {}, std::int64_t max_tokens_any_rank = 0);
  // Synchronizes `stream` and raises moekit::Error for the first thing the kernels flagged since the
  // last check (a NaN logit, an expert id out of range, a count over capacity), naming the token,
  // expert and limit; the flags are cleared when read.
  void check_status(Stream stream = nullptr);

  const MoeProblem& problem() const;
  // The shared experts' problem (shared_experts_problem), nullopt when the step has none.
  const std::optional<MoeProblem>& shared_problem() const;
  const WorkspacePlan& plan() const;               // what `moekit plan` prints for this layout
  std::int64_t allocated_workspace_bytes() const;  // plan().total_bytes, or more with guard bands
  const StepStats& last_step() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit
