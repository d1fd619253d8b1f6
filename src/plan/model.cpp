// Loading a model's config.json (a preset or a path) and choosing its FP8 scheme. What the keys mean
// is the architecture table's (plan/architectures.cpp).
#include <fmt/ranges.h>
#include <algorithm>
#include <filesystem>

#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/model.h"
#include "moekit/recipe.h"
#include "plan/model_presets.h"
#include "plan/untrusted_input.h"

namespace moekit {
ModelConfig load_model_config_file(const std::string& path) {
  MOEKIT_CHECK(plan::path_exists(path), "cannot read model config '{}': no such file (presets: {})", path,
               fmt::join(model_preset_names(), ", "));
  return parse_model_config(plan::read_regular_file(path, limits::kMaxConfigBytes, "config.json"), path);
}

QuantChoice choose_quant(const ModelConfig& m, std::string_view name) {
  const std::string from = m.checkpoint_format.empty()
                               ? "the checkpoint is unquantized"
                               : fmt::format("the checkpoint's quantization_config is {}", m.checkpoint_format);
  if (name.empty() || name == "auto") {
    if (m.checkpoint_quant) return {*m.checkpoint_quant, fmt::format("{} ({})", quant_name(*m.checkpoint_quant), from)};
    if (m.checkpoint_format.empty()) {
      const QuantScheme own = unquantized_checkpoint_quant(m.checkpoint_dtype);
      return {own, fmt::format("{} ({}{})", quant_name(own), from,
                               m.checkpoint_dtype.empty() ? "" : fmt::format(", torch_dtype {}", m.checkpoint_dtype))};
    }
    return {kUnrunFormatQuant, fmt::format("{} FP8 planned instead: {}, a format moekit does not run",
                                           quant_name(kUnrunFormatQuant), from)};
  }
  const QuantScheme q = parse_quant(name);
  if (!m.checkpoint_format.empty() && !has_weight_scales(recipe_info(q)))
    return {q, fmt::format("{} as asked; {}: moekit does not dequantize it into {} (not exact), so a load of the "
                           "checkpoint refuses this; seeded synthetic weights run it",
                           quant_name(q), from, dtype_name(recipe_info(q).weight_dtype))};
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
