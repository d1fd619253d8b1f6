// The safetensors reader: the header's rules (safetensors.h) checked in one pass before any tensor is
// handed out.
#include "checkpoint/safetensors.h"

#include <sys/mman.h>
#include <unistd.h>

#include <fmt/ranges.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <unordered_set>
#include <utility>

#include "moekit/check.h"
#include "moekit/limits.h"
#include "plan/untrusted_input.h"

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

std::int64_t non_negative(std::uint64_t u, const std::string& what) {
  MOEKIT_CHECK(u <= static_cast<std::uint64_t>(INT64_MAX), "{} = {} is past 2^63", what, u);
  return static_cast<std::int64_t>(u);
}

// One JSON scalar of the header, as the SAX parser hands it over.
struct Scalar {
  enum class Kind : std::uint8_t { kNull, kBool, kNegative, kUnsigned, kFloat, kString } kind;
  std::uint64_t u = 0;
  std::string text;  // the value as the header wrote it (a string's contents; a number's digits)
  std::string shown() const {
    const std::string_view v = std::string_view(text).substr(0, 64);
    return kind == Kind::kString ? fmt::format("\"{}\"", v) : std::string(v);
  }
};

// The header's rules checked as nlohmann's SAX parser reads it, in one pass: memory and time linear in
// the header (no document is built, and a key is looked up once). Depth 1 is the header object, depth 2
// a tensor's entry (or __metadata__), depth 3 a shape or data_offsets array; nothing nests deeper.
class HeaderReader {
 public:
  HeaderReader(const std::string& path, std::int64_t data_bytes, std::vector<TensorInfo>& tensors,
               std::map<std::string, std::string>& metadata)
      : path_(path), data_bytes_(data_bytes), tensors_(tensors), metadata_(metadata) {}

  bool null() { return scalar({Scalar::Kind::kNull, 0, "null"}); }
  bool boolean(bool v) { return scalar({Scalar::Kind::kBool, 0, v ? "true" : "false"}); }
  bool number_integer(json::number_integer_t v) {
    return scalar(
        {v < 0 ? Scalar::Kind::kNegative : Scalar::Kind::kUnsigned, static_cast<std::uint64_t>(v), std::to_string(v)});
  }
  bool number_unsigned(json::number_unsigned_t v) { return scalar({Scalar::Kind::kUnsigned, v, std::to_string(v)}); }
  bool number_float(json::number_float_t, const json::string_t& text) {
    return scalar({Scalar::Kind::kFloat, 0, text});
  }
  bool string(json::string_t& v) { return scalar({Scalar::Kind::kString, 0, std::move(v)}); }
  bool binary(json::binary_t&) { MOEKIT_FAIL("{}: the header holds binary data", path_); }
  bool start_object(std::size_t) { return open(true); }
  bool start_array(std::size_t) { return open(false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t position, const std::string& token, const nlohmann::detail::exception& e) {
    MOEKIT_FAIL("{}: the header is not valid JSON at byte {}{} (read '{}'): {}", path_, position,
                name_.empty() ? std::string() : fmt::format(" (in tensor '{}')", name_.substr(0, 200)),
                token.substr(0, 64), e.what());
  }

  bool key(json::string_t& k) {
    if (depth_ == 1) {
      MOEKIT_CHECK(names_.insert(k).second, "{}: the header names tensor '{}' twice", path_, k);
      name_ = std::move(k);
      metadata_entry_ = name_ == "__metadata__";
      return true;
    }
    if (metadata_entry_) {
      MOEKIT_CHECK(!metadata_.contains(k), "{}: __metadata__ names key '{}' twice", path_, k);
      field_ = std::move(k);
      return true;
    }
    const std::string what = entry();
    const int f = k == "dtype" ? 0 : k == "shape" ? 1 : k == "data_offsets" ? 2 : -1;
    MOEKIT_CHECK(f >= 0, "{}: unknown field '{}' (dtype, shape and data_offsets only)", what, k);
    MOEKIT_CHECK(!seen_[f], "{}: field '{}' is given twice (a JSON reader keeps one of them silently)", what, k);
    seen_[f] = true;
    field_ = std::move(k);
    return true;
  }

 private:
  std::string entry() const { return fmt::format("{}: tensor '{}'", path_, name_); }

  bool open(bool object) {
    ++depth_;
    if (depth_ == 1) {
      MOEKIT_CHECK(object, "{}: the header is not a JSON object", path_);
    } else if (depth_ == 2) {
      MOEKIT_CHECK(object || !metadata_entry_, "{}: __metadata__ must be an object of strings", path_);
      MOEKIT_CHECK(object, "{}: its entry must be an object with dtype, shape and data_offsets", entry());
      t_ = TensorInfo{};
      t_.name = name_;
      seen_[0] = seen_[1] = seen_[2] = false;
      numel_ = 1;
      offsets_.clear();
    } else if (depth_ == 3) {
      MOEKIT_CHECK(!metadata_entry_, "{}: __metadata__['{}'] must be a string, got {}", path_, field_,
                   object ? "an object" : "an array");
      MOEKIT_CHECK(field_ != "dtype", "{}: dtype must be a string, got {}", entry(), object ? "an object" : "an array");
      MOEKIT_CHECK(!object, "{}: {} must be an array of integers, got an object", entry(), field_);
    } else {
      MOEKIT_FAIL("{}: the header nests deeper than 3 levels (in tensor '{}'); a safetensors header nests 3", path_,
                  name_.substr(0, 200));
    }
    return true;
  }

  bool close() {
    if (depth_ == 2 && !metadata_entry_) finish_entry();
    if (depth_ == 3 && field_ == "data_offsets") {
      MOEKIT_CHECK(offsets_.size() == 2, "{}: data_offsets must be [begin, end], got {} values", entry(),
                   offsets_.size());
    }
    --depth_;
    return true;
  }

  bool scalar(Scalar v) {
    if (depth_ == 0) MOEKIT_FAIL("{}: the header is not a JSON object", path_);
    if (depth_ == 1) {
      MOEKIT_CHECK(!metadata_entry_, "{}: __metadata__ must be an object of strings", path_);
      MOEKIT_FAIL("{}: its entry must be an object with dtype, shape and data_offsets, got {}", entry(), v.shown());
    }
    if (depth_ == 2 && metadata_entry_) {
      MOEKIT_CHECK(v.kind == Scalar::Kind::kString, "{}: __metadata__['{}'] must be a string, got {}", path_, field_,
                   v.shown());
      metadata_.emplace(field_, std::move(v.text));
      return true;
    }
    const std::string what = entry();
    if (depth_ == 2) {
      if (field_ == "dtype") {
        MOEKIT_CHECK(v.kind == Scalar::Kind::kString, "{}: dtype must be a string, got {}", what, v.shown());
        const auto row =
            std::find_if(kDTypes.begin(), kDTypes.end(), [&](const DTypeRow& r) { return r.name == v.text; });
        MOEKIT_CHECK(row != kDTypes.end(), "{}: unknown dtype '{}'", what, v.text.substr(0, 64));
        t_.dtype = row->dtype;
        return true;
      }
      MOEKIT_CHECK(field_ != "shape", "{}: shape must be an array of integers, got {}", what, v.shown());
      MOEKIT_FAIL("{}: data_offsets must be [begin, end], got {}", what, v.shown());
    }
    // depth 3: an element of shape or data_offsets.
    const bool is_shape = field_ == "shape";
    const std::string element = is_shape ? fmt::format("{}: shape[{}]", what, t_.shape.size())
                                         : fmt::format("{}: data_offsets[{}]", what, offsets_.size());
    MOEKIT_CHECK(v.kind == Scalar::Kind::kUnsigned, "{} must be a non-negative integer, got {}", element, v.shown());
    const std::int64_t x = non_negative(v.u, element);
    if (is_shape) {
      MOEKIT_CHECK(static_cast<int>(t_.shape.size()) < limits::kMaxTensorRank,
                   "{}: its shape has more than {} dimensions (moekit/limits.h)", what, limits::kMaxTensorRank);
      MOEKIT_CHECK(!__builtin_mul_overflow(numel_, x, &numel_), "{}: its shape ({}, {}...) overflows 64 bits", what,
                   fmt::join(t_.shape, ", "), x);
      t_.shape.push_back(x);
    } else {
      MOEKIT_CHECK(offsets_.size() < 2, "{}: data_offsets must be [begin, end], got more than 2 values", what);
      offsets_.push_back(x);
    }
    return true;
  }

  void finish_entry() {
    const std::string what = entry();
    MOEKIT_CHECK(seen_[0] && seen_[1] && seen_[2], "{}: needs dtype, shape and data_offsets", what);
    TensorInfo& t = t_;
    t.begin = offsets_[0];
    t.end = offsets_[1];
    MOEKIT_CHECK(t.begin <= t.end, "{}: data_offsets [{}, {}] end before they begin", what, t.begin, t.end);
    const std::int64_t size = dtype_bytes(t.dtype);
    std::int64_t bytes = 0;
    MOEKIT_CHECK(!__builtin_mul_overflow(numel_, size, &bytes), "{}: {} elements of {} overflow 64 bits", what, numel_,
                 dtype_name(t.dtype));
    MOEKIT_CHECK(bytes == t.end - t.begin,
                 "{}: shape [{}] of {} is {} bytes, but data_offsets [{}, {}] span {}: the header lies about its size",
                 what, fmt::join(t.shape, ","), dtype_name(t.dtype), bytes, t.begin, t.end, t.end - t.begin);
    MOEKIT_CHECK(t.end <= data_bytes_, "{}: data_offsets [{}, {}] run past the data section's {} bytes: truncated?",
                 what, t.begin, t.end, data_bytes_);
    tensors_.push_back(std::move(t));
  }

  const std::string& path_;
  const std::int64_t data_bytes_;
  std::vector<TensorInfo>& tensors_;
  std::map<std::string, std::string>& metadata_;
  std::unordered_set<std::string> names_;
  int depth_ = 0;
  std::string name_, field_;
  bool metadata_entry_ = false;
  bool seen_[3] = {false, false, false};  // dtype, shape, data_offsets
  TensorInfo t_;
  std::int64_t numel_ = 1;
  std::vector<std::int64_t> offsets_;
};

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

void populate_read(const std::byte* data, std::int64_t bytes) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;  // Linux 5.14 (older headers lack the name)
#endif
  if (data == nullptr || bytes <= 0) return;
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(data) & ~(page - 1);
  const auto end = reinterpret_cast<std::uintptr_t>(data) + static_cast<std::uintptr_t>(bytes);
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ);  // a hint: errors ignored
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const plan::OpenFile file = plan::open_regular_file(path, "safetensors file");
  const int fd = file.fd;
  size_ = file.size;
  if (size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<std::size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    if (p == MAP_FAILED) ::close(fd);
    MOEKIT_CHECK(p != MAP_FAILED, "{}: cannot map its {} bytes: {}", path, size_, std::strerror(err));
    base_ = static_cast<const std::byte*>(p);
    mapped_ = true;
    fd_ = fd;
  } else {
    ::close(fd);
  }
  try {
    parse();
  } catch (...) {
    if (mapped_) ::munmap(const_cast<std::byte*>(base_), static_cast<std::size_t>(size_));
    if (fd_ >= 0) ::close(fd_);
    mapped_ = false;
    fd_ = -1;
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
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsFile::copy_out(const std::byte* src, std::int64_t bytes, void* dst) const {
  MOEKIT_CHECK(src >= base_ && bytes >= 0 && bytes <= size_ - (src - base_),
               "{}: a copy of {} bytes at offset {} outside its {} bytes", path_, bytes, src - base_, size_);
  if (fd_ < 0) {
    std::memcpy(dst, src, static_cast<std::size_t>(bytes));
    return;
  }
  auto* out = static_cast<char*>(dst);
  std::int64_t offset = src - base_, done = 0;
  while (done < bytes) {
    const ssize_t n =
        ::pread(fd_, out + done, static_cast<std::size_t>(bytes - done), static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    MOEKIT_CHECK(n > 0, "{}: reading {} bytes at offset {}: {} (the file changed while open?)", path_, bytes - done,
                 offset + done, n == 0 ? std::string("it ends there") : std::string(std::strerror(errno)));
    done += n;
  }
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      base_(o.base_),
      size_(o.size_),
      mapped_(o.mapped_),
      fd_(o.fd_),
      owned_(std::move(o.owned_)),
      data_offset_(o.data_offset_),
      tensors_(std::move(o.tensors_)),
      index_(std::move(o.index_)),
      metadata_(std::move(o.metadata_)) {
  if (!mapped_) base_ = owned_.data();
  o.mapped_ = false;
  o.fd_ = -1;
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
  data_offset_ = 8 + static_cast<std::int64_t>(n);
  HeaderReader reader(path_, size_ - data_offset_, tensors_, metadata_);
  json::sax_parse(header, &reader);
  const std::int64_t data_bytes = size_ - data_offset_;
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
