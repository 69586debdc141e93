// Weighted mixtures of data sources (data.sources), blended as Megatron-LM blends datasets: each draw
// takes the next sample of the source furthest below its share of all draws so far. Application
// layer, plain C++20 like data.hpp: deterministic and platform independent (integer arithmetic for
// the blend, our own permutations for the sources' shuffles).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::app {

/// Where a source stands after some draws: its samples drawn so far (`drawn`), the epoch of the
/// source they are in (drawn / size) and the position in that epoch (drawn % size).
struct SourcePosition {
  std::int64_t drawn = 0, epoch = 0, position = 0;
};

/// A source's part of a run's draws so far (summary.json, sources.csv): the samples drawn, the share
/// asked and the share given, its epoch and position.
struct SourceShare {
  std::string path;
  double weight = 0, share = 0, drawn_share = 0;
  std::int64_t drawn = 0, epoch = 0, position = 0;
};

/// The blend of sources of `sizes` samples with `weights`. Draw g (g = 0, 1, ...) goes to the source
/// s with the largest deficit share_s * (g + 1) - drawn_s (the lowest s on a tie), so after any n draws
/// every source has drawn within one sample of share_s * n. A source's k-th draw is its sample
/// k % size in epoch k / size, read through that epoch's permutation when `shuffle` (seeded by `seed`,
/// the source and its epoch): each source is reshuffled in its own epochs, whatever the others do.
/// Samples are numbered as if the sources were concatenated: source s's sample j is offset(s) + j.
class Blend {
 public:
  /// DataError unless there is a source, every weight is finite and > 0, and every size >= 1.
  Blend(const std::vector<double>& weights, std::vector<std::int64_t> sizes, bool shuffle, std::uint64_t seed);

  std::size_t num_sources() const noexcept { return sizes_.size(); }
  /// The sum of the sizes: one epoch of the mixture.
  std::int64_t total_size() const noexcept { return offsets_.back(); }
  std::int64_t offset(std::size_t source) const { return offsets_.at(source); }
  /// The source of concatenated sample `index`.
  std::size_t source_of(std::int64_t index) const;
  /// Source s's share of the draws: weight_s / the sum of the weights (as the blend rounds it).
  double share(std::size_t source) const;

  /// The samples of draws [first, first + count) (concatenated numbering). Sequential calls are
  /// O(count x sources); an earlier `first` than the last call's end replays from draw 0.
  /// positions_after() inside the last call's range replays from its start.
  std::vector<std::int64_t> draws(std::int64_t first, std::int64_t count);
  /// Every source's position after the first `n` draws.
  std::vector<SourcePosition> positions_after(std::int64_t n);

 private:
  /// Advances the blend state (draw counter, per-source counts) to draw `n`.
  void advance_to(std::int64_t n);
  std::size_t next_source() const;
  /// Source s's sample for its `k`-th draw.
  std::int64_t sample_of(std::size_t s, std::int64_t k);

  std::vector<std::int64_t> sizes_, offsets_;
  std::vector<std::int64_t> scaled_weights_;  // share_s = scaled_weights_[s] / scale_
  std::int64_t scale_ = 0;
  bool shuffle_;
  std::uint64_t seed_;
  std::int64_t next_ = 0;            // draws made
  std::vector<std::int64_t> drawn_;  // per source, after next_ draws
  std::int64_t mark_next_ = 0;       // the state where the last draws() began (a checkpoint inside the epoch replays from it)
  std::vector<std::int64_t> mark_drawn_;
  std::vector<std::int64_t> perm_epoch_;  // the epoch of each cached permutation; -1: none
  std::vector<std::vector<std::int64_t>> perms_;
};

}  // namespace fsdp::app
