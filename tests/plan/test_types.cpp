// Vocabulary types: activation widths, names round-trip, unknown names rejected with the list.
#include <gtest/gtest.h>

#include "moekit/check.h"
#include "moekit/types.h"

namespace moekit {
namespace {

TEST(Types, ActivationOutDim) {
  for (Activation a : {Activation::kSilu, Activation::kGelu, Activation::kGeluTanh, Activation::kSwigluOai}) {
    EXPECT_TRUE(is_gated(a));
    EXPECT_EQ(activation_out_dim(a, 4096), 2048) << activation_name(a);
    EXPECT_THROW(activation_out_dim(a, 4095), Error) << activation_name(a);
  }
  for (Activation a : {Activation::kRelu2, Activation::kSiluNoMul, Activation::kGeluNoMul}) {
    EXPECT_FALSE(is_gated(a));
    EXPECT_EQ(activation_out_dim(a, 4095), 4095) << activation_name(a);
  }
  EXPECT_THROW(activation_out_dim(Activation::kSilu, 0), Error);
  EXPECT_EQ(all_activations().size(), 7u);
}

TEST(Types, NamesRoundTrip) {
  for (Activation a : all_activations()) EXPECT_EQ(parse_activation(activation_name(a)), a);
  for (QuantScheme q : all_quant_schemes()) EXPECT_EQ(parse_quant(quant_name(q)), q);
  for (ActivationFormat f : {ActivationFormat::kStandard, ActivationFormat::kBatchedExperts})
    EXPECT_EQ(parse_format(format_name(f)), f);
  EXPECT_EQ(parse_activation("relu2_no_mul"), Activation::kRelu2);  // vLLM's name
  for (Accumulation a : {Accumulation::kPrecise, Accumulation::kFast})
    EXPECT_EQ(parse_accumulation(accumulation_name(a)), a);
  EXPECT_THROW(parse_accumulation("fp8"), Error);
  try {
    parse_activation("geglu");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'geglu'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("swigluoai"), std::string::npos);
  }
}

TEST(Types, DtypeSizes) {
  EXPECT_EQ(dtype_size(DType::kFp8E4m3), 1);
  EXPECT_EQ(dtype_size(DType::kBf16), 2);
  EXPECT_EQ(dtype_size(DType::kFp32), 4);
  EXPECT_EQ(dtype_size(DType::kPtr), 8);
  EXPECT_EQ(dtype_name(DType::kFp8E4m3), "fp8_e4m3");
}

TEST(Types, CheckMacroNamesFileLineAndValues) {
  try {
    const int value = 7;
    MOEKIT_CHECK(value < 5, "value = {} must be < 5; pass a smaller one", value);
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("value = 7 must be < 5"), std::string::npos) << msg;
    // The user reads what, the limit and the fix; where it was raised is for --verbose.
    EXPECT_EQ(msg.find("test_types.cpp"), std::string::npos) << msg;
    EXPECT_NE(e.where().find("test_types.cpp"), std::string::npos) << e.where();
    EXPECT_NE(e.where().find("value < 5"), std::string::npos) << e.where();
  }
}

}  // namespace
}  // namespace moekit
