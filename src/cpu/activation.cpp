// The MoE activations on the CPU: numerics/activation.h evaluated in float (from bf16 or fp32) and in
// double.
#include "cpu/activation.h"

#include "moekit/recipe.h"

#include "moekit/check.h"
#include "numerics/activation.h"

namespace moekit::cpu {
namespace {

// One output row of width out_dim from one input row; load(i) reads input column i as T.
template <typename T, typename Load>
void activation_row(Activation act, W1Rows w1, std::int64_t out_dim, Load load, T* out, SwigluOaiParams swiglu) {
  for (std::int64_t c = 0; c < out_dim; ++c)
    out[c] =
        activation_value<T, HostMath>(act, load(gate_column(w1, out_dim, c)), load(up_column(w1, out_dim, c)), swiglu);
}

// Block pairs hold whole 128-row blocks: I must be a multiple of 128 (as block128 problems are).
void check_block_pairs(Activation act, QuantScheme quant, std::int64_t I) {
  MOEKIT_CHECK(w1_rows(act, quant) != W1Rows::kBlockPairs || I % kQuantBlock == 0,
               "{} under block128 reads W1 rows in block pairs: I = {} must be a multiple of 128", activation_name(act),
               I);
}

template <typename In, typename Decode>
void activation_rows_of(Activation act, const In* in, std::int64_t rows, std::int64_t N, std::int64_t ld_in, float* out,
                        std::int64_t ld_out, QuantScheme quant, SwigluOaiParams swiglu, Decode decode) {
  const std::int64_t out_dim = activation_out_dim(act, N);  // checks N > 0, and N even when gated
  MOEKIT_CHECK(rows >= 0, "activation_rows: rows = {} must be >= 0", rows);
  MOEKIT_CHECK(ld_in >= N, "activation_rows: input stride ld_in = {} is below N = {}; pass ld_in >= N", ld_in, N);
  MOEKIT_CHECK(ld_out >= out_dim,
               "activation_rows: output stride ld_out = {} is below the output width {} ({} of N = {})", ld_out,
               out_dim, activation_name(act), N);
  MOEKIT_CHECK(rows == 0 || (in != nullptr && out != nullptr), "activation_rows: null in or out with rows = {}", rows);
  check_block_pairs(act, quant, out_dim);
  validate_swiglu(swiglu, "activation");
  for (std::int64_t r = 0; r < rows; ++r) {
    const In* row = in + r * ld_in;
    activation_row<float>(
        act, w1_rows(act, quant), out_dim, [row, decode](std::int64_t i) { return decode(row[i]); }, out + r * ld_out,
        swiglu);
  }
}

}  // namespace

void activation_rows(Activation act, const bf16_t* in, std::int64_t rows, std::int64_t N, std::int64_t ld_in,
                     float* out, std::int64_t ld_out, QuantScheme quant, SwigluOaiParams swiglu) {
  // W1's output in the recipe's intermediate dtype: bf16, or fp16 for the fp16 recipe.
  if (recipe_info(quant).intermediate_dtype == DType::kFp16)
    activation_rows_of(act, in, rows, N, ld_in, out, ld_out, quant, swiglu,
                       [](std::uint16_t x) { return fp16_decode(x); });
  else
    activation_rows_of(act, in, rows, N, ld_in, out, ld_out, quant, swiglu, [](bf16_t x) { return bf16_decode(x); });
}

void activation_rows(Activation act, const float* in, std::int64_t rows, std::int64_t N, std::int64_t ld_in, float* out,
                     std::int64_t ld_out, QuantScheme quant, SwigluOaiParams swiglu) {
  activation_rows_of(act, in, rows, N, ld_in, out, ld_out, quant, swiglu, [](float x) { return x; });
}

void activation_row_ref(Activation act, const double* in, std::int64_t N, double* out, QuantScheme quant,
                        SwigluOaiParams swiglu) {
  const std::int64_t out_dim = activation_out_dim(act, N);
  MOEKIT_CHECK(in != nullptr && out != nullptr, "activation_row_ref: null in or out");
  check_block_pairs(act, quant, out_dim);
  validate_swiglu(swiglu, "activation");
  activation_row<double>(
      act, w1_rows(act, quant), out_dim, [in](std::int64_t i) { return in[i]; }, out, swiglu);
}

}  // namespace moekit::cpu
