// One runtime per rank for all of a model's MoE layers. A model's MoE layers run one after another,
// so they share everything but their weights: the one workspace (the plan of the layer problem), the
// seams (router, prepare/finalize with its communicator and NCCL window, experts), the side stream
// of the shared experts and the status words. A layer is a weight set registered with the runtime;
// 58 layers of DeepSeek-V3 hold 58 weight sets and one workspace, never 58.
//
// Every layer of one runtime has the runtime's problem (one ModelConfig): the MoE layers of the
// models moekit runs are alike. MoeLayer (moekit/layer.h) is a runtime holding one layer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "moekit/communicator.h"
#include "moekit/layer.h"
#include "moekit/model.h"
#include "moekit/placement.h"
#include "moekit/problem.h"
#include "moekit/weights.h"
#include "moekit/workspace.h"

namespace moekit {

class MoeRuntime {
 public:
  // Validates the layout, picks the seams and allocates the one workspace (collective under expert
  // parallelism: every rank builds its runtime with the same arguments).
  MoeRuntime(const ModelConfig& model, const ParallelConfig& parallel, const LayerOptions& options, Communicator& comm);
  ~MoeRuntime();
  MoeRuntime(const MoeRuntime&) = delete;
  MoeRuntime& operator=(const MoeRuntime&) = delete;

  // Registers one MoE layer's weights (a view: the caller keeps them alive while the runtime runs
  // the layer) and returns its index, 0, 1, ... in registration order. Validated here exactly as a
  // MoeLayer validates its weights; nothing is allocated.
  int add_layer(const LayerWeights& weights);
  int num_layers() const;
  const LayerWeights& layer_weights(int layer) const;

  // Redundant experts (moekit/placement.h). A layer's placement, nullptr when it has none (slot =
  // expert).
  const ExpertPlacement* placement(int layer) const;
  // This rank's (token, expert) pairs sent to each of the layer's E_local * ep slots since it was
  // registered or last read; reading clears them (it synchronizes `stream`). Summed over the ranks
  // (logical_load) they are the load that rebalance_experts turns into a new placement. A layer
  // without a placement is an Error: register it with one (round_robin_placement(E, E) is the
  // identity) to count.
  std::vector<std::int64_t> expert_load(int layer, Stream stream = nullptr);
  // Replaces a layer's weights and placement (validated as add_layer does; the slot count stays
  // E_local * ep): a new placement from rebalance_experts with the slots' new weights. The
  // placement tables are rewritten where the step reads them, after the work enqueued on `stream`,
  // and the load counts restart: a CUDA graph captured before replays the new placement, with the
  // weights at the addresses it captured (rewrite the slots' weights in place to keep it; weights
  // at new addresses need a new capture).
  void replace_layer(int layer, const LayerWeights& weights, Stream stream = nullptr);

  // MoeLayer::forward / enqueue for the registered `layer`: the same contracts (collective, chunks,
  // CUDA graph capture, max_tokens_any_rank). A graph may hold steps of several layers; they run in
  // the order enqueued, each over the one workspace.
  void forward(int layer, const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens,
               std::uint16_t* output, Stream stream = nullptr);
  void enqueue(int layer, const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens,
               std::uint16_t* output, Stream stream = nullptr, const MoeLayer::StageObserver& observer = {},
               std::int64_t max_tokens_any_rank = 0);
  // The status words are the runtime's: a check reports the first error any layer's step flagged
  // since the last check, naming the seam that flagged it (forward's own checks name the layer too).
  void check_status(Stream stream = nullptr);
  // Raises moekit::Error when `layer`'s output of a step (num_tokens rows at `output`, with its input
  // `hidden`, both on options.device) holds a NaN or an Inf, naming the layer, the token and column
  // and where it entered: the input, the router's correction bias, the routed or the shared experts'
  // weights (the first non-finite value, named), or none of them (a row the step must not read: a
  // bug). forward() runs it in checked mode; `moekit run` after every run.
  void check_output(int layer, const std::uint16_t* hidden, std::int64_t num_tokens, const std::uint16_t* output,
                    Stream stream = nullptr);

  const MoeProblem& problem() const;
  const std::optional<MoeProblem>& shared_problem() const;
  const WorkspacePlan& plan() const;
  std::int64_t allocated_workspace_bytes() const;
  const StepStats& last_step() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit
