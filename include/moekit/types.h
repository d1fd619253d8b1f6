// Vocabulary types of the MoE problem: dtypes, activation formats, activations and quantization
// schemes, each with a parser and a printer that use the names of DESIGN.md (and of the CLI).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moekit {

// Where a seam runs and its memory lives. kCuda: the current CUDA device of the calling thread.
enum class Device : std::uint8_t { kCpu, kCuda };
std::string_view device_name(Device device);
Device parse_device(std::string_view name);

enum class DType : std::uint8_t { kFp8E4m3, kBf16, kFp16, kFp32, kInt32, kInt64, kUint8, kPtr };

// Bytes per element. kPtr is a device pointer (8 bytes on every supported target). constexpr, so
// that device code (the dispatch's record layout, plan/ep_layout.h) reads the same figure.
constexpr std::int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFp8E4m3:
    case DType::kUint8: return 1;
    case DType::kBf16:
    case DType::kFp16: return 2;
    case DType::kFp32:
    case DType::kInt32: return 4;
    case DType::kInt64:
    case DType::kPtr: return 8;
  }
  return 0;  // not a DType
}
std::string_view dtype_name(DType dtype);
// The unquantized recipes' 2-byte floats: bf16 and fp16.
constexpr bool is_sixteen_bit(DType dtype) {
  return dtype == DType::kBf16 || dtype == DType::kFp16;
}

// Standard: (M, K) hidden states + topk ids/weights; experts permute rows themselves.
// BatchedExperts: (E_local, M, K), one buffer of M rows per local expert, plus expert_num_tokens.
enum class ActivationFormat : std::uint8_t { kStandard, kBatchedExperts };
std::string_view format_name(ActivationFormat format);
ActivationFormat parse_format(std::string_view name);

// Gated activations read N = 2*I columns (gate, up) and write I; non-gated read and write N.
// parse_activation also takes the other names engines use (relu2_no_mul: relu2).
enum class Activation : std::uint8_t { kSilu, kGelu, kGeluTanh, kSwigluOai, kRelu2, kSiluNoMul, kGeluNoMul };
std::string_view activation_name(Activation act);
Activation parse_activation(std::string_view name);
bool is_gated(Activation act);
// Columns the activation writes for a W1 output of width N (N/2 when gated; N must then be even).
std::int64_t activation_out_dim(Activation act, std::int64_t N);
const std::vector<Activation>& all_activations();
// swigluoai's parameters, gpt-oss's config.swiglu_limit and config.swiglu_alpha (transformers'
// GptOssConfig defaults, the released models' values): with g = min(gate, limit) and
// u = clamp(up, -limit, limit), out = (u + 1) * g * sigmoid(alpha * g). One value travels from the
// config through the problem to the CPU, the CUDA kernels and the float64 reference; the other
// activations ignore it.
inline constexpr float kDefaultSwigluLimit = 7.0f;
inline constexpr float kDefaultSwigluAlpha = 1.702f;
struct SwigluOaiParams {
  float limit = kDefaultSwigluLimit;  // the gate's clamp above, the up projection's on both sides
  float alpha = kDefaultSwigluAlpha;  // gate * sigmoid(alpha * gate)
  bool operator==(const SwigluOaiParams&) const = default;
};
// Raises moekit::Error unless swiglu_limit and swiglu_alpha are each finite and in (0, their bound]
// (moekit/limits.h), naming `where` (a config file, the problem, an op), the field, the value and the
// bound. Doubles: a config's numbers are checked before they become floats.
void validate_swiglu(double limit, double alpha, std::string_view where);
inline void validate_swiglu(const SwigluOaiParams& swiglu, std::string_view where) {
  validate_swiglu(swiglu.limit, swiglu.alpha, where);
}

// The experts' numeric recipe (moekit/recipe.h has one row of facts for each). The FP8 ones quantize
// activations and weights with fp32 scales; kBf16 and kFp16 quantize nothing.
//   kPerTensor:          one scale per activation tensor (per expert) x one per weight tensor.
//   kPerTokenPerChannel: one scale per activation row x one per weight output channel.
//   kBlock128:           one scale per 1x128 activation group x one per 128x128 weight block.
//   kBf16:               bf16 activations and weights as they are, no scales, fp32 sums.
//   kFp16:               the same in fp16 (fp16 checkpoints' own precision).
enum class QuantScheme : std::uint8_t { kPerTensor, kPerTokenPerChannel, kBlock128, kBf16, kFp16 };
std::string_view quant_name(QuantScheme quant);
QuantScheme parse_quant(std::string_view name);
const std::vector<QuantScheme>& all_quant_schemes();
inline constexpr std::int64_t kQuantBlock = 128;

// How an FP8 GEMM sums over K on a GPU. Hopper's FP8 tensor-core instructions keep about 14 bits of
// their running sum (DeepSeek-V3's report; measured here: all-positive products at K = 7168 came
// out 12-21% low when left in them for the whole K loop).
//   kPrecise: the partial sums move into an fp32 accumulator every 128 elements of K (per-token,
//             per-tensor: CUTLASS's FP8 promotion; block128 does it in its per-k-block scale step).
//   kFast:    per-token and per-tensor keep the whole K loop in the tensor cores (CUTLASS's
//             FP8FastAccum): faster, and 12-21% low at K = 7168 on all-positive products.
//             block128 has no fast form. The CPU accumulates in fp32 under either.
enum class Accumulation : std::uint8_t { kPrecise, kFast };
std::string_view accumulation_name(Accumulation accumulation);
Accumulation parse_accumulation(std::string_view name);

}  // namespace moekit
