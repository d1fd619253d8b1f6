// Safetensors files written by the tests in the format's layout: the 8-byte little-endian header
// length (or a given, lying one), the header text, the data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace moekit::checkpoint::testing {

inline std::vector<std::byte> file_bytes(const std::string& header, const std::vector<std::uint8_t>& data,
                                         std::uint64_t length_field = UINT64_MAX) {
  const std::uint64_t n = length_field == UINT64_MAX ? header.size() : length_field;
  std::vector<std::byte> out(8);
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xFF);
  for (char c : header) out.push_back(static_cast<std::byte>(c));
  for (std::uint8_t b : data) out.push_back(static_cast<std::byte>(b));
  return out;
}

inline void write_file(const std::filesystem::path& path, const std::vector<std::byte>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}

// A tensor to write: its format dtype name ("BF16", "F8_E4M3", ...), shape and little-endian bytes.
struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> data;
};

template <class T>
Tensor tensor_of(std::string name, std::string dtype, std::vector<std::int64_t> shape, const T* values,
                 std::size_t count) {
  Tensor t{std::move(name), std::move(dtype), std::move(shape), std::vector<std::uint8_t>(count * sizeof(T))};
  std::memcpy(t.data.data(), values, t.data.size());
  return t;
}

// A safetensors file of `tensors`, in order, as the format lays them out.
inline void write_tensors(const std::filesystem::path& path, const std::vector<Tensor>& tensors) {
  std::string header = "{";
  std::vector<std::uint8_t> data;
  for (const Tensor& t : tensors) {
    if (header.size() > 1) header += ",";
    header.append("\"").append(t.name).append("\":{\"dtype\":\"").append(t.dtype).append("\",\"shape\":[");
    for (std::size_t i = 0; i < t.shape.size(); ++i) header.append(i ? "," : "").append(std::to_string(t.shape[i]));
    header.append("],\"data_offsets\":[").append(std::to_string(data.size())).append(",");
    header.append(std::to_string(data.size() + t.data.size())).append("]}");
    data.insert(data.end(), t.data.begin(), t.data.end());
  }
  header += "}";
  write_file(path, file_bytes(header, data));
}

}  // namespace moekit::checkpoint::testing
