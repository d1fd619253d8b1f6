// The Hopper batched FP8 experts against the CPU backend (itself checked against float64) on fresh
// random data: DeepSeek-V3, Qwen3-235B-A22B and Mixtral-8x7B shapes; m_e patterns all zero, one
// expert full (m_e = M), uniform, random skew and sizes no tile divides; every config. The
// workspace is the plan's, allocated with guard bands; every region and padding row is poisoned
// with NaN; the guards must survive, padding rows of the output stay unwritten, no NaN reaches a
// valid row. Two runs are bit-identical, a CUDA graph replay too; counts over M are an error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <thread>

#include "cpu/activation.h"
#include "cpu/experts.h"
#include "cpu/gemm.h"
#include "cpu/quant.h"
#include "cuda/batched_experts.h"
#include "gpu_test_util.h"
#include "moekit/check.h"
#include "moekit/workspace.h"

namespace moekit {
namespace {

using testing::DeviceBuffer;

// Tolerances, from the recipe:
// - Each stage alone (W1 GEMM into bf16, W2 GEMM from the GPU's own FP8 activation): bf16 output
//   rounding (2^-9 relative) where fp32 sums in another order land on the other side of a bf16
//   rounding boundary, plus the tensor cores' FP8 accumulation: a few 1e-3. Bound 5e-3.
// - End to end against the CPU backend: a bf16 W1 output one ulp apart flips the FP8 code
//   (2^-4 relative steps) of the activation computed from it; two correct implementations differ by
//   such flips at ~1.5e-2 (measured on the CPU alone: fp32 vs float64 W1 sums, README). Bound 3e-2.
//   Indexing or scaling bugs give O(1) errors.
constexpr double kStageTolerance = 5e-3;
constexpr double kRelTolerance = 3e-2;
constexpr std::int64_t kGuardBytes = 4096;

MoeProblem problem_for(const std::string& model_name, std::int64_t E_local, std::int64_t M, QuantScheme quant,
                       std::optional<Activation> activation = std::nullopt) {
  const ModelConfig m = load_model(model_name);
  MoeProblem p;
  p.format = ActivationFormat::kBatchedExperts;
  p.M = M;
  p.K = m.hidden_size;
  p.activation = activation.value_or(m.activation);
  p.N = is_gated(p.activation) ? 2 * m.moe_intermediate_size : m.moe_intermediate_size;
  p.topk = m.topk;
  p.E = m.num_experts;
  p.E_local = E_local;
  p.quant = quant;
  p.max_tokens_per_rank = M;
  p.num_dispatchers = 1;
  validate_problem(p);
  return p;
}

struct GpuRun {
  std::vector<std::uint16_t> output;
  std::vector<std::uint8_t> workspace;  // whole allocation, guards included
  WorkspacePlan placed;
};

class GpuExperts {
 public:
  GpuExperts(const MoeProblem& p, const cpu::ExpertWeights& w)
      : p_(p),
        w1_(w.w1),
        w1s_(w.w1_scales),
        w2_(w.w2),
        w2s_(w.w2_scales),
        placed_(plan_workspace("batched-fp8", p, kGuardBytes)),
        ws_mem_(static_cast<std::size_t>(placed_.total_bytes)),
        out_(static_cast<std::size_t>(p.E_local * p.M * p.K)) {
    WorkspaceBuilder b("batched-fp8", p, ws_mem_.ptr, placed_.total_bytes, kGuardBytes);
    ws_ = plan::declare_batched_fp8(p, b);
    b.finish();
    info_ = cuda::device_info(0);
  }

  // Poisons workspace regions and the output with 0xFF (NaN), guards with their pattern.
  void poison() {
    std::vector<std::uint8_t> host(static_cast<std::size_t>(placed_.total_bytes), 0xFF);
    for (const auto& g : placed_.guards) std::fill_n(host.begin() + g.offset, g.bytes, WorkspaceBuilder::kGuardByte);
    MOEKIT_CUDA_CHECK(cudaMemcpy(ws_mem_.ptr, host.data(), host.size(), cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemset(out_.ptr, 0xFF, out_.count * sizeof(std::uint16_t)));
  }

  void launch(const testing::BatchedInputs& in, DeviceBuffer<std::uint8_t>& a1q, DeviceBuffer<float>& scale,
              DeviceBuffer<std::int32_t>& counts, plan::GemmConfig config, cudaStream_t stream) {
    cuda::batched_fp8_experts(p_, weights(), a1q.ptr, scale.ptr, counts.ptr, out_.ptr, ws_, config, info_.num_sms,
                              stream);
    (void)in;
  }

  GpuRun run(const testing::BatchedInputs& in, plan::GemmConfig config, bool expect_status_ok = true) {
    DeviceBuffer<std::uint8_t> a1q(in.a1q);
    DeviceBuffer<float> scale(in.a1q_scale);
    DeviceBuffer<std::int32_t> counts(in.expert_num_tokens);
    poison();
    launch(in, a1q, scale, counts, config, nullptr);
    MOEKIT_CUDA_CHECK(cudaGetLastError());
    if (expect_status_ok) cuda::check_status(ws_.status, nullptr, p_.M);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    GpuRun r{out_.download(), {}, placed_};
    r.workspace.resize(static_cast<std::size_t>(placed_.total_bytes));
    MOEKIT_CUDA_CHECK(cudaMemcpy(r.workspace.data(), ws_mem_.ptr, r.workspace.size(), cudaMemcpyDeviceToHost));
    return r;
  }

  cuda::DeviceExpertWeights weights() const { return {w1_.ptr, w1s_.ptr, w2_.ptr, w2s_.ptr}; }
  const plan::BatchedFp8Workspace& ws() const { return ws_; }
  std::uint16_t* out() const { return out_.ptr; }
  int num_sms() const { return info_.num_sms; }

 private:
  MoeProblem p_;
  DeviceBuffer<std::uint8_t> w1_;
  DeviceBuffer<float> w1s_;
  DeviceBuffer<std::uint8_t> w2_;
  DeviceBuffer<float> w2s_;
  WorkspacePlan placed_;
  DeviceBuffer<std::uint8_t> ws_mem_;
  DeviceBuffer<std::uint16_t> out_;
  plan::BatchedFp8Workspace ws_;
  cuda::DeviceInfo info_;
};

struct CpuResult {
  std::vector<std::uint16_t> output;  // (E_local, M, K)
  std::vector<std::uint16_t> w1_out;  // (E_local, M, N)
};

CpuResult cpu_oracle(const MoeProblem& p, const cpu::ExpertWeights& w, const testing::BatchedInputs& in,
                     cpu::ThreadPool& pool) {
  const WorkspacePlan plan = plan_workspace("batched-fp8", p);
  std::vector<std::byte> mem(static_cast<std::size_t>(plan.total_bytes + 256));
  auto* base = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(mem.data()) + 255) / 256 * 256);
  WorkspaceBuilder b("batched-fp8", p, base, plan.total_bytes);
  const auto ws = plan::declare_batched_fp8(p, b);
  CpuResult r;
  r.output.assign(static_cast<std::size_t>(p.E_local * p.M * p.K), 0xFFFF);
  cpu::batched_experts(p, w, in.a1q.data(), in.a1q_scale.data(), in.expert_num_tokens.data(), r.output.data(), ws,
                       pool);
  r.w1_out.assign(ws.w1_out, ws.w1_out + p.E_local * p.M * p.N);
  return r;
}

// ||a - b|| / ||b|| over the valid rows of (E_local, M, width) bf16 tensors.
double rel_err_valid(const MoeProblem& p, const std::uint16_t* a, const std::uint16_t* b, std::int64_t width,
                     const std::vector<std::int32_t>& counts) {
  double err = 0, norm = 0;
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = counts[static_cast<std::size_t>(e)];
    if (m < 0 || m > p.M) continue;
    for (std::int64_t i = e * p.M * width; i < (e * p.M + m) * width; ++i) {
      const double x = cpu::bf16_decode(a[i]), y = cpu::bf16_decode(b[i]);
      err += (x - y) * (x - y);
      norm += y * y;
    }
  }
  return norm > 0 ? std::sqrt(err / norm) : 0.0;
}

// Stage by stage: the GPU's W1 output against the CPU's; the GPU's activation codes against the
// CPU activation + quantization of the GPU's own W1 output; the GPU's output against the CPU W2
// GEMM of the GPU's own activation. Each isolates one kernel from the requantization flips.
void check_stages(const MoeProblem& p, const cpu::ExpertWeights& w, const GpuRun& r, const CpuResult& ref,
                  const std::vector<std::int32_t>& counts, cpu::ThreadPool& pool, const std::string& ctx) {
  const std::int64_t N = p.N, K = p.K, I = p.I(), M = p.M;
  const auto* gpu_w1 = reinterpret_cast<const std::uint16_t*>(r.workspace.data() + r.placed.region("w1_out").offset);
  const auto* gpu_act = reinterpret_cast<const std::uint8_t*>(r.workspace.data() + r.placed.region("act_q").offset);
  const auto* gpu_scale = reinterpret_cast<const float*>(r.workspace.data() + r.placed.region("act_scale").offset);
  const double w1_err = rel_err_valid(p, gpu_w1, ref.w1_out.data(), N, counts);
  EXPECT_LT(w1_err, kStageTolerance) << ctx << ": W1 GEMM";

  const bool per_tensor = p.quant == QuantScheme::kPerTensor;
  std::int64_t codes = 0, code_diff = 0;
  double scale_diff = 0;
  std::vector<std::uint16_t> gemm2(static_cast<std::size_t>(M * K));
  double err2 = 0, norm2 = 0;
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = counts[static_cast<std::size_t>(e)];
    if (m <= 0 || m > M) continue;
    // Activation + quantization of the GPU's own w1_out rows on the CPU.
    std::vector<float> act(static_cast<std::size_t>(m * I));
    cpu::activation_rows(p.activation, gpu_w1 + e * M * N, m, N, N, act.data(), I);
    std::vector<std::uint8_t> q(static_cast<std::size_t>(m * I));
    std::vector<float> qs(static_cast<std::size_t>(per_tensor ? 1 : m));
    cpu::quantize_activation(p.quant, act.data(), m, I, I, q.data(), I, qs.data());
    for (std::int64_t i = 0; i < m * I; ++i) code_diff += q[static_cast<std::size_t>(i)] != gpu_act[e * M * I + i];
    codes += m * I;
    const float* gs = per_tensor ? gpu_scale + e : gpu_scale + e * M;
    for (std::size_t i = 0; i < qs.size(); ++i) scale_diff = std::max(scale_diff, std::fabs(double(gs[i]) / qs[i] - 1));
    // W2 on the CPU from the GPU's activation.
    cpu::Fp8GemmArgs g;
    g.M = m;
    g.N = K;
    g.K = I;
    g.quant = p.quant;
    g.A = gpu_act + e * M * I;
    g.lda = I;
    g.a_scales = gs;
    g.B = w.w2.data() + e * K * I;
    g.ldb = I;
    g.b_scales = w.w2_scales.data() + e * w.w2_scale_stride;
    g.D_bf16 = gemm2.data();
    g.ldd = K;
    cpu::fp8_gemm(g, pool);
    for (std::int64_t i = 0; i < m * K; ++i) {
      const double x = cpu::bf16_decode(r.output[static_cast<std::size_t>(e * M * K + i)]);
      const double y = cpu::bf16_decode(gemm2[static_cast<std::size_t>(i)]);
      err2 += (x - y) * (x - y);
      norm2 += y * y;
    }
  }
  // expf / erff differ from the host's by an ulp or two: a code flips only at a rounding boundary.
  EXPECT_LE(code_diff, codes / 500) << ctx << ": activation FP8 codes differ: " << code_diff << " of " << codes;
  EXPECT_LT(scale_diff, 1e-5) << ctx << ": activation scales";
  const double w2_err = norm2 > 0 ? std::sqrt(err2 / norm2) : 0.0;
  EXPECT_LT(w2_err, kStageTolerance) << ctx << ": W2 GEMM";
  std::printf("  %-62s W1 %.1e  act codes %lld/%lld  W2 %.1e\n", ctx.c_str(), w1_err, static_cast<long long>(code_diff),
              static_cast<long long>(codes), w2_err);
}

// Checks guards, padding rows untouched, no NaN in valid rows; returns ||gpu - cpu|| / ||cpu||.
double check_run(const MoeProblem& p, const GpuRun& r, const std::vector<std::uint16_t>& ref,
                 const std::vector<std::int32_t>& counts, const std::string& ctx) {
  for (const auto& g : r.placed.guards)
    for (std::int64_t i = 0; i < g.bytes; ++i)
      if (r.workspace[static_cast<std::size_t>(g.offset + i)] != WorkspaceBuilder::kGuardByte) {
        ADD_FAILURE() << ctx << ": guard band at offset " << g.offset << " overwritten at +" << i;
        break;
      }
  double err = 0, norm = 0;
  std::int64_t nan_valid = 0, written_padding = 0;
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = counts[static_cast<std::size_t>(e)];
    for (std::int64_t row = 0; row < p.M; ++row) {
      for (std::int64_t c = 0; c < p.K; ++c) {
        const std::size_t i = static_cast<std::size_t>((e * p.M + row) * p.K + c);
        if (row >= m || m > p.M) {
          written_padding += r.output[i] != 0xFFFF;
          continue;
        }
        const double g = cpu::bf16_decode(r.output[i]), c_ref = cpu::bf16_decode(ref[i]);
        if (std::isnan(g)) ++nan_valid;
        err += (g - c_ref) * (g - c_ref);
        norm += c_ref * c_ref;
      }
    }
  }
  EXPECT_EQ(nan_valid, 0) << ctx << ": NaN reached valid output rows";
  EXPECT_EQ(written_padding, 0) << ctx << ": padding rows of the output were written";
  return norm > 0 ? std::sqrt(err / norm) : 0.0;
}

std::vector<std::int32_t> pattern_counts(const std::string& pattern, std::int64_t E_local, std::int64_t M,
                                         std::uint64_t seed) {
  std::vector<std::int32_t> c(static_cast<std::size_t>(E_local), 0);
  cpu::SplitMix rng = cpu::stream(seed, 7, 0);
  for (std::int64_t e = 0; e < E_local; ++e) {
    const auto ue = static_cast<std::size_t>(e);
    if (pattern == "zero")
      c[ue] = 0;
    else if (pattern == "one_full")
      c[ue] = e == 1 ? static_cast<std::int32_t>(M) : 0;
    else if (pattern == "uniform")
      c[ue] = static_cast<std::int32_t>(M / 2);
    else if (pattern == "skew")
      c[ue] = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(M + 1));
    else if (pattern == "ragged") {
      const std::int32_t odd[] = {1, 37, 129, 255, 7, 200};
      c[ue] = std::min<std::int32_t>(odd[e % 6], static_cast<std::int32_t>(M));
    }
  }
  return c;
}

struct Case {
  std::string model;
  std::int64_t E_local, M;
  QuantScheme quant;
  std::optional<Activation> activation = std::nullopt;  // default: the model's
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << " E_local=" << c.E_local << " M=" << c.M << " " << quant_name(c.quant);
  if (c.activation) *os << " " << activation_name(*c.activation);
}

class BatchedExpertsGpu : public ::testing::TestWithParam<Case> {};

TEST_P(BatchedExpertsGpu, MatchesCpuInsideTheContract) {
  MOEKIT_REQUIRE_GPU();
  const Case c = GetParam();
  const MoeProblem p = problem_for(c.model, c.E_local, c.M, c.quant, c.activation);
  cpu::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const cpu::ExpertWeights w = cpu::make_random_weights(p, 0, 17, pool);
  GpuExperts gpu(p, w);
  for (const std::string pattern : {"zero", "one_full", "uniform", "skew", "ragged"}) {
    const auto counts = pattern_counts(pattern, p.E_local, p.M, 3);
    const auto in = testing::make_batched_inputs(p, counts, 23);
    const auto ref = cpu_oracle(p, w, in, pool);
    for (const auto& cfg : plan::gemm_configs()) {
      if (cfg.id == plan::GemmConfig::kPingpong64x256 && (p.N % 256 != 0 || p.K % 256 != 0)) continue;
      const std::string ctx = c.model + " E_local=" + std::to_string(p.E_local) + " M=" + std::to_string(p.M) + " " +
                              std::string(quant_name(p.quant)) + " " + std::string(activation_name(p.activation)) +
                              " " + pattern + " " + std::string(cfg.name);
      const GpuRun r = gpu.run(in, cfg.id);
      const double rel = check_run(p, r, ref.output, counts, ctx);
      EXPECT_LT(rel, kRelTolerance) << ctx;
      std::printf("  %-62s end to end vs CPU %.3e\n", ctx.c_str(), rel);
      check_stages(p, w, r, ref, counts, pool, ctx);
      if (pattern == "skew") {
        const GpuRun again = gpu.run(in, cfg.id);
        EXPECT_EQ(r.output, again.output) << ctx << ": two runs differ";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, BatchedExpertsGpu,
    ::testing::Values(Case{"deepseek-v3", 4, 256, QuantScheme::kPerTokenPerChannel},
                      Case{"deepseek-v3", 3, 64, QuantScheme::kPerTensor},
                      Case{"qwen3-235b-a22b", 4, 192, QuantScheme::kPerTokenPerChannel},
                      Case{"mixtral-8x7b", 2, 160, QuantScheme::kPerTokenPerChannel},
                      Case{"gpt-oss-120b", 3, 96, QuantScheme::kPerTokenPerChannel},
                      // The other activations, on Qwen3-30B shapes (K = 2048, I = 768).
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTokenPerChannel, Activation::kGelu},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTokenPerChannel, Activation::kGeluTanh},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTokenPerChannel, Activation::kRelu2},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTensor, Activation::kSiluNoMul}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      std::string n = param_info.param.model + "_" + std::string(quant_name(param_info.param.quant));
      if (param_info.param.activation) n += "_" + std::string(activation_name(*param_info.param.activation));
      std::replace_if(
          n.begin(), n.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
      return n;
    });

TEST(BatchedExpertsGpuContract, CountOverCapacityIsAnErrorAndWritesNothing) {
  MOEKIT_REQUIRE_GPU();
  const MoeProblem p = problem_for("qwen3-30b-a3b", 3, 64, QuantScheme::kPerTokenPerChannel);
  cpu::ThreadPool pool(4);
  const cpu::ExpertWeights w = cpu::make_random_weights(p, 0, 5, pool);
  GpuExperts gpu(p, w);
  std::vector<std::int32_t> counts = {10, static_cast<std::int32_t>(p.M + 5), 64};
  auto in = testing::make_batched_inputs(p, {10, 0, 64}, 9);
  in.expert_num_tokens = counts;
  try {
    gpu.run(in, plan::GemmConfig::kCooperative128x128, true);
    FAIL() << "expert_num_tokens > M was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert_num_tokens[1] = 69"), std::string::npos) << e.what();
  }
  // The bad expert wrote nothing; the others are right.
  const GpuRun r = gpu.run(in, plan::GemmConfig::kCooperative128x128, false);
  auto ok_in = in;
  ok_in.expert_num_tokens = {10, 0, 64};
  const auto ref = cpu_oracle(p, w, ok_in, pool);
  EXPECT_LT(check_run(p, r, ref.output, counts, "count over M"), kRelTolerance);
  check_stages(p, w, r, ref, {10, 0, 64}, pool, "count over M");
}

TEST(BatchedExpertsGpuContract, ActivationKernelsAgreeBitForBit) {
  MOEKIT_REQUIRE_GPU();
  // Every variant computes the same formulas and an exact max: identical codes and scales.
  const MoeProblem p = problem_for("deepseek-v3", 3, 96, QuantScheme::kPerTokenPerChannel);
  cpu::ThreadPool pool(4);
  const cpu::ExpertWeights w = cpu::make_random_weights(p, 0, 12, pool);
  GpuExperts gpu(p, w);
  const auto counts = pattern_counts("ragged", p.E_local, p.M, 2);
  const auto in = testing::make_batched_inputs(p, counts, 6);
  const GpuRun base = gpu.run(in, plan::GemmConfig::kPingpong64x256);  // leaves w1_out in the workspace
  DeviceBuffer<std::int32_t> dcounts(in.expert_num_tokens);
  const auto& act = base.placed.region("act_q");
  const auto& scale = base.placed.region("act_scale");
  for (auto kernel : {cuda::ActivationKernel::kGeneric, cuda::ActivationKernel::kRowPerBlock}) {
    MOEKIT_CUDA_CHECK(cudaMemset(gpu.ws().act_q, 0xFF, static_cast<std::size_t>(act.bytes)));
    MOEKIT_CUDA_CHECK(cudaMemset(gpu.ws().act_scale, 0xFF, static_cast<std::size_t>(scale.bytes)));
    cuda::activation_quant(p, gpu.ws(), dcounts.ptr, gpu.num_sms(), nullptr, kernel);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::uint8_t> q(static_cast<std::size_t>(act.bytes));
    std::vector<float> sc(static_cast<std::size_t>(scale.bytes / 4));
    MOEKIT_CUDA_CHECK(cudaMemcpy(q.data(), gpu.ws().act_q, q.size(), cudaMemcpyDeviceToHost));
    MOEKIT_CUDA_CHECK(cudaMemcpy(sc.data(), gpu.ws().act_scale, sc.size() * 4, cudaMemcpyDeviceToHost));
    const std::int64_t I = p.I();
    for (std::int64_t e = 0; e < p.E_local; ++e) {
      const std::int64_t m = counts[static_cast<std::size_t>(e)];
      for (std::int64_t r = 0; r < m; ++r) {
        const std::size_t row = static_cast<std::size_t>(e * p.M + r);
        EXPECT_EQ(std::memcmp(q.data() + row * I, base.workspace.data() + act.offset + row * I, I), 0)
            << "kernel " << static_cast<int>(kernel) << " expert " << e << " row " << r;
        float base_scale;
        std::memcpy(&base_scale, base.workspace.data() + scale.offset + row * 4, 4);
        EXPECT_EQ(sc[row], base_scale) << "kernel " << static_cast<int>(kernel) << " expert " << e << " row " << r;
      }
    }
  }
}

TEST(BatchedExpertsGpuContract, CudaGraphReplayMatchesEagerRun) {
  MOEKIT_REQUIRE_GPU();
  const MoeProblem p = problem_for("deepseek-v3", 2, 64, QuantScheme::kPerTokenPerChannel);
  cpu::ThreadPool pool(4);
  const cpu::ExpertWeights w = cpu::make_random_weights(p, 0, 8, pool);
  GpuExperts gpu(p, w);
  const auto counts = pattern_counts("ragged", p.E_local, p.M, 1);
  const auto in = testing::make_batched_inputs(p, counts, 4);
  const GpuRun eager = gpu.run(in, plan::GemmConfig::kSwapAB128x32);

  DeviceBuffer<std::uint8_t> a1q(in.a1q);
  DeviceBuffer<float> scale(in.a1q_scale);
  DeviceBuffer<std::int32_t> dcounts(in.expert_num_tokens);
  gpu.poison();
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gpu.launch(in, a1q, scale, dcounts, plan::GemmConfig::kSwapAB128x32, stream);
  MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<std::uint16_t> replay(eager.output.size());
  MOEKIT_CUDA_CHECK(cudaMemcpy(replay.data(), gpu.out(), replay.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(replay, eager.output);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moekit
