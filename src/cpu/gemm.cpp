// CPU FP8 and 16-bit (bf16, fp16) GEMMs (the oracle and default expert backend) and their float64 references. A is
// decoded once to fp32 and transposed to k-major (At[k][m]); B is decoded panel by panel; a register
// tile of (MV vectors of m) x (NC columns of n) accumulates over k with one fp32 chain per output
// element. The two element types share every line but the decode and the scales.
#include "cpu/gemm.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "moekit/check.h"
#include "moekit/recipe.h"

namespace moekit::cpu {
namespace {

// --- vector type ---------------------------------------------------------------------------------
// GCC vector extensions: portable (SSE-only or non-x86 machines split them), one register each on
// AVX-512 (16 floats) or AVX2 (8 floats). The tile vectorizes across m, so accumulation over k
// stays one sequential fp32 chain per (m, n): the result never depends on the blocking.
#if defined(__AVX512F__)
constexpr int kVL = 16;
constexpr int kNcOneVec = 24;  // MV=1 tile: 24 accumulators + A + broadcast of 32 zmm
constexpr int kNcTwoVec = 12;  // MV=2 tile: 24 accumulators
#elif defined(__AVX__)
constexpr int kVL = 8;
constexpr int kNcOneVec = 12;  // 16 ymm: 12 accumulators + A + broadcast
constexpr int kNcTwoVec = 6;   // 12 accumulators + 2 A + broadcast
#else
constexpr int kVL = 4;
constexpr int kNcOneVec = 12;
constexpr int kNcTwoVec = 6;
#endif
using V = float __attribute__((vector_size(kVL * sizeof(float))));

// NOTES: FMA here is not a numerics change. Every product is of two raw FP8 values (scales are
// applied after the sum): 4-bit x 4-bit significands give 8 bits and exponents stay in
// [2^-18, 2^17], so a * b is exact in fp32 and fma(a, b, c) == a * b + c bit for bit. bf16 x bf16
// gives 16 bits, exact too unless the product leaves fp32's range (|a * b| < 2^-126 or > 2^128:
// values no model's tokens and weights hold); fp16 x fp16 gives 22 bits within [2^-48, 2^32]: exact
// always. The build has -ffp-contract=off, so without the
// intrinsic the compiler would issue mul + add (2x the uops).
inline V fmadd(V a, V b, V c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__) && defined(__AVX__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline V splat(float x) {
  return V{} + x;
}

// KC = one quantization block: a k-chunk never straddles two kBlock128 blocks, and a B chunk of
// NC=24 columns is 24 * 128 * 4 B = 12 KiB (L1); an At chunk for M=256 is 128 KiB (L2).
constexpr std::int64_t kKc = kQuantBlock;
// Panels per C-buffer group: caps the fp32 accumulator buffer at M_pad * 16 * 24 * 4 B
// (393 KiB for M=256) while the At chunk is reused across all panels of the group.
constexpr std::int64_t kMaxGroupPanels = 16;

// --- FP8 decode ----------------------------------------------------------------------------------
// Branch-free on kVL lanes (the 256-entry table would be a gather; a scalar loop with selects does
// not vectorize and cost more than the FMAs at M <= 64). Normal codes: the 7 magnitude bits shifted
// into fp32's exponent/mantissa fields, rebias +120; subnormals (magnitude < 8) are mantissa * 2^-9,
// exact as a small int times a power of two; 0x7F is NaN. Bit-exact with fp8_table() (tested).
using VU = std::uint32_t __attribute__((vector_size(kVL * sizeof(std::uint32_t))));
using VI = std::int32_t __attribute__((vector_size(kVL * sizeof(std::int32_t))));
using VB = std::uint8_t __attribute__((vector_size(kVL)));

inline void decode_fp8(const fp8_t* src, float* dst, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kVL <= n; i += kVL) {
    VB raw;
    std::memcpy(&raw, src + i, sizeof(VB));
    const VU code = __builtin_convertvector(raw, VU);
    const VU mag = code & 0x7Fu;
    const VU normal = (mag << 20) + (120u << 23);
    const V sub_f = __builtin_convertvector(std::bit_cast<VI>(mag), V) * (1.0f / 512.0f);
    const VU sub = std::bit_cast<VU>(sub_f);
    const VU is_sub = std::bit_cast<VU>(mag < 8u);
    const VU is_nan = std::bit_cast<VU>(mag == 0x7Fu);
    VU bits = (sub & is_sub) | (normal & ~is_sub);
    bits = (is_nan & 0x7FC00000u) | (bits & ~is_nan);
    bits |= (code & 0x80u) << 24;
    std::memcpy(dst + i, &bits, sizeof(VU));
  }
  for (; i < n; ++i) dst[i] = fp8_decode(src[i]);
}

// bf16 is the top half of an fp32: a shift, exact (NaN stays NaN);
// fp16 (fp16 = true): exponent rebiased, subnormals scaled (numerics::fp16_decode).
inline void decode(const fp8_t* src, float* dst, std::int64_t n, bool /*fp16*/) {
  decode_fp8(src, dst, n);
}
inline void decode(const std::uint16_t* src, float* dst, std::int64_t n, bool fp16) {
  if (fp16) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = fp16_decode(src[i]);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t bits = static_cast<std::uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}
inline double decode_one(fp8_t x, bool /*fp16*/) {
  return fp8_decode(x);
}
inline double decode_one(std::uint16_t x, bool fp16) {
  return decode16(x, fp16);
}

// How the sums are scaled, from the recipe's activation scales (moekit/recipe.h): the FP8 recipes
// pair each activation rule with one weight rule, the unquantized one has neither.
enum class Scaling { kNone, kTensor, kRowChannel, kBlock };
Scaling scaling_of(QuantScheme quant) {
  switch (recipe_info(quant).activation_scales) {
    case ActivationScales::kNone: return Scaling::kNone;
    case ActivationScales::kPerTensor: return Scaling::kTensor;
    case ActivationScales::kPerRow: return Scaling::kRowChannel;
    case ActivationScales::kGroup1x128: return Scaling::kBlock;
  }
  return Scaling::kNone;
}

// One GEMM of either element type: Fp8GemmArgs / SixteenBitGemmArgs, the same fields (16-bit: the
// recipe's operand dtype, fp16_operands below, says what A, B and D_16 hold; FP8's D_16 is bf16).
template <class T>
struct GemmCore {
  const char* who;
  std::int64_t M, N, K;
  Scaling scaling;
  QuantScheme quant;
  const T* A;
  std::int64_t lda;
  const float* a_scales;
  const T* B;
  std::int64_t ldb;
  const float* b_scales;
  const float* bias;
  float* D_f32;
  std::uint16_t* D_16;
  std::int64_t ldd;
};

GemmCore<fp8_t> core_of(const Fp8GemmArgs& a) {
  MOEKIT_CHECK(recipe_info(a.quant).activation_dtype == DType::kFp8E4m3,
               "fp8_gemm: recipe {} has no FP8 operands; call sixteen_bit_gemm", quant_name(a.quant));
  return {"fp8_gemm", a.M,        a.N, a.K,   scaling_of(a.quant), a.quant, a.A,
          a.lda,      a.a_scales, a.B, a.ldb, a.b_scales,          a.bias,  a.D_f32,
          a.D_bf16,   a.ldd};
}
GemmCore<std::uint16_t> core_of(const SixteenBitGemmArgs& a) {
  MOEKIT_CHECK(is_sixteen_bit(a.dtype), "sixteen_bit_gemm: operands of dtype {}; it takes bf16 or fp16",
               dtype_name(a.dtype));
  const QuantScheme quant = a.dtype == DType::kFp16 ? QuantScheme::kFp16 : QuantScheme::kBf16;
  return {"sixteen_bit_gemm",
          a.M,
          a.N,
          a.K,
          Scaling::kNone,
          quant,
          a.A,
          a.lda,
          nullptr,
          a.B,
          a.ldb,
          nullptr,
          a.bias,
          a.D_f32,
          a.D_16,
          a.ldd};
}

// Whether a GEMM's 16-bit values (A, B, D_16 of an unquantized recipe) are fp16, not bf16.
template <class T>
bool fp16_operands(const GemmCore<T>& a) {
  return recipe_info(a.quant).activation_dtype == DType::kFp16;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// --- micro-kernel --------------------------------------------------------------------------------
// MV vectors of m (MV * kVL rows) x NC columns of n, over one k-chunk of length kc.
//   at:  At + k0 * m_pad + m0 (k-major, stride m_pad);  bd: decoded B chunk, bd[c * kKc + k];
//   c:   C buffer (column-major, C[col * m_pad + m]) at (m0, the panel's first column).
// kPerTensor / kPerTokenPerChannel: acc continues the running sum in C (first chunk: starts at 0).
// kBlock128: acc is a fresh block sum; C += (acc * sa[m, kb]) * sb[n/128, kb].
template <int MV, int NC>
void tile(const float* at, std::int64_t m_pad, const float* bd, std::int64_t kc, float* c, bool block_mode, bool first,
          const float* sa_kb, const float* sb_kb) {
  V acc[MV][NC];
  for (int mv = 0; mv < MV; ++mv)
    for (int j = 0; j < NC; ++j) {
      if (block_mode || first)
        acc[mv][j] = V{};
      else
        std::memcpy(&acc[mv][j], c + j * m_pad + mv * kVL, sizeof(V));
    }
  for (std::int64_t k = 0; k < kc; ++k) {
    V a[MV];
    for (int mv = 0; mv < MV; ++mv) std::memcpy(&a[mv], at + k * m_pad + mv * kVL, sizeof(V));
#pragma GCC unroll 24
    for (int j = 0; j < NC; ++j) {
      const V b = splat(bd[j * kKc + k]);
#pragma GCC unroll 2
      for (int mv = 0; mv < MV; ++mv) acc[mv][j] = fmadd(a[mv], b, acc[mv][j]);
    }
  }
  for (int mv = 0; mv < MV; ++mv) {
    V sa{};
    if (block_mode) std::memcpy(&sa, sa_kb + mv * kVL, sizeof(V));
    for (int j = 0; j < NC; ++j) {
      float* dst = c + j * m_pad + mv * kVL;
      V out = acc[mv][j];
      if (block_mode) {
        out = (out * sa) * splat(sb_kb[j]);
        if (!first) {
          V prev;
          std::memcpy(&prev, dst, sizeof(V));
          out = prev + out;
        }
      }
      std::memcpy(dst, &out, sizeof(V));
    }
  }
}

// The reference ignores the output fields (D_f32, D_16, ldd): it writes its own double matrix.
template <class T>
void validate(const GemmCore<T>& a, bool check_output) {
  const char* who = a.who;
  MOEKIT_CHECK(a.M >= 0 && a.N >= 0 && a.K >= 0, "{}: M={}, N={}, K={} must be >= 0", who, a.M, a.N, a.K);
  MOEKIT_CHECK(a.lda >= a.K, "{}: lda={} < K={}; A rows need K contiguous elements", who, a.lda, a.K);
  MOEKIT_CHECK(a.ldb >= a.K, "{}: ldb={} < K={}; B (N, K) rows need K contiguous elements", who, a.ldb, a.K);
  if (check_output) {
    MOEKIT_CHECK(a.ldd >= a.N, "{}: ldd={} < N={}; pass ldd >= N", who, a.ldd, a.N);
    MOEKIT_CHECK((a.D_f32 != nullptr) != (a.D_16 != nullptr),
                 "{}: exactly one of D_f32 / the 16-bit D must be set (got D_f32={}, D_16={})", who,
                 static_cast<const void*>(a.D_f32), static_cast<const void*>(a.D_16));
  }
  if (a.M > 0 && a.K > 0) MOEKIT_CHECK(a.A != nullptr, "{}: A is null with M={}, K={}", who, a.M, a.K);
  if (a.N > 0 && a.K > 0) MOEKIT_CHECK(a.B != nullptr, "{}: B is null with N={}, K={}", who, a.N, a.K);
  if (a.M > 0 && a.N > 0 && a.scaling != Scaling::kNone) {
    MOEKIT_CHECK(a.a_scales != nullptr, "{}: a_scales is null (M={}, quant {})", who, a.M, quant_name(a.quant));
    MOEKIT_CHECK(a.b_scales != nullptr, "{}: b_scales is null (N={}, quant {})", who, a.N, quant_name(a.quant));
  }
}

// --- gemm ----------------------------------------------------------------------------------------
// Napkin (DeepSeek W1 N=4096 K=7168, M=64): 3.8 GFLOP; B is 29 MB of FP8 (58 MB of bf16) read once
// and decoded once per m-part (24 B floats per 16 or 32 rows of FMAs), At is 64*7168*4 = 1.8 MB,
// reread per panel group from L2/L3.
template <class T>
void gemm(const GemmCore<T>& args, ThreadPool& pool) {
  validate(args, /*check_output=*/true);
  const std::int64_t M = args.M, N = args.N, K = args.K;
  if (M == 0 || N == 0) return;
  const bool fp16 = fp16_operands(args);
  const bool block_mode = args.scaling == Scaling::kBlock;
  const std::int64_t m_pad = ceil_div(M, kVL) * kVL;
  const std::int64_t num_mvec = m_pad / kVL;
  const std::int64_t num_kb = ceil_div(K, kKc);
  const int MV = num_mvec >= 2 ? 2 : 1;
  const std::int64_t nc = MV == 2 ? kNcTwoVec : kNcOneVec;
  const int num_threads = pool.num_threads();

  // --- A: decode + transpose to At[k][m] (padding rows 0); parallel over k, so threads write
  // disjoint rows of At and never share a cache line but at the boundary.
  std::vector<float> at(static_cast<std::size_t>(K * m_pad), 0.0f);
  pool.parallel_for(
      K,
      [&](std::int64_t k0, std::int64_t k1) {
        std::vector<float> row(static_cast<std::size_t>(k1 - k0));
        for (std::int64_t m = 0; m < M; ++m) {
          decode(args.A + m * args.lda + k0, row.data(), k1 - k0, fp16);
          for (std::int64_t k = k0; k < k1; ++k)
            at[static_cast<std::size_t>(k * m_pad + m)] = row[static_cast<std::size_t>(k - k0)];
        }
      },
      kKc);
  // kBlock128 activation scales, transposed like At: sat[kb][m] (padding rows 0).
  std::vector<float> sat;
  if (block_mode) {
    sat.assign(static_cast<std::size_t>(num_kb * m_pad), 0.0f);
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t kb = 0; kb < num_kb; ++kb)
        sat[static_cast<std::size_t>(kb * m_pad + m)] = args.a_scales[m * num_kb + kb];
  }

  // --- work split: items = m_parts x panels. Panels alone when there are enough to balance the
  // threads; else also split m (each part a run of MV-vector row blocks).
  const std::int64_t num_panels = ceil_div(N, nc);
  const std::int64_t num_mblocks = ceil_div(num_mvec, MV);
  const std::int64_t m_parts = num_panels >= 2 * num_threads ? 1 : std::min<std::int64_t>(num_mblocks, num_threads);
  const std::int64_t mblocks_per_part = ceil_div(num_mblocks, m_parts);

  auto run = [&](std::int64_t part, std::int64_t p0, std::int64_t p1) {
    const std::int64_t mv0 = part * mblocks_per_part * MV;
    const std::int64_t mv1 = std::min(num_mvec, mv0 + mblocks_per_part * MV);
    if (mv0 >= mv1) return;
    const std::int64_t row0 = mv0 * kVL, row1 = std::min(M, mv1 * kVL);
    std::vector<float> bd(static_cast<std::size_t>(nc * kKc));
    std::vector<float> sb(static_cast<std::size_t>(nc));
    std::vector<float> cbuf(static_cast<std::size_t>(std::min(p1 - p0, kMaxGroupPanels) * nc * m_pad));
    for (std::int64_t g0 = p0; g0 < p1; g0 += kMaxGroupPanels) {
      const std::int64_t g1 = std::min(p1, g0 + kMaxGroupPanels);
      for (std::int64_t kb = 0; kb < num_kb; ++kb) {
        const std::int64_t k0 = kb * kKc, kc = std::min(kKc, K - k0);
        for (std::int64_t p = g0; p < g1; ++p) {
          // Decode this panel's k-chunk of B; columns past N are zeros (computed, never stored).
          const std::int64_t n0 = p * nc;
          for (std::int64_t j = 0; j < nc; ++j) {
            float* dst = bd.data() + j * kKc;
            if (n0 + j < N) {
              decode(args.B + (n0 + j) * args.ldb + k0, dst, kc, fp16);
              if (block_mode) sb[static_cast<std::size_t>(j)] = args.b_scales[((n0 + j) / kKc) * num_kb + kb];
            } else {
              std::fill(dst, dst + kc, 0.0f);
              sb[static_cast<std::size_t>(j)] = 0.0f;
            }
          }
          float* c_panel = cbuf.data() + (p - g0) * nc * m_pad;
          const float* sa_kb = block_mode ? sat.data() + kb * m_pad : nullptr;
          for (std::int64_t mv = mv0; mv < mv1; mv += MV) {
            const std::int64_t m0 = mv * kVL;
            const float* at_k = at.data() + k0 * m_pad + m0;
            float* c = c_panel + m0;
            const float* sa = sa_kb ? sa_kb + m0 : nullptr;
            const bool first = kb == 0;
            if (MV == 2 && mv + 2 <= mv1)
              tile<2, kNcTwoVec>(at_k, m_pad, bd.data(), kc, c, block_mode, first, sa, sb.data());
            else if (MV == 2)
              tile<1, kNcTwoVec>(at_k, m_pad, bd.data(), kc, c, block_mode, first, sa, sb.data());
            else
              tile<1, kNcOneVec>(at_k, m_pad, bd.data(), kc, c, block_mode, first, sa, sb.data());
          }
        }
      }
      // Epilogue: scales (non-block schemes) and the store; K == 0 gives a zero sum.
      const std::int64_t n_begin = g0 * nc, n_end = std::min(N, g1 * nc);
      for (std::int64_t n = n_begin; n < n_end; ++n) {
        const float* col = cbuf.data() + (n - g0 * nc) * m_pad;
        for (std::int64_t m = row0; m < row1; ++m) {
          float v = num_kb == 0 ? 0.0f : col[m];
          if (args.scaling == Scaling::kTensor)
            v = (v * args.a_scales[0]) * args.b_scales[0];
          else if (args.scaling == Scaling::kRowChannel)
            v = (v * args.a_scales[m]) * args.b_scales[n];
          if (args.bias) v += args.bias[n];
          if (args.D_f32)
            args.D_f32[m * args.ldd + n] = v;
          else
            args.D_16[m * args.ldd + n] = encode16(v, fp16);
        }
      }
    }
  };

  pool.parallel_for(m_parts * num_panels, [&](std::int64_t i0, std::int64_t i1) {
    // Runs of items with the same m part are one contiguous panel range.
    for (std::int64_t i = i0; i < i1;) {
      const std::int64_t part = i / num_panels;
      const std::int64_t end = std::min(i1, (part + 1) * num_panels);
      run(part, i % num_panels, i % num_panels + (end - i));
      i = end;
    }
  });
}

// --- gemm_ref ------------------------------------------------------------------------------------
template <class T>
void gemm_ref(const GemmCore<T>& args, double* D, std::int64_t ldd) {
  validate(args, /*check_output=*/false);
  const std::int64_t M = args.M, N = args.N, K = args.K;
  MOEKIT_CHECK(ldd >= N, "{}_ref: ldd={} < N={}", args.who, ldd, N);
  if (M == 0 || N == 0) return;
  MOEKIT_CHECK(D != nullptr, "{}_ref: D is null with M={}, N={}", args.who, M, N);
  const bool fp16 = fp16_operands(args);
  const std::int64_t num_kb = ceil_div(K, kQuantBlock);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double total = 0.0;
      for (std::int64_t kb = 0; kb < num_kb; ++kb) {
        double acc = 0.0;
        for (std::int64_t k = kb * kQuantBlock; k < std::min(K, (kb + 1) * kQuantBlock); ++k)
          acc += decode_one(args.A[m * args.lda + k], fp16) * decode_one(args.B[n * args.ldb + k], fp16);
        if (args.scaling == Scaling::kBlock)
          total += acc * args.a_scales[m * num_kb + kb] * args.b_scales[(n / kQuantBlock) * num_kb + kb];
        else
          total += acc;
      }
      if (args.scaling == Scaling::kTensor)
        total *= static_cast<double>(args.a_scales[0]) * args.b_scales[0];
      else if (args.scaling == Scaling::kRowChannel)
        total *= static_cast<double>(args.a_scales[m]) * args.b_scales[n];
      if (args.bias) total += args.bias[n];
      D[m * ldd + n] = total;
    }
}

}  // namespace

void fp8_gemm(const Fp8GemmArgs& args, ThreadPool& pool) {
  gemm(core_of(args), pool);
}
void fp8_gemm_ref(const Fp8GemmArgs& args, double* D, std::int64_t ldd) {
  gemm_ref(core_of(args), D, ldd);
}
void sixteen_bit_gemm(const SixteenBitGemmArgs& args, ThreadPool& pool) {
  gemm(core_of(args), pool);
}
void sixteen_bit_gemm_ref(const SixteenBitGemmArgs& args, double* D, std::int64_t ldd) {
  gemm_ref(core_of(args), D, ldd);
}

}  // namespace moekit::cpu
