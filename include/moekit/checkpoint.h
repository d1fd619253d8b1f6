// Hugging Face checkpoints in, layer weights out. A checkpoint directory (config.json and
// model.safetensors, or shards named by model.safetensors.index.json) is read as untrusted input
// (the safetensors headers and the index are checked; src/checkpoint/), memory-mapped, and only the
// tensors a rank asks for are touched: its experts of each layer, the router, the shared experts.
//
// The family's tensor names come from the architecture table (ModelConfig::weight_names). Weights
// are arranged once, at load, into the layout of moekit/weights.h for a problem (its scheme, its
// activation's W1 rows, its E_local experts from first_expert):
//   - FP8 e4m3 weights whose scales (weight_scale_inv, or compressed-tensors' weight_scale) have the
//     problem's granularity (128x128 blocks for block128, one per row for per-token) load as stored:
//     codes and scales moved, never re-rounded;
//   - bf16, fp16 and fp32 weights, and FP8 weights of another granularity (dequantized first), are
//     quantized at load by cpu::quantize_weight, the one quantizer the tests and the synthetic
//     weights use (what was done is in CheckpointLayer::note);
//   - MXFP4 (gpt-oss's *_blocks / *_scales) and packed int4 are refused by name; FP8 weights under a
//     config.json without quantization_config are refused (the two disagree).
// A load checks every tensor's header against the config before it sizes a buffer, the bytes it will
// allocate against the host's memory (moekit/limits.h), and every value it reads: weights finite (no
// NaN or Inf, no FP8 NaN code), scales finite and > 0, the first bad element an Error naming the
// shard, the tensor and the element. The scan is integer tests at memory speed, a small share of a
// load's time (measured in docs/FEATURES.md), so it has no switch.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moekit/layer.h"
#include "moekit/memory.h"
#include "moekit/model.h"
#include "moekit/problem.h"
#include "moekit/weights.h"

namespace moekit {

// One MoE layer's weights for one rank, on the host.
struct CheckpointLayer {
  std::int64_t layer = 0;                           // the model's layer number (model.layers.L)
  HostExpertWeights experts;                        // the rank's E_local routed experts
  std::optional<HostExpertWeights> shared_experts;  // one expert of shared_experts_problem
  std::vector<std::uint16_t> shared_expert_gate;    // (K) bf16: Qwen2-MoE's gate; else empty
  std::vector<float> e_score_correction_bias;       // (E) when the model routes with one; else empty
  std::vector<float> router_weight;                 // (E, K): the router's linear layer
  std::vector<float> router_bias;                   // (E): gpt-oss's router bias; else empty
  std::string note;                                 // how the routed experts were stored and what loading did to them

  // The layer's weights on the device of `copies` (which holds the device copies).
  LayerWeights view(DeviceCopies& copies) const;
  // Router logits (num_tokens, E) of bf16 hidden rows (num_tokens, K): hidden . router_weight^T
  // (+ router_bias), summed in fp32 (the model computes them before the MoE block; moekit takes them
  // as an input).
  std::vector<float> router_logits(const std::uint16_t* hidden, std::int64_t num_tokens) const;
};

class Checkpoint {
 public:
  // Reads config.json through the architecture table and the checkpoint's index; opens no shard yet.
  // Raises moekit::Error for a directory that is not a Hugging Face checkpoint, naming the file.
  // num_threads: the threads a load reads, checks and quantizes on (0: the machine's hardware threads).
  explicit Checkpoint(const std::string& dir, int num_threads = 0);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::string& dir() const;
  const ModelConfig& model() const;
  // The model's layers that hold an MoE block, found from the tensor names (ascending; layers at or
  // past num_hidden_layers, e.g. DeepSeek-V3's multi-token-prediction layer, are not the model's).
  const std::vector<std::int64_t>& moe_layers() const;

  // Layer `layer`'s weights for `problem` (a problem of this model: K, I, E, activation and scheme)
  // on the rank holding experts [first_expert, first_expert + problem.E_local); the shared experts
  // when `shared_experts` and the model has them. Each tensor's dtype and shape are checked against
  // the config, each violation an Error naming the tensor.
  CheckpointLayer load_layer(std::int64_t layer, const MoeProblem& problem, std::int64_t first_expert,
                             bool shared_experts = true);
  // Redundant experts (moekit/placement.h): this rank's slots, slot j holding the model's expert
  // slot_experts[j] (a placement's physical_to_logical from rank * E_local, E_local of them); the
  // weights' first_expert is -1.
  CheckpointLayer load_layer(std::int64_t layer, const MoeProblem& problem, std::span<const std::int32_t> slot_experts,
                             bool shared_experts = true);
  // Every MoE layer's tensors for all experts checked from the shards' headers as a load would check
  // them (names, dtypes, shapes, scale layouts, the config's quantization_config), no tensor data read
  // and nothing allocated: what `moekit plan --checkpoint` runs, so that it refuses what `run` would.
  void check_headers(bool shared_experts = true);
  // The shard files read so far.
  std::vector<std::string> opened_shards() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit
