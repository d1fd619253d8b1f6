// A model's MoE description, read from a Hugging Face config.json (presets in models/, embedded
// at build time), and the parallel layout it is deployed with.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/types.h"

namespace moekit {

enum class Scoring : std::uint8_t { kSoftmax, kSigmoid };

struct ModelConfig {
  std::string name;                        // preset name or file path it was read from
  std::string model_type;                  // config.json "model_type"
  std::int64_t hidden_size = 0;            // K
  std::int64_t moe_intermediate_size = 0;  // I
  std::int64_t num_experts = 0;            // E (routed)
  std::int64_t topk = 0;
  std::int64_t num_shared_experts = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_moe_layers = 0;
  Activation activation = Activation::kSilu;
  Scoring scoring = Scoring::kSoftmax;
  bool norm_topk_prob = true;
  bool has_score_correction_bias = false;  // DeepSeek-V3 `noaux_tc`: e_score_correction_bias
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  // How the checkpoint stores its weights (config.json "quantization_config"; empty: unquantized).
  // checkpoint_quant is the FP8 scheme moekit runs those weights with: `fp8` with weight_block_size
  // [128, 128] is block128 (DeepSeek-V3, Kimi-K2), `fp8` without blocks per-token (per-tensor for a
  // static activation scheme); none for a format moekit does not run (mxfp4, int4, ...).
  std::string checkpoint_format;
  std::optional<QuantScheme> checkpoint_quant;

  std::int64_t N() const { return is_gated(activation) ? 2 * moe_intermediate_size : moe_intermediate_size; }
};

// Reads a Hugging Face config.json. A missing or malformed field raises moekit::Error naming the
// field and the file.
ModelConfig load_model_config_file(const std::string& path);
ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name);
// `name_or_path`: a preset name (deepseek-v3, kimi-k2, qwen3-30b-a3b, qwen3-235b-a22b,
// mixtral-8x7b, gpt-oss-120b) or a path to a config.json.
ModelConfig load_model(const std::string& name_or_path);
std::vector<std::string> model_preset_names();

// The FP8 scheme a layer of `model` runs: `name` (per-tensor, per-token, block128), or for "auto"
// (and "") the checkpoint's own scheme, per-token when the checkpoint is unquantized or in a format
// moekit does not run. `note` says where the choice came from, naming a checkpoint format moekit
// does not run or a scheme that differs from the checkpoint's (its weights would be requantized).
struct QuantChoice {
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  std::string note;
};
QuantChoice choose_quant(const ModelConfig& model, std::string_view name);

// How the layer is spread over GPUs. Every rank dispatches to every rank's experts, so the
// number of dispatchers D is dp; E_local is E / ep unless given (EPLB redundant experts).
struct ParallelConfig {
  std::int64_t dp = 1;
  std::int64_t ep = 1;
  std::int64_t max_tokens_per_rank = 0;
  std::int64_t local_experts = 0;  // 0: E / ep
};

}  // namespace moekit
