// Files and JSON from outside, read as untrusted input (DESIGN.md): a config.json, a checkpoint's
// index and its shards. A file is opened only when it is a regular file (a symlink to one is followed:
// Hugging Face's cache links each file of a snapshot to its blob), checked before the open and again
// on the descriptor, opened without blocking (a FIFO never stalls the process), and read only up to
// its limit. JSON is parsed in one linear pass that refuses a key given twice at any level, nests no
// deeper than limits::kMaxJsonDepth, and turns every parse error (a number like 1e999 included) into
// a moekit::Error naming the file, the byte and the key it was reading.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace moekit::plan {

// A regular file opened read-only (close it with ::close).
struct OpenFile {
  int fd = -1;
  std::int64_t size = 0;
};
// `what` names the file's role in errors ("config.json", "shard", ...). Raises moekit::Error for a
// path that is missing, a directory, a FIFO, a device, a socket or a dangling symlink, naming it.
OpenFile open_regular_file(const std::string& path, std::string_view what);
// Its whole text, when it is at most max_bytes.
std::string read_regular_file(const std::string& path, std::int64_t max_bytes, std::string_view what);
// Whether `path` names something (a regular file or not, a dangling symlink too): lstat, no open.
bool path_exists(const std::string& path);

// `source` names the text in errors (a path, or a preset's name).
nlohmann::json parse_json(std::string_view text, const std::string& source);
// A value as JSON for an error message, cut to 80 characters (a hostile value may be megabytes).
std::string brief(const nlohmann::json& value);

}  // namespace moekit::plan
