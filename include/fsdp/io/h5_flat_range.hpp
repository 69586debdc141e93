// Reading and writing a flat range of an HDF5 dataset (io layer): the union of boxes it covers in a
// tensor's logical shape, selected in the file and in memory alike, and the check of every stored
// chunk a read touches before HDF5 reads it.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/core/slab.hpp"
#include "fsdp/core/text.hpp"
#include "fsdp/io/h5.hpp"

namespace fsdp::h5 {

/// File dataspace of `dataset` with the union of `boxes` selected (nothing selected if empty).
inline Id select_boxes(hid_t dataset, const std::vector<Box>& boxes) {
  Id space(H5Dget_space(dataset), "H5Dget_space");
  check(H5Sselect_none(space), "H5Sselect_none");
  for (const auto& b : boxes) {
    std::vector<hsize_t> start(b.start.begin(), b.start.end()), count(b.count.begin(), b.count.end());
    check(H5Sselect_hyperslab(space, H5S_SELECT_OR, start.data(), nullptr, count.data(), nullptr), "H5Sselect_hyperslab");
  }
  return space;
}

inline Id memory_space(std::int64_t n) {
  const hsize_t count = static_cast<hsize_t>(std::max<std::int64_t>(n, 1));
  Id space(H5Screate_simple(1, &count, nullptr), "H5Screate_simple");
  if (n == 0) check(H5Sselect_none(space), "H5Sselect_none");
  return space;
}

/// The file and memory dataspaces for the flat elements [begin, begin + n) of a dataset of `dims`:
/// the same union of boxes selected in both. With a 1-d memory space HDF5 1.10 maps element by
/// element (measured 5-8x slower); with identical selections it copies whole runs.
struct FlatSelection {
  Id file_space, mem_space;
};
inline FlatSelection select_flat_range(hid_t dataset, const std::vector<std::int64_t>& dims, std::int64_t begin, std::int64_t n) {
  const auto boxes = flat_range_boxes(dims, begin, begin + n);
  FlatSelection sel{select_boxes(dataset, boxes), Id()};
  std::vector<hsize_t> d(dims.begin(), dims.end());
  sel.mem_space = Id(H5Screate_simple(static_cast<int>(d.size()), d.data(), nullptr), "H5Screate_simple");
  check(H5Sselect_none(sel.mem_space), "H5Sselect_none");
  for (const auto& b : boxes) {
    std::vector<hsize_t> start(b.start.begin(), b.start.end()), count(b.count.begin(), b.count.end());
    check(H5Sselect_hyperslab(sel.mem_space, H5S_SELECT_OR, start.data(), nullptr, count.data(), nullptr), "H5Sselect_hyperslab");
  }
  return sel;
}

/// Writes the flat elements [begin, end) of a tensor of `shape` from `data` (end - begin elements of
/// type `t`). With a collective `dxpl` every rank must call this for the dataset, possibly with an
/// empty range.
inline void write_flat_range(hid_t dataset, const std::vector<std::int64_t>& shape, std::int64_t begin, std::int64_t end, ElementType t,
                             const void* data, hid_t dxpl, const std::string& where) {
  const std::int64_t n = std::max<std::int64_t>(0, end - begin);
  std::vector<std::int64_t> dims = shape;
  if (dims.empty()) dims.push_back(1);
  // A dataset without elements has no storage to write (every rank knows: no collective mismatch).
  if (std::any_of(dims.begin(), dims.end(), [](std::int64_t d) { return d == 0; })) return;
  Id mem_type = file_type(t);
  if (n == 0) {  // take part in the collective call with nothing selected
    Id file_space(H5Dget_space(dataset), "H5Dget_space");
    check(H5Sselect_none(file_space), "H5Sselect_none");
    Id mem_space = memory_space(0);
    check(H5Dwrite(dataset, mem_type, mem_space, file_space, dxpl, nullptr), "cannot write " + where);
    return;
  }
  const auto sel = select_flat_range(dataset, dims, begin, n);
  // The memory space spans the whole tensor: HDF5 addresses `data` as if it held element 0, and
  // touches only the selected elements [begin, end).
  const char* base = static_cast<const char*>(data) - begin * static_cast<std::int64_t>(element_size(t));
  check(H5Dwrite(dataset, mem_type, sel.mem_space, sel.file_space, dxpl, base), "cannot write " + where);
}

inline std::string coordinates_text(const std::vector<hsize_t>& at) { return "[" + comma_separated(at) + "]"; }

/// Refuses a chunked dataset whose stored chunks cannot be what a checkpoint writer produced before
/// HDF5 decodes them: libhdf5 1.10's Fletcher32 filter reads out of bounds on a chunk shorter than its
/// 4-byte checksum (a damaged chunk index), so a damaged file must be caught here, not in the library.
/// Checks the chunks that `boxes` touch: each allocated one has no filter skipped and, when Fletcher32
/// is the only filter, exactly the chunk's bytes plus the checksum.
inline void check_stored_chunks(hid_t dataset, const std::vector<Box>& boxes, const std::string& where) {
  Id dcpl(H5Dget_create_plist(dataset), "H5Dget_create_plist");
  if (H5Pget_layout(dcpl) != H5D_CHUNKED) return;
  const int rank = H5Pget_chunk(dcpl, 0, nullptr);
  if (rank <= 0) throw CheckpointError("cannot read " + where + ": chunked dataset without a chunk shape (corrupt file)");
  std::vector<hsize_t> chunk(static_cast<std::size_t>(rank));
  check(H5Pget_chunk(dcpl, rank, chunk.data()), "H5Pget_chunk");
  const int filters = check(H5Pget_nfilters(dcpl), "H5Pget_nfilters");
  bool fletcher = false;
  for (int f = 0; f < filters; ++f) {
    unsigned flags = 0;
    std::size_t nvalues = 0;
    const H5Z_filter_t id = check(H5Pget_filter2(dcpl, static_cast<unsigned>(f), &flags, &nvalues, nullptr, 0, nullptr, nullptr), "H5Pget_filter2");
    fletcher = fletcher || id == H5Z_FILTER_FLETCHER32;
  }
  if (!fletcher) return;
  Id type(H5Dget_type(dataset), "H5Dget_type");
  hsize_t chunk_bytes = H5Tget_size(type);
  for (const auto c : chunk) chunk_bytes *= c;
  const hsize_t checksum_bytes = 4;
  // Chunks shared by two boxes (at their boundaries) are looked up twice: cheaper than remembering all.
  for (const auto& b : boxes) {
    if (b.start.size() != chunk.size()) throw CheckpointError("cannot read " + where + ": chunk rank differs from the dataset's (corrupt file)");
    std::vector<hsize_t> first(chunk.size()), last(chunk.size()), at(chunk.size());
    for (std::size_t d = 0; d < chunk.size(); ++d) {
      if (chunk[d] == 0) throw CheckpointError("cannot read " + where + ": zero chunk extent (corrupt file)");
      first[d] = static_cast<hsize_t>(b.start[d]) / chunk[d];
      last[d] = static_cast<hsize_t>(b.start[d] + b.count[d] - 1) / chunk[d];
    }
    at = first;
    while (true) {
      {
        std::vector<hsize_t> offset(chunk.size());
        for (std::size_t d = 0; d < chunk.size(); ++d) offset[d] = at[d] * chunk[d];
        unsigned filter_mask = 0;
        haddr_t address = HADDR_UNDEF;
        hsize_t stored = 0;
        check(H5Dget_chunk_info_by_coord(dataset, offset.data(), &filter_mask, &address, &stored), "cannot read " + where + " (corrupt chunk index)");
        const bool allocated = address != HADDR_UNDEF;  // a stored size of 0 at an address is damage too
        if (allocated && (filter_mask != 0 || stored < checksum_bytes || (filters == 1 && stored != chunk_bytes + checksum_bytes)))
          throw CheckpointError("cannot read " + where + ": the chunk at " + coordinates_text(offset) + " is stored as " + std::to_string(stored) +
                                " bytes with filter mask " + std::to_string(filter_mask) + ", expected " +
                                std::to_string(chunk_bytes + checksum_bytes) + " checksummed bytes (corrupt file)");
      }
      std::size_t d = chunk.size();
      while (d-- > 0) {
        if (++at[d] <= last[d]) break;
        at[d] = first[d];
      }
      if (d == static_cast<std::size_t>(-1)) break;
    }
  }
}

/// Reads the flat elements [begin, end) of dataset (logical `shape`) into `data`, converting the
/// stored element type to `t`. Checksums of every chunk touched are verified by HDF5.
inline void read_flat_range(hid_t dataset, const std::vector<std::int64_t>& shape, std::int64_t begin, std::int64_t end, ElementType t, void* data,
                            const std::string& where) {
  const std::int64_t n = std::max<std::int64_t>(0, end - begin);
  if (n == 0) return;
  std::vector<std::int64_t> dims = shape;
  if (dims.empty()) dims.push_back(1);
  check_stored_chunks(dataset, flat_range_boxes(dims, begin, begin + n), where);
  const auto sel = select_flat_range(dataset, dims, begin, n);
  Id mem_type = file_type(t);
  char* base = static_cast<char*>(data) - begin * static_cast<std::int64_t>(element_size(t));
  check(H5Dread(dataset, mem_type, sel.mem_space, sel.file_space, H5P_DEFAULT, base),
        "cannot read " + where + " (corrupt data or checksum mismatch)");
}

}  // namespace fsdp::h5
