// A Hugging Face checkpoint directory: config.json and the weights, one `model.safetensors` or shards
// named by `model.safetensors.index.json` (its weight_map: tensor name -> shard file). Shards are
// opened (memory-mapped, their headers checked: safetensors.h) on the first read of a tensor they
// hold, so a rank that reads only its experts maps only the shards that hold them.
//
// The index is untrusted input too: a regular file of at most kMaxIndexBytes holding valid JSON that
// names no key twice (plan/untrusted_input.h: a tensor named twice in weight_map is refused), a
// weight_map of strings, shard names that are plain file names in the directory ending in
// ".safetensors" (no path separators: the index names files of the directory only), and each tensor
// found in the shard the index names, with its header's checks. A file of the directory that is a
// symlink is followed to the regular file it names, wherever that lies (Hugging Face's cache links
// snapshots/<revision>/<file> to blobs/<hash>); a dangling symlink, a directory, a FIFO or a device
// is refused by name. Each violation is a moekit::Error naming the file and tensor.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/safetensors.h"
#include "moekit/limits.h"

namespace moekit::checkpoint {

// The index's weight_map (tensor name -> shard file name) from its text; `source` names it in errors.
std::map<std::string, std::string, std::less<>> parse_index(std::string_view text, const std::string& source);

class CheckpointDir {
 public:
  static constexpr std::int64_t kMaxIndexBytes = limits::kMaxIndexBytes;

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
  // The shard that holds the tensor (opened on first use).
  const SafetensorsFile& file_of(std::string_view name);
  // The path of the shard that holds the tensor (for messages).
  std::string shard_path(std::string_view name) const;
  // Every shard file the index names (sorted), and one of them opened (its header checked).
  std::vector<std::string> shard_files() const;
  void open_shard(const std::string& file);
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
