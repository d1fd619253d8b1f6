// A checkpoint directory written here as Hugging Face writes one: a single model.safetensors, or
// shards with model.safetensors.index.json. Tensors read from the right shard, shards opened only
// when a tensor of theirs is read; a hostile or broken index is an Error naming the file and tensor,
// and no name in it reaches outside the directory.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>

#include "checkpoint/checkpoint_dir.h"
#include "error_text.h"
#include "moekit/error.h"
#include "write_safetensors.h"

namespace moekit::checkpoint {
namespace {

namespace fs = std::filesystem;
using moekit::testing::error_of;
using testing::file_bytes;
using testing::write_file;
using testing::write_text;

class CheckpointDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("moekit_ckpt_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    write_text(dir_ / "config.json", R"({"model_type": "deepseek_v3"})");
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Two shards: a.weight (2 bytes 1, 2) in shard 1, b.weight (4 bytes 3..6) in shard 2.
  void write_shards(const std::string& index) {
    write_file(dir_ / "model-00001-of-00002.safetensors",
               file_bytes(R"({"a.weight":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", {1, 2}));
    write_file(dir_ / "model-00002-of-00002.safetensors",
               file_bytes(R"({"b.weight":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})", {3, 4, 5, 6}));
    write_text(dir_ / "model.safetensors.index.json", index);
  }
  fs::path dir_;
};

const char* kIndex = R"({"metadata": {"total_size": 6}, "weight_map": {
    "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}})";

TEST_F(CheckpointDirTest, ShardsOpenWhenTheirTensorsAreRead) {
  write_shards(kIndex);
  CheckpointDir ck(dir_.string());
  EXPECT_EQ(ck.tensor_names(), (std::vector<std::string>{"a.weight", "b.weight"}));
  EXPECT_TRUE(ck.opened_shards().empty());
  const auto b = ck.data("b.weight");
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(static_cast<int>(b[0]), 3);
  EXPECT_EQ(ck.info("b.weight").dtype, TensorDType::kBF16);
  EXPECT_EQ(ck.opened_shards(), (std::vector<std::string>{"model-00002-of-00002.safetensors"}));
  EXPECT_EQ(static_cast<int>(ck.data("a.weight")[1]), 2);
  EXPECT_EQ(ck.opened_shards().size(), 2u);
  EXPECT_NE(error_of([&] { ck.info("c.weight"); }).find("no tensor 'c.weight'"), std::string::npos);
  EXPECT_EQ(ck.config_path(), (dir_ / "config.json").string());
}

TEST_F(CheckpointDirTest, OneFileWithoutAnIndex) {
  write_file(dir_ / "model.safetensors",
             file_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", {0, 0, 128, 63}));
  CheckpointDir ck(dir_.string());
  EXPECT_EQ(ck.tensor_names(), std::vector<std::string>{"x"});
  EXPECT_EQ(ck.data("x").size(), 4u);
}

TEST_F(CheckpointDirTest, AHostileOrBrokenIndexIsAnError) {
  struct Case {
    std::string index, expect;
  };
  const std::vector<Case> cases = {
      {R"({"weight_map": {"a.weight": "../outside.safetensors"}})", "no path separators"},
      {R"({"weight_map": {"a.weight": "/etc/passwd"}})", "no path separators"},
      {R"({"weight_map": {"a.weight": "model.bin"}})", "ending in .safetensors"},
      {R"({"weight_map": {"a.weight": 7}})", "weight_map['a.weight'] must be a shard file name"},
      {R"({"weights": {}})", "needs a 'weight_map' object"},
      {R"({"weight_map": {"a.weight": )", "not valid JSON"},
  };
  for (const Case& c : cases) {
    write_shards(c.index);
    const std::string e = error_of([&] { CheckpointDir ck(dir_.string()); });
    EXPECT_NE(e.find("model.safetensors.index.json"), std::string::npos) << c.index << ": " << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << c.index << ": " << e;
  }
  // The index names a shard that is missing, or one that does not hold the tensor.
  write_shards(R"({"weight_map": {"a.weight": "model-00009-of-00009.safetensors",
                                  "b.weight": "model-00001-of-00002.safetensors"}})");
  CheckpointDir ck(dir_.string());
  EXPECT_NE(error_of([&] { ck.data("a.weight"); }).find("cannot open"), std::string::npos);
  const std::string e = error_of([&] { ck.data("b.weight"); });
  EXPECT_NE(e.find("puts tensor 'b.weight' in this shard, which does not hold it"), std::string::npos) << e;
  // Not a checkpoint.
  EXPECT_NE(error_of([&] { CheckpointDir x((dir_ / "nope").string()); }).find("not a directory"), std::string::npos);
  fs::remove(dir_ / "model.safetensors.index.json");
  EXPECT_NE(error_of([&] { CheckpointDir x(dir_.string()); }).find("neither model.safetensors"), std::string::npos);
}

}  // namespace
}  // namespace moekit::checkpoint
