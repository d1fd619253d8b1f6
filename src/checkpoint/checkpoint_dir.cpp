// The checkpoint directory's index and its lazily opened shards (checkpoint_dir.h).
#include "checkpoint/checkpoint_dir.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "moekit/check.h"
#include "plan/untrusted_input.h"

namespace moekit::checkpoint {
namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// A shard name the index may give: a plain file name of this directory.
void check_shard_name(const std::string& index, const std::string& tensor, const std::string& file) {
  const bool plain = !file.empty() && file.find('/') == std::string::npos && file.find('\\') == std::string::npos &&
                     file != "." && file != ".." && file.find('\0') == std::string::npos;
  MOEKIT_CHECK(plain && file.ends_with(".safetensors"),
               "{}: tensor '{}' names shard '{}': a shard is a file name of the checkpoint's directory ending in "
               ".safetensors (no path separators)",
               index, tensor, file);
}

}  // namespace

std::map<std::string, std::string, std::less<>> parse_index(std::string_view text, const std::string& source) {
  const nlohmann::json j = plan::parse_json(text, source);
  MOEKIT_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
               "{}: needs a 'weight_map' object (tensor name -> shard file)", source);
  std::map<std::string, std::string, std::less<>> weight_map;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    MOEKIT_CHECK(it.value().is_string(), "{}: weight_map['{}'] must be a shard file name, got {}", source, it.key(),
                 plan::brief(it.value()));
    const std::string file = it.value().get<std::string>();
    check_shard_name(source, it.key(), file);
    weight_map.emplace(it.key(), file);
  }
  return weight_map;
}

CheckpointDir::CheckpointDir(const std::string& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  MOEKIT_CHECK(fs::is_directory(dir),
               "{}: not a directory (a checkpoint is a directory with config.json and "
               "model.safetensors or model.safetensors.index.json)",
               dir);
  const fs::path index = fs::path(dir) / kIndexFile;
  if (plan::path_exists(index.string())) {
    const std::string where = index.string();
    weight_map_ = parse_index(plan::read_regular_file(where, kMaxIndexBytes, "checkpoint index"), where);
    return;
  }
  const fs::path single = fs::path(dir) / kSingleFile;
  MOEKIT_CHECK(plan::path_exists(single.string()), "{}: neither {} nor {} is there", dir, kSingleFile, kIndexFile);
  SafetensorsFile& st = shard(kSingleFile);
  for (const TensorInfo& t : st.tensors()) weight_map_.emplace(t.name, kSingleFile);
}

std::vector<std::string> CheckpointDir::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(weight_map_.size());
  for (const auto& [name, file] : weight_map_) names.push_back(name);
  return names;
}

bool CheckpointDir::contains(std::string_view name) const {
  return weight_map_.find(name) != weight_map_.end();
}

const std::string& CheckpointDir::shard_of(std::string_view name) const {
  const auto it = weight_map_.find(name);
  MOEKIT_CHECK(it != weight_map_.end(), "{}: the checkpoint has no tensor '{}' ({} tensors)", dir_, name,
               weight_map_.size());
  return it->second;
}

SafetensorsFile& CheckpointDir::shard(const std::string& file) {
  auto it = shards_.find(file);
  if (it == shards_.end()) it = shards_.emplace(file, std::make_unique<SafetensorsFile>(dir_ + "/" + file)).first;
  return *it->second;
}

const TensorInfo& CheckpointDir::info(std::string_view name) {
  const std::string& file = shard_of(name);
  SafetensorsFile& st = shard(file);
  const TensorInfo* t = st.find(name);
  MOEKIT_CHECK(t != nullptr, "{}/{}: the index puts tensor '{}' in this shard, which does not hold it", dir_, file,
               name);
  return *t;
}

std::span<const std::byte> CheckpointDir::data(std::string_view name) {
  const TensorInfo& t = info(name);
  return shard(shard_of(name)).data(t);
}

const SafetensorsFile& CheckpointDir::file_of(std::string_view name) {
  return shard(shard_of(name));
}

std::string CheckpointDir::shard_path(std::string_view name) const {
  return dir_ + "/" + shard_of(name);
}

std::vector<std::string> CheckpointDir::shard_files() const {
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map_) files.insert(file);
  return {files.begin(), files.end()};
}

void CheckpointDir::open_shard(const std::string& file) {
  shard(file);
}

std::vector<std::string> CheckpointDir::opened_shards() const {
  std::vector<std::string> files;
  for (const auto& [file, st] : shards_) files.push_back(file);
  return files;
}

}  // namespace moekit::checkpoint
