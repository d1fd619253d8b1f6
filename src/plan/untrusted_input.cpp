// Untrusted files and JSON (untrusted_input.h): regular files only, opened without blocking, and a
// strict JSON reader built on nlohmann's SAX interface (one pass, a key twice refused at every level).
#include "plan/untrusted_input.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "moekit/check.h"
#include "moekit/limits.h"

namespace moekit::plan {
namespace {

using nlohmann::json;

std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Builds the document as nlohmann's own DOM parser does, refusing what it would accept silently: a
// key given twice (nlohmann keeps the last), nesting past kMaxJsonDepth, and any parse error.
class StrictDom {
 public:
  explicit StrictDom(const std::string& source) : source_(source) {}
  json& result() { return root_; }

  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(json::number_integer_t v) { return put(v); }
  bool number_unsigned(json::number_unsigned_t v) { return put(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(v); }
  bool string(json::string_t& v) { return put(std::move(v)); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    json& object = *stack_.back();
    MOEKIT_CHECK(!object.contains(k),
                 "{}: key '{}' is given twice in {} (a JSON reader would keep one of them silently): remove one",
                 source_, k, where());
    slot_ = &object[k];
    key_ = k;
    return true;
  }
  bool parse_error(std::size_t position, const std::string& token, const nlohmann::detail::exception& e) {
    MOEKIT_FAIL("{}: not valid JSON at byte {}{} (read '{}'): {}", source_, position,
                key_.empty() ? std::string() : fmt::format(", in the value of key '{}'", key_), token.substr(0, 64),
                e.what());
  }

 private:
  // Where the current container sits, for messages: "the top-level object" or "'a'.'b'".
  std::string where() const {
    if (path_.size() <= 1) return "the top-level object";
    std::string s;
    for (std::size_t i = 1; i < path_.size(); ++i) s += fmt::format("{}'{}'", i > 1 ? "." : "", path_[i]);
    return s;
  }
  json* place(json&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }
  bool put(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& v) {
    const bool in_array = !stack_.empty() && stack_.back()->is_array();
    const std::string name = stack_.empty() ? std::string()
                             : in_array     ? fmt::format("[{}]", stack_.back()->size())
                                            : key_;
    stack_.push_back(place(std::move(v)));
    path_.push_back(name);
    MOEKIT_CHECK(static_cast<int>(stack_.size()) <= limits::kMaxJsonDepth,
                 "{}: JSON nested deeper than {} levels (at {}): not a config or index moekit reads", source_,
                 limits::kMaxJsonDepth, where());
    return true;
  }
  bool close() {
    stack_.pop_back();
    path_.pop_back();
    return true;
  }

  const std::string& source_;
  json root_;
  std::vector<json*> stack_;
  std::vector<std::string> path_;
  json* slot_ = nullptr;
  std::string key_;
};

}  // namespace

OpenFile open_regular_file(const std::string& path, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    struct stat link {};
    if (::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode)) {
      std::vector<char> target(4096);
      const ssize_t n = ::readlink(path.c_str(), target.data(), target.size() - 1);
      MOEKIT_FAIL("cannot open {} '{}': a symlink to '{}', which cannot be opened: {}", what, path,
                  n > 0 ? std::string(target.data(), static_cast<std::size_t>(n)) : "?", std::strerror(err));
    }
    MOEKIT_FAIL("cannot open {} '{}': {}", what, path, std::strerror(err));
  }
  MOEKIT_CHECK(S_ISREG(st.st_mode), "{} '{}' is {}, not a regular file: moekit reads a {} only from a regular file",
               what, path, kind_of(st.st_mode), what);
  // O_NONBLOCK: were the path swapped for a FIFO after the stat, the open still returns at once.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  MOEKIT_CHECK(fd >= 0, "cannot open {} '{}': {}", what, path, std::strerror(errno));
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MOEKIT_FAIL("{} '{}' changed while it was opened and is no longer a regular file", what, path);
  }
  return {fd, static_cast<std::int64_t>(st.st_size)};
}

std::string read_regular_file(const std::string& path, std::int64_t max_bytes, std::string_view what) {
  const OpenFile f = open_regular_file(path, what);
  if (f.size > max_bytes) {
    ::close(f.fd);
    MOEKIT_FAIL("{} '{}' is {} bytes, past moekit's limit of {} bytes for a {}: a corrupt or wrong file?", what, path,
                f.size, max_bytes, what);
  }
  std::string text(static_cast<std::size_t>(f.size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(f.fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  const int err = errno;
  ::close(f.fd);
  MOEKIT_CHECK(got == text.size(), "{} '{}': read {} of its {} bytes: {}", what, path, got, text.size(),
               got < text.size() ? std::strerror(err) : "");
  return text;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

json parse_json(std::string_view text, const std::string& source) {
  StrictDom dom(source);
  json::sax_parse(text, &dom);
  return std::move(dom.result());
}

std::string brief(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

}  // namespace moekit::plan
