// numerics/fp8.h against the formats' definitions, written here independently: every e4m3fn code
// decoded, a dense sweep of floats encoded (nearest value, ties to even, saturation, NaN, signed
// zero), and bf16 round-to-nearest-even. The GPU conversions are checked against numerics/fp8.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "numerics/fp8.h"

namespace moekit::numerics {
namespace {

// --- e4m3fn by definition -------------------------------------------------------------------------

// S.EEEE.MMM, bias 7: normal (1 + M/8) * 2^(E-7), subnormal M * 2^-9, S.1111.111 is NaN.
double e4m3_by_definition(int code) {
  const int sign = (code >> 7) & 1;
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -magnitude : magnitude;
}

// The 127 finite non-negative values, ascending with the code (codes 0x00..0x7E).
const std::vector<double>& e4m3_positive_values() {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int c = 0; c <= 0x7E; ++c) v.push_back(e4m3_by_definition(c));
    return v;
  }();
  return values;
}

// Nearest finite e4m3 value, ties to the even code, |x| > 448 saturates, NaN -> 0x7F, sign kept.
// Distances are compared as 2|x| against lo + hi: both exact in double, unlike |x| - lo for a tiny x.
fp8_t e4m3_encode_by_definition(float x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return static_cast<fp8_t>(sign | 0x7F);
  const double a = std::fabs(static_cast<double>(x));
  if (a > 448.0) return static_cast<fp8_t>(sign | 0x7E);
  const auto& v = e4m3_positive_values();
  const auto it = std::lower_bound(v.begin(), v.end(), a);  // first value >= a; a <= 448 so it exists
  int code = static_cast<int>(it - v.begin());
  if (*it != a) {
    const int lo = code - 1;  // a > 0 here, and v[0] = 0 < a
    const double twice = 2.0 * a, sum = v[static_cast<std::size_t>(lo)] + *it;
    if (twice < sum || (twice == sum && lo % 2 == 0)) code = lo;
  }
  return static_cast<fp8_t>(sign | code);
}

std::string hex_float(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a (bits 0x%08x)", static_cast<double>(x), std::bit_cast<std::uint32_t>(x));
  return buf;
}

TEST(Fp8Decode, AllCodesMatchDefinition) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_by_definition(c);
    const float got = fp8_decode(static_cast<fp8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code 0x" << std::hex << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code 0x" << std::hex << c;
    }
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code 0x" << std::hex << c;
  }
  // Landmarks of the format.
  EXPECT_EQ(fp8_decode(0x7E), 448.0f);
  EXPECT_EQ(fp8_decode(0xFE), -448.0f);
  EXPECT_EQ(fp8_decode(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(fp8_decode(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(fp8_decode(0x38), 1.0f);
  EXPECT_TRUE(std::isnan(fp8_decode(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_decode(0xFF)));
  EXPECT_EQ(fp8_decode(0x78), 256.0f);  // e4m3fn has no infinity: 1111.000 is a normal value
  EXPECT_EQ(kFp8Max, 448.0f);
}

TEST(Fp8Encode, RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<fp8_t>(c);
    // NaN codes re-encode as S.1111.111 too: the sign survives decode and encode.
    EXPECT_EQ(fp8_encode(fp8_decode(code)), code) << "code 0x" << std::hex << c;
  }
}

// Encodes x with numerics.h and by definition; returns true when they agree (reports the first few misses).
bool check_encode(float x, int& failures) {
  const fp8_t got = fp8_encode(x), want = e4m3_encode_by_definition(x);
  if (got == want) return true;
  if (++failures <= 10)
    ADD_FAILURE() << "fp8_encode(" << hex_float(x) << ") = 0x" << std::hex << int(got) << ", want 0x" << int(want);
  return false;
}

TEST(Fp8Encode, StridedSweepOfAllFloatBitPatterns) {
  // A stride of 257 over 2^32 patterns: ~16.7M floats, every exponent of both signs; the stride is
  // odd, so every value of the low 20 bits (all that rounding to 3 mantissa bits looks at) occurs 16
  // times: ties, and tails just either side of them, in every binade.
  int failures = 0;
  std::int64_t count = 0;
  for (std::uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 257, ++count)
    check_encode(std::bit_cast<float>(static_cast<std::uint32_t>(bits)), failures);
  EXPECT_EQ(failures, 0) << "of " << count << " floats";
}

TEST(Fp8Encode, MidpointsAndNeighbours) {
  // Around every pair of adjacent e4m3 values: the values, the midpoint (a tie: exactly representable
  // in float, 5 significant bits), and the floats just below and above each.
  int failures = 0;
  const auto& v = e4m3_positive_values();
  std::vector<float> probes;
  const auto around = [&probes](float p) {
    probes.push_back(p);
    probes.push_back(std::nextafter(p, 0.0f));
    probes.push_back(std::nextafter(p, std::numeric_limits<float>::infinity()));
  };
  for (std::size_t i = 0; i < v.size(); ++i) {
    around(static_cast<float>(v[i]));
    if (i + 1 < v.size()) {
      const double mid = (v[i] + v[i + 1]) / 2;
      ASSERT_EQ(static_cast<double>(static_cast<float>(mid)), mid);
      around(static_cast<float>(mid));
    }
  }
  // Beyond 448: 464 is the midpoint to the next (nonexistent) binade value 480; all saturate.
  for (float p : {448.5f, 463.9f, 464.0f, 465.0f, 480.0f, 512.0f, 1e4f, 1e38f, std::numeric_limits<float>::max()})
    around(p);
  for (float p : probes) {
    check_encode(p, failures);
    check_encode(-p, failures);
  }
  EXPECT_EQ(failures, 0);
  // The tie rule spelled out on hand cases: 1.0625 lies between 1.0 (0x38, even) and 1.125 (0x39).
  EXPECT_EQ(fp8_encode(1.0625f), 0x38);
  EXPECT_EQ(fp8_encode(1.1875f), 0x3A);    // between 0x39 and 0x3A (even)
  EXPECT_EQ(fp8_encode(0x1p-10f), 0x00);   // half the smallest subnormal: tie to 0 (even)
  EXPECT_EQ(fp8_encode(0x3p-10f), 0x02);   // 1.5 * 2^-9: tie between 0x01 and 0x02 (even)
  EXPECT_EQ(fp8_encode(-0x1p-10f), 0x80);  // rounds to zero, keeps the sign
  EXPECT_EQ(fp8_encode(0x1.ep-7f), 0x08);  // 7.5 * 2^-9: tie between 0x07 and 0x08 (smallest normal, even)
  EXPECT_EQ(fp8_encode(432.0f), 0x7E);     // between 416 (0x7D) and 448 (0x7E, even)
}

TEST(Fp8Encode, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fp8_encode(0.0f), 0x00);
  EXPECT_EQ(fp8_encode(-0.0f), 0x80);
  EXPECT_EQ(fp8_encode(inf), 0x7E);
  EXPECT_EQ(fp8_encode(-inf), 0xFE);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(fp8_encode(-1e38f), 0xFE);
  EXPECT_EQ(fp8_encode(448.0f), 0x7E);
  EXPECT_EQ(fp8_encode(std::nextafter(448.0f, inf)), 0x7E);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(fp8_encode(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::signaling_NaN()), 0x7F);
  EXPECT_EQ(fp8_encode(std::bit_cast<float>(0x7F800001u)), 0x7F);  // smallest NaN payload
  EXPECT_EQ(fp8_encode(std::bit_cast<float>(0xFFFFFFFFu)), 0xFF);
  // Denormal floats are far below half the smallest subnormal e4m3 (2^-10): they round to signed zero.
  for (std::uint32_t bits : {0x00000001u, 0x00000400u, 0x007FFFFFu, 0x00800000u}) {
    EXPECT_EQ(fp8_encode(std::bit_cast<float>(bits)), 0x00) << hex_float(std::bit_cast<float>(bits));
    EXPECT_EQ(fp8_encode(std::bit_cast<float>(bits | 0x80000000u)), 0x80);
  }
  int failures = 0;
  for (float x : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()})
    check_encode(x, failures);
  EXPECT_EQ(failures, 0);
}

// --- bf16 by definition ---------------------------------------------------------------------------

// Value of a non-negative bf16 code, with 0x7F80 read as 2^128: the next value of an unbounded
// exponent, which is where round-to-nearest-even decides between bf16 max and overflow to infinity.
double bf16_magnitude_unbounded(std::uint32_t code) {
  if (code == 0x7F80u) return std::ldexp(1.0, 128);
  return static_cast<double>(std::bit_cast<float>(code << 16));
}

bf16_t bf16_encode_by_definition(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  if (std::isinf(x)) return static_cast<bf16_t>(sign | 0x7F80u);
  const double a = std::fabs(static_cast<double>(x));
  const std::uint32_t lo = (bits & 0x7FFFFFFFu) >> 16;  // truncation: the value at or below |x|
  const double lo_v = bf16_magnitude_unbounded(lo), hi_v = bf16_magnitude_unbounded(lo + 1);
  std::uint32_t code = lo;
  if (a != lo_v) {
    const double twice = 2.0 * a, sum = lo_v + hi_v;
    if (twice > sum || (twice == sum && lo % 2 == 1)) code = lo + 1;
  }
  return static_cast<bf16_t>(sign | code);
}

// Every `stride`-th float bit pattern (NaNs aside): `encode` equals `by_definition`, bit for bit.
template <class Encode, class ByDefinition>
void expect_strided_sweep(const char* name, std::uint64_t stride, Encode encode, ByDefinition by_definition) {
  int failures = 0;
  std::int64_t count = 0;
  for (std::uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += stride, ++count) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    if (std::isnan(x)) continue;
    const std::uint16_t got = encode(x), want = by_definition(x);
    if (got != want && ++failures <= 10)
      ADD_FAILURE() << name << "(" << hex_float(x) << ") = 0x" << std::hex << got << ", want 0x" << want;
  }
  EXPECT_EQ(failures, 0) << "of " << count << " floats";
}

TEST(Bf16, StridedSweepRoundsToNearestEven) {
  expect_strided_sweep("bf16_encode", 257, bf16_encode, bf16_encode_by_definition);
}

TEST(Bf16, TiesAndNeighbours) {
  // Every bf16 code: the value round-trips; the tie above it (bit 15 set, nothing below) goes to the
  // even of the two neighbours; one float either side of the tie goes to the nearer one.
  int failures = 0;
  for (std::uint32_t code = 0; code < 0x10000u; ++code) {
    const std::uint32_t bits = code << 16;
    const float x = std::bit_cast<float>(bits);
    if (std::isnan(x)) continue;
    const auto expect = [&](std::uint32_t b, bf16_t want) {
      const bf16_t got = bf16_encode(std::bit_cast<float>(b));
      if (got != want && ++failures <= 10)
        ADD_FAILURE() << "bf16_encode(bits 0x" << std::hex << b << ") = 0x" << got << ", want 0x" << want;
    };
    expect(bits, static_cast<bf16_t>(code));
    if (std::isinf(x)) continue;
    const auto up = static_cast<bf16_t>(code + 1);  // the next magnitude (may be infinity)
    expect(bits | 0x8000u, (code & 1u) ? up : static_cast<bf16_t>(code));
    expect(bits | 0x7FFFu, static_cast<bf16_t>(code));
    expect(bits | 0x8001u, up);
  }
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(bf16_encode(1.0f), 0x3F80);
  EXPECT_EQ(bf16_encode(std::bit_cast<float>(0x3F808000u)), 0x3F80);  // tie, 0x3F80 even
  EXPECT_EQ(bf16_encode(std::bit_cast<float>(0x3F818000u)), 0x3F82);  // tie, 0x3F82 even
  EXPECT_EQ(bf16_encode(std::bit_cast<float>(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bf16_encode(std::numeric_limits<float>::max()), 0x7F80);  // rounds up past bf16 max: inf
  EXPECT_EQ(bf16_encode(-std::numeric_limits<float>::max()), 0xFF80);
  EXPECT_EQ(bf16_encode(-0.0f), 0x8000);
  EXPECT_EQ(bf16_decode(0x3F80), 1.0f);
  EXPECT_EQ(bf16_decode(0xC000), -2.0f);
}

TEST(Bf16, InfAndNanSurvive) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(bf16_encode(inf), 0x7F80);
  EXPECT_EQ(bf16_encode(-inf), 0xFF80);
  EXPECT_TRUE(std::isinf(bf16_decode(bf16_encode(inf))));
  // NaNs whose payload lives only in the low 16 bits would truncate to infinity: they must stay NaN.
  for (std::uint32_t bits :
       {0x7FC00000u, 0x7F800001u, 0x7F80FFFFu, 0x7FBFFFFFu, 0xFF800001u, 0xFFC00000u, 0xFFFFFFFFu}) {
    const float x = std::bit_cast<float>(bits);
    const bf16_t b = bf16_encode(x);
    EXPECT_TRUE(std::isnan(bf16_decode(b))) << hex_float(x) << " -> 0x" << std::hex << b;
    EXPECT_EQ(std::signbit(bf16_decode(b)), std::signbit(x)) << hex_float(x);
  }
}

// --- fp16 by definition ---------------------------------------------------------------------------

// Value of a non-negative fp16 code by its fields (0x7C00 read as 2^16: the next value of an unbounded
// exponent, where round-to-nearest-even decides between 65504 and infinity).
double fp16_magnitude_unbounded(std::uint32_t code) {
  const std::uint32_t e = code >> 10, m = code & 0x3FFu;
  if (e == 0) return std::ldexp(static_cast<double>(m), -24);
  return std::ldexp(1.0 + static_cast<double>(m) / 1024.0, static_cast<int>(e) - 15);
}

fp16_t fp16_encode_by_definition(float x) {
  const std::uint32_t sign = (std::bit_cast<std::uint32_t>(x) >> 16) & 0x8000u;
  const double a = std::fabs(static_cast<double>(x));
  if (std::isinf(x) || a >= fp16_magnitude_unbounded(0x7C00u)) return static_cast<fp16_t>(sign | 0x7C00u);
  std::uint32_t lo = 0, hi = 0x7C00u;  // the largest code at or below a: binary search, values increase
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    (fp16_magnitude_unbounded(mid) <= a ? lo : hi) = mid;
  }
  const double lo_v = fp16_magnitude_unbounded(lo), hi_v = fp16_magnitude_unbounded(lo + 1);
  std::uint32_t code = lo;
  if (a != lo_v) {
    const double twice = 2.0 * a, sum = lo_v + hi_v;
    if (twice > sum || (twice == sum && lo % 2 == 1)) code = lo + 1;
  }
  return static_cast<fp16_t>(sign | code);
}

TEST(Fp16, EveryCodeDecodesToItsValue) {
  int failures = 0;
  for (std::uint32_t code = 0; code < 0x10000u; ++code) {
    const float got = fp16_decode(static_cast<fp16_t>(code));
    const std::uint32_t mag = code & 0x7FFFu;
    if (mag > 0x7C00u) {
      if (!std::isnan(got) && ++failures <= 10) ADD_FAILURE() << "fp16_decode(0x" << std::hex << code << ") not NaN";
      continue;
    }
    const double want = (code & 0x8000u ? -1.0 : 1.0) *
                        (mag == 0x7C00u ? std::numeric_limits<double>::infinity() : fp16_magnitude_unbounded(mag));
    if (static_cast<double>(got) != want && ++failures <= 10)
      ADD_FAILURE() << "fp16_decode(0x" << std::hex << code << ") = " << got << ", want " << want;
    if (fp16_encode(got) != code && ++failures <= 10)  // every value round-trips, -0 and inf included
      ADD_FAILURE() << "fp16_encode(fp16_decode(0x" << std::hex << code << ")) = 0x" << fp16_encode(got);
  }
  EXPECT_EQ(failures, 0);
}

TEST(Fp16, StridedSweepRoundsToNearestEven) {
  expect_strided_sweep("fp16_encode", 4099, fp16_encode, fp16_encode_by_definition);
}

TEST(Fp16, TiesRangeEdgesAndNan) {
  // Every finite code: the ties above it go to the even neighbour, one float either side to the nearer.
  int failures = 0;
  for (std::uint32_t code = 0; code < 0x7C00u; ++code) {
    const double lo = fp16_magnitude_unbounded(code), hi = fp16_magnitude_unbounded(code + 1);
    const auto tie = static_cast<float>((lo + hi) / 2);  // exact in float: 12 significant bits at most
    const auto expect = [&](float x, std::uint32_t want) {
      if (fp16_encode(x) != want && ++failures <= 10)
        ADD_FAILURE() << "fp16_encode(" << hex_float(x) << ") = 0x" << std::hex << fp16_encode(x) << ", want 0x"
                      << want;
    };
    expect(tie, code % 2 == 1 ? code + 1 : code);
    expect(std::nextafter(tie, 0.0f), code);
    expect(std::nextafter(tie, 1e9f), code + 1);
  }
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(fp16_encode(65504.0f), 0x7BFF);
  EXPECT_EQ(fp16_encode(65519.99f), 0x7BFF);  // below the tie with 2^16: rounds down to the largest
  EXPECT_EQ(fp16_encode(65520.0f), 0x7C00);   // the tie: rounds to even, which is infinity
  EXPECT_EQ(fp16_encode(-1e6f), 0xFC00);
  EXPECT_EQ(fp16_encode(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(fp16_encode(0x1p-25f), 0x0000);  // half the smallest subnormal: tie to even 0
  EXPECT_EQ(fp16_encode(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(fp16_encode(-0.0f), 0x8000);
  EXPECT_EQ(fp16_decode(0x3C00), 1.0f);
  EXPECT_EQ(fp16_decode(0x7BFF), kFp16Max);
  for (std::uint32_t bits : {0x7FC00000u, 0x7F800001u, 0xFFC00000u, 0x7F801000u})
    EXPECT_TRUE(std::isnan(fp16_decode(fp16_encode(std::bit_cast<float>(bits))))) << std::hex << bits;
}

}  // namespace
}  // namespace moekit::numerics
