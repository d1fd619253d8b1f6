// Safetensors files written by the tests in the format's layout: the 8-byte little-endian header
// length (or a given, lying one), the header text, the data.
#pragma once

#include <cstddef>
#include <cstdint>
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

}  // namespace moekit::checkpoint::testing
