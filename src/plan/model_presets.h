// Model presets: models/*.json embedded at build time (cmake/embed_models.cmake).
#pragma once

#include <string>
#include <vector>

namespace moekit::detail {

struct ModelPreset {
  const char* name;  // file name without .json, e.g. "deepseek-v3"
  const char* json;
};
const std::vector<ModelPreset>& model_presets();

}  // namespace moekit::detail
