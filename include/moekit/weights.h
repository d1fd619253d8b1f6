// The weights of one rank's local experts, as the caller holds them: a view (pointers, layout,
// scales), never a copy, on the device the experts run on. Elements of the recipe's weight_dtype
// (moekit/recipe.h): FP8 e4m3 codes with fp32 scales, or bf16 values and no scales (w1_scale and
// w2_scale then hold nothing and may be null); w1 and w2 point at their bytes:
//   w1        (E_local, N, K), K contiguous. Rows are W1's output channels in the layout of
//             numerics::w1_rows(activation, quant): gate rows [0, I) then up rows [I, 2I) for silu /
//             gelu / gelu_tanh (HF's gate_proj then up_proj); under block128 the same activations
//             pair the blocks instead, per 256 rows gate block b then up block b (rows [256b,
//             256b + 128) = gate rows [128b, 128b + 128), the next 128 the up rows), with w1_scale's
//             block rows in the same order: arrange_w1_block_pairs does it once at load (the fused
//             W1 epilogue holds a whole output group in one tile); interleaved gate/up pairs for
//             swigluoai (gpt-oss); N = I rows for the non-gated activations.
//   w2        (E_local, K, I), I contiguous (HF's down_proj).
//   w1_scale  per expert weight_scale_count(quant, N, K) floats, w2_scale weight_scale_count(quant,
//             K, I) (numerics/scales.h): per-tensor 1, per-channel one per output row, block128
//             one per 128x128 block, row-major over blocks.
//   w1_bias   (E_local, N) and w2_bias (E_local, K) fp32, in W1's row order: the expert biases of
//             the models that have them (gpt-oss's gate_up_proj_bias, down_proj_bias), added to
//             each GEMM's output in fp32 (the CPU before its bf16 store; CUDA after it, within an
//             ulp: docs/DESIGN.md); null for the others.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "moekit/memory.h"
#include "moekit/problem.h"
#include "moekit/types.h"

namespace moekit {

struct ExpertWeightsView {
  Device device = Device::kCpu;
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  std::int64_t E_local = 0, N = 0, K = 0, I = 0;
  const std::uint8_t* w1 = nullptr;
  const float* w1_scale = nullptr;
  const std::uint8_t* w2 = nullptr;
  const float* w2_scale = nullptr;
  const float* w1_bias = nullptr;
  const float* w2_bias = nullptr;

  // Floats of scales per expert (0 for an unquantized recipe).
  std::int64_t w1_scale_stride() const;
  std::int64_t w2_scale_stride() const;
  // Bytes of one weight element: FP8 1, bf16 2.
  std::int64_t element_bytes() const;
  // One expert's view (E_local = 1), for references and tests.
  ExpertWeightsView expert(std::int64_t e) const;

  // The view of `problem`'s local experts at these pointers, on `device`.
  static ExpertWeightsView of(const MoeProblem& problem, Device device, const std::uint8_t* w1, const float* w1_scale,
                              const std::uint8_t* w2, const float* w2_scale);
};

// Host-owned expert weights in the layout above (seeded synthetic ones, or loaded from a checkpoint).
// Host memory for weights (moekit/memory.h's host side): a block of >= 32 MiB is 2 MiB-aligned and
// asks for transparent huge pages, so that the first touch of a layer's gigabytes faults once every
// 2 MiB, not every 4 KiB (where the kernel grants them: its "madvise" or "always" setting).
void* host_weights_allocate(std::size_t bytes);
void host_weights_free(void* p, std::size_t bytes) noexcept;

// An allocator that leaves what a vector grows by unset (default-initialized, not zeroed), on
// host_weights_allocate: the weights' producers (the checkpoint loader, the synthetic weights) write
// every element, in parallel, and zeroing first, on one thread and a page fault every 4 KiB, cost a
// load more than its copy.
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n > std::allocator_traits<std::allocator<T>>::max_size(*this)) throw std::bad_array_new_length();
    return static_cast<T*>(host_weights_allocate(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { host_weights_free(p, n * sizeof(T)); }
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <class T>
using HostBuffer = std::vector<T, UninitializedAllocator<T>>;

struct HostExpertWeights {
  MoeProblem problem;
  std::int64_t first_expert = 0;  // global index of expert 0 here
  // Every element written by whoever sizes them (HostBuffer does not zero).
  HostBuffer<std::uint8_t> w1, w2;  // bytes: element_bytes() a weight
  HostBuffer<float> w1_scale, w2_scale;
  HostBuffer<float> w1_bias, w2_bias;  // problem.expert_bias: (E_local, N), (E_local, K); else empty
  ExpertWeightsView view() const;      // on the host
  // On the device of `copies`, which holds them (the host weights themselves on the CPU).
  ExpertWeightsView view(DeviceCopies& copies) const;
};

// One expert's W1 from halves (gate rows then up rows, HF's layout) to block pairs (the layout
// block128 reads for silu / gelu / gelu_tanh), out of place, on the host: codes (2I, K) and their
// 128x128 block scales (2I / 128, ceil(K / 128)). Rows and scales are moved, never re-rounded.
// Raises moekit::Error unless I is a positive multiple of 128.
void arrange_w1_block_pairs(std::int64_t I, std::int64_t K, const std::uint8_t* halves, const float* halves_scale,
                            std::uint8_t* pairs, float* pairs_scale);

// The inverse: block pairs back to halves (the layout a checkpoint stores), out of place, on the host.
void arrange_w1_halves(std::int64_t I, std::int64_t K, const std::uint8_t* pairs, const float* pairs_scale,
                       std::uint8_t* halves, float* halves_scale);

// W1 rows as transformers' and the checkpoints' modules hold them ("gate_up": gate_proj's rows then
// up_proj's; gpt-oss's interleaved pairs, its stored order, for swigluoai) or as block128's recipe
// reads them ("block_pairs"). Whether `layout` must be arranged (arrange_w1_block_pairs) for the
// recipe of (activation, quant): raises moekit::Error for "block_pairs" where the recipe reads
// another layout (it would compute something else) and for an unknown name.
bool w1_needs_block_pairs(std::string_view layout, Activation activation, QuantScheme quant);

// Raises moekit::Error naming the field, its value and what the problem needs.
void validate_weights(const ExpertWeightsView& weights, const MoeProblem& problem, Device device);

// The local experts' weights (FP8 or bf16) and their fp32 scales, in bytes (what sits beside the workspace).
std::int64_t expert_weight_bytes(const MoeProblem& problem);

}  // namespace moekit
