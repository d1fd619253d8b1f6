// The grouped 16-bit GEMMs (cuda/grouped_gemm.h, GroupedGemmLaunch::operand bf16 / fp16: no
// scales) alone, on operands this test writes, for every config of the table with 16-bit
// instances (plan::GemmConfigInfo::sixteen_bit) and both dtypes. Asserts:
// - every valid row of every group against a float64 sum of the same 16-bit inputs, within the
//   output's rounding (half an ulp of bf16 / fp16) plus fp32 summation over K;
// - groups of 0, 5, 70 and 300 rows (empty, one partial tile, a ragged last tile, several tiles)
//   and a K that is no multiple of the K tile;
// - rows past a group's valid rows are never written (their D keeps its poison) and never read
//   into a result (their A rows are NaN);
// - a config without 16-bit instances, and an operand that is neither bf16 nor fp16, raise
//   moekit::Error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cuda/grouped_gemm.h"
#include "cuda/launch.h"
#include "gpu_test_util.h"
#include "moekit/error.h"
#include "moekit/memory.h"
#include "numerics/fp8.h"
#include "plan/gemm_config.h"
#include "test_names.h"

namespace moekit {
namespace {

constexpr std::uint16_t kPoison16 = 0xFFFF;  // a NaN in bf16 and fp16 alike

// 16-bit element codecs on the host: bf16 through numerics/fp8.h, fp16 through the compiler's _Float16.
std::uint16_t encode(DType t, float x) {
  if (t == DType::kBf16) return numerics::bf16_encode(x);
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t bits = 0;
  std::memcpy(&bits, &h, 2);
  return bits;
}
double decode(DType t, std::uint16_t bits) {
  if (t == DType::kBf16) return numerics::bf16_decode(bits);
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<double>(h);
}
// Unit roundoff of the output: 2^-8 (bf16, 8 significant bits), 2^-11 (fp16).
double unit_roundoff(DType t) {
  return t == DType::kBf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}

struct Case {
  plan::GemmConfig config;
  DType dtype;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << plan::gemm_config_info(c.config).name << " " << dtype_name(c.dtype);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& c : plan::kGemmConfigs)
    if (c.sixteen_bit)
      for (const DType t : {DType::kBf16, DType::kFp16}) out.push_back({c.id, t});
  return out;
}

class GroupedSixteenBitGemm : public ::testing::TestWithParam<Case> {};

TEST_P(GroupedSixteenBitGemm, ValidRowsMatchFloat64AndPaddingIsUntouched) {
  MOEKIT_REQUIRE_GPU();
  const Case tc = GetParam();
  const plan::GemmConfigInfo& info = plan::gemm_config_info(tc.config);
  const std::vector<int> m = {0, 5, 70, 300};
  const int groups = static_cast<int>(m.size());
  const int cap = 304;  // rows a group holds (batched layout): rows m..cap-1 are padding
  const std::int64_t n = 256, k = 200;
  ASSERT_TRUE(plan::supports_sixteen_bit(info, n, k));
  ASSERT_FALSE(plan::supports_sixteen_bit(info, n, 100)) << "k % 8 != 0 has no 16-byte TMA rows";

  // Operands: values in [-1, 1) rounded to the dtype; padding rows of A are NaN.
  std::mt19937_64 rng(0x16b17ULL + static_cast<std::uint64_t>(tc.config) * 7 + static_cast<std::uint64_t>(tc.dtype));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> A(static_cast<std::size_t>(groups * cap * k)), B(static_cast<std::size_t>(groups * n * k));
  for (int g = 0; g < groups; ++g)
    for (int r = 0; r < cap; ++r)
      for (std::int64_t c = 0; c < k; ++c)
        A[static_cast<std::size_t>((g * cap + r) * k + c)] = r < m[g] ? encode(tc.dtype, u(rng)) : kPoison16;
  for (auto& b : B) b = encode(tc.dtype, u(rng));

  const auto memory = make_memory(Device::kCuda);
  auto upload = [&](const std::vector<std::uint16_t>& host, std::string_view what) {
    DeviceBuffer b(*memory, static_cast<std::int64_t>(host.size() * 2), what);
    memory->from_host(b.get(), host.data(), b.bytes(), nullptr);
    return b;
  };
  const DeviceBuffer dA = upload(A, "A"), dB = upload(B, "B");
  DeviceBuffer dD(*memory, static_cast<std::int64_t>(groups) * cap * n * 2, "D");
  memory->fill(dD.get(), 0xFF, dD.bytes(), nullptr);
  DeviceBuffer scratch(*memory, cuda::kGemmScratchBytes, "gemm_scratch");

  // The arguments as the experts' prepare kernel writes them (cuda/experts.cu), swapped or not.
  std::vector<std::byte> args(static_cast<std::size_t>(groups * cuda::kGemmArgsBytesPerGroup));
  DeviceBuffer dArgs(*memory, static_cast<std::int64_t>(args.size()), "gemm_args");
  const cuda::GroupedGemmArrays a = cuda::GroupedGemmArrays::at(args.data(), groups);
  for (int g = 0; g < groups; ++g) {
    const void* tokens = dA.as<std::uint16_t>() + static_cast<std::int64_t>(g) * cap * k;
    const void* weights = dB.as<std::uint16_t>() + static_cast<std::int64_t>(g) * n * k;
    a.ptr_D[g] = dD.as<std::uint16_t>() + static_cast<std::int64_t>(g) * cap * n;
    a.ptr_col[g] = a.ptr_row[g] = nullptr;
    a.stride_A[g] = a.stride_B[g] = k;
    a.stride_D[g] = n;
    int* shape = a.shapes + 3 * g;
    shape[0] = info.swap_ab ? static_cast<int>(n) : m[g];
    shape[1] = info.swap_ab ? m[g] : static_cast<int>(n);
    shape[2] = static_cast<int>(k);
    a.ptr_A[g] = info.swap_ab ? weights : tokens;
    a.ptr_B[g] = info.swap_ab ? tokens : weights;
  }
  // `a` lays the arrays out in host memory (device pointers as values); the kernel reads a copy.
  memory->from_host(dArgs.get(), args.data(), dArgs.bytes(), nullptr);

  cuda::GroupedGemmLaunch l;
  l.args = dArgs.as<std::byte>();
  l.groups = groups;
  l.n = n;
  l.k = k;
  l.operand = tc.dtype;
  l.scratch = scratch.as<std::byte>();
  l.scratch_bytes = scratch.bytes();
  l.num_sms = cuda::current_device_num_sms();
  cuda::grouped_fp8_gemm(tc.config, l, nullptr);
  std::vector<std::uint16_t> D(static_cast<std::size_t>(groups * cap * n));
  memory->to_host(D.data(), dD.get(), dD.bytes(), nullptr);  // synchronizes

  const double ur = unit_roundoff(tc.dtype);
  int bad = 0, written_padding = 0;
  for (int g = 0; g < groups; ++g) {
    for (int r = 0; r < cap; ++r) {
      for (std::int64_t c = 0; c < n; ++c) {
        const std::uint16_t got = D[static_cast<std::size_t>((g * cap + r) * n + c)];
        if (r >= m[g]) {
          written_padding += got != kPoison16;
          continue;
        }
        double ref = 0, abs_sum = 0;
        for (std::int64_t i = 0; i < k; ++i) {
          const double x = decode(tc.dtype, A[static_cast<std::size_t>((g * cap + r) * k + i)]) *
                           decode(tc.dtype, B[static_cast<std::size_t>((g * n + c) * k + i)]);
          ref += x;
          abs_sum += std::fabs(x);
        }
        // The output's rounding (half an ulp, relative) plus fp32 sums over K in any order.
        const double tol = ur * std::fabs(ref) + static_cast<double>(k) * std::ldexp(1.0, -24) * abs_sum;
        const double v = decode(tc.dtype, got);
        if (!(std::fabs(v - ref) <= tol) && bad++ < 5)
          ADD_FAILURE() << "group " << g << " row " << r << " col " << c << ": " << v << " against " << ref
                        << " (tolerance " << tol << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(written_padding, 0) << "D rows past a group's valid rows were written";
}

INSTANTIATE_TEST_SUITE_P(Configs, GroupedSixteenBitGemm, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return testing::test_name(std::string(plan::gemm_config_info(i.param.config).name) + "_" +
                                                     std::string(dtype_name(i.param.dtype)));
                         });

TEST(GroupedSixteenBitGemmRefusal, ConfigWithoutSixteenBitInstancesAndOtherOperandsRaise) {
  MOEKIT_REQUIRE_GPU();
  cuda::GroupedGemmLaunch l;
  l.groups = 1;
  l.n = 256;
  l.k = 256;
  l.operand = DType::kBf16;
  for (const auto& c : plan::kGemmConfigs)
    if (!c.sixteen_bit) EXPECT_THROW(cuda::grouped_fp8_gemm(c.id, l, nullptr), Error) << c.name;
  l.operand = DType::kFp32;
  EXPECT_THROW(cuda::grouped_fp8_gemm(plan::GemmConfig::kCooperative128x128, l, nullptr), Error);
}

}  // namespace
}  // namespace moekit
