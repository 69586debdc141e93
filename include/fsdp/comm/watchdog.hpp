// A deadline on every blocking collective (comm layer, std only), like NCCL's watchdog: a rank that
// waits in one collective longer than the timeout prints which collective, which unit and which step,
// and ends its process (exit code kWatchdogExitCode); the launcher (mpirun, srun --kill-on-bad-exit)
// then ends the job, and ranks waiting elsewhere hit their own deadline. Off until configure().
//
// Cost on the hot path: a relaxed atomic load when off; a clock read and two atomic stores when on.
// Each thread that runs collectives (the main thread, the engine's collective worker when prefetching)
// has its own slot, so a collective on one thread cannot hide a stuck one on another.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "fsdp/comm/flight_recorder.hpp"

namespace fsdp {

inline constexpr int kWatchdogExitCode = 6;

class CollectiveWatchdog {
  static constexpr std::size_t kSlots = 4;
  struct Slot {
    std::atomic<std::int64_t> since_ns{0};
    std::atomic<const char*> op{nullptr};
    std::atomic<int> unit{-1};
  };

 public:
  static CollectiveWatchdog& instance() {
    static CollectiveWatchdog w;
    return w;
  }

  /// Starts watching with `timeout_s` (<= 0: off) for world rank `rank`. Call once, early.
  void configure(double timeout_s, int rank) {
    rank_ = rank;
    timeout_ns_.store(timeout_s > 0 ? static_cast<std::int64_t>(timeout_s * 1e9) : 0, std::memory_order_relaxed);
    if (timeout_s > 0 && !thread_started_.exchange(true)) std::thread([this] { watch(); }).detach();
  }
  bool enabled() const noexcept { return timeout_ns_.load(std::memory_order_relaxed) > 0; }

  /// What the process is doing, for the message: the FSDP unit (-1: none) and the training step.
  /// The unit is per thread (the collective worker gathers one unit while the main thread computes another).
  void set_unit(int unit) noexcept { slots_[thread_slot()].unit.store(unit, std::memory_order_relaxed); }
  void set_step(std::int64_t step) noexcept { step_.store(step, std::memory_order_relaxed); }
  int unit() const noexcept { return slots_[thread_slot()].unit.load(std::memory_order_relaxed); }
  std::int64_t step() const noexcept { return step_.load(std::memory_order_relaxed); }

  /// Marks one blocking collective (a string literal naming it) for its scope.
  class Scope {
   public:
    explicit Scope(const char* op) noexcept : w_(instance()) {
      if (!w_.enabled()) return;
      slot_ = &w_.slots_[thread_slot()];
      slot_->since_ns.store(now_ns(), std::memory_order_relaxed);
      slot_->op.store(op, std::memory_order_release);
    }
    ~Scope() {
      if (slot_) slot_->op.store(nullptr, std::memory_order_release);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CollectiveWatchdog& w_;
    Slot* slot_ = nullptr;
  };

 private:
  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  /// This thread's slot: a thread takes a free slot when it first runs a collective and gives it back
  /// when it ends (engines' collective workers come and go). More live threads than slots share them,
  /// which only weakens the deadline for the extra ones.
  static std::size_t thread_slot() noexcept {
    struct Holder {
      std::size_t index;
      bool owned;
      Holder() : index(0), owned(false) {
        auto& w = instance();
        for (std::size_t i = 0; i < kSlots; ++i) {
          bool expected = false;
          if (w.slot_taken_[i].compare_exchange_strong(expected, true)) {
            index = i;
            owned = true;
            return;
          }
        }
        index = w.shared_next_.fetch_add(1, std::memory_order_relaxed) % kSlots;
      }
      ~Holder() {
        if (owned) instance().slot_taken_[index].store(false);
      }
    };
    thread_local const Holder holder;
    return holder.index;
  }

  void watch() {
    for (;;) {
      const std::int64_t timeout = timeout_ns_.load(std::memory_order_relaxed);
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout > 0 && timeout < 10'000'000'000 ? timeout / 10'000'000 + 1 : 1000));
      if (timeout <= 0) continue;
      for (auto& slot : slots_) check(slot, timeout);
    }
  }

  void check(Slot& slot, std::int64_t timeout) {
    {
      const char* op = slot.op.load(std::memory_order_acquire);
      if (!op) return;
      const std::int64_t waited = now_ns() - slot.since_ns.load(std::memory_order_relaxed);
      if (waited < timeout || op != slot.op.load(std::memory_order_acquire)) return;
      const int unit = slot.unit.load(std::memory_order_relaxed);
      const std::int64_t step = step_.load(std::memory_order_relaxed);
      char where[96] = "";
      if (unit >= 0) std::snprintf(where, sizeof where, ", unit %d", unit);
      std::fprintf(stderr,
                   "[fsdp.comm.deadline] rank %d waited %.1f s in %s (step %lld%s): a peer rank is missing, stuck or called "
                   "another collective; ending the job (comm.timeout_s = %.1f, exit code %d)\n",
                   rank_, static_cast<double>(waited) / 1e9, op, static_cast<long long>(step), where, static_cast<double>(timeout) / 1e9,
                   kWatchdogExitCode);
      std::fflush(stderr);
      // The other ranks are stuck too, or about to be: give their dumps a moment, then say where the
      // ranks parted. Bounded, so that the job still ends soon after the deadline.
      if (const auto text = FlightRecorder::instance().dump_and_compare(std::min(10.0, static_cast<double>(timeout) / 1e9)); !text.empty()) {
        std::fprintf(stderr, "[fsdp.comm.deadline] rank %d: %s\n", rank_, text.c_str());
        std::fflush(stderr);
      }
      std::_Exit(kWatchdogExitCode);  // the launcher ends the other ranks
    }
  }

  std::atomic<std::int64_t> timeout_ns_{0};
  Slot slots_[kSlots];
  std::atomic<bool> slot_taken_[kSlots] = {};
  std::atomic<std::size_t> shared_next_{0};
  std::atomic<std::int64_t> step_{0};
  std::atomic<bool> thread_started_{false};
  int rank_ = 0;
};

}  // namespace fsdp
