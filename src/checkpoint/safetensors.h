// A safetensors file (Hugging Face checkpoints' tensor format) read as untrusted input: an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range in the
// data section that follows, then the data. The file is memory-mapped read-only; a tensor's bytes are
// a view into the mapping, read only when the caller touches them (only this rank's tensors).
//
// The file is opened only when it is a regular file (plan/untrusted_input.h: a FIFO, a device or a
// directory is refused before any open). Every header rule is checked in one pass over the header,
// in time and memory linear in its size, before any tensor is handed out, each violation a
// moekit::Error that names the file and the tensor: the header length within kMaxHeaderBytes and the
// file; JSON that parses, nests no deeper than the format does and names no tensor twice and no field
// of an entry twice; a known dtype; a shape of at most limits::kMaxTensorRank non-negative integers
// whose element count times the dtype's size is the tensor's byte range (without overflow); ranges
// inside the data section that neither overlap nor leave holes, covering it exactly (the format's own
// rule); `__metadata__` a map of strings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/limits.h"

namespace moekit::checkpoint {

enum class TensorDType : std::uint8_t {
  kBool,
  kU8,
  kI8,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kI64,
  kU64,
  kF64
};
std::string_view dtype_name(TensorDType dtype);  // the format's spelling: "BF16", "F8_E4M3", ...
std::int64_t dtype_bytes(TensorDType dtype);

struct TensorInfo {
  std::string name;
  TensorDType dtype = TensorDType::kU8;
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0, end = 0;  // byte range in the data section
  std::int64_t bytes() const { return end - begin; }
  std::int64_t numel() const;
};

// Maps the pages of [data, data + bytes) of a memory-mapped file into the process at once
// (madvise MADV_POPULATE_READ: one call instead of a page fault per 4 KiB, from the page cache or the
// disk), so that threads reading disjoint regions fault them in parallel and in bulk. A hint: where the
// kernel does not have it (before Linux 5.14) the pages fault in as read.
void populate_read(const std::byte* data, std::int64_t bytes);

class SafetensorsFile {
 public:
  // The largest header read (bytes): the format's reference reader's limit.
  static constexpr std::int64_t kMaxHeaderBytes = limits::kMaxHeaderBytes;

  // Opens and maps `path`, then checks its header (above).
  explicit SafetensorsFile(const std::string& path);
  // The same checks over bytes in memory (tests, fuzzing); `name` stands for the path in errors.
  SafetensorsFile(std::vector<std::byte> bytes, std::string name);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) = delete;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in data order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(std::string_view name) const;
  // The tensor, or an Error naming the file, the tensor and how many the file holds.
  const TensorInfo& info(std::string_view name) const;
  // Its bytes in the mapping (the data section's [begin, end)).
  std::span<const std::byte> data(const TensorInfo& tensor) const;
  // Copies `bytes` bytes of the file from `src` (a pointer into data()) to dst: by pread from a
  // mapped file (the page cache copied without being mapped in: 0.75x a heap-to-heap memcpy on the
  // 2-core CI machine, where mmap + memcpy reached 0.42x), by memcpy from the in-memory form. A file
  // that ends before them (truncated while open) is an Error naming it, the offset and the length.
  void copy_out(const std::byte* src, std::int64_t bytes, void* dst) const;

 private:
  void parse();

  std::string path_;
  const std::byte* base_ = nullptr;  // the whole file
  std::int64_t size_ = 0;
  bool mapped_ = false;
  int fd_ = -1;                   // kept open while mapped (copy_out)
  std::vector<std::byte> owned_;  // the in-memory form
  std::int64_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moekit::checkpoint
