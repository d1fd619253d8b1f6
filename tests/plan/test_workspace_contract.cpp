// The workspace contract, held by tests: batched M is max_tokens_per_rank * num_dispatchers and is
// never multiplied again; region shapes; live regions never share bytes; totals; guard bands; the
// golden DeepSeek-V3 figures of the upstream report; bad input raises moekit::Error naming the value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <tuple>

#include "moekit/check.h"
#include "moekit/problem.h"
#include "moekit/workspace.h"
#include "plan/experts_workspace.h"

namespace moekit {
namespace {

constexpr std::int64_t kGiB = std::int64_t{1} << 30;
constexpr std::int64_t kMaxTokensPerRank = 256;

std::int64_t align256(std::int64_t x) {
  return (x + 255) / 256 * 256;
}

ModelConfig deepseek_like() {
  ModelConfig m = load_model("deepseek-v3");
  return m;
}

// Every pair of regions whose lifetimes intersect occupies disjoint bytes; every region lies inside
// the allocation on an aligned offset.
void expect_live_regions_disjoint(const WorkspacePlan& plan, const std::string& ctx) {
  for (const auto& r : plan.regions) {
    EXPECT_EQ(r.offset % WorkspaceBuilder::kAlignment, 0) << ctx << " region " << r.name;
    EXPECT_GE(r.offset, 0) << ctx << " region " << r.name;
    EXPECT_LE(r.offset + r.bytes, plan.total_bytes) << ctx << " region " << r.name;
  }
  for (std::size_t i = 0; i < plan.regions.size(); ++i) {
    for (std::size_t j = i + 1; j < plan.regions.size(); ++j) {
      const Region& a = plan.regions[i];
      const Region& b = plan.regions[j];
      const bool live_together = a.live_from <= b.live_to && b.live_from <= a.live_to;
      const bool bytes_overlap = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
      EXPECT_FALSE(live_together && bytes_overlap && a.bytes > 0 && b.bytes > 0)
          << ctx << ": regions " << a.name << " [" << a.offset << ", +" << a.bytes << ") and " << b.name << " ["
          << b.offset << ", +" << b.bytes << ") are live together and share bytes";
      if (bytes_overlap && a.bytes > 0 && b.bytes > 0) {
        EXPECT_FALSE(a.alias_group.empty()) << ctx << ": " << a.name << " overlaps " << b.name << " undeclared";
        EXPECT_EQ(a.alias_group, b.alias_group) << ctx << ": " << a.name << " overlaps " << b.name;
      }
    }
  }
}

// Expected total from the regions alone: alias groups count their largest alternative. Regions of
// one alternative are consecutive; a new alternative restarts at the group's first offset.
std::int64_t expected_total(const WorkspacePlan& plan) {
  std::int64_t end = 0;
  for (const auto& r : plan.regions) end = std::max(end, align256(r.offset + r.bytes));
  return end;
}

using ContractParam = std::tuple<std::int64_t /*dp*/, std::int64_t /*E_local*/, Activation, ActivationFormat>;

class WorkspaceContract : public ::testing::TestWithParam<ContractParam> {};

TEST_P(WorkspaceContract, ShapesLifetimesTotals) {
  const auto [dp, E_local, act, format] = GetParam();
  const ModelConfig model = deepseek_like();
  const ParallelConfig par{dp, model.num_experts / E_local, kMaxTokensPerRank, E_local};
  for (QuantScheme quant : all_quant_schemes()) {
    const MoeProblem p = make_problem(model, par, format, quant, act);
    const std::int64_t I = activation_out_dim(act, p.N);
    const std::string ctx = p.describe();

    // The contract: batched M is max_tokens_per_rank * num_dispatchers, already global.
    if (format == ActivationFormat::kBatchedExperts) {
      ASSERT_EQ(p.M, kMaxTokensPerRank * dp) << ctx;
      ASSERT_EQ(p.num_dispatchers, dp) << ctx;
    } else {
      ASSERT_EQ(p.M, kMaxTokensPerRank) << ctx;
    }
    ASSERT_EQ(p.N, is_gated(act) ? 2 * model.moe_intermediate_size : model.moe_intermediate_size) << ctx;

    for (const auto& info : backends()) {
      if (info.format != format) continue;
      const WorkspacePlan plan = plan_workspace(info.name, p);
      const std::string c = info.name + " " + ctx;
      expect_live_regions_disjoint(plan, c);
      EXPECT_EQ(plan.total_bytes, expected_total(plan)) << c;
      EXPECT_EQ(plan.problem.M, p.M) << c;

      // The workspace depends on M alone, not on how M splits into tokens x dispatchers: the same
      // M reached as (M tokens, 1 dispatcher) must give byte-identical plans. A backend that
      // multiplies M by num_dispatchers again fails here (except the quoted before-fix formula).
      if (format == ActivationFormat::kBatchedExperts && info.name != "upstream-batched-cutlass-before-fix") {
        MoeProblem single = p;
        single.max_tokens_per_rank = p.M;
        single.num_dispatchers = 1;
        const WorkspacePlan same = plan_workspace(info.name, single);
        EXPECT_EQ(same.total_bytes, plan.total_bytes) << c << ": workspace depends on num_dispatchers beyond M";
        EXPECT_EQ(same.buffer_bytes, plan.buffer_bytes) << c;
      }

      if (info.name == "batched-fp8") {
        EXPECT_EQ(plan.region("w1_out").shape, (std::vector<std::int64_t>{E_local, p.M, p.N})) << c;
        EXPECT_EQ(plan.region("act_q").shape, (std::vector<std::int64_t>{E_local, p.M, I})) << c;
        EXPECT_EQ(plan.region("act_q").dtype, DType::kFp8E4m3) << c;
        EXPECT_EQ(plan.region("output").shape, (std::vector<std::int64_t>{E_local, p.M, p.K})) << c;
        EXPECT_EQ(plan.region("a1q").shape, (std::vector<std::int64_t>{E_local, p.M, p.K})) << c;
        const auto scale = plan.region("act_scale").shape;
        switch (quant) {
          case QuantScheme::kPerTensor: EXPECT_EQ(scale, (std::vector<std::int64_t>{E_local})) << c; break;
          case QuantScheme::kPerTokenPerChannel:
            EXPECT_EQ(scale, (std::vector<std::int64_t>{E_local, p.M})) << c;
            break;
          case QuantScheme::kBlock128: EXPECT_EQ(scale, (std::vector<std::int64_t>{E_local, p.M, I / 128})) << c; break;
        }
        // Exact total: no aliasing in the batched design, every region aligned to 256 bytes.
        std::int64_t sum = 0;
        for (const auto& r : plan.regions) sum += align256(r.bytes);
        EXPECT_EQ(plan.total_bytes, sum) << c;
      } else if (info.name == "standard-fp8") {
        const std::int64_t rows = p.M * p.topk;
        EXPECT_EQ(plan.region("a1q_permuted").shape, (std::vector<std::int64_t>{rows, p.K})) << c;
        EXPECT_EQ(plan.region("w1_out").shape, (std::vector<std::int64_t>{rows, p.N})) << c;
        EXPECT_EQ(plan.region("w2_out").shape, (std::vector<std::int64_t>{rows, p.K})) << c;
        EXPECT_EQ(plan.region("act_q").shape, (std::vector<std::int64_t>{rows, I})) << c;
        EXPECT_EQ(plan.region("output").shape, (std::vector<std::int64_t>{p.M, p.K})) << c;
        // Declared aliasing really shares bytes: w2_out starts where w1_out starts.
        EXPECT_EQ(plan.region("w1_out").offset, plan.region("w2_out").offset) << c;
        EXPECT_EQ(plan.region("a1q_permuted").offset, plan.region("act_q").offset) << c;
      } else {
        const std::int64_t tokens = info.name == "upstream-batched-cutlass-before-fix" ? p.M * dp : p.M;
        EXPECT_TRUE(plan.reference) << c;
        EXPECT_EQ(plan.region("workspace1").shape, (std::vector<std::int64_t>{E_local, tokens, std::max(p.N, p.K)}))
            << c;
        EXPECT_EQ(plan.region("workspace2").shape, (std::vector<std::int64_t>{E_local, tokens, std::max(I, p.K)})) << c;
      }

      // Checked mode: guard bands before and after every region, none inside a region.
      const WorkspacePlan guarded = plan_workspace(info.name, p, 4096);
      ASSERT_EQ(guarded.regions.size(), plan.regions.size()) << c;
      EXPECT_GT(guarded.total_bytes, plan.total_bytes) << c;
      for (const auto& r : guarded.regions) {
        const bool before = std::any_of(guarded.guards.begin(), guarded.guards.end(), [&](const Guard& g) {
          return g.offset + g.bytes <= r.offset && r.offset - (g.offset + g.bytes) < 256;
        });
        const bool after = std::any_of(guarded.guards.begin(), guarded.guards.end(), [&](const Guard& g) {
          return g.offset >= r.offset + r.bytes && g.offset - (r.offset + r.bytes) < 256;
        });
        EXPECT_TRUE(before && after) << c << ": region " << r.name << " lacks a guard band";
        for (const auto& g : guarded.guards)
          EXPECT_TRUE(g.offset + g.bytes <= r.offset || g.offset >= r.offset + r.bytes)
              << c << ": guard inside region " << r.name;
      }
    }
  }
}

std::string contract_name(const ::testing::TestParamInfo<ContractParam>& info) {
  const auto [dp, E_local, act, format] = info.param;
  return fmt::format("dp{}_Elocal{}_{}_{}", dp, E_local, activation_name(act), format_name(format));
}

INSTANTIATE_TEST_SUITE_P(
    AllLayouts, WorkspaceContract,
    ::testing::Combine(::testing::Values(1, 2, 4, 8, 16, 32, 64), ::testing::Values(1, 8, 16, 32, 256),
                       ::testing::ValuesIn(all_activations()),
                       ::testing::Values(ActivationFormat::kStandard, ActivationFormat::kBatchedExperts)),
    contract_name);

// --- Golden figures: the upstream report's case -----------------------------------------------

MoeProblem deepseek_dp32(std::int64_t local_experts, ActivationFormat format = ActivationFormat::kBatchedExperts) {
  return make_problem(load_model("deepseek-v3"), ParallelConfig{32, 32, 256, local_experts}, format,
                      QuantScheme::kPerTokenPerChannel);
}

TEST(GoldenFigures, DeepSeekV3Dp32SixteenLocalExperts) {
  const MoeProblem p = deepseek_dp32(16);
  ASSERT_EQ(p.M, 8192);
  // before: 2 regions x 16 experts x (8192 * 32) tokens x 7168 x 2 bytes = 112 GiB exactly.
  const WorkspacePlan before = plan_workspace("upstream-batched-cutlass-before-fix", p);
  EXPECT_EQ(before.total_bytes, std::int64_t{120259084288});
  EXPECT_EQ(before.total_bytes, 112 * kGiB);
  // after: 2 x 16 x 8192 x 7168 x 2 bytes = 3.5 GiB exactly.
  const WorkspacePlan after = plan_workspace("upstream-batched-cutlass-after-fix", p);
  EXPECT_EQ(after.total_bytes, std::int64_t{3758096384});
  EXPECT_EQ(after.total_bytes * 2, 7 * kGiB);
  EXPECT_EQ(before.total_bytes, 32 * after.total_bytes);

  // moekit: w1_out 16*8192*4096*2 = 1073741824, act_q 16*8192*2048 = 268435456, act_scale
  // 16*8192*4 = 524288, gemm_args 2*16*256 = 8192, gemm_scratch 1 MiB, status 32 -> 256.
  const WorkspacePlan ours = plan_workspace("batched-fp8", p);
  EXPECT_EQ(ours.total_bytes, std::int64_t{1073741824 + 268435456 + 524288 + 8192 + 1048576 + 256});
  std::int64_t scale_bytes = ours.region("act_scale").bytes;
  EXPECT_LE(ours.total_bytes, 2 * kGiB + scale_bytes + (2 << 20)) << "batched-fp8 exceeds 2.0 GiB + scales";
  EXPECT_LT(ours.total_bytes * 2, after.total_bytes) << "moekit should need under half of the fixed upstream figure";
}

TEST(GoldenFigures, DeepSeekV3Dp32Ep32EightLocalExperts) {
  const MoeProblem p = deepseek_dp32(0);  // 256 / 32 = 8 local experts
  ASSERT_EQ(p.E_local, 8);
  EXPECT_EQ(plan_workspace("upstream-batched-cutlass-before-fix", p).total_bytes, 56 * kGiB);
  EXPECT_EQ(plan_workspace("upstream-batched-cutlass-after-fix", p).total_bytes, 7 * kGiB / 4);
}

TEST(GoldenFigures, WeightsOfLocalExperts) {
  const MoeProblem p = deepseek_dp32(16);
  // 16 x (4096*7168 + 7168*2048) FP8 bytes + 16 x (4096 + 7168) fp32 per-channel scales.
  EXPECT_EQ(expert_weight_bytes(p), 16LL * (4096 * 7168 + 7168 * 2048) + 16LL * (4096 + 7168) * 4);
}

// --- The same declaration assigns pointers at run time ------------------------------------------

TEST(Builder, RuntimePointersMatchThePlan) {
  const ModelConfig model = load_model("qwen3-30b-a3b");
  const MoeProblem p =
      make_problem(model, ParallelConfig{2, 16, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  const WorkspacePlan plan = plan_workspace("batched-fp8", p);
  auto storage = std::unique_ptr<std::byte, decltype(&std::free)>(
      static_cast<std::byte*>(std::aligned_alloc(256, static_cast<std::size_t>(plan.total_bytes))), &std::free);
  WorkspaceBuilder runtime("batched-fp8", p, storage.get(), plan.total_bytes);
  const plan::BatchedFp8Workspace w = plan::declare_batched_fp8(p, runtime);
  EXPECT_EQ(reinterpret_cast<std::byte*>(w.w1_out), storage.get() + plan.region("w1_out").offset);
  EXPECT_EQ(reinterpret_cast<std::byte*>(w.act_q), storage.get() + plan.region("act_q").offset);
  EXPECT_EQ(reinterpret_cast<std::byte*>(w.act_scale), storage.get() + plan.region("act_scale").offset);
  EXPECT_EQ(reinterpret_cast<std::byte*>(w.status), storage.get() + plan.region("status").offset);
  EXPECT_EQ(runtime.finish().total_bytes, plan.total_bytes);

  // An allocation one byte short of the plan is refused, naming the region that does not fit.
  WorkspaceBuilder too_small("batched-fp8", p, storage.get(), plan.total_bytes - 256);
  try {
    plan::declare_batched_fp8(p, too_small);
    too_small.finish();
    FAIL() << "a short workspace was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too small"), std::string::npos) << e.what();
  }
}

// --- Bad input: a moekit::Error whose message names the value ------------------------------------

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no moekit::Error raised (expected one naming: " << needles.front() << ")";
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(BadInput, ParallelLayout) {
  const ModelConfig m = load_model("deepseek-v3");
  const auto fmt_b = ActivationFormat::kBatchedExperts;
  const auto q = QuantScheme::kPerTokenPerChannel;
  expect_error([&] { make_problem(m, {0, 32, 256, 0}, fmt_b, q); }, {"dp = 0"});
  expect_error([&] { make_problem(m, {32, 0, 256, 0}, fmt_b, q); }, {"ep = 0"});
  expect_error([&] { make_problem(m, {32, 3, 256, 0}, fmt_b, q); }, {"256 experts", "ep = 3"});
  expect_error([&] { make_problem(m, {32, 32, 256, 300}, fmt_b, q); }, {"local experts = 300", "256"});
  expect_error([&] { make_problem(m, {32, 4, 256, 16}, fmt_b, q); }, {"local experts = 16", "ep = 4"});
  expect_error([&] { make_problem(m, {32, 32, 0, 0}, fmt_b, q); }, {"max_tokens_per_rank = 0"});
  expect_error([&] { make_problem(m, {32, 32, -5, 0}, fmt_b, q); }, {"max_tokens_per_rank = -5"});
  // M = max_tokens_per_rank * dp overflows 64 bits.
  expect_error(
      [&] {
        make_problem(m, {std::int64_t{1} << 40, 32, std::int64_t{1} << 40, 0}, fmt_b, q);
      },
      {"overflows"});
  // M fits but the bytes of (E_local, M, max(N, K)) do not.
  expect_error([&] { make_problem(m, {std::int64_t{1} << 20, 1, std::int64_t{1} << 24, 0}, fmt_b, q); }, {"overflows"});
  expect_error([&] { parse_activation("swiglu_typo"); }, {"swiglu_typo", "silu"});
  expect_error([&] { parse_quant("int4"); }, {"int4", "block128"});
  // gpt-oss's K = 2880 is not a multiple of 128: block-wise scales do not apply.
  expect_error(
      [&] {
        make_problem(load_model("gpt-oss-120b"), {1, 1, 16, 0}, fmt_b, QuantScheme::kBlock128);
      },
      {"2880", "block128"});
}

TEST(BadInput, HandBuiltProblemWithMTimesDispatchers) {
  // The upstream bug as a hand-built problem: M already multiplied by num_dispatchers.
  MoeProblem p = deepseek_dp32(16);
  p.M = p.M * p.num_dispatchers;
  expect_error([&] { validate_problem(p); }, {"M = 262144", "never multiplied again"});
  expect_error([&] { plan_workspace("batched-fp8", p); }, {"M = 262144"});
}

TEST(BadInput, BackendAndFormatMismatch) {
  expect_error([&] { plan_workspace("standard-fp8", deepseek_dp32(16)); }, {"standard-fp8", "batched"});
  expect_error([&] { plan_workspace("cutlass-magic", deepseek_dp32(16)); }, {"cutlass-magic", "batched-fp8"});
}

}  // namespace
}  // namespace moekit
