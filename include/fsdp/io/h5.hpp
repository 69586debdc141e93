// A thin C++ layer over the HDF5 C API (io layer): owning handles, errors as CheckpointError with
// the HDF5 error stack, attributes, chunked Fletcher32 datasets (their flat ranges: h5_flat_range.hpp). The C++ API of
// HDF5 is not used because Debian's parallel build only supports the C API with MPI-IO.
#pragma once

#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/errors.hpp"

namespace fsdp::h5 {

/// Text of the current HDF5 error stack, innermost problem last, e.g. "H5Z: Fletcher32 checksum failed".
inline std::string error_stack_text() {
  std::string text;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto& out = *static_cast<std::string*>(data);
        if (n > 0) out += "; ";
        out += e->desc ? e->desc : "?";
        if (e->func_name) out += std::string(" (") + e->func_name + ")";
        return 0;
      },
      &text);
  H5Eclear2(H5E_DEFAULT);
  return text.empty() ? "unknown HDF5 error" : text;
}

/// Turns off HDF5's printing of error stacks to stderr: errors become exceptions instead.
inline void silence_errors() {
  static const bool once = [] {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    return true;
  }();
  (void)once;
}

/// Throws CheckpointError("<context>: <HDF5 error stack>") if `status` is negative.
template <class T>
T check(T status, const std::string& context) {
  if (status < 0) throw CheckpointError(context + ": " + error_stack_text());
  return status;
}

/// Owning HDF5 identifier of any kind (file, group, dataset, dataspace, type, property list, attribute).
class Id {
 public:
  Id() = default;
  explicit Id(hid_t id) : id_(id) {}
  Id(hid_t id, const std::string& context) : id_(check(id, context)) {}
  Id(Id&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)) {}
  Id& operator=(Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
    }
    return *this;
  }
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  ~Id() { reset(); }

  hid_t get() const noexcept { return id_; }
  operator hid_t() const noexcept { return id_; }  // NOLINT: the C API takes hid_t everywhere
  bool valid() const noexcept { return id_ >= 0; }

  /// Closes now; for files this is where data is flushed and, with MPI-IO, where ranks synchronize.
  void close(const std::string& context) {
    if (!valid()) return;
    const hid_t id = std::exchange(id_, H5I_INVALID_HID);
    check(close_id(id), context);
  }
  void reset() noexcept {
    if (valid()) (void)close_id(std::exchange(id_, H5I_INVALID_HID));
  }

 private:
  static herr_t close_id(hid_t id) noexcept {
    switch (H5Iget_type(id)) {
      case H5I_FILE: return H5Fclose(id);
      case H5I_GROUP: return H5Gclose(id);
      case H5I_DATASET: return H5Dclose(id);
      case H5I_DATASPACE: return H5Sclose(id);
      case H5I_DATATYPE: return H5Tclose(id);
      case H5I_GENPROP_LST: return H5Pclose(id);
      case H5I_ATTR: return H5Aclose(id);
      default: return 0;
    }
  }
  hid_t id_ = H5I_INVALID_HID;
};

// ---- element types ----------------------------------------------------------------------------

/// Element types a checkpoint stores, by the names written to files ("float32", ...).
enum class ElementType { kFloat32, kFloat64, kFloat16, kBFloat16, kInt64, kInt32, kUInt8, kBool };

inline const char* element_type_name(ElementType t) noexcept {
  switch (t) {
    case ElementType::kFloat32: return "float32";
    case ElementType::kFloat64: return "float64";
    case ElementType::kFloat16: return "float16";
    case ElementType::kBFloat16: return "bfloat16";
    case ElementType::kInt64: return "int64";
    case ElementType::kInt32: return "int32";
    case ElementType::kUInt8: return "uint8";
    case ElementType::kBool: return "bool";
  }
  return "?";
}

inline std::size_t element_size(ElementType t) noexcept {
  switch (t) {
    case ElementType::kFloat64:
    case ElementType::kInt64: return 8;
    case ElementType::kFloat32:
    case ElementType::kInt32: return 4;
    case ElementType::kFloat16:
    case ElementType::kBFloat16: return 2;
    case ElementType::kUInt8:
    case ElementType::kBool: return 1;
  }
  return 1;
}

/// The little-endian HDF5 type of `t`. 16-bit floats are IEEE-style float types with custom fields
/// (the same layout h5py uses for float16), so h5py and h5dump read them as floats.
inline Id file_type(ElementType t) {
  const auto copy = [](hid_t base) { return Id(H5Tcopy(base), "H5Tcopy"); };
  switch (t) {
    case ElementType::kFloat32: return copy(H5T_IEEE_F32LE);
    case ElementType::kFloat64: return copy(H5T_IEEE_F64LE);
    case ElementType::kInt64: return copy(H5T_STD_I64LE);
    case ElementType::kInt32: return copy(H5T_STD_I32LE);
    case ElementType::kUInt8:
    case ElementType::kBool: return copy(H5T_STD_U8LE);
    case ElementType::kFloat16:
    case ElementType::kBFloat16: {
      Id type = copy(H5T_IEEE_F32LE);
      const bool half = t == ElementType::kFloat16;
      // sign bit 15; exponent at 10 (5 bits) or 7 (8 bits); mantissa from 0.
      check(H5Tset_fields(type, 15, half ? 10 : 7, half ? 5 : 8, 0, half ? 10 : 7), "H5Tset_fields");
      check(H5Tset_size(type, 2), "H5Tset_size");
      check(H5Tset_ebias(type, half ? 15 : 127), "H5Tset_ebias");
      return type;
    }
  }
  throw CheckpointError("unknown element type");
}

/// The element type stored in a dataset, recognised from its HDF5 type.
inline ElementType stored_element_type(hid_t dataset, const std::string& where) {
  Id type(H5Dget_type(dataset), where + ": H5Dget_type");
  const auto cls = H5Tget_class(type);
  const auto size = H5Tget_size(type);
  if (cls == H5T_FLOAT) {
    if (size == 4) return ElementType::kFloat32;
    if (size == 8) return ElementType::kFloat64;
    if (size == 2) {
      std::size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
      check(H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize), where + ": H5Tget_fields");
      return esize == 8 ? ElementType::kBFloat16 : ElementType::kFloat16;
    }
  } else if (cls == H5T_INTEGER) {
    const bool is_signed = H5Tget_sign(type) == H5T_SGN_2;
    if (size == 8 && is_signed) return ElementType::kInt64;
    if (size == 4 && is_signed) return ElementType::kInt32;
    if (size == 1 && !is_signed) return ElementType::kUInt8;
  }
  throw CheckpointError(where + ": unsupported HDF5 element type (class " + std::to_string(static_cast<int>(cls)) + ", " + std::to_string(size) +
                        " bytes)");
}

// ---- property lists and files -----------------------------------------------------------------

/// File access list: 1.8+ object format (dense attribute storage for long attributes such as the
/// deck text), optionally MPI-IO on `comm`.
inline Id file_access(const MPI_Comm* comm = nullptr) {
  Id fapl(H5Pcreate(H5P_FILE_ACCESS), "H5Pcreate(file access)");
  check(H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_LATEST), "H5Pset_libver_bounds");
  if (comm) {
    check(H5Pset_fapl_mpio(fapl, *comm, MPI_INFO_NULL), "H5Pset_fapl_mpio");
    check(H5Pset_all_coll_metadata_ops(fapl, true), "H5Pset_all_coll_metadata_ops");
    check(H5Pset_coll_metadata_write(fapl, true), "H5Pset_coll_metadata_write");
  }
  return fapl;
}

/// Creates (truncating) `path`; collective over `comm` when given.
inline Id create_file(const std::string& path, const MPI_Comm* comm = nullptr) {
  silence_errors();
  Id fapl = file_access(comm);
  Id fcpl(H5Pcreate(H5P_FILE_CREATE), "H5Pcreate(file create)");
  check(H5Pset_obj_track_times(fcpl, false), "H5Pset_obj_track_times");  // the root group: see untimed_creation()
  return Id(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl, fapl), "cannot create checkpoint file '" + path + "'");
}

/// Opens `path` read-only with the POSIX driver (each rank on its own: no collective calls).
inline Id open_file_readonly(const std::string& path) {
  silence_errors();
  Id fapl = file_access();
  return Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), "cannot open checkpoint file '" + path + "' (missing, truncated or not HDF5)");
}

/// Transfer list for collective MPI-IO writes (required by filters such as Fletcher32 in parallel).
inline Id collective_transfer() {
  Id dxpl(H5Pcreate(H5P_DATASET_XFER), "H5Pcreate(transfer)");
  check(H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_COLLECTIVE), "H5Pset_dxpl_mpio");
  return dxpl;
}

// ---- groups and links -------------------------------------------------------------------------

inline bool exists(hid_t loc, const std::string& path) {
  // Check each prefix: H5Lexists fails (rather than returning false) when an intermediate is missing.
  std::size_t pos = path[0] == '/' ? 1 : 0;
  while (true) {
    const auto next = path.find('/', pos);
    const std::string prefix = path.substr(0, next);
    if (!prefix.empty() && prefix != "/" && H5Lexists(loc, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (next == std::string::npos) return true;
    pos = next + 1;
  }
}

/// A creation property list of `cls` without object times: HDF5 stamps each object with the time
/// of its creation by default, so two saves of the same state would differ in more than `created`.
inline Id untimed_creation(hid_t cls) {
  Id plist(H5Pcreate(cls), "H5Pcreate(object create)");
  check(H5Pset_obj_track_times(plist, false), "H5Pset_obj_track_times");
  return plist;
}

/// Opens group `path`, creating it and its parents if needed (collective in parallel files).
inline Id require_group(hid_t loc, const std::string& path) {
  if (exists(loc, path)) return Id(H5Gopen2(loc, path.c_str(), H5P_DEFAULT), "H5Gopen2(" + path + ")");
  // Parents one by one: intermediate groups HDF5 creates itself would carry times.
  if (const auto slash = path.find_last_of('/'); slash != std::string::npos && slash > 0) require_group(loc, path.substr(0, slash));
  Id gcpl = untimed_creation(H5P_GROUP_CREATE);
  return Id(H5Gcreate2(loc, path.c_str(), H5P_DEFAULT, gcpl, H5P_DEFAULT), "cannot create group " + path);
}

inline Id open_group(hid_t loc, const std::string& path, const std::string& file) {
  if (!exists(loc, path)) throw CheckpointError("checkpoint '" + file + "' has no group " + path);
  return Id(H5Gopen2(loc, path.c_str(), H5P_DEFAULT), "checkpoint '" + file + "': cannot open group " + path);
}

/// Names directly inside group `path` (datasets, groups and links), in creation-independent name order.
inline std::vector<std::string> list_names(hid_t loc, const std::string& path) {
  std::vector<std::string> names;
  Id group(H5Gopen2(loc, path.c_str(), H5P_DEFAULT), "H5Gopen2(" + path + ")");
  hsize_t index = 0;
  check(H5Literate(
            group, H5_INDEX_NAME, H5_ITER_INC, &index,
            [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
              static_cast<std::vector<std::string>*>(data)->emplace_back(name);
              return 0;
            },
            &names),
        "H5Literate(" + path + ")");
  return names;
}

/// Every dataset in the file by absolute path (each object once, under its first name).
inline std::vector<std::string> list_datasets(hid_t file) {
  std::vector<std::string> out;
  check(H5Ovisit(
            file, H5_INDEX_NAME, H5_ITER_INC,
            [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
              if (info->type == H5O_TYPE_DATASET) static_cast<std::vector<std::string>*>(data)->push_back(std::string("/") + name);
              return 0;
            },
            &out),
        "H5Ovisit");
  return out;
}

// ---- attributes -------------------------------------------------------------------------------

inline bool has_attribute(hid_t obj, const std::string& name) { return H5Aexists(obj, name.c_str()) > 0; }

inline void write_attribute_raw(hid_t obj, const std::string& name, hid_t type, hid_t space, const void* data) {
  if (has_attribute(obj, name)) check(H5Adelete(obj, name.c_str()), "H5Adelete(" + name + ")");
  Id attr(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), "cannot create attribute " + name);
  check(H5Awrite(attr, type, data), "cannot write attribute " + name);
}

inline void write_attribute(hid_t obj, const std::string& name, const std::string& value) {
  Id type(H5Tcopy(H5T_C_S1), "H5Tcopy");
  check(H5Tset_size(type, std::max<std::size_t>(1, value.size())), "H5Tset_size");
  check(H5Tset_strpad(type, H5T_STR_NULLPAD), "H5Tset_strpad");  // the full size holds text, no terminator
  check(H5Tset_cset(type, H5T_CSET_UTF8), "H5Tset_cset");
  Id space(H5Screate(H5S_SCALAR), "H5Screate");
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  write_attribute_raw(obj, name, type, space, padded.data());
}
inline void write_attribute(hid_t obj, const std::string& name, const char* value) { write_attribute(obj, name, std::string(value)); }

inline void write_attribute(hid_t obj, const std::string& name, std::int64_t value) {
  Id space(H5Screate(H5S_SCALAR), "H5Screate");
  write_attribute_raw(obj, name, H5T_STD_I64LE, space, &value);
}
inline void write_attribute(hid_t obj, const std::string& name, int value) { write_attribute(obj, name, static_cast<std::int64_t>(value)); }

inline void write_attribute(hid_t obj, const std::string& name, double value) {
  Id space(H5Screate(H5S_SCALAR), "H5Screate");
  write_attribute_raw(obj, name, H5T_IEEE_F64LE, space, &value);
}

inline void write_attribute(hid_t obj, const std::string& name, const std::vector<std::int64_t>& values) {
  const hsize_t n = values.size();
  Id space(n == 0 ? H5Screate(H5S_NULL) : H5Screate_simple(1, &n, nullptr), "H5Screate");
  const std::int64_t none = 0;  // HDF5 refuses a null buffer even for an empty attribute
  write_attribute_raw(obj, name, H5T_STD_I64LE, space, n ? static_cast<const void*>(values.data()) : &none);
}

inline void write_attribute(hid_t obj, const std::string& name, const std::vector<double>& values) {
  const hsize_t n = values.size();
  Id space(n == 0 ? H5Screate(H5S_NULL) : H5Screate_simple(1, &n, nullptr), "H5Screate");
  const double none = 0;
  write_attribute_raw(obj, name, H5T_IEEE_F64LE, space, n ? static_cast<const void*>(values.data()) : &none);
}

/// An array of fixed-length strings (null padded to the longest).
inline void write_attribute(hid_t obj, const std::string& name, const std::vector<std::string>& values) {
  std::size_t width = 1;
  for (const auto& v : values) width = std::max(width, v.size());
  std::string packed(values.size() * width, '\0');
  for (std::size_t i = 0; i < values.size(); ++i) std::memcpy(packed.data() + i * width, values[i].data(), values[i].size());
  Id type(H5Tcopy(H5T_C_S1), "H5Tcopy");
  check(H5Tset_size(type, width), "H5Tset_size");
  check(H5Tset_strpad(type, H5T_STR_NULLPAD), "H5Tset_strpad");
  check(H5Tset_cset(type, H5T_CSET_UTF8), "H5Tset_cset");
  const hsize_t n = values.size();
  Id space(n == 0 ? H5Screate(H5S_NULL) : H5Screate_simple(1, &n, nullptr), "H5Screate");
  if (packed.empty()) packed.assign(width, '\0');
  write_attribute_raw(obj, name, type, space, packed.data());
}

/// Names of the attributes of `obj`, in name order.
inline std::vector<std::string> list_attribute_names(hid_t obj) {
  std::vector<std::string> names;
  hsize_t index = 0;
  check(H5Aiterate2(
            obj, H5_INDEX_NAME, H5_ITER_INC, &index,
            [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
              static_cast<std::vector<std::string>*>(data)->emplace_back(name);
              return 0;
            },
            &names),
        "H5Aiterate2");
  return names;
}

inline Id open_attribute(hid_t obj, const std::string& name, const std::string& where) {
  if (!has_attribute(obj, name)) throw CheckpointError(where + ": attribute '" + name + "' is missing");
  return Id(H5Aopen(obj, name.c_str(), H5P_DEFAULT), where + ": cannot open attribute " + name);
}

inline hssize_t attribute_length(hid_t attr) {
  Id space(H5Aget_space(attr), "H5Aget_space");
  if (H5Sget_simple_extent_type(space) == H5S_NULL) return 0;
  return H5Sget_simple_extent_npoints(space);
}

inline std::int64_t read_int_attribute(hid_t obj, const std::string& name, const std::string& where) {
  Id attr = open_attribute(obj, name, where);
  std::int64_t v = 0;
  check(H5Aread(attr, H5T_NATIVE_INT64, &v), where + ": cannot read attribute " + name);
  return v;
}

inline double read_double_attribute(hid_t obj, const std::string& name, const std::string& where) {
  Id attr = open_attribute(obj, name, where);
  double v = 0;
  check(H5Aread(attr, H5T_NATIVE_DOUBLE, &v), where + ": cannot read attribute " + name);
  return v;
}

inline std::vector<std::int64_t> read_int_array_attribute(hid_t obj, const std::string& name, const std::string& where) {
  Id attr = open_attribute(obj, name, where);
  std::vector<std::int64_t> v(static_cast<std::size_t>(attribute_length(attr)));
  if (!v.empty()) check(H5Aread(attr, H5T_NATIVE_INT64, v.data()), where + ": cannot read attribute " + name);
  return v;
}

inline std::vector<double> read_double_array_attribute(hid_t obj, const std::string& name, const std::string& where) {
  Id attr = open_attribute(obj, name, where);
  std::vector<double> v(static_cast<std::size_t>(attribute_length(attr)));
  if (!v.empty()) check(H5Aread(attr, H5T_NATIVE_DOUBLE, v.data()), where + ": cannot read attribute " + name);
  return v;
}

/// Reads a fixed-length string attribute, or an array of them.
inline std::vector<std::string> read_string_array_attribute(hid_t obj, const std::string& name, const std::string& where) {
  Id attr = open_attribute(obj, name, where);
  Id type(H5Aget_type(attr), "H5Aget_type");
  if (H5Tget_class(type) != H5T_STRING || H5Tis_variable_str(type) > 0)
    throw CheckpointError(where + ": attribute '" + name + "' is not a fixed-length string");
  const std::size_t width = H5Tget_size(type);
  Id space(H5Aget_space(attr), "H5Aget_space");
  const auto kind = H5Sget_simple_extent_type(space);
  const std::size_t n = kind == H5S_NULL ? 0 : static_cast<std::size_t>(H5Sget_simple_extent_npoints(space));
  std::string packed(n * width, '\0');
  if (n > 0) check(H5Aread(attr, type, packed.data()), where + ": cannot read attribute " + name);
  std::vector<std::string> out;
  for (std::size_t i = 0; i < n; ++i) {
    std::string s = packed.substr(i * width, width);
    s.erase(std::find(s.begin(), s.end(), '\0'), s.end());
    out.push_back(std::move(s));
  }
  return out;
}

inline std::string read_string_attribute(hid_t obj, const std::string& name, const std::string& where) {
  auto v = read_string_array_attribute(obj, name, where);
  return v.empty() ? std::string() : v.front();
}

// ---- datasets ---------------------------------------------------------------------------------

/// Chunk shape of about `target_bytes`: whole trailing dimensions, a block of leading ones.
inline std::vector<hsize_t> chunk_shape(const std::vector<hsize_t>& dims, std::size_t elem_bytes, std::size_t target_bytes = 1 << 20) {
  std::vector<hsize_t> chunk(dims.size(), 1);
  std::size_t inner = elem_bytes;  // bytes of one index of the current dimension's sub-block
  for (std::size_t d = dims.size(); d-- > 0;) {
    if (inner * dims[d] <= target_bytes) {
      chunk[d] = dims[d];
      inner *= dims[d];
    } else {
      // Rows per chunk, evened out so the last chunk is not a nearly empty one stored at full size.
      const hsize_t rows = std::max<hsize_t>(1, target_bytes / inner);
      const hsize_t chunks = (dims[d] + rows - 1) / rows;
      chunk[d] = (dims[d] + chunks - 1) / chunks;
      break;
    }
  }
  return chunk;
}

/// Creates dataset `path` (parents included) of `dims`, chunked with the Fletcher32 checksum filter.
/// A 0-d tensor is stored with dims {1}; an empty one unchunked (HDF5 cannot chunk a 0 extent).
inline Id create_dataset(hid_t loc, const std::string& path, ElementType t, const std::vector<std::int64_t>& shape) {
  const std::vector<hsize_t> dims = shape.empty() ? std::vector<hsize_t>{1} : std::vector<hsize_t>(shape.begin(), shape.end());
  Id space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), "H5Screate_simple(" + path + ")");
  Id dcpl = untimed_creation(H5P_DATASET_CREATE);
  const bool empty = std::any_of(dims.begin(), dims.end(), [](hsize_t d) { return d == 0; });
  if (!empty) {
    const auto chunk = chunk_shape(dims, element_size(t));
    check(H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data()), "H5Pset_chunk(" + path + ")");
    check(H5Pset_fletcher32(dcpl), "H5Pset_fletcher32");
    // Every chunk is written in full by the ranks together: no need to pre-fill.
    check(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER), "H5Pset_fill_time");
  }
  if (const auto slash = path.find_last_of('/'); slash != std::string::npos && slash > 0) require_group(loc, path.substr(0, slash));
  Id type = file_type(t);
  return Id(H5Dcreate2(loc, path.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), "cannot create dataset " + path);
}

inline Id open_dataset(hid_t loc, const std::string& path, const std::string& file) {
  if (!exists(loc, path)) throw CheckpointError("checkpoint '" + file + "' has no dataset " + path);
  return Id(H5Dopen2(loc, path.c_str(), H5P_DEFAULT), "checkpoint '" + file + "': cannot open dataset " + path);
}

inline std::vector<std::int64_t> dataset_dims(hid_t dataset) {
  Id space(H5Dget_space(dataset), "H5Dget_space");
  const int rank = H5Sget_simple_extent_ndims(space);
  std::vector<hsize_t> dims(static_cast<std::size_t>(std::max(rank, 0)));
  if (rank > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return {dims.begin(), dims.end()};
}

}  // namespace fsdp::h5
