// A checkpoint's tensor values checked at load (untrusted input): weights must be finite (no NaN or
// Inf in bf16, fp16 or fp32; no NaN code 0x7F / 0xFF in FP8 e4m3fn, which has no Inf) and scales
// finite and > 0 (a zero or negative block scale passes even a float64 reference built on the same
// operands). A scan is integer tests on the stored bits, block by block, at memory speed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"

namespace moekit::checkpoint {

enum class ValueRule : std::uint8_t {
  kFinite,          // weights and biases
  kFinitePositive,  // scales
};

// The first element of [begin, end) (in elements) of a tensor's bytes that breaks `rule`, or -1.
// dtype: BF16, F16, F32 or F8_E4M3 (F8 under kFinite only).
std::int64_t first_bad_value(const std::byte* data, TensorDType dtype, std::int64_t begin, std::int64_t end,
                             ValueRule rule);

// The element's value in words for a message: "NaN", "+Inf", "-0.5", "FP8 code 0x7f (NaN)".
std::string value_text(const std::byte* data, TensorDType dtype, std::int64_t index);
// Its coordinates in `shape`: "[3, 9, 82]".
std::string coordinates(const std::vector<std::int64_t>& shape, std::int64_t index);

}  // namespace moekit::checkpoint
