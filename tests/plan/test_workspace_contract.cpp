// The workspace contract, held by tests, for every implementation in the registry (CPU and CUDA:
// their declarations are plain C++): batched M is max_tokens_per_rank * num_dispatchers and is never
// multiplied again; region shapes; live regions never share bytes; sections tile the one allocation;
// totals; guard bands; the golden DeepSeek-V3 figures of the upstream report; the Workspace binds
// the plan by name and keeps its problem; bad input raises moekit::Error naming the value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <tuple>

#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/problem.h"
#include "moekit/recipe.h"
#include "moekit/registry.h"
#include "moekit/workspace.h"
#include "plan/gemm_config.h"
#include "plan/upstream.h"

namespace moekit {
namespace {

constexpr std::int64_t kGiB = std::int64_t{1} << 30;
constexpr std::int64_t kMaxTokensPerRank = 256;

std::int64_t align256(std::int64_t x) {
  return (x + 255) / 256 * 256;
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no moekit::Error raised (expected one naming: " << needles.front() << ")";
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
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

// The sections tile the allocation in order, every region lies inside its own section.
void expect_sections_tile(const WorkspacePlan& plan, const std::string& ctx) {
  std::int64_t end = 0;
  for (const auto& s : plan.sections) {
    EXPECT_EQ(s.offset, end) << ctx << ": section " << s.name;
    end = s.offset + s.bytes;
  }
  EXPECT_EQ(end, plan.total_bytes) << ctx;
  for (const auto& r : plan.regions) {
    const Section& s = plan.section(r.section);
    EXPECT_GE(r.offset, s.offset) << ctx << " region " << r.name;
    EXPECT_LE(r.offset + r.bytes, s.offset + s.bytes) << ctx << " region " << r.name;
  }
}

TEST_P(WorkspaceContract, ShapesLifetimesTotals) {
  const auto [dp, E_local, act, format] = GetParam();
  const ModelConfig model = deepseek_like();
  const ParallelConfig par{dp, model.num_experts / E_local, kMaxTokensPerRank, E_local};
  for (QuantScheme quant : all_quant_schemes()) {
    const MoeProblem p = make_problem(model, par, format, quant, act);
    // DeepSeek-V3's shared expert: its own step, one section of the same allocation (checked with it).
    const std::optional<MoeProblem> shared = shared_experts_problem(model, p);
    ASSERT_TRUE(shared.has_value());
    const std::int64_t I = activation_out_dim(act, p.N);
    const std::string ctx = p.describe();
    // The recipe's row, read here in its own words: scales or none, act_q (FP8) or act (bf16).
    const RecipeInfo recipe = recipe_info(quant);
    const bool scaled = has_activation_scales(recipe);
    const char* act_name = recipe.requantizes_intermediate ? "act_q" : "act";

    // The contract: batched M is max_tokens_per_rank * num_dispatchers, already global.
    if (format == ActivationFormat::kBatchedExperts) {
      ASSERT_EQ(p.M, kMaxTokensPerRank * dp) << ctx;
      ASSERT_EQ(p.num_dispatchers, dp) << ctx;
    } else {
      ASSERT_EQ(p.M, kMaxTokensPerRank) << ctx;
    }
    ASSERT_EQ(p.N, is_gated(act) ? 2 * model.moe_intermediate_size : model.moe_intermediate_size) << ctx;

    for (const auto& entry : experts_registry()) {
      if (entry.format != format) continue;
      const std::string c = std::string(entry.name) + " (" + std::string(device_name(entry.device)) + ") " + ctx;
      const std::string why = entry.make({})->unsupported(p);
      if (!why.empty()) {
        // What an implementation cannot run is refused with its reason, never planned wrong: the CUDA
        // experts refuse a recipe they have no kernels for (RecipeInfo::cuda_experts) saying what to
        // run instead.
        EXPECT_TRUE(entry.device == Device::kCuda && (quant == QuantScheme::kBlock128 || !recipe.cuda_experts))
            << c << ": " << why;
        expect_error([&] { plan_layer(p, entry, par.ep); }, {std::string(entry.name), why.substr(0, 20)});
        if (!recipe.cuda_experts)
          expect_error([&] { plan_layer(p, entry, par.ep); },
                       {recipe.name, "no kernels", "--device cpu", "--quant per-token", "block128"});
        continue;
      }
      // Every CPU row runs every recipe; a CUDA row runs every recipe that has CUDA experts.
      EXPECT_TRUE(entry.device == Device::kCpu || recipe.cuda_experts) << c;
      const WorkspacePlan plan = plan_layer(p, entry, par.ep, 0, {}, shared);
      EXPECT_EQ(plan.section(kSharedExpertsSection).owner, plan_shared_experts(*shared, entry.device).name) << c;
      expect_live_regions_disjoint(plan, c);
      expect_sections_tile(plan, c);
      EXPECT_EQ(plan.total_bytes, expected_total(plan)) << c;
      EXPECT_EQ(plan.problem, p) << c;

      // The workspace depends on M alone, not on how M splits into tokens x dispatchers: the same
      // M reached as (M tokens, 1 dispatcher) must give byte-identical experts' workspaces and I/O
      // buffers. An implementation that multiplies M by num_dispatchers again fails here.
      if (format == ActivationFormat::kBatchedExperts) {
        MoeProblem single = p;
        single.max_tokens_per_rank = p.M;
        single.num_dispatchers = 1;
        const WorkspacePlan same = plan_layer(single, entry, par.ep);
        EXPECT_EQ(same.section_bytes("experts"), plan.section_bytes("experts"))
            << c << ": workspace depends on num_dispatchers beyond M";
        // The experts' input/output too (a prepare/finalize may add per-rank state, sized by the
        // tokens of one rank: that is not M).
        for (const char* io : {"a1q", "a1q_scale", "expert_num_tokens", "expert_output"})
          if (scaled || std::string_view(io) != "a1q_scale") {
            EXPECT_EQ(same.region(io).bytes, plan.region(io).bytes) << c << ": " << io;
          }
      }

      // A recipe without scales declares no scale region (not an empty one) and no act_q.
      if (!scaled) {
        for (const char* none : {"a1q_scale", "act_scale", "a1q_scale_permuted", "act_q"})
          EXPECT_EQ(plan.find_region(none), nullptr) << c << ": " << none;
      }
      const auto scale = scaled ? plan.region("act_scale").shape : std::vector<std::int64_t>{};
      // A fused W1 (fuse_w1, never make_problem's default) has no w1_out on any device.
      const bool fused = plan::fuses_w1(p);
      EXPECT_EQ(plan.find_region("w1_out") == nullptr, fused) << c;
      // On the GPU the fused recipe's small experts write fp32 rows into w1_small (64 an expert, or
      // fewer where an expert's slab holds fewer).
      EXPECT_EQ(plan.find_region("w1_small") != nullptr, fused && entry.device == Device::kCuda) << c;
      if (plan.find_region("w1_small")) {
        const std::int64_t slab = format == ActivationFormat::kStandard ? p.M * p.topk : p.M;
        EXPECT_EQ(plan.region("w1_small").shape,
                  (std::vector<std::int64_t>{E_local, std::min<std::int64_t>(64, slab), p.N}))
            << c;
      }
      if (format == ActivationFormat::kBatchedExperts) {
        if (!fused) {
          EXPECT_EQ(plan.region("w1_out").shape, (std::vector<std::int64_t>{E_local, p.M, p.N})) << c;
        }
        EXPECT_EQ(plan.region(act_name).shape, (std::vector<std::int64_t>{E_local, p.M, I})) << c;
        EXPECT_EQ(plan.region(act_name).dtype, recipe.activation_dtype) << c;
        EXPECT_EQ(plan.region("a1q").dtype, recipe.activation_dtype) << c;
        EXPECT_EQ(plan.region("expert_output").shape, (std::vector<std::int64_t>{E_local, p.M, p.K})) << c;
        EXPECT_EQ(plan.region("a1q").shape, (std::vector<std::int64_t>{E_local, p.M, p.K})) << c;
        EXPECT_EQ(plan.region("expert_num_tokens").shape, (std::vector<std::int64_t>{E_local})) << c;
        switch (quant) {
          case QuantScheme::kPerTensor: EXPECT_EQ(scale, (std::vector<std::int64_t>{E_local})) << c; break;
          case QuantScheme::kPerTokenPerChannel:
            EXPECT_EQ(scale, (std::vector<std::int64_t>{E_local, p.M})) << c;
            break;
          case QuantScheme::kBlock128: EXPECT_EQ(scale, (std::vector<std::int64_t>{E_local, p.M, I / 128})) << c; break;
          case QuantScheme::kBf16:
          case QuantScheme::kFp16: EXPECT_TRUE(scale.empty()) << c; break;
        }
        // Exact experts' total: no aliasing in the batched design, every region aligned to 256 bytes.
        std::int64_t sum = 0;
        for (const auto& r : plan.regions)
          if (r.section == "experts") sum += align256(r.bytes);
        EXPECT_EQ(plan.section_bytes("experts"), sum) << c;
        // The CPU allocates no GPU-only region.
        if (entry.device == Device::kCpu) {
          for (const char* gpu_only : {"gemm_args_w1", "gemm_args_w2", "gemm_scratch", "experts_status", "row_offsets",
                                       "router_status", "w1_small"})
            EXPECT_EQ(plan.find_region(gpu_only), nullptr) << c << ": " << gpu_only;
        }
      } else {
        const std::int64_t rows = p.M * p.topk;
        EXPECT_EQ(plan.region("a1q_permuted").shape, (std::vector<std::int64_t>{rows, p.K})) << c;
        if (!fused) {
          EXPECT_EQ(plan.region("w1_out").shape, (std::vector<std::int64_t>{rows, p.N})) << c;
        }
        EXPECT_EQ(plan.region("w2_out").shape, (std::vector<std::int64_t>{rows, p.K})) << c;
        EXPECT_EQ(plan.region(act_name).shape, (std::vector<std::int64_t>{rows, I})) << c;
        EXPECT_EQ(plan.region(act_name).dtype, recipe.activation_dtype) << c;
        EXPECT_EQ(plan.region("a1q_permuted").dtype, recipe.activation_dtype) << c;
        EXPECT_EQ(plan.region("pair_row").shape, (std::vector<std::int64_t>{rows})) << c;
        EXPECT_EQ(plan.region("a1q").shape, (std::vector<std::int64_t>{p.M, p.K})) << c;
        // Declared aliasing really shares bytes: w2_out starts where w1_out starts (fused: where
        // a1q_permuted does, since act_q is born in W1 while the tokens are read).
        if (!fused) {
          EXPECT_EQ(plan.region("w1_out").offset, plan.region("w2_out").offset) << c;
          EXPECT_EQ(plan.region("a1q_permuted").offset, plan.region(act_name).offset) << c;
        } else {
          EXPECT_EQ(plan.region("a1q_permuted").offset, plan.region("w2_out").offset) << c;
        }
      }
      EXPECT_EQ(plan.region("topk_ids").shape, (std::vector<std::int64_t>{p.max_tokens_per_rank, p.topk})) << c;

      // Checked mode: guard bands before and after every region, none inside a region.
      const WorkspacePlan guarded = plan_layer(p, entry, par.ep, 4096, {}, shared);
      ASSERT_EQ(guarded.regions.size(), plan.regions.size()) << c;
      EXPECT_GT(guarded.total_bytes, plan.total_bytes) << c;
      expect_sections_tile(guarded, c + " guarded");
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
    // The quoted upstream formulas: the token dimension before the fix counts the dispatchers twice.
    if (format == ActivationFormat::kBatchedExperts) {
      for (const auto& ref : plan::upstream_references()) {
        const WorkspacePlan plan = plan::plan_upstream_reference(ref, p);
        const std::int64_t tokens = ref.before_fix ? p.M * dp : p.M;
        EXPECT_TRUE(plan.reference) << ref.name;
        EXPECT_EQ(plan.region("workspace1").shape, (std::vector<std::int64_t>{E_local, tokens, std::max(p.N, p.K)}))
            << ref.name << " " << ctx;
        EXPECT_EQ(plan.region("workspace2").shape, (std::vector<std::int64_t>{E_local, tokens, std::max(I, p.K)}))
            << ref.name << " " << ctx;
        expect_sections_tile(plan, std::string(ref.name));
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

std::int64_t reference_bytes(bool before_fix, const MoeProblem& p) {
  for (const auto& ref : plan::upstream_references())
    if (ref.before_fix == before_fix) return plan::plan_upstream_reference(ref, p).section_bytes("experts");
  return -1;
}

TEST(GoldenFigures, DeepSeekV3Dp32SixteenLocalExperts) {
  const MoeProblem p = deepseek_dp32(16);
  ASSERT_EQ(p.M, 8192);
  // before: 2 regions x 16 experts x (8192 * 32) tokens x 7168 x 2 bytes = 112 GiB exactly.
  const std::int64_t before = reference_bytes(true, p);
  EXPECT_EQ(before, std::int64_t{120259084288});
  EXPECT_EQ(before, 112 * kGiB);
  // after: 2 x 16 x 8192 x 7168 x 2 bytes = 3.5 GiB exactly.
  const std::int64_t after = reference_bytes(false, p);
  EXPECT_EQ(after, std::int64_t{3758096384});
  EXPECT_EQ(after * 2, 7 * kGiB);
  EXPECT_EQ(before, 32 * after);

  // moekit on the GPU: w1_out 16*8192*4096*2 = 1073741824, act_q 16*8192*2048 = 268435456,
  // act_scale 16*8192*4 = 524288, gemm_args 2 GEMMs x 3 launches x 16 experts x 128 = 2 x 6144,
  // gemm_scratch 1 MiB, row_offsets 17*4 -> 256, status 32 -> 256.
  const WorkspacePlan gpu = plan_layer(p, find_experts("batched-fp8", Device::kCuda), 32);
  const std::int64_t ours = gpu.section_bytes("experts");
  EXPECT_EQ(ours, std::int64_t{1073741824 + 268435456 + 524288 + 6144 + 6144 + 1048576 + 256 + 256});
  EXPECT_LE(ours, 2 * kGiB + gpu.region("act_scale").bytes + (2 << 20)) << "batched-fp8 exceeds 2.0 GiB + scales";
  EXPECT_LT(ours * 2, after) << "moekit should need under half of the fixed upstream figure";
  // The CPU twin holds the same three regions and nothing GPU-only.
  const WorkspacePlan cpu = plan_layer(p, find_experts("batched-fp8", Device::kCpu), 32);
  EXPECT_EQ(cpu.section_bytes("experts"), std::int64_t{1073741824 + 268435456 + 524288});
  // The experts' input/output beside it: a1q 896 MiB + scales 512 KiB + counts + output 1.75 GiB.
  EXPECT_EQ(gpu.region("a1q").bytes + gpu.region("a1q_scale").bytes + gpu.region("expert_num_tokens").bytes +
                gpu.region("expert_output").bytes,
            std::int64_t{939524096} + 524288 + 64 + 1879048192);
  // With 32 GPUs the prepare-finalize is NCCL's device-initiated transport: records from 32 sources x
  // 256 tokens x (64 B header + 7168 FP8 + 4 B scale, 16-aligned = 7264 B), and one fp32 partial per
  // (token, destination rank), at most topk = 8 destinations: 256 x 8 x 7168 x 4.
  EXPECT_EQ(gpu.sections[1].owner, "nccl (cuda)");
  EXPECT_EQ(gpu.region("ep_recv").bytes, std::int64_t{32} * 256 * 7264);
  EXPECT_EQ(gpu.region("ep_combine_recv").bytes, std::int64_t{256} * 8 * 7168 * 4);
  EXPECT_TRUE(gpu.region("ep_recv").persistent && gpu.region("ep_flags").persistent);
  EXPECT_LT(gpu.section_bytes("prepare-finalize") - (std::int64_t{939524096} + 524288 + 64 + 1879048192),
            130 * (std::int64_t{1} << 20))
      << "the NCCL transport's own buffers stay under 130 MiB at DeepSeek-V3 DP 32";
}

// DeepSeek-V3's own scheme, block128, fused (its default): the fused W1 writes act_q and its 1x128 scales from
// the GEMM's epilogue, so w1_out (1 GiB) is gone: act_q 268435456 + act_scale 16*8192*16*4 = 8388608 + the GEMM
// arguments, scratch, row offsets and status as above + w1_small, the fp32 W1 rows of the experts of
// <= 64 rows, 16*64*4096*4 = 16777216 = 0.274 GiB (issue target 0.30; upstream after its fix 3.5).
// The CPU follows the same recipe with 64 fp32 W1 rows at a time (1 MiB).
TEST(GoldenFigures, DeepSeekV3Dp32Block128FusedW1) {
  MoeProblem p = make_problem(load_model("deepseek-v3"), ParallelConfig{32, 32, 256, 16},
                              ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  EXPECT_TRUE(p.fuse_w1);  // make_problem's default for block128
  // Unfused (asked for: --no-fuse-w1): w1_out 1 GiB + act_q + 1x128 scales + the rest = 1.26 GiB.
  p.fuse_w1 = false;
  EXPECT_EQ(plan_layer(p, find_experts("batched-fp8", Device::kCuda), 32).section_bytes("experts"),
            std::int64_t{1073741824 + 268435456 + 8388608 + 6144 + 6144 + 1048576 + 256 + 256});
  p.fuse_w1 = true;
  const WorkspacePlan gpu = plan_layer(p, find_experts("batched-fp8", Device::kCuda), 32);
  EXPECT_EQ(gpu.find_region("w1_out"), nullptr);
  EXPECT_EQ(gpu.section_bytes("experts"),
            std::int64_t{268435456 + 8388608 + 6144 + 6144 + 1048576 + 256 + 256 + 16777216});
  EXPECT_EQ(gpu.region("w1_small").bytes, 16 * 64 * 4096 * 4);
  EXPECT_LE(gpu.section_bytes("experts"), 3 * kGiB / 10);
  const WorkspacePlan cpu = plan_layer(p, find_experts("batched-fp8", Device::kCpu), 32);
  EXPECT_EQ(cpu.section_bytes("experts"), std::int64_t{268435456 + 8388608 + 64 * 4096 * 4});
  // The standard format: act_q is born in W1, so the tokens share bytes with w2_out instead.
  MoeProblem s = make_problem(load_model("deepseek-v3"), ParallelConfig{32, 32, 256, 16}, ActivationFormat::kStandard,
                              QuantScheme::kBlock128);
  // Fused by default there too (one recipe for both formats), though the standard format's w1_out
  // shares its bytes with w2_out (K >= N): fusing saves nothing there, w1_small adds 16 MiB.
  EXPECT_TRUE(s.fuse_w1);
  s.fuse_w1 = false;
  const std::int64_t standard_unfused =
      plan_layer(s, find_experts("standard-fp8", Device::kCuda), 32).section_bytes("experts");
  s.fuse_w1 = true;
  EXPECT_EQ(plan_layer(s, find_experts("standard-fp8", Device::kCuda), 32).section_bytes("experts") - standard_unfused,
            51532800 - 45569024);
  for (Device d : {Device::kCpu, Device::kCuda}) {
    const WorkspacePlan sp = plan_layer(s, find_experts("standard-fp8", d), 32);
    EXPECT_EQ(sp.find_region("w1_out"), nullptr);
    EXPECT_EQ(sp.region("a1q_permuted").offset, sp.region("w2_out").offset);
    EXPECT_NE(sp.region("a1q_permuted").offset, sp.region("act_q").offset);
  }
}

// The unquantized recipe (bf16, --quant bf16): no scales, the activation's output kept in bf16 (act,
// twice act_q's bytes), on both devices. DeepSeek-V3 DP 32, 16 local experts, M = 8192, batched:
//   w1_out 16 x 8192 x 4096 x 2 = 1073741824, act 16 x 8192 x 2048 x 2 = 536870912: 1.5 GiB
//   (FP8 per-token: 1.25 GiB + 512 KiB of act_scale). I/O: a1q 16 x 8192 x 7168 x 2 = 1879048192
//   (FP8's 896 MiB doubled), no a1q_scale, counts 64, expert_output 1879048192.
// Standard, 256 tokens, top-8: 2048 rows; expert_offsets 17 x 4 -> 256, pair_row 2048 x 4 = 8192,
//   "gemm_in" max(a1q_permuted 2048 x 7168 x 2 = 29360128, act 2048 x 2048 x 2 = 8388608),
//   "gemm_out" max(w1_out 2048 x 4096 x 2 = 16777216, w2_out 2048 x 7168 x 2 = 29360128):
//   256 + 8192 + 29360128 + 29360128 = 58728704 (56 MiB).
// The GPU adds what its kernels need, as for FP8: gemm_args 2 GEMMs x 3 launches x 16 experts x 128
//   = 2 x 6144, gemm_scratch 1 MiB, status 32 -> 256, and row_offsets 17 x 4 -> 256 (batched) or
//   expert_counts 64 -> 256 and row_map_tiles 2 tiles x 16 x 4 -> 256 (standard). Its NCCL records
//   carry 7168 bf16 (80 B header + 14336 B row, no scales: 14416 B) from 32 sources x 256 tokens.
// fp16's figures are bf16's, in fp16 (the same 2-byte elements), its expert rows fp16 too.
TEST(GoldenFigures, DeepSeekV3Dp32SixteenBit) {
  for (const QuantScheme q : {QuantScheme::kBf16, QuantScheme::kFp16}) {
    SCOPED_TRACE(quant_name(q));
    const DType dt = recipe_info(q).activation_dtype;
    const ModelConfig model = load_model("deepseek-v3");
    const MoeProblem p = make_problem(model, ParallelConfig{32, 32, 256, 16}, ActivationFormat::kBatchedExperts, q);
    ASSERT_EQ(p.M, 8192);
    const WorkspacePlan cpu = plan_layer(p, find_experts("batched-fp8", Device::kCpu), 32);
    EXPECT_EQ(cpu.section_bytes("experts"), std::int64_t{1073741824 + 536870912});
    EXPECT_EQ(cpu.section_bytes("experts"), 3 * kGiB / 2);
    EXPECT_EQ(cpu.region("act").dtype, dt);
    EXPECT_EQ(cpu.region("w1_out").dtype, dt);
    EXPECT_EQ(cpu.region("expert_output").dtype, dt);
    EXPECT_EQ(cpu.find_region("act_scale"), nullptr);
    EXPECT_EQ(cpu.find_region("a1q_scale"), nullptr);
    EXPECT_EQ(cpu.region("a1q").bytes, std::int64_t{1879048192});
    EXPECT_EQ(cpu.region("a1q").bytes + cpu.region("expert_num_tokens").bytes + cpu.region("expert_output").bytes,
              std::int64_t{1879048192} + 64 + 1879048192);
    const WorkspacePlan gpu = plan_layer(p, find_experts("batched-fp8", Device::kCuda), 32);
    EXPECT_EQ(gpu.section_bytes("experts"), std::int64_t{1073741824 + 536870912 + 6144 + 6144 + 1048576 + 256 + 256});
    EXPECT_EQ(gpu.region("act").dtype, dt);
    for (const char* none : {"act_q", "act_scale", "a1q_scale", "w1_small"})
      EXPECT_EQ(gpu.find_region(none), nullptr) << none;
    EXPECT_EQ(gpu.region("a1q").bytes, std::int64_t{1879048192});
    EXPECT_EQ(gpu.sections[1].owner, "nccl (cuda)");
    EXPECT_EQ(gpu.region("ep_recv").bytes, std::int64_t{32} * 256 * 14416);
    // 16 x (4096 x 7168 + 7168 x 2048) bf16 weights, no scales: twice the FP8 bytes.
    EXPECT_EQ(expert_weight_bytes(p), 2 * 16LL * (4096 * 7168 + 7168 * 2048));

    const MoeProblem s = make_problem(model, ParallelConfig{32, 32, 256, 16}, ActivationFormat::kStandard, q);
    const WorkspacePlan sp = plan_layer(s, find_experts("standard-fp8", Device::kCpu), 32);
    EXPECT_EQ(sp.section_bytes("experts"), std::int64_t{256 + 8192 + 29360128 + 29360128});
    EXPECT_EQ(sp.region("a1q_permuted").offset, sp.region("act").offset);
    EXPECT_EQ(sp.region("w1_out").offset, sp.region("w2_out").offset);
    const WorkspacePlan sg = plan_layer(s, find_experts("standard-fp8", Device::kCuda), 32);
    EXPECT_EQ(sg.section_bytes("experts"),
              std::int64_t{256 + 8192 + 29360128 + 29360128 + 256 + 256 + 6144 + 6144 + 1048576 + 256});
    EXPECT_EQ(sg.region("a1q_permuted").offset, sg.region("act").offset);
    EXPECT_EQ(sg.find_region("a1q_scale_permuted"), nullptr);
    EXPECT_EQ(sg.region("w2_out").dtype, dt);
  }
}

// Qwen3-30B-A3B (K = 2048, I = 768, 128 experts, top-8, a bf16 checkpoint) in bf16, DP 8 EP 8:
// 16 local experts, 256 tokens a rank, batched M = 256 x 8 = 2048:
//   w1_out 16 x 2048 x 1536 x 2 = 100663296, act 16 x 2048 x 768 x 2 = 50331648: 144 MiB;
//   a1q 16 x 2048 x 2048 x 2 = 134217728, expert_output the same.
// Standard, 256 tokens: 2048 rows; expert_offsets 256, pair_row 8192, "gemm_in" max(a1q_permuted
//   2048 x 2048 x 2 = 8388608, act 2048 x 768 x 2 = 3145728), "gemm_out" max(w1_out 2048 x 1536 x 2 =
//   6291456, w2_out 8388608): 256 + 8192 + 8388608 + 8388608 = 16785664.
TEST(GoldenFigures, Qwen3MoeSixteenBit) {
  for (const QuantScheme q : {QuantScheme::kBf16, QuantScheme::kFp16}) {
    SCOPED_TRACE(quant_name(q));
    const ModelConfig model = load_model("qwen3-30b-a3b");
    const MoeProblem p = make_problem(model, ParallelConfig{8, 8, 256, 0}, ActivationFormat::kBatchedExperts, q);
    ASSERT_EQ(p.E_local, 16);
    ASSERT_EQ(p.M, 2048);
    ASSERT_EQ(p.K, 2048);
    ASSERT_EQ(p.N, 1536);
    const WorkspacePlan cpu = plan_layer(p, find_experts("batched-fp8", Device::kCpu), 8);
    EXPECT_EQ(cpu.section_bytes("experts"), std::int64_t{100663296 + 50331648});
    EXPECT_EQ(cpu.region("a1q").bytes, std::int64_t{134217728});
    EXPECT_EQ(cpu.region("expert_output").bytes, std::int64_t{134217728});
    EXPECT_EQ(expert_weight_bytes(p), 2 * 16LL * (1536 * 2048 + 2048 * 768));
    const MoeProblem s = make_problem(model, ParallelConfig{8, 8, 256, 0}, ActivationFormat::kStandard, q);
    EXPECT_EQ(plan_layer(s, find_experts("standard-fp8", Device::kCpu), 8).section_bytes("experts"),
              std::int64_t{256 + 8192 + 8388608 + 8388608});
    // The GPU: + gemm_args 2 x 3 x 16 x 128, scratch 1 MiB, status 256, and row_offsets 256 (batched)
    // or expert_counts 256 + row_map_tiles 256 (standard), as DeepSeek-V3's above.
    EXPECT_EQ(plan_layer(p, find_experts("batched-fp8", Device::kCuda), 8).section_bytes("experts"),
              std::int64_t{100663296 + 50331648 + 6144 + 6144 + 1048576 + 256 + 256});
    EXPECT_EQ(plan_layer(s, find_experts("standard-fp8", Device::kCuda), 8).section_bytes("experts"),
              std::int64_t{256 + 8192 + 8388608 + 8388608 + 256 + 256 + 6144 + 6144 + 1048576 + 256});
  }
}

TEST(GoldenFigures, DeepSeekV3Dp32Ep32EightLocalExperts) {
  const MoeProblem p = deepseek_dp32(0);  // 256 / 32 = 8 local experts
  ASSERT_EQ(p.E_local, 8);
  EXPECT_EQ(reference_bytes(true, p), 56 * kGiB);
  EXPECT_EQ(reference_bytes(false, p), 7 * kGiB / 4);
}

TEST(GoldenFigures, WeightsOfLocalExperts) {
  const MoeProblem p = deepseek_dp32(16);
  // 16 x (4096*7168 + 7168*2048) FP8 bytes + 16 x (4096 + 7168) fp32 per-channel scales.
  EXPECT_EQ(expert_weight_bytes(p), 16LL * (4096 * 7168 + 7168 * 2048) + 16LL * (4096 + 7168) * 4);
}

// --- The Workspace: one allocation, regions bound by name, the problem it was planned for -------

TEST(Workspace, BindsThePlanAndKeepsItsProblem) {
  const ModelConfig model = load_model("qwen3-30b-a3b");
  const MoeProblem p = make_problem(model, ParallelConfig{2, 16, 8, 0}, ActivationFormat::kBatchedExperts,
                                    QuantScheme::kPerTokenPerChannel);
  const auto& entry = find_experts("batched-fp8", Device::kCpu);
  const auto memory = make_memory(Device::kCpu);
  Workspace ws(plan_layer(p, entry, 16, 4096), *memory);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ws.base()) % WorkspaceBuilder::kAlignment, 0u);
  for (const char* name : {"w1_out", "act_q", "a1q", "expert_output", "topk_ids"})
    EXPECT_EQ(ws.get<std::byte>(name), ws.base() + ws.plan().region(name).offset) << name;
  EXPECT_NE(ws.get<float>("act_scale"), nullptr);
  // A region read as the wrong type, a region that is not there, another problem: each an Error.
  expect_error([&] { ws.get<float>("w1_out"); }, {"w1_out", "bf16"});
  expect_error([&] { ws.get<float>("no_such_region"); }, {"no_such_region"});
  MoeProblem other = p;
  ASSERT_EQ(p.E_local, 8);
  other.E_local = 4;
  expect_error([&] { ws.require(other, "test"); }, {"E_local=4", "E_local=8"});
  ws.require(p, "test");

  // Checked mode: poisoned regions are NaN, guards intact until a write lands outside a region.
  ws.poison(nullptr);
  EXPECT_EQ(ws.get<std::uint16_t>("w1_out")[0], 0xFFFF);
  ws.verify_guards(nullptr);
  const Region& act_q = ws.plan().region("act_q");
  ws.base()[act_q.offset + act_q.bytes] = std::byte{0};  // one byte past act_q
  expect_error([&] { ws.verify_guards(nullptr); }, {"overwritten", "act_q"});
}

// --- Bad input: a moekit::Error whose message names the value ------------------------------------

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
  // Past the limits of moekit/limits.h: refused by name before any product is formed.
  expect_error(
      [&] {
        make_problem(m, {std::int64_t{1} << 20, 1, std::int64_t{1} << 24, 0}, fmt_b, q);
      },
      {"max_tokens_per_rank = 16777216", "limit of 1048576"});
  // Every size at its limit: M fits, but the bytes of (E_local, M, max(N, K)) do not.
  ModelConfig widest = m;
  widest.hidden_size = limits::kMaxHiddenSize;
  widest.moe_intermediate_size = limits::kMaxIntermediateSize;
  widest.num_experts = limits::kMaxExperts;
  expect_error(
      [&] {
        make_problem(widest, {limits::kMaxRanks, 1, limits::kMaxTokensPerRank, 0}, fmt_b, q);
      },
      {"overflows"});
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
  expect_error([&] { plan_layer(p, find_experts("batched-fp8", Device::kCuda), 32); }, {"M = 262144"});
}

TEST(BadInput, HandBuiltProblemWithBadSwiglu) {
  // The problem's swigluoai parameters (the ops' swiglu_limit and swiglu_alpha) under the config's rule.
  MoeProblem p = make_problem(load_model("gpt-oss-120b"), {1, 1, 16, 0}, ActivationFormat::kStandard,
                              QuantScheme::kPerTokenPerChannel);
  p.swiglu.alpha = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { validate_problem(p); }, {"problem: field 'swiglu_alpha' = nan", "(0, 1024]"});
  p.swiglu.alpha = 0.0f;
  expect_error([&] { validate_problem(p); }, {"'swiglu_alpha' = 0", "(0, 1024]"});
  p.swiglu = {.limit = -1.0f, .alpha = 1.0f};
  expect_error([&] { validate_problem(p); }, {"'swiglu_limit' = -1", "(0, 65504]"});
  p.swiglu = {.limit = 7.0f, .alpha = 1.0f};
  EXPECT_NO_THROW(validate_problem(p));
}

TEST(BadInput, ExpertsAndFormatMismatch) {
  expect_error([&] { plan_layer(deepseek_dp32(16), find_experts("standard-fp8", Device::kCpu), 32); },
               {"standard-fp8", "batched"});
  expect_error([&] { find_experts("cutlass-magic", Device::kCuda); }, {"cutlass-magic", "batched-fp8 (cuda)"});
}

}  // namespace
}  // namespace moekit
