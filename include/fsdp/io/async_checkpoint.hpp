// Asynchronous checkpoints (io layer; PyTorch DCP's async_save): training waits only while the state is
// copied to host buffers (CheckpointSnapshot); the save itself, every HDF5 call included, runs on one
// I/O thread over the snapshot's own communicators. At most one save is in flight: the next one waits
// for it. The checkpoint is committed (fsynced, renamed, `latest` moved, old ones pruned) by that
// thread only once written, exactly as a synchronous save does, so a crash during the write leaves
// the previous checkpoint as `latest`.
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>

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
/// The writing thread yields its core to training where the two share one (a node whose cores all run
/// ranks): the write only has to end before the next save. Linux threads have their own nice value.
/// Signals go to the training thread: the writing thread blocks them, so that no handler interrupts
/// a write (EINTR inside HDF5 or MPI-IO).
inline void prepare_writing_thread() {
#ifdef __linux__
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
#endif
}
}  // namespace detail

/// What starting an asynchronous save cost the training thread.
struct AsyncSaveStart {
  double waited_seconds = 0;           ///< for the previous save to finish
  double copy_seconds = 0;             ///< copying the state to the host buffers
  std::optional<SaveResult> previous;  ///< the previous save, if this call waited for it to finish
};

/// Parallel HDF5 is not thread-safe: while a save is in flight, the process must make no other HDF5
/// call (fsdp-train makes none during training; its export waits for the write).
template <class Engine>
class AsyncCheckpointer {
 public:
  /// Duplicates the engine's communicators for the I/O thread and one for agreeing on its progress.
  /// Collective over the engine's world.
  explicit AsyncCheckpointer(Engine& engine)
      : snapshot_(std::make_shared<CheckpointSnapshot<Engine>>(engine)), control_(detail::duplicate_as_mpi(engine.comm())) {
    // A thread waiting for a peer must not take the core training runs on.
    snapshot_->comm().set_waiting_yields_cpu(true);
    snapshot_->shard_comm().set_waiting_yields_cpu(true);
    snapshot_->replica_comm().set_waiting_yields_cpu(true);
  }

  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// A save still running is waited for (its outcome is lost: call wait() first to learn it). When an
  /// exception unwinds past this, the wait is bounded by the last save's collective_timeout_s: a
  /// rank failing alone must reach its abort even if the write cannot end (a peer died); the write,
  /// left running, never commits a partial checkpoint.
  ~AsyncCheckpointer() {
    if (!thread_.joinable()) return;
    if (std::uncaught_exceptions() > 0 && timeout_s_ > 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
      while (!outcome_->finished.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (!outcome_->finished.load(std::memory_order_acquire)) {
        thread_.detach();  // it holds the snapshot and the outcome itself
        return;
      }
    }
    thread_.join();
  }

  /// Waits for the save in flight (its failure is thrown, as CheckpointError, on every rank), copies the
  /// engine's and `optimizer`'s state to the host and starts saving it as save_checkpoint() would,
  /// on the I/O thread. The ranks first meet within `options.collective_timeout_s` (a rank that never
  /// comes: CommError fsdp.comm.deadline). Collective over the world.
  AsyncSaveStart save(Engine& engine, const torch::optim::Optimizer* optimizer, const std::string& dir, const TrainState& state,
                      const CheckpointOptions& options = {}) {
    using Clock = std::chrono::steady_clock;
    AsyncSaveStart start;
    const auto t0 = Clock::now();
    start.previous = wait();
    detail::arrive_together(control_, options, "save_checkpoint");
    const auto t1 = Clock::now();
    constexpr bool pending = detail::collectives_may_be_pending<Engine>();
    if constexpr (!pending) detail::synchronize_shards_of(engine);  // collective: every rank here, before any local failure can part them
    std::optional<std::string> error = detail::capture_error([&] {
      if constexpr (pending) {  // a GPU communicator fails at its deadline on every rank: agreed below, over MPI
        detail::synchronize_shards_of(engine);
        detail::synchronize_collectives_of(engine);  // before reading
      }
      snapshot_->capture(engine, optimizer);
      detail::synchronize_collectives_of(engine);  // the capture's own gathers
    });
    detail::agree(control_, error);
    start.waited_seconds = std::chrono::duration<double>(t1 - t0).count();
    start.copy_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
    timeout_s_ = options.collective_timeout_s;
    // Every rank arrived above: the writing threads need no deadline to meet (one may start late on a busy core).
    CheckpointOptions in_thread = options;
    in_thread.collective_timeout_s = 0;
    outcome_ = std::make_shared<Outcome>();
    in_flight_ = true;
    thread_ = std::thread([snapshot = snapshot_, outcome = outcome_, dir, state, in_thread] {
      detail::prepare_writing_thread();
      try {
        outcome->result = save_checkpoint(*snapshot, snapshot->optimizer(), dir, state, in_thread);
      } catch (...) {
        outcome->failure = std::current_exception();
      }
      outcome->finished.store(true, std::memory_order_release);
    });
    return start;
  }

  /// Allocates the host buffers for the state as it is now (call once the optimizer has state, e.g.
  /// after the first step), so that the first save holds training up no longer than the next ones.
  /// Local; not while a save is in flight (its thread reads those buffers).
  void reserve(Engine& engine, const torch::optim::Optimizer* optimizer) {
    if (in_flight_) throw CheckpointError("AsyncCheckpointer::reserve: a save is in flight");
    snapshot_->reserve(engine, optimizer);
  }

  /// Whether a save was started and has not been collected by poll() or wait().
  bool in_flight() const noexcept { return in_flight_; }

  /// The save in flight's result once it has finished on every rank; nothing while it is still
  /// running somewhere (or none is in flight). A failure is thrown on every rank. Collective over the
  /// world while a save is in flight (one small all-reduce), local otherwise.
  std::optional<SaveResult> poll() {
    if (!in_flight_) return std::nullopt;
    std::int32_t running_somewhere = outcome_->finished.load(std::memory_order_acquire) ? 0 : 1;
    control_.all_reduce(&running_somewhere, &running_somewhere, 1, DType::kInt32, ReduceOp::kMax);
    if (running_somewhere) return std::nullopt;
    return collect();
  }

  /// Blocks until the save in flight has finished and returns its result (nothing if none was in
  /// flight). A failure is thrown on every rank. Collective over the world while a save is in flight.
  std::optional<SaveResult> wait() {
    if (!in_flight_) return std::nullopt;
    return collect();
  }

  /// Host memory held by the staging buffers.
  std::int64_t staging_bytes() const { return snapshot_->staging_bytes(); }

 private:
  struct Outcome {
    std::atomic<bool> finished{false};
    std::optional<SaveResult> result;  // written by the I/O thread, read after join
    std::exception_ptr failure;
  };

  std::optional<SaveResult> collect() {
    thread_.join();
    in_flight_ = false;
    std::optional<std::string> error;
    if (outcome_->failure) error = detail::capture_error([&] { std::rethrow_exception(outcome_->failure); });
    detail::agree(control_, error);  // the save agreed already; this also covers a failure before its first collective
    return std::move(outcome_->result);
  }

  std::shared_ptr<CheckpointSnapshot<Engine>> snapshot_;  // shared with the I/O thread
  MpiComm control_;                                       // the training thread's agreement on the I/O thread's progress
  std::thread thread_;
  std::shared_ptr<Outcome> outcome_;
  bool in_flight_ = false;
  double timeout_s_ = 0;
};

}  // namespace fsdp
