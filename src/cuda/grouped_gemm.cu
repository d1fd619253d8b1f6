// Dispatch from a named config and scaling to its instantiation (no CUTLASS here).
#include "cuda/check.h"
#include "cuda/grouped_gemm.h"

namespace moekit::cuda {

namespace {
// The config's instance for the launch's scaling; a scaling the config has no instance for (the
// table's token_scaled / block_scaled) is an error, never another kernel.
template <plan::GemmConfig kConfig>
void instance(const GroupedGemmLaunch& l, void* stream) {
  constexpr plan::GemmConfigInfo info = plan::gemm_config_info(kConfig);
  if (l.operand != DType::kFp8E4m3) {
    MOEKIT_CUDA_REQUIRE(is_sixteen_bit(l.operand), "grouped GEMM: operands are FP8 codes, bf16 or fp16, not " +
                                                       std::string(dtype_name(l.operand)));
    MOEKIT_CUDA_REQUIRE(
        info.sixteen_bit && l.fused.act_q == nullptr && !l.d_fp32,
        "grouped GEMM: config " + std::string(info.name) + " has no 16-bit instance (sixteen_bit, plan/gemm_config.h)");
    if constexpr (info.sixteen_bit) {
      if (l.operand == DType::kBf16) return grouped_sixteen_bit_gemm_instance<kConfig, DType::kBf16>(l, stream);
      return grouped_sixteen_bit_gemm_instance<kConfig, DType::kFp16>(l, stream);
    }
  }
  if constexpr (info.fused_w1) {
    MOEKIT_CUDA_REQUIRE(l.block_scaled && l.fused.act_q != nullptr,
                        "grouped_fp8_gemm: config " + std::string(info.name) +
                            " is a fused W1: it runs a block-scaled W1 into act_q (plan/gemm_config.h)");
    grouped_fp8_gemm_fused_w1_instance<kConfig>(l, stream);
  } else {
    MOEKIT_CUDA_REQUIRE(l.fused.act_q == nullptr, "grouped_fp8_gemm: config " + std::string(info.name) +
                                                      " is not a fused W1 (plan/gemm_config.h)");
    if (l.d_fp32) {
      MOEKIT_CUDA_REQUIRE(l.block_scaled && info.w1_fp32, "grouped_fp8_gemm: config " + std::string(info.name) +
                                                              " has no block-scaled fp32-D instance (w1_fp32, "
                                                              "plan/gemm_config.h)");
      if constexpr (info.w1_fp32) return grouped_fp8_gemm_block_f32_instance<kConfig>(l, stream);
    }
    MOEKIT_CUDA_REQUIRE(l.block_scaled ? info.block_scaled : info.token_scaled,
                        "grouped_fp8_gemm: config " + std::string(info.name) + " has no " +
                            (l.block_scaled ? "block-scaled" : "per-token / per-tensor") +
                            " instance (plan/gemm_config.h)");
    MOEKIT_CUDA_REQUIRE(!(l.fast_accumulation && l.block_scaled),
                        "grouped_fp8_gemm: block-scaled GEMMs have no fast accumulation (they promote every k-block)");
    if constexpr (info.block_scaled)
      if (l.block_scaled) return grouped_fp8_gemm_block_instance<kConfig>(l, stream);
    if constexpr (info.token_scaled) {
      if (l.fast_accumulation) return grouped_fp8_gemm_fast_instance<kConfig>(l, stream);
      grouped_fp8_gemm_instance<kConfig>(l, stream);
    }
  }
}
}  // namespace

void grouped_fp8_gemm(plan::GemmConfig config, const GroupedGemmLaunch& l, void* stream) {
  switch (config) {
    case plan::GemmConfig::kSwapAB128x32: return instance<plan::GemmConfig::kSwapAB128x32>(l, stream);
    case plan::GemmConfig::kSwapAB128x64: return instance<plan::GemmConfig::kSwapAB128x64>(l, stream);
    case plan::GemmConfig::kPingpong64x256: return instance<plan::GemmConfig::kPingpong64x256>(l, stream);
    case plan::GemmConfig::kCooperative128x128: return instance<plan::GemmConfig::kCooperative128x128>(l, stream);
    case plan::GemmConfig::kBlock128x256: return instance<plan::GemmConfig::kBlock128x256>(l, stream);
    case plan::GemmConfig::kFusedW1Block128x256: return instance<plan::GemmConfig::kFusedW1Block128x256>(l, stream);
    case plan::GemmConfig::kCooperative128x256: return instance<plan::GemmConfig::kCooperative128x256>(l, stream);
  }
  MOEKIT_CUDA_REQUIRE(false, "unknown GEMM config " + std::to_string(static_cast<int>(config)));
}

}  // namespace moekit::cuda
