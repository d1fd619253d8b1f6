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

TEST(Cli, PlanJsonSchemaAndGpuMemory) {
  PlanRequest req;
  req.parallel = {32, 32, 256, 16};
  req.gpu_memory = "141GiB";
  const PlanReport report = make_plan_report(req);
  const nlohmann::json j = plan_json(req, report);
  EXPECT_EQ(j["model"], "deepseek-v3");
  ASSERT_EQ(j["backends"].size(), 4u);
  std::map<std::string, std::int64_t> totals;
  for (const auto& b : j["backends"]) {
    for (const char* key : {"name", "format", "M", "regions", "total_bytes", "gpu_memory_left_bytes"})
      EXPECT_TRUE(b.contains(key)) << key;
    for (const auto& r : b["regions"]) {
      for (const char* key : {"name", "dtype", "shape", "bytes", "offset"}) EXPECT_TRUE(r.contains(key)) << key;
      EXPECT_LE(r["offset"].get<std::int64_t>() + r["bytes"].get<std::int64_t>(), b["total_bytes"].get<std::int64_t>());
    }
    totals[b["name"]] = b["total_bytes"];
    EXPECT_EQ(b["gpu_memory_left_bytes"].get<std::int64_t>(),
              (141LL << 30) - b["expert_weight_bytes"].get<std::int64_t>() - b["total_bytes"].get<std::int64_t>() -
                  b["buffer_bytes"].get<std::int64_t>());
  }
  EXPECT_EQ(totals["upstream-batched-cutlass-before-fix"], 112LL << 30);
  EXPECT_EQ(totals["upstream-batched-cutlass-after-fix"], 7LL << 29);
  EXPECT_LT(totals["batched-fp8"], 2LL << 30);
  EXPECT_EQ(j["backends"][0]["M"], 8192);

  const std::string table = plan_table(req, report);
  EXPECT_NE(table.find("112.00 GiB"), std::string::npos) << table;
  EXPECT_NE(table.find("3.50 GiB"), std::string::npos) << table;
  EXPECT_NE(table.find("w1_out"), std::string::npos) << table;
}

TEST(Cli, BackendFilterAndUnknownBackend) {
  PlanRequest req;
  req.backends = {"batched-fp8"};
  EXPECT_EQ(make_plan_report(req).plans.size(), 1u);
  req.backends = {"nope"};
  EXPECT_THROW(make_plan_report(req), Error);
}

}  // namespace
}  // namespace moekit::cli
