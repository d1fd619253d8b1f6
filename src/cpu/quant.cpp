// FP8 e4m3fn quantization on the CPU: one fp32 scale per group (tensor, row/channel, 1x128 slice,
// 128x128 block), scale = fp8_scale(amax), q = fp8_encode(x / scale). Two passes per group: amax, encode.
// The GPU quantization kernels are checked against this bit for bit (same division, same rounding).
#include "cpu/quant.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "moekit/check.h"

namespace moekit::cpu {
namespace {

inline float to_float(float x) {
  return x;
}
inline float to_float(bf16_t x) {
  return bf16_decode(x);
}

// Largest |x| over [x, x + len). std::max(m, nan) keeps m, so NaNs do not poison the scale.
template <typename T>
float amax_of(const T* x, std::int64_t len) {
  float m = 0.0f;
  for (std::int64_t i = 0; i < len; ++i) m = std::max(m, std::fabs(to_float(x[i])));
  return m;
}

template <typename T>
void encode(const T* x, std::int64_t len, float scale, fp8_t* q) {
  for (std::int64_t i = 0; i < len; ++i) q[i] = fp8_encode(to_float(x[i]) / scale);
}

void check_activation_args(const char* what, std::int64_t rows, std::int64_t cols, std::int64_t ldx, std::int64_t ldq,
                           const void* x, const void* q, const float* scales, bool scaled = true) {
  MOEKIT_CHECK(rows >= 0, "{}: rows = {} must be >= 0 (0 tokens is allowed)", what, rows);
  MOEKIT_CHECK(cols > 0, "{}: cols = {} must be > 0 (the hidden size K or the width I)", what, cols);
  MOEKIT_CHECK(ldx >= cols, "{}: input row stride ldx = {} is below cols = {}; pass ldx >= cols", what, ldx, cols);
  MOEKIT_CHECK(ldq >= cols, "{}: output row stride ldq = {} is below cols = {}; pass ldq >= cols", what, ldq, cols);
  MOEKIT_CHECK(rows == 0 || (x != nullptr && q != nullptr), "{}: null input or output pointer with rows = {}", what,
               rows);
  MOEKIT_CHECK(!scaled || scales != nullptr, "{}: scales is null; it needs activation_scale_count() floats", what);
}

template <typename T>
void quantize_activation_impl(QuantScheme quant, const T* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                              fp8_t* q, std::int64_t ldq, float* scales) {
  check_activation_args("quantize_activation", rows, cols, ldx, ldq, x, q, scales);
  switch (quant) {
    case QuantScheme::kPerTensor: {
      float amax = 0.0f;
      for (std::int64_t r = 0; r < rows; ++r) amax = std::max(amax, amax_of(x + r * ldx, cols));
      const float scale = fp8_scale(amax);
      scales[0] = scale;
      for (std::int64_t r = 0; r < rows; ++r) encode(x + r * ldx, cols, scale, q + r * ldq);
      return;
    }
    case QuantScheme::kPerTokenPerChannel: {
      for (std::int64_t r = 0; r < rows; ++r) {
        const float scale = fp8_scale(amax_of(x + r * ldx, cols));
        scales[r] = scale;
        encode(x + r * ldx, cols, scale, q + r * ldq);
      }
      return;
    }
    case QuantScheme::kBlock128: {
      const std::int64_t groups_per_row = ceil_div(cols, kQuantBlock);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t g = 0; g < groups_per_row; ++g) {
          const std::int64_t c0 = g * kQuantBlock;
          const std::int64_t len = std::min(kQuantBlock, cols - c0);  // the last group may be shorter
          const T* xg = x + r * ldx + c0;
          const float scale = fp8_scale(amax_of(xg, len));
          scales[r * groups_per_row + g] = scale;
          encode(xg, len, scale, q + r * ldq + c0);
        }
      }
      return;
    }
    case QuantScheme::kBf16:
    case QuantScheme::kFp16: break;
  }
  MOEKIT_FAIL("quantize_activation: {} is not an FP8 recipe (scheme {}): its rows are stored with store_activation",
              recipe_info(quant).name != nullptr ? recipe_info(quant).name : "?", static_cast<int>(quant));
}

template <typename T>
void store_activation_impl(QuantScheme quant, const T* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                           std::uint8_t* q, std::int64_t ldq, float* scales) {
  const RecipeInfo recipe = recipe_info(quant);
  if (has_activation_scales(recipe)) {
    quantize_activation_impl(quant, x, rows, cols, ldx, q, ldq, scales);
    return;
  }
  check_activation_args("store_activation", rows, cols, ldx, ldq, x, q, scales, false);
  MOEKIT_CHECK(is_sixteen_bit(recipe.activation_dtype),
               "store_activation: recipe {} stores {} activations; the CPU stores bf16 or fp16 ones",
               recipe.name != nullptr ? recipe.name : "?", dtype_name(recipe.activation_dtype));
  const bool fp16 = recipe.activation_dtype == DType::kFp16;
  auto* out = reinterpret_cast<std::uint16_t*>(q);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      if constexpr (std::is_same_v<T, bf16_t>) {
        // bf16 tokens: as they are, bit for bit; into fp16 rounded once (past 65504: inf, as .half()).
        out[r * ldq + c] = fp16 ? fp16_encode(bf16_decode(x[r * ldx + c])) : x[r * ldx + c];
      } else {
        out[r * ldq + c] = encode16(x[r * ldx + c], fp16);
      }
    }
}

}  // namespace

void quantize_activation(QuantScheme quant, const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                         fp8_t* q, std::int64_t ldq, float* scales) {
  quantize_activation_impl(quant, x, rows, cols, ldx, q, ldq, scales);
}

void quantize_activation(QuantScheme quant, const bf16_t* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                         fp8_t* q, std::int64_t ldq, float* scales) {
  quantize_activation_impl(quant, x, rows, cols, ldx, q, ldq, scales);
}

void store_activation(QuantScheme quant, const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                      std::uint8_t* q, std::int64_t ldq, float* scales) {
  store_activation_impl(quant, x, rows, cols, ldx, q, ldq, scales);
}

void store_activation(QuantScheme quant, const bf16_t* x, std::int64_t rows, std::int64_t cols, std::int64_t ldx,
                      std::uint8_t* q, std::int64_t ldq, float* scales) {
  store_activation_impl(quant, x, rows, cols, ldx, q, ldq, scales);
}

void quantize_weight(QuantScheme quant, const float* w, std::int64_t n, std::int64_t k, fp8_t* q, float* scales) {
  MOEKIT_CHECK(n > 0 && k > 0, "quantize_weight: weight shape ({}, {}) needs n > 0 and k > 0", n, k);
  MOEKIT_CHECK(w != nullptr && q != nullptr && scales != nullptr,
               "quantize_weight: null weight, code or scale pointer");
  switch (quant) {
    case QuantScheme::kPerTensor:
      // A channel is a row, so per-tensor is the per-activation-tensor case with rows = n.
      quantize_activation_impl(QuantScheme::kPerTensor, w, n, k, k, q, k, scales);
      return;
    case QuantScheme::kPerTokenPerChannel:
      quantize_activation_impl(QuantScheme::kPerTokenPerChannel, w, n, k, k, q, k, scales);
      return;
    case QuantScheme::kBlock128: {
      // NOTES: a block row (128 rows x k) is walked row by row, so each pass streams contiguous memory:
      // pass 1 folds every row's 128-wide segments into the amax of their blocks, pass 2 encodes.
      // DeepSeek-V3 W1 of 8 experts is 8 x 4096 x 7168 x 4 B = 940 MB read twice at startup.
      const std::int64_t kb_count = ceil_div(k, kQuantBlock);
      std::vector<float> amax(static_cast<std::size_t>(kb_count));
      for (std::int64_t n0 = 0; n0 < n; n0 += kQuantBlock) {
        const std::int64_t n1 = std::min(n, n0 + kQuantBlock);  // edge blocks may be partial
        std::fill(amax.begin(), amax.end(), 0.0f);
        for (std::int64_t row = n0; row < n1; ++row) {
          for (std::int64_t kb = 0; kb < kb_count; ++kb) {
            const std::int64_t c0 = kb * kQuantBlock;
            auto& m = amax[static_cast<std::size_t>(kb)];
            m = std::max(m, amax_of(w + row * k + c0, std::min(kQuantBlock, k - c0)));
          }
        }
        float* block_scales = scales + (n0 / kQuantBlock) * kb_count;
        for (std::int64_t kb = 0; kb < kb_count; ++kb) block_scales[kb] = fp8_scale(amax[static_cast<std::size_t>(kb)]);
        for (std::int64_t row = n0; row < n1; ++row) {
          for (std::int64_t kb = 0; kb < kb_count; ++kb) {
            const std::int64_t c0 = kb * kQuantBlock;
            encode(w + row * k + c0, std::min(kQuantBlock, k - c0), block_scales[kb], q + row * k + c0);
          }
        }
      }
      return;
    }
    case QuantScheme::kBf16:
    case QuantScheme::kFp16: break;
  }
  MOEKIT_FAIL("quantize_weight: {} is not an FP8 recipe (scheme {}): its weights are stored as they are, not quantized",
              recipe_info(quant).name != nullptr ? recipe_info(quant).name : "?", static_cast<int>(quant));
}

void store_weight(QuantScheme quant, const float* w, std::int64_t n, std::int64_t k, std::uint8_t* q, float* scales) {
  const RecipeInfo recipe = recipe_info(quant);
  if (has_weight_scales(recipe)) {
    quantize_weight(quant, w, n, k, q, scales);
    return;
  }
  MOEKIT_CHECK(n > 0 && k > 0, "store_weight: weight shape ({}, {}) needs n > 0 and k > 0", n, k);
  MOEKIT_CHECK(w != nullptr && q != nullptr, "store_weight: null weight or output pointer");
  MOEKIT_CHECK(is_sixteen_bit(recipe.weight_dtype),
               "store_weight: recipe {} stores {} weights; the CPU stores bf16 or fp16 ones",
               recipe.name != nullptr ? recipe.name : "?", dtype_name(recipe.weight_dtype));
  auto* out = reinterpret_cast<std::uint16_t*>(q);
  if (recipe.weight_dtype == DType::kBf16) {
    for (std::int64_t i = 0; i < n * k; ++i) out[i] = bf16_encode(w[i]);
    return;
  }
  // fp16: a finite weight past fp16's range would become inf in every product: refused, not stored.
  for (std::int64_t i = 0; i < n * k; ++i) {
    out[i] = fp16_encode(w[i]);
    MOEKIT_CHECK(
        !std::isfinite(w[i]) || (out[i] & 0x7C00u) != 0x7C00u,
        "store_weight: weight value {} (row {}, column {}) is beyond fp16's largest finite {}: the fp16 recipe "
        "cannot hold it; run --quant bf16",
        w[i], i / k, i % k, kFp16Max);
  }
}

double dequant_activation(QuantScheme quant, const fp8_t* q, std::int64_t ldq, const float* scales, std::int64_t cols,
                          std::int64_t r, std::int64_t c) {
  MOEKIT_CHECK(r >= 0 && c >= 0 && c < cols, "dequant_activation: element ({}, {}) is outside rows x {} columns", r, c,
               cols);
  return static_cast<double>(fp8_decode(q[r * ldq + c])) *
         static_cast<double>(scales[activation_scale_index(quant, r, c, cols)]);
}

double dequant_weight(QuantScheme quant, const fp8_t* q, const float* scales, std::int64_t k, std::int64_t n_idx,
                      std::int64_t k_idx) {
  MOEKIT_CHECK(n_idx >= 0 && k_idx >= 0 && k_idx < k, "dequant_weight: element ({}, {}) is outside n x {} weight",
               n_idx, k_idx, k);
  return static_cast<double>(fp8_decode(q[n_idx * k + k_idx])) *
         static_cast<double>(scales[weight_scale_index(quant, n_idx, k_idx, k)]);
}

}  // namespace moekit::cpu
