// Benchmark of the CPU FP8 GEMM (per-token scheme, bf16 out) and of the bf16 recipe's GEMM (bf16
// operands, no scales, bf16 out) on DeepSeek-V3 expert shapes against OpenBLAS sgemm on the same
// shapes (fp32 operands) and against sgemm's ceiling on a 2048^3 square.
// Build: ninja -C build bench_cpu_gemm; run: ./build/bench/bench_cpu_gemm [--quick]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#ifdef MOEKIT_HAVE_BLAS
#include <cblas.h>
#endif

#include "cpu/gemm.h"
#include "numerics/fp8.h"

namespace {

using moekit::cpu::fp8_t;

template <typename F>
double median_ms(int reps, F&& fn) {
  fn();  // warm-up: page faults, pool start, caches
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

#ifdef MOEKIT_HAVE_BLAS
// C (M, N) = A (M, K) * B (N, K)^T, the same layout as the FP8 GEMM.
double sgemm_ms(int reps, std::int64_t M, std::int64_t N, std::int64_t K) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> A(static_cast<std::size_t>(M * K)), B(static_cast<std::size_t>(N * K)),
      C(static_cast<std::size_t>(M * N));
  for (auto& x : A) x = u(rng);
  for (auto& x : B) x = u(rng);
  return median_ms(reps, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                1.0f, A.data(), static_cast<int>(K), B.data(), static_cast<int>(K), 0.0f, C.data(),
                static_cast<int>(N));
  });
}
#endif

void print_header(const char* what) {
  std::printf("%-22s | %10s | %8s | %10s | %8s | %10s | %10s\n", what, "moekit ms", "GFLOP/s", "sgemm ms", "GFLOP/s",
              "x sgemm", "x ceiling");
}

// One row of the table: moekit's median `ms` for C (M, N) = A (M, K) B (N, K)^T, beside sgemm's on
// the same shape (timed here) and sgemm's ceiling.
void print_row(const char* name, std::int64_t M, std::int64_t N, std::int64_t K, double ms, int reps, double ceiling) {
  const double flop = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  const double gflops = flop / (ms * 1e6);
  char label[64];
  std::snprintf(label, sizeof(label), "%s M=%lld N=%lld K=%lld", name, static_cast<long long>(M),
                static_cast<long long>(N), static_cast<long long>(K));
#ifdef MOEKIT_HAVE_BLAS
  const double sms = sgemm_ms(reps, M, N, K);
  const double sgflops = flop / (sms * 1e6);
  std::printf("%-22s | %10.2f | %8.1f | %10.2f | %8.1f | %10.2f | %10.2f\n", label, ms, gflops, sms, sgflops,
              gflops / sgflops, gflops / ceiling);
#else
  (void)reps;
  (void)ceiling;
  std::printf("%-22s | %10.2f | %8.1f | %10s | %8s | %10s | %10s\n", label, ms, gflops, "-", "-", "-", "-");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int reps = quick ? 3 : 5;
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("machine: %d hardware threads, %s\n", threads, cpu_model().c_str());
  moekit::cpu::ThreadPool pool(threads);

  double ceiling = 0;
#ifdef MOEKIT_HAVE_BLAS
  {
    const std::int64_t S = quick ? 1024 : 2048;
    const double ms = sgemm_ms(reps, S, S, S);
    ceiling = 2.0 * static_cast<double>(S * S * S) / (ms * 1e6);
    std::printf("ceiling: OpenBLAS sgemm %lld^3: %.2f ms = %.1f GFLOP/s\n", static_cast<long long>(S), ms, ceiling);
  }
#else
  std::printf("ceiling: no BLAS found at configure time; moekit numbers only\n");
#endif

  struct Shape {
    const char* name;
    std::int64_t N, K;
  };
  const Shape shapes[] = {{"W1", 4096, 7168}, {"W2", 7168, 2048}};
  const std::vector<std::int64_t> Ms =
      quick ? std::vector<std::int64_t>{16, 64} : std::vector<std::int64_t>{16, 64, 256};
  print_header("shape (fp8 per-token)");
  for (const Shape& s : shapes) {
    std::mt19937 rng(2);
    std::uniform_int_distribution<int> code(0, 0x7E);  // finite e4m3 magnitudes; sign below
    std::vector<fp8_t> B(static_cast<std::size_t>(s.N * s.K));
    for (auto& b : B) b = static_cast<fp8_t>(code(rng) | (rng() & 0x80));
    std::vector<float> sb(static_cast<std::size_t>(s.N), 0.01f);
    for (std::int64_t M : Ms) {
      if (quick && s.N == 7168 && M > 16) continue;
      std::vector<fp8_t> A(static_cast<std::size_t>(M * s.K));
      for (auto& a : A) a = static_cast<fp8_t>(code(rng) | (rng() & 0x80));
      std::vector<float> sa(static_cast<std::size_t>(M), 0.02f);
      std::vector<moekit::cpu::bf16_t> D(static_cast<std::size_t>(M * s.N));
      moekit::cpu::Fp8GemmArgs args;
      args.M = M, args.N = s.N, args.K = s.K, args.quant = moekit::QuantScheme::kPerTokenPerChannel;
      args.A = A.data(), args.lda = s.K, args.a_scales = sa.data();
      args.B = B.data(), args.ldb = s.K, args.b_scales = sb.data();
      args.D_bf16 = D.data(), args.ldd = s.N;
      print_row(s.name, M, s.N, s.K, median_ms(reps, [&] { moekit::cpu::fp8_gemm(args, pool); }), reps, ceiling);
    }
  }
  // The bf16 recipe's GEMM: the same shapes, bf16 operands of unit spread, no scales.
  print_header("shape (bf16)");
  for (const Shape& s : shapes) {
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<moekit::cpu::bf16_t> B(static_cast<std::size_t>(s.N * s.K));
    for (auto& b : B) b = moekit::numerics::bf16_encode(normal(rng));
    for (std::int64_t M : Ms) {
      if (quick && s.N == 7168 && M > 16) continue;
      std::vector<moekit::cpu::bf16_t> A(static_cast<std::size_t>(M * s.K)), D(static_cast<std::size_t>(M * s.N));
      for (auto& a : A) a = moekit::numerics::bf16_encode(normal(rng));
      moekit::cpu::SixteenBitGemmArgs args;
      args.M = M, args.N = s.N, args.K = s.K;
      args.A = A.data(), args.lda = s.K, args.B = B.data(), args.ldb = s.K;
      args.D_16 = D.data(), args.ldd = s.N;
      print_row(s.name, M, s.N, s.K, median_ms(reps, [&] { moekit::cpu::sixteen_bit_gemm(args, pool); }), reps,
                ceiling);
    }
  }
  return 0;
}
