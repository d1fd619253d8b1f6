// Names and sizes of the vocabulary types; parsers accept the CLI spellings and raise moekit::Error
// listing the valid names otherwise.
#include "moekit/types.h"

#include <array>
#include <cmath>
#include <utility>

#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/recipe.h"

namespace moekit {
namespace {

template <class Enum, std::size_t N>
Enum parse_named(std::string_view name, const std::array<std::pair<std::string_view, Enum>, N>& table,
                 std::string_view kind) {
  std::string valid;
  for (const auto& [text, value] : table) {
    if (text == name) return value;
    valid += (valid.empty() ? "" : ", ") + std::string(text);
  }
  MOEKIT_FAIL("unknown {} '{}': valid names are {}", kind, name, valid);
}

template <class Enum, std::size_t N>
std::string_view name_of(Enum value, const std::array<std::pair<std::string_view, Enum>, N>& table) {
  for (const auto& [text, v] : table)
    if (v == value) return text;
  MOEKIT_FAIL("enum value {} has no name", static_cast<int>(value));
}

constexpr std::array<std::pair<std::string_view, Device>, 2> kDevices{{
    {"cpu", Device::kCpu},
    {"cuda", Device::kCuda},
}};

constexpr std::array<std::pair<std::string_view, ActivationFormat>, 2> kFormats{{
    {"standard", ActivationFormat::kStandard},
    {"batched", ActivationFormat::kBatchedExperts},
}};

constexpr std::array<std::pair<std::string_view, Activation>, 7> kActivations{{
    {"silu", Activation::kSilu},
    {"gelu", Activation::kGelu},
    {"gelu_tanh", Activation::kGeluTanh},
    {"swigluoai", Activation::kSwigluOai},
    {"relu2", Activation::kRelu2},
    {"silu_no_mul", Activation::kSiluNoMul},
    {"gelu_no_mul", Activation::kGeluNoMul},
}};
// Other names engines pass for the same functions (vLLM's fused-MoE activation names).
constexpr std::array<std::pair<std::string_view, Activation>, 1> kActivationAliases{{
    {"relu2_no_mul", Activation::kRelu2},
}};

// The recipes' names, from their rows (moekit/recipe.h).
constexpr std::array<std::pair<std::string_view, QuantScheme>, kNumRecipes> make_quant_names() {
  std::array<std::pair<std::string_view, QuantScheme>, kNumRecipes> names{};
  for (int i = 0; i < kNumRecipes; ++i) names[i] = {kRecipes[i].name, kRecipes[i].scheme};
  return names;
}
constexpr std::array<std::pair<std::string_view, QuantScheme>, kNumRecipes> kQuants = make_quant_names();

constexpr std::array<std::pair<std::string_view, Accumulation>, 2> kAccumulations{{
    {"precise", Accumulation::kPrecise},
    {"fast", Accumulation::kFast},
}};

}  // namespace

std::string_view device_name(Device device) {
  return name_of(device, kDevices);
}

Device parse_device(std::string_view name) {
  return parse_named(name, kDevices, "device");
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFp8E4m3: return "fp8_e4m3";
    case DType::kBf16: return "bf16";
    case DType::kFp16: return "fp16";
    case DType::kFp32: return "fp32";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUint8: return "uint8";
    case DType::kPtr: return "ptr";
  }
  MOEKIT_FAIL("unknown dtype {}", static_cast<int>(dtype));
}

std::string_view format_name(ActivationFormat format) {
  return name_of(format, kFormats);
}
ActivationFormat parse_format(std::string_view name) {
  return parse_named(name, kFormats, "activation format");
}

std::string_view activation_name(Activation act) {
  return name_of(act, kActivations);
}
Activation parse_activation(std::string_view name) {
  for (const auto& [alias, act] : kActivationAliases)
    if (alias == name) return act;
  return parse_named(name, kActivations, "activation");
}

bool is_gated(Activation act) {
  switch (act) {
    case Activation::kSilu:
    case Activation::kGelu:
    case Activation::kGeluTanh:
    case Activation::kSwigluOai: return true;
    case Activation::kRelu2:
    case Activation::kSiluNoMul:
    case Activation::kGeluNoMul: return false;
  }
  MOEKIT_FAIL("unknown activation {}", static_cast<int>(act));
}

std::int64_t activation_out_dim(Activation act, std::int64_t N) {
  MOEKIT_CHECK(N > 0, "W1 output width N = {} must be positive", N);
  if (!is_gated(act)) return N;
  MOEKIT_CHECK(N % 2 == 0, "gated activation {} needs an even W1 output width N (gate and up halves), got N = {}",
               activation_name(act), N);
  return N / 2;
}

const std::vector<Activation>& all_activations() {
  static const std::vector<Activation> all = [] {
    std::vector<Activation> v;
    for (const auto& [name, act] : kActivations) v.push_back(act);
    return v;
  }();
  return all;
}

std::string_view quant_name(QuantScheme quant) {
  return name_of(quant, kQuants);
}
QuantScheme parse_quant(std::string_view name) {
  return parse_named(name, kQuants, "quantization scheme");
}

std::string_view accumulation_name(Accumulation accumulation) {
  return name_of(accumulation, kAccumulations);
}
Accumulation parse_accumulation(std::string_view name) {
  return parse_named(name, kAccumulations, "accumulation");
}

void validate_swiglu(double limit, double alpha, std::string_view where) {
  MOEKIT_CHECK(std::isfinite(limit) && limit > 0 && limit <= limits::kMaxSwigluLimit,
               "{}: field 'swiglu_limit' = {} must be a finite number in (0, {}] (swigluoai's clamp of the gate and "
               "the up projection; gpt-oss: 7; moekit/limits.h)",
               where, limit, limits::kMaxSwigluLimit);
  MOEKIT_CHECK(std::isfinite(alpha) && alpha > 0 && alpha <= limits::kMaxSwigluAlpha,
               "{}: field 'swiglu_alpha' = {} must be a finite number in (0, {}] (swigluoai's gate * sigmoid(alpha * "
               "gate); gpt-oss: 1.702; moekit/limits.h)",
               where, alpha, limits::kMaxSwigluAlpha);
}

const std::vector<QuantScheme>& all_quant_schemes() {
  static const std::vector<QuantScheme> all = [] {
    std::vector<QuantScheme> schemes;
    for (const RecipeInfo& r : kRecipes) schemes.push_back(r.scheme);
    return schemes;
  }();
  return all;
}

}  // namespace moekit
