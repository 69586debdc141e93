// Collectives queued on one in-order stream whose completion the host has not yet seen (comm layer,
// std only). They complete in the order they were queued, so the host polls from the oldest: the
// completed ones are released, and the oldest pending one is the only one whose deadline and errors
// matter (every later one waits behind it). Used by NcclComm, whose issuing thread releases and whose
// watcher thread only looks (both under the lane's lock); the logic needs no device and is tested with
// fake events (test_core).
#pragma once

#include <cstddef>
#include <deque>
#include <mutex>
#include <utility>

namespace fsdp {

template <class Entry>
class InOrderCompletions {
 public:
  void push(Entry entry) { entries_.push_back(std::move(entry)); }

  /// Releases (hands to `release`, oldest first) the entries `is_done` reports complete, stopping at
  /// the first that is not; returns that one (the oldest still pending) or nullptr when none is.
  template <class IsDone, class Release>
  Entry* drop_completed(IsDone&& is_done, Release&& release) {
    while (!entries_.empty()) {
      if (!is_done(entries_.front())) return &entries_.front();
      Entry done = std::move(entries_.front());
      entries_.pop_front();
      release(std::move(done));
    }
    return nullptr;
  }

  /// The oldest entry `is_done` does not report complete, or nullptr; releases nothing (for a thread
  /// that watches while another one owns the releasing).
  template <class IsDone>
  Entry* first_pending(IsDone&& is_done) {
    for (auto& e : entries_)
      if (!is_done(e)) return &e;
    return nullptr;
  }

  /// Calls `f` on every entry, oldest first.
  template <class F>
  void for_each(F&& f) {
    for (auto& e : entries_) f(e);
  }

  /// Hands every entry to `release` without asking (after the stream was drained or its work aborted).
  template <class Release>
  void release_all(Release&& release) {
    while (!entries_.empty()) {
      Entry e = std::move(entries_.front());
      entries_.pop_front();
      release(std::move(e));
    }
  }

  bool empty() const noexcept { return entries_.empty(); }
  std::size_t size() const noexcept { return entries_.size(); }

 private:
  std::deque<Entry> entries_;
};

/// One look of a watcher thread at `pending`, whose issuing thread holds `mutex` while it issues and
/// releases: skipped (an empty result) while that thread holds it, so the watcher never waits for it.
/// Otherwise, for the oldest entry `is_done` does not report complete, `fault_of(entry)` (an
/// optional); when that holds a fault, `on_fault(fault)` runs, still under the lock, and the fault is
/// returned for what must be done outside the lock (an abort that may take long).
template <class Mutex, class Entry, class IsDone, class FaultOf, class OnFault>
auto watch_oldest_pending(Mutex& mutex, InOrderCompletions<Entry>& pending, IsDone&& is_done, FaultOf&& fault_of, OnFault&& on_fault)
    -> decltype(fault_of(std::declval<Entry&>())) {
  std::unique_lock<Mutex> lock(mutex, std::try_to_lock);
  if (!lock.owns_lock()) return {};
  Entry* oldest = pending.first_pending(is_done);
  if (oldest == nullptr) return {};
  auto fault = fault_of(*oldest);
  if (fault) on_fault(*fault);
  return fault;
}

}  // namespace fsdp
