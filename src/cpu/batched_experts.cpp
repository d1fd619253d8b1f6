// The batched experts on the CPU: (E_local, M, K) FP8 (or bf16) tokens with expert_num_tokens -> W1 ->
// activation + FP8 (or bf16) -> W2 -> (E_local, M, K) bf16, valid rows only; the oracle of the CUDA twin
// (src/cuda/batched_experts.cpp). Workspace (DeepSeek-V3 DP 32, 16 local experts, M = 8192):
// w1_out 16 x 8192 x 4096 bf16 = 1 GiB, act_q 256 MiB, act_scale 512 KiB.
#include <fmt/format.h>

#include <cstddef>

#include "cpu/backend.h"
#include "cpu/expert_pipeline.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "numerics/scales.h"
#include "plan/experts_recipe.h"
#include "plan/gemm_config.h"

namespace moekit::cpu {
namespace {

class CpuBatchedExperts final : public Experts {
 public:
  explicit CpuBatchedExperts(const ExecContext& ctx) : pool_(ctx.pool) {}

  std::string_view name() const override { return "batched-fp8"; }
  Device device() const override { return Device::kCpu; }
  ActivationFormat format() const override { return ActivationFormat::kBatchedExperts; }

  std::string unsupported(const MoeProblem& p) const override { return plan::format_mismatch(name(), format(), p); }

  std::string describe_config(const MoeProblem& p, std::int64_t) const override {
    return fmt::format("fp32-accumulating {} GEMMs on the CPU's vector units",
                       dtype_name(recipe_info(p.quant).activation_dtype));
  }

  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override {
    MOEKIT_CHECK(unsupported(p).empty(), "{}", unsupported(p));
    const bool fused = plan::fuses_w1(p);
    plan::declare_batched_recipe(p, b, !fused);
    if (fused) declare_fused_w1_rows(p, b);
  }

  ExpertsOutput run(const MoeProblem& p, const ExpertsInput& in, const ExpertWeightsView& w, Workspace& ws,
                    Stream) override {
    ws.require(p, "batched-fp8 (cpu)");
    validate_weights(w, p, Device::kCpu);
    MOEKIT_CHECK(pool_ != nullptr, "batched-fp8 (cpu) runs on a thread pool: build it with ExecContext::pool");
    const std::int64_t N = p.N, K = p.K, I = p.I(), M = p.M;
    const std::int64_t a_spr = activation_scales_per_row(p.quant, K), act_spr = activation_scales_per_row(p.quant, I);
    const bool fused = plan::fuses_w1(p);
    const bool scaled = has_activation_scales(recipe_info(p.quant));
    const std::int64_t ab = activation_bytes(p);  // bytes of an a1q / act_q element: FP8 1, bf16 2
    auto* w1_out = fused ? nullptr : ws.get<bf16_t>("w1_out");
    auto* w1_rows = fused ? ws.get<float>("w1_rows") : nullptr;
    auto* act_q = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>(plan::act_region(p.quant)));
    auto* act_scale = scaled ? ws.get<float>("act_scale") : nullptr;
    // One read of each count, one behaviour (the CUDA experts'): a count outside [0, M], or past the
    // rows the step's tokens allow (plan::step_tokens_per_rank), runs that expert with 0 rows (nothing
    // is read or written past its M rows) and is raised by check_status(), not mid-step: the step's
    // collective finalize still runs on every rank.
    const std::int64_t max_rows =
        plan::max_rows_per_expert(p, plan::step_tokens_per_rank(p, in.num_tokens, in.max_tokens_any_rank));
    std::string bad;
    for (std::int64_t e = 0; e < p.E_local; ++e) {
      std::int64_t m = in.expert_num_tokens[e];
      if (m < 0 || m > M) {
        if (bad.empty()) bad = plan::bad_count_message("batched-fp8 (cpu)", e, m, M);
        m = 0;
      } else if (m > max_rows) {
        if (bad.empty()) bad = plan::over_step_bound_message("batched-fp8 (cpu)", e, m, max_rows);
        m = 0;
      }
      // Per-tensor: one scale per expert; otherwise the expert's rows' scales; unquantized: none.
      const float* a_scale = !scaled                                          ? nullptr
                             : numerics::activation_scale_per_tensor(p.quant) ? in.a1q_scale + e
                                                                              : in.a1q_scale + e * M * a_spr;
      float* e_act_scale = !scaled                                          ? nullptr
                           : numerics::activation_scale_per_tensor(p.quant) ? act_scale + e
                                                                            : act_scale + e * M * act_spr;
      expert_rows(p, w, e, m, in.a1q + e * M * K * ab, a_scale, fused ? nullptr : w1_out + e * M * N, w1_rows,
                  act_q + e * M * I * ab, e_act_scale, in.output + e * M * K, *pool_);
    }
    if (pending_.empty()) pending_ = std::move(bad);  // the first error stays until read
    return {in.output, nullptr};
  }

  void check_status(Workspace&, Stream) override {
    if (pending_.empty()) return;
    const std::string why = std::move(pending_);
    pending_.clear();
    MOEKIT_FAIL("{}", why);
  }

 private:
  ThreadPool* pool_;
  std::string pending_;
};

}  // namespace

std::unique_ptr<Experts> make_batched_experts(const ExecContext& ctx) {
  return std::make_unique<CpuBatchedExperts>(ctx);
}

}  // namespace moekit::cpu
