// The MoE layer runner: route -> quantize -> dispatch -> experts -> combine, on one rank of a
// communicator. It builds its local experts (seeded random weights), allocates the experts'
// workspace once from the plan `moekit plan` prints, and chunks steps larger than
// max_tokens_per_rank. Checked mode puts guard bands around every region, poisons workspace,
// padding rows and outputs with NaN, and verifies after each step. Plain C++: bf16 is uint16_t bits.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "moekit/communicator.h"
#include "moekit/model.h"
#include "moekit/problem.h"
#include "moekit/workspace.h"

namespace moekit {

struct LayerOptions {
  ActivationFormat format = ActivationFormat::kBatchedExperts;
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  std::optional<Activation> activation;  // default: the model's
  bool checked = false;
  std::int64_t guard_bytes = 4096;
  int num_threads = 1;  // CPU threads of this rank
  std::uint64_t seed = 1;
  bool reference = false;  // also compute the float64 reference of every output (slow)
};

struct StepStats {
  std::int64_t tokens = 0;       // this rank's tokens in the step
  std::int64_t chunks = 0;       // collective chunks (the same on every rank)
  std::int64_t expert_rows = 0;  // (token, expert) rows this rank's experts computed
  double route_quant_ms = 0, dispatch_ms = 0, experts_ms = 0, combine_ms = 0, total_ms = 0;
  // With LayerOptions::reference: sum over this rank's outputs of (out - ref)^2 and ref^2.
  double ref_err_sq = 0, ref_norm_sq = 0;
};

class MoeLayer {
 public:
  MoeLayer(const ModelConfig& model, const ParallelConfig& parallel, const LayerOptions& options, Communicator& comm);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // hidden (num_tokens, K) bf16 and router_logits (num_tokens, E) fp32 of this rank's tokens ->
  // output (num_tokens, K) bf16. Collective: every rank calls it (num_tokens may be 0).
  void forward(const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens, std::uint16_t* output);

  const MoeProblem& problem() const;
  const WorkspacePlan& plan() const;               // what `moekit plan` prints for this layout
  std::int64_t allocated_workspace_bytes() const;  // plan().total_bytes, or more with guard bands
  const StepStats& last_step() const;
  std::int64_t first_local_expert() const;
  // The routing bias (DeepSeek-V3 e_score_correction_bias; empty otherwise), the same on every rank.
  const std::vector<float>& routing_bias() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit
