// Large safetensors exports split as Hugging Face's save_pretrained splits them (io layer, no LibTorch,
// no MPI): tensors in order, a new file whenever the next tensor would take the current one past the
// limit (a tensor larger than the limit alone in its file), files named
// <stem>-00001-of-0000N.safetensors beside <stem>.safetensors.index.json, whose "weight_map" names
// each tensor's file. Both exporters (fsdp-ckpt's from a checkpoint file, fsdp-train's from the
// shards of every rank) decide the split and publish the files here.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "fsdp/io/checkpoint_files.hpp"
#include "fsdp/io/safetensors_format.hpp"

namespace fsdp::safetensors {

/// save_pretrained's default max_shard_size: 5 GB (decimal, as transformers counts).
inline constexpr std::int64_t kDefaultMaxShardBytes = 5'000'000'000;

/// The bytes of one entry's data.
inline std::int64_t data_bytes(const TensorEntry& e) { return e.numel() * element_size(e.dtype).value_or(0); }

/// The file (0-based) of each entry, in order; every entry in file 0 when `max_bytes` <= 0.
inline std::vector<int> split_into_files(const std::vector<TensorEntry>& entries, std::int64_t max_bytes) {
  std::vector<int> file_of;
  int file = 0;
  std::int64_t in_file = 0;
  for (const auto& e : entries) {
    const std::int64_t bytes = data_bytes(e);
    if (max_bytes > 0 && in_file > 0 && in_file + bytes > max_bytes) {
      ++file;
      in_file = 0;
    }
    file_of.push_back(file);
    in_file += bytes;
  }
  return file_of;
}

/// File `k` (0-based) of `n` for the export named `target` (".../model.safetensors"): `target` itself
/// when n is 1, else ".../model-0000k+1-of-0000n.safetensors".
inline std::filesystem::path shard_path(const std::filesystem::path& target, int k, int n) {
  if (n <= 1) return target;
  char tail[48];
  std::snprintf(tail, sizeof tail, "-%05d-of-%05d.safetensors", k + 1, n);
  return target.parent_path() / (target.stem().string() + tail);
}

/// The index beside a split export: ".../model.safetensors.index.json".
inline std::filesystem::path index_path(const std::filesystem::path& target) {
  return target.parent_path() / (target.filename().string() + ".index.json");
}

/// The index of a split export: {"metadata": {"total_size": data bytes}, "weight_map": {tensor: file}}.
inline std::string index_json(const std::vector<TensorEntry>& entries, const std::vector<int>& file_of, const std::filesystem::path& target) {
  const int n = file_of.empty() ? 1 : file_of.back() + 1;
  nlohmann::ordered_json index;
  std::int64_t total = 0;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    total += data_bytes(entries[i]);
    weight_map[entries[i].name] = shard_path(target, file_of[i], n).filename().string();
  }
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = weight_map;
  return index.dump(2) + "\n";
}

/// Before the files of an export of `n` files named `target` replace what is there: a split export's
/// old index and single file go first, so that a crash while the new files are renamed into place
/// leaves a folder no reader takes for a model, never one that mixes two. A single file replaces its
/// old self in one rename and needs nothing removed first.
inline void clear_for_publishing(const std::filesystem::path& target, int n) {
  if (n <= 1) return;
  std::error_code ec;
  std::filesystem::remove(index_path(target), ec);
  std::filesystem::remove(target, ec);
}

/// After an export of `n` files named `target` is in place (and its index, if split): the files of
/// an earlier export under the same name with another split, and a stale index, are removed.
inline void remove_stale_files(const std::filesystem::path& target, int n) {
  const auto dir = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  const std::regex split(std::regex_replace(target.stem().string(), std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)") +
                         R"(-(\d{5})-of-(\d{5})\.safetensors)");
  std::error_code ec;
  if (n <= 1) std::filesystem::remove(index_path(target), ec);
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, m, split)) continue;
    if (n > 1 && std::stoi(m[2].str()) == n && std::stoi(m[1].str()) <= n) continue;  // one of this export's
    std::filesystem::remove(entry.path(), ec);
  }
  ckpt::fsync_path(dir);
}

}  // namespace fsdp::safetensors
