// A map that several threads may use at once (torch layer): the engines' registries, which fsdp::forward
// reads on the forward thread, autograd's hooks and nodes on its worker threads (one per GPU), and
// engines being built or destroyed on any thread.
#pragma once

#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

namespace fsdp::detail {

template <class Key, class Value>
class LockedMap {
 public:
  std::optional<Value> find(const Key& key) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = map_.find(key);
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }
  void set(const Key& key, Value value) {
    std::lock_guard<std::mutex> lock(mutex_);
    map_[key] = std::move(value);
  }
  /// Erases `key` if its value satisfies `pred`.
  template <class Pred>
  void erase_if(const Key& key, Pred&& pred) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (const auto it = map_.find(key); it != map_.end() && pred(it->second)) map_.erase(it);
  }
  void erase(const Key& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    map_.erase(key);
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<Key, Value> map_;
};

}  // namespace fsdp::detail
