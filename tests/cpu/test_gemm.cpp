// fp8_gemm against the float64 fp8_gemm_ref for every quantization scheme on odd and DeepSeek-like
// shapes; poisoned outputs, untouched ldd padding, bit-identity across row batching and thread
// counts, exact decoding of all 256 FP8 codes, and rejection of bad arguments.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/gemm.h"
#include "moekit/error.h"

namespace moekit::cpu {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr bf16_t kBf16Nan = 0x7FC1;  // a NaN payload the kernel never produces

// Quantized operands built here (not with cpu/quant.cpp): random normals times a per-row
// magnitude, encoded with fp8_encode after dividing by a scale of amax/448 of their group.
struct Operands {
  std::int64_t M, N, K, lda, ldb;
  QuantScheme quant;
  std::vector<fp8_t> A, B;
  std::vector<float> sa, sb;
};

std::int64_t num_kb(std::int64_t K) {
  return (K + kQuantBlock - 1) / kQuantBlock;
}

Operands make_operands(QuantScheme quant, std::int64_t M, std::int64_t N, std::int64_t K, std::uint64_t seed) {
  Operands op{M, N, K, K + 3, K + 5, quant, {}, {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(0.25f, 4.0f);
  std::uniform_real_distribution<float> scale(0.001f, 0.01f);
  // Codes: fp8_encode of normals spread over about 2^-4..2^8 (subnormals included), never NaN.
  auto fill = [&](std::vector<fp8_t>& q, std::int64_t rows, std::int64_t ld) {
    q.assign(static_cast<std::size_t>(rows * ld), 0x7F);  // padding holds NaN codes: must be ignored
    for (std::int64_t r = 0; r < rows; ++r) {
      const float row_mag = mag(rng) * 40.0f;
      for (std::int64_t k = 0; k < K; ++k) {
        fp8_t code = fp8_encode(normal(rng) * row_mag);
        if (code == 0x00 || code == 0x80) code = 0x01;  // no zeros: every product matters
        q[static_cast<std::size_t>(r * ld + k)] = code;
      }
    }
  };
  fill(op.A, M, op.lda);
  fill(op.B, N, op.ldb);
  const std::int64_t nkb = num_kb(K);
  const std::int64_t sa_count = quant == QuantScheme::kPerTensor            ? 1
                                : quant == QuantScheme::kPerTokenPerChannel ? M
                                                                            : M * nkb;
  const std::int64_t sb_count = quant == QuantScheme::kPerTensor            ? 1
                                : quant == QuantScheme::kPerTokenPerChannel ? N
                                                                            : num_kb(N) * nkb;
  for (std::int64_t i = 0; i < sa_count; ++i) op.sa.push_back(scale(rng));
  for (std::int64_t i = 0; i < sb_count; ++i) op.sb.push_back(scale(rng));
  return op;
}

Fp8GemmArgs args_for(const Operands& op, std::int64_t row0, std::int64_t rows) {
  Fp8GemmArgs a;
  a.M = rows;
  a.N = op.N;
  a.K = op.K;
  a.quant = op.quant;
  a.A = op.A.data() + row0 * op.lda;
  a.lda = op.lda;
  a.a_scales = op.sa.data() + (op.quant == QuantScheme::kPerTensor            ? 0
                               : op.quant == QuantScheme::kPerTokenPerChannel ? row0
                                                                              : row0 * num_kb(op.K));
  a.B = op.B.data();
  a.ldb = op.ldb;
  a.b_scales = op.sb.data();
  return a;
}

std::string describe(const Operands& op) {
  return std::string(quant_name(op.quant)) + " M=" + std::to_string(op.M) + " N=" + std::to_string(op.N) +
         " K=" + std::to_string(op.K);
}

// Runs fp32 and bf16 outputs into NaN-poisoned buffers with ldd = N + 2 and checks them against
// the float64 reference.
// Bounds: operands are exact FP8 values and their products exact in fp32, so the only fp32 error is
// the rounding of each running sum (<= 2^-24 of the partial sum). Random signs make the errors a
// random walk: relative Frobenius error ~ 2^-24 * sqrt(K/2) = 3.6e-6 at K=7168; the scale
// multiplications add a few 2^-24. Bound 1e-5 (~3x margin at the largest K). bf16 output adds one
// rounding to 8 significant bits, relative <= 2^-8 = 3.9e-3 per element; bound 8e-3. The bf16
// result must also equal bf16_encode of the fp32 result exactly.
void check_case(const Operands& op, ThreadPool& pool) {
  const std::int64_t ldd = op.N + 2;
  std::vector<double> ref(static_cast<std::size_t>(op.M * op.N));
  Fp8GemmArgs a = args_for(op, 0, op.M);
  fp8_gemm_ref(a, ref.data(), op.N);

  std::vector<float> d32(static_cast<std::size_t>(op.M * ldd), kNan);
  a.D_f32 = d32.data();
  a.ldd = ldd;
  fp8_gemm(a, pool);
  std::vector<bf16_t> d16(static_cast<std::size_t>(op.M * ldd), kBf16Nan);
  a.D_f32 = nullptr;
  a.D_bf16 = d16.data();
  fp8_gemm(a, pool);

  double err32 = 0, err16 = 0, norm = 0;
  for (std::int64_t m = 0; m < op.M; ++m) {
    for (std::int64_t n = 0; n < op.N; ++n) {
      const float v = d32[static_cast<std::size_t>(m * ldd + n)];
      const bf16_t h = d16[static_cast<std::size_t>(m * ldd + n)];
      ASSERT_TRUE(std::isfinite(v)) << describe(op) << " fp32 D[" << m << "," << n << "] not written";
      ASSERT_EQ(h, bf16_encode(v)) << describe(op) << " bf16 D[" << m << "," << n << "] != bf16(fp32 D)";
      const double r = ref[static_cast<std::size_t>(m * op.N + n)];
      err32 += (v - r) * (v - r);
      err16 += (bf16_decode(h) - r) * (bf16_decode(h) - r);
      norm += r * r;
    }
    for (std::int64_t n = op.N; n < ldd; ++n) {
      ASSERT_TRUE(std::isnan(d32[static_cast<std::size_t>(m * ldd + n)])) << describe(op) << " padding written";
      ASSERT_EQ(d16[static_cast<std::size_t>(m * ldd + n)], kBf16Nan) << describe(op) << " bf16 padding written";
    }
  }
  ASSERT_GT(norm, 0.0) << describe(op);
  EXPECT_LT(std::sqrt(err32 / norm), 1e-5) << describe(op);
  EXPECT_LT(std::sqrt(err16 / norm), 8e-3) << describe(op);
}

const QuantScheme kSchemes[] = {QuantScheme::kPerTensor, QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128};

TEST(Fp8Gemm, SmallOddShapesMatchReference) {
  ThreadPool pool(2);
  std::uint64_t seed = 1;
  for (QuantScheme q : kSchemes)
    for (std::int64_t M : {1, 3, 17, 40})
      for (std::int64_t N : {5, 40, 129})
        for (std::int64_t K : {128, 256, 200, 1}) check_case(make_operands(q, M, N, K, seed++), pool);
}

TEST(Fp8Gemm, DeepSeekLikeShapeMatchesReference) {
  ThreadPool pool(2);
  for (QuantScheme q : kSchemes) {
    check_case(make_operands(q, 8, 512, 7168, 100 + static_cast<int>(q)), pool);
    check_case(make_operands(q, 33, 256, 2048, 200 + static_cast<int>(q)), pool);
  }
}

// A row's result must not depend on which other rows are batched with it nor on the thread count.
TEST(Fp8Gemm, BitIdenticalAcrossBatchingAndThreads) {
  for (QuantScheme q : kSchemes) {
    const Operands op = make_operands(q, 70, 77, 384, 300 + static_cast<int>(q));
    ThreadPool pool1(1);
    std::vector<float> full(static_cast<std::size_t>(op.M * op.N), kNan);
    Fp8GemmArgs a = args_for(op, 0, op.M);
    a.D_f32 = full.data();
    a.ldd = op.N;
    fp8_gemm(a, pool1);
    const std::pair<std::int64_t, std::int64_t> ranges[] = {{0, 70}, {0, 1}, {5, 6}, {3, 20}, {17, 50}, {31, 70}};
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      for (auto [r0, r1] : ranges) {
        std::vector<float> part(static_cast<std::size_t>((r1 - r0) * op.N), kNan);
        Fp8GemmArgs b = args_for(op, r0, r1 - r0);
        b.D_f32 = part.data();
        b.ldd = op.N;
        fp8_gemm(b, pool);
        EXPECT_EQ(0, std::memcmp(part.data(), full.data() + r0 * op.N, part.size() * sizeof(float)))
            << describe(op) << " rows [" << r0 << "," << r1 << ") threads=" << threads;
      }
    }
  }
}

// Row m of A holds code m at k=0 and zeros elsewhere; B is 1.0 at k=0: D[m] == fp8_decode(m).
TEST(Fp8Gemm, DecodesEveryCodeExactly) {
  ThreadPool pool(2);
  const std::int64_t M = 256, N = 3, K = 130;
  std::vector<fp8_t> A(static_cast<std::size_t>(M * K), 0x00), B(static_cast<std::size_t>(N * K), 0x00);
  for (std::int64_t m = 0; m < M; ++m) A[static_cast<std::size_t>(m * K)] = static_cast<fp8_t>(m);
  for (std::int64_t n = 0; n < N; ++n) B[static_cast<std::size_t>(n * K)] = 0x38;  // 1.0
  const float one = 1.0f;
  std::vector<float> D(static_cast<std::size_t>(M * N), 0.0f);
  Fp8GemmArgs a;
  a.M = M, a.N = N, a.K = K, a.quant = QuantScheme::kPerTensor;
  a.A = A.data(), a.lda = K, a.a_scales = &one, a.B = B.data(), a.ldb = K, a.b_scales = &one;
  a.D_f32 = D.data(), a.ldd = N;
  fp8_gemm(a, pool);
  for (std::int64_t m = 0; m < M; ++m) {
    const float want = fp8_decode(static_cast<fp8_t>(m));
    for (std::int64_t n = 0; n < N; ++n) {
      const float got = D[static_cast<std::size_t>(m * N + n)];
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(got)) << "code " << m;
      else
        EXPECT_EQ(got, want) << "code " << m;
    }
  }
}

TEST(Fp8Gemm, ZeroRowsIsNoOp) {
  ThreadPool pool(2);
  const Operands op = make_operands(QuantScheme::kPerTokenPerChannel, 4, 9, 128, 7);
  Fp8GemmArgs a = args_for(op, 0, 0);
  float sentinel = kNan;
  a.D_f32 = &sentinel;
  a.ldd = op.N;
  fp8_gemm(a, pool);
  EXPECT_TRUE(std::isnan(sentinel));
  a.A = nullptr;  // M == 0 needs no A
  fp8_gemm(a, pool);
  std::vector<double> ref(1, -1.0);
  fp8_gemm_ref(a, ref.data(), op.N);
  EXPECT_EQ(ref[0], -1.0);
}

TEST(Fp8Gemm, RejectsBadArguments) {
  ThreadPool pool(1);
  const Operands op = make_operands(QuantScheme::kPerTokenPerChannel, 4, 9, 128, 8);
  std::vector<float> D(static_cast<std::size_t>(4 * 9));
  std::vector<bf16_t> D16(static_cast<std::size_t>(4 * 9));
  auto good = [&] {
    Fp8GemmArgs a = args_for(op, 0, op.M);
    a.D_f32 = D.data();
    a.ldd = op.N;
    return a;
  };
  EXPECT_NO_THROW(fp8_gemm(good(), pool));
  // output_only: the reference writes its own double matrix and ignores D_f32 / D_bf16 / ldd.
  auto expect_bad = [&](auto mutate, const char* what, bool output_only = false) {
    Fp8GemmArgs a = good();
    mutate(a);
    EXPECT_THROW(fp8_gemm(a, pool), moekit::Error) << what;
    std::vector<double> ref(static_cast<std::size_t>(4 * 9));
    if (output_only)
      EXPECT_NO_THROW(fp8_gemm_ref(a, ref.data(), 9)) << what << " (ref)";
    else
      EXPECT_THROW(fp8_gemm_ref(a, ref.data(), 9), moekit::Error) << what << " (ref)";
  };
  expect_bad([](Fp8GemmArgs& a) { a.M = -1; }, "M < 0");
  expect_bad([](Fp8GemmArgs& a) { a.N = -1; }, "N < 0");
  expect_bad([](Fp8GemmArgs& a) { a.K = -1; }, "K < 0");
  expect_bad([](Fp8GemmArgs& a) { a.lda = a.K - 1; }, "lda < K");
  expect_bad([](Fp8GemmArgs& a) { a.ldb = a.K - 1; }, "ldb < K");
  expect_bad([](Fp8GemmArgs& a) { a.ldd = a.N - 1; }, "ldd < N", true);
  expect_bad([](Fp8GemmArgs& a) { a.D_f32 = nullptr; }, "no output", true);
  expect_bad([&](Fp8GemmArgs& a) { a.D_bf16 = D16.data(); }, "two outputs", true);
  expect_bad([](Fp8GemmArgs& a) { a.A = nullptr; }, "A null");
  expect_bad([](Fp8GemmArgs& a) { a.B = nullptr; }, "B null");
  expect_bad([](Fp8GemmArgs& a) { a.a_scales = nullptr; }, "a_scales null");
  expect_bad([](Fp8GemmArgs& a) { a.b_scales = nullptr; }, "b_scales null");
  std::vector<double> ref(static_cast<std::size_t>(4 * 9));
  EXPECT_THROW(fp8_gemm_ref(good(), ref.data(), 8), moekit::Error) << "ref ldd < N";
  EXPECT_THROW(fp8_gemm_ref(good(), nullptr, 9), moekit::Error) << "ref D null";
  try {
    Fp8GemmArgs a = good();
    a.lda = 100;
    fp8_gemm(a, pool);
    FAIL() << "lda < K accepted";
  } catch (const moekit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lda=100"), std::string::npos) << e.what();
  }
}

// The 16-bit GEMM (bf16 and fp16 operands) against its float64 reference: the sum is fp32 over exact
// products (22 bits at most), so the fp32 output's bound is the FP8 GEMM's (1e-5); the 16-bit D is
// exactly encode16 of the fp32 D (bf16: 2^-8 per element, fp16: 2^-11), padding columns untouched,
// and rows computed alone give the same bits as rows computed together.
TEST(SixteenBitGemm, BothDtypesMatchReferenceAndEncodeTheFp32Result) {
  ThreadPool pool(3);
  for (const DType dtype : {DType::kBf16, DType::kFp16}) {
    const bool fp16 = dtype == DType::kFp16;
    for (const auto& [M, N, K] : {std::array<std::int64_t, 3>{1, 7, 5}, {37, 130, 200}, {70, 257, 1031}}) {
      const std::string what = std::string(dtype_name(dtype)) + " M=" + std::to_string(M) + " N=" + std::to_string(N) +
                               " K=" + std::to_string(K);
      std::mt19937_64 rng(static_cast<std::uint64_t>(M * 7919 + N * 31 + K + (fp16 ? 1 : 0)));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      const std::int64_t lda = K + 3, ldb = K + 1, ldd = N + 2;
      // Padding holds NaNs of the dtype: never read.
      const std::uint16_t nan16 = fp16 ? 0x7E01 : kBf16Nan;
      std::vector<std::uint16_t> A(static_cast<std::size_t>(M * lda), nan16),
          B(static_cast<std::size_t>(N * ldb), nan16);
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t k = 0; k < K; ++k)
          A[static_cast<std::size_t>(m * lda + k)] = encode16(normal(rng) * 3.0f, fp16);
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t k = 0; k < K; ++k)
          B[static_cast<std::size_t>(n * ldb + k)] = encode16(normal(rng) * 0.05f, fp16);
      std::vector<float> bias(static_cast<std::size_t>(N));
      for (auto& b : bias) b = normal(rng);
      SixteenBitGemmArgs a;
      a.dtype = dtype;
      a.M = M, a.N = N, a.K = K, a.A = A.data(), a.lda = lda, a.B = B.data(), a.ldb = ldb, a.bias = bias.data();
      a.ldd = ldd;
      std::vector<double> ref(static_cast<std::size_t>(M * N));
      sixteen_bit_gemm_ref(a, ref.data(), N);
      std::vector<float> d32(static_cast<std::size_t>(M * ldd), kNan);
      a.D_f32 = d32.data();
      sixteen_bit_gemm(a, pool);
      std::vector<std::uint16_t> d16(static_cast<std::size_t>(M * ldd), nan16);
      a.D_f32 = nullptr;
      a.D_16 = d16.data();
      sixteen_bit_gemm(a, pool);
      std::vector<std::uint16_t> row_by_row(static_cast<std::size_t>(M * ldd), nan16);
      for (std::int64_t m = 0; m < M; ++m) {
        SixteenBitGemmArgs one = a;
        one.M = 1, one.A = A.data() + m * lda, one.D_16 = row_by_row.data() + m * ldd;
        sixteen_bit_gemm(one, pool);
      }
      double err32 = 0, err16 = 0, norm = 0;
      for (std::int64_t m = 0; m < M; ++m) {
        for (std::int64_t n = 0; n < N; ++n) {
          const std::size_t i = static_cast<std::size_t>(m * ldd + n);
          ASSERT_EQ(d16[i], encode16(d32[i], fp16)) << what << " D[" << m << "," << n << "]";
          ASSERT_EQ(row_by_row[i], d16[i]) << what << " row " << m << " alone";
          const double r = ref[static_cast<std::size_t>(m * N + n)];
          err32 += (d32[i] - r) * (d32[i] - r);
          err16 += (decode16(d16[i], fp16) - r) * (decode16(d16[i], fp16) - r);
          norm += r * r;
        }
        for (std::int64_t n = N; n < ldd; ++n) ASSERT_EQ(d16[static_cast<std::size_t>(m * ldd + n)], nan16) << what;
      }
      EXPECT_LT(std::sqrt(err32 / norm), 1e-5) << what;
      EXPECT_LT(std::sqrt(err16 / norm), fp16 ? 1e-3 : 8e-3) << what;
      if (fp16) {
        EXPECT_GT(std::sqrt(err16 / norm), 1e-5) << what << ": the fp16 store rounds";
      }
    }
  }
  SixteenBitGemmArgs bad;
  bad.dtype = DType::kFp32;
  bad.M = 1, bad.N = 1, bad.K = 1, bad.lda = 1, bad.ldb = 1, bad.ldd = 1;
  std::vector<std::uint16_t> one(1, 0x3C00);
  float out = 0;
  bad.A = one.data(), bad.B = one.data(), bad.D_f32 = &out;
  EXPECT_THROW(sixteen_bit_gemm(bad, pool), moekit::Error) << "fp32 operands";
}

}  // namespace
}  // namespace moekit::cpu
