// The standard-format experts on the CPU: tokens (FP8 or bf16) in token order with their local top-k ids ->
// permute (rows grouped by expert, (token, slot) order inside each) -> W1 -> activation + FP8 (or bf16) ->
// W2 -> one output row per (token, slot), left in the workspace for the finalize's combine. The
// GEMM buffers alias by lifetime: a1q_permuted dies at W1 where act_q is born, w1_out at the
// activation where w2_out is born (DeepSeek-V3, 256 tokens, top-8, 16 local experts: 43 MiB).
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "cpu/backend.h"
#include "cpu/expert_pipeline.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "numerics/scales.h"
#include "plan/experts_recipe.h"
#include "plan/gemm_config.h"

namespace moekit::cpu {
namespace {

class CpuStandardExperts final : public Experts {
 public:
  explicit CpuStandardExperts(const ExecContext& ctx) : pool_(ctx.pool) {}

  std::string_view name() const override { return "standard-fp8"; }
  Device device() const override { return Device::kCpu; }
  ActivationFormat format() const override { return ActivationFormat::kStandard; }

  std::string unsupported(const MoeProblem& p) const override { return plan::format_mismatch(name(), format(), p); }

  std::string describe_config(const MoeProblem& p, std::int64_t) const override {
    return fmt::format("fp32-accumulating {} GEMMs on the CPU's vector units",
                       dtype_name(recipe_info(p.quant).activation_dtype));
  }

  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override {
    MOEKIT_CHECK(unsupported(p).empty(), "{}", unsupported(p));
    const bool fused = plan::fuses_w1(p);
    plan::declare_standard_recipe(p, b, !fused);
    if (fused) declare_fused_w1_rows(p, b);
  }

  ExpertsOutput run(const MoeProblem& p, const ExpertsInput& in, const ExpertWeightsView& w, Workspace& ws,
                    Stream) override {
    ws.require(p, "standard-fp8 (cpu)");
    validate_weights(w, p, Device::kCpu);
    MOEKIT_CHECK(pool_ != nullptr, "standard-fp8 (cpu) runs on a thread pool: build it with ExecContext::pool");
    const std::int64_t T = in.num_tokens, N = p.N, K = p.K, I = p.I(), topk = p.topk, E_local = p.E_local;
    MOEKIT_CHECK(T >= 0 && T <= p.M, "T = {} tokens exceed the capacity M = {}: chunk the step", T, p.M);
    for (std::int64_t i = 0; i < T * topk; ++i)
      MOEKIT_CHECK(in.topk_ids[i] >= -1 && in.topk_ids[i] < E_local,
                   "topk_ids[{}][{}] = {} is outside [-1, E_local = {}): ids must be local expert indices", i / topk,
                   i % topk, in.topk_ids[i], E_local);
    auto* offsets = ws.get<std::int32_t>("expert_offsets");
    auto* pair_row = ws.get<std::int32_t>("pair_row");
    // Scales only where the recipe has them (the unquantized one declares none); a1q and act_q hold
    // `ab` bytes an element.
    const bool scaled = has_activation_scales(recipe_info(p.quant));
    const std::int64_t ab = activation_bytes(p);
    auto* a1q_permuted = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q_permuted"));
    auto* a1q_scale_permuted = scaled ? ws.get<float>("a1q_scale_permuted") : nullptr;
    auto* act_q = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>(plan::act_region(p.quant)));
    auto* act_scale = scaled ? ws.get<float>("act_scale") : nullptr;
    const bool fused = plan::fuses_w1(p);
    auto* w1_out = fused ? nullptr : ws.get<bf16_t>("w1_out");
    auto* w2_out = ws.get<bf16_t>("w2_out");

    // Permute: rows grouped by expert, in (token, slot) order inside each expert.
    std::vector<std::int64_t> count(static_cast<std::size_t>(E_local), 0);
    for (std::int64_t i = 0; i < T * topk; ++i)
      if (in.topk_ids[i] >= 0) ++count[static_cast<std::size_t>(in.topk_ids[i])];
    // Each token picks an expert at most once, so an expert holds at most T rows: the CUDA experts plan
    // their GEMM launches on that bound and refuse more (plan::max_rows_per_expert). Refused here too,
    // before anything is computed: the two devices agree on duplicated top-k ids.
    const std::int64_t max_rows = plan::max_rows_per_expert(p, T);
    for (std::int64_t e = 0; e < E_local; ++e)
      MOEKIT_CHECK(
          count[static_cast<std::size_t>(e)] <= max_rows, "{}",
          plan::over_step_bound_message("standard-fp8 (cpu)", e, count[static_cast<std::size_t>(e)], max_rows));
    offsets[0] = 0;
    for (std::int64_t e = 0; e < E_local; ++e)
      offsets[e + 1] = offsets[e] + static_cast<std::int32_t>(count[static_cast<std::size_t>(e)]);
    std::vector<std::int64_t> cursor(offsets, offsets + E_local);
    const std::int64_t a_spr = activation_scales_per_row(p.quant, K), act_spr = activation_scales_per_row(p.quant, I);
    for (std::int64_t i = 0; i < T * topk; ++i) {
      const std::int32_t e = in.topk_ids[i];
      if (e < 0) {
        pair_row[i] = -1;
        continue;
      }
      const std::int64_t row = cursor[static_cast<std::size_t>(e)]++;
      pair_row[i] = static_cast<std::int32_t>(row);
      const std::int64_t t = i / topk;
      std::copy_n(in.a1q + t * K * ab, K * ab, a1q_permuted + row * K * ab);
      if (scaled) std::copy_n(in.a1q_scale + t * a_spr, a_spr, a1q_scale_permuted + row * a_spr);
    }
    if (numerics::activation_scale_per_tensor(p.quant)) a1q_scale_permuted[0] = in.a1q_scale[0];

    if (fused) {
      // The fused W1: act_q is written while W1 runs, so the recipe aliases a1q_permuted with w2_out
      // instead (plan/experts_recipe.cpp).
      auto* w1_rows = ws.get<float>("w1_rows");
      for (std::int64_t e = 0; e < E_local; ++e) {
        const std::int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
        if (m == 0) continue;
        fused_w1_activation_quant(p, w, e, m, a1q_permuted + r0 * K, a1q_scale_permuted + r0 * a_spr, w1_rows,
                                  act_q + r0 * I, act_scale + r0 * act_spr, *pool_);
      }
    } else {
      // W1 per expert over its rows (reads a1q_permuted, which act_q overwrites only afterwards).
      for (std::int64_t e = 0; e < E_local; ++e) {
        const std::int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
        if (m == 0) continue;
        const float* a_scale = !scaled                                          ? nullptr
                               : numerics::activation_scale_per_tensor(p.quant) ? a1q_scale_permuted
                                                                                : a1q_scale_permuted + r0 * a_spr;
        run_expert_gemm(p, w, 1, e, m, a1q_permuted + r0 * K * ab, a_scale, w1_out + r0 * N, *pool_);
      }
      // Activation + quant over all permuted rows at once: they form one tensor (per-tensor keeps one
      // scale for it; the other schemes are row-local). All of it precedes W2, because w2_out aliases
      // w1_out (declared: their lifetimes do not overlap).
      activation_quant(p, w1_out, offsets[E_local], act_q, act_scale, *pool_);
    }
    for (std::int64_t e = 0; e < E_local; ++e) {
      const std::int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
      if (m == 0) continue;
      const float* a_scale = !scaled                                          ? nullptr
                             : numerics::activation_scale_per_tensor(p.quant) ? act_scale
                                                                              : act_scale + r0 * act_spr;
      run_expert_gemm(p, w, 2, e, m, act_q + r0 * I * ab, a_scale, w2_out + r0 * K, *pool_);
    }
    return {w2_out, pair_row};
  }

  void check_status(Workspace&, Stream) override {}

 private:
  ThreadPool* pool_;
};

}  // namespace

std::unique_ptr<Experts> make_standard_experts(const ExecContext& ctx) {
  return std::make_unique<CpuStandardExperts>(ctx);
}

}  // namespace moekit::cpu
