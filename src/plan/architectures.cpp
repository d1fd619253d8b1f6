// The architecture table: one row per supported config.json `model_type`, saying how that family's
// MoE block computes (routing, activation, expert biases, shared experts) and which keys it reads,
// each with the default of transformers' own config class. Truth is the family's modeling file in
// Hugging Face transformers (tests/parity runs its MoE block against moekit's layer). A key the
// row does not honor, an unknown model_type, or a value that would change the math in a way moekit
// does not compute is an Error naming the key and the value: never a silent default.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <set>

#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/model.h"
#include "moekit/recipe.h"
#include "plan/untrusted_input.h"

namespace moekit {
namespace {

using nlohmann::json;

struct Reader {
  const json& doc;
  const std::string& source;

  const json* find(std::initializer_list<const char*> names) const {
    for (const char* n : names)
      if (doc.contains(n) && !doc.at(n).is_null()) return &doc.at(n);
    return nullptr;
  }

  static std::string joined(std::initializer_list<const char*> names) {
    std::string s;
    for (const char* n : names) s += (s.empty() ? "'" : " or '") + std::string(n) + "'";
    return s;
  }

  // An integer in [min_value, max_value]: max_value is a limit of moekit/limits.h, so that no size a
  // config.json gives can overflow a product or exhaust memory before the memory check sees it.
  std::int64_t integer(std::initializer_list<const char*> names, std::int64_t min_value, std::int64_t max_value) const {
    const json* v = find(names);
    MOEKIT_CHECK(v != nullptr, "{}: missing field {} (an integer >= {})", source, joined(names), min_value);
    MOEKIT_CHECK(v->is_number_integer(), "{}: field {} must be an integer, got {}", source, joined(names),
                 plan::brief(*v));
    MOEKIT_CHECK(!(v->is_number_unsigned() && v->get<std::uint64_t>() > INT64_MAX),
                 "{}: field {} = {} is past moekit's limit of {} (moekit/limits.h)", source, joined(names),
                 plan::brief(*v), max_value);
    const auto value = v->get<std::int64_t>();
    MOEKIT_CHECK(value >= min_value, "{}: field {} = {} must be >= {}", source, joined(names), value, min_value);
    MOEKIT_CHECK(value <= max_value,
                 "{}: field {} = {} is past moekit's limit of {} (moekit/limits.h; no published model comes near it): "
                 "a corrupt or wrong config.json?",
                 source, joined(names), value, max_value);
    return value;
  }

  std::int64_t integer_or(std::initializer_list<const char*> names, std::int64_t fallback, std::int64_t min_value,
                          std::int64_t max_value) const {
    return find(names) ? integer(names, min_value, max_value) : fallback;
  }

  // n_shared_experts x moe_intermediate_size: one MLP of that width, within kMaxSharedIntermediateSize.
  std::int64_t shared_width(std::int64_t num_shared, std::int64_t intermediate) const {
    const std::int64_t width =
        limits::checked_mul(num_shared, intermediate, "n_shared_experts * moe_intermediate_size");
    MOEKIT_CHECK(
        width <= limits::kMaxSharedIntermediateSize,
        "{}: n_shared_experts = {} x moe_intermediate_size = {} = {}, past moekit's limit of {} for the shared "
        "experts' width (moekit/limits.h)",
        source, num_shared, intermediate, width, limits::kMaxSharedIntermediateSize);
    return width;
  }

  // A list of at most kMaxLayers entries (layer indices or layer types).
  const json* layer_list(const char* name) const {
    const json* v = find({name});
    if (v == nullptr) return nullptr;
    MOEKIT_CHECK(v->is_array(), "{}: field '{}' must be a list, got {}", source, name, plan::brief(*v));
    MOEKIT_CHECK(static_cast<std::int64_t>(v->size()) <= limits::kMaxLayers,
                 "{}: field '{}' lists {} entries, past moekit's limit of {} layers (moekit/limits.h)", source, name,
                 v->size(), limits::kMaxLayers);
    return v;
  }

  double number_or(const char* name, double fallback) const {
    const json* v = find({name});
    if (!v) return fallback;
    MOEKIT_CHECK(v->is_number(), "{}: field '{}' must be a number, got {}", source, name, plan::brief(*v));
    return v->get<double>();
  }

  bool boolean_or(const char* name, bool fallback) const {
    const json* v = find({name});
    if (!v) return fallback;
    MOEKIT_CHECK(v->is_boolean(), "{}: field '{}' must be true or false, got {}", source, name, plan::brief(*v));
    return v->get<bool>();
  }

  std::string string(const char* name) const {
    const json* v = find({name});
    MOEKIT_CHECK(v != nullptr, "{}: missing field '{}' (a string)", source, name);
    MOEKIT_CHECK(v->is_string(), "{}: field '{}' must be a string, got {}", source, name, plan::brief(*v));
    return v->get<std::string>();
  }

  std::string string_or(const char* name, const std::string& fallback) const {
    return find({name}) ? string(name) : fallback;
  }

  // A key the family's MoE block ignores but whose value, if it meant anything, would change the
  // math (another model's code reads it): accepted only at the value the block computes.
  void require_string(const char* name, std::initializer_list<const char*> allowed, const std::string& why) const {
    const json* v = find({name});
    if (!v) return;
    const std::string got = string(name);
    const bool ok = std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return got == a; });
    MOEKIT_CHECK(ok, "{}: field '{}' = '{}' is not what this model's MoE block computes ({}); moekit accepts {}",
                 source, name, got, why, joined(allowed));
  }
  void require_number(const char* name, double expected, const std::string& why) const {
    const double got = number_or(name, expected);
    MOEKIT_CHECK(got == expected, "{}: field '{}' = {} is not supported ({}); moekit computes {} = {}", source, name,
                 got, why, name, expected);
  }
};

// The checkpoint's quantization_config: its format in words and the FP8 scheme moekit runs it with.
void read_quantization(const Reader& r, ModelConfig& m) {
  // The weights' dtype as transformers saved them (torch_dtype; "dtype" from transformers 4.56 on). A
  // hint only (the tensors' own dtypes are checked at load): absent, null or not a string, it is empty.
  for (const char* key : {"torch_dtype", "dtype"})
    if (const json* d = r.find({key}); d != nullptr && d->is_string() && m.checkpoint_dtype.empty())
      m.checkpoint_dtype = d->get<std::string>().substr(0, 32);
  const json* q = r.find({"quantization_config"});
  if (q == nullptr) return;
  MOEKIT_CHECK(q->is_object(), "{}: field 'quantization_config' must be an object, got {}", r.source, plan::brief(*q));
  const Reader qr{*q, r.source};
  const std::string method = qr.string("quant_method");
  m.checkpoint_format = method;
  if (method == "fp8") {
    if (const json* b = qr.find({"weight_block_size"})) {
      MOEKIT_CHECK(b->is_array() && b->size() == 2 && (*b)[0].is_number_integer() && (*b)[1].is_number_integer(),
                   "{}: quantization_config.weight_block_size must be two integers, got {}", r.source, plan::brief(*b));
      const auto rows = (*b)[0].get<std::int64_t>(), cols = (*b)[1].get<std::int64_t>();
      m.checkpoint_format = fmt::format("fp8, weight_block_size [{}, {}]", rows, cols);
      if (rows == kQuantBlock && cols == kQuantBlock)
        m.checkpoint_quant = recipe_for_weight_scales(WeightScales::kBlock128x128);
      return;  // other block sizes: not run
    }
    // Static activation scales come with one scale per weight tensor (the per-tensor recipe).
    const bool is_static = qr.string_or("activation_scheme", "dynamic") == "static";
    m.checkpoint_format = is_static ? "fp8, static activation scales" : "fp8, per-channel weights";
    m.checkpoint_quant =
        recipe_for_weight_scales(is_static ? WeightScales::kPerTensor : WeightScales::kPerOutputChannel);
    return;
  }
  if (method == "mxfp4") {
    // gpt-oss's release: e2m1 values with an e8m0 exponent per 32, converted to FP8 at load, exactly
    // (checkpoint/mxfp4.h); one scale a row runs every shape (gpt-oss's 2880 is no multiple of 128).
    m.checkpoint_format = "mxfp4 (e2m1 values, an e8m0 exponent per 32; converted exactly to FP8 at load)";
    m.checkpoint_quant = recipe_for_weight_scales(WeightScales::kPerOutputChannel);
    return;
  }
  if (method == "compressed-tensors") {
    // Name the weights' type from the first config group (e.g. "int4"): moekit runs none of them.
    if (const json* groups = qr.find({"config_groups"}); groups && groups->is_object() && !groups->empty()) {
      const json& g = groups->begin().value();
      if (g.is_object() && g.contains("weights") && g.at("weights").is_object()) {
        const json& w = g.at("weights");
        const std::string type = w.contains("type") && w.at("type").is_string() ? w.at("type").get<std::string>() : "";
        const std::int64_t bits =
            w.contains("num_bits") && w.at("num_bits").is_number_integer() ? w.at("num_bits").get<std::int64_t>() : 0;
        if (!type.empty() && bits > 0) m.checkpoint_format = fmt::format("compressed-tensors {}{}", type, bits);
      }
    }
  }
}

// transformers' ACT2FN names of the activations moekit computes.
Activation activation_from_config(const Reader& r) {
  const std::string act = r.string_or("hidden_act", "silu");
  if (act == "silu" || act == "swish") return Activation::kSilu;
  if (act == "gelu") return Activation::kGelu;
  if (act == "gelu_pytorch_tanh" || act == "gelu_new" || act == "gelu_tanh") return Activation::kGeluTanh;
  if (act == "relu2") return Activation::kRelu2;
  MOEKIT_FAIL("{}: field 'hidden_act' = '{}' is not a supported MoE activation (silu, gelu, gelu_pytorch_tanh, relu2)",
              r.source, act);
}

// ---- The rows ------------------------------------------------------------------------------------
// Each reads the MoE keys of one family, with transformers' defaults, into `m` (hidden_size,
// num_hidden_layers, quantization_config and the checks common to all are read by the caller).

// DeepseekV3MoE (Kimi-K2 ships DeepSeek-V3's code) and the GLM blocks that copy it: sigmoid scores,
// e_score_correction_bias for selection, groups scored by their top-2 sum, renormalized with
// + 1e-20, times routed_scaling_factor; n_shared_experts x moe_intermediate_size shared MLP. The
// families differ only in their config classes' defaults.
struct NoauxTcDefaults {
  const char* family;
  std::int64_t n_group, topk_group;
  double routed_scaling_factor;
  std::int64_t first_k_dense_replace;
  bool norm_topk_prob = true;
  std::int64_t n_shared_experts = 1;  // < 0: no default (the key is required)
  // > 0: transformers keeps exactly this many dense layers first whatever first_k_dense_replace says
  // (a config that says otherwise is refused: the checkpoint's layers would not be where moekit counts).
  std::int64_t fixed_dense_layers = 0;
};

void read_noaux_tc(const Reader& r, ModelConfig& m, const NoauxTcDefaults& d) {
  m.moe_intermediate_size = r.integer({"moe_intermediate_size"}, 1, limits::kMaxIntermediateSize);
  m.num_experts = r.integer({"n_routed_experts"}, 1, limits::kMaxExperts);
  m.topk = r.integer({"num_experts_per_tok"}, 1, limits::kMaxTopk);
  r.require_string("scoring_func", {"sigmoid"}, fmt::format("{}'s router always scores with a sigmoid", d.family));
  r.require_string("topk_method", {"noaux_tc"}, fmt::format("{}'s router always selects with noaux_tc", d.family));
  m.scoring = Scoring::kSigmoid;
  m.has_score_correction_bias = true;
  m.n_group = r.integer_or({"n_group"}, d.n_group, 1, limits::kMaxExperts);
  m.topk_group = r.integer_or({"topk_group"}, d.topk_group, 1, limits::kMaxExperts);
  m.group_score = GroupScore::kTop2Sum;
  m.norm_topk_prob = r.boolean_or("norm_topk_prob", d.norm_topk_prob);
  m.renormalize_epsilon = 1e-20;
  m.routed_scaling_factor = r.number_or("routed_scaling_factor", d.routed_scaling_factor);
  m.num_shared_experts = d.n_shared_experts < 0
                             ? r.integer({"n_shared_experts"}, 0, limits::kMaxExperts)
                             : r.integer_or({"n_shared_experts"}, d.n_shared_experts, 0, limits::kMaxExperts);
  m.shared_intermediate_size = r.shared_width(m.num_shared_experts, m.moe_intermediate_size);
  m.activation = activation_from_config(r);
  r.require_number("moe_layer_freq", 1, "every layer past first_k_dense_replace is an MoE layer");
  // GLM-5 lists its layers in mlp_layer_types; the others keep the first first_k_dense_replace dense.
  if (const json* types = r.layer_list("mlp_layer_types")) {
    m.num_moe_layers = std::count(types->begin(), types->end(), json("sparse"));
  } else if (d.fixed_dense_layers > 0) {
    const std::int64_t k = r.integer_or({"first_k_dense_replace"}, d.fixed_dense_layers, 0, limits::kMaxLayers);
    MOEKIT_CHECK(k == d.fixed_dense_layers,
                 "{}: field 'first_k_dense_replace' = {}: {}'s transformers code keeps exactly {} dense layer(s) "
                 "first whatever it says; moekit counts the layers as that code builds them",
                 r.source, k, d.family, d.fixed_dense_layers);
    m.num_moe_layers = m.num_layers - d.fixed_dense_layers;
  } else {
    m.num_moe_layers =
        m.num_layers - r.integer_or({"first_k_dense_replace"}, d.first_k_dense_replace, 0, limits::kMaxLayers);
  }
}
void read_deepseek_v3(const Reader& r, ModelConfig& m) {
  read_noaux_tc(r, m, {"DeepSeek-V3", 8, 4, 2.5, 3});
}
// Glm4MoeMoE (GLM-4.5 / 4.6) and GLM-5's glm_moe_dsa (the same block).
void read_glm4_moe(const Reader& r, ModelConfig& m) {
  read_noaux_tc(r, m, {"GLM", 1, 1, 1.0, 1});
}
void read_glm_moe_dsa(const Reader& r, ModelConfig& m) {
  read_noaux_tc(r, m, {"GLM", 1, 1, 2.5, 3});
}
// DeepseekV32MoE: DeepSeek-V3's block and defaults.
void read_deepseek_v32(const Reader& r, ModelConfig& m) {
  read_noaux_tc(r, m, {"DeepSeek-V3.2", 8, 4, 2.5, 3});
}
// Glm4MoeLiteMoE: GLM's block, routed_scaling_factor 1.8 by default, one dense layer first.
void read_glm4_moe_lite(const Reader& r, ModelConfig& m) {
  read_noaux_tc(r, m, {"GLM-4.7-Flash (glm4_moe_lite)", 1, 1, 1.8, 1, true, 1, 1});
}
// Dots1MoE: DeepSeek-V3's block; not renormalized by default, n_shared_experts required (no
// default in Dots1Config), n_group / topk_group null in the released configs (1).
void read_dots1(const Reader& r, ModelConfig& m) {
  read_noaux_tc(r, m, {"dots.llm1", 1, 1, 1.0, 0, false, -1});
}

// DeepseekV2Moe: softmax scores; topk_method greedy (all experts) or group_limited_greedy (groups
// scored by their largest score); never renormalized; times routed_scaling_factor; n_shared_experts
// x moe_intermediate_size shared MLP.
void read_deepseek_v2(const Reader& r, ModelConfig& m) {
  m.moe_intermediate_size = r.integer({"moe_intermediate_size"}, 1, limits::kMaxIntermediateSize);
  m.num_experts = r.integer({"n_routed_experts"}, 1, limits::kMaxExperts);
  m.topk = r.integer({"num_experts_per_tok"}, 1, limits::kMaxTopk);
  r.require_string("scoring_func", {"softmax"}, "DeepSeek-V2's router scores with a softmax");
  m.scoring = Scoring::kSoftmax;
  const std::string method = r.string_or("topk_method", "greedy");
  MOEKIT_CHECK(method == "greedy" || method == "group_limited_greedy",
               "{}: field 'topk_method' = '{}': transformers' DeepseekV2Moe selects with 'greedy' or "
               "'group_limited_greedy' (noaux_tc is DeepSeek-V3's: use model_type deepseek_v3)",
               r.source, method);
  if (method == "group_limited_greedy") {
    m.n_group = r.integer({"n_group"}, 1, limits::kMaxExperts);
    m.topk_group = r.integer({"topk_group"}, 1, limits::kMaxExperts);
    m.group_score = GroupScore::kMax;
  }
  // NOTES: transformers' DeepseekV2Moe never renormalizes; DeepSeek's own code does when
  // norm_topk_prob is true. The two disagree there, so only false is accepted.
  MOEKIT_CHECK(!r.boolean_or("norm_topk_prob", false),
               "{}: field 'norm_topk_prob' = true: transformers' DeepseekV2Moe ignores it (no renormalization) while "
               "DeepSeek's own code renormalizes; set it to false (the released DeepSeek-V2 configs do)",
               r.source);
  m.norm_topk_prob = false;
  m.routed_scaling_factor = r.number_or("routed_scaling_factor", 1.0);
  m.num_shared_experts = r.integer_or({"n_shared_experts"}, 2, 0, limits::kMaxExperts);
  m.shared_intermediate_size = r.shared_width(m.num_shared_experts, m.moe_intermediate_size);
  m.activation = activation_from_config(r);
  r.require_number("moe_layer_freq", 1, "every layer past first_k_dense_replace is an MoE layer");
  m.num_moe_layers = m.num_layers - r.integer_or({"first_k_dense_replace"}, 0, 0, limits::kMaxLayers);
}

// The softmax top-k routers of Qwen2-MoE, Qwen3-MoE and OLMoE: softmax over all experts, the top-k,
// renormalized when norm_topk_prob (default false); no scaling factor.
void read_softmax_topk(const Reader& r, ModelConfig& m, const char* intermediate_key) {
  m.moe_intermediate_size = r.integer({intermediate_key}, 1, limits::kMaxIntermediateSize);
  // transformers 5 writes Qwen3-MoE's count as num_local_experts (its attribute_map); the published
  // configs say num_experts.
  m.num_experts = r.integer({"num_experts", "num_local_experts"}, 1, limits::kMaxExperts);
  m.topk = r.integer({"num_experts_per_tok"}, 1, limits::kMaxTopk);
  m.scoring = Scoring::kSoftmax;
  m.norm_topk_prob = r.boolean_or("norm_topk_prob", false);
  m.activation = activation_from_config(r);
}

// Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock: layers in mlp_only_layers are dense, and a layer
// is sparse when (index + 1) % decoder_sparse_step == 0.
std::int64_t qwen_moe_layers(const Reader& r, std::int64_t num_layers) {
  const std::int64_t step = r.integer_or({"decoder_sparse_step"}, 1, 1, limits::kMaxLayers);
  std::set<std::int64_t> dense;
  if (const json* v = r.layer_list("mlp_only_layers")) {
    for (const json& i : *v) {
      MOEKIT_CHECK(i.is_number_integer(), "{}: field 'mlp_only_layers' must list layer indices, got {}", r.source,
                   plan::brief(i));
      dense.insert(i.get<std::int64_t>());
    }
  }
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < num_layers; ++i) n += !dense.contains(i) && (i + 1) % step == 0;
  return n;
}

void read_qwen3_moe(const Reader& r, ModelConfig& m) {
  read_softmax_topk(r, m, "moe_intermediate_size");
  m.num_moe_layers = qwen_moe_layers(r, m.num_layers);
}

// Qwen2MoeSparseMoeBlock adds one shared MLP of shared_expert_intermediate_size (default 5632) whose
// output is scaled by sigmoid(hidden . shared_expert_gate).
void read_qwen2_moe(const Reader& r, ModelConfig& m) {
  read_softmax_topk(r, m, "moe_intermediate_size");
  m.num_moe_layers = qwen_moe_layers(r, m.num_layers);
  m.shared_intermediate_size =
      r.integer_or({"shared_expert_intermediate_size"}, 5632, 0, limits::kMaxSharedIntermediateSize);
  m.num_shared_experts = m.shared_intermediate_size > 0 ? 1 : 0;
  m.shared_expert_gate = m.num_shared_experts > 0;
}

// Qwen3NextSparseMoeBlock: Qwen2-MoE's block (gated shared expert) with Qwen3-Next's defaults:
// norm_topk_prob true, shared_expert_intermediate_size 512.
void read_qwen3_next(const Reader& r, ModelConfig& m) {
  read_qwen2_moe(r, m);
  m.norm_topk_prob = r.boolean_or("norm_topk_prob", true);
  m.shared_intermediate_size =
      r.integer_or({"shared_expert_intermediate_size"}, 512, 0, limits::kMaxSharedIntermediateSize);
  m.num_shared_experts = m.shared_intermediate_size > 0 ? 1 : 0;
  m.shared_expert_gate = m.num_shared_experts > 0;
}

// OlmoeSparseMoeBlock: every layer is MoE; intermediate_size is the experts' width.
void read_olmoe(const Reader& r, ModelConfig& m) {
  read_softmax_topk(r, m, "intermediate_size");
  m.num_moe_layers = m.num_layers;
}

// FlexOlmoSparseMoeBlock: OLMoE's block.
void read_flex_olmo(const Reader& r, ModelConfig& m) {
  read_olmoe(r, m);
}

// MixtralSparseMoeBlock: softmax, top-k, always renormalized; every layer is MoE. MiniMax-Text-01
// (MiniMaxSparseMoeBlock) and Granite (GraniteMoeMoE: softmax over the top-k logits, the same
// renormalized weights) run the same block under Mixtral's keys.
void read_mixtral_block(const Reader& r, ModelConfig& m, std::initializer_list<const char*> experts_keys) {
  m.moe_intermediate_size = r.integer({"intermediate_size"}, 1, limits::kMaxIntermediateSize);
  m.num_experts = r.integer(experts_keys, 1, limits::kMaxExperts);
  m.topk = r.integer({"num_experts_per_tok"}, 1, limits::kMaxTopk);
  m.scoring = Scoring::kSoftmax;
  m.norm_topk_prob = true;
  m.activation = activation_from_config(r);
  m.num_moe_layers = m.num_layers;
}
void read_mixtral(const Reader& r, ModelConfig& m) {
  read_mixtral_block(r, m, {"num_local_experts"});
}
void read_granitemoe(const Reader& r, ModelConfig& m) {
  read_mixtral_block(r, m, {"num_local_experts"});
  r.require_number("shared_intermediate_size", 0, "GraniteMoeMoE has no shared expert (granitemoeshared's does)");
}
// MiniMaxConfig takes num_experts for num_local_experts.
void read_minimax(const Reader& r, ModelConfig& m) {
  read_mixtral_block(r, m, {"num_local_experts", "num_experts"});
  r.require_number("shared_intermediate_size", 0, "MiniMaxSparseMoeBlock has no shared expert");
}

// JambaSparseMoeBlock: softmax top-k, never renormalized; layer i is MoE when i %
// expert_layer_period == expert_layer_offset (2 and 1 by default).
void read_jamba(const Reader& r, ModelConfig& m) {
  m.moe_intermediate_size = r.integer({"intermediate_size"}, 1, limits::kMaxIntermediateSize);
  m.num_experts = r.integer({"num_experts"}, 1, limits::kMaxExperts);
  m.topk = r.integer({"num_experts_per_tok"}, 1, limits::kMaxTopk);
  m.scoring = Scoring::kSoftmax;
  m.norm_topk_prob = false;
  m.activation = activation_from_config(r);
  const std::int64_t period = r.integer_or({"expert_layer_period"}, 2, 1, limits::kMaxLayers);
  const std::int64_t offset = r.integer_or({"expert_layer_offset"}, 1, 0, limits::kMaxLayers);
  m.num_moe_layers = 0;
  for (std::int64_t i = 0; i < m.num_layers; ++i) m.num_moe_layers += i % period == offset;
}

// GptOssMLP: the top-k of the logits, softmax over those k (the renormalized softmax), experts with
// biases on gate_up_proj and down_proj and the clamped SwiGLU (limit swiglu_limit, alpha swiglu_alpha:
// GptOssExperts' gate * sigmoid(gate * alpha)) over interleaved gate/up columns; hidden_act is not
// read. Every layer is MoE.
void read_gpt_oss(const Reader& r, ModelConfig& m) {
  m.moe_intermediate_size = r.integer({"intermediate_size"}, 1, limits::kMaxIntermediateSize);
  m.num_experts = r.integer({"num_local_experts"}, 1, limits::kMaxExperts);
  m.topk = r.integer({"num_experts_per_tok", "experts_per_token"}, 1, limits::kMaxTopk);
  m.scoring = Scoring::kSoftmax;
  m.norm_topk_prob = true;
  m.activation = Activation::kSwigluOai;
  // Checked as the config's doubles, before they become the floats every device runs.
  const double limit = r.number_or("swiglu_limit", kDefaultSwigluLimit);
  const double alpha = r.number_or("swiglu_alpha", kDefaultSwigluAlpha);
  validate_swiglu(limit, alpha, r.source);
  m.swiglu = {.limit = static_cast<float>(limit), .alpha = static_cast<float>(alpha)};
  m.expert_bias = true;
  m.num_moe_layers = m.num_layers;
}

// Llama4TextMoe weights each token's *input* by its sigmoid router score before the experts; moekit
// weights the experts' outputs (every other family), so the two differ through the activation.
void refuse_llama4(const Reader& r, ModelConfig&) {
  MOEKIT_FAIL(
      "{}: model_type '{}' is not supported: Llama 4's MoE block scales each token's input to the experts by its "
      "router score (moekit scales their outputs, as every supported family does); supported: {}",
      r.source, r.string("model_type"), fmt::join(supported_model_types(), ", "));
}

struct Row {
  ArchitectureInfo info;
  void (*read)(const Reader&, ModelConfig&);
  WeightNames names = WeightNames::kNone;  // how its checkpoints name the MoE block's tensors
};

const std::vector<Row>& rows() {
  static const std::vector<Row> table = {
      {{"deepseek_v3", "DeepseekV3MoE",
        "sigmoid + e_score_correction_bias, groups by top-2 sum, renormalized, scaled; shared experts"},
       read_deepseek_v3,
       WeightNames::kDeepseek},
      {{"kimi_k2", "DeepseekV3MoE", "Kimi-K2 ships DeepSeek-V3's code: the deepseek_v3 row"},
       read_deepseek_v3,
       WeightNames::kDeepseek},
      {{"deepseek_v2", "DeepseekV2Moe",
        "softmax, greedy or group_limited_greedy (groups by max), scaled, never renormalized; shared experts"},
       read_deepseek_v2,
       WeightNames::kDeepseek},
      {{"glm4_moe", "Glm4MoeMoE", "DeepSeek-V3's routing with GLM's defaults; shared experts"},
       read_glm4_moe,
       WeightNames::kDeepseek},
      {{"glm_moe_dsa", "GlmMoeDsaMoE", "GLM-5: the glm4_moe block (routed_scaling_factor 2.5 by default)"},
       read_glm_moe_dsa,
       WeightNames::kDeepseek},
      {{"deepseek_v32", "DeepseekV32MoE", "DeepSeek-V3.2: the deepseek_v3 block and defaults"},
       read_deepseek_v32,
       WeightNames::kDeepseek},
      {{"glm4_moe_lite", "Glm4MoeLiteMoE", "the glm4_moe block, routed_scaling_factor 1.8, one dense layer first"},
       read_glm4_moe_lite,
       WeightNames::kDeepseek},
      {{"dots1", "Dots1MoE", "the deepseek_v3 block; not renormalized unless norm_topk_prob"},
       read_dots1,
       WeightNames::kDeepseek},
      {{"qwen2_moe", "Qwen2MoeSparseMoeBlock", "softmax top-k (norm_topk_prob); a shared expert behind a sigmoid gate"},
       read_qwen2_moe,
       WeightNames::kQwen},
      {{"qwen3_next", "Qwen3NextSparseMoeBlock",
        "the qwen2_moe block (gated shared expert), norm_topk_prob true by default"},
       read_qwen3_next,
       WeightNames::kQwen},
      {{"qwen3_moe", "Qwen3MoeSparseMoeBlock", "softmax top-k (norm_topk_prob)"}, read_qwen3_moe, WeightNames::kQwen},
      {{"olmoe", "OlmoeSparseMoeBlock", "softmax top-k (norm_topk_prob)"}, read_olmoe, WeightNames::kQwen},
      {{"flex_olmo", "FlexOlmoSparseMoeBlock", "the olmoe block"}, read_flex_olmo, WeightNames::kQwen},
      {{"mixtral", "MixtralSparseMoeBlock", "softmax top-k, always renormalized"}, read_mixtral, WeightNames::kMixtral},
      {{"minimax", "MiniMaxSparseMoeBlock", "the mixtral block (MiniMax-Text-01)"},
       read_minimax,
       WeightNames::kMixtral},
      {{"granitemoe", "GraniteMoeMoE", "the mixtral block: softmax over the top-k logits"},
       read_granitemoe,
       WeightNames::kGranite},
      {{"jamba", "JambaSparseMoeBlock", "softmax top-k, never renormalized"}, read_jamba, WeightNames::kJamba},
      {{"gpt_oss", "GptOssMLP",
        "softmax over the top-k logits; expert biases; clamped SwiGLU (swiglu_limit, swiglu_alpha)"},
       read_gpt_oss,
       WeightNames::kGptOss},
      {{"llama4_text", "Llama4TextMoe", "refused: the router weights the experts' input"}, refuse_llama4},
      {{"llama4", "Llama4TextMoe", "refused: the router weights the experts' input"}, refuse_llama4},
  };
  return table;
}

}  // namespace

std::string_view group_score_name(GroupScore rule) {
  return rule == GroupScore::kMax ? "max" : "top-2 sum";
}

const std::vector<ArchitectureInfo>& supported_architectures() {
  static const std::vector<ArchitectureInfo> infos = [] {
    std::vector<ArchitectureInfo> v;
    for (const Row& r : rows()) v.push_back(r.info);
    return v;
  }();
  return infos;
}

std::vector<std::string> supported_model_types() {
  std::vector<std::string> names;
  for (const Row& r : rows())
    if (r.read != refuse_llama4) names.emplace_back(r.info.model_type);
  return names;
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name) {
  const json doc = plan::parse_json(json_text, source_name);
  MOEKIT_CHECK(doc.is_object(), "{}: a config.json must hold a JSON object, got {}", source_name, doc.type_name());
  const Reader r{doc, source_name};

  ModelConfig m;
  m.name = source_name;
  m.model_type = r.string("model_type");
  const auto row =
      std::find_if(rows().begin(), rows().end(), [&](const Row& x) { return x.info.model_type == m.model_type; });
  MOEKIT_CHECK(row != rows().end(),
               "{}: model_type '{}' is not in moekit's architecture table, so how its MoE block routes and what it "
               "computes is unknown; supported: {}",
               source_name, m.model_type, fmt::join(supported_model_types(), ", "));
  m.moe_block = row->info.moe_block;
  m.hidden_size = r.integer({"hidden_size"}, 1, limits::kMaxHiddenSize);
  m.num_layers = r.integer({"num_hidden_layers"}, 1, limits::kMaxLayers);
  row->read(r, m);
  m.weight_names = row->names;
  read_quantization(r, m);

  MOEKIT_CHECK(m.num_moe_layers >= 1, "{}: {} layers leave no MoE layer", source_name, m.num_layers);
  MOEKIT_CHECK(m.topk <= m.num_experts, "{}: num_experts_per_tok = {} exceeds the {} routed experts", source_name,
               m.topk, m.num_experts);
  MOEKIT_CHECK(m.num_experts % m.n_group == 0, "{}: n_group = {} must divide the {} routed experts", source_name,
               m.n_group, m.num_experts);
  MOEKIT_CHECK(m.topk_group <= m.n_group, "{}: topk_group = {} exceeds n_group = {}", source_name, m.topk_group,
               m.n_group);
  MOEKIT_CHECK(m.topk <= m.topk_group * (m.num_experts / m.n_group),
               "{}: num_experts_per_tok = {} exceeds the {} experts of the topk_group = {} chosen groups", source_name,
               m.topk, m.topk_group * (m.num_experts / m.n_group), m.topk_group);
  MOEKIT_CHECK(std::isfinite(m.routed_scaling_factor) && m.routed_scaling_factor > 0,
               "{}: routed_scaling_factor = {} must be finite and positive", source_name, m.routed_scaling_factor);
  return m;
}

}  // namespace moekit
