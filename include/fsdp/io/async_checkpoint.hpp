// Asynchronous checkpoints (io layer; PyTorch DCP's async_save): training waits only while the state is
// copied to host buffers (CheckpointSnapshot); the save itself, every HDF5 call included, runs on an
// I/O thread over the snapshot's own communicators. With set_copy_in_background(true) (DCP's
// asynchronous staging) even most of the copy leaves the save: the I/O thread copies the shards and
// the optimizer state while training runs its next forward and backward, and wait_for_copies() must
// come before the next update. With `copies` host copies, up to that many saves are
// in flight: each is copied at once and written after the one before it (one HDF5 writer at a time, in
// order); a save that finds every copy busy waits for the oldest write. The checkpoint is committed
// (fsynced, renamed, `latest` moved, old ones pruned) by its thread only once written, exactly as a
// synchronous save does, so a crash during a write leaves the previous checkpoint as `latest`.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "fsdp/io/checkpoint_save.hpp"
#include "fsdp/io/checkpoint_snapshot.hpp"

namespace fsdp {

namespace detail {
/// Signals go to the training thread: the writing thread blocks them, so that no handler interrupts
/// a write (EINTR inside HDF5 or MPI-IO).
inline void block_signals_in_writing_thread() {
#ifdef __linux__
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
#endif
}
/// The writing thread yields its core to training where the two share one (a node whose cores all run
/// ranks): the write only has to end before the next save. Linux threads have their own nice value.
/// Called after a background copy, which the next update waits for, so that the copy is not also
/// behind another save's write on the core they share.
inline void lower_writing_thread_priority() {
#ifdef __linux__
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
#endif
}
}  // namespace detail

/// What starting an asynchronous save cost the training thread.
struct AsyncSaveStart {
  double waited_seconds = 0;           ///< for the previous save to finish
  double copy_seconds = 0;             ///< copying the state to the host buffers
  std::size_t background_bytes = 0;    ///< of the state, left to copy beside training (set_copy_in_background)
  std::optional<SaveResult> previous;  ///< the oldest save in flight, if this call waited for it to finish (every copy was busy)
  bool queued = false;                 ///< written after the save still in flight (a second host copy took it)
};

/// Parallel HDF5 is not thread-safe: while a save is in flight, the process must make no other HDF5
/// call (fsdp-train makes none during training; its export waits for the writes).
template <class Engine>
class AsyncCheckpointer {
 public:
  /// `copies` host copies of the state (1 or more), each with duplicates of the engine's communicators
  /// for its I/O thread, and one communicator for agreeing on their progress. Collective over the
  /// engine's world.
  explicit AsyncCheckpointer(Engine& engine, int copies = 1) : control_(detail::duplicate_as_mpi(engine.comm())) {
    if (copies < 1) throw CheckpointError("AsyncCheckpointer: copies must be at least 1, not " + std::to_string(copies));
    for (int i = 0; i < copies; ++i) {
      auto snapshot = std::make_shared<CheckpointSnapshot<Engine>>(engine);
      // A thread waiting for a peer must not take the core training runs on.
      snapshot->comm().set_waiting_yields_cpu(true);
      snapshot->shard_comm().set_waiting_yields_cpu(true);
      snapshot->replica_comm().set_waiting_yields_cpu(true);
      snapshots_.push_back(std::move(snapshot));
    }
  }

  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// Saves still running are waited for (their outcomes are lost: call wait() until !in_flight() first
  /// to learn them). When an exception unwinds past this, the wait is bounded by the last save's
  /// collective_timeout_s per save: a rank failing alone must reach its abort even if a write cannot end
  /// (a peer died); a write left running never commits a partial checkpoint.
  ~AsyncCheckpointer() {
    const bool unwinding = std::uncaught_exceptions() > 0;
    if (unwinding)
      for (auto& job : jobs_) job.outcome->cancelled.store(true);  // a save not yet begun is not written
    bool detached = false;
    for (auto& job : jobs_) {
      if (detached) {  // it waits for the detached one: it cannot begin either
        job.thread.detach();
        continue;
      }
      if (unwinding && timeout_s_ > 0) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
        while (!job.outcome->finished.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        if (!job.outcome->finished.load(std::memory_order_acquire)) {
          job.thread.detach();  // it holds its snapshot and outcome itself
          detached = true;
          continue;
        }
      }
      job.thread.join();
    }
  }

  /// Copies the engine's and `optimizer`'s state to a free host copy and starts saving it as
  /// save_checkpoint() would, on an I/O thread, after the saves still in flight. When every copy is
  /// busy, the oldest save is waited for first (its failure is thrown, as CheckpointError, on every
  /// rank). The ranks first meet within `options.collective_timeout_s` (a rank that never comes:
  /// CommError fsdp.comm.deadline). Collective over the world.
  AsyncSaveStart save(Engine& engine, const torch::optim::Optimizer* optimizer, const std::string& dir, const TrainState& state,
                      const CheckpointOptions& options = {}) {
    using Clock = std::chrono::steady_clock;
    AsyncSaveStart start;
    const auto t0 = Clock::now();
    if (jobs_.size() == snapshots_.size()) start.previous = wait();
    detail::arrive_together(control_, options, "save_checkpoint");
    const auto snapshot = free_snapshot();
    const auto t1 = Clock::now();
    constexpr bool pending = detail::collectives_may_be_pending<Engine>();
    if constexpr (!pending) detail::synchronize_shards_of(engine);  // collective: every rank here, before any local failure can part them
    std::optional<std::string> error = detail::capture_error([&] {
      if constexpr (pending) {  // a GPU communicator fails at its deadline on every rank: agreed below, over MPI
        detail::synchronize_shards_of(engine);
        detail::synchronize_collectives_of(engine);  // before reading
      }
      snapshot->capture(engine, optimizer, copy_in_background_);
      detail::synchronize_collectives_of(engine);  // the capture's own gathers
    });
    detail::agree(control_, error);
    start.waited_seconds = std::chrono::duration<double>(t1 - t0).count();
    start.copy_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
    start.background_bytes = snapshot->background_bytes();
    timeout_s_ = options.collective_timeout_s;
    // Every rank arrived above: the writing threads need no deadline to meet (one may start late on a busy core).
    CheckpointOptions in_thread = options;
    in_thread.collective_timeout_s = 0;
    auto outcome = std::make_shared<Outcome>();
    // The write before it must end first: one HDF5 writer at a time, and checkpoints committed in order.
    // If it failed (on every rank alike: a save agrees on its errors), this one is not written either,
    // so that nothing commits after a failure the run is about to stop on.
    std::shared_ptr<Outcome> before = jobs_.empty() ? nullptr : jobs_.back().outcome;
    start.queued = before && !before->finished.load(std::memory_order_acquire);
    std::thread thread([snapshot, outcome, before, dir, state, in_thread] {
      detail::block_signals_in_writing_thread();
      try {
        if (in_thread.on_stage) in_thread.on_stage("copying", state.step);
        snapshot->copy_rest();    // at once, even while the write before it goes on
        snapshot->finish_copy();  // the chunks wait_for_copies() took
        detail::lower_writing_thread_priority();
        std::optional<std::string> torn;
        if (snapshot->copy_torn())
          torn = "cannot save checkpoint step " + std::to_string(state.step) +
                 ": the state was updated while it was being copied to host memory (call AsyncCheckpointer::wait_for_copies() "
                 "before the optimizer step); not written";
        detail::agree(snapshot->comm(), torn);  // every rank's writer alike
        if (before) before->done.wait();
        if (outcome->cancelled.load() || (before && before->failure))
          throw CheckpointError("cannot save checkpoint step " + std::to_string(state.step) + ": not written, the background save before it failed");
        outcome->result = save_checkpoint(*snapshot, snapshot->optimizer(), dir, state, in_thread);
      } catch (...) {
        outcome->failure = std::current_exception();
      }
      outcome->finished.store(true, std::memory_order_release);
      outcome->written.set_value();
    });
    jobs_.push_back({snapshot, outcome, std::move(thread)});
    return start;
  }

  /// Allocates every host copy's buffers for the state as it is now (call once the optimizer has state,
  /// e.g. after the first step), so that the first save holds training up no longer than the next
  /// ones. Local; not while a save is in flight (its thread reads those buffers).
  void reserve(Engine& engine, const torch::optim::Optimizer* optimizer) {
    if (in_flight()) throw CheckpointError("AsyncCheckpointer::reserve: a save is in flight");
    for (auto& snapshot : snapshots_) snapshot->reserve(engine, optimizer);
  }

  /// Whether a save copies the shards and optimizer state in the background (host memory only; pairs
  /// on a GPU, and everything when the optimizer is sharded over the replicas, are copied at the
  /// save), beside training's next forward and backward: then nothing may change them (an optimizer
  /// step, a load, summon_full_params) before wait_for_copies() returns. A missed call is usually
  /// caught: a save whose state was written in place before its copy ended (as LibTorch's version
  /// counters tell: Adam's and the bf16-moment optimizer's updates; not a write through .data(), such
  /// as plain SGD's) fails on every rank and is not written. Default: off, the whole copy at the save.
  /// Local.
  void set_copy_in_background(bool on) noexcept { copy_in_background_ = on; }
  bool copy_in_background() const noexcept { return copy_in_background_; }

  /// Finishes the background copies of the saves in flight: this thread and the snapshot's copy
  /// threads less one take what is left of them (as a copy at the save would), and wait for the chunks
  /// the I/O thread holds. After it the engine's and the optimizer's state may change. Returns the
  /// seconds it took. Local; without background copies, nothing to do.
  double wait_for_copies() {
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& job : jobs_) job.snapshot->finish_copy(job.snapshot->copy_threads());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  /// Whether a background copy of a save in flight is not finished yet. Local.
  bool copying() const {
    return std::any_of(jobs_.begin(), jobs_.end(), [](const Job& j) { return !j.snapshot->copy_finished(); });
  }

  /// Whether a save was started and has not been collected by poll() or wait().
  bool in_flight() const noexcept { return !jobs_.empty(); }
  /// Saves started and not yet collected.
  int saves_in_flight() const noexcept { return static_cast<int>(jobs_.size()); }
  /// Whether a save now would wait for the oldest write (every host copy busy).
  bool every_copy_busy() const noexcept { return jobs_.size() == snapshots_.size(); }

  /// The oldest save in flight's result once it has finished on every rank; nothing while it is still
  /// running somewhere (or none is in flight). A failure is thrown on every rank. Collective over the
  /// world while a save is in flight (one small all-reduce), local otherwise.
  std::optional<SaveResult> poll() {
    if (!in_flight()) return std::nullopt;
    std::int32_t running_somewhere = jobs_.front().outcome->finished.load(std::memory_order_acquire) ? 0 : 1;
    control_.all_reduce(&running_somewhere, &running_somewhere, 1, DType::kInt32, ReduceOp::kMax);
    if (running_somewhere) return std::nullopt;
    return collect();
  }

  /// Blocks until the oldest save in flight has finished and returns its result (nothing if none was
  /// in flight); call until !in_flight() to wait for all. A failure is thrown on every rank.
  /// Collective over the world while a save is in flight.
  std::optional<SaveResult> wait() {
    if (!in_flight()) return std::nullopt;
    return collect();
  }

  /// Host memory held by the staging buffers, every copy.
  std::int64_t staging_bytes() const {
    std::int64_t bytes = 0;
    for (const auto& snapshot : snapshots_) bytes += snapshot->staging_bytes();
    return bytes;
  }

 private:
  struct Outcome {
    std::atomic<bool> finished{false};
    std::optional<SaveResult> result;  // written by the I/O thread, read after join
    std::exception_ptr failure;
    std::promise<void> written;  // set when the write has ended, however: the next save's thread starts then
    std::shared_future<void> done = written.get_future().share();
    std::atomic<bool> cancelled{false};  // set before it began: not to be written (an earlier save failed, or unwinding)
  };
  struct Job {
    std::shared_ptr<CheckpointSnapshot<Engine>> snapshot;
    std::shared_ptr<Outcome> outcome;
    std::thread thread;
  };

  /// A host copy no save in flight reads.
  std::shared_ptr<CheckpointSnapshot<Engine>> free_snapshot() const {
    for (const auto& snapshot : snapshots_)
      if (std::none_of(jobs_.begin(), jobs_.end(), [&](const Job& j) { return j.snapshot == snapshot; })) return snapshot;
    throw CheckpointError("AsyncCheckpointer: no free host copy");  // save() waits for one first
  }

  std::optional<SaveResult> collect() {
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    job.thread.join();
    std::optional<std::string> error;
    if (job.outcome->failure) error = detail::capture_error([&] { std::rethrow_exception(job.outcome->failure); });
    try {
      detail::agree(control_, error);  // the save agreed already; this also covers a failure before its first collective
    } catch (...) {
      for (auto& queued : jobs_) queued.outcome->cancelled.store(true);  // nothing commits after a failure
      throw;
    }
    return std::move(job.outcome->result);
  }

  std::vector<std::shared_ptr<CheckpointSnapshot<Engine>>> snapshots_;  // each shared with the I/O thread writing it
  MpiComm control_;                                                     // the training thread's agreement on the I/O threads' progress
  std::deque<Job> jobs_;                                                // saves in flight, oldest first
  double timeout_s_ = 0;
  bool copy_in_background_ = false;
};

}  // namespace fsdp
