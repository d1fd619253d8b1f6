// The batched FP8 experts on Hopper, host side: the declaration (what `moekit plan` prints for
// cuda), what it cannot run, and the launch over the workspace; the kernels are in
// batched_experts.cu and grouped_gemm_*.cu. Mirrors src/cpu/batched_experts.cpp. Workspace
// (DeepSeek-V3 DP 32, 16 local experts, M = 8192): w1_out 1 GiB, act_q 256 MiB, act_scale 512 KiB,
// GEMM arguments 2 x 2 KiB, CUTLASS scratch 1 MiB, status words and row offsets.
#include <fmt/format.h>

#include <limits>
#include <optional>

#include "cuda/backend.h"
#include "cuda/launch.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "plan/experts_recipe.h"

namespace moekit::cuda {
namespace {

class CudaBatchedExperts final : public Experts {
 public:
  explicit CudaBatchedExperts(std::optional<plan::GemmConfig> forced) : forced_(forced) {}

  std::string_view name() const override { return "batched-fp8"; }
  Device device() const override { return Device::kCuda; }
  ActivationFormat format() const override { return ActivationFormat::kBatchedExperts; }

  std::string unsupported(const MoeProblem& p) const override {
    if (std::string why = plan::format_mismatch(name(), format(), p); !why.empty()) return why;
    if (std::string why = plan::recipe_unsupported(name(), device(), p); !why.empty()) return why;
    if (p.expert_bias && p.fuse_w1) return plan::kExpertBiasUnfusedOnly;
    if (p.M > std::numeric_limits<std::int32_t>::max() || p.E_local > 65535)
      return fmt::format(
          "M = {} and E_local = {} must fit the kernels' 32-bit rows and grid (M < 2^31, E_local <= "
          "65535)",
          p.M, p.E_local);
    if (forced_) {
      const plan::GemmConfigInfo& c = plan::gemm_config_info(*forced_);
      if (c.fused_w1 != plan::fuses_w1(p))
        return fmt::format("GEMM config {} {} W1, the problem's recipe {} it (fuse_w1)", c.name,
                           c.fused_w1 ? "fuses" : "does not fuse", p.fuse_w1 ? "fuses" : "does not fuse");
      if (c.fused_w1 ? !plan::supports(c, p.N, p.K, p.quant, true)
                     : !plan::supports(c, p.N, p.K, p.quant) || !plan::supports(c, p.K, p.I(), p.quant))
        return fmt::format(
            "GEMM config {} does not run W1 (n = {}, k = {}) and W2 (n = {}, k = {}) for the {} recipe (see "
            "plan/gemm_config.h: its n multiple and the recipes it has instances for)",
            c.name, p.N, p.K, p.K, p.I(), quant_name(p.quant));
    }
    return {};
  }

  std::string describe_config(const MoeProblem& p, std::int64_t tokens_per_rank) const override {
    const plan::ExpertsGemmPlan g = gemms(p, tokens_per_rank);
    return fmt::format("GEMMs by each expert's rows (<= {} in a step): W1 {}; W2 {}{}",
                       plan::max_rows_per_expert(p, tokens_per_rank > 0 ? tokens_per_rank : p.max_tokens_per_rank),
                       plan::describe(g.w1), plan::describe(g.w2), forced_ ? " (fixed)" : "");
  }

  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override {
    MOEKIT_CHECK(unsupported(p).empty(), "{}", unsupported(p));
    const plan::ExpertsGemmPlan g = gemms(p, p.max_tokens_per_rank);
    plan::declare_batched_recipe(p, b, !g.fused_w1);
    declare_gemm_regions(p, g, b);
    b.add({"row_offsets",
           DType::kInt32,
           {p.E_local + 1},
           Stage::kPrepare,
           Stage::kGemm2,
           "first valid row of each expert over the valid rows: the activation's (and W2's biases') row index"});
  }

  ExpertsOutput run(const MoeProblem& p, const ExpertsInput& in, const ExpertWeightsView& w, Workspace& ws,
                    Stream stream) override {
    ws.require(p, "batched-fp8 (cuda)");
    MOEKIT_CHECK(ws.device() == Device::kCuda, "batched-fp8 (cuda) needs its workspace in CUDA memory, got {}",
                 device_name(ws.device()));
    validate_weights(w, p, Device::kCuda);
    if (num_sms_ == 0) num_sms_ = current_device_num_sms();
    const BatchedExpertsLaunch l = make_launch(
        p, in, w, ws, num_sms_, gemms(p, plan::step_tokens_per_rank(p, in.num_tokens, in.max_tokens_any_rank)));
    launch_batched_experts(l, stream);
    return {in.output, nullptr};
  }

  void check_status(Workspace& ws, Stream stream) override {
    check_status_words(ws.get<std::int32_t>("experts_status"), "batched-fp8 (cuda)", ws.problem().M, ws.problem().E,
                       stream);
  }

  // The launches for steps of tokens_per_rank tokens on every dispatcher (plan::step_tokens_per_rank).
  plan::ExpertsGemmPlan gemms(const MoeProblem& p, std::int64_t tokens_per_rank) const {
    if (forced_) return plan::single_config(*forced_, p);
    return plan::plan_experts_gemms(p, tokens_per_rank > 0 ? tokens_per_rank : p.max_tokens_per_rank);
  }

 private:
  std::optional<plan::GemmConfig> forced_;
  int num_sms_ = 0;
};

}  // namespace

void declare_gemm_regions(const MoeProblem& p, const plan::ExpertsGemmPlan& g, WorkspaceBuilder& b) {
  if (g.w1_small)
    b.add({"w1_small",
           DType::kFp32,
           {p.E_local, plan::w1_small_rows(p), p.N},
           Stage::kGemm1,
           Stage::kActivation,
           "the fused recipe's W1 output (fp32) of the experts of <= " + std::to_string(plan::fused_w1_small_rows()) +
               " rows, for the activation kernel (the fused W1 runs the others)"});
  b.add({"gemm_args_w1",
         DType::kUint8,
         {plan::kMaxGemmLaunches, p.E_local, kGemmArgsBytesPerGroup},
         Stage::kPrepare,
         Stage::kGemm1,
         "W1 grouped-GEMM shapes, pointers and strides per launch, built on the device from the counts"});
  b.add({"gemm_args_w2",
         DType::kUint8,
         {plan::kMaxGemmLaunches, p.E_local, kGemmArgsBytesPerGroup},
         Stage::kPrepare,
         Stage::kGemm2,
         "W2 grouped-GEMM shapes, pointers and strides per launch, built on the device from the counts"});
  b.add({"gemm_scratch",
         DType::kUint8,
         {kGemmScratchBytes},
         Stage::kGemm1,
         Stage::kGemm2,
         "CUTLASS workspace (a bound, checked at every launch)"});
  b.add({"experts_status",
         DType::kInt32,
         {kStatusWords},
         Stage::kPrepare,
         Stage::kFinalize,
         "device error flags (counts out of range, bad expert ids): kept across steps until check_status reads them",
         true});
}

void fill_gemm_regions(BatchedExpertsLaunch& l, Workspace& ws) {
  l.w1_out = ws.plan().find_region("w1_out") ? ws.get<std::uint16_t>("w1_out") : nullptr;  // none when W1 is fused
  l.w1_small = ws.plan().find_region("w1_small") ? ws.get<float>("w1_small") : nullptr;
  // W2's A operand: act_q + act_scale (FP8), or act (bf16, no scales) as its bytes.
  const MoeProblem& p = ws.problem();
  l.act_q = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>(plan::act_region(p.quant)));
  const RecipeInfo recipe = recipe_info(p.quant);
  l.act_scale = has_activation_scales(recipe) ? ws.get<float>("act_scale") : nullptr;
  l.gemm_args_w1 = ws.get<std::byte>("gemm_args_w1");
  l.gemm_args_w2 = ws.get<std::byte>("gemm_args_w2");
  l.gemm_scratch = ws.get<std::byte>("gemm_scratch");
}

BatchedExpertsLaunch make_launch(const MoeProblem& p, const ExpertsInput& in, const ExpertWeightsView& w, Workspace& ws,
                                 int num_sms, plan::ExpertsGemmPlan gemms) {
  BatchedExpertsLaunch l;
  l.problem = p;
  l.weights = w;
  l.a1q = in.a1q;
  l.a1q_scale = in.a1q_scale;
  l.expert_num_tokens = in.expert_num_tokens;
  l.output = in.output;
  fill_gemm_regions(l, ws);
  l.row_offsets = ws.get<std::int32_t>("row_offsets");
  l.status = ws.get<std::int32_t>("experts_status");
  l.gemms = gemms;
  l.max_rows = plan::max_rows_per_expert(p, plan::step_tokens_per_rank(p, in.num_tokens, in.max_tokens_any_rank));
  l.num_sms = num_sms;
  return l;
}

std::unique_ptr<Experts> make_batched_experts(const ExecContext&) {
  return std::make_unique<CudaBatchedExperts>(std::nullopt);
}

std::unique_ptr<Experts> make_batched_experts(const ExecContext&, plan::GemmConfig config) {
  return std::make_unique<CudaBatchedExperts>(config);
}

}  // namespace moekit::cuda
