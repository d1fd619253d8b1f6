// The routing rules of a model (moekit/router.h), validated where they enter; every Router
// implementation runs exactly these.
#include <cmath>

#include "moekit/check.h"
#include "moekit/router.h"

namespace moekit {

// The contract route() relies on; routing_config() checks it too, so a hand-built config (tests,
// tools) gets the same messages as one read from a model.
void validate_routing(const RoutingConfig& c) {
  MOEKIT_CHECK(c.num_experts >= 1, "routing: num_experts = {} must be >= 1", c.num_experts);
  MOEKIT_CHECK(c.topk >= 1 && c.topk <= c.num_experts,
               "routing: topk = {} must be in [1, num_experts = {}]; lower num_experts_per_tok", c.topk, c.num_experts);
  MOEKIT_CHECK(c.n_group >= 1 && c.num_experts % c.n_group == 0,
               "routing: n_group = {} must be >= 1 and divide num_experts = {}", c.n_group, c.num_experts);
  MOEKIT_CHECK(c.topk_group >= 1 && c.topk_group <= c.n_group, "routing: topk_group = {} must be in [1, n_group = {}]",
               c.topk_group, c.n_group);
  MOEKIT_CHECK(c.topk <= c.topk_group * (c.num_experts / c.n_group),
               "routing: topk = {} exceeds the {} experts of the topk_group = {} chosen groups of {}; raise "
               "topk_group or lower topk",
               c.topk, c.topk_group * (c.num_experts / c.n_group), c.topk_group, c.num_experts / c.n_group);
  MOEKIT_CHECK(std::isfinite(c.renormalize_epsilon) && c.renormalize_epsilon >= 0,
               "routing: renormalize_epsilon = {} must be finite and >= 0", c.renormalize_epsilon);
  MOEKIT_CHECK(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor > 0,
               "routing: routed_scaling_factor = {} must be finite and > 0", c.routed_scaling_factor);
}

RoutingConfig routing_config(const ModelConfig& model) {
  RoutingConfig c;
  c.num_experts = model.num_experts;
  c.topk = model.topk;
  c.scoring = model.scoring;
  c.correction_bias = model.has_score_correction_bias;
  c.n_group = model.n_group;
  c.topk_group = model.topk_group;
  c.group_score = model.group_score;
  c.renormalize = model.norm_topk_prob;
  c.renormalize_epsilon = model.renormalize_epsilon;
  c.routed_scaling_factor = model.routed_scaling_factor;
  validate_routing(c);
  return c;
}

void declare_router_output(const MoeProblem& p, WorkspaceBuilder& b) {
  b.add({"topk_ids",
         DType::kInt32,
         {p.max_tokens_per_rank, p.topk},
         Stage::kPrepare,
         Stage::kFinalize,
         "routed experts of this rank's tokens, global ids"});
  b.add({"topk_weights",
         DType::kFp32,
         {p.max_tokens_per_rank, p.topk},
         Stage::kPrepare,
         Stage::kFinalize,
         "routing weights, applied by the combine"});
}

}  // namespace moekit
