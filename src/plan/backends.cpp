// The workspace of each experts backend, region by region, and the upstream reference formulas.
// Napkin math for DeepSeek-V3 at DP 32 with 16 local experts, 256 tokens per rank (M = 8192,
// K = 7168, N = 4096, I = 2048):
//   upstream before fix: 2 x (16 x 8192*32 x 7168) bf16           = 112 GiB
//   upstream after fix:  2 x (16 x 8192 x 7168) bf16              = 3.5 GiB
//   moekit batched-fp8:  16 x 8192 x 4096 bf16 + 16 x 8192 x 2048 fp8 + scales = 1.25 GiB + 0.5 MiB
#include <algorithm>

#include "moekit/check.h"
#include "plan/experts_workspace.h"

namespace moekit {
namespace plan {

std::vector<std::int64_t> activation_scale_shape(QuantScheme quant, std::vector<std::int64_t> rows, std::int64_t cols,
                                                 bool batched) {
  switch (quant) {
    case QuantScheme::kPerTensor:
      // One scale per tensor: per expert in the batched format, one in the standard format.
      return batched ? std::vector<std::int64_t>{rows.front()} : std::vector<std::int64_t>{1};
    case QuantScheme::kPerTokenPerChannel: return rows;
    case QuantScheme::kBlock128: rows.push_back((cols + kQuantBlock - 1) / kQuantBlock); return rows;
  }
  MOEKIT_FAIL("unknown quantization scheme {}", static_cast<int>(quant));
}

// The batched experts' input and output, held by the layer (dispatch receive buffer and combine
// source), the same for every batched backend.
void declare_batched_buffers(const MoeProblem& p, WorkspaceBuilder& b) {
  b.add_buffer({"a1q",
                DType::kFp8E4m3,
                {p.E_local, p.M, p.K},
                Stage::kPrepare,
                Stage::kGemm1,
                "dispatched FP8 tokens, M rows per local expert, rows >= expert_num_tokens[e] are padding"});
  b.add_buffer({"a1q_scale", DType::kFp32, activation_scale_shape(p.quant, {p.E_local, p.M}, p.K, true),
                Stage::kPrepare, Stage::kGemm1, "scales of a1q"});
  b.add_buffer({"expert_num_tokens",
                DType::kInt32,
                {p.E_local},
                Stage::kPrepare,
                Stage::kFinalize,
                "valid rows m_e of each local expert, in device memory"});
  b.add_buffer({"output",
                DType::kBf16,
                {p.E_local, p.M, p.K},
                Stage::kGemm2,
                Stage::kFinalize,
                "experts' output (E_local, M, K): valid rows are the result, the rest padding"});
}

BatchedFp8Workspace declare_batched_fp8(const MoeProblem& p, WorkspaceBuilder& b) {
  MOEKIT_CHECK(p.format == ActivationFormat::kBatchedExperts, "batched-fp8 needs the batched format, got {}",
               format_name(p.format));
  const std::int64_t I = p.I();
  const std::vector<std::int64_t> rows{p.E_local, p.M};  // M is global already: no num_dispatchers here
  BatchedFp8Workspace w;

  declare_batched_buffers(p, b);

  // Workspace proper.
  w.w1_out = b.add_as<std::uint16_t>({"w1_out",
                                      DType::kBf16,
                                      {p.E_local, p.M, p.N},
                                      Stage::kGemm1,
                                      Stage::kActivation,
                                      "W1 GEMM output (gate|up), valid rows only are written"});
  w.act_q = b.add_as<std::uint8_t>({"act_q",
                                    DType::kFp8E4m3,
                                    {p.E_local, p.M, I},
                                    Stage::kActivation,
                                    Stage::kGemm2,
                                    "activation output quantized to FP8: the A operand of the W2 GEMM"});
  w.act_scale = b.add_as<float>({"act_scale", DType::kFp32, activation_scale_shape(p.quant, rows, I, true),
                                 Stage::kActivation, Stage::kGemm2, "scales of act_q"});
  w.gemm_args = b.add_as<std::byte>({"gemm_args",
                                     DType::kUint8,
                                     {2, p.E_local, kGemmArgsBytesPerExpert},
                                     Stage::kPrepare,
                                     Stage::kGemm2,
                                     "grouped-GEMM problem sizes, pointers and strides, built on the device"});
  w.gemm_scratch = b.add_as<std::byte>({"gemm_scratch",
                                        DType::kUint8,
                                        {kGemmScratchBytes},
                                        Stage::kGemm1,
                                        Stage::kGemm2,
                                        "CUTLASS workspace (bound, checked at run time)"});
  w.status = b.add_as<std::int32_t>({"status",
                                     DType::kInt32,
                                     {kStatusWords},
                                     Stage::kPrepare,
                                     Stage::kFinalize,
                                     "device error flags (expert_num_tokens > M, ...), read after the step"});
  return w;
}

StandardFp8Workspace declare_standard_fp8(const MoeProblem& p, WorkspaceBuilder& b) {
  MOEKIT_CHECK(p.format == ActivationFormat::kStandard, "standard-fp8 needs the standard format, got {}",
               format_name(p.format));
  const std::int64_t I = p.I();
  const std::int64_t rows = p.M * p.topk;  // every (token, slot) pair may land on a local expert
  StandardFp8Workspace w;

  b.add_buffer({"a1q", DType::kFp8E4m3, {p.M, p.K}, Stage::kPrepare, Stage::kPrepare, "FP8 tokens in token order"});
  b.add_buffer({"a1q_scale", DType::kFp32, activation_scale_shape(p.quant, {p.M}, p.K, false), Stage::kPrepare,
                Stage::kPrepare, "scales of a1q"});
  b.add_buffer({"topk_ids", DType::kInt32, {p.M, p.topk}, Stage::kPrepare, Stage::kFinalize, "routed experts"});
  b.add_buffer({"topk_weights", DType::kFp32, {p.M, p.topk}, Stage::kPrepare, Stage::kFinalize, "routing weights"});
  b.add_buffer({"output",
                DType::kBf16,
                {p.M, p.K},
                Stage::kFinalize,
                Stage::kFinalize,
                "weighted sum over the token's local experts, token order"});

  w.expert_offsets = b.add_as<std::int64_t>({"expert_offsets",
                                             DType::kInt64,
                                             {p.E_local + 1},
                                             Stage::kPrepare,
                                             Stage::kGemm2,
                                             "first permuted row of each local expert"});
  w.permuted_src = b.add_as<std::int32_t>({"permuted_src",
                                           DType::kInt32,
                                           {rows},
                                           Stage::kPrepare,
                                           Stage::kFinalize,
                                           "token * topk + slot of each permuted row (for the combine)"});
  // a1q_permuted dies after W1; act_q is born at the activation: they share bytes.
  b.begin_alias("gemm_in");
  w.a1q_permuted = b.add_as<std::uint8_t>({"a1q_permuted",
                                           DType::kFp8E4m3,
                                           {rows, p.K},
                                           Stage::kPrepare,
                                           Stage::kGemm1,
                                           "FP8 tokens grouped by local expert"});
  w.a1q_scale_permuted =
      b.add_as<float>({"a1q_scale_permuted", DType::kFp32, activation_scale_shape(p.quant, {rows}, p.K, false),
                       Stage::kPrepare, Stage::kGemm1, "scales of a1q_permuted"});
  b.next_alternative();
  w.act_q = b.add_as<std::uint8_t>(
      {"act_q", DType::kFp8E4m3, {rows, I}, Stage::kActivation, Stage::kGemm2, "activation output quantized to FP8"});
  w.act_scale = b.add_as<float>({"act_scale", DType::kFp32, activation_scale_shape(p.quant, {rows}, I, false),
                                 Stage::kActivation, Stage::kGemm2, "scales of act_q"});
  b.end_alias();
  // w1_out dies at the activation; w2_out is born at W2: they share bytes.
  b.begin_alias("gemm_out");
  w.w1_out = b.add_as<std::uint16_t>(
      {"w1_out", DType::kBf16, {rows, p.N}, Stage::kGemm1, Stage::kActivation, "W1 GEMM output (gate|up)"});
  b.next_alternative();
  w.w2_out = b.add_as<std::uint16_t>({"w2_out",
                                      DType::kBf16,
                                      {rows, p.K},
                                      Stage::kGemm2,
                                      Stage::kFinalize,
                                      "W2 GEMM output per (token, slot), reduced by the combine"});
  b.end_alias();
  w.gemm_args = b.add_as<std::byte>({"gemm_args",
                                     DType::kUint8,
                                     {2, p.E_local, kGemmArgsBytesPerExpert},
                                     Stage::kPrepare,
                                     Stage::kGemm2,
                                     "grouped-GEMM arguments"});
  w.gemm_scratch = b.add_as<std::byte>({"gemm_scratch",
                                        DType::kUint8,
                                        {kGemmScratchBytes},
                                        Stage::kGemm1,
                                        Stage::kGemm2,
                                        "CUTLASS workspace (bound, checked at run time)"});
  w.status = b.add_as<std::int32_t>(
      {"status", DType::kInt32, {kStatusWords}, Stage::kPrepare, Stage::kFinalize, "device error flags"});
  return w;
}

void declare_upstream_batched_cutlass(const MoeProblem& p, WorkspaceBuilder& b, bool before_fix) {
  MOEKIT_CHECK(p.format == ActivationFormat::kBatchedExperts, "the upstream batched formula needs the batched format");
  // Before the fix the token dimension was M * num_dispatchers: the dispatch ranks counted twice.
  std::int64_t tokens = p.M;
  if (before_fix)
    MOEKIT_CHECK(!__builtin_mul_overflow(p.M, p.num_dispatchers, &tokens), "M * num_dispatchers = {} * {} overflows",
                 p.M, p.num_dispatchers);
  const std::int64_t I = p.I();
  b.set_reference(before_fix ? "upstream CutlassBatchedExpertsFp8.workspace_shapes before the fix: "
                               "workspace token dimension M * num_dispatchers (dispatch ranks counted twice)"
                             : "upstream CutlassBatchedExpertsFp8.workspace_shapes after the fix: token dimension M");
  declare_batched_buffers(p, b);
  b.add({"workspace1",
         DType::kBf16,
         {p.E_local, tokens, std::max(p.N, p.K)},
         Stage::kPrepare,
         Stage::kFinalize,
         before_fix ? "W1 output, token dim M*D: counts the dispatchers twice" : "W1 output, (E_local, M, max(N, K))"});
  b.add({"workspace2",
         DType::kBf16,
         {p.E_local, tokens, std::max(I, p.K)},
         Stage::kPrepare,
         Stage::kFinalize,
         before_fix ? "activation output / W2 output, token dim M*D" : "activation output / W2 output, max(I, K)"});
}

}  // namespace plan

// --- Registry ---------------------------------------------------------------------------------

const std::vector<BackendInfo>& backends() {
  static const std::vector<BackendInfo> all = {
      {"batched-fp8", ActivationFormat::kBatchedExperts, false,
       "moekit batched FP8 experts: valid rows only, W2 straight into the output, FP8 activation"},
      {"standard-fp8", ActivationFormat::kStandard, false,
       "moekit standard FP8 experts: permute, grouped GEMMs, combine; gemm buffers aliased by lifetime"},
      {"upstream-batched-cutlass-before-fix", ActivationFormat::kBatchedExperts, true,
       "reference: upstream batched CUTLASS FP8 formula before the fix (M * num_dispatchers)"},
      {"upstream-batched-cutlass-after-fix", ActivationFormat::kBatchedExperts, true,
       "reference: upstream batched CUTLASS FP8 formula after the fix (M)"},
  };
  return all;
}

const BackendInfo& backend_info(std::string_view name) {
  std::string valid;
  for (const auto& b : backends()) {
    if (b.name == name) return b;
    valid += (valid.empty() ? "" : ", ") + b.name;
  }
  MOEKIT_FAIL("unknown backend '{}': valid backends are {}", name, valid);
}

WorkspacePlan plan_workspace(std::string_view backend, const MoeProblem& problem, std::int64_t guard_bytes) {
  const BackendInfo& info = backend_info(backend);
  MOEKIT_CHECK(problem.format == info.format, "backend {} takes the {} format, the problem is {}", info.name,
               format_name(info.format), format_name(problem.format));
  validate_problem(problem);
  WorkspaceBuilder builder(info.name, problem, nullptr, 0, guard_bytes);
  if (info.name == "batched-fp8") {
    plan::declare_batched_fp8(problem, builder);
  } else if (info.name == "standard-fp8") {
    plan::declare_standard_fp8(problem, builder);
  } else {
    plan::declare_upstream_batched_cutlass(problem, builder, info.name == "upstream-batched-cutlass-before-fix");
  }
  WorkspacePlan plan = builder.finish();
  plan.note = plan.note.empty() ? info.summary : plan.note;
  return plan;
}

std::int64_t expert_weight_bytes(const MoeProblem& p) {
  const std::int64_t I = p.I();
  const std::int64_t fp8 = shape_bytes({p.E_local, p.N * p.K + p.K * I}, DType::kFp8E4m3, "expert weights");
  auto blocks = [](std::int64_t x) { return (x + kQuantBlock - 1) / kQuantBlock; };
  std::int64_t scales = 0;
  switch (p.quant) {
    case QuantScheme::kPerTensor: scales = 2; break;
    case QuantScheme::kPerTokenPerChannel: scales = p.N + p.K; break;
    case QuantScheme::kBlock128: scales = blocks(p.N) * blocks(p.K) + blocks(p.K) * blocks(I); break;
  }
  return fp8 + shape_bytes({p.E_local, scales}, DType::kFp32, "expert weight scales");
}

}  // namespace moekit
