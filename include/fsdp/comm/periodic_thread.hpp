// A thread that runs a task at a fixed period until it is stopped (comm layer, std only). NcclComm's
// lane watcher runs on one: it ends a hung or failed collective while the host is blocked elsewhere
// (a device sync that reads a loss), as c10d's watchdog thread does. Tested in test_core (also under
// ThreadSanitizer).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace fsdp {

class PeriodicThread {
 public:
  PeriodicThread() = default;
  PeriodicThread(const PeriodicThread&) = delete;
  PeriodicThread& operator=(const PeriodicThread&) = delete;
  ~PeriodicThread() { stop(); }

  /// Runs `tick` every `period` on a new thread, the first time one period from now. An exception
  /// escaping `tick` is dropped (the next tick still runs): a watcher must outlive a failed poll.
  void start(std::chrono::nanoseconds period, std::function<void()> tick) {
    stop();
    shared_ = std::make_shared<Shared>();
    // The thread owns what it touches between ticks, so that it can be let go (stop's patience).
    thread_ = std::thread([shared = shared_, period, tick = std::move(tick)] {
      std::unique_lock<std::mutex> lock(shared->mutex);
      while (!shared->wake.wait_for(lock, period, [&] { return shared->stopping; })) {
        lock.unlock();
        try {
          tick();
        } catch (...) {}
        lock.lock();
      }
      shared->finished = true;
      shared->wake.notify_all();
    });
  }

  /// Wakes the thread and waits up to `patience` for it to end (after the tick it is running, if any);
  /// a tick still running then is let go (detached; it must not touch what its owner frees) and false
  /// is returned. Not from `tick`.
  bool stop(std::chrono::nanoseconds patience = std::chrono::nanoseconds::max()) noexcept {
    if (!thread_.joinable()) return true;
    bool finished = false;
    {
      std::unique_lock<std::mutex> lock(shared_->mutex);
      shared_->stopping = true;
      shared_->wake.notify_all();
      const auto done = [&] { return shared_->finished; };
      if (patience == std::chrono::nanoseconds::max())
        shared_->wake.wait(lock, done);
      else
        shared_->wake.wait_for(lock, patience, done);
      finished = shared_->finished;
    }
    if (finished)
      thread_.join();
    else
      thread_.detach();
    shared_.reset();
    return finished;
  }

  bool running() const noexcept { return thread_.joinable(); }

 private:
  struct Shared {
    std::mutex mutex;
    std::condition_variable wake;
    bool stopping = false;
    bool finished = false;
  };
  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

}  // namespace fsdp
