// fsdp-train (app layer): what a long run needs watched on every rank, reported with the progress
// log: each rank's resident memory and its growth since warm-up (a leak ends a two-day job; warned
// past run.rss_growth_warn_mib), and which rank was slowest in the window and how long the others
// waited for it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "train/ranks.hpp"
#include "train/timing.hpp"

namespace fsdp::app {

/// One log window seen across the ranks.
struct RankReport {
  std::vector<double> rss_mib;        ///< per rank, now
  double max_rss_mib = 0;             ///< over the ranks
  int slowest_rank = 0;               ///< the rank whose own work (step time minus communication waits) took longest
  double others_waited_ms = 0;        ///< per step: how much longer the slowest rank worked than the others, on average
  std::vector<std::string> warnings;  ///< resident memory that grew past the threshold (rank 0 prints them)
};

class RankWatch {
 public:
  /// Resident memory grows at the start of a run (allocator pools, checkpoint staging, the first
  /// evaluation); growth is measured from the first log at least this many steps into the process
  /// and after the first evaluation and save.
  static constexpr std::int64_t kWarmupSteps = 100;

  /// `warn_mib`: run.rss_growth_warn_mib (0: never warn); `first_step`: the step this process starts at.
  RankWatch(int world_size, std::int64_t warn_mib, std::int64_t first_step)
      : warn_mib_(warn_mib),
        warmed_up_at_(first_step + kWarmupSteps),
        baseline_(static_cast<std::size_t>(world_size)),
        warned_(static_cast<std::size_t>(world_size), 0) {}

  /// Gathers every rank's resident memory and its own work in the window (`busy_s` over `steps`
  /// steps) at step `step`. Collective.
  RankReport observe(MpiComm& world, std::int64_t step, double busy_s, std::int64_t steps) {
    const std::size_t n = static_cast<std::size_t>(world.size());
    const double mine[2] = {current_rss_mb(), busy_s};
    std::vector<double> all(2 * n);
    world.all_gather(mine, all.data(), 2, fsdp::DType::kFloat64);
    RankReport r;
    r.rss_mib.resize(n);
    std::vector<double> busy(n);
    for (std::size_t k = 0; k < n; ++k) {
      r.rss_mib[k] = all[2 * k];
      busy[k] = all[2 * k + 1];
    }
    r.max_rss_mib = *std::max_element(r.rss_mib.begin(), r.rss_mib.end());
    const auto slowest = std::max_element(busy.begin(), busy.end());
    r.slowest_rank = static_cast<int>(slowest - busy.begin());
    if (n > 1 && steps > 0) {
      double behind = 0;
      for (std::size_t k = 0; k < n; ++k) behind += *slowest - busy[k];
      r.others_waited_ms = 1000 * behind / static_cast<double>(n - 1) / static_cast<double>(steps);
    }
    watch_growth(step, r);
    return r;
  }

  /// What raises resident memory once for good (glibc keeps the heap's high-water mark): the first
  /// evaluation's activations and the first checkpoint's buffers. Warm-up ends only after both (where
  /// the run has them): their first occurrence restarts it from the next step.
  enum class Occasion { kEvaluation, kSave };
  void first_time_restarts_warmup(Occasion occasion, std::int64_t step) {
    bool& seen = occasion == Occasion::kEvaluation ? seen_evaluation_ : seen_save_;
    if (seen) return;
    seen = true;
    warm_ = false;
    warmed_up_at_ = std::max(warmed_up_at_, step + 1);
  }

  /// Per rank: resident memory at the last log minus at the end of warm-up (the latest one, when a
  /// first save or evaluation restarted it); empty before warm-up ever ended.
  std::vector<double> growth_mib() const {
    if (!has_baseline_) return {};
    std::vector<double> g(last_.size());
    for (std::size_t k = 0; k < last_.size(); ++k) g[k] = last_[k] - baseline_[k];
    return g;
  }
  std::optional<std::int64_t> warm_since_step() const { return has_baseline_ ? std::optional<std::int64_t>(warm_step_) : std::nullopt; }

 private:
  void watch_growth(std::int64_t step, RankReport& r) {
    last_ = r.rss_mib;
    if (!warm_) {
      if (step < warmed_up_at_) return;
      warm_ = has_baseline_ = true;
      warm_step_ = step;
      baseline_ = r.rss_mib;
      std::fill(warned_.begin(), warned_.end(), 0);
      return;
    }
    if (warn_mib_ <= 0) return;
    for (std::size_t k = 0; k < r.rss_mib.size(); ++k) {
      const double grown = r.rss_mib[k] - baseline_[k];
      // Once per threshold crossed: a steady leak warns again after each further warn_mib.
      if (grown < static_cast<double>(warn_mib_) * static_cast<double>(warned_[k] + 1)) continue;
      warned_[k] = static_cast<std::int64_t>(grown / static_cast<double>(warn_mib_));
      char text[320];
      std::snprintf(text, sizeof text,
                    "warning: rank %zu's resident memory grew by %.0f MiB since step %lld (%.0f -> %.0f MiB), past run.rss_growth_warn_mib = %lld: "
                    "memory that keeps growing ends a long run (see docs/reliability.md, \"Long runs\")",
                    k, grown, static_cast<long long>(warm_step_), baseline_[k], r.rss_mib[k], static_cast<long long>(warn_mib_));
      r.warnings.emplace_back(text);
    }
  }

  std::int64_t warn_mib_;
  std::int64_t warmed_up_at_;
  bool warm_ = false;          // warnings are armed
  bool has_baseline_ = false;  // a warm-up ended once (growth is reported from it)
  bool seen_evaluation_ = false, seen_save_ = false;
  std::int64_t warm_step_ = 0;
  std::vector<double> baseline_, last_;
  std::vector<std::int64_t> warned_;
};

}  // namespace fsdp::app
