// Model presets read from models/*.json with the public model cards' values, and config.json
// files that are malformed or incomplete rejected with the field and the file named.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/model.h"
#include "moekit/problem.h"

namespace moekit {
namespace {

TEST(Model, Presets) {
  struct Expect {
    const char* name;
    std::int64_t K, I, E, topk, layers, moe_layers;
    Activation act;
    Scoring scoring;
  };
  const Expect cases[] = {
      {"deepseek-v3", 7168, 2048, 256, 8, 61, 58, Activation::kSilu, Scoring::kSigmoid},
      {"kimi-k2", 7168, 2048, 384, 8, 61, 60, Activation::kSilu, Scoring::kSigmoid},
      {"qwen3-30b-a3b", 2048, 768, 128, 8, 48, 48, Activation::kSilu, Scoring::kSoftmax},
      {"qwen3-235b-a22b", 4096, 1536, 128, 8, 94, 94, Activation::kSilu, Scoring::kSoftmax},
      {"mixtral-8x7b", 4096, 14336, 8, 2, 32, 32, Activation::kSilu, Scoring::kSoftmax},
      {"gpt-oss-120b", 2880, 2880, 128, 4, 36, 36, Activation::kSwigluOai, Scoring::kSoftmax},
  };
  EXPECT_EQ(model_preset_names().size(), std::size(cases));
  for (const auto& c : cases) {
    const ModelConfig m = load_model(c.name);
    EXPECT_EQ(m.hidden_size, c.K) << c.name;
    EXPECT_EQ(m.moe_intermediate_size, c.I) << c.name;
    EXPECT_EQ(m.num_experts, c.E) << c.name;
    EXPECT_EQ(m.topk, c.topk) << c.name;
    EXPECT_EQ(m.num_layers, c.layers) << c.name;
    EXPECT_EQ(m.num_moe_layers, c.moe_layers) << c.name;
    EXPECT_EQ(m.activation, c.act) << c.name;
    EXPECT_EQ(m.scoring, c.scoring) << c.name;
  }
  const ModelConfig ds = load_model("DeepSeek-V3");  // names are case-insensitive
  EXPECT_EQ(ds.n_group, 8);
  EXPECT_EQ(ds.topk_group, 4);
  EXPECT_DOUBLE_EQ(ds.routed_scaling_factor, 2.5);
  EXPECT_TRUE(ds.has_score_correction_bias);
  EXPECT_EQ(ds.num_shared_experts, 1);
  EXPECT_EQ(ds.N(), 4096);
}

// quantization_config picks the default scheme; a format moekit does not run is named, never
// silently replaced.
TEST(Model, CheckpointQuantizationPicksTheDefaultScheme) {
  const ModelConfig ds = load_model("deepseek-v3");
  ASSERT_TRUE(ds.checkpoint_quant.has_value());
  EXPECT_EQ(*ds.checkpoint_quant, QuantScheme::kBlock128);
  EXPECT_EQ(ds.checkpoint_format, "fp8, weight_block_size [128, 128]");
  EXPECT_EQ(choose_quant(ds, "auto").quant, QuantScheme::kBlock128);
  EXPECT_EQ(choose_quant(ds, "").quant, QuantScheme::kBlock128);
  EXPECT_EQ(load_model("kimi-k2").checkpoint_quant, QuantScheme::kBlock128);
  const QuantChoice asked = choose_quant(ds, "per-token");
  EXPECT_EQ(asked.quant, QuantScheme::kPerTokenPerChannel);
  EXPECT_NE(asked.note.find("requantized"), std::string::npos) << asked.note;
  // Unquantized (bf16) checkpoints: their own precision, bf16.
  const ModelConfig qwen = load_model("qwen3-30b-a3b");
  EXPECT_FALSE(qwen.checkpoint_quant.has_value());
  EXPECT_EQ(choose_quant(qwen, "auto").quant, QuantScheme::kBf16);
  EXPECT_NE(choose_quant(qwen, "auto").note.find("unquantized"), std::string::npos);
  // An fp16 checkpoint (torch_dtype float16): fp16, its values as stored; bf16 and fp32: bf16.
  ModelConfig fp16_ckpt = qwen;
  fp16_ckpt.checkpoint_dtype = "float16";
  EXPECT_EQ(choose_quant(fp16_ckpt, "auto").quant, QuantScheme::kFp16);
  EXPECT_NE(choose_quant(fp16_ckpt, "auto").note.find("torch_dtype float16"), std::string::npos);
  EXPECT_EQ(choose_quant(fp16_ckpt, "bf16").quant, QuantScheme::kBf16);
  for (const char* d : {"bfloat16", "float32", ""}) {
    fp16_ckpt.checkpoint_dtype = d;
    EXPECT_EQ(choose_quant(fp16_ckpt, "auto").quant, QuantScheme::kBf16) << d;
  }
  // From config.json: torch_dtype, or transformers' newer "dtype"; null or a non-string is no hint.
  auto dtype_of = [](const std::string& field) {
    return parse_model_config(R"({"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 128,
      "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, )" +
                                  field + "}",
                              "test.json");
  };
  EXPECT_EQ(choose_quant(dtype_of(R"("torch_dtype": "float16")"), "auto").quant, QuantScheme::kFp16);
  EXPECT_EQ(choose_quant(dtype_of(R"("dtype": "float16")"), "auto").quant, QuantScheme::kFp16);
  EXPECT_EQ(choose_quant(dtype_of(R"("torch_dtype": "bfloat16")"), "auto").quant, QuantScheme::kBf16);
  for (const char* odd : {R"("torch_dtype": null)", R"("torch_dtype": 16)", R"("dtype": ["float16"])"})
    EXPECT_EQ(choose_quant(dtype_of(odd), "auto").quant, QuantScheme::kBf16) << odd;
  // gpt-oss ships MXFP4 experts: converted exactly to per-token FP8 at load (its 2880 is no multiple
  // of 128), and the note says so.
  const ModelConfig oss_model = load_model("gpt-oss-120b");
  EXPECT_EQ(oss_model.checkpoint_quant, QuantScheme::kPerTokenPerChannel);
  const QuantChoice oss = choose_quant(oss_model, "auto");
  EXPECT_EQ(oss.quant, QuantScheme::kPerTokenPerChannel);
  EXPECT_NE(oss.note.find("mxfp4 (e2m1 values, an e8m0 exponent per 32; converted exactly to FP8 at load)"),
            std::string::npos)
      << oss.note;
  // Hand-written configs: fp8 without blocks, static activations, other block sizes, int4.
  auto with = [](const std::string& q) {
    return parse_model_config(R"({"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 128,
      "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "quantization_config": )" +
                                  q + "}",
                              "test.json");
  };
  EXPECT_EQ(with(R"({"quant_method": "fp8"})").checkpoint_quant, QuantScheme::kPerTokenPerChannel);
  EXPECT_EQ(with(R"({"quant_method": "fp8", "activation_scheme": "static"})").checkpoint_quant,
            QuantScheme::kPerTensor);
  const ModelConfig b64 = with(R"({"quant_method": "fp8", "weight_block_size": [64, 64]})");
  EXPECT_FALSE(b64.checkpoint_quant.has_value());
  EXPECT_NE(choose_quant(b64, "auto").note.find("[64, 64], a format moekit does not run"), std::string::npos);
  const ModelConfig int4 = with(
      R"({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}})");
  EXPECT_EQ(int4.checkpoint_format, "compressed-tensors int4");
  EXPECT_EQ(choose_quant(int4, "auto").quant, QuantScheme::kPerTokenPerChannel);
  EXPECT_NE(choose_quant(int4, "block128").note.find("int4, a format moekit does not run"), std::string::npos);
  EXPECT_THROW(with(R"({"quant_method": "fp8", "weight_block_size": "128"})"), Error);
  EXPECT_THROW(with(R"([1, 2])"), Error);
  EXPECT_THROW(choose_quant(ds, "int4"), Error);
}

TEST(Model, PresetFileOnDiskEqualsEmbedded) {
  const auto path = std::string(MOEKIT_SOURCE_DIR) + "/models/qwen3-235b-a22b.json";
  // The source tree this binary was built from; a binary carried elsewhere has only the embedded one.
  if (!std::filesystem::is_regular_file(path)) GTEST_SKIP() << path << " is not here (the binary left its source tree)";
  const ModelConfig m = load_model(path);
  EXPECT_EQ(m.name, path);
  EXPECT_EQ(m.moe_intermediate_size, 1536);
}

std::string error_of(const std::string& json, const std::string& name = "test/config.json") {
  try {
    parse_model_config(json, name);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Model, MalformedOrIncompleteConfig) {
  const std::string ok =
      R"({"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
          "num_experts_per_tok": 2, "num_hidden_layers": 2})";
  EXPECT_EQ(error_of(ok), "");

  std::string e = error_of(R"({"model_type": "qwen3_moe", "hidden_size": 64,)");
  EXPECT_NE(e.find("test/config.json"), std::string::npos) << e;
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;

  e = error_of(R"({"model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                   "num_hidden_layers": 2})");
  EXPECT_NE(e.find("missing field 'hidden_size'"), std::string::npos) << e;
  EXPECT_NE(e.find("test/config.json"), std::string::npos) << e;

  e = error_of(R"({"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                   "num_hidden_layers": 2})");
  EXPECT_NE(e.find("missing field 'num_experts'"), std::string::npos) << e;

  e = error_of(R"({"model_type": "qwen3_moe", "hidden_size": "64", "moe_intermediate_size": 32, "num_experts": 8,
                   "num_experts_per_tok": 2, "num_hidden_layers": 2})");
  EXPECT_NE(e.find("'hidden_size' must be an integer"), std::string::npos) << e;

  e = error_of(R"({"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
                   "num_experts_per_tok": 9, "num_hidden_layers": 2})");
  EXPECT_NE(e.find("num_experts_per_tok = 9"), std::string::npos) << e;

  e = error_of(R"({"model_type": "qwen3_moe", "hidden_size": 0, "moe_intermediate_size": 32, "num_experts": 8,
                   "num_experts_per_tok": 2, "num_hidden_layers": 2})");
  EXPECT_NE(e.find("'hidden_size' = 0 must be >= 1"), std::string::npos) << e;

  e = error_of(R"({"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
                   "num_experts_per_tok": 2, "num_hidden_layers": 2, "hidden_act": "tanh"})");
  EXPECT_NE(e.find("'hidden_act' = 'tanh'"), std::string::npos) << e;

  e = error_of(R"([1, 2])");
  EXPECT_NE(e.find("JSON object"), std::string::npos) << e;
}

// The architecture table: each family's keys with transformers' defaults, and a refusal naming the
// key for a value its MoE block does not compute.
std::string config(const std::string& model_type, const std::string& extra) {
  return R"({"model_type": ")" + model_type + R"(", "hidden_size": 64, "moe_intermediate_size": 32,
    "intermediate_size": 48, "n_routed_experts": 16, "num_experts": 16, "num_local_experts": 16,
    "num_experts_per_tok": 4, "num_hidden_layers": 4)" +
         extra + "}";
}

// Every size a config.json gives is within its limit of moekit/limits.h (the limit itself is
// accepted), so no product of them overflows and no loop over them runs away; past it, an Error names
// the key, the value and the limit. Lists of layers are bounded too; a key twice is refused.
TEST(Model, ConfigSizesWithinTheirLimits) {
  const std::string base = R"({"model_type": "deepseek_v3", "hidden_size": 128, "moe_intermediate_size": 128,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 4, "first_k_dense_replace": 1,
    "n_group": 4, "topk_group": 2, "n_shared_experts": 1})";
  // base with `key`'s value replaced.
  auto with = [&](const std::string& key, const std::string& value, const std::string& from = {}) {
    std::string text = from.empty() ? base : from;
    const std::string k = "\"" + key + "\": ";
    const auto at = text.find(k) + k.size();
    return text.replace(at, text.find_first_of(",}", at) - at, value);
  };
  struct Case {
    std::string key;
    std::int64_t limit;
  };
  const std::vector<Case> cases = {
      {"hidden_size", limits::kMaxHiddenSize},   {"moe_intermediate_size", limits::kMaxIntermediateSize},
      {"n_routed_experts", limits::kMaxExperts}, {"num_experts_per_tok", limits::kMaxTopk},
      {"num_hidden_layers", limits::kMaxLayers}, {"first_k_dense_replace", limits::kMaxLayers},
      {"n_group", limits::kMaxExperts},          {"n_shared_experts", limits::kMaxExperts}};
  for (const Case& c : cases) {
    for (const std::int64_t v : {c.limit + 1, std::int64_t{1} << 40, std::int64_t{1} << 62}) {
      const std::string e = error_of(with(c.key, std::to_string(v)));
      EXPECT_NE(e.find(fmt::format("'{}' = {} is past moekit's limit of {}", c.key, v, c.limit)), std::string::npos)
          << c.key << " = " << v << ": " << e;
    }
    const std::string past = error_of(with(c.key, "18446744073709551615"));
    EXPECT_NE(past.find("past moekit's limit"), std::string::npos) << c.key << ": " << past;
  }
  // At the limits: refused for what the model computes (topk_group, shared width), not for the size.
  EXPECT_EQ(error_of(with("hidden_size", "131072", with("num_hidden_layers", "4096"))), "");
  std::string e = error_of(with("moe_intermediate_size", "131072", with("n_shared_experts", "16")));
  EXPECT_NE(e.find("n_shared_experts = 16 x moe_intermediate_size = 131072"), std::string::npos) << e;
  // Lists of layers: at most kMaxLayers entries, read in linear time.
  std::string list = "0";
  for (int i = 1; i <= limits::kMaxLayers; ++i) list += ",0";
  e = error_of(config("qwen3_moe", R"(, "mlp_only_layers": [)" + list + "]"));
  EXPECT_NE(e.find("'mlp_only_layers' lists 4097 entries, past moekit's limit of 4096"), std::string::npos) << e;
  e = error_of(config("glm_moe_dsa", R"(, "mlp_layer_types": [)" + list + "]"));
  EXPECT_NE(e.find("'mlp_layer_types' lists 4097 entries"), std::string::npos) << e;
  // Numbers past a double, and keys twice, name the key.
  e = error_of(config("deepseek_v3", R"(, "routed_scaling_factor": 1e999)"));
  EXPECT_NE(e.find("key 'routed_scaling_factor'"), std::string::npos) << e;
  EXPECT_NE(e.find("number overflow"), std::string::npos) << e;
  e = error_of(R"({"model_type": "qwen3_moe", "model_type": "mixtral"})");
  EXPECT_NE(e.find("key 'model_type' is given twice"), std::string::npos) << e;
}

TEST(Model, ArchitectureTableReadsEachFamilyAsTransformersDoes) {
  // GLM-4.5: no scoring_func / topk_method in its config, yet sigmoid + bias + groups + scaling.
  const ModelConfig glm = parse_model_config(config("glm4_moe", R"(, "routed_scaling_factor": 2.5, "n_group": 4,
    "topk_group": 2)"),
                                             "glm.json");
  EXPECT_EQ(glm.scoring, Scoring::kSigmoid);
  EXPECT_TRUE(glm.has_score_correction_bias);
  EXPECT_EQ(glm.n_group, 4);
  EXPECT_EQ(glm.group_score, GroupScore::kTop2Sum);
  EXPECT_DOUBLE_EQ(glm.routed_scaling_factor, 2.5);
  EXPECT_DOUBLE_EQ(glm.renormalize_epsilon, 1e-20);
  EXPECT_EQ(glm.shared_intermediate_size, 32);  // n_shared_experts (default 1) x moe_intermediate_size
  EXPECT_EQ(glm.num_moe_layers, 3);             // first_k_dense_replace defaults to 1
  EXPECT_EQ(glm.moe_block, "Glm4MoeMoE");
  const ModelConfig glm5 = parse_model_config(config("glm_moe_dsa", ""), "glm5.json");
  EXPECT_DOUBLE_EQ(glm5.routed_scaling_factor, 2.5);

  // DeepSeek-V2: softmax, group_limited_greedy scores a group by its max, scaled, not renormalized.
  const ModelConfig v2 = parse_model_config(config("deepseek_v2", R"(, "topk_method": "group_limited_greedy",
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 16.0, "n_shared_experts": 2)"),
                                            "v2.json");
  EXPECT_EQ(v2.scoring, Scoring::kSoftmax);
  EXPECT_EQ(v2.group_score, GroupScore::kMax);
  EXPECT_FALSE(v2.norm_topk_prob);
  EXPECT_DOUBLE_EQ(v2.routed_scaling_factor, 16.0);
  EXPECT_EQ(v2.shared_intermediate_size, 64);
  const ModelConfig v2_greedy = parse_model_config(config("deepseek_v2", ""), "v2.json");
  EXPECT_EQ(v2_greedy.n_group, 1);

  // Qwen2-MoE: a shared expert behind a sigmoid gate; norm_topk_prob defaults to false.
  const ModelConfig q2 = parse_model_config(config("qwen2_moe", R"(, "shared_expert_intermediate_size": 96)"), "q2");
  EXPECT_EQ(q2.shared_intermediate_size, 96);
  EXPECT_TRUE(q2.shared_expert_gate);
  EXPECT_FALSE(q2.norm_topk_prob);
  EXPECT_FALSE(parse_model_config(config("olmoe", ""), "olmoe").norm_topk_prob);
  EXPECT_EQ(parse_model_config(config("olmoe", ""), "olmoe").moe_intermediate_size, 48);
  EXPECT_TRUE(parse_model_config(config("mixtral", R"(, "norm_topk_prob": false)"), "mixtral").norm_topk_prob);

  // gpt-oss: expert biases, swigluoai whatever hidden_act says.
  const ModelConfig oss = parse_model_config(config("gpt_oss", R"(, "hidden_act": "silu", "swiglu_limit": 7.0)"), "o");
  EXPECT_TRUE(oss.expert_bias);
  EXPECT_EQ(oss.activation, Activation::kSwigluOai);
  EXPECT_EQ(oss.swiglu.limit, 7.0f);
  EXPECT_EQ(oss.swiglu.alpha, 1.702f);  // GptOssConfig's default where the config has none
  // The limit and alpha are the config's, and reach the problem every device runs (its describe(),
  // which keys the ops' cached workspaces, names both).
  const ModelConfig oss10 =
      parse_model_config(config("gpt_oss", R"(, "swiglu_limit": 10.0, "swiglu_alpha": 1.0)"), "o");
  EXPECT_EQ(oss10.swiglu.limit, 10.0f);
  EXPECT_EQ(oss10.swiglu.alpha, 1.0f);
  const MoeProblem p10 = make_problem(oss10, ParallelConfig{.max_tokens_per_rank = 16}, ActivationFormat::kStandard,
                                      QuantScheme::kPerTokenPerChannel);
  EXPECT_EQ(p10.swiglu.limit, 10.0f);
  EXPECT_EQ(p10.swiglu.alpha, 1.0f);
  EXPECT_NE(p10.describe().find("swigluoai(limit 10, alpha 1)"), std::string::npos) << p10.describe();
  // And the shared experts' problem, built from the routed one.
  ModelConfig oss_shared = oss10;
  oss_shared.shared_intermediate_size = oss10.moe_intermediate_size;
  const std::optional<MoeProblem> shared = shared_experts_problem(oss_shared, p10);
  ASSERT_TRUE(shared.has_value());
  EXPECT_EQ(shared->swiglu, p10.swiglu);
  EXPECT_EQ(parse_model_config(config("gpt_oss", R"(, "swiglu_alpha": 2.5)"), "o").swiglu.alpha, 2.5f);

  // Accumulation: precise by default; fast where the scheme has it, refused by name under block128.
  const ModelConfig ds = load_model("deepseek-v3");
  const ParallelConfig one{.max_tokens_per_rank = 16};
  EXPECT_EQ(make_problem(ds, one, ActivationFormat::kStandard, QuantScheme::kPerTokenPerChannel).accumulation,
            Accumulation::kPrecise);
  const MoeProblem fast = make_problem(ds, one, ActivationFormat::kStandard, QuantScheme::kPerTokenPerChannel,
                                       ds.activation, std::nullopt, Accumulation::kFast);
  EXPECT_NE(fast.describe().find("fast-accumulation"), std::string::npos) << fast.describe();
  try {
    make_problem(ds, one, ActivationFormat::kStandard, QuantScheme::kBlock128, ds.activation, std::nullopt,
                 Accumulation::kFast);
    ADD_FAILURE() << "fast accumulation under block128 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("block128"), std::string::npos) << e.what();
  }
  EXPECT_EQ(load_model("kimi-k2").moe_block, "DeepseekV3MoE");

  // Families on the blocks above, with their own config classes' defaults.
  const ModelConfig dots = parse_model_config(config("dots1", R"(, "n_shared_experts": 2, "n_group": null)"), "d");
  EXPECT_FALSE(dots.norm_topk_prob);  // Dots1Config: false
  EXPECT_EQ(dots.n_group, 1);         // null in the released configs
  EXPECT_DOUBLE_EQ(dots.routed_scaling_factor, 1.0);
  EXPECT_EQ(dots.shared_intermediate_size, 64);
  EXPECT_DOUBLE_EQ(parse_model_config(config("glm4_moe_lite", ""), "g").routed_scaling_factor, 1.8);
  EXPECT_EQ(parse_model_config(config("glm4_moe_lite", ""), "g").num_moe_layers, 3);
  EXPECT_EQ(parse_model_config(config("deepseek_v32", ""), "v32").n_group, 8);
  const ModelConfig next = parse_model_config(config("qwen3_next", ""), "n");
  EXPECT_TRUE(next.norm_topk_prob);
  EXPECT_EQ(next.shared_intermediate_size, 512);
  EXPECT_TRUE(next.shared_expert_gate);
  EXPECT_EQ(parse_model_config(R"({"model_type": "minimax", "hidden_size": 64, "intermediate_size": 48,
    "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2})",
                               "mm")
                .num_experts,
            8);
  EXPECT_TRUE(parse_model_config(config("granitemoe", ""), "gr").norm_topk_prob);
  const ModelConfig jamba = parse_model_config(config("jamba", ""), "j");
  EXPECT_FALSE(jamba.norm_topk_prob);
  EXPECT_EQ(jamba.num_moe_layers, 2);  // layers 1 and 3 of 4 (period 2, offset 1)
  EXPECT_EQ(parse_model_config(config("flex_olmo", ""), "f").moe_intermediate_size, 48);
}

TEST(Model, ArchitectureTableRefusesWhatItCannotHonor) {
  auto refused = [](const std::string& model_type, const std::string& extra) {
    return error_of(config(model_type, extra), "c.json");
  };
  std::string e = refused("llama_moe_x", "");
  EXPECT_NE(e.find("model_type 'llama_moe_x' is not in moekit's architecture table"), std::string::npos) << e;
  EXPECT_NE(e.find("deepseek_v3"), std::string::npos) << e;  // the supported list
  e = refused("llama4_text", "");
  EXPECT_NE(e.find("scales each token's input"), std::string::npos) << e;
  e = refused("deepseek_v3", R"(, "scoring_func": "softmax")");
  EXPECT_NE(e.find("'scoring_func' = 'softmax'"), std::string::npos) << e;
  e = refused("glm4_moe", R"(, "topk_method": "greedy")");
  EXPECT_NE(e.find("'topk_method' = 'greedy'"), std::string::npos) << e;
  e = refused("deepseek_v2", R"(, "topk_method": "noaux_tc")");
  EXPECT_NE(e.find("'topk_method' = 'noaux_tc'"), std::string::npos) << e;
  e = refused("deepseek_v2", R"(, "norm_topk_prob": true)");
  EXPECT_NE(e.find("'norm_topk_prob' = true"), std::string::npos) << e;
  e = refused("deepseek_v2", R"(, "topk_method": "group_limited_greedy")");
  EXPECT_NE(e.find("missing field 'n_group'"), std::string::npos) << e;
  e = refused("gpt_oss", R"(, "swiglu_limit": 0)");
  EXPECT_NE(e.find("'swiglu_limit' = 0"), std::string::npos) << e;
  e = refused("gpt_oss", R"(, "swiglu_limit": -7.0)");
  EXPECT_NE(e.find("'swiglu_limit' = -7"), std::string::npos) << e;
  e = refused("gpt_oss", R"(, "swiglu_limit": 1e6)");
  EXPECT_NE(e.find("'swiglu_limit' = 1000000 must be a finite number in (0, 65504]"), std::string::npos) << e;
  // transformers' GptOssConfig.swiglu_alpha: any finite value in (0, 1024] runs (above); others are
  // refused by name with the file, the value and the bound, never clamped or ignored.
  for (const char* bad : {"0", "-1.702", "1025", "1e39"}) {
    e = refused("gpt_oss", fmt::format(R"(, "swiglu_alpha": {})", bad));
    EXPECT_NE(e.find("c.json: field 'swiglu_alpha' = "), std::string::npos) << bad << ": " << e;
    EXPECT_NE(e.find("must be a finite number in (0, 1024]"), std::string::npos) << bad << ": " << e;
  }
  e = refused("gpt_oss", R"(, "swiglu_alpha": "1.0")");
  EXPECT_NE(e.find("field 'swiglu_alpha' must be a number"), std::string::npos) << e;
  e = refused("deepseek_v3", R"(, "moe_layer_freq": 2)");
  EXPECT_NE(e.find("'moe_layer_freq' = 2"), std::string::npos) << e;
  e = refused("dots1", "");
  EXPECT_NE(e.find("missing field 'n_shared_experts'"), std::string::npos) << e;
  e = refused("glm4_moe_lite", R"(, "first_k_dense_replace": 0)");
  EXPECT_NE(e.find("'first_k_dense_replace' = 0"), std::string::npos) << e;
  e = refused("minimax", R"(, "shared_intermediate_size": 64)");
  EXPECT_NE(e.find("'shared_intermediate_size' = 64"), std::string::npos) << e;
  e = refused("deepseek_v3", R"(, "routed_scaling_factor": 0)");
  EXPECT_NE(e.find("routed_scaling_factor = 0"), std::string::npos) << e;
}

TEST(Model, MissingFileAndUnknownPreset) {
  try {
    load_model("/nonexistent/config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/config.json"), std::string::npos) << e.what();
  }
  try {
    load_model("deepseek-v9");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("deepseek-v9"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("deepseek-v3"), std::string::npos) << e.what();
  }
  // A file on disk that is incomplete names its path.
  const auto path = std::filesystem::temp_directory_path() / "moekit_incomplete_config.json";
  std::ofstream(path) << R"({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2})";
  try {
    load_model(path.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("moe_intermediate_size"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace moekit
