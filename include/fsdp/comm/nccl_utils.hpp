// One NCCL communicator's lifetime and abort (NcclState) and the stream communicators share with its
// watcher thread (NcclLane) (comm layer; CUDA runtime + NCCL + MPI, no LibTorch), apart from the
// collectives as c10d keeps NCCLUtils.hpp apart from ProcessGroupNCCL. Include
// fsdp/comm/nccl_comm.hpp, not this file.
//
// NcclState owns a non-blocking NCCL communicator (ncclConfig_t::blocking = 0): every wait (init,
// split, enqueue, completion, finalize) polls ncclCommGetAsyncError and a deadline, and past the
// deadline the communicator is aborted (ncclCommAbort) and CommError with id fsdp.comm.deadline is thrown.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/in_order_completions.hpp"
#include "fsdp/comm/mpi_comm.hpp"
#include "fsdp/comm/nccl_calls.hpp"
#include "fsdp/comm/periodic_thread.hpp"

namespace fsdp {

namespace detail {

// ---- the stream communicators share, and one NCCL communicator -------------------------------------

struct NcclState;
struct NcclLane;

/// A collective's completion event, shared by the lane's pending list (until the host sees it
/// complete) and a request (until its wait()); it goes back to the lane's spares when neither needs it.
struct CompletionEvent {
  cudaEvent_t event = nullptr;
  std::weak_ptr<NcclLane> lane;
  CompletionEvent(cudaEvent_t e, std::weak_ptr<NcclLane> l) : event(e), lane(std::move(l)) {}
  CompletionEvent(const CompletionEvent&) = delete;
  CompletionEvent& operator=(const CompletionEvent&) = delete;
  inline ~CompletionEvent();
};

/// Why a communicator was aborted: the CommError every later call on it throws.
struct NcclFault {
  std::string message;
  std::string id = "fsdp.comm";
};

/// The one CUDA stream on which a bootstrapped communicator and every communicator split from it run
/// their collectives, and its order against the compute stream. NCCL documents that collectives of
/// several communicators in flight at once can deadlock (a kernel waiting for its peers can keep
/// another communicator's from running); on one in-order stream they run one after another, in the
/// order they were issued, which is the same on every rank. Collectives are stream-ordered: the lane
/// waits for the compute stream (an event recorded there), the collective is queued, and the compute
/// stream waits for its completion event; the host goes on. `pending` keeps those completion events
/// until the host has seen them complete.
///
/// The lane's watcher thread looks at the oldest pending collective every tenth of the timeout the
/// lane was created with (at most 100 ms): NCCL's asynchronous error or its passed deadline aborts
/// every communicator of the lane. The aborted kernels end, so a host blocked in a device sync
/// elsewhere (LibTorch reading a loss) goes on, and the next call on any of the lane's communicators
/// throws that error. The issuing thread checks the same at each collective, wait and host wait, and
/// throws at once. The watcher never waits for the lock (a look is skipped while the issuing thread
/// holds it) and calls ncclCommAbort outside it, so neither thread can hold the other.
struct NcclLane : std::enable_shared_from_this<NcclLane> {
  struct Pending {
    std::shared_ptr<CompletionEvent> done;
    NcclState* owner;  // whose collective; cleared when that communicator is destroyed
    const char* op;
    Deadline deadline;
    int unit;  // the FSDP unit and training step it was issued in, for the deadline's message
    std::int64_t step;
  };

  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;                   // recorded on the compute stream before each collective
  cudaStream_t compute_stream = nullptr;         // 0: the default stream; used unless the hooks below are set
  std::function<void(void*)> record_on_compute;  // records a cudaEvent_t on the compute stream (the engine's: LibTorch's current stream)
  std::function<void(void*)> compute_waits_for;  // makes the compute stream wait for a cudaEvent_t
  // Guards `pending`, `spare`, `members`, `fault` and the members' NCCL handles and abort state: the
  // issuing thread and the watcher share them. Recursive: an abort found while issuing aborts every member.
  std::recursive_mutex mutex;
  InOrderCompletions<Pending> pending;
  std::vector<cudaEvent_t> spare;   // completion events to reuse
  std::vector<NcclState*> members;  // the live communicators with an NCCL handle on this lane
  std::optional<NcclFault> fault;   // set once the lane's communicators were aborted
  PeriodicThread watcher;           // last member: stopped first

  NcclLane(int dev, double timeout_s) : device(dev) {
    const CudaDeviceGuard on(device);
    FSDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const cudaError_t rc = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    if (rc != cudaSuccess) {
      cudaStreamDestroy(stream);
      throw_cuda_error("cudaEventCreateWithFlags(&ready, cudaEventDisableTiming)", rc, __FILE__, __LINE__);
    }
    watcher.start(watch_period(timeout_s), [this] { watch_once(); });
  }
  NcclLane(const NcclLane&) = delete;
  NcclLane& operator=(const NcclLane&) = delete;
  ~NcclLane() {
    // A watcher still inside ncclCommAbort after that (an abort that does not return) is let go, and
    // so are the stream and events its kernels may still hold: the process's end frees them.
    if (!watcher.stop(std::chrono::seconds(30))) return;
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    cudaStreamSynchronize(stream);        // every communicator of the lane is finalized or aborted by now
    pending.release_all([](Pending) {});  // the events are destroyed: this lane is gone for them
    for (cudaEvent_t e : spare) cudaEventDestroy(e);
    cudaEventDestroy(ready);
    cudaStreamDestroy(stream);
    if (switched) cudaSetDevice(previous);
  }

  static std::chrono::nanoseconds watch_period(double timeout_s) {
    const std::chrono::nanoseconds most = std::chrono::milliseconds(100);
    if (timeout_s <= 0) return most;  // NCCL's asynchronous errors are still watched
    const auto tenth = std::chrono::nanoseconds(static_cast<std::int64_t>(timeout_s * 1e8));
    return std::clamp(tenth, std::chrono::nanoseconds(std::chrono::milliseconds(1)), most);
  }

  /// The lane waits for everything already queued on the compute stream (the collective's inputs).
  void order_after_compute() {
    if (record_on_compute)
      record_on_compute(static_cast<void*>(ready));
    else
      FSDP_CUDA_CHECK(cudaEventRecord(ready, compute_stream));
    FSDP_CUDA_CHECK(cudaStreamWaitEvent(stream, ready, 0));
  }
  /// The compute stream waits for `done` (a collective's completion) before what is queued on it next.
  void order_compute_after(cudaEvent_t done) {
    if (compute_waits_for)
      compute_waits_for(static_cast<void*>(done));
    else
      FSDP_CUDA_CHECK(cudaStreamWaitEvent(compute_stream, done, 0));
  }
  std::shared_ptr<CompletionEvent> take_event() {
    cudaEvent_t e = nullptr;
    {
      const std::lock_guard<std::recursive_mutex> lock(mutex);
      if (!spare.empty()) {
        e = spare.back();
        spare.pop_back();
      }
    }
    if (e == nullptr) FSDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return std::make_shared<CompletionEvent>(e, weak_from_this());
  }

  /// Marks every communicator of the lane aborted with `why` (their collectives share this stream:
  /// behind a failed one, the order the ranks agreed on is gone) and hands over their NCCL handles, for
  /// ncclCommAbort outside the lock: `first`'s first (the owner of the collective that failed: aborting
  /// another one first could wait for that one's kernel). Under `mutex`.
  inline std::vector<ncclComm_t> mark_aborted(const NcclFault& why, NcclState* first);

  /// Aborts every communicator of the lane with `why`, `first`'s first (the issuing thread's path).
  inline void abort_all(const NcclFault& why, NcclState* first);

  /// The watcher's look at the oldest pending collective (see the struct's comment).
  inline void watch_once();

  /// Entries neither thread watches: complete (or their event failed: the issuing thread's release
  /// reports that), or of a communicator destroyed since (its collective ends with it).
  static bool not_watched(const Pending& p) noexcept { return p.owner == nullptr || cudaEventQuery(p.done->event) != cudaErrorNotReady; }
};

CompletionEvent::~CompletionEvent() {
  if (const auto l = lane.lock()) {
    const std::lock_guard<std::recursive_mutex> lock(l->mutex);
    l->spare.push_back(event);
  } else {
    cudaEventDestroy(event);
  }
}

struct NcclState : std::enable_shared_from_this<NcclState> {
  ncclComm_t comm = nullptr;  // under lane->mutex once registered (add_to_lane)
  int rank = 0;
  int size = 1;
  int device = 0;
  void* scratch = nullptr;  // device memory for host staging, barrier and split_node
  std::size_t scratch_bytes = 0;
  int host_reads = 0;  // > 0 while a collective's result is read by the host (staging): it waits
  NcclOptions options;
  std::shared_ptr<NcclLane> lane;  // the stream, shared with the communicators split from this one
  std::optional<MpiComm> mpi;      // the same ranks in the same order, when bootstrapped over MPI
  SharedCounters counters;
  std::atomic<bool> aborted{false};
  NcclFault fault;          // why it was aborted (under lane->mutex)
  std::string flight_name;  // the flight recorder's name: "nccl:" and the lineage ("nccl:world/split#0")
  int flight_id = -1;       // the flight recorder's index of this communicator

  /// A new lane unless `shared_lane` (the parent's, for a split) is given.
  NcclState(int dev, const NcclOptions& opts, std::shared_ptr<NcclLane> shared_lane = nullptr)
      : device(dev), options(opts), lane(shared_lane ? std::move(shared_lane) : std::make_shared<NcclLane>(dev, opts.timeout_s)) {}
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;

  /// Flushes and frees the communicator (ncclCommFinalize, polled within the deadline, then
  /// ncclCommDestroy); aborts it instead if that fails, or at once while an exception unwinds (a peer
  /// may be gone: finalizing would wait for it until the deadline). Never throws.
  ~NcclState() {
    {
      // From here on the watcher neither sees nor aborts this communicator.
      const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
      std::erase(lane->members, this);
      lane->pending.for_each([this](NcclLane::Pending& p) {
        if (p.owner == this) p.owner = nullptr;
      });
    }
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    if (comm != nullptr && !aborted && std::uncaught_exceptions() > 0) {
      ncclCommAbort(comm);
      comm = nullptr;
    }
    if (comm != nullptr && !aborted) {
      ncclResult_t rc = ncclCommFinalize(comm);
      const Deadline deadline(options.timeout_s);
      unsigned spins = 0;
      while (rc == ncclInProgress && !deadline.passed()) {
        poll_pause(spins);
        if (ncclCommGetAsyncError(comm, &rc) != ncclSuccess) break;
      }
      if (rc == ncclSuccess) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
      comm = nullptr;
    }
    if (scratch != nullptr) cudaFreeAsync(scratch, lane->stream);  // no device-wide wait (NCCL kernels of other communicators)
    if (switched) cudaSetDevice(previous);
  }

  /// Lets the lane's watcher see this communicator (once its NCCL handle exists). On a lane aborted
  /// meanwhile (a split made while the watcher aborted its parent) it is aborted too, and throws.
  void add_to_lane() {
    std::optional<NcclFault> lane_fault;
    {
      const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
      if (!lane->fault) {
        lane->members.push_back(this);
        return;
      }
      lane_fault = lane->fault;
    }
    abort(*lane_fault);
    throw CommError(who() + ": the NCCL communicators it was split from were aborted: " + lane_fault->message, lane_fault->id);
  }

  std::string who() const { return "rank " + std::to_string(rank) + "/" + std::to_string(size) + " (device " + std::to_string(device) + ")"; }

  void check_usable(const char* op) const {
    const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
    if (aborted) throw CommError(who() + ": " + op + ": the NCCL communicator was aborted: " + fault.message, fault.id);
    if (comm == nullptr) throw CommError(who() + ": " + op + ": no NCCL communicator");
  }

  /// Marks this communicator aborted with `why` and hands over its NCCL handle (null if it had none or
  /// was aborted before). Under lane->mutex.
  ncclComm_t mark_aborted(const NcclFault& why) noexcept {
    if (aborted) return nullptr;
    fault = why;
    aborted = true;
    return std::exchange(comm, nullptr);
  }

  /// ncclCommAbort on handles taken from communicators of `device`: ends what they queued on the
  /// device. Outside lane->mutex where it can be: it may take long. An abort that never returns is the
  /// process watchdog's (CollectiveWatchdog, when the application configured it), as c10d's monitor does.
  static void abort_handles(const std::vector<ncclComm_t>& handles, int device) noexcept {
    if (handles.empty()) return;
    const CollectiveWatchdog::Scope aborting("ncclCommAbort");
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    for (ncclComm_t c : handles) ncclCommAbort(c);  // its result does not matter: the handle is given up either way
    if (switched) cudaSetDevice(previous);
  }

  /// ncclCommAbort of this communicator alone: ends what it queued on the device; it is unusable afterwards.
  void abort(const NcclFault& why) noexcept {
    ncclComm_t taken = nullptr;
    {
      const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
      taken = mark_aborted(why);
    }
    if (taken != nullptr) abort_handles({taken}, device);
  }

  /// Aborts this communicator (the owner of what failed) and then every one of the lane with `f`, and
  /// throws it.
  [[noreturn]] void fail(const NcclFault& f) {
    abort(f);  // also while it is not a member yet (init, split)
    lane->abort_all(f, this);
    throw CommError(f.message, f.id);
  }

  /// NCCL's asynchronous state of this communicator (ncclSuccess, ncclInProgress) in `state`, or the
  /// fault it reports. Under lane->mutex, with a handle.
  std::optional<NcclFault> async_fault(const char* op, ncclResult_t& state, const char* file, int line) const {
    state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    if (rc != ncclSuccess) return NcclFault{who() + ": " + op + ": ncclCommGetAsyncError failed: " + nccl_error_text(rc, comm) + where(file, line)};
    if (state != ncclSuccess && state != ncclInProgress)
      return NcclFault{who() + ": " + op + ": asynchronous NCCL error: " + nccl_error_text(state, comm) + "; the communicator was aborted" +
                       where(file, line)};
    return std::nullopt;
  }

  /// Throws (after aborting) if NCCL reports an asynchronous error; returns the state otherwise.
  /// Under lane->mutex, with a handle.
  ncclResult_t poll_async(const char* op, const char* file, int line) {
    ncclResult_t state = ncclSuccess;
    if (auto f = async_fault(op, state, file, line)) fail(*f);
    return state;
  }

  /// fsdp.comm.deadline, naming the collective, the step and the FSDP unit it was issued in (as the
  /// CollectiveWatchdog does for MPI).
  NcclFault deadline_fault(const char* op, const Deadline& deadline, int unit, std::int64_t step) const {
    return {who() + ": " + op + " did not complete within " + seconds_text(deadline.seconds()) + " s (step " + std::to_string(step) +
                (unit >= 0 ? ", unit " + std::to_string(unit) : std::string()) +
                "): a peer rank is missing, stuck or called another collective; the NCCL communicator was aborted "
                "(NcclOptions::timeout_s, comm.timeout_s)",
            "fsdp.comm.deadline"};
  }
  /// Aborts and throws deadline_fault for a collective of the calling thread.
  [[noreturn]] void deadline_passed(const char* op, const Deadline& deadline) {
    const auto& watchdog = CollectiveWatchdog::instance();
    fail(deadline_fault(op, deadline, watchdog.unit(), watchdog.step()));
  }

  /// The fault of the lane's oldest pending collective `p` (this communicator's): NCCL's asynchronous
  /// error or its passed deadline; none while neither, or once this communicator is finalized or
  /// aborted (its kernels end on their own). Under lane->mutex.
  std::optional<NcclFault> fault_of(const NcclLane::Pending& p) const {
    if (comm == nullptr) return std::nullopt;
    ncclResult_t state = ncclSuccess;
    if (auto f = async_fault(p.op, state, __FILE__, __LINE__)) return f;
    if (p.deadline.passed()) return deadline_fault(p.op, p.deadline, p.unit, p.step);
    return std::nullopt;
  }

  /// After an NCCL call on this (non-blocking) communicator: an error throws; ncclInProgress is polled
  /// (ncclCommGetAsyncError) until it settles, within the deadline. The lock is held per poll only.
  void settle(ncclResult_t rc, const char* call, const char* op, const char* file, int line, const Deadline& deadline) {
    if (rc == ncclSuccess) return;
    if (rc != ncclInProgress) {
      const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
      check_usable(op);
      // An asynchronous error makes the communicator unusable (abort); an immediate one (bad arguments) does not.
      poll_async(op, file, line);
      throw CommError(who() + ": " + call + " failed: " + nccl_error_text(rc, comm) + where(file, line));
    }
    unsigned spins = 0;
    for (;;) {
      {
        const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
        check_usable(op);  // the watcher may have aborted it between two polls
        if (poll_async(op, file, line) != ncclInProgress) return;
        if (deadline.passed()) deadline_passed(op, deadline);
      }
      poll_pause(spins);
    }
  }

  /// Waits on the host until `event` has completed, polling NCCL's asynchronous errors and the deadline
  /// (and the lane's earlier collectives: one of another communicator may be the one that hangs).
  void wait_event(cudaEvent_t event, const char* op, const Deadline& deadline) {
    unsigned spins = 0;
    for (;;) {
      {
        const std::lock_guard<std::recursive_mutex> lock(lane->mutex);  // not while pausing: the watcher looks too
        check_usable(op);                                               // an aborted collective's event completes too: it must not look done
        const cudaError_t q = cudaEventQuery(event);
        if (q == cudaSuccess) return;
        if (q != cudaErrorNotReady) throw_cuda_error("cudaEventQuery(completion event)", q, __FILE__, __LINE__);
        poll_lane();
        poll_async(op, __FILE__, __LINE__);
        if (deadline.passed()) deadline_passed(op, deadline);
      }
      poll_pause(spins);
    }
  }

  /// Orders the lane after the compute stream, enqueues `launch` (an NCCL call) on the lane's stream
  /// and records `completion` after it. `deadline` is the collective's, from enqueue to completion.
  /// The caller holds a CudaDeviceGuard.
  template <class Launch>
  void enqueue(const char* op, const char* call, const char* file, int line, Launch&& launch, cudaEvent_t completion, const Deadline& deadline) {
    ncclResult_t rc = ncclSuccess;
    {
      const std::lock_guard<std::recursive_mutex> lock(lane->mutex);  // the watcher may abort `comm`
      check_usable(op);
      lane->order_after_compute();
      // A launch can block inside CUDA (a full launch queue behind a hung kernel), where no deadline of
      // ours runs: the process watchdog's (CollectiveWatchdog, when the application configured it).
      const CollectiveWatchdog::Scope launching(op);
      rc = launch();
    }
    settle(rc, call, op, file, line, deadline);
    FSDP_CUDA_CHECK(cudaEventRecord(completion, lane->stream));
  }

  /// The lane watches `done` (deadline, NCCL's errors) until the host sees it complete (poll_lane,
  /// drain_lane), in issue order: call it as the collective is queued.
  void watch(std::shared_ptr<CompletionEvent> done, const char* op, const Deadline& deadline) {
    const auto& watchdog = CollectiveWatchdog::instance();
    const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
    lane->pending.push({std::move(done), this, op, deadline, watchdog.unit(), watchdog.step()});
  }
  /// Stream-ordered completion: the compute stream waits for `done`, which the lane watches.
  void order_compute_after(std::shared_ptr<CompletionEvent> done, const char* op, const Deadline& deadline) {
    lane->order_compute_after(done->event);
    watch(std::move(done), op, deadline);
    poll_lane();
  }

  /// Releases the lane's completed collectives; for the oldest pending one, an asynchronous NCCL error
  /// or a passed deadline aborts the lane's communicators and throws (every later one waits behind it).
  /// A fault the watcher found first throws here too.
  void poll_lane() {
    const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
    auto* oldest = lane->pending.drop_completed(
        [](const NcclLane::Pending& p) {
          const cudaError_t q = cudaEventQuery(p.done->event);
          if (q == cudaSuccess) return true;
          if (q != cudaErrorNotReady) throw_cuda_error("cudaEventQuery(completion event)", q, __FILE__, __LINE__);
          return false;
        },
        [](NcclLane::Pending) {});  // its event goes back to the spares once no request holds it
    if (aborted) throw CommError(who() + ": the NCCL communicator was aborted: " + fault.message, fault.id);
    if (oldest == nullptr) return;
    // A destroyed communicator's collective ends with it; the next one of a live communicator is watched.
    auto* watched = lane->pending.first_pending(NcclLane::not_watched);
    if (watched == nullptr) return;
    if (auto f = watched->owner->fault_of(*watched)) watched->owner->fail(*f);  // its owner aborted first
  }

  /// Waits on the host until every collective queued on the lane has completed (deadlines, errors).
  void drain_lane() {
    unsigned spins = 0;
    for (;;) {
      {
        const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
        poll_lane();
        if (lane->pending.empty()) return;
      }
      poll_pause(spins);
    }
  }

  /// Device scratch of at least `bytes`, kept between calls and grown (doubling) only when too small.
  /// Grown with the stream-ordered allocator on the lane's stream: cudaFree would wait for the whole
  /// device, NCCL kernels waiting for their peers included, which NCCL documents as a deadlock.
  void* ensure_scratch(std::size_t bytes) {
    if (bytes > scratch_bytes) {
      drain_lane();  // the synchronize below then waits for nothing that could hang
      const std::size_t grown = std::max(bytes, 2 * scratch_bytes);
      if (scratch != nullptr) FSDP_CUDA_CHECK(cudaFreeAsync(scratch, lane->stream));
      scratch = nullptr;
      scratch_bytes = 0;
      FSDP_CUDA_CHECK(cudaMallocAsync(&scratch, grown, lane->stream));
      FSDP_CUDA_CHECK(cudaStreamSynchronize(lane->stream));  // usable from the host's copies on other streams
      scratch_bytes = grown;
    }
    return scratch;
  }

  /// Creates this state's communicator as `rank` of `nranks` from `id` (collective over those ranks).
  void init(const ncclUniqueId& id, int nranks, int my_rank) {
    const CudaDeviceGuard on(device);
    rank = my_rank;
    size = nranks;
    ncclConfig_t config = nonblocking_config();
    ncclComm_t c = nullptr;
    const ncclResult_t rc = ncclCommInitRankConfig(&c, nranks, id, my_rank, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      if (c != nullptr) ncclCommAbort(c);
      throw_nccl_error("ncclCommInitRankConfig(&comm, nranks, id, rank, &config)", rc, __FILE__, __LINE__);
    }
    comm = c;
    settle(rc, "ncclCommInitRankConfig(&comm, nranks, id, rank, &config)", "NCCL init", __FILE__, __LINE__, Deadline(options.timeout_s));
    check_rank_and_size();
    add_to_lane();
  }

  void check_rank_and_size() const {
    int n = 0, r = 0;
    FSDP_NCCL_CHECK(ncclCommCount(comm, &n));
    FSDP_NCCL_CHECK(ncclCommUserRank(comm, &r));
    if (n != size || r != rank)
      throw CommError(who() + ": NCCL made rank " + std::to_string(r) + " of " + std::to_string(n) + ", expected rank " + std::to_string(rank) +
                      " of " + std::to_string(size));
  }
};

std::vector<ncclComm_t> NcclLane::mark_aborted(const NcclFault& why, NcclState* first) {
  if (!fault) fault = why;
  std::vector<ncclComm_t> taken;
  taken.reserve(members.size());
  if (first != nullptr)
    if (ncclComm_t c = first->mark_aborted(why)) taken.push_back(c);
  for (NcclState* member : members)
    if (ncclComm_t c = member->mark_aborted(why)) taken.push_back(c);
  return taken;
}

void NcclLane::abort_all(const NcclFault& why, NcclState* first) {
  std::vector<ncclComm_t> taken;
  {
    const std::lock_guard<std::recursive_mutex> lock(mutex);
    taken = mark_aborted(why, first);
  }
  NcclState::abort_handles(taken, device);
}

void NcclLane::watch_once() {
  const int dev = device;  // after the abort below nothing of the lane is touched (stop() may have let this thread go)
  cudaSetDevice(dev);      // this thread's; the events and communicators are of this device
  std::vector<ncclComm_t> taken;
  NcclState* owner = nullptr;  // of the collective that failed: aborted first
  const auto found = watch_oldest_pending(
      mutex, pending, not_watched,
      [&](const Pending& p) {
        auto f = p.owner->fault_of(p);
        if (f) owner = p.owner;
        return f;
      },
      [&](const NcclFault& why) { taken = mark_aborted(why, owner); });
  if (!found) return;
  // The issuing thread throws at its next call; until then the job's log says why its step ended.
  std::fprintf(stderr, "[%s] %s (seen by the communicator's watcher thread)\n", found->id.c_str(), found->message.c_str());
  std::fflush(stderr);
  NcclState::abort_handles(taken, dev);
}

}  // namespace detail

}  // namespace fsdp
