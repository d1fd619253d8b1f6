// The activation kernels (cuda::launch_activation_quant) alone, on W1 rows this test writes, so that
// every input they can be given is reachable: each W1 row source (bf16 w1_out in the batched and in
// the contiguous format; the fused recipe's fp32 w1_small of its experts of <= 64 rows), each scaling
// and W1 row layout, each width class of the row-per-block kernel (1, 2 and 4 chunks of 2048 values;
// past 8192 the generic kernel alone), and NaN and infinities in the input. Asserts:
// - the generic and the row-per-block kernels agree bit for bit (codes and scales, a NaN's sign too);
// - both agree with the CPU's activation + quantization of the same rows (codes up to the ulp flips
//   of expf / erff at a rounding boundary, as tests/cuda/test_batched_experts.cpp bounds them; any
//   NaN code equals any other: the host's NaN sign is its own);
// - a NaN or an infinity stays where the scaling puts it: in its row (per-token), its 1x128 group
//   (block128) or its tensor (per-tensor: an expert's batched, the whole slab contiguous); every code
//   and scale it cannot reach equals a clean run's bit for bit;
// - nothing outside the rows walked is written: padding rows, the experts a w1_small walk skips, and
//   a tail past each output region keep their poison bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cpu/activation.h"
#include "cpu/quant.h"
#include "cuda/launch.h"
#include "gpu_test_util.h"
#include "moekit/error.h"
#include "moekit/memory.h"
#include "numerics/activation.h"
#include "numerics/fp8.h"
#include "numerics/scales.h"
#include "plan/gemm_config.h"
#include "synthetic/random.h"
#include "test_names.h"

namespace moekit {
namespace {

constexpr std::uint8_t kPoison = 0xA5;  // act_q / act_scale bytes no kernel writes
constexpr std::size_t kTail = 256;      // bytes past each output region that must keep kPoison

enum class Source { kBf16, kFp32Small };

struct Case {
  const char* model;
  QuantScheme quant;
  ActivationFormat format;
  Source source = Source::kBf16;
  std::optional<Activation> activation = std::nullopt;
  std::int64_t I = 0;           // 0: the model's; else W1 of 2 * I (gated) or I rows (a width class no model has)
  SwigluOaiParams swiglu = {};  // swigluoai's clamp and alpha (the config's)
};

std::string name_of(const Case& c) {
  std::string n =
      std::string(c.model) + "_" + std::string(quant_name(c.quant)) + "_" + std::string(format_name(c.format)) +
      (c.source == Source::kFp32Small ? "_w1_small" : "") +
      (c.activation ? "_" + std::string(activation_name(*c.activation)) : "") +
      (c.I ? "_I" + std::to_string(c.I) : "") +
      (c.swiglu.limit != kDefaultSwigluLimit ? "_limit" + std::to_string(static_cast<int>(c.swiglu.limit * 100)) + "e-2"
                                             : "") +
      (c.swiglu.alpha != kDefaultSwigluAlpha ? "_alpha" + std::to_string(static_cast<int>(c.swiglu.alpha * 100)) + "e-2"
                                             : "");
  return testing::test_name(n);
}

MoeProblem problem_of(const Case& c) {
  MoeProblem p = testing::problem_for(c.model, 5, 96, c.quant, c.activation, c.source == Source::kFp32Small, c.format);
  if (c.I) p.N = is_gated(p.activation) ? 2 * c.I : c.I;
  p.swiglu = c.swiglu;
  validate_problem(p);
  return p;
}

// A poisoned input value: where (expert, row, activation column), and which W1 column it enters by.
struct Poison {
  int expert, row, col;
  bool gate;
  float value;
};

// The W1 rows of a case on the host (fp32 values; the bf16 source rounds them), the walk's layout,
// and what one launch of one kernel wrote.
class Rows {
 public:
  Rows(const Case& c, std::vector<std::int32_t> counts) : c_(c), p_(problem_of(c)), counts_(std::move(counts)) {
    const std::int64_t E = p_.E_local;
    offsets_.assign(static_cast<std::size_t>(E + 1), 0);
    for (std::int64_t e = 0; e < E; ++e)
      offsets_[static_cast<std::size_t>(e + 1)] =
          offsets_[static_cast<std::size_t>(e)] + counts_[static_cast<std::size_t>(e)];
    small_rows_ = c.source == Source::kFp32Small ? plan::w1_small_rows(p_) : 0;
    values_.assign(static_cast<std::size_t>(input_rows() * p_.N), std::numeric_limits<float>::quiet_NaN());
    for (std::int64_t e = 0; e < E; ++e) {
      synthetic::SplitMix rng = synthetic::stream(91, synthetic::Purpose::kExpertTokens, static_cast<std::uint64_t>(e));
      for (std::int64_t r = 0; r < counts_[static_cast<std::size_t>(e)]; ++r) {
        if (!walked(e)) continue;
        const float row_scale = 0.5f + static_cast<float>((r + e) % 5);  // rows of different magnitudes
        float* row = values_.data() + in_row(e, r) * p_.N;
        for (std::int64_t j = 0; j < p_.N; ++j) row[j] = row_scale * rng.normal();
      }
    }
  }

  const MoeProblem& problem() const { return p_; }
  bool small() const { return small_rows_ > 0; }
  // Whether the launch walks expert e's rows (a w1_small walk skips the experts past 64 rows).
  bool walked(std::int64_t e) const { return !small() || counts_[static_cast<std::size_t>(e)] <= small_rows_; }
  std::int64_t count(std::int64_t e) const { return counts_[static_cast<std::size_t>(e)]; }
  std::int64_t input_rows() const {
    return small()        ? p_.E_local * small_rows_
           : contiguous() ? std::max<std::int32_t>(offsets_.back(), 1)
                          : p_.E_local * p_.M;
  }
  std::int64_t output_rows() const {
    return contiguous() ? std::max<std::int32_t>(offsets_.back(), 1) : p_.E_local * p_.M;
  }
  bool contiguous() const { return p_.format == ActivationFormat::kStandard; }
  std::int64_t in_row(std::int64_t e, std::int64_t r) const { return small() ? e * small_rows_ + r : out_row(e, r); }
  std::int64_t out_row(std::int64_t e, std::int64_t r) const {
    return contiguous() ? offsets_[static_cast<std::size_t>(e)] + r : e * p_.M + r;
  }
  // f(e, r, o) for row r of expert e at output row o, every row the launch walks.
  template <class F>
  void for_each_walked(F&& f) const {
    for (std::int64_t e = 0; e < p_.E_local; ++e)
      if (walked(e))
        for (std::int64_t r = 0; r < count(e); ++r) f(e, r, out_row(e, r));
  }
  // The activation tensor a row belongs to (per-tensor scales): an expert's, or the one slab.
  std::int64_t tensor(std::int64_t e) const { return contiguous() ? 0 : e; }
  std::int64_t scale_count() const {
    if (p_.quant == QuantScheme::kPerTensor) return contiguous() ? 1 : p_.E_local;
    return output_rows() * numerics::activation_scales_per_row(p_.quant, p_.I());
  }

  void poison(const Poison& x) {
    const numerics::W1Rows w1 = numerics::w1_rows(p_.activation, p_.quant);
    const std::int64_t j = x.gate ? numerics::gate_column(w1, p_.I(), x.col) : numerics::up_column(w1, p_.I(), x.col);
    values_[static_cast<std::size_t>(in_row(x.expert, x.row) * p_.N + j)] = x.value;
    poisons_.push_back(x);
  }
  const std::vector<Poison>& poisons() const { return poisons_; }

  struct Output {
    std::vector<std::uint8_t> q, scale;  // act_q, act_scale bytes, each with its kTail
  };

  // One launch of `kernel` over these rows into poisoned outputs.
  Output run(cuda::ActivationKernel kernel) const {
    const std::int64_t I = p_.I();
    const auto memory = make_memory(Device::kCuda);
    auto upload = [&]<class T>(const std::vector<T>& host, std::string_view what) {
      DeviceBuffer b(*memory, static_cast<std::int64_t>(host.size() * sizeof(T)), what);
      memory->from_host(b.get(), host.data(), b.bytes(), nullptr);
      return b;
    };
    auto poisoned = [&](std::int64_t bytes, std::string_view what) {
      DeviceBuffer b(*memory, bytes, what);
      memory->fill(b.get(), kPoison, bytes, nullptr);
      return b;
    };
    const DeviceBuffer offsets = upload(offsets_, "row_offsets");
    const DeviceBuffer act_q = poisoned(output_rows() * I + static_cast<std::int64_t>(kTail), "act_q");
    const DeviceBuffer act_scale = poisoned(scale_count() * 4 + static_cast<std::int64_t>(kTail), "act_scale");
    cuda::BatchedExpertsLaunch l;
    l.problem = p_;
    l.contiguous = contiguous();
    l.act_q = act_q.as<std::uint8_t>();
    l.act_scale = act_scale.as<float>();
    l.row_offsets = offsets.as<std::int32_t>();
    l.num_sms = cuda::current_device_num_sms();
    DeviceBuffer in;
    if (small()) {
      in = upload(values_, "w1_small");
      l.w1_small = in.as<float>();
      l.gemms.fused_w1 = l.gemms.w1_small = true;
    } else {
      std::vector<std::uint16_t> rounded(values_.size());
      for (std::size_t i = 0; i < values_.size(); ++i) rounded[i] = numerics::bf16_encode(values_[i]);
      in = upload(rounded, "w1_out");
      l.w1_out = in.as<std::uint16_t>();
    }
    cuda::launch_activation_quant(l, kernel, nullptr);
    Output out{std::vector<std::uint8_t>(static_cast<std::size_t>(act_q.bytes())),
               std::vector<std::uint8_t>(static_cast<std::size_t>(act_scale.bytes()))};
    memory->to_host(out.q.data(), act_q.get(), act_q.bytes(), nullptr);
    memory->to_host(out.scale.data(), act_scale.get(), act_scale.bytes(), nullptr);  // synchronizes
    return out;
  }

  // The CPU's activation + quantization of the walked rows, in the output's layout (rows and scales
  // nobody walks keep kPoison).
  Output cpu() const {
    const std::int64_t N = p_.N, I = p_.I();
    const std::int64_t spr = numerics::activation_scales_per_row(p_.quant, I);
    Output out{std::vector<std::uint8_t>(static_cast<std::size_t>(output_rows() * I) + kTail, kPoison),
               std::vector<std::uint8_t>(static_cast<std::size_t>(scale_count()) * 4 + kTail, kPoison)};
    auto* scales = reinterpret_cast<float*>(out.scale.data());
    std::vector<float> act(static_cast<std::size_t>(I));
    std::vector<std::uint16_t> rounded(static_cast<std::size_t>(N));
    auto activation_of = [&](std::int64_t e, std::int64_t r, float* dst) {
      const float* row = values_.data() + in_row(e, r) * N;
      if (small()) {
        cpu::activation_rows(p_.activation, row, 1, N, N, dst, I, p_.quant, p_.swiglu);
      } else {
        for (std::int64_t j = 0; j < N; ++j) rounded[static_cast<std::size_t>(j)] = numerics::bf16_encode(row[j]);
        cpu::activation_rows(p_.activation, rounded.data(), 1, N, N, dst, I, p_.quant, p_.swiglu);
      }
    };
    if (p_.quant == QuantScheme::kPerTensor) {
      // One amax over each tensor's rows, then its codes.
      const std::int64_t tensors = contiguous() ? 1 : p_.E_local;
      for (std::int64_t t = 0; t < tensors; ++t) {
        std::vector<float> all;
        std::vector<std::int64_t> rows;
        for_each_walked([&](std::int64_t e, std::int64_t r, std::int64_t o) {
          if (tensor(e) != t) return;
          activation_of(e, r, act.data());
          all.insert(all.end(), act.begin(), act.end());
          rows.push_back(o);
        });
        std::vector<std::uint8_t> q(all.size());
        const auto m = static_cast<std::int64_t>(rows.size());
        if (m > 0) {
          cpu::quantize_activation(p_.quant, all.data(), m, I, I, q.data(), I, scales + t);
        } else {
          scales[t] = numerics::fp8_scale(0.0f);
        }
        for (std::int64_t i = 0; i < m; ++i)
          std::memcpy(out.q.data() + rows[static_cast<std::size_t>(i)] * I, q.data() + i * I,
                      static_cast<std::size_t>(I));
      }
      return out;
    }
    for_each_walked([&](std::int64_t e, std::int64_t r, std::int64_t o) {
      activation_of(e, r, act.data());
      cpu::quantize_activation(p_.quant, act.data(), 1, I, I, out.q.data() + o * I, I, scales + o * spr);
    });
    return out;
  }

  // Whether a poison can reach the code of output (row o of expert e, activation column c), or the
  // scale at index s: its row (per-token), its group (block128), its tensor (per-tensor).
  bool reaches_code(std::int64_t e, std::int64_t r, std::int64_t c) const {
    for (const Poison& x : poisons_) {
      if (p_.quant == QuantScheme::kPerTensor) {
        if (tensor(x.expert) == tensor(e)) return true;
      } else if (x.expert == e && x.row == r) {
        if (p_.quant == QuantScheme::kPerTokenPerChannel || x.col / kQuantBlock == c / kQuantBlock) return true;
      }
    }
    return false;
  }

 private:
  Case c_;
  MoeProblem p_;
  std::vector<std::int32_t> counts_, offsets_;
  std::int64_t small_rows_ = 0;
  std::vector<float> values_;
  std::vector<Poison> poisons_;
};

bool is_nan_code(std::uint8_t q) {
  return (q & 0x7F) == 0x7F;
}

float scale_at(const std::vector<std::uint8_t>& bytes, std::int64_t i) {
  float s;
  std::memcpy(&s, bytes.data() + i * 4, 4);
  return s;
}

// Every walked code and scale of `got` against the CPU's `want` (the ulp-flip bound; NaN = NaN).
void expect_near_cpu(const Rows& rows, const Rows::Output& got, const Rows::Output& want, const std::string& ctx) {
  const MoeProblem& p = rows.problem();
  const std::int64_t I = p.I();
  std::int64_t codes = 0, code_diff = 0, nan_diff = 0;
  rows.for_each_walked([&](std::int64_t, std::int64_t, std::int64_t o) {
    for (std::int64_t c = 0; c < I; ++c) {
      const std::uint8_t a = got.q[static_cast<std::size_t>(o * I + c)],
                         b = want.q[static_cast<std::size_t>(o * I + c)];
      ++codes;
      if (is_nan_code(a) != is_nan_code(b))
        ++nan_diff;
      else if (!is_nan_code(a) && a != b)
        ++code_diff;
    }
  });
  EXPECT_EQ(nan_diff, 0) << ctx << ": NaN codes where the CPU has none, or the reverse";
  // expf / erff differ from the host's by an ulp or two: a code flips only at a rounding boundary.
  EXPECT_LE(code_diff, codes / 500) << ctx << ": codes differ from the CPU's: " << code_diff << " of " << codes;
  double scale_diff = 0;
  std::int64_t scale_mismatch = 0;
  for (std::int64_t i = 0; i < rows.scale_count(); ++i) {
    const float a = scale_at(got.scale, i), b = scale_at(want.scale, i);
    if (std::memcmp(&a, &b, 4) == 0) continue;
    if (std::isfinite(a) && std::isfinite(b) && b > 0)
      scale_diff = std::max(scale_diff, std::fabs(double(a) / b - 1));
    else
      ++scale_mismatch;  // one infinite or poisoned, the other not
  }
  EXPECT_EQ(scale_mismatch, 0) << ctx << ": scales written / infinite where the CPU's are not";
  EXPECT_LT(scale_diff, 1e-5) << ctx << ": scales";
}

// Bytes outside the walked rows and the scales the launch owns keep kPoison.
void expect_untouched(const Rows& rows, const Rows::Output& got, const std::string& ctx) {
  const MoeProblem& p = rows.problem();
  const std::int64_t I = p.I(), spr = numerics::activation_scales_per_row(p.quant, I);
  std::vector<bool> written_row(static_cast<std::size_t>(rows.output_rows()), false);
  rows.for_each_walked(
      [&](std::int64_t, std::int64_t, std::int64_t o) { written_row[static_cast<std::size_t>(o)] = true; });
  std::int64_t stray = 0, stray_scales = 0;
  for (std::int64_t o = 0; o < rows.output_rows(); ++o) {
    if (written_row[static_cast<std::size_t>(o)]) continue;
    for (std::int64_t c = 0; c < I; ++c) stray += got.q[static_cast<std::size_t>(o * I + c)] != kPoison;
    for (std::int64_t j = 0; j < spr * 4; ++j)
      stray_scales += got.scale[static_cast<std::size_t>(o * spr * 4 + j)] != kPoison;
  }
  for (std::size_t i = got.q.size() - kTail; i < got.q.size(); ++i) stray += got.q[i] != kPoison;
  for (std::size_t i = got.scale.size() - kTail; i < got.scale.size(); ++i) stray_scales += got.scale[i] != kPoison;
  EXPECT_EQ(stray, 0) << ctx << ": act_q bytes written outside the walked rows";
  EXPECT_EQ(stray_scales, 0) << ctx << ": act_scale bytes written outside the walked rows' scales";
}

// What a poison cannot reach equals the clean run bit for bit; what it reaches, the CPU checks.
// (Per-tensor contiguous: the slab is one tensor, every code reachable; the CPU check carries it.)
void expect_contained(const Rows& poisoned, const Rows::Output& got, const Rows::Output& clean,
                      const std::string& ctx) {
  const MoeProblem& p = poisoned.problem();
  const std::int64_t I = p.I(), spr = numerics::activation_scales_per_row(p.quant, I);
  std::int64_t leaked = 0, leaked_scales = 0, reached = 0;
  poisoned.for_each_walked([&](std::int64_t e, std::int64_t r, std::int64_t o) {
    for (std::int64_t c = 0; c < I; ++c) {
      if (poisoned.reaches_code(e, r, c)) {
        ++reached;
        continue;
      }
      const auto i = static_cast<std::size_t>(o * I + c);
      leaked += got.q[i] != clean.q[i];
    }
    for (std::int64_t j = 0; j < spr; ++j) {
      if (poisoned.reaches_code(e, r, j * kQuantBlock)) continue;
      leaked_scales +=
          std::memcmp(got.scale.data() + (o * spr + j) * 4, clean.scale.data() + (o * spr + j) * 4, 4) != 0;
    }
  });
  EXPECT_GT(reached, 0) << ctx << ": no poison was walked (the test's own bug)";
  EXPECT_EQ(leaked, 0) << ctx << ": a NaN / inf changed codes outside its row, group or tensor";
  EXPECT_EQ(leaked_scales, 0) << ctx << ": a NaN / inf changed scales outside its row or group";
  if (p.quant == QuantScheme::kPerTensor)
    for (std::int64_t e = 0; e < p.E_local; ++e) {
      bool hit = false;
      for (const Poison& x : poisoned.poisons()) hit |= poisoned.tensor(x.expert) == poisoned.tensor(e);
      if (!hit)
        EXPECT_EQ(
            std::memcmp(got.scale.data() + poisoned.tensor(e) * 4, clean.scale.data() + poisoned.tensor(e) * 4, 4), 0)
            << ctx << ": tensor " << poisoned.tensor(e) << "'s scale moved without a poison in it";
    }
}

// Counts no tile divides, an empty expert, a full one, experts either side of w1_small's 64 rows.
const std::vector<std::int32_t> kCounts = {37, 0, 96, 64, 1};
// 389 valid rows, more than w1_small's 5 x 64 slots: its walk goes slot by slot (ActivationRows::begin),
// the other walk above.
const std::vector<std::int32_t> kSlotWalkCounts = {64, 96, 96, 96, 37};

class ActivationKernelInputs : public ::testing::TestWithParam<Case> {};

// The cases and the CPU side of the checks run on any machine: each case is a valid problem, and
// the CPU's output writes exactly the rows and scales the kernels are held to.
TEST_P(ActivationKernelInputs, CaseIsValidOnTheHost) {
  const Case& c = GetParam();
  Rows rows(c, kCounts);
  expect_untouched(rows, rows.cpu(), name_of(c) + " cpu");
  rows.poison({0, 3, 5, true, std::numeric_limits<float>::quiet_NaN()});
  const Rows::Output poisoned = rows.cpu();
  EXPECT_TRUE(is_nan_code(poisoned.q[static_cast<std::size_t>(rows.out_row(0, 3) * rows.problem().I() + 5)]))
      << name_of(c) << ": a NaN gate gives a NaN code on the CPU";
}

TEST_P(ActivationKernelInputs, KernelsAgreeWithEachOtherAndTheCpu) {
  MOEKIT_REQUIRE_GPU();
  const Case& c = GetParam();
  for (const std::vector<std::int32_t>* counts : {&kCounts, &kSlotWalkCounts}) {
    const std::string ctx = name_of(c) + (counts == &kCounts ? "" : " (slot walk counts)");
    const Rows rows(c, *counts);
    const Rows::Output generic = rows.run(cuda::ActivationKernel::kGeneric);
    expect_untouched(rows, generic, ctx + " generic");
    expect_near_cpu(rows, generic, rows.cpu(), ctx + " generic");
    if (rows.problem().I() > 8192) continue;  // the row-per-block kernel's reach (experts.cu): below
    const Rows::Output row = rows.run(cuda::ActivationKernel::kRowPerBlock);
    EXPECT_EQ(row.q, generic.q) << ctx << ": row-per-block codes differ from the generic kernel's";
    EXPECT_EQ(row.scale, generic.scale) << ctx << ": row-per-block scales differ from the generic kernel's";
    EXPECT_EQ(rows.run(cuda::ActivationKernel::kAuto).q, row.q) << ctx << ": kAuto is the row-per-block kernel";
  }
  // Past 8192 the row-per-block kernel refuses, naming I; kAuto runs the generic kernel.
  const std::string ctx = name_of(c);
  const Rows rows(c, kCounts);
  const std::int64_t I = rows.problem().I();
  if (I > 8192) {
    try {
      rows.run(cuda::ActivationKernel::kRowPerBlock);
      FAIL() << ctx << ": the row-per-block kernel took I = " << I;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("I = " + std::to_string(I)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("I <= 8192"), std::string::npos) << e.what();
    }
    EXPECT_EQ(rows.run(cuda::ActivationKernel::kAuto).q, rows.run(cuda::ActivationKernel::kGeneric).q)
        << ctx << ": kAuto is the generic kernel";
  }
}

TEST_P(ActivationKernelInputs, NanAndInfinityStayInTheirRowGroupOrTensor) {
  MOEKIT_REQUIRE_GPU();
  const Case& c = GetParam();
  const std::string ctx = name_of(c) + " NaN / inf";
  const Rows clean(c, kCounts);
  Rows poisoned(c, kCounts);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // Expert 0 (37 rows, walked by every source): a NaN gate, a negative NaN up, +inf and -inf in
  // gates and ups, in different rows and 1x128 groups; expert 4 (1 row): +inf alone.
  const std::int64_t I = poisoned.problem().I();
  poisoned.poison({0, 3, 5, true, nan});
  poisoned.poison({0, 10, static_cast<int>(std::min<std::int64_t>(130, I - 1)), false, inf});
  poisoned.poison({0, 20, static_cast<int>(I - 1), true, -inf});
  poisoned.poison({0, 20, 0, false, -inf});
  poisoned.poison({0, 30, static_cast<int>(std::min<std::int64_t>(300, I - 1)), false, -nan});
  poisoned.poison({4, 0, static_cast<int>(I / 2), true, inf});
  const Rows::Output base = clean.run(cuda::ActivationKernel::kAuto);
  const Rows::Output generic = poisoned.run(cuda::ActivationKernel::kGeneric);
  expect_untouched(poisoned, generic, ctx + " generic");
  expect_contained(poisoned, generic, base, ctx + " generic");
  expect_near_cpu(poisoned, generic, poisoned.cpu(), ctx + " generic");
  if (I <= 8192) {
    const Rows::Output row = poisoned.run(cuda::ActivationKernel::kRowPerBlock);
    EXPECT_EQ(row.q, generic.q) << ctx << ": row-per-block codes differ from the generic kernel's";
    EXPECT_EQ(row.scale, generic.scale) << ctx << ": row-per-block scales differ from the generic kernel's";
  }
}

// No rows at all: nothing written but the per-tensor scales (1: an empty tensor's, fp8_scale(0)).
TEST_P(ActivationKernelInputs, NoRowsWriteNothing) {
  MOEKIT_REQUIRE_GPU();
  const Case& c = GetParam();
  const Rows rows(c, std::vector<std::int32_t>(kCounts.size(), 0));
  for (auto kernel : {cuda::ActivationKernel::kGeneric, cuda::ActivationKernel::kAuto}) {
    const Rows::Output got = rows.run(kernel);
    expect_untouched(rows, got, name_of(c) + " empty");
    if (c.quant == QuantScheme::kPerTensor)
      for (std::int64_t t = 0; t < rows.scale_count(); ++t) EXPECT_EQ(scale_at(got.scale, t), 1.0f) << "tensor " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sources, ActivationKernelInputs,
    ::testing::Values(
        // DeepSeek-V3 (I = 2048, one chunk): every scaling, both formats, w1_small (block128's fused recipe).
        Case{"deepseek-v3", QuantScheme::kPerTokenPerChannel, ActivationFormat::kBatchedExperts},
        Case{"deepseek-v3", QuantScheme::kPerTokenPerChannel, ActivationFormat::kStandard},
        Case{"deepseek-v3", QuantScheme::kBlock128, ActivationFormat::kBatchedExperts},
        Case{"deepseek-v3", QuantScheme::kBlock128, ActivationFormat::kStandard},
        Case{"deepseek-v3", QuantScheme::kPerTensor, ActivationFormat::kBatchedExperts},
        Case{"deepseek-v3", QuantScheme::kPerTensor, ActivationFormat::kStandard},
        Case{"deepseek-v3", QuantScheme::kBlock128, ActivationFormat::kBatchedExperts, Source::kFp32Small},
        Case{"deepseek-v3", QuantScheme::kBlock128, ActivationFormat::kStandard, Source::kFp32Small},
        // Row layouts: interleaved (gpt-oss, I = 2880: two chunks, the last partial), single rows.
        Case{"gpt-oss-120b", QuantScheme::kPerTokenPerChannel, ActivationFormat::kStandard},
        Case{"gpt-oss-120b", QuantScheme::kPerTensor, ActivationFormat::kBatchedExperts},
        // A swiglu_limit inside the W1 outputs' range (the config's): the clamps bite.
        Case{"gpt-oss-120b", QuantScheme::kPerTokenPerChannel, ActivationFormat::kBatchedExperts, Source::kBf16,
             std::nullopt, 0, SwigluOaiParams{.limit = 0.25f}},
        // A swiglu_alpha other than the released 1.702 (the config's): the kernels run the config's
        // sigmoid(alpha * gate) as the CPU does, per-token and per-tensor (both passes).
        Case{"gpt-oss-120b", QuantScheme::kPerTokenPerChannel, ActivationFormat::kStandard, Source::kBf16, std::nullopt,
             0, SwigluOaiParams{.alpha = 1.0f}},
        Case{"gpt-oss-120b", QuantScheme::kPerTensor, ActivationFormat::kBatchedExperts, Source::kBf16, std::nullopt, 0,
             SwigluOaiParams{.limit = 3.0f, .alpha = 2.5f}},
        Case{"qwen3-30b-a3b", QuantScheme::kBlock128, ActivationFormat::kStandard, Source::kFp32Small,
             Activation::kRelu2},
        Case{"qwen3-30b-a3b", QuantScheme::kPerTokenPerChannel, ActivationFormat::kBatchedExperts, Source::kBf16,
             Activation::kGeluTanh},
        // The four-chunk kernel, full (I = 8192) and with its last chunk empty (I = 6144): no model here
        // has them; and past the row-per-block kernel (Mixtral, I = 14336).
        Case{"deepseek-v3", QuantScheme::kBlock128, ActivationFormat::kBatchedExperts, Source::kBf16, std::nullopt,
             8192},
        Case{"deepseek-v3", QuantScheme::kPerTensor, ActivationFormat::kStandard, Source::kBf16, std::nullopt, 6144},
        Case{"mixtral-8x7b", QuantScheme::kPerTokenPerChannel, ActivationFormat::kBatchedExperts}),
    [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

}  // namespace
}  // namespace moekit
