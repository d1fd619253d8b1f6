// The Hopper batched FP8 experts, through the Experts seam over a Workspace from plan_layer,
// against the CPU experts (themselves checked against float64) on fresh random data, stage by stage:
// DeepSeek-V3, Qwen3-235B-A22B, Mixtral-8x7B, gpt-oss and Qwen3-30B shapes, every activation,
// per-token, per-tensor, block-scaled (1x128 activation groups, 128x128 weight blocks) and the
// unquantized recipe (bf16 operands, no scales, the activation stored in bf16); m_e
// patterns all zero, one expert full (m_e = M), uniform, random skew and sizes no tile divides; every
// config the table says supports the shapes. The workspace carries guard bands; every region and
// padding row is poisoned with NaN; the guards must survive, padding rows of the output stay
// unwritten, no NaN reaches a valid row. Two runs are bit-identical, a CUDA graph replay too; counts
// over M are an error that writes nothing.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>

#include "check/reference.h"
#include "cpu/activation.h"
#include "cpu/expert_pipeline.h"
#include "cpu/gemm.h"
#include "cpu/quant.h"
#include "cuda/backend.h"
#include "cuda/check.h"
#include "cuda/grouped_gemm.h"
#include "cuda/launch.h"
#include "cuda/launch_cache.h"
#include "gpu_test_util.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "moekit/registry.h"
#include "numerics/scales.h"
#include "plan/experts_recipe.h"
#include "synthetic/synthetic.h"
#include "test_names.h"

namespace moekit {
namespace {

using numerics::bf16_decode;

// A 16-bit value of the problem's recipe (w1_out, act, the output rows): fp16 for the fp16 recipe,
// else bf16 (the FP8 recipes' w1_out and output).
double v16(const MoeProblem& p, std::uint16_t x) {
  return numerics::decode16(x, recipe_info(p.quant).activation_dtype == DType::kFp16);
}

// Tolerances, from the recipe:
// - Each stage alone (W1 GEMM into bf16, W2 GEMM from the GPU's own FP8 activation): bf16 output
//   rounding (2^-9 relative) where fp32 sums in another order land on the other side of a bf16
//   rounding boundary, plus the tensor cores' FP8 accumulation: a few 1e-3. Bound 5e-3.
// - End to end against the CPU backend: check::device_vs_cpu_tolerance (a bf16 W1 output one ulp
//   apart flips the FP8 code of the activation computed from it: ~1.5e-2; per-tensor, the expert's one
//   scale may move too; bf16: both devices round the same stored values, 8e-3). Indexing or scaling
//   bugs give O(1) errors.
constexpr double kStageTolerance = 5e-3;
constexpr std::int64_t kGuardBytes = 4096;

using testing::problem_for;

plan::GemmConfig both(plan::GemmConfig c) {  // every expert of both GEMMs on c
  return c;
}

struct GpuRun {
  std::vector<std::uint16_t> output;    // the expert_output region
  std::vector<std::uint8_t> workspace;  // the whole allocation, guards included
  WorkspacePlan placed;
};

// The CUDA experts over one guarded Workspace on the GPU (the runtime's plan for the problem: w1_out
// unless it fuses W1), with the experts' input regions filled from the host.
class GpuExperts {
 public:
  GpuExperts(const MoeProblem& p, const synthetic::HostExpertWeights& w)
      : p_(p),
        memory_(make_memory(Device::kCuda)),
        weight_copies_(*memory_),
        view_(w.view(weight_copies_)),
        ws_(plan_layer(p, find_experts("batched-fp8", Device::kCuda), 1, kGuardBytes), *memory_) {}

  // Poisons the workspace (regions NaN, guards their pattern), then writes the inputs.
  ExpertsInput load(const testing::BatchedInputs& in) {
    ws_.poison(nullptr);
    // A recipe without activation scales (bf16) has no a1q_scale region: its rows go alone.
    const bool scaled = has_activation_scales(recipe_info(p_.quant));
    put("a1q", in.a1q.data(), static_cast<std::int64_t>(in.a1q.size()));
    if (scaled) put("a1q_scale", in.a1q_scale.data(), static_cast<std::int64_t>(in.a1q_scale.size() * 4));
    put("expert_num_tokens", in.expert_num_tokens.data(), static_cast<std::int64_t>(in.expert_num_tokens.size() * 4));
    return {reinterpret_cast<const std::uint8_t*>(ws_.get<std::byte>("a1q")),
            scaled ? ws_.get<float>("a1q_scale") : nullptr,
            ws_.get<std::int32_t>("expert_num_tokens"),
            nullptr,
            p_.max_tokens_per_rank,
            ws_.get<std::uint16_t>("expert_output")};
  }

  GpuRun run(const testing::BatchedInputs& in, std::optional<plan::GemmConfig> configs, bool expect_status_ok = true) {
    const ExpertsInput input = load(in);
    const auto experts = configs ? cuda::make_batched_experts({}, *configs) : cuda::make_batched_experts({});
    experts->run(p_, input, view_, ws_, nullptr);
    if (expect_status_ok) experts->check_status(ws_, nullptr);
    return download();
  }

  GpuRun download() {
    GpuRun r;
    r.placed = ws_.plan();
    r.workspace.resize(static_cast<std::size_t>(ws_.bytes()));
    memory_->to_host(r.workspace.data(), ws_.base(), ws_.bytes(), nullptr);
    const Region& out = r.placed.region("expert_output");
    r.output.resize(static_cast<std::size_t>(out.bytes / 2));
    std::memcpy(r.output.data(), r.workspace.data() + out.offset, static_cast<std::size_t>(out.bytes));
    return r;
  }

  const ExpertWeightsView& weights() const { return view_; }
  Workspace& workspace() { return ws_; }

 private:
  void put(const char* region, const void* host, std::int64_t bytes) {
    ASSERT_LE(bytes, ws_.plan().region(region).bytes) << region;
    memory_->from_host(ws_.get<std::byte>(region), host, bytes, nullptr);
  }

  MoeProblem p_;
  std::unique_ptr<Memory> memory_;
  DeviceCopies weight_copies_;
  ExpertWeightsView view_;
  Workspace ws_;
};

struct CpuResult {
  std::vector<std::uint16_t> output;  // (E_local, M, K)
  std::vector<std::uint16_t> w1_out;  // (E_local, M, N): W1 into bf16, valid rows (the unfused stage)
  std::vector<std::uint8_t> act_q;    // (E_local, M, I): the CPU experts' own activation codes (bf16: act's bytes)
  std::vector<float> act_scale;       // and scales (the fused recipe's, where it applies; none for bf16)
};

CpuResult cpu_oracle(const MoeProblem& p, const synthetic::HostExpertWeights& w, const testing::BatchedInputs& in,
                     cpu::ThreadPool& pool) {
  const auto memory = make_memory(Device::kCpu);
  const auto& entry = find_experts("batched-fp8", Device::kCpu);
  Workspace ws(plan_layer(p, entry, 1), *memory);
  ws.poison(nullptr);
  const auto experts = entry.make({&pool, nullptr});
  auto* out = ws.get<std::uint16_t>("expert_output");
  const bool scaled = has_activation_scales(recipe_info(p.quant));
  experts->run(p,
               {in.a1q.data(), scaled ? in.a1q_scale.data() : nullptr, in.expert_num_tokens.data(), nullptr,
                p.max_tokens_per_rank, out},
               w.view(), ws, nullptr);
  CpuResult r;
  r.output.assign(out, out + p.E_local * p.M * p.K);
  const char* act = plan::act_region(p.quant);  // act_q (FP8) or act (bf16)
  const auto* q = reinterpret_cast<const std::uint8_t*>(ws.get<std::byte>(act));
  r.act_q.assign(q, q + ws.plan().region(act).bytes);
  if (scaled) {
    const auto* s = ws.get<float>("act_scale");
    r.act_scale.assign(s, s + ws.plan().region("act_scale").bytes / 4);
  }
  // W1 into bf16 on the CPU (the unfused GPU stage's oracle), whatever recipe the experts followed,
  // in the recipe's operand type (cpu::run_expert_gemm: FP8 with scales or bf16).
  r.w1_out.assign(static_cast<std::size_t>(p.E_local * p.M * p.N), 0xFFFF);
  const ExpertWeightsView view = w.view();
  const std::int64_t a_spr = numerics::activation_scales_per_row(p.quant, p.K);
  const std::int64_t ab = dtype_size(recipe_info(p.quant).activation_dtype);
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = in.expert_num_tokens[static_cast<std::size_t>(e)];
    if (m <= 0 || m > p.M) continue;
    const float* a_scale = !scaled                              ? nullptr
                           : p.quant == QuantScheme::kPerTensor ? in.a1q_scale.data() + e
                                                                : in.a1q_scale.data() + e * p.M * a_spr;
    cpu::run_expert_gemm(p, view, 1, e, m, in.a1q.data() + e * p.M * p.K * ab, a_scale, r.w1_out.data() + e * p.M * p.N,
                         pool);
  }
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
      const double x = v16(p, a[i]), y = v16(p, b[i]);
      err += (x - y) * (x - y);
      norm += y * y;
    }
  }
  return norm > 0 ? std::sqrt(err / norm) : 0.0;
}

// The W2 stage alone: the CPU W2 GEMM of the GPU's own activation rows against the GPU's output
// rows, ||gpu - cpu|| / ||cpu|| over the experts added.
class W2Stage {
 public:
  W2Stage(const MoeProblem& p, ExpertWeightsView w, const GpuRun& r, cpu::ThreadPool& pool)
      : p_(p), w_(w), r_(r), pool_(pool), out_(static_cast<std::size_t>(p.M * p.K)) {}
  // act: m rows of I elements of the recipe's operand (FP8 codes with act_scale, or bf16 and null).
  void add(std::int64_t e, std::int64_t m, const std::uint8_t* act, const float* act_scale) {
    cpu::run_expert_gemm(p_, w_, 2, e, m, act, act_scale, out_.data(), pool_);
    for (std::int64_t i = 0; i < m * p_.K; ++i) {
      const double x = v16(p_, r_.output[static_cast<std::size_t>(e * p_.M * p_.K + i)]);
      const double y = v16(p_, out_[static_cast<std::size_t>(i)]);
      err_ += (x - y) * (x - y);
      norm_ += y * y;
    }
  }
  double relative() const { return norm_ > 0 ? std::sqrt(err_ / norm_) : 0.0; }

 private:
  const MoeProblem& p_;
  ExpertWeightsView w_;
  const GpuRun& r_;
  cpu::ThreadPool& pool_;
  std::vector<std::uint16_t> out_;
  double err_ = 0, norm_ = 0;
};

// The CPU activation (fp32) of the GPU's own w1_out rows of expert e (m valid rows): what each stage
// check compares the GPU's activation stage with, isolated from W1's differences.
std::vector<float> cpu_activation_of_gpu_w1(const MoeProblem& p, const std::uint16_t* gpu_w1, std::int64_t e,
                                            std::int64_t m) {
  std::vector<float> act(static_cast<std::size_t>(m * p.I()));
  cpu::activation_rows(p.activation, gpu_w1 + e * p.M * p.N, m, p.N, p.N, act.data(), p.I(), p.quant, p.swiglu);
  return act;
}

// Stage by stage: the GPU's W1 output against the CPU's; the GPU's activation codes against the
// CPU activation + quantization of the GPU's own W1 output; the GPU's output against the CPU W2
// GEMM of the GPU's own activation. Each isolates one kernel from the requantization flips.
void check_stages(const MoeProblem& p, const synthetic::HostExpertWeights& w, const GpuRun& r, const CpuResult& ref,
                  const std::vector<std::int32_t>& counts, cpu::ThreadPool& pool, const std::string& ctx) {
  const std::int64_t N = p.N, K = p.K, I = p.I(), M = p.M;
  const auto* gpu_w1 = reinterpret_cast<const std::uint16_t*>(r.workspace.data() + r.placed.region("w1_out").offset);
  const auto* gpu_act = reinterpret_cast<const std::uint8_t*>(r.workspace.data() + r.placed.region("act_q").offset);
  const auto* gpu_scale = reinterpret_cast<const float*>(r.workspace.data() + r.placed.region("act_scale").offset);
  const double w1_err = rel_err_valid(p, gpu_w1, ref.w1_out.data(), N, counts);
  EXPECT_LT(w1_err, kStageTolerance) << ctx << ": W1 GEMM";

  const bool per_tensor = p.quant == QuantScheme::kPerTensor;
  const std::int64_t spr = numerics::activation_scales_per_row(p.quant, I);
  std::int64_t codes = 0, code_diff = 0;
  double scale_diff = 0;
  W2Stage w2(p, w.view(), r, pool);
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = counts[static_cast<std::size_t>(e)];
    if (m <= 0 || m > M) continue;
    // Activation + quantization of the GPU's own w1_out rows on the CPU.
    const std::vector<float> act = cpu_activation_of_gpu_w1(p, gpu_w1, e, m);
    std::vector<std::uint8_t> q(static_cast<std::size_t>(m * I));
    std::vector<float> qs(static_cast<std::size_t>(numerics::activation_scale_count(p.quant, m, I)));
    cpu::quantize_activation(p.quant, act.data(), m, I, I, q.data(), I, qs.data());
    for (std::int64_t i = 0; i < m * I; ++i) code_diff += q[static_cast<std::size_t>(i)] != gpu_act[e * M * I + i];
    codes += m * I;
    const float* gs = per_tensor ? gpu_scale + e : gpu_scale + e * M * spr;
    for (std::size_t i = 0; i < qs.size(); ++i) scale_diff = std::max(scale_diff, std::fabs(double(gs[i]) / qs[i] - 1));
    w2.add(e, m, gpu_act + e * M * I, gs);  // W2 on the CPU from the GPU's activation
  }
  // expf / erff differ from the host's by an ulp or two: a code flips only at a rounding boundary.
  EXPECT_LE(code_diff, codes / 500) << ctx << ": activation FP8 codes differ: " << code_diff << " of " << codes;
  EXPECT_LT(scale_diff, 1e-5) << ctx << ": activation scales";
  const double w2_err = w2.relative();
  EXPECT_LT(w2_err, kStageTolerance) << ctx << ": W2 GEMM";
  std::printf("  %-62s W1 %.1e  act codes %lld/%lld  W2 %.1e\n", ctx.c_str(), w1_err, static_cast<long long>(code_diff),
              static_cast<long long>(codes), w2_err);
}

// The unquantized recipe (bf16), stage by stage: W1 as above; the GPU's bf16 act against the CPU
// activation of the GPU's own w1_out rows rounded once to bf16 (expf / erff differ from the host's
// by an ulp or two: a value moves by one bf16 ulp, its neighbouring bits, only where the fp32 value
// sits at a rounding boundary); W2 against the CPU W2 GEMM of the GPU's own act.
void check_bf16_stages(const MoeProblem& p, const synthetic::HostExpertWeights& w, const GpuRun& r,
                       const CpuResult& ref, const std::vector<std::int32_t>& counts, cpu::ThreadPool& pool,
                       const std::string& ctx) {
  const std::int64_t N = p.N, I = p.I(), M = p.M;
  const auto* gpu_w1 = reinterpret_cast<const std::uint16_t*>(r.workspace.data() + r.placed.region("w1_out").offset);
  const auto* gpu_act = reinterpret_cast<const std::uint16_t*>(r.workspace.data() + r.placed.region("act").offset);
  const double w1_err = rel_err_valid(p, gpu_w1, ref.w1_out.data(), N, counts);
  EXPECT_LT(w1_err, kStageTolerance) << ctx << ": W1 GEMM";
  std::int64_t values = 0, one_ulp = 0, far = 0;
  W2Stage w2(p, w.view(), r, pool);
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = counts[static_cast<std::size_t>(e)];
    if (m <= 0 || m > M) continue;
    const std::vector<float> act = cpu_activation_of_gpu_w1(p, gpu_w1, e, m);
    std::vector<std::uint16_t> q(static_cast<std::size_t>(m * I));
    cpu::store_activation(p.quant, act.data(), m, I, I, reinterpret_cast<std::uint8_t*>(q.data()), I, nullptr);
    // Near zero, gelu's 1 + erf(x / sqrt 2) cancels: erff's ulp or two at -1 is a large relative
    // error of a tiny value (gelu(-5) = -1.4e-6, moved by ~3e-7), many bf16 ulps but nothing W2 can
    // see. Differences below 2^-16 of the expert's largest activation (1/256 of a bf16 ulp there) are
    // that noise; the rest must be one ulp, and rare.
    float amax = 0.0f;
    for (const float v : act) amax = std::max(amax, std::abs(v));
    for (std::int64_t i = 0; i < m * I; ++i) {
      const std::uint16_t a = q[static_cast<std::size_t>(i)], b = gpu_act[e * M * I + i];
      if (a == b) continue;
      if (std::abs(v16(p, a) - v16(p, b)) <= std::ldexp(amax, -16)) continue;
      if (std::abs(static_cast<int>(a) - static_cast<int>(b)) == 1)  // neighbouring bf16s of one sign
        ++one_ulp;
      else
        ++far;
    }
    values += m * I;
    w2.add(e, m, reinterpret_cast<const std::uint8_t*>(gpu_act + e * M * I), nullptr);
  }
  EXPECT_EQ(far, 0) << ctx << ": bf16 activation values more than one ulp from the CPU's";
  EXPECT_LE(one_ulp, values / 500) << ctx << ": bf16 activation values one ulp apart: " << one_ulp << " of " << values;
  const double w2_err = w2.relative();
  EXPECT_LT(w2_err, kStageTolerance) << ctx << ": W2 GEMM";
  std::printf("  %-62s W1 %.1e  act one ulp %lld/%lld  W2 %.1e\n", ctx.c_str(), w1_err, static_cast<long long>(one_ulp),
              static_cast<long long>(values), w2_err);
}

// The fused W1 (no w1_out): its activation codes and scales against the CPU experts' own (the same
// recipe: fp32 W1 output into the activation), and the GPU's output against the CPU W2 GEMM of the
// GPU's own activation. There is no intermediate both sides share (the unfused check feeds the CPU
// the GPU's own w1_out), so what differs is W1 itself: the tensor cores' FP8 accumulation (a few
// 1e-4 relative after the per-k-block promotion) moves a group's amax, hence its scale, by up to
// ~1e-3 and a code by one FP8 step (2^-4) where a value sat near a rounding boundary; the error is
// absolute (the dot product's size, not the result's), so near zero, where e4m3's steps shrink to
// 2^-9 of a code unit, it spans several steps. Measured (DeepSeek-V3, Qwen3, Mixtral shapes): scales
// <= 7.1e-4 apart, ~0.4-1.1% of codes one step, ~0.07% further but within 0.5 code units (1/900 of
// a group's largest code). Bounds: scales 2e-3, codes apart by more than one FP8 ulp of the larger
// magnitude 2.5% (and then by at most 0.5 code units), none further.
void check_fused_stages(const MoeProblem& p, const synthetic::HostExpertWeights& w, const GpuRun& r,
                        const CpuResult& ref, const std::vector<std::int32_t>& counts, cpu::ThreadPool& pool,
                        const std::string& ctx) {
  const std::int64_t K = p.K, I = p.I(), M = p.M;
  const auto* gpu_act = reinterpret_cast<const std::uint8_t*>(r.workspace.data() + r.placed.region("act_q").offset);
  const auto* gpu_scale = reinterpret_cast<const float*>(r.workspace.data() + r.placed.region("act_scale").offset);
  const std::int64_t spr = numerics::activation_scales_per_row(p.quant, I);
  std::int64_t codes = 0, one_step = 0, far = 0;
  double scale_diff = 0;
  W2Stage w2(p, w.view(), r, pool);
  for (std::int64_t e = 0; e < p.E_local; ++e) {
    const std::int64_t m = counts[static_cast<std::size_t>(e)];
    if (m <= 0 || m > M) continue;
    const std::uint8_t* q = ref.act_q.data() + e * M * I;
    const float* qs = ref.act_scale.data() + e * M * spr;
    for (std::int64_t i = 0; i < m * I; ++i) {
      const std::uint8_t a = q[i], b = gpu_act[e * M * I + i];
      if (a == b) continue;
      const double x = numerics::fp8_decode(a), y = numerics::fp8_decode(b);
      const double big = std::max(std::fabs(x), std::fabs(y));
      // e4m3: 3 mantissa bits, normals from 2^-6, subnormal steps 2^-9.
      const double ulp = big >= 0x1p-6 ? std::exp2(std::floor(std::log2(big)) - 3) : 0x1p-9;
      if (std::fabs(x - y) <= std::max(ulp, 0.5))
        ++one_step;
      else
        ++far;
    }
    codes += m * I;
    const float* gs = gpu_scale + e * M * spr;
    for (std::int64_t i = 0; i < m * spr; ++i) scale_diff = std::max(scale_diff, std::fabs(double(gs[i]) / qs[i] - 1));
    w2.add(e, m, gpu_act + e * M * I, gs);
  }
  EXPECT_EQ(far, 0) << ctx << ": fused activation codes more than one FP8 step from the CPU's";
  EXPECT_LE(one_step, codes / 40) << ctx << ": fused activation codes one step apart: " << one_step << " of " << codes;
  EXPECT_LT(scale_diff, 2e-3) << ctx << ": fused activation scales";
  const double w2_err = w2.relative();
  EXPECT_LT(w2_err, kStageTolerance) << ctx << ": W2 GEMM";
  std::printf("  %-62s fused act codes %lld one step /%lld, scales %.1e  W2 %.1e\n", ctx.c_str(),
              static_cast<long long>(one_step), static_cast<long long>(codes), scale_diff, w2_err);
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
        const double g = v16(p, r.output[i]), c_ref = v16(p, ref[i]);
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

using testing::pattern_counts;

struct Case {
  std::string model;
  std::int64_t E_local, M;
  QuantScheme quant;
  std::optional<Activation> activation = std::nullopt;  // default: the model's
  bool fuse_w1 = false;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << " E_local=" << c.E_local << " M=" << c.M << " " << quant_name(c.quant);
  if (c.activation) *os << " " << activation_name(*c.activation);
  if (c.fuse_w1) *os << " fused-w1";
}

class BatchedExpertsGpu : public ::testing::TestWithParam<Case> {};

TEST_P(BatchedExpertsGpu, MatchesCpuInsideTheContract) {
  MOEKIT_REQUIRE_GPU();
  const Case c = GetParam();
  const MoeProblem p = problem_for(c.model, c.E_local, c.M, c.quant, c.activation, c.fuse_w1);
  cpu::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const auto w = synthetic::make_expert_weights(p, 0, 17, pool);
  GpuExperts gpu(p, w);
  for (const std::string pattern : {"zero", "one_full", "uniform", "skew", "ragged", "tails"}) {
    const auto counts = pattern_counts(pattern, p.E_local, p.M, 3);
    const auto in = testing::make_batched_inputs(p, counts, 23);
    const auto ref = cpu_oracle(p, w, in, pool);
    for (const auto& cfg : plan::kGemmConfigs) {
      // One config for both GEMMs, wherever the table says it runs both shapes; a fused W1 config
      // on W1 (W2 by the rule) where the problem fuses W1.
      const bool fused = cfg.fused_w1;
      if (fused != plan::fuses_w1(p)) continue;
      if (fused ? !plan::supports(cfg, p.N, p.K, p.quant, true)
                : !plan::supports(cfg, p.N, p.K, p.quant) || !plan::supports(cfg, p.K, p.I(), p.quant))
        continue;
      const std::string ctx = c.model + " E_local=" + std::to_string(p.E_local) + " M=" + std::to_string(p.M) + " " +
                              std::string(quant_name(p.quant)) + " " + std::string(activation_name(p.activation)) +
                              " " + pattern + " " + std::string(cfg.name);
      const GpuRun r = gpu.run(in, both(cfg.id));
      const double rel = check_run(p, r, ref.output, counts, ctx);
      EXPECT_LT(rel, check::device_vs_cpu_tolerance(p.quant)) << ctx;
      std::printf("  %-62s end to end vs CPU %.3e\n", ctx.c_str(), rel);
      if (fused)
        check_fused_stages(p, w, r, ref, counts, pool, ctx);
      else if (!recipe_info(p.quant).requantizes_intermediate)
        check_bf16_stages(p, w, r, ref, counts, pool, ctx);
      else
        check_stages(p, w, r, ref, counts, pool, ctx);
      if (pattern == "skew") {
        const GpuRun again = gpu.run(in, both(cfg.id));
        EXPECT_EQ(r.output, again.output) << ctx << ": two runs differ";
      }
    }
    if (plan::fuses_w1(p)) {
      // The fused rule: experts of <= 64 rows on the swapped fp32-D tiles + the activation kernel
      // (w1_small), the others on the fused W1; the patterns mix both.
      const std::string ctx = c.model + " E_local=" + std::to_string(p.E_local) + " M=" + std::to_string(p.M) + " " +
                              std::string(activation_name(p.activation)) + " " + pattern + " fused rule";
      const GpuRun r = gpu.run(in, std::nullopt);
      const double rel = check_run(p, r, ref.output, counts, ctx);
      EXPECT_LT(rel, check::device_vs_cpu_tolerance(p.quant)) << ctx;
      std::printf("  %-62s end to end vs CPU %.3e\n", ctx.c_str(), rel);
      check_fused_stages(p, w, r, ref, counts, pool, ctx);
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
                      Case{"gpt-oss-120b", 3, 96, QuantScheme::kPerTensor},
                      // The other activations, on Qwen3-30B shapes (K = 2048, I = 768).
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTokenPerChannel, Activation::kGelu},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTokenPerChannel, Activation::kGeluTanh},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTokenPerChannel, Activation::kRelu2},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTensor, Activation::kSiluNoMul},
                      // Block-scaled (DeepSeek-V3's recipe): I = 14336 > 8192 (Mixtral) and swigluoai
                      // take the generic activation kernel, the others the row-per-block one.
                      Case{"deepseek-v3", 4, 256, QuantScheme::kBlock128},
                      Case{"qwen3-235b-a22b", 4, 192, QuantScheme::kBlock128},
                      Case{"mixtral-8x7b", 2, 160, QuantScheme::kBlock128},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kGelu},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kSwigluOai},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kRelu2},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kSiluNoMul},
                      // The fused W1 (fuse_w1: no w1_out): every activation it runs; qwen3-30b-a3b's
                      // I = 768 = 3 output groups, a non-gated tile's second group empty at the end.
                      Case{"deepseek-v3", 4, 256, QuantScheme::kBlock128, std::nullopt, true},
                      Case{"qwen3-235b-a22b", 4, 192, QuantScheme::kBlock128, std::nullopt, true},
                      Case{"mixtral-8x7b", 2, 160, QuantScheme::kBlock128, std::nullopt, true},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kGelu, true},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kGeluTanh, true},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kRelu2, true},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kSiluNoMul, true},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kPerTokenPerChannel, Activation::kGeluNoMul},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBlock128, Activation::kGeluNoMul, true},
                      // The unquantized recipe (bf16): the configs' 16-bit instances, every activation.
                      Case{"deepseek-v3", 4, 256, QuantScheme::kBf16},
                      Case{"qwen3-235b-a22b", 4, 192, QuantScheme::kBf16},
                      Case{"mixtral-8x7b", 2, 160, QuantScheme::kBf16}, Case{"gpt-oss-120b", 3, 96, QuantScheme::kBf16},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBf16},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBf16, Activation::kGelu},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBf16, Activation::kGeluTanh},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBf16, Activation::kRelu2},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBf16, Activation::kSiluNoMul},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kBf16, Activation::kGeluNoMul},
                      // fp16: the same instances in fp16, W1's output, act and the rows in fp16.
                      Case{"deepseek-v3", 4, 256, QuantScheme::kFp16}, Case{"gpt-oss-120b", 3, 96, QuantScheme::kFp16},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kFp16},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kFp16, Activation::kGelu},
                      Case{"qwen3-30b-a3b", 3, 80, QuantScheme::kFp16, Activation::kRelu2}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      std::string n = param_info.param.model + "_" + std::string(quant_name(param_info.param.quant));
      if (param_info.param.activation) n += "_" + std::string(activation_name(*param_info.param.activation));
      if (param_info.param.fuse_w1) n += "_fused_w1";
      return testing::test_name(n);
    });

// The GEMMs' sum over K (moekit::Accumulation) against the CPU's fp32 sums, at DeepSeek-V3's K = 7168
// (W1) and I = 2048 (W2), unfused (w1_out holds W1's output):
// - all-positive operands (every code's sign cleared): each product adds to a growing sum, where a
//   running sum kept in reduced precision loses the most. Precise: W1 within 1% of the CPU (the
//   fp32 promotion every 128 elements leaves bf16 rounding, ~2e-3); fast: low, within its documented
//   bound (moekit/types.h: up to ~20% at K = 7168; bound 30%).
// - random operands (the synthetic weights and tokens): W1 within kStageTolerance, precise or fast;
//   end to end within check::device_vs_cpu_tolerance.
struct AccumulationCase {
  QuantScheme quant;
  Accumulation accumulation;
};

void PrintTo(const AccumulationCase& c, std::ostream* os) {
  *os << quant_name(c.quant) << " " << accumulation_name(c.accumulation);
}

class AccumulationGpu : public ::testing::TestWithParam<AccumulationCase> {};

constexpr double kPreciseAllPositiveBound = 1e-2;
constexpr double kFastAllPositiveBound = 0.3;

std::uint8_t positive_code(std::uint8_t code) {
  const std::uint8_t magnitude = code & 0x7F;
  return magnitude == 0x7F ? 0x7E : magnitude;  // 0x7F is NaN: the largest finite code instead
}

TEST_P(AccumulationGpu, W1MatchesTheFp32SumsAtK7168) {
  MOEKIT_REQUIRE_GPU();
  const AccumulationCase c = GetParam();
  MoeProblem p = problem_for("deepseek-v3", 2, 64, c.quant);
  p.accumulation = c.accumulation;
  validate_problem(p);
  cpu::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const std::vector<std::int32_t> counts = {64, 37};
  for (const bool all_positive : {true, false}) {
    auto w = synthetic::make_expert_weights(p, 0, 31, pool);
    auto in = testing::make_batched_inputs(p, counts, 41);
    if (all_positive) {
      for (auto& code : w.w1) code = positive_code(code);
      for (auto& code : w.w2) code = positive_code(code);
      for (std::int64_t e = 0; e < p.E_local; ++e)
        for (std::int64_t i = 0; i < counts[static_cast<std::size_t>(e)] * p.K; ++i) {
          auto& code = in.a1q[static_cast<std::size_t>(e * p.M * p.K + i)];
          code = positive_code(code);
        }
    }
    const auto ref = cpu_oracle(p, w, in, pool);
    GpuExperts gpu(p, w);
    const GpuRun r = gpu.run(in, std::nullopt);
    const auto* gpu_w1 = reinterpret_cast<const std::uint16_t*>(r.workspace.data() + r.placed.region("w1_out").offset);
    const double w1_err = rel_err_valid(p, gpu_w1, ref.w1_out.data(), p.N, counts);
    // The mean signed relative difference of W1's outputs: how far low (negative) the sums come out.
    double signed_sum = 0;
    std::int64_t values = 0;
    for (std::int64_t e = 0; e < p.E_local; ++e)
      for (std::int64_t i = 0; i < counts[static_cast<std::size_t>(e)] * p.N; ++i) {
        const double g = v16(p, gpu_w1[e * p.M * p.N + i]), y = v16(p, ref.w1_out[e * p.M * p.N + i]);
        if (y != 0) signed_sum += (g - y) / std::fabs(y), ++values;
      }
    const double end_to_end = check_run(p, r, ref.output, counts, "accumulation");
    const std::string ctx = std::string(quant_name(p.quant)) + " " + std::string(accumulation_name(p.accumulation)) +
                            (all_positive ? " all-positive" : " random");
    std::printf("  %-36s W1 vs CPU %.3e (mean signed %+.3e), end to end %.3e\n", ctx.c_str(), w1_err,
                values ? signed_sum / static_cast<double>(values) : 0.0, end_to_end);
    if (all_positive) {
      EXPECT_LT(w1_err, c.accumulation == Accumulation::kFast ? kFastAllPositiveBound : kPreciseAllPositiveBound)
          << ctx;
    } else {
      EXPECT_LT(w1_err, kStageTolerance) << ctx;
      EXPECT_LT(end_to_end, check::device_vs_cpu_tolerance(p.quant)) << ctx;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schemes, AccumulationGpu,
                         ::testing::Values(AccumulationCase{QuantScheme::kPerTokenPerChannel, Accumulation::kPrecise},
                                           AccumulationCase{QuantScheme::kPerTensor, Accumulation::kPrecise},
                                           AccumulationCase{QuantScheme::kBlock128, Accumulation::kPrecise},
                                           AccumulationCase{QuantScheme::kPerTokenPerChannel, Accumulation::kFast},
                                           AccumulationCase{QuantScheme::kPerTensor, Accumulation::kFast}),
                         [](const ::testing::TestParamInfo<AccumulationCase>& info) {
                           return testing::test_name(std::string(quant_name(info.param.quant)) + "_" +
                                                     std::string(accumulation_name(info.param.accumulation)));
                         });

TEST(BatchedExpertsGpuContract, CountOverCapacityIsAnErrorAndWritesNothing) {
  MOEKIT_REQUIRE_GPU();
  const MoeProblem p = problem_for("qwen3-30b-a3b", 3, 64, QuantScheme::kPerTokenPerChannel);
  cpu::ThreadPool pool(4);
  const auto w = synthetic::make_expert_weights(p, 0, 5, pool);
  GpuExperts gpu(p, w);
  std::vector<std::int32_t> counts = {10, static_cast<std::int32_t>(p.M + 5), 64};
  auto in = testing::make_batched_inputs(p, {10, 0, 64}, 9);
  in.expert_num_tokens = counts;
  try {
    gpu.run(in, both(plan::GemmConfig::kCooperative128x128), true);
    FAIL() << "expert_num_tokens > M was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert_num_tokens[1] = 69"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("M = 64"), std::string::npos) << e.what();
  }
  // The bad expert wrote nothing; the others are right.
  const GpuRun r = gpu.run(in, both(plan::GemmConfig::kCooperative128x128), false);
  auto ok_in = in;
  ok_in.expert_num_tokens = {10, 0, 64};
  const auto ref = cpu_oracle(p, w, ok_in, pool);
  EXPECT_LT(check_run(p, r, ref.output, counts, "count over M"), check::device_vs_cpu_tolerance(p.quant));
  check_stages(p, w, r, ref, {10, 0, 64}, pool, "count over M");
}

// The rule's ragged tails (plan::ragged_tail_rows): an expert on cooperative-128x128 whose last
// 128-row token tile holds at most 64 rows runs those rows in the swapped launch of their count, from
// their own first row. The GEMM arguments the prepare kernel wrote say so (each launch's rows and the
// tail's token pointer), the rows of every launch together are the expert's, and the result is the
// CPU's stage by stage: per-token and per-tensor on gpt-oss's shapes (W1 and W2 on cooperative), and
// block128 unfused on Qwen3-235B's (W1, k = 4096, on cooperative; W2, k = 1536, on block-128x256,
// which does not split; Qwen3-30B's W1 has k = 2048 and runs block-128x256 too).
TEST(BatchedExpertsGpuContract, RuleRunsRaggedTailsOnTheSwappedTiles) {
  MOEKIT_REQUIRE_GPU();
  struct Shape {
    const char* model;
    QuantScheme quant;
  };
  // 129: a 1-row tail; 192: 64; 193: a 65-row last tile stays; 300: 44; 40: swapped alone; 256: whole tiles.
  const std::vector<std::int32_t> counts = {129, 192, 193, 300, 40, 256};
  for (const Shape s :
       {Shape{"gpt-oss-120b", QuantScheme::kPerTokenPerChannel}, Shape{"gpt-oss-120b", QuantScheme::kPerTensor},
        Shape{"qwen3-235b-a22b", QuantScheme::kBlock128}}) {
    const MoeProblem p = problem_for(s.model, static_cast<std::int64_t>(counts.size()), 320, s.quant);
    ASSERT_FALSE(plan::fuses_w1(p));
    const std::string ctx = std::string(s.model) + " " + std::string(quant_name(s.quant)) + " rule, ragged tails";
    cpu::ThreadPool pool(8);
    const auto w = synthetic::make_expert_weights(p, 0, 41, pool);
    GpuExperts gpu(p, w);
    const auto in = testing::make_batched_inputs(p, counts, 17);
    const GpuRun r = gpu.run(in, std::nullopt);
    const plan::ExpertsGemmPlan gemms = plan::plan_experts_gemms(p, p.max_tokens_per_rank);
    ASSERT_EQ(gemms.w1.tail_tile[gemms.w1.count - 1], 128) << ctx << ": W1's cooperative launch splits";
    const auto* a1q = gpu.workspace().get<std::uint8_t>("a1q");
    int split = 0;
    for (int which = 1; which <= 2; ++which) {
      const plan::GemmLaunches& l = which == 1 ? gemms.w1 : gemms.w2;
      const std::int64_t k = which == 1 ? p.K : p.I();
      std::vector<std::uint8_t> args(
          r.workspace.begin() + r.placed.region(which == 1 ? "gemm_args_w1" : "gemm_args_w2").offset,
          r.workspace.end());
      for (std::size_t g = 0; g < counts.size(); ++g) {
        const std::int64_t m = counts[g];
        int home = 0;
        for (int j = 0; j < l.count; ++j)
          if (m >= l.lo[j] && m <= l.hi[j]) home = j;
        const std::int64_t tail = plan::ragged_tail_rows(m, l.tail_tile[home]);
        std::int64_t sum = 0;
        for (int j = 0; j < l.count; ++j) {
          const bool swap = plan::gemm_config_info(l.config[j]).swap_ab;
          const cuda::GroupedGemmArrays a = cuda::GroupedGemmArrays::at(
              reinterpret_cast<std::byte*>(args.data()) + j * p.E_local * cuda::kGemmArgsBytesPerGroup,
              static_cast<int>(p.E_local));
          const int rows = a.shapes[3 * g + (swap ? 1 : 0)];
          const bool takes_tail = tail > 0 && j != home && tail >= l.lo[j] && tail <= l.hi[j];
          const std::int64_t want = j == home ? m - tail : takes_tail ? tail : 0;
          EXPECT_EQ(rows, want) << ctx << " W" << which << " launch " << j << " expert " << g << " of " << m << " rows";
          sum += rows;
          if (takes_tail && which == 1) {
            ++split;
            const void* tokens = swap ? a.ptr_B[g] : a.ptr_A[g];
            EXPECT_EQ(tokens, a1q + (static_cast<std::int64_t>(g) * p.M + m - tail) * k)
                << ctx << ": the tail's tokens start at its own first row";
          }
        }
        EXPECT_EQ(sum, m) << ctx << " W" << which << " expert " << g << ": the launches' rows are the expert's";
      }
    }
    EXPECT_EQ(split, 3) << ctx << ": W1 splits the experts of 129, 192 and 300 rows";
    const auto ref = cpu_oracle(p, w, in, pool);
    EXPECT_LT(check_run(p, r, ref.output, counts, ctx), check::device_vs_cpu_tolerance(p.quant)) << ctx;
    check_stages(p, w, r, ref, counts, pool, ctx);
  }
}

std::string quant_param_name(const ::testing::TestParamInfo<QuantScheme>& info) {
  return testing::test_name(std::string(quant_name(info.param)));
}

// The activation kernels' cases: every scaling, and every W1 row layout the row-per-block kernel
// reads (halves, block pairs, interleaved gate / up pairs, single rows).
struct ActivationKernelCase {
  const char* model;
  QuantScheme quant;
  std::optional<Activation> activation;
};

class ActivationKernels : public ::testing::TestWithParam<ActivationKernelCase> {};

TEST_P(ActivationKernels, AgreeBitForBit) {
  MOEKIT_REQUIRE_GPU();
  // Every variant computes the same formulas and an exact max: identical codes and scales.
  const MoeProblem p = problem_for(GetParam().model, 3, 96, GetParam().quant, GetParam().activation);
  const std::int64_t spr = numerics::activation_scales_per_row(p.quant, p.I());
  const bool per_tensor = p.quant == QuantScheme::kPerTensor;
  cpu::ThreadPool pool(4);
  const auto w = synthetic::make_expert_weights(p, 0, 12, pool);
  GpuExperts gpu(p, w);
  const auto counts = pattern_counts("ragged", p.E_local, p.M, 2);
  const auto in = testing::make_batched_inputs(p, counts, 6);
  const auto configs = both(plan::GemmConfig::kCooperative128x128);  // every scaling has it
  const GpuRun base = gpu.run(in, configs);                          // leaves w1_out and row_offsets in the workspace
  Workspace& ws = gpu.workspace();
  const ExpertsInput input{ws.get<std::uint8_t>("a1q"),
                           ws.get<float>("a1q_scale"),
                           ws.get<std::int32_t>("expert_num_tokens"),
                           nullptr,
                           p.M,
                           ws.get<std::uint16_t>("expert_output")};
  const cuda::BatchedExpertsLaunch l =
      cuda::make_launch(p, input, gpu.weights(), ws, cuda::current_device_num_sms(), plan::single_config(configs, p));
  const auto& act = base.placed.region("act_q");
  const auto& scale = base.placed.region("act_scale");
  for (auto kernel : {cuda::ActivationKernel::kGeneric, cuda::ActivationKernel::kRowPerBlock}) {
    MOEKIT_CUDA_CHECK(cudaMemset(l.act_q, 0xFF, static_cast<std::size_t>(act.bytes)));
    MOEKIT_CUDA_CHECK(cudaMemset(l.act_scale, 0xFF, static_cast<std::size_t>(scale.bytes)));
    cuda::launch_activation_quant(l, kernel, nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::uint8_t> q(static_cast<std::size_t>(act.bytes));
    std::vector<float> sc(static_cast<std::size_t>(scale.bytes / 4));
    MOEKIT_CUDA_CHECK(cudaMemcpy(q.data(), l.act_q, q.size(), cudaMemcpyDeviceToHost));
    MOEKIT_CUDA_CHECK(cudaMemcpy(sc.data(), l.act_scale, sc.size() * 4, cudaMemcpyDeviceToHost));
    const std::int64_t I = p.I();
    for (std::int64_t e = 0; e < p.E_local; ++e) {
      const std::int64_t m = counts[static_cast<std::size_t>(e)];
      for (std::int64_t r = 0; r < m; ++r) {
        const std::size_t row = static_cast<std::size_t>(e * p.M + r);
        EXPECT_EQ(std::memcmp(q.data() + row * I, base.workspace.data() + act.offset + row * I, I), 0)
            << "kernel " << static_cast<int>(kernel) << " expert " << e << " row " << r;
        for (std::int64_t j = 0; j < spr; ++j) {
          float base_scale;
          std::memcpy(&base_scale, base.workspace.data() + scale.offset + (row * spr + j) * 4, 4);
          EXPECT_EQ(sc[row * spr + j], base_scale)
              << "kernel " << static_cast<int>(kernel) << " expert " << e << " row " << r << " scale " << j;
        }
      }
      if (per_tensor) {  // one scale an expert's tensor
        float base_scale;
        std::memcpy(&base_scale, base.workspace.data() + scale.offset + e * 4, 4);
        EXPECT_EQ(sc[static_cast<std::size_t>(e)], base_scale)
            << "kernel " << static_cast<int>(kernel) << " expert " << e;
        EXPECT_GT(base_scale, 0.0f) << "expert " << e;
      }
    }
  }
}

// The plan of a fused W1 (fuse_w1): no w1_out region at all, every other region and guard intact,
// the output as the CPU's; a CUDA graph replay equals the eager run.
TEST(BatchedExpertsGpuContract, FusedW1PlanHasNoW1Out) {
  MOEKIT_REQUIRE_GPU();
  for (Activation act : {Activation::kSilu, Activation::kRelu2}) {
    const MoeProblem p = problem_for("qwen3-30b-a3b", 3, 200, QuantScheme::kBlock128, act, true);
    ASSERT_TRUE(plan::fuses_w1(p));
    cpu::ThreadPool pool(4);
    const auto w = synthetic::make_expert_weights(p, 0, 31, pool);
    const ExpertsEntry& entry = find_experts("batched-fp8", Device::kCuda);
    GpuExperts gpu(p, w);
    EXPECT_EQ(gpu.workspace().plan().find_region("w1_out"), nullptr);
    MoeProblem unfused_p = p;
    unfused_p.fuse_w1 = false;
    const WorkspacePlan unfused = plan_layer(unfused_p, entry, 1);
    // w1_out gone; w1_small (the fp32 W1 rows of the experts of <= 64 rows) in.
    const WorkspacePlan fused = plan_layer(p, entry, 1);
    EXPECT_EQ(fused.region("w1_small").bytes, p.E_local * 64 * p.N * 4);
    EXPECT_EQ(unfused.total_bytes - fused.total_bytes, unfused.region("w1_out").bytes - fused.region("w1_small").bytes);
    EXPECT_EQ(unfused.region("w1_out").bytes, p.E_local * p.M * p.N * 2);
    const auto counts = pattern_counts("ragged", p.E_local, p.M, 5);
    const auto in = testing::make_batched_inputs(p, counts, 3);
    const auto ref = cpu_oracle(p, w, in, pool);
    const GpuRun r = gpu.run(in, std::nullopt);
    const std::string ctx = std::string("fused plan ") + std::string(activation_name(act));
    EXPECT_LT(check_run(p, r, ref.output, counts, ctx), check::device_vs_cpu_tolerance(p.quant));
    check_fused_stages(p, w, r, ref, counts, pool, ctx);
    // An unfused config does not follow this problem's recipe: a clear error, not a crash.
    EXPECT_THROW(gpu.run(in, plan::GemmConfig::kCooperative128x128), Error);

    const ExpertsInput input = gpu.load(in);
    const auto experts = cuda::make_batched_experts({});
    Stream stream = cuda::create_stream();
    cuda::Graph graph([&](Stream s) { experts->run(p, input, gpu.weights(), gpu.workspace(), s); }, stream);
    for (int replay = 0; replay < 2; ++replay) graph.replay(stream);
    experts->check_status(gpu.workspace(), stream);  // synchronizes
    EXPECT_EQ(gpu.download().output, r.output) << ctx << ": graph replay";
    cuda::destroy_stream(stream);
  }
}

INSTANTIATE_TEST_SUITE_P(
    BatchedExpertsGpuContract, ActivationKernels,
    ::testing::Values(ActivationKernelCase{"deepseek-v3", QuantScheme::kPerTokenPerChannel, std::nullopt},
                      ActivationKernelCase{"deepseek-v3", QuantScheme::kBlock128, std::nullopt},
                      ActivationKernelCase{"deepseek-v3", QuantScheme::kPerTensor, std::nullopt},
                      ActivationKernelCase{"deepseek-v3", QuantScheme::kPerTokenPerChannel, Activation::kRelu2},
                      ActivationKernelCase{"gpt-oss-120b", QuantScheme::kPerTokenPerChannel, std::nullopt},
                      ActivationKernelCase{"gpt-oss-120b", QuantScheme::kPerTensor, std::nullopt}),
    [](const ::testing::TestParamInfo<ActivationKernelCase>& info) {
      std::string n = std::string(info.param.model) + "_" + std::string(quant_name(info.param.quant)) + "_" +
                      (info.param.activation ? std::string(activation_name(*info.param.activation)) : "default");
      return testing::test_name(n);
    });

class GraphReplay : public ::testing::TestWithParam<QuantScheme> {};

TEST_P(GraphReplay, MatchesEagerRun) {
  MOEKIT_REQUIRE_GPU();
  const MoeProblem p = problem_for("deepseek-v3", 2, 64, GetParam());
  cpu::ThreadPool pool(4);
  const auto w = synthetic::make_expert_weights(p, 0, 8, pool);
  GpuExperts gpu(p, w);
  const auto counts = pattern_counts("ragged", p.E_local, p.M, 1);
  const auto in = testing::make_batched_inputs(p, counts, 4);
  const auto configs = both(plan::GemmConfig::kSwapAB128x32);
  const GpuRun eager = gpu.run(in, configs);

  const ExpertsInput input = gpu.load(in);  // poisoned again
  const auto experts = cuda::make_batched_experts({}, configs);
  Stream stream = cuda::create_stream();
  cuda::Graph graph([&](Stream s) { experts->run(p, input, gpu.weights(), gpu.workspace(), s); }, stream);
  for (int replay = 0; replay < 2; ++replay) graph.replay(stream);
  experts->check_status(gpu.workspace(), stream);  // synchronizes
  EXPECT_EQ(gpu.download().output, eager.output);
  cuda::destroy_stream(stream);
}

INSTANTIATE_TEST_SUITE_P(BatchedExpertsGpuContract, GraphReplay,
                         ::testing::Values(QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128, QuantScheme::kBf16,
                                           QuantScheme::kFp16),
                         quant_param_name);

// A step captured once with the rule's three row ranges, replayed over counts that fall in one
// range, in each, or in none: every replay equals an eager run of the same counts bit for bit (the
// prepare kernel re-gives each expert to the launch of its rows at every replay, whatever the replay
// before ran), and a step with no rows writes nothing.
struct ReplayCase {
  QuantScheme quant;
  bool fuse_w1;
};

// The recipes (per-token; block128 unfused and fused; bf16; fp16) and their test names.
const auto kRecipes =
    ::testing::Values(ReplayCase{QuantScheme::kPerTokenPerChannel, false}, ReplayCase{QuantScheme::kBlock128, false},
                      ReplayCase{QuantScheme::kBlock128, true}, ReplayCase{QuantScheme::kBf16, false},
                      ReplayCase{QuantScheme::kFp16, false});
std::string recipe_name(const ::testing::TestParamInfo<ReplayCase>& info) {
  return testing::test_name(std::string(quant_name(info.param.quant))) + (info.param.fuse_w1 ? "_fused" : "");
}

class GraphReplayFollowsTheCounts : public ::testing::TestWithParam<ReplayCase> {};

TEST_P(GraphReplayFollowsTheCounts, EachReplayEqualsAnEagerRun) {
  MOEKIT_REQUIRE_GPU();
  const auto [quant, fuse] = GetParam();
  const MoeProblem p = problem_for("qwen3-30b-a3b", 4, 200, quant, std::nullopt, fuse);
  const plan::ExpertsGemmPlan rule = plan::plan_experts_gemms(p, p.M);
  ASSERT_EQ(rule.w2.count, 3) << "the test wants W2's three row ranges: " << plan::describe(rule.w2);
  cpu::ThreadPool pool(4);
  const auto w = synthetic::make_expert_weights(p, 0, 41, pool);
  GpuExperts gpu(p, w);
  const std::vector<std::vector<std::int32_t>> patterns = {
      {5, 32, 0, 17},     // the first range only
      {200, 65, 130, 0},  // the last range only
      {3, 50, 200, 0},    // one expert in each
      {0, 0, 0, 0},       // no rows: nothing runs, nothing is written
      {40, 64, 33, 1},    // the first two
  };
  const auto experts = cuda::make_batched_experts({});
  Stream stream = cuda::create_stream();
  const ExpertsInput input = gpu.load(testing::make_batched_inputs(p, patterns[0], 1));
  cuda::Graph graph([&](Stream s) { experts->run(p, input, gpu.weights(), gpu.workspace(), s); }, stream);
  for (std::size_t i = 0; i < patterns.size(); ++i) {
    const auto& counts = patterns[i];
    const auto in = testing::make_batched_inputs(p, counts, 10 + static_cast<int>(i));
    const GpuRun eager = gpu.run(in, std::nullopt);
    gpu.load(in);  // poisoned again
    graph.replay(stream);
    experts->check_status(gpu.workspace(), stream);  // synchronizes
    const GpuRun replay = gpu.download();
    const std::string ctx = std::string(quant_name(quant)) + (fuse ? " fused" : "") + " pattern " + std::to_string(i);
    EXPECT_EQ(replay.output, eager.output) << ctx << ": graph replay differs from the eager run";
    check_run(p, replay, eager.output, counts, ctx);  // guards intact, padding rows unwritten
  }
  cuda::destroy_stream(stream);
}

INSTANTIATE_TEST_SUITE_P(BatchedExpertsGpuContract, GraphReplayFollowsTheCounts, kRecipes, recipe_name);

// The launch cache (cuda/launch_cache.h): launches that reuse bound host work (CUTLASS's
// parameters, the TMA descriptors) equal launches that redo it, bit for bit, over two workspaces
// (and two copies of the weights) used in turn and counts that change between calls: a key that
// missed an input would launch into the other workspace, or with the other weights.
class LaunchCache : public ::testing::TestWithParam<ReplayCase> {};

TEST_P(LaunchCache, BoundLaunchesEqualFreshOnes) {
  MOEKIT_REQUIRE_GPU();
  const auto [quant, fuse] = GetParam();
  const MoeProblem p = problem_for("qwen3-30b-a3b", 4, 200, quant, std::nullopt, fuse);
  cpu::ThreadPool pool(4);
  const auto w = synthetic::make_expert_weights(p, 0, 43, pool);
  GpuExperts a(p, w), b(p, w);
  const std::vector<std::vector<std::int32_t>> patterns = {{5, 32, 0, 17}, {200, 65, 130, 0}, {3, 50, 200, 1}};
  struct Restore {
    ~Restore() { cuda::detail::set_launch_cache_enabled(true); }
  } restore;
  cuda::detail::set_launch_cache_enabled(false);
  std::vector<GpuRun> fresh;
  for (std::size_t i = 0; i < patterns.size(); ++i)
    fresh.push_back(a.run(testing::make_batched_inputs(p, patterns[i], 50 + static_cast<int>(i)), std::nullopt));
  cuda::detail::set_launch_cache_enabled(true);
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t i = 0; i < patterns.size(); ++i) {
      const auto in = testing::make_batched_inputs(p, patterns[i], 50 + static_cast<int>(i));
      for (GpuExperts* gpu : {&a, &b}) {
        const GpuRun bound = gpu->run(in, std::nullopt);
        const std::string ctx = std::string(quant_name(quant)) + (fuse ? " fused" : "") + " pass " +
                                std::to_string(pass) + " pattern " + std::to_string(i) +
                                (gpu == &a ? " (workspace a)" : " (workspace b)");
        EXPECT_EQ(bound.output, fresh[i].output) << ctx << ": a bound launch differs from a fresh one";
        check_run(p, bound, fresh[i].output, patterns[i], ctx);  // guards intact, padding rows unwritten
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BatchedExpertsGpuContract, LaunchCache, kRecipes, recipe_name);

}  // namespace
}  // namespace moekit
