// The selection rule over the config table (plan/gemm_config.h).
#include "plan/gemm_config.h"

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

std::int64_t expected_rows_per_expert(std::int64_t tokens, std::int64_t topk, std::int64_t E) {
  MOEKIT_CHECK(tokens >= 0 && topk >= 1 && E >= 1, "expected_rows_per_expert: tokens = {}, topk = {}, E = {}", tokens,
               topk, E);
  return (tokens * topk + E - 1) / E;
}

GemmConfig select_gemm_config(std::int64_t expected_rows, std::int64_t n, std::int64_t k) {
  MOEKIT_CHECK(expected_rows >= 0 && n >= 1 && k >= 1, "select_gemm_config: rows = {}, n = {}, k = {}", expected_rows,
               n, k);
  for (const auto& c : kGemmConfigs)
    if (supports(c, n, k) && (c.max_rows < 0 || expected_rows <= c.max_rows)) return c.id;
  MOEKIT_FAIL("no grouped FP8 GEMM config runs n = {}, k = {}: every config needs n and k to be multiples of 16", n, k);
}

ExpertsGemmConfigs select_experts_gemm_configs(const MoeProblem& p, std::int64_t tokens_per_rank) {
  // Batched: every dispatcher sends its tokens' rows to these experts. Standard: this rank's own.
  const std::int64_t tokens =
      p.format == ActivationFormat::kBatchedExperts ? tokens_per_rank * p.num_dispatchers : tokens_per_rank;
  const std::int64_t rows = expected_rows_per_expert(tokens, p.topk, p.E);
  return {select_gemm_config(rows, p.N, p.K), select_gemm_config(rows, p.K, p.I())};
}

}  // namespace moekit::plan
