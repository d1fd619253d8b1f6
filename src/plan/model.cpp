// Reads a model's MoE description from a Hugging Face config.json with nlohmann-json. Field names
// differ between families (DeepSeek: n_routed_experts, Qwen3: num_experts, Mixtral/gpt-oss:
// num_local_experts); the first one present wins. Every failure names the field and the file.
#include <fmt/ranges.h>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moekit/check.h"
#include "moekit/model.h"
#include "plan/model_presets.h"

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

  std::int64_t integer(std::initializer_list<const char*> names, std::int64_t min_value) const {
    const json* v = find(names);
    MOEKIT_CHECK(v != nullptr, "{}: missing field {} (an integer >= {})", source, joined(names), min_value);
    MOEKIT_CHECK(v->is_number_integer(), "{}: field {} must be an integer, got {}", source, joined(names), v->dump());
    const auto value = v->get<std::int64_t>();
    MOEKIT_CHECK(value >= min_value, "{}: field {} = {} must be >= {}", source, joined(names), value, min_value);
    return value;
  }

  std::int64_t integer_or(std::initializer_list<const char*> names, std::int64_t fallback,
                          std::int64_t min_value) const {
    return find(names) ? integer(names, min_value) : fallback;
  }

  double number_or(const char* name, double fallback) const {
    const json* v = find({name});
    if (!v) return fallback;
    MOEKIT_CHECK(v->is_number(), "{}: field '{}' must be a number, got {}", source, name, v->dump());
    return v->get<double>();
  }

  bool boolean_or(const char* name, bool fallback) const {
    const json* v = find({name});
    if (!v) return fallback;
    MOEKIT_CHECK(v->is_boolean(), "{}: field '{}' must be true or false, got {}", source, name, v->dump());
    return v->get<bool>();
  }

  std::string string(const char* name) const {
    const json* v = find({name});
    MOEKIT_CHECK(v != nullptr, "{}: missing field '{}' (a string)", source, name);
    MOEKIT_CHECK(v->is_string(), "{}: field '{}' must be a string, got {}", source, name, v->dump());
    return v->get<std::string>();
  }

  std::string string_or(const char* name, const std::string& fallback) const {
    return find({name}) ? string(name) : fallback;
  }
};

// The checkpoint's quantization_config: its format in words and the FP8 scheme moekit runs it with.
void read_quantization(const Reader& r, ModelConfig& m) {
  const json* q = r.find({"quantization_config"});
  if (q == nullptr) return;
  MOEKIT_CHECK(q->is_object(), "{}: field 'quantization_config' must be an object, got {}", r.source, q->dump());
  const Reader qr{*q, r.source};
  const std::string method = qr.string("quant_method");
  m.checkpoint_format = method;
  if (method == "fp8") {
    if (const json* b = qr.find({"weight_block_size"})) {
      MOEKIT_CHECK(b->is_array() && b->size() == 2 && (*b)[0].is_number_integer() && (*b)[1].is_number_integer(),
                   "{}: quantization_config.weight_block_size must be two integers, got {}", r.source, b->dump());
      const auto rows = (*b)[0].get<std::int64_t>(), cols = (*b)[1].get<std::int64_t>();
      m.checkpoint_format = fmt::format("fp8, weight_block_size [{}, {}]", rows, cols);
      if (rows == kQuantBlock && cols == kQuantBlock) m.checkpoint_quant = QuantScheme::kBlock128;
      return;  // other block sizes: not run
    }
    const bool is_static = qr.string_or("activation_scheme", "dynamic") == "static";
    m.checkpoint_format = is_static ? "fp8, static activation scales" : "fp8, per-channel weights";
    m.checkpoint_quant = is_static ? QuantScheme::kPerTensor : QuantScheme::kPerTokenPerChannel;
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

Activation activation_from_config(const Reader& r, const std::string& model_type) {
  // gpt-oss's experts use a clamped SwiGLU with alpha 1.702 and (up + 1); its config says so only
  // through its model type.
  if (model_type == "gpt_oss") return Activation::kSwigluOai;
  const std::string act = r.string_or("hidden_act", "silu");
  if (act == "silu" || act == "swish") return Activation::kSilu;
  if (act == "gelu") return Activation::kGelu;
  if (act == "gelu_pytorch_tanh" || act == "gelu_new" || act == "gelu_tanh") return Activation::kGeluTanh;
  if (act == "relu2") return Activation::kRelu2;
  MOEKIT_FAIL("{}: field 'hidden_act' = '{}' is not a supported MoE activation (silu, gelu, gelu_pytorch_tanh, relu2)",
              r.source, act);
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::parse_error& e) {
    MOEKIT_FAIL("{}: not valid JSON ({}); pass a Hugging Face config.json", source_name, e.what());
  }
  MOEKIT_CHECK(doc.is_object(), "{}: a config.json must hold a JSON object, got {}", source_name, doc.type_name());
  const Reader r{doc, source_name};

  ModelConfig m;
  m.name = source_name;
  m.model_type = r.string("model_type");
  m.hidden_size = r.integer({"hidden_size"}, 1);
  m.moe_intermediate_size = r.integer({"moe_intermediate_size", "intermediate_size"}, 1);
  m.num_experts = r.integer({"n_routed_experts", "num_experts", "num_local_experts"}, 1);
  m.topk = r.integer({"num_experts_per_tok", "experts_per_token"}, 1);
  m.num_shared_experts = r.integer_or({"n_shared_experts"}, 0, 0);
  m.num_layers = r.integer({"num_hidden_layers"}, 1);
  m.activation = activation_from_config(r, m.model_type);
  read_quantization(r, m);

  const std::string scoring = r.string_or("scoring_func", "softmax");
  MOEKIT_CHECK(scoring == "softmax" || scoring == "sigmoid",
               "{}: field 'scoring_func' = '{}' must be 'softmax' or 'sigmoid'", source_name, scoring);
  m.scoring = scoring == "sigmoid" ? Scoring::kSigmoid : Scoring::kSoftmax;
  m.norm_topk_prob = r.boolean_or("norm_topk_prob", true);
  m.has_score_correction_bias = r.string_or("topk_method", "") == "noaux_tc";
  m.n_group = r.integer_or({"n_group"}, 1, 1);
  m.topk_group = r.integer_or({"topk_group"}, 1, 1);
  m.routed_scaling_factor = r.number_or("routed_scaling_factor", 1.0);

  // MoE layers: DeepSeek keeps its first `first_k_dense_replace` layers dense; Qwen3 lists dense
  // layers in `mlp_only_layers`; the others are MoE throughout.
  const std::int64_t dense = r.integer_or({"first_k_dense_replace"}, 0, 0);
  std::int64_t mlp_only = 0;
  if (const json* v = r.find({"mlp_only_layers"})) {
    MOEKIT_CHECK(v->is_array(), "{}: field 'mlp_only_layers' must be a list, got {}", source_name, v->dump());
    mlp_only = static_cast<std::int64_t>(v->size());
  }
  m.num_moe_layers = m.num_layers - dense - mlp_only;

  MOEKIT_CHECK(m.num_moe_layers >= 1, "{}: {} layers with {} dense leaves no MoE layer", source_name, m.num_layers,
               dense + mlp_only);
  MOEKIT_CHECK(m.topk <= m.num_experts, "{}: num_experts_per_tok = {} exceeds the {} routed experts", source_name,
               m.topk, m.num_experts);
  MOEKIT_CHECK(m.num_experts % m.n_group == 0, "{}: n_group = {} must divide the {} routed experts", source_name,
               m.n_group, m.num_experts);
  MOEKIT_CHECK(m.topk_group <= m.n_group, "{}: topk_group = {} exceeds n_group = {}", source_name, m.topk_group,
               m.n_group);
  MOEKIT_CHECK(m.topk <= m.topk_group * (m.num_experts / m.n_group),
               "{}: num_experts_per_tok = {} exceeds the {} experts of the topk_group = {} chosen groups", source_name,
               m.topk, m.topk_group * (m.num_experts / m.n_group), m.topk_group);
  MOEKIT_CHECK(m.routed_scaling_factor > 0, "{}: routed_scaling_factor = {} must be positive", source_name,
               m.routed_scaling_factor);
  return m;
}

ModelConfig load_model_config_file(const std::string& path) {
  std::ifstream in(path);
  MOEKIT_CHECK(in.good(), "cannot read model config '{}': no such file or not readable (presets: {})", path,
               fmt::join(model_preset_names(), ", "));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_model_config(ss.str(), path);
}

QuantChoice choose_quant(const ModelConfig& m, std::string_view name) {
  const std::string from = m.checkpoint_format.empty()
                               ? "the checkpoint is unquantized"
                               : fmt::format("the checkpoint's quantization_config is {}", m.checkpoint_format);
  if (name.empty() || name == "auto") {
    if (m.checkpoint_quant) return {*m.checkpoint_quant, fmt::format("{} ({})", quant_name(*m.checkpoint_quant), from)};
    if (m.checkpoint_format.empty()) return {QuantScheme::kPerTokenPerChannel, fmt::format("per-token ({})", from)};
    return {QuantScheme::kPerTokenPerChannel,
            fmt::format("per-token FP8 planned instead: {}, a format moekit does not run", from)};
  }
  const QuantScheme q = parse_quant(name);
  if (m.checkpoint_quant && q != *m.checkpoint_quant)
    return {q, fmt::format("{} as asked; {}: its weights would be requantized", quant_name(q), from)};
  if (!m.checkpoint_quant && !m.checkpoint_format.empty())
    return {q, fmt::format("{} as asked; {}, a format moekit does not run", quant_name(q), from)};
  return {q, fmt::format("{} ({})", quant_name(q), from)};
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : detail::model_presets()) names.emplace_back(p.name);
  std::sort(names.begin(), names.end());
  return names;
}

ModelConfig load_model(const std::string& name_or_path) {
  std::string key = name_or_path;
  std::transform(key.begin(), key.end(), key.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const auto& p : detail::model_presets()) {
    if (key == p.name) {
      ModelConfig m = parse_model_config(p.json, std::string("models/") + p.name + ".json");
      m.name = p.name;
      return m;
    }
  }
  const bool looks_like_path = name_or_path.find('/') != std::string::npos || name_or_path.ends_with(".json");
  MOEKIT_CHECK(looks_like_path || std::filesystem::exists(name_or_path),
               "unknown model '{}': pass a preset ({}) or a path to a config.json", name_or_path,
               fmt::join(model_preset_names(), ", "));
  return load_model_config_file(name_or_path);
}

}  // namespace moekit
