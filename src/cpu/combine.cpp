// The CPU combine (cpu/combine.h).
#include "cpu/combine.h"

#include <algorithm>
#include <vector>

namespace moekit::cpu {

using namespace numerics;

namespace {

// acc[0, K) = sum over slots k in order of w[t,k] * y(t,k), fp32, never fused (-ffp-contract=off).
// acc starts from its own values.
void sum_slots(std::int64_t t, std::int64_t topk, std::int64_t K, const float* topk_weights, const bf16_t* rows,
               const std::int32_t* row_of, float* acc) {
  for (std::int64_t k = 0; k < topk; ++k) {
    const std::int64_t row = row_of ? row_of[t * topk + k] : t * topk + k;
    if (row < 0) continue;
    const float wk = topk_weights[t * topk + k];
    const bf16_t* y = rows + row * K;
    for (std::int64_t c = 0; c < K; ++c) acc[c] += wk * bf16_decode(y[c]);
  }
}

}  // namespace

void combine_topk(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights, const bf16_t* rows,
                  const std::int32_t* row_of, bf16_t* output, ThreadPool& pool, bool accumulate) {
  pool.parallel_for(T, [&](std::int64_t t0, std::int64_t t1) {
    std::vector<float> acc(static_cast<std::size_t>(K));
    for (std::int64_t t = t0; t < t1; ++t) {
      for (std::int64_t c = 0; c < K; ++c)
        acc[static_cast<std::size_t>(c)] = accumulate ? bf16_decode(output[t * K + c]) : 0.0f;
      sum_slots(t, topk, K, topk_weights, rows, row_of, acc.data());
      for (std::int64_t c = 0; c < K; ++c) output[t * K + c] = bf16_encode(acc[static_cast<std::size_t>(c)]);
    }
  });
}

void combine_topk_fp32(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights, const bf16_t* rows,
                       const std::int32_t* row_of, float* partials, ThreadPool& pool) {
  pool.parallel_for(T, [&](std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t) {
      std::fill(partials + t * K, partials + (t + 1) * K, 0.0f);
      sum_slots(t, topk, K, topk_weights, rows, row_of, partials + t * K);
    }
  });
}

}  // namespace moekit::cpu
