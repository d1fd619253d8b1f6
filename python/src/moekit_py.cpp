// moekit's Python module (nanobind): the plan, the layer and the experts ops over arrays DLPack hands
// over (NumPy, torch; CPU and CUDA), zero copy, every array validated where it enters,
// moekit::Error raised as moekit.Error. CUDA work is enqueued on the stream the caller names (the
// package passes torch's current stream). Expert parallelism from Python runs over a communicator
// object the package builds (torch.distributed, or any object with rank/size/all_gather). The
// Python package (python/moekit/__init__.py) wraps it in documented classes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <fmt/format.h>

#include <bit>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "cli/commands.h"
#include "cpu/combine.h"
#include "cpu/thread_pool.h"
#include "cuda/device_info.h"
#include "cuda/launch.h"
#include "cuda/launch_cache.h"
#include "moekit/check.h"
#include "moekit/checkpoint.h"
#include "moekit/communicator.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "moekit/recipe.h"
#include "moekit/registry.h"
#include "moekit/runtime.h"
#include "numerics/activation.h"
#include "numerics/scales.h"
#include "synthetic/synthetic.h"

namespace nb = nanobind;

namespace moekit::python {
namespace {

// An array of any dtype, shape, layout and device, as DLPack hands it over (NumPy, torch, ...), never
// converted or copied: require() checks it and raises moekit.Error naming what is wrong.
using Array = nb::ndarray<>;

// Where an array lives: the CPU or one CUDA device (DLPack's device type and id).
struct Place {
  std::int32_t type = nb::device::cpu::value;
  std::int32_t id = 0;
  bool operator==(const Place&) const = default;
  bool cuda() const { return type == nb::device::cuda::value; }
  Device device() const { return cuda() ? Device::kCuda : Device::kCpu; }
  std::string text() const {
    return type == nb::device::cpu::value    ? std::string("cpu")
           : type == nb::device::cuda::value ? fmt::format("cuda:{}", id)
                                             : fmt::format("DLPack device type {} (id {})", type, id);
  }
};

Place place_of(const Array& a) {
  const Place p{a.device_type(), a.device_id()};
  MOEKIT_CHECK(p.type == nb::device::cpu::value || p.cuda(),
               "an array on {}: moekit takes host (cpu) and CUDA device memory (cuda:N); move it there first",
               p.text());
  return p;
}

// The places the layer and the ops run on: "cpu" or "cuda" (the current CUDA device).
Place parse_place(const std::string& name) {
  if (name == "cpu") return {};
  MOEKIT_CHECK(name == "cuda", "device = '{}': moekit runs on 'cpu' or 'cuda' (the current CUDA device)", name);
#ifdef MOEKIT_HAVE_CUDA
  MOEKIT_CHECK(cuda::device_count() > 0, "device = 'cuda' but no CUDA device is present: use device='cpu'");
#else
  MOEKIT_FAIL("device = 'cuda' but this moekit was built without CUDA (no nvcc when it was built): use device='cpu'");
#endif
  return {nb::device::cuda::value, cuda::current_device()};
}

// Makes the arrays' GPU current for the calling scope (the ops follow their arrays, as torch does).
class DeviceScope {
 public:
  explicit DeviceScope(const Place& p) {
    if (!p.cuda()) return;
    const int current = cuda::current_device();
    if (current == p.id) return;
    cuda::set_device(p.id);
    previous_ = current;
  }
  ~DeviceScope() {
    if (previous_ < 0) return;
    try {
      cuda::set_device(previous_);
    } catch (...) {  // a sticky device error: the call that hit it has raised already
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

std::string dims_text(const std::vector<std::int64_t>& dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

std::string shape_text(const Array& a) {
  std::vector<std::int64_t> dims(a.ndim());
  for (std::size_t i = 0; i < dims.size(); ++i) dims[i] = static_cast<std::int64_t>(a.shape(i));
  return dims_text(dims);
}

std::vector<std::int64_t> dims_of(const Array& a) {
  std::vector<std::int64_t> dims(a.ndim());
  for (std::size_t i = 0; i < dims.size(); ++i) dims[i] = static_cast<std::int64_t>(a.shape(i));
  return dims;
}

// Whether a scale array of shape `have` holds the values of the canonical `want` in the same order:
// equal once trailing ones are dropped from both ((E, M, 1) per-token, (T, 1), (E, 1, 1)), or, with
// `per_expert` (weight scales, want (E, s)), the experts first and s values after them in any shape
// (weight_scale_inv's (E, N / 128, K / 128) blocks, (E, N, 1) channels, (E,) one per tensor).
bool scale_shape_fits(std::vector<std::int64_t> have, std::vector<std::int64_t> want, bool per_expert) {
  if (per_expert && !have.empty() && want.size() == 2 && have[0] == want[0]) {
    std::int64_t rest = 1;
    for (std::size_t i = 1; i < have.size(); ++i) rest *= have[i];
    if (rest == want[1]) return true;
  }
  while (!have.empty() && have.back() == 1) have.pop_back();
  while (!want.empty() && want.back() == 1) want.pop_back();
  return have == want;
}

std::string dtype_text(nb::dlpack::dtype d) {
  const char* kind = d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)    ? "float"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int)    ? "int"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)   ? "uint"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                                                                                           : "other";
  return fmt::format("{}{}", kind, d.bits);
}

// Raises moekit.Error unless `a` holds `bits`-bit elements of one of `codes` in exactly `shape`,
// C-contiguous, on `where`.
enum class ShapeRule { kExact, kScale, kExpertScale };

void require(const Array& a, const char* what, std::initializer_list<nb::dlpack::dtype_code> codes, int bits,
             const std::vector<std::int64_t>& shape, const char* expected_dtype, const Place& where,
             ShapeRule rule = ShapeRule::kExact) {
  bool code_ok = false;
  for (auto c : codes) code_ok = code_ok || a.dtype().code == static_cast<std::uint8_t>(c);
  MOEKIT_CHECK(code_ok && a.dtype().bits == bits && a.dtype().lanes == 1, "{}: dtype {} where {} is needed", what,
               dtype_text(a.dtype()), expected_dtype);
  const bool shape_ok = rule == ShapeRule::kExact
                            ? dims_of(a) == shape
                            : scale_shape_fits(dims_of(a), shape, rule == ShapeRule::kExpertScale);
  MOEKIT_CHECK(shape_ok, "{}: shape {} where {} is needed{}", what, shape_text(a), dims_text(shape),
               rule == ShapeRule::kExact   ? ""
               : rule == ShapeRule::kScale ? " (or the same with trailing ones)"
                                           : " (or the experts first and the same values after them, e.g. "
                                             "weight_scale_inv's (E, N / 128, K / 128))");
  const Place here = place_of(a);
  MOEKIT_CHECK(here == where, "{}: on {} where {} is needed (every array of a call on one device{})", what, here.text(),
               where.text(), where.cuda() ? ", the one the layer or the op's first array is on" : "");
  // An empty array (the bf16 recipe's scales, (E_local, 0)) has no element to lay out: any strides.
  std::int64_t expected = 1, elements = 1;
  for (std::size_t i = 0; i < a.ndim(); ++i) elements *= static_cast<std::int64_t>(a.shape(i));
  for (std::size_t i = a.ndim(); elements > 0 && i-- > 0;) {
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

// An array of 16-bit values of `dtype`: bfloat16 or float16 as the recipe says (or their uint16 bits:
// numpy has no bfloat16), `for_what` naming why in the error.
void require16(const Array& a, const char* what, DType dtype, const std::vector<std::int64_t>& shape,
               const Place& where, std::string_view for_what = "") {
  const bool fp16 = dtype == DType::kFp16;
  const std::string expected = fmt::format("{} (or its uint16 bits){}", fp16 ? "float16" : "bfloat16", for_what);
  require(a, what, {fp16 ? kFloat : kBfloat, kUInt, kInt}, 16, shape, expected.c_str(), where);
}

Stream stream_of(std::uintptr_t stream) {
  return reinterpret_cast<Stream>(stream);  // NOLINT: a cudaStream_t handed over as an integer
}

// The experts' weights of `p` (moekit/weights.h layouts), validated, as a view of the arrays.
ExpertWeightsView weights_of(const MoeProblem& p, const Array& w1, const Array& w1_scale, const Array& w2,
                             const Array& w2_scale, const Place& where) {
  // The recipe's weight dtype: FP8 codes (uint8), or bf16 / fp16 values (or their uint16 bits) with
  // empty (E_local, 0) scales.
  const DType wd = recipe_info(p.quant).weight_dtype;
  if (wd != DType::kFp8E4m3) {
    require16(w1, "w1", wd, {p.E_local, p.N, p.K}, where);
    require16(w2, "w2", wd, {p.E_local, p.K, p.I()}, where);
  } else {
    require(w1, "w1", {kUInt, kInt}, 8, {p.E_local, p.N, p.K}, "uint8 FP8 e4m3 codes", where);
    require(w2, "w2", {kUInt, kInt}, 8, {p.E_local, p.K, p.I()}, "uint8 FP8 e4m3 codes", where);
  }
  require(w1_scale, "w1_scale", {kFloat}, 32, {p.E_local, numerics::weight_scale_count(p.quant, p.N, p.K)}, "float32",
          where, ShapeRule::kExpertScale);
  require(w2_scale, "w2_scale", {kFloat}, 32, {p.E_local, numerics::weight_scale_count(p.quant, p.K, p.I())}, "float32",
          where, ShapeRule::kExpertScale);
  return ExpertWeightsView::of(p, where.device(), static_cast<const std::uint8_t*>(w1.data()),
                               static_cast<const float*>(w1_scale.data()), static_cast<const std::uint8_t*>(w2.data()),
                               static_cast<const float*>(w2_scale.data()));
}

// A preset or config.json, with its routed experts overridden when num_experts > 0 (as the CLI's
// --num-experts: shorter runs of the same shapes).
ModelConfig model_with(const std::string& name, std::int64_t num_experts) {
  MOEKIT_CHECK(num_experts >= 0, "num_experts = {} must be >= 0 (0: the model's)", num_experts);
  ModelConfig m = load_model(name);
  if (num_experts > 0) m.num_experts = num_experts;
  return m;
}

std::string plan_json_text(const std::string& model, std::int64_t dp, std::int64_t ep, std::int64_t max_tokens,
                           std::int64_t local_experts, const std::string& device, const std::string& quant,
                           const std::string& activation, const std::vector<std::string>& experts,
                           const std::string& dispatch, std::optional<bool> fuse_w1, const std::string& accumulation) {
  cli::PlanRequest req;
  req.fuse_w1 = fuse_w1;
  req.accumulation = accumulation;
  req.model = model;
  req.parallel = ParallelConfig{dp, ep, max_tokens, local_experts};
  req.device = device;
  req.quant = quant;
  req.activation = activation;
  req.experts = experts;
  req.dispatch = dispatch;
  return cli::plan_json(req, cli::make_plan_report(req)).dump();
}

// The ranks of a Python group (the package's moekit.TorchGroup over torch.distributed, or any object
// with rank(), size() and all_gather(bytes) -> list of every rank's bytes in rank order). Every
// collective is one all_gather: the layer uses them to set up (NCCL's unique id, agreeing that every
// rank is ready) and once per forward (the chunk count); a CPU layer also moves its tokens with them.
// Each message starts with the collective's sequence number and kind; ranks that disagree (one rank
// skipped a collective after raising) and payloads of the wrong size raise instead of pairing
// different calls.
class PyCommunicator final : public Communicator {
 public:
  explicit PyCommunicator(nb::object group) : group_(std::move(group)) {
    rank_ = nb::cast<int>(group_.attr("rank")());
    size_ = nb::cast<int>(group_.attr("size")());
    MOEKIT_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "the group says rank {} of {} ranks", rank_, size_);
  }
  ~PyCommunicator() override {
    nb::gil_scoped_acquire gil;
    group_.reset();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "python"; }

  void all_to_all_v(const void* send, std::span<const std::int64_t> send_bytes,
                    std::span<const std::int64_t> send_offsets, void* recv, std::span<const std::int64_t> recv_bytes,
                    std::span<const std::int64_t> recv_offsets) override {
    // Every rank's payloads to every rank: [bytes to rank 0 .. P-1] then the payloads in rank order.
    const auto P = static_cast<std::size_t>(size_);
    std::string mine(P * sizeof(std::int64_t), '\0');
    std::memcpy(mine.data(), send_bytes.data(), P * sizeof(std::int64_t));
    for (std::size_t r = 0; r < P; ++r)
      mine.append(static_cast<const char*>(send) + send_offsets[r], static_cast<std::size_t>(send_bytes[r]));
    const std::vector<std::string> all = all_gather(mine, Op::kAllToAll);
    for (std::size_t r = 0; r < P; ++r) {
      std::vector<std::int64_t> sizes(P);
      MOEKIT_CHECK(all[r].size() >= P * sizeof(std::int64_t), "all_to_all_v: rank {} sent {} bytes", r, all[r].size());
      std::memcpy(sizes.data(), all[r].data(), P * sizeof(std::int64_t));
      std::int64_t total = 0;
      for (std::int64_t v : sizes) total += v;
      MOEKIT_CHECK(total >= 0 && all[r].size() == P * sizeof(std::int64_t) + static_cast<std::size_t>(total),
                   "all_to_all_v: rank {} sent {} bytes for payloads of {}", r, all[r].size(), total);
      std::size_t at = P * sizeof(std::int64_t);
      for (std::size_t q = 0; q < static_cast<std::size_t>(rank_); ++q) at += static_cast<std::size_t>(sizes[q]);
      MOEKIT_CHECK(sizes[rank_] == recv_bytes[r], "rank {} sends {} bytes to rank {}, which expects {}", r,
                   sizes[rank_], rank_, recv_bytes[r]);
      std::memcpy(static_cast<char*>(recv) + recv_offsets[r], all[r].data() + at,
                  static_cast<std::size_t>(recv_bytes[r]));
    }
  }
  void all_to_all_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    MOEKIT_CHECK(send.size() == static_cast<std::size_t>(size_) && recv.size() == send.size(),
                 "all_to_all_counts: {} and {} values for {} ranks", send.size(), recv.size(), size_);
    const std::vector<std::string> all =
        all_gather(bytes_of(send.data(), send.size()), Op::kCounts, static_cast<std::int64_t>(send.size() * 8));
    for (std::size_t r = 0; r < all.size(); ++r)
      std::memcpy(&recv[r], all[r].data() + static_cast<std::size_t>(rank_) * sizeof(std::int64_t),
                  sizeof(std::int64_t));
  }
  std::int64_t all_reduce_max(std::int64_t value) override { return max_of(value); }
  double all_reduce_max(double value) override { return max_of(value); }
  void barrier() override { (void)all_gather({}, Op::kBarrier, 0); }
  void broadcast(void* data, std::int64_t bytes, int root) override {
    MOEKIT_CHECK(root >= 0 && root < size_ && bytes >= 0, "broadcast: root {} of {} ranks, {} bytes", root, size_,
                 bytes);
    const std::vector<std::string> all =
        all_gather(rank_ == root ? std::string(static_cast<const char*>(data), static_cast<std::size_t>(bytes)) : "",
                   Op::kBroadcast);
    MOEKIT_CHECK(static_cast<std::int64_t>(all[root].size()) == bytes, "broadcast: root {} sent {} bytes, {} expected",
                 root, all[root].size(), bytes);
    std::memcpy(data, all[root].data(), static_cast<std::size_t>(bytes));
  }

 private:
  template <typename T>
  static std::string bytes_of(const T* data, std::size_t count) {
    return std::string(reinterpret_cast<const char*>(data), count * sizeof(T));
  }
  template <typename T>
  T max_of(T value) {
    T best = value;
    for (const std::string& b : all_gather(bytes_of(&value, 1), Op::kMax, sizeof(T))) {
      T v;
      std::memcpy(&v, b.data(), sizeof(T));
      best = std::max(best, v);
    }
    return best;
  }
  enum class Op : std::uint32_t { kAllToAll = 1, kCounts, kMax, kBarrier, kBroadcast };
  struct Header {
    std::uint64_t sequence;
    std::uint32_t op, pad;
  };

  // Every rank's `mine`, in rank order, each checked to come from the same collective (and to hold
  // `expected` bytes when that is not -1).
  std::vector<std::string> all_gather(const std::string& mine, Op op, std::int64_t expected = -1) {
    const Header h{sequence_++, static_cast<std::uint32_t>(op), 0};
    std::string message(sizeof(Header), '\0');
    std::memcpy(message.data(), &h, sizeof(Header));
    message += mine;
    nb::gil_scoped_acquire gil;
    std::vector<std::string> out;
    try {
      nb::object got = group_.attr("all_gather")(nb::bytes(message.data(), message.size()));
      for (nb::handle item : got) {
        const auto b = nb::cast<nb::bytes>(item);
        out.emplace_back(b.c_str(), b.size());
      }
    } catch (const nb::python_error& e) {
      if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) throw;
      MOEKIT_FAIL("rank {}: the group's all_gather raised: {}: {}", rank_, nb::str(e.type().attr("__name__")).c_str(),
                  nb::str(e.value()).c_str());
    } catch (const nb::cast_error&) {
      MOEKIT_FAIL("rank {}: the group's all_gather must return a list of bytes, one per rank", rank_);
    }
    MOEKIT_CHECK(out.size() == static_cast<std::size_t>(size_),
                 "rank {}: the group's all_gather returned {} items for {} ranks", rank_, out.size(), size_);
    for (std::size_t r = 0; r < out.size(); ++r) {
      Header theirs{};
      MOEKIT_CHECK(out[r].size() >= sizeof(Header), "rank {}: rank {} sent {} bytes, not a moekit message", rank_, r,
                   out[r].size());
      std::memcpy(&theirs, out[r].data(), sizeof(Header));
      MOEKIT_CHECK(theirs.sequence == h.sequence && theirs.op == h.op,
                   "rank {}: rank {} is at collective {} (kind {}) where this rank is at {} (kind {}): a rank raised "
                   "or skipped a step; rebuild the layer on every rank",
                   rank_, r, theirs.sequence, theirs.op, h.sequence, h.op);
      out[r].erase(0, sizeof(Header));
      MOEKIT_CHECK(expected < 0 || static_cast<std::int64_t>(out[r].size()) == expected,
                   "rank {}: rank {} sent {} bytes where {} are needed", rank_, r, out[r].size(), expected);
    }
    return out;
  }

  nb::object group_;
  int rank_ = 0, size_ = 1;
  std::uint64_t sequence_ = 0;
};

// W1 of `w` (E_local experts of `p`) from the checkpoint's gate-then-up rows to the block pairs p's
// recipe reads (arrange_w1_block_pairs, expert by expert on the host), into buffers `owned` keeps on
// `memory`'s device; the view then reads them. Once, at construction: a GPU's W1 goes to the host and
// back.
ExpertWeightsView with_block_pairs(const MoeProblem& p, ExpertWeightsView w, Memory& memory,
                                   std::deque<DeviceBuffer>& owned) {
  const std::int64_t I = p.I(), N = p.N, K = p.K, s1 = w.w1_scale_stride();
  std::vector<std::uint8_t> halves(static_cast<std::size_t>(w.E_local * N * K)), pairs(halves.size());
  std::vector<float> halves_scale(static_cast<std::size_t>(w.E_local * s1)), pairs_scale(halves_scale.size());
  memory.to_host(halves.data(), w.w1, static_cast<std::int64_t>(halves.size()), nullptr);
  memory.to_host(halves_scale.data(), w.w1_scale, static_cast<std::int64_t>(4 * halves_scale.size()), nullptr);
  for (std::int64_t e = 0; e < w.E_local; ++e)
    arrange_w1_block_pairs(I, K, halves.data() + e * N * K, halves_scale.data() + e * s1, pairs.data() + e * N * K,
                           pairs_scale.data() + e * s1);
  owned.emplace_back(memory, static_cast<std::int64_t>(pairs.size()), "W1 in block pairs");
  memory.from_host(owned.back().get(), pairs.data(), static_cast<std::int64_t>(pairs.size()), nullptr);
  w.w1 = owned.back().as<std::uint8_t>();
  owned.emplace_back(memory, static_cast<std::int64_t>(4 * pairs_scale.size()), "W1 block scales in block pairs");
  memory.from_host(owned.back().get(), pairs_scale.data(), static_cast<std::int64_t>(4 * pairs_scale.size()), nullptr);
  w.w1_scale = owned.back().as<float>();
  return w;
}

// One rank's runtime for a model's MoE layers (MoeRuntime), over weight arrays the caller keeps
// alive (the wrapper holds references to them), on the CPU or the current CUDA device. Without a
// group: one rank holding every expert (dp = ep = 1). With one: dp = ep = the group's size, this
// rank's E / size experts, NCCL between GPUs (the default dispatch) or the group itself between CPU
// ranks. Layers are added one by one (add_layer); all share the one workspace.
class Runtime {
 public:
  Runtime(const std::string& model_name, std::int64_t num_experts, std::int64_t max_tokens, const std::string& quant,
          const std::string& experts, std::optional<std::string> activation, const std::string& device,
          const std::string& dispatch, bool shared_experts, int num_threads, std::optional<bool> fuse_w1,
          const std::string& accumulation, std::optional<nb::object> group, std::int64_t local_experts)
      : model_(model_with(model_name, num_experts)), place_(parse_place(device)) {
    MOEKIT_CHECK(max_tokens >= 1, "max_tokens_per_rank = {} must be >= 1", max_tokens);
    LayerOptions opt;
    opt.device = place_.device();
    opt.experts = experts;
    opt.prepare_finalize = dispatch;
    opt.quant = choose_quant(model_, quant).quant;
    if (activation) opt.activation = parse_activation(*activation);
    opt.fuse_w1 = fuse_w1;
    opt.accumulation = parse_accumulation(accumulation);
    opt.shared_experts = shared_experts;
    opt.num_threads = std::max(1, num_threads);
    shared_experts_ = shared_experts;
    if (group) {
      comm_ = std::make_unique<PyCommunicator>(*group);
    } else {
      group_ = std::make_unique<Group>();  // a group of one, held for the runtime's life
    }
    Communicator& comm = comm_ ? *comm_ : group_->comm();
    const ParallelConfig par{comm.size(), comm.size(), max_tokens, local_experts};
    const ExpertsEntry& entry = find_experts(experts, opt.device);
    problem_ = make_problem(model_, par, entry.format, opt.quant, opt.activation.value_or(model_.activation),
                            opt.fuse_w1, opt.accumulation);
    DeviceScope scope(place_);
    memory_ = make_memory(place_.device());
    nb::gil_scoped_release release;  // NCCL's set-up blocks; the group takes the GIL back for its collectives
    runtime_ = std::make_unique<MoeRuntime>(model_, par, opt, comm);
  }

  // One layer's weights (this rank's experts); returns its index. W1 arranged into the runtime's own
  // copy where the recipe reads block pairs and the caller's are in gate_up order (owns_w1 then).
  int add_layer(Array w1, Array w1_scale, Array w2, Array w2_scale, std::optional<Array> bias,
                std::optional<Array> w1_bias, std::optional<Array> w2_bias, std::optional<Array> shared_w1,
                std::optional<Array> shared_w1_scale, std::optional<Array> shared_w2,
                std::optional<Array> shared_w2_scale, std::optional<Array> shared_gate, const std::string& w1_layout,
                std::optional<std::vector<std::int32_t>> placement) {
    const MoeProblem& p = problem_;
    const std::size_t owned_before = owned_.size();
    ExpertWeightsView weights = weights_of(p, w1, w1_scale, w2, w2_scale, place_);
    const bool arrange = w1_needs_block_pairs(w1_layout, p.activation, p.quant);
    if (arrange) {
      DeviceScope scope(place_);
      weights = with_block_pairs(p, weights, *memory_, owned_);
    }
    const float* bias_ptr = nullptr;
    if (model_.has_score_correction_bias) {
      MOEKIT_CHECK(bias.has_value(), "model '{}' routes with e_score_correction_bias: pass {} float32 values",
                   model_.name, p.E);
      require(*bias, "e_score_correction_bias", {kFloat}, 32, {p.E}, "float32", place_);
      bias_ptr = static_cast<const float*>(bias->data());
    } else {
      MOEKIT_CHECK(!bias.has_value(),
                   "model '{}' ({}) routes without e_score_correction_bias, but the weights carry one: drop it",
                   model_.name, model_.model_type);
    }
    MOEKIT_CHECK(p.expert_bias || (!w1_bias && !w2_bias),
                 "model '{}' ({}) has no expert biases, but the weights carry w1_bias / w2_bias: drop them",
                 model_.name, model_.model_type);
    if (p.expert_bias) {
      MOEKIT_CHECK(w1_bias && w2_bias,
                   "model '{}' ({}) has expert biases: pass w1_bias (E_local, N) = ({}, {}) and w2_bias (E_local, K) = "
                   "({}, {}) float32 (transformers' gate_up_proj_bias and down_proj_bias, W1's rows in moekit's order)",
                   model_.name, model_.model_type, p.E_local, p.N, p.E_local, p.K);
      require(*w1_bias, "w1_bias", {kFloat}, 32, {p.E_local, p.N}, "float32", place_);
      require(*w2_bias, "w2_bias", {kFloat}, 32, {p.E_local, p.K}, "float32", place_);
      weights.w1_bias = static_cast<const float*>(w1_bias->data());
      weights.w2_bias = static_cast<const float*>(w2_bias->data());
    }
    LayerWeights lw{weights, bias_ptr};
    // The shared experts: every rank's full copy, one expert of shared_experts_problem.
    const bool any_shared = shared_w1 || shared_w1_scale || shared_w2 || shared_w2_scale || shared_gate;
    const auto sp = shared_experts_ ? shared_experts_problem(model_, p) : std::nullopt;
    if (!sp) {
      MOEKIT_CHECK(!any_shared, "model '{}' ({}) {}, but the weights carry shared_* keys: drop them", model_.name,
                   model_.model_type,
                   model_.shared_intermediate_size == 0 ? "has no shared experts" : "runs with shared_experts=False");
    } else {
      MOEKIT_CHECK(shared_w1 && shared_w1_scale && shared_w2 && shared_w2_scale,
                   "model '{}' ({}) has shared experts (shared_intermediate_size = {}): pass shared_w1 (1, {}, {}), "
                   "shared_w1_scale, shared_w2 (1, {}, {}) and shared_w2_scale in the layouts of w1 .. w2_scale, or "
                   "shared_experts=False to run the routed experts only",
                   model_.name, model_.model_type, model_.shared_intermediate_size, sp->N, sp->K, sp->K, sp->I());
      try {
        lw.shared_experts = weights_of(*sp, *shared_w1, *shared_w1_scale, *shared_w2, *shared_w2_scale, place_);
      } catch (const Error& e) {
        MOEKIT_FAIL("the shared experts' weights (shared_w1 .. shared_w2_scale): {}", e.what());
      }
      if (arrange) {
        DeviceScope scope(place_);
        lw.shared_experts = with_block_pairs(*sp, lw.shared_experts, *memory_, owned_);
      }
      MOEKIT_CHECK(shared_gate.has_value() == model_.shared_expert_gate, "model '{}' ({}) {}: {} shared_expert_gate",
                   model_.name, model_.model_type,
                   model_.shared_expert_gate ? "gates its shared experts" : "has no shared expert gate",
                   model_.shared_expert_gate ? fmt::format("pass ({},) bfloat16 as", p.K) : "drop");
      if (shared_gate) {
        require(*shared_gate, "shared_expert_gate", {kBfloat, kUInt}, 16, {p.K}, "bfloat16 (or its uint16 bits)",
                place_);
        lw.shared_expert_gate = static_cast<const std::uint16_t*>(shared_gate->data());
      }
    }
    std::optional<ExpertPlacement> given;  // validated and derived by the runtime, which copies it
    if (placement) given = ExpertPlacement{p.E, *placement, {}, {}};
    lw.placement = given ? &*given : nullptr;
    std::lock_guard lock(mu_);
    try {
      const int index = runtime_->add_layer(lw);
      owns_w1_.push_back(owned_.size() > owned_before);
      return index;
    } catch (...) {
      owned_.resize(owned_before);  // nothing of a refused layer stays
      throw;
    }
  }

  ~Runtime() {
    DeviceScope scope(place_);
    nb::gil_scoped_release release;  // a multi-rank teardown may wait for the group
    runtime_.reset();
  }

  // hidden (T, K) bfloat16 (or its uint16 bits), router_logits (T, E) float32 -> out (T, K), same
  // dtype, on the layer's device. Synchronizes `stream` (the status of every chunk is checked).
  void forward(int layer, Array hidden, Array logits, Array out, std::uintptr_t stream) {
    const std::int64_t T = check_step(hidden, logits, out);
    DeviceScope scope(place_);
    nb::gil_scoped_release release;
    std::lock_guard lock(mu_);  // one step at a time on the runtime's workspace
    runtime_->forward(layer, static_cast<const std::uint16_t*>(hidden.data()), static_cast<const float*>(logits.data()),
                      T, static_cast<std::uint16_t*>(out.data()), stream_of(stream));
  }

  // One step of at most max_tokens_per_rank tokens enqueued on `stream` with no host synchronization
  // (capturable in a CUDA graph); check_status() raises for what its kernels flagged.
  // max_tokens_any_rank: MoeLayer::enqueue's (0: not known).
  void enqueue(int layer, Array hidden, Array logits, Array out, std::uintptr_t stream,
               std::int64_t max_tokens_any_rank) {
    const std::int64_t T = check_step(hidden, logits, out);
    DeviceScope scope(place_);
    nb::gil_scoped_release release;
    std::lock_guard lock(mu_);
    runtime_->enqueue(layer, static_cast<const std::uint16_t*>(hidden.data()), static_cast<const float*>(logits.data()),
                      T, static_cast<std::uint16_t*>(out.data()), stream_of(stream), {}, max_tokens_any_rank);
  }

  void check_status(std::uintptr_t stream) {
    DeviceScope scope(place_);
    nb::gil_scoped_release release;
    std::lock_guard lock(mu_);
    runtime_->check_status(stream_of(stream));
  }

  // Redundant experts: the layer's slot -> expert map (None without a placement), and this rank's
  // per-slot pair counts since the last read (cleared).
  std::optional<std::vector<std::int32_t>> placement(int layer) const {
    const ExpertPlacement* pl = runtime_->placement(layer);
    if (pl == nullptr) return std::nullopt;
    return pl->physical_to_logical;
  }
  std::vector<std::int64_t> expert_load(int layer, std::uintptr_t stream) {
    DeviceScope scope(place_);
    nb::gil_scoped_release release;
    std::lock_guard lock(mu_);
    return runtime_->expert_load(layer, stream_of(stream));
  }

  std::int64_t workspace_bytes() const { return runtime_->allocated_workspace_bytes(); }
  int num_layers() const { return runtime_->num_layers(); }
  std::int64_t K() const { return problem_.K; }
  std::int64_t E() const { return problem_.E; }
  std::int64_t E_local() const { return problem_.E_local; }
  int rank() const { return comm_ ? comm_->rank() : 0; }
  int ranks() const { return comm_ ? comm_->size() : 1; }
  std::string device() const { return place_.text(); }
  std::string problem() const { return problem_.describe(); }
  std::string dispatch() const { return runtime_->plan().section("prepare-finalize").owner; }
  // Layer `layer`'s W1 (and its shared experts') were arranged into the runtime's own copy: the
  // caller's may go.
  bool owns_w1(int layer) const {
    MOEKIT_CHECK(layer >= 0 && static_cast<std::size_t>(layer) < owns_w1_.size(), "no layer {}", layer);
    return owns_w1_[static_cast<std::size_t>(layer)];
  }

 private:
  std::int64_t check_step(const Array& hidden, const Array& logits, const Array& out) const {
    const MoeProblem& p = problem_;
    MOEKIT_CHECK(hidden.ndim() == 2, "hidden: shape {} where (tokens, K = {}) is needed", shape_text(hidden), p.K);
    const auto T = static_cast<std::int64_t>(hidden.shape(0));
    require(hidden, "hidden", {kBfloat, kUInt, kInt}, 16, {T, p.K}, "bfloat16 (or its uint16 bits)", place_);
    require(logits, "router_logits", {kFloat}, 32, {T, p.E}, "float32", place_);
    require(out, "out", {kBfloat, kUInt, kInt}, 16, {T, p.K}, "bfloat16 (or its uint16 bits)", place_);
    return T;
  }

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
  Place place_;
  MoeProblem problem_;
  bool shared_experts_ = true;
  std::unique_ptr<Memory> memory_;  // the arranged W1's device (with w1_layout = gate_up under block128)
  std::deque<DeviceBuffer> owned_;  // the arranged W1 and scales of every layer, routed then shared
  std::vector<bool> owns_w1_;       // per layer
  std::unique_ptr<Group> group_;    // destroyed after runtime_ (declared before it)
  std::unique_ptr<PyCommunicator> comm_;
  std::mutex mu_;
  std::unique_ptr<MoeRuntime> runtime_;
};

// The scheme of an experts call: `quant` when named, else the one scheme whose scale shapes the
// arrays have (activation scales over `rows`, W1 scales (E_local, s1)).
QuantScheme scheme_of(const std::string& quant, const Array& a1q_scale, const Array& w1_scale,
                      const std::vector<std::int64_t>& rows, std::int64_t N, std::int64_t K, bool batched) {
  if (!quant.empty()) return parse_quant(quant);
  const std::vector<std::int64_t> have = dims_of(a1q_scale), have_w1 = dims_of(w1_scale);
  std::vector<QuantScheme> fits;
  std::string shapes;
  for (QuantScheme q : all_quant_schemes()) {
    if (!has_activation_scales(recipe_info(q))) continue;  // an unquantized recipe is named (quant='bf16', 'fp16')
    const std::vector<std::int64_t> want = numerics::activation_scale_shape(q, rows, K, batched);
    const std::int64_t experts = have_w1.empty() ? 0 : have_w1[0];
    if (scale_shape_fits(have, want, false) &&
        scale_shape_fits(have_w1, {experts, numerics::weight_scale_count(q, N, K)}, true))
      fits.push_back(q);
    shapes += fmt::format("{}{}: a1q_scale {}, w1_scale (E_local, {})", shapes.empty() ? "" : "; ", quant_name(q),
                          dims_text(want), numerics::weight_scale_count(q, N, K));
  }
  MOEKIT_CHECK(fits.size() == 1,
               "experts op: a1q_scale {} and w1_scale {} fit {}: pass quant= ({}; bf16 or fp16 operands without "
               "scales: quant='bf16' or quant='fp16')",
               shape_text(a1q_scale), shape_text(w1_scale), fits.empty() ? "no scheme" : "more than one scheme",
               shapes);
  return fits.front();
}

// The ops' problems: from the arrays' shapes (the ops) or the caller's numbers (the workspace
// queries), one construction for both.
struct OpOptions {
  std::string activation;
  std::optional<bool> fuse_w1;
  SwigluOaiParams swiglu;  // swigluoai's clamp and alpha (the ops' swiglu_limit, swiglu_alpha)
  std::string accumulation = "precise";
};

MoeProblem finish_op_problem(MoeProblem p, QuantScheme quant, const OpOptions& o) {
  p.num_dispatchers = 1;
  p.activation = parse_activation(o.activation);
  p.swiglu = o.swiglu;
  p.accumulation = parse_accumulation(o.accumulation);
  p.quant = quant;
  p.fuse_w1 = o.fuse_w1.value_or(fuse_w1_runs(p.quant, p.activation));
  validate_problem(p);
  return p;
}

MoeProblem batched_op_problem(std::int64_t E_local, std::int64_t M, std::int64_t K, std::int64_t N, QuantScheme quant,
                              const OpOptions& o) {
  MoeProblem p;
  p.format = ActivationFormat::kBatchedExperts;
  p.E_local = p.E = E_local;
  p.M = p.max_tokens_per_rank = M;
  p.K = K;
  p.N = N;
  p.topk = 1;
  return finish_op_problem(p, quant, o);
}

// The standard op's workspace holds the next power of two of T rows (a few workspaces serve every
// batch size); its ids are local, so topk may exceed E_local (the other slots are -1).
MoeProblem standard_op_problem(std::int64_t T, std::int64_t K, std::int64_t N, std::int64_t topk, std::int64_t E_local,
                               QuantScheme quant, const OpOptions& o) {
  MOEKIT_CHECK(T >= 0, "standard_experts: T = {} tokens must be >= 0", T);
  MoeProblem p;
  p.format = ActivationFormat::kStandard;
  p.E_local = E_local;
  p.M = p.max_tokens_per_rank =
      static_cast<std::int64_t>(std::bit_ceil(static_cast<std::uint64_t>(std::max<std::int64_t>(T, 1))));
  p.K = K;
  p.N = N;
  p.topk = topk;
  p.E = std::max(p.E_local, p.topk);
  return finish_op_problem(p, quant, o);
}

// The experts section an op's workspace holds (its whole plan).
WorkspacePlan op_plan(const char* name, const MoeProblem& p, Experts& experts, Device device) {
  const std::string why = experts.unsupported(p);
  MOEKIT_CHECK(why.empty(), "{}: {}", name, why);
  WorkspaceBuilder b(fmt::format("{} op", name), p);
  b.begin_section("experts", fmt::format("{} ({})", name, device_name(device)));
  experts.declare(p, b);
  return b.finish();
}

// The experts' input rows in the recipe's activation dtype: FP8 codes (uint8), or bf16 / fp16 values
// (or their uint16 bits: numpy has no bfloat16) for the unquantized recipes.
void require_a1q(const Array& a1q, const MoeProblem& p, const std::vector<std::int64_t>& shape, const Place& where) {
  const RecipeInfo recipe = recipe_info(p.quant);
  if (recipe.activation_dtype != DType::kFp8E4m3)
    require16(a1q, "a1q", recipe.activation_dtype, shape, where, fmt::format(" for quant='{}'", recipe.name));
  else
    require(a1q, "a1q", {kUInt, kInt}, 8, shape, "uint8 FP8 e4m3 codes", where);
}

// The ops never copy weights: a W1 whose rows the recipe reads in another order is refused, naming
// the one-time arrangement (w1_needs_block_pairs: block128's gated activations read block pairs).
void require_w1_layout(const std::string& w1_layout, const MoeProblem& p) {
  MOEKIT_CHECK(!w1_needs_block_pairs(w1_layout, p.activation, p.quant),
               "experts op: w1_layout = 'gate_up' (the checkpoint's gate rows then up rows), but {} with {} reads W1 "
               "in block pairs and the ops never copy weights: arrange it once at load, w1, w1_scale = "
               "moekit.arrange_w1_block_pairs(w1, w1_scale), and pass w1_layout='block_pairs'",
               quant_name(p.quant), activation_name(p.activation));
}

// The experts alone, in the BatchedExperts or the standard convention, on the arrays' device: shapes
// read off the arrays, one workspace per problem and device kept for the next call (built on the
// first call; a first call inside CUDA graph capture is refused: warm up first). CUDA calls enqueue
// on the caller's stream and never synchronize; a call on another stream than the workspace's last
// eager call waits for it (an event), so calls sharing a workspace never overlap (captured graphs:
// the caller orders their replays). Each workspace keeps the first flags its calls raised until
// check_status() reads them (the experts' status words persist across steps; cuda/launch.h). The
// CPU raises at once.
class ExpertsOp {
 public:
  void batched(Array a1q, Array a1q_scale, Array counts, Array w1, Array w1_scale, Array w2, Array w2_scale, Array out,
               const std::string& activation_name, const std::string& quant, std::optional<bool> fuse_w1,
               int num_threads, std::uintptr_t stream, std::int64_t max_rows, SwigluOaiParams swiglu,
               const std::string& accumulation, const std::string& w1_layout, std::optional<Array> workspace) {
    MOEKIT_CHECK(a1q.ndim() == 3 && w1.ndim() == 3 && w2.ndim() == 3,
                 "batched_experts: a1q (E_local, M, K), w1 (E_local, N, K) and w2 (E_local, K, I) are 3-D; got {}, {} "
                 "and {}",
                 shape_text(a1q), shape_text(w1), shape_text(w2));
    const auto E_local = static_cast<std::int64_t>(a1q.shape(0)), M = static_cast<std::int64_t>(a1q.shape(1)),
               K = static_cast<std::int64_t>(a1q.shape(2)), N = static_cast<std::int64_t>(w1.shape(1));
    const MoeProblem p =
        batched_op_problem(E_local, M, K, N, scheme_of(quant, a1q_scale, w1_scale, {E_local, M}, N, K, true),
                           {activation_name, fuse_w1, swiglu, accumulation});
    require_w1_layout(w1_layout, p);
    const Place where = place_of(a1q);
    require_a1q(a1q, p, {p.E_local, p.M, p.K}, where);
    require(a1q_scale, "a1q_scale", {kFloat}, 32,
            numerics::activation_scale_shape(p.quant, {p.E_local, p.M}, p.K, true), "float32", where,
            ShapeRule::kScale);
    require(counts, "expert_num_tokens", {kInt}, 32, {p.E_local}, "int32", where);
    const ExpertWeightsView w = weights_of(p, w1, w1_scale, w2, w2_scale, where);
    // W2 writes `out`'s valid rows: the recipe's output dtype (bf16; fp16 for quant='fp16').
    require16(out, "out", recipe_info(p.quant).output_dtype, {p.E_local, p.M, p.K}, where,
              fmt::format(" for quant='{}'", quant_name(p.quant)));
    MOEKIT_CHECK(max_rows >= 0 && max_rows <= p.M,
                 "batched_experts: max_rows = {} (the most rows any expert holds in this call) must be 0 (not known: "
                 "M) or within [1, M = {}]",
                 max_rows, p.M);
    // One dispatcher: the rows it fed bound every expert's (plan::step_tokens_per_rank).
    const ExpertsInput in{static_cast<const std::uint8_t*>(a1q.data()),
                          static_cast<const float*>(a1q_scale.data()),
                          static_cast<const std::int32_t*>(counts.data()),
                          nullptr,
                          max_rows > 0 ? max_rows : p.M,
                          static_cast<std::uint16_t*>(out.data())};
    DeviceScope scope(where);
    if (workspace) {
      with_caller_workspace(
          "batched-fp8", p, where, num_threads, stream, *workspace,
          [&](Experts& e, Workspace& ws, cpu::ThreadPool&) { e.run(p, in, w, ws, stream_of(stream)); });
      return;
    }
    const std::shared_ptr<Runner> r = runner("batched-fp8", p, where, num_threads, stream);
    nb::gil_scoped_release release;
    std::lock_guard lock(r->mu);
    const bool capturing = begin(*r, stream);
    r->experts->run(p, in, w, *r->workspace, stream_of(stream));
    if (where.cuda())
      end(*r, stream, capturing);
    else
      r->experts->check_status(*r->workspace, nullptr);  // the CPU raises at once
  }

  void standard(Array a1q, Array a1q_scale, Array topk_ids, Array topk_weights, Array w1, Array w1_scale, Array w2,
                Array w2_scale, Array out, const std::string& activation_name, const std::string& quant,
                std::optional<bool> fuse_w1, int num_threads, std::uintptr_t stream, SwigluOaiParams swiglu,
                const std::string& accumulation, const std::string& w1_layout, std::optional<Array> workspace) {
    MOEKIT_CHECK(a1q.ndim() == 2 && topk_ids.ndim() == 2 && w1.ndim() == 3 && w2.ndim() == 3,
                 "standard_experts: a1q (T, K), topk_ids (T, topk), w1 (E_local, N, K) and w2 (E_local, K, I); got {}, "
                 "{}, {} and {}",
                 shape_text(a1q), shape_text(topk_ids), shape_text(w1), shape_text(w2));
    const auto T = static_cast<std::int64_t>(a1q.shape(0)), K = static_cast<std::int64_t>(a1q.shape(1)),
               N = static_cast<std::int64_t>(w1.shape(1));
    const MoeProblem p = standard_op_problem(
        T, K, N, static_cast<std::int64_t>(topk_ids.shape(1)), static_cast<std::int64_t>(w1.shape(0)),
        scheme_of(quant, a1q_scale, w1_scale, {T}, N, K, false), {activation_name, fuse_w1, swiglu, accumulation});
    require_w1_layout(w1_layout, p);
    const Place where = place_of(a1q);
    require_a1q(a1q, p, {T, p.K}, where);
    require(a1q_scale, "a1q_scale", {kFloat}, 32, numerics::activation_scale_shape(p.quant, {T}, p.K, false), "float32",
            where, ShapeRule::kScale);
    require(topk_ids, "topk_ids", {kInt}, 32, {T, p.topk}, "int32 local expert ids (-1: none)", where);
    require(topk_weights, "topk_weights", {kFloat}, 32, {T, p.topk}, "float32", where);
    const ExpertWeightsView w = weights_of(p, w1, w1_scale, w2, w2_scale, where);
    // The combine rounds its fp32 sums once to `out`'s dtype: bfloat16 or float16 (uint16 bits: the
    // recipe's output dtype).
    const DType out_dtype = out.dtype().code == static_cast<std::uint8_t>(kFloat) ? DType::kFp16
                            : out.dtype().code == static_cast<std::uint8_t>(kBfloat)
                                ? DType::kBf16
                                : recipe_info(p.quant).output_dtype;
    require(out, "out", {kBfloat, kFloat, kUInt, kInt}, 16, {T, p.K}, "bfloat16 or float16 (or uint16 bits)", where);
    if (T == 0) return;
    const ExpertsInput in{static_cast<const std::uint8_t*>(a1q.data()),
                          static_cast<const float*>(a1q_scale.data()),
                          nullptr,
                          static_cast<const std::int32_t*>(topk_ids.data()),
                          T,
                          nullptr};
    DeviceScope scope(where);
    const auto* weights = static_cast<const float*>(topk_weights.data());
    auto* output = static_cast<std::uint16_t*>(out.data());
    // The experts, then the top-k weighted sum of their rows (the CPU raises bad ids first).
    auto run_and_combine = [&](Experts& e, Workspace& ws, cpu::ThreadPool& pool) {
      const ExpertsOutput y = e.run(p, in, w, ws, stream_of(stream));
      if (where.cuda()) {
        cuda::launch_combine(y.row_of, weights, T, static_cast<int>(p.topk), p.K, y.rows, output, stream_of(stream),
                             false, recipe_info(p.quant).output_dtype, out_dtype);
      } else {
        e.check_status(ws, nullptr);
        cpu::combine_topk(T, p.topk, p.K, weights, y.rows, y.row_of, output, pool, false,
                          recipe_info(p.quant).output_dtype, out_dtype);
      }
    };
    if (workspace) {
      with_caller_workspace("standard-fp8", p, where, num_threads, stream, *workspace, run_and_combine);
      return;
    }
    const std::shared_ptr<Runner> r = runner("standard-fp8", p, where, num_threads, stream);
    nb::gil_scoped_release release;
    std::lock_guard lock(r->mu);
    const bool capturing = begin(*r, stream);
    run_and_combine(*r->experts, *r->workspace, *r->pool);
    if (where.cuda()) end(*r, stream, capturing);
  }

  // Raises for the flags the last call on the caller's workspace `buffer` raised (on a GPU; the CPU
  // raised at once); synchronizes `stream`, or (0) that call's stream.
  void check_status(std::uintptr_t stream, const Array& buffer) {
    const auto* base = static_cast<const std::byte*>(buffer.data());
    std::shared_ptr<Bound> last;
    {
      std::lock_guard lock(mu_);
      for (auto& [key, b] : bound_)
        if (b->last_base == base && (!last || b->last_use > last->last_use)) last = b;
    }
    if (!last || !last->place.cuda()) return;
    nb::gil_scoped_release release;
    DeviceScope scope(last->place);
    std::lock_guard lock(last->mu);
    const auto ws = Workspace::over(last->plan, *last->memory, const_cast<std::byte*>(base), last->plan.total_bytes,
                                    false, nullptr);
    last->experts->check_status(*ws, stream_of(stream != 0 ? stream : last->last_stream));
  }

  // Raises for the first flags each CUDA workspace kept since the last check, and clears them;
  // synchronizes `stream`, or (0) each workspace's last stream.
  void check_status(std::uintptr_t stream) {
    std::vector<std::shared_ptr<Runner>> all;
    {
      std::lock_guard lock(mu_);
      for (auto& [key, r] : runners_) all.push_back(r);
    }
    nb::gil_scoped_release release;
    for (const auto& r : all) {
      if (!r->place.cuda() || !r->used) continue;
      DeviceScope scope(r->place);
      std::lock_guard lock(r->mu);
      const Stream s = stream_of(stream != 0 ? stream : r->last_stream);
      try {
        r->experts->check_status(*r->workspace, s);  // reads the flags and clears what it raises
      } catch (const Error& e) {
        std::string_view m = e.what();
        if (m.starts_with("moekit: ")) m.remove_prefix(8);
        throw Error(fmt::format("moekit: {} op on {}: {}", r->experts->name(), r->place.text(), m), e.where());
      }
    }
  }

  std::int64_t workspace_bytes() {
    std::lock_guard lock(mu_);
    return total_bytes();
  }

  // The bound on the cached workspaces (bytes): a new workspace that would take the total past it
  // first frees the least recently used ones that no CUDA graph captured.
  std::int64_t cap() {
    std::lock_guard lock(mu_);
    return cap_;
  }
  void set_cap(std::int64_t bytes) {
    MOEKIT_CHECK(bytes >= 0, "set_workspace_cap({}): a byte count >= 0", bytes);
    std::lock_guard lock(mu_);
    cap_ = bytes;
  }

  // Frees the cached workspaces (those a CUDA graph captured only with `captured`: the caller says
  // those graphs are gone), after their last calls finish; raises the first flags they kept.
  // Returns the bytes freed.
  std::int64_t release(bool captured) {
    std::lock_guard lock(mu_);
    std::int64_t freed = 0;
    std::optional<Error> first;
    for (auto it = runners_.begin(); it != runners_.end();) {
      Runner& r = *it->second;
      if ((r.captured && !captured) || it->second.use_count() > 1) {
        ++it;
        continue;
      }
      freed += r.workspace->plan().total_bytes;
      retire(r, first);
      it = runners_.erase(it);
    }
    if (first) throw *first;
    return freed;
  }

  // The bytes one op's workspace takes for a problem (what its first call allocates).
  static std::int64_t plan_bytes(const char* name, const MoeProblem& p, Device device) {
    const auto experts = find_experts(name, device).make({nullptr, nullptr});
    return op_plan(name, p, *experts, device).total_bytes;
  }

 private:
  // A problem's experts on a device: its implementation, plan and memory, and its last call.
  struct Core {
    Place place;
    std::mutex mu;
    std::unique_ptr<cpu::ThreadPool> pool;
    std::unique_ptr<Experts> experts;
    std::unique_ptr<Memory> memory;
    WorkspacePlan plan;
    std::uintptr_t last_stream = 0;  // CUDA: the stream of its last eager call
    std::uint64_t last_use = 0;      // the op clock at its last call (least recently used goes first)
    void make(const char* name, const MoeProblem& p, const Place& where, int threads) {
      place = where;
      pool = std::make_unique<cpu::ThreadPool>(threads);
      experts = find_experts(name, where.device()).make({pool.get(), nullptr});
      plan = op_plan(name, p, *experts, where.device());
      memory = make_memory(where.device());
    }
  };

  // With the workspace the ops cache.
  struct Runner : Core {
    ~Runner() {
      if (event != nullptr) cuda::destroy_event(event);
    }
    std::unique_ptr<Workspace> workspace;
    void* event = nullptr;  // CUDA: after the last eager call
    bool used = false;
    bool captured = false;  // a CUDA graph captured a call on it: never freed but by release(true)
  };

  // For calls that bring their own workspace (nothing cached but the plan: the memory is the caller's).
  struct Bound : Core {
    const std::byte* last_base = nullptr;  // the buffer of its last call
  };

  // The cache key of a problem's experts on a device; `threads` becomes the count they run with.
  static std::string key_of(const char* name, const MoeProblem& p, const Place& where, int& threads) {
    threads = where.cuda() ? 1 : std::max(1, threads);
    return fmt::format("{}/{}/{}/{}", name, where.text(), p.describe(), threads);
  }

  // Runs `f(experts, workspace, pool)` over the caller's buffer (1-D uint8 on the arrays' device, at
  // least the plan's bytes, aligned): its status words start at zero for this call.
  template <class F>
  void with_caller_workspace(const char* name, const MoeProblem& p, const Place& where, int threads,
                             std::uintptr_t stream, const Array& buffer, F&& f) {
    MOEKIT_CHECK(buffer.ndim() == 1, "workspace: shape {} where a 1-D uint8 buffer is needed", shape_text(buffer));
    require(buffer, "workspace", {kUInt, kInt}, 8, {static_cast<std::int64_t>(buffer.shape(0))}, "uint8", where);
    const std::string key = key_of(name, p, where, threads);
    std::shared_ptr<Bound> b;
    {
      std::lock_guard lock(mu_);
      auto& slot = bound_[key];
      if (!slot) {
        auto made = std::make_shared<Bound>();
        made->make(name, p, where, threads);
        slot = std::move(made);
      }
      b = slot;
      b->last_use = ++clock_;
    }
    auto* base = static_cast<std::byte*>(buffer.data());
    nb::gil_scoped_release release;
    std::lock_guard lock(b->mu);
    const auto ws =
        Workspace::over(b->plan, *b->memory, base, static_cast<std::int64_t>(buffer.nbytes()), true, stream_of(stream));
    f(*b->experts, *ws, *b->pool);
    if (!where.cuda()) b->experts->check_status(*ws, nullptr);  // the CPU raises at once
    b->last_base = base;
    b->last_stream = stream;
  }

  std::int64_t total_bytes() const {
    std::int64_t total = 0;
    for (const auto& [key, r] : runners_) total += r->workspace->plan().total_bytes;
    return total;
  }

  // Before a workspace is freed: its last call finished, its flags read (the first error kept).
  static void retire(Runner& r, std::optional<Error>& first) {
    if (!r.place.cuda() || !r.used) return;
    DeviceScope scope(r.place);
    cuda::synchronize_event(r.event);
    try {
      r.experts->check_status(*r.workspace, stream_of(r.last_stream));
    } catch (const Error& e) {
      if (!first) first = e;
    }
  }

  // Frees least recently used workspaces until `need` more bytes fit under the cap. One workspace
  // larger than the cap may stand alone; workspaces a graph captured, or a call is using, stay.
  void make_room(std::int64_t need, const std::string& what) {
    std::optional<Error> first;
    while (total_bytes() + need > cap_ && !runners_.empty()) {
      auto lru = runners_.end();
      for (auto it = runners_.begin(); it != runners_.end(); ++it)
        if (!it->second->captured && it->second.use_count() == 1 &&
            (lru == runners_.end() || it->second->last_use < lru->second->last_use))
          lru = it;
      MOEKIT_CHECK(lru != runners_.end(),
                   "{}: a new workspace of {} bytes would take the ops' cached workspaces to {} bytes, past the cap of "
                   "{} (moekit.ops.set_workspace_cap), and every cached one is in use or captured by a CUDA graph: "
                   "call moekit.ops.release_workspaces(captured=True) once those graphs are gone, or raise the cap",
                   what, need, total_bytes() + need, cap_);
      retire(*lru->second, first);
      runners_.erase(lru);
    }
    if (first) throw *first;
  }

  // Before a CUDA call: wait for the workspace's last eager call when it ran on another stream.
  // Returns whether `stream` is being captured.
  static bool begin(Runner& r, std::uintptr_t stream) {
    if (!r.place.cuda()) return false;
    const bool capturing = cuda::stream_capturing(stream_of(stream));
    r.captured = r.captured || capturing;
    if (!capturing && r.used && r.last_stream != stream) cuda::stream_wait_event(stream_of(stream), r.event);
    return capturing;
  }

  // After a CUDA call: mark its end for the next stream (its flags stay in the workspace).
  static void end(Runner& r, std::uintptr_t stream, bool capturing) {
    if (capturing) return;
    cuda::record_event(r.event, stream_of(stream));
    r.last_stream = stream;
    r.used = true;
  }

  // One workspace per (implementation, device, problem), kept until the cap needs its bytes (least
  // recently used first) or release() frees it; one a CUDA graph captured may be replayed into at
  // any time, so only release(captured = true) frees it.
  std::shared_ptr<Runner> runner(const char* name, const MoeProblem& p, const Place& where, int threads,
                                 std::uintptr_t stream) {
    const std::string key = key_of(name, p, where, threads);
    std::lock_guard lock(mu_);
    auto it = runners_.find(key);
    if (it != runners_.end()) {
      it->second->last_use = ++clock_;
      return it->second;
    }
    MOEKIT_CHECK(!(where.cuda() && cuda::stream_capturing(stream_of(stream))),
                 "{} on {}: the first call with these shapes ({}) is inside CUDA graph capture, where its workspace "
                 "cannot be allocated: call it once before capturing (a warm-up), then capture",
                 name, where.text(), p.describe());
    auto r = std::make_shared<Runner>();
    r->make(name, p, where, threads);
    make_room(r->plan.total_bytes, fmt::format("{} on {} ({})", name, where.text(), p.describe()));
    r->workspace = std::make_unique<Workspace>(r->plan, *r->memory);
    if (where.cuda()) r->event = cuda::create_event();
    r->last_use = ++clock_;
    runners_.emplace(key, r);
    return r;
  }

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Runner>> runners_;
  std::map<std::string, std::shared_ptr<Bound>> bound_;
  std::int64_t cap_ = kDefaultCap;
  std::uint64_t clock_ = 0;

 public:
  // 4 GiB: DeepSeek-V3's batched experts at M = 8192 rows an expert fit alone (one workspace past
  // the cap stands alone, the others freed).
  static constexpr std::int64_t kDefaultCap = std::int64_t{4} << 30;
};

ExpertsOp& experts_op() {
  static ExpertsOp* op = new ExpertsOp;  // never destroyed: CUDA memory outlives interpreter teardown order
  return *op;
}

// Seeded synthetic weights and tokens, as `moekit run --seed` draws them (one rank, every expert).
// Rank `rank` of `ranks` (dp = ep = ranks) gets its E / ranks experts and the global tokens
// [rank * tokens, (rank + 1) * tokens), as `moekit run --dp ranks` draws them.
// An array owning its data through a capsule that holds `holder` (a shared_ptr of the storage).
template <class Holder, class T>
nb::ndarray<nb::numpy, T> owned_array(const Holder& holder, T* data, std::initializer_list<std::size_t> shape) {
  auto* keep = new Holder(holder);
  nb::capsule owner(keep, [](void* ptr) noexcept { delete static_cast<Holder*>(ptr); });
  return nb::ndarray<nb::numpy, T>(data, shape, owner);
}

// Expert weights (HostExpertWeights::w1 / w2 bytes) as the array their recipe's dtype reads: uint8
// FP8 codes, or the uint16 bits of bf16 / fp16 values.
template <class Holder>
void put_weight(nb::dict& d, const char* key, const Holder& holder, std::uint8_t* data, const MoeProblem& p,
                std::initializer_list<std::size_t> shape) {
  if (recipe_info(p.quant).weight_dtype != DType::kFp8E4m3)
    d[key] = owned_array(holder, reinterpret_cast<std::uint16_t*>(data), shape);
  else
    d[key] = owned_array(holder, data, shape);
}

// W1 in block pairs back to gate-then-up rows (the order Python callers pass, and MoeLayer
// arranges itself), in place.
void w1_to_halves(const MoeProblem& q, HostBuffer<std::uint8_t>& w1, HostBuffer<float>& w1_scale) {
  if (numerics::w1_rows(q.activation, q.quant) != numerics::W1Rows::kBlockPairs) return;
  const HostBuffer<std::uint8_t> pairs = w1;
  const HostBuffer<float> pairs_scale = w1_scale;
  const std::int64_t s1 = numerics::weight_scale_count(q.quant, q.N, q.K);
  for (std::int64_t e = 0; e < q.E_local; ++e)
    arrange_w1_halves(q.I(), q.K, pairs.data() + e * q.N * q.K, pairs_scale.data() + e * s1, w1.data() + e * q.N * q.K,
                      w1_scale.data() + e * s1);
}

// A checkpoint directory (moekit/checkpoint.h): one layer's weights for one rank as the arrays
// MoeLayer / Runtime.add_layer take (W1 in gate-then-up order), plus the router's weight and bias.
class PyCheckpoint {
 public:
  PyCheckpoint(const std::string& dir, int num_threads) : ck_(dir, num_threads) {}
  std::string model_type() const { return ck_.model().model_type; }
  std::string config_path() const { return ck_.dir() + "/config.json"; }
  std::vector<std::int64_t> moe_layers() const { return ck_.moe_layers(); }
  std::vector<std::string> opened_shards() const { return ck_.opened_shards(); }

  // placement: the slot -> expert map of all ranks' E_local * ranks slots (redundant experts), this
  // rank's slots read; None: experts [rank * E / ranks, ...).
  nb::dict load_layer(std::int64_t layer, const std::string& quant, std::int64_t rank, std::int64_t ranks,
                      bool shared_experts, std::optional<std::vector<std::int32_t>> placement) {
    const ModelConfig& m = ck_.model();
    MOEKIT_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "rank = {} of ranks = {}: need 0 <= rank < ranks", rank,
                 ranks);
    std::int64_t local = 0;
    if (placement) {
      const auto slots = static_cast<std::int64_t>(placement->size());
      MOEKIT_CHECK(slots % ranks == 0, "placement: {} slots do not divide over ranks = {}", slots, ranks);
      local = slots / ranks;
      make_placement(m.num_experts, *placement);  // validated: every expert in some slot
    }
    const ParallelConfig par{ranks, ranks, 1, local};
    const MoeProblem p = make_problem(m, par, ActivationFormat::kBatchedExperts, choose_quant(m, quant).quant);
    auto l = std::make_shared<CheckpointLayer>();
    {
      nb::gil_scoped_release release;
      const std::int64_t first = first_local_expert(par, p, static_cast<int>(rank));
      *l =
          placement
              ? ck_.load_layer(
                    layer, p,
                    std::span(*placement).subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(p.E_local)),
                    shared_experts)
              : ck_.load_layer(layer, p, first, shared_experts);
      w1_to_halves(p, l->experts.w1, l->experts.w1_scale);
      if (l->shared_experts)
        w1_to_halves(l->shared_experts->problem, l->shared_experts->w1, l->shared_experts->w1_scale);
    }
    using Z = std::size_t;
    const auto E = static_cast<Z>(p.E_local), N = static_cast<Z>(p.N), K = static_cast<Z>(p.K),
               I = static_cast<Z>(p.I());
    HostExpertWeights& w = l->experts;
    nb::dict d;
    put_weight(d, "w1", l, w.w1.data(), p, {E, N, K});
    put_weight(d, "w2", l, w.w2.data(), p, {E, K, I});
    d["w1_scale"] = owned_array(l, w.w1_scale.data(), {E, w.w1_scale.size() / E});
    d["w2_scale"] = owned_array(l, w.w2_scale.data(), {E, w.w2_scale.size() / E});
    if (p.expert_bias) {
      d["w1_bias"] = owned_array(l, w.w1_bias.data(), {E, N});
      d["w2_bias"] = owned_array(l, w.w2_bias.data(), {E, K});
    }
    if (!l->e_score_correction_bias.empty())
      d["e_score_correction_bias"] =
          owned_array(l, l->e_score_correction_bias.data(), {l->e_score_correction_bias.size()});
    if (l->shared_experts) {
      HostExpertWeights& sw = *l->shared_experts;
      const auto Ns = static_cast<Z>(sw.problem.N), Is = static_cast<Z>(sw.problem.I());
      put_weight(d, "shared_w1", l, sw.w1.data(), p, {1, Ns, K});
      put_weight(d, "shared_w2", l, sw.w2.data(), p, {1, K, Is});
      d["shared_w1_scale"] = owned_array(l, sw.w1_scale.data(), {1, sw.w1_scale.size()});
      d["shared_w2_scale"] = owned_array(l, sw.w2_scale.data(), {1, sw.w2_scale.size()});
      if (!l->shared_expert_gate.empty())
        d["shared_expert_gate"] = owned_array(l, l->shared_expert_gate.data(), {l->shared_expert_gate.size()});
    }
    d["router_weight"] = owned_array(l, l->router_weight.data(), {static_cast<Z>(p.E), K});
    if (!l->router_bias.empty()) d["router_bias"] = owned_array(l, l->router_bias.data(), {l->router_bias.size()});
    d["note"] = l->note;
    d["quant"] = std::string(quant_name(p.quant));
    return d;
  }

 private:
  Checkpoint ck_;
};

nb::dict synthetic(const std::string& model_name, std::int64_t num_experts, std::int64_t tokens,
                   std::int64_t max_tokens, const std::string& quant, std::uint64_t seed, std::int64_t rank,
                   std::int64_t ranks, int num_threads) {
  const ModelConfig m = model_with(model_name, num_experts);
  MOEKIT_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "rank = {} of ranks = {}: need 0 <= rank < ranks", rank, ranks);
  MOEKIT_CHECK(tokens >= 0, "tokens = {} must be >= 0", tokens);
  const ParallelConfig par{ranks, ranks, max_tokens, 0};
  const MoeProblem p =
      make_problem(m, par, ActivationFormat::kBatchedExperts, choose_quant(m, quant).quant, m.activation);
  std::shared_ptr<synthetic::HostExpertWeights> w;
  std::shared_ptr<synthetic::HostSharedExperts> sh;
  std::shared_ptr<synthetic::Tokens> t;
  {
    nb::gil_scoped_release release;
    cpu::ThreadPool pool(std::max(1, num_threads));
    w = std::make_shared<synthetic::HostExpertWeights>(
        synthetic::make_expert_weights(p, first_local_expert(par, p, static_cast<int>(rank)), seed, pool));
    sh = std::make_shared<synthetic::HostSharedExperts>(synthetic::make_shared_experts(m, p, seed, pool));
    // As a checkpoint stores W1 (gate rows then up rows): the layer arranges block pairs itself.
    w1_to_halves(p, w->w1, w->w1_scale);
    if (sh->problem) w1_to_halves(*sh->problem, sh->experts.w1, sh->experts.w1_scale);
    t = std::make_shared<synthetic::Tokens>(synthetic::make_tokens(p.K, p.E, rank * tokens, tokens, seed));
  }
  auto bias = std::make_shared<std::vector<float>>(m.has_score_correction_bias ? synthetic::make_routing_bias(p.E, seed)
                                                                               : std::vector<float>{});
  const auto E = static_cast<std::size_t>(p.E_local);
  nb::dict d;
  put_weight(d, "w1", w, w->w1.data(), p, {E, static_cast<std::size_t>(p.N), static_cast<std::size_t>(p.K)});
  put_weight(d, "w2", w, w->w2.data(), p, {E, static_cast<std::size_t>(p.K), static_cast<std::size_t>(p.I())});
  d["w1_scale"] = owned_array(w, w->w1_scale.data(), {E, w->w1_scale.size() / E});
  d["w2_scale"] = owned_array(w, w->w2_scale.data(), {E, w->w2_scale.size() / E});
  d["hidden"] = owned_array(t, t->hidden.data(), {static_cast<std::size_t>(tokens), static_cast<std::size_t>(p.K)});
  d["router_logits"] =
      owned_array(t, t->logits.data(), {static_cast<std::size_t>(tokens), static_cast<std::size_t>(p.E)});
  if (!bias->empty()) d["e_score_correction_bias"] = owned_array(bias, bias->data(), {bias->size()});
  if (sh->problem) {
    auto& sw = sh->experts;  // writable arrays: the layer takes nb::ndarray<> (read-only ones are refused)
    const auto N = static_cast<std::size_t>(sh->problem->N), I = static_cast<std::size_t>(sh->problem->I()),
               K = static_cast<std::size_t>(p.K);
    put_weight(d, "shared_w1", sh, sw.w1.data(), p, {1, N, K});
    put_weight(d, "shared_w2", sh, sw.w2.data(), p, {1, K, I});
    d["shared_w1_scale"] = owned_array(sh, sw.w1_scale.data(), {1, sw.w1_scale.size()});
    d["shared_w2_scale"] = owned_array(sh, sw.w2_scale.data(), {1, sw.w2_scale.size()});
    if (!sh->gate.empty()) d["shared_expert_gate"] = owned_array(sh, sh->gate.data(), {K});
  }
  if (p.expert_bias) {
    d["w1_bias"] = owned_array(w, w->w1_bias.data(), {E, static_cast<std::size_t>(p.N)});
    d["w2_bias"] = owned_array(w, w->w2_bias.data(), {E, static_cast<std::size_t>(p.K)});
  }
  return d;
}

// The recipe table (moekit/recipe.h), one dict a row: what moekit.recipes() returns.
nb::list recipes() {
  nb::list rows;
  for (const RecipeInfo& r : kRecipes) {
    nb::dict d;
    d["name"] = std::string(r.name);
    d["activation_dtype"] = std::string(dtype_name(r.activation_dtype));
    d["weight_dtype"] = std::string(dtype_name(r.weight_dtype));
    d["activation_scales"] = std::string(r.activation_scales == ActivationScales::kNone        ? "none"
                                         : r.activation_scales == ActivationScales::kPerTensor ? "per-tensor"
                                         : r.activation_scales == ActivationScales::kPerRow    ? "per-row"
                                                                                               : "1x128");
    d["weight_scales"] = std::string(r.weight_scales == WeightScales::kNone               ? "none"
                                     : r.weight_scales == WeightScales::kPerTensor        ? "per-tensor"
                                     : r.weight_scales == WeightScales::kPerOutputChannel ? "per-output-channel"
                                                                                          : "128x128");
    d["intermediate_dtype"] = std::string(dtype_name(r.intermediate_dtype));
    d["requantizes_intermediate"] = r.requantizes_intermediate;
    d["needs_block_multiple"] = r.needs_block_multiple;
    d["fused_w1"] = r.fused_w1;
    d["fast_accumulation"] = r.fast_accumulation;
    d["cuda_experts"] = r.cuda_experts;
    d["device_vs_cpu_tolerance"] = r.device_vs_cpu_tolerance;
    rows.append(d);
  }
  return rows;
}
}  // namespace
}  // namespace moekit::python

NB_MODULE(_moekit, m) {
  using namespace moekit::python;
  m.doc() = "moekit's C++ core; use the `moekit` package";
  nb::exception<moekit::Error>(m, "Error");
  m.def("recipes", &recipes);
  m.def("plan_json", &plan_json_text, nb::arg("model"), nb::arg("dp"), nb::arg("ep"), nb::arg("max_tokens_per_rank"),
        nb::arg("local_experts"), nb::arg("device"), nb::arg("quant"), nb::arg("activation"), nb::arg("experts"),
        nb::arg("dispatch"), nb::arg("fuse_w1").none(), nb::arg("accumulation"));
  m.def("synthetic", &synthetic, nb::arg("model"), nb::arg("num_experts"), nb::arg("tokens"),
        nb::arg("max_tokens_per_rank"), nb::arg("quant"), nb::arg("seed"), nb::arg("rank"), nb::arg("ranks"),
        nb::arg("num_threads"));
  m.def(
      "batched_experts",
      [](Array a1q, Array a1q_scale, Array counts, Array w1, Array w1_scale, Array w2, Array w2_scale, Array out,
         const std::string& activation, const std::string& quant, std::optional<bool> fuse_w1, int num_threads,
         std::uintptr_t stream, std::int64_t max_rows, float swiglu_limit, float swiglu_alpha,
         const std::string& accumulation, const std::string& w1_layout, std::optional<Array> workspace) {
        experts_op().batched(a1q, a1q_scale, counts, w1, w1_scale, w2, w2_scale, out, activation, quant, fuse_w1,
                             num_threads, stream, max_rows, {swiglu_limit, swiglu_alpha}, accumulation, w1_layout,
                             workspace);
      },
      nb::arg("a1q"), nb::arg("a1q_scale"), nb::arg("expert_num_tokens"), nb::arg("w1"), nb::arg("w1_scale"),
      nb::arg("w2"), nb::arg("w2_scale"), nb::arg("out"), nb::arg("activation"), nb::arg("quant"),
      nb::arg("fuse_w1").none(), nb::arg("num_threads"), nb::arg("stream"), nb::arg("max_rows"),
      nb::arg("swiglu_limit"), nb::arg("swiglu_alpha"), nb::arg("accumulation"), nb::arg("w1_layout"),
      nb::arg("workspace").none());
  m.def(
      "standard_experts",
      [](Array a1q, Array a1q_scale, Array topk_ids, Array topk_weights, Array w1, Array w1_scale, Array w2,
         Array w2_scale, Array out, const std::string& activation, const std::string& quant,
         std::optional<bool> fuse_w1, int num_threads, std::uintptr_t stream, float swiglu_limit, float swiglu_alpha,
         const std::string& accumulation, const std::string& w1_layout, std::optional<Array> workspace) {
        experts_op().standard(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out, activation,
                              quant, fuse_w1, num_threads, stream, {swiglu_limit, swiglu_alpha}, accumulation,
                              w1_layout, workspace);
      },
      nb::arg("a1q"), nb::arg("a1q_scale"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w1"),
      nb::arg("w1_scale"), nb::arg("w2"), nb::arg("w2_scale"), nb::arg("out"), nb::arg("activation"), nb::arg("quant"),
      nb::arg("fuse_w1").none(), nb::arg("num_threads"), nb::arg("stream"), nb::arg("swiglu_limit"),
      nb::arg("swiglu_alpha"), nb::arg("accumulation"), nb::arg("w1_layout"), nb::arg("workspace").none());
  m.def(
      "ops_check_status",
      [](std::uintptr_t stream, std::optional<Array> workspace) {
        if (workspace)
          experts_op().check_status(stream, *workspace);
        else
          experts_op().check_status(stream);
      },
      nb::arg("stream"), nb::arg("workspace").none());
  m.def("ops_workspace_bytes", [] { return experts_op().workspace_bytes(); });
  m.def("ops_workspace_cap", [] { return experts_op().cap(); });
  // Private, for the host-time test: launches redo their bound host work (cuda/launch_cache.h).
  m.def(
      "_set_launch_cache", [](bool on) { moekit::cuda::detail::set_launch_cache_enabled(on); }, nb::arg("on"));
  // A checkpoint's tensors as moekit reads them (a directory, or one .safetensors file): name ->
  // (dtype, shape, bytes). For tests against the safetensors package's writer.
  m.def(
      "checkpoint_tensors",
      [](const std::string& path) {
        namespace ck = moekit::checkpoint;
        nb::dict out;
        auto put = [&](const ck::TensorInfo& t, std::span<const std::byte> bytes) {
          nb::list shape;
          for (const std::int64_t d : t.shape) shape.append(d);
          out[t.name.c_str()] = nb::make_tuple(std::string(ck::dtype_name(t.dtype)), shape,
                                               nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
        };
        if (std::filesystem::is_directory(path)) {
          ck::CheckpointDir dir(path);
          for (const std::string& name : dir.tensor_names()) put(dir.info(name), dir.data(name));
        } else {
          const ck::SafetensorsFile st(path);
          for (const ck::TensorInfo& t : st.tensors()) put(t, st.data(t));
        }
        return out;
      },
      nb::arg("path"));
  m.def(
      "ops_set_workspace_cap", [](std::int64_t bytes) { experts_op().set_cap(bytes); }, nb::arg("bytes"));
  m.def(
      "ops_release_workspaces",
      [](bool captured) {
        nb::gil_scoped_release release;
        return experts_op().release(captured);
      },
      nb::arg("captured"));
  m.def(
      "ops_batched_workspace_bytes",
      [](std::int64_t E_local, std::int64_t M, std::int64_t K, std::int64_t N, const std::string& activation,
         const std::string& quant, std::optional<bool> fuse_w1, float swiglu_limit, float swiglu_alpha,
         const std::string& accumulation, const std::string& device) {
        const moekit::MoeProblem p =
            batched_op_problem(E_local, M, K, N, moekit::parse_quant(quant),
                               {activation, fuse_w1, {swiglu_limit, swiglu_alpha}, accumulation});
        return ExpertsOp::plan_bytes("batched-fp8", p, moekit::parse_device(device));
      },
      nb::arg("E_local"), nb::arg("M"), nb::arg("K"), nb::arg("N"), nb::arg("activation"), nb::arg("quant"),
      nb::arg("fuse_w1").none(), nb::arg("swiglu_limit"), nb::arg("swiglu_alpha"), nb::arg("accumulation"),
      nb::arg("device"));
  m.def(
      "ops_standard_workspace_bytes",
      [](std::int64_t T, std::int64_t K, std::int64_t N, std::int64_t topk, std::int64_t E_local,
         const std::string& activation, const std::string& quant, std::optional<bool> fuse_w1, float swiglu_limit,
         float swiglu_alpha, const std::string& accumulation, const std::string& device) {
        const moekit::MoeProblem p =
            standard_op_problem(T, K, N, topk, E_local, moekit::parse_quant(quant),
                                {activation, fuse_w1, {swiglu_limit, swiglu_alpha}, accumulation});
        return ExpertsOp::plan_bytes("standard-fp8", p, moekit::parse_device(device));
      },
      nb::arg("T"), nb::arg("K"), nb::arg("N"), nb::arg("topk"), nb::arg("E_local"), nb::arg("activation"),
      nb::arg("quant"), nb::arg("fuse_w1").none(), nb::arg("swiglu_limit"), nb::arg("swiglu_alpha"),
      nb::arg("accumulation"), nb::arg("device"));
  m.def("cuda_device_count", [] { return moekit::cuda::device_count(); });
  m.def(
      "arrange_w1_block_pairs",
      [](Array halves, Array halves_scale, Array pairs, Array pairs_scale) {
        MOEKIT_CHECK(halves.ndim() == 3, "w1: shape {} where (E, 2I, K) is needed", shape_text(halves));
        const auto E = static_cast<std::int64_t>(halves.shape(0)), N = static_cast<std::int64_t>(halves.shape(1)),
                   K = static_cast<std::int64_t>(halves.shape(2));
        MOEKIT_CHECK(N % (2 * moekit::kQuantBlock) == 0,
                     "w1: {} rows: gate and up halves of I rows each, I a multiple of 128, are needed", N);
        const std::int64_t blocks = N / moekit::kQuantBlock * moekit::numerics::ceil_div(K, moekit::kQuantBlock);
        const Place cpu{};
        using C = nb::dlpack::dtype_code;
        require(halves, "w1", {C::UInt, C::Int, C::Float}, 8, {E, N, K}, "8-bit FP8 codes", cpu);
        require(pairs, "out", {C::UInt, C::Int, C::Float}, 8, {E, N, K}, "8-bit FP8 codes", cpu);
        require(halves_scale, "w1_scale", {C::Float}, 32, {E, blocks}, "float32", cpu);
        require(pairs_scale, "out_scale", {C::Float}, 32, {E, blocks}, "float32", cpu);
        for (std::int64_t e = 0; e < E; ++e)
          moekit::arrange_w1_block_pairs(N / 2, K, static_cast<const std::uint8_t*>(halves.data()) + e * N * K,
                                         static_cast<const float*>(halves_scale.data()) + e * blocks,
                                         static_cast<std::uint8_t*>(pairs.data()) + e * N * K,
                                         static_cast<float*>(pairs_scale.data()) + e * blocks);
      },
      nb::arg("w1"), nb::arg("w1_scale"), nb::arg("out"), nb::arg("out_scale"));
  nb::class_<Runtime>(m, "Runtime")
      .def(nb::init<const std::string&, std::int64_t, std::int64_t, const std::string&, const std::string&,
                    std::optional<std::string>, const std::string&, const std::string&, bool, int, std::optional<bool>,
                    const std::string&, std::optional<nb::object>, std::int64_t>(),
           nb::arg("model"), nb::arg("num_experts"), nb::arg("max_tokens_per_rank"), nb::arg("quant"),
           nb::arg("experts"), nb::arg("activation").none(), nb::arg("device"), nb::arg("dispatch"),
           nb::arg("shared_experts"), nb::arg("num_threads"), nb::arg("fuse_w1").none(), nb::arg("accumulation"),
           nb::arg("group").none(), nb::arg("local_experts"))
      .def("add_layer", &Runtime::add_layer, nb::arg("w1"), nb::arg("w1_scale"), nb::arg("w2"), nb::arg("w2_scale"),
           nb::arg("e_score_correction_bias").none(), nb::arg("w1_bias").none(), nb::arg("w2_bias").none(),
           nb::arg("shared_w1").none(), nb::arg("shared_w1_scale").none(), nb::arg("shared_w2").none(),
           nb::arg("shared_w2_scale").none(), nb::arg("shared_expert_gate").none(), nb::arg("w1_layout"),
           nb::arg("placement").none())
      .def("placement", &Runtime::placement, nb::arg("layer"))
      .def("expert_load", &Runtime::expert_load, nb::arg("layer"), nb::arg("stream"))
      .def("forward", &Runtime::forward, nb::arg("layer"), nb::arg("hidden"), nb::arg("router_logits"), nb::arg("out"),
           nb::arg("stream"))
      .def("enqueue", &Runtime::enqueue, nb::arg("layer"), nb::arg("hidden"), nb::arg("router_logits"), nb::arg("out"),
           nb::arg("stream"), nb::arg("max_tokens_any_rank"))
      .def("check_status", &Runtime::check_status, nb::arg("stream"))
      .def("owns_w1", &Runtime::owns_w1, nb::arg("layer"))
      .def_prop_ro("workspace_bytes", &Runtime::workspace_bytes)
      .def_prop_ro("num_layers", &Runtime::num_layers)
      .def_prop_ro("K", &Runtime::K)
      .def_prop_ro("E", &Runtime::E)
      .def_prop_ro("E_local", &Runtime::E_local)
      .def_prop_ro("rank", &Runtime::rank)
      .def_prop_ro("ranks", &Runtime::ranks)
      .def_prop_ro("device", &Runtime::device)
      .def_prop_ro("dispatch", &Runtime::dispatch)
      .def_prop_ro("problem", &Runtime::problem);
  m.def("workspace_allocations", &moekit::Workspace::allocation_count);
  m.def(
      "rebalance_experts",
      [](const std::vector<double>& load, std::int64_t num_physical, std::int64_t num_groups, std::int64_t num_nodes,
         std::int64_t num_ranks) {
        return moekit::rebalance_experts(load, num_physical, num_groups, num_nodes, num_ranks).physical_to_logical;
      },
      nb::arg("load"), nb::arg("num_physical"), nb::arg("num_groups"), nb::arg("num_nodes"), nb::arg("num_ranks"));
  m.def(
      "round_robin_placement",
      [](std::int64_t num_logical, std::int64_t num_physical) {
        return moekit::round_robin_placement(num_logical, num_physical).physical_to_logical;
      },
      nb::arg("num_logical"), nb::arg("num_physical"));
  nb::class_<PyCheckpoint>(m, "Checkpoint")
      .def(nb::init<const std::string&, int>(), nb::arg("path"), nb::arg("num_threads"))
      .def("load_layer", &PyCheckpoint::load_layer, nb::arg("layer"), nb::arg("quant"), nb::arg("rank"),
           nb::arg("ranks"), nb::arg("shared_experts"), nb::arg("placement").none())
      .def_prop_ro("model_type", &PyCheckpoint::model_type)
      .def_prop_ro("config_path", &PyCheckpoint::config_path)
      .def_prop_ro("moe_layers", &PyCheckpoint::moe_layers)
      .def_prop_ro("opened_shards", &PyCheckpoint::opened_shards);
}
