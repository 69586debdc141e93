// The safetensors format (io layer, no LibTorch, no MPI): an 8-byte little-endian header length N,
// N bytes of UTF-8 JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the end of the header) plus an optional "__metadata__" of string pairs, then
// the raw little-endian row-major bytes. This file encodes and validates headers; who writes which
// bytes is io/safetensors.hpp's business.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/errors.hpp"

namespace fsdp::safetensors {

/// Bytes per element of a safetensors dtype name ("F32" -> 4); nothing for an unknown name.
inline std::optional<std::int64_t> element_size(const std::string& dtype) {
  static const std::map<std::string, std::int64_t> sizes = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
                                                            {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
                                                            {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  const auto it = sizes.find(dtype);
  if (it == sizes.end()) return std::nullopt;
  return it->second;
}

/// The largest header we accept (the reference implementation's limit).
inline constexpr std::int64_t kMaxHeaderBytes = std::int64_t{100} << 20;

/// One tensor's entry in the header.
struct TensorEntry {
  std::string name;
  std::string dtype;  ///< "F32", "BF16", ...
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0;  ///< byte offsets into the data section, [begin, end)
  std::int64_t end = 0;
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

/// A parsed and checked header: tensors in data order, the metadata, and where the data starts.
struct Header {
  std::vector<TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
  std::int64_t data_start = 0;  ///< 8 + N: the file offset of data_offsets 0
  std::int64_t data_bytes = 0;  ///< the data section's size
  const TensorEntry* find(const std::string& name) const {
    for (const auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
};

/// Lays `tensors` out back to back in the given order (their begin/end are set) and returns the
/// header bytes to write at offset 0: the length, then the JSON padded with spaces so that the data
/// starts at a multiple of 8 bytes.
inline std::string encode_header(std::vector<TensorEntry>& tensors, const std::map<std::string, std::string>& metadata, Header* layout = nullptr) {
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  if (!metadata.empty()) json["__metadata__"] = metadata;
  std::int64_t offset = 0;
  for (auto& t : tensors) {
    const auto size = element_size(t.dtype);
    if (!size) throw ConfigError("safetensors: tensor '" + t.name + "' has unknown dtype '" + t.dtype + "'");
    t.begin = offset;
    t.end = offset + t.numel() * *size;
    offset = t.end;
    json[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = json.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  std::string out(8, '\0');
  const std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  if (layout) {
    layout->tensors = tensors;
    layout->metadata = metadata;
    layout->data_start = static_cast<std::int64_t>(8 + n);
    layout->data_bytes = offset;
  }
  return out + text;
}

/// Parses and checks the header of a safetensors file of `file_bytes` bytes whose first bytes are
/// `prefix` (at least 8; then at least 8 + N). Every problem names the file `path` and, where there
/// is one, the tensor and the byte offset. Throws CheckpointError.
inline Header parse_header(const std::string& prefix, std::int64_t file_bytes, const std::string& path) {
  const std::string where = "safetensors file '" + path + "'";
  if (file_bytes < 8 || prefix.size() < 8)
    throw CheckpointError(where + ": " + std::to_string(file_bytes) + " bytes, too short for the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[static_cast<std::size_t>(i)]);
  if (n > static_cast<std::uint64_t>(kMaxHeaderBytes) || static_cast<std::int64_t>(n) > file_bytes - 8)
    throw CheckpointError(where + ": header length " + std::to_string(n) + " at offset 0 exceeds the file (" + std::to_string(file_bytes) +
                          " bytes) or the 100 MiB limit");
  if (prefix.size() < 8 + n) throw CheckpointError(where + ": header of " + std::to_string(n) + " bytes not read whole");
  Header h;
  h.data_start = static_cast<std::int64_t>(8 + n);
  h.data_bytes = file_bytes - h.data_start;
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(prefix.begin() + 8, prefix.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(where + ": the header (bytes 8.." + std::to_string(8 + n) + ") is not valid JSON: " + e.what());
  }
  if (!json.is_object()) throw CheckpointError(where + ": the header is not a JSON object");
  for (const auto& [name, value] : json.items()) {
    const std::string tensor = where + ": tensor '" + name + "'";
    if (name == "__metadata__") {
      if (!value.is_object()) throw CheckpointError(where + ": __metadata__ is not an object of strings");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) throw CheckpointError(where + ": __metadata__ value of '" + k + "' is not a string");
        h.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    TensorEntry t;
    t.name = name;
    try {
      t.dtype = value.at("dtype").get<std::string>();
      t.shape = value.at("shape").get<std::vector<std::int64_t>>();
      const auto offsets = value.at("data_offsets").get<std::vector<std::int64_t>>();
      if (offsets.size() != 2) throw CheckpointError(tensor + ": data_offsets must have two entries");
      t.begin = offsets[0];
      t.end = offsets[1];
    } catch (const nlohmann::json::exception& e) {
      throw CheckpointError(tensor + ": malformed entry (needs dtype, shape and data_offsets): " + e.what());
    }
    const auto size = element_size(t.dtype);
    if (!size) throw CheckpointError(tensor + ": unknown dtype '" + t.dtype + "'");
    for (auto d : t.shape)
      if (d < 0) throw CheckpointError(tensor + ": negative dimension in its shape");
    if (t.begin < 0 || t.end < t.begin || t.end > h.data_bytes)
      throw CheckpointError(tensor + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + ") outside the data section of " +
                            std::to_string(h.data_bytes) + " bytes (file offset " + std::to_string(h.data_start + t.begin) + ")");
    if (t.end - t.begin != t.numel() * *size)
      throw CheckpointError(tensor + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + ") hold " +
                            std::to_string(t.end - t.begin) + " bytes, its shape and dtype need " + std::to_string(t.numel() * *size));
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) { return a.begin < b.begin; });
  std::int64_t expected = 0;
  for (const auto& t : h.tensors) {
    if (t.begin != expected)
      throw CheckpointError(where + ": tensor '" + t.name + "' starts at data offset " + std::to_string(t.begin) + ", expected " +
                            std::to_string(expected) + " (tensors must cover the data section without gaps or overlaps)");
    expected = t.end;
  }
  if (expected != h.data_bytes)
    throw CheckpointError(where + ": the tensors end at data offset " + std::to_string(expected) + " but the data section has " +
                          std::to_string(h.data_bytes) + " bytes");
  return h;
}

/// Reads and checks the header of the file at `path` (only the header's bytes are read).
inline Header read_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw CheckpointError("cannot open safetensors file '" + path + "': " + std::strerror(errno));
  const std::int64_t size = static_cast<std::int64_t>(in.tellg());
  in.seekg(0);
  std::string prefix(static_cast<std::size_t>(std::min<std::int64_t>(size, 8)), '\0');
  in.read(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  if (prefix.size() == 8) {
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[static_cast<std::size_t>(i)]);
    if (n <= static_cast<std::uint64_t>(kMaxHeaderBytes) && static_cast<std::int64_t>(n) <= size - 8) {
      prefix.resize(8 + n);
      in.read(prefix.data() + 8, static_cast<std::streamsize>(n));
      if (!in) throw CheckpointError("cannot read the header of safetensors file '" + path + "'");
    }
  }
  return parse_header(prefix, size, path);
}

/// The tensors of one model stored as safetensors: one file, or the files of a Hugging Face
/// `model.safetensors.index.json` (its "weight_map" names the file of each tensor).
struct Source {
  struct File {
    std::string path;
    Header header;
  };
  struct Found {
    const File* file = nullptr;
    const TensorEntry* entry = nullptr;
  };
  std::string description;  ///< for messages: the file, or the index and its folder
  std::vector<File> files;

  /// The tensor `name`, in whichever file holds it.
  std::optional<Found> find(const std::string& name) const {
    for (const auto& f : files)
      if (const auto* e = f.header.find(name)) return Found{&f, e};
    return std::nullopt;
  }
  /// Every tensor name, in file order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& f : files)
      for (const auto& t : f.header.tensors) out.push_back(t.name);
    return out;
  }
};

/// Opens `path`: a .safetensors file, a model.safetensors.index.json, or a folder holding either
/// (model.safetensors first). Reads only headers. Throws CheckpointError naming what is wrong: a folder
/// with neither file, an index that does not parse or names a missing file, a tensor the index places
/// in a file that lacks it, or a tensor held by two files.
inline Source open_source(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  if (fs::is_directory(p)) {
    if (fs::exists(p / "model.safetensors"))
      p /= "model.safetensors";
    else if (fs::exists(p / "model.safetensors.index.json"))
      p /= "model.safetensors.index.json";
    else
      throw CheckpointError("folder '" + path + "' holds neither model.safetensors nor model.safetensors.index.json");
  }
  Source source;
  const std::string name = p.filename().string();
  if (name.size() < 11 || name.compare(name.size() - 11, 11, ".index.json") != 0) {
    source.description = "safetensors file '" + p.string() + "'";
    source.files.push_back({p.string(), read_header(p.string())});
    return source;
  }
  source.description = "safetensors index '" + p.string() + "'";
  std::ifstream in(p);
  if (!in) throw CheckpointError("cannot open safetensors index '" + p.string() + "': " + std::strerror(errno));
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(source.description + " is not JSON: " + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw CheckpointError(source.description + " has no \"weight_map\" object");
  std::map<std::string, std::vector<std::string>> tensors_of_file;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!file.is_string()) throw CheckpointError(source.description + ": the file of tensor '" + tensor + "' is not a string");
    tensors_of_file[file.get<std::string>()].push_back(tensor);
  }
  for (const auto& [file, tensors] : tensors_of_file) {
    const fs::path f = p.parent_path() / file;
    source.files.push_back({f.string(), read_header(f.string())});
    for (const auto& t : tensors)
      if (!source.files.back().header.find(t))
        throw CheckpointError(source.description + " places tensor '" + t + "' in '" + f.string() + "', which does not hold it");
  }
  std::map<std::string, std::string> holder;
  for (const auto& f : source.files)
    for (const auto& t : f.header.tensors)
      if (const auto [it, fresh] = holder.emplace(t.name, f.path); !fresh)
        throw CheckpointError(source.description + ": tensor '" + t.name + "' is in both '" + it->second + "' and '" + f.path + "'");
  return source;
}

}  // namespace fsdp::safetensors
