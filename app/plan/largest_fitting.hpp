// Memory planning (app layer): the largest value for which a monotone "fits" predicate holds.
#pragma once

#include <cstdint>
#include <functional>

namespace fsdp::app {

// ==== 6. The largest model that fits ==================================================================

/// The largest value in [lo, ...) for which fits(v) holds, assuming fits is monotone (true then false);
/// 0 if not even `lo` fits. Stops at `cap` (returned if it still fits).
inline std::int64_t largest_fitting(std::int64_t lo, std::int64_t cap, const std::function<bool(std::int64_t)>& fits) {
  if (!fits(lo)) return 0;
  std::int64_t good = lo, bad = -1, probe = lo;
  while (bad < 0) {
    probe = std::min(cap, probe * 2);
    if (fits(probe)) {
      good = probe;
      if (probe == cap) return cap;
    } else {
      bad = probe;
    }
  }
  while (bad - good > 1) {
    const std::int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

}  // namespace fsdp::app
