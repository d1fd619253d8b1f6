// The recipe table (moekit/recipe.h): every row's facts checked against the code that reads or
// still encodes them: names, the scale layouts, the regions the planner declares, the problem's
// validation, the GEMM configs, the W1 layout and the device tolerance.
#include <gtest/gtest.h>

#include <string>

#include "check/reference.h"
#include "moekit/check.h"
#include "moekit/model.h"
#include "moekit/problem.h"
#include "moekit/recipe.h"
#include "moekit/registry.h"
#include "moekit/workspace.h"
#include "numerics/activation.h"
#include "numerics/scales.h"
#include "plan/gemm_config.h"

namespace moekit {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// The rules written out once more, from the table's words, independently of numerics/scales.h.
std::int64_t expected_activation_scales(const RecipeInfo& r, std::int64_t rows, std::int64_t cols) {
  switch (r.activation_scales) {
    case ActivationScales::kNone: return 0;
    case ActivationScales::kPerTensor: return 1;
    case ActivationScales::kPerRow: return rows;
    case ActivationScales::kGroup1x128: return rows * ceil_div(cols, 128);
  }
  return -1;
}
std::int64_t expected_weight_scales(const RecipeInfo& r, std::int64_t n, std::int64_t k) {
  switch (r.weight_scales) {
    case WeightScales::kNone: return 0;
    case WeightScales::kPerTensor: return 1;
    case WeightScales::kPerOutputChannel: return n;
    case WeightScales::kBlock128x128: return ceil_div(n, 128) * ceil_div(k, 128);
  }
  return -1;
}

TEST(Recipe, RowsInSchemeOrderAndNamesRoundTrip) {
  ASSERT_EQ(all_quant_schemes().size(), static_cast<std::size_t>(kNumRecipes));
  for (int i = 0; i < kNumRecipes; ++i) {
    const RecipeInfo& r = kRecipes[i];
    EXPECT_EQ(static_cast<int>(r.scheme), i) << r.name;
    EXPECT_EQ(all_quant_schemes()[i], r.scheme) << r.name;
    EXPECT_EQ(quant_name(r.scheme), r.name);
    EXPECT_EQ(parse_quant(r.name), r.scheme) << r.name;
    EXPECT_EQ(recipe_info(r.scheme).name, r.name);
  }
  try {
    parse_quant("fp4");
    ADD_FAILURE() << "parse_quant accepted 'fp4'";
  } catch (const Error& e) {
    for (const RecipeInfo& r : kRecipes) EXPECT_NE(std::string(e.what()).find(r.name), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_quant(quant_name(kUnquantizedCheckpointQuant)), kUnquantizedCheckpointQuant);
}

TEST(Recipe, ScaleLayoutsFollowTheRows) {
  for (const RecipeInfo& r : kRecipes) {
    for (const std::int64_t cols : {std::int64_t{7168}, std::int64_t{2048}, std::int64_t{2880}, std::int64_t{16}}) {
      const std::string ctx = std::string(r.name) + " cols " + std::to_string(cols);
      for (const std::int64_t rows : {std::int64_t{1}, std::int64_t{7}, std::int64_t{256}}) {
        EXPECT_EQ(numerics::activation_scale_count(r.scheme, rows, cols), expected_activation_scales(r, rows, cols))
            << ctx << " rows " << rows;
        EXPECT_EQ(numerics::weight_scale_count(r.scheme, rows, cols), expected_weight_scales(r, rows, cols))
            << ctx << " n " << rows;
        // The last element's scale is the last scale (per-tensor: the only one; unquantized: none).
        if (!has_activation_scales(r)) continue;
        EXPECT_EQ(numerics::activation_scale_index(r.scheme, rows - 1, cols - 1, cols),
                  expected_activation_scales(r, rows, cols) - 1)
            << ctx;
        EXPECT_EQ(numerics::weight_scale_index(r.scheme, rows - 1, cols - 1, cols),
                  expected_weight_scales(r, rows, cols) - 1)
            << ctx;
      }
      EXPECT_EQ(numerics::activation_scale_per_tensor(r.scheme), r.activation_scales == ActivationScales::kPerTensor)
          << ctx;
      EXPECT_EQ(numerics::activation_scale_group(r.scheme, cols),
                r.activation_scales == ActivationScales::kGroup1x128 ? 128 : cols)
          << ctx;
      // Batched: one tensor per expert (per-tensor keeps E_local scales).
      const std::vector<std::int64_t> batched = numerics::activation_scale_shape(r.scheme, {8, 512}, cols, true);
      std::int64_t numel = 1;
      for (const std::int64_t d : batched) numel *= d;
      EXPECT_EQ(numel, 8 * expected_activation_scales(r, 512, cols)) << ctx;
    }
  }
}

// The planner declares a1q_scale and act_scale in the rows' shapes, on every experts row of the
// registry that runs the problem (DeepSeek-V3 and Qwen3-30B-A3B sizes, both formats); a recipe
// without scales declares neither, and its act in place of act_q.
TEST(Recipe, PlannedScaleRegionsFollowTheRows) {
  for (const char* name : {"deepseek-v3", "qwen3-30b-a3b"}) {
    const ModelConfig model = load_model(name);
    for (const ActivationFormat format : {ActivationFormat::kBatchedExperts, ActivationFormat::kStandard}) {
      const ParallelConfig par{1, 1, 64, 0};
      for (const RecipeInfo& r : kRecipes) {
        const MoeProblem p = make_problem(model, par, format, r.scheme, model.activation);
        const bool batched = format == ActivationFormat::kBatchedExperts;
        const std::int64_t tensors = batched ? p.E_local : 1, rows = p.M;
        int planned = 0;
        for (const auto& entry : experts_registry()) {
          if (entry.format != format || !entry.make({})->unsupported(p).empty()) continue;
          const std::string ctx =
              std::string(entry.name) + " (" + std::string(device_name(entry.device)) + ") " + p.describe();
          const WorkspacePlan plan = plan_layer(p, entry, par.ep);
          const Region* a1q_scale = plan.find_region("a1q_scale");
          if (!has_activation_scales(r)) {
            for (const char* scales : {"a1q_scale", "act_scale", "a1q_scale_permuted", "act_q"})
              EXPECT_EQ(plan.find_region(scales), nullptr) << ctx << ": " << scales;
            const Region* act = plan.find_region("act");
            ASSERT_NE(act, nullptr) << ctx;
            EXPECT_EQ(act->dtype, r.activation_dtype) << ctx;
            EXPECT_FALSE(r.requantizes_intermediate) << ctx;
          } else {
            ASSERT_NE(a1q_scale, nullptr) << ctx;
            EXPECT_EQ(a1q_scale->dtype, DType::kFp32) << ctx;
            EXPECT_EQ(a1q_scale->bytes, 4 * tensors * expected_activation_scales(r, rows, p.K)) << ctx;
          }
          const Region* a1q = plan.find_region("a1q");
          ASSERT_NE(a1q, nullptr) << ctx;
          EXPECT_EQ(a1q->dtype, r.activation_dtype) << ctx;
          // act_scale: the intermediate requantized, one scale tensor per expert (batched).
          if (const Region* act_scale = plan.find_region("act_scale"); act_scale != nullptr && batched) {
            EXPECT_TRUE(r.requantizes_intermediate) << ctx;
            EXPECT_EQ(act_scale->bytes, 4 * p.E_local * expected_activation_scales(r, p.M, p.I())) << ctx;
          }
          if (const Region* w1_out = plan.find_region("w1_out"); w1_out != nullptr) {
            EXPECT_EQ(w1_out->dtype, r.intermediate_dtype) << ctx;
          }
          ++planned;
        }
        EXPECT_GT(planned, 0) << name << " " << r.name << ": no experts row plans it";
      }
    }
  }
}

TEST(Recipe, ValidationFollowsTheRows) {
  const ModelConfig model = load_model("deepseek-v3");
  const ParallelConfig par{1, 8, 64, 0};
  for (const RecipeInfo& r : kRecipes) {
    const std::string ctx = r.name;
    MoeProblem p = make_problem(model, par, ActivationFormat::kBatchedExperts, r.scheme, Activation::kSilu, false);
    // Fast accumulation: refused where the row says it does not run.
    p.accumulation = Accumulation::kFast;
    if (r.fast_accumulation)
      EXPECT_NO_THROW(validate_problem(p)) << ctx;
    else
      EXPECT_THROW(validate_problem(p), Error) << ctx;
    p.accumulation = Accumulation::kPrecise;
    // K a multiple of 16, not of 128: refused where the row needs whole blocks.
    p.K = 7168 + 16;
    if (r.needs_block_multiple)
      EXPECT_THROW(validate_problem(p), Error) << ctx;
    else
      EXPECT_NO_THROW(validate_problem(p)) << ctx;
    // The fused W1 exists where the row says (with an activation whose W1 rows allow it).
    EXPECT_EQ(fuse_w1_runs(r.scheme, Activation::kSilu), r.fused_w1) << ctx;
    EXPECT_FALSE(fuse_w1_runs(r.scheme, Activation::kSwigluOai)) << ctx;
    // Gated W1 in block pairs exactly where weights carry 128x128 block scales.
    EXPECT_EQ(numerics::w1_rows(Activation::kSilu, r.scheme) == numerics::W1Rows::kBlockPairs,
              r.weight_scales == WeightScales::kBlock128x128)
        << ctx;
    EXPECT_EQ(check::device_vs_cpu_tolerance(r.scheme), r.device_vs_cpu_tolerance) << ctx;
    EXPECT_GT(r.device_vs_cpu_tolerance, 0.0) << ctx;
  }
}

// Which GEMM configs run a recipe (plan::supports) follows block_scaled_gemm (FP8) or the configs'
// 16-bit instances (a 16-bit recipe: bf16), and each recipe has at least one config for
// DeepSeek-V3's W1 and W2.
TEST(Recipe, GemmConfigsFollowTheRows) {
  for (const RecipeInfo& r : kRecipes) {
    int unfused = 0, fused = 0;
    const bool sixteen_bit = plan::sixteen_bit_gemm(r.scheme);
    EXPECT_EQ(sixteen_bit, !has_weight_scales(r)) << r.name;
    for (const auto& c : plan::kGemmConfigs) {
      const std::string ctx = std::string(r.name) + " " + std::string(c.name);
      const bool instance = sixteen_bit ? c.sixteen_bit && !c.fast_accumulation_only
                                        : (r.block_scaled_gemm ? c.block_scaled : c.token_scaled);
      EXPECT_EQ(plan::supports(c, 4096, 7168, r.scheme),
                r.cuda_experts && 4096 % c.n_multiple == 0 && !c.fused_w1 && instance)
          << ctx;
      unfused += plan::supports(c, 4096, 7168, r.scheme) && plan::supports(c, 7168, 2048, r.scheme);
      fused += plan::supports(c, 4096, 7168, r.scheme, true);
    }
    EXPECT_EQ(unfused > 0, r.cuda_experts) << r.name;
    EXPECT_EQ(fused > 0, r.fused_w1) << r.name;
  }
}

// The 16-bit rule: swapab-128x32 for m_e <= 32, swapab-128x64 for m_e <= 64, cooperative-128x256
// past that (pingpong-64x256 is FP8 fast accumulation only), never a fused W1, for the W1 and W2
// of DeepSeek-V3 and Qwen3-30B-A3B and a K only a multiple of 16.
TEST(Recipe, SixteenBitRule) {
  using plan::GemmConfig;
  struct Gemm {
    std::int64_t n, k;
  };
  for (const Gemm g : {Gemm{4096, 7168}, Gemm{7168, 2048}, Gemm{1536, 2048}, Gemm{2048, 768}, Gemm{4096, 7184}}) {
    const std::string ctx = "n = " + std::to_string(g.n) + ", k = " + std::to_string(g.k);
    for (const std::int64_t rows : {0, 1, 31, 32})
      EXPECT_EQ(plan::select_gemm_config(rows, g.n, g.k, QuantScheme::kBf16), GemmConfig::kSwapAB128x32) << ctx;
    for (const std::int64_t rows : {33, 64})
      EXPECT_EQ(plan::select_gemm_config(rows, g.n, g.k, QuantScheme::kBf16), GemmConfig::kSwapAB128x64) << ctx;
    for (const std::int64_t rows : {65, 128, 300, 8192})
      EXPECT_EQ(plan::select_gemm_config(rows, g.n, g.k, QuantScheme::kBf16), GemmConfig::kCooperative128x256) << ctx;
    const plan::GemmLaunches l = plan::plan_gemm_launches(g.n, g.k, 8192, QuantScheme::kBf16);
    ASSERT_EQ(l.count, 3) << ctx;
    EXPECT_EQ(l.config[0], GemmConfig::kSwapAB128x32) << ctx;
    EXPECT_EQ(l.config[1], GemmConfig::kSwapAB128x64) << ctx;
    EXPECT_EQ(l.config[2], GemmConfig::kCooperative128x256) << ctx;
    for (int j = 0; j < l.count; ++j) {
      EXPECT_EQ(l.tail_tile[j], 0) << ctx;  // nothing splits ragged tails
      EXPECT_TRUE(plan::supports_sixteen_bit(plan::gemm_config_info(l.config[j]), g.n, g.k)) << ctx;
    }
    for (const auto& c : plan::kGemmConfigs)
      EXPECT_FALSE(plan::supports(c, g.n, g.k, QuantScheme::kBf16, true)) << ctx << " " << c.name;
  }
  // The problem's plan: both GEMMs on the rule, no fused W1 even where the problem asks for one.
  const ModelConfig model = load_model("deepseek-v3");
  const MoeProblem p = make_problem(model, ParallelConfig{1, 8, 256, 0}, ActivationFormat::kBatchedExperts,
                                    QuantScheme::kBf16, Activation::kSilu);
  EXPECT_FALSE(p.fuse_w1);
  const plan::ExpertsGemmPlan g = plan::plan_experts_gemms(p, 256);
  EXPECT_FALSE(g.fused_w1);
  EXPECT_FALSE(g.w1_small);
  EXPECT_EQ(g.w1.config[g.w1.count - 1], GemmConfig::kCooperative128x256);
  EXPECT_EQ(g.w2.config[g.w2.count - 1], GemmConfig::kCooperative128x256);
}

}  // namespace
}  // namespace moekit
