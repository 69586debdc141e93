// Gradient reductions overlapped with the rest of backward (torch layer): a unit's reduce-scatter and
// replica reduction run on the collective worker (MPI), or are issued as non-blocking collectives that
// progress on their own (a GPU stream), while backward goes on; at the end of backward the results are
// waited for in submission order and summed per unit, so the engine can add them to the shards'
// gradients exactly as AccumulateGrad would (bit-identical to reducing synchronously on the worker).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <utility>
#include <vector>

#include "fsdp/comm/collective_worker.hpp"
#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/watchdog.hpp"
#include "fsdp/torch/options.hpp"
#include "fsdp/trace.hpp"

namespace fsdp::detail {

class OverlappedReductions {
 public:
  /// Sharded units keep at most this many unreduced full-size gradients waiting (a memory bound);
  /// NO_SHARD's gradients are full-size anyway.
  static constexpr int kMaxShardedInFlight = 2;
  /// A unit's reduced shard gradient in its master shard's dtype and memory.
  using ToMaster = std::function<torch::Tensor(int unit, const torch::Tensor& shard_grad)>;

  OverlappedReductions(OverlapStats& stats, ToMaster to_master) : stats_(stats), to_master_(std::move(to_master)) {}
  /// Runs submit()'s collectives on `worker` (else only submit_issued() is used).
  void use_worker(CollectiveWorker& worker) { worker_ = &worker; }

  OverlappedReductions(const OverlappedReductions&) = delete;
  OverlappedReductions& operator=(const OverlappedReductions&) = delete;
  ~OverlappedReductions() { discard(); }

  /// Queues unit `unit`'s reduction: `collectives` (on the worker's duplicate groups; it holds its
  /// buffers) write the reduced gradient into `result`. Waits first for the oldest sharded ones beyond
  /// kMaxShardedInFlight.
  void submit(int unit, bool sharded, std::function<void()> collectives, const torch::Tensor& result) {
    make_room(sharded);
    auto done = worker_->submit([collectives = std::move(collectives), unit] {
      CollectiveWatchdog::instance().set_unit(unit);
      collectives();
      CollectiveWatchdog::instance().set_unit(-1);
    });
    pending_.push_back({unit, sharded, std::move(done), result});
  }

  /// Queues unit `unit`'s reduction already issued as non-blocking collectives: `done`, when waited
  /// for, orders their result for this thread and keeps their buffers alive until then.
  void submit_issued(int unit, bool sharded, std::shared_future<void> done, const torch::Tensor& result) {
    make_room(sharded);
    pending_.push_back({unit, sharded, std::move(done), result});
  }

  /// Waits for every queued reduction and returns, per unit in the order they finished, the sum of
  /// its reduced gradients of this backward (a unit called twice sends two, summed first as
  /// autograd's input buffer does). On an error the rest are still waited for (the worker writes
  /// into their buffers) and the first error is rethrown.
  std::vector<std::pair<int, torch::Tensor>> finish() {
    std::exception_ptr first;
    while (!pending_.empty()) {
      try {
        finish_oldest();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    auto out = std::exchange(reduced_, {});
    if (first) std::rethrow_exception(first);
    return out;
  }

  /// Waits for and drops everything queued (after a backward that threw: its results must not reach
  /// a later step).
  void discard() noexcept {
    for (auto& r : pending_) {
      try {
        r.done.wait();
      } catch (...) {}
    }
    pending_.clear();
    reduced_.clear();
  }

 private:
  struct Pending {
    int unit = -1;
    bool sharded = false;  // holds a full-size unit gradient until reduced
    std::shared_future<void> done;
    torch::Tensor shard_grad;  // the worker's result
  };

  void make_room(bool sharded) {
    ++stats_.reductions_overlapped;
    if (sharded)
      while (in_flight_sharded() >= kMaxShardedInFlight) finish_oldest();
  }

  int in_flight_sharded() const {
    return static_cast<int>(std::count_if(pending_.begin(), pending_.end(), [](const Pending& r) { return r.sharded; }));
  }

  void finish_oldest() {
    Pending r = std::move(pending_.front());
    pending_.pop_front();
    const auto began = std::chrono::steady_clock::now();
    {
      const TraceScope traced("wait for gradient reduction", "comm", {{"unit", static_cast<double>(r.unit)}});
      const CollectiveWatchdog::Scope watched("gradient reduction (overlapped, waiting for the worker)");
      r.done.get();  // rethrows the collective's CommError
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    stats_.exposed_reduce_seconds += waited;
    stats_.waited_for_worker_seconds += waited;
    torch::NoGradGuard no_grad;
    torch::Tensor grad = to_master_(r.unit, r.shard_grad);
    const auto it = std::find_if(reduced_.begin(), reduced_.end(), [&](const auto& e) { return e.first == r.unit; });
    if (it == reduced_.end())
      reduced_.emplace_back(r.unit, grad);
    else
      it->second = it->second + grad;
  }

  CollectiveWorker* worker_ = nullptr;
  OverlapStats& stats_;
  ToMaster to_master_;
  std::deque<Pending> pending_;                         // this backward's reductions, oldest first
  std::vector<std::pair<int, torch::Tensor>> reduced_;  // finished: unit -> its summed gradient, in finishing order
};

}  // namespace fsdp::detail
