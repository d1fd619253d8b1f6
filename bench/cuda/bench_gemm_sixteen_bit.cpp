// Benchmark of the grouped 16-bit GEMMs (bf16 / fp16 operands, no scales: cuda/grouped_gemm.h's
// 16-bit instances) at DeepSeek-V3's expert shapes: W1 (n = 2 x 2048, k = 7168) and W2 (n = 7168,
// k = 2048) over E_local experts of m_e rows each (a batched layout of M = 8192 rows an expert).
// Measures the machine's ceilings first, in the same process: cuBLASLt's dense GEMM at 8192^3 in
// each dtype asked for (and in FP8, for scale). Then, per dtype, m_e and GEMM, every config of the
// table with 16-bit instances that runs it: the median time of 5 back-to-back launches (20 rounds,
// each launch's time), TFLOP/s of the valid rows and the ratio to the dtype's dense rate.
//
// Run: ./bench_gemm_sixteen_bit out.json [--case m_e]... (default 64 256 512 1024) [--dtype bf16,fp16]
//      [--experts E_local] (default 16)
// Writes JSON (argv[1]).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ceilings/ceilings.h"
#include "cuda/backend.h"
#include "cuda/grouped_gemm.h"
#include "cuda/launch.h"
#include "moekit/error.h"
#include "moekit/memory.h"
#include "plan/gemm_config.h"

using namespace moekit;

namespace {

struct Gemm {
  const char* name;
  std::int64_t n, k;
};
constexpr Gemm kGemms[] = {{"W1", 2 * 2048, 7168}, {"W2", 7168, 2048}};
constexpr std::int64_t kCapacity = 8192;  // rows an expert holds (the batched layout's M)

int usage(const char* what) {
  std::fprintf(stderr, "bench_gemm_sixteen_bit: %s (the flags: the top of bench/cuda/bench_gemm_sixteen_bit.cpp)\n",
               what);
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string out_path = argc > 1 ? argv[1] : "bench_gemm_sixteen_bit.json";
  std::vector<std::int64_t> cases;
  std::vector<DType> dtypes;
  std::int64_t E = 16;
  for (int a = 2; a < argc; ++a) {
    const std::string flag = argv[a];
    if (a + 1 >= argc) return usage((flag + " takes a value, or is no flag").c_str());
    const std::string value = argv[++a];
    if (flag == "--case") {
      const std::int64_t m = std::atoll(value.c_str());
      if (m < 1 || m > kCapacity) return usage(("--case m_e takes 1-8192, got '" + value + "'").c_str());
      cases.push_back(m);
    } else if (flag == "--experts") {
      E = std::atoll(value.c_str());
      if (E < 1 || E > 64) return usage(("--experts takes 1-64, got '" + value + "'").c_str());
    } else if (flag == "--dtype") {
      for (std::size_t pos = 0; pos <= value.size();) {
        const std::size_t comma = std::min(value.find(',', pos), value.size());
        const std::string d = value.substr(pos, comma - pos);
        if (d != "bf16" && d != "fp16") return usage(("--dtype takes bf16 and fp16, got '" + d + "'").c_str());
        dtypes.push_back(d == "bf16" ? DType::kBf16 : DType::kFp16);
        pos = comma + 1;
      }
    } else {
      return usage(("unknown argument '" + flag + "'").c_str());
    }
  }
  if (cases.empty()) cases = {64, 256, 512, 1024};
  if (dtypes.empty()) dtypes = {DType::kBf16, DType::kFp16};
  if (!cuda::available()) {
    std::fprintf(stderr, "bench_gemm_sixteen_bit: no CUDA device\n");
    return 1;
  }
  void* stream = cuda::create_stream();
  nlohmann::json out;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  out["device"] = prop.name;
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const double fp8_peak = ceilings::fp8_gemm_tflops(stream);
  std::printf("ceilings: cuBLASLt FP8 e4m3 8192^3 %.0f TFLOP/s\n", fp8_peak);
  out["ceilings"]["fp8_tflops"] = fp8_peak;

  const auto memory = make_memory(Device::kCuda);
  const std::int64_t max_k = 7168, max_n = 7168;
  DeviceBuffer A(*memory, E * kCapacity * max_k * 2, "A"), B(*memory, E * max_n * max_k * 2, "B");
  DeviceBuffer D(*memory, E * kCapacity * max_n * 2, "D");
  DeviceBuffer scratch(*memory, cuda::kGemmScratchBytes, "gemm_scratch");
  DeviceBuffer args_buf(*memory, E * cuda::kGemmArgsBytesPerGroup, "gemm_args");
  std::vector<std::byte> args(static_cast<std::size_t>(E * cuda::kGemmArgsBytesPerGroup));

  for (const DType dtype : dtypes) {
    const std::string dn(dtype_name(dtype));
    ceilings::fill_random_sixteen_bit(A.get(), static_cast<std::size_t>(E * kCapacity * max_k), 1, dtype);
    ceilings::fill_random_sixteen_bit(B.get(), static_cast<std::size_t>(E * max_n * max_k), 2, dtype);
    const double peak = ceilings::sixteen_bit_gemm_tflops(dtype, stream);
    std::printf("ceilings: cuBLASLt %s 8192^3 %.0f TFLOP/s\n", dn.c_str(), peak);
    out["ceilings"][dn + "_tflops"] = peak;
    for (const std::int64_t m_e : cases) {
      for (const Gemm& g : kGemms) {
        for (const auto& c : plan::kGemmConfigs) {
          if (!plan::supports_sixteen_bit(c, g.n, g.k)) continue;
          const cuda::GroupedGemmArrays a = cuda::GroupedGemmArrays::at(args.data(), static_cast<int>(E));
          for (std::int64_t e = 0; e < E; ++e) {
            const void* tokens = A.as<std::uint16_t>() + e * kCapacity * g.k;
            const void* weights = B.as<std::uint16_t>() + e * g.n * g.k;
            a.ptr_D[e] = D.as<std::uint16_t>() + e * kCapacity * g.n;
            a.ptr_col[e] = a.ptr_row[e] = nullptr;
            a.stride_A[e] = a.stride_B[e] = g.k;
            a.stride_D[e] = g.n;
            int* shape = a.shapes + 3 * e;
            shape[0] = static_cast<int>(c.swap_ab ? g.n : m_e);
            shape[1] = static_cast<int>(c.swap_ab ? m_e : g.n);
            shape[2] = static_cast<int>(g.k);
            a.ptr_A[e] = c.swap_ab ? weights : tokens;
            a.ptr_B[e] = c.swap_ab ? tokens : weights;
          }
          memory->from_host(args_buf.get(), args.data(), args_buf.bytes(), stream);
          cuda::GroupedGemmLaunch l;
          l.args = args_buf.as<std::byte>();
          l.groups = static_cast<int>(E);
          l.n = g.n;
          l.k = g.k;
          l.operand = dtype;
          l.scratch = scratch.as<std::byte>();
          l.scratch_bytes = scratch.bytes();
          l.num_sms = cuda::current_device_num_sms();
          constexpr int kBackToBack = 5;
          const double ms = cuda::median_ms(
                                20,
                                [&] {
                                  for (int i = 0; i < kBackToBack; ++i) cuda::grouped_fp8_gemm(c.id, l, stream);
                                },
                                stream) /
                            kBackToBack;
          const double tflops = 2.0 * static_cast<double>(E * m_e * g.n * g.k) / (ms * 1e-3) / 1e12;
          std::printf("%s m_e %5lld %s %-20s %8.4f ms %7.1f TFLOP/s %.2f of cuBLASLt %s\n", dn.c_str(),
                      static_cast<long long>(m_e), g.name, std::string(c.name).c_str(), ms, tflops, tflops / peak,
                      dn.c_str());
          out["results"].push_back({{"dtype", dn},
                                    {"m_e", m_e},
                                    {"E_local", E},
                                    {"gemm", g.name},
                                    {"n", g.n},
                                    {"k", g.k},
                                    {"config", std::string(c.name)},
                                    {"ms", ms},
                                    {"tflops", tflops},
                                    {"of_dense", tflops / peak}});
        }
      }
    }
  }
  cuda::destroy_stream(stream);
  std::ofstream(out_path) << out.dump(2) << "\n";
  return 0;
} catch (const Error& e) {
  std::fprintf(stderr, "bench_gemm_sixteen_bit: %s\n", e.what());
  return 1;
}
