// A Hugging Face checkpoint directory: config.json and the weights, one `model.safetensors` or shards
// named by `model.safetensors.index.json` (its weight_map: tensor name -> shard file). Shards are
// opened (memory-mapped, their headers checked: safetensors.h) on the first read of a tensor they
// hold, so a rank that reads only its experts maps only the shards that hold them.
//
// The index is untrusted input too: valid JSON of at most kMaxIndexBytes, a weight_map of strings,
// shard names that are plain file names in the directory ending in ".safetensors" (no path
// separators: nothing outside the directory is ever opened), and each tensor found in the shard the
// index names, with its header's checks. Each violation is a moekit::Error naming the file and tensor.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/safetensors.h"

namespace moekit::checkpoint {

class CheckpointDir {
 public:
  static constexpr std::int64_t kMaxIndexBytes = 64 << 20;

  // Reads the index (or finds the single file); opens no shard yet.
  explicit CheckpointDir(const std::string& dir);

  const std::string& dir() const { return dir_; }
  std::string config_path() const { return dir_ + "/config.json"; }
  // Every tensor name the checkpoint holds (the index's, or the single file's), sorted.
  std::vector<std::string> tensor_names() const;
  bool contains(std::string_view name) const;
  // The tensor's header entry and bytes (its shard opened on first use); an Error naming the tensor
  // and the checkpoint when it has none.
  const TensorInfo& info(std::string_view name);
  std::span<const std::byte> data(std::string_view name);
  // The shard files opened so far (what a rank read).
  std::vector<std::string> opened_shards() const;

 private:
  SafetensorsFile& shard(const std::string& file);
  const std::string& shard_of(std::string_view name) const;

  std::string dir_;
  std::map<std::string, std::string, std::less<>> weight_map_;  // tensor -> shard file name
  std::map<std::string, std::unique_ptr<SafetensorsFile>, std::less<>> shards_;
};

}  // namespace moekit::checkpoint
