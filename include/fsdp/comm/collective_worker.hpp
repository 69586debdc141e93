// A background thread that runs collectives in the order they were submitted (comm layer, std only).
//
// Why a thread: MPI's non-blocking collectives progress only inside MPI calls, and the main thread
// spends its time in LibTorch kernels, so an MPI_Iallgather issued before a unit's compute mostly
// runs when it is waited for. A thread that sits in the blocking collective moves the bytes while
// the main thread computes. Every rank submits the same collectives in the same program order, and
// the worker runs them one at a time on its own communicator (a duplicate of the shard group), so
// they match across ranks without interfering with the main thread's collectives on the original.
// MPI must provide MPI_THREAD_MULTIPLE.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <utility>

namespace fsdp::detail {

class CollectiveWorker {
 public:
  CollectiveWorker() : thread_([this] { loop(); }) {}
  /// Runs what is still queued first: peers wait for each of those collectives, and whether one has
  /// started differs between ranks, so none is dropped, even when unwinding from an error. A
  /// collective whose peers are gone ends at the communicator's deadline (MpiComm: the
  /// CollectiveWatchdog, fsdp-train's comm.timeout_s; NcclComm: NcclOptions::timeout_s).
  ~CollectiveWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }
  CollectiveWorker(const CollectiveWorker&) = delete;
  CollectiveWorker& operator=(const CollectiveWorker&) = delete;

  /// Queues `task`; the future completes when it has run (and rethrows what it threw).
  std::shared_future<void> submit(std::function<void()> task) {
    std::packaged_task<void()> packaged(std::move(task));
    std::shared_future<void> done = packaged.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(packaged));
    }
    wake_.notify_one();
    return done;
  }

 private:
  void loop() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();  // an exception is stored in the task's future
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace fsdp::detail
