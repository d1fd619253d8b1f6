// Checkpoints written here in the layouts Hugging Face publishes them, loaded back into layer weights:
//   - DeepSeek-V3 FP8 with 128x128 weight_scale_inv blocks, sharded with an index: loaded as stored,
//     byte for byte the weights the same seed makes in memory (block pairs arranged at load), a rank
//     reading only the shards of its experts; the layer's output from them equals the output from
//     the in-memory weights; the same checkpoint run per-token is requantized, within FP8's step;
//   - Qwen3 (bf16, one tensor per expert, and transformers' fused in-memory tensors), Qwen2-MoE
//     (gated shared expert), Mixtral (w1/w3/w2) and gpt-oss (fused, K first, interleaved gate/up,
//     expert and router biases): loaded equal to the one quantizer applied to the same values in the
//     layout each recipe reads;
//   - malformed checkpoints: a tensor of the wrong shape or dtype, a missing tensor, FP8 without its
//     scales, MXFP4, a family without names, a layer without an MoE block: an Error naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>

#include "cpu/quant.h"
#include "error_text.h"
#include "layer/layer_test_util.h"
#include "moekit/checkpoint.h"
#include "moekit/error.h"
#include "moekit/limits.h"
#include "moekit/placement.h"
#include "moekit/runtime.h"
#include "numerics/fp8.h"
#include "numerics/mxfp4.h"
#include "numerics/scales.h"
#include "synthetic/random.h"
#include "write_safetensors.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using checkpoint::testing::Tensor;
using checkpoint::testing::tensor_of;
using checkpoint::testing::write_tensors;
using checkpoint::testing::write_text;

constexpr std::int64_t K = 256, I = 128, E = 16;

using moekit::testing::error_of;

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("moekit_loader_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// ---- DeepSeek-V3, FP8 blocks --------------------------------------------------------------------

constexpr const char* kDeepseekConfig = R"({
  "model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
  "num_hidden_layers": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 16,
  "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc",
  "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.5, "hidden_act": "silu",
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}})";

// Expert `e` of `w` (block128, W1 in block pairs) as the checkpoint stores it: gate_proj, up_proj
// (halves) and down_proj, each with its weight_scale_inv blocks.
void add_fp8_expert(std::vector<Tensor>& out, const std::string& prefix, const HostExpertWeights& w, std::int64_t e) {
  const MoeProblem& p = w.problem;
  const std::int64_t In = p.I(), s1 = w.view().w1_scale_stride(), s2 = w.view().w2_scale_stride();
  std::vector<std::uint8_t> halves(static_cast<std::size_t>(2 * In * K));
  std::vector<float> halves_scale(static_cast<std::size_t>(s1));
  arrange_w1_halves(In, K, w.w1.data() + e * 2 * In * K, w.w1_scale.data() + e * s1, halves.data(),
                    halves_scale.data());
  const std::int64_t bk = K / 128, bi = In / 128;
  out.push_back(tensor_of(prefix + "gate_proj.weight", "F8_E4M3", {In, K}, halves.data(), In * K));
  out.push_back(tensor_of(prefix + "gate_proj.weight_scale_inv", "F32", {bi, bk}, halves_scale.data(), bi * bk));
  out.push_back(tensor_of(prefix + "up_proj.weight", "F8_E4M3", {In, K}, halves.data() + In * K, In * K));
  out.push_back(
      tensor_of(prefix + "up_proj.weight_scale_inv", "F32", {bi, bk}, halves_scale.data() + bi * bk, bi * bk));
  out.push_back(tensor_of(prefix + "down_proj.weight", "F8_E4M3", {K, In}, w.w2.data() + e * K * In, K * In));
  out.push_back(tensor_of(prefix + "down_proj.weight_scale_inv", "F32", {bk, bi}, w.w2_scale.data() + e * s2, bk * bi));
}

std::vector<float> seeded(std::int64_t n, std::uint64_t seed, float scale) {
  synthetic::SplitMix rng = synthetic::stream(seed, synthetic::Purpose::kW1, 7);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = scale * rng.normal();
  return v;
}

struct DeepseekLayer {
  HostExpertWeights experts;  // all 16, block128 (block pairs)
  synthetic::HostSharedExperts shared;
  std::vector<float> router, bias;
};

// Layers 1 and 2 (layer 0 is dense): layer 1's experts 0-7 with the routers and shared experts in
// shard 1, its experts 8-15 in shard 2, layer 2 in shard 3.
// `edit` changes layer 2's tensors before they are written (the index follows).
std::map<std::int64_t, DeepseekLayer> write_deepseek(const fs::path& dir,
                                                     const std::function<void(std::vector<Tensor>&)>& edit = {}) {
  write_text(dir / "config.json", kDeepseekConfig);
  const ModelConfig m = parse_model_config(kDeepseekConfig, "config.json");
  const MoeProblem p = make_problem(m, {1, 1, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  cpu::ThreadPool pool(2);
  std::map<std::int64_t, DeepseekLayer> layers;
  std::vector<std::vector<Tensor>> shards(3);
  for (std::int64_t L : {1, 2}) {
    const auto seed = static_cast<std::uint64_t>(40 + L);
    DeepseekLayer d{synthetic::make_expert_weights(p, 0, seed, pool), synthetic::make_shared_experts(m, p, seed, pool),
                    seeded(E * K, seed, 0.05f), synthetic::make_routing_bias(E, seed)};
    const std::string pre = "model.layers." + std::to_string(L) + ".mlp.";
    for (std::int64_t e = 0; e < E; ++e)
      add_fp8_expert(shards[static_cast<std::size_t>(L == 2  ? 2
                                                     : e < 8 ? 0
                                                             : 1)],
                     pre + "experts." + std::to_string(e) + ".", d.experts, e);
    auto& first = shards[static_cast<std::size_t>(L == 2 ? 2 : 0)];
    add_fp8_expert(first, pre + "shared_experts.", d.shared.experts, 0);
    first.push_back(tensor_of(pre + "gate.weight", "F32", {E, K}, d.router.data(), d.router.size()));
    first.push_back(tensor_of(pre + "gate.e_score_correction_bias", "F32", {E}, d.bias.data(), d.bias.size()));
    layers.emplace(L, std::move(d));
  }
  // The dense layer's MLP: not an MoE block.
  const std::vector<std::uint16_t> dense(static_cast<std::size_t>(512 * K), 0x3F80);
  shards[0].push_back(tensor_of("model.layers.0.mlp.gate_proj.weight", "BF16", {512, K}, dense.data(), dense.size()));
  if (edit) edit(shards[2]);
  std::string index = R"({"metadata": {}, "weight_map": {)";
  bool comma = false;
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const std::string file = "model-0000" + std::to_string(s + 1) + "-of-00003.safetensors";
    write_tensors(dir / file, shards[s]);
    for (const Tensor& t : shards[s]) {
      index.append(comma ? "," : "").append("\"").append(t.name).append("\": \"").append(file).append("\"");
      comma = true;
    }
  }
  write_text(dir / "model.safetensors.index.json", index + "}}");
  return layers;
}

TEST_F(LoaderTest, DeepseekFp8BlocksLoadAsStoredAndOnlyTheRanksShards) {
  const auto layers = write_deepseek(dir_);
  Checkpoint ck(dir_.string(), 3);  // three threads over a rank's 8 experts
  EXPECT_EQ(ck.moe_layers(), (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(ck.model().checkpoint_quant, QuantScheme::kBlock128);
  const ParallelConfig par{2, 2, 8, 0};  // rank r holds experts [8r, 8r + 8)
  const MoeProblem p = make_problem(ck.model(), par, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  ASSERT_EQ(p.E_local, 8);
  cpu::ThreadPool pool(1);
  const DeepseekLayer& src = layers.at(1);
  const CheckpointLayer rank0 = ck.load_layer(1, p, 0);
  EXPECT_EQ(ck.opened_shards(), std::vector<std::string>{"model-00001-of-00003.safetensors"})
      << "rank 0's layer 1 lies in shard 1";
  EXPECT_NE(rank0.note.find("loaded as stored (block128)"), std::string::npos) << rank0.note;
  for (int r = 0; r < 2; ++r) {
    const CheckpointLayer got = r == 0 ? rank0 : ck.load_layer(1, p, 8);
    const HostExpertWeights want = synthetic::make_expert_weights(p, 8 * r, 41, pool);
    EXPECT_EQ(got.experts.w1, want.w1) << "rank " << r;
    EXPECT_EQ(got.experts.w1_scale, want.w1_scale) << "rank " << r;
    EXPECT_EQ(got.experts.w2, want.w2) << "rank " << r;
    EXPECT_EQ(got.experts.w2_scale, want.w2_scale) << "rank " << r;
    ASSERT_TRUE(got.shared_experts.has_value());
    EXPECT_EQ(got.shared_experts->w1, src.shared.experts.w1);
    EXPECT_EQ(got.shared_experts->w2_scale, src.shared.experts.w2_scale);
    EXPECT_EQ(got.e_score_correction_bias, src.bias);
    EXPECT_EQ(got.router_weight, src.router);
  }
  EXPECT_EQ(ck.opened_shards().size(), 2u) << "layer 2's shard is not opened before it is read";
}

// Redundant experts: a rank's slots of a placement (hot experts replicated) load each slot's
// expert as stored, the same bytes as that expert's own load.
TEST_F(LoaderTest, DeepseekSlotsOfAPlacementLoadTheirExperts) {
  write_deepseek(dir_);
  Checkpoint ck(dir_.string());
  const ParallelConfig par{2, 2, 8, 12};  // 24 slots for 16 experts
  const MoeProblem p = make_problem(ck.model(), par, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  ASSERT_EQ(p.E_local, 12);
  std::vector<double> load(16, 1.0);
  load[3] = 20;
  load[9] = 12;
  const ExpertPlacement placement = rebalance_experts(load, 24, 1, 1, 2);
  cpu::ThreadPool pool(1);
  for (std::int64_t r = 0; r < 2; ++r) {
    const std::span<const std::int32_t> slots =
        std::span(placement.physical_to_logical).subspan(static_cast<std::size_t>(12 * r), 12);
    const CheckpointLayer got = ck.load_layer(1, p, slots);
    const HostExpertWeights want = synthetic::make_slot_weights(p, placement, 12 * r, 41, pool);
    EXPECT_EQ(got.experts.first_expert, -1);
    EXPECT_EQ(got.experts.w1, want.w1) << "rank " << r;
    EXPECT_EQ(got.experts.w1_scale, want.w1_scale) << "rank " << r;
    EXPECT_EQ(got.experts.w2, want.w2) << "rank " << r;
    EXPECT_EQ(got.experts.w2_scale, want.w2_scale) << "rank " << r;
    EXPECT_NE(got.note.find("12 slots of experts"), std::string::npos) << got.note;
  }
  EXPECT_GT(placement.replica_count(3), 1);
  const std::vector<std::int32_t> bad(12, 16);
  EXPECT_NE(error_of([&] { ck.load_layer(1, p, bad); }).find("the model's expert 16, outside [0, 16)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ck.load_layer(1, p, std::span(bad).first(5)); }).find("5 slot experts"), std::string::npos);
}

// The layer from the checkpoint equals the layer from the same weights in memory, bit for bit, for
// both MoE layers on one runtime.
TEST_F(LoaderTest, DeepseekLayersFromTheCheckpointRunAsInMemory) {
  const auto layers = write_deepseek(dir_);
  Checkpoint ck(dir_.string());
  const ParallelConfig par{1, 1, 16, 0};
  LayerOptions opt;
  opt.quant = QuantScheme::kBlock128;
  const MoeProblem p = make_problem(ck.model(), par, ActivationFormat::kBatchedExperts, opt.quant);
  const auto memory = make_memory(Device::kCpu);
  DeviceCopies copies(*memory);
  const auto tokens = synthetic::make_tokens(K, E, 0, 11, 5);
  run_in_process(1, [&](Communicator& comm) {
    MoeRuntime loaded(ck.model(), par, opt, comm), in_memory(ck.model(), par, opt, comm);
    std::vector<CheckpointLayer> held;
    for (std::int64_t L : ck.moe_layers()) held.push_back(ck.load_layer(L, p, 0));
    for (const auto& h : held) loaded.add_layer(h.view(copies));
    for (const auto& [L, d] : layers) {
      LayerWeights w{d.experts.view(), d.bias.data()};
      d.shared.set(w);
      in_memory.add_layer(w);
    }
    for (int L = 0; L < 2; ++L) {
      const std::vector<float> logits = held[static_cast<std::size_t>(L)].router_logits(tokens.hidden.data(), 11);
      std::vector<std::uint16_t> a(tokens.hidden.size(), 0xFFFF), b(tokens.hidden.size(), 0);
      loaded.forward(L, tokens.hidden.data(), logits.data(), 11, a.data());
      in_memory.forward(L, tokens.hidden.data(), logits.data(), 11, b.data());
      EXPECT_EQ(a, b) << "MoE layer " << L;
    }
  });
}

// Dequantized weights of expert e's W1 row r (in the layout of `w`), for comparisons.
double relative(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

std::vector<float> dequant_w1(const HostExpertWeights& w, std::int64_t e) {
  const MoeProblem& p = w.problem;
  const ExpertWeightsView v = w.view().expert(e);
  std::vector<float> out(static_cast<std::size_t>(p.N * p.K));
  for (std::int64_t n = 0; n < p.N; ++n)
    for (std::int64_t k = 0; k < p.K; ++k)
      out[static_cast<std::size_t>(n * p.K + k)] =
          static_cast<float>(cpu::dequant_weight(p.quant, v.w1, v.w1_scale, p.K, n, k));
  return out;
}

TEST_F(LoaderTest, DeepseekFp8BlocksRunPerTokenRequantized) {
  const auto layers = write_deepseek(dir_);
  Checkpoint ck(dir_.string());
  const ParallelConfig par{1, 1, 8, 0};
  const MoeProblem block = make_problem(ck.model(), par, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  const MoeProblem token =
      make_problem(ck.model(), par, ActivationFormat::kBatchedExperts, QuantScheme::kPerTokenPerChannel);
  const CheckpointLayer a = ck.load_layer(2, block, 0), b = ck.load_layer(2, token, 0);
  EXPECT_NE(b.note.find("quantized to per-token at load"), std::string::npos) << b.note;
  // Block pairs vs halves: compare gate row c and up row c of expert 3 after dequantization.
  const std::vector<float> da = dequant_w1(a.experts, 3), db = dequant_w1(b.experts, 3);
  std::vector<float> pa, pb;
  for (std::int64_t c = 0; c < I; ++c)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t ga = (c / 128) * 256 + c % 128, ua = ga + 128;  // block pairs
      pa.push_back(da[static_cast<std::size_t>(ga * K + k)]);
      pa.push_back(da[static_cast<std::size_t>(ua * K + k)]);
      pb.push_back(db[static_cast<std::size_t>(c * K + k)]);
      pb.push_back(db[static_cast<std::size_t>((I + c) * K + k)]);
    }
  // One FP8 rounding of values that were FP8 already: e4m3's half step is 2^-4 relative, at most.
  EXPECT_LT(relative(pb, pa), 0.03);
}

// ---- Float checkpoints: Qwen3, Qwen2-MoE, Mixtral, gpt-oss --------------------------------------

struct FloatExpert {
  std::vector<float> gate, up, down;  // (I, K), (I, K), (K, I) as HF holds them (bf16-exact values)
};

std::vector<float> bf16_exact(std::vector<float> v) {
  for (auto& x : v) x = numerics::bf16_decode(numerics::bf16_encode(x));
  return v;
}

// The values as 16-bit bits: bf16, or fp16 where `fp16`.
std::vector<std::uint16_t> to_16(const std::vector<float>& v, bool fp16) {
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = numerics::encode16(v[i], fp16);
  return out;
}
std::vector<std::uint16_t> to_bf16(const std::vector<float>& v) {
  return to_16(v, false);
}

FloatExpert float_expert(std::int64_t In, std::uint64_t seed) {
  return {bf16_exact(seeded(In * K, seed, 0.06f)), bf16_exact(seeded(In * K, seed + 1, 0.06f)),
          bf16_exact(seeded(K * In, seed + 2, 0.09f))};
}

// A BF16 (fp16: F16) tensor of the values.
Tensor sixteen_bit_tensor(const std::string& name, std::vector<std::int64_t> shape, const std::vector<float>& v,
                          bool fp16) {
  const auto b = to_16(v, fp16);
  return tensor_of(name, fp16 ? "F16" : "BF16", std::move(shape), b.data(), b.size());
}
Tensor bf16_tensor(const std::string& name, std::vector<std::int64_t> shape, const std::vector<float>& v) {
  return sixteen_bit_tensor(name, std::move(shape), v, false);
}

// The routed experts as HF stores them one tensor per expert (gate, up, down under `pre`), in bf16
// or (fp16) F16.
void push_per_expert(std::vector<Tensor>& t, const std::string& pre, const std::vector<FloatExpert>& x,
                     bool fp16 = false) {
  for (std::size_t e = 0; e < x.size(); ++e) {
    const std::string ep = pre + "experts." + std::to_string(e) + ".";
    t.push_back(sixteen_bit_tensor(ep + "gate_proj.weight", {I, K}, x[e].gate, fp16));
    t.push_back(sixteen_bit_tensor(ep + "up_proj.weight", {I, K}, x[e].up, fp16));
    t.push_back(sixteen_bit_tensor(ep + "down_proj.weight", {K, I}, x[e].down, fp16));
  }
}

// An unquantized load holds experts x[first], x[first + 1], ... bit for bit in bf16 (fp16): W1 the
// gate rows then the up rows, W2 the down rows.
void expect_bits_of(const HostExpertWeights& got, const std::vector<FloatExpert>& x, std::int64_t first,
                    std::int64_t count, bool fp16, const std::string& what) {
  for (std::int64_t e = 0; e < count; ++e) {
    const FloatExpert& ex = x[static_cast<std::size_t>(first + e)];
    std::vector<std::uint16_t> w1 = to_16(ex.gate, fp16), up = to_16(ex.up, fp16);
    w1.insert(w1.end(), up.begin(), up.end());
    const std::vector<std::uint16_t> w2 = to_16(ex.down, fp16);
    EXPECT_EQ(std::memcmp(got.w1.data() + e * 2 * I * K * 2, w1.data(), w1.size() * 2), 0)
        << what << " W1 of expert " << e;
    EXPECT_EQ(std::memcmp(got.w2.data() + e * K * I * 2, w2.data(), w2.size() * 2), 0) << what << " W2 of expert " << e;
  }
}

// W1 as the recipe reads it, from the HF halves, quantized by the one quantizer: halves for per-token;
// for block128 halves quantized, then arranged in block pairs; interleaved rows for swigluoai.
std::pair<std::vector<std::uint8_t>, std::vector<float>> expected_w1(const FloatExpert& x, std::int64_t In,
                                                                     QuantScheme q, bool interleaved) {
  std::vector<float> w(static_cast<std::size_t>(2 * In * K));
  for (std::int64_t c = 0; c < In; ++c)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t g = interleaved ? 2 * c : c, u = interleaved ? 2 * c + 1 : In + c;
      w[static_cast<std::size_t>(g * K + k)] = x.gate[static_cast<std::size_t>(c * K + k)];
      w[static_cast<std::size_t>(u * K + k)] = x.up[static_cast<std::size_t>(c * K + k)];
    }
  std::vector<std::uint8_t> codes(w.size());
  std::vector<float> scales(static_cast<std::size_t>(numerics::weight_scale_count(q, 2 * In, K)));
  cpu::quantize_weight(q, w.data(), 2 * In, K, codes.data(), scales.data());
  if (q == QuantScheme::kBlock128 && !interleaved) {
    std::vector<std::uint8_t> pc(codes.size());
    std::vector<float> ps(scales.size());
    arrange_w1_block_pairs(In, K, codes.data(), scales.data(), pc.data(), ps.data());
    return {pc, ps};
  }
  return {codes, scales};
}

std::pair<std::vector<std::uint8_t>, std::vector<float>> expected_w2(const FloatExpert& x, std::int64_t In,
                                                                     QuantScheme q) {
  std::vector<std::uint8_t> codes(x.down.size());
  std::vector<float> scales(static_cast<std::size_t>(numerics::weight_scale_count(q, K, In)));
  cpu::quantize_weight(q, x.down.data(), K, In, codes.data(), scales.data());
  return {codes, scales};
}

// Expert e of `got` equals the quantizer applied to x in the recipe's layout.
void expect_expert(const HostExpertWeights& got, std::int64_t e, const FloatExpert& x, bool interleaved,
                   const std::string& what) {
  const MoeProblem& p = got.problem;
  const std::int64_t In = p.I();
  const auto [c1, s1] = expected_w1(x, In, p.quant, interleaved);
  const auto [c2, s2] = expected_w2(x, In, p.quant);
  const auto n1 = static_cast<std::ptrdiff_t>(c1.size()), n2 = static_cast<std::ptrdiff_t>(c2.size());
  const auto m1 = static_cast<std::ptrdiff_t>(s1.size()), m2 = static_cast<std::ptrdiff_t>(s2.size());
  EXPECT_TRUE(std::equal(c1.begin(), c1.end(), got.w1.begin() + e * n1)) << what << " W1 of expert " << e;
  EXPECT_TRUE(std::equal(s1.begin(), s1.end(), got.w1_scale.begin() + e * m1)) << what << " W1 scales " << e;
  EXPECT_TRUE(std::equal(c2.begin(), c2.end(), got.w2.begin() + e * n2)) << what << " W2 of expert " << e;
  EXPECT_TRUE(std::equal(s2.begin(), s2.end(), got.w2_scale.begin() + e * m2)) << what << " W2 scales " << e;
}

std::string qwen_config(const std::string& type, std::int64_t shared) {
  return R"({"model_type": ")" + type +
         R"(", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 1,
  "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": true, "hidden_act": "silu", "decoder_sparse_step": 1,
  "mlp_only_layers": [], "shared_expert_intermediate_size": )" +
         std::to_string(shared) + "}";
}

TEST_F(LoaderTest, Qwen3Bf16PerExpertAndFusedLoadQuantizedByTheOneQuantizer) {
  std::vector<FloatExpert> x;
  for (std::int64_t e = 0; e < E; ++e) x.push_back(float_expert(I, 300 + static_cast<std::uint64_t>(3 * e)));
  const std::vector<float> router = bf16_exact(seeded(E * K, 9, 0.05f));
  for (const bool fused : {false, true}) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    write_text(dir_ / "config.json", qwen_config("qwen3_moe", 0));
    std::vector<Tensor> t;
    const std::string pre = "model.layers.0.mlp.";
    if (fused) {  // transformers' in-memory form: (E, 2I, K) gate rows then up rows, (E, K, I)
      std::vector<float> gu, d;
      for (const auto& ex : x) {
        gu.insert(gu.end(), ex.gate.begin(), ex.gate.end());
        gu.insert(gu.end(), ex.up.begin(), ex.up.end());
        d.insert(d.end(), ex.down.begin(), ex.down.end());
      }
      t.push_back(bf16_tensor(pre + "experts.gate_up_proj", {E, 2 * I, K}, gu));
      t.push_back(bf16_tensor(pre + "experts.down_proj", {E, K, I}, d));
    } else {
      push_per_expert(t, pre, x);
    }
    t.push_back(bf16_tensor(pre + "gate.weight", {E, K}, router));
    write_tensors(dir_ / "model.safetensors", t);
    // One thread, and more threads than the load's 16 tasks: the same bytes.
    for (const int threads : {1, 5, 19}) {
      Checkpoint ck(dir_.string(), threads);
      EXPECT_EQ(ck.moe_layers(), std::vector<std::int64_t>{0});
      for (QuantScheme q : {QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128, QuantScheme::kPerTensor}) {
        const MoeProblem p = make_problem(ck.model(), {2, 2, 8, 0}, ActivationFormat::kBatchedExperts, q);
        const CheckpointLayer got = ck.load_layer(0, p, 8);  // rank 1: experts 8-15
        EXPECT_NE(got.note.find("quantized to"), std::string::npos) << got.note;
        EXPECT_NE(got.note.find(fused ? "fused tensors" : "one tensor per expert"), std::string::npos) << got.note;
        for (std::int64_t e = 0; e < 8; ++e)
          expect_expert(got.experts, e, x[static_cast<std::size_t>(8 + e)], false,
                        std::string(fused ? "fused " : "per-expert ") + std::string(quant_name(q)) + ", " +
                            std::to_string(threads) + " threads");
        EXPECT_EQ(got.router_weight, router);
        EXPECT_FALSE(got.shared_experts.has_value());
      }
    }
  }
}

// The unquantized recipe (--quant bf16) keeps a bf16 checkpoint's values exactly: W1 the gate rows
// then the up rows, W2 the down rows, bit for bit, no scales; per-expert and fused tensors alike.
TEST_F(LoaderTest, Qwen3Bf16LoadsBitExactUnderTheBf16Recipe) {
  std::vector<FloatExpert> x;
  for (std::int64_t e = 0; e < E; ++e) x.push_back(float_expert(I, 500 + static_cast<std::uint64_t>(3 * e)));
  for (const bool fused : {false, true}) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    write_text(dir_ / "config.json", qwen_config("qwen3_moe", 0));
    std::vector<Tensor> t;
    const std::string pre = "model.layers.0.mlp.";
    if (fused) {
      std::vector<float> gu, d;
      for (const auto& ex : x) {
        gu.insert(gu.end(), ex.gate.begin(), ex.gate.end());
        gu.insert(gu.end(), ex.up.begin(), ex.up.end());
        d.insert(d.end(), ex.down.begin(), ex.down.end());
      }
      t.push_back(bf16_tensor(pre + "experts.gate_up_proj", {E, 2 * I, K}, gu));
      t.push_back(bf16_tensor(pre + "experts.down_proj", {E, K, I}, d));
    } else {
      push_per_expert(t, pre, x);
    }
    t.push_back(bf16_tensor(pre + "gate.weight", {E, K}, bf16_exact(seeded(E * K, 9, 0.05f))));
    write_tensors(dir_ / "model.safetensors", t);
    Checkpoint ck(dir_.string(), 3);
    const MoeProblem p = make_problem(ck.model(), {2, 2, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kBf16);
    const CheckpointLayer got = ck.load_layer(0, p, 8);  // rank 1: experts 8-15
    const std::string what = fused ? "fused" : "per-expert";
    EXPECT_NE(got.note.find("read as bf16"), std::string::npos) << got.note;
    EXPECT_TRUE(got.experts.w1_scale.empty() && got.experts.w2_scale.empty()) << what;
    ASSERT_EQ(got.experts.w1.size(), static_cast<std::size_t>(8 * 2 * I * K * 2)) << what;
    ASSERT_EQ(got.experts.w2.size(), static_cast<std::size_t>(8 * K * I * 2)) << what;
    expect_bits_of(got.experts, x, 8, 8, false, what);
    // The view reads them as the bf16 recipe's weights.
    EXPECT_NO_THROW(validate_weights(got.experts.view(), p, Device::kCpu)) << what;
    EXPECT_EQ(got.experts.view().element_bytes(), 2);
  }
}

// An fp16 checkpoint as transformers saves one (F16 tensors, config.json's torch_dtype float16) runs
// the fp16 recipe by default, its values bit for bit; under --quant bf16 they are rounded once; a
// bf16 checkpoint holding a value past fp16's range is refused under --quant fp16, naming it.
TEST_F(LoaderTest, Qwen3Fp16RunsAsStoredAndBf16PastItsRangeIsRefused) {
  std::string config = qwen_config("qwen3_moe", 0);
  config.insert(config.find('{') + 1, "\"torch_dtype\": \"float16\", ");
  write_text(dir_ / "config.json", config);
  std::vector<FloatExpert> x;
  for (std::int64_t e = 0; e < E; ++e) x.push_back(float_expert(I, 700 + static_cast<std::uint64_t>(3 * e)));
  std::vector<Tensor> t;
  const std::string pre = "model.layers.0.mlp.";
  push_per_expert(t, pre, x, true);
  t.push_back(bf16_tensor(pre + "gate.weight", {E, K}, bf16_exact(seeded(E * K, 9, 0.05f))));
  write_tensors(dir_ / "model.safetensors", t);
  Checkpoint ck(dir_.string(), 2);
  const QuantChoice auto_quant = choose_quant(ck.model(), "auto");
  ASSERT_EQ(auto_quant.quant, QuantScheme::kFp16) << auto_quant.note;
  const MoeProblem p = make_problem(ck.model(), {1, 1, 8, 0}, ActivationFormat::kBatchedExperts, auto_quant.quant);
  const CheckpointLayer got = ck.load_layer(0, p, 0);
  EXPECT_NE(got.note.find("read as fp16, bit for bit"), std::string::npos) << got.note;
  expect_bits_of(got.experts, x, 0, E, true, "fp16");
  EXPECT_NO_THROW(validate_weights(got.experts.view(), p, Device::kCpu));
  const MoeProblem pb = make_problem(ck.model(), {1, 1, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kBf16);
  EXPECT_NE(ck.load_layer(0, pb, 0).note.find("rounded once to bf16"), std::string::npos);
  // A bf16 checkpoint with one value past 65504, loaded under fp16: refused, the value named.
  x[3].down[5] = 1.5e5f;
  t.clear();
  push_per_expert(t, pre, x);
  t.push_back(bf16_tensor(pre + "gate.weight", {E, K}, bf16_exact(seeded(E * K, 9, 0.05f))));
  write_tensors(dir_ / "model.safetensors", t);
  Checkpoint big(dir_.string(), 2);
  const std::string err = error_of([&] { big.load_layer(0, p, 0); });
  for (const char* needle : {"experts.3.down_proj.weight", "element (0, 5)", "149504", "fp16", "--quant bf16"})
    EXPECT_NE(err.find(needle), std::string::npos) << needle << " in: " << err;
}

// FP8 weights are not dequantized into bf16 (code x fp32 scale is not a bf16 in general): a load
// under the bf16 recipe is refused naming the tensor and what to run instead; the planner says so.
TEST_F(LoaderTest, DeepseekFp8UnderTheBf16RecipeIsRefused) {
  write_deepseek(dir_);
  Checkpoint ck(dir_.string(), 2);
  const MoeProblem p = make_problem(ck.model(), {1, 1, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kBf16);
  const std::string err = error_of([&] { ck.load_layer(1, p, 0); });
  for (const char* needle : {"F8_E4M3", "gate_proj.weight", "--quant bf16", "does not dequantize", "--quant auto"})
    EXPECT_NE(err.find(needle), std::string::npos) << needle << " in: " << err;
  EXPECT_NE(choose_quant(ck.model(), "bf16").note.find("refuses"), std::string::npos)
      << choose_quant(ck.model(), "bf16").note;
}

TEST_F(LoaderTest, Qwen2MoeSharedExpertAndItsGate) {
  write_text(dir_ / "config.json", qwen_config("qwen2_moe", 256));
  std::vector<Tensor> t;
  const std::string pre = "model.layers.0.mlp.";
  for (std::int64_t e = 0; e < E; ++e) {
    const FloatExpert x = float_expert(I, 500 + static_cast<std::uint64_t>(e));
    const std::string ep = pre + "experts." + std::to_string(e) + ".";
    t.push_back(bf16_tensor(ep + "gate_proj.weight", {I, K}, x.gate));
    t.push_back(bf16_tensor(ep + "up_proj.weight", {I, K}, x.up));
    t.push_back(bf16_tensor(ep + "down_proj.weight", {K, I}, x.down));
  }
  const FloatExpert shared = float_expert(256, 77);
  t.push_back(bf16_tensor(pre + "shared_expert.gate_proj.weight", {256, K}, shared.gate));
  t.push_back(bf16_tensor(pre + "shared_expert.up_proj.weight", {256, K}, shared.up));
  t.push_back(bf16_tensor(pre + "shared_expert.down_proj.weight", {K, 256}, shared.down));
  const std::vector<float> gate = bf16_exact(seeded(K, 5, 0.1f));
  t.push_back(bf16_tensor(pre + "shared_expert_gate.weight", {1, K}, gate));
  t.push_back(bf16_tensor(pre + "gate.weight", {E, K}, bf16_exact(seeded(E * K, 9, 0.05f))));
  write_tensors(dir_ / "model.safetensors", t);
  Checkpoint ck(dir_.string());
  const MoeProblem p =
      make_problem(ck.model(), {1, 1, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kPerTokenPerChannel);
  const CheckpointLayer got = ck.load_layer(0, p, 0);
  ASSERT_TRUE(got.shared_experts.has_value());
  expect_expert(*got.shared_experts, 0, shared, false, "shared expert");
  EXPECT_EQ(got.shared_expert_gate, to_bf16(gate));
  EXPECT_FALSE(ck.load_layer(0, p, 0, false).shared_experts.has_value());
}

TEST_F(LoaderTest, MixtralNames) {
  write_text(dir_ / "config.json", R"({"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_local_experts": 16, "num_experts_per_tok": 2, "hidden_act": "silu"})");
  std::vector<Tensor> t;
  std::vector<FloatExpert> x;
  for (std::int64_t e = 0; e < E; ++e) {
    x.push_back(float_expert(I, 700 + static_cast<std::uint64_t>(e)));
    const std::string ep = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
    t.push_back(bf16_tensor(ep + "w1.weight", {I, K}, x.back().gate));
    t.push_back(bf16_tensor(ep + "w3.weight", {I, K}, x.back().up));
    t.push_back(bf16_tensor(ep + "w2.weight", {K, I}, x.back().down));
  }
  t.push_back(bf16_tensor("model.layers.0.block_sparse_moe.gate.weight", {E, K}, bf16_exact(seeded(E * K, 9, 0.05f))));
  write_tensors(dir_ / "model.safetensors", t);
  Checkpoint ck(dir_.string());
  const MoeProblem p = make_problem(ck.model(), {1, 1, 8, 0}, ActivationFormat::kStandard, QuantScheme::kBlock128);
  const CheckpointLayer got = ck.load_layer(0, p, 0);
  for (std::int64_t e = 0; e < E; ++e) expect_expert(got.experts, e, x[static_cast<std::size_t>(e)], false, "mixtral");
}

TEST_F(LoaderTest, GptOssFusedTransposedWithBiases) {
  write_text(dir_ / "config.json", R"({"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_local_experts": 16, "num_experts_per_tok": 4, "swiglu_limit": 7.0})");
  std::vector<FloatExpert> x;
  std::vector<float> gate_up(static_cast<std::size_t>(E * K * 2 * I)), down(static_cast<std::size_t>(E * I * K));
  for (std::int64_t e = 0; e < E; ++e) {
    x.push_back(float_expert(I, 900 + static_cast<std::uint64_t>(e)));
    for (std::int64_t c = 0; c < I; ++c)
      for (std::int64_t k = 0; k < K; ++k) {  // (E, K, 2I): gate of channel c at 2c, up at 2c + 1
        gate_up[static_cast<std::size_t>((e * K + k) * 2 * I + 2 * c)] =
            x.back().gate[static_cast<std::size_t>(c * K + k)];
        gate_up[static_cast<std::size_t>((e * K + k) * 2 * I + 2 * c + 1)] =
            x.back().up[static_cast<std::size_t>(c * K + k)];
        down[static_cast<std::size_t>((e * I + c) * K + k)] = x.back().down[static_cast<std::size_t>(k * I + c)];
      }
  }
  const std::vector<float> b1 = bf16_exact(seeded(E * 2 * I, 3, 0.1f)), b2 = bf16_exact(seeded(E * K, 4, 0.1f));
  const std::vector<float> router = bf16_exact(seeded(E * K, 9, 0.05f)), router_bias = bf16_exact(seeded(E, 10, 0.5f));
  const std::string pre = "model.layers.0.mlp.";
  write_tensors(
      dir_ / "model.safetensors",
      {bf16_tensor(pre + "experts.gate_up_proj", {E, K, 2 * I}, gate_up),
       bf16_tensor(pre + "experts.gate_up_proj_bias", {E, 2 * I}, b1),
       bf16_tensor(pre + "experts.down_proj", {E, I, K}, down), bf16_tensor(pre + "experts.down_proj_bias", {E, K}, b2),
       bf16_tensor(pre + "router.weight", {E, K}, router), bf16_tensor(pre + "router.bias", {E}, router_bias)});
  Checkpoint ck(dir_.string());
  const MoeProblem p =
      make_problem(ck.model(), {1, 1, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kPerTokenPerChannel);
  const CheckpointLayer got = ck.load_layer(0, p, 0);
  for (std::int64_t e = 0; e < E; ++e) expect_expert(got.experts, e, x[static_cast<std::size_t>(e)], true, "gpt-oss");
  // Interleaved, the stored order, is W1's row order.
  EXPECT_EQ(std::vector<float>(got.experts.w1_bias.begin(), got.experts.w1_bias.end()), b1);
  EXPECT_EQ(std::vector<float>(got.experts.w2_bias.begin(), got.experts.w2_bias.end()), b2);
  EXPECT_EQ(got.router_bias, router_bias);
  // The router's logits include its bias.
  const auto tokens = synthetic::make_tokens(K, E, 0, 2, 3);
  const std::vector<float> logits = got.router_logits(tokens.hidden.data(), 2);
  double want = router_bias[5];
  for (std::int64_t k = 0; k < K; ++k)
    want += static_cast<double>(numerics::bf16_decode(tokens.hidden[static_cast<std::size_t>(K + k)])) *
            router[static_cast<std::size_t>(5 * K + k)];
  EXPECT_NEAR(logits[static_cast<std::size_t>(E + 5)], want, 1e-4);
}

TEST_F(LoaderTest, ThreadCountsOutsideTheirRangeAreRefused) {
  write_deepseek(dir_);
  EXPECT_THROW(Checkpoint(dir_.string(), -1), Error);
  EXPECT_THROW(Checkpoint(dir_.string(), limits::kMaxThreads + 1), Error);
}

TEST_F(LoaderTest, MalformedCheckpointsAreErrorsNamingTheTensor) {
  write_deepseek(dir_);
  const ParallelConfig par{1, 1, 8, 0};
  auto problem_of = [&](const Checkpoint& ck) {
    return make_problem(ck.model(), par, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
  };
  {
    Checkpoint ck(dir_.string());
    const MoeProblem p = problem_of(ck);
    EXPECT_NE(error_of([&] { ck.load_layer(0, p, 0); }).find("layer 0 holds no MoE block (the MoE layers are 1, 2)"),
              std::string::npos);
    EXPECT_NE(error_of([&] { ck.load_layer(1, p, 9); }).find("first_expert"), std::string::npos);
    MoeProblem other = p;
    other.K = 512;
    EXPECT_NE(error_of([&] { ck.load_layer(1, other, 0); }).find("not one of this checkpoint's model"),
              std::string::npos);
  }
  // Layer 2's shard rewritten with one fault each: a shape, a dtype, missing scales, scales of a
  // shape no granularity has, a missing tensor.
  auto rewrite_layer2 = [&](const std::function<void(std::vector<Tensor>&)>& edit) {
    write_deepseek(dir_, edit);
    Checkpoint ck(dir_.string());
    return error_of([&] { ck.load_layer(2, problem_of(ck), 0); });
  };
  auto find = [](std::vector<Tensor>& t, const std::string& name) -> Tensor& {
    return *std::find_if(t.begin(), t.end(), [&](const Tensor& x) { return x.name == name; });
  };
  const std::string e3 = "model.layers.2.mlp.experts.3.";
  std::string err = rewrite_layer2([&](std::vector<Tensor>& t) {
    Tensor& g = find(t, e3 + "gate_proj.weight");
    g.shape = {K, I};
  });
  EXPECT_NE(
      err.find("'" + e3 + "gate_proj.weight' (an expert's gate rows) has shape (256, 128), the config says (128, 256)"),
      std::string::npos)
      << err;
  err = rewrite_layer2([&](std::vector<Tensor>& t) {
    Tensor& g = find(t, e3 + "up_proj.weight");
    g.dtype = "I8";
  });
  EXPECT_NE(err.find("'" + e3 + "up_proj.weight' (an expert's up rows) is I8; moekit reads BF16, F16, F32, F8_E4M3"),
            std::string::npos)
      << err;
  err = rewrite_layer2([&](std::vector<Tensor>& t) {
    t.erase(
        std::find_if(t.begin(), t.end(), [&](const Tensor& x) { return x.name == e3 + "down_proj.weight_scale_inv"; }));
  });
  EXPECT_NE(err.find("FP8 tensor '" + e3 + "down_proj.weight' has no scale tensor"), std::string::npos) << err;
  err = rewrite_layer2([&](std::vector<Tensor>& t) {
    Tensor& s = find(t, e3 + "down_proj.weight_scale_inv");
    s.shape = {1, 2};
  });
  EXPECT_NE(err.find("has shape (1, 2): for a weight of shape (256, 128)"), std::string::npos) << err;
  err = rewrite_layer2([&](std::vector<Tensor>& t) {
    t.erase(std::find_if(t.begin(), t.end(),
                         [&](const Tensor& x) { return x.name == "model.layers.2.mlp.gate.e_score_correction_bias"; }));
  });
  EXPECT_NE(err.find("holds no tensor 'model.layers.2.mlp.gate.e_score_correction_bias'"), std::string::npos) << err;
}

// Untrusted values and headers: every value a load reads is checked (the first NaN, FP8 NaN code or
// non-positive scale named by shard, tensor and element), and check_headers (plan --checkpoint) refuses
// from the headers alone what a load refuses, for every expert of every MoE layer, reading no data.
TEST_F(LoaderTest, ValuesAreCheckedAtLoadAndHeadersWithoutLoading) {
  const ParallelConfig par{2, 2, 8, 0};
  auto load_error = [&](const std::function<void(std::vector<Tensor>&)>& edit, std::int64_t first_expert) {
    write_deepseek(dir_, edit);
    Checkpoint ck(dir_.string());
    const MoeProblem p = make_problem(ck.model(), par, ActivationFormat::kBatchedExperts, QuantScheme::kBlock128);
    return error_of([&] { ck.load_layer(2, p, first_expert); });
  };
  auto find = [](std::vector<Tensor>& t, const std::string& name) -> Tensor& {
    return *std::find_if(t.begin(), t.end(), [&](const Tensor& x) { return x.name == name; });
  };
  const std::string e3 = "model.layers.2.mlp.experts.3.", e12 = "model.layers.2.mlp.experts.12.";
  std::string err = load_error([&](std::vector<Tensor>& t) { find(t, e3 + "up_proj.weight").data[300] = 0xFF; }, 0);
  EXPECT_NE(err.find("tensor '" + e3 + "up_proj.weight' element [1, 44] (flat index 300) is FP8 code 0xff"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find(".safetensors"), std::string::npos) << err;
  // Rank 1 reads experts 8-15 only: expert 3's bad code is not its to read; expert 12's scale is.
  const float zero = 0.0f;
  auto zero_scale = [&](std::vector<Tensor>& t) {
    find(t, e3 + "up_proj.weight").data[300] = 0xFF;
    std::memcpy(find(t, e12 + "down_proj.weight_scale_inv").data.data() + 4, &zero, 4);
  };
  err = load_error(zero_scale, 8);
  EXPECT_NE(err.find("tensor '" + e12 +
                     "down_proj.weight_scale_inv' element [1, 0] (flat index 1) is 0: a scale must be "
                     "finite and > 0"),
            std::string::npos)
      << err;
  const float nan = NAN;  // the router's fp32 weight (0, 3)
  err = load_error(
      [&](std::vector<Tensor>& t) { std::memcpy(find(t, "model.layers.2.mlp.gate.weight").data.data() + 12, &nan, 4); },
      0);
  EXPECT_NE(err.find("tensor 'model.layers.2.mlp.gate.weight' element [0, 3] (flat index 3) is NaN"), std::string::npos)
      << err;
  // Headers only: a contradiction in any expert of any layer is refused, a bad value is not seen.
  write_deepseek(dir_, zero_scale);
  {
    Checkpoint ck(dir_.string());
    EXPECT_NO_THROW(ck.check_headers());
  }
  write_deepseek(dir_, [&](std::vector<Tensor>& t) { find(t, e12 + "gate_proj.weight").shape = {K, I}; });
  Checkpoint ck(dir_.string());
  err = error_of([&] { ck.check_headers(); });
  EXPECT_NE(err.find("'" + e12 + "gate_proj.weight' (an expert's gate rows) has shape (256, 128)"), std::string::npos)
      << err;
}

// gpt-oss as released: MXFP4 experts (packed e2m1 codes and e8m0 exponents, U8), converted to FP8 at
// load exactly: every value code * scale equals its MXFP4 value in float64; a row whose exponents span
// more than FP8 holds under one scale is refused, naming the tensor, the expert and the value.
struct MxLayer {
  std::vector<std::uint8_t> w1_blocks, w1_exp, w2_blocks, w2_exp;
};
double mx_value(const std::vector<std::uint8_t>& blocks, const std::vector<std::uint8_t>& exps, std::int64_t row,
                std::int64_t col, std::int64_t cols) {
  const std::int64_t g = col / 32, groups = cols / 32;
  const std::uint8_t* packed = blocks.data() + (row * groups + g) * 16;
  return std::ldexp(static_cast<double>(numerics::e2m1_value(numerics::e2m1_nibble(packed, col % 32))),
                    static_cast<int>(exps[static_cast<std::size_t>(row * groups + g)]) - 127);
}
MxLayer write_gpt_oss_mxfp4(const fs::path& dir, const std::function<void(MxLayer&)>& edit = {}) {
  write_text(dir / "config.json", R"({"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_local_experts": 16, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}})");
  MxLayer m{std::vector<std::uint8_t>(static_cast<std::size_t>(E * 2 * I * (K / 32) * 16)),
            std::vector<std::uint8_t>(static_cast<std::size_t>(E * 2 * I * (K / 32))),
            std::vector<std::uint8_t>(static_cast<std::size_t>(E * K * (I / 32) * 16)),
            std::vector<std::uint8_t>(static_cast<std::size_t>(E * K * (I / 32)))};
  synthetic::SplitMix rng = synthetic::stream(21, synthetic::Purpose::kW1, 0);
  for (auto* v : {&m.w1_blocks, &m.w2_blocks})
    for (auto& b : *v) b = static_cast<std::uint8_t>(rng.next());
  for (auto* v : {&m.w1_exp, &m.w2_exp})  // 2^-9 .. 2^-1: weights' range, a span of 8 binades
    for (auto& e : *v) e = static_cast<std::uint8_t>(118 + rng.next() % 9);
  if (edit) edit(m);
  const std::vector<float> b1 = bf16_exact(seeded(E * 2 * I, 3, 0.1f)), b2 = bf16_exact(seeded(E * K, 4, 0.1f));
  const std::vector<float> router = bf16_exact(seeded(E * K, 9, 0.05f)), router_bias = bf16_exact(seeded(E, 10, 0.5f));
  const std::string pre = "model.layers.0.mlp.";
  write_tensors(
      dir / "model.safetensors",
      {tensor_of(pre + "experts.gate_up_proj_blocks", "U8", {E, 2 * I, K / 32, 16}, m.w1_blocks.data(),
                 m.w1_blocks.size()),
       tensor_of(pre + "experts.gate_up_proj_scales", "U8", {E, 2 * I, K / 32}, m.w1_exp.data(), m.w1_exp.size()),
       tensor_of(pre + "experts.down_proj_blocks", "U8", {E, K, I / 32, 16}, m.w2_blocks.data(), m.w2_blocks.size()),
       tensor_of(pre + "experts.down_proj_scales", "U8", {E, K, I / 32}, m.w2_exp.data(), m.w2_exp.size()),
       bf16_tensor(pre + "experts.gate_up_proj_bias", {E, 2 * I}, b1),
       bf16_tensor(pre + "experts.down_proj_bias", {E, K}, b2), bf16_tensor(pre + "router.weight", {E, K}, router),
       bf16_tensor(pre + "router.bias", {E}, router_bias)});
  return m;
}

TEST_F(LoaderTest, GptOssMxfp4ConvertsExactly) {
  const MxLayer m = write_gpt_oss_mxfp4(dir_);
  Checkpoint ck(dir_.string(), 3);
  EXPECT_EQ(ck.model().checkpoint_quant, QuantScheme::kPerTokenPerChannel);
  EXPECT_NO_THROW(ck.check_headers());
  const MoeProblem p =
      make_problem(ck.model(), {2, 2, 8, 0}, ActivationFormat::kBatchedExperts, choose_quant(ck.model(), "auto").quant);
  const CheckpointLayer got = ck.load_layer(0, p, 8);  // rank 1: experts 8-15
  EXPECT_NE(got.note.find("MXFP4 (fused tensors), converted exactly to per-token FP8"), std::string::npos) << got.note;
  const ExpertWeightsView v = got.experts.view();
  for (std::int64_t e = 0; e < 8; ++e) {
    const ExpertWeightsView x = v.expert(e);
    const std::int64_t g = 8 + e;
    for (std::int64_t r = 0; r < 2 * I; ++r)  // the stored interleaved rows are W1's rows
      for (std::int64_t c = 0; c < K; ++c)
        ASSERT_EQ(numerics::fp8_decode(x.w1[r * K + c]) * static_cast<double>(x.w1_scale[r]),
                  mx_value(m.w1_blocks, m.w1_exp, g * 2 * I + r, c, K))
            << "expert " << g << " W1 (" << r << ", " << c << ")";
    for (std::int64_t r = 0; r < K; ++r)
      for (std::int64_t c = 0; c < I; ++c)
        ASSERT_EQ(numerics::fp8_decode(x.w2[r * I + c]) * static_cast<double>(x.w2_scale[r]),
                  mx_value(m.w2_blocks, m.w2_exp, g * K + r, c, I))
            << "expert " << g << " W2 (" << r << ", " << c << ")";
  }
  EXPECT_EQ(got.experts.w1_bias.size(), static_cast<std::size_t>(8 * 2 * I));
}

TEST_F(LoaderTest, GptOssMxfp4RowsFp8CannotHoldAreRefusedByName) {
  // Expert 9's W2 row 5: its first group 20 binades below the row's others, its values 0.5 and 1.5.
  write_gpt_oss_mxfp4(dir_, [](MxLayer& m) {
    const std::int64_t row = 9 * K + 5;
    m.w2_exp[static_cast<std::size_t>(row * (I / 32))] = 100;
    for (int b = 0; b < 16; ++b) m.w2_blocks[static_cast<std::size_t>(row * (I / 32) * 16 + b)] = 0x31;
  });
  Checkpoint ck(dir_.string());
  const MoeProblem p =
      make_problem(ck.model(), {1, 1, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kPerTokenPerChannel);
  const std::string err = error_of([&] { ck.load_layer(0, p, 0); });
  EXPECT_NE(err.find("tensor 'model.layers.0.mlp.experts.down_proj_blocks' expert 9"), std::string::npos) << err;
  EXPECT_NE(err.find("row 5, column 0"), std::string::npos) << err;
  EXPECT_NE(err.find("cannot be held exactly in FP8"), std::string::npos) << err;
  // A NaN exponent (255) is a damaged checkpoint, named.
  write_gpt_oss_mxfp4(dir_, [](MxLayer& m) { m.w1_exp[static_cast<std::size_t>(3 * 2 * I * (K / 32) + 7)] = 255; });
  Checkpoint ck2(dir_.string());
  const std::string nan = error_of([&] { ck2.load_layer(0, p, 0); });
  EXPECT_NE(nan.find("gate_up_proj_blocks' expert 3: row 0, columns 224..255: MXFP4 exponent 255 is NaN"),
            std::string::npos)
      << nan;
}

TEST_F(LoaderTest, IncompleteMxfp4IsRefusedByName) {
  write_text(dir_ / "config.json", R"({"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_local_experts": 16, "num_experts_per_tok": 4, "quantization_config": {"quant_method": "mxfp4"}})");
  const std::vector<std::uint8_t> blocks(static_cast<std::size_t>(E * 2 * I * (K / 32) * 16), 0);
  const std::vector<float> router(static_cast<std::size_t>(E * K), 0.0f);
  const std::string pre = "model.layers.0.mlp.";
  write_tensors(
      dir_ / "model.safetensors",
      {tensor_of(pre + "experts.gate_up_proj_blocks", "U8", {E, 2 * I, K / 32, 16}, blocks.data(), blocks.size()),
       tensor_of(pre + "router.weight", "F32", {E, K}, router.data(), router.size())});
  Checkpoint ck(dir_.string());
  const MoeProblem p =
      make_problem(ck.model(), {1, 1, 8, 0}, ActivationFormat::kBatchedExperts, QuantScheme::kPerTokenPerChannel);
  const std::string err = error_of([&] { ck.load_layer(0, p, 0); });
  EXPECT_NE(err.find("no tensor 'model.layers.0.mlp.experts.gate_up_proj_scales' (MXFP4 W1 exponents)"),
            std::string::npos)
      << err;
}

}  // namespace
}  // namespace moekit
