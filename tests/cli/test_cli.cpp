// `moekit plan` rendering: byte parsing, the JSON schema, --gpu-memory arithmetic, the table.
#include <gtest/gtest.h>

#include "cli/commands.h"
#include "moekit/check.h"

namespace moekit::cli {
namespace {

TEST(Cli, ParseBytes) {
  EXPECT_EQ(parse_bytes("141GiB"), 141LL << 30);
  EXPECT_EQ(parse_bytes("80GB"), 80'000'000'000LL);
  EXPECT_EQ(parse_bytes("512MiB"), 512LL << 20);
  EXPECT_EQ(parse_bytes("1e9"), 1'000'000'000LL);
  EXPECT_THROW(parse_bytes("lots"), Error);
  EXPECT_THROW(parse_bytes("12XB"), Error);
  EXPECT_THROW(parse_bytes("-1GiB"), Error);
}

// A numeric flag's range: the text parsed exactly as the flag's kind, refused outside the range with
// the flag, the value and the range in CLI11's usage error.
TEST(Cli, NumericFlagsHaveRanges) {
  auto parse = [](const std::string& flag, const CLI::Validator& range, const std::string& value) -> std::string {
    CLI::App app;
    std::string got;
    app.add_option(flag, got)->check(range);
    std::vector<std::string> args{value, flag};  // CLI11 parses the vector from its back
    try {
      app.parse(args);
    } catch (const CLI::ParseError& e) {
      return e.what();
    }
    return "";
  };
  const CLI::Validator threads = int_range(0, 1024), seed = uint_range(0, UINT64_MAX), tol = real_range(0, 1);
  EXPECT_EQ(parse("--threads", threads, "16"), "");
  EXPECT_EQ(parse("--threads", threads, "1024"), "");
  EXPECT_EQ(parse("--threads", threads, "-5"), "--threads: -5 is outside [0, 1024] (moekit/limits.h)");
  EXPECT_EQ(parse("--threads", threads, "1025"), "--threads: 1025 is outside [0, 1024] (moekit/limits.h)");
  EXPECT_NE(parse("--threads", threads, "1e3").find("'1e3' is not an integer"), std::string::npos);
  EXPECT_NE(parse("--threads", threads, " 7").find("is not an integer"), std::string::npos);
  EXPECT_NE(parse("--threads", threads, "99999999999999999999").find("is outside"), std::string::npos);
  EXPECT_EQ(parse("--seed", seed, "18446744073709551615"), "");
  EXPECT_NE(parse("--seed", seed, "-1").find("'-1' is not a non-negative integer"), std::string::npos);
  EXPECT_NE(parse("--seed", seed, "18446744073709551616").find("is outside"), std::string::npos);
  EXPECT_EQ(parse("--tolerance", tol, "1e-2"), "");
  for (const char* bad : {"nan", "inf", "-inf"})
    EXPECT_NE(parse("--tolerance", tol, bad).find("is not a finite number"), std::string::npos) << bad;
  EXPECT_NE(parse("--tolerance", tol, "1.5").find("1.5 is outside [0, 1]"), std::string::npos);
}

TEST(Cli, PlanJsonSchemaAndGpuMemory) {
  PlanRequest req;
  req.parallel = {32, 32, 256, 16};
  req.gpu_memory = "141GiB";
  const PlanReport report = make_plan_report(req);
  const nlohmann::json j = plan_json(req, report);
  EXPECT_EQ(j["model"], "deepseek-v3");
  EXPECT_EQ(j["device"], "cuda");
  ASSERT_EQ(j["plans"].size(), 4u);  // batched-fp8 and standard-fp8 (cuda), the two references
  std::map<std::string, std::int64_t> workspace;
  for (const auto& b : j["plans"]) {
    for (const char* key : {"name", "format", "M", "sections", "regions", "total_bytes", "workspace_bytes",
                            "buffer_bytes", "gpu_memory_left_bytes", "config"})
      EXPECT_TRUE(b.contains(key)) << key;
    std::int64_t sections = 0;
    for (const auto& s : b["sections"]) sections += s["bytes"].get<std::int64_t>();
    EXPECT_EQ(sections, b["total_bytes"].get<std::int64_t>());
    for (const auto& r : b["regions"]) {
      for (const char* key : {"name", "section", "dtype", "shape", "bytes", "offset"})
        EXPECT_TRUE(r.contains(key)) << key;
      EXPECT_LE(r["offset"].get<std::int64_t>() + r["bytes"].get<std::int64_t>(), b["total_bytes"].get<std::int64_t>());
    }
    workspace[b["name"]] = b["workspace_bytes"];
    EXPECT_EQ(b["workspace_bytes"].get<std::int64_t>() + b["buffer_bytes"].get<std::int64_t>(),
              b["total_bytes"].get<std::int64_t>());
    EXPECT_EQ(b["gpu_memory_left_bytes"].get<std::int64_t>(),
              (141LL << 30) - b["expert_weight_bytes"].get<std::int64_t>() - b["total_bytes"].get<std::int64_t>());
  }
  EXPECT_EQ(workspace["upstream-batched-cutlass-before-fix"], 112LL << 30);
  EXPECT_EQ(workspace["upstream-batched-cutlass-after-fix"], 7LL << 29);
  EXPECT_LT(workspace["batched-fp8 (cuda)"], 2LL << 30);
  EXPECT_EQ(j["plans"][0]["M"], 8192);
  // DeepSeek-V3's checkpoint is block-quantized: block128 is its default, and its GEMMs take the
  // block-scaled configs.
  EXPECT_EQ(j["plans"][0]["quant"], "block128");
  EXPECT_NE(j["quant_note"].get<std::string>().find("weight_block_size [128, 128]"), std::string::npos);
  // block128 fuses W1 by default: the activation and its 1x128 quantization in W1's epilogue (the
  // experts of <= 64 rows: a kernel over their fp32 rows in w1_small), no w1_out.
  EXPECT_EQ(j["plans"][0]["config"],
            "GEMMs by each expert's rows (<= 8192 in a step): W1 swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64), "
            "fused-w1-128x256 (m_e > 64); W2 swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= 64), "
            "block-128x256 (m_e > 64)");
  EXPECT_EQ(j["plans"][0]["fuse_w1"], true);
  EXPECT_EQ(j["plans"][0]["workspace_bytes"], 268435456 + 8388608 + 6144 + 6144 + 1048576 + 256 + 256 + 16777216);
  {
    // --no-fuse-w1: W1 into bf16 w1_out (1 GiB), then the activation kernel.
    PlanRequest unfused = req;
    unfused.fuse_w1 = false;
    const PlanReport u = make_plan_report(unfused);
    const nlohmann::json f = plan_json(unfused, u);
    EXPECT_EQ(f["plans"][0]["config"],
              "GEMMs by each expert's rows (<= 8192 in a step): W1 swapab-128x32 (m_e <= 32), swapab-128x64 (m_e <= "
              "64), cooperative-128x128 (m_e > 64; a last tile of <= 64 rows apart); W2 swapab-128x32 (m_e <= 32), "
              "swapab-128x64 (m_e <= 64), "
              "block-128x256 (m_e > 64)");
    EXPECT_EQ(f["plans"][0]["fuse_w1"], false);
    EXPECT_NE(plan_table(unfused, u).find("w1_out"), std::string::npos);
    // --step-tokens 1: a decode step declared at 1 token a rank (DP 32): experts of <= 32 rows, one
    // launch a GEMM; the workspace is the one planned for capacity.
    PlanRequest decode = req;
    decode.step_tokens = 1;
    const nlohmann::json d = plan_json(decode, make_plan_report(decode));
    EXPECT_EQ(d["plans"][0]["config"],
              "GEMMs by each expert's rows (<= 32 in a step): W1 swapab-128x32; W2 swapab-128x32");
    EXPECT_EQ(d["plans"][0]["workspace_bytes"], j["plans"][0]["workspace_bytes"]);
    EXPECT_EQ(d["parallel"]["step_tokens"], 1);
    decode.step_tokens = 257;
    EXPECT_THROW(make_plan_report(decode), Error);
    // --fuse-w1 where it cannot run: an error naming the fix; not asked, per-token simply is unfused.
    PlanRequest fused = req;
    fused.fuse_w1 = true;
    fused.quant = "per-token";
    EXPECT_THROW(make_plan_report(fused), Error);
    fused.fuse_w1.reset();
    EXPECT_EQ(plan_json(fused, make_plan_report(fused))["plans"][0]["fuse_w1"], false);
  }

  const std::string table = plan_table(req, report);
  EXPECT_NE(table.find("112.00 GiB"), std::string::npos) << table;
  EXPECT_NE(table.find("3.50 GiB"), std::string::npos) << table;
  EXPECT_EQ(table.find("w1_out"), std::string::npos) << table;
  EXPECT_NE(table.find("w1_small"), std::string::npos) << table;
  EXPECT_NE(table.find("fused-w1-128x256 (m_e > 64)"), std::string::npos) << table;
  EXPECT_NE(table.find("quantization: block128 (the checkpoint's quantization_config is fp8"), std::string::npos)
      << table;
  // Asked for per-token: planned, and the note says the checkpoint's weights would be requantized.
  req.quant = "per-token";
  const PlanReport per_token = make_plan_report(req);
  EXPECT_NE(per_token.quant_note.find("requantized"), std::string::npos) << per_token.quant_note;
  EXPECT_NE(plan_table(req, per_token).find("cooperative-128x128 (m_e > 64"), std::string::npos);
  // Fast accumulation: its rule (pingpong-64x256), and the plan says which.
  req.accumulation = "fast";
  const PlanReport fast = make_plan_report(req);
  EXPECT_NE(plan_table(req, fast).find("pingpong-64x256 (m_e > 64)"), std::string::npos);
  req.quant = "block128";
  EXPECT_THROW(make_plan_report(req), Error);  // block128 has no fast accumulation
}

TEST(Cli, DevicesAndExpertsFilter) {
  PlanRequest req;
  req.experts = {"batched-fp8"};
  EXPECT_EQ(make_plan_report(req).entries.size(), 1u);
  req.device = "cpu";
  req.experts = {};
  req.parallel = {1, 1, 64, 0};
  const PlanReport cpu = make_plan_report(req);
  ASSERT_EQ(cpu.entries.size(), 4u);  // batched-fp8, standard-fp8 and the references
  EXPECT_EQ(cpu.entries[1].plan.name, "standard-fp8 (cpu)");
  // On the GPU, block128 is planned like the other schemes; a model whose K is no multiple of 128
  // is refused with the reason.
  req.device = "cuda";
  req.quant = "block128";
  const PlanReport block = make_plan_report(req);
  EXPECT_GT(block.entries[0].workspace_bytes, 0) << block.entries[0].plan.note;
  req.model = "gpt-oss-120b";
  EXPECT_THROW(make_plan_report(req), Error);
  req.experts = {"nope"};
  EXPECT_THROW(make_plan_report(req), Error);
}

}  // namespace
}  // namespace moekit::cli
