// The Router seam: router logits (T, E) fp32 -> topk_ids (T, topk) int32 global expert ids and
// topk_weights (T, topk) fp32, experts listed by descending selection score, ties to the lower
// expert index.
//   softmax:   p = softmax(logits); pick topk largest p; weights = p (divided by their sum when
//              renormalize; Mixtral, Qwen3, gpt-oss renormalize).
//   grouped (DeepSeek-V3 noaux_tc): s = sigmoid(logits); c = s + e_score_correction_bias;
//              group score = sum of its 2 largest c; keep the topk_group best groups (of n_group);
//              pick the topk largest c inside them; weights = s of those (not c), divided by their
//              sum when renormalize, times routed_scaling_factor.
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
  bool renormalize = true;
  bool grouped = false;  // DeepSeek-V3 style grouped top-k with a correction bias
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
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
  // logits (num_tokens, E) and bias ((E) e_score_correction_bias or nullptr for zeros, grouped
  // routing only) on the router's device. A NaN logit (or no finite maximum under softmax) is an
  // Error naming the token: the CPU raises it here, a GPU after the step (check_status), its token
  // routed nowhere (ids -1) meanwhile.
  virtual RouterOutput route(const MoeProblem& problem, const float* logits, std::int64_t num_tokens, const float* bias,
                             Workspace& workspace, Stream stream) = 0;
  virtual void check_status(Workspace& workspace, Stream stream) = 0;
};

// The router output regions every router declares.
void declare_router_output(const MoeProblem& problem, WorkspaceBuilder& builder);

}  // namespace moekit
