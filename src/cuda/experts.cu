// The experts' kernels on Hopper, for both formats: a1q with its scales (FP8), or bf16 without
// scales (the 16-bit recipe: its GEMMs on the configs' 16-bit instances, the activation into a bf16
// act), and the per-expert counts in device memory -> the experts' output, valid rows only. Batched: (E_local, M, K) in
// and out, expert g's rows at g * M. Contiguous (the standard experts, after their permutation): expert g's rows at the
// prefix of the counts.
//   prepare (one block: reads the counts once, validates, writes row_offsets and both GEMMs'
//   arguments) -> grouped GEMM with W1 -> the activation (fused with its FP8 quantization; bf16:
//   rounded to bf16) -> grouped GEMM with W2 written straight into the output.
// No host synchronization: a step replays from a CUDA graph. Padding rows are never read into a
// result and never written. Napkin math for DeepSeek-V3, E_local = 16, m_e = 256:
// 2 * 16 * 256 * (4096*7168 + 7168*2048) = 361 GFLOP -> 0.29 ms at ~1250 TFLOP/s; weights
// 16 * 44 MiB = 704 MiB -> 0.18 ms at ~4 TB/s. The activation kernel touches only valid rows:
// 16 * 256 * (4096 * 2 + 2048) bytes = 42 MB, ~10 us.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <string>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/grouped_gemm.h"
#include "cuda/launch.h"
#include "cuda/launch_cache.h"
#include "cuda/pdl.cuh"
#include "cuda/quantize.cuh"
#include "cuda/reduce.cuh"
#include "cuda/sixteen_bit.cuh"
#include "cuda/status.cuh"
#include "numerics/activation.h"
#include "numerics/fp8.h"
#include "numerics/scales.h"

namespace moekit::cuda {
namespace {

using numerics::DeviceMath;

constexpr int kActThreads = kQuantThreads;  // the row-per-block kernel holds a row as QuantRowOf

// Blocks of `kernel` (kActThreads each, no dynamic shared memory) that fit on one SM at once: the
// occupancy query, bound once per kernel and device (launch_cache.h).
int blocks_per_sm(const void* kernel) {
  struct Key {
    const void* kernel;
    std::int64_t device;
  };
  thread_local detail::BoundCache<Key, int, 32> cache;
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  const Key key{kernel, device};
  if (const int* bound = cache.find(key)) return *bound;
  int per_sm = 0;
  MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kActThreads, 0));
  return cache.bind(key, std::max(1, per_sm));
}
constexpr int kPrepareThreads = 1024;

// --- prepare --------------------------------------------------------------------------------------

// One GEMM's per-group operands and its launches (plan::GemmLaunches), for the prepare kernel.
struct GemmOperands {
  std::byte* args;        // launch j's arrays at args + j * groups * kGemmArgsBytesPerGroup
  const std::uint8_t* A;  // group g at A + row_start * k elements
  const float* sa;        // per row (row_start + row) or per group; null without scales
  const std::uint8_t* B;  // group g at B + g * n * k elements
  const float* sb;        // per column (g * n + col) or per group (g); null without scales
  std::uint16_t* D;       // group g at D + row_start * n
  int n, k;
  // Bytes of an A and a B element: 1 (FP8 codes) or 2 (bf16, the 16-bit recipe). The kernels'
  // strides count elements (k); the group's first row moves by bytes.
  int element_bytes = 1;
  bool scaled = true;        // the recipe has scales (RecipeInfo); else ptr_col / ptr_row are null
  float* D_small = nullptr;  // the w1_fp32 launches' D (w1_small): group g at D_small + g * small_rows * n
  int small_rows = 0;
  int sa_per_row;             // scales per row of A: 1 (per token) or ceil(k / 128) (1x128 groups)
  std::int64_t sb_per_group;  // scales per expert's weight: n (per channel) or 128x128 blocks
  bool block;                 // kBlock128: the kernel reads block-scale layouts too
  int launches;
  bool swap_ab[plan::kMaxGemmLaunches];
  bool small[plan::kMaxGemmLaunches];  // writes D_small (a w1_fp32 config in the fused recipe)
  std::int64_t lo[plan::kMaxGemmLaunches], hi[plan::kMaxGemmLaunches];
  std::int64_t tail_tile[plan::kMaxGemmLaunches];  // plan::GemmLaunches::tail_tile
};

__device__ void write_launch_args(const GemmOperands& op, int j, int groups, int g, int m, std::int64_t row_start,
                                  bool per_row, bool contiguous) {
  const GroupedGemmArrays a =
      GroupedGemmArrays::at(op.args + static_cast<std::int64_t>(j) * groups * kGemmArgsBytesPerGroup, groups);
  const void* tokens = op.A + row_start * op.k * op.element_bytes;
  const void* weights = op.B + static_cast<std::int64_t>(g) * op.n * op.k * op.element_bytes;
  // Per-tensor: one activation scale per expert tensor (batched) or for all rows (contiguous).
  // Unscaled (bf16): no scale pointers (the 16-bit instances read none).
  const float* sa = !op.scaled ? nullptr
                    : per_row  ? op.sa + row_start * op.sa_per_row
                               : (contiguous ? op.sa : op.sa + g);
  const float* sb = !op.scaled ? nullptr : per_row ? op.sb + g * op.sb_per_group : op.sb + g;
  const int k_blocks = static_cast<int>(numerics::ceil_div(op.k, kQuantBlock));
  if (op.block) {
    const int weight_blocks = static_cast<int>(numerics::ceil_div(op.n, kQuantBlock));
    write_block_scale_layout(a.layout_sfa + 5 * g, op.swap_ab[j] ? weight_blocks : m, k_blocks);
    write_block_scale_layout(a.layout_sfb + 5 * g, op.swap_ab[j] ? m : weight_blocks, k_blocks);
  }
  if (op.small[j])
    a.ptr_D[g] = op.D_small + static_cast<std::int64_t>(g) * op.small_rows * op.n;
  else
    a.ptr_D[g] = op.D != nullptr ? op.D + row_start * op.n : nullptr;  // none for the fused W1
  a.stride_A[g] = op.k;
  a.stride_B[g] = op.k;
  a.stride_D[g] = op.n;
  int* shape = a.shapes + 3 * g;
  if (op.swap_ab[j]) {
    // Kernel problem (n, m, k): A = weights (n x k row-major), B = tokens (k x m column-major).
    shape[0] = op.n;
    shape[1] = m;
    a.ptr_A[g] = weights;
    a.ptr_B[g] = tokens;
    a.ptr_col[g] = sb;
    a.ptr_row[g] = sa;
  } else {
    shape[0] = m;
    shape[1] = op.n;
    a.ptr_A[g] = tokens;
    a.ptr_B[g] = weights;
    a.ptr_col[g] = sa;
    a.ptr_row[g] = sb;
  }
  shape[2] = op.k;
}

// Group g's arguments in every launch of `op`: its m rows in the launch whose range holds m, 0 rows
// (an empty problem, nothing read or written) in the others; but a ragged expert's last rows
// (plan::ragged_tail_rows of that launch's tail_tile) in the launch whose range holds them, from
// their own first row (the A rows, their scales and the D rows all advance with row_start).
__device__ void write_group_args(const GemmOperands& op, int groups, int g, int m, std::int64_t row_start, bool per_row,
                                 bool contiguous) {
  int rows[plan::kMaxGemmLaunches] = {};
  std::int64_t start[plan::kMaxGemmLaunches];
  int home = -1;
  for (int j = 0; j < op.launches; ++j) {
    start[j] = row_start;
    if (m >= op.lo[j] && m <= op.hi[j]) {
      rows[j] = m;
      home = j;
    }
  }
  const int tail = home < 0 ? 0 : static_cast<int>(plan::ragged_tail_rows(m, op.tail_tile[home]));
  for (int j = 0; tail > 0 && j < op.launches; ++j)
    if (j != home && !op.small[j] && tail >= op.lo[j] && tail <= op.hi[j]) {  // (w1_small: by expert)
      rows[home] = m - tail;
      rows[j] = tail;
      start[j] = row_start + (m - tail);
      break;
    }
  for (int j = 0; j < op.launches; ++j) write_launch_args(op, j, groups, g, rows[j], start[j], per_row, contiguous);
}

// The one read of the counts. A count outside [0, capacity], or past the step's bound max_rows (no
// launch covers it), sets the status flag (first one wins), and that expert runs with 0 rows in both
// GEMMs and the activation: nothing past its rows is touched. row_offsets is the exclusive prefix of
// the valid counts (the activation's row index).
__global__ void __launch_bounds__(kPrepareThreads)
    prepare_kernel(const std::int32_t* __restrict__ counts, int E, std::int64_t capacity, std::int64_t max_rows,
                   bool contiguous, bool per_row, GemmOperands w1, GemmOperands w2,
                   std::int32_t* __restrict__ row_offsets, std::int32_t* __restrict__ status) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  using Scan = cub::BlockScan<int, kPrepareThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < E; base += kPrepareThreads) {
    const int g = base + static_cast<int>(threadIdx.x);
    int m = 0;
    if (g < E) {
      m = counts[g];
      if (m < 0 || m > capacity) {
        flag_status(status, kStatusBadCount, g, m);
        m = 0;
      } else if (m > max_rows) {
        flag_status(status, kStatusOverStepBound, g, m, static_cast<int>(max_rows));
        m = 0;
      }
    }
    int offset = 0, total = 0;
    Scan(scan).ExclusiveSum(m, offset, total);
    if (g < E) {  // the thread's own count and offset: nothing re-read from memory
      const int first = carry + offset;
      row_offsets[g] = first;
      const std::int64_t row_start = contiguous ? first : static_cast<std::int64_t>(g) * capacity;
      write_group_args(w1, E, g, m, row_start, per_row, contiguous);
      write_group_args(w2, E, g, m, row_start, per_row, contiguous);
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) row_offsets[E] = carry;
}

// --- activation + FP8 -------------------------------------------------------------------------------

// Expert and row of the i-th valid row: a binary search over row_offsets (E_local + 1 ints; in
// shared memory when ActivationRows staged them).
__device__ __forceinline__ void locate_row(const std::int32_t* __restrict__ row_offsets, int E, int i, int& e, int& r) {
  int lo = 0, hi = E - 1;  // the last expert whose first row is <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (row_offsets[mid] <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  e = lo;
  r = i - row_offsets[lo];
}

// row_offsets staged in shared memory by ActivationRows::begin() (E_local <= this; more read global).
constexpr int kActStagedExperts = 512;

// The rows an activation launch walks. small_rows == 0: the valid rows of w1_out (bf16), each
// written to the same row of act_q. small_rows > 0: the rows in w1_small (fp32, small_rows an
// expert) of the experts of <= small_rows rows, the fused recipe's small experts (the fused W1 wrote
// the other experts' act_q itself), each to its row of act_q. Those are found by walking the valid
// rows or w1_small's slots, whichever are fewer: a walk step is a few dependent loads, and a step
// with few rows (decode) or one whose experts are all past small_rows should not pay for either
// (measured: walking 256 x 128 slots for 8 rows cost ~17 us at T = 1; docs/PERF.md).
struct ActivationRows {
  const std::int32_t* row_offsets;
  int E, M, small_rows;
  bool contiguous;
  bool by_slot = false;
  // Find each row's expert in a contiguous w1_out too (its expert biases need it); the per-tensor
  // amax stays the slab's one (amax_index).
  bool locate = false;

  // The walk's length; chooses the walk (call once, before at(), by every thread of the block).
  // Stages row_offsets into `staged` (kActStagedExperts + 1 ints of shared memory) when they fit:
  // one round trip to memory for the block instead of one per step of each row's binary search,
  // which was most of a decode step's activation kernel (docs/PERF.md).
  __device__ int begin(std::int32_t* staged) {
    if (E <= kActStagedExperts) {
      for (int x = static_cast<int>(threadIdx.x); x <= E; x += static_cast<int>(blockDim.x))
        staged[x] = __ldg(row_offsets + x);
      __syncthreads();
      row_offsets = staged;
    }
    const int valid = row_offsets[E];
    by_slot = small_rows > 0 && E * small_rows < valid;
    return by_slot ? E * small_rows : valid;
  }
  // Walk index i -> its input row, output row and expert (0 for a contiguous w1_out unless locate);
  // false when step i holds no row to run.
  __device__ bool at(int i, std::int64_t& in_row, std::int64_t& out_row, int& e) const {
    int r = i;
    e = 0;
    if (by_slot) {
      e = i / small_rows;
      r = i - e * small_rows;
    } else if (!contiguous || small_rows > 0 || locate) {
      locate_row(row_offsets, E, i, e, r);  // contiguous w1_out: one tensor (e = 0) of rows i
    }
    if (small_rows == 0) {
      in_row = out_row = contiguous ? i : static_cast<std::int64_t>(e) * M + r;
      return true;
    }
    const int first = row_offsets[e], m = row_offsets[e + 1] - first;
    if (m > small_rows || r >= m) return false;
    in_row = static_cast<std::int64_t>(e) * small_rows + r;
    out_row = contiguous ? first + r : static_cast<std::int64_t>(e) * M + r;
    return true;
  }
  // The per-tensor amax of expert e's rows: its own batched, the slab's one contiguous.
  __device__ int amax_index(int e) const { return contiguous ? 0 : e; }
};

__device__ __forceinline__ float to_float(float x) {
  return x;
}

// 8 consecutive W1 outputs from a 16-byte-aligned address (bf16, fp16: one 16-byte load, fp32: two).
template <class T>
__device__ __forceinline__ void load8(const T* p, float (&out)[8]) {
  static_assert(sizeof(T) == 2, "16-bit W1 outputs");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* b = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = to_float(b[j]);
}
__device__ __forceinline__ void load8(const float* p, float (&out)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// The activation of 8 output columns from c0 on (a multiple of 8) of one W1 output row in layout
// w1, the expert's bias (fp32, null: none) added to the inputs: c0's 8 gate (and up) inputs are
// contiguous in every layout; interleaved, they are the 16 values from column 2 c0 on, gate at even
// columns. Both 16-byte-vector activation kernels (FP8 row per block, bf16) read through it.
template <Activation kAct, class In>
__device__ __forceinline__ void activation8(const In* row, const float* bias, numerics::W1Rows w1, int I, int c0,
                                            const SwigluOaiParams& swiglu, float (&out)[8]) {
  auto load8_biased = [&](int col, float(&v)[8]) {
    load8(row + col, v);
    if (bias != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += bias[col + j];
    }
  };
  float g8[8], u8[8];
  // Interleaved rows follow the activation alone (numerics::w1_rows), whatever the recipe.
  if constexpr (numerics::w1_rows(kAct, QuantScheme::kPerTokenPerChannel) == numerics::W1Rows::kInterleaved) {
    float lo[8], hi[8];
    load8_biased(numerics::gate_column(numerics::W1Rows::kInterleaved, I, c0), lo);
    load8_biased(numerics::gate_column(numerics::W1Rows::kInterleaved, I, c0 + 4), hi);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      g8[j] = lo[2 * j], u8[j] = lo[2 * j + 1];
      g8[j + 4] = hi[2 * j], u8[j + 4] = hi[2 * j + 1];
    }
  } else {
    load8_biased(numerics::gate_column(w1, I, c0), g8);
    load8_biased(numerics::up_column(w1, I, c0), u8);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = numerics::activation_value<float, DeviceMath>(kAct, g8[j], u8[j], swiglu);
}

// W1's output at column `col` of a row, with the expert's bias (fp32, null: none) added: the bias
// reaches the activation in fp32 (the CPU adds it before w1_out's bf16 rounding: an ulp apart at most).
template <class In>
__device__ __forceinline__ float w1_value(const In* row, const float* bias, int col) {
  return bias != nullptr ? to_float(row[col]) + bias[col] : to_float(row[col]);
}

template <class In>
__device__ __forceinline__ float activation_at(Activation act, SwigluOaiParams swiglu, numerics::W1Rows w1,
                                               const In* row, const float* bias, int I, int c) {
  return numerics::activation_value<float, DeviceMath>(act, w1_value(row, bias, numerics::gate_column(w1, I, c)),
                                                       w1_value(row, bias, numerics::up_column(w1, I, c)), swiglu);
}

// The generic activation kernel: what the row-per-block kernel below does not take (I > 8192; it
// also needs I % 8 == 0, which validate_problem's I % 16 == 0 gives), and the check it is compared
// with bit for bit (tests/cuda). A persistent grid walks the valid rows only: its cost follows
// sum(m_e), not E_local * M.
// Per-token: amax of the row -> scale -> FP8 of x / scale. Per-tensor: pass 0 only raises the
// expert's amax (as int bits: non-negative floats order like their bits); pass 1 quantizes.
// (expert_amax is act_scale itself, per-tensor: neither is __restrict__ to the other.)
// Block128: one warp per 1x128 group (4 values per lane), its amax -> its scale -> its codes.
template <class In>
__global__ void __launch_bounds__(kActThreads)
    activation_quant_kernel(Activation act, SwigluOaiParams swiglu, numerics::W1Rows w1, int pass, bool per_tensor,
                            bool block, ActivationRows rows, const In* __restrict__ w1_rows,
                            const float* __restrict__ w1_bias, int N, int I, __nv_fp8_e4m3* __restrict__ act_q,
                            float* __restrict__ act_scale, unsigned int* expert_amax) {
  // cuda/pdl.cuh: before any global memory access. No early launch_dependents: W2 follows, whose
  // CTAs would take whole SMs (waiting) from this grid's unplaced blocks (pdl.cuh).
  pdl_wait();
  __shared__ std::int32_t staged[kActStagedExperts + 1];
  const int total = rows.begin(staged);
  for (int i = blockIdx.x; i < total; i += gridDim.x) {
    int e = 0;
    std::int64_t in_row = 0, row_idx = 0;
    if (!rows.at(i, in_row, row_idx, e)) continue;
    const In* row = w1_rows + in_row * N;
    const float* bias = w1_bias != nullptr ? w1_bias + static_cast<std::int64_t>(e) * N : nullptr;
    if (block) {
      const int groups = static_cast<int>(numerics::ceil_div(I, kQuantBlock));
      const int lane = static_cast<int>(threadIdx.x) % 32;
      for (int grp = static_cast<int>(threadIdx.x) / 32; grp < groups; grp += kActThreads / 32) {
        float v[4];
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = grp * static_cast<int>(kQuantBlock) + j * 32 + lane;
          v[j] = c < I ? activation_at(act, swiglu, w1, row, bias, I, c) : 0.0f;
          m = fmaxf(m, fabsf(v[j]));
        }
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        const float scale = numerics::fp8_scale(m);
        if (lane == 0) act_scale[row_idx * groups + grp] = scale;
        float q[4];
        numerics::DivideBy(scale).with_quotient([&](const auto& quotient) {  // one range test for the 4
#pragma unroll
          for (int j = 0; j < 4; ++j) q[j] = quotient(v[j]);
        });
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = grp * static_cast<int>(kQuantBlock) + j * 32 + lane;
          if (c < I) act_q[row_idx * I + c] = __nv_fp8_e4m3(q[j]);
        }
      }
      continue;
    }
    float amax = 0.0f;
    if (!per_tensor || pass == 0) {
      for (int c = threadIdx.x; c < I; c += kActThreads)
        amax = fmaxf(amax, fabsf(activation_at(act, swiglu, w1, row, bias, I, c)));
      amax = block_max<kActThreads>(amax);
      if (per_tensor) {
        if (threadIdx.x == 0) atomicMax(expert_amax + rows.amax_index(e), __float_as_uint(amax));
        continue;
      }
    } else {
      amax = __uint_as_float(expert_amax[rows.amax_index(e)]);
    }
    const float scale = numerics::fp8_scale(amax);
    if (!per_tensor && threadIdx.x == 0) act_scale[row_idx] = scale;
    __nv_fp8_e4m3* out = act_q + row_idx * I;
    numerics::DivideBy(scale).with_quotient([&](const auto& quotient) {  // one range test for the row
      for (int c = threadIdx.x; c < I; c += kActThreads)
        out[c] = __nv_fp8_e4m3(quotient(activation_at(act, swiglu, w1, row, bias, I, c)));  // RNE, saturating to 448
    });
  }
}

// One block per row: 16-byte loads of 8 gate and 8 up values per thread (interleaved rows:
// 16 consecutive values, gate / up pairs), the row's values kept in registers (cuda/quantize.cuh's
// QuantRowOf, the quantize-and-scatter's arithmetic) between the amax and the quantization, 8-byte
// stores; for I <= 256 * 8 * kChunks, I % 8 == 0. Per-token and block128 in one pass (kPass < 0).
// Per-tensor in two, as activation_quant_kernel: kPass 0 raises the expert's amax (int bits in
// expert_amax), kPass 1 quantizes with its scale (values computed again: the amax spans rows).
// The activation and the pass are compile-time constants (their switches fold away; ncu found the
// kernel instruction-bound, not memory-bound: docs/PERF.md).
template <int kChunks, Activation kAct, int kPass, class In>
__global__ void __launch_bounds__(kActThreads)
    activation_quant_row_per_block(SwigluOaiParams swiglu, numerics::W1Rows w1, QuantScheme quant, ActivationRows rows,
                                   const In* __restrict__ w1_rows, const float* __restrict__ w1_bias, int N, int I,
                                   __nv_fp8_e4m3* __restrict__ act_q, float* __restrict__ act_scale,
                                   unsigned int* expert_amax) {
  // cuda/pdl.cuh: before any global memory access. No early launch_dependents: W2 follows, whose
  // CTAs would take whole SMs (waiting) from this grid's unplaced blocks (pdl.cuh).
  pdl_wait();
  __shared__ std::int32_t staged[kActStagedExperts + 1];
  const int total = rows.begin(staged);
  const int spr = static_cast<int>(numerics::activation_scales_per_row(quant, I));
  for (int i = blockIdx.x; i < total; i += gridDim.x) {
    int e = 0;
    std::int64_t in_row = 0, row_idx = 0;
    if (!rows.at(i, in_row, row_idx, e)) continue;
    const In* row = w1_rows + in_row * N;
    const float* bias = w1_bias != nullptr ? w1_bias + static_cast<std::int64_t>(e) * N : nullptr;
    QuantRowOf<kChunks> q;
    q.load_with(I, [&](int c0, float(&out)[8]) { activation8<kAct>(row, bias, w1, I, c0, swiglu, out); });
    auto* out = reinterpret_cast<std::uint8_t*>(act_q + row_idx * I);
    if constexpr (kPass == 0) {  // per-tensor: the expert's amax (non-negative floats order like their bits)
      const float amax = block_max<kActThreads>(q.amax_thread);
      if (threadIdx.x == 0) atomicMax(expert_amax + rows.amax_index(e), __float_as_uint(amax));
    } else if constexpr (kPass == 1) {
      q.store(QuantScheme::kPerTensor, numerics::fp8_scale(__uint_as_float(expert_amax[rows.amax_index(e)])), I, out,
              nullptr);
    } else {
      q.store(quant, q.token_scale(quant), I, out, act_scale + row_idx * spr);
    }
  }
}

// The 16-bit recipes' activation (RecipeInfo::requantizes_intermediate false: bf16, fp16): W1's output
// rows in the recipe's dtype T (the expert's W1 bias added in fp32) -> the activation in fp32 -> act
// in T, rounded once to nearest even (cpu::activation_quant's store_activation); no amax, no scales. A block a valid
// row (ActivationRows: never a padding row), 8 output columns a thread a step: 16-byte loads of 8
// gate and 8 up values (interleaved rows: 16 consecutive values, gate / up pairs), one 16-byte
// store; any I % 8 == 0 (validate_problem's I % 16 == 0 gives it). Napkin math, DeepSeek-V3
// m_e = 256 x 16 experts: 4096 rows x (4096 + 2048) x 2 bytes = 50 MB, ~17 us at ~3 TB/s.
template <Activation kAct, class T>
__global__ void __launch_bounds__(kActThreads)
    activation_sixteen_bit_kernel(SwigluOaiParams swiglu, numerics::W1Rows w1, ActivationRows rows,
                                  const T* __restrict__ w1_rows, const float* __restrict__ w1_bias, int N, int I,
                                  T* __restrict__ act) {
  // cuda/pdl.cuh: before any global memory access. No early launch_dependents (W2 follows, as for
  // the FP8 kernels above).
  pdl_wait();
  __shared__ std::int32_t staged[kActStagedExperts + 1];
  const int total = rows.begin(staged);
  for (int i = blockIdx.x; i < total; i += gridDim.x) {
    int e = 0;
    std::int64_t in_row = 0, out_row = 0;
    if (!rows.at(i, in_row, out_row, e)) continue;
    const T* row = w1_rows + in_row * N;
    const float* bias = w1_bias != nullptr ? w1_bias + static_cast<std::int64_t>(e) * N : nullptr;
    for (int c0 = static_cast<int>(threadIdx.x) * 8; c0 < I; c0 += kActThreads * 8) {
      float v[8];
      activation8<kAct>(row, bias, w1, I, c0, swiglu, v);
      uint4 packed;
      auto* o = reinterpret_cast<T*>(&packed);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = from_float<T>(v[j]);
      *reinterpret_cast<uint4*>(act + out_row * I + c0) = packed;
    }
  }
}

__global__ void per_tensor_scales_kernel(const unsigned int* expert_amax, float* act_scale, int E_local) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  const int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= E_local) return;
  act_scale[e] = numerics::fp8_scale(__uint_as_float(expert_amax[e]));
}

// W2's expert biases: b2[e] added to each valid output row of expert e (fp32, one more rounding to
// the output dtype T: the CPU adds it before W2's store, an ulp apart at most), the rows found as the
// activation finds them (row_offsets, never a padding row). A block a row, 8 columns a thread.
template <class T>
__global__ void __launch_bounds__(kActThreads)
    w2_bias_kernel(ActivationRows rows, const float* __restrict__ w2_bias, int K, T* __restrict__ out) {
  pdl_enter();  // cuda/pdl.cuh: before any global memory access
  __shared__ std::int32_t staged[kActStagedExperts + 1];
  const int total = rows.begin(staged);
  for (int i = blockIdx.x; i < total; i += gridDim.x) {
    int e = 0;
    std::int64_t in_row = 0, out_row = 0;
    if (!rows.at(i, in_row, out_row, e)) continue;
    const float* b = w2_bias + static_cast<std::int64_t>(e) * K;
    T* y = out + out_row * K;
    for (int c0 = static_cast<int>(threadIdx.x) * 8; c0 < K; c0 += kActThreads * 8) {
      uint4 raw = *reinterpret_cast<const uint4*>(y + c0);
      auto* v = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = from_float<T>(DeviceMath::add(to_float(v[j]), b[c0 + j]));
      *reinterpret_cast<uint4*>(y + c0) = raw;
    }
  }
}

GemmOperands operands(const BatchedExpertsLaunch& l, int which) {
  const MoeProblem& p = l.problem;
  const plan::GemmLaunches& launches = which == 1 ? l.gemms.w1 : l.gemms.w2;
  GemmOperands op;
  if (which == 1) {  // (m_e x K) . (N x K)^T -> w1_out (m_e x N)
    op = {l.gemm_args_w1,     l.a1q,    l.a1q_scale,           l.weights.w1,
          l.weights.w1_scale, l.w1_out, static_cast<int>(p.N), static_cast<int>(p.K)};
  } else {  // (m_e x I) . (K x I)^T -> output (m_e x K), straight into the experts' output
    op = {l.gemm_args_w2,     l.act_q,  l.act_scale,           l.weights.w2,
          l.weights.w2_scale, l.output, static_cast<int>(p.K), static_cast<int>(p.I())};
  }
  const RecipeInfo recipe = recipe_info(p.quant);
  op.element_bytes = static_cast<int>(dtype_size(recipe.activation_dtype));
  op.scaled = has_activation_scales(recipe) && has_weight_scales(recipe);
  op.sa_per_row = static_cast<int>(numerics::activation_scales_per_row(p.quant, op.k));
  op.sb_per_group = numerics::weight_scale_count(p.quant, op.n, op.k);
  op.block = recipe.block_scaled_gemm;
  op.launches = launches.count;
  if (which == 1 && l.gemms.w1_small) {
    op.D_small = l.w1_small;
    op.small_rows = static_cast<int>(plan::w1_small_rows(p));
  }
  for (int j = 0; j < launches.count; ++j) {
    const plan::GemmConfigInfo& info = plan::gemm_config_info(launches.config[j]);
    op.swap_ab[j] = info.swap_ab;
    op.small[j] = which == 1 && plan::writes_w1_small(l.gemms, j);
    op.lo[j] = launches.lo[j];
    op.hi[j] = launches.hi[j];
    op.tail_tile[j] = launches.tail_tile[j];
  }
  return op;
}

// The most rows one expert's slab of the token tensor holds: batched, its own M rows (expert g's at
// g * M); contiguous, all M * topk rows of a1q_permuted may be one expert's.
std::int64_t expert_capacity(const BatchedExpertsLaunch& l) {
  return l.contiguous ? l.problem.M * l.problem.topk : l.problem.M;
}

// The 16-bit recipes' activation: w1_out -> act, both the recipe's dtype (bf16, fp16), one kernel
// whatever ActivationKernel asks (no amax to keep in registers: the generic / row-per-block split is
// the FP8 quantization's).
void launch_activation_sixteen_bit(const BatchedExpertsLaunch& l, cudaStream_t stream) {
  const MoeProblem& p = l.problem;
  const RecipeInfo recipe = recipe_info(p.quant);
  const DType dtype = recipe.activation_dtype;
  MOEKIT_CUDA_REQUIRE(is_sixteen_bit(dtype) && recipe.intermediate_dtype == dtype && !l.gemms.fused_w1 &&
                          l.w1_out != nullptr && l.act_q != nullptr,
                      "launch_activation_quant: the " + std::string(recipe.name) +
                          " recipe's activation reads a 16-bit w1_out and writes act in the same dtype (no fused W1)");
  MOEKIT_CUDA_REQUIRE(p.I() % 8 == 0, "launch_activation_quant: I = " + std::to_string(p.I()) +
                                          " must be a multiple of 8 (16-byte rows)");
  ActivationRows rows{l.row_offsets, static_cast<int>(p.E_local), static_cast<int>(p.M), 0, l.contiguous};
  rows.locate = l.weights.w1_bias != nullptr;
  const numerics::W1Rows w1 = numerics::w1_rows(p.activation, p.quant);
  with_sixteen_bit(dtype, [&](auto tag) {
    using T = decltype(tag);
    numerics::with_activation(p.activation, [&]<Activation kAct>() {
      auto* k = activation_sixteen_bit_kernel<kAct, T>;
      launch_pdl(k, blocks_per_sm(reinterpret_cast<const void*>(k)) * l.num_sms, kActThreads, 0, stream, p.swiglu, w1,
                 rows, reinterpret_cast<const T*>(l.w1_out), l.weights.w1_bias, static_cast<int>(p.N),
                 static_cast<int>(p.I()), reinterpret_cast<T*>(l.act_q));
      MOEKIT_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace

void launch_experts_prepare(const BatchedExpertsLaunch& l, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const MoeProblem& p = l.problem;
  const std::int64_t capacity = expert_capacity(l);
  launch_pdl(prepare_kernel, 1, kPrepareThreads, 0, stream, l.expert_num_tokens, static_cast<int>(p.E_local), capacity,
             std::min(l.max_rows, capacity), l.contiguous, !numerics::activation_scale_per_tensor(p.quant),
             operands(l, 1), operands(l, 2), l.row_offsets, l.status);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void launch_experts_gemm(const BatchedExpertsLaunch& l, int which, void* stream) {
  const MoeProblem& p = l.problem;
  const plan::GemmLaunches& launches = which == 1 ? l.gemms.w1 : l.gemms.w2;
  for (int j = 0; j < launches.count; ++j) {
    GroupedGemmLaunch g;
    g.args = (which == 1 ? l.gemm_args_w1 : l.gemm_args_w2) + j * p.E_local * kGemmArgsBytesPerGroup;
    g.groups = static_cast<int>(p.E_local);
    g.n = which == 1 ? p.N : p.K;
    g.k = which == 1 ? p.K : p.I();
    g.scales_per_row = !numerics::activation_scale_per_tensor(p.quant);
    g.block_scaled = recipe_info(p.quant).block_scaled_gemm;
    g.fast_accumulation = p.accumulation == Accumulation::kFast;
    // FP8 codes with scales, or the 16-bit recipe's bf16 operands on the configs' 16-bit instances.
    g.operand = plan::sixteen_bit_gemm(p.quant) ? recipe_info(p.quant).activation_dtype : DType::kFp8E4m3;
    g.scratch = l.gemm_scratch;
    g.scratch_bytes = kGemmScratchBytes;
    g.num_sms = l.num_sms;
    // The token tensor: one slab of rows (contiguous) or E_local of them (batched).
    g.tensors.tokens = which == 1 ? static_cast<const void*>(l.a1q) : l.act_q;
    g.tensors.token_rows = expert_capacity(l) * (l.contiguous ? 1 : p.E_local);
    g.tensors.weights = which == 1 ? l.weights.w1 : l.weights.w2;
    g.tensors.weight_rows = p.E_local * g.n;
    // D's tensor, row for row with the tokens (write_launch_args); the fused recipe's W1 writes none.
    g.tensors.output = which == 2 ? static_cast<void*>(l.output) : l.gemms.fused_w1 ? nullptr : l.w1_out;
    if (which == 1 && plan::writes_w1_small(l.gemms, j)) {
      MOEKIT_CUDA_REQUIRE(l.w1_small != nullptr, "the fused recipe's small-expert W1 needs the w1_small region");
      g.d_fp32 = true;  // into w1_small, then the activation kernel
    } else if (which == 1 && l.gemms.fused_w1) {
      g.fused.act_q = l.act_q;
      g.fused.act_scale = l.act_scale;
      g.fused.row_offsets = l.contiguous ? l.row_offsets : nullptr;
      g.fused.M = p.M;
      g.fused.I = static_cast<int>(p.I());
      g.fused.activation = p.activation;
    }
    grouped_fp8_gemm(launches.config[j], g, stream);
  }
}

void launch_activation_quant(const BatchedExpertsLaunch& l, ActivationKernel kernel, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (!recipe_info(l.problem.quant).requantizes_intermediate) return launch_activation_sixteen_bit(l, stream);
  // The fused recipe runs it on w1_small's experts only (fp32 rows); the others' activation ran in
  // the fused W1's epilogue.
  const bool small = l.gemms.fused_w1;
  MOEKIT_CUDA_REQUIRE(small ? l.gemms.w1_small && l.w1_small != nullptr : l.w1_out != nullptr,
                      small ? "launch_activation_quant: the W1 GEMM is fused and no expert ran into w1_small: the "
                              "activation ran in its epilogue"
                            : "launch_activation_quant: no w1_out");
  const MoeProblem& p = l.problem;
  const bool per_tensor = numerics::activation_scale_per_tensor(p.quant);
  const int E = static_cast<int>(p.E_local), M = static_cast<int>(p.M), N = static_cast<int>(p.N),
            I = static_cast<int>(p.I());
  // Per-tensor accumulates each expert's amax in act_scale itself (as bits), then converts it in
  // place to the scale.
  auto* amax = reinterpret_cast<unsigned int*>(l.act_scale);
  // Persistent grids of exactly one wave (ncu: a 1.33-wave grid left a partial wave idle): the
  // blocks that fit on every SM at once, each walking valid rows.
  auto one_wave = [&](const void* k) { return blocks_per_sm(k) * l.num_sms; };
  auto* w1_out = reinterpret_cast<const __nv_bfloat16*>(l.w1_out);
  auto* act_q = reinterpret_cast<__nv_fp8_e4m3*>(l.act_q);
  const float* w1_bias = l.weights.w1_bias;
  ActivationRows rows{l.row_offsets, E, M, small ? static_cast<int>(plan::w1_small_rows(p)) : 0, l.contiguous};
  rows.locate = w1_bias != nullptr;
  // The W1 rows the kernels read: bf16 w1_out, or fp32 w1_small (block128 only: the fused recipe).
  auto with_rows = [&](auto&& launch) {
    if (small)
      launch(l.w1_small);
    else
      launch(w1_out);
  };
  const numerics::W1Rows w1 = numerics::w1_rows(p.activation, p.quant);
  // The row-per-block kernel holds a row in registers, 8 values a thread a chunk: I <= 8192, I % 8 == 0.
  constexpr int kRowMaxI = kActThreads * 8 * 4;
  const bool row_ok = I <= kRowMaxI && I % 8 == 0;
  if (kernel == ActivationKernel::kAuto) kernel = row_ok ? ActivationKernel::kRowPerBlock : ActivationKernel::kGeneric;
  MOEKIT_CUDA_REQUIRE(kernel == ActivationKernel::kGeneric || row_ok,
                      "row-per-block activation kernel: I = " + std::to_string(I) +
                          "; it needs I <= " + std::to_string(kRowMaxI) + " and a multiple of 8");
  MOEKIT_CUDA_REQUIRE(!(per_tensor && small), "per-tensor scales have no fused recipe");
  // Per-tensor: either kernel runs two passes (each expert's amax, then its codes), then the amax
  // becomes the scale in place. act_scale holds one scale a tensor (numerics::activation_scale_shape):
  // an expert's batched, one for the whole contiguous slab; clearing E_local of them there ran past
  // the region (into w1_out, with gpt-oss's layout, at E_local > 64).
  const int tensors = l.contiguous ? 1 : E;
  if (per_tensor)
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(l.act_scale, 0, static_cast<std::size_t>(tensors) * sizeof(float), stream));
  if (kernel == ActivationKernel::kRowPerBlock) {
    const int chunks = (I + kActThreads * 8 - 1) / (kActThreads * 8);
    with_rows([&]<class In>(const In* in) {
      auto launch = [&](auto k) {
        launch_pdl(k, one_wave(reinterpret_cast<const void*>(k)), kActThreads, 0, stream, p.swiglu, w1, p.quant, rows,
                   in, w1_bias, N, I, act_q, l.act_scale, amax);
        MOEKIT_CUDA_CHECK_LAUNCH();
      };
      auto launch_passes = [&]<int kChunks, Activation kAct>() {
        if constexpr (std::is_same_v<In, __nv_bfloat16>) {  // per-tensor reads w1_out (bf16) only
          if (per_tensor) {
            launch(activation_quant_row_per_block<kChunks, kAct, 0, In>);
            launch(activation_quant_row_per_block<kChunks, kAct, 1, In>);
            return;
          }
        }
        launch(activation_quant_row_per_block<kChunks, kAct, -1, In>);
      };
      numerics::with_activation(p.activation, [&]<Activation kAct>() {
        if (chunks == 1) {
          launch_passes.template operator()<1, kAct>();
        } else if (chunks == 2) {
          launch_passes.template operator()<2, kAct>();
        } else {
          launch_passes.template operator()<4, kAct>();
        }
      });
    });
  } else {
    with_rows([&]<class In>(const In* in) {
      auto* k = activation_quant_kernel<In>;
      const int grid = one_wave(reinterpret_cast<const void*>(k));
      for (int pass = per_tensor ? 0 : 1; pass < 2; ++pass) {
        launch_pdl(k, grid, kActThreads, 0, stream, p.activation, p.swiglu, w1, pass, per_tensor,
                   recipe_info(p.quant).activation_scales == ActivationScales::kGroup1x128, rows, in, w1_bias, N, I,
                   act_q, l.act_scale, amax);
        MOEKIT_CUDA_CHECK_LAUNCH();
      }
    });
  }
  if (per_tensor) {
    launch_pdl(per_tensor_scales_kernel, (tensors + 127) / 128, 128, 0, stream, amax, l.act_scale, tensors);
  }
  MOEKIT_CUDA_CHECK_LAUNCH();
}

namespace {

void launch_w2_bias(const BatchedExpertsLaunch& l, void* stream_ptr) {
  const MoeProblem& p = l.problem;
  MOEKIT_CUDA_REQUIRE(l.weights.w2_bias != nullptr && p.K % 8 == 0,
                      "launch_w2_bias: no w2_bias, or K not a multiple of 8");
  ActivationRows rows{l.row_offsets, static_cast<int>(p.E_local), static_cast<int>(p.M), 0, l.contiguous};
  rows.locate = true;
  with_sixteen_bit(recipe_info(p.quant).output_dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* k = w2_bias_kernel<T>;
    launch_pdl(k, blocks_per_sm(reinterpret_cast<const void*>(k)) * l.num_sms, kActThreads, 0,
               static_cast<cudaStream_t>(stream_ptr), rows, l.weights.w2_bias, static_cast<int>(p.K),
               reinterpret_cast<T*>(l.output));
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void launch_batched_experts(const BatchedExpertsLaunch& l, void* stream) {
  MOEKIT_CUDA_REQUIRE(l.weights.w1_bias == nullptr || !l.gemms.fused_w1,
                      "expert biases run the unfused recipe (the fused W1's epilogue adds none)");
  launch_experts_prepare(l, stream);
  launch_experts_gemm(l, 1, stream);  // fused: writes act_q / act_scale itself (but for w1_small's experts)
  if (plan::runs_activation_kernel(l.gemms)) launch_activation_quant(l, ActivationKernel::kAuto, stream);
  launch_experts_gemm(l, 2, stream);
  if (l.weights.w2_bias != nullptr) launch_w2_bias(l, stream);
}

}  // namespace moekit::cuda
