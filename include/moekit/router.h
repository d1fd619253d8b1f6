// The Router seam: router logits (T, E) fp32 -> topk_ids (T, topk) int32 global expert ids and
// topk_weights (T, topk) fp32, experts listed by descending selection score, ties to the lower
// expert index. One rule covers every family of the architecture table:
//   score     s = softmax(logits) or sigmoid(logits)
//   choice    c = s + e_score_correction_bias (correction_bias), else s: what selection ranks
//   groups    n_group > 1: each group scored by the sum of its 2 largest c (top-2 sum: DeepSeek-V3,
//             GLM) or its largest c (max: DeepSeek-V2 group_limited_greedy); only the experts of the
//             topk_group best groups stay candidates
//   select    the topk largest c among the candidates
//   weights   s of those (not c), divided by (their sum + renormalize_epsilon) when renormalize,
//             then times routed_scaling_factor
#pragma once

#include <cstdint>
#include <string_view>

#include "moekit/memory.h"
#include "moekit/model.h"
#include "moekit/problem.h"
#include "moekit/workspace.h"

namespace moekit {

struct RoutingConfig {
  std::int64_t num_experts = 0;
  std::int64_t topk = 0;
  Scoring scoring = Scoring::kSoftmax;
  bool correction_bias = false;  // route() takes the (E) e_score_correction_bias
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
  GroupScore group_score = GroupScore::kTop2Sum;
  bool renormalize = true;
  double renormalize_epsilon = 0.0;
  double routed_scaling_factor = 1.0;
};

RoutingConfig routing_config(const ModelConfig& model);  // validates, raises moekit::Error
void validate_routing(const RoutingConfig& config);

// Where the router left this step's choice: (num_tokens, topk) each, on the router's device.
struct RouterOutput {
  std::int32_t* topk_ids = nullptr;  // global expert ids; -1 for a token the router could not route
  float* topk_weights = nullptr;
};

class Router {
 public:
  virtual ~Router() = default;
  virtual std::string_view name() const = 0;
  virtual Device device() const = 0;
  virtual const RoutingConfig& config() const = 0;
  // Its output (topk_ids, topk_weights: max_tokens_per_rank rows) and anything else it holds.
  virtual void declare(const MoeProblem& problem, WorkspaceBuilder& builder) const = 0;
  // logits (num_tokens, E) and bias ((E) e_score_correction_bias or nullptr for zeros; read only
  // with correction_bias) on the router's device. A NaN logit (or no finite maximum under softmax) is an
  // Error naming the token: the CPU raises it here, a GPU after the step (check_status), its token
  // routed nowhere (ids -1) meanwhile.
  virtual RouterOutput route(const MoeProblem& problem, const float* logits, std::int64_t num_tokens, const float* bias,
                             Workspace& workspace, Stream stream) = 0;
  // The shared experts' route, on a router built for E = topk = 1 over shared_experts_problem's
  // workspace: every token to expert 0 with weight 1, or, with `gate` ((K) bf16 on the router's
  // device: Qwen2-MoE's shared_expert_gate), weight sigmoid(hidden[t] . gate) in fp32
  // (numerics::shared_gate_*: the same bits on every device).
  virtual RouterOutput route_shared(const MoeProblem& shared, const std::uint16_t* hidden, std::int64_t num_tokens,
                                    const std::uint16_t* gate, Workspace& workspace, Stream stream) = 0;
  virtual void check_status(Workspace& workspace, Stream stream) = 0;
};

// The router output regions every router declares.
void declare_router_output(const MoeProblem& problem, WorkspaceBuilder& builder);

}  // namespace moekit
