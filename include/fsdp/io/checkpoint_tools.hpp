// Offline checkpoint tools behind `fsdp-ckpt` (io layer, HDF5 only: no LibTorch, no MPI calls):
// inspect, verify, merge a LOCAL folder into one FULL file, and diff two checkpoints.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/errors.hpp"
#include "fsdp/io/checkpoint_files.hpp"
#include "fsdp/io/h5.hpp"
#include "fsdp/io/h5_flat_range.hpp"

namespace fsdp::ckpt {

/// One stored tensor.
struct TensorEntry {
  std::string path;                  ///< "/model/fc1.weight"
  std::vector<std::int64_t> shape;   ///< logical shape ({} for a 0-d tensor)
  std::string dtype;                 ///< "float32", ...
  std::int64_t bytes = 0;            ///< logical bytes
  std::int64_t stored_bytes = 0;     ///< bytes on disk (chunks with checksums)
  std::vector<std::string> aliases;  ///< other names of the same dataset (tied parameters)
};

/// What `fsdp-ckpt inspect` shows of one file.
struct FileInfo {
  std::string path;
  std::vector<std::pair<std::string, std::string>> attributes;  ///< root attributes, then /train's as "train/epoch", "train/data/<name>"; printable
  std::vector<TensorEntry> tensors;
};

/// A tensor shape as messages and tables print it: "[3, 4]".
inline std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

/// Which save a LOCAL rank file comes from, "step 16, written 2026-11-29T20:01:36Z": every rank file
/// of one save has the same step and start time (rank 0's, broadcast). A rank file copied in from
/// another save differs.
inline std::string local_save_of(hid_t file, const std::string& path) {
  const std::string where = "checkpoint '" + path + "'";
  std::string save = "step " + std::to_string(h5::read_int_attribute(file, "step", where));
  if (h5::has_attribute(file, "created")) save += ", written " + h5::read_string_attribute(file, "created", where);
  return save;
}

/// The datasets a save counts in its num_tensors attribute (written last): parameters, buffers,
/// optimizer state and LOCAL flat shards; the RNG rows are not counted.
inline bool counted_tensor(const std::string& dataset) {
  return dataset.rfind("/model/", 0) == 0 || dataset.rfind("/optim/", 0) == 0 || dataset.rfind("/units/", 0) == 0;
}

/// Why `file` lacks tensors its save wrote (one deleted by hand, a tool that dropped a group), or
/// nothing: its num_tensors against the datasets it holds. A file without the attribute is not judged.
inline std::optional<std::string> missing_tensors(hid_t file, const std::string& path) {
  if (!h5::has_attribute(file, "num_tensors")) return std::nullopt;
  const auto expected = h5::read_int_attribute(file, "num_tensors", "checkpoint '" + path + "'");
  const auto datasets = h5::list_datasets(file);
  const auto stored = std::count_if(datasets.begin(), datasets.end(), counted_tensor);
  if (stored == expected) return std::nullopt;
  return "checkpoint '" + path + "' is incomplete: " + std::to_string(stored) + " tensors stored, " + std::to_string(expected) + " expected";
}

namespace detail {

inline std::vector<std::int64_t> logical_shape(hid_t ds) {
  if (h5::has_attribute(ds, "scalar")) return {};
  return h5::dataset_dims(ds);
}

inline std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

/// An attribute as text: strings as is, numbers and arrays of them comma separated.
inline std::string attribute_text(hid_t obj, const std::string& name, const std::string& where) {
  h5::Id attr = h5::open_attribute(obj, name, where);
  h5::Id type(H5Aget_type(attr), "H5Aget_type");
  const auto cls = H5Tget_class(type);
  if (cls == H5T_STRING) {
    const auto v = h5::read_string_array_attribute(obj, name, where);
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
    return s;
  }
  std::ostringstream os;
  if (cls == H5T_INTEGER) {
    const auto v = h5::read_int_array_attribute(obj, name, where);
    for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  } else if (cls == H5T_FLOAT) {
    const auto v = h5::read_double_array_attribute(obj, name, where);
    os.precision(10);
    for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  } else {
    os << "<type class " << static_cast<int>(cls) << ">";
  }
  return os.str();
}

inline haddr_t object_address(hid_t file, const std::string& path) {
  H5O_info_t info{};
  h5::check(H5Oget_info_by_name2(file, path.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT), "H5Oget_info_by_name(" + path + ")");
  return info.addr;
}

/// Reads a whole dataset (logical elements, in blocks of rows) as doubles, verifying checksums.
inline std::vector<double> read_all_as_double(hid_t ds, const std::string& where) {
  auto dims = h5::dataset_dims(ds);
  const std::int64_t n = numel(dims);
  std::vector<double> out(static_cast<std::size_t>(n));
  h5::read_flat_range(ds, dims, 0, n, h5::ElementType::kFloat64, out.data(), where);
  return out;
}

/// Reads `ds` block by block (at most ~64 MiB at a time) so every chunk's checksum is verified.
/// The per-rank datasets' layout (/rng/..., /rank_local/...): one row of `n` bytes per rank, in rank
/// order, [world, n] uint8. Creates `dataset` and writes rows [first_row, first_row + rows) from `bytes`.
inline void write_rank_rows_bytes(hid_t file, const std::string& dataset, std::int64_t world, std::int64_t n, std::int64_t first_row,
                                  std::int64_t rows, const void* bytes, hid_t dxpl) {
  h5::Id ds = h5::create_dataset(file, dataset, h5::ElementType::kUInt8, {world, n});
  h5::write_flat_range(ds, {world, n}, first_row * n, (first_row + rows) * n, h5::ElementType::kUInt8, bytes, dxpl, dataset);
}

inline void read_through(hid_t ds, const std::string& where) {
  const auto dims = h5::dataset_dims(ds);
  const std::int64_t n = numel(dims);
  if (n == 0) return;
  const auto type = h5::stored_element_type(ds, where);
  const std::int64_t elem = static_cast<std::int64_t>(h5::element_size(type));
  const std::int64_t block = std::max<std::int64_t>(1, (64 << 20) / elem);
  std::vector<char> buf(static_cast<std::size_t>(std::min(n, block) * elem));
  for (std::int64_t lo = 0; lo < n; lo += block) h5::read_flat_range(ds, dims, lo, std::min(n, lo + block), type, buf.data(), where);
}

}  // namespace detail

/// Root attributes and tensor table of a checkpoint file (or one rank file of a LOCAL folder).
inline FileInfo inspect_file(const std::string& path) {
  FileInfo info;
  info.path = path;
  h5::Id file = h5::open_file_readonly(path);
  const std::string where = "checkpoint '" + path + "'";
  for (const auto& name : h5::list_attribute_names(file)) info.attributes.emplace_back(name, detail::attribute_text(file, name, where));
  // The data position: epoch and sample, and the application's counters (a mixture's sources).
  for (const std::string group : {"/train", "/train/data"}) {
    if (!h5::exists(file, group)) continue;
    h5::Id g = h5::open_group(file, group, path);
    for (const auto& name : h5::list_attribute_names(g))
      if (name != "step") info.attributes.emplace_back(group.substr(1) + "/" + name, detail::attribute_text(g, name, where));
  }
  std::map<haddr_t, std::size_t> by_address;
  for (const auto& p : h5::list_datasets(file)) {
    h5::Id ds(H5Dopen2(file, p.c_str(), H5P_DEFAULT), where + ": cannot open " + p);
    TensorEntry e;
    e.path = p;
    e.shape = detail::logical_shape(ds);
    const auto t = h5::stored_element_type(ds, where + " " + p);
    e.dtype = h5::element_type_name(t);
    e.bytes = detail::numel(e.shape) * static_cast<std::int64_t>(h5::element_size(t));
    e.stored_bytes = static_cast<std::int64_t>(H5Dget_storage_size(ds));
    by_address[detail::object_address(file, p)] = info.tensors.size();
    info.tensors.push_back(std::move(e));
  }
  if (h5::exists(file, "/model")) {
    for (const auto& name : h5::list_names(file, "/model")) {
      const std::string p = "/model/" + name;
      const auto it = by_address.find(detail::object_address(file, p));
      if (it != by_address.end() && info.tensors[it->second].path != p) info.tensors[it->second].aliases.push_back(p);
    }
  }
  return info;
}

/// Problems found by verify(); empty means the checkpoint is complete and every checksum matches.
struct VerifyReport {
  std::string path;
  std::int64_t tensors_checked = 0;
  std::int64_t bytes_checked = 0;
  std::vector<std::string> problems;
  bool ok() const noexcept { return problems.empty(); }
};

namespace detail {
/// What verify compares between the rank files of a LOCAL folder.
struct RankFileFacts {
  std::optional<std::string> plan, save, type;
  std::optional<std::int64_t> world;
};

inline void verify_file_into(const std::string& path, VerifyReport& report, RankFileFacts* facts = nullptr) {
  h5::Id file;
  try {
    file = h5::open_file_readonly(path);
  } catch (const CheckpointError& e) {
    report.problems.push_back(e.what());
    return;
  }
  const std::string where = "checkpoint '" + path + "'";
  try {
    const auto format = h5::read_string_attribute(file, "format", where);
    if (format != kFormatName) report.problems.push_back(where + ": format is '" + format + "', not " + kFormatName);
    const auto version = h5::read_int_attribute(file, "format_version", where);
    if (version > kFormatVersion) report.problems.push_back(where + ": format version " + std::to_string(version) + " is newer than this tool");
    if (const auto type = h5::read_string_attribute(file, "state_dict_type", where);
        type != "SHARDED_STATE_DICT" && type != "FULL_STATE_DICT" && type != "LOCAL_STATE_DICT")
      report.problems.push_back(where + ": state_dict_type '" + type + "' is none of SHARDED_STATE_DICT, FULL_STATE_DICT, LOCAL_STATE_DICT");
    if (facts) {
      facts->plan = h5::read_string_attribute(file, "plan_hash", where);
      facts->world = h5::read_int_attribute(file, "world_size", where);
      facts->save = local_save_of(file, path);
      facts->type = h5::read_string_attribute(file, "state_dict_type", where);
    }
    if (h5::exists(file, "/train")) {
      h5::Id train = h5::open_group(file, "/train", path);
      const auto named = h5::read_int_attribute(file, "step", where), trained = h5::read_int_attribute(train, "step", where + " /train");
      if (named != trained)
        report.problems.push_back(where + ": its step attribute is " + std::to_string(named) + " and /train's step " + std::to_string(trained));
    }
  } catch (const CheckpointError& e) {
    report.problems.push_back(e.what());
    return;
  }
  std::int64_t counted = 0;
  std::vector<std::string> datasets;
  try {
    datasets = h5::list_datasets(file);
  } catch (const CheckpointError& e) {
    report.problems.push_back(where + ": cannot list datasets: " + e.what());
    return;
  }
  for (const auto& p : datasets) {
    try {
      h5::Id ds(H5Dopen2(file, p.c_str(), H5P_DEFAULT), where + ": cannot open dataset " + p);
      // Stored, whether or not its bytes read back: completeness is counted apart from damage.
      if (counted_tensor(p)) ++counted;
      h5::Id dcpl(H5Dget_create_plist(ds), "H5Dget_create_plist");
      const auto dims = h5::dataset_dims(ds);
      const bool empty = numel(dims) == 0;
      if (!empty && H5Pget_nfilters(dcpl) == 0) report.problems.push_back(where + ": dataset " + p + " has no checksum filter");
      read_through(ds, where + " dataset " + p);
      ++report.tensors_checked;
      report.bytes_checked += static_cast<std::int64_t>(H5Dget_storage_size(ds));
    } catch (const CheckpointError& e) {
      report.problems.push_back(e.what());
    }
  }
  try {
    const auto expected = h5::read_int_attribute(file, "num_tensors", where);
    if (expected != counted)
      report.problems.push_back(where + ": incomplete: " + std::to_string(counted) + " tensors stored, " + std::to_string(expected) + " expected");
  } catch (const CheckpointError& e) {
    report.problems.push_back(e.what());
  }
}
}  // namespace detail

/// Reads every dataset of a checkpoint file or LOCAL folder (checksums) and checks completeness:
/// the tensor count written last, and for LOCAL folders every rank file with one plan.
inline VerifyReport verify(const std::string& path) {
  VerifyReport report;
  report.path = path;
  if (!std::filesystem::is_directory(path)) {
    detail::verify_file_into(path, report);
    return report;
  }
  detail::RankFileFacts first;
  const auto file0 = (std::filesystem::path(path) / local_rank_file(0)).string();
  detail::verify_file_into(file0, report, &first);
  if (!first.world) return report;
  if (first.type && *first.type != "LOCAL_STATE_DICT") report.problems.push_back("'" + file0 + "' is a " + *first.type + " file, not a rank file");
  for (std::int64_t r = 1; r < *first.world; ++r) {
    const auto file = (std::filesystem::path(path) / local_rank_file(static_cast<int>(r))).string();
    if (!std::filesystem::exists(file)) {
      report.problems.push_back("LOCAL checkpoint '" + path + "' is missing " + local_rank_file(static_cast<int>(r)) + " of world size " +
                                std::to_string(*first.world));
      continue;
    }
    detail::RankFileFacts facts;
    detail::verify_file_into(file, report, &facts);
    if (facts.type && *facts.type != "LOCAL_STATE_DICT") report.problems.push_back("'" + file + "' is a " + *facts.type + " file, not a rank file");
    if (facts.plan && first.plan && *facts.plan != *first.plan)
      report.problems.push_back("'" + file + "' has plan " + *facts.plan + ", rank 0 has " + *first.plan);
    if (facts.save && first.save && *facts.save != *first.save)
      report.problems.push_back("'" + file + "' comes from another save (" + *facts.save + ") than rank 0's (" + *first.save + ")");
  }
  return report;
}

/// Merges a LOCAL_STATE_DICT folder into one FULL_STATE_DICT file with the same schema as
/// save_checkpoint writes (like `accelerate merge-weights`). Written atomically (temporary + rename).
inline void merge_local(const std::string& dir, const std::string& out_path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw CheckpointError("'" + dir + "' is not a LOCAL_STATE_DICT checkpoint folder");
  const std::string first = (fs::path(dir) / local_rank_file(0)).string();
  h5::Id f0 = h5::open_file_readonly(first);
  const std::string w0 = "checkpoint '" + first + "'";
  if (h5::read_string_attribute(f0, "state_dict_type", w0) != "LOCAL_STATE_DICT") throw CheckpointError(w0 + " is not a LOCAL_STATE_DICT rank file");
  const auto world = h5::read_int_attribute(f0, "world_size", w0);
  const auto group = h5::read_int_attribute(f0, "shard_group_size", w0);
  const auto plan = h5::read_string_attribute(f0, "plan_hash", w0);
  const auto save = local_save_of(f0, first);
  // The output may not replace a rank file nor sit in the folder as one more.
  std::error_code ec;
  if (fs::is_directory(out_path, ec)) throw CheckpointError("'" + out_path + "' is a folder: give the merged file's name");
  const fs::path out_folder = fs::weakly_canonical(fs::absolute(out_path).parent_path(), ec), in_folder = fs::weakly_canonical(fs::absolute(dir), ec);
  if (out_folder == in_folder)
    throw CheckpointError("'" + out_path + "' lies inside the LOCAL checkpoint '" + dir + "' it merges: write it elsewhere");
  // Files of replica 0, by shard rank; every rank file for the RNG rows.
  std::vector<h5::Id> shard_files(static_cast<std::size_t>(group));
  std::vector<h5::Id> all(static_cast<std::size_t>(world));
  for (std::int64_t r = 0; r < world; ++r) {
    const std::string p = (fs::path(dir) / local_rank_file(static_cast<int>(r))).string();
    if (!fs::exists(p)) throw CheckpointError("LOCAL checkpoint '" + dir + "' is missing " + local_rank_file(static_cast<int>(r)));
    h5::Id f = h5::open_file_readonly(p);
    const std::string w = "checkpoint '" + p + "'";
    if (h5::read_string_attribute(f, "plan_hash", w) != plan) throw CheckpointError(w + " has another plan than rank 0's");
    if (h5::read_string_attribute(f, "state_dict_type", w) != "LOCAL_STATE_DICT") throw CheckpointError(w + " is not a LOCAL_STATE_DICT rank file");
    if (const auto other = local_save_of(f, p); other != save)
      throw CheckpointError(w + " comes from another save (" + other + ") than rank 0's (" + save + ")");
    if (h5::read_int_attribute(f, "replica_rank", w) == 0) {
      const auto s = h5::read_int_attribute(f, "shard_rank", w);
      if (s < 0 || s >= group) throw CheckpointError(w + ": shard_rank out of range");
      shard_files[static_cast<std::size_t>(s)] = h5::open_file_readonly(p);
    }
    all[static_cast<std::size_t>(r)] = std::move(f);
  }
  for (std::size_t s = 0; s < shard_files.size(); ++s)
    if (!shard_files[s].valid()) throw CheckpointError("LOCAL checkpoint '" + dir + "' has no file for shard rank " + std::to_string(s));

  const fs::path final_path(out_path);
  const fs::path tmp = final_path.parent_path() / temporary_name(final_path.filename().string());
  // A full disk shows here, before HDF5 writes (a failed close leaves HDF5 unable to shut down cleanly;
  // the space is checked, not held), and a failure on the way leaves no temporary behind.
  std::int64_t bytes = 1 << 20;
  for (const auto& f : shard_files) {
    hsize_t size = 0;
    if (H5Fget_filesize(f, &size) >= 0) bytes += static_cast<std::int64_t>(size);
  }
  reserve_space(tmp, bytes, out_path);
  struct RemoveOnFailure {
    const fs::path& path;
    bool armed = true;
    ~RemoveOnFailure() {
      std::error_code ignored;
      if (armed) fs::remove(path, ignored);
    }
  } cleanup{tmp};
  {
    h5::Id out = h5::create_file(tmp.string());
    for (const auto& name : h5::list_attribute_names(f0)) {
      if (name == "rank" || name == "shard_rank" || name == "replica_rank" || name == "aliases" || name == "num_tensors") continue;
      // Copy the attribute as stored.
      h5::Id a(H5Aopen(f0, name.c_str(), H5P_DEFAULT), w0 + ": attribute " + name);
      h5::Id type(H5Aget_type(a), "H5Aget_type");
      h5::Id space(H5Aget_space(a), "H5Aget_space");
      std::vector<char> buf(H5Aget_storage_size(a) + 1);
      h5::check(H5Aread(a, type, buf.data()), w0 + ": attribute " + name);
      h5::write_attribute_raw(out, name, type, space, buf.data());
    }
    h5::write_attribute(out, "state_dict_type", "FULL_STATE_DICT");
    h5::write_attribute(out, "merged_from", dir);
    std::int64_t tensors = 0;
    const auto unit_names = h5::list_names(f0, "/units");
    for (const auto& unit : unit_names) {
      const std::string base = "/units/" + unit;
      h5::Id g = h5::open_group(f0, base, first);
      const auto names = h5::read_string_array_attribute(g, "param_names", w0);
      const auto ndims = h5::read_int_array_attribute(g, "param_ndims", w0);
      const auto dims = h5::read_int_array_attribute(g, "param_dims", w0);
      const auto shard_numel = h5::read_int_attribute(g, "shard_numel", w0);
      if (names.empty()) continue;
      // Assemble one flat tensor (raw bytes of the stored type) from the shard files.
      auto assemble = [&](const std::string& p, h5::ElementType& type) {
        std::vector<char> flat;
        for (std::int64_t s = 0; s < group; ++s) {
          const auto& f = shard_files[static_cast<std::size_t>(s)];
          h5::Id ds = h5::open_dataset(f, p, dir + "/" + local_rank_file(0));
          type = h5::stored_element_type(ds, p);
          const std::size_t elem = h5::element_size(type);
          const std::size_t at = flat.size();
          flat.resize(at + static_cast<std::size_t>(shard_numel) * elem);
          h5::read_flat_range(ds, {shard_numel}, 0, shard_numel, type, flat.data() + at,
                              "LOCAL checkpoint '" + dir + "' shard " + std::to_string(s) + " " + p);
        }
        return flat;
      };
      auto write_params = [&](const std::vector<char>& flat, h5::ElementType type, const std::string& suffix, const char* kind) {
        std::int64_t offset = 0;
        std::size_t d = 0;
        const std::size_t elem = h5::element_size(type);
        for (std::size_t i = 0; i < names.size(); ++i) {
          std::vector<std::int64_t> shape(dims.begin() + static_cast<std::ptrdiff_t>(d),
                                          dims.begin() + static_cast<std::ptrdiff_t>(d + static_cast<std::size_t>(ndims[i])));
          d += static_cast<std::size_t>(ndims[i]);
          const std::int64_t n = detail::numel(shape);
          const std::string p = suffix.empty() ? "/model/" + names[i] : "/optim/" + names[i] + "/" + suffix;
          h5::Id ds = h5::create_dataset(out, p, type, shape);
          h5::write_attribute(ds, "kind", kind);
          if (shape.empty()) h5::write_attribute(ds, "scalar", std::int64_t{1});
          h5::write_flat_range(ds, shape, 0, n, type, flat.data() + static_cast<std::size_t>(offset) * elem, H5P_DEFAULT, p);
          offset += n;
          ++tensors;
        }
      };
      h5::ElementType type{};
      write_params(assemble(base + "/flat", type), type, "", "parameter");
      if (h5::exists(f0, base + "/optim")) {
        h5::Id og = h5::open_group(f0, base + "/optim", first);
        const auto step = h5::read_int_attribute(og, "step", w0);
        for (const auto& state : h5::list_names(f0, base + "/optim"))
          write_params(assemble(base + "/optim/" + state, type), type, state, "optimizer_state");
        for (const auto& n : names) {
          h5::Id pg = h5::require_group(out, "/optim/" + n);
          h5::write_attribute(pg, "step", step);
        }
      }
    }
    for (const auto& link : h5::read_string_array_attribute(f0, "aliases", w0)) {
      const auto eq = link.find('=');
      const std::string alias = link.substr(0, eq), name = link.substr(eq + 1);
      h5::check(H5Lcreate_hard(out, ("/model/" + name).c_str(), out, ("/model/" + alias).c_str(), H5P_DEFAULT, H5P_DEFAULT), "link " + alias);
    }
    // A per-rank dataset (world x bytes) from every rank file's `read(file, bytes)`.
    auto write_rows = [&](const std::string& dataset, std::int64_t n, const std::vector<std::vector<char>>& rows) {
      std::vector<char> joined;
      for (const auto& r : rows) joined.insert(joined.end(), r.begin(), r.begin() + n);
      joined.push_back(0);
      detail::write_rank_rows_bytes(out, dataset, world, n, 0, world, joined.data(), H5P_DEFAULT);
    };
    if (h5::exists(f0, "/model")) {  // buffers: rank 0's, and every rank's of one that differs between them
      for (const auto& name : h5::list_names(f0, "/model")) {
        const std::string p = "/model/" + name;
        if (h5::exists(out, p)) continue;
        h5::Id src = h5::open_dataset(f0, p, first);
        const auto type = h5::stored_element_type(src, p);
        const auto shape = detail::logical_shape(src);
        const auto stored_dims = h5::dataset_dims(src);
        const auto bytes = static_cast<std::size_t>(detail::numel(stored_dims)) * h5::element_size(type);
        std::vector<std::vector<char>> per_rank(static_cast<std::size_t>(world), std::vector<char>(bytes + 1));
        bool differ = false;
        for (std::int64_t r = 0; r < world; ++r) {
          const std::string pr = dir + "/" + local_rank_file(static_cast<int>(r));
          h5::Id ds = h5::open_dataset(all[static_cast<std::size_t>(r)], p, pr);
          if (h5::dataset_dims(ds) != stored_dims) throw CheckpointError("checkpoint '" + pr + "' dataset " + p + " has another shape than rank 0's");
          h5::read_flat_range(ds, stored_dims, 0, detail::numel(stored_dims), type, per_rank[static_cast<std::size_t>(r)].data(),
                              "checkpoint '" + pr + "' dataset " + p);
          differ = differ || std::memcmp(per_rank[static_cast<std::size_t>(r)].data(), per_rank[0].data(), bytes) != 0;
        }
        if (differ) write_rows(std::string(kRankLocalGroup) + "/" + name, static_cast<std::int64_t>(bytes), per_rank);
        const auto& buf = per_rank[0];
        h5::Id ds = h5::create_dataset(out, p, type, shape);
        h5::write_attribute(ds, "kind", "buffer");
        if (shape.empty()) h5::write_attribute(ds, "scalar", std::int64_t{1});
        h5::write_flat_range(ds, shape, 0, detail::numel(stored_dims), type, buf.data(), H5P_DEFAULT, p);
        ++tensors;
      }
    }
    if (h5::exists(f0, "/optim")) {
      h5::Id src = h5::open_group(f0, "/optim", first);
      h5::Id dst = h5::require_group(out, "/optim");
      h5::write_attribute(dst, "kind", h5::read_string_attribute(src, "kind", w0));
      h5::write_attribute(dst, "lr", h5::read_double_array_attribute(src, "lr", w0));
    }
    {
      h5::Id src = h5::open_group(f0, "/train", first);
      h5::Id dst = h5::require_group(out, "/train");
      for (const char* k : {"step", "epoch", "sample_index"}) h5::write_attribute(dst, k, h5::read_int_attribute(src, k, w0));
      h5::Id ssrc = h5::open_group(f0, "/train/scheduler", first);
      h5::Id sdst = h5::require_group(out, "/train/scheduler");
      for (const auto& k : h5::list_attribute_names(ssrc)) h5::write_attribute(sdst, k, h5::read_double_attribute(ssrc, k, w0));
      if (h5::exists(f0, "/train/data")) {
        h5::Id dsrc = h5::open_group(f0, "/train/data", first);
        h5::Id ddst = h5::require_group(out, "/train/data");
        for (const auto& k : h5::list_attribute_names(dsrc)) h5::write_attribute(ddst, k, h5::read_int_attribute(dsrc, k, w0));
      }
    }
    if (h5::exists(f0, "/rng")) {  // each generator: one row per rank, in rank order
      for (const auto& name : h5::list_names(f0, "/rng")) {
        const std::string dataset = "/rng/" + name;
        h5::Id ds0 = h5::open_dataset(f0, dataset, first);
        const std::int64_t n = h5::dataset_dims(ds0).back();
        std::vector<std::vector<char>> rows(static_cast<std::size_t>(world), std::vector<char>(static_cast<std::size_t>(n) + 1));
        for (std::int64_t r = 0; r < world; ++r) {
          const std::string pr = dir + "/" + local_rank_file(static_cast<int>(r));
          h5::Id ds = h5::open_dataset(all[static_cast<std::size_t>(r)], dataset, pr);
          if (h5::dataset_dims(ds) != std::vector<std::int64_t>{1, n})
            throw CheckpointError("checkpoint '" + pr + "' dataset " + dataset + " has another size than rank 0's");
          h5::read_flat_range(ds, {1, n}, 0, n, h5::ElementType::kUInt8, rows[static_cast<std::size_t>(r)].data(),
                              "checkpoint '" + pr + "' dataset " + dataset);
        }
        write_rows(dataset, n, rows);
      }
    }
    h5::write_attribute(out, "num_tensors", tensors);
    out.close("cannot close '" + tmp.string() + "'");
  }
  fsync_path(tmp);
  fs::rename(tmp, final_path, ec);
  if (ec) throw CheckpointError("cannot rename '" + tmp.string() + "' to '" + out_path + "': " + ec.message());
  cleanup.armed = false;
}

/// Per-tensor comparison of two FULL/SHARDED checkpoint files.
struct TensorDiff {
  std::string path;
  std::string status;  ///< "ok", "differs", "only in A", "only in B", "shape"
  double max_abs = 0;  ///< max |a - b|
  double max_rel = 0;  ///< max |a - b| / max |b| over the tensor (0 when b is all zeros and a == b)
  double max_b = 0;    ///< max |b|
};

inline std::vector<TensorDiff> diff(const std::string& a_path, const std::string& b_path) {
  h5::Id a = h5::open_file_readonly(a_path), b = h5::open_file_readonly(b_path);
  auto tensors = [](hid_t f) {
    std::set<std::string> out;
    for (const char* root : {"/model", "/optim"}) {
      if (!h5::exists(f, root)) continue;
      if (std::string(root) == "/model") {
        for (const auto& n : h5::list_names(f, root)) out.insert("/model/" + n);
      } else {
        for (const auto& p : h5::list_datasets(f))
          if (p.rfind("/optim/", 0) == 0) out.insert(p);
      }
    }
    return out;
  };
  const auto ta = tensors(a), tb = tensors(b);
  std::set<std::string> names = ta;
  names.insert(tb.begin(), tb.end());
  std::vector<TensorDiff> out;
  for (const auto& p : names) {
    TensorDiff d;
    d.path = p;
    if (!ta.count(p))
      d.status = "only in B";
    else if (!tb.count(p))
      d.status = "only in A";
    else {
      h5::Id da = h5::open_dataset(a, p, a_path), db = h5::open_dataset(b, p, b_path);
      if (detail::logical_shape(da) != detail::logical_shape(db)) {
        d.status = "shape " + shape_text(detail::logical_shape(da)) + " vs " + shape_text(detail::logical_shape(db));
      } else {
        const auto va = detail::read_all_as_double(da, "checkpoint '" + a_path + "' dataset " + p);
        const auto vb = detail::read_all_as_double(db, "checkpoint '" + b_path + "' dataset " + p);
        for (std::size_t i = 0; i < va.size(); ++i) {
          const double diff_abs = std::abs(va[i] - vb[i]);
          if (std::isnan(va[i]) != std::isnan(vb[i])) d.max_abs = std::numeric_limits<double>::infinity();
          d.max_abs = std::max(d.max_abs, diff_abs);
          d.max_b = std::max(d.max_b, std::abs(vb[i]));
        }
        d.max_rel = d.max_b > 0 ? d.max_abs / d.max_b : (d.max_abs > 0 ? std::numeric_limits<double>::infinity() : 0.0);
        d.status = d.max_abs == 0 ? "ok" : "differs";
      }
    }
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace fsdp::ckpt
