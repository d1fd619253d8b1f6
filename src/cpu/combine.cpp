// The CPU combine (cpu/combine.h).
#include "cpu/combine.h"

#include <algorithm>
#include <vector>

namespace moekit::cpu {

using namespace numerics;

void combine_topk(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights, const bf16_t* rows,
                  const std::int32_t* row_of, bf16_t* output, ThreadPool& pool) {
  pool.parallel_for(T, [&](std::int64_t t0, std::int64_t t1) {
    std::vector<float> acc(static_cast<std::size_t>(K));
    for (std::int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int64_t k = 0; k < topk; ++k) {
        const std::int64_t row = row_of ? row_of[t * topk + k] : t * topk + k;
        if (row < 0) continue;
        const float wk = topk_weights[t * topk + k];
        const bf16_t* y = rows + row * K;
        for (std::int64_t c = 0; c < K; ++c) acc[static_cast<std::size_t>(c)] += wk * bf16_decode(y[c]);
      }
      for (std::int64_t c = 0; c < K; ++c) output[t * K + c] = bf16_encode(acc[static_cast<std::size_t>(c)]);
    }
  });
}

}  // namespace moekit::cpu
