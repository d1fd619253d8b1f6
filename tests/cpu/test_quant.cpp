// cpu/quant.h: every scheme on fresh random data (seeded, never zeros, magnitudes varied per row and
// per 128-column slice so the scales differ), real shapes (7168) and ragged ones (200, 300x200):
// scale = amax/448 exactly, per-element error within half an fp8 ulp, amax -> +-448, Frobenius error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/quant.h"
#include "moekit/check.h"
#include "moekit/recipe.h"

namespace moekit::cpu {
namespace {

using std::int64_t;

// Normal values times 10^U(-2, 2) per row and 2^U(-3, 3) per 128-column slice; zeros are re-drawn.
std::vector<float> random_matrix(int64_t rows, int64_t cols, int64_t ld, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> row_exp(-2.0f, 2.0f), slice_exp(-3.0f, 3.0f);
  std::vector<float> x(static_cast<size_t>(std::max<int64_t>(rows * ld, 1)), std::nanf(""));  // padding stays NaN
  for (int64_t r = 0; r < rows; ++r) {
    const float row_mag = std::pow(10.0f, row_exp(rng));
    float slice_mag = 1.0f;
    for (int64_t c = 0; c < cols; ++c) {
      if (c % kQuantBlock == 0) slice_mag = std::exp2(slice_exp(rng));
      float v = 0.0f;
      while (v == 0.0f) v = normal(rng);
      x[static_cast<size_t>(r * ld + c)] = v * row_mag * slice_mag;
    }
  }
  return x;
}

// The matrix under test, seen through the scheme: group_of(r, c) is the scale index, value(r, c)
// the input, code(r, c) the fp8 code and deq(r, c) the dequantized value.
struct Quantized {
  std::string what;
  int64_t rows, cols;
  std::function<int64_t(int64_t, int64_t)> group_of;
  std::function<float(int64_t, int64_t)> value;
  std::function<fp8_t(int64_t, int64_t)> code;
  std::function<double(int64_t, int64_t)> deq;
  const float* scales;
  int64_t num_scales;
};

void expect_quantized_well(const Quantized& m) {
  SCOPED_TRACE(m.what);
  // Reference amax and its position per group, computed here independently of the library.
  std::vector<float> amax(static_cast<size_t>(m.num_scales), 0.0f);
  std::vector<std::pair<int64_t, int64_t>> argmax(static_cast<size_t>(m.num_scales), {-1, -1});
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const auto g = static_cast<size_t>(m.group_of(r, c));
      ASSERT_LT(g, amax.size()) << "group index of (" << r << ", " << c << ")";
      if (std::fabs(m.value(r, c)) > amax[g]) amax[g] = std::fabs(m.value(r, c)), argmax[g] = {r, c};
    }
  for (size_t g = 0; g < amax.size(); ++g) {
    const float want = amax[g] > 0.0f ? amax[g] / 448.0f : 1.0f;
    EXPECT_EQ(m.scales[g], want) << "scale of group " << g << " (amax " << amax[g] << ")";
    if (argmax[g].first < 0) continue;
    // The largest element lands on +-448 exactly: x / (amax/448) is 448 within an fp32 ulp, and the
    // e4m3 neighbours of 448 are 32 away.
    const auto [r, c] = argmax[g];
    const fp8_t want_code = static_cast<fp8_t>((m.value(r, c) < 0 ? 0x80 : 0x00) | 0x7E);
    EXPECT_EQ(m.code(r, c), want_code) << "group " << g << " max element (" << r << ", " << c
                                       << ") = " << m.value(r, c);
  }
  // Per element: with y = x / scale, e4m3 rounding moves y by at most half an ulp, i.e. by |y| * 2^-4
  // in the normal range (3 mantissa bits: ulp = 2^(e-3), |y| >= 2^e) and by 2^-10 among the
  // subnormals (ulp 2^-9). Scaled back: |deq - x| <= max(|x| * 2^-4, scale * 2^-10); the fp32
  // division x / scale adds a relative 2^-24, covered by the (1 + 2^-20) slack.
  int failures = 0;
  double err2 = 0.0, ref2 = 0.0;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const double x = m.value(r, c), d = m.deq(r, c);
      const double scale = m.scales[m.group_of(r, c)];
      const double bound = std::max(std::fabs(x) * 0x1p-4, scale * 0x1p-10) * (1.0 + 0x1p-20);
      if (!(std::fabs(d - x) <= bound) && ++failures <= 10)
        ADD_FAILURE() << "element (" << r << ", " << c << "): x = " << x << ", dequant = " << d << ", |err| "
                      << std::fabs(d - x) << " > bound " << bound << " (scale " << scale << ")";
      err2 += (d - x) * (d - x);
      ref2 += x * x;
    }
  EXPECT_EQ(failures, 0);
  // Relative Frobenius error: the worst case is the unit roundoff 2^-4 = 0.0625 (a value just above a
  // power of two); rounding error is spread uniformly over +-half an ulp, so its rms relative to the
  // value is ~0.0625 * (average 1/mantissa ~0.72) / sqrt(3) ~= 0.026. 0.04 leaves room for sampling
  // and for the subnormal tail, and still fails for an off-by-one-bit mantissa (~0.05).
  if (ref2 > 0) {
    EXPECT_LT(std::sqrt(err2 / ref2), 0.04);
  }
}

std::string describe(QuantScheme quant, int64_t rows, int64_t cols, int64_t ld_x, int64_t ld_q) {
  std::ostringstream os;
  os << quant_name(quant) << " activation " << rows << "x" << cols << " ldx " << ld_x << " ldq " << ld_q;
  return os.str();
}

// --- activations ---------------------------------------------------------------------------------

struct ActShape {
  int64_t rows, cols, ld_x, ld_q;
};
const std::vector<ActShape> kActShapes = {
    {1, 1, 1, 1},          {3, 128, 128, 128},    {7, 200, 200, 200},     {4, 129, 131, 133},
    {5, 7168, 7168, 7168}, {2, 2048, 2050, 2056}, {64, 7168, 7168, 7168},
};

TEST(QuantActivation, AllSchemesMeetTheErrorBound) {
  std::uint32_t seed = 1;
  for (QuantScheme quant : all_quant_schemes()) {
    if (!has_activation_scales(recipe_info(quant))) continue;  // FP8 recipes only (bf16: store_activation)
    for (const ActShape& s : kActShapes) {
      const std::string what = describe(quant, s.rows, s.cols, s.ld_x, s.ld_q);
      const std::vector<float> x = random_matrix(s.rows, s.cols, s.ld_x, seed++);
      std::vector<fp8_t> q(static_cast<size_t>(s.rows * s.ld_q), 0xAB);  // poison, padding must stay so
      const int64_t num_scales = activation_scale_count(quant, s.rows, s.cols);
      std::vector<float> scales(static_cast<size_t>(num_scales) + 1, std::nanf(""));
      quantize_activation(quant, x.data(), s.rows, s.cols, s.ld_x, q.data(), s.ld_q, scales.data());
      EXPECT_TRUE(std::isnan(scales.back())) << what << ": wrote past activation_scale_count()";
      for (int64_t r = 0; r < s.rows; ++r)
        for (int64_t c = s.cols; c < s.ld_q; ++c)
          ASSERT_EQ(q[static_cast<size_t>(r * s.ld_q + c)], 0xAB)
              << what << ": wrote padding (" << r << ", " << c << ")";
      const int64_t groups_per_row = (s.cols + kQuantBlock - 1) / kQuantBlock;
      expect_quantized_well({
          what,
          s.rows,
          s.cols,
          [&](int64_t r, int64_t c) -> int64_t {
            switch (quant) {
              case QuantScheme::kPerTensor: return 0;
              case QuantScheme::kPerTokenPerChannel: return r;
              case QuantScheme::kBlock128: return r * groups_per_row + c / kQuantBlock;
              case QuantScheme::kBf16:
              case QuantScheme::kFp16: break;
            }
            return -1;
          },
          [&](int64_t r, int64_t c) { return x[static_cast<size_t>(r * s.ld_x + c)]; },
          [&](int64_t r, int64_t c) { return q[static_cast<size_t>(r * s.ld_q + c)]; },
          [&](int64_t r, int64_t c) {
            return dequant_activation(quant, q.data(), s.ld_q, scales.data(), s.cols, r, c);
          },
          scales.data(),
          num_scales,
      });
    }
  }
}

TEST(QuantActivation, ScaleCounts) {
  EXPECT_EQ(activation_scale_count(QuantScheme::kPerTensor, 5, 7168), 1);
  EXPECT_EQ(activation_scale_count(QuantScheme::kPerTokenPerChannel, 5, 7168), 5);
  EXPECT_EQ(activation_scale_count(QuantScheme::kBlock128, 5, 7168), 5 * 56);
  EXPECT_EQ(activation_scale_count(QuantScheme::kBlock128, 3, 200), 6);
  EXPECT_EQ(activation_scale_count(QuantScheme::kBlock128, 0, 200), 0);
  EXPECT_EQ(weight_scale_count(QuantScheme::kPerTensor, 4096, 7168), 1);
  EXPECT_EQ(weight_scale_count(QuantScheme::kPerTokenPerChannel, 4096, 7168), 4096);
  EXPECT_EQ(weight_scale_count(QuantScheme::kBlock128, 4096, 7168), 32 * 56);
  EXPECT_EQ(weight_scale_count(QuantScheme::kBlock128, 300, 200), 3 * 2);
}

TEST(QuantActivation, Bf16InputMatchesFloatInputBitForBit) {
  std::uint32_t seed = 100;
  for (QuantScheme quant : all_quant_schemes()) {
    if (!has_activation_scales(recipe_info(quant))) continue;  // FP8 recipes only (bf16: store_activation)
    for (const ActShape& s : kActShapes) {
      const std::string what = describe(quant, s.rows, s.cols, s.ld_x, s.ld_x);
      std::vector<float> x = random_matrix(s.rows, s.cols, s.ld_x, seed++);
      std::vector<bf16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        xb[i] = bf16_encode(x[i]);
        x[i] = bf16_decode(xb[i]);  // the float input is exactly the bf16 input
      }
      const auto num_scales = static_cast<size_t>(activation_scale_count(quant, s.rows, s.cols));
      std::vector<fp8_t> qf(x.size(), 0), qb(x.size(), 0);
      std::vector<float> sf(num_scales), sb(num_scales);
      quantize_activation(quant, x.data(), s.rows, s.cols, s.ld_x, qf.data(), s.ld_x, sf.data());
      quantize_activation(quant, xb.data(), s.rows, s.cols, s.ld_x, qb.data(), s.ld_x, sb.data());
      EXPECT_EQ(qf, qb) << what;
      EXPECT_EQ(std::memcmp(sf.data(), sb.data(), num_scales * sizeof(float)), 0) << what;
    }
  }
}

TEST(QuantActivation, ZeroGroupsGetScaleOne) {
  for (QuantScheme quant : all_quant_schemes()) {
    if (!has_activation_scales(recipe_info(quant))) continue;  // FP8 recipes only (bf16: store_activation)
    const int64_t rows = 4, cols = 300;
    std::vector<float> x = random_matrix(rows, cols, cols, 7);
    // Row 1 all zeros (a padding row); for per-tensor the whole matrix is zeroed below.
    std::fill(x.begin() + cols, x.begin() + 2 * cols, 0.0f);
    if (quant == QuantScheme::kPerTensor) std::fill(x.begin(), x.end(), 0.0f);
    std::vector<fp8_t> q(x.size(), 0xAB);
    std::vector<float> scales(static_cast<size_t>(activation_scale_count(quant, rows, cols)), std::nanf(""));
    quantize_activation(quant, x.data(), rows, cols, cols, q.data(), cols, scales.data());
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_EQ(q[static_cast<size_t>(cols + c)], 0x00) << quant_name(quant) << " column " << c;
      EXPECT_EQ(dequant_activation(quant, q.data(), cols, scales.data(), cols, 1, c), 0.0) << quant_name(quant);
    }
    switch (quant) {
      case QuantScheme::kPerTensor: EXPECT_EQ(scales[0], 1.0f); break;
      case QuantScheme::kPerTokenPerChannel:
        EXPECT_EQ(scales[1], 1.0f);
        EXPECT_NE(scales[0], 1.0f);
        break;
      case QuantScheme::kBlock128:
        for (int g = 3; g < 6; ++g) EXPECT_EQ(scales[static_cast<size_t>(g)], 1.0f) << "group " << g;
        EXPECT_NE(scales[0], 1.0f);
        break;
      case QuantScheme::kBf16:
      case QuantScheme::kFp16: break;
    }
  }
}

TEST(QuantActivation, ZeroRowsIsANoOp) {
  for (QuantScheme quant : all_quant_schemes()) {
    if (!has_activation_scales(recipe_info(quant))) continue;  // FP8 recipes only (bf16: store_activation)
    float scale = std::nanf("");
    quantize_activation(quant, static_cast<const float*>(nullptr), 0, 7168, 7168, nullptr, 7168, &scale);
    if (quant == QuantScheme::kPerTensor) {
      EXPECT_EQ(scale, 1.0f);  // one scale always exists
    }
  }
}

TEST(QuantActivation, BadArgumentsThrow) {
  std::vector<float> x(256, 1.0f);
  std::vector<fp8_t> q(256);
  std::vector<float> s(256);
  for (QuantScheme quant : all_quant_schemes()) {
    if (!has_activation_scales(recipe_info(quant))) continue;  // FP8 recipes only (bf16: store_activation)
    EXPECT_THROW(quantize_activation(quant, x.data(), -1, 128, 128, q.data(), 128, s.data()), Error);
    EXPECT_THROW(quantize_activation(quant, x.data(), 1, 0, 128, q.data(), 128, s.data()), Error);
    EXPECT_THROW(quantize_activation(quant, x.data(), 2, 128, 100, q.data(), 128, s.data()), Error);
    EXPECT_THROW(quantize_activation(quant, x.data(), 2, 128, 128, q.data(), 100, s.data()), Error);
    EXPECT_THROW(quantize_activation(quant, x.data(), 2, 128, 128, q.data(), 128, nullptr), Error);
    EXPECT_THROW(quantize_weight(quant, x.data(), -1, 128, q.data(), s.data()), Error);
    EXPECT_THROW(quantize_weight(quant, x.data(), 2, 0, q.data(), s.data()), Error);
    EXPECT_THROW(dequant_activation(quant, q.data(), 128, s.data(), 128, 0, 128), Error);
    EXPECT_THROW(dequant_weight(quant, q.data(), s.data(), 128, 0, -1), Error);
  }
  try {
    quantize_activation(QuantScheme::kBlock128, x.data(), -3, 128, 128, q.data(), 128, s.data());
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("-3"), std::string::npos) << e.what();
  }
}

// --- weights ---------------------------------------------------------------------------------------

TEST(QuantWeight, AllSchemesMeetTheErrorBound) {
  struct Shape {
    int64_t n, k;
  };
  std::uint32_t seed = 1000;
  for (QuantScheme quant : all_quant_schemes()) {
    if (!has_activation_scales(recipe_info(quant))) continue;  // FP8 recipes only (bf16: store_activation)
    for (const Shape s :
         {Shape{1, 1}, Shape{128, 128}, Shape{300, 200}, Shape{129, 130}, Shape{256, 7168}, Shape{4096, 256}}) {
      std::ostringstream os;
      os << quant_name(quant) << " weight " << s.n << "x" << s.k;
      const std::vector<float> w = random_matrix(s.n, s.k, s.k, seed++);
      std::vector<fp8_t> q(w.size(), 0xAB);
      const int64_t num_scales = weight_scale_count(quant, s.n, s.k);
      std::vector<float> scales(static_cast<size_t>(num_scales) + 1, std::nanf(""));
      quantize_weight(quant, w.data(), s.n, s.k, q.data(), scales.data());
      EXPECT_TRUE(std::isnan(scales.back())) << os.str() << ": wrote past weight_scale_count()";
      const int64_t kb_count = (s.k + kQuantBlock - 1) / kQuantBlock;
      expect_quantized_well({
          os.str(),
          s.n,
          s.k,
          [&](int64_t n, int64_t k) -> int64_t {
            switch (quant) {
              case QuantScheme::kPerTensor: return 0;
              case QuantScheme::kPerTokenPerChannel: return n;
              case QuantScheme::kBlock128: return (n / kQuantBlock) * kb_count + k / kQuantBlock;
              case QuantScheme::kBf16:
              case QuantScheme::kFp16: break;
            }
            return -1;
          },
          [&](int64_t n, int64_t k) { return w[static_cast<size_t>(n * s.k + k)]; },
          [&](int64_t n, int64_t k) { return q[static_cast<size_t>(n * s.k + k)]; },
          [&](int64_t n, int64_t k) { return dequant_weight(quant, q.data(), scales.data(), s.k, n, k); },
          scales.data(),
          num_scales,
      });
    }
  }
}

TEST(QuantWeight, ZeroBlockGetsScaleOne) {
  // 300 x 200: blocks (0..2) x (0..1); zero the partial edge block (2, 1) = rows 256..299, cols 128..199.
  const int64_t n = 300, k = 200;
  std::vector<float> w = random_matrix(n, k, k, 77);
  for (int64_t r = 256; r < n; ++r)
    for (int64_t c = 128; c < k; ++c) w[static_cast<size_t>(r * k + c)] = 0.0f;
  std::vector<fp8_t> q(w.size(), 0xAB);
  std::vector<float> scales(6, std::nanf(""));
  quantize_weight(QuantScheme::kBlock128, w.data(), n, k, q.data(), scales.data());
  EXPECT_EQ(scales[5], 1.0f);
  for (int g = 0; g < 5; ++g) EXPECT_NE(scales[static_cast<size_t>(g)], 1.0f) << "block " << g;
  for (int64_t r = 256; r < n; ++r)
    for (int64_t c = 128; c < k; ++c) ASSERT_EQ(q[static_cast<size_t>(r * k + c)], 0x00) << r << ", " << c;
}

// The unquantized recipe stores its operands, it does not quantize them: bf16 tokens are copied bit
// for bit (NaN and signed zero included), fp32 rounds to nearest even, scales are neither needed nor
// touched, and the FP8 entry points refuse it with an Error naming it.
TEST(Bf16Recipe, StoresRowsAsTheyAreAndRefusesFp8Quantization) {
  const int64_t rows = 3, cols = 5, ld = 7;
  std::vector<bf16_t> x(static_cast<size_t>(rows * ld));
  std::mt19937 rng(54);
  for (auto& v : x) v = static_cast<bf16_t>(rng());
  x[2] = 0x7FC1;  // a NaN with a payload
  x[3] = 0x8000;  // -0
  std::vector<bf16_t> q(static_cast<size_t>(rows * cols), 0xFFFF);
  float untouched = 123.0f;
  store_activation(QuantScheme::kBf16, x.data(), rows, cols, ld, reinterpret_cast<std::uint8_t*>(q.data()), cols,
                   &untouched);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(q[static_cast<size_t>(r * cols + c)], x[static_cast<size_t>(r * ld + c)]) << r << ", " << c;
  EXPECT_EQ(untouched, 123.0f);
  store_activation(QuantScheme::kBf16, x.data(), rows, cols, ld, reinterpret_cast<std::uint8_t*>(q.data()), cols,
                   nullptr);  // no scales needed
  // fp32: round to nearest even, once.
  const std::vector<float> f = {1.0f + 1.0f / 256.0f, 1.0f + 3.0f / 256.0f, -2.5f};
  std::vector<bf16_t> fq(3);
  store_activation(QuantScheme::kBf16, f.data(), 1, 3, 3, reinterpret_cast<std::uint8_t*>(fq.data()), 3, nullptr);
  EXPECT_EQ(fq[0], bf16_encode(1.0f));  // a tie, to even
  EXPECT_EQ(fq[1], bf16_encode(1.0f + 4.0f / 256.0f));
  EXPECT_EQ(bf16_decode(fq[2]), -2.5f);
  std::vector<float> w = {0.5f, -0.25f, 3.0f, 1e-3f};
  std::vector<bf16_t> wq(4);
  store_weight(QuantScheme::kBf16, w.data(), 2, 2, reinterpret_cast<std::uint8_t*>(wq.data()), nullptr);
  for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ(wq[i], bf16_encode(w[i])) << i;
  std::vector<fp8_t> codes(static_cast<size_t>(rows * cols));
  std::vector<float> scales(16);
  try {
    quantize_activation(QuantScheme::kBf16, x.data(), rows, cols, ld, codes.data(), cols, scales.data());
    ADD_FAILURE() << "quantize_activation accepted the bf16 recipe";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
  EXPECT_THROW(quantize_weight(QuantScheme::kBf16, w.data(), 2, 2, codes.data(), scales.data()), Error);
}

// The fp16 recipe: bf16 tokens rounded once to fp16 (exact where bf16's 8 bits fit; past 65504 inf,
// as torch's .half(); NaN stays NaN), fp32 rounded once; a weight past fp16's range is refused by
// value and place, never stored as inf; the FP8 entry points refuse it.
TEST(Fp16Recipe, ConvertsRowsOnceAndRefusesWeightsPastItsRange) {
  const std::vector<bf16_t> x = {bf16_encode(1.5f),
                                 bf16_encode(-3.0e-3f),
                                 bf16_encode(65504.0f),
                                 bf16_encode(7e4f),
                                 bf16_encode(-1e6f),
                                 0x7FC1,
                                 0x8000,
                                 bf16_encode(1e-9f)};
  const auto n = static_cast<int64_t>(x.size());
  std::vector<std::uint16_t> q(x.size() + 1, 0xABCD);
  store_activation(QuantScheme::kFp16, x.data(), 1, n, n, reinterpret_cast<std::uint8_t*>(q.data()), n, nullptr);
  for (size_t i = 0; i < x.size(); ++i) {
    const float v = bf16_decode(x[i]);
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(fp16_decode(q[i]))) << i;
      continue;
    }
    EXPECT_EQ(q[i], fp16_encode(v)) << i;
  }
  EXPECT_EQ(q.back(), 0xABCD) << "wrote past the row";
  EXPECT_EQ(fp16_decode(q[0]), 1.5f);
  EXPECT_EQ(q[3], 0x7C00) << "7e4 is past 65504: inf";
  EXPECT_EQ(q[4], 0xFC00);
  EXPECT_EQ(q[6], 0x8000) << "-0 stays -0";
  EXPECT_EQ(q[7], 0x0000) << "1e-9 is below half fp16's smallest subnormal (2^-25)";
  const std::vector<float> w = {0.5f, -0.25f, 65504.0f, 1e-3f};
  std::vector<std::uint16_t> wq(4);
  store_weight(QuantScheme::kFp16, w.data(), 2, 2, reinterpret_cast<std::uint8_t*>(wq.data()), nullptr);
  for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ(wq[i], fp16_encode(w[i])) << i;
  const std::vector<float> big = {0.5f, -0.25f, 1.0f, -7e4f};
  try {
    store_weight(QuantScheme::kFp16, big.data(), 2, 2, reinterpret_cast<std::uint8_t*>(wq.data()), nullptr);
    ADD_FAILURE() << "a weight past fp16's range was stored";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("-70000"), std::string::npos) << what;
    EXPECT_NE(what.find("row 1, column 1"), std::string::npos) << what;
    EXPECT_NE(what.find("--quant bf16"), std::string::npos) << what;
  }
  std::vector<fp8_t> codes(8);
  std::vector<float> scales(8);
  EXPECT_THROW(quantize_activation(QuantScheme::kFp16, x.data(), 1, n, n, codes.data(), n, scales.data()), Error);
  EXPECT_THROW(quantize_weight(QuantScheme::kFp16, w.data(), 2, 2, codes.data(), scales.data()), Error);
}

}  // namespace
}  // namespace moekit::cpu
