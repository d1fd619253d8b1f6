// The safetensors reader against files written here in the format's layout: what a writer produces is
// read back exactly (in memory and memory-mapped from disk); every malformed header is an Error naming
// the file and the tensor; seeded mutations of a valid file (bytes flipped, the length rewritten,
// truncation, insertion) never crash and never hand out a byte outside the file (ASan in CI).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "moekit/error.h"
#include "synthetic/random.h"
#include "write_safetensors.h"

namespace moekit::checkpoint {
namespace {

using testing::file_bytes;

// Three tensors in the layouts a model's shard holds: bf16 (2, 3), FP8 codes (4,), an fp32 scalar.
const std::string kHeader =
    R"({"__metadata__":{"format":"pt"},"w.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
    R"("w.weight_scale_inv":{"dtype":"F32","shape":[],"data_offsets":[16,20]},)"
    R"("q":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[12,16]}})";

std::vector<std::uint8_t> data20() {
  std::vector<std::uint8_t> d(20);
  std::iota(d.begin(), d.end(), std::uint8_t{1});
  return d;
}

TEST(Safetensors, ReadsWhatTheFormatWrites) {
  const auto bytes = file_bytes(kHeader, data20());
  const auto dir = std::filesystem::temp_directory_path() / "moekit_safetensors_test";
  std::filesystem::create_directories(dir);
  const auto path = (dir / "model.safetensors").string();
  testing::write_file(path, bytes);
  for (int from_disk = 0; from_disk < 2; ++from_disk) {
    const SafetensorsFile st = from_disk ? SafetensorsFile(path) : SafetensorsFile(bytes, "mem");
    ASSERT_EQ(st.tensors().size(), 3u);
    EXPECT_EQ(st.metadata().at("format"), "pt");
    // In data order.
    EXPECT_EQ(st.tensors()[0].name, "w.weight");
    EXPECT_EQ(st.tensors()[1].name, "q");
    EXPECT_EQ(st.tensors()[2].name, "w.weight_scale_inv");
    const TensorInfo& w = st.info("w.weight");
    EXPECT_EQ(w.dtype, TensorDType::kBF16);
    EXPECT_EQ(w.shape, (std::vector<std::int64_t>{2, 3}));
    EXPECT_EQ(w.numel(), 6);
    const auto span = st.data(st.info("q"));
    ASSERT_EQ(span.size(), 4u);
    for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(static_cast<std::uint8_t>(span[i]), 13 + i);
    EXPECT_EQ(st.info("w.weight_scale_inv").numel(), 1);  // a scalar: shape []
    EXPECT_EQ(st.find("nope"), nullptr);
    try {
      st.info("nope");
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no tensor 'nope'"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(dtype_name(TensorDType::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(dtype_bytes(TensorDType::kBF16), 2);
  // Moved, the views still point at its bytes.
  SafetensorsFile a(bytes, "mem");
  SafetensorsFile b(std::move(a));
  EXPECT_EQ(static_cast<std::uint8_t>(b.data(b.info("q"))[0]), 13);
  std::filesystem::remove_all(dir);
}

std::string error_of(const std::vector<std::byte>& bytes) {
  try {
    SafetensorsFile st(bytes, "bad.safetensors");
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

std::string one(const std::string& fields, const std::string& name = "t") {
  return R"({")" + name + R"(":{)" + fields + "}}";
}

TEST(Safetensors, MalformedHeadersAreErrorsNamingTheFileAndTheTensor) {
  const std::vector<std::uint8_t> four(4, 7);
  struct Case {
    const char* what;
    std::vector<std::byte> bytes;
    std::vector<std::string> expect;
  };
  const std::string ok = R"("dtype":"F32","shape":[1],"data_offsets":[0,4])";
  std::string forty_ones = "1";
  for (int i = 1; i < 40; ++i) forty_ones += ",1";
  const std::vector<Case> cases = {
      {"truncated length", std::vector<std::byte>(5), {"shorter than the 8-byte"}},
      {"enormous header length", file_bytes(one(ok), four, 1ull << 62), {"past the 100000000-byte limit"}},
      {"length past the file", file_bytes(one(ok), four, 4096), {"runs past the file's end"}},
      {"not JSON", file_bytes("{\"t\": {dtype}", {}), {"not valid JSON"}},
      {"not an object", file_bytes("[1, 2]", {}), {"does not start with '{'"}},
      {"deep nesting",
       file_bytes("{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}", {}),
       {"tensor 'a'", "must be an object"}},
      {"deep nesting in an entry",
       file_bytes("{\"a\":{\"shape\":" + std::string(100000, '[') + std::string(100000, ']') + "}}", {}),
       {"nests deeper than 3 levels"}},
      {"a field twice (the last would win)",
       file_bytes(one(R"("dtype":"BF16","dtype":"F16","shape":[2],"data_offsets":[0,4])"), four),
       {"tensor 't'", "field 'dtype' is given twice"}},
      {"a number past double",
       file_bytes(one(R"("dtype":"U8","shape":[1e999],"data_offsets":[0,4])"), four),
       {"not valid JSON", "number overflow"}},
      {"too many dimensions",
       file_bytes(one(R"("dtype":"U8","shape":[)" + forty_ones + R"(],"data_offsets":[0,1])"), {1}),
       {"tensor 't'", "more than 32 dimensions"}},
      {"a name twice",
       file_bytes(R"({"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                  R"("t":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                  four),
       {"names tensor 't' twice"}},
      {"unknown dtype",
       file_bytes(one(R"("dtype":"F7","shape":[1],"data_offsets":[0,4])"), four),
       {"tensor 't'", "unknown dtype 'F7'"}},
      {"negative dim",
       file_bytes(one(R"("dtype":"F32","shape":[-1],"data_offsets":[0,4])"), four),
       {"tensor 't': shape[0]", "non-negative"}},
      {"shape overflow",
       file_bytes(one(R"("dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,4])"), four),
       {"tensor 't'", "overflows 64 bits"}},
      {"size lie",
       file_bytes(one(R"("dtype":"F32","shape":[2],"data_offsets":[0,4])"), four),
       {"tensor 't'", "lies about its size"}},
      {"offsets past the end",
       file_bytes(one(R"("dtype":"F32","shape":[2],"data_offsets":[0,8])"), four),
       {"tensor 't'", "run past the data section"}},
      {"end before begin",
       file_bytes(one(R"("dtype":"U8","shape":[0],"data_offsets":[4,0])"), four),
       {"tensor 't'", "end before they begin"}},
      {"overlap",
       file_bytes(R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                  R"("b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                  four),
       {"tensor 'b'", "overlaps tensor 'a'"}},
      {"hole",
       file_bytes(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                  four),
       {"tensor 'b'", "unnamed"}},
      {"bytes past the tensors",
       file_bytes(one(R"("dtype":"U8","shape":[2],"data_offsets":[0,2])"), four),
       {"bytes past them unnamed"}},
      {"unknown field", file_bytes(one(ok + R"(,"align":8)"), four), {"tensor 't'", "unknown field 'align'"}},
      {"missing field",
       file_bytes(one(R"("dtype":"F32","shape":[1])"), four),
       {"tensor 't'", "needs dtype, shape and data_offsets"}},
      {"bad offsets",
       file_bytes(one(R"("dtype":"F32","shape":[1],"data_offsets":[0])"), four),
       {"tensor 't'", "data_offsets must be [begin, end]"}},
      {"float shape",
       file_bytes(one(R"("dtype":"F32","shape":[1.5],"data_offsets":[0,4])"), four),
       {"tensor 't': shape[0]"}},
      {"entry not an object", file_bytes(R"({"t":[0,4]})", four), {"tensor 't'", "must be an object"}},
      {"metadata not strings", file_bytes(R"({"__metadata__":{"n":3}})", {}), {"__metadata__['n']"}},
  };
  for (const Case& c : cases) {
    const std::string e = error_of(c.bytes);
    ASSERT_FALSE(e.empty()) << c.what << ": accepted";
    EXPECT_NE(e.find("bad.safetensors"), std::string::npos) << c.what << ": " << e;
    for (const std::string& s : c.expect) EXPECT_NE(e.find(s), std::string::npos) << c.what << ": " << e;
  }
  // A valid one of the same pieces parses, and an empty file of no tensors is valid.
  EXPECT_EQ(error_of(file_bytes(one(ok), four)), "");
  EXPECT_EQ(error_of(file_bytes("{}", {})), "");
  // Files that are not there, or not files.
  EXPECT_THROW(SafetensorsFile("/nonexistent/model.safetensors"), Error);
  EXPECT_THROW(SafetensorsFile(std::filesystem::temp_directory_path().string()), Error);
}

TEST(Safetensors, SeededMutationsNeverCrashOrReadOutsideTheFile) {
  const auto valid = file_bytes(kHeader, data20());
  synthetic::SplitMix rng{20261203};
  int accepted = 0, refused = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    std::vector<std::byte> b = valid;
    const std::uint64_t kind = rng.next() % 5;
    const std::uint64_t edits = 1 + rng.next() % 4;
    for (std::uint64_t k = 0; k < edits; ++k) {
      if (b.empty()) break;
      const std::size_t at = static_cast<std::size_t>(rng.next() % b.size());
      switch (kind) {
        case 0: b[at] = static_cast<std::byte>(rng.next() & 0xFF); break;  // a byte anywhere
        case 1: {  // a byte of the header, from the characters that matter to JSON and numbers
          const char kChars[] = "{}[]\",:0123456789-e.E \\";
          const std::size_t h = 8 + static_cast<std::size_t>(rng.next() % kHeader.size());
          b[h] = static_cast<std::byte>(kChars[rng.next() % (sizeof(kChars) - 1)]);
          break;
        }
        case 2: b.resize(at); break;  // truncated
        case 3: {                     // the length field rewritten
          const std::uint64_t n = rng.next() % 3 == 0 ? rng.next() : kHeader.size() + (rng.next() % 64) - 32;
          for (int i = 0; i < 8 && static_cast<std::size_t>(i) < b.size(); ++i)
            b[static_cast<std::size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xFF);
          break;
        }
        default: b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), static_cast<std::byte>(rng.next() & 0xFF));
      }
    }
    try {
      const SafetensorsFile st(b, "mutated");
      ++accepted;
      for (const TensorInfo& t : st.tensors()) {
        const auto span = st.data(t);
        // Inside the bytes: ASan would catch a read past them; the arithmetic is checked too.
        ASSERT_GE(span.data(), st.data(st.tensors().front()).data());
        std::uint64_t sum = 0;
        for (const std::byte x : span) sum += static_cast<std::uint8_t>(x);
        (void)sum;
        ASSERT_EQ(static_cast<std::int64_t>(span.size()), t.numel() * dtype_bytes(t.dtype));
      }
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(accepted, 0);  // some edits keep a valid file (a data byte, a space)
  std::printf("  4000 mutations: %d refused by name, %d still valid\n", refused, accepted);
}

}  // namespace
}  // namespace moekit::checkpoint
