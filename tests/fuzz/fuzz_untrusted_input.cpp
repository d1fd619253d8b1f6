// The fuzz target of moekit's untrusted input: one input is a config.json (first byte '0' mod 3), a
// checkpoint index ('1') or a safetensors file ('2'), read as moekit reads them. Each is accepted or
// refused by a moekit::Error that names the file; anything else (another exception, a refusal that
// does not name the file, a crash, a leak, ASan or UBSan's finding) aborts, so the fuzzer keeps it.
// Under clang: libFuzzer (tests/fuzz/CMakeLists.txt, MOEKIT_FUZZ); elsewhere the seeded mutation
// loop of mutation_driver.cpp runs the same entry point. Counts print at exit.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/safetensors.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/problem.h"
#include "moekit/weights.h"

namespace {

struct Counts {
  long tried[3] = {0, 0, 0}, accepted = 0, refused = 0;
};
Counts counts;

void print_counts() {
  std::printf(
      "fuzz: %ld inputs tried (config.json %ld, index %ld, safetensors %ld): %ld accepted, %ld refused by name, 0 "
      "anything else\n",
      counts.tried[0] + counts.tried[1] + counts.tried[2], counts.tried[0], counts.tried[1], counts.tried[2],
      counts.accepted, counts.refused);
  std::fflush(stdout);
}

[[noreturn]] void anything_else(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz: %s: %s\n", what, detail.c_str());
  std::abort();
}

// A config.json through the architecture table, then the problem and bytes it plans (parsed: the
// parse is done, later refusals name values, not the file).
void config(const std::string& text, bool& parsed) {
  const moekit::ModelConfig m = moekit::parse_model_config(text, "fuzz/config.json");
  parsed = true;
  const moekit::MoeProblem p = moekit::make_problem(m, {1, 1, 16, 0}, moekit::ActivationFormat::kBatchedExperts,
                                                    moekit::QuantScheme::kPerTokenPerChannel, m.activation);
  (void)moekit::expert_weight_bytes(p);
  (void)moekit::shared_experts_problem(m, p);
}

void index(const std::string& text) {
  (void)moekit::checkpoint::parse_index(text, "fuzz/model.safetensors.index.json");
}

// A safetensors file: its header, then every tensor's bytes read (ASan sees a read outside them).
void safetensors(std::vector<std::byte> bytes) {
  const moekit::checkpoint::SafetensorsFile st(std::move(bytes), "fuzz/model.safetensors");
  std::uint64_t sum = 0;
  for (const auto& t : st.tensors())
    for (const std::byte b : st.data(t)) sum += static_cast<std::uint8_t>(b);
  if (sum == 1) std::fputs("", stdout);  // keeps the reads
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::atexit(print_counts);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int kind = data[0] % 3;
  static const char* const kSource[3] = {"fuzz/config.json", "fuzz/model.safetensors.index.json",
                                         "fuzz/model.safetensors"};
  ++counts.tried[kind];
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  // Parsing must refuse by naming the file; what the config plans afterwards may refuse by its values.
  bool parsed = false;
  try {
    if (kind == 0) {
      config(text, parsed);
    } else if (kind == 1) {
      index(text);
    } else {
      std::vector<std::byte> bytes(size - 1);
      if (size > 1) std::memcpy(bytes.data(), data + 1, size - 1);
      safetensors(std::move(bytes));
    }
    ++counts.accepted;
  } catch (const moekit::Error& e) {
    if (!parsed && std::strstr(e.what(), kSource[kind]) == nullptr)
      anything_else("a refusal that does not name the file", e.what());
    ++counts.refused;
  } catch (const std::exception& e) {
    anything_else("not a moekit::Error", e.what());
  }
  return 0;
}
