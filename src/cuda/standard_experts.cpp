// The standard-format FP8 experts on Hopper, host side: tokens in token order with their local top-k
// ids -> a device row map (rows of an expert contiguous, in (token, slot) order, as the CPU) -> the
// permutation of the FP8 rows -> the grouped GEMMs of cuda/experts.cu over contiguous rows -> one
// output row per (token, slot) in w2_out, unpermuted by the finalize's combine. Mirrors
// src/cpu/standard_experts.cpp; the recipe's regions are plan/experts_recipe.cpp's.
#include <fmt/format.h>

#include <limits>

#include "cuda/backend.h"
#include "cuda/launch.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "plan/experts_recipe.h"

namespace moekit::cuda {
namespace {

class CudaStandardExperts final : public Experts {
 public:
  std::string_view name() const override { return "standard-fp8"; }
  Device device() const override { return Device::kCuda; }
  ActivationFormat format() const override { return ActivationFormat::kStandard; }

  std::string unsupported(const MoeProblem& p) const override {
    if (std::string why = plan::format_mismatch(name(), format(), p); !why.empty()) return why;
    if (std::string why = plan::recipe_unsupported(name(), device(), p); !why.empty()) return why;
    if (p.expert_bias && p.fuse_w1) return plan::kExpertBiasUnfusedOnly;
    if (p.E_local > kMaxRowMapExperts)
      return fmt::format("E_local = {} exceeds the {} experts the CUDA row map holds", p.E_local, kMaxRowMapExperts);
    if (p.M * p.topk > std::numeric_limits<std::int32_t>::max())
      return fmt::format("M * topk = {} rows exceed 2^31 - 1", p.M * p.topk);
    return {};
  }

  std::string describe_config(const MoeProblem& p, std::int64_t tokens_per_rank) const override {
    const std::int64_t T = tokens_per_rank > 0 ? tokens_per_rank : p.max_tokens_per_rank;
    const plan::ExpertsGemmPlan g = plan::plan_experts_gemms(p, T);
    return fmt::format("GEMMs by each expert's rows (<= {} in a step): W1 {}; W2 {}", plan::max_rows_per_expert(p, T),
                       plan::describe(g.w1), plan::describe(g.w2));
  }

  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override {
    MOEKIT_CHECK(unsupported(p).empty(), "{}", unsupported(p));
    const plan::ExpertsGemmPlan g = plan::plan_experts_gemms(p, p.max_tokens_per_rank);
    plan::declare_standard_recipe(p, b, !g.fused_w1);
    b.add({"expert_counts",
           DType::kInt32,
           {p.E_local},
           Stage::kPrepare,
           Stage::kGemm2,
           "rows of each local expert, from the device row map"});
    b.add({"row_map_tiles",
           DType::kInt32,
           {row_map_scratch_ints(p.M * p.topk, p.E_local)},
           Stage::kPrepare,
           Stage::kPrepare,
           "the row map's per-tile counts and first ranks per expert"});
    declare_gemm_regions(p, g, b);
  }

  ExpertsOutput run(const MoeProblem& p, const ExpertsInput& in, const ExpertWeightsView& w, Workspace& ws,
                    Stream stream) override {
    ws.require(p, "standard-fp8 (cuda)");
    validate_weights(w, p, Device::kCuda);
    MOEKIT_CHECK(in.num_tokens >= 0 && in.num_tokens <= p.M, "T = {} tokens exceed the capacity M = {}: chunk the step",
                 in.num_tokens, p.M);
    if (num_sms_ == 0) num_sms_ = current_device_num_sms();
    auto* status = ws.get<std::int32_t>("experts_status");
    auto* pair_row = ws.get<std::int32_t>("pair_row");
    launch_row_map(in.topk_ids, in.num_tokens * p.topk, static_cast<int>(p.topk), static_cast<int>(p.E_local), true,
                   p.M * p.topk, pair_row, ws.get<std::int32_t>("expert_counts"),
                   ws.get<std::int32_t>("expert_offsets"), ws.get<std::int32_t>("row_map_tiles"), status, stream);
    // A recipe without activation scales (bf16) has no a1q_scale_permuted: its rows move alone.
    float* permuted_scale = has_activation_scales(recipe_info(p.quant)) ? ws.get<float>("a1q_scale_permuted") : nullptr;
    launch_permute_rows(pair_row, in.num_tokens, static_cast<int>(p.topk), p.K, p.quant, in.a1q, in.a1q_scale,
                        reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q_permuted")), permuted_scale, stream);
    BatchedExpertsLaunch l;
    l.problem = p;
    l.weights = w;
    l.contiguous = true;
    l.a1q = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q_permuted"));
    l.a1q_scale = permuted_scale;
    l.expert_num_tokens = ws.get<std::int32_t>("expert_counts");
    l.output = ws.get<std::uint16_t>("w2_out");
    fill_gemm_regions(l, ws);
    l.row_offsets = ws.get<std::int32_t>("expert_offsets");
    l.status = status;
    l.gemms = plan::plan_experts_gemms(p, in.num_tokens);
    l.max_rows = plan::max_rows_per_expert(p, in.num_tokens);  // each token picks an expert at most once
    l.num_sms = num_sms_;
    launch_batched_experts(l, stream);
    return {l.output, pair_row};
  }

  void check_status(Workspace& ws, Stream stream) override {
    check_status_words(ws.get<std::int32_t>("experts_status"), "standard-fp8 (cuda)",
                       ws.problem().M * ws.problem().topk, ws.problem().E_local, stream);
  }

 private:
  int num_sms_ = 0;
};

}  // namespace

std::unique_ptr<Experts> make_standard_experts(const ExecContext&) {
  return std::make_unique<CudaStandardExperts>();
}

}  // namespace moekit::cuda
