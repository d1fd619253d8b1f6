// cpu/activation.h: the float kernel of each activation against its float64 reference on random bf16
// rows, the gate/up layouts (halves; interleaved for swigluoai) and clamping on hand cases, and
// bad widths rejected.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "cpu/activation.h"
#include "moekit/check.h"
#include "moekit/weights.h"
#include "numerics/activation.h"

namespace moekit::cpu {
namespace {

using std::int64_t;

std::vector<bf16_t> to_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> out;
  for (float x : v) out.push_back(bf16_encode(x));
  return out;
}

TEST(Activation, FloatKernelMatchesFloat64Reference) {
  // Same formula in float and in double: a handful of fp32 roundings (exp, erf, tanh, the products)
  // give a relative error of a few 2^-24 ~= 6e-8; 1e-5 is far above that and far below any formula
  // slip. Near a zero of the output (x ~ 0, or up = -1 for swigluoai) relative error is meaningless,
  // hence the absolute floor 1e-6.
  const int64_t rows = 5, N = 2 * 1536, ld_in = N + 8;
  std::uint32_t seed = 42;
  for (Activation act : all_activations()) {
    std::mt19937 rng(seed++);
    // Values up to ~+-12 reach swigluoai's clamps at 7 and the saturated tails of every curve.
    std::normal_distribution<float> normal(0.0f, 4.0f);
    std::vector<bf16_t> in(static_cast<size_t>(rows * ld_in), 0x7FC0);  // NaN padding: must not be read
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < N; ++i) in[static_cast<size_t>(r * ld_in + i)] = bf16_encode(normal(rng));
    const int64_t out_dim = activation_out_dim(act, N), ld_out = out_dim + 3;
    std::vector<float> out(static_cast<size_t>(rows * ld_out), std::nanf(""));
    activation_rows(act, in.data(), rows, N, ld_in, out.data(), ld_out);
    std::vector<double> in_d(static_cast<size_t>(N)), ref(static_cast<size_t>(out_dim));
    int failures = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < N; ++i)
        in_d[static_cast<size_t>(i)] = bf16_decode(in[static_cast<size_t>(r * ld_in + i)]);
      activation_row_ref(act, in_d.data(), N, ref.data());
      for (int64_t j = 0; j < out_dim; ++j) {
        const double got = out[static_cast<size_t>(r * ld_out + j)], want = ref[static_cast<size_t>(j)];
        const double err = std::fabs(got - want);
        if (!(err <= 1e-6 || err <= 1e-5 * std::fabs(want)) && ++failures <= 10)
          ADD_FAILURE() << activation_name(act) << " N " << N << " row " << r << " col " << j << ": got " << got
                        << ", want " << want;
      }
      for (int64_t j = out_dim; j < ld_out; ++j)
        EXPECT_TRUE(std::isnan(out[static_cast<size_t>(r * ld_out + j)])) << activation_name(act) << ": wrote padding";
    }
    EXPECT_EQ(failures, 0) << activation_name(act);
  }
}

double silu_d(double x) {
  return x / (1.0 + std::exp(-x));
}

TEST(Activation, GatedHalvesLayout) {
  // gate = [1, 2], up = [3, 4]: out = [act(1) * 3, act(2) * 4]. All inputs are exact in bf16.
  const std::vector<bf16_t> in = to_bf16({1.0f, 2.0f, 3.0f, 4.0f});
  const auto gelu_erf = [](double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); };
  const auto gelu_tanh = [](double x) {
    return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
  };
  struct Case {
    Activation act;
    double want0, want1;
  };
  for (const Case& c : {Case{Activation::kSilu, silu_d(1) * 3, silu_d(2) * 4},
                        Case{Activation::kGelu, gelu_erf(1) * 3, gelu_erf(2) * 4},
                        Case{Activation::kGeluTanh, gelu_tanh(1) * 3, gelu_tanh(2) * 4}}) {
    float out[2] = {};
    activation_rows(c.act, in.data(), 1, 4, 4, out, 2);
    EXPECT_NEAR(out[0], c.want0, 1e-5 * std::fabs(c.want0)) << activation_name(c.act);
    EXPECT_NEAR(out[1], c.want1, 1e-5 * std::fabs(c.want1)) << activation_name(c.act);
    double ref[2] = {};
    const double in_d[4] = {1, 2, 3, 4};
    activation_row_ref(c.act, in_d, 4, ref);
    EXPECT_NEAR(ref[0], c.want0, 1e-14) << activation_name(c.act);
    EXPECT_NEAR(ref[1], c.want1, 1e-14) << activation_name(c.act);
  }
}

TEST(Activation, SwigluOaiInterleavedAndClamped) {
  // Pairs (gate, up): plain; gate above the clamp (8 -> 7); up above and below (+-9 -> +-7);
  // a very negative gate is not clamped from below (sigmoid takes it to ~0).
  const double in_d[8] = {1.0, 2.0, 8.0, 0.5, 2.0, 9.0, -10.0, -9.0};
  // transformers' GptOssExperts: (up + 1) * gate * sigmoid(gate * alpha), in float64, with alpha as
  // every device holds it (a float: the released 1.702 is 1.702f).
  const auto glu = [](double g, double u, float alpha) {
    return (u + 1.0) * g / (1.0 + std::exp(-static_cast<double>(alpha) * g));
  };
  const std::vector<bf16_t> in = to_bf16(std::vector<float>(in_d, in_d + 8));
  // The released alpha, the default; and the config's others (GptOssConfig.swiglu_alpha), which
  // must reach the formula: with alpha 1.0, pair 0 is 0.34 and pair 2 1.4 from the default's.
  for (const float alpha : {kDefaultSwigluAlpha, 1.0f, 2.5f}) {
    const SwigluOaiParams swiglu{.limit = 7.0f, .alpha = alpha};
    const double want[4] = {glu(1.0, 2.0, alpha), glu(7.0, 0.5, alpha), glu(2.0, 7.0, alpha), glu(-10.0, -7.0, alpha)};
    float out[4] = {};
    activation_rows(Activation::kSwigluOai, in.data(), 1, 8, 8, out, 4, QuantScheme::kPerTokenPerChannel, swiglu);
    double ref[4] = {};
    activation_row_ref(Activation::kSwigluOai, in_d, 8, ref, QuantScheme::kPerTokenPerChannel, swiglu);
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(out[i], want[i], 1e-5 * std::fabs(want[i]) + 1e-7) << "swigluoai alpha " << alpha << " pair " << i;
      EXPECT_NEAR(ref[i], want[i], 1e-14 * std::fabs(want[i]) + 1e-300) << "swigluoai alpha " << alpha << " pair " << i;
    }
    if (alpha != kDefaultSwigluAlpha) {  // the case tells the alphas apart
      EXPECT_GT(std::fabs(want[0] - glu(1.0, 2.0, kDefaultSwigluAlpha)), 1e-2) << "alpha " << alpha;
    }
    // The case tells the layouts apart: the halves layout would make pair 1 (gate x[1] = 2, up x[5] =
    // 9 -> 7), far from the interleaved (7, 0.5) the kernel was checked against above.
    EXPECT_GT(std::fabs(ref[1] - glu(2.0, 7.0, alpha)), 1.0) << "alpha " << alpha;
  }
  // Parameters outside their range are refused by name, on the float path and the reference alike.
  float out[4] = {};
  double ref[4] = {};
  for (const float alpha : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(), 2048.0f}) {
    const SwigluOaiParams bad{.limit = 7.0f, .alpha = alpha};
    for (const auto& run : std::vector<std::function<void()>>{
             [&] {
               activation_rows(Activation::kSwigluOai, in.data(), 1, 8, 8, out, 4, QuantScheme::kPerTokenPerChannel,
                               bad);
             },
             [&] {
               activation_row_ref(Activation::kSwigluOai, in_d, 8, ref, QuantScheme::kPerTokenPerChannel, bad);
             }}) {
      try {
        run();
        ADD_FAILURE() << "swiglu_alpha " << alpha << " was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("activation: field 'swiglu_alpha' = "), std::string::npos) << e.what();
      }
    }
  }
}

TEST(Activation, NonGated) {
  const std::vector<bf16_t> in = to_bf16({-2.0f, -0.5f, 0.0f, 1.5f, 3.0f});
  float out[5] = {};
  activation_rows(Activation::kRelu2, in.data(), 1, 5, 5, out, 5);
  const float want_relu2[5] = {0.0f, 0.0f, 0.0f, 2.25f, 9.0f};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(out[i], want_relu2[i]) << "relu2 " << i;
  activation_rows(Activation::kSiluNoMul, in.data(), 1, 5, 5, out, 5);
  const double x[5] = {-2.0, -0.5, 0.0, 1.5, 3.0};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(out[i], silu_d(x[i]), 1e-6) << "silu_no_mul " << i;
  activation_rows(Activation::kGeluNoMul, in.data(), 1, 5, 5, out, 5);
  for (int i = 0; i < 5; ++i)  // gelu(x) = x Phi(x), the erf form
    EXPECT_NEAR(out[i], 0.5 * x[i] * (1.0 + std::erf(x[i] / std::sqrt(2.0))), 1e-6) << "gelu_no_mul " << i;
}

// A NaN W1 output stays NaN through every activation, the clamps and relu2's max included (PyTorch's
// clamp and relu keep it); infinities follow IEEE through the same formulas on every device
// (tests/cuda/test_activation_kernels.cpp holds the GPU kernels to the same).
TEST(Activation, NanStaysNanThroughClampsAndRelu) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (Activation act : all_activations()) {
    const bool gated = is_gated(act);
    // Output 0 from a NaN gate, output 1 from a NaN up (gated): halves (g0, g1 | u0, u1) and
    // swigluoai's pairs (g0, u0, g1, u1) both put them at columns 0 and 3.
    const std::vector<float> row = gated ? std::vector<float>{nan, 1.0f, 1.0f, nan} : std::vector<float>{nan, 1.0f};
    const std::vector<bf16_t> in = to_bf16(row);
    float out[2] = {};
    activation_rows(act, in.data(), 1, static_cast<int64_t>(row.size()), static_cast<int64_t>(row.size()), out, 2);
    EXPECT_TRUE(std::isnan(out[0])) << activation_name(act) << ": NaN gate gave " << out[0];
    if (gated) {
      EXPECT_TRUE(std::isnan(out[1])) << activation_name(act) << ": NaN up gave " << out[1];
    }
  }
  // swigluoai: +inf gate clamps to 7 (finite); -inf up clamps to -7: (1 - 7) * silu-like(g).
  const std::vector<bf16_t> clamped = to_bf16({inf, 0.5f, 1.0f, -inf});
  float out[2] = {};
  activation_rows(Activation::kSwigluOai, clamped.data(), 1, 4, 4, out, 2);
  EXPECT_TRUE(std::isfinite(out[0]) && std::isfinite(out[1])) << out[0] << " " << out[1];
  EXPECT_NEAR(out[1], -6.0 * 1.0 / (1.0 + std::exp(-static_cast<double>(kDefaultSwigluAlpha))), 1e-5);
  // relu2: -inf -> 0, +inf -> +inf.
  const std::vector<bf16_t> relu_in = to_bf16({-inf, inf});
  activation_rows(Activation::kRelu2, relu_in.data(), 1, 2, 2, out, 2);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], inf);
}

// Block128 pairs W1's blocks (numerics::w1_rows): per 256 rows a gate block then its up block.
// arrange_w1_block_pairs moves HF's halves there, rows and block scales, and the activation of a W1
// output read in pairs equals the halves one.
TEST(Activation, BlockPairsLayout) {
  using numerics::W1Rows;
  EXPECT_EQ(numerics::w1_rows(Activation::kSilu, QuantScheme::kBlock128), W1Rows::kBlockPairs);
  EXPECT_EQ(numerics::w1_rows(Activation::kGeluTanh, QuantScheme::kBlock128), W1Rows::kBlockPairs);
  EXPECT_EQ(numerics::w1_rows(Activation::kSilu, QuantScheme::kPerTokenPerChannel), W1Rows::kHalves);
  EXPECT_EQ(numerics::w1_rows(Activation::kSwigluOai, QuantScheme::kBlock128), W1Rows::kInterleaved);
  EXPECT_EQ(numerics::w1_rows(Activation::kRelu2, QuantScheme::kBlock128), W1Rows::kSingle);
  const int64_t I = 256, K = 160, kb = 2;
  EXPECT_EQ(numerics::gate_column(W1Rows::kBlockPairs, I, 0), 0);
  EXPECT_EQ(numerics::up_column(W1Rows::kBlockPairs, I, 0), 128);
  EXPECT_EQ(numerics::gate_column(W1Rows::kBlockPairs, I, 130), 258);
  EXPECT_EQ(numerics::up_column(W1Rows::kBlockPairs, I, 255), 511);

  std::mt19937 rng(7);
  std::vector<std::uint8_t> halves(static_cast<size_t>(2 * I * K)), pairs(halves.size(), 0xAA);
  for (auto& b : halves) b = static_cast<std::uint8_t>(rng());
  std::vector<float> hs(static_cast<size_t>(2 * I / 128 * kb)), ps(hs.size(), -1.0f);
  for (size_t i = 0; i < hs.size(); ++i) hs[i] = static_cast<float>(i + 1);
  arrange_w1_block_pairs(I, K, halves.data(), hs.data(), pairs.data(), ps.data());
  for (int64_t c = 0; c < I; ++c)
    for (int64_t k = 0; k < K; ++k) {
      ASSERT_EQ(pairs[numerics::gate_column(W1Rows::kBlockPairs, I, c) * K + k], halves[c * K + k]) << c;
      ASSERT_EQ(pairs[numerics::up_column(W1Rows::kBlockPairs, I, c) * K + k], halves[(I + c) * K + k]) << c;
    }
  // Block rows: gate 0, up 0, gate 1, up 1 (halves: gate 0, gate 1, up 0, up 1).
  const std::vector<float> want = {1, 2, 5, 6, 3, 4, 7, 8};
  EXPECT_EQ(ps, want);
  EXPECT_THROW(arrange_w1_block_pairs(192, K, halves.data(), hs.data(), pairs.data(), ps.data()), Error);
  EXPECT_THROW(arrange_w1_block_pairs(I, K, halves.data(), hs.data(), halves.data(), ps.data()), Error);

  std::vector<float> h_row(static_cast<size_t>(2 * I)), p_row(h_row.size());
  for (auto& x : h_row) x = std::normal_distribution<float>(0.0f, 2.0f)(rng);
  for (int64_t c = 0; c < I; ++c) {
    p_row[static_cast<size_t>(numerics::gate_column(W1Rows::kBlockPairs, I, c))] = h_row[static_cast<size_t>(c)];
    p_row[static_cast<size_t>(numerics::up_column(W1Rows::kBlockPairs, I, c))] = h_row[static_cast<size_t>(I + c)];
  }
  const std::vector<bf16_t> hb = to_bf16(h_row), pb = to_bf16(p_row);
  std::vector<float> out_h(static_cast<size_t>(I)), out_p(static_cast<size_t>(I));
  activation_rows(Activation::kSilu, hb.data(), 1, 2 * I, 2 * I, out_h.data(), I, QuantScheme::kPerTokenPerChannel);
  activation_rows(Activation::kSilu, pb.data(), 1, 2 * I, 2 * I, out_p.data(), I, QuantScheme::kBlock128);
  EXPECT_EQ(out_h, out_p);
  // Block pairs need whole blocks.
  EXPECT_THROW(activation_rows(Activation::kSilu, hb.data(), 1, 64, 64, out_h.data(), 32, QuantScheme::kBlock128),
               Error);
}

TEST(Activation, BadWidthsThrow) {
  std::vector<bf16_t> in(64, 0);
  std::vector<float> out(64);
  std::vector<double> in_d(64), out_d(64);
  for (Activation act : all_activations()) {
    EXPECT_THROW(activation_rows(act, in.data(), 1, 0, 64, out.data(), 64), Error) << activation_name(act);
    EXPECT_THROW(activation_rows(act, in.data(), 1, -4, 64, out.data(), 64), Error) << activation_name(act);
    EXPECT_THROW(activation_rows(act, in.data(), -1, 8, 8, out.data(), 8), Error) << activation_name(act);
    EXPECT_THROW(activation_rows(act, in.data(), 2, 8, 7, out.data(), 8), Error) << activation_name(act);
    EXPECT_THROW(activation_rows(act, in.data(), 2, 8, 8, out.data(), activation_out_dim(act, 8) - 1), Error)
        << activation_name(act);
    EXPECT_THROW(activation_row_ref(act, in_d.data(), 0, out_d.data()), Error) << activation_name(act);
    if (is_gated(act)) {
      EXPECT_THROW(activation_rows(act, in.data(), 1, 7, 7, out.data(), 7), Error) << activation_name(act);
      EXPECT_THROW(activation_row_ref(act, in_d.data(), 7, out_d.data()), Error) << activation_name(act);
    } else {
      EXPECT_NO_THROW(activation_rows(act, in.data(), 1, 7, 7, out.data(), 7)) << activation_name(act);
    }
  }
  // Zero rows is fine (an expert with no tokens).
  EXPECT_NO_THROW(activation_rows(Activation::kSilu, nullptr, 0, 8, 8, nullptr, 4));
}

}  // namespace
}  // namespace moekit::cpu
