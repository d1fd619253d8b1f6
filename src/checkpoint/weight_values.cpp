// The value scans of weight_values.h: integer tests on the stored bits (a finite float is one whose
// exponent is not all ones; a finite positive one lies in [1, largest finite] as an unsigned integer),
// OR-reduced over blocks so the compiler vectorizes them; only a block with a bad element is searched.
#include "checkpoint/weight_values.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moekit/check.h"
#include "numerics/fp8.h"

namespace moekit::checkpoint {
namespace {

constexpr std::int64_t kBlock = 4096;

// Bad under the rule: not finite (exponent bits `exp` all set), or for positive ones outside
// [1, largest] as unsigned bits (zero, negative, Inf, NaN).
template <class U>
struct Test {
  U exp, largest;
  bool positive;
  bool bad(U x) const { return positive ? static_cast<U>(x - 1) >= largest : static_cast<U>(x & exp) == exp; }
};

// The mask of U's lanes replicated over 64 bits.
template <class U>
constexpr std::uint64_t lanes(U v) {
  std::uint64_t r = 0;
  for (std::size_t i = 0; i < 8 / sizeof(U); ++i) r |= static_cast<std::uint64_t>(v) << (8 * sizeof(U) * i);
  return r;
}

// Whether any of the n elements at p is not finite, 8 bytes at a time (SWAR): a lane's exponent bits
// (x & exp) plus the exponent's lowest bit carry into the lane's sign bit exactly when they are all
// ones, and never past the lane.
template <class U>
bool any_not_finite(const std::byte* p, std::int64_t n, U exp) {
  constexpr U kSign = static_cast<U>(U{1} << (8 * sizeof(U) - 1));
  const std::uint64_t e = lanes<U>(exp), low = lanes<U>(static_cast<U>(exp & (~exp + 1))), sign = lanes<U>(kSign);
  const std::int64_t bytes = n * static_cast<std::int64_t>(sizeof(U)), words = bytes / 8;
  std::uint64_t hit = 0;
  for (std::int64_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);
    hit |= ((w & e) + low) & sign;
  }
  for (std::int64_t i = words * 8; i < bytes; i += static_cast<std::int64_t>(sizeof(U))) {
    U x;
    std::memcpy(&x, p + i, sizeof(U));
    hit |= static_cast<U>(x & exp) == exp;
  }
  return hit != 0;
}

template <class U>
std::int64_t scan(const std::byte* data, std::int64_t begin, std::int64_t end, Test<U> t) {
  constexpr auto size = static_cast<std::int64_t>(sizeof(U));
  for (std::int64_t b = begin; b < end; b += kBlock) {
    const std::int64_t e = std::min(end, b + kBlock);
    if (!t.positive && !any_not_finite<U>(data + b * size, e - b, t.exp)) continue;
    for (std::int64_t i = b; i < e; ++i) {
      U x;
      std::memcpy(&x, data + i * size, sizeof(U));
      if (t.bad(x)) return i;
    }
  }
  return -1;
}

}  // namespace

std::int64_t first_bad_value(const std::byte* data, TensorDType dtype, std::int64_t begin, std::int64_t end,
                             ValueRule rule) {
  const bool positive = rule == ValueRule::kFinitePositive;
  switch (dtype) {
    case TensorDType::kF8E4M3: return scan<std::uint8_t>(data, begin, end, {0x7F, 0x7E, positive});
    case TensorDType::kBF16: return scan<std::uint16_t>(data, begin, end, {0x7F80, 0x7F7F, positive});
    case TensorDType::kF16: return scan<std::uint16_t>(data, begin, end, {0x7C00, 0x7BFF, positive});
    case TensorDType::kF32: return scan<std::uint32_t>(data, begin, end, {0x7F800000u, 0x7F7FFFFFu, positive});
    default: MOEKIT_FAIL("no value check for dtype {}", dtype_name(dtype));
  }
}

std::string value_text(const std::byte* data, TensorDType dtype, std::int64_t index) {
  double v = 0;
  switch (dtype) {
    case TensorDType::kF8E4M3: {
      const auto code = static_cast<std::uint8_t>(data[index]);
      if ((code & 0x7F) == 0x7F) return fmt::format("FP8 code {:#04x} (e4m3fn's NaN)", code);
      v = numerics::fp8_decode(code);
      break;
    }
    case TensorDType::kBF16: {
      std::uint16_t h;
      std::memcpy(&h, data + 2 * index, 2);
      v = numerics::bf16_decode(h);
      break;
    }
    case TensorDType::kF16: {
      std::uint16_t h;
      std::memcpy(&h, data + 2 * index, 2);
      const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
      v = exp == 0x1F ? (man ? NAN : INFINITY) : std::ldexp(exp ? 1024 + man : 2 * man, exp - 25);
      if (h & 0x8000) v = -v;
      break;
    }
    case TensorDType::kF32: {
      float f;
      std::memcpy(&f, data + 4 * index, 4);
      v = f;
      break;
    }
    default: return "?";
  }
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

std::string coordinates(const std::vector<std::int64_t>& shape, std::int64_t index) {
  std::vector<std::int64_t> at(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    at[d] = shape[d] > 0 ? index % shape[d] : 0;
    index = shape[d] > 0 ? index / shape[d] : 0;
  }
  return fmt::format("[{}]", fmt::join(at, ", "));
}

}  // namespace moekit::checkpoint
