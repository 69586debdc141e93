// Sharded models to and from safetensors files (io layer). Saving: every rank computes the same header
// from the units' names and shapes, rank 0 writes it, and every rank writes the bytes of its own
// shard slices into the one file (MPI-IO, no gather), under a temporary name that rank 0 renames once
// every rank has synced. Loading: every rank reads the header and then only the byte ranges of its
// own shard slices, at any world size and strategy; the ranks agree that every read succeeded before
// any parameter changes. Peak memory: this rank's shards (staged) plus one slice.
#pragma once

#include <mpi.h>
#include <torch/torch.h>

#include <bit>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fsdp/io/checkpoint_state.hpp"
#include "fsdp/io/safetensors_format.hpp"
#include "fsdp/io/safetensors_shards.hpp"
#include "fsdp/io/tensor_naming.hpp"

namespace fsdp {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; so must the host be");

/// The safetensors dtype name of a torch dtype ("F32" for float).
inline std::string safetensors_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "F32";
    case c10::ScalarType::Half: return "F16";
    case c10::ScalarType::BFloat16: return "BF16";
    case c10::ScalarType::Double: return "F64";
    case c10::ScalarType::Long: return "I64";
    case c10::ScalarType::Int: return "I32";
    case c10::ScalarType::Short: return "I16";
    case c10::ScalarType::Char: return "I8";
    case c10::ScalarType::Byte: return "U8";
    case c10::ScalarType::Bool: return "BOOL";
    default: throw CheckpointError(std::string("safetensors cannot store tensors of dtype ") + c10::toString(t));
  }
}

/// The torch dtype of a safetensors dtype name, if LibTorch has one.
inline std::optional<c10::ScalarType> torch_dtype_of_safetensors(const std::string& dtype) {
  static const std::map<std::string, c10::ScalarType> types = {
      {"F32", c10::ScalarType::Float}, {"F16", c10::ScalarType::Half}, {"BF16", c10::ScalarType::BFloat16}, {"F64", c10::ScalarType::Double},
      {"I64", c10::ScalarType::Long},  {"I32", c10::ScalarType::Int},  {"I16", c10::ScalarType::Short},     {"I8", c10::ScalarType::Char},
      {"U8", c10::ScalarType::Byte},   {"BOOL", c10::ScalarType::Bool}};
  const auto it = types.find(dtype);
  if (it == types.end()) return std::nullopt;
  return it->second;
}

struct SafetensorsSaveOptions {
  /// Floating-point tensors are written in this dtype (bf16/fp16 exports); unset: as trained.
  std::optional<c10::ScalarType> dtype;
  /// The file's "__metadata__" (string pairs, e.g. {"format": "pt"}).
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  /// Include the model's buffers (e.g. BatchNorm statistics) as tensors.
  bool buffers = true;
  /// Names and layouts of another program (e.g. Hugging Face GPT-2's); null: the model's own.
  const TensorNaming* naming = nullptr;
  /// Deadline for the ranks to arrive together (comm.timeout_s in fsdp-train).
  double collective_timeout_s = 600;
  /// Larger exports are split into several files and an index (safetensors_shards.hpp); <= 0: one file.
  std::int64_t max_file_bytes = 0;
};

struct SafetensorsSaveResult {
  std::string path;  ///< the file, or the index of a split export
  int files = 1;
  std::int64_t bytes = 0;
  std::int64_t tensors = 0;
  double seconds = 0;
};

struct SafetensorsLoadOptions {
  /// Parameters the file may lack (they keep their values), listed in the result; otherwise a
  /// missing parameter is an error.
  bool allow_missing = false;
  /// Tensors no parameter or buffer claims are listed in the result; otherwise they are an error.
  bool allow_unexpected = false;
  /// Load buffers found in the file (by name); buffers the file lacks keep their values.
  bool buffers = true;
  /// Names and layouts of the program that wrote the file; null: the model's own.
  const TensorNaming* naming = nullptr;
  double collective_timeout_s = 600;
};

struct SafetensorsLoadResult {
  std::vector<std::string> missing;     ///< parameters not in the file (allow_missing)
  std::vector<std::string> unexpected;  ///< tensors of the file that no parameter or buffer claims
  std::int64_t bytes_read = 0;          ///< by this rank
  /// Tensors stored in a narrower floating-point type than the model's (e.g. BF16 into fp32 master
  /// weights), widened on load: "BF16 to Float" -> how many. The same on every rank.
  std::map<std::string, std::int64_t> widened;
};

namespace detail {

/// MPI's counts are int: large pieces go in chunks.
inline constexpr std::int64_t kMpiChunkBytes = std::int64_t{1} << 30;

inline void mpi_io_check(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CheckpointError(what + ": " + std::string(text, static_cast<std::size_t>(len)));
}

/// A model tensor's external form, checked against its shape.
inline std::optional<ExternalTensor> checked_external(const TensorNaming* naming, const std::string& name, const std::vector<std::int64_t>& shape) {
  auto e = external_tensor(naming, name, shape);
  if (!e) return e;
  if (e->transposed && shape.size() != 2)
    throw CheckpointError("naming '" + naming->scheme + "' transposes '" + name + "', which has " + std::to_string(shape.size()) + " dimensions");
  if (e->rows > (shape.empty() ? 0 : shape[0]))
    throw CheckpointError("naming '" + naming->scheme + "' keeps " + std::to_string(e->rows) + " rows of '" + name + "' " + shape_text(shape));
  return e;
}

/// What a save writes, in file order: every unit's parameters, then the buffers.
struct SafetensorsSavePlan {
  std::vector<safetensors::TensorEntry> entries;
  std::vector<ExternalTensor> external;                   ///< per entry
  std::vector<std::vector<std::int64_t>> entry_of_param;  ///< per unit, per parameter: entry index or -1
  std::vector<std::pair<std::string, torch::Tensor>> buffers;
  std::vector<std::int64_t> entry_of_buffer;
};

template <class Engine>
SafetensorsSavePlan plan_safetensors_save(Engine& engine, const SafetensorsSaveOptions& options) {
  SafetensorsSavePlan plan;
  auto out_dtype = [&](c10::ScalarType t) { return options.dtype && c10::isFloatingType(t) ? *options.dtype : t; };
  auto add = [&](const std::string& name, const std::vector<std::int64_t>& shape, c10::ScalarType dtype) -> std::int64_t {
    const auto e = checked_external(options.naming, name, shape);
    if (!e) return -1;
    plan.entries.push_back({e->name, safetensors_dtype(out_dtype(dtype)), external_shape(shape, *e)});
    plan.external.push_back(*e);
    return static_cast<std::int64_t>(plan.entries.size()) - 1;
  };
  for (const auto& u : engine.sharded_units()) {
    plan.entry_of_param.emplace_back();
    for (std::size_t i = 0; i < u.param_names.size(); ++i) plan.entry_of_param.back().push_back(add(u.param_names[i], u.shapes[i], u.dtype));
  }
  if (options.buffers)
    for (const auto& [name, b] : named_buffers_of(engine)) {
      plan.buffers.emplace_back(name, b);
      plan.entry_of_buffer.push_back(add(name, b.sizes().vec(), b.scalar_type()));
    }
  return plan;
}

/// `value` (a model tensor of `shape`, any layout) as the file stores it, flat.
inline torch::Tensor to_external_layout(const torch::Tensor& value, const std::vector<std::int64_t>& shape, const ExternalTensor& e) {
  auto t = value.reshape(shape);
  if (e.rows >= 0) t = t.narrow(0, 0, e.rows);
  if (e.transposed) t = t.t();
  return t.contiguous().view({-1});
}

/// A tensor read from a file (flat, external layout of a model tensor of `shape`) in the model's
/// element order: the first external_numel() flat elements of the model tensor.
inline torch::Tensor to_model_layout(const torch::Tensor& stored, const std::vector<std::int64_t>& shape, const ExternalTensor& e) {
  if (!e.transposed) return stored;
  const auto s = external_shape(shape, e);
  return stored.view({s[0], s[1]}).t().contiguous().view({-1});
}

}  // namespace detail

/// Writes the model's parameters (and buffers) to the safetensors file `path`. Each tensor once, under
/// its canonical name or `options.naming`'s (tied parameters once, as safetensors has no aliases).
/// Collective over the engine's world; on any rank's failure every rank throws CheckpointError and
/// `path` is untouched. Tensors stored as they are go from each shard straight to the file; a unit
/// with a tensor the naming transposes is gathered (one unit at a time) and each such tensor is
/// written whole by one rank of the shard group.
template <class Engine>
SafetensorsSaveResult save_safetensors(Engine& engine, const std::string& path, const SafetensorsSaveOptions& options = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  auto& world = engine.comm();
  detail::arrive_together(world, CheckpointOptions{.collective_timeout_s = options.collective_timeout_s}, "save_safetensors");
  detail::settle_shards_of(engine);
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::optional<detail::SafetensorsSavePlan> planned;
  std::optional<std::string> error = detail::capture_error([&] { planned = detail::plan_safetensors_save(engine, options); });
  detail::agree(world, error);
  auto& plan = *planned;
  // The files (one unless split): each with its own header; entry i is tensor where[i] of file file_of[i].
  const std::vector<int> file_of = safetensors::split_into_files(plan.entries, options.max_file_bytes);
  const int n_files = safetensors::count_files(file_of);
  struct OutFile {
    std::filesystem::path path, tmp;
    std::vector<safetensors::TensorEntry> entries;
    safetensors::Header layout;
    std::string header;
    MPI_File fh = MPI_FILE_NULL;
  };
  std::vector<OutFile> files(static_cast<std::size_t>(n_files));
  std::vector<std::size_t> local_of(plan.entries.size());
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    auto& f = files[static_cast<std::size_t>(file_of[i])];
    local_of[i] = f.entries.size();
    f.entries.push_back(plan.entries[i]);
  }
  std::int64_t total = 0;
  for (int k = 0; k < n_files; ++k) {
    auto& f = files[static_cast<std::size_t>(k)];
    f.path = safetensors::shard_path(target, k, n_files);
    f.tmp = dir / ckpt::temporary_name(f.path.filename().string());
    f.header = safetensors::encode_header(f.entries, options.metadata, &f.layout);
    total += f.layout.data_start + f.layout.data_bytes;
  }
  auto remove_temporaries = [&] {
    std::error_code ec;
    if (world.rank() == 0)
      for (const auto& f : files) std::filesystem::remove(f.tmp, ec);
  };

  error = detail::capture_error([&] {
    if (world.rank() != 0) return;
    std::filesystem::create_directories(dir);
    for (const auto& f : files) {
      ckpt::reserve_space(f.tmp, f.layout.data_start + f.layout.data_bytes, f.path.string());
      std::fstream out(f.tmp, std::ios::in | std::ios::out | std::ios::binary);
      out.write(f.header.data(), static_cast<std::streamsize>(f.header.size()));
      out.flush();
      if (!out) throw CheckpointError("cannot write the header of '" + f.tmp.string() + "': " + std::strerror(errno));
    }
  });
  try {
    detail::agree(world, error);
  } catch (...) {
    remove_temporaries();
    throw;
  }

  const MPI_Comm mpi = detail::mpi_handle(world);
  // MPI_File_open is collective: all ranks open the files in the same order, all or none.
  error = detail::capture_error([&] {
    for (auto& f : files)
      detail::mpi_io_check(MPI_File_open(mpi, f.tmp.c_str(), MPI_MODE_WRONLY, MPI_INFO_NULL, &f.fh), "cannot open '" + f.tmp.string() + "'");
  });
  try {
    detail::agree(world, error);
  } catch (...) {
    for (auto& f : files)
      if (f.fh != MPI_FILE_NULL) MPI_File_close(&f.fh);
    remove_temporaries();
    throw;
  }

  // Entry `idx` of the plan: its header entry and file.
  auto header_entry = [&](std::int64_t idx) -> const safetensors::TensorEntry& {
    const auto i = static_cast<std::size_t>(idx);
    return files[static_cast<std::size_t>(file_of[i])].layout.tensors[local_of[i]];
  };
  auto write_at = [&](std::int64_t idx, std::int64_t offset_in_tensor, const torch::Tensor& bytes_of) {
    const auto i = static_cast<std::size_t>(idx);
    auto& f = files[static_cast<std::size_t>(file_of[i])];
    const auto& e = f.layout.tensors[local_of[i]];
    const std::int64_t offset = f.layout.data_start + e.begin + offset_in_tensor;
    const auto* data = static_cast<const char*>(bytes_of.data_ptr());
    const std::int64_t n = bytes_of.numel() * static_cast<std::int64_t>(bytes_of.element_size());
    for (std::int64_t done = 0; done < n; done += detail::kMpiChunkBytes) {
      const int count = static_cast<int>(std::min(detail::kMpiChunkBytes, n - done));
      MPI_Status status;
      detail::mpi_io_check(MPI_File_write_at(f.fh, offset + done, data + done, count, MPI_BYTE, &status),
                           "cannot write tensor '" + e.name + "' at offset " + std::to_string(offset + done) + " of '" + f.tmp.string() + "'");
    }
  };
  // One copy of each shard is written: the first replica's.
  const bool writer = engine.replica_comm().rank() == 0;
  const auto units = engine.sharded_units();
  error = detail::capture_error([&] {
    torch::NoGradGuard no_grad;
    for (std::size_t k = 0; k < units.size(); ++k) {
      const auto& u = units[k];
      if (u.empty()) continue;
      const auto& entry_of = plan.entry_of_param[k];
      bool transposes = false;
      for (const auto idx : entry_of) transposes = transposes || (idx >= 0 && plan.external[static_cast<std::size_t>(idx)].transposed);
      // Every rank of every shard group calls gather_flat for the same units (the naming decides).
      const torch::Tensor full = transposes ? engine.gather_flat(static_cast<int>(k), u.shard).to(torch::kCPU) : torch::Tensor();
      if (!writer) continue;
      const auto shard = u.shard.detach().to(torch::kCPU).contiguous();
      for (const auto& slice : u.layout.slices(u.shard_rank)) {
        const auto idx = entry_of[static_cast<std::size_t>(slice.param_index)];
        if (idx < 0) continue;
        const auto& ext = plan.external[static_cast<std::size_t>(idx)];
        if (ext.transposed) continue;
        // Stored as is, or cut to its first rows: a prefix of the flat tensor.
        const auto kept = external_numel(u.shapes[static_cast<std::size_t>(slice.param_index)], ext);
        const auto n = std::min(slice.numel, kept - slice.param_offset);
        if (n <= 0) continue;
        const auto& e = header_entry(idx);
        const auto piece = shard.narrow(0, slice.shard_offset, n).to(*torch_dtype_of_safetensors(e.dtype)).contiguous();
        write_at(idx, slice.param_offset * static_cast<std::int64_t>(piece.element_size()), piece);
      }
      if (!transposes) continue;
      for (std::int64_t i = 0; i < u.layout.num_params(); ++i) {
        const auto idx = entry_of[static_cast<std::size_t>(i)];
        if (idx < 0 || !plan.external[static_cast<std::size_t>(idx)].transposed || i % u.layout.group_size() != u.shard_rank) continue;
        const auto& e = header_entry(idx);
        const auto value = full.narrow(0, u.layout.param_offset(i), u.layout.param_numel(i));
        write_at(idx, 0,
                 detail::to_external_layout(value, u.shapes[static_cast<std::size_t>(i)], plan.external[static_cast<std::size_t>(idx)])
                     .to(*torch_dtype_of_safetensors(e.dtype)));
      }
    }
    if (world.rank() == 0) {
      for (std::size_t b = 0; b < plan.buffers.size(); ++b) {
        const auto idx = plan.entry_of_buffer[b];
        if (idx < 0) continue;
        const auto& e = header_entry(idx);
        const auto& value = plan.buffers[b].second;
        write_at(idx, 0,
                 detail::to_external_layout(value.detach().to(torch::kCPU), value.sizes().vec(), plan.external[static_cast<std::size_t>(idx)])
                     .to(*torch_dtype_of_safetensors(e.dtype)));
      }
    }
  });
  // MPI_File_sync and MPI_File_close are collective: every rank calls them, failed or not.
  for (auto& f : files) {
    const int sync_rc = MPI_File_sync(f.fh);
    const int close_rc = MPI_File_close(&f.fh);
    if (!error)
      error = detail::capture_error([&] {
        detail::mpi_io_check(sync_rc, "cannot sync '" + f.tmp.string() + "'");
        detail::mpi_io_check(close_rc, "cannot close '" + f.tmp.string() + "'");
      });
  }
  // Whichever rank failed, the partial files go: rank 0 removes them once all agree on the failure.
  auto agree_or_remove = [&](const std::optional<std::string>& failure) {
    try {
      detail::agree(world, failure);
    } catch (...) {
      remove_temporaries();
      throw;
    }
  };
  agree_or_remove(error);

  // Every file is complete before any is renamed into place; a split export's index comes last.
  error = detail::capture_error([&] {
    if (world.rank() != 0) return;
    const auto earlier = safetensors::files_of_earlier_export(target);
    safetensors::clear_for_publishing(target, n_files, earlier);
    for (const auto& f : files) std::filesystem::rename(f.tmp, f.path);
    if (n_files > 1) write_file_atomically(safetensors::index_path(target), safetensors::index_json(plan.entries, file_of, target));
    safetensors::finish_publishing(target, n_files, earlier);
  });
  agree_or_remove(error);
  SafetensorsSaveResult result;
  result.path = n_files > 1 ? safetensors::index_path(target).string() : path;
  result.files = n_files;
  result.bytes = total;
  result.tensors = static_cast<std::int64_t>(plan.entries.size());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

namespace detail {

/// Bytes [offset, offset + n) of `in` as a tensor of `dtype` (n a multiple of its size).
inline torch::Tensor read_bytes(std::ifstream& in, const std::string& path, std::int64_t offset, std::int64_t n, c10::ScalarType dtype,
                                const std::string& name) {
  auto t = torch::empty({n / static_cast<std::int64_t>(c10::elementSize(dtype))}, torch::TensorOptions().dtype(dtype));
  in.clear();
  in.seekg(offset);
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(n));
  if (!in)
    throw CheckpointError("safetensors file '" + path + "': cannot read tensor '" + name + "' (" + std::to_string(n) + " bytes at offset " +
                          std::to_string(offset) + ")");
  return t;
}

/// A model tensor's place in a safetensors source.
struct SourceTensor {
  safetensors::Source::Found found;
  ExternalTensor external;
};

}  // namespace detail

/// Loads parameters (and buffers) from safetensors into the model: `path` is a file, a
/// model.safetensors.index.json, or a folder with either (safetensors::open_source). Each rank reads
/// only the bytes of its own shard slices (a tensor the naming transposes is read whole, one at a
/// time). Every parameter must be in the file with its shape (a tied parameter under any of its
/// names), in a dtype it can be cast from; problems are listed in one CheckpointError on every rank,
/// and nothing changes. Rows a naming does not store (vocabulary padding) keep their values.
/// Optimizer state is not touched. Collective.
template <class Engine>
SafetensorsLoadResult load_safetensors(Engine& engine, const std::string& path, const SafetensorsLoadOptions& options = {}) {
  auto& world = engine.comm();
  detail::arrive_together(world, CheckpointOptions{.collective_timeout_s = options.collective_timeout_s}, "load_safetensors");
  SafetensorsLoadResult result;
  std::vector<torch::Tensor> staged_shards;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> staged_buffers;  // live, new value (model layout, flat)
  const auto units = engine.sharded_units();
  const auto error = detail::capture_error([&] {
    const auto source = safetensors::open_source(path);
    std::map<std::string, std::ifstream> streams;
    auto read = [&](const detail::SourceTensor& t, std::int64_t offset, std::int64_t n, c10::ScalarType dtype) {
      auto& in = streams[t.found.file->path];
      if (!in.is_open()) {
        in.open(t.found.file->path, std::ios::binary);
        if (!in) throw CheckpointError("cannot open safetensors file '" + t.found.file->path + "'");
      }
      result.bytes_read += n;
      return detail::read_bytes(in, t.found.file->path, t.found.file->header.data_start + t.found.entry->begin + offset, n, dtype,
                                t.found.entry->name);
    };
    std::set<std::string> claimed;
    std::vector<std::string> problems;
    // The file's tensor for model tensor `name` (a tied parameter under any of its names), checked.
    auto entry_of = [&](const std::string& name, const std::vector<std::int64_t>& shape, c10::ScalarType into,
                        bool parameter) -> std::optional<detail::SourceTensor> {
      std::vector<std::string> names{name};
      if (const auto aliases = engine.tied_parameter_aliases().find(name); aliases != engine.tied_parameter_aliases().end())
        names.insert(names.end(), aliases->second.begin(), aliases->second.end());
      std::optional<detail::SourceTensor> hit;
      std::string wanted;
      for (const auto& n : names) {
        const auto e = detail::checked_external(options.naming, n, shape);
        if (!e) continue;
        if (wanted.empty()) wanted = e->name;
        std::vector<std::string> candidates{e->name};
        candidates.insert(candidates.end(), e->aliases.begin(), e->aliases.end());
        for (const auto& c : candidates)
          if (const auto f = source.find(c); f && !hit) hit = detail::SourceTensor{*f, *e};
        if (hit) break;
      }
      if (!hit) {
        if (parameter) {
          if (!options.allow_missing)
            problems.push_back("parameter '" + name + "' is missing" + (wanted.empty() || wanted == name ? "" : " (as '" + wanted + "')"));
          result.missing.push_back(name);
        }
        return std::nullopt;
      }
      const auto* e = hit->found.entry;
      claimed.insert(e->name);
      const auto dtype = torch_dtype_of_safetensors(e->dtype);
      if (const auto expected = external_shape(shape, hit->external); e->shape != expected) {
        problems.push_back("tensor '" + e->name + "': shape " + detail::shape_text(e->shape) + " in the file, " + detail::shape_text(expected) +
                           " expected for '" + name + "' " + detail::shape_text(shape));
        return std::nullopt;
      }
      if (!dtype || c10::isFloatingType(*dtype) != c10::isFloatingType(into)) {
        problems.push_back("tensor '" + e->name + "': dtype " + e->dtype + " cannot be loaded into " + c10::toString(into));
        return std::nullopt;
      }
      if (c10::isFloatingType(*dtype) && c10::elementSize(*dtype) < c10::elementSize(into)) ++result.widened[e->dtype + " to " + c10::toString(into)];
      return hit;
    };
    std::vector<std::vector<std::optional<detail::SourceTensor>>> found(units.size());
    for (std::size_t k = 0; k < units.size(); ++k)
      for (std::size_t i = 0; i < units[k].param_names.size(); ++i)
        found[k].push_back(entry_of(units[k].param_names[i], units[k].shapes[i], units[k].dtype, true));
    std::vector<std::pair<torch::Tensor, detail::SourceTensor>> buffer_entries;
    if (options.buffers)
      for (const auto& b : engine.module()->named_buffers(/*recurse=*/true))
        if (b.value().defined())
          if (auto e = entry_of(b.key(), b.value().sizes().vec(), b.value().scalar_type(), false)) buffer_entries.emplace_back(b.value(), *e);
    for (const auto& name : source.names())
      if (!claimed.count(name) && !(options.naming && options.naming->ignorable && options.naming->ignorable(name)))
        result.unexpected.push_back(name);
    if (!options.allow_unexpected)
      for (const auto& name : result.unexpected) problems.push_back("unexpected tensor '" + name + "' (no parameter or buffer of the model)");
    if (!problems.empty()) throw CheckpointError(detail::mismatch_message(source.description, problems), detail::kMismatchId);

    torch::NoGradGuard no_grad;
    for (std::size_t k = 0; k < units.size(); ++k) {
      const auto& u = units[k];
      if (u.empty()) {
        staged_shards.emplace_back();
        continue;
      }
      auto staged = u.shard.detach().to(torch::kCPU).clone();
      for (const auto& slice : u.layout.slices(u.shard_rank)) {
        const auto& t = found[k][static_cast<std::size_t>(slice.param_index)];
        if (!t) continue;  // allowed missing: keeps its value
        const auto& shape = u.shapes[static_cast<std::size_t>(slice.param_index)];
        const auto n = std::min(slice.numel, external_numel(shape, t->external) - slice.param_offset);
        if (n <= 0) continue;  // rows the file does not store keep their values
        const auto dtype = *torch_dtype_of_safetensors(t->found.entry->dtype);
        const auto esize = static_cast<std::int64_t>(c10::elementSize(dtype));
        const auto piece = t->external.transposed
                               ? detail::to_model_layout(read(*t, 0, t->found.entry->end - t->found.entry->begin, dtype), shape, t->external)
                                     .narrow(0, slice.param_offset, n)
                               : read(*t, slice.param_offset * esize, n * esize, dtype);
        staged.narrow(0, slice.shard_offset, n).copy_(piece);
      }
      staged_shards.push_back(staged);
    }
    for (const auto& [live, t] : buffer_entries) {
      const auto dtype = *torch_dtype_of_safetensors(t.found.entry->dtype);
      staged_buffers.emplace_back(
          live, detail::to_model_layout(read(t, 0, t.found.entry->end - t.found.entry->begin, dtype), live.sizes().vec(), t.external));
    }
  });
  detail::agree(world, error);
  torch::NoGradGuard no_grad;
  for (std::size_t k = 0; k < units.size(); ++k)
    if (!units[k].empty()) units[k].shard.detach().copy_(staged_shards[k]);  // bumps the version: gathered copies are refreshed
  for (auto& [live, value] : staged_buffers) live.view({-1}).narrow(0, 0, value.numel()).copy_(value);
  return result;
}

}  // namespace fsdp
