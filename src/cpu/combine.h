// The combine on the CPU: out[t] = bf16(sum over slots k in order of w[t,k] * y(t,k)) with fp32
// accumulation and one rounding (accumulate: the sum starts from out[t]'s own values): the one combine formula of both
// formats and every device, so their outputs agree bit for bit. Row y(t,k) is rows + row_of[t*topk + k] * K (row_of ==
// nullptr: row t*topk + k; -1: slot skipped). The rows are the recipe's output dtype (RecipeInfo::
// output_dtype: bf16, or fp16 for the fp16 recipe); the output bf16 (the layer's), or fp16 (the ops'
// fp16 `out`, rounded once from the same fp32 sums).
#pragma once

#include <cstdint>

#include "cpu/thread_pool.h"
#include "moekit/types.h"
#include "numerics/fp8.h"

namespace moekit::cpu {

void combine_topk(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights,
                  const std::uint16_t* rows, const std::int32_t* row_of, std::uint16_t* output, ThreadPool& pool,
                  bool accumulate = false, DType rows_dtype = DType::kBf16, DType output_dtype = DType::kBf16);
// The same sums left in fp32 (no rounding): an expert-parallel owner's partial of one token over the
// slots it holds (weights and row_of per (record, slot), topk of them).
void combine_topk_fp32(std::int64_t T, std::int64_t topk, std::int64_t K, const float* topk_weights,
                       const std::uint16_t* rows, const std::int32_t* row_of, float* partials, ThreadPool& pool,
                       DType rows_dtype = DType::kBf16);

}  // namespace moekit::cpu
