// MXFP4 -> FP8 (checkpoint/mxfp4.h) against a float64 decode of the MXFP4 values: exact wherever a
// scale group's exponents fit e4m3's range, for every recipe's grouping and for partial 128-blocks;
// inexact values counted and the first named; NaN exponents and unscalable groups refused by name.
// The e2m1 table is the one transformers' Mxfp4 integration decodes gpt-oss's checkpoints with.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/mxfp4.h"
#include "moekit/error.h"
#include "numerics/fp8.h"
#include "numerics/mxfp4.h"
#include "numerics/scales.h"
#include "synthetic/random.h"

namespace moekit::checkpoint {
namespace {

using numerics::kMxBlock;
using numerics::kMxBlockBytes;

struct Mx {
  std::int64_t rows, cols;
  std::vector<std::uint8_t> blocks, exponents;
  Mxfp4Matrix view() const { return {blocks.data(), exponents.data(), rows, cols}; }
  double value(std::int64_t r, std::int64_t c) const {
    const std::int64_t g = c / kMxBlock, groups = cols / kMxBlock;
    const std::uint8_t* packed = blocks.data() + (r * groups + g) * kMxBlockBytes;
    return std::ldexp(static_cast<double>(numerics::e2m1_value(numerics::e2m1_nibble(packed, c % kMxBlock))),
                      static_cast<int>(exponents[static_cast<std::size_t>(r * groups + g)]) - 127);
  }
};

// Random codes (every nibble, zeros too) and exponents drawn from [e_lo, e_hi].
Mx random_mx(std::int64_t rows, std::int64_t cols, int e_lo, int e_hi, std::uint64_t seed) {
  Mx m{rows, cols, std::vector<std::uint8_t>(static_cast<std::size_t>(rows * cols / 2)),
       std::vector<std::uint8_t>(static_cast<std::size_t>(rows * cols / kMxBlock))};
  auto rng = synthetic::stream(seed, synthetic::Purpose::kW1, 0);
  for (auto& b : m.blocks) b = static_cast<std::uint8_t>(rng.next());
  for (auto& e : m.exponents) e = static_cast<std::uint8_t>(e_lo + static_cast<int>(rng.next() % (e_hi - e_lo + 1)));
  return m;
}

struct Converted {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
  Mxfp4Conversion result;
};
Converted convert(const Mx& m, QuantScheme q) {
  Converted c{std::vector<std::uint8_t>(static_cast<std::size_t>(m.rows * m.cols), 0xFF),  // poisoned: NaN codes
              std::vector<float>(static_cast<std::size_t>(numerics::weight_scale_count(q, m.rows, m.cols)), NAN),
              {}};
  c.result = mxfp4_to_fp8(m.view(), q, c.codes.data(), c.scales.data(), "experts.gate_up_proj");
  return c;
}

TEST(Mxfp4, E2m1TableIsTheOneCheckpointsAreDecodedWith) {
  // transformers.integrations.mxfp4.FP4_VALUES, by code.
  const float published[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int n = 0; n < 16; ++n) {
    EXPECT_EQ(numerics::e2m1_value(static_cast<std::uint8_t>(n)), published[n]) << "nibble " << n;
    EXPECT_EQ(std::signbit(numerics::e2m1_value(static_cast<std::uint8_t>(n))), n >= 8) << "nibble " << n;
  }
  const std::uint8_t packed[2] = {0x2F, 0x71};  // elements 0..3: nibbles F, 2, 1, 7 (the lower nibble first)
  EXPECT_EQ(numerics::e2m1_nibble(packed, 0), 0xF);
  EXPECT_EQ(numerics::e2m1_nibble(packed, 1), 0x2);
  EXPECT_EQ(numerics::e2m1_nibble(packed, 2), 0x1);
  EXPECT_EQ(numerics::e2m1_nibble(packed, 3), 0x7);
}

struct Case {
  QuantScheme quant;
  std::int64_t rows, cols;
  int e_lo, e_hi;  // biased e8m0 exponents drawn
};

class Mxfp4Exact : public ::testing::TestWithParam<Case> {};

// Exponents spanning at most 14 in a group: every value held exactly, scales powers of two, every
// code written (the poison gone), each value code * scale in float64.
TEST_P(Mxfp4Exact, EveryValueHeldExactly) {
  const Case k = GetParam();
  const Mx m = random_mx(k.rows, k.cols, k.e_lo, k.e_hi, 7);
  const Converted c = convert(m, k.quant);
  const std::string ctx = std::string(quant_name(k.quant)) + " " + std::to_string(k.rows) + "x" +
                          std::to_string(k.cols) + " exponents " + std::to_string(k.e_lo - 127) + ".." +
                          std::to_string(k.e_hi - 127);
  EXPECT_EQ(c.result.inexact, 0) << ctx << ": " << c.result.describe();
  for (float s : c.scales) {
    int e = 0;
    EXPECT_EQ(std::frexp(s, &e), 0.5f) << ctx << ": scale " << s << " is not a power of two";
  }
  for (std::int64_t r = 0; r < m.rows; ++r)
    for (std::int64_t col = 0; col < m.cols; ++col) {
      const std::uint8_t code = c.codes[static_cast<std::size_t>(r * m.cols + col)];
      const float scale = c.scales[static_cast<std::size_t>(numerics::weight_scale_index(k.quant, r, col, m.cols))];
      ASSERT_NE(code & 0x7F, 0x7F) << ctx << " (" << r << ", " << col << "): a NaN code";
      ASSERT_EQ(static_cast<double>(numerics::fp8_decode(code)) * scale, m.value(r, col))
          << ctx << " (" << r << ", " << col << ")";
    }
}

INSTANTIATE_TEST_SUITE_P(Recipes, Mxfp4Exact,
                         ::testing::Values(
                             // gpt-oss-like exponents (around 2^-8 .. 2^-1), whole and partial 128-blocks (gpt-oss's
                             // 2880 columns are 22.5 blocks).
                             Case{QuantScheme::kBlock128, 256, 384, 119, 126},
                             Case{QuantScheme::kBlock128, 160, 2880, 113, 127},
                             Case{QuantScheme::kPerTokenPerChannel, 96, 2880, 115, 129},
                             Case{QuantScheme::kPerTensor, 64, 256, 120, 134},
                             // The widest span e4m3 holds: 14 (values 0.5 * 2^e_lo .. 6 * 2^e_hi).
                             Case{QuantScheme::kBlock128, 128, 128, 100, 114}),
                         [](const ::testing::TestParamInfo<Case>& p) {
                           const Case& k = p.param;
                           const std::string recipe = k.quant == QuantScheme::kBlock128             ? "block128"
                                                      : k.quant == QuantScheme::kPerTokenPerChannel ? "per_channel"
                                                                                                    : "per_tensor";
                           return recipe + "_" + std::to_string(k.rows) + "x" + std::to_string(k.cols) + "_span" +
                                  std::to_string(k.e_hi - k.e_lo);
                         });

// A group whose exponents span more than e4m3 holds: the small values are counted inexact and the
// first is named; an all-zero group's exponent does not count.
TEST(Mxfp4, WideSpansAreCountedAndNamedNotHidden) {
  Mx m = random_mx(128, 128, 120, 124, 9);
  // Row 3's first group: 2^-20 below the block's largest exponent, its values 0.5 .. 6.
  m.exponents[3 * 4] = 104;
  for (int b = 0; b < kMxBlockBytes; ++b) m.blocks[(3 * 4) * kMxBlockBytes + b] = 0x31;  // 0.5 and 1.5
  Converted c = convert(m, QuantScheme::kBlock128);
  EXPECT_GT(c.result.inexact, 0);
  EXPECT_EQ(c.result.row, 3);
  EXPECT_EQ(c.result.col, 0);
  EXPECT_EQ(c.result.value, m.value(3, 0));
  EXPECT_NE(c.result.stored, c.result.value);
  EXPECT_EQ(c.result.exponent_min, 104 - 127);
  EXPECT_NE(c.result.describe().find("row 3, column 0"), std::string::npos) << c.result.describe();
  // The same group all zeros with that exponent: nothing inexact (zeros carry no range).
  for (int b = 0; b < kMxBlockBytes; ++b) m.blocks[(3 * 4) * kMxBlockBytes + b] = 0x00;
  c = convert(m, QuantScheme::kBlock128);
  EXPECT_EQ(c.result.inexact, 0) << c.result.describe();
  // Per-channel: one row's span, so the other rows stay exact when only row 3 is wide.
  for (int b = 0; b < kMxBlockBytes; ++b) m.blocks[(3 * 4) * kMxBlockBytes + b] = 0x31;
  c = convert(m, QuantScheme::kPerTokenPerChannel);
  EXPECT_EQ(c.result.row, 3);
}

// The boundary: 0.5 * 2^e beside 6 * 2^(e + 14) in one 128-block is exact, beside 6 * 2^(e + 15) not.
TEST(Mxfp4, FourteenBinadesFitOneScaleFifteenDoNot) {
  for (int span : {14, 15}) {
    Mx m{128, 128, std::vector<std::uint8_t>(128 * 64, 0), std::vector<std::uint8_t>(128 * 4, 110)};
    m.blocks[0] = 0x01;  // (0, 0) = 0.5 * 2^(110 - 127)
    m.exponents[4] = static_cast<std::uint8_t>(110 + span);
    m.blocks[4 * kMxBlockBytes] = 0x07;  // (1, 0) = 6 * 2^(110 + span - 127)
    const Converted c = convert(m, QuantScheme::kBlock128);
    EXPECT_EQ(c.result.inexact, span == 14 ? 0 : 1) << "span " << span << ": " << c.result.describe();
  }
}

TEST(Mxfp4, NanExponentsAndUnscalableGroupsAreRefusedByName) {
  Mx m = random_mx(64, 64, 120, 124, 11);
  m.exponents[5 * 2 + 1] = 255;
  try {
    convert(m, QuantScheme::kBlock128);
    FAIL() << "an e8m0 NaN exponent was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("experts.gate_up_proj: row 5, columns 32..63: MXFP4 exponent 255 is NaN"), std::string::npos)
        << what;
  }
  // 2^-126 * 0.5 as a group's largest value: its FP8 scale would be 2^-135.
  Mx tiny = random_mx(32, 32, 1, 1, 12);
  EXPECT_THROW(convert(tiny, QuantScheme::kPerTensor), Error);
  Mx cols = random_mx(4, 32, 120, 121, 13);
  cols.cols = 48;  // not whole 32-value blocks
  EXPECT_THROW(mxfp4_to_fp8(cols.view(), QuantScheme::kBlock128, nullptr, nullptr, "w"), Error);
}

}  // namespace
}  // namespace moekit::checkpoint
