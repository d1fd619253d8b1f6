// `moekit bench layer`: the whole layer's step time per experts implementation and tokens per step,
// on the GPU from CUDA graph replay (median and p99 over --iters replays; stage times from a second
// graph with events recorded between the stages), on the CPU from wall time. Prints the machine's measured ceilings
// (copy bandwidth, cuBLASLt's dense rate in the recipe's operand dtype: FP8, or bf16 unquantized) and each step
// against the floor max(FLOPs / that peak, bytes / copy bandwidth), bytes = the weights (and scales) of the
// experts that received a token + the tokens in and out. A table on stdout, JSON with
// --format json, progress on stderr.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <iostream>
#include <memory>
#include <thread>

#include "ceilings/ceilings.h"
#include "cli/commands.h"
#include "cpu/routing.h"
#include "cuda/backend.h"
#include "cuda/device_info.h"
#include "cuda/launch.h"
#include "moekit/check.h"
#include "moekit/layer.h"
#include "moekit/limits.h"
#include "moekit/registry.h"
#include "numerics/fp8.h"
#include "numerics/scales.h"
#include "synthetic/synthetic.h"

namespace moekit::cli {

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(
      std::min<double>(static_cast<double>(v.size() - 1), std::ceil(q * static_cast<double>(v.size())) - 1));
  return v[i];
}

namespace {

struct BenchRequest {
  std::string what;
  std::string model = "deepseek-v3";
  std::int64_t num_experts = 0;  // 0: the model's
  // bench layer: expert slots on the GPU (0: E); more: redundant experts in the runtime's default
  // placement (round robin), the replica step in every step (random weights: the time, not the values)
  std::int64_t local_experts = 0;
  std::string device = "auto";
  std::vector<std::string> experts{"batched-fp8", "standard-fp8"};
  std::vector<std::int64_t> tokens{1, 8, 32, 128, 512, 2048, 8192};
  std::string quant = "auto";   // auto: the checkpoint's scheme (choose_quant)
  std::optional<bool> fuse_w1;  // the fused W1 (no w1_out): nullopt where it runs (fuse_w1_runs)
  // The model's shared experts in the step: "on", "off" or both (each implementation measured both
  // ways, in one process); a model without shared experts runs "off" only.
  std::vector<std::string> shared{"on"};
  // The GPU GEMMs' sum over K: "precise", "fast" or both (each measured, in one process).
  std::vector<std::string> accumulation{"precise"};
  int iters = 50;
  std::uint64_t seed = 1;
  std::string format = "table";
  // bench dispatch
  std::vector<std::string> routing{"uniform", "skewed"};
  std::string dispatch = "nccl";
  int ranks = 0;
  std::int64_t max_tokens_per_rank = 0;
  bool tokens_given = false;
  bool routing_given = false;
};

// The layer benchmark's routing: "uniform" (the default), the synthetic model's seeded logits (iid
// N(0, 2^2)) with the correction bias zeroed, every expert's expected load equal (T = 512: max ~30
// rows), as a checkpoint trained for balanced load routes; "model", the same logits with the
// synthetic model's seeded e_score_correction_bias, 0.1 N(0, 1): under DeepSeek-V3's sigmoid scores
// the bias outweighs the saturated scores' differences, so a few experts take most tokens (T = 512:
// 124 of 256 experts active, the busiest 135 rows against 16 on average), which flatters the
// step's time (fewer experts' weights read: docs/PERF.md).
std::string layer_routing(const BenchRequest& req) {
  if (!req.routing_given) return "uniform";
  MOEKIT_CHECK(req.routing.size() == 1 && (req.routing[0] == "model" || req.routing[0] == "uniform"),
               "bench layer --routing {}: one of model (the synthetic model's logits and correction bias: a few "
               "experts take most tokens) or uniform (the bias zeroed: every expert's expected load equal)",
               fmt::join(req.routing, ","));
  return req.routing[0];
}

const char* kStages[] = {"route", "prepare", "experts", "finalize"};

struct Row {
  std::string experts;
  std::int64_t T = 0;
  double median_ms = 0, p99_ms = 0, floor_ms = 0;
  double stage_ms[4] = {0, 0, 0, 0};
  std::int64_t active_experts = 0;
  std::int64_t max_rows = 0;  // the most (token, slot) pairs one expert received
  double flops = 0, bytes = 0;
  bool fused = false;   // the problem's recipe (MoeProblem::fuse_w1)
  bool shared = false;  // the shared experts in the step
  bool fast = false;    // Accumulation::kFast
};

// The layer's weights on its device: seeded synthetic ones on the CPU; on a GPU random values in the
// recipe's weight dtype, FP8 codes with scales of the right magnitude or bf16 values without scales
// (a 256-expert model is 11 GiB in FP8: timing needs no quantizer pass over it on the host).
struct BenchWeights {
  synthetic::HostExpertWeights host;
  std::vector<DeviceBuffer> device;
  ExpertWeightsView view;
};

BenchWeights make_weights(const MoeProblem& p, Device device, Memory& memory, std::uint64_t seed, cpu::ThreadPool& pool,
                          std::int64_t first_expert = 0) {
  BenchWeights w;
  if (device == Device::kCpu) {
    w.host = synthetic::make_expert_weights(p, first_expert, seed, pool);
    w.view = w.host.view();
    return w;
  }
  const std::int64_t I = p.I();
  const std::int64_t s1 = numerics::weight_scale_count(p.quant, p.N, p.K),
                     s2 = numerics::weight_scale_count(p.quant, p.K, I);
  const DType weight_dtype = recipe_info(p.quant).weight_dtype;
  const std::int64_t element = dtype_size(weight_dtype);
  w.device.emplace_back(memory, element * p.E_local * p.N * p.K, "W1");
  w.device.emplace_back(memory, element * p.E_local * p.K * I, "W2");
  for (int i = 0; i < 2; ++i) {
    const std::size_t bytes = static_cast<std::size_t>(w.device[static_cast<std::size_t>(i)].bytes());
    if (weight_dtype == DType::kFp8E4m3)
      ceilings::fill_random_bytes(w.device[static_cast<std::size_t>(i)].get(), bytes, seed + i, true);
    else  // 16-bit values of magnitude [0.5, 1): their sums stay finite at every shape (the time needs no more)
      ceilings::fill_random_sixteen_bit(w.device[static_cast<std::size_t>(i)].get(), bytes / 2, seed + i, weight_dtype);
  }
  // Codes span +-448: scales of 1 / (448 sqrt(k)) give weights of rms ~ 1 / sqrt(k), as trained ones.
  // An unquantized recipe has none (null scales).
  const float* scales[2] = {nullptr, nullptr};
  const std::int64_t counts[2] = {s1, s2}, k_of[2] = {p.K, I};
  for (int i = 0; i < 2; ++i) {
    if (counts[i] == 0) continue;
    const std::vector<float> sc(static_cast<std::size_t>(p.E_local * counts[i]),
                                1.0f / (448.0f * std::sqrt(static_cast<float>(k_of[i]))));
    w.device.emplace_back(memory, 4 * p.E_local * counts[i], i == 0 ? "W1 scales" : "W2 scales");
    memory.from_host(w.device.back().get(), sc.data(), w.device.back().bytes(), nullptr);
    scales[i] = w.device.back().as<float>();
  }
  w.view = ExpertWeightsView::of(p, device, w.device[0].as<std::uint8_t>(), scales[0], w.device[1].as<std::uint8_t>(),
                                 scales[1]);
  if (p.expert_bias) {  // gpt-oss: its W1 and W2 biases, small constants (their values do not move the time)
    const std::vector<float> b1(static_cast<std::size_t>(p.E_local * p.N), 0.01f),
        b2(static_cast<std::size_t>(p.E_local * p.K), 0.01f);
    w.device.emplace_back(memory, 4 * p.E_local * p.N, "W1 biases");
    memory.from_host(w.device.back().get(), b1.data(), w.device.back().bytes(), nullptr);
    w.view.w1_bias = w.device.back().as<float>();
    w.device.emplace_back(memory, 4 * p.E_local * p.K, "W2 biases");
    memory.from_host(w.device.back().get(), b2.data(), w.device.back().bytes(), nullptr);
    w.view.w2_bias = w.device.back().as<float>();
  }
  return w;
}

std::vector<Row> bench_layer(const BenchRequest& req, const ModelConfig& model, Device device, double peak_tflops,
                             double copy_gbs) {
  std::vector<Row> rows;
  const std::int64_t max_T = *std::max_element(req.tokens.begin(), req.tokens.end());
  const ParallelConfig par{1, 1, std::max<std::int64_t>(max_T, 1), req.local_experts};
  const auto memory = make_memory(device);
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu::ThreadPool pool(threads);
  // Tokens and router logits of the largest step (smaller steps take its first rows), on the device.
  const synthetic::Tokens tok = synthetic::make_tokens(model.hidden_size, model.num_experts, 0, max_T, req.seed);
  const std::vector<float> bias = layer_routing(req) == "uniform"
                                      ? std::vector<float>(static_cast<std::size_t>(model.num_experts), 0.0f)
                                      : synthetic::make_routing_bias(model.num_experts, req.seed);
  DeviceCopies inputs(*memory);
  const std::uint16_t* hidden = inputs.put(tok.hidden, "hidden");
  const float* logits = inputs.put(tok.logits, "logits");
  const float* dbias = inputs.put(bias, "bias");
  DeviceBuffer out_dev;
  std::vector<std::uint16_t> out_host(static_cast<std::size_t>(max_T * model.hidden_size));
  std::uint16_t* output = out_host.data();
  if (device != Device::kCpu) {
    out_dev = DeviceBuffer(*memory, static_cast<std::int64_t>(2 * out_host.size()), "bench output");
    output = out_dev.as<std::uint16_t>();
  }
  const RoutingConfig routing = routing_config(model);
  const QuantScheme quant = choose_quant(model, req.quant).quant;
  const std::size_t total_cases = req.experts.size() * req.tokens.size() * std::max<std::size_t>(1, req.shared.size());
  std::size_t done = 0;
  // Every implementation is built first; then each T is measured for each of them in turn, so that
  // no implementation gains or loses from its place in the sweep (measured one after the other, the
  // second's small steps ran right after the first's T = 8192 and read 1-12% slow on a heated GPU:
  // docs/PERF.md). Implementations whose weights have the same shape share one copy.
  struct Impl {
    std::string name;
    MoeProblem p;
    std::size_t weights = 0;  // index into `weights`
    bool shared = false;
  };
  std::vector<Accumulation> accumulations;
  for (const std::string& a : req.accumulation) {
    const Accumulation acc = parse_accumulation(a);
    if (std::find(accumulations.begin(), accumulations.end(), acc) == accumulations.end()) accumulations.push_back(acc);
  }
  std::vector<Impl> impls;
  std::vector<BenchWeights> weights;
  weights.reserve(req.experts.size() + 1);     // the views point into them
  std::optional<BenchWeights> shared_weights;  // one copy for every implementation (the same problem)
  std::vector<std::uint16_t> shared_gate;
  const std::uint16_t* shared_gate_dev = nullptr;
  std::vector<bool> shared_modes;
  for (const std::string& mode : req.shared) {
    MOEKIT_CHECK(mode == "on" || mode == "off", "--shared-experts {}: on, off or on,off", mode);
    const bool on = mode == "on" && model.shared_intermediate_size > 0;
    if (std::find(shared_modes.begin(), shared_modes.end(), on) == shared_modes.end()) shared_modes.push_back(on);
  }
  std::vector<MoeProblem> weight_shapes;
  for (const std::string& name : req.experts) {
    const ExpertsEntry& entry = find_experts(name, device);
    // --fuse-w1 where it cannot run: the error names the fix.
    const MoeProblem p = make_problem(model, par, entry.format, quant, model.activation, req.fuse_w1);
    for (const Accumulation acc : accumulations)  // fast where it cannot run: the error names the fix
      make_problem(model, par, entry.format, quant, model.activation, req.fuse_w1, acc);
    std::size_t wi = 0;
    while (wi < weight_shapes.size() &&
           !(weight_shapes[wi].E_local == p.E_local && weight_shapes[wi].N == p.N && weight_shapes[wi].K == p.K &&
             weight_shapes[wi].quant == p.quant && weight_shapes[wi].activation == p.activation &&
             weight_shapes[wi].fuse_w1 == p.fuse_w1))
      ++wi;
    if (wi == weight_shapes.size()) {
      std::cerr << fmt::format("bench layer: {} ({}): building {} experts' weights...\n", name, device_name(device),
                               p.E_local);
      weights.push_back(make_weights(p, device, *memory, req.seed, pool));
      weight_shapes.push_back(p);
    }
    for (const Accumulation acc : accumulations)
      for (const bool on : shared_modes) {
        MoeProblem pa = p;
        pa.accumulation = acc;
        impls.push_back({name, pa, wi, on});
      }
    const auto sp = shared_experts_problem(model, p);
    if (sp && !shared_weights && std::find(shared_modes.begin(), shared_modes.end(), true) != shared_modes.end()) {
      shared_weights = make_weights(*sp, device, *memory, req.seed + 7, pool, synthetic::kSharedExpertIndex);
      if (model.shared_expert_gate) {
        shared_gate.assign(static_cast<std::size_t>(p.K), numerics::bf16_encode(0.01f));
        shared_gate_dev = inputs.put(shared_gate, "shared_expert_gate");
      }
    }
  }
  std::vector<std::vector<Row>> by_impl(impls.size());
  run_in_process(1, [&](Communicator& comm) {
    std::vector<std::unique_ptr<MoeLayer>> layers;
    for (const Impl& im : impls) {
      LayerOptions opt;
      opt.device = device;
      opt.experts = im.name;
      opt.quant = im.p.quant;
      opt.fuse_w1 = im.p.fuse_w1;
      opt.accumulation = im.p.accumulation;
      opt.num_threads = threads;
      opt.shared_experts = im.shared;
      LayerWeights lw{weights[im.weights].view, model.has_score_correction_bias ? dbias : nullptr};
      if (im.shared) {
        lw.shared_experts = shared_weights->view;
        lw.shared_expert_gate = shared_gate_dev;
      }
      layers.push_back(std::make_unique<MoeLayer>(model, par, opt, lw, comm));
    }
    void* stream = device == Device::kCpu ? nullptr : cuda::create_stream();
    for (const std::int64_t T : req.tokens) {
      for (std::size_t li = 0; li < impls.size(); ++li) {
        MoeLayer& layer = *layers[li];
        const MoeProblem& p = impls[li].p;
        const std::string& name = impls[li].name;
        const auto shared_p = impls[li].shared ? layer.shared_problem() : std::nullopt;
        std::cerr << fmt::format("bench layer: {}{} T = {} ({}/{})\n", name, shared_p ? " +shared" : "", T, ++done,
                                 total_cases);
        Row r;
        r.experts = name;
        r.shared = shared_p.has_value();
        r.fast = p.accumulation == Accumulation::kFast;
        r.T = T;
        std::vector<double> step;
        std::vector<std::vector<double>> stage(4);
        if (device == Device::kCpu) {
          for (int i = 0; i < std::max(1, req.iters); ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            layer.forward(hidden, logits, T, output, stream);
            step.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
            const StepStats& s = layer.last_step();
            const double ms[4] = {s.route_ms, s.prepare_ms, s.experts_ms, s.finalize_ms};
            for (int k = 0; k < 4; ++k) stage[static_cast<std::size_t>(k)].push_back(ms[k]);
          }
        } else {
          // The step alone in one graph (its time); the step with events at the stage boundaries in a
          // second graph (the stage times: event nodes add their own gaps, so not the total).
          cuda::Event marks[5], start, end;
          auto plain = [&](void* s) { layer.enqueue(hidden, logits, T, output, s); };
          auto marked = [&](void* s) {
            int next = 0;
            layer.enqueue(hidden, logits, T, output, s, [&](std::string_view, Stream st) { marks[next++].record(st); });
          };
          plain(stream);  // eager once: flags checked before timing
          layer.check_status(stream);
          cuda::Graph step_graph(plain, stream), stage_graph(marked, stream);
          for (int i = 0; i < 5; ++i) step_graph.replay(stream);
          for (int i = 0; i < req.iters; ++i) {
            start.record(stream);
            step_graph.replay(stream);
            end.record(stream);
            step.push_back(end.ms_since(start));
          }
          for (int i = 0; i < std::max(5, req.iters / 2); ++i) {
            stage_graph.replay(stream);
            for (int k = 0; k < 4; ++k) stage[static_cast<std::size_t>(k)].push_back(marks[k + 1].ms_since(marks[k]));
          }
          layer.check_status(stream);
        }
        r.median_ms = percentile(step, 0.5);
        r.p99_ms = percentile(step, 0.99);
        for (int k = 0; k < 4; ++k) r.stage_ms[k] = percentile(stage[static_cast<std::size_t>(k)], 0.5);
        // The floor: FLOPs of the valid rows; bytes of the experts that received a token (their
        // weights in the recipe's dtype and scales) + the tokens in and out (bf16).
        std::vector<std::int32_t> ids(static_cast<std::size_t>(T * p.topk));
        std::vector<float> wts(ids.size());
        cpu::route(routing, tok.logits.data(), T, model.has_score_correction_bias ? bias.data() : nullptr, ids.data(),
                   wts.data());
        std::vector<std::int64_t> rows_of(static_cast<std::size_t>(p.E), 0);
        for (const std::int32_t e : ids)
          if (e >= 0) ++rows_of[static_cast<std::size_t>(e)];
        r.active_experts = std::count_if(rows_of.begin(), rows_of.end(), [](std::int64_t n) { return n > 0; });
        r.max_rows = *std::max_element(rows_of.begin(), rows_of.end());
        r.fused = p.fuse_w1;
        MoeProblem one = p;
        one.E_local = 1;
        r.flops = 2.0 * static_cast<double>(T * p.topk) * static_cast<double>(p.N * p.K + p.K * p.I());
        r.bytes = static_cast<double>(r.active_experts) * static_cast<double>(expert_weight_bytes(one)) +
                  4.0 * static_cast<double>(T * p.K);
        if (shared_p && T > 0) {  // every token through the shared experts: their FLOPs and weights
          r.flops += 2.0 * static_cast<double>(T) * static_cast<double>(shared_p->N * p.K + p.K * shared_p->I());
          r.bytes += static_cast<double>(expert_weight_bytes(*shared_p));
        }
        if (peak_tflops > 0 && copy_gbs > 0)
          r.floor_ms = std::max(r.flops / (peak_tflops * 1e12), r.bytes / (copy_gbs * 1e9)) * 1e3;
        by_impl[li].push_back(r);
      }
    }
    if (stream != nullptr) cuda::destroy_stream(stream);
  });
  for (const std::vector<Row>& mine : by_impl) rows.insert(rows.end(), mine.begin(), mine.end());
  return rows;
}

int bench_command(const BenchRequest& req) {
  MOEKIT_CHECK(req.what == "layer" || req.what == "dispatch", "moekit bench {}: the benchmarks are: layer, dispatch",
               req.what);
  if (req.what == "dispatch") {
    DispatchBenchRequest d;
    d.model = req.model;
    d.num_experts = req.num_experts;
    if (req.tokens_given) d.tokens = req.tokens;
    d.routing = req.routing;
    d.dispatch = req.dispatch;
    d.quant = req.quant;
    d.ranks = req.ranks;
    d.max_tokens_per_rank = req.max_tokens_per_rank;
    d.iters = req.iters;
    d.seed = req.seed;
    d.format = req.format;
    return bench_dispatch_command(d);
  }
  MOEKIT_CHECK(!req.tokens.empty() && *std::min_element(req.tokens.begin(), req.tokens.end()) >= 0,
               "--tokens needs one or more counts >= 0");
  MOEKIT_CHECK(req.iters >= 1, "--iters = {} must be >= 1", req.iters);
  ModelConfig model = load_model(req.model);
  if (req.num_experts > 0) model.num_experts = req.num_experts;
  const QuantChoice quant = choose_quant(model, req.quant);
  const Device device =
      req.device == "auto" ? (cuda::available() ? Device::kCuda : Device::kCpu) : parse_device(req.device);
  double copy_gbs = 0, peak = 0;
  // The floor's rate: cuBLASLt's dense GEMM in the recipe's operand dtype (FP8, or bf16 unquantized).
  const DType peak_dtype = recipe_info(quant.quant).weight_dtype;
  const std::string peak_name = peak_dtype == DType::kFp8E4m3 ? "fp8" : std::string(dtype_name(peak_dtype));
  std::string device_text = "cpu";
  if (device == Device::kCuda) {
    const cuda::DeviceInfo info = cuda::device_info(0);
    device_text = fmt::format("{} ({} SMs)", info.name, info.num_sms);
    void* s = cuda::create_stream();
    copy_gbs = ceilings::copy_gbs(s);
    peak =
        peak_dtype == DType::kFp8E4m3 ? ceilings::fp8_gemm_tflops(s) : ceilings::sixteen_bit_gemm_tflops(peak_dtype, s);
    cuda::destroy_stream(s);
  }
  const std::vector<Row> rows = bench_layer(req, model, device, peak, copy_gbs);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  if (req.format == "json") {
    nlohmann::json j;
    j["benchmark"] = "layer";
    j["device"] = device_text;
    j["date"] = date;
    j["model"] = model.name;
    j["E"] = model.num_experts;
    j["local_experts"] = req.local_experts == 0 ? model.num_experts : req.local_experts;
    j["topk"] = model.topk;
    j["K"] = model.hidden_size;
    j["I"] = model.moe_intermediate_size;
    j["quant"] = quant_name(quant.quant);
    j["fuse_w1"] = req.fuse_w1 ? nlohmann::json(*req.fuse_w1) : nlohmann::json();  // null: not asked
    j["routing"] = layer_routing(req);
    j["ceilings"] = {
        {"copy_gbs", copy_gbs}, {peak_name + "_tflops", peak}, {"gemm_tflops", peak}, {"gemm_dtype", peak_name}};
    j["rows"] = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json x = {{"experts", r.experts},
                          {"T", r.T},
                          {"median_ms", r.median_ms},
                          {"p99_ms", r.p99_ms},
                          {"floor_ms", r.floor_ms},
                          {"active_experts", r.active_experts},
                          {"max_rows", r.max_rows},
                          {"fuse_w1", r.fused},
                          {"shared_experts", r.shared},
                          {"accumulation", r.fast ? "fast" : "precise"},
                          {"flops", r.flops},
                          {"bytes", r.bytes},
                          {"stages_ms", nlohmann::json::object()}};
      for (int k = 0; k < 4; ++k) x["stages_ms"][kStages[k]] = r.stage_ms[k];
      j["rows"].push_back(x);
    }
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("moekit bench layer: {} on {}, E = {} ({}), top-{}, K = {}, I = {}, {}{}; {} routing; {}\n",
                           model.name, device_text, model.num_experts,
                           req.local_experts > model.num_experts
                               ? fmt::format("in {} slots, round robin: redundant experts", req.local_experts)
                               : std::string("all local"),
                           model.topk, model.hidden_size, model.moe_intermediate_size, quant.note,
                           req.fuse_w1 ? (*req.fuse_w1 ? " (--fuse-w1)" : " (--no-fuse-w1)") : "", layer_routing(req),
                           device == Device::kCuda ? fmt::format("graph replay, {} iterations", req.iters)
                                                   : fmt::format("wall time, {} iterations", req.iters));
  if (device == Device::kCuda)
    std::cout << fmt::format("ceilings: D2D copy {:.0f} GB/s (read + write), cuBLASLt {} 8192^3 {:.0f} TFLOP/s\n",
                             copy_gbs, peak_name, peak);
  std::cout << fmt::format("{:<28} {:>6} {:>9} {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>7} {:>8} {:>13}\n",
                           "experts", "T", "ms", "p99 ms", "floor ms", "x floor", "route", "prepare", "experts",
                           "finalize", "rest %", "TFLOP/s", "experts/most");
  for (const Row& r : rows) {
    const double rest = r.stage_ms[0] + r.stage_ms[1] + r.stage_ms[3];
    std::cout << fmt::format(
        "{:<28} {:>6} {:>9.4f} {:>9.4f} {:>9.4f} {:>7.2f} {:>8.4f} {:>8.4f} {:>8.4f} {:>8.4f} {:>7.1f} {:>8.1f} "
        "{:>13}\n",
        r.experts + (r.fused ? " fused" : "") + (r.shared ? " +sh" : "") + (r.fast ? " fast" : ""), r.T, r.median_ms,
        r.p99_ms, r.floor_ms, r.floor_ms > 0 ? r.median_ms / r.floor_ms : 0.0, r.stage_ms[0], r.stage_ms[1],
        r.stage_ms[2], r.stage_ms[3], r.median_ms > 0 ? 100.0 * rest / r.median_ms : 0.0,
        r.median_ms > 0 ? r.flops / (r.median_ms * 1e9) : 0.0, fmt::format("{}/{}", r.active_experts, r.max_rows));
  }
  std::cout << "rest % = (route + prepare + finalize) / step; floor = max(FLOPs / the recipe's GEMM peak (cuBLASLt, "
               "its operand dtype), bytes / copy bandwidth); "
               "experts/most = experts that got a token / the most rows one got; +sh: with the shared experts (their "
               "FLOPs and weights in the floor)\n";
  return 0;
}

}  // namespace

std::function<int()> add_bench_command(CLI::App& app) {
  auto req = std::make_shared<BenchRequest>();
  CLI::App* cmd = app.add_subcommand("bench", "Measure the layer: step time per tokens per step, against the floor");
  cmd->add_option("what", req->what, "What to measure: layer (the whole layer) or dispatch (the NCCL transport)")
      ->required();
  cmd->add_option("--model", req->model, "Preset name or path to a Hugging Face config.json")->capture_default_str();
  cmd->add_option("--local-experts", req->local_experts,
                  "layer: expert slots (0: E); more: redundant experts (round-robin placement, its replica step)")
      ->check(int_range(0, limits::kMaxSlotsPerExpert * limits::kMaxExperts))
      ->capture_default_str();
  cmd->add_option("--num-experts", req->num_experts, "Override the model's routed experts (0: keep)")
      ->check(int_range(0, limits::kMaxExperts))
      ->capture_default_str();
  cmd->add_option("--device", req->device, "auto (cuda when present), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--experts", req->experts, "Experts implementations (repeatable)")->capture_default_str();
  cmd->add_option("--tokens", req->tokens, "Tokens per step (per rank for dispatch; default 1,8,32,128,512,4096 there)")
      ->delimiter(',')
      ->check(int_range(0, limits::kMaxTokensPerRank))
      ->capture_default_str()
      ->each([req](const std::string&) { req->tokens_given = true; });
  cmd->add_option("--routing", req->routing,
                  "dispatch: uniform and/or skewed (every token to rank 0's experts); layer: uniform (default: the "
                  "synthetic model's logits, its correction bias zeroed) or model (its logits and correction bias: "
                  "a few experts take most tokens)")
      ->delimiter(',')
      ->capture_default_str()
      ->each([req](const std::string&) { req->routing_given = true; });
  cmd->add_option("--dispatch", req->dispatch, "dispatch: nccl (device-initiated) or nccl-reference")
      ->capture_default_str();
  cmd->add_option("--ranks", req->ranks, "dispatch: ranks, one per GPU (0: every GPU)")
      ->check(int_range(0, limits::kMaxRanks))
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", req->max_tokens_per_rank, "dispatch: capacity (0: each case's tokens)")
      ->check(int_range(0, limits::kMaxTokensPerRank))
      ->capture_default_str();
  add_quant_option(*cmd, req->quant);
  add_fuse_w1_flags(*cmd, req->fuse_w1);
  cmd->add_option("--shared-experts", req->shared,
                  "layer: on (the model's shared experts in the step), off, or on,off (both, one process)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--accumulation", req->accumulation,
                  "layer: the GPU GEMMs' sum over K: precise, fast (per-token and per-tensor) or precise,fast (both, "
                  "one process)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--iters", req->iters, "Timed steps per case")
      ->check(int_range(1, limits::kMaxSteps))
      ->capture_default_str();
  cmd->add_option("--seed", req->seed, "Seed of tokens and weights")
      ->check(uint_range(0, UINT64_MAX))
      ->capture_default_str();
  cmd->add_option("--format", req->format, "table or json")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();
  return [cmd, req]() -> int {
    if (!cmd->parsed()) return -1;
    return bench_command(*req);
  };
}

}  // namespace moekit::cli
