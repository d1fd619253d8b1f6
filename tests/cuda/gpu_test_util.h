// Helpers of the GPU tests: skip without a device, a model's experts problem, the batched experts'
// inputs built on the host (seeded random tokens quantized per scheme, NaN in every padding row),
// m_e patterns.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cpu/quant.h"
#include "cuda/backend.h"
#include "moekit/model.h"
#include "moekit/problem.h"
#include "moekit/recipe.h"
#include "synthetic/random.h"

#define MOEKIT_REQUIRE_GPU()                                            \
  do {                                                                  \
    if (!::moekit::cuda::available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace moekit::testing {

// One GPU's experts problem of a model's shapes: E_local experts of up to M rows (batched), or M
// tokens' rows in one slab (standard); the model's activation unless one is given.
inline MoeProblem problem_for(const std::string& model_name, std::int64_t E_local, std::int64_t M, QuantScheme quant,
                              std::optional<Activation> activation = std::nullopt, bool fuse_w1 = false,
                              ActivationFormat format = ActivationFormat::kBatchedExperts) {
  const ModelConfig m = load_model(model_name);
  MoeProblem p;
  p.format = format;
  p.M = M;
  p.K = m.hidden_size;
  p.activation = activation.value_or(m.activation);
  p.N = is_gated(p.activation) ? 2 * m.moe_intermediate_size : m.moe_intermediate_size;
  p.topk = m.topk;
  p.E = m.num_experts;
  p.E_local = E_local;
  p.quant = quant;
  p.max_tokens_per_rank = M;
  p.num_dispatchers = 1;
  p.fuse_w1 = fuse_w1;
  validate_problem(p);
  return p;
}

struct BatchedInputs {
  std::vector<std::uint8_t> a1q;  // (E_local, M, K) FP8 codes or bf16 values (bytes), padding rows NaN
  std::vector<float> a1q_scale;   // per plan shape, padding NaN
  std::vector<std::int32_t> expert_num_tokens;
};

// Tokens drawn per (expert, row) from the seed, quantized row by row (per-tensor: per expert).
inline BatchedInputs make_batched_inputs(const MoeProblem& p, const std::vector<std::int32_t>& counts,
                                         std::uint64_t seed) {
  BatchedInputs in;
  const std::int64_t K = p.K, M = p.M;
  in.expert_num_tokens = counts;
  // The recipe's operand: FP8 codes (NaN 0x7F) or bf16 values (2 bytes each, NaN 0xFFFF).
  const std::int64_t ab = dtype_size(recipe_info(p.quant).activation_dtype);
  in.a1q.assign(static_cast<std::size_t>(p.E_local * M * K * ab), ab == 1 ? 0x7F : 0xFF);
  const std::int64_t spr = numerics::activation_scales_per_row(p.quant, K);
  const std::size_t scale_count =
      static_cast<std::size_t>(p.quant == QuantScheme::kPerTensor ? p.E_local : p.E_local * M * spr);
  in.a1q_scale.assign(scale_count, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> x;
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = std::clamp<std::int64_t>(counts[static_cast<std::size_t>(e)], 0, M);
    if (m == 0) continue;
    x.resize(static_cast<std::size_t>(m * K));
    synthetic::SplitMix rng = synthetic::stream(seed, synthetic::Purpose::kExpertTokens, static_cast<std::uint64_t>(e));
    for (std::int64_t r = 0; r < m; ++r) {
      const float row_scale = 0.25f + static_cast<float>(r % 7);  // rows of different magnitudes
      for (std::int64_t c = 0; c < K; ++c) x[static_cast<std::size_t>(r * K + c)] = row_scale * rng.normal();
    }
    float* scales = p.quant == QuantScheme::kPerTensor ? in.a1q_scale.data() + e : in.a1q_scale.data() + e * M * spr;
    cpu::store_activation(p.quant, x.data(), m, K, K, in.a1q.data() + e * M * K * ab, K, scales);
  }
  return in;
}

inline std::vector<std::int32_t> pattern_counts(const std::string& pattern, std::int64_t E_local, std::int64_t M,
                                                std::uint64_t seed) {
  std::vector<std::int32_t> c(static_cast<std::size_t>(E_local), 0);
  synthetic::SplitMix rng = synthetic::stream(seed, synthetic::Purpose::kExpertCounts, 0);
  for (std::int64_t e = 0; e < E_local; ++e) {
    const auto ue = static_cast<std::size_t>(e);
    if (pattern == "zero")
      c[ue] = 0;
    else if (pattern == "one_full")
      c[ue] = e == 1 ? static_cast<std::int32_t>(M) : 0;
    else if (pattern == "uniform")
      c[ue] = static_cast<std::int32_t>(M / 2);
    else if (pattern == "skew")
      c[ue] = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(M + 1));
    else if (pattern == "ragged") {
      const std::int32_t odd[] = {1, 37, 129, 255, 7, 200};
      c[ue] = std::min<std::int32_t>(odd[e % 6], static_cast<std::int32_t>(M));
    } else if (pattern == "tails") {
      // Either side of a 128-row token tile's half: the block GEMM's last tile of a group is a half
      // tile when it holds <= 64 of the group's rows (193: 65 rows, full; 129: 1 row, half; 64: half).
      const std::int32_t edge[] = {193, 64, 129, 65, 192, 1, 128, 63};
      c[ue] = std::min<std::int32_t>(edge[e % 8], static_cast<std::int32_t>(M));
    }
  }
  return c;
}

}  // namespace moekit::testing
