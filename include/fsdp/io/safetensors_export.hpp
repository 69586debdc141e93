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
#include "fsdp/io/tensor_naming.hpp"

namespace fsdp::ckpt {

struct ExportOptions {
  /// Floating-point tensors are written as "fp32", "bf16" or "fp16"; empty: as stored.
  std::string dtype;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  /// Names and layouts of another program (e.g. Hugging Face GPT-2's); null: the model's own.
  const TensorNaming* naming = nullptr;
};

struct ExportResult {
  std::string path;
  std::int64_t tensors = 0;
  std::int64_t bytes = 0;
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
  safetensors::Header layout;
  const std::string header = safetensors::encode_header(entries, options.metadata, &layout);

  const std::filesystem::path target(out);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  const std::filesystem::path tmp = dir / temporary_name(target.filename().string());
  std::filesystem::create_directories(dir);
  reserve_space(tmp, layout.data_start + layout.data_bytes, out);
  try {
    std::fstream o(tmp, std::ios::in | std::ios::out | std::ios::binary);
    o.write(header.data(), static_cast<std::streamsize>(header.size()));
    constexpr std::int64_t kChunk = std::int64_t{1} << 22;  // elements read and written at a time
    std::vector<char> in_buf, out_buf;
    for (std::size_t k = 0; k < entries.size(); ++k) {
      const auto& e = entries[k];
      const auto& s = sources[k];
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
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw;
  }
  fsync_path(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, target, ec);
  if (ec) throw CheckpointError("cannot rename '" + tmp.string() + "' to '" + out + "': " + ec.message());
  fsync_path(dir);
  return {out, static_cast<std::int64_t>(entries.size()), layout.data_start + layout.data_bytes};
}

}  // namespace fsdp::ckpt
