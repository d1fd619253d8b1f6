// The selection rule over the config table (plan/gemm_config.h).
#include "plan/gemm_config.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "moekit/check.h"

namespace moekit::plan {

GemmConfig parse_gemm_config(std::string_view name) {
  std::string valid;
  for (const auto& c : kGemmConfigs) {
    if (c.name == name) return c.id;
    valid += (valid.empty() ? "" : ", ") + std::string(c.name);
  }
  MOEKIT_FAIL("unknown GEMM config '{}': valid configs are {}", name, valid);
}

GemmConfig select_gemm_config(std::int64_t rows, std::int64_t n, std::int64_t k, QuantScheme quant,
                              Accumulation accumulation) {
  MOEKIT_CHECK(rows >= 0 && n >= 1 && k >= 1, "select_gemm_config: rows = {}, n = {}, k = {}", rows, n, k);
  for (const auto& c : kGemmConfigs)
    if (eligible(c, n, k, quant, false, accumulation) && (c.max_rows < 0 || rows <= c.max_rows)) return c.id;
  MOEKIT_FAIL(
      "no grouped GEMM config runs n = {}, k = {} for the {} recipe: every config needs n and k to be "
      "multiples of 16",
      n, k, quant_name(quant));
}

GemmLaunches plan_gemm_launches(std::int64_t n, std::int64_t k, std::int64_t max_rows, QuantScheme quant, bool fused_w1,
                                Accumulation accumulation) {
  MOEKIT_CHECK(max_rows >= 0, "plan_gemm_launches: max_rows = {} must be >= 0", max_rows);
  GemmLaunches l;
  std::int64_t lo = 0;
  for (const auto& c : kGemmConfigs) {
    if (!eligible(c, n, k, quant, fused_w1, accumulation)) continue;
    const std::int64_t hi = c.max_rows < 0 ? std::numeric_limits<std::int64_t>::max() : c.max_rows;
    if (hi < lo) continue;
    if (lo <= std::max<std::int64_t>(max_rows, 1)) {
      MOEKIT_CHECK(l.count < kMaxGemmLaunches, "the GEMM config table has more row ranges than kMaxGemmLaunches = {}",
                   kMaxGemmLaunches);
      l.config[l.count] = c.id;
      l.lo[l.count] = lo;
      l.hi[l.count] = hi;
      ++l.count;
    }
    if (c.max_rows < 0) break;
    lo = hi + 1;
  }
  MOEKIT_CHECK(l.count > 0,
               "no grouped GEMM config runs n = {}, k = {} for the {} recipe: every config needs n and k to be "
               "multiples of 16",
               n, k, quant_name(quant));
  // A splitting config's ragged tails go to the launches of up to half its token tile, when the
  // plan holds every such row count (the ranges are contiguous from 0: launch 0 starts there).
  // (Splitting configs keep tokens on their M side: ragged_tail_splitters_write_rows.)
  for (int j = 0; j < l.count; ++j) {
    const GemmConfigInfo& c = gemm_config_info(l.config[j]);
    if (c.splits_ragged_tail && j > 0 && l.lo[j] > c.tile_m / 2) l.tail_tile[j] = c.tile_m;
  }
  return l;
}

GemmLaunches single_launch(GemmConfig config) {
  GemmLaunches l;
  l.count = 1;
  l.config[0] = config;
  l.lo[0] = 0;
  l.hi[0] = std::numeric_limits<std::int64_t>::max();
  return l;
}

std::string describe(const GemmLaunches& l) {
  std::string s;
  for (int j = 0; j < l.count; ++j) {
    const bool open = l.hi[j] == std::numeric_limits<std::int64_t>::max();
    s += (j ? ", " : "") + std::string(gemm_config_info(l.config[j]).name);
    if (l.count > 1) {
      s += open ? " (m_e > " + std::to_string(l.lo[j] - 1) : " (m_e <= " + std::to_string(l.hi[j]);
      s += l.tail_tile[j] > 0 ? "; a last tile of <= " + std::to_string(l.tail_tile[j] / 2) + " rows apart)" : ")";
    }
  }
  return s;
}

std::int64_t max_rows_per_expert(const MoeProblem& p, std::int64_t tokens_per_rank) {
  const std::int64_t dispatchers = p.format == ActivationFormat::kBatchedExperts ? p.num_dispatchers : 1;
  return std::min(p.M, tokens_per_rank * dispatchers);
}

std::int64_t step_tokens_per_rank(const MoeProblem& p, std::int64_t num_tokens, std::int64_t max_tokens_any_rank) {
  MOEKIT_CHECK(
      max_tokens_any_rank == 0 || (max_tokens_any_rank >= num_tokens && max_tokens_any_rank <= p.max_tokens_per_rank),
      "max_tokens_any_rank = {} (the most tokens any rank feeds this step) must be 0 (not known) or within "
      "[this rank's {} tokens, max_tokens_per_rank = {}]",
      max_tokens_any_rank, num_tokens, p.max_tokens_per_rank);
  const bool one = p.format == ActivationFormat::kStandard || p.num_dispatchers == 1;
  if (one && num_tokens > 0) return std::min(num_tokens, p.max_tokens_per_rank);
  return max_tokens_any_rank > 0 ? max_tokens_any_rank : p.max_tokens_per_rank;
}

std::string bad_count_message(std::string_view who, std::int64_t expert, std::int64_t count, std::int64_t M) {
  return fmt::format(
      "{}: expert_num_tokens[{}] = {} is outside [0, M = {}]: that expert was skipped (nothing written past its "
      "buffer); fix the dispatch's counts",
      who, expert, count, M);
}

std::string over_step_bound_message(std::string_view who, std::int64_t expert, std::int64_t rows,
                                    std::int64_t max_rows) {
  return fmt::format(
      "{}: expert {} received {} rows, more than the {} its step was planned for (the step's tokens per rank, "
      "max_tokens_any_rank when declared, times the dispatchers): that expert was skipped (nothing written past "
      "its rows). Declare the most tokens any rank feeds the step, or 0 (max_tokens_per_rank); with one "
      "dispatcher, num_tokens must count the tokens this rank fed. A token whose top-k ids name the expert twice "
      "counts twice",
      who, expert, rows, max_rows);
}

std::int64_t w1_small_rows(const MoeProblem& p) {
  return std::min(fused_w1_small_rows(), p.format == ActivationFormat::kStandard ? p.M * p.topk : p.M);
}

bool fuses_w1(const MoeProblem& p) {
  return p.fuse_w1 && fuse_w1_runs(p.quant, p.activation);
}

bool writes_w1_small(const ExpertsGemmPlan& g, int j) {
  return g.fused_w1 && j >= 0 && j < g.w1.count && gemm_config_info(g.w1.config[j]).w1_fp32;
}

bool runs_activation_kernel(const ExpertsGemmPlan& g) {
  return !g.fused_w1 || g.w1_small;
}

ExpertsGemmPlan plan_experts_gemms(const MoeProblem& p, std::int64_t tokens_per_rank) {
  const std::int64_t rows = max_rows_per_expert(p, tokens_per_rank);
  const bool fused = fuses_w1(p);
  ExpertsGemmPlan g{plan_gemm_launches(p.N, p.K, rows, p.quant, fused, p.accumulation),
                    plan_gemm_launches(p.K, p.I(), rows, p.quant, false, p.accumulation), fused};
  for (int j = 0; j < g.w1.count; ++j) g.w1_small |= writes_w1_small(g, j);
  return g;
}

ExpertsGemmPlan single_config(GemmConfig config, const MoeProblem& p) {
  if (gemm_config_info(config).fused_w1) {
    MOEKIT_CHECK(fuses_w1(p),
                 "GEMM config {} is a fused W1: it runs problems with fuse_w1 (block128 with silu, gelu, gelu_tanh, "
                 "relu2 or silu_no_mul); the problem is {} with {}{}",
                 gemm_config_info(config).name, quant_name(p.quant), activation_name(p.activation),
                 p.fuse_w1 ? "" : ", not fused");
    ExpertsGemmPlan g = plan_experts_gemms(p, p.max_tokens_per_rank);
    g.w1 = single_launch(config);
    g.w1_small = false;
    return g;
  }
  MOEKIT_CHECK(!fuses_w1(p),
               "GEMM config {} runs W1 into w1_out, but the problem fuses W1 (fuse_w1): force a fused-w1 config or "
               "drop fuse_w1",
               gemm_config_info(config).name);
  return {single_launch(config), single_launch(config), false};
}

}  // namespace moekit::plan
