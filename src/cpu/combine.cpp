// The CPU combine (cpu/combine.h).
#include "cpu/combine.h"

#include <algorithm>
#include <vector>

#include "moekit/check.h"

namespace moekit::cpu {

using namespace numerics;

namespace {

// acc[0, K) = sum over slots k in order of w[t,k] * y(t,k), fp32, never fused (-ffp-contract=off).
// acc starts from its own values. Rows of bf16 or (kFp16) fp16 values.
template <bool kFp16>
void sum_slots(std::int64_t t, std::int64_t topk, std::int64_t K, const float* topk_weights, const std::uint16_t* rows,
               const std::int32_t* row_of, float* acc) {
  for (std::int64_t k = 0; k < topk; ++k) {
    const std::int64_t row = row_of ? row_of[t * topk + k] : t * topk + k;
    if (row < 0) continue;
    const float wk = topk_weights[t * topk + k];
    const std::uint16_t* y = rows + row * K;
    for (std::int64_t c = 0; c < K; ++c) acc[c] += wk * (kFp16 ? fp16_decode(y[c]) : bf16_decode(y[c]));
  }
}

void sum_slots(DType rows_dtype, std::int64_t t, std::int64_t topk, std::int64_t K, const float* topk_weights,
               const std::uint16_t* rows, const std::int32_t* row_of, float* acc) {
  if (rows_dtype == DType::kFp16)
    sum_slots<true>(t, topk, K, topk_weights, rows, row_of, acc);
  else
    sum_slots<false>(t, topk, K, topk_weights, rows, row_of, acc);
}

void check_dtypes(DType rows_dtype, DType output_dtype) {
  MOEKIT_CHECK(is_sixteen_bit(rows_dtype) && is_sixteen_bit(output_dtype),
               "the combine reads bf16 or fp16 expert rows into a bf16 or fp16 output; got rows {}, output {}",
               dtype_name(rows_dtype), dtype_name(output_dtype));
}

}  // namespace

void combine_topk(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights,
                  const std::uint16_t* rows, const std::int32_t* row_of, std::uint16_t* output, ThreadPool& pool,
                  bool accumulate, DType rows_dtype, DType output_dtype) {
  check_dtypes(rows_dtype, output_dtype);
  const bool out_fp16 = output_dtype == DType::kFp16;
  pool.parallel_for(T, [&](std::int64_t t0, std::int64_t t1) {
    std::vector<float> acc(static_cast<std::size_t>(K));
    for (std::int64_t t = t0; t < t1; ++t) {
      for (std::int64_t c = 0; c < K; ++c)
        acc[static_cast<std::size_t>(c)] = accumulate ? decode16(output[t * K + c], out_fp16) : 0.0f;
      sum_slots(rows_dtype, t, topk, K, topk_weights, rows, row_of, acc.data());
      for (std::int64_t c = 0; c < K; ++c) output[t * K + c] = encode16(acc[static_cast<std::size_t>(c)], out_fp16);
    }
  });
}

void combine_topk_fp32(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights,
                       const std::uint16_t* rows, const std::int32_t* row_of, float* partials, ThreadPool& pool,
                       DType rows_dtype) {
  check_dtypes(rows_dtype, DType::kBf16);
  pool.parallel_for(T, [&](std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t) {
      std::fill(partials + t * K, partials + (t + 1) * K, 0.0f);
      sum_slots(rows_dtype, t, topk, K, topk_weights, rows, row_of, partials + t * K);
    }
  });
}

}  // namespace moekit::cpu
