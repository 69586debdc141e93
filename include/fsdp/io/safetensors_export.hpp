// A checkpoint's model tensors as a safetensors file (io layer, HDF5 only: no LibTorch, no MPI): the
// seed guides' merge-weights, behind `fsdp-ckpt export`. FULL and SHARDED files hold every tensor in
// its logical shape, so they stream tensor by tensor (memory: one chunk); a LOCAL folder is merged
// into a FULL file first.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/comm/detail/reduce.hpp"
#include "fsdp/io/checkpoint_files.hpp"
#include "fsdp/io/checkpoint_tools.hpp"
#include "fsdp/io/h5.hpp"
#include "fsdp/io/h5_flat_range.hpp"
#include "fsdp/io/safetensors_format.hpp"
#include "fsdp/io/safetensors_shards.hpp"
#include "fsdp/io/tensor_naming.hpp"

namespace fsdp::ckpt {

struct ExportOptions {
  /// Floating-point tensors are written as "fp32", "bf16" or "fp16"; empty: as stored.
  std::string dtype;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  /// Names and layouts of another program (e.g. Hugging Face GPT-2's); null: the model's own.
  const TensorNaming* naming = nullptr;
  /// Larger exports are split into several files and an index (safetensors_shards.hpp); <= 0: one file.
  std::int64_t max_file_bytes = 0;
};

struct ExportResult {
  std::string path;  ///< the file, or the index of a split export
  std::int64_t tensors = 0;
  std::int64_t bytes = 0;
  int files = 1;
};

namespace detail {

inline std::string safetensors_dtype_of(h5::ElementType t) {
  switch (t) {
    case h5::ElementType::kFloat32: return "F32";
    case h5::ElementType::kFloat64: return "F64";
    case h5::ElementType::kFloat16: return "F16";
    case h5::ElementType::kBFloat16: return "BF16";
    case h5::ElementType::kInt64: return "I64";
    case h5::ElementType::kInt32: return "I32";
    case h5::ElementType::kUInt8: return "U8";
    case h5::ElementType::kBool: return "BOOL";
  }
  return "?";
}

inline bool is_floating(h5::ElementType t) {
  return t == h5::ElementType::kFloat32 || t == h5::ElementType::kFloat64 || t == h5::ElementType::kFloat16 || t == h5::ElementType::kBFloat16;
}

/// Element `i` of a buffer of `t` as a double, and back.
inline double load_as_double(const char* data, std::int64_t i, h5::ElementType t) {
  switch (t) {
    case h5::ElementType::kFloat32: {
      float v;
      std::memcpy(&v, data + i * 4, 4);
      return v;
    }
    case h5::ElementType::kFloat64: {
      double v;
      std::memcpy(&v, data + i * 8, 8);
      return v;
    }
    case h5::ElementType::kFloat16:
    case h5::ElementType::kBFloat16: {
      std::uint16_t bits;
      std::memcpy(&bits, data + i * 2, 2);
      return t == h5::ElementType::kFloat16 ? fsdp::detail::f16_to_float(bits) : fsdp::detail::bf16_to_float(bits);
    }
    default: return 0;
  }
}
inline void store_from_double(char* data, std::int64_t i, double v, h5::ElementType t) {
  switch (t) {
    case h5::ElementType::kFloat32: {
      const float f = static_cast<float>(v);
      std::memcpy(data + i * 4, &f, 4);
      return;
    }
    case h5::ElementType::kFloat64: std::memcpy(data + i * 8, &v, 8); return;
    case h5::ElementType::kFloat16:
    case h5::ElementType::kBFloat16: {
      const float f = static_cast<float>(v);
      const std::uint16_t bits = t == h5::ElementType::kFloat16 ? fsdp::detail::float_to_f16(f) : fsdp::detail::float_to_bf16(f);
      std::memcpy(data + i * 2, &bits, 2);
      return;
    }
    default: return;
  }
}

inline std::optional<h5::ElementType> export_type(const std::string& dtype) {
  if (dtype.empty()) return std::nullopt;
  if (dtype == "fp32") return h5::ElementType::kFloat32;
  if (dtype == "bf16") return h5::ElementType::kBFloat16;
  if (dtype == "fp16") return h5::ElementType::kFloat16;
  throw ConfigError("export dtype must be fp32, bf16 or fp16, got '" + dtype + "'");
}

}  // namespace detail

/// Writes the model tensors (/model/*) of the FULL or SHARDED checkpoint file `checkpoint` to the
/// safetensors file `out`, under their parameter and buffer names; a tied tensor once, under one of
/// its names. Written under a temporary name, fsynced, renamed. Throws CheckpointError naming the file
/// and dataset.
inline ExportResult export_safetensors(const std::string& checkpoint, const std::string& out, const ExportOptions& options = {}) {
  const auto target_type = detail::export_type(options.dtype);
  if (std::filesystem::is_directory(checkpoint)) {
    // LOCAL: merge the rank files into one FULL file next to the output, export it, remove it.
    const std::filesystem::path merged =
        std::filesystem::path(out).parent_path() / ("." + std::filesystem::path(out).filename().string() + ".merged.h5");
    if (merged.has_parent_path()) std::filesystem::create_directories(merged.parent_path());
    merge_local(checkpoint, merged.string());
    try {
      auto result = export_safetensors(merged.string(), out, options);
      std::filesystem::remove(merged);
      return result;
    } catch (...) {
      std::error_code ec;
      std::filesystem::remove(merged, ec);
      throw;
    }
  }
  const auto info = inspect_file(checkpoint);
  h5::Id file = h5::open_file_readonly(checkpoint);
  const std::string where = "checkpoint '" + checkpoint + "'";
  struct Source {
    std::string dataset;
    std::vector<std::int64_t> shape;  ///< in the model
    ExternalTensor external;
    h5::ElementType stored;
    h5::ElementType written;
  };
  std::vector<safetensors::TensorEntry> entries;
  std::vector<Source> sources;
  for (const auto& t : info.tensors) {
    if (t.path.rfind("/model/", 0) != 0) continue;
    h5::Id ds = h5::open_dataset(file, t.path, checkpoint);
    const auto stored = h5::stored_element_type(ds, where + " " + t.path);
    const auto written = target_type && detail::is_floating(stored) ? *target_type : stored;
    const auto external = external_tensor(options.naming, t.path.substr(7), t.shape);
    if (!external) continue;  // the naming does not store it
    if (external->transposed && t.shape.size() != 2)
      throw CheckpointError(where + ": naming '" + options.naming->scheme + "' transposes " + t.path + ", which is not a matrix");
    entries.push_back({external->name, detail::safetensors_dtype_of(written), external_shape(t.shape, *external)});
    sources.push_back({t.path, t.shape, *external, stored, written});
  }
  if (entries.empty()) throw CheckpointError(where + " has no model tensors (/model) to export");
  const std::vector<int> file_of = safetensors::split_into_files(entries, options.max_file_bytes);
  const int n_files = safetensors::count_files(file_of);
  const std::filesystem::path target(out);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::filesystem::create_directories(dir);

  // Each file is written whole under a temporary name and fsynced before any is renamed into place.
  std::vector<std::filesystem::path> temporaries, earlier;
  std::int64_t total_bytes = 0;
  auto remove_temporaries = [&] {
    std::error_code ec;
    for (const auto& t : temporaries) std::filesystem::remove(t, ec);
  };
  try {
    for (int f = 0; f < n_files; ++f) {
      std::vector<std::size_t> members;
      std::vector<safetensors::TensorEntry> file_entries;
      for (std::size_t k = 0; k < entries.size(); ++k)
        if (file_of[k] == f) {
          members.push_back(k);
          file_entries.push_back(entries[k]);
        }
      safetensors::Header layout;
      const std::string header = safetensors::encode_header(file_entries, options.metadata, &layout);
      const auto path = safetensors::shard_path(target, f, n_files);
      temporaries.push_back(dir / temporary_name(path.filename().string()));
      const auto& tmp = temporaries.back();
      reserve_space(tmp, layout.data_start + layout.data_bytes, path.string());
      total_bytes += layout.data_start + layout.data_bytes;
      std::fstream o(tmp, std::ios::in | std::ios::out | std::ios::binary);
      o.write(header.data(), static_cast<std::streamsize>(header.size()));
      constexpr std::int64_t kChunk = std::int64_t{1} << 22;  // elements read and written at a time
      std::vector<char> in_buf, out_buf;
      for (std::size_t m = 0; m < members.size(); ++m) {
        const auto& e = file_entries[m];
        const auto& s = sources[members[m]];
        h5::Id ds = h5::open_dataset(file, s.dataset, checkpoint);
        const std::int64_t n = e.numel();  // a prefix of the model tensor's elements (its first rows)
        const std::size_t in_size = h5::element_size(s.stored), out_size = h5::element_size(s.written);
        if (s.external.transposed) {
          // A transposed tensor is read whole (one tensor, not the model) and written column by column.
          const std::int64_t rows = e.shape[1], cols = e.shape[0];  // of the model's [rows, cols] prefix
          in_buf.resize(static_cast<std::size_t>(n) * in_size);
          h5::read_flat_range(ds, s.shape, 0, n, s.stored, in_buf.data(), where + " dataset " + s.dataset);
          out_buf.resize(static_cast<std::size_t>(n) * out_size);
          for (std::int64_t c = 0; c < cols; ++c)
            for (std::int64_t r = 0; r < rows; ++r) {
              const std::int64_t from = r * cols + c, to = c * rows + r;
              if (s.written == s.stored)
                std::memcpy(out_buf.data() + to * out_size, in_buf.data() + from * in_size, in_size);
              else
                detail::store_from_double(out_buf.data(), to, detail::load_as_double(in_buf.data(), from, s.stored), s.written);
            }
          o.write(out_buf.data(), static_cast<std::streamsize>(n * static_cast<std::int64_t>(out_size)));
          continue;
        }
        for (std::int64_t begin = 0; begin < n; begin += kChunk) {
          const std::int64_t count = std::min(kChunk, n - begin);
          in_buf.resize(static_cast<std::size_t>(count) * in_size);
          h5::read_flat_range(ds, s.shape, begin, begin + count, s.stored, in_buf.data(), where + " dataset " + s.dataset);
          const char* bytes = in_buf.data();
          if (s.written != s.stored) {
            out_buf.resize(static_cast<std::size_t>(count) * out_size);
            for (std::int64_t i = 0; i < count; ++i)
              detail::store_from_double(out_buf.data(), i, detail::load_as_double(in_buf.data(), i, s.stored), s.written);
            bytes = out_buf.data();
          }
          o.write(bytes, static_cast<std::streamsize>(count * static_cast<std::int64_t>(out_size)));
        }
      }
      o.flush();
      if (!o) throw CheckpointError("cannot write '" + tmp.string() + "': " + std::strerror(errno));
      o.close();
      fsync_path(tmp);
    }
    earlier = safetensors::files_of_earlier_export(target);
    safetensors::clear_for_publishing(target, n_files, earlier);
    for (int f = 0; f < n_files; ++f) {
      const auto path = safetensors::shard_path(target, f, n_files);
      std::error_code ec;
      std::filesystem::rename(temporaries[static_cast<std::size_t>(f)], path, ec);
      if (ec)
        throw CheckpointError("cannot rename '" + temporaries[static_cast<std::size_t>(f)].string() + "' to '" + path.string() +
                              "': " + ec.message());
    }
  } catch (...) {
    remove_temporaries();
    throw;
  }
  if (n_files > 1) write_file_atomically(safetensors::index_path(target), safetensors::index_json(entries, file_of, target));
  safetensors::finish_publishing(target, n_files, earlier);
  const std::string published = n_files > 1 ? safetensors::index_path(target).string() : out;
  return {published, static_cast<std::int64_t>(entries.size()), total_bytes, n_files};
}

}  // namespace fsdp::ckpt
