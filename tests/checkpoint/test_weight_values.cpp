// The value scans of checkpoint/weight_values.h against a plain reference over every element: for
// each dtype and rule, a bad value planted at every kind of place (the first element, a block's
// edge, the tail after the last 8-byte word, past a good block) is found first, and only it; the
// values' words and coordinates in messages.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "checkpoint/weight_values.h"
#include "moekit/error.h"
#include "numerics/fp8.h"
#include "synthetic/random.h"

namespace moekit::checkpoint {
namespace {

struct Kind {
  TensorDType dtype;
  std::size_t size;
};

// n good values of the dtype (finite, > 0 when positive), little-endian.
std::vector<std::byte> good(const Kind& k, std::int64_t n, bool positive, std::uint64_t seed) {
  synthetic::SplitMix rng{seed};
  std::vector<std::byte> b(static_cast<std::size_t>(n) * k.size);
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = positive ? 0.001f + static_cast<float>(rng.next() % 1000) : rng.normal();
    std::byte* at = b.data() + static_cast<std::size_t>(i) * k.size;
    if (k.dtype == TensorDType::kF32) {
      std::memcpy(at, &v, 4);
    } else if (k.dtype == TensorDType::kBF16) {
      const std::uint16_t h = numerics::bf16_encode(v);
      std::memcpy(at, &h, 2);
    } else if (k.dtype == TensorDType::kF16) {
      const std::uint16_t h = static_cast<std::uint16_t>(positive ? 0x3C00 + rng.next() % 0x3000 : rng.next() % 0x7C00);
      std::memcpy(at, &h, 2);  // finite halves (positive: [1, 2^12))
    } else {
      *at = static_cast<std::byte>(positive ? 1 + rng.next() % 0x7E : rng.next() % 0x7F | (rng.next() % 2) << 7);
    }
  }
  return b;
}

// The bad values of a dtype under a rule, as stored bits.
std::vector<std::uint32_t> bad_bits(TensorDType d, bool positive) {
  std::vector<std::uint32_t> v;
  switch (d) {
    case TensorDType::kF32: v = {0x7FC00000u, 0x7F800000u, 0xFF800000u, 0xFFC00001u}; break;
    case TensorDType::kBF16: v = {0x7FC0, 0x7F80, 0xFF80, 0xFF81}; break;
    case TensorDType::kF16: v = {0x7E00, 0x7C00, 0xFC00}; break;
    default: v = {0x7F, 0xFF};
  }
  if (positive) {
    if (d == TensorDType::kF32) v.insert(v.end(), {0u, 0x80000000u, 0xBF000000u});  // 0, -0, -0.5
    if (d == TensorDType::kBF16) v.insert(v.end(), {0u, 0x8000u, 0xBF00u});
    if (d == TensorDType::kF16) v.insert(v.end(), {0u, 0x8000u, 0xB800u});
  }
  return v;
}

TEST(WeightValues, TheFirstBadValueIsFoundWhereverItIs) {
  const std::vector<Kind> kinds = {
      {TensorDType::kF8E4M3, 1}, {TensorDType::kBF16, 2}, {TensorDType::kF16, 2}, {TensorDType::kF32, 4}};
  const std::int64_t n = 4096 * 2 + 13;  // two full blocks and a tail past the last 8-byte word
  for (const Kind& k : kinds) {
    for (const bool positive : {false, true}) {
      if (k.dtype == TensorDType::kF8E4M3 && positive) continue;
      const ValueRule rule = positive ? ValueRule::kFinitePositive : ValueRule::kFinite;
      const std::string ctx = std::string(dtype_name(k.dtype)) + (positive ? " positive" : " finite");
      const std::vector<std::byte> ok = good(k, n, positive, 3);
      EXPECT_EQ(first_bad_value(ok.data(), k.dtype, 0, n, rule), -1) << ctx;
      for (const std::uint32_t bits : bad_bits(k.dtype, positive)) {
        for (const std::int64_t at : {std::int64_t{0}, std::int64_t{4095}, std::int64_t{4096}, n - 1, n - 6}) {
          std::vector<std::byte> b = ok;
          std::memcpy(b.data() + static_cast<std::size_t>(at) * k.size, &bits, k.size);
          EXPECT_EQ(first_bad_value(b.data(), k.dtype, 0, n, rule), at) << ctx << " bits " << bits << " at " << at;
          // A range that ends before it, or begins after it, has none.
          EXPECT_EQ(first_bad_value(b.data(), k.dtype, 0, at, rule), -1) << ctx << " at " << at;
          EXPECT_EQ(first_bad_value(b.data(), k.dtype, at + 1, n, rule), -1) << ctx << " at " << at;
          if (at > 0) {  // two bad values: the first is named
            std::memcpy(b.data() + static_cast<std::size_t>(at - 1) * k.size, &bits, k.size);
            EXPECT_EQ(first_bad_value(b.data(), k.dtype, 0, n, rule), at - 1) << ctx << " at " << at;
          }
        }
      }
    }
  }
  // Finite weights may be zero or negative; only scales must be > 0.
  const float zero = 0.0f, negative = -3.0f;
  EXPECT_EQ(first_bad_value(reinterpret_cast<const std::byte*>(&zero), TensorDType::kF32, 0, 1, ValueRule::kFinite),
            -1);
  EXPECT_EQ(first_bad_value(reinterpret_cast<const std::byte*>(&negative), TensorDType::kF32, 0, 1, ValueRule::kFinite),
            -1);
  EXPECT_THROW(first_bad_value(nullptr, TensorDType::kI32, 0, 1, ValueRule::kFinite), Error);
}

TEST(WeightValues, ValuesAndCoordinatesInWords) {
  const float f[] = {NAN, -INFINITY, -0.5f};
  const auto* b = reinterpret_cast<const std::byte*>(f);
  EXPECT_EQ(value_text(b, TensorDType::kF32, 0), "NaN");
  EXPECT_EQ(value_text(b, TensorDType::kF32, 1), "-Inf");
  EXPECT_EQ(value_text(b, TensorDType::kF32, 2), "-0.5");
  const std::uint8_t codes[] = {0x7F, 0xFF, 0x38};
  const auto* c = reinterpret_cast<const std::byte*>(codes);
  EXPECT_EQ(value_text(c, TensorDType::kF8E4M3, 0), "FP8 code 0x7f (e4m3fn's NaN)");
  EXPECT_EQ(value_text(c, TensorDType::kF8E4M3, 1), "FP8 code 0xff (e4m3fn's NaN)");
  EXPECT_EQ(value_text(c, TensorDType::kF8E4M3, 2), "1");
  const std::uint16_t halves[] = {0x7C00, 0x3800, 0x0001};
  const auto* h = reinterpret_cast<const std::byte*>(halves);
  EXPECT_EQ(value_text(h, TensorDType::kF16, 0), "+Inf");
  EXPECT_EQ(value_text(h, TensorDType::kF16, 1), "0.5");
  EXPECT_EQ(value_text(h, TensorDType::kF16, 2), fmt::format("{}", std::ldexp(1.0, -24)));
  EXPECT_EQ(coordinates({256, 128}, 1000), "[7, 104]");
  EXPECT_EQ(coordinates({4, 2, 3}, 23), "[3, 1, 2]");
  EXPECT_EQ(coordinates({}, 0), "[]");
}

}  // namespace
}  // namespace moekit::checkpoint
