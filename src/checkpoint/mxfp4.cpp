// MXFP4 -> FP8 with exact power-of-two scales (checkpoint/mxfp4.h).
#include "checkpoint/mxfp4.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moekit/check.h"
#include "numerics/fp8.h"
#include "numerics/mxfp4.h"
#include "numerics/scales.h"

namespace moekit::checkpoint {

namespace {
using numerics::kMxBlock;

// 2^e for the smallest e with amax / 2^e <= 448 (amax == 0: 1). Exact: a power of two.
int scale_exponent(double amax) {
  if (amax <= 0.0) return 0;
  int e = static_cast<int>(std::ceil(std::log2(amax / numerics::kFp8Max)));
  while (amax / std::ldexp(1.0, e) > numerics::kFp8Max) ++e;  // log2's last bit
  while (amax / std::ldexp(1.0, e - 1) <= numerics::kFp8Max) --e;
  return e;
}
}  // namespace

std::string Mxfp4Conversion::describe() const {
  return fmt::format(
      "row {}, column {}: {:g} becomes {:g} (its scale group's MXFP4 exponents span 2^{} .. 2^{}, "
      "wider than FP8 e4m3 holds under one scale)",
      row, col, value, stored, exponent_min, exponent_max);
}

Mxfp4Conversion mxfp4_to_fp8(const Mxfp4Matrix& m, QuantScheme quant, std::uint8_t* codes, float* scales,
                             const std::string& what) {
  MOEKIT_CHECK(m.rows >= 0 && m.cols >= 0 && m.cols % kMxBlock == 0,
               "{}: {} x {} MXFP4 values: the columns must be whole blocks of {}", what, m.rows, m.cols, kMxBlock);
  const std::int64_t groups_per_row = m.cols / kMxBlock;
  const std::int64_t n_scales = numerics::weight_scale_count(quant, m.rows, m.cols);
  // Pass 1: each scale group's largest magnitude and its exponents' span (nonzero values only).
  std::vector<double> amax(static_cast<std::size_t>(n_scales), 0.0);
  std::vector<int> e_min(amax.size(), 1 << 30), e_max(amax.size(), -(1 << 30));
  for (std::int64_t r = 0; r < m.rows; ++r) {
    const std::uint8_t* row_blocks = m.blocks + r * groups_per_row * numerics::kMxBlockBytes;
    for (std::int64_t g = 0; g < groups_per_row; ++g) {
      const std::uint8_t e8 = m.exponents[r * groups_per_row + g];
      MOEKIT_CHECK(e8 != numerics::kE8m0NaN,
                   "{}: row {}, columns {}..{}: MXFP4 exponent 255 is NaN (OCP MX); the checkpoint is damaged", what, r,
                   g * kMxBlock, g * kMxBlock + kMxBlock - 1);
      const int e = static_cast<int>(e8) - numerics::kE8m0Bias;
      const std::uint8_t* packed = row_blocks + g * numerics::kMxBlockBytes;
      const std::size_t s = static_cast<std::size_t>(numerics::weight_scale_index(quant, r, g * kMxBlock, m.cols));
      for (int j = 0; j < kMxBlock; ++j) {
        const double v = std::fabs(static_cast<double>(numerics::e2m1_value(numerics::e2m1_nibble(packed, j))));
        if (v == 0.0) continue;
        amax[s] = std::max(amax[s], std::ldexp(v, e));
        e_min[s] = std::min(e_min[s], e);
        e_max[s] = std::max(e_max[s], e);
      }
    }
  }
  std::vector<int> s_exp(amax.size());
  for (std::size_t s = 0; s < amax.size(); ++s) {
    s_exp[s] = scale_exponent(amax[s]);
    MOEKIT_CHECK(s_exp[s] >= -126 && s_exp[s] <= 127,
                 "{}: scale group {} needs an FP8 scale of 2^{}, outside float32's normal powers of two "
                 "(2^-126 .. 2^127): its MXFP4 exponents reach 2^{}",
                 what, s, s_exp[s], e_max[s]);
    scales[s] = static_cast<float>(std::ldexp(1.0, s_exp[s]));
  }
  // Pass 2: the codes, each decoded again and compared.
  Mxfp4Conversion result;
  for (std::int64_t r = 0; r < m.rows; ++r) {
    const std::uint8_t* row_blocks = m.blocks + r * groups_per_row * numerics::kMxBlockBytes;
    for (std::int64_t g = 0; g < groups_per_row; ++g) {
      const int e = static_cast<int>(m.exponents[r * groups_per_row + g]) - numerics::kE8m0Bias;
      const std::uint8_t* packed = row_blocks + g * numerics::kMxBlockBytes;
      const std::size_t s = static_cast<std::size_t>(numerics::weight_scale_index(quant, r, g * kMxBlock, m.cols));
      for (int j = 0; j < kMxBlock; ++j) {
        const std::int64_t c = g * kMxBlock + j;
        const double v = std::ldexp(static_cast<double>(numerics::e2m1_value(numerics::e2m1_nibble(packed, j))), e);
        const auto code = numerics::fp8_encode(static_cast<float>(std::ldexp(v, -s_exp[s])));
        codes[r * m.cols + c] = code;
        const double back = std::ldexp(static_cast<double>(numerics::fp8_decode(code)), s_exp[s]);
        if (back != v) {
          if (result.inexact++ == 0) {
            result.row = r;
            result.col = c;
            result.value = v;
            result.stored = back;
            result.exponent_min = e_min[s];
            result.exponent_max = e_max[s];
          }
        }
      }
    }
  }
  return result;
}

}  // namespace moekit::checkpoint
