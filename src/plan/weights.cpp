// The weights view: strides, per-expert views, validation against the problem, bytes.
#include "moekit/weights.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>

#include "moekit/check.h"
#include "moekit/recipe.h"
#include "moekit/workspace.h"
#include "numerics/activation.h"
#include "numerics/scales.h"

namespace moekit {

std::int64_t ExpertWeightsView::w1_scale_stride() const {
  return numerics::weight_scale_count(quant, N, K);
}

std::int64_t ExpertWeightsView::w2_scale_stride() const {
  return numerics::weight_scale_count(quant, K, I);
}

namespace {

// The arguments both arrangements take: block128's shapes, four distinct buffers (out of place).
void check_arrangement(const char* who, std::int64_t I, std::int64_t K, const void* from, const void* from_scale,
                       const void* to, const void* to_scale) {
  MOEKIT_CHECK(I > 0 && I % kQuantBlock == 0 && K > 0,
               "{}: I = {} must be a positive multiple of 128 and K = {} positive (block128)", who, I, K);
  MOEKIT_CHECK(from != nullptr && from_scale != nullptr && to != nullptr && to_scale != nullptr && from != to &&
                   from_scale != to_scale,
               "{}: four distinct non-null buffers are needed (out of place)", who);
}

}  // namespace

namespace {

// Row h of the halves (gate rows [0, I), then up rows) is this row of the block pairs; halves
// scale-block row b is block row pair_block(b) (per 256 rows: gate block, then its up block).
std::int64_t pair_row(std::int64_t I, std::int64_t h) {
  const numerics::W1Rows rows = numerics::W1Rows::kBlockPairs;
  return h < I ? numerics::gate_column(rows, I, h) : numerics::up_column(rows, I, h - I);
}
std::int64_t pair_block(std::int64_t I, std::int64_t b) {
  const std::int64_t blocks = I / kQuantBlock;
  return b < blocks ? 2 * b : 2 * (b - blocks) + 1;
}

// One expert's W1 codes and block scales between the two layouts, rows and scales moved whole.
void move_w1(std::int64_t I, std::int64_t K, const std::uint8_t* from, const float* from_scale, std::uint8_t* to,
             float* to_scale, bool to_pairs) {
  const std::int64_t k_blocks = numerics::ceil_div(K, kQuantBlock);
  for (std::int64_t h = 0; h < 2 * I; ++h) {
    const std::int64_t p = pair_row(I, h);
    std::copy_n(from + (to_pairs ? h : p) * K, K, to + (to_pairs ? p : h) * K);
  }
  for (std::int64_t b = 0; b < 2 * I / kQuantBlock; ++b) {
    const std::int64_t p = pair_block(I, b);
    std::copy_n(from_scale + (to_pairs ? b : p) * k_blocks, k_blocks, to_scale + (to_pairs ? p : b) * k_blocks);
  }
}

}  // namespace

void arrange_w1_block_pairs(std::int64_t I, std::int64_t K, const std::uint8_t* halves, const float* halves_scale,
                            std::uint8_t* pairs, float* pairs_scale) {
  check_arrangement("arrange_w1_block_pairs", I, K, halves, halves_scale, pairs, pairs_scale);
  move_w1(I, K, halves, halves_scale, pairs, pairs_scale, true);
}

void arrange_w1_halves(std::int64_t I, std::int64_t K, const std::uint8_t* pairs, const float* pairs_scale,
                       std::uint8_t* halves, float* halves_scale) {
  check_arrangement("arrange_w1_halves", I, K, pairs, pairs_scale, halves, halves_scale);
  move_w1(I, K, pairs, pairs_scale, halves, halves_scale, false);
}

bool w1_needs_block_pairs(std::string_view layout, Activation activation, QuantScheme quant) {
  MOEKIT_CHECK(layout == "gate_up" || layout == "block_pairs",
               "w1_layout = '{}': 'gate_up' (gate_proj's rows then up_proj's, as checkpoints store them) or "
               "'block_pairs' (block128's arranged layout, arrange_w1_block_pairs)",
               layout);
  const bool pairs = numerics::w1_rows(activation, quant) == numerics::W1Rows::kBlockPairs;
  MOEKIT_CHECK(layout == "gate_up" || pairs,
               "w1_layout = 'block_pairs' is block128's arranged W1 for gated activations, but this layer runs {} "
               "with {}, which reads W1 as stored: pass w1_layout='gate_up' with the checkpoint's rows",
               quant_name(quant), activation_name(activation));
  return pairs && layout == "gate_up";
}

std::int64_t ExpertWeightsView::element_bytes() const {
  return dtype_size(recipe_info(quant).weight_dtype);
}

ExpertWeightsView ExpertWeightsView::expert(std::int64_t e) const {
  MOEKIT_CHECK(e >= 0 && e < E_local, "expert {} is outside the view's [0, {})", e, E_local);
  ExpertWeightsView v = *this;
  v.E_local = 1;
  v.w1 = w1 + e * N * K * element_bytes();
  v.w2 = w2 + e * K * I * element_bytes();
  if (w1_scale != nullptr) v.w1_scale = w1_scale + e * w1_scale_stride();
  if (w2_scale != nullptr) v.w2_scale = w2_scale + e * w2_scale_stride();
  if (w1_bias != nullptr) v.w1_bias = w1_bias + e * N;
  if (w2_bias != nullptr) v.w2_bias = w2_bias + e * K;
  return v;
}

ExpertWeightsView ExpertWeightsView::of(const MoeProblem& p, Device device, const std::uint8_t* w1,
                                        const float* w1_scale, const std::uint8_t* w2, const float* w2_scale) {
  ExpertWeightsView v;
  v.device = device;
  v.quant = p.quant;
  v.E_local = p.E_local;
  v.N = p.N;
  v.K = p.K;
  v.I = p.I();
  v.w1 = w1;
  v.w1_scale = w1_scale;
  v.w2 = w2;
  v.w2_scale = w2_scale;
  return v;
}

void validate_weights(const ExpertWeightsView& w, const MoeProblem& p, Device device) {
  MOEKIT_CHECK(w.device == device,
               "the expert weights are on the {} but the experts run on the {}: pass weights in {} memory",
               device_name(w.device), device_name(device), device_name(device));
  MOEKIT_CHECK(w.quant == p.quant,
               "the expert weights are quantized {} but the layer runs {}: requantize them or pass --quant {}",
               quant_name(w.quant), quant_name(p.quant), quant_name(w.quant));
  MOEKIT_CHECK(
      w.E_local == p.E_local && w.N == p.N && w.K == p.K && w.I == p.I(),
      "the expert weights hold E_local = {}, N = {}, K = {}, I = {}; the problem needs E_local = {}, N = {}, K "
      "= {}, I = {} ({})",
      w.E_local, w.N, w.K, w.I, p.E_local, p.N, p.K, p.I(), activation_name(p.activation));
  // An unquantized recipe's weights carry no scales (their pointers may be null, and are not read).
  const bool scaled = has_weight_scales(recipe_info(p.quant));
  MOEKIT_CHECK(w.w1 != nullptr && w.w2 != nullptr && (!scaled || (w.w1_scale != nullptr && w.w2_scale != nullptr)),
               "the expert weights view has a null pointer (w1 {}, w1_scale {}, w2 {}, w2_scale {})",
               static_cast<const void*>(w.w1), static_cast<const void*>(w.w1_scale), static_cast<const void*>(w.w2),
               static_cast<const void*>(w.w2_scale));
  if (p.expert_bias)
    MOEKIT_CHECK(w.w1_bias != nullptr && w.w2_bias != nullptr,
                 "the model's experts have biases (gate_up_proj_bias, down_proj_bias): pass w1_bias (E_local, N) and "
                 "w2_bias (E_local, K) fp32 (got w1_bias {}, w2_bias {})",
                 static_cast<const void*>(w.w1_bias), static_cast<const void*>(w.w2_bias));
  else
    MOEKIT_CHECK(w.w1_bias == nullptr && w.w2_bias == nullptr,
                 "the model's experts have no biases, but the weights carry w1_bias {} / w2_bias {}: a bias the model "
                 "does not have changes its output; drop them",
                 static_cast<const void*>(w.w1_bias), static_cast<const void*>(w.w2_bias));
  // TMA reads weight rows in 16-byte units from 16-byte aligned starts.
  for (const void* ptr : {static_cast<const void*>(w.w1), static_cast<const void*>(w.w2)})
    MOEKIT_CHECK(reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0,
                 "expert weights at {} are not 16-byte aligned; the GEMMs read rows with 16-byte loads", ptr);
}

std::int64_t expert_weight_bytes(const MoeProblem& p) {
  const std::int64_t I = p.I();
  const std::int64_t weights =
      shape_bytes({p.E_local, p.N * p.K + p.K * I}, recipe_info(p.quant).weight_dtype, "expert weights");
  const std::int64_t scales =
      numerics::weight_scale_count(p.quant, p.N, p.K) + numerics::weight_scale_count(p.quant, p.K, I);
  const std::int64_t biases = p.expert_bias ? p.N + p.K : 0;
  return weights + shape_bytes({p.E_local, scales + biases}, DType::kFp32, "expert weight scales and biases");
}

namespace {
constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kHugeFrom = std::size_t{32} << 20;  // smaller blocks: the allocator's own
}  // namespace

void* host_weights_allocate(std::size_t bytes) {
  if (bytes < kHugeFrom) {
    void* p = std::malloc(bytes == 0 ? 1 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  const std::size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, rounded);
  if (p == nullptr) throw std::bad_alloc();
  ::madvise(p, rounded, MADV_HUGEPAGE);  // a hint: where the kernel never grants them, 4 KiB pages
  return p;
}

void host_weights_free(void* p, std::size_t) noexcept {
  std::free(p);
}

ExpertWeightsView HostExpertWeights::view() const {
  ExpertWeightsView v =
      ExpertWeightsView::of(problem, Device::kCpu, w1.data(), w1_scale.data(), w2.data(), w2_scale.data());
  if (problem.expert_bias) {
    v.w1_bias = w1_bias.data();
    v.w2_bias = w2_bias.data();
  }
  return v;
}

ExpertWeightsView HostExpertWeights::view(DeviceCopies& copies) const {
  ExpertWeightsView v =
      ExpertWeightsView::of(problem, copies.device(), copies.put(w1, "W1"), copies.put(w1_scale, "W1 scales"),
                            copies.put(w2, "W2"), copies.put(w2_scale, "W2 scales"));
  if (problem.expert_bias) {
    v.w1_bias = copies.put(w1_bias, "W1 biases");
    v.w2_bias = copies.put(w2_bias, "W2 biases");
  }
  return v;
}

}  // namespace moekit
