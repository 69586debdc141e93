// Row-major index math for writing a contiguous flat range of a tensor into an N-d dataset
// (core layer: std only, constexpr). A rank's shard covers a contiguous range of a parameter's
// flattened elements; in the parameter's logical shape that range is a union of at most 2*ndim-1
// rectangular boxes (a partial row at each end, whole rows between, recursively). HDF5 selects the
// union and maps it to a 1-d memory buffer in row-major order, which is the flat order.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace fsdp {

/// A rectangular block of an N-d index space.
struct Box {
  std::vector<std::int64_t> start;
  std::vector<std::int64_t> count;
  constexpr std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (const auto c : count) n *= c;
    return n;
  }
  constexpr bool operator==(const Box&) const = default;
};

namespace detail {

constexpr std::int64_t product(std::span<const std::int64_t> dims) noexcept {
  std::int64_t n = 1;
  for (const auto d : dims) n *= d;
  return n;
}

// Appends boxes covering flat offsets [begin, end) of the sub-tensor at dimension `level`, whose
// leading indices are fixed to `prefix`.
constexpr void append_boxes(std::span<const std::int64_t> shape, std::size_t level, std::vector<std::int64_t>& prefix, std::int64_t begin,
                            std::int64_t end, std::vector<Box>& out) {
  if (begin >= end) return;
  const auto box_from = [&](std::int64_t first_row, std::int64_t rows) {
    Box b;
    b.start = prefix;
    b.count.assign(prefix.size(), 1);
    b.start.push_back(first_row);
    b.count.push_back(rows);
    for (std::size_t d = level + 1; d < shape.size(); ++d) {
      b.start.push_back(0);
      b.count.push_back(shape[d]);
    }
    out.push_back(std::move(b));
  };
  const std::int64_t row = product(shape.subspan(level + 1));  // elements per index of this dimension
  if (level + 1 == shape.size()) return box_from(begin, end - begin);
  std::int64_t first = begin / row;
  const std::int64_t last = end / row;  // rows [first, last) are whole once the head is handled
  if (begin % row != 0) {
    const std::int64_t head_end = (first + 1) * row < end ? (first + 1) * row : end;
    prefix.push_back(first);
    append_boxes(shape, level + 1, prefix, begin - first * row, head_end - first * row, out);
    prefix.pop_back();
    if (head_end == end) return;
    ++first;
  }
  if (last > first) box_from(first, last - first);
  if (end % row != 0 && last >= first) {
    prefix.push_back(last);
    append_boxes(shape, level + 1, prefix, 0, end - last * row, out);
    prefix.pop_back();
  }
}

}  // namespace detail

/// Boxes, in row-major order, that together cover exactly the flat elements [begin, end) of a
/// tensor of `shape`. A 0-d tensor is treated as shape {1}. Empty for an empty range.
constexpr std::vector<Box> flat_range_boxes(std::span<const std::int64_t> shape, std::int64_t begin, std::int64_t end) {
  std::vector<Box> out;
  if (begin >= end) return out;
  if (shape.empty()) {
    const std::int64_t one[] = {1};
    std::vector<std::int64_t> prefix;
    detail::append_boxes(std::span<const std::int64_t>(one), 0, prefix, begin, end, out);
    return out;
  }
  std::vector<std::int64_t> prefix;
  detail::append_boxes(shape, 0, prefix, begin, end, out);
  return out;
}

namespace detail {
constexpr bool boxes_selftest() {
  const std::int64_t s[] = {7, 5};
  // Whole tensor: one box.
  if (flat_range_boxes(s, 0, 35) != std::vector<Box>{Box{{0, 0}, {7, 5}}}) return false;
  // Partial first row, whole rows, partial last row.
  const auto b = flat_range_boxes(s, 3, 22);
  if (b != std::vector<Box>{Box{{0, 3}, {1, 2}}, Box{{1, 0}, {3, 5}}, Box{{4, 0}, {1, 2}}}) return false;
  // Inside one row.
  if (flat_range_boxes(s, 6, 8) != std::vector<Box>{Box{{1, 1}, {1, 2}}}) return false;
  const std::int64_t t[] = {2, 3, 4};
  std::int64_t covered = 0;
  for (const auto& box : flat_range_boxes(t, 5, 19)) covered += box.numel();
  return covered == 14;
}
static_assert(boxes_selftest());
}  // namespace detail

}  // namespace fsdp
