// Flat-parameter layout math (core layer: std only, constexpr, no MPI, no LibTorch).
//
// A unit's parameters are flattened in registration order and concatenated into one flat vector of
// `numel` elements, padded to `padded = shard * G` where `shard = ceil(numel / G)` for a shard group of
// G ranks. Rank r owns [r * shard, (r + 1) * shard). A shard may be partly or wholly padding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "fsdp/errors.hpp"

namespace fsdp {

/// A half-open range [begin, end) of flat element indices.
struct FlatRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  constexpr std::int64_t numel() const noexcept { return end > begin ? end - begin : 0; }
  constexpr bool empty() const noexcept { return numel() == 0; }
  friend constexpr bool operator==(const FlatRange&, const FlatRange&) = default;
};

/// Elements per rank for `numel` elements over `group_size` ranks (ceil division).
constexpr std::int64_t shard_numel(std::int64_t numel, std::int64_t group_size) {
  if (group_size <= 0) throw ConfigError("shard group size must be positive, got " + std::to_string(group_size));
  if (numel < 0) throw ConfigError("numel must be non-negative, got " + std::to_string(numel));
  return (numel + group_size - 1) / group_size;
}

/// Flat length after padding to a multiple of the group size.
constexpr std::int64_t padded_numel(std::int64_t numel, std::int64_t group_size) { return shard_numel(numel, group_size) * group_size; }

/// The flat range rank `rank` owns (may extend into padding).
constexpr FlatRange shard_range(std::int64_t numel, std::int64_t group_size, std::int64_t rank) {
  const std::int64_t shard = shard_numel(numel, group_size);
  return {rank * shard, (rank + 1) * shard};
}

/// With the optimizer sharded over the world (OptimizerSharding::WORLD), the group shard of `shard`
/// elements is split again over `replicas` ranks like a flat parameter over a group: replica q updates
/// [q * part, (q + 1) * part) of it with part = ceil(shard / replicas); the last part may run past the
/// shard, and with more replicas than elements whole parts may lie past it (padding, always zero).
constexpr FlatRange replica_part_range(std::int64_t shard, std::int64_t replicas, std::int64_t replica_rank) {
  return shard_range(shard, replicas, replica_rank);
}

/// Intersection of two ranges (empty if disjoint).
constexpr FlatRange intersect(FlatRange a, FlatRange b) noexcept {
  const std::int64_t lo = std::max(a.begin, b.begin);
  const std::int64_t hi = std::min(a.end, b.end);
  return hi > lo ? FlatRange{lo, hi} : FlatRange{lo, lo};
}

/// The part of one parameter that lies in one rank's shard (or in a part of it).
struct ParamSlice {
  std::int64_t param_index = 0;   ///< which parameter of the unit
  std::int64_t param_offset = 0;  ///< first element inside the parameter (flattened)
  std::int64_t shard_offset = 0;  ///< where that element sits inside the rank's shard
  std::int64_t numel = 0;         ///< elements in the slice
  friend constexpr bool operator==(const ParamSlice&, const ParamSlice&) = default;
};

/// Layout of one unit's flat parameter over a shard group.
class FlatLayout {
 public:
  constexpr FlatLayout() = default;
  constexpr FlatLayout(std::vector<std::int64_t> param_numels, std::int64_t group_size) : numels_(std::move(param_numels)), group_size_(group_size) {
    std::int64_t offset = 0;
    offsets_.reserve(numels_.size());
    for (std::int64_t n : numels_) {
      if (n < 0) throw ConfigError("parameter numel must be non-negative");
      offsets_.push_back(offset);
      offset += n;
    }
    numel_ = offset;
    shard_ = fsdp::shard_numel(numel_, group_size_);
  }

  constexpr std::int64_t num_params() const noexcept { return static_cast<std::int64_t>(numels_.size()); }
  constexpr std::int64_t numel() const noexcept { return numel_; }
  constexpr std::int64_t group_size() const noexcept { return group_size_; }
  constexpr std::int64_t shard_numel() const noexcept { return shard_; }
  constexpr std::int64_t padded_numel() const noexcept { return shard_ * group_size_; }
  constexpr std::int64_t padding() const noexcept { return padded_numel() - numel_; }
  constexpr std::int64_t param_offset(std::int64_t i) const { return offsets_.at(static_cast<std::size_t>(i)); }
  constexpr std::int64_t param_numel(std::int64_t i) const { return numels_.at(static_cast<std::size_t>(i)); }
  constexpr FlatRange param_range(std::int64_t i) const { return {param_offset(i), param_offset(i) + param_numel(i)}; }
  constexpr FlatRange rank_range(std::int64_t rank) const {
    if (rank < 0 || rank >= group_size_) throw ConfigError("rank " + std::to_string(rank) + " outside shard group of " + std::to_string(group_size_));
    return {rank * shard_, (rank + 1) * shard_};
  }
  /// Elements of `rank`'s shard that are real (not padding).
  constexpr std::int64_t real_numel(std::int64_t rank) const { return intersect(rank_range(rank), {0, numel_}).numel(); }

  /// The part of parameter `i` inside the flat range `range` (a shard, or the part of one a replica
  /// owns); shard_offset counts from range.begin; numel 0 when they do not meet.
  constexpr ParamSlice slice_in(std::int64_t i, FlatRange range) const {
    const FlatRange hit = intersect(range, param_range(i));
    if (hit.empty()) return {i, 0, 0, 0};
    return {i, hit.begin - param_offset(i), hit.begin - range.begin, hit.numel()};
  }

  /// The parameter slices that lie in `rank`'s shard, in flat order.
  constexpr std::vector<ParamSlice> slices(std::int64_t rank) const {
    const FlatRange mine = rank_range(rank);
    std::vector<ParamSlice> out;
    for (std::int64_t i = 0; i < num_params(); ++i)
      if (const ParamSlice s = slice_in(i, mine); s.numel > 0) out.push_back(s);
    return out;
  }

 private:
  std::vector<std::int64_t> numels_;
  std::vector<std::int64_t> offsets_;
  std::int64_t group_size_ = 1;
  std::int64_t numel_ = 0;
  std::int64_t shard_ = 0;
};

// Compile-time checks of the worked example in docs/design.md: numels 6 + 3 + 1 at G = 4.
static_assert(shard_numel(10, 4) == 3);
static_assert(padded_numel(10, 4) == 12);
static_assert(shard_range(10, 4, 3) == FlatRange{9, 12});
static_assert(shard_numel(1, 3) == 1 && padded_numel(1, 3) == 3);
static_assert(shard_numel(0, 2) == 0);
static_assert(FlatLayout({6, 3, 1}, 4).real_numel(3) == 1);
static_assert(FlatLayout({6, 3, 1}, 3).slices(1).size() == 2);
static_assert(FlatLayout({6, 3, 1}, 4).slices(3)[0] == ParamSlice{2, 0, 0, 1});
static_assert(replica_part_range(3, 2, 1) == FlatRange{2, 4});  // the last part runs one element into padding

}  // namespace fsdp
