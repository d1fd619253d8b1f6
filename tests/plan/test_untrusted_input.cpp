// Untrusted files and JSON (plan/untrusted_input.h): a key twice is refused at every level, naming it
// and where it sits; nesting past the limit and every parse error (a number past a double included)
// are Errors naming the source, the byte and the key; files are read only when regular (a FIFO, a
// device, a directory, a dangling symlink refused before any open; a symlink to a file followed) and
// no larger than their limit; a long value is cut in messages.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "error_text.h"
#include "moekit/error.h"
#include "moekit/limits.h"
#include "plan/untrusted_input.h"

namespace moekit::plan {
namespace {

namespace fs = std::filesystem;

using moekit::testing::error_of;

TEST(UntrustedJson, AKeyTwiceIsRefusedAtEveryLevel) {
  struct Case {
    std::string text, expect;
  };
  const std::vector<Case> cases = {
      {R"({"a": 1, "a": 2})", "key 'a' is given twice in the top-level object"},
      {R"({"q": {"m": "fp8", "m": "int4"}})", "key 'm' is given twice in 'q'"},
      {R"({"weight_map": {"t": "x.safetensors", "u": "y", "t": "y.safetensors"}})",
       "key 't' is given twice in 'weight_map'"},
      {R"({"l": [{"k": 1}, {"k": 2, "k": 3}]})", "key 'k' is given twice in 'l'.'[1]'"},
  };
  for (const Case& c : cases) {
    const std::string e = error_of([&] { parse_json(c.text, "src.json"); });
    EXPECT_NE(e.find("src.json"), std::string::npos) << c.text << ": " << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << c.text << ": " << e;
  }
  // The same keys in different objects are not twice; values come through as written.
  const nlohmann::json j = parse_json(R"({"a": {"k": 1}, "b": {"k": [1, 2.5, "x", null, true]}})", "src.json");
  EXPECT_EQ(j["a"]["k"], 1);
  EXPECT_EQ(j["b"]["k"][1], 2.5);
  EXPECT_EQ(j["b"]["k"][2], "x");
}

TEST(UntrustedJson, ParseErrorsNameTheSourceTheByteAndTheKey) {
  struct Case {
    std::string text;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {R"({"hidden_size": 1e999})", {"at byte", "in the value of key 'hidden_size'", "number overflow", "1e999"}},
      {R"({"x": -1e999})", {"key 'x'", "number overflow"}},
      {R"({"a": 1,})", {"not valid JSON"}},
      {"", {"not valid JSON at byte"}},
      {R"({"a": 1} trailing)", {"not valid JSON"}},
      {"{\"a\": \"\xff\"}", {"not valid JSON"}},  // not UTF-8
      {std::string(limits::kMaxJsonDepth + 1, '['), {"nested deeper than 64 levels"}},
  };
  for (const Case& c : cases) {
    const std::string e = error_of([&] { parse_json(c.text, "cfg.json"); });
    EXPECT_NE(e.find("cfg.json"), std::string::npos) << c.text.substr(0, 40) << ": " << e;
    for (const std::string& s : c.expect) EXPECT_NE(e.find(s), std::string::npos) << c.text.substr(0, 40) << ": " << e;
  }
  // As deep as the limit parses.
  const std::string deep = std::string(limits::kMaxJsonDepth, '[') + std::string(limits::kMaxJsonDepth, ']');
  EXPECT_EQ(error_of([&] { parse_json(deep, "cfg.json"); }), "");
  // A value for a message is cut to 80 characters.
  EXPECT_EQ(brief(nlohmann::json(std::string(500, 'x'))).size(), 80u);
  EXPECT_EQ(brief(nlohmann::json(7)), "7");
}

class UntrustedFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moekit_untrusted_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(UntrustedFiles, OnlyRegularFilesAreRead) {
  const fs::path file = dir_ / "config.json", fifo = dir_ / "fifo.json", link = dir_ / "link.json",
                 dangling = dir_ / "dangling.json", to_dev = dir_ / "zero.json";
  std::ofstream(file) << R"({"a": 1})";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  fs::create_symlink(file, link);
  fs::create_symlink(dir_ / "gone.json", dangling);
  fs::create_symlink("/dev/zero", to_dev);
  EXPECT_EQ(read_regular_file(file.string(), 100, "config.json"), R"({"a": 1})");
  EXPECT_EQ(read_regular_file(link.string(), 100, "config.json"), R"({"a": 1})") << "a symlink to a file is followed";
  struct Case {
    fs::path path;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {fifo, "is a FIFO (named pipe), not a regular file"},
      {dir_, "is a directory"},
      {"/dev/zero", "is a character device"},
      {to_dev, "is a character device"},
      {dangling, "a symlink to '" + (dir_ / "gone.json").string() + "', which cannot be opened"},
      {dir_ / "missing.json", "cannot open config.json"},
  };
  for (const Case& c : cases) {
    // A FIFO with no writer would block an open: the check comes first, so this returns at once.
    const std::string e = error_of([&] { read_regular_file(c.path.string(), 100, "config.json"); });
    EXPECT_NE(e.find(c.path.string()), std::string::npos) << c.path << ": " << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << c.path << ": " << e;
  }
  const std::string big = error_of([&] { read_regular_file(file.string(), 4, "config.json"); });
  EXPECT_NE(big.find("is 8 bytes, past moekit's limit of 4 bytes"), std::string::npos) << big;
  EXPECT_TRUE(path_exists(dangling.string()));
  EXPECT_FALSE(path_exists((dir_ / "missing.json").string()));
}

}  // namespace
}  // namespace moekit::plan
