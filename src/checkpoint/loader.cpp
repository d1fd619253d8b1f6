// The checkpoint loader (moekit/checkpoint.h): tensor names from the family's naming, each tensor
// checked against the config, then every expert matrix either moved as stored (FP8 of the problem's
// granularity) or decoded to fp32 and quantized by cpu::quantize_weight, in the W1 row layout of the
// problem's activation and scheme (numerics::w1_rows).
#include "moekit/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <mutex>
#include <set>
#include <string_view>
#include <thread>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/mxfp4.h"
#include "checkpoint/weight_values.h"
#include "cpu/quant.h"
#include "cpu/thread_pool.h"
#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/model.h"
#include "moekit/recipe.h"
#include "numerics/activation.h"
#include "numerics/fp8.h"
#include "numerics/mxfp4.h"
#include "numerics/scales.h"

namespace moekit {
namespace {

using checkpoint::CheckpointDir;
using checkpoint::TensorDType;
using checkpoint::TensorInfo;

float f16_decode(std::uint16_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  std::uint32_t bits = 0;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man != 0) {  // subnormal: normalize
    int e = -1;
    std::uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400u) == 0);
    bits = sign | (static_cast<std::uint32_t>(112 - e) << 23) | ((m & 0x3FFu) << 13);
  } else {
    bits = sign;
  }
  float f = 0;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Element i of a float tensor's bytes (bf16, fp16, fp32; unaligned-safe).
float float_at(const std::byte* data, TensorDType d, std::int64_t i) {
  if (d == TensorDType::kF32) {
    float f = 0;
    std::memcpy(&f, data + 4 * i, 4);
    return f;
  }
  std::uint16_t h = 0;
  std::memcpy(&h, data + 2 * i, 2);
  return d == TensorDType::kBF16 ? numerics::bf16_decode(h) : f16_decode(h);
}

// The Error for element `bad` of a tensor's bytes that breaks `rule`: the shard, the tensor, the element.
[[noreturn]] void fail_value(const std::string& file, const std::string& name, const std::byte* data, TensorDType dtype,
                             const std::vector<std::int64_t>& shape, std::int64_t bad, checkpoint::ValueRule rule) {
  const bool scale = rule == checkpoint::ValueRule::kFinitePositive;
  MOEKIT_FAIL(
      "{}: tensor '{}' element {} (flat index {}) is {}: {} must be finite{}; the checkpoint is corrupt: "
      "download or convert it again",
      file, name, checkpoint::coordinates(shape, bad), bad, checkpoint::value_text(data, dtype, bad),
      scale ? "a scale" : "a weight", scale ? " and > 0" : "");
}

enum class Granularity : std::uint8_t { kTensor, kChannel, kBlock };

// One (n, k) weight matrix inside a checkpoint tensor: element (r, c) at offset + r * stride_r + c *
// stride_c (elements), so a per-expert tensor, a slice of a fused one and a transposed one read
// alike. FP8 matrices carry their scale tensor (per-expert tensors only).
struct Matrix {
  std::string name;
  TensorDType dtype = TensorDType::kBF16;
  const std::byte* data = nullptr;
  const checkpoint::SafetensorsFile* shard = nullptr;  // the file data lies in (codes_rows reads through it)
  std::int64_t n = 0, k = 0, offset = 0, stride_r = 0, stride_c = 1;
  // What the value check scans: elements [region_begin, region_end) of the tensor (its shape), in
  // the shard `file`: a per-expert tensor whole, a fused tensor's expert slab.
  std::string file;
  std::vector<std::int64_t> shape;
  std::int64_t region_begin = 0, region_end = 0;
  // FP8 only.
  const std::byte* scale = nullptr;
  TensorDType scale_dtype = TensorDType::kF32;
  Granularity granularity = Granularity::kTensor;
  std::int64_t scale_cols = 1;  // block scales per row of blocks
  std::string scale_name, scale_file;
  std::vector<std::int64_t> scale_shape;

  float scale_of(std::int64_t r, std::int64_t c) const {
    const std::int64_t i = granularity == Granularity::kTensor    ? 0
                           : granularity == Granularity::kChannel ? r
                                                                  : (r / kQuantBlock) * scale_cols + c / kQuantBlock;
    return float_at(scale, scale_dtype, i);
  }
  // Row r's k FP8 codes into dst (one copy where the row is contiguous), checked there for NaN codes
  // while the row is in cache: the value check of codes that move as stored, in the copy's one pass.
  void codes_row(std::int64_t r, std::uint8_t* dst) const {
    const std::byte* src = data + offset + r * stride_r;
    if (stride_c == 1) {
      std::memcpy(dst, src, static_cast<std::size_t>(k));
    } else {
      for (std::int64_t c = 0; c < k; ++c) dst[c] = static_cast<std::uint8_t>(src[c * stride_c]);
    }
    const std::int64_t bad = checkpoint::first_bad_value(reinterpret_cast<const std::byte*>(dst), TensorDType::kF8E4M3,
                                                         0, k, checkpoint::ValueRule::kFinite);
    if (bad >= 0)
      fail_value(file, name, data, dtype, shape, offset + r * stride_r + bad * stride_c,
                 checkpoint::ValueRule::kFinite);
  }
  // Rows r0 .. r0 + rows - 1 into dst one after another, checked as codes_row checks: rows that lie
  // contiguous in the shard are read through it (SafetensorsFile::copy_out: pread, no mapping) about
  // 1 MiB at a time, each piece checked while in cache; others row by row.
  void codes_rows(std::int64_t r0, std::int64_t rows, std::uint8_t* dst) const {
    if (shard == nullptr || stride_c != 1 || stride_r != k || dtype != TensorDType::kF8E4M3) {
      for (std::int64_t i = 0; i < rows; ++i) codes_row(r0 + i, dst + i * k);
      return;
    }
    const std::int64_t piece = std::max<std::int64_t>(1, (std::int64_t{1} << 20) / k);
    for (std::int64_t i = 0; i < rows; i += piece) {
      const std::int64_t n_rows = std::min(piece, rows - i), at = offset + (r0 + i) * stride_r;
      shard->copy_out(data + at, n_rows * k, dst + i * k);
      const std::int64_t bad =
          checkpoint::first_bad_value(reinterpret_cast<const std::byte*>(dst + i * k), TensorDType::kF8E4M3, 0,
                                      n_rows * k, checkpoint::ValueRule::kFinite);
      if (bad >= 0) fail_value(file, name, data, dtype, shape, at + bad, checkpoint::ValueRule::kFinite);
    }
  }
  // Row r's k values as floats (FP8 dequantized by its scales): the dtype chosen once a row, the
  // inner loops plain loads and shifts (a slice of a fused tensor strided, a transposed one across rows).
  void floats_row(std::int64_t r, float* dst) const {
    const std::int64_t base = offset + r * stride_r;
    switch (dtype) {
      case TensorDType::kF8E4M3:
        for (std::int64_t c0 = 0; c0 < k; c0 += kQuantBlock) {
          const float s = scale_of(r, c0);
          const std::int64_t c1 = std::min(k, c0 + kQuantBlock);
          for (std::int64_t c = c0; c < c1; ++c)
            dst[c] = numerics::fp8_decode(static_cast<std::uint8_t>(data[base + c * stride_c])) * s;
        }
        return;
      case TensorDType::kBF16:
      case TensorDType::kF16: {
        const bool bf16 = dtype == TensorDType::kBF16;
        for (std::int64_t c = 0; c < k; ++c) {
          std::uint16_t h = 0;
          std::memcpy(&h, data + 2 * (base + c * stride_c), 2);
          dst[c] = bf16 ? numerics::bf16_decode(h) : f16_decode(h);
        }
        return;
      }
      case TensorDType::kF32:
        if (stride_c == 1) {
          std::memcpy(dst, data + 4 * base, static_cast<std::size_t>(4 * k));
          return;
        }
        for (std::int64_t c = 0; c < k; ++c) std::memcpy(dst + c, data + 4 * (base + c * stride_c), 4);
        return;
      default: MOEKIT_FAIL("{}: a weight of dtype {} cannot be read as floats", name, checkpoint::dtype_name(dtype));
    }
  }
};

// The scale granularity a checkpoint stores the recipe's weights in (its row's weight scales).
std::optional<Granularity> granularity_of(QuantScheme q) {
  switch (recipe_info(q).weight_scales) {
    case WeightScales::kNone: return std::nullopt;  // unquantized: no FP8 moves as stored
    case WeightScales::kPerTensor: return Granularity::kTensor;
    case WeightScales::kPerOutputChannel: return Granularity::kChannel;
    case WeightScales::kBlock128x128: return Granularity::kBlock;
  }
  return std::nullopt;
}

std::string_view granularity_name(Granularity g) {
  return g == Granularity::kTensor    ? "one scale per tensor"
         : g == Granularity::kChannel ? "one scale per row"
                                      : "128x128 block scales";
}

std::string shape_str(const std::vector<std::int64_t>& s) {
  return fmt::format("({})", fmt::join(s, ", "));
}

// Where a family keeps its MoE block inside a layer and its router inside the block, as its
// checkpoints name them (transformers' save_pretrained writes the same names).
std::string_view block_of(WeightNames n) {
  return n == WeightNames::kMixtral || n == WeightNames::kGranite ? "block_sparse_moe."
         : n == WeightNames::kJamba                               ? "feed_forward."
                                                                  : "mlp.";
}
std::string_view router_of(WeightNames n) {
  return n == WeightNames::kGptOss || n == WeightNames::kJamba ? "router.weight"
         : n == WeightNames::kGranite                          ? "router.layer.weight"
                                                               : "gate.weight";
}

// The tensor names of one family's MoE block of layer L.
struct Names {
  WeightNames naming;
  std::string prefix;  // "model.layers.L." and block_of(naming)

  std::string expert(std::int64_t e, std::string_view which) const {  // which: gate, up, down
    if (naming == WeightNames::kMixtral)
      return fmt::format("{}experts.{}.{}.weight", prefix, e, which == "gate" ? "w1" : which == "up" ? "w3" : "w2");
    return fmt::format("{}experts.{}.{}_proj.weight", prefix, e, which);
  }
  std::string router() const { return prefix + std::string(router_of(naming)); }
  // The experts in two fused tensors: W1 (E, 2I, K) gate rows then up rows (gpt-oss: (E, K, 2I)
  // interleaved), W2 (E, K, I) (gpt-oss: (E, I, K)); granite's input_linear and output_linear.
  std::string fused_w1() const {
    return prefix + (naming == WeightNames::kGranite ? "input_linear.weight" : "experts.gate_up_proj");
  }
  std::string fused_w2() const {
    return prefix + (naming == WeightNames::kGranite ? "output_linear.weight" : "experts.down_proj");
  }
  std::string shared(std::string_view which) const {
    return fmt::format("{}{}.{}_proj.weight", prefix, naming == WeightNames::kQwen ? "shared_expert" : "shared_experts",
                       which);
  }
};

}  // namespace

struct Checkpoint::Impl {
  CheckpointDir dir;
  ModelConfig model;
  std::vector<std::int64_t> layers;

  Impl(const std::string& path, int load_threads)
      : dir(path), model(load_model_config_file(dir.config_path())), num_threads(load_threads) {
    MOEKIT_CHECK(model.weight_names != WeightNames::kNone,
                 "{}: moekit's checkpoint loader does not know how model_type '{}' names its MoE tensors (it reads "
                 "the deepseek, qwen, mixtral, gpt_oss, granitemoe and jamba families' names); pass the weights in "
                 "memory instead",
                 dir.config_path(), model.model_type);
    const std::string router_leaf =
        std::string(block_of(model.weight_names)) + std::string(router_of(model.weight_names));
    std::set<std::int64_t> found;
    for (const std::string& name : dir.tensor_names()) {
      constexpr std::string_view head = "model.layers.";
      if (!name.starts_with(head)) continue;
      const std::string_view rest = std::string_view(name).substr(head.size());
      std::int64_t L = -1;
      const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), L);
      if (ec != std::errc() || end == rest.data() || *end != '.') continue;
      if (std::string_view(end + 1) == router_leaf && L < model.num_layers) found.insert(L);
    }
    layers.assign(found.begin(), found.end());
  }

  Names names(std::int64_t L) const {
    return {model.weight_names, fmt::format("model.layers.{}.{}", L, block_of(model.weight_names))};
  }

  // The tensor, checked to have `shape` (when given) and a dtype of `dtypes`.
  const TensorInfo& tensor(const std::string& name, const std::vector<std::int64_t>& shape,
                           std::initializer_list<TensorDType> dtypes, std::string_view what) {
    MOEKIT_CHECK(dir.contains(name), "{}: the checkpoint holds no tensor '{}' ({}), which model_type '{}' needs",
                 dir.dir(), name, what, model.model_type);
    const TensorInfo& t = dir.info(name);
    MOEKIT_CHECK(shape.empty() || t.shape == shape, "{}: tensor '{}' ({}) has shape {}, the config says {}", dir.dir(),
                 name, what, shape_str(t.shape), shape_str(shape));
    if (std::find(dtypes.begin(), dtypes.end(), t.dtype) == dtypes.end()) {
      std::vector<std::string_view> accepted;
      for (const TensorDType d : dtypes) accepted.push_back(checkpoint::dtype_name(d));
      MOEKIT_FAIL("{}: tensor '{}' ({}) is {}; moekit reads {} there", dir.dir(), name, what,
                  checkpoint::dtype_name(t.dtype), fmt::join(accepted, ", "));
    }
    return t;
  }

  const std::byte* bytes(const std::string& name) { return dir.data(name).data(); }

  Matrix matrix(const std::string& name, const TensorInfo& t, std::int64_t n, std::int64_t k) {
    Matrix m;
    m.name = name;
    m.dtype = t.dtype;
    m.data = bytes(name);
    m.shard = &dir.file_of(name);
    m.n = n;
    m.k = k;
    return m;
  }

  // A per-expert (n, k) weight: float, or FP8 with its scale tensor (weight_scale_inv or weight_scale).
  Matrix stored(const std::string& name, std::int64_t n, std::int64_t k, std::string_view what) {
    const TensorInfo& t =
        tensor(name, {n, k}, {TensorDType::kBF16, TensorDType::kF16, TensorDType::kF32, TensorDType::kF8E4M3}, what);
    Matrix m = matrix(name, t, n, k);
    m.stride_r = k;
    m.file = dir.shard_path(name);
    m.shape = t.shape;
    m.region_end = t.numel();
    if (t.dtype != TensorDType::kF8E4M3) return m;
    MOEKIT_CHECK(!model.checkpoint_format.empty(),
                 "{}: tensor '{}' is F8_E4M3, but config.json has no quantization_config (it describes an unquantized "
                 "checkpoint): the config and the weights disagree; restore the quantization_config the checkpoint "
                 "was saved with (DeepSeek-V3: quant_method fp8, weight_block_size [128, 128])",
                 dir.dir(), name);
    const std::string base = name.substr(0, name.size() - std::string_view(".weight").size());
    std::string sname = base + ".weight_scale_inv";
    if (!dir.contains(sname)) sname = base + ".weight_scale";
    MOEKIT_CHECK(dir.contains(sname),
                 "{}: FP8 tensor '{}' has no scale tensor ('{}.weight_scale_inv' or '.weight_scale'): an FP8 "
                 "weight without its scales cannot be read",
                 dir.dir(), name, base);
    const TensorInfo& s = tensor(sname, {}, {TensorDType::kF32, TensorDType::kBF16}, "FP8 weight scales");
    const std::int64_t bn = (n + kQuantBlock - 1) / kQuantBlock, bk = (k + kQuantBlock - 1) / kQuantBlock;
    if (s.numel() == 1) {
      m.granularity = Granularity::kTensor;
    } else if (s.shape == std::vector<std::int64_t>{n} || s.shape == std::vector<std::int64_t>{n, 1}) {
      m.granularity = Granularity::kChannel;
    } else if (s.shape == std::vector<std::int64_t>{bn, bk}) {
      m.granularity = Granularity::kBlock;
      m.scale_cols = bk;
    } else {
      MOEKIT_FAIL(
          "{}: scale tensor '{}' has shape {}: for a weight of shape ({}, {}) moekit reads one scale, one "
          "per row ({}) or 128x128 blocks ({}, {})",
          dir.dir(), sname, shape_str(s.shape), n, k, n, bn, bk);
    }
    m.scale = bytes(sname);
    m.scale_dtype = s.dtype;
    m.scale_name = sname;
    m.scale_file = dir.shard_path(sname);
    m.scale_shape = s.shape;
    return m;
  }

  // Expert e's (n, k) slice of a fused float tensor (E, ., .): rows from `row0` step `row_step`,
  // transposed when the tensor holds K first (gpt-oss).
  Matrix fused(const std::string& name, std::int64_t e, std::int64_t n, std::int64_t k, std::int64_t row0,
               std::int64_t row_step, bool transposed, std::int64_t dim1, std::int64_t dim2) {
    const TensorInfo& t = tensor(name, {model.num_experts, dim1, dim2},
                                 {TensorDType::kBF16, TensorDType::kF16, TensorDType::kF32}, "fused experts");
    Matrix m = matrix(name, t, n, k);
    m.offset = e * dim1 * dim2;
    m.file = dir.shard_path(name);
    m.shape = t.shape;
    m.region_begin = e * dim1 * dim2;
    m.region_end = (e + 1) * dim1 * dim2;
    if (transposed) {  // element (r, c) of W at [c][row0 + r * row_step] of the (dim1 = k, dim2) expert
      m.offset += row0;
      m.stride_r = row_step;
      m.stride_c = dim2;
    } else {  // at [row0 + r * row_step][c]
      m.offset += row0 * dim2;
      m.stride_r = row_step * dim2;
      m.stride_c = 1;
    }
    return m;
  }

  // Whether `m` moves into problem `p` as stored: FP8 of the problem's granularity.
  static bool as_stored(const MoeProblem& p, const Matrix& m) {
    return m.dtype == TensorDType::kF8E4M3 && granularity_of(p.quant) == m.granularity;
  }

  // Whether W1 moves as stored from gate and up: both FP8 of the problem's granularity; per-tensor
  // only when both carry one and the same scale; block scales move with whole 128-row blocks, not
  // into interleaved rows.
  static bool w1_as_stored(const MoeProblem& p, const Matrix& gate, const Matrix* up) {
    return as_stored(p, gate) && (up == nullptr || as_stored(p, *up)) &&
           (recipe_info(p.quant).weight_scales != WeightScales::kBlock128x128 ||
            numerics::w1_rows(p.activation, p.quant) != numerics::W1Rows::kInterleaved) &&
           (recipe_info(p.quant).weight_scales != WeightScales::kPerTensor || up == nullptr ||
            gate.scale_of(0, 0) == up->scale_of(0, 0));
  }

  // Fills expert slot `slot` of `out` from its gate and up matrices (W1; up is null for single-row
  // activations); returns whether the codes were moved as stored. Slots and the two GEMMs' weights
  // of one slot are filled in parallel: each writes only its own codes and scales.
  // scratch: the fp32 matrix a quantized load decodes into (resized here; one per thread, reused:
  // a fresh 4-byte-an-element buffer for each matrix cost page faults on every one).
  static bool put_w1(HostExpertWeights& out, std::int64_t slot, const Matrix& gate, const Matrix* up,
                     std::vector<float>& scratch) {
    const MoeProblem& p = out.problem;
    const std::int64_t N = p.N, K = p.K, I = p.I();
    const numerics::W1Rows rows = numerics::w1_rows(p.activation, p.quant);
    const std::int64_t s1 = numerics::weight_scale_count(p.quant, N, K);
    const WeightScales scales = recipe_info(p.quant).weight_scales;
    std::uint8_t* w1 = out.w1.data() + slot * N * K * out.view().element_bytes();
    float* sc1 = out.w1_scale.data() + slot * s1;
    const bool w1_stored = w1_as_stored(p, gate, up);
    auto dest_row = [&](bool is_up, std::int64_t c) {
      return is_up ? numerics::up_column(rows, I, c) : numerics::gate_column(rows, I, c);
    };
    if (w1_stored) {
      for (int part = 0; part < (up ? 2 : 1); ++part) {
        const Matrix& m = part == 0 ? gate : *up;
        // The codes in runs of rows whose destination rows are consecutive too (a 128-row block at
        // least under W1Rows::kBlockPairs; all I rows of a part under kHalves).
        for (std::int64_t r = 0; r < I;) {
          std::int64_t run = 1;
          const std::int64_t d = dest_row(part == 1, r);
          while (r + run < I && dest_row(part == 1, r + run) == d + run) ++run;
          m.codes_rows(r, run, w1 + d * K);
          r += run;
        }
        for (std::int64_t r = 0; r < I; ++r) {
          const std::int64_t d = dest_row(part == 1, r);
          if (scales == WeightScales::kPerOutputChannel) sc1[d] = m.scale_of(r, 0);
          if (scales == WeightScales::kBlock128x128 && r % kQuantBlock == 0)
            for (std::int64_t b = 0; b < m.scale_cols; ++b)
              sc1[(d / kQuantBlock) * m.scale_cols + b] = m.scale_of(r, b * kQuantBlock);
        }
      }
      if (scales == WeightScales::kPerTensor) sc1[0] = gate.scale_of(0, 0);
    } else {
      std::vector<float>& w = scratch;
      w.resize(std::max(w.size(), static_cast<std::size_t>(N * K)));
      for (int part = 0; part < (up ? 2 : 1); ++part) {
        const Matrix& m = part == 0 ? gate : *up;
        for (std::int64_t r = 0; r < I; ++r) {
          m.floats_row(r, w.data() + dest_row(part == 1, r) * K);
          check_range(p, m, w.data() + dest_row(part == 1, r) * K, r, K);
        }
      }
      cpu::store_weight(p.quant, w.data(), N, K, w1, sc1);  // values of the recipe's dtype: rounded back to themselves
    }
    return w1_stored;
  }

  // The fp16 recipe holds no finite value that rounds to inf (numerics::fp16_overflows): one in row r
  // of `m` is refused, naming the tensor, the element and what runs it (store_weight's check, made
  // here where the tensor's own row and column are known).
  static void check_range(const MoeProblem& p, const Matrix& m, const float* row, std::int64_t r, std::int64_t cols) {
    if (recipe_info(p.quant).weight_dtype != DType::kFp16) return;
    for (std::int64_t c = 0; c < cols; ++c)
      MOEKIT_CHECK(!numerics::fp16_overflows(row[c]),
                   "{}: '{}' element ({}, {}) = {} is beyond fp16's largest finite value {}: --quant fp16 cannot "
                   "hold it; run --quant bf16 (or auto)",
                   m.file, m.name, r, c, row[c], numerics::kFp16Max);
  }

  // Fills expert slot `slot`'s W2 from `down`; returns whether the codes were moved as stored.
  static bool put_w2(HostExpertWeights& out, std::int64_t slot, const Matrix& down, std::vector<float>& scratch) {
    const MoeProblem& p = out.problem;
    const std::int64_t K = p.K, I = p.I();
    const std::int64_t s2 = numerics::weight_scale_count(p.quant, K, I);
    std::uint8_t* w2 = out.w2.data() + slot * K * I * out.view().element_bytes();
    float* sc2 = out.w2_scale.data() + slot * s2;
    const bool w2_stored = as_stored(p, down);
    if (w2_stored) {
      const WeightScales scales = recipe_info(p.quant).weight_scales;
      down.codes_rows(0, K, w2);
      for (std::int64_t i = 0; i < s2; ++i)
        sc2[i] = scales == WeightScales::kPerTensor ? down.scale_of(0, 0)
                 : scales == WeightScales::kPerOutputChannel
                     ? down.scale_of(i, 0)
                     : down.scale_of((i / down.scale_cols) * kQuantBlock, (i % down.scale_cols) * kQuantBlock);
    } else {
      std::vector<float>& w = scratch;
      w.resize(std::max(w.size(), static_cast<std::size_t>(K * I)));
      for (std::int64_t r = 0; r < K; ++r) {
        down.floats_row(r, w.data() + r * I);
        check_range(p, down, w.data() + r * I, r, I);
      }
      cpu::store_weight(p.quant, w.data(), K, I, w2, sc2);
    }
    return w2_stored;
  }

  static HostExpertWeights empty_experts(const MoeProblem& p, std::int64_t first_expert) {
    HostExpertWeights w;
    w.problem = p;
    w.first_expert = first_expert;
    const std::int64_t N = p.N, K = p.K, I = p.I(), wb = dtype_size(recipe_info(p.quant).weight_dtype);
    w.w1.resize(static_cast<std::size_t>(p.E_local * N * K * wb));
    w.w2.resize(static_cast<std::size_t>(p.E_local * K * I * wb));
    w.w1_scale.resize(static_cast<std::size_t>(p.E_local * numerics::weight_scale_count(p.quant, N, K)));
    w.w2_scale.resize(static_cast<std::size_t>(p.E_local * numerics::weight_scale_count(p.quant, K, I)));
    if (p.expert_bias) {
      w.w1_bias.resize(static_cast<std::size_t>(p.E_local * N));
      w.w2_bias.resize(static_cast<std::size_t>(p.E_local * K));
    }
    return w;
  }

  void check_problem(const MoeProblem& p) const {
    MOEKIT_CHECK(p.K == model.hidden_size && p.I() == model.moe_intermediate_size && p.E == model.num_experts,
                 "load_layer: the problem ({}) is not one of this checkpoint's model (hidden_size {}, "
                 "moe_intermediate_size {}, {} experts): build it with make_problem from Checkpoint::model()",
                 p.describe(), model.hidden_size, model.moe_intermediate_size, model.num_experts);
    MOEKIT_CHECK(p.expert_bias == model.expert_bias, "load_layer: the problem {} expert biases, the model {}",
                 p.expert_bias ? "has" : "has no", model.expert_bias ? "has" : "has none");
    MOEKIT_CHECK(p.activation == model.activation,
                 "load_layer: the problem's activation {} is not the model's ({}): the checkpoint's W1 holds the "
                 "model's gate and up rows",
                 activation_name(p.activation), activation_name(model.activation));
  }

  // ---- One layer's reads: every tensor a load touches, checked against the config from the headers
  // alone (names, dtypes, shapes, scale layouts), before any buffer is sized or any value read.
  struct ExpertMatrices {
    Matrix gate, up, down;
  };
  // gpt-oss's released experts: MXFP4 packed codes and e8m0 exponents, converted exactly at load.
  struct Mxfp4Reads {
    std::string w1_name, w2_name;  // the *_blocks tensors (their *_scales beside them)
    std::string w1_file, w2_file;
    const std::uint8_t *w1_blocks = nullptr, *w1_exponents = nullptr, *w2_blocks = nullptr, *w2_exponents = nullptr;
  };
  struct LayerReads {
    std::vector<ExpertMatrices> routed;  // one per local slot (not for MXFP4)
    std::optional<Mxfp4Reads> mxfp4;     // gpt-oss's MXFP4 experts instead
    bool per_expert = true;              // one tensor per expert (else fused tensors)
    std::string stored_as;
    // The routed experts' float tensors are the unquantized recipe's own dtype (bf16 or fp16): read
    // bit for bit.
    bool stored_in_recipe_dtype = false;
    std::optional<ExpertMatrices> shared;
    std::optional<MoeProblem> shared_problem;
  };

  // The model's sizes the reads are checked against (a problem of this model: check_problem).
  LayerReads plan_reads(const Names& nm, const MoeProblem& p, const std::vector<std::int64_t>& experts,
                        bool want_shared) {
    const std::int64_t K = p.K, I = p.I(), E = p.E;
    const bool gated = numerics::w1_rows(p.activation, p.quant) != numerics::W1Rows::kSingle;
    MOEKIT_CHECK(gated, "{}: loading non-gated experts ({}) is not supported: the families moekit loads are gated",
                 dir.dir(), activation_name(p.activation));
    const std::string fused_w1 = nm.fused_w1(), fused_w2 = nm.fused_w2();
    const bool mxfp4 = dir.contains(fused_w1 + "_blocks") || dir.contains(fused_w1 + "_scales");
    const std::string first = nm.expert(experts.front(), "gate");
    MOEKIT_CHECK(!dir.contains(first.substr(0, first.size() - 7) + ".weight_packed"),
                 "{}: '{}' is packed int4 (compressed-tensors), which moekit does not read", dir.dir(),
                 first.substr(0, first.size() - 7) + ".weight_packed");
    // NOTES: an unquantized recipe takes float weights only. FP8 (or MXFP4) into bf16 would be a
    // dequantization, code x fp32 scale, which bf16 does not hold exactly in general (an 8-bit
    // significand for a 4-bit code times a 24-bit scale): refused rather than rounded silently.
    const RecipeInfo recipe = recipe_info(p.quant);
    auto refuse_quantized = [&](std::string_view stored_as) {
      MOEKIT_FAIL(
          "{}: the experts are stored as {}, but --quant {} runs unquantized {} weights; moekit does not dequantize "
          "FP8 or MXFP4 weights into {} (not exact): run the checkpoint as stored (--quant auto) or with --quant "
          "per-token / block128",
          dir.dir(), stored_as, recipe.name, dtype_name(recipe.weight_dtype), dtype_name(recipe.weight_dtype));
    };
    if (mxfp4 && !has_weight_scales(recipe)) refuse_quantized("MXFP4");
    LayerReads r = mxfp4 ? plan_mxfp4(nm, p) : LayerReads{};
    if (!mxfp4) {
      r.per_expert = nm.naming != WeightNames::kGptOss && !dir.contains(fused_w1);
      r.routed.reserve(experts.size());
      for (const std::int64_t g : experts) {
        if (r.per_expert) {
          r.routed.push_back({stored(nm.expert(g, "gate"), I, K, "an expert's gate rows"),
                              stored(nm.expert(g, "up"), I, K, "an expert's up rows"),
                              stored(nm.expert(g, "down"), K, I, "an expert's W2")});
        } else if (nm.naming == WeightNames::kGptOss) {
          // (E, K, 2I) with gate/up interleaved along the last axis; down (E, I, K).
          r.routed.push_back({fused(fused_w1, g, I, K, 0, 2, true, K, 2 * I),
                              fused(fused_w1, g, I, K, 1, 2, true, K, 2 * I),
                              fused(fused_w2, g, K, I, 0, 1, true, I, K)});
        } else {
          // transformers' in-memory form: (E, 2I, K) gate rows then up rows; down (E, K, I).
          r.routed.push_back({fused(fused_w1, g, I, K, 0, 1, false, 2 * I, K),
                              fused(fused_w1, g, I, K, I, 1, false, 2 * I, K),
                              fused(fused_w2, g, K, I, 0, 1, false, K, I)});
        }
      }
      const Matrix& g0 = r.routed.front().gate;
      r.stored_as = g0.dtype == TensorDType::kF8E4M3 ? fmt::format("F8_E4M3 with {}", granularity_name(g0.granularity))
                                                     : std::string(checkpoint::dtype_name(g0.dtype));
      const TensorDType own = recipe.weight_dtype == DType::kFp16 ? TensorDType::kF16 : TensorDType::kBF16;
      r.stored_in_recipe_dtype =
          !has_weight_scales(recipe) && std::all_of(r.routed.begin(), r.routed.end(), [own](const ExpertMatrices& x) {
            return x.gate.dtype == own && x.up.dtype == own && x.down.dtype == own;
          });
      if (!has_weight_scales(recipe))
        for (const ExpertMatrices& x : r.routed)
          for (const Matrix* m : {&x.gate, &x.up, &x.down})
            if (m->dtype == TensorDType::kF8E4M3) refuse_quantized(fmt::format("F8_E4M3 ('{}')", m->name));
    }
    const auto float_types = {TensorDType::kBF16, TensorDType::kF16, TensorDType::kF32};
    if (p.expert_bias) {
      MOEKIT_CHECK(nm.naming == WeightNames::kGptOss, "{}: expert biases are read for gpt_oss only", dir.dir());
      tensor(nm.prefix + "experts.gate_up_proj_bias", {E, 2 * I}, float_types, "W1 biases");
      tensor(nm.prefix + "experts.down_proj_bias", {E, K}, float_types, "W2 biases");
    }
    tensor(nm.router(), {E, K}, float_types, "the router's weight");
    if (nm.naming == WeightNames::kGptOss) tensor(nm.prefix + "router.bias", {E}, float_types, "the router's bias");
    if (model.has_score_correction_bias)
      tensor(nm.prefix + "gate.e_score_correction_bias", {E}, float_types, "the router's e_score_correction_bias");
    if (want_shared) r.shared_problem = shared_experts_problem(model, p);
    if (r.shared_problem) {
      const std::int64_t Is = r.shared_problem->I();
      r.shared = ExpertMatrices{stored(nm.shared("gate"), Is, K, "the shared experts' gate rows"),
                                stored(nm.shared("up"), Is, K, "the shared experts' up rows"),
                                stored(nm.shared("down"), K, Is, "the shared experts' W2")};
      if (!has_weight_scales(recipe))
        for (const Matrix* m : {&r.shared->gate, &r.shared->up, &r.shared->down})
          if (m->dtype == TensorDType::kF8E4M3) refuse_quantized(fmt::format("F8_E4M3 ('{}')", m->name));
      if (model.shared_expert_gate)
        tensor(nm.prefix + "shared_expert_gate.weight", {1, K}, float_types, "shared_expert_gate");
    }
    return r;
  }

  // gpt-oss's MXFP4 experts as released: gate_up_proj_blocks (E, 2I, K / 32, 16) and _scales (E, 2I,
  // K / 32) (rows the interleaved gate/up outputs, as moekit's swigluoai W1 reads them), down_proj's
  // (E, K, I / 32, 16) and (E, K, I / 32), all U8; converted at load (checkpoint/mxfp4.h).
  // The experts only: plan_reads checks the biases, the router and the rest as for any family.
  LayerReads plan_mxfp4(const Names& nm, const MoeProblem& p) {
    const std::int64_t K = p.K, I = p.I(), E = p.E, mx = numerics::kMxBlock;
    MOEKIT_CHECK(nm.naming == WeightNames::kGptOss && p.activation == Activation::kSwigluOai,
                 "{}: MXFP4 experts are read in gpt-oss's layout only (model_type '{}')", dir.dir(), model.model_type);
    MOEKIT_CHECK(K % mx == 0 && I % mx == 0, "{}: MXFP4 experts need K = {} and I = {} in whole blocks of {}",
                 dir.dir(), K, I, mx);
    const std::string w1 = nm.fused_w1(), w2 = nm.fused_w2();
    const auto u8 = {TensorDType::kU8};
    tensor(w1 + "_blocks", {E, 2 * I, K / mx, numerics::kMxBlockBytes}, u8, "MXFP4 W1 codes");
    tensor(w1 + "_scales", {E, 2 * I, K / mx}, u8, "MXFP4 W1 exponents");
    tensor(w2 + "_blocks", {E, K, I / mx, numerics::kMxBlockBytes}, u8, "MXFP4 W2 codes");
    tensor(w2 + "_scales", {E, K, I / mx}, u8, "MXFP4 W2 exponents");
    LayerReads r;
    r.per_expert = false;
    r.stored_as = "MXFP4";
    auto at = [&](const std::string& name) { return reinterpret_cast<const std::uint8_t*>(bytes(name)); };
    r.mxfp4 = Mxfp4Reads{w1 + "_blocks",
                         w2 + "_blocks",
                         dir.shard_path(w1 + "_blocks"),
                         dir.shard_path(w2 + "_blocks"),
                         at(w1 + "_blocks"),
                         at(w1 + "_scales"),
                         at(w2 + "_blocks"),
                         at(w2 + "_scales")};
    return r;
  }

  // Slot `slot`'s W1 or W2 from expert g's MXFP4 matrix, exact or an Error naming the value that is not.
  static void put_mxfp4(HostExpertWeights& out, std::int64_t slot, std::int64_t g, const Mxfp4Reads& m, bool w2) {
    const MoeProblem& p = out.problem;
    const std::int64_t rows = w2 ? p.K : p.N, cols = w2 ? p.I() : p.K, groups = cols / numerics::kMxBlock;
    const std::int64_t scales = numerics::weight_scale_count(p.quant, rows, cols);
    const checkpoint::Mxfp4Matrix mat{(w2 ? m.w2_blocks : m.w1_blocks) + g * rows * groups * numerics::kMxBlockBytes,
                                      (w2 ? m.w2_exponents : m.w1_exponents) + g * rows * groups, rows, cols};
    const std::string& name = w2 ? m.w2_name : m.w1_name;
    const std::string& file = w2 ? m.w2_file : m.w1_file;
    const std::string what = fmt::format("{}: tensor '{}' expert {}", file, name, g);
    const checkpoint::Mxfp4Conversion c =
        checkpoint::mxfp4_to_fp8(mat, p.quant, (w2 ? out.w2.data() : out.w1.data()) + slot * rows * cols,
                                 (w2 ? out.w2_scale.data() : out.w1_scale.data()) + slot * scales, what);
    MOEKIT_CHECK(c.inexact == 0,
                 "{}: {} of its values cannot be held exactly in FP8 under {}'s scales, first {}; load it with "
                 "--quant {} (finer scale groups), or convert the checkpoint to bf16 and let moekit quantize it",
                 what, c.inexact, quant_name(p.quant), c.describe(),
                 recipe_info(p.quant).weight_scales == WeightScales::kBlock128x128 ? "block128 is the finest there is"
                                                                                   : "block128 where K and I allow it");
  }

  // ---- Values: the first element that is not finite, or a scale that is not finite
  // and > 0, is an Error naming the shard, the tensor and the element.
  void check_region(const std::string& file, const std::string& name, const std::byte* data, TensorDType dtype,
                    const std::vector<std::int64_t>& shape, std::int64_t begin, std::int64_t end,
                    checkpoint::ValueRule rule) {
    {
      const std::lock_guard<std::mutex> lock(checked_mutex);  // loads check their experts in parallel
      if (!checked.insert({data, begin}).second) return;
    }
    const std::int64_t bad = checkpoint::first_bad_value(data, dtype, begin, end, rule);
    if (bad >= 0) fail_value(file, name, data, dtype, shape, bad, rule);
  }
  // Maps a matrix's region (and its scales) in at once before it is read (checkpoint::populate_read).
  static void populate(const Matrix& m) {
    const std::int64_t elem = checkpoint::dtype_bytes(m.dtype);
    checkpoint::populate_read(m.data + elem * m.region_begin, elem * (m.region_end - m.region_begin));
  }
  // codes_checked_at_copy: the matrix moves as stored, so codes_row checks its codes as it copies them.
  void check_matrix(const Matrix& m, bool codes_checked_at_copy = false) {
    if (!codes_checked_at_copy)
      check_region(m.file, m.name, m.data, m.dtype, m.shape, m.region_begin, m.region_end,
                   checkpoint::ValueRule::kFinite);
    if (m.scale != nullptr) {
      std::int64_t numel = 1;
      for (const std::int64_t d : m.scale_shape) numel *= d;
      check_region(m.scale_file, m.scale_name, m.scale, m.scale_dtype, m.scale_shape, 0, numel,
                   checkpoint::ValueRule::kFinitePositive);
    }
  }
  void check_tensor(const std::string& name) {
    const TensorInfo& t = dir.info(name);
    check_region(dir.shard_path(name), name, bytes(name), t.dtype, t.shape, 0, t.numel(),
                 checkpoint::ValueRule::kFinite);
  }

  // The routed experts of the reads into `out`; returns the load note.
  std::string load_routed(const Names& nm, const LayerReads& r, const std::vector<std::int64_t>& experts,
                          HostExpertWeights& out) {
    const MoeProblem& p = out.problem;
    if (r.mxfp4) {
      // W1's rows are the stored interleaved gate/up outputs, swigluoai's own order: moved row for row.
      MOEKIT_CHECK(numerics::w1_rows(p.activation, p.quant) == numerics::W1Rows::kInterleaved,
                   "{}: MXFP4 W1 rows are interleaved gate/up pairs; {} reads another order", dir.dir(),
                   activation_name(p.activation));
      pool().parallel_for(2 * p.E_local, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t t = begin; t < end; ++t)
          put_mxfp4(out, t / 2, experts[static_cast<std::size_t>(t / 2)], *r.mxfp4, t % 2 == 1);
      });
      if (p.expert_bias) load_expert_biases(nm, experts, out);
      return fmt::format("{}experts: MXFP4 (fused tensors), converted exactly to {} FP8 at load", nm.prefix,
                         quant_name(p.quant));
    }
    // Two tasks a slot (its W1, its W2), spread over the load's threads; each checks the values it
    // reads, then writes its slot's codes and scales.
    std::vector<char> stored(2 * r.routed.size(), 0);
    pool().parallel_for(static_cast<std::int64_t>(stored.size()), [&](std::int64_t begin, std::int64_t end) {
      std::vector<float> scratch;
      for (std::int64_t t = begin; t < end; ++t) {
        const ExpertMatrices& x = r.routed[static_cast<std::size_t>(t / 2)];
        // Codes moved as stored are read by pread (codes_rows), so only what is read through the
        // mapping is mapped in first.
        if (t % 2 == 0) {
          const bool moved = w1_as_stored(out.problem, x.gate, &x.up);
          if (!moved) {
            populate(x.gate);
            populate(x.up);
          }
          check_matrix(x.gate, moved);
          check_matrix(x.up, moved);
          stored[static_cast<std::size_t>(t)] = put_w1(out, t / 2, x.gate, &x.up, scratch);
        } else {
          const bool moved = as_stored(out.problem, x.down);
          if (!moved) populate(x.down);
          check_matrix(x.down, moved);
          stored[static_cast<std::size_t>(t)] = put_w2(out, t / 2, x.down, scratch);
        }
      }
    });
    const bool all_stored = std::all_of(stored.begin(), stored.end(), [](char c) { return c != 0; });
    if (p.expert_bias) load_expert_biases(nm, experts, out);
    const std::string which = out.first_expert >= 0
                                  ? fmt::format("experts {}-{}", out.first_expert, out.first_expert + p.E_local - 1)
                                  : fmt::format("{} slots of experts {}", p.E_local, fmt::join(experts, ","));
    return fmt::format(
        "{}{}: {} ({}), {}", nm.prefix, which, r.stored_as, r.per_expert ? "one tensor per expert" : "fused tensors",
        all_stored                                ? fmt::format("loaded as stored ({})", quant_name(p.quant))
        : has_weight_scales(recipe_info(p.quant)) ? fmt::format("quantized to {} at load", quant_name(p.quant))
        : r.stored_in_recipe_dtype
            ? fmt::format("read as {}, bit for bit (unquantized)", dtype_name(recipe_info(p.quant).weight_dtype))
            : fmt::format("rounded once to {} at load (unquantized)", dtype_name(recipe_info(p.quant).weight_dtype)));
  }

  void load_expert_biases(const Names& nm, const std::vector<std::int64_t>& experts, HostExpertWeights& out) {
    const MoeProblem& p = out.problem;
    const std::int64_t N = p.N, K = p.K, I = p.I();
    const std::string b1 = nm.prefix + "experts.gate_up_proj_bias", b2 = nm.prefix + "experts.down_proj_bias";
    const TensorInfo& t1 = dir.info(b1);
    const TensorInfo& t2 = dir.info(b2);
    check_tensor(b1);
    check_tensor(b2);
    const std::byte* d1 = bytes(b1);
    const std::byte* d2 = bytes(b2);
    const numerics::W1Rows rows = numerics::w1_rows(p.activation, p.quant);
    for (std::int64_t e = 0; e < p.E_local; ++e) {
      const std::int64_t g = experts[static_cast<std::size_t>(e)];
      for (std::int64_t c = 0; c < I; ++c) {  // stored interleaved: gate 2c, up 2c + 1
        out.w1_bias[static_cast<std::size_t>(e * N + numerics::gate_column(rows, I, c))] =
            float_at(d1, t1.dtype, g * 2 * I + 2 * c);
        out.w1_bias[static_cast<std::size_t>(e * N + numerics::up_column(rows, I, c))] =
            float_at(d1, t1.dtype, g * 2 * I + 2 * c + 1);
      }
      for (std::int64_t c = 0; c < K; ++c)
        out.w2_bias[static_cast<std::size_t>(e * K + c)] = float_at(d2, t2.dtype, g * K + c);
    }
  }

  // A float tensor whose header plan_reads checked, decoded whole.
  std::vector<float> floats(const std::string& name) {
    const TensorInfo& t = dir.info(name);
    check_tensor(name);
    const std::byte* d = bytes(name);
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = float_at(d, t.dtype, static_cast<std::int64_t>(i));
    return v;
  }

  // The host bytes a load allocates: the local experts' codes and scales (and the shared experts'),
  // the router's tensors as fp32, and one expert's fp32 matrix per thread while it is quantized.
  static std::int64_t load_bytes(const MoeProblem& p, const std::optional<MoeProblem>& shared, int threads) {
    using limits::checked_add;
    using limits::checked_mul;
    std::int64_t bytes = expert_weight_bytes(p);
    if (shared) bytes = checked_add(bytes, expert_weight_bytes(*shared), "load bytes");
    bytes = checked_add(bytes, checked_mul(4 * (p.E + 2), p.K, "router bytes"), "load bytes");
    const std::int64_t widest = std::max(p.N, shared ? shared->N : 0);
    return checked_add(bytes, checked_mul(checked_mul(4 * widest, p.K, "one expert's fp32 W1"), threads, "fp32 W1s"),
                       "load bytes");
  }

  // experts: the model's expert of each local slot; first_expert: experts[0] when they are a
  // range, -1 for the slots of a placement.
  CheckpointLayer load(std::int64_t L, const MoeProblem& p, const std::vector<std::int64_t>& experts,
                       std::int64_t first_expert, bool want_shared) {
    MOEKIT_CHECK(std::binary_search(layers.begin(), layers.end(), L),
                 "{}: layer {} holds no MoE block (the MoE layers are {})", dir.dir(), L,
                 layers.empty() ? std::string("none") : fmt::format("{}", fmt::join(layers, ", ")));
    check_problem(p);
    MOEKIT_CHECK(static_cast<std::int64_t>(experts.size()) == p.E_local,
                 "load_layer: {} slot experts for a problem of E_local = {}", experts.size(), p.E_local);
    for (std::size_t e = 0; e < experts.size(); ++e)
      MOEKIT_CHECK(experts[e] >= 0 && experts[e] < p.E,
                   "load_layer: local expert {} is the model's expert {}, outside [0, {}){}", e, experts[e], p.E,
                   first_expert >= 0 ? ": first_expert is rank * E_local" : "");
    const Names nm = names(L);
    // Every header first; then the bytes, against the host's memory; then the buffers.
    const LayerReads reads = plan_reads(nm, p, experts, want_shared);
    limits::require_memory(load_bytes(p, reads.shared_problem, num_threads), limits::host_memory_bytes(),
                           fmt::format("loading layer {} ({} local experts of {})", L, p.E_local, p.describe()),
                           "host memory", "load fewer experts per rank (a larger ep) or run on a larger machine");
    CheckpointLayer out;
    out.layer = L;
    out.experts = empty_experts(p, first_expert);
    out.note = load_routed(nm, reads, experts, out.experts);
    out.router_weight = floats(nm.router());
    if (nm.naming == WeightNames::kGptOss) out.router_bias = floats(nm.prefix + "router.bias");
    if (model.has_score_correction_bias)
      out.e_score_correction_bias = floats(nm.prefix + "gate.e_score_correction_bias");
    if (reads.shared) {
      out.shared_experts = empty_experts(*reads.shared_problem, 0);
      for (const Matrix* m : {&reads.shared->gate, &reads.shared->up, &reads.shared->down}) check_matrix(*m);
      std::vector<float> scratch;
      put_w1(*out.shared_experts, 0, reads.shared->gate, &reads.shared->up, scratch);
      put_w2(*out.shared_experts, 0, reads.shared->down, scratch);
      if (model.shared_expert_gate) {
        const std::vector<float> g = floats(nm.prefix + "shared_expert_gate.weight");
        out.shared_expert_gate.resize(g.size());
        std::transform(g.begin(), g.end(), out.shared_expert_gate.begin(), numerics::bf16_encode);
      }
    }
    return out;
  }

  // Every MoE layer's reads for all E experts (plan --checkpoint): the headers checked as a load of
  // any rank would check them, no tensor data read, nothing allocated.
  void check_headers(bool want_shared) {
    const MoeProblem p = header_problem();
    std::vector<std::int64_t> all(static_cast<std::size_t>(p.E));
    for (std::size_t e = 0; e < all.size(); ++e) all[e] = static_cast<std::int64_t>(e);
    for (const std::int64_t L : layers) plan_reads(names(L), p, all, want_shared);
  }

  // A problem of the model for the header checks: its sizes, its activation, every expert on one rank.
  MoeProblem header_problem() const {
    const QuantScheme q = choose_quant(model, "auto").quant;  // what a load with quant = "auto" runs
    return make_problem(model, ParallelConfig{1, 1, 1, 0}, ActivationFormat::kBatchedExperts, q, model.activation);
  }

  std::set<std::pair<const std::byte*, std::int64_t>> checked;  // regions whose values were checked
  std::mutex checked_mutex;
  // The loads' threads (Checkpoint's num_threads), started at the first load.
  int num_threads = 1;
  std::optional<cpu::ThreadPool> threads;
  cpu::ThreadPool& pool() {
    if (!threads) threads.emplace(num_threads);
    return *threads;
  }
};

LayerWeights CheckpointLayer::view(DeviceCopies& copies) const {
  LayerWeights w{experts.view(copies),
                 e_score_correction_bias.empty() ? nullptr : copies.put(e_score_correction_bias, "routing bias")};
  if (shared_experts) {
    w.shared_experts = shared_experts->view(copies);
    w.shared_expert_gate = shared_expert_gate.empty() ? nullptr : copies.put(shared_expert_gate, "shared_expert_gate");
  }
  return w;
}

std::vector<float> CheckpointLayer::router_logits(const std::uint16_t* hidden, std::int64_t num_tokens) const {
  const std::int64_t K = experts.problem.K, E = experts.problem.E;
  std::vector<float> logits(static_cast<std::size_t>(num_tokens * E));
  std::vector<float> h(static_cast<std::size_t>(K));
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    for (std::int64_t c = 0; c < K; ++c) h[static_cast<std::size_t>(c)] = numerics::bf16_decode(hidden[t * K + c]);
    for (std::int64_t e = 0; e < E; ++e) {
      const float* w = router_weight.data() + e * K;
      float acc = router_bias.empty() ? 0.0f : router_bias[static_cast<std::size_t>(e)];
      for (std::int64_t c = 0; c < K; ++c) acc += h[static_cast<std::size_t>(c)] * w[c];
      logits[static_cast<std::size_t>(t * E + e)] = acc;
    }
  }
  return logits;
}

Checkpoint::Checkpoint(const std::string& dir, int num_threads) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  MOEKIT_CHECK(num_threads >= 0 && num_threads <= limits::kMaxThreads,
               "Checkpoint: num_threads = {} is outside [0, {}] (0: the machine's {} hardware threads)", num_threads,
               limits::kMaxThreads, hw);
  impl_ = std::make_unique<Impl>(dir, num_threads == 0 ? std::min(hw, limits::kMaxThreads) : num_threads);
}
void Checkpoint::check_headers(bool shared_experts) {
  impl_->check_headers(shared_experts);
}
Checkpoint::~Checkpoint() = default;

const std::string& Checkpoint::dir() const {
  return impl_->dir.dir();
}
const ModelConfig& Checkpoint::model() const {
  return impl_->model;
}
const std::vector<std::int64_t>& Checkpoint::moe_layers() const {
  return impl_->layers;
}
CheckpointLayer Checkpoint::load_layer(std::int64_t layer, const MoeProblem& problem, std::int64_t first_expert,
                                       bool shared_experts) {
  std::vector<std::int64_t> experts(static_cast<std::size_t>(std::max<std::int64_t>(problem.E_local, 0)));
  for (std::size_t e = 0; e < experts.size(); ++e) experts[e] = first_expert + static_cast<std::int64_t>(e);
  return impl_->load(layer, problem, experts, first_expert, shared_experts);
}
CheckpointLayer Checkpoint::load_layer(std::int64_t layer, const MoeProblem& problem,
                                       std::span<const std::int32_t> slot_experts, bool shared_experts) {
  return impl_->load(layer, problem, {slot_experts.begin(), slot_experts.end()}, -1, shared_experts);
}
std::vector<std::string> Checkpoint::opened_shards() const {
  return impl_->dir.opened_shards();
}

}  // namespace moekit
