// The whole layer on every device present, against the CPU layer on the same inputs and weights:
// every activation, both formats, per-token and per-tensor scales; T = 0, T = 1, every token to one
// expert, T not a multiple of any tile; checked mode (guard bands, NaN-poisoned workspace) changes
// nothing; a NaN or Inf in one token's hidden state changes only that token's output; a workspace
// the GPU cannot hold is an Error naming the plan's figure and the free memory. GPU cases skip, by
// name, without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "check/reference.h"
#include "cuda/backend.h"
#include "cuda/launch.h"
#include "layer_test_util.h"
#include "moekit/check.h"
#include "moekit/registry.h"
#include "test_names.h"

namespace moekit {
namespace {

using numerics::bf16_decode;

// A device against the CPU on the same inputs: check::device_vs_cpu_tolerance (3e-2; per-tensor 5e-2,
// whose one scale over a slab moves: tiny with relu2 at 600 tokens measured 3.3e-2 standard, 1.1e-2
// batched, the same layer at 450 or 900 tokens 0.6e-2).
using check::device_vs_cpu_tolerance;
constexpr std::uint64_t kSeed = 29;

struct Case {
  std::string model = "tiny";
  std::string experts = "batched-fp8";
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  Activation activation = Activation::kSilu;
  std::int64_t tokens = 13;
  std::int64_t num_experts = 0;  // 0: the model's
  bool fuse_w1 = false;
};

// "tiny": DeepSeek-style (grouped sigmoid routing, one ungated shared expert); "tiny-gated":
// Qwen2-MoE-style (softmax routing, a gated shared expert of twice the routed size); else a preset.
ModelConfig model_of(const Case& c) {
  ModelConfig m = c.model == "tiny"         ? synthetic::tiny_model(true)
                  : c.model == "tiny-gated" ? synthetic::tiny_model(false)
                                            : load_model(c.model);
  if (c.model == "tiny-gated") {
    m.shared_intermediate_size = 2 * m.moe_intermediate_size;
    m.num_shared_experts = 1;
    m.shared_expert_gate = true;
  }
  if (c.num_experts > 0) m.num_experts = c.num_experts;
  m.activation = c.activation;
  m.expert_bias = m.expert_bias && c.activation == Activation::kSwigluOai;  // gpt-oss's biases, with its activation
  return m;
}

// Device pointers of one layer's inputs and output, for `body`.
struct LayerIo {
  MoeLayer& layer;
  const std::uint16_t* hidden;
  const float* logits;
  std::uint16_t* output;
};

// One rank's layer on `device` with the seeded synthetic weights, inputs on the device; `body` runs
// it. Returns the outputs on the host after `body`.
std::vector<std::uint16_t> with_layer(const Case& c, Device device, const synthetic::Tokens& tokens, bool checked,
                                      const std::function<void(LayerIo&)>& body) {
  const ModelConfig m = model_of(c);
  const ParallelConfig par{1, 1, std::max<std::int64_t>(c.tokens, 1), 0};
  const ExpertsEntry& entry = find_experts(c.experts, device);
  const MoeProblem p = make_problem(m, par, entry.format, c.quant);
  cpu::ThreadPool pool(2);
  const auto w = synthetic::make_expert_weights(p, 0, kSeed, pool);
  const std::vector<float> bias = synthetic::make_routing_bias(m.num_experts, kSeed);
  const auto memory = make_memory(device);
  DeviceCopies copies(*memory);
  const ExpertWeightsView view = w.view(copies);
  const float* dbias = copies.put(bias, "bias");
  const std::uint16_t* hidden = copies.put(tokens.hidden, "hidden");
  const float* logits = copies.put(tokens.logits, "logits");
  std::vector<std::uint16_t> out(tokens.hidden.size(), 0);
  DeviceBuffer dout;
  std::uint16_t* output = out.data();
  if (device != Device::kCpu && !out.empty()) {
    dout = DeviceBuffer(*memory, static_cast<std::int64_t>(2 * out.size()), "output");
    output = dout.as<std::uint16_t>();
  }
  LayerOptions opt;
  opt.device = device;
  opt.experts = c.experts;
  opt.quant = c.quant;
  opt.fuse_w1 = c.fuse_w1;
  opt.checked = checked;
  opt.num_threads = 2;
  const auto shared = synthetic::make_shared_experts(m, p, kSeed, pool);
  LayerWeights lw{view, m.has_score_correction_bias ? dbias : nullptr};
  shared.set(lw, copies);
  run_in_process(1, [&](Communicator& comm) {
    MoeLayer layer(m, par, opt, lw, comm);
    LayerIo io{layer, hidden, logits, output};
    body(io);
  });
  if (output != out.data()) memory->to_host(out.data(), output, static_cast<std::int64_t>(2 * out.size()), nullptr);
  return out;
}

std::vector<std::uint16_t> run_layer(const Case& c, Device device, const synthetic::Tokens& tokens,
                                     bool checked = false) {
  return with_layer(c, device, tokens, checked,
                    [&](LayerIo& io) { io.layer.forward(io.hidden, io.logits, c.tokens, io.output); });
}

std::string name_of(const Case& c) {
  std::string n = c.model + "_" + c.experts + "_" + std::string(quant_name(c.quant)) + "_" +
                  std::string(activation_name(c.activation)) + "_T" + std::to_string(c.tokens) +
                  (c.fuse_w1 ? "_fused_w1" : "");
  return testing::test_name(n);
}

synthetic::Tokens tokens_of(const Case& c) {
  const ModelConfig m = model_of(c);
  return synthetic::make_tokens(m.hidden_size, m.num_experts, 0, c.tokens, 31);
}

class LayerOnDevice : public ::testing::TestWithParam<Case> {};

TEST_P(LayerOnDevice, MatchesTheCpuLayer) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  const Case c = GetParam();
  const auto tokens = tokens_of(c);
  const auto cpu = run_layer(c, Device::kCpu, tokens);
  const auto gpu = run_layer(c, Device::kCuda, tokens);
  const double err = testing::relative_difference(gpu, cpu);
  EXPECT_LT(err, device_vs_cpu_tolerance(c.quant)) << name_of(c);
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    if (std::isnan(bf16_decode(gpu[i]))) {
      ADD_FAILURE() << name_of(c) << ": NaN at output " << i;
      break;
    }
  }
  std::printf("  %-60s cuda vs cpu %.3e\n", name_of(c).c_str(), err);
  // Checked mode (guard bands, poisoned workspace) gives the same bits.
  if (c.tokens == 13) {
    EXPECT_EQ(run_layer(c, Device::kCuda, tokens, true), gpu) << name_of(c);
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (const char* experts : {"batched-fp8", "standard-fp8"}) {
    for (Activation a : all_activations())
      for (QuantScheme q : {QuantScheme::kPerTokenPerChannel, QuantScheme::kPerTensor})
        all.push_back({"tiny", experts, q, a, 13});
    // Edge sizes: none, one, not a multiple of any tile, more tokens than one expert's 64-row tile.
    for (std::int64_t T : {0, 1, 37, 300})
      all.push_back({"tiny", experts, QuantScheme::kPerTokenPerChannel, Activation::kSilu, T});
    // DeepSeek-V3's shapes and routing (grouped top-8 of 64 here, K = 7168, I = 2048), with its
    // own block-scaled recipe too.
    all.push_back({"deepseek-v3", experts, QuantScheme::kPerTokenPerChannel, Activation::kSilu, 24, 64});
    all.push_back({"deepseek-v3", experts, QuantScheme::kBlock128, Activation::kSilu, 24, 64});
    all.push_back({"tiny", experts, QuantScheme::kBlock128, Activation::kSilu, 37});
    // The fused W1 (no w1_out), both formats: the standard one aliases its tokens with w2_out then.
    all.push_back({"deepseek-v3", experts, QuantScheme::kBlock128, Activation::kSilu, 24, 64, true});
    all.push_back({"tiny", experts, QuantScheme::kBlock128, Activation::kRelu2, 37, 0, true});
    // Experts past 64 rows (1200 rows over 16 experts, grouped routing): the fused rule's second
    // launch, moekit's own block GEMM (fused-w1-128x256), gated and not.
    all.push_back({"tiny", experts, QuantScheme::kBlock128, Activation::kSilu, 300, 0, true});
    all.push_back({"tiny", experts, QuantScheme::kBlock128, Activation::kRelu2, 300, 0, true});
    // W1 on cooperative-128x128 (relu2's n = 128 is no multiple of 256; W2, n = 256, on pingpong):
    // 2400 rows over 16 experts, so that many hold 129-192 rows, whose last <= 64 run on the swapped
    // tiles (ragged_tail_rows), per-token and per-tensor (whose scale moves at 600 tokens here:
    // device_vs_cpu_tolerance). And block128 unfused past 64 rows (tiny's k = 256: block-128x256).
    all.push_back({"tiny", experts, QuantScheme::kPerTokenPerChannel, Activation::kRelu2, 600});
    all.push_back({"tiny", experts, QuantScheme::kPerTensor, Activation::kRelu2, 600});
    all.push_back({"tiny", experts, QuantScheme::kBlock128, Activation::kSilu, 300});
    // gpt-oss's interleaved W1 rows (swigluoai) and per-tensor scales past 64 experts: the standard
    // format's one scale must not be cleared as E_local of them (that ran into w1_out: guard bands).
    all.push_back({"gpt-oss-120b", experts, QuantScheme::kPerTensor, Activation::kSwigluOai, 13, 72});
    all.push_back({"gpt-oss-120b", experts, QuantScheme::kPerTokenPerChannel, Activation::kSwigluOai, 13, 72});
    // Qwen2-MoE's gated shared expert (its gate's dot product on the GPU, a shared N of 512),
    // decode-sized and past one tile, every scheme.
    all.push_back({"tiny-gated", experts, QuantScheme::kPerTokenPerChannel, Activation::kSilu, 13});
    all.push_back({"tiny-gated", experts, QuantScheme::kPerTensor, Activation::kSilu, 13});
    all.push_back({"tiny-gated", experts, QuantScheme::kBlock128, Activation::kSilu, 300, 0, true});
    // The unquantized recipe (bf16: the configs' 16-bit instances, act in bf16, bf16 rows through
    // the scatter / permutation): every activation, the edge sizes, each of the rule's three row
    // ranges (600 tokens: experts past 64 rows on cooperative-128x256), DeepSeek-V3's shapes,
    // gpt-oss's interleaved rows and expert biases, Qwen2-MoE's gated shared expert.
    for (Activation a : all_activations()) all.push_back({"tiny", experts, QuantScheme::kBf16, a, 13});
    for (std::int64_t T : {0, 1, 37, 600}) all.push_back({"tiny", experts, QuantScheme::kBf16, Activation::kSilu, T});
    all.push_back({"deepseek-v3", experts, QuantScheme::kBf16, Activation::kSilu, 24, 64});
    all.push_back({"gpt-oss-120b", experts, QuantScheme::kBf16, Activation::kSwigluOai, 13, 72});
    all.push_back({"tiny-gated", experts, QuantScheme::kBf16, Activation::kSilu, 13});
    // fp16: the bf16 tokens rounded to fp16 at the scatter / permutation, fp16 rows combined into bf16.
    for (std::int64_t T : {1, 37, 600}) all.push_back({"tiny", experts, QuantScheme::kFp16, Activation::kSilu, T});
    all.push_back({"gpt-oss-120b", experts, QuantScheme::kFp16, Activation::kSwigluOai, 13, 72});
    all.push_back({"tiny-gated", experts, QuantScheme::kFp16, Activation::kGelu, 13});
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Cases, LayerOnDevice, ::testing::ValuesIn(cases()),
                         [](const auto& param_info) { return name_of(param_info.param); });

class LayerEveryDevice : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override {
    if (GetParam() == Device::kCuda && !cuda::available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(LayerEveryDevice, EveryTokenToOneExpert) {
  for (const char* experts : {"batched-fp8", "standard-fp8"}) {
    Case c{"tiny", experts, QuantScheme::kPerTokenPerChannel, Activation::kSilu, 40};
    auto tokens = tokens_of(c);
    for (std::int64_t t = 0; t < c.tokens; ++t) tokens.logits[static_cast<std::size_t>(t * 16 + 5)] = 50.0f;
    const auto out = run_layer(c, GetParam(), tokens);
    const auto cpu = run_layer(c, Device::kCpu, tokens);
    EXPECT_LT(testing::relative_difference(out, cpu), device_vs_cpu_tolerance(c.quant)) << experts;
  }
}

// Per-token scales: a non-finite value in one token's hidden state reaches that token's output only.
TEST_P(LayerEveryDevice, NonFiniteHiddenStaysInItsToken) {
  for (const char* experts : {"batched-fp8", "standard-fp8"}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      Case c{"tiny", experts, QuantScheme::kPerTokenPerChannel, Activation::kSilu, 8};
      const auto clean = tokens_of(c);
      auto dirty = clean;
      dirty.hidden[3 * 256 + 17] = numerics::bf16_encode(bad);
      const auto a = run_layer(c, GetParam(), clean), b = run_layer(c, GetParam(), dirty);
      for (std::int64_t t = 0; t < c.tokens; ++t) {
        if (t == 3) continue;
        EXPECT_TRUE(std::equal(a.begin() + t * 256, a.begin() + (t + 1) * 256, b.begin() + t * 256))
            << experts << " bad value " << bad << " changed token " << t;
      }
    }
  }
}

TEST_P(LayerEveryDevice, NaNLogitIsAnErrorNamingTheToken) {
  Case c{"tiny", "batched-fp8", QuantScheme::kPerTokenPerChannel, Activation::kSilu, 6};
  auto tokens = tokens_of(c);
  tokens.logits[4 * 16 + 2] = std::numeric_limits<float>::quiet_NaN();
  try {
    run_layer(c, GetParam(), tokens);
    FAIL() << "a NaN router logit was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 4"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, LayerEveryDevice, ::testing::Values(Device::kCpu, Device::kCuda),
                         [](const auto& param_info) { return std::string(device_name(param_info.param)); });

// The whole step captured once and replayed: the same bits as the eager step, every replay. The
// small kernels of a step overlap their neighbours' launch (programmatic dependent launch,
// cuda/pdl.cuh): a kernel that read or wrote before its wait would show here as replays that differ,
// most likely at one token, where every kernel is shortest.
TEST(LayerOnGpu, GraphReplayEqualsEager) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  // Both shared experts (tiny's, tiny-gated's) run on the layer's second stream inside the capture.
  for (const char* model : {"tiny", "tiny-gated"})
    for (const char* experts : {"batched-fp8", "standard-fp8"})
      for (QuantScheme quant : {QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128})
        for (std::int64_t T : {1, 37}) {
          const Case c{model, experts, quant, Activation::kSilu, T};
          const auto tokens = tokens_of(c);
          const auto eager = run_layer(c, Device::kCuda, tokens);
          std::vector<std::vector<std::uint16_t>> replays;
          const auto memory = make_memory(Device::kCuda);
          with_layer(c, Device::kCuda, tokens, false, [&](LayerIo& io) {
            void* stream = cuda::create_stream();
            {
              cuda::Graph graph([&](void* s) { io.layer.enqueue(io.hidden, io.logits, c.tokens, io.output, s); },
                                stream);
              for (int i = 0; i < 8; ++i) {
                memory->fill(io.output, 0xFF, 2 * c.tokens * 256, stream);  // NaN before each replay
                graph.replay(stream);
                io.layer.check_status(stream);
                std::vector<std::uint16_t> out(static_cast<std::size_t>(c.tokens * 256));
                memory->to_host(out.data(), io.output, 2 * c.tokens * 256, stream);
                replays.push_back(out);
              }
            }
            cuda::destroy_stream(stream);
          });
          for (const auto& r : replays)
            EXPECT_EQ(r, eager) << model << " " << experts << " " << quant_name(quant) << " T = " << T;
        }
}

// A step's device flags outlive the steps after it (graph replays included) until check_status reads
// them, and reading clears them: a NaN logit in the first of three replays is reported after the
// third, and the next check passes.
TEST(LayerOnGpu, FlagsOutliveLaterStepsUntilRead) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  for (const char* experts : {"batched-fp8", "standard-fp8"}) {
    const Case c{"tiny", experts, QuantScheme::kPerTokenPerChannel, Activation::kSilu, 6};
    const auto tokens = tokens_of(c);
    std::vector<float> bad = tokens.logits;
    bad[4 * 16 + 2] = std::numeric_limits<float>::quiet_NaN();
    const auto memory = make_memory(Device::kCuda);
    with_layer(c, Device::kCuda, tokens, false, [&](LayerIo& io) {
      auto* logits = const_cast<float*>(io.logits);
      const auto bytes = static_cast<std::int64_t>(4 * bad.size());
      void* stream = cuda::create_stream();
      {
        cuda::Graph graph([&](void* s) { io.layer.enqueue(io.hidden, io.logits, c.tokens, io.output, s); }, stream);
        memory->from_host(logits, bad.data(), bytes, stream);
        graph.replay(stream);
        memory->from_host(logits, tokens.logits.data(), bytes, stream);
        graph.replay(stream);
        graph.replay(stream);
        try {
          io.layer.check_status(stream);
          ADD_FAILURE() << experts << ": the NaN logit of the first replay was not reported";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("token 4"), std::string::npos) << e.what();
        }
        EXPECT_NO_THROW(io.layer.check_status(stream)) << experts << ": reading the flag did not clear it";
        graph.replay(stream);
        EXPECT_NO_THROW(io.layer.check_status(stream)) << experts;
      }
      cuda::destroy_stream(stream);
    });
  }
}

TEST(LayerOnGpu, WorkspaceTheGpuCannotHoldIsAnError) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  // DeepSeek-V3, every expert on one GPU, 2^20 tokens: the batched workspace is ~8 TiB.
  const ModelConfig m = load_model("deepseek-v3");
  const ParallelConfig par{1, 1, std::int64_t{1} << 20, 0};
  const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, QuantScheme::kPerTokenPerChannel);
  const WorkspacePlan plan = plan_layer(p, find_experts("batched-fp8", Device::kCuda), 1);
  const auto memory = make_memory(Device::kCuda);
  DeviceBuffer scratch(*memory, 1 << 20, "fake weights");  // never read: construction fails at the allocation
  const ExpertWeightsView view =
      ExpertWeightsView::of(p, Device::kCuda, scratch.as<std::uint8_t>(), scratch.as<float>(),
                            scratch.as<std::uint8_t>(), scratch.as<float>());
  std::vector<float> bias(static_cast<std::size_t>(m.num_experts));
  DeviceBuffer dbias(*memory, 4 * m.num_experts, "bias");
  LayerOptions opt;
  opt.device = Device::kCuda;
  opt.shared_experts = false;  // the routed experts' workspace alone is past the GPU
  try {
    run_in_process(1, [&](Communicator& comm) { MoeLayer l(m, par, opt, {view, dbias.as<float>()}, comm); });
    FAIL() << "a " << plan.total_bytes << "-byte workspace was allocated";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(std::to_string(plan.total_bytes)), std::string::npos) << what;
    EXPECT_NE(what.find("free"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace moekit
