// Weighted mixtures of data sources: the blend (see mixture.hpp).
#include "mixture.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "data.hpp"

namespace fsdp::app {

namespace {
/// Shares are integers over 2^40: exact comparisons on every platform, and a rounding of at most
/// 2^-41 per share, far below one sample in any run.
constexpr std::int64_t kShareScale = std::int64_t{1} << 40;
/// Source s's seeds are the run's moved by a multiple of this odd constant (the golden ratio's
/// 64-bit fraction), plus the source's epoch as DistributedSampler adds the run's.
constexpr std::uint64_t kSourceSeedStride = 0x9E3779B97F4A7C15ULL;
}  // namespace

Blend::Blend(const std::vector<double>& weights, std::vector<std::int64_t> sizes, bool shuffle, std::uint64_t seed)
    : sizes_(std::move(sizes)), shuffle_(shuffle), seed_(seed) {
  if (weights.empty() || weights.size() != sizes_.size())
    throw DataError("a mixture needs one weight per source and at least one source (" + std::to_string(weights.size()) + " weights, " +
                    std::to_string(sizes_.size()) + " sources)");
  double largest = 0;
  for (std::size_t s = 0; s < weights.size(); ++s) {
    if (!std::isfinite(weights[s]) || weights[s] <= 0) throw DataError("source " + std::to_string(s) + " of the mixture: weight must be > 0");
    if (sizes_[s] < 1) throw DataError("source " + std::to_string(s) + " of the mixture holds no sample");
    largest = std::max(largest, weights[s]);
  }
  double sum = 0;  // of the weights over the largest: finite whatever their scale
  for (double w : weights) sum += w / largest;
  offsets_.push_back(0);
  for (std::size_t s = 0; s < weights.size(); ++s) {
    scaled_weights_.push_back(std::max<std::int64_t>(1, std::llround(weights[s] / largest / sum * static_cast<double>(kShareScale))));
    scale_ += scaled_weights_.back();
    offsets_.push_back(offsets_.back() + sizes_[s]);
  }
  drawn_.assign(sizes_.size(), 0);
  mark_drawn_ = drawn_;
  perm_epoch_.assign(sizes_.size(), -1);
  perms_.resize(sizes_.size());
}

std::size_t Blend::source_of(std::int64_t index) const {
  if (index < 0 || index >= total_size())
    throw DataError("mixture sample " + std::to_string(index) + " out of range [0, " + std::to_string(total_size()) + ")");
  return static_cast<std::size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), index) - offsets_.begin() - 1);
}

double Blend::share(std::size_t source) const { return static_cast<double>(scaled_weights_.at(source)) / static_cast<double>(scale_); }

std::size_t Blend::next_source() const {
  // Deficit of s before draw next_: share_s * (next_ + 1) - drawn_s, in units of 1 / scale_.
  std::size_t best = 0;
  __int128 best_deficit = 0;
  for (std::size_t s = 0; s < sizes_.size(); ++s) {
    const __int128 deficit = static_cast<__int128>(scaled_weights_[s]) * (next_ + 1) - static_cast<__int128>(drawn_[s]) * scale_;
    if (s == 0 || deficit > best_deficit) best = s, best_deficit = deficit;
  }
  return best;
}

void Blend::advance_to(std::int64_t n) {
  if (n < next_) {  // back to the last draws()'s start, or replay from draw 0: the blend is a function of the draw number alone
    next_ = n >= mark_next_ ? mark_next_ : 0;
    drawn_ = n >= mark_next_ ? mark_drawn_ : std::vector<std::int64_t>(sizes_.size(), 0);
  }
  for (; next_ < n; ++next_) ++drawn_[next_source()];
}

std::int64_t Blend::sample_of(std::size_t s, std::int64_t k) {
  const std::int64_t size = sizes_[s], epoch = k / size, position = k % size;
  if (!shuffle_) return position;
  if (perm_epoch_[s] != epoch) {
    perms_[s] = random_permutation(size, seed_ + kSourceSeedStride * (s + 1) + static_cast<std::uint64_t>(epoch));
    perm_epoch_[s] = epoch;
  }
  return perms_[s][static_cast<std::size_t>(position)];
}

std::vector<std::int64_t> Blend::draws(std::int64_t first, std::int64_t count) {
  if (first < 0 || count < 0) throw DataError("mixture draws: first and count must be >= 0");
  advance_to(first);
  mark_next_ = next_;
  mark_drawn_ = drawn_;
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(count));
  for (std::int64_t g = 0; g < count; ++g, ++next_) {
    const std::size_t s = next_source();
    out.push_back(offsets_[s] + sample_of(s, drawn_[s]++));
  }
  return out;
}

std::vector<SourcePosition> Blend::positions_after(std::int64_t n) {
  if (n < 0) throw DataError("mixture positions: n must be >= 0");
  advance_to(n);
  std::vector<SourcePosition> out;
  for (std::size_t s = 0; s < sizes_.size(); ++s) out.push_back({drawn_[s], drawn_[s] / sizes_[s], drawn_[s] % sizes_[s]});
  return out;
}

}  // namespace fsdp::app
