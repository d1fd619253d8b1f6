// MXFP4 weights (numerics/mxfp4.h) to FP8 e4m3 codes with fp32 scales of a moekit recipe, exactly:
// each scale group (a 128x128 block for block128, a row for per-token / per-channel, the matrix for
// per-tensor) takes the power of two S that puts its largest magnitude in (224, 448]; every value is
// then e2m1 * 2^k / S, a power of two times 1 or 1.5, which e4m3 holds exactly unless it falls below
// its subnormals (exponents spanning more than e4m3's range inside one group). Each converted value is
// decoded again and compared: the inexact ones are counted and the first is named, so a loader can
// refuse them, never round silently.
#pragma once

#include <cstdint>
#include <string>

#include "moekit/types.h"

namespace moekit::checkpoint {

// One (rows x cols) matrix as a checkpoint stores it: packed codes (rows, cols / 32, 16) and
// exponents (rows, cols / 32), row-major; cols a multiple of 32.
struct Mxfp4Matrix {
  const std::uint8_t* blocks = nullptr;
  const std::uint8_t* exponents = nullptr;
  std::int64_t rows = 0, cols = 0;
};

struct Mxfp4Conversion {
  std::int64_t inexact = 0;  // values the recipe's FP8 could not hold exactly (rounded in `codes`)
  // The first of them (row-major), and its group's exponent span: where a loader's error points.
  std::int64_t row = -1, col = -1;
  double value = 0.0, stored = 0.0;
  int exponent_min = 0, exponent_max = 0;  // e8m0 exponents (unbiased) of the nonzero values of its group
  std::string describe() const;            // "row r, column c: v becomes s (...)"
};

// Converts `m` into codes (rows * cols, row-major) and scales (numerics::weight_scale_count(quant,
// rows, cols), in its layout). Raises moekit::Error naming `what` for an e8m0 NaN exponent (255) or
// a group no fp32 power of two can scale (beyond 2^-126 .. 2^127).
Mxfp4Conversion mxfp4_to_fp8(const Mxfp4Matrix& m, QuantScheme quant, std::uint8_t* codes, float* scales,
                             const std::string& what);

}  // namespace moekit::checkpoint
