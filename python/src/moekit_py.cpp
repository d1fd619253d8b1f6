// moekit's Python module (nanobind): the plan, the layer over NumPy arrays (CPU) by DLPack, zero
// copy, every array validated where it enters, moekit::Error raised as moekit.Error. The Python
// package (python/moekit/__init__.py) wraps it in documented classes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cpu/thread_pool.h"
#include "moekit/check.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "moekit/registry.h"
#include "numerics/scales.h"
#include "synthetic/synthetic.h"

namespace nb = nanobind;

namespace moekit::python {
namespace {

// An array of any dtype, shape, layout and device, as DLPack hands it over (NumPy, torch, ...), never
// converted or copied: require() checks it and raises moekit.Error naming what is wrong.
using Array = nb::ndarray<>;

std::string shape_text(const Array& a) {
  std::string s = "(";
  for (std::size_t i = 0; i < a.ndim(); ++i) s += fmt::format("{}{}", i ? ", " : "", a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

std::string dtype_text(nb::dlpack::dtype d) {
  const char* kind = d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)    ? "float"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int)    ? "int"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)   ? "uint"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                                                                                           : "other";
  return fmt::format("{}{}", kind, d.bits);
}

// Raises moekit.Error unless `a` holds `bits`-bit elements of one of `codes` in exactly `shape`.
void require(const Array& a, const char* what, std::initializer_list<nb::dlpack::dtype_code> codes, int bits,
             const std::vector<std::int64_t>& shape, const char* expected_dtype) {
  bool code_ok = false;
  for (auto c : codes) code_ok = code_ok || a.dtype().code == static_cast<std::uint8_t>(c);
  MOEKIT_CHECK(code_ok && a.dtype().bits == bits && a.dtype().lanes == 1, "{}: dtype {} where {} is needed", what,
               dtype_text(a.dtype()), expected_dtype);
  bool shape_ok = a.ndim() == shape.size();
  for (std::size_t i = 0; shape_ok && i < shape.size(); ++i)
    shape_ok = static_cast<std::int64_t>(a.shape(i)) == shape[i];
  std::string want = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) want += fmt::format("{}{}", i ? ", " : "", shape[i]);
  want += shape.size() == 1 ? ",)" : ")";
  MOEKIT_CHECK(shape_ok, "{}: shape {} where {} is needed", what, shape_text(a), want);
  MOEKIT_CHECK(a.device_type() == nb::device::cpu::value,
               "{}: on a device of DLPack type {}; the Python layer runs on the CPU today (pass host arrays)", what,
               a.device_type());
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    MOEKIT_CHECK(a.shape(i) <= 1 || a.stride(i) == expected,
                 "{}: not C-contiguous (dimension {} has stride {} elements, {} needed): pass "
                 "numpy.ascontiguousarray(...) or tensor.contiguous()",
                 what, i, a.stride(i), expected);
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
}

const auto kFloat = nb::dlpack::dtype_code::Float;
const auto kUInt = nb::dlpack::dtype_code::UInt;
const auto kInt = nb::dlpack::dtype_code::Int;
const auto kBfloat = nb::dlpack::dtype_code::Bfloat;

// The experts' weights of `p` (moekit/weights.h layouts), validated, as a view of the arrays.
ExpertWeightsView weights_of(const MoeProblem& p, const Array& w1, const Array& w1_scale, const Array& w2,
                             const Array& w2_scale) {
  require(w1, "w1", {kUInt, kInt}, 8, {p.E_local, p.N, p.K}, "uint8 FP8 e4m3 codes");
  require(w2, "w2", {kUInt, kInt}, 8, {p.E_local, p.K, p.I()}, "uint8 FP8 e4m3 codes");
  require(w1_scale, "w1_scale", {kFloat}, 32, {p.E_local, numerics::weight_scale_count(p.quant, p.N, p.K)}, "float32");
  require(w2_scale, "w2_scale", {kFloat}, 32, {p.E_local, numerics::weight_scale_count(p.quant, p.K, p.I())},
          "float32");
  return ExpertWeightsView::of(p, Device::kCpu, static_cast<const std::uint8_t*>(w1.data()),
                               static_cast<const float*>(w1_scale.data()), static_cast<const std::uint8_t*>(w2.data()),
                               static_cast<const float*>(w2_scale.data()));
}

std::string plan_json_text(const std::string& model, std::int64_t dp, std::int64_t ep, std::int64_t max_tokens,
                           std::int64_t local_experts, const std::string& device, const std::string& quant,
                           const std::string& activation, const std::vector<std::string>& experts,
                           const std::string& dispatch) {
  cli::PlanRequest req;
  req.model = model;
  req.parallel = ParallelConfig{dp, ep, max_tokens, local_experts};
  req.device = device;
  req.quant = quant;
  req.activation = activation;
  req.experts = experts;
  req.dispatch = dispatch;
  return cli::plan_json(req, cli::make_plan_report(req)).dump();
}

// One rank's layer (dp = ep = 1) on the CPU over arrays the caller keeps alive (the wrapper holds
// references to them).
class Layer {
 public:
  Layer(const std::string& model_name, std::int64_t max_tokens, const std::string& quant, const std::string& experts,
        std::optional<std::string> activation, Array w1, Array w1_scale, Array w2, Array w2_scale,
        std::optional<Array> bias, int num_threads)
      : model_(load_model(model_name)) {
    MOEKIT_CHECK(max_tokens >= 1, "max_tokens_per_rank = {} must be >= 1", max_tokens);
    LayerOptions opt;
    opt.device = Device::kCpu;
    opt.experts = experts;
    opt.quant = choose_quant(model_, quant).quant;
    if (activation) opt.activation = parse_activation(*activation);
    opt.num_threads = std::max(1, num_threads);
    const ParallelConfig par{1, 1, max_tokens, 0};
    const ExpertsEntry& entry = find_experts(experts, Device::kCpu);
    problem_ = make_problem(model_, par, entry.format, opt.quant, opt.activation.value_or(model_.activation));
    const MoeProblem& p = problem_;
    weights_ = weights_of(p, w1, w1_scale, w2, w2_scale);
    const float* bias_ptr = nullptr;
    if (model_.has_score_correction_bias) {
      MOEKIT_CHECK(bias.has_value(), "model '{}' routes with e_score_correction_bias: pass {} float32 values",
                   model_.name, p.E);
      require(*bias, "e_score_correction_bias", {kFloat}, 32, {p.E}, "float32");
      bias_ptr = static_cast<const float*>(bias->data());
    }
    // One rank: the layer's collectives are over a group of one, held for the layer's life.
    group_ = std::make_unique<Group>();
    layer_ = std::make_unique<MoeLayer>(model_, par, opt, LayerWeights{weights_, bias_ptr}, group_->comm());
  }

  // hidden (T, K) bfloat16 (or its uint16 bits), router_logits (T, E) float32 -> out (T, K), same dtype.
  void forward(Array hidden, Array logits, Array out) {
    const MoeProblem& p = problem_;
    MOEKIT_CHECK(hidden.ndim() == 2, "hidden: shape {} where (tokens, K = {}) is needed", shape_text(hidden), p.K);
    const auto T = static_cast<std::int64_t>(hidden.shape(0));
    require(hidden, "hidden", {kBfloat, kUInt, kInt}, 16, {T, p.K}, "bfloat16 (or its uint16 bits)");
    require(logits, "router_logits", {kFloat}, 32, {T, p.E}, "float32");
    require(out, "out", {kBfloat, kUInt, kInt}, 16, {T, p.K}, "bfloat16 (or its uint16 bits)");
    nb::gil_scoped_release release;
    layer_->forward(static_cast<const std::uint16_t*>(hidden.data()), static_cast<const float*>(logits.data()), T,
                    static_cast<std::uint16_t*>(out.data()));
  }

  std::int64_t workspace_bytes() const { return layer_->allocated_workspace_bytes(); }
  std::int64_t K() const { return problem_.K; }
  std::int64_t E() const { return problem_.E; }
  std::string problem() const { return problem_.describe(); }

 private:
  // A communicator of one rank that outlives the layer: run_in_process hands it out only inside
  // its function, so the group lives on a thread parked until the layer is gone.
  class Group {
   public:
    Group() {
      thread_ = std::thread([this] {
        run_in_process(1, [this](Communicator& c) {
          std::unique_lock lock(mu_);
          comm_ = &c;
          cv_.notify_all();
          cv_.wait(lock, [this] { return done_; });
        });
      });
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return comm_ != nullptr; });
    }
    ~Group() {
      {
        std::lock_guard lock(mu_);
        done_ = true;
      }
      cv_.notify_all();
      thread_.join();
    }
    Communicator& comm() { return *comm_; }

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    Communicator* comm_ = nullptr;
    bool done_ = false;
    std::thread thread_;
  };

  ModelConfig model_;
  MoeProblem problem_;
  ExpertWeightsView weights_;
  std::unique_ptr<Group> group_;  // destroyed after layer_ (declared before it)
  std::unique_ptr<MoeLayer> layer_;
};

// The experts alone in the BatchedExperts convention, on the CPU: shapes read off the arrays, the
// scheme off the scales' shapes, one workspace per problem kept for the next call.
class ExpertsOp {
 public:
  void run(Array a1q, Array a1q_scale, Array counts, Array w1, Array w1_scale, Array w2, Array w2_scale, Array out,
           const std::string& activation_name, int num_threads) {
    MOEKIT_CHECK(a1q.ndim() == 3 && w1.ndim() == 3 && w2.ndim() == 3,
                 "batched_experts: a1q (E_local, M, K), w1 (E_local, N, K) and w2 (E_local, K, I) are 3-D; got {}, {} "
                 "and {}",
                 shape_text(a1q), shape_text(w1), shape_text(w2));
    MoeProblem p;
    p.format = ActivationFormat::kBatchedExperts;
    p.E_local = p.E = static_cast<std::int64_t>(a1q.shape(0));
    p.M = p.max_tokens_per_rank = static_cast<std::int64_t>(a1q.shape(1));
    p.K = static_cast<std::int64_t>(a1q.shape(2));
    p.N = static_cast<std::int64_t>(w1.shape(1));
    p.topk = 1;
    p.num_dispatchers = 1;
    p.activation = parse_activation(activation_name);
    // The scheme, from the activation scales' shape.
    const auto s0 = a1q_scale.ndim() > 0 ? static_cast<std::int64_t>(a1q_scale.shape(0)) : -1;
    p.quant = a1q_scale.ndim() == 1 && s0 == p.E_local ? QuantScheme::kPerTensor
              : a1q_scale.ndim() == 3                  ? QuantScheme::kBlock128
                                                       : QuantScheme::kPerTokenPerChannel;
    validate_problem(p);
    const std::int64_t spr = numerics::activation_scales_per_row(p.quant, p.K);
    require(a1q, "a1q", {kUInt, kInt}, 8, {p.E_local, p.M, p.K}, "uint8 FP8 e4m3 codes");
    require(a1q_scale, "a1q_scale", {kFloat}, 32,
            p.quant == QuantScheme::kPerTensor  ? std::vector<std::int64_t>{p.E_local}
            : p.quant == QuantScheme::kBlock128 ? std::vector<std::int64_t>{p.E_local, p.M, spr}
                                                : std::vector<std::int64_t>{p.E_local, p.M},
            "float32 (E_local,) per-tensor, (E_local, M) per-token or (E_local, M, ceil(K/128)) 1x128");
    require(counts, "expert_num_tokens", {kInt}, 32, {p.E_local}, "int32");
    const ExpertWeightsView w = weights_of(p, w1, w1_scale, w2, w2_scale);
    require(out, "out", {kBfloat, kUInt, kInt}, 16, {p.E_local, p.M, p.K}, "bfloat16 (or its uint16 bits)");
    const std::string key = p.describe() + "/" + std::to_string(num_threads);
    Runner& r = runner(key, p, std::max(1, num_threads));
    const ExpertsInput in{static_cast<const std::uint8_t*>(a1q.data()),
                          static_cast<const float*>(a1q_scale.data()),
                          static_cast<const std::int32_t*>(counts.data()),
                          nullptr,
                          p.M,
                          static_cast<std::uint16_t*>(out.data())};
    nb::gil_scoped_release release;
    r.experts->run(p, in, w, *r.workspace, nullptr);
  }

 private:
  struct Runner {
    std::unique_ptr<cpu::ThreadPool> pool;
    std::unique_ptr<Experts> experts;
    std::unique_ptr<Memory> memory;
    std::unique_ptr<Workspace> workspace;
  };

  Runner& runner(const std::string& key, const MoeProblem& p, int threads) {
    std::lock_guard lock(mu_);
    auto it = runners_.find(key);
    if (it != runners_.end()) return *it->second;
    if (runners_.size() >= 8) runners_.clear();  // a few shapes at a time; a new one rebuilds
    auto r = std::make_unique<Runner>();
    r->pool = std::make_unique<cpu::ThreadPool>(threads);
    r->experts = find_experts("batched-fp8", Device::kCpu).make({r->pool.get(), nullptr});
    const std::string why = r->experts->unsupported(p);
    MOEKIT_CHECK(why.empty(), "batched_experts: {}", why);
    WorkspaceBuilder b("batched_experts op", p);
    b.begin_section("experts", "batched-fp8 (cpu)");
    r->experts->declare(p, b);
    r->memory = make_memory(Device::kCpu);
    r->workspace = std::make_unique<Workspace>(b.finish(), *r->memory);
    return *runners_.emplace(key, std::move(r)).first->second;
  }

  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Runner>> runners_;
};

ExpertsOp& experts_op() {
  static ExpertsOp op;
  return op;
}

// Seeded synthetic weights and tokens, as `moekit run --seed` draws them (one rank, every expert).
nb::dict synthetic(const std::string& model_name, std::int64_t tokens, std::int64_t max_tokens,
                   const std::string& quant, std::uint64_t seed) {
  const ModelConfig m = load_model(model_name);
  const MoeProblem p = make_problem(m, ParallelConfig{1, 1, max_tokens, 0}, ActivationFormat::kBatchedExperts,
                                    choose_quant(m, quant).quant);
  cpu::ThreadPool pool(2);
  auto w = std::make_shared<synthetic::HostExpertWeights>(synthetic::make_expert_weights(p, 0, seed, pool));
  auto t = std::make_shared<synthetic::Tokens>(synthetic::make_tokens(p.K, p.E, 0, tokens, seed));
  auto bias = std::make_shared<std::vector<float>>(m.has_score_correction_bias ? synthetic::make_routing_bias(p.E, seed)
                                                                               : std::vector<float>{});
  // Arrays that own their data through a capsule holding the shared_ptr.
  auto owned = [](auto holder, auto* data, std::initializer_list<std::size_t> shape) {
    using T = std::remove_pointer_t<decltype(data)>;
    auto* keep = new decltype(holder)(holder);
    nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<decltype(holder)*>(p); });
    return nb::ndarray<nb::numpy, T>(data, shape, owner);
  };
  const auto E = static_cast<std::size_t>(p.E_local);
  nb::dict d;
  d["w1"] = owned(w, w->w1.data(), {E, static_cast<std::size_t>(p.N), static_cast<std::size_t>(p.K)});
  d["w2"] = owned(w, w->w2.data(), {E, static_cast<std::size_t>(p.K), static_cast<std::size_t>(p.I())});
  d["w1_scale"] = owned(w, w->w1_scale.data(), {E, w->w1_scale.size() / E});
  d["w2_scale"] = owned(w, w->w2_scale.data(), {E, w->w2_scale.size() / E});
  d["hidden"] = owned(t, t->hidden.data(), {static_cast<std::size_t>(tokens), static_cast<std::size_t>(p.K)});
  d["router_logits"] = owned(t, t->logits.data(), {static_cast<std::size_t>(tokens), static_cast<std::size_t>(p.E)});
  if (!bias->empty()) d["e_score_correction_bias"] = owned(bias, bias->data(), {bias->size()});
  return d;
}

}  // namespace
}  // namespace moekit::python

NB_MODULE(_moekit, m) {
  using namespace moekit::python;
  m.doc() = "moekit's C++ core; use the `moekit` package";
  nb::exception<moekit::Error>(m, "Error");
  m.def("plan_json", &plan_json_text, nb::arg("model"), nb::arg("dp"), nb::arg("ep"), nb::arg("max_tokens_per_rank"),
        nb::arg("local_experts"), nb::arg("device"), nb::arg("quant"), nb::arg("activation"), nb::arg("experts"),
        nb::arg("dispatch"));
  m.def("synthetic", &synthetic, nb::arg("model"), nb::arg("tokens"), nb::arg("max_tokens_per_rank"), nb::arg("quant"),
        nb::arg("seed"));
  m.def(
      "batched_experts",
      [](Array a1q, Array a1q_scale, Array counts, Array w1, Array w1_scale, Array w2, Array w2_scale, Array out,
         const std::string& activation, int num_threads) {
        experts_op().run(a1q, a1q_scale, counts, w1, w1_scale, w2, w2_scale, out, activation, num_threads);
      },
      nb::arg("a1q"), nb::arg("a1q_scale"), nb::arg("expert_num_tokens"), nb::arg("w1"), nb::arg("w1_scale"),
      nb::arg("w2"), nb::arg("w2_scale"), nb::arg("out"), nb::arg("activation"), nb::arg("num_threads"));
  nb::class_<Layer>(m, "Layer")
      .def(nb::init<const std::string&, std::int64_t, const std::string&, const std::string&,
                    std::optional<std::string>, Array, Array, Array, Array, std::optional<Array>, int>(),
           nb::arg("model"), nb::arg("max_tokens_per_rank"), nb::arg("quant"), nb::arg("experts"),
           nb::arg("activation").none(), nb::arg("w1"), nb::arg("w1_scale"), nb::arg("w2"), nb::arg("w2_scale"),
           nb::arg("e_score_correction_bias").none(), nb::arg("num_threads"))
      .def("forward", &Layer::forward, nb::arg("hidden"), nb::arg("router_logits"), nb::arg("out"))
      .def_prop_ro("workspace_bytes", &Layer::workspace_bytes)
      .def_prop_ro("K", &Layer::K)
      .def_prop_ro("E", &Layer::E)
      .def_prop_ro("problem", &Layer::problem);
}
