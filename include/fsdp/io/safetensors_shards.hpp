// Large safetensors exports split as Hugging Face's save_pretrained splits them (io layer, no LibTorch,
// no MPI): tensors in order, a new file whenever the next tensor would take the current one past the
// limit, a tensor larger than the limit in a file of its own (the current one goes on), files named
// <stem>-00001-of-0000N.safetensors beside <stem>.safetensors.index.json, whose "weight_map" names
// each tensor's file. Both exporters (fsdp-ckpt's from a checkpoint file, fsdp-train's from the
// shards of every rank) decide the split and publish the files here.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "fsdp/io/checkpoint_files.hpp"
#include "fsdp/io/safetensors_format.hpp"

namespace fsdp::safetensors {

/// The bytes of one entry's data.
inline std::int64_t data_bytes(const TensorEntry& e) { return e.numel() * element_size(e.dtype).value_or(0); }

/// The file (0-based) of each entry; every entry in file 0 when `max_bytes` <= 0. Files are numbered
/// as huggingface_hub's split_torch_state_dict_into_shards lists them: a tensor over the limit takes
/// the next number at once, a file being filled takes its number when it is full (or at the end).
inline std::vector<int> split_into_files(const std::vector<TensorEntry>& entries, std::int64_t max_bytes) {
  std::vector<int> file_of(entries.size(), 0);
  if (max_bytes <= 0) return file_of;
  int next = 0;
  std::vector<std::size_t> filling;
  std::int64_t in_file = 0;
  auto close = [&] {
    for (const auto i : filling) file_of[i] = next;
    ++next;
    filling.clear();
    in_file = 0;
  };
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::int64_t bytes = data_bytes(entries[i]);
    if (bytes > max_bytes) {
      file_of[i] = next++;
      continue;
    }
    if (in_file + bytes > max_bytes) close();
    filling.push_back(i);
    in_file += bytes;
  }
  if (!filling.empty()) close();
  return file_of;
}

/// How many files split_into_files made.
inline int count_files(const std::vector<int>& file_of) {
  int n = 1;
  for (const int f : file_of) n = std::max(n, f + 1);
  return n;
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

/// The index of a split export: {"metadata": {"total_size": data bytes, "written_by": "fsdp"},
/// "weight_map": {tensor: file}}. written_by marks the files as this program's to replace.
inline std::string index_json(const std::vector<TensorEntry>& entries, const std::vector<int>& file_of, const std::filesystem::path& target) {
  const int n = count_files(file_of);
  nlohmann::ordered_json index;
  std::int64_t total = 0;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    total += data_bytes(entries[i]);
    weight_map[entries[i].name] = shard_path(target, file_of[i], n).filename().string();
  }
  index["metadata"] = {{"total_size", total}, {"written_by", "fsdp"}};
  index["weight_map"] = weight_map;
  return index.dump(2) + "\n";
}

/// The files of the split export an fsdp index beside `target` lists (metadata.written_by "fsdp"),
/// only names shard_path gives (<stem>-NNNNN-of-NNNNN.safetensors): what a new export under the same
/// name replaces. Nothing for another program's index (a downloaded model's files are never
/// removed), an unreadable one, or none.
inline std::vector<std::filesystem::path> files_of_earlier_export(const std::filesystem::path& target) {
  std::ifstream in(index_path(target));
  if (!in) return {};
  const auto index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!index.is_object() || !index.contains("metadata") || !index["metadata"].is_object() || !index.contains("weight_map") ||
      !index["weight_map"].is_object())
    return {};
  const auto& by = index["metadata"];
  if (!by.contains("written_by") || !by["written_by"].is_string() || by["written_by"].get<std::string>() != "fsdp") return {};
  const std::string stem = target.stem().string();
  auto is_shard_name = [&](const std::string& name) {
    static const std::regex tail(R"(-\d{5}-of-\d{5}\.safetensors)");
    return name.size() > stem.size() && name.compare(0, stem.size(), stem) == 0 && std::regex_match(name.substr(stem.size()), tail);
  };
  std::vector<std::filesystem::path> files;
  for (const auto& [tensor, file] : index["weight_map"].items())
    if (file.is_string() && is_shard_name(file.get<std::string>())) {
      const auto path = target.parent_path() / file.get<std::string>();
      if (std::find(files.begin(), files.end(), path) == files.end()) files.push_back(path);
    }
  return files;
}

/// Before the files of an export of `n` files named `target` replace what is there. The earlier fsdp
/// export's files (`earlier`, files_of_earlier_export) that this one does not write again go first:
/// nothing will list them. Then a split export's old index and single file (the export's own names),
/// so that a crash while the new files are renamed into place leaves a folder no reader takes for a
/// model, never one that mixes two. A single file replaces its old self in one rename.
inline void clear_for_publishing(const std::filesystem::path& target, int n, const std::vector<std::filesystem::path>& earlier) {
  std::error_code ec;
  for (const auto& file : earlier) {
    bool rewritten = false;
    for (int k = 0; k < n && !rewritten; ++k) rewritten = shard_path(target, k, n) == file;
    if (!rewritten) std::filesystem::remove(file, ec);
  }
  if (n <= 1) return;
  std::filesystem::remove(index_path(target), ec);
  std::filesystem::remove(target, ec);
}

/// After a single-file export is in place: the earlier fsdp export's index, which lists files gone.
inline void finish_publishing(const std::filesystem::path& target, int n, const std::vector<std::filesystem::path>& earlier) {
  if (n > 1 || earlier.empty()) return;
  std::error_code ec;
  std::filesystem::remove(index_path(target), ec);
  ckpt::fsync_path(target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path());
}

}  // namespace fsdp::safetensors
