// Model + parallel layout -> the experts' problem, validated where it enters. The one rule this
// project exists for: in the batched format M = max_tokens_per_rank * num_dispatchers is already
// the global capacity, and nothing downstream multiplies it by num_dispatchers again.
#include "moekit/problem.h"

#include <fmt/format.h>

#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/recipe.h"
#include "numerics/activation.h"

namespace moekit {
using limits::checked_mul;
using limits::kMaxSlotsPerExpert;

std::string MoeProblem::describe() const {
  return fmt::format(
      "format={} M={} N={} K={} I={} topk={} E={} E_local={} D={} max_tokens_per_rank={} act={}{} quant={}{}{}{}",
      format_name(format), M, N, K, N > 0 ? activation_out_dim(activation, N) : 0, topk, E, E_local, num_dispatchers,
      max_tokens_per_rank, activation_name(activation),
      activation == Activation::kSwigluOai ? fmt::format("(limit {}, alpha {})", swiglu.limit, swiglu.alpha) : "",
      quant_name(quant), fuse_w1 ? " fused-w1" : "", expert_bias ? " expert-bias" : "",
      accumulation == Accumulation::kFast ? " fast-accumulation" : "");
}

bool fuse_w1_runs(QuantScheme quant, Activation activation) {
  const numerics::W1Rows rows = numerics::w1_rows(activation, quant);
  return recipe_info(quant).fused_w1 && (rows == numerics::W1Rows::kBlockPairs || rows == numerics::W1Rows::kSingle);
}

void validate_problem(const MoeProblem& p) {
  // Each size within its limit (moekit/limits.h) first: every product below then fits 64 bits or is
  // refused by checked_mul, and the memory checks see real figures.
  MOEKIT_CHECK(p.K >= 1 && p.K <= limits::kMaxHiddenSize, "hidden size K = {} must be in [1, {}] (moekit/limits.h)",
               p.K, limits::kMaxHiddenSize);
  MOEKIT_CHECK(p.N >= 1 && p.N <= 2 * limits::kMaxSharedIntermediateSize,
               "W1 output width N = {} must be in [1, {}] (moekit/limits.h)", p.N,
               2 * limits::kMaxSharedIntermediateSize);
  MOEKIT_CHECK(p.E >= 1 && p.E <= limits::kMaxExperts, "number of experts E = {} must be in [1, {}] (moekit/limits.h)",
               p.E, limits::kMaxExperts);
  MOEKIT_CHECK(p.topk <= limits::kMaxTopk, "topk = {} is past moekit's limit of {} experts per token (moekit/limits.h)",
               p.topk, limits::kMaxTopk);
  MOEKIT_CHECK(p.max_tokens_per_rank <= limits::kMaxTokensPerRank,
               "max_tokens_per_rank = {} is past moekit's limit of {} (moekit/limits.h): chunk larger steps",
               p.max_tokens_per_rank, limits::kMaxTokensPerRank);
  MOEKIT_CHECK(p.num_dispatchers <= limits::kMaxRanks,
               "num_dispatchers D = {} is past moekit's limit of {} ranks (moekit/limits.h)", p.num_dispatchers,
               limits::kMaxRanks);
  // E_local above E: redundant experts (moekit/placement.h) on few ranks, each slot a replica.
  MOEKIT_CHECK(p.E_local >= 1 && p.E_local <= kMaxSlotsPerExpert * p.E,
               "local experts E_local = {} must be in [1, {} x E = {}]: more slots than {} replicas of every expert "
               "serve no placement",
               p.E_local, kMaxSlotsPerExpert, kMaxSlotsPerExpert * p.E, kMaxSlotsPerExpert);
  MOEKIT_CHECK(p.topk >= 1 && p.topk <= p.E, "topk = {} must be in [1, E = {}]", p.topk, p.E);
  MOEKIT_CHECK(p.num_dispatchers >= 1, "num_dispatchers D = {} must be >= 1 (it is dp: every rank dispatches)",
               p.num_dispatchers);
  MOEKIT_CHECK(p.max_tokens_per_rank >= 1, "max_tokens_per_rank = {} must be >= 1 (a chunk holds at least one token)",
               p.max_tokens_per_rank);
  const std::int64_t expected_M = p.format == ActivationFormat::kBatchedExperts
                                      ? checked_mul(p.max_tokens_per_rank, p.num_dispatchers, "M")
                                      : p.max_tokens_per_rank;
  MOEKIT_CHECK(p.M == expected_M,
               "M = {} but the {} format needs M = {} (max_tokens_per_rank = {}, num_dispatchers = {}): batched M is "
               "max_tokens_per_rank * num_dispatchers, already global, and is never multiplied again",
               p.M, format_name(p.format), expected_M, p.max_tokens_per_rank, p.num_dispatchers);
  const std::int64_t I = activation_out_dim(p.activation, p.N);  // checks N even when gated
  validate_swiglu(p.swiglu, "problem");
  const RecipeInfo recipe = recipe_info(p.quant);
  MOEKIT_CHECK(p.accumulation == Accumulation::kPrecise || recipe.fast_accumulation,
               "fast accumulation (--accumulation fast) runs per-token and per-tensor only: block128 moves its sums "
               "into fp32 at every k-block as it scales them; drop it, or use --quant per-token");
  // The GEMMs' TMA reads rows in 16-byte units from 16-byte aligned starts (16 FP8 or 8 bf16
  // elements); every recipe asks the same 16 elements, so one shape runs in each of them.
  MOEKIT_CHECK(p.K % 16 == 0 && I % 16 == 0,
               "K = {} and I = {} must be multiples of 16 (the GEMMs read 16-byte aligned rows; every recipe asks "
               "the same): pad the hidden and intermediate sizes to a multiple of 16",
               p.K, I);
  if (recipe.needs_block_multiple) {
    MOEKIT_CHECK(p.K % kQuantBlock == 0 && I % kQuantBlock == 0,
                 "block128 quantization needs K = {} and I = {} to be multiples of 128; use --quant per-token", p.K, I);
  }
  MOEKIT_CHECK(!p.fuse_w1 || fuse_w1_runs(p.quant, p.activation),
               "the fused W1 (fuse_w1, --fuse-w1) runs block128 with silu, gelu, gelu_tanh, relu2 or silu_no_mul; "
               "the problem is {} with {}: drop --fuse-w1 or use --quant block128",
               quant_name(p.quant), activation_name(p.activation));
  // Every byte count downstream is a product of these: refuse shapes whose largest tensor
  // (E_local, M, max(N, K)) would overflow 64-bit bytes.
  const std::int64_t width = p.N > p.K ? p.N : p.K;
  checked_mul(checked_mul(checked_mul(p.E_local, p.M, "E_local * M"), width, "E_local * M * max(N, K)"), 8 * p.topk,
              "E_local * M * max(N, K) * 8 * topk");
}

MoeProblem make_problem(const ModelConfig& model, const ParallelConfig& par, ActivationFormat format, QuantScheme quant,
                        Activation activation, std::optional<bool> fuse_w1, Accumulation accumulation) {
  MOEKIT_CHECK(par.dp >= 1, "dp = {} must be >= 1 (data-parallel ranks)", par.dp);
  MOEKIT_CHECK(par.ep >= 1, "ep = {} must be >= 1 (expert-parallel ranks)", par.ep);
  MOEKIT_CHECK(par.max_tokens_per_rank >= 1, "max_tokens_per_rank = {} must be >= 1", par.max_tokens_per_rank);
  std::int64_t E_local = par.local_experts;
  if (E_local == 0) {
    MOEKIT_CHECK(model.num_experts % par.ep == 0,
                 "{}: {} experts are not divisible by ep = {}; choose an ep that divides {} or pass --local-experts",
                 model.name, model.num_experts, par.ep, model.num_experts);
    E_local = model.num_experts / par.ep;
  } else {
    MOEKIT_CHECK(E_local >= 1, "local experts = {} must be >= 1", E_local);
    const std::int64_t slots = checked_mul(E_local, par.ep, "local_experts * ep");
    MOEKIT_CHECK(slots >= model.num_experts,
                 "local experts = {} on ep = {} ranks hold {} slots, fewer than the {} experts of {}", E_local, par.ep,
                 slots, model.num_experts, model.name);
    MOEKIT_CHECK(
        slots <= kMaxSlotsPerExpert * model.num_experts,
        "local experts = {} on ep = {} ranks hold {} slots, more than {} replicas of each of the {} experts of "
        "{} (at most {} slots)",
        E_local, par.ep, slots, kMaxSlotsPerExpert, model.num_experts, model.name,
        kMaxSlotsPerExpert * model.num_experts);
  }

  MoeProblem p;
  p.format = format;
  p.activation = activation;
  p.K = model.hidden_size;
  p.N = is_gated(activation) ? checked_mul(2, model.moe_intermediate_size, "N") : model.moe_intermediate_size;
  p.topk = model.topk;
  p.E = model.num_experts;
  p.E_local = E_local;
  p.quant = quant;
  p.max_tokens_per_rank = par.max_tokens_per_rank;
  p.num_dispatchers = par.dp;
  p.M = format == ActivationFormat::kBatchedExperts ? checked_mul(par.max_tokens_per_rank, par.dp, "M")
                                                    : par.max_tokens_per_rank;
  p.fuse_w1 = fuse_w1.value_or(fuse_w1_runs(quant, activation));
  p.expert_bias = model.expert_bias;
  p.swiglu = model.swiglu;
  p.accumulation = accumulation;
  validate_problem(p);
  return p;
}

std::optional<MoeProblem> shared_experts_problem(const ModelConfig& model, const MoeProblem& routed) {
  if (model.shared_intermediate_size == 0) return std::nullopt;
  MOEKIT_CHECK(model.shared_intermediate_size > 0, "{}: shared_intermediate_size = {} must be >= 0", model.name,
               model.shared_intermediate_size);
  MoeProblem p = routed;
  p.format = ActivationFormat::kStandard;
  p.N = is_gated(routed.activation) ? checked_mul(2, model.shared_intermediate_size, "shared N")
                                    : model.shared_intermediate_size;
  p.topk = p.E = p.E_local = 1;
  p.num_dispatchers = 1;
  p.M = routed.max_tokens_per_rank;
  p.expert_bias = false;
  try {
    validate_problem(p);
  } catch (const Error& e) {
    MOEKIT_FAIL("{}: the shared experts (shared_intermediate_size = {}) cannot run as planned: {}", model.name,
                model.shared_intermediate_size, e.what());
  }
  return p;
}

MoeProblem make_problem(const ModelConfig& model, const ParallelConfig& parallel, ActivationFormat format,
                        QuantScheme quant) {
  return make_problem(model, parallel, format, quant, model.activation);
}

}  // namespace moekit
