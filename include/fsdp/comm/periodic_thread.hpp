// A thread that runs a task at a fixed period until it is stopped (comm layer, std only). NcclComm's
// lane watcher runs on one: it ends a hung or failed collective while the host is blocked elsewhere
// (a device sync that reads a loss), as c10d's watchdog thread does. Tested in test_core (also under
// ThreadSanitizer).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
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
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = false;
    }
    thread_ = std::thread([this, period, tick = std::move(tick)] {
      std::unique_lock<std::mutex> lock(mutex_);
      while (!wake_.wait_for(lock, period, [this] { return stopping_; })) {
        lock.unlock();
        try {
          tick();
        } catch (...) {
        }
        lock.lock();
      }
    });
  }

  /// Wakes the thread and waits for it to end (after the tick it is running, if any). Not from `tick`.
  void stop() noexcept {
    if (!thread_.joinable()) return;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  bool running() const noexcept { return thread_.joinable(); }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace fsdp
