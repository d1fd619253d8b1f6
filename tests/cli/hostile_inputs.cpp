// The hostile-input suite: the real `moekit` binary, as a user or an attacker runs it, against every
// class of bad input moekit guards (docs/FEATURES.md, "Untrusted input"): numbers that overflow,
// sizes that exhaust memory, work that never ends, bad weights, keys given twice, plan --checkpoint
// against broken checkpoints, and flags outside their ranges; controls that must run show a refusal
// is not a refusal of everything. Each case runs in a child process under a time limit and a memory
// cap (8 GiB of address space; under ASan, a cap on each allocation), and is classified:
//   refused by name  exit 1 or 2 and stderr names what the case expects (file, tensor, key or flag, value)
//   accepted         exit 0 where the case is a control (and stdout says what it expects)
//   anything else    a signal, a timeout, an internal error (exit 4), a leak, a refusal naming the
//                    wrong cause, a control refused, or a refusal that first grew past 1 GiB
// The suite fails on anything else and prints the counts at its end. Build and run:
// cmake --build build --target hostile_inputs && ./build/tests/hostile_inputs
// (MOEKIT_HOSTILE_CLI=/path/to/moekit runs the cases against another build of the CLI.)
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/write_safetensors.h"
#include "numerics/fp8.h"
#include "synthetic/random.h"
#include "test_names.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using checkpoint::testing::file_bytes;
using checkpoint::testing::Tensor;
using checkpoint::testing::tensor_of;
using checkpoint::testing::write_file;
using checkpoint::testing::write_tensors;
using checkpoint::testing::write_text;

constexpr int kTimeLimitSeconds = 60;
constexpr long kMaxRefusalRssKb = 1L << 20;  // 1 GiB: a refusal comes before any large allocation

// ---- Running the CLI in a child --------------------------------------------------------------------

struct Outcome {
  int exit_code = -1;  // -1: killed by a signal
  int signal = 0;
  bool timed_out = false;
  std::string out, err;
  double seconds = 0;
  long max_rss_kb = 0;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// `moekit args...` with stdout and stderr into files of `dir`; `huge_stacks`: every thread but the
// main one is refused by the OS (RLIMIT_STACK past any machine's memory: glibc sizes new threads'
// stacks from it, and pthread_create fails with EAGAIN as it does past a thread limit).
Outcome run_cli(const std::vector<std::string>& args, const fs::path& dir, bool huge_stacks) {
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
#if !defined(__SANITIZE_ADDRESS__)
    // ASan reserves terabytes of shadow address space: there the cap is on each allocation instead.
    const rlimit as{8ul << 30, 8ul << 30};
    ::setrlimit(RLIMIT_AS, &as);
#endif
    if (huge_stacks) {
      const rlimit stack{1ul << 46, RLIM_INFINITY};
      ::setrlimit(RLIMIT_STACK, &stack);
    }
    std::string asan = std::getenv("ASAN_OPTIONS") ? std::getenv("ASAN_OPTIONS") : "";
    asan += std::string(asan.empty() ? "" : ":") + "max_allocation_size_mb=8192:allocator_may_return_null=0";
    ::setenv("ASAN_OPTIONS", asan.c_str(), 1);
    ::unsetenv("OMPI_COMM_WORLD_SIZE");
    const char* cli = std::getenv("MOEKIT_HOSTILE_CLI") ? std::getenv("MOEKIT_HOSTILE_CLI") : MOEKIT_CLI;
    std::vector<char*> argv{const_cast<char*>(cli)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(cli, argv.data());
    ::_exit(127);
  }
  Outcome r;
  int status = 0;
  rusage usage{};
  for (;;) {
    const pid_t done = ::wait4(pid, &status, WNOHANG, &usage);
    if (done == pid) break;
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(kTimeLimitSeconds)) {
      ::kill(pid, SIGKILL);
      ::wait4(pid, &status, 0, &usage);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.max_rss_kb = usage.ru_maxrss;
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// ---- Tiny checkpoints ------------------------------------------------------------------------------

// Float tensors stored as bf16 (or F32), seeded small normal values.
Tensor bf16_tensor(const std::string& name, std::vector<std::int64_t> shape, std::uint64_t seed) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  synthetic::SplitMix rng{seed};
  std::vector<std::uint16_t> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = numerics::bf16_encode(0.05f * rng.normal());
  return tensor_of(name, "BF16", std::move(shape), v.data(), v.size());
}

Tensor f32_tensor(const std::string& name, std::vector<std::int64_t> shape, float lo, float hi, std::uint64_t seed) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  synthetic::SplitMix rng{seed};
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = lo + (hi - lo) * static_cast<float>(rng.next() % 1000) / 1000.0f;
  return tensor_of(name, "F32", std::move(shape), v.data(), v.size());
}

// FP8 e4m3 codes, never the NaN codes 0x7F / 0xFF.
Tensor fp8_tensor(const std::string& name, std::vector<std::int64_t> shape, std::uint64_t seed) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  synthetic::SplitMix rng{seed};
  Tensor t{name, "F8_E4M3", std::move(shape), std::vector<std::uint8_t>(static_cast<std::size_t>(n))};
  for (auto& c : t.data) c = static_cast<std::uint8_t>((rng.next() % 0x70) | (rng.next() % 2 ? 0x80 : 0));
  return t;
}

Tensor* find(std::vector<Tensor>& ts, const std::string& name) {
  for (Tensor& t : ts)
    if (t.name == name) return &t;
  ADD_FAILURE() << "no tensor " << name;
  return nullptr;
}

// Qwen3-MoE, bf16, one MoE layer: K = 64, I = 32, 4 experts, top-2.
constexpr const char* kQwenConfig =
    R"({"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
 "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": true, "hidden_act": "silu"})";

std::vector<Tensor> qwen_tensors() {
  std::vector<Tensor> t;
  const std::string p = "model.layers.0.mlp.";
  t.push_back(bf16_tensor(p + "gate.weight", {4, 64}, 1));
  for (int e = 0; e < 4; ++e) {
    const std::string x = p + "experts." + std::to_string(e) + ".";
    t.push_back(bf16_tensor(x + "gate_proj.weight", {32, 64}, 10 + 3 * e));
    t.push_back(bf16_tensor(x + "up_proj.weight", {32, 64}, 11 + 3 * e));
    t.push_back(bf16_tensor(x + "down_proj.weight", {64, 32}, 12 + 3 * e));
  }
  return t;
}

// DeepSeek-V3, FP8 with 128x128 block scales: K = 256, I = 128, 4 experts, top-2, no shared expert.
constexpr const char* kDeepseekConfig =
    R"({"model_type": "deepseek_v3", "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 1,
 "first_k_dense_replace": 0, "n_routed_experts": 4, "n_shared_experts": 0, "num_experts_per_tok": 2, "n_group": 1,
 "topk_group": 1, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})";

std::vector<Tensor> deepseek_tensors() {
  std::vector<Tensor> t;
  const std::string p = "model.layers.0.mlp.";
  t.push_back(bf16_tensor(p + "gate.weight", {4, 256}, 2));
  t.push_back(f32_tensor(p + "gate.e_score_correction_bias", {4}, -0.1f, 0.1f, 3));
  for (int e = 0; e < 4; ++e) {
    const std::string x = p + "experts." + std::to_string(e) + ".";
    for (const auto& [w, n, k] : {std::tuple{"gate_proj", 128, 256}, {"up_proj", 128, 256}, {"down_proj", 256, 128}}) {
      t.push_back(fp8_tensor(x + w + ".weight", {n, k}, static_cast<std::uint64_t>(20 + e)));
      t.push_back(f32_tensor(x + w + ".weight_scale_inv", {n / 128, k / 128}, 1e-3f, 2e-3f, 30));
    }
  }
  return t;
}

// A checkpoint directory: config.json and one model.safetensors, or two shards and an index.
fs::path write_checkpoint(const fs::path& dir, const std::string& config, const std::vector<Tensor>& tensors,
                          bool sharded = false) {
  fs::create_directories(dir);
  write_text(dir / "config.json", config);
  if (!sharded) {
    write_tensors(dir / "model.safetensors", tensors);
    return dir;
  }
  std::vector<Tensor> a(tensors.begin(), tensors.begin() + static_cast<std::ptrdiff_t>(tensors.size() / 2));
  std::vector<Tensor> b(tensors.begin() + static_cast<std::ptrdiff_t>(tensors.size() / 2), tensors.end());
  write_tensors(dir / "model-00001-of-00002.safetensors", a);
  write_tensors(dir / "model-00002-of-00002.safetensors", b);
  std::string index = R"({"metadata": {}, "weight_map": {)";
  for (std::size_t i = 0; i < tensors.size(); ++i)
    index += (i ? ", \"" : "\"") + tensors[i].name + "\": \"model-0000" + (i < a.size() ? "1" : "2") +
             "-of-00002.safetensors\"";
  write_text(dir / "model.safetensors.index.json", index + "}}");
  return dir;
}

// A config.json text with `key`'s value replaced (or added) as raw JSON text.
std::string with_key(std::string config, const std::string& key, const std::string& value) {
  const std::string k = "\"" + key + "\": ";
  const auto at = config.find(k);
  if (at == std::string::npos) return config.substr(0, config.rfind('}')) + ", " + k + value + "}";
  const auto begin = at + k.size();
  const auto end = config.find_first_of(",}", begin);
  return config.substr(0, begin) + value + config.substr(end);
}

std::string preset(const std::string& name) {
  return slurp(fs::path(MOEKIT_SOURCE_DIR) / "models" / (name + ".json"));
}

// ---- The cases ------------------------------------------------------------------------------------

// What a case runs and expects.
struct Invocation {
  std::vector<std::string> args;
  bool accept = false;              // a control: exit 0
  std::vector<std::string> expect;  // in stderr (a refusal) or stdout (a control)
  bool huge_stacks = false;
};

struct Case {
  std::string klass;  // the class of bad input it is a regression case of
  std::string name;
  std::function<Invocation(const fs::path& dir)> make;
};

const std::vector<std::string> kRunCpu = {"--device", "cpu",     "--dp", "1",         "--tokens-per-rank",
                                          "4",        "--steps", "1",    "--threads", "1"};

std::vector<std::string> run_args(const fs::path& ck, std::vector<std::string> extra = {}) {
  std::vector<std::string> a{"run", "--checkpoint", ck.string()};
  a.insert(a.end(), kRunCpu.begin(), kRunCpu.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}
std::vector<std::string> plan_args(const fs::path& ck) {
  return {"plan", "--checkpoint", ck.string(), "--device", "cpu", "--dp", "1", "--ep", "1"};
}
std::vector<std::string> plan_model(const fs::path& config) {
  return {"plan", "--model", config.string(), "--device", "cpu", "--dp", "1", "--ep", "1"};
}
std::vector<std::string> run_model(const fs::path& config, std::vector<std::string> extra = {}) {
  std::vector<std::string> a{"run", "--model", config.string()};
  a.insert(a.end(), kRunCpu.begin(), kRunCpu.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// A config file of `text` in `dir`.
fs::path config_file(const fs::path& dir, const std::string& text) {
  fs::create_directories(dir);
  write_text(dir / "config.json", text);
  return dir / "config.json";
}

// A refusal of a config that says `key` = `value` (raw JSON), by plan or run.
Case config_case(const std::string& klass, const std::string& name, const std::string& base, const std::string& key,
                 const std::string& value, std::vector<std::string> expect, bool run = false) {
  return {klass, name, [=](const fs::path& d) {
            const fs::path c = config_file(d, with_key(base, key, value));
            std::vector<std::string> e = expect;
            e.push_back(c.string());
            return Invocation{run ? run_model(c) : plan_model(c), false, e};
          }};
}

// A refusal of a flag: `moekit <args>` naming `flag`.
Case flag_case(const std::string& name, std::vector<std::string> args, std::vector<std::string> expect,
               const std::string& klass = "flags") {
  return {klass, name, [=](const fs::path&) { return Invocation{args, false, expect}; }};
}

// A checkpoint whose tensor `tensor` holds `bytes` at element `at` (little-endian), refused by run
// naming the shard, the tensor, the element and the value.
Case weight_case(const std::string& name, bool fp8, const std::string& tensor, std::int64_t at,
                 std::vector<std::uint8_t> bytes, std::vector<std::string> expect) {
  return {"bad weights", name, [=](const fs::path& d) {
            std::vector<Tensor> ts = fp8 ? deepseek_tensors() : qwen_tensors();
            Tensor* t = find(ts, tensor);
            for (std::size_t i = 0; i < bytes.size(); ++i)
              t->data[static_cast<std::size_t>(at) * bytes.size() + i] = bytes[i];
            const fs::path ck = write_checkpoint(d / "ck", fp8 ? kDeepseekConfig : kQwenConfig, ts);
            std::vector<std::string> e = expect;
            e.push_back((ck / "model.safetensors").string());
            e.push_back("tensor '" + tensor + "'");
            return Invocation{run_args(ck, {"--check"}), false, e};
          }};
}

std::vector<std::uint8_t> f32_bytes(float f) {
  std::vector<std::uint8_t> b(4);
  std::memcpy(b.data(), &f, 4);
  return b;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  const std::string qwen = kQwenConfig, deepseek = kDeepseekConfig;
  const std::string ds_preset = preset("deepseek-v3"), qwen_preset = preset("qwen3-30b-a3b");

  // ---- Numbers that overflow: a JSON number past a double is an Error naming the file and key.
  c.push_back(config_case("overflow", "hidden_size_1e999", qwen_preset, "hidden_size", "1e999",
                          {"'hidden_size'", "number overflow", "1e999"}));
  c.push_back(config_case("overflow", "routed_scaling_factor_1e999", ds_preset, "routed_scaling_factor", "1e999",
                          {"'routed_scaling_factor'", "number overflow"}));
  c.push_back(config_case("overflow", "run_hidden_size_1e999", qwen_preset, "hidden_size", "-1e999",
                          {"'hidden_size'", "number overflow"}, true));
  c.push_back(config_case("overflow", "hidden_size_past_2_64", qwen_preset, "hidden_size", "18446744073709551616",
                          {"'hidden_size' must be an integer"}));
  c.push_back(config_case("overflow", "weight_block_size_1e999", ds_preset, "quantization_config",
                          R"({"quant_method": "fp8", "weight_block_size": [1e999, 128]})",
                          {"'weight_block_size'", "number overflow"}));
  c.push_back({"overflow", "index_number_1e999", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors(), true);
                 write_text(ck / "model.safetensors.index.json",
                            R"({"metadata": {"total_size": 1e999}, "weight_map": {}})");
                 return Invocation{plan_args(ck), false, {"model.safetensors.index.json", "'total_size'", "overflow"}};
               }});
  c.push_back({"overflow", "header_shape_1e999", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 write_file(ck / "model.safetensors",
                            file_bytes(R"({"t":{"dtype":"U8","shape":[1e999],"data_offsets":[0,1]}})", {0}));
                 return Invocation{plan_args(ck), false, {"model.safetensors", "tensor 't'", "number overflow"}};
               }});

  // ---- Sizes that exhaust memory: past a limit of moekit/limits.h, refused by key and limit; within
  // the limits but past the machine, refused by the bytes computed before any allocation.
  c.push_back(config_case("memory", "n_routed_experts_2_31", ds_preset, "n_routed_experts", "2147483648",
                          {"'n_routed_experts' = 2147483648", "limit of 16384"}));
  c.push_back(config_case("memory", "config_num_experts_2_31", qwen_preset, "num_experts", "2147483648",
                          {"'num_experts' or 'num_local_experts' = 2147483648", "limit"}, true));
  c.push_back(config_case("memory", "hidden_size_2_40", qwen_preset, "hidden_size", "1099511627776",
                          {"'hidden_size' = 1099511627776", "limit of 131072"}));
  for (const char* v : {"16777216", "1099511627776"})
    c.push_back(config_case("memory", std::string("moe_intermediate_size_") + v, ds_preset, "moe_intermediate_size", v,
                            {std::string("'moe_intermediate_size' = ") + v, "limit of 131072"}, true));
  c.push_back(config_case("memory", "shared_width_past_limit", ds_preset, "n_shared_experts", "16384",
                          {"n_shared_experts = 16384", "shared experts' width"}));
  c.push_back(flag_case("tokens_per_rank_2_31", {"run", "--tokens-per-rank", "2147483648"},
                        {"--tokens-per-rank", "2147483648", "[0, 1048576]"}, "memory"));
  c.push_back(flag_case("flag_num_experts_2_31", {"run", "--num-experts", "2147483648"},
                        {"--num-experts", "2147483648"}, "memory"));
  c.push_back({"memory", "run_past_host_memory", [=](const fs::path& d) {
                 // Every size within its limit, the model's bytes past any machine: refused before allocating.
                 std::string cfg = with_key(qwen_preset, "hidden_size", "131072");
                 cfg = with_key(cfg, "moe_intermediate_size", "131072");
                 const fs::path c2 = config_file(d, cfg);
                 return Invocation{run_model(c2, {"--num-experts", "16384"}),
                                   false,
                                   {"this run", "needs", "host memory", "lower --num-experts"}};
               }});
  c.push_back({"memory", "bench_past_host_memory", [=](const fs::path& d) {
                 std::string cfg = with_key(qwen_preset, "hidden_size", "131072");
                 const fs::path c2 = config_file(d, with_key(cfg, "moe_intermediate_size", "131072"));
                 return Invocation{{"bench", "layer", "--device", "cpu", "--model", c2.string(), "--num-experts",
                                    "16384", "--tokens", "1", "--iters", "1", "--experts", "batched-fp8"},
                                   false,
                                   {"seeded synthetic weights of 16384 experts", "needs", "host memory"}};
               }});
  c.push_back({"memory", "plan_past_gpu_memory_said", [=](const fs::path& d) {
                 const fs::path c2 = config_file(d, with_key(ds_preset, "moe_intermediate_size", "131072"));
                 std::vector<std::string> a = plan_model(c2);
                 a.insert(a.end(), {"--gpu-memory", "141GiB", "--experts", "batched-fp8"});
                 return Invocation{a, true, {"DOES NOT FIT in --gpu-memory 141.00 GiB"}};
               }});
  for (const bool plan : {false, true})
    c.push_back({"memory", plan ? "plan_config_wider_than_tensors" : "run_config_wider_than_tensors",
                 [plan](const fs::path& d) {
                   // Within the limits and the machine (128 experts of I = 2^17: 3 GiB of buffers) but
                   // not the tensors' (4 experts of I = 32): refused by the header check before any
                   // buffer is sized (the child's size is checked too).
                   std::string cfg = with_key(kQwenConfig, "moe_intermediate_size", "131072");
                   const fs::path ck = write_checkpoint(d / "ck", with_key(cfg, "num_experts", "128"), qwen_tensors());
                   return Invocation{plan ? plan_args(ck) : run_args(ck),
                                     false,
                                     {"model.layers.0.mlp.experts.0.gate_proj.weight", "has shape (32, 64)",
                                      "the config says (131072, 64)"}};
                 }});

  // ---- Work that never ends: loops over config values are bounded, files are regular files opened
  // without blocking, the header parse is linear, threads the OS refuses raise.
  c.push_back(config_case("endless", "num_hidden_layers_2_62", qwen_preset, "num_hidden_layers", "4611686018427387904",
                          {"'num_hidden_layers' = 4611686018427387904", "limit of 4096"}));
  c.push_back({"endless", "mlp_only_layers_1M", [=](const fs::path& d) {
                 std::string list = "[0";
                 for (int i = 1; i < 1000000; ++i) list += ",0";
                 const fs::path c2 = config_file(d, with_key(qwen_preset, "mlp_only_layers", list + "]"));
                 return Invocation{plan_model(c2), false, {"'mlp_only_layers' lists 1000000 entries", "limit"}};
               }});
  c.push_back({"endless", "header_100k_entries_linear", [](const fs::path& d) {
                 // The real tensors and 100,000 one-byte ones: the header is read in one linear pass
                 // (a quadratic parse runs past the time limit); plan --checkpoint reads every header.
                 std::vector<Tensor> ts = qwen_tensors();
                 for (int i = 0; i < 100000; ++i) ts.push_back({"junk." + std::to_string(i), "U8", {1}, {0}});
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, ts);
                 return Invocation{plan_args(ck), true, {"whole model per GPU: 1 MoE layers"}};
               }});
  c.push_back(
      {"endless", "fifo_config", [](const fs::path& d) {
         fs::create_directories(d);
         ::mkfifo((d / "config.json").c_str(), 0644);
         return Invocation{plan_model(d / "config.json"), false, {(d / "config.json").string(), "a FIFO (named pipe)"}};
       }});
  c.push_back({"endless", "fifo_config_in_checkpoint", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 fs::remove(ck / "config.json");
                 ::mkfifo((ck / "config.json").c_str(), 0644);
                 return Invocation{run_args(ck), false, {(ck / "config.json").string(), "a FIFO"}};
               }});
  c.push_back({"endless", "fifo_shard", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 fs::remove(ck / "model.safetensors");
                 ::mkfifo((ck / "model.safetensors").c_str(), 0644);
                 return Invocation{plan_args(ck), false, {(ck / "model.safetensors").string(), "a FIFO"}};
               }});
  c.push_back({"endless", "fifo_index", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors(), true);
                 fs::remove(ck / "model.safetensors.index.json");
                 ::mkfifo((ck / "model.safetensors.index.json").c_str(), 0644);
                 return Invocation{run_args(ck), false, {"model.safetensors.index.json", "a FIFO"}};
               }});
  c.push_back({"endless", "dev_zero_config", [](const fs::path&) {
                 return Invocation{plan_model("/dev/zero"), false, {"'/dev/zero'", "a character device"}};
               }});
  c.push_back({"endless", "symlink_to_dev_zero_shard", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 fs::remove(ck / "model.safetensors");
                 fs::create_symlink("/dev/zero", ck / "model.safetensors");
                 return Invocation{run_args(ck), false, {"model.safetensors", "a character device"}};
               }});
  c.push_back({"endless", "threads_the_os_refuses", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 std::vector<std::string> a = run_args(ck);
                 a.back() = "8";  // --threads 8
                 return Invocation{a, false, {"could start only 1 of the 8 threads", "--threads"}, true};
               }});
  c.push_back({"endless", "rank_threads_the_os_refuses", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 return Invocation{{"run", "--checkpoint", ck.string(), "--device", "cpu", "--dp", "2", "--ep", "1",
                                    "--tokens-per-rank", "4", "--steps", "1"},
                                   false,
                                   {"could start only 1 of the 2 in-process ranks' threads", "--dp"},
                                   true};
               }});
  c.push_back(
      flag_case("threads_past_limit", {"run", "--threads", "100000"}, {"--threads", "100000", "[0, 1024]"}, "endless"));

  // ---- Bad weights: every value a load reads is checked; the first bad one named.
  const std::string qe = "model.layers.0.mlp.experts.1.up_proj.weight";
  const std::string de = "model.layers.0.mlp.experts.2.down_proj.weight";
  c.push_back(weight_case("bf16_nan", false, qe, 69, {0xC0, 0x7F}, {"element [1, 5]", "is NaN"}));
  c.push_back(weight_case("bf16_inf", false, qe, 64, {0x80, 0xFF}, {"element [1, 0]", "is -Inf"}));
  c.push_back(weight_case("router_nan", false, "model.layers.0.mlp.gate.weight", 3, {0xC0, 0x7F}, {"is NaN"}));
  c.push_back(weight_case("fp8_nan_code", true, de, 1000, {0x7F}, {"element [7, 104]", "FP8 code 0x7f"}));
  c.push_back(weight_case("fp8_negative_nan_code", true, de, 5, {0xFF}, {"FP8 code 0xff"}));
  c.push_back(
      weight_case("scale_nan", true, de + "_scale_inv", 1, f32_bytes(NAN), {"element [1, 0]", "is NaN", "a scale"}));
  c.push_back(weight_case("scale_inf", true, de + "_scale_inv", 0, f32_bytes(INFINITY), {"is +Inf", "a scale"}));
  c.push_back(weight_case("scale_zero", true, de + "_scale_inv", 0, f32_bytes(0.0f), {"is 0", "finite and > 0"}));
  c.push_back(weight_case("scale_negative", true, de + "_scale_inv", 1, f32_bytes(-0.5f), {"is -0.5", "> 0"}));
  c.push_back(weight_case("correction_bias_nan", true, "model.layers.0.mlp.gate.e_score_correction_bias", 2,
                          f32_bytes(NAN), {"element [2]", "is NaN"}));

  // ---- Last one wins: a key given twice is refused at every level.
  c.push_back(
      {"keys twice", "dtype_field_twice", [](const fs::path& d) {
         const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
         write_file(
             ck / "model.safetensors",
             file_bytes(R"({"t":{"dtype":"BF16","dtype":"F16","shape":[2],"data_offsets":[0,4]}})", {0, 0, 0, 0}));
         return Invocation{run_args(ck), false, {"model.safetensors", "tensor 't'", "field 'dtype' is given twice"}};
       }});
  c.push_back({"keys twice", "tensor_twice_in_header", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 write_file(ck / "model.safetensors",
                            file_bytes(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                       R"("t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                                       {0, 0}));
                 return Invocation{plan_args(ck), false, {"model.safetensors", "names tensor 't' twice"}};
               }});
  c.push_back({"keys twice", "tensor_twice_in_weight_map", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors(), true);
                 std::string index = slurp(ck / "model.safetensors.index.json");
                 const std::string dup = R"("model.layers.0.mlp.gate.weight": "model-00002-of-00002.safetensors", )";
                 index.insert(index.find("\"weight_map\": {") + 15, dup);
                 write_text(ck / "model.safetensors.index.json", index);
                 return Invocation{run_args(ck),
                                   false,
                                   {"model.safetensors.index.json", "'model.layers.0.mlp.gate.weight' is given twice",
                                    "'weight_map'"}};
               }});
  c.push_back({"keys twice", "config_key_twice", [=](const fs::path& d) {
                 const fs::path c2 =
                     config_file(d, qwen_preset.substr(0, qwen_preset.rfind('}')) + ", \"hidden_size\": 4096}");
                 return Invocation{plan_model(c2), false, {"key 'hidden_size' is given twice", c2.string()}};
               }});
  c.push_back(config_case("keys twice", "quantization_config_key_twice", ds_preset, "quantization_config",
                          R"({"quant_method": "fp8", "quant_method": "mxfp4"})",
                          {"key 'quant_method' is given twice in 'quantization_config'"}));
  c.push_back({"keys twice", "metadata_key_twice", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 write_file(ck / "model.safetensors", file_bytes(R"({"__metadata__":{"a":"x","a":"y"}})", {}));
                 return Invocation{plan_args(ck), false, {"model.safetensors", "__metadata__ names key 'a' twice"}};
               }});

  // ---- plan --checkpoint reads the headers and refuses what run refuses.
  c.push_back(
      {"plan --checkpoint", "missing_shard", [](const fs::path& d) {
         const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors(), true);
         fs::remove(ck / "model-00002-of-00002.safetensors");
         return Invocation{plan_args(ck), false, {"model-00002-of-00002.safetensors", "cannot open", "No such file"}};
       }});
  c.push_back({"plan --checkpoint", "dangling_symlink_shard", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors(), true);
                 fs::remove(ck / "model-00001-of-00002.safetensors");
                 fs::create_symlink(d / "gone.safetensors", ck / "model-00001-of-00002.safetensors");
                 return Invocation{plan_args(ck), false, {"model-00001-of-00002.safetensors", "a symlink to", "gone"}};
               }});
  c.push_back({"plan --checkpoint", "directory_as_shard", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors(), true);
                 fs::remove(ck / "model-00002-of-00002.safetensors");
                 fs::create_directory(ck / "model-00002-of-00002.safetensors");
                 return Invocation{plan_args(ck), false, {"model-00002-of-00002.safetensors", "is a directory"}};
               }});
  c.push_back({"plan --checkpoint", "hidden_size_contradicts_tensors", [](const fs::path& d) {
                 const fs::path ck =
                     write_checkpoint(d / "ck", with_key(kQwenConfig, "hidden_size", "128"), qwen_tensors());
                 return Invocation{plan_args(ck), false, {"has shape (32, 64), the config says (32, 128)"}};
               }});
  c.push_back({"plan --checkpoint", "more_experts_than_tensors", [](const fs::path& d) {
                 const fs::path ck =
                     write_checkpoint(d / "ck", with_key(kQwenConfig, "num_experts", "8"), qwen_tensors());
                 return Invocation{plan_args(ck), false, {"experts.4.gate_proj.weight", "holds no tensor"}};
               }});
  c.push_back({"plan --checkpoint", "fp8_without_quantization_config", [](const fs::path& d) {
                 std::string cfg = kDeepseekConfig;
                 cfg = cfg.substr(0, cfg.find(", \"quantization_config\"")) + "}";
                 const fs::path ck = write_checkpoint(d / "ck", cfg, deepseek_tensors());
                 return Invocation{plan_args(ck), false, {"is F8_E4M3", "no quantization_config"}};
               }});
  c.push_back({"plan --checkpoint", "run_fp8_without_quantization_config", [](const fs::path& d) {
                 std::string cfg = kDeepseekConfig;
                 cfg = cfg.substr(0, cfg.find(", \"quantization_config\"")) + "}";
                 const fs::path ck = write_checkpoint(d / "ck", cfg, deepseek_tensors());
                 return Invocation{run_args(ck), false, {"is F8_E4M3", "no quantization_config"}};
               }});

  // ---- Flags: every numeric flag has a range; the text is parsed exactly.
  c.push_back(flag_case("num_experts_negative", {"run", "--num-experts", "-1"}, {"--num-experts", "-1 is outside"}));
  c.push_back(flag_case("threads_negative", {"run", "--threads", "-5"}, {"--threads", "-5 is outside"}));
  c.push_back(flag_case("seed_negative", {"run", "--seed", "-1"}, {"--seed", "'-1' is not a non-negative integer"}));
  c.push_back(
      flag_case("seed_past_2_64", {"bench", "layer", "--seed", "18446744073709551616"}, {"--seed", "is outside"}));
  c.push_back(flag_case("tolerance_nan", {"run", "--tolerance", "nan"}, {"--tolerance", "nan is not a finite number"}));
  c.push_back(flag_case("tolerance_inf", {"run", "--cpu-tolerance", "inf"}, {"--cpu-tolerance", "not a finite"}));
  c.push_back(flag_case("steps_zero", {"run", "--steps", "0"}, {"--steps", "0 is outside"}));
  c.push_back(flag_case("steps_float", {"run", "--steps", "1e3"}, {"--steps", "'1e3' is not an integer"}));
  c.push_back(flag_case("dp_zero", {"plan", "--dp", "0"}, {"--dp", "0 is outside"}));
  c.push_back(flag_case("local_experts_negative", {"plan", "--local-experts", "-3"}, {"--local-experts"}));
  c.push_back(flag_case("step_tokens_negative", {"plan", "--step-tokens", "-1"}, {"--step-tokens"}));
  c.push_back(flag_case("gpu_memory_nan", {"plan", "--gpu-memory", "nanGiB"}, {"byte count 'nanGiB'"}));
  c.push_back(flag_case("gpu_memory_1e999", {"plan", "--gpu-memory", "1e999GiB"}, {"'1e999GiB'"}));
  c.push_back(flag_case("iters_zero", {"bench", "layer", "--iters", "0"}, {"--iters", "0 is outside"}));
  c.push_back(flag_case("tokens_negative", {"bench", "layer", "--tokens", "1,-8"}, {"--tokens", "-8 is outside"}));
  c.push_back({"flags", "layers_past_2_63", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors());
                 return Invocation{
                     run_args(ck, {"--layers", "99999999999999999999"}), false, {"--layers '99999999999999999999'"}};
               }});

  // ---- Controls: the same checkpoints, whole, run and plan; Hugging Face's cache layout (a snapshot
  // of symlinks into blobs/) is followed.
  c.push_back({"controls", "qwen_bf16_runs_checked", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kQwenConfig, qwen_tensors(), true);
                 return Invocation{run_args(ck, {"--check"}), true, {"check layer 0: relative error vs float64"}};
               }});
  c.push_back({"controls", "deepseek_fp8_runs_checked", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kDeepseekConfig, deepseek_tensors());
                 return Invocation{run_args(ck, {"--check"}), true, {"loaded as stored (block128)", "check layer 0"}};
               }});
  c.push_back({"controls", "hf_cache_symlinks_followed", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "blobs_src", kQwenConfig, qwen_tensors(), true);
                 const fs::path snap = d / "snapshots" / "rev";
                 fs::create_directories(snap);
                 fs::create_directories(d / "blobs");
                 for (const auto& f : fs::directory_iterator(ck)) {
                   const fs::path blob = d / "blobs" / ("hash-" + f.path().filename().string());
                   fs::rename(f.path(), blob);
                   fs::create_symlink(fs::path("../..") / "blobs" / blob.filename(), snap / f.path().filename());
                 }
                 return Invocation{run_args(snap), true, {"checkpoint: " + snap.string(), "step   0"}};
               }});
  c.push_back({"controls", "plan_checkpoint_whole", [](const fs::path& d) {
                 const fs::path ck = write_checkpoint(d / "ck", kDeepseekConfig, deepseek_tensors(), true);
                 return Invocation{plan_args(ck), true, {"whole model per GPU: 1 MoE layers"}};
               }});
  return c;
}

// ---- The suite ------------------------------------------------------------------------------------

// gtest names a failed case by this, not by the Case's bytes.
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.klass << " / " << c.name;
}

struct Counts {
  int tried = 0, refused = 0, accepted = 0, other = 0;
  std::map<std::string, std::pair<int, int>> by_class;  // class -> (as expected, tried)
  std::map<std::string, int> other_kinds;               // what "anything else" was
  double slowest = 0;
  std::string slowest_name;
  long largest_rss_kb = 0;
};

Counts& counts() {
  static Counts c;
  return c;
}

class Summary : public ::testing::Environment {
 public:
  void TearDown() override {
    const Counts& c = counts();
    std::string classes;
    for (const auto& [k, v] : c.by_class)
      classes += fmt::format("{}{} {}/{}", classes.empty() ? "" : ", ", k, v.first, v.second);
    std::string kinds;
    for (const auto& [k, v] : c.other_kinds) kinds += fmt::format("{}{} {}", kinds.empty() ? " (" : ", ", v, k);
    if (!kinds.empty()) kinds += ")";
    std::printf(
        "hostile inputs: %d tried, %d refused by name, %d accepted (controls), %d anything else%s\n"
        "  as expected by class: %s\n  slowest %.2f s (%s), largest child %.0f MiB\n",
        c.tried, c.refused, c.accepted, c.other, kinds.c_str(), classes.c_str(), c.slowest, c.slowest_name.c_str(),
        static_cast<double>(c.largest_rss_kb) / 1024.0);
    std::fflush(stdout);
  }
};
const auto* const kSummary = ::testing::AddGlobalTestEnvironment(new Summary);

class Hostile : public ::testing::TestWithParam<Case> {};

TEST_P(Hostile, RefusedByNameOrRunsAsAControl) {
  const Case& k = GetParam();
  const fs::path dir = fs::temp_directory_path() / ("moekit_hostile_" + std::to_string(::getpid())) / k.name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const Invocation inv = k.make(dir);
  const Outcome r = run_cli(inv.args, dir, inv.huge_stacks);
  std::string why, kind;  // empty: as expected
  if (r.timed_out) {
    why = fmt::format("timed out after {} s", kTimeLimitSeconds);
    kind = "hung";
  } else if (r.signal != 0) {
    why = fmt::format("killed by signal {} ({})", r.signal, strsignal(r.signal));
    kind = "killed by a signal";
  } else if (inv.accept && r.exit_code != 0) {
    why = fmt::format("a control exited {}", r.exit_code);
    kind = "controls refused";
  } else if (!inv.accept && r.exit_code == 0) {
    why = "accepted silently";
    kind = "accepted silently";
  } else if (!inv.accept && r.exit_code != 1 && r.exit_code != 2) {
    why = fmt::format("exit code {} (1: refused, 2: usage; 4: internal error)", r.exit_code);
    kind = "exited otherwise";
  } else if (!inv.accept && r.max_rss_kb > kMaxRefusalRssKb) {
    why = fmt::format("refused only after growing to {} MiB", r.max_rss_kb / 1024);
    kind = "refused after allocating";
  }
  if (why.empty()) {
    for (const std::string& e : inv.expect)
      if ((inv.accept ? r.out : r.err).find(e) == std::string::npos) why += fmt::format("does not say \"{}\"; ", e);
    if (!why.empty()) kind = inv.accept ? "controls without their output" : "refused naming another cause";
  }
  Counts& c = counts();
  ++c.tried;
  auto& cls = c.by_class[k.klass];
  ++cls.second;
  if (r.seconds > c.slowest) {
    c.slowest = r.seconds;
    c.slowest_name = k.name;
  }
  c.largest_rss_kb = std::max(c.largest_rss_kb, r.max_rss_kb);
  if (why.empty()) {
    ++(inv.accept ? c.accepted : c.refused);
    ++cls.first;
    fs::remove_all(dir);
  } else {
    ++c.other;
    ++c.other_kinds[kind];
  }
  std::string cmd = "moekit";
  for (const std::string& a : inv.args) cmd += " " + (a.size() > 120 ? a.substr(0, 117) + "..." : a);
  EXPECT_TRUE(why.empty()) << k.klass << " / " << k.name << ": " << why << "\n  $ " << cmd << "\n  exit " << r.exit_code
                           << " in " << r.seconds << " s, " << r.max_rss_kb / 1024
                           << " MiB\n  stderr: " << r.err.substr(0, 2000) << "\n  stdout: " << r.out.substr(0, 600);
}

INSTANTIATE_TEST_SUITE_P(Cases, Hostile, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return testing::test_name(i.param.name); });

}  // namespace
}  // namespace moekit
