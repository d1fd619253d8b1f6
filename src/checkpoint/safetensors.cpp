// The safetensors reader: the header's rules (safetensors.h) checked in one pass before any tensor is
// handed out.
#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "moekit/check.h"

namespace moekit::checkpoint {
namespace {

using json = nlohmann::json;

struct DTypeRow {
  std::string_view name;
  TensorDType dtype;
  std::int64_t bytes;
};

constexpr std::array<DTypeRow, 16> kDTypes{{
    {"BOOL", TensorDType::kBool, 1},
    {"U8", TensorDType::kU8, 1},
    {"I8", TensorDType::kI8, 1},
    {"F8_E4M3", TensorDType::kF8E4M3, 1},
    {"F8_E5M2", TensorDType::kF8E5M2, 1},
    {"F8_E8M0", TensorDType::kF8E8M0, 1},
    {"I16", TensorDType::kI16, 2},
    {"U16", TensorDType::kU16, 2},
    {"F16", TensorDType::kF16, 2},
    {"BF16", TensorDType::kBF16, 2},
    {"I32", TensorDType::kI32, 4},
    {"U32", TensorDType::kU32, 4},
    {"F32", TensorDType::kF32, 4},
    {"I64", TensorDType::kI64, 8},
    {"U64", TensorDType::kU64, 8},
    {"F64", TensorDType::kF64, 8},
}};

const DTypeRow& row_of(TensorDType dtype) {
  for (const auto& r : kDTypes)
    if (r.dtype == dtype) return r;
  MOEKIT_FAIL("safetensors: dtype enum {} has no row", static_cast<int>(dtype));
}

// The deepest nesting of arrays and objects in `text` (strings skipped): a valid header nests 3 deep
// ({name: {"shape": [...]}}), and a parser recursing into an untrusted depth could exhaust the stack.
int nesting_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

std::int64_t non_negative(const json& v, const std::string& what) {
  MOEKIT_CHECK(v.is_number_integer() && (v.is_number_unsigned() || v.get<std::int64_t>() >= 0),
               "{} must be a non-negative integer, got {}", what, v.dump());
  const auto u = v.get<std::uint64_t>();
  MOEKIT_CHECK(u <= static_cast<std::uint64_t>(INT64_MAX), "{} = {} is past 2^63", what, u);
  return static_cast<std::int64_t>(u);
}

}  // namespace

std::string_view dtype_name(TensorDType dtype) {
  return row_of(dtype).name;
}

std::int64_t dtype_bytes(TensorDType dtype) {
  return row_of(dtype).bytes;
}

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;  // checked when the header was read
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOEKIT_CHECK(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    MOEKIT_FAIL("{}: not a regular file{}", path, err ? std::string(": ") + std::strerror(err) : "");
  }
  size_ = static_cast<std::int64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<std::size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    MOEKIT_CHECK(p != MAP_FAILED, "{}: cannot map its {} bytes: {}", path, size_, std::strerror(err));
    base_ = static_cast<const std::byte*>(p);
    mapped_ = true;
  } else {
    ::close(fd);
  }
  try {
    parse();
  } catch (...) {
    if (mapped_) ::munmap(const_cast<std::byte*>(base_), static_cast<std::size_t>(size_));
    mapped_ = false;
    throw;
  }
}

SafetensorsFile::SafetensorsFile(std::vector<std::byte> bytes, std::string name)
    : path_(std::move(name)), owned_(std::move(bytes)) {
  base_ = owned_.data();
  size_ = static_cast<std::int64_t>(owned_.size());
  parse();
}

SafetensorsFile::~SafetensorsFile() {
  if (mapped_) ::munmap(const_cast<std::byte*>(base_), static_cast<std::size_t>(size_));
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      base_(o.base_),
      size_(o.size_),
      mapped_(o.mapped_),
      owned_(std::move(o.owned_)),
      data_offset_(o.data_offset_),
      tensors_(std::move(o.tensors_)),
      index_(std::move(o.index_)),
      metadata_(std::move(o.metadata_)) {
  if (!mapped_) base_ = owned_.data();
  o.mapped_ = false;
  o.base_ = nullptr;
  o.size_ = 0;
}

void SafetensorsFile::parse() {
  MOEKIT_CHECK(size_ >= 8, "{}: {} bytes, shorter than the 8-byte header length of a safetensors file", path_, size_);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(base_[i]);  // little-endian
  MOEKIT_CHECK(n <= static_cast<std::uint64_t>(kMaxHeaderBytes),
               "{}: header length {} bytes is past the {}-byte limit (a corrupt or non-safetensors file)", path_, n,
               kMaxHeaderBytes);
  MOEKIT_CHECK(static_cast<std::int64_t>(n) <= size_ - 8,
               "{}: header length {} bytes runs past the file's end ({} bytes after the length): truncated?", path_, n,
               size_ - 8);
  const std::string_view header(reinterpret_cast<const char*>(base_ + 8), static_cast<std::size_t>(n));
  MOEKIT_CHECK(!header.empty() && header.front() == '{', "{}: the header does not start with '{{' (a JSON object)",
               path_);
  const int depth = nesting_depth(header);
  MOEKIT_CHECK(depth <= 3, "{}: the header nests {} levels deep; a safetensors header nests 3", path_, depth);
  // Names seen at the top level: nlohmann keeps the last of duplicate keys, so they are caught here.
  std::set<std::string> seen;
  std::string duplicate;
  json h;
  try {
    h = json::parse(header, [&](int d, json::parse_event_t event, json& parsed) {
      if (d == 1 && event == json::parse_event_t::key && !seen.insert(parsed.get<std::string>()).second &&
          duplicate.empty())
        duplicate = parsed.get<std::string>();
      return true;
    });
  } catch (const json::exception& e) {
    MOEKIT_FAIL("{}: the header is not valid JSON: {}", path_, e.what());
  }
  MOEKIT_CHECK(duplicate.empty(), "{}: the header names tensor '{}' twice", path_, duplicate);
  MOEKIT_CHECK(h.is_object(), "{}: the header is not a JSON object", path_);
  data_offset_ = 8 + static_cast<std::int64_t>(n);
  const std::int64_t data_bytes = size_ - data_offset_;

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      MOEKIT_CHECK(v.is_object(), "{}: __metadata__ must be an object of strings", path_);
      for (auto m = v.begin(); m != v.end(); ++m) {
        MOEKIT_CHECK(m.value().is_string(), "{}: __metadata__['{}'] must be a string, got {}", path_, m.key(),
                     m.value().dump());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = fmt::format("{}: tensor '{}'", path_, name);
    MOEKIT_CHECK(v.is_object(), "{}: its entry must be an object with dtype, shape and data_offsets", what);
    for (auto k = v.begin(); k != v.end(); ++k)
      MOEKIT_CHECK(k.key() == "dtype" || k.key() == "shape" || k.key() == "data_offsets",
                   "{}: unknown field '{}' (dtype, shape and data_offsets only)", what, k.key());
    MOEKIT_CHECK(v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
                 "{}: needs dtype, shape and data_offsets", what);
    TensorInfo t;
    t.name = name;
    const json& dt = v["dtype"];
    MOEKIT_CHECK(dt.is_string(), "{}: dtype must be a string, got {}", what, dt.dump());
    const auto row = std::find_if(kDTypes.begin(), kDTypes.end(),
                                  [&](const DTypeRow& r) { return r.name == dt.get<std::string>(); });
    MOEKIT_CHECK(row != kDTypes.end(), "{}: unknown dtype '{}'", what, dt.get<std::string>());
    t.dtype = row->dtype;
    const json& shape = v["shape"];
    MOEKIT_CHECK(shape.is_array(), "{}: shape must be an array of integers, got {}", what, shape.dump());
    std::int64_t numel = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      const std::int64_t d = non_negative(shape[i], fmt::format("{}: shape[{}]", what, i));
      MOEKIT_CHECK(!__builtin_mul_overflow(numel, d, &numel), "{}: its shape {} overflows 64 bits", what, shape.dump());
      t.shape.push_back(d);
    }
    const json& off = v["data_offsets"];
    MOEKIT_CHECK(off.is_array() && off.size() == 2, "{}: data_offsets must be [begin, end], got {}", what, off.dump());
    t.begin = non_negative(off[0], what + ": data_offsets[0]");
    t.end = non_negative(off[1], what + ": data_offsets[1]");
    MOEKIT_CHECK(t.begin <= t.end, "{}: data_offsets [{}, {}] end before they begin", what, t.begin, t.end);
    std::int64_t bytes = 0;
    MOEKIT_CHECK(!__builtin_mul_overflow(numel, row->bytes, &bytes), "{}: {} elements of {} overflow 64 bits", what,
                 numel, row->name);
    MOEKIT_CHECK(bytes == t.end - t.begin,
                 "{}: shape {} of {} is {} bytes, but data_offsets [{}, {}] span {}: the header lies about its size",
                 what, shape.dump(), row->name, bytes, t.begin, t.end, t.end - t.begin);
    MOEKIT_CHECK(t.end <= data_bytes,
                 "{}: data_offsets [{}, {}] run past the data section's {} bytes (the file is {} bytes): truncated?",
                 what, t.begin, t.end, data_bytes, size_);
    tensors_.push_back(std::move(t));
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // The format's rule: the ranges tile the data section, in order, with no overlap and no hole.
  std::int64_t at = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : tensors_) {
    MOEKIT_CHECK(t.begin >= at, "{}: tensor '{}' ([{}, {}]) overlaps tensor '{}' ([{}, {}])", path_, t.name, t.begin,
                 t.end, prev ? prev->name : "", prev ? prev->begin : 0, prev ? prev->end : 0);
    MOEKIT_CHECK(t.begin == at, "{}: tensor '{}' begins at byte {} of the data section, leaving bytes [{}, {}) unnamed",
                 path_, t.name, t.begin, at, t.begin);
    at = t.end;
    prev = &t;
  }
  MOEKIT_CHECK(at == data_bytes, "{}: the tensors end at byte {} of a {}-byte data section: bytes past them unnamed",
               path_, at, data_bytes);
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  const TensorInfo* t = find(name);
  MOEKIT_CHECK(t != nullptr, "{}: no tensor '{}' (the file holds {} tensors)", path_, name, tensors_.size());
  return *t;
}

std::span<const std::byte> SafetensorsFile::data(const TensorInfo& t) const {
  MOEKIT_CHECK(find(t.name) == &t, "{}: tensor '{}' is not one of this file's", path_, t.name);
  return {base_ + data_offset_ + t.begin, static_cast<std::size_t>(t.bytes())};
}

}  // namespace moekit::checkpoint
