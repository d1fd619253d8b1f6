// One runtime for a model's MoE layers: 8 layers (each its own seeded weights, routing bias and
// shared experts) over exactly one workspace allocation per rank, at the plan's size; each layer's
// output equals that layer run alone (a MoeLayer), in any order of layers; on a GPU a CUDA graph of 4
// layers' steps (each layer's output the next one's input) replays bit for bit as the eager chain.
// Layers are validated when registered; an index no layer holds is an Error; a NaN names its layer
// and the seam it entered at.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "cuda/backend.h"
#include "cuda/launch.h"
#include "layer_test_util.h"
#include "moekit/check.h"
#include "moekit/runtime.h"
#include "test_names.h"

namespace moekit {
namespace {

constexpr int kLayers = 8;

// Layer L's weights on one rank: its experts, routing bias and shared experts from seed 100 + L.
struct HostLayer {
  synthetic::HostExpertWeights experts;
  synthetic::HostSharedExperts shared;
  std::vector<float> bias;
};

HostLayer make_host_layer(const ModelConfig& m, const MoeProblem& p, std::int64_t first_expert, int L) {
  cpu::ThreadPool pool(1);
  const auto seed = static_cast<std::uint64_t>(100 + L);
  return {synthetic::make_expert_weights(p, first_expert, seed, pool), synthetic::make_shared_experts(m, p, seed, pool),
          synthetic::make_routing_bias(m.num_experts, seed)};
}

LayerWeights weights_of(const HostLayer& h, DeviceCopies& copies) {
  LayerWeights w{h.experts.view(copies), copies.put(h.bias, "routing bias")};
  h.shared.set(w, copies);
  return w;
}

struct Layout {
  std::string experts;
  int ranks;
};

class RuntimeOnCpu : public ::testing::TestWithParam<Layout> {};

TEST_P(RuntimeOnCpu, EightLayersOneWorkspaceEachAsAlone) {
  const Layout lay = GetParam();
  const ModelConfig m = synthetic::tiny_model(true);  // grouped routing, correction bias, a shared expert
  const std::int64_t K = m.hidden_size, E = m.num_experts, T = 21;
  const auto tokens = synthetic::make_tokens(K, E, 0, T * lay.ranks, 7);
  LayerOptions opt;
  opt.experts = lay.experts;
  const ParallelConfig par{lay.ranks, lay.ranks, 16, 0};  // 21 tokens a rank: two chunks
  // outputs[L][rank], from the runtime and from each layer alone.
  std::vector<std::vector<std::vector<std::uint16_t>>> together(kLayers), alone(kLayers);
  for (auto& l : together) l.resize(static_cast<std::size_t>(lay.ranks));
  for (auto& l : alone) l.resize(static_cast<std::size_t>(lay.ranks));
  const MoeProblem p = make_problem(m, par, find_experts(opt.experts, Device::kCpu).format, opt.quant);
  const auto memory = make_memory(Device::kCpu);
  DeviceCopies copies(*memory);
  std::vector<std::vector<HostLayer>> host(static_cast<std::size_t>(lay.ranks));  // [rank][layer]
  for (int r = 0; r < lay.ranks; ++r)
    for (int L = 0; L < kLayers; ++L)
      host[static_cast<std::size_t>(r)].push_back(make_host_layer(m, p, first_local_expert(par, p, r), L));
  auto rank_io = [&](int r) { return std::pair{tokens.hidden.data() + r * T * K, tokens.logits.data() + r * T * E}; };

  const std::int64_t before = Workspace::allocation_count();
  run_in_process(lay.ranks, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto [hidden, logits] = rank_io(r);
    MoeRuntime runtime(m, par, opt, comm);
    for (int L = 0; L < kLayers; ++L)
      EXPECT_EQ(runtime.add_layer(weights_of(host[static_cast<std::size_t>(r)][static_cast<std::size_t>(L)], copies)),
                L);
    EXPECT_EQ(runtime.num_layers(), kLayers);
    EXPECT_EQ(runtime.allocated_workspace_bytes(), runtime.plan().total_bytes);
    for (int L : {3, 0, 7, 1, 6, 2, 5, 4, 3}) {  // any order, a layer twice
      auto& out = together[static_cast<std::size_t>(L)][static_cast<std::size_t>(r)];
      out.assign(static_cast<std::size_t>(T * K), 0xFFFF);
      runtime.forward(L, hidden, logits, T, out.data());
    }
  });
  EXPECT_EQ(Workspace::allocation_count() - before, lay.ranks) << "one workspace per rank for " << kLayers << " layers";

  run_in_process(lay.ranks, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto [hidden, logits] = rank_io(r);
    for (int L = 0; L < kLayers; ++L) {
      MoeLayer layer(m, par, opt, weights_of(host[static_cast<std::size_t>(r)][static_cast<std::size_t>(L)], copies),
                     comm);
      auto& out = alone[static_cast<std::size_t>(L)][static_cast<std::size_t>(r)];
      out.assign(static_cast<std::size_t>(T * K), 0xFFFF);
      layer.forward(hidden, logits, T, out.data());
    }
  });
  for (int L = 0; L < kLayers; ++L)
    for (int r = 0; r < lay.ranks; ++r)
      EXPECT_EQ(together[static_cast<std::size_t>(L)][static_cast<std::size_t>(r)],
                alone[static_cast<std::size_t>(L)][static_cast<std::size_t>(r)])
          << "layer " << L << " rank " << r;
  // Different layers compute different things (the comparison above is not of one layer eight times).
  EXPECT_NE(together[0][0], together[1][0]);
}

INSTANTIATE_TEST_SUITE_P(Layouts, RuntimeOnCpu,
                         ::testing::Values(Layout{"batched-fp8", 1}, Layout{"batched-fp8", 2},
                                           Layout{"standard-fp8", 1}),
                         [](const ::testing::TestParamInfo<Layout>& i) {
                           return testing::test_name(i.param.experts + "_dp" + std::to_string(i.param.ranks));
                         });

// One rank, counted alone: exactly one allocation for eight layers.
TEST(Runtime, ExactlyOneWorkspaceAllocation) {
  const ModelConfig m = synthetic::tiny_model(true);
  const ParallelConfig par{1, 1, 32, 0};
  LayerOptions opt;
  const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, opt.quant);
  const auto memory = make_memory(Device::kCpu);
  DeviceCopies copies(*memory);
  std::vector<HostLayer> host;
  for (int L = 0; L < kLayers; ++L) host.push_back(make_host_layer(m, p, 0, L));
  run_in_process(1, [&](Communicator& comm) {
    const std::int64_t before = Workspace::allocation_count();
    MoeRuntime runtime(m, par, opt, comm);
    for (const auto& h : host) runtime.add_layer(weights_of(h, copies));
    EXPECT_EQ(Workspace::allocation_count() - before, 1);
    const auto tokens = synthetic::make_tokens(m.hidden_size, m.num_experts, 0, 5, 3);
    std::vector<std::uint16_t> out(tokens.hidden.size());
    for (int L = 0; L < kLayers; ++L) runtime.forward(L, tokens.hidden.data(), tokens.logits.data(), 5, out.data());
    EXPECT_EQ(Workspace::allocation_count() - before, 1) << "a step allocated a workspace";
  });
}

TEST(RuntimeBadInput, LayersAreValidatedWhenRegisteredAndIndicesChecked) {
  const ModelConfig m = synthetic::tiny_model(true);
  const ParallelConfig par{1, 1, 8, 0};
  LayerOptions opt;
  const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, opt.quant);
  const auto memory = make_memory(Device::kCpu);
  DeviceCopies copies(*memory);
  const HostLayer h = make_host_layer(m, p, 0, 0);
  run_in_process(1, [&](Communicator& comm) {
    MoeRuntime runtime(m, par, opt, comm);
    std::vector<std::uint16_t> hidden(8 * 256), out(8 * 256);
    std::vector<float> logits(8 * 16);
    EXPECT_THROW(
        try { runtime.forward(0, hidden.data(), logits.data(), 1, out.data()); } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("layer 0 is not registered"), std::string::npos) << e.what();
          throw;
        },
        Error);
    LayerWeights no_bias = weights_of(h, copies);
    no_bias.e_score_correction_bias = nullptr;
    EXPECT_THROW(runtime.add_layer(no_bias), Error);
    LayerWeights wrong_shape = weights_of(h, copies);
    wrong_shape.experts.K = 128;
    EXPECT_THROW(runtime.add_layer(wrong_shape), Error);
    EXPECT_EQ(runtime.num_layers(), 0) << "a refused layer was registered";
    EXPECT_EQ(runtime.add_layer(weights_of(h, copies)), 0);
    EXPECT_THROW(runtime.enqueue(1, hidden.data(), logits.data(), 1, out.data()), Error);
    EXPECT_THROW(runtime.forward(-1, hidden.data(), logits.data(), 1, out.data()), Error);
    EXPECT_NO_THROW(runtime.forward(0, hidden.data(), logits.data(), 1, out.data()));
  });
}

// A NaN met at run time names the runtime's layer and the seam it entered at: a NaN logit (the router
// raises, the message says layer and seam), a NaN hidden state (the input), a NaN scale or FP8 NaN
// code in one layer's experts, a NaN in the shared expert's weights. Checked mode runs check_output
// inside forward; unchecked, the caller runs it (as `moekit run` does).
TEST(RuntimeBadInput, ANaNNamesTheLayerAndTheSeam) {
  const ModelConfig m = synthetic::tiny_model(true);
  const ParallelConfig par{1, 1, 8, 0};
  const std::int64_t K = m.hidden_size, E = m.num_experts, T = 5;
  const auto memory = make_memory(Device::kCpu);
  DeviceCopies copies(*memory);
  const auto tokens = synthetic::make_tokens(K, E, 0, T, 3);
  for (const bool checked : {true, false}) {
    LayerOptions opt;
    opt.checked = checked;
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, opt.quant);
    HostLayer good = make_host_layer(m, p, 0, 0), scale_nan = make_host_layer(m, p, 0, 1),
              code_nan = make_host_layer(m, p, 0, 2), shared_nan = make_host_layer(m, p, 0, 3);
    scale_nan.experts.w2_scale[3 * static_cast<std::size_t>(p.K)] = NAN;  // expert 3's first W2 scale
    std::fill(code_nan.experts.w1.begin(), code_nan.experts.w1.end(), std::uint8_t{0x7F});
    ASSERT_TRUE(shared_nan.shared.problem.has_value());
    shared_nan.shared.experts.w1_scale[0] = INFINITY;
    run_in_process(1, [&](Communicator& comm) {
      MoeRuntime runtime(m, par, opt, comm);
      for (const HostLayer* h : {&good, &scale_nan, &code_nan, &shared_nan}) runtime.add_layer(weights_of(*h, copies));
      std::vector<std::uint16_t> out(static_cast<std::size_t>(T * K));
      auto error_of = [&](int layer, const std::uint16_t* hidden, const float* logits) -> std::string {
        try {
          runtime.forward(layer, hidden, logits, T, out.data());
          if (!checked) runtime.check_output(layer, hidden, T, out.data());
        } catch (const Error& e) {
          return e.what();
        }
        return "";
      };
      const std::string ctx = checked ? "checked" : "unchecked";
      EXPECT_EQ(error_of(0, tokens.hidden.data(), tokens.logits.data()), "") << ctx;
      std::vector<float> logits = tokens.logits;
      logits[static_cast<std::size_t>(2 * E + 1)] = NAN;
      const std::string routed = error_of(0, tokens.hidden.data(), logits.data());
      EXPECT_NE(routed.find("layer 0, seam route:"), std::string::npos) << ctx << ": " << routed;
      EXPECT_NE(routed.find("token 2"), std::string::npos) << ctx << ": " << routed;
      std::vector<std::uint16_t> hidden = tokens.hidden;
      hidden[static_cast<std::size_t>(4 * K + 7)] = 0x7FC0;  // bf16 NaN
      const std::string input = error_of(0, hidden.data(), tokens.logits.data());
      EXPECT_NE(input.find("layer 0: output of token 4"), std::string::npos) << ctx << ": " << input;
      EXPECT_NE(input.find("the input: hidden state of token 4 column 7"), std::string::npos) << ctx << ": " << input;
      const std::string scale = error_of(1, tokens.hidden.data(), tokens.logits.data());
      EXPECT_NE(scale.find("layer 1: output of token"), std::string::npos) << ctx << ": " << scale;
      EXPECT_NE(scale.find("seam experts: local expert 3's W2 scale 0 is not finite"), std::string::npos)
          << ctx << ": " << scale;
      const std::string code = error_of(2, tokens.hidden.data(), tokens.logits.data());
      EXPECT_NE(code.find("layer 2:"), std::string::npos) << ctx << ": " << code;
      EXPECT_NE(code.find("seam experts: local expert 0's W1 code 0 is not finite"), std::string::npos)
          << ctx << ": " << code;
      const std::string shared = error_of(3, tokens.hidden.data(), tokens.logits.data());
      EXPECT_NE(shared.find("layer 3:"), std::string::npos) << ctx << ": " << shared;
      EXPECT_NE(shared.find("seam shared experts: local expert 0's W1 scale 0"), std::string::npos)
          << ctx << ": " << shared;
    });
  }
}

// The 16-bit recipes' weights are bf16 / fp16 values, not FP8 codes: the search for the non-finite
// weight reads them in the recipe's dtype (a value with a 0x7F byte, e.g. bf16 0x3F7F = 0.996, is
// finite; fp16's exponent field differs from bf16's) and names the value.
TEST(RuntimeBadInput, ASixteenBitNaNWeightIsNamedAsAValue) {
  for (const QuantScheme quant : {QuantScheme::kBf16, QuantScheme::kFp16}) {
    const ModelConfig m = synthetic::tiny_model(true);
    const ParallelConfig par{1, 1, 8, 0};
    const std::int64_t K = m.hidden_size, E = m.num_experts, T = 5;
    const auto memory = make_memory(Device::kCpu);
    DeviceCopies copies(*memory);
    const auto tokens = synthetic::make_tokens(K, E, 0, T, 3);
    LayerOptions opt;
    opt.quant = quant;
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, opt.quant);
    HostLayer bad = make_host_layer(m, p, 0, 0);
    ASSERT_EQ(bad.experts.w1.size(), static_cast<std::size_t>(2 * p.E_local * p.N * p.K));
    // Every value finite (bf16 0x7F7F, fp16 0x3C3C), then value 5 a NaN of the dtype (0x7FC0, 0x7E00).
    const bool fp16 = quant == QuantScheme::kFp16;
    std::fill(bad.experts.w1.begin(), bad.experts.w1.end(),
              std::uint8_t{fp16 ? std::uint8_t{0x3C} : std::uint8_t{0x7F}});
    bad.experts.w1[2 * 5] = fp16 ? 0x00 : 0xC0;
    bad.experts.w1[2 * 5 + 1] = fp16 ? 0x7E : 0x7F;
    run_in_process(1, [&](Communicator& comm) {
      MoeRuntime runtime(m, par, opt, comm);
      runtime.add_layer(weights_of(bad, copies));
      std::vector<std::uint16_t> out(static_cast<std::size_t>(T * K));
      std::string error;
      try {
        runtime.forward(0, tokens.hidden.data(), tokens.logits.data(), T, out.data());
        runtime.check_output(0, tokens.hidden.data(), T, out.data());
      } catch (const Error& e) {
        error = e.what();
      }
      EXPECT_NE(error.find("seam experts: local expert 0's W1 value 5 is not finite"), std::string::npos)
          << quant_name(quant) << ": " << error;
    });
  }
}

// On the GPU: 8 layers over one workspace, each equal to itself alone; a graph of 4 layers' steps,
// chained (each output the next layer's hidden), replays bit for bit as the eager chain.
TEST(RuntimeOnGpu, EightLayersAndAGraphOfFour) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  for (QuantScheme quant : {QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128}) {
    const ModelConfig m = synthetic::tiny_model(true);
    const std::int64_t K = m.hidden_size, E = m.num_experts, T = 37;
    const ParallelConfig par{1, 1, T, 0};
    LayerOptions opt;
    opt.device = Device::kCuda;
    opt.quant = quant;
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, quant);
    const auto memory = make_memory(Device::kCuda);
    DeviceCopies copies(*memory);
    std::vector<HostLayer> host;
    for (int L = 0; L < kLayers; ++L) host.push_back(make_host_layer(m, p, 0, L));
    const auto tokens = synthetic::make_tokens(K, E, 0, T, 11);
    const auto* hidden = copies.put(tokens.hidden, "hidden");
    const auto* logits = copies.put(tokens.logits, "logits");
    const std::int64_t bytes = T * K * 2;
    std::vector<DeviceBuffer> outs;
    for (int L = 0; L < kLayers; ++L) outs.emplace_back(*memory, bytes, "output");
    auto host_of = [&](const DeviceBuffer& b) {
      std::vector<std::uint16_t> h(static_cast<std::size_t>(T * K));
      memory->to_host(h.data(), b.get(), bytes, nullptr);
      return h;
    };
    std::vector<std::vector<std::uint16_t>> alone(kLayers);
    run_in_process(1, [&](Communicator& comm) {
      for (int L = 0; L < kLayers; ++L) {
        MoeLayer layer(m, par, opt, weights_of(host[static_cast<std::size_t>(L)], copies), comm);
        layer.forward(hidden, logits, T, outs[static_cast<std::size_t>(L)].as<std::uint16_t>());
        alone[static_cast<std::size_t>(L)] = host_of(outs[static_cast<std::size_t>(L)]);
      }
      const std::int64_t before = Workspace::allocation_count();
      MoeRuntime runtime(m, par, opt, comm);
      for (const auto& h : host) runtime.add_layer(weights_of(h, copies));
      EXPECT_EQ(Workspace::allocation_count() - before, 1);
      for (int L = kLayers - 1; L >= 0; --L) {
        memory->fill(outs[static_cast<std::size_t>(L)].get(), 0xFF, bytes, nullptr);
        runtime.forward(L, hidden, logits, T, outs[static_cast<std::size_t>(L)].as<std::uint16_t>());
        EXPECT_EQ(host_of(outs[static_cast<std::size_t>(L)]), alone[static_cast<std::size_t>(L)])
            << quant_name(quant) << " layer " << L;
      }
      // The chain: layer 0 reads the tokens, layer L + 1 reads layer L's output.
      auto chain = [&](void* s) {
        for (int L = 0; L < 4; ++L)
          runtime.enqueue(L, L == 0 ? hidden : outs[static_cast<std::size_t>(L - 1)].as<std::uint16_t>(), logits, T,
                          outs[static_cast<std::size_t>(L)].as<std::uint16_t>(), s);
      };
      void* stream = cuda::create_stream();
      chain(stream);
      runtime.check_status(stream);
      const auto eager = host_of(outs[3]);
      {
        cuda::Graph graph(chain, stream);
        for (int i = 0; i < 4; ++i) {
          for (int L = 0; L < 4; ++L) memory->fill(outs[static_cast<std::size_t>(L)].get(), 0xFF, bytes, stream);
          graph.replay(stream);
          runtime.check_status(stream);
          EXPECT_EQ(host_of(outs[3]), eager) << quant_name(quant) << " replay " << i;
        }
      }
      cuda::destroy_stream(stream);
    });
  }
}

}  // namespace
}  // namespace moekit
