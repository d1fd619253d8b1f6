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
// How a group of experts is scored for group-limited routing: the sum of its two largest selection
// scores (DeepSeek-V3 noaux_tc, GLM-4.5) or its largest one (DeepSeek-V2 group_limited_greedy).
enum class GroupScore : std::uint8_t { kTop2Sum, kMax };
std::string_view group_score_name(GroupScore rule);

// A model's MoE block as its own code (Hugging Face transformers' modeling file) computes it, read
// through the architecture table (src/plan/architectures.cpp): one row per supported model_type,
// the only place that knows which config keys a family reads and transformers' default for each.
// How a family's Hugging Face checkpoints name its MoE block's tensors (model.layers.L. + ...):
//   kDeepseek  mlp.experts.e.{gate,up,down}_proj.weight, mlp.gate.weight (+ e_score_correction_bias),
//              mlp.shared_experts.{gate,up,down}_proj.weight
//   kQwen      mlp.experts.e.{gate,up,down}_proj.weight, mlp.gate.weight,
//              mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight
//   kMixtral   block_sparse_moe.experts.e.{w1,w3,w2}.weight, block_sparse_moe.gate.weight
//   kGptOss    mlp.experts.{gate_up_proj,down_proj}[_bias] (transposed: K first), mlp.router.{weight,bias}
//   kNone      not read by moekit's checkpoint loader (the family's names are not in the table)
// The first three also load transformers' fused in-memory form, mlp.experts.gate_up_proj (E, 2I, K)
// and mlp.experts.down_proj (E, K, I).
enum class WeightNames : std::uint8_t { kNone, kDeepseek, kQwen, kMixtral, kGptOss, kGranite, kJamba };

struct ModelConfig {
  std::string name;                        // preset name or file path it was read from
  std::string model_type;                  // config.json "model_type"
  std::string moe_block;                   // transformers' MoE block class the row follows (tests/parity)
  std::int64_t hidden_size = 0;            // K
  std::int64_t moe_intermediate_size = 0;  // I
  std::int64_t num_experts = 0;            // E (routed)
  std::int64_t topk = 0;
  std::int64_t num_shared_experts = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_moe_layers = 0;
  Activation activation = Activation::kSilu;
  SwigluOaiParams swiglu;  // swigluoai's clamp and alpha (gpt-oss's config.swiglu_limit, swiglu_alpha)
  // Routing (moekit/router.h runs exactly these).
  Scoring scoring = Scoring::kSoftmax;
  bool norm_topk_prob = true;              // renormalize the chosen weights to sum 1
  double renormalize_epsilon = 0.0;        // added to that sum (DeepSeek-V3 / GLM: 1e-20)
  bool has_score_correction_bias = false;  // e_score_correction_bias, added to the scores for selection only
  std::int64_t n_group = 1;                // group-limited routing when > 1
  std::int64_t topk_group = 1;
  GroupScore group_score = GroupScore::kTop2Sum;
  double routed_scaling_factor = 1.0;  // every routed weight times this, after renormalization
  // Experts beyond the routed GEMMs.
  bool expert_bias = false;  // fp32 biases on W1 (N per expert) and W2 (K per expert): gpt-oss
  // Shared experts: one MLP of this intermediate size over every token (a family's several shared
  // experts are one wider MLP), added to the routed output; 0: none.
  std::int64_t shared_intermediate_size = 0;
  bool shared_expert_gate = false;  // Qwen2-MoE: the shared output times sigmoid(hidden . w_gate)
  // How the checkpoint stores its weights (config.json "quantization_config"; empty: unquantized).
  // checkpoint_quant is the FP8 scheme moekit runs those weights with: `fp8` with weight_block_size
  // [128, 128] is block128 (DeepSeek-V3, Kimi-K2), `fp8` without blocks per-token (per-tensor for a
  // static activation scheme), `mxfp4` (gpt-oss) per-token, converted exactly at load; none for a
  // format moekit does not run (int4, ...).
  std::string checkpoint_format;
  std::optional<QuantScheme> checkpoint_quant;
  // config.json's torch_dtype (transformers' newer "dtype"): "float16", "bfloat16", "float32"; empty
  // when absent. An unquantized checkpoint's own recipe follows it (unquantized_checkpoint_quant).
  std::string checkpoint_dtype;
  WeightNames weight_names = WeightNames::kNone;

  std::int64_t N() const { return is_gated(activation) ? 2 * moe_intermediate_size : moe_intermediate_size; }
};

// Reads a Hugging Face config.json through the architecture table. An unknown model_type, a missing
// or malformed field, or a value moekit cannot honor raises moekit::Error naming the key, the value
// and the file: never a default that changes the math.
ModelConfig load_model_config_file(const std::string& path);
ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name);
// `name_or_path`: a preset name (deepseek-v3, kimi-k2, qwen3-30b-a3b, qwen3-235b-a22b,
// mixtral-8x7b, gpt-oss-120b) or a path to a config.json.
ModelConfig load_model(const std::string& name_or_path);
std::vector<std::string> model_preset_names();

// The architecture table's rows, for listings and docs: model_type, transformers' MoE block class,
// and a line on what the row reads and refuses.
struct ArchitectureInfo {
  std::string_view model_type;
  std::string_view moe_block;
  std::string_view summary;
};
const std::vector<ArchitectureInfo>& supported_architectures();
std::vector<std::string> supported_model_types();  // the rows moekit runs (not the refused ones)

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
