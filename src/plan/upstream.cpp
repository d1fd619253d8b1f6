// The upstream formulas, quoted. Napkin math for DeepSeek-V3 at DP 32 with 16 local experts, 256
// tokens per rank (M = 8192, K = 7168, N = 4096):
//   before the fix: 2 x (16 x 8192*32 x 7168) bf16 = 112 GiB;  after: 2 x (16 x 8192 x 7168) bf16 = 3.5 GiB.
#include "plan/upstream.h"

#include <algorithm>

#include "moekit/check.h"
#include "moekit/prepare_finalize.h"

namespace moekit::plan {

const std::vector<UpstreamReference>& upstream_references() {
  static const std::vector<UpstreamReference> all = {
      {"upstream-batched-cutlass-before-fix", true,
       "upstream CutlassBatchedExpertsFp8.workspace_shapes before the fix: workspace token dimension M * "
       "num_dispatchers (dispatch ranks counted twice)"},
      {"upstream-batched-cutlass-after-fix", false,
       "upstream CutlassBatchedExpertsFp8.workspace_shapes after the fix: token dimension M"},
  };
  return all;
}

WorkspacePlan plan_upstream_reference(const UpstreamReference& ref, const MoeProblem& p) {
  MOEKIT_CHECK(p.format == ActivationFormat::kBatchedExperts, "{} quotes a batched-format formula; the problem is {}",
               ref.name, format_name(p.format));
  validate_problem(p);
  // Before the fix the token dimension was M * num_dispatchers: the dispatch ranks counted twice.
  std::int64_t tokens = p.M;
  if (ref.before_fix)
    MOEKIT_CHECK(!__builtin_mul_overflow(p.M, p.num_dispatchers, &tokens), "M * num_dispatchers = {} * {} overflows",
                 p.M, p.num_dispatchers);
  const std::int64_t I = p.I();
  WorkspaceBuilder b(std::string(ref.name), p);
  b.set_reference(std::string(ref.summary));
  b.begin_section("experts", std::string(ref.name));
  b.add({"workspace1",
         DType::kBf16,
         {p.E_local, tokens, std::max(p.N, p.K)},
         Stage::kPrepare,
         Stage::kFinalize,
         ref.before_fix ? "W1 output, token dim M*D: counts the dispatchers twice"
                        : "W1 output, (E_local, M, max(N, K))"});
  b.add({"workspace2",
         DType::kBf16,
         {p.E_local, tokens, std::max(I, p.K)},
         Stage::kPrepare,
         Stage::kFinalize,
         ref.before_fix ? "activation output / W2 output, token dim M*D" : "activation output / W2 output, max(I, K)"});
  b.begin_section("prepare-finalize", "the batched experts' input/output");
  declare_experts_io(p, b);
  return b.finish();
}

}  // namespace moekit::plan
