// Benchmark of the Hopper batched FP8 experts through the Experts seam (DeepSeek-V3 shapes unless
// --model, E_local = 16 unless --experts), over a Workspace from plan_layer. Measures the machine's ceilings first
// (device-to-device copy bandwidth; cuBLASLt FP8 GEMM 8192^3), then for M in {2048, 8192} and m_e in
// {8, 64, 256, 300, 1024}: median time of the whole experts step (prepare, W1 GEMM, activation +
// quantization, W2 GEMM) per config of the table (both GEMMs on it) and for the pair the runtime's
// rule selects, TFLOP/s on valid rows, the floor max(flops / FP8 peak, (weight + activation bytes) /
// bandwidth), the ratio to it, the weights' bytes over the copy ceiling ("weights") and one read of
// the local experts' weights measured in the same process (TMA streaming W1 and W2 the way the
// GEMMs read them, ceilings::weight_stream_ms: "read", the small-m_e floor); for each
// quantization scheme asked for (per-token and block128 by default, a case's variants of both in
// the same rounds, so the two are compared on the same machine state; block128 over per-token at
// the end). Each step is timed eagerly (launch by launch, as a first call runs) and replayed from a
// CUDA graph (as decode runs it); every time of a case (the step eager and replayed, each GEMM
// alone, the parts) is taken in rounds, one sample of each measurement of each variant a round,
// each variant on its own workspace (neither the sweep's order nor the machine's state at one
// moment favors any); the ratios are the graph's. m_e = 300 is a ragged expert (two 128-row token
// tiles and 44 rows), as uniform routing gives DeepSeek-V3's 256 experts 210-311 rows at 8192 tokens.
//
// Writes JSON (argv[1]) for bench/torch_baseline.py.
//
// Run: ./bench_gpu_experts out.json [--quick] [--case M m_e]... [--quant per-token,block128] [--configs a,b]
//      [--fast-accumulation] (per-token and per-tensor with Accumulation::kFast; default precise)
//      [--model NAME] (a model of models/: its shapes and activation; default deepseek-v3) [--rule-first] (the
//      runtime's rule measured before the configs too: the sweep's order effect)
//      [--max-rows R] (the rules planned for steps of up to R rows an expert, as the runtime plans for
//      M: the launches of the ranges above m_e run empty; beside them the "declared" rules, planned
//      for m_e rows, as a step declared with max_tokens_any_rank plans) [--experts E_local] (default 16: DeepSeek-V3
//      at DP 16; 8 is DP 32) [--graph-parts] (each variant's step in parts, each part replayed from
//      its own graph: W1 + activation, activation + W2, W1 + W2, W1 + activation + W2; where a
//      step's graph time exceeds its GEMMs alone plus the rest, which adjacency costs it)
//      [--baseline CONFIG] (a config of the table, run too: every variant's graph step and GEMMs
//      replayed alone as ratios to its of the same scheme, measured in the same rounds. Compare builds or machines by
//      these ratios: the SM clock of a power-capped GPU moves 5-10% between processes)
//      [--host-time] (the rules' host time a call: each launcher's enqueue alone, with the host work
//      bound once per workspace (cuda/launch_cache.h) and redone every call; median of 31)
// (--case, repeatable: those cases only, any M and m_e <= M, and quick (5 iterations, the rules only) unless
// --configs names configs of the table to run too: for profiling one config under ncu)
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ceilings/ceilings.h"
#include "cuda/backend.h"
#include "cuda/check.h"
#include "cuda/device_info.h"
#include "cuda/launch.h"
#include "cuda/launch_cache.h"
#include "moekit/model.h"
#include "moekit/recipe.h"
#include "moekit/registry.h"
#include "moekit/workspace.h"
#include "numerics/scales.h"

using namespace moekit;

namespace {
std::string fixed4(double v) {
  char s[32];
  std::snprintf(s, sizeof(s), "%.4f", v);
  return s;
}
}  // namespace

using cuda::median_ms;

// A name parsed by moekit's parser, or nothing: its Error (which lists the valid names) printed.
template <class Parse>
auto parsed(Parse parse, const std::string& name) -> std::optional<decltype(parse(name))> {
  try {
    return parse(name);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_gpu_experts: %s\n", e.what());
    return std::nullopt;
  }
}

// A rule's launches as a row label: one list when W1 and W2 take the same configs, else each GEMM's.
std::string rule_name(const plan::ExpertsGemmPlan& g) {
  const std::string w1 = plan::describe(g.w1), w2 = plan::describe(g.w2);
  return w1 == w2 ? w1 : "W1 " + w1 + "; W2 " + w2;
}

bool known_config(const std::string& name) {
  return parsed(plan::parse_gemm_config, name).has_value();
}

// An integer argument, or nothing (what was wrong printed).
std::optional<std::int64_t> int_arg(const char* text, const char* flag) {
  try {
    std::size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used == std::strlen(text)) return v;
  } catch (const std::exception&) {
  }
  std::fprintf(stderr, "bench_gpu_experts: %s takes an integer, got '%s'\n", flag, text);
  return std::nullopt;
}

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "bench_gpu_experts.json";
  bool quick = false;
  bool rule_first = false;
  bool graph_parts = false;
  bool host_time = false;
  std::vector<std::pair<std::int64_t, std::int64_t>> only_cases;  // --case M m_e, each one given (none: all)
  std::int64_t max_rows = 0;  // the rules planned for up to this many rows an expert (0: m_e)
  std::int64_t E_local = 16;  // DeepSeek-V3's local experts at DP 16 (8 at DP 32)
  std::vector<QuantScheme> quants = {QuantScheme::kPerTokenPerChannel, QuantScheme::kBlock128};
  std::vector<std::string> only_configs;   // empty: every config of the table (unless quick)
  std::string baseline;                    // --baseline: the config every variant is a ratio to
  std::string model_name = "deepseek-v3";  // --model: its shapes and activation
  bool fast_accumulation = false;          // --fast-accumulation: per-token / per-tensor with Accumulation::kFast
  auto split = [](const std::string& list) {
    std::vector<std::string> items;
    for (std::size_t pos = 0; pos <= list.size();) {
      const std::size_t comma = std::min(list.find(',', pos), list.size());
      items.push_back(list.substr(pos, comma - pos));
      pos = comma + 1;
    }
    return items;
  };
  for (int a = 2; a < argc; ++a) {
    const std::string flag = argv[a];
    // How many values follow the flag (consumed below); an unknown argument or a missing value is an
    // error, not ignored.
    const int values = flag == "--case" ? 2
                       : flag == "--max-rows" || flag == "--experts" || flag == "--quant" || flag == "--configs" ||
                               flag == "--model" || flag == "--baseline"
                           ? 1
                           : 0;
    if (values == 0 && flag != "--quick" && flag != "--rule-first" && flag != "--graph-parts" &&
        flag != "--fast-accumulation" && flag != "--host-time") {
      std::fprintf(
          stderr, "bench_gpu_experts: unknown argument '%s' (the flags: the top of bench/cuda/bench_gpu_experts.cpp)\n",
          flag.c_str());
      return 2;
    }
    if (a + values >= argc) {
      std::fprintf(stderr, "bench_gpu_experts: %s takes %d value%s\n", flag.c_str(), values, values > 1 ? "s" : "");
      return 2;
    }
    const char* value = values > 0 ? argv[a + 1] : nullptr;
    a += values;
    if (flag == "--quick") quick = true;
    if (flag == "--fast-accumulation") fast_accumulation = true;
    if (flag == "--rule-first") rule_first = true;
    if (flag == "--graph-parts") graph_parts = true;
    if (flag == "--host-time") host_time = true;
    if (flag == "--max-rows") {
      const auto v = int_arg(value, "--max-rows");
      if (!v) return 2;
      max_rows = *v;
    }
    if (flag == "--experts") {
      const auto v = int_arg(value, "--experts");
      if (!v) return 2;
      E_local = *v;
      if (E_local < 1 || E_local > 256) {
        std::fprintf(stderr, "bench_gpu_experts: --experts takes 1 to 256 local experts, got %lld\n",
                     static_cast<long long>(E_local));
        return 2;
      }
    }
    if (flag == "--quant") {
      quants.clear();
      for (const std::string& q : split(value)) {
        const auto v = parsed(parse_quant, q);
        if (!v) return 2;
        quants.push_back(*v);
      }
    }
    if (flag == "--configs") {
      only_configs = split(value);
      for (const std::string& c : only_configs)
        if (!known_config(c)) return 2;
    }
    if (flag == "--model") model_name = value;
    if (flag == "--baseline") {
      baseline = value;
      if (!known_config(baseline)) return 2;
    }
    if (flag == "--case") {
      const auto m = int_arg(value, "--case M"), me = int_arg(argv[a], "--case m_e");
      if (!m || !me) return 2;
      if (*m < 1 || *me < 1 || *me > *m) {
        std::fprintf(stderr, "bench_gpu_experts: --case M m_e needs 1 <= m_e <= M, got M = %lld, m_e = %lld\n",
                     static_cast<long long>(*m), static_cast<long long>(*me));
        return 2;
      }
      if (std::find(only_cases.begin(), only_cases.end(), std::pair{*m, *me}) == only_cases.end())
        only_cases.emplace_back(*m, *me);
      quick = true;
    }
  }
  ModelConfig model;
  try {
    model = load_model(model_name);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_gpu_experts: --model: %s\n", e.what());
    return 2;
  }
  if (!baseline.empty() && std::find(only_configs.begin(), only_configs.end(), baseline) == only_configs.end() &&
      (quick || !only_configs.empty()))
    only_configs.push_back(baseline);
  if (cuda::device_count() == 0) {
    std::printf("bench_gpu_experts: no CUDA device, nothing to measure\n");
    return 0;
  }
  const cuda::DeviceInfo dev = cuda::device_info(0);
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  const double bw = ceilings::copy_gbs(stream);
  const double peak = ceilings::fp8_gemm_tflops(stream);
  std::printf("device %s, %d SMs, L2 %lld MiB, CUTLASS %s\n", dev.name.c_str(), dev.num_sms, dev.l2_bytes >> 20,
              cuda::cutlass_version().c_str());
  std::printf("ceilings: D2D copy %.0f GB/s (read + write), cuBLASLt FP8 8192^3 %.0f TFLOP/s\n", bw, peak);

  // One read of the local experts' weights, measured: TMA streams W1 (E_local x N x K) and W2
  // (E_local x K x I) as the GEMMs read them, no math; a ceiling, so the best of 3 medians.
  double read_ms = 0;  // 0: not measured ("x read" prints nan)
  if (const std::int64_t K = model.hidden_size, I = model.moe_intermediate_size, N = model.N();
      !ceilings::weight_stream_takes(N, K) || !ceilings::weight_stream_takes(K, I)) {
    std::printf(
        "one read of the weights: not measured (its TMA stream takes 128-row, 128-byte boxes: N = %lld, K = "
        "%lld, I = %lld)\n",
        static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(I));
  } else {
    const auto mem = make_memory(Device::kCuda);
    DeviceBuffer w1(*mem, E_local * N * K, "W1 (read ceiling)"), w2(*mem, E_local * K * I, "W2 (read ceiling)");
    ceilings::fill_random_bytes(w1.get(), static_cast<std::size_t>(w1.bytes()), 11, true);
    ceilings::fill_random_bytes(w2.get(), static_cast<std::size_t>(w2.bytes()), 12, true);
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep)
      best = std::min(best, ceilings::weight_stream_ms(
                                {.weights = w1.get(), .experts = E_local, .rows_per_expert = N, .k = K}, stream) +
                                ceilings::weight_stream_ms(
                                    {.weights = w2.get(), .experts = E_local, .rows_per_expert = K, .k = I}, stream));
    read_ms = best;
    std::printf("one read of the weights, measured (TMA stream of W1 + W2, E_local = %lld): %.4f ms, %.0f GB/s\n",
                static_cast<long long>(E_local), read_ms, double(w1.bytes() + w2.bytes()) / (read_ms * 1e6));
  }
  if (host_time) {
    // The host's floor a launch, as the launchers enqueue (PDL), by the size of the kernel's
    // parameters (CUTLASS's grouped GEMMs pass ~1 KB, moekit's block GEMM 5 TMA descriptors + ~200 B).
    std::printf("launch floor (host us to enqueue an empty kernel, %d blocks, median of 31):", dev.num_sms);
    for (const int bytes : {64, 512, 1024, 2048, 4096})
      std::printf(" %d B %.2f%s", bytes, ceilings::launch_us(bytes, dev.num_sms, stream), bytes == 4096 ? "\n" : ",");
  }
  std::string json = "{\n  \"device\": \"" + dev.name + "\",\n";
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  json += "  \"date\": \"" + std::string(date) + "\",\n  \"cutlass\": \"" + cuda::cutlass_version() + "\",\n";
  json += "  \"ceilings\": {\"copy_gbs\": " + std::to_string(bw) + ", \"fp8_tflops\": " + std::to_string(peak) +
          ", \"weights_stream_ms\": " + (read_ms > 0 ? std::to_string(read_ms) : std::string("null")) +
          "},\n  \"model\": " + nlohmann::json(model_name).dump() + ", \"activation\": \"" +
          std::string(activation_name(model.activation)) + "\", \"E_local\": " + std::to_string(E_local) +
          ", \"K\": " + std::to_string(model.hidden_size) + ", \"N\": " + std::to_string(model.N()) +
          ", \"I\": " + std::to_string(model.moe_intermediate_size) + ",\n  \"cases\": [\n";
  std::printf("%-9s %6s %6s %-20s %9s %9s %9s %9s %8s %9s %10s %7s\n", "quant", "M", "m_e", "config", "eager ms",
              "graph ms", "TFLOP/s", "floor ms", "x floor", "weights", "x weights", "x read");
  bool first = true;
  // Each case's rules (graph step), for block128 over per-token at the end: (M, m_e) -> (scheme,
  // fused rule) -> ms.
  std::map<std::pair<std::int64_t, std::int64_t>, std::map<std::pair<QuantScheme, bool>, double>> rules_ms;
  const auto memory = make_memory(Device::kCuda);
  // The workspace every variant runs in: the default (unfused) plan, w1_out included; the fused W1
  // (fuse_w1) ignores w1_out, its own plan is printed beside.
  const ExpertsEntry& entry = find_experts("batched-fp8", Device::kCuda);
  // A case's variants of every scheme run in the same rounds (below), so that block128 and per-token
  // are compared on the same machine state: each scheme's problem, weights and tokens, per M.
  struct Scheme {
    QuantScheme quant;
    MoeProblem p, fused_p;  // fused_p: the same with fuse_w1 where it runs (block128, fuse_w1_runs)
    DeviceBuffer w1, w2, w1s, w2s;
    std::optional<Workspace> ws;  // the tokens, scales and counts every variant reads
    std::optional<ExpertWeightsView> view;
    std::optional<ExpertsInput> input;
  };
  // The cases: every --case given (in the order given, grouped by M), else the sweep.
  std::vector<std::int64_t> Ms = {2048, 8192};
  if (!only_cases.empty()) {
    Ms.clear();
    for (const auto& [M, m_e] : only_cases)
      if (std::find(Ms.begin(), Ms.end(), M) == Ms.end()) Ms.push_back(M);
  }
  for (const std::int64_t M : Ms) {
    std::vector<std::unique_ptr<Scheme>> schemes;
    for (const QuantScheme quant : quants) {
      auto sc = std::make_unique<Scheme>();
      sc->quant = quant;
      MoeProblem& p = sc->p;
      p.format = ActivationFormat::kBatchedExperts;
      p.M = M;
      p.K = model.hidden_size;
      p.N = model.N();
      p.topk = model.topk;
      p.E = model.num_experts;
      p.E_local = E_local;
      p.activation = model.activation;
      p.quant = quant;
      p.max_tokens_per_rank = M;
      p.num_dispatchers = 1;
      if (fast_accumulation && quant != QuantScheme::kBlock128) p.accumulation = Accumulation::kFast;
      if (!has_weight_scales(recipe_info(quant))) {  // its operands, floor and peak are 16-bit, not FP8
        std::printf(
            "%s M = %lld: not run: this benchmark's operands, floor and peak are FP8's (the 16-bit GEMMs: "
            "bench_gemm_sixteen_bit)\n",
            std::string(quant_name(quant)).c_str(), static_cast<long long>(M));
        continue;
      }
      try {
        validate_problem(p);
      } catch (const Error& e) {  // e.g. block128 with I not a multiple of 128 (gpt-oss)
        std::printf("%s M = %lld: not run: %s\n", std::string(quant_name(quant)).c_str(), static_cast<long long>(M),
                    e.what());
        continue;
      }
      sc->fused_p = p;
      sc->fused_p.fuse_w1 = fuse_w1_runs(quant, p.activation);
      const std::int64_t K = p.K, N = p.N, I = p.I();
      // Weights: random FP8 codes and scales of the right magnitude (timing does not need a
      // quantizer pass over 704 MiB on the host).
      sc->w1 = DeviceBuffer(*memory, E_local * N * K, "W1");
      sc->w2 = DeviceBuffer(*memory, E_local * K * I, "W2");
      const std::int64_t s1_count = E_local * numerics::weight_scale_count(quant, N, K),
                         s2_count = E_local * numerics::weight_scale_count(quant, K, I),
                         sa_count = numerics::activation_scale_count(quant, E_local * M, K);
      sc->w1s = DeviceBuffer(*memory, s1_count * 4, "W1 scales");
      sc->w2s = DeviceBuffer(*memory, s2_count * 4, "W2 scales");
      ceilings::fill_random_bytes(sc->w1.get(), static_cast<std::size_t>(sc->w1.bytes()), 11, true);
      ceilings::fill_random_bytes(sc->w2.get(), static_cast<std::size_t>(sc->w2.bytes()), 12, true);
      Workspace& ws = sc->ws.emplace(plan_layer(p, entry, 1), *memory);
      if (quant == QuantScheme::kBlock128)
        std::printf("block128 M = %lld: experts' workspace %.3f GiB, %.3f GiB with fuse_w1 (no w1_out)\n",
                    static_cast<long long>(M), double(ws.plan().section_bytes("experts")) / double(1 << 30),
                    double(plan_layer(sc->fused_p, entry, 1).section_bytes("experts")) / double(1 << 30));
      ceilings::fill_random_bytes(ws.get<std::uint8_t>("a1q"), static_cast<std::size_t>(ws.plan().region("a1q").bytes),
                                  13, true);
      {
        std::vector<float> s1(s1_count, 1.0f / 448.0f), s2(s2_count, 1.0f / 448.0f), sa(sa_count, 1.0f / 16.0f);
        memory->from_host(sc->w1s.get(), s1.data(), sc->w1s.bytes(), nullptr);
        memory->from_host(sc->w2s.get(), s2.data(), sc->w2s.bytes(), nullptr);
        memory->from_host(ws.get<float>("a1q_scale"), sa.data(), static_cast<std::int64_t>(sa.size() * 4), nullptr);
      }
      sc->view = ExpertWeightsView::of(p, Device::kCuda, sc->w1.as<std::uint8_t>(), sc->w1s.as<float>(),
                                       sc->w2.as<std::uint8_t>(), sc->w2s.as<float>());
      sc->input = ExpertsInput{ws.get<std::uint8_t>("a1q"),
                               ws.get<float>("a1q_scale"),
                               ws.get<std::int32_t>("expert_num_tokens"),
                               nullptr,
                               M,
                               ws.get<std::uint16_t>("expert_output")};
      schemes.push_back(std::move(sc));
    }
    if (schemes.empty()) continue;
    {
      const MoeProblem& p = schemes.front()->p;  // the shapes every scheme shares
      const std::int64_t K = p.K, N = p.N, I = p.I();
      const double weight_bytes = double(E_local) * double(N * K + K * I);
      std::vector<std::int64_t> m_es = {8, 64, 256, 300, 1024};
      if (!only_cases.empty()) {
        m_es.clear();
        for (const auto& [case_M, m_e] : only_cases)
          if (case_M == M) m_es.push_back(m_e);
      }
      for (const std::int64_t m_e : m_es) {
        if (m_e > M) continue;
        std::vector<std::int32_t> c(static_cast<std::size_t>(E_local), static_cast<std::int32_t>(m_e));
        for (const auto& sc : schemes)
          memory->from_host(sc->ws->get<std::int32_t>("expert_num_tokens"), c.data(), E_local * 4, nullptr);
        const double flops = 2.0 * double(E_local) * double(m_e) * double(N * K + K * I);
        const double act_bytes = double(E_local) * double(m_e) * double(K + 2 * K);
        const double floor_ms = std::max(flops / (peak * 1e12), (weight_bytes + act_bytes) / (bw * 1e9)) * 1e3;
        const double weights_ms = weight_bytes / (bw * 1e9) * 1e3;
        // Each config of the table on every expert of both GEMMs, then what the runtime runs: its
        // launches for experts of up to m_e rows (here all of them hold m_e).
        // Block128 also runs the fused W1 (fuse_w1: no w1_out), the same problem otherwise.
        enum class Rule { kNone, kUnfused, kFused };  // the runtime's rule planned for `rows`, or neither
        struct Variant {
          std::string name;
          plan::ExpertsGemmPlan gemms;
          MoeProblem problem;
          const Scheme* scheme;  // its weights and tokens
          Rule rule = Rule::kNone;
        };
        std::vector<Variant> sweep;
        // The rules planned for steps of up to --max-rows rows an expert (default m_e), as the runtime
        // plans for M: the launches of the ranges above m_e then run empty.
        const std::int64_t rows = std::max(m_e, max_rows);
        for (const auto& sc_owned : schemes) {
          const Scheme* sc = sc_owned.get();
          const QuantScheme quant = sc->quant;
          const MoeProblem &sp = sc->p, &fused_p = sc->fused_p;
          const plan::ExpertsGemmPlan rule = plan::plan_experts_gemms(sp, rows);
          if (rule_first) sweep.push_back({"rule, run first: " + rule_name(rule), rule, sp, sc});
          for (const auto& cfg : plan::kGemmConfigs) {
            if (only_configs.empty()
                    ? quick
                    : std::find(only_configs.begin(), only_configs.end(), cfg.name) == only_configs.end())
              continue;
            if (cfg.fused_w1 ? fused_p.fuse_w1 && plan::supports(cfg, N, K, quant, true)
                             : plan::supports(cfg, N, K, quant) && plan::supports(cfg, K, I, quant))
              sweep.push_back({std::string(cfg.name), plan::single_config(cfg.id, cfg.fused_w1 ? fused_p : sp),
                               cfg.fused_w1 ? fused_p : sp, sc});
          }
          if (fused_p.fuse_w1) {
            const plan::ExpertsGemmPlan fused = plan::plan_experts_gemms(fused_p, rows);
            // What the runtime runs by default (make_problem fuses W1 where it runs): the selected row.
            sweep.push_back({"fuse_w1 rule: " + rule_name(fused), fused, fused_p, sc, Rule::kFused});
          }
          if (rows > m_e) {
            // What a step declared with its most tokens of any rank plans (ExpertsInput::
            // max_tokens_any_rank): the rules for m_e rows, beside the rules for --max-rows.
            const plan::ExpertsGemmPlan declared = plan::plan_experts_gemms(sp, m_e);
            sweep.push_back({"declared rule: " + rule_name(declared), declared, sp, sc});
            if (fused_p.fuse_w1) {
              const plan::ExpertsGemmPlan fused = plan::plan_experts_gemms(fused_p, m_e);
              sweep.push_back({"declared fuse_w1 rule: " + rule_name(fused), fused, fused_p, sc});
            }
          }
          sweep.push_back({"rule: " + rule_name(rule), rule, sp, sc, Rule::kUnfused});
        }
        // Every time below is taken in rounds, one sample of each measurement of each variant a round
        // (the step eager and from its graph, each GEMM alone, the parts), so that no variant and no
        // measurement gains from its place in the sweep or from the machine's state at the time: taken
        // one after another, the same config's W1 alone moved by up to 8% between two variants of one
        // sweep (docs/PERF.md, the "graph gap" section). Each variant runs on its own workspace (the prepare
        // kernel's arguments of one stay while the others run), reading the tokens of `ws`.
        struct Timed {
          std::function<void()> run;
          std::unique_ptr<cuda::Graph> graph;  // what `run` replays, if a graph
          std::vector<double> samples;
          double median() {
            std::sort(samples.begin(), samples.end());
            return samples[samples.size() / 2];
          }
        };
        struct Measured {
          std::optional<Workspace> ws;
          cuda::BatchedExpertsLaunch launch;
          bool act = false;  // runs the activation kernel (not the fused W1)
          // eager: the step, W1, W2; graph: the step, W1, W2, then the parts (--graph-parts).
          std::vector<Timed> timed;
          std::string notes;  // the activation kernels' lines
        };
        enum : std::size_t { kEagerStep, kEagerW1, kEagerW2, kGraphStep, kGraphW1, kGraphW2, kParts };
        std::vector<Measured> measured(sweep.size());
        for (std::size_t i = 0; i < sweep.size(); ++i) {
          const Variant& v = sweep[i];
          Measured& r = measured[i];
          r.ws.emplace(plan_layer(v.problem, entry, 1), *memory);
          r.launch = cuda::make_launch(v.problem, *v.scheme->input, *v.scheme->view, *r.ws, dev.num_sms, v.gemms);
          const cuda::BatchedExpertsLaunch& l = r.launch;
          r.act = plan::runs_activation_kernel(v.gemms);
          auto eager = [&](std::function<void(void*)> enqueue) {
            r.timed.push_back({[enqueue, &stream] { enqueue(stream); }, nullptr, {}});
          };
          // What `enqueue` puts on a stream, captured once and replayed: no host launch work in the time.
          auto graph = [&](const std::function<void(void*)>& enqueue) {
            auto g = std::make_unique<cuda::Graph>(enqueue, stream);
            cuda::Graph* raw = g.get();
            r.timed.push_back({[raw, &stream] { raw->replay(stream); }, std::move(g), {}});
          };
          const cuda::BatchedExpertsLaunch* lp = &r.launch;
          auto step = [lp](void* s) {
            cuda::clear_status_words(lp->status, s);
            cuda::launch_batched_experts(*lp, s);
          };
          // Each grouped GEMM alone (the rest is the prepare and activation kernels and launch gaps), so
          // that W1 and W2 can be judged apart; the prepare kernel's arguments stay in r.ws.
          auto gemm = [lp](int which) { return [lp, which](void* s) { cuda::launch_experts_gemm(*lp, which, s); }; };
          auto activation = [lp, act = r.act](void* s) {
            if (act) cuda::launch_activation_quant(*lp, cuda::ActivationKernel::kAuto, s);
          };
          eager(step);
          eager(gemm(1));
          eager(gemm(2));
          graph(step);
          graph(gemm(1));
          graph(gemm(2));
          if (graph_parts) {
            // As launch_batched_experts runs them, without the prepare kernel (its arguments stay).
            graph([&](void* s) {
              gemm(1)(s);
              activation(s);
            });
            graph([&](void* s) {
              activation(s);
              gemm(2)(s);
            });
            graph([&](void* s) {
              gemm(1)(s);
              gemm(2)(s);
            });
            graph([&](void* s) {
              gemm(1)(s);
              activation(s);
              gemm(2)(s);
            });
          }
          for (Timed& t : r.timed) t.run();  // warm-up (the eager step runs the prepare kernel first)
          if (v.rule == Rule::kUnfused && r.act) {
            // The unfused rule's activation stage alone, per kernel variant (w1_out holds real values now).
            const double act_bytes_moved = double(E_local * m_e) * double(N * 2 + I + 4);
            for (auto [kernel, kname] : {std::pair{cuda::ActivationKernel::kGeneric, "generic"},
                                         std::pair{cuda::ActivationKernel::kRowPerBlock, "row/block"}}) {
              const double us =
                  1e3 * median_ms(
                            quick ? 5 : 20, [&] { cuda::launch_activation_quant(l, kernel, stream); }, stream);
              char line[128];
              std::snprintf(line, sizeof(line), "       activation %-9s %8.1f us %7.0f GB/s\n", kname, us,
                            act_bytes_moved / (us * 1e3));
              r.notes += line;
            }
          }
        }
        {
          cuda::Event a, b;
          for (int round = 0; round < (quick ? 9 : 21); ++round)
            for (Measured& r : measured) {
              for (Timed& t : r.timed) {
                a.record(stream);
                t.run();
                b.record(stream);
                t.samples.push_back(b.ms_since(a));
              }
            }
        }
        // The baseline's medians (--baseline), each scheme's own, where it runs this case.
        std::map<const Scheme*, std::array<double, 3>> bases;  // graph step, W1 and W2 replayed alone
        for (std::size_t i = 0; i < sweep.size() && !baseline.empty(); ++i)
          if (sweep[i].name == baseline)
            bases[sweep[i].scheme] = {measured[i].timed[kGraphStep].median(), measured[i].timed[kGraphW1].median(),
                                      measured[i].timed[kGraphW2].median()};
        for (const auto& sc : schemes)
          if (!baseline.empty() && !bases.contains(sc.get()))
            std::printf("       (--baseline %s does not run this case with %s: no ratios)\n", baseline.c_str(),
                        std::string(quant_name(sc->quant)).c_str());
        for (std::size_t i = 0; i < sweep.size(); ++i) {
          const Variant& v = sweep[i];
          const QuantScheme quant = v.scheme->quant;
          Measured& r = measured[i];
          cuda::check_status_words(r.launch.status, "bench", M, p.E, stream);
          std::array<double, 3> vs{};  // graph step, W1, W2 over the baseline's
          const auto base_it = bases.find(v.scheme);
          const bool base = base_it != bases.end();
          if (base) {
            const std::array<double, 3>& b = base_it->second;
            vs = {r.timed[kGraphStep].median() / b[0], r.timed[kGraphW1].median() / b[1],
                  r.timed[kGraphW2].median() / b[2]};
            r.notes += "       vs " + baseline + " (same rounds): step " + fixed4(vs[0]) + ", W1 " + fixed4(vs[1]) +
                       ", W2 " + fixed4(vs[2]) + "\n";
          }
          const double ms = r.timed[kEagerStep].median(), g1_ms = r.timed[kEagerW1].median(),
                       g2_ms = r.timed[kEagerW2].median();
          const double graph_ms = r.timed[kGraphStep].median();
          if (graph_parts)
            r.notes += "       graph parts: W1+act " + fixed4(r.timed[kParts].median()) + ", act+W2 " +
                       fixed4(r.timed[kParts + 1].median()) + ", W1+W2 " + fixed4(r.timed[kParts + 2].median()) +
                       ", W1+act+W2 " + fixed4(r.timed[kParts + 3].median()) + " ms" +
                       (r.act ? "" : " (no activation kernel: fused)") + "\n";
          const auto& name = v.name;
          // What the runtime runs by default: the fused rule where W1 fuses, else the rule.
          const bool chosen = v.rule == (v.scheme->fused_p.fuse_w1 ? Rule::kFused : Rule::kUnfused);
          // The variant's row, then its stage lines.
          std::printf("%-9s %6lld %6lld %-20s %9.4f %9.4f %9.1f %9.4f %8.2f %9.4f %10.2f %7.2f%s\n",
                      std::string(quant_name(quant)).c_str(), static_cast<long long>(M), static_cast<long long>(m_e),
                      name.c_str(), ms, graph_ms, flops / (graph_ms * 1e-3) / 1e12, floor_ms, graph_ms / floor_ms,
                      weights_ms, graph_ms / weights_ms, read_ms > 0 ? graph_ms / read_ms : std::nan(""),
                      chosen ? "  <- selected" : "");
          std::printf(
              "       stages: W1 GEMM %.4f ms (%.0f TFLOP/s), W2 GEMM %.4f ms (%.0f TFLOP/s), rest %.4f ms; "
              "replayed alone: W1 %.4f, W2 %.4f ms\n",
              g1_ms, 2.0 * double(E_local * m_e * N * K) / (g1_ms * 1e9), g2_ms,
              2.0 * double(E_local * m_e * K * I) / (g2_ms * 1e9), ms - g1_ms - g2_ms, r.timed[kGraphW1].median(),
              r.timed[kGraphW2].median());
          if (host_time && v.rule != Rule::kNone) {
            // The seam's run (the plan, the launch's arguments, then the launches) and each launcher
            // alone, bound and fresh.
            const auto experts = cuda::make_batched_experts({});
            const cuda::BatchedExpertsLaunch* lp = &r.launch;
            const std::vector<std::pair<const char*, std::function<void()>>> parts = {
                {"step", [&] { cuda::launch_batched_experts(*lp, stream); }},
                {"seam run", [&] { experts->run(v.problem, *v.scheme->input, *v.scheme->view, *r.ws, stream); }},
                {"prepare", [&] { cuda::launch_experts_prepare(*lp, stream); }},
                {"W1", [&] { cuda::launch_experts_gemm(*lp, 1, stream); }},
                {"W2", [&] { cuda::launch_experts_gemm(*lp, 2, stream); }},
            };
            const int launches = 1 + r.launch.gemms.w1.count + (r.act ? 1 : 0) + r.launch.gemms.w2.count;
            std::string line = "       host us a call (median of 31; bound / fresh; the step " +
                               std::to_string(launches) + " launches):";
            for (const auto& [part, enqueue] : parts) {
              const double bound = ceilings::host_us(enqueue, stream);
              cuda::detail::set_launch_cache_enabled(false);
              const double fresh = ceilings::host_us(enqueue, stream);
              cuda::detail::set_launch_cache_enabled(true);
              char item[96];
              std::snprintf(item, sizeof(item), " %s %.1f / %.1f,", part, bound, fresh);
              line += item;
            }
            line.back() = '\n';
            r.notes += line;
            cuda::check_status_words(r.launch.status, "bench (host time)", M, p.E, stream);
          }
          std::printf("%s", r.notes.c_str());
          if (v.rule != Rule::kNone) rules_ms[{M, m_e}][{quant, v.rule == Rule::kFused}] = graph_ms;
          json += std::string(first ? "" : ",\n") + "    {\"quant\": \"" + std::string(quant_name(quant)) +
                  "\", \"M\": " + std::to_string(M) + ", \"m_e\": " + std::to_string(m_e) + ", \"config\": \"" + name +
                  "\", \"selected\": " + (chosen ? "true" : "false") + ", \"ms\": " + std::to_string(ms) +
                  ", \"graph_ms\": " + std::to_string(graph_ms) + ", \"floor_ms\": " + std::to_string(floor_ms) +
                  ", \"weights_read_ms\": " + std::to_string(weights_ms) +
                  ", \"tflops\": " + std::to_string(flops / (graph_ms * 1e-3) / 1e12) +
                  ", \"gemm1_ms\": " + std::to_string(g1_ms) + ", \"gemm2_ms\": " + std::to_string(g2_ms) +
                  (base ? ", \"baseline\": \"" + baseline + "\", \"vs_baseline\": [" + std::to_string(vs[0]) + ", " +
                              std::to_string(vs[1]) + ", " + std::to_string(vs[2]) + "]"
                        : std::string()) +
                  "}";
          first = false;
        }
      }
    }
  }
  // Issue 10's target: block128 (the fused recipe, its default, and unfused) within 1.05x of
  // per-token's step at every m_e, both measured in the same rounds.
  bool header = false;
  for (const auto& [c, v] : rules_ms) {
    const auto pt = v.find({QuantScheme::kPerTokenPerChannel, false});
    if (pt == v.end()) continue;
    for (const bool fused : {true, false}) {
      const auto bq = v.find({QuantScheme::kBlock128, fused});
      if (bq == v.end()) continue;
      if (!header)
        std::printf(
            "block128 over per-token (graph step, each scheme's rule, same rounds; target <= 1.05):\n"
            "%6s %6s %-20s %9s %9s %7s\n",
            "M", "m_e", "block128", "ms", "per-token", "ratio");
      header = true;
      std::printf("%6lld %6lld %-20s %9.4f %9.4f %7.3f\n", static_cast<long long>(c.first),
                  static_cast<long long>(c.second), fused ? "fused rule (default)" : "rule (unfused)", bq->second,
                  pt->second, bq->second / pt->second);
    }
  }
  json += "\n  ]\n}\n";
  std::ofstream(out_path) << json;
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}
