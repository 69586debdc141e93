// The order in which a step's forward ran the nested units, and which unit to prefetch next (core
// layer: std only). Backward runs units in the reverse of this step's forward; the next forward is
// expected to follow the previous one's order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace fsdp {

class ExecutionOrder {
 public:
  /// A root forward begins: the order recorded so far becomes the previous step's.
  void begin_forward() {
    if (!current_.empty()) previous_ = std::move(current_);
    current_.clear();
  }
  /// A nested unit's forward begins (a unit called twice is recorded once, at its first call).
  void record(int unit) {
    if (std::find(current_.begin(), current_.end(), unit) == current_.end()) current_.push_back(unit);
  }
  /// The unit whose forward followed `unit`'s in the previous step (forward prefetch); -1 if none.
  int next_forward(int unit) const { return neighbour(previous_, unit, +1); }
  /// The unit whose backward comes after `unit`'s in this step: the one whose forward ran before it;
  /// after the root's (unit 0) backward begins, the last nested unit. -1 if none.
  int next_backward(int unit) const { return neighbour(current_, unit, -1); }
  const std::vector<int>& current() const noexcept { return current_; }

 private:
  static int neighbour(const std::vector<int>& order, int unit, int direction) {
    const auto it = std::find(order.begin(), order.end(), unit);
    if (it == order.end()) return direction < 0 && unit == 0 && !order.empty() ? order.back() : -1;
    const auto pos = (it - order.begin()) + direction;
    return pos >= 0 && pos < static_cast<std::ptrdiff_t>(order.size()) ? order[static_cast<std::size_t>(pos)] : -1;
  }
  std::vector<int> current_;   // nested units in the order this step's forward ran them
  std::vector<int> previous_;  // ... and the previous step's
};

}  // namespace fsdp
