// The one table of grouped FP8 GEMM tile configurations of the Hopper experts: name, tile, schedule,
// swap A/B, the shapes each supports and the rows per expert it is chosen for. The CUTLASS
// instances (src/cuda/grouped_gemm_<name>.cu: one per .cu file) take their tile and schedule from
// it, the selector, the benchmark, the tests and `moekit plan` read it. Plain C++, constexpr, so
// nvcc reads the same table.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "moekit/problem.h"
#include "moekit/recipe.h"

namespace moekit::plan {

enum class GemmConfig : std::uint8_t {
  kSwapAB128x32,
  kSwapAB128x64,
  kPingpong64x256,
  kBlock128x256,
  kCooperative128x256,
  kCooperative128x128,
  kFusedW1Block128x256
};
enum class GemmSchedule : std::uint8_t { kCooperative, kPingpong };
// Whose main loop: CUTLASS 4.2's (src/cuda/grouped_gemm_impl.cuh) or moekit's own block-scaled one
// (src/cuda/block_gemm_sm90.cuh: 128 x 256 tiles promoted one 128-column half at a time).
enum class GemmMainLoop : std::uint8_t { kCutlass, kMoekit };

struct GemmConfigInfo {
  GemmConfig id;
  std::string_view name;
  int tile_m, tile_n, tile_k;  // CTA tile in the kernel's own (possibly swapped) M, N, K
  GemmSchedule schedule;       // cooperative: both consumer warpgroups on one tile; pingpong: alternate tiles
  bool swap_ab;                // D^T = W . A^T: weights on the 128-row side, tokens on tile_n
  int n_multiple;              // supports GEMMs whose n (output columns) is a multiple of this
  std::int64_t max_rows;       // chosen for experts expected to hold <= max_rows rows (-1: any)
  bool token_scaled;           // has a per-token / per-tensor instance, grouped_gemm_<name>.cu
  bool block_scaled;           // has a block-scaled (kBlock128) instance, grouped_gemm_block_<name>.cu
  bool fused_w1;               // block-scaled W1 whose epilogue writes act_q / act_scale (no w1_out):
                               // grouped_gemm_<name>.cu; it runs no other GEMM
  std::string_view why;
  GemmMainLoop main_loop = GemmMainLoop::kCutlass;
  // Has a block-scaled instance with an fp32 D, grouped_gemm_block_f32_<name>.cu: the fused
  // recipe's W1 for the experts of <= max_rows rows, into w1_small (fused_w1_small_rows() fp32 rows
  // an expert), the activation kernel then reading the fp32 rows (no bf16 rounding: the fused
  // recipe's numerics). The fused rule runs these rows on small experts, the fused W1 on the rest.
  bool w1_fp32 = false;
  std::int64_t max_k = -1;  // chosen for GEMMs of k <= max_k (-1: any); it runs any k it supports
  // In the rule, an expert's last token tile of tile_m rows holding at most half of them (a ragged
  // expert) leaves this config's launch for the launch whose range holds those rows (a swapped 32- or
  // 64-token tile): ragged_tail_rows. For configs whose whole token tiles beat smaller ones but
  // whose tail tile computes mostly padding.
  bool splits_ragged_tail = false;
  // Chosen only under fast accumulation (Accumulation::kFast). Precise accumulation keeps a second
  // fp32 accumulator for the promotion: a 64x256 warpgroup tile then needs 256 accumulator
  // registers a thread, and spills.
  bool fast_accumulation_only = false;
  // moekit's main loop: CTAs a cluster (1 or 2). Two share each weight tile of a pair of full token
  // tiles, each loading half of it by TMA multicast into both (half the L2 reads of the weights); a
  // group's odd last tile and half tiles run one a CTA (block_gemm_items.h). Where the device holds
  // no cluster of two at once, the launch runs unclustered.
  int cluster = 1;
  // Has 16-bit instances, grouped_gemm_bf16_<name>.cu and grouped_gemm_fp16_<name>.cu: bf16 or fp16
  // operands without scales, fp32 accumulation over the whole K, D in the operands' dtype. Their K
  // tile holds the same 128 bytes a row as the FP8 one: tile_k / 2 elements (sixteen_bit_tile_k).
  bool sixteen_bit = false;
};
// The K tile of a config's 16-bit instances, in elements: one 128-byte row of the operand a stage.
constexpr int sixteen_bit_tile_k(const GemmConfigInfo& config) {
  return config.tile_k / 2;
}

// In selection order: the first row that supports (n, k) and whose max_rows and max_k cover the
// expected rows per expert and k is chosen. The order is the measured one (docs/PERF.md: each row's
// choice against its neighbours on DeepSeek-V3 shapes).
inline constexpr GemmConfigInfo kGemmConfigs[] = {
    {GemmConfig::kSwapAB128x32,
     "swapab-128x32",
     128,
     32,
     128,
     GemmSchedule::kCooperative,
     true,
     16,
     32,
     true,
     true,
     false,
     "m_e <= 32: a 128-row token tile would be mostly padding; weights take the 128 side",
     GemmMainLoop::kCutlass,
     true,
     -1,
     false,
     false,
     1,
     true},
    {GemmConfig::kSwapAB128x64,
     "swapab-128x64",
     128,
     64,
     128,
     GemmSchedule::kCooperative,
     true,
     16,
     64,
     true,
     true,
     false,
     "32 < m_e <= 64: weights read once per 64-token tile (128x32 would read them twice)",
     GemmMainLoop::kCutlass,
     true,
     -1,
     false,
     false,
     1,
     true},
    // No block-scaled instance: CUTLASS 4.2's blockwise main loop does not compile with two 128-wide
    // weight blocks in one tile and 64 token scales (fp8_accumulation.hpp: "Accumulator and scaleB
    // must have same shape"); block128 takes block-128x256 (k <= 2048) or cooperative-128x128 for
    // m_e > 64 (a block-scaled pingpong-64x128 measured slower than the latter).
    // n % 256 == 0 is the rule's choice, not the kernel's limit (it computes gpt-oss's n = 5760 and
    // 2880 right): there it lost to cooperative-128x128 on full token tiles, so gpt-oss stays there.
    // Under precise accumulation its 64x256 warpgroup tile needs a second accumulator and spills
    // (2.5-2.8x slower), so it runs under fast accumulation only.
    {GemmConfig::kPingpong64x256,
     "pingpong-64x256",
     64,
     256,
     128,
     GemmSchedule::kPingpong,
     false,
     256,
     -1,
     true,
     false,
     false,
     "m_e > 64, n % 256 == 0, fast accumulation: pingpong overlaps one tile's epilogue with the other's MMA",
     GemmMainLoop::kCutlass,
     false,
     -1,
     false,
     true,
     1,
     true},
    // moekit's own block-scaled main loop (block_gemm_sm90.cuh): 128 tokens x 256 weight rows, the
    // per-k-block promotion one 128-column half at a time (128 accumulators + 64 temporaries a
    // thread), so the 256-wide tile CUTLASS's blockwise main loop cannot build fits; unswapped, so
    // the fused W1's gate block and up block are the tile's two halves, paired in registers. The
    // fused W1 runs here alone: CUTLASS's blockwise main loop holds whole 1x128 output groups only
    // swapped (256 weight rows on its M side, 64 or 96 tokens), and those kernels measured slower
    // than fused-w1-128x256 at every m_e.
    // Chosen for block128's short-K GEMMs (DeepSeek-V3's W2, k = 2048: 16 k-blocks a tile), where
    // its two advantages over cooperative-128x128 count: a ragged expert's last token tile of <= 64
    // rows runs as half a tile (half pairs), and D leaves by TMA while the next tile's main loop runs
    // (ragged experts gain, full tiles break even). W1 (k = 7168) stays on cooperative: its main loop
    // is faster on full tiles.
    {GemmConfig::kBlock128x256, "block-128x256", 128, 256, 128, GemmSchedule::kCooperative, false, 128, -1, false, true,
     false,
     "block128, m_e > 64, k <= 2048: 256-wide tiles, half tiles for a ragged expert's last rows, D by TMA "
     "(moekit's main loop)",
     GemmMainLoop::kMoekit, false, 2048, false, false, 2},
    // 16-bit only (no FP8 instance: the FP8 rule never sees it): CUTLASS's 128 x 256 tile with a
    // 64-deep K tile of bf16 / fp16, both consumer warpgroups on one tile (128 fp32 accumulators a
    // thread; nothing to promote). Before cooperative-128x128, so that a 16-bit rule takes it past
    // 64 rows (bench/results/h100-2026-12-06-gemm-sixteen-bit.txt: W1 0.81-0.84 of cuBLASLt at m_e
    // 512-1024 against 0.70-0.76).
    {GemmConfig::kCooperative128x256,
     "cooperative-128x256",
     128,
     256,
     128,
     GemmSchedule::kCooperative,
     false,
     16,
     -1,
     false,
     false,
     false,
     "16-bit, m_e > 64: 128 x 256 tiles, both warpgroups on one tile",
     GemmMainLoop::kCutlass,
     false,
     -1,
     false,
     false,
     1,
     true},
    // Its ragged experts' last <= 64 rows run in the rule's swapped 32- / 64-token launch.
    {GemmConfig::kCooperative128x128,
     "cooperative-128x128",
     128,
     128,
     128,
     GemmSchedule::kCooperative,
     false,
     16,
     -1,
     true,
     true,
     false,
     "m_e > 64 when no pingpong tile runs n: 128x128 tiles, both warpgroups on one tile; a ragged expert's last "
     "<= 64 rows on the swapped tiles",
     GemmMainLoop::kCutlass,
     false,
     -1,
     true,
     false,
     1,
     true},
    {GemmConfig::kFusedW1Block128x256, "fused-w1-128x256", 128, 256, 128, GemmSchedule::kCooperative, false, 128, -1,
     false, false, true, "fused W1, every m_e: 128 tokens x 256 weight rows (moekit's main loop)",
     GemmMainLoop::kMoekit, false, -1, false, false, 2},
};
inline constexpr int kNumGemmConfigs = sizeof(kGemmConfigs) / sizeof(kGemmConfigs[0]);

// A config that splits ragged tails (splits_ragged_tail) hands rows to another launch from their own
// first row: it must be a CUTLASS kernel with tokens on its M side writing D by row, not a fused W1 or
// a w1_fp32 config (their codes and w1_small slots are laid out by expert, not by row).
constexpr bool ragged_tail_splitters_write_rows() {
  for (const auto& c : kGemmConfigs)
    if (c.splits_ragged_tail && (c.fused_w1 || c.w1_fp32 || c.swap_ab || c.main_loop != GemmMainLoop::kCutlass))
      return false;
  return true;
}
static_assert(ragged_tail_splitters_write_rows(), "a splits_ragged_tail config must write D row by row (see above)");

constexpr const GemmConfigInfo& gemm_config_info(GemmConfig config) {
  for (const auto& c : kGemmConfigs)
    if (c.id == config) return c;
  return kGemmConfigs[0];  // unreachable for a valid enum (every enumerator has a row: tested)
}

// A 16-bit GEMM (bf16 or fp16 operands, no scales) on the config's 16-bit instances: k % 8 == 0
// (16-byte TMA rows of 2-byte elements) and its n_multiple.
constexpr bool supports_sixteen_bit(const GemmConfigInfo& config, std::int64_t n, std::int64_t k) {
  return config.sixteen_bit && n > 0 && k > 0 && k % 8 == 0 && n % config.n_multiple == 0;
}

// Whether a recipe's GEMMs run on the configs' 16-bit instances (operands bf16 or fp16, no scales),
// not on their FP8 ones: its operands are 2-byte values without weight scales.
constexpr bool sixteen_bit_gemm(QuantScheme quant) {
  const RecipeInfo r = recipe_info(quant);
  return !has_weight_scales(r) && dtype_size(r.activation_dtype) == 2 && dtype_size(r.weight_dtype) == 2;
}

// FP8: every GEMM needs k % 16 == 0 (16-byte TMA rows); each config adds its n_multiple and an
// instance for the scaling (the recipe's block_scaled_gemm: moekit/recipe.h); the fused recipe's W1
// (a recipe with fused_w1) runs on the fused W1 configs and, for small experts, the fp32-D ones
// (w1_fp32); the fused W1 configs run nothing else. A 16-bit recipe (sixteen_bit_gemm: bf16) runs
// on the configs with 16-bit instances (supports_sixteen_bit) but the fast-accumulation-only one
// (pingpong-64x256: FP8 fast accumulation's tile; past 64 rows the 16-bit measurements chose
// cooperative-128x256), and never fuses W1: the rule takes swapab-128x32 for m_e <= 32,
// swapab-128x64 for m_e <= 64, cooperative-128x256 past that (tests/plan/test_recipe.cpp).
// A recipe without CUDA experts (cuda_experts) runs on none.
constexpr bool supports(const GemmConfigInfo& config, std::int64_t n, std::int64_t k,
                        QuantScheme quant = QuantScheme::kPerTokenPerChannel, bool fused_w1 = false) {
  if (!recipe_info(quant).cuda_experts) return false;
  if (sixteen_bit_gemm(quant))
    return !fused_w1 && !config.fused_w1 && !config.fast_accumulation_only && supports_sixteen_bit(config, n, k);
  return n > 0 && k > 0 && k % 16 == 0 && n % config.n_multiple == 0 &&
         (fused_w1
              ? (config.fused_w1 || config.w1_fp32) && recipe_info(quant).fused_w1
              : !config.fused_w1 && (recipe_info(quant).block_scaled_gemm ? config.block_scaled : config.token_scaled));
}

// Whether the rule may choose `config` for a GEMM of depth k (its max_k); supports() says whether it runs.
constexpr bool chosen_for_k(const GemmConfigInfo& config, std::int64_t k) {
  return config.max_k < 0 || k <= config.max_k;
}

// Whether the rule (select_gemm_config, plan_gemm_launches) considers `config` for this GEMM: it runs
// it, its max_k admits k and its accumulation is the problem's. Rows then pick among the eligible
// configs by max_rows.
constexpr bool eligible(const GemmConfigInfo& config, std::int64_t n, std::int64_t k,
                        QuantScheme quant = QuantScheme::kPerTokenPerChannel, bool fused_w1 = false,
                        Accumulation accumulation = Accumulation::kPrecise) {
  return supports(config, n, k, quant, fused_w1) && chosen_for_k(config, k) &&
         (!config.fast_accumulation_only || accumulation == Accumulation::kFast);
}

// The most rows an expert runs on the w1_fp32 configs in the fused recipe: the most any w1_fp32
// row of the table is chosen for.
constexpr std::int64_t fused_w1_small_rows() {
  std::int64_t rows = 0;
  for (const auto& c : kGemmConfigs)
    if (c.w1_fp32 && c.max_rows > rows) rows = c.max_rows;
  return rows;
}

// Whether the experts fuse the activation and its 1x128 quantization into the W1 GEMM (no w1_out;
// W1's fp32 output feeds the activation without a bf16 rounding, on every device: the CUDA epilogue
// or the activation kernel over w1_small's fp32 rows, the CPU's fp32 rows, the float64 reference):
// the problem's fuse_w1 where fuse_w1_runs (block128 with an activation whose W1 rows pair whole
// output groups in a 256-row tile, numerics::W1Rows kBlockPairs or kSingle; swigluoai's interleaved
// rows cannot). make_problem's default there: about the unfused rule's speed (within 5% either
// way) at a fifth of its workspace (docs/PERF.md).
bool fuses_w1(const MoeProblem& problem);

GemmConfig parse_gemm_config(std::string_view name);

// The config for a GEMM of (rows of one expert, n, k): the first row of the table that supports
// (n, k) and whose max_rows and max_k cover the rows and k. Raises moekit::Error when no config supports (n, k).
GemmConfig select_gemm_config(std::int64_t rows, std::int64_t n, std::int64_t k,
                              QuantScheme quant = QuantScheme::kPerTokenPerChannel,
                              Accumulation accumulation = Accumulation::kPrecise);

// The grouped-GEMM launches of one GEMM of the experts. The host cannot see how many rows each expert
// holds (the counts stay on the device), so it launches one grouped GEMM per config whose rows a
// step can hold, and the device prepare step gives each expert to the launch of the config the rule
// chooses for its own row count (0 rows in the others): launch j runs the experts with lo[j] <=
// m_e <= hi[j]. Skewed routing (a few experts with thousands of rows, most with a handful) gets
// each expert's best tile; uniform routing gets one launch.
// At most one launch per range of the rule: up to 32, up to 64, more (pingpong or cooperative).
inline constexpr int kMaxGemmLaunches = 3;
struct GemmLaunches {
  int count = 0;
  GemmConfig config[kMaxGemmLaunches] = {};
  std::int64_t lo[kMaxGemmLaunches] = {}, hi[kMaxGemmLaunches] = {};
  // > 0: launch j's token tile (its config splits_ragged_tail and another launch takes 1..tile/2
  // rows): an expert of launch j runs its ragged_tail_rows(m, tail_tile[j]) last rows in the launch
  // whose range holds them, the rows before in launch j.
  std::int64_t tail_tile[kMaxGemmLaunches] = {};
};
// The rows of a ragged expert's last token tile that leave its launch (GemmLaunches::tail_tile):
// of m rows in token tiles of `tile` rows, the m % tile rows of the last tile when it holds at most
// half a tile and a whole tile precedes it; 0 otherwise (nothing moves). gpt-oss at m_e = 300 on
// cooperative-128x128: 44 rows leave a third 128-row tile, which cost +46% of the step for +17%
// rows (docs/PERF.md). One rule: the plan, the prepare kernel and the tests read it.
constexpr std::int64_t ragged_tail_rows(std::int64_t m, std::int64_t tile) {
  if (tile <= 0 || m <= tile) return 0;
  const std::int64_t t = m % tile;
  return t <= tile / 2 ? t : 0;
}
// select_gemm_config's rule as row ranges, those that intersect [0, max_rows].
GemmLaunches plan_gemm_launches(std::int64_t n, std::int64_t k, std::int64_t max_rows,
                                QuantScheme quant = QuantScheme::kPerTokenPerChannel, bool fused_w1 = false,
                                Accumulation accumulation = Accumulation::kPrecise);
// Every expert on one config (benchmarks and tests sweep the table).
GemmLaunches single_launch(GemmConfig config);
std::string describe(const GemmLaunches& launches);

struct ExpertsGemmPlan {
  GemmLaunches w1;        // (m_e x K) . (N x K)^T
  GemmLaunches w2;        // (m_e x I) . (K x I)^T
  bool fused_w1 = false;  // the fused recipe: no w1_out; the fused W1 configs write act_q / act_scale
  // Of the fused recipe: some W1 launches are w1_fp32 configs, which write their experts' fp32 rows
  // into w1_small; the activation kernel then runs on those experts' rows only.
  bool w1_small = false;
};
// Whether W1 launch j writes w1_small (a w1_fp32 config in the fused recipe), not w1_out or act_q:
// what the plan's region, the prepare kernel's D pointers and the launch's D type all follow.
bool writes_w1_small(const ExpertsGemmPlan& gemms, int j);
// Whether a step runs the activation kernel between the GEMMs: unfused, or fused with experts in
// w1_small (the fused W1 writes act_q / act_scale itself for the others).
bool runs_activation_kernel(const ExpertsGemmPlan& gemms);
// Rows an expert of w1_small (the fused recipe's fp32 W1 output of its small experts): at most
// fused_w1_small_rows(), at most the rows an expert's slab holds (batched M, standard M * topk).
// The plan's region, the prepare kernel's slot stride and the activation kernel's rows read it.
std::int64_t w1_small_rows(const MoeProblem& problem);
// The most rows one local expert can receive in a step of tokens_per_rank tokens on every
// dispatcher (each token picks an expert at most once), at most its capacity.
std::int64_t max_rows_per_expert(const MoeProblem& problem, std::int64_t tokens_per_rank);
// The tokens per dispatcher a batched step is planned for (its GEMM launches, the rows an expert may
// hold): with one dispatcher the step's own num_tokens; with several, max_tokens_any_rank when the
// caller declared it (the most tokens any rank fed this step: engines that pad data-parallel ranks to
// one batch size know it), else max_tokens_per_rank. 0 means not known for either. Planned for
// max_tokens_per_rank, a decode step at DP 32 launched every row range's GEMMs, 4 of them empty
// (12-14 us, docs/PERF.md). Raises moekit::Error for a max_tokens_any_rank outside [num_tokens,
// max_tokens_per_rank] (0 aside).
std::int64_t step_tokens_per_rank(const MoeProblem& problem, std::int64_t num_tokens, std::int64_t max_tokens_any_rank);
// The errors of an expert's count, after the step (the expert ran with 0 rows, nothing past them
// was written); one text each for the CPU and the CUDA experts. A count outside [0, M]:
std::string bad_count_message(std::string_view who, std::int64_t expert, std::int64_t count, std::int64_t M);
// More rows than its step was planned for:
std::string over_step_bound_message(std::string_view who, std::int64_t expert, std::int64_t rows,
                                    std::int64_t max_rows);
// The fused recipe when fuses_w1(problem): the experts of <= fused_w1_small_rows() rows on the
// w1_fp32 configs + the activation kernel, the others on the fused W1; W1 GEMM + the activation
// kernel otherwise.
ExpertsGemmPlan plan_experts_gemms(const MoeProblem& problem, std::int64_t tokens_per_rank);
// One config on every expert of both GEMMs; a fused W1 config runs W1 only (every expert, no
// w1_small), W2 takes the rule's. The config must follow the problem's recipe (a fused W1 config
// iff fuses_w1): else an Error.
ExpertsGemmPlan single_config(GemmConfig config, const MoeProblem& problem);

}  // namespace moekit::plan
