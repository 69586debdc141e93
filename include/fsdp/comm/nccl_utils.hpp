// The checked CUDA and NCCL calls of NcclComm, their error text, and one NCCL communicator's lifetime
// (comm layer; CUDA runtime + NCCL + MPI, no LibTorch), apart from the collectives as c10d keeps
// NCCLUtils.hpp apart from ProcessGroupNCCL. Include fsdp/comm/nccl_comm.hpp, not this file.
//
// Every CUDA and NCCL call is checked (FSDP_CUDA_CHECK, FSDP_NCCL_CHECK) and a failure is a CommError
// naming the call, the rank, file:line and the CUDA / NCCL error text. NcclState owns a non-blocking
// NCCL communicator (ncclConfig_t::blocking = 0) with its stream and events: every wait (init, split,
// enqueue, completion, finalize) polls ncclCommGetAsyncError and a deadline, and past the deadline
// the communicator is aborted (ncclCommAbort) and CommError with id fsdp.comm.deadline is thrown.
#pragma once

#if !defined(FSDP_WITH_NCCL)
#error "fsdp/comm/nccl_comm.hpp needs FSDP_WITH_NCCL: configure with -DFSDP_WITH_NCCL=ON and link fsdp::nccl"
#endif
#if !__has_include(<nccl.h>) || !__has_include(<cuda_runtime_api.h>)
#error "fsdp/comm/nccl_comm.hpp: nccl.h or cuda_runtime_api.h not on the include path (link fsdp::nccl)"
#endif

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <nccl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/in_order_completions.hpp"
#include "fsdp/comm/mpi_comm.hpp"
#include "fsdp/comm/periodic_thread.hpp"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "NcclComm needs NCCL >= 2.14 (non-blocking communicators, ncclCommInitRankConfig, ncclAvg, bfloat16)"
#endif

/// Checks a CUDA runtime call; a failure throws fsdp::CommError naming the call, rank and file:line.
#define FSDP_CUDA_CHECK(call)                                                                                     \
  do {                                                                                                            \
    const cudaError_t fsdp_cuda_rc_ = (call);                                                                     \
    if (fsdp_cuda_rc_ != cudaSuccess) ::fsdp::detail::throw_cuda_error(#call, fsdp_cuda_rc_, __FILE__, __LINE__); \
  } while (0)

/// Checks an NCCL call that must succeed at once (ncclInProgress is a failure here; calls on the
/// non-blocking communicator go through NcclComm's own polling instead).
#define FSDP_NCCL_CHECK(call)                                                                                     \
  do {                                                                                                            \
    const ncclResult_t fsdp_nccl_rc_ = (call);                                                                    \
    if (fsdp_nccl_rc_ != ncclSuccess) ::fsdp::detail::throw_nccl_error(#call, fsdp_nccl_rc_, __FILE__, __LINE__); \
  } while (0)

namespace fsdp {

/// How NcclComm::split makes sub-communicators.
enum class NcclSplit {
  kAuto,       ///< ncclCommSplit where NCCL >= 2.18, else kMpi
  kCommSplit,  ///< ncclCommSplit (an error before NCCL 2.18)
  kMpi,        ///< a new communicator per group, its id broadcast over MPI (needs the MPI bootstrap)
};

/// Settings of an NcclComm (copied into every communicator split from it).
struct NcclOptions {
  /// Deadline in seconds of every wait (init, split, each collective, barrier, finalize); past it the
  /// communicator is aborted and CommError (fsdp.comm.deadline) is thrown. <= 0 waits forever.
  /// Give it the deck's comm.timeout_s.
  double timeout_s = 600;
  /// CUDA device of this rank; -1: the node-local rank modulo the number of visible devices.
  int device = -1;
  /// How split() makes sub-communicators.
  NcclSplit split = NcclSplit::kAuto;
  /// from_slurm_file: how long ranks other than 0 wait for rank 0's id file, in seconds.
  double id_file_timeout_s = 300;
};

namespace detail {

/// The rank named in error messages; the bootstraps set it to the world rank.
inline std::atomic<int>& nccl_process_rank_slot() noexcept {
  static std::atomic<int> rank{-1};
  return rank;
}

/// This process's rank for messages: set by a bootstrap, else MPI's world rank, else SLURM_PROCID, else -1.
inline int process_rank() noexcept {
  const int set = nccl_process_rank_slot().load(std::memory_order_relaxed);
  if (set >= 0) return set;
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized && MPI_Comm_rank(MPI_COMM_WORLD, &rank) == MPI_SUCCESS) return rank;
  if (const char* s = std::getenv("SLURM_PROCID")) return std::atoi(s);
  return -1;
}

/// Seconds for messages: "2", "0.5", "600".
inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

inline std::string where(const char* file, int line) { return std::string(" (") + file + ":" + std::to_string(line) + ")"; }

[[noreturn]] inline void throw_cuda_error(const char* call, cudaError_t rc, const char* file, int line) {
  throw CommError("rank " + std::to_string(process_rank()) + ": " + call + " failed: " + cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc) +
                  where(file, line));
}

inline std::string nccl_error_text(ncclResult_t rc, ncclComm_t comm) {
  std::string text = std::string(ncclGetErrorString(rc));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string("; NCCL says: ") + last;
  return text;
}

[[noreturn]] inline void throw_nccl_error(const char* call, ncclResult_t rc, const char* file, int line, ncclComm_t comm = nullptr) {
  throw CommError("rank " + std::to_string(process_rank()) + ": " + call + " failed: " + nccl_error_text(rc, comm) + where(file, line));
}

inline ncclDataType_t nccl_datatype(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kUInt8: return ncclUint8;
  }
  throw CommError("rank " + std::to_string(process_rank()) + ": unsupported dtype for NCCL");
}

inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  throw CommError("rank " + std::to_string(process_rank()) + ": unsupported reduction for NCCL");
}

inline std::size_t nccl_count(std::int64_t n, const char* what) {
  if (n < 0) throw CommError("rank " + std::to_string(process_rank()) + ": " + what + ": negative element count " + std::to_string(n));
  return static_cast<std::size_t>(n);
}

/// A point in time after which waiting is an error; seconds <= 0 never passes.
class Deadline {
 public:
  explicit Deadline(double seconds)
      : seconds_(seconds),
        at_(std::chrono::steady_clock::now() +
            std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds > 0 ? seconds : 0))) {}
  bool passed() const noexcept { return seconds_ > 0 && std::chrono::steady_clock::now() > at_; }
  double seconds() const noexcept { return seconds_; }

 private:
  double seconds_;
  std::chrono::steady_clock::time_point at_;
};

/// Spins briefly, then sleeps up to 1 ms between polls.
inline void poll_pause(unsigned& spins) {
  if (++spins < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 50 : 1000));
  }
}

/// Makes `device` current for its scope (the autograd engine may call from a thread on another device).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    FSDP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ == device) {
      previous_ = -1;
    } else {
      FSDP_CUDA_CHECK(cudaSetDevice(device));
    }
  }
  ~CudaDeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

inline ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

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
/// The lane's watcher thread looks at the oldest pending collective every tenth of the deadline (at
/// most 100 ms): NCCL's asynchronous error or its passed deadline aborts every communicator of the
/// lane. The aborted kernels end, so a host blocked in a device sync elsewhere (LibTorch reading a
/// loss) goes on, and the next call on any of the lane's communicators throws that error. The issuing
/// thread checks the same at each collective, wait and host wait, and throws at once.
struct NcclLane : std::enable_shared_from_this<NcclLane> {
  struct Pending {
    std::shared_ptr<CompletionEvent> done;
    NcclState* owner;  // whose collective; cleared when that communicator is destroyed
    const char* op;
    Deadline deadline;
    int unit;           // the FSDP unit and training step it was issued in, for the deadline's message
    std::int64_t step;
  };

  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;                    // recorded on the compute stream before each collective
  cudaStream_t compute_stream = nullptr;          // 0: the default stream; used unless the hooks below are set
  std::function<void(void*)> record_on_compute;   // records a cudaEvent_t on the compute stream (the engine's: LibTorch's current stream)
  std::function<void(void*)> compute_waits_for;   // makes the compute stream wait for a cudaEvent_t
  // Guards `pending`, `spare`, `members` and the members' NCCL handles and abort state: the issuing
  // thread and the watcher share them. Recursive: an abort found while issuing aborts every member.
  std::recursive_mutex mutex;
  InOrderCompletions<Pending> pending;
  std::vector<cudaEvent_t> spare;      // completion events to reuse
  std::vector<NcclState*> members;     // the live communicators with an NCCL handle on this lane
  PeriodicThread watcher;              // last member: stopped first

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
    watcher.stop();
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    cudaStreamSynchronize(stream);  // every communicator of the lane is finalized or aborted by now
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

  /// Aborts every communicator of the lane with `fault` (their collectives share this stream: behind a
  /// failed one, the order the ranks agreed on is gone).
  inline void abort_all(const NcclFault& fault) noexcept;

  /// The watcher's look at the oldest pending collective (see the struct's comment).
  inline void watch_once() noexcept;
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
  int host_reads = 0;       // > 0 while a collective's result is read by the host (staging): it waits
  NcclOptions options;
  std::shared_ptr<NcclLane> lane;  // the stream, shared with the communicators split from this one
  std::optional<MpiComm> mpi;  // the same ranks in the same order, when bootstrapped over MPI
  SharedCounters counters;
  std::atomic<bool> aborted{false};
  NcclFault fault;            // why it was aborted (under lane->mutex)
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

  /// Lets the lane's watcher see this communicator (once its NCCL handle exists).
  void add_to_lane() {
    const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
    lane->members.push_back(this);
  }

  std::string who() const { return "rank " + std::to_string(rank) + "/" + std::to_string(size) + " (device " + std::to_string(device) + ")"; }

  void check_usable(const char* op) const {
    const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
    if (aborted) throw CommError(who() + ": " + op + ": the NCCL communicator was aborted: " + fault.message, fault.id);
    if (comm == nullptr) throw CommError(who() + ": " + op + ": no NCCL communicator");
  }

  /// ncclCommAbort: ends what is queued on the device; the communicator is unusable afterwards.
  void abort(NcclFault why) noexcept {
    const std::lock_guard<std::recursive_mutex> lock(lane->mutex);
    if (aborted) return;
    fault = std::move(why);
    aborted = true;
    if (comm != nullptr) {
      int previous = -1;
      const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
      ncclCommAbort(comm);  // its result does not matter: the handle is given up either way
      comm = nullptr;
      if (switched) cudaSetDevice(previous);
    }
  }

  /// Aborts this communicator and every one of the lane with `fault` and throws it.
  [[noreturn]] void fail(const NcclFault& f) {
    abort(f);  // also while it is not a member yet (init, split)
    lane->abort_all(f);
    throw CommError(f.message, f.id);
  }

  /// NCCL's asynchronous state of `c` (ncclSuccess, ncclInProgress) in `state`, or the fault it reports.
  std::optional<NcclFault> async_fault(ncclComm_t c, const char* op, ncclResult_t& state, const char* file, int line) const {
    state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(c, &state);
    if (rc != ncclSuccess) return NcclFault{who() + ": " + op + ": ncclCommGetAsyncError failed: " + nccl_error_text(rc, c) + where(file, line)};
    if (state != ncclSuccess && state != ncclInProgress)
      return NcclFault{who() + ": " + op + ": asynchronous NCCL error: " + nccl_error_text(state, c) + "; the communicator was aborted" + where(file, line)};
    return std::nullopt;
  }

  /// Throws (after aborting) if NCCL reports an asynchronous error on `c`; returns its state otherwise.
  ncclResult_t poll_async(ncclComm_t c, const char* op, const char* file, int line) {
    ncclResult_t state = ncclSuccess;
    if (auto f = async_fault(c, op, state, file, line)) fail(*f);
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
    if (auto f = async_fault(comm, p.op, state, __FILE__, __LINE__)) return f;
    if (p.deadline.passed()) return deadline_fault(p.op, p.deadline, p.unit, p.step);
    return std::nullopt;
  }

  /// After an NCCL call on the non-blocking communicator `c`: an error throws; ncclInProgress is
  /// polled (ncclCommGetAsyncError) until it settles, within the deadline.
  void settle(ncclComm_t c, ncclResult_t rc, const char* call, const char* op, const char* file, int line, const Deadline& deadline) {
    if (rc == ncclSuccess) return;
    if (rc != ncclInProgress) {
      // An asynchronous error makes the communicator unusable (abort); an immediate one (bad arguments) does not.
      poll_async(c, op, file, line);
      throw CommError(who() + ": " + call + " failed: " + nccl_error_text(rc, c) + where(file, line));
    }
    unsigned spins = 0;
    while (poll_async(c, op, file, line) == ncclInProgress) {
      if (deadline.passed()) deadline_passed(op, deadline);
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
        check_usable(op);  // an aborted collective's event completes too: it must not look done
        const cudaError_t q = cudaEventQuery(event);
        if (q == cudaSuccess) return;
        if (q != cudaErrorNotReady) throw_cuda_error("cudaEventQuery(completion event)", q, __FILE__, __LINE__);
        poll_lane();
        poll_async(comm, op, __FILE__, __LINE__);
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
    const std::lock_guard<std::recursive_mutex> lock(lane->mutex);  // the watcher may abort `comm`
    check_usable(op);
    lane->order_after_compute();
    settle(comm, launch(), call, op, file, line, deadline);
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
    if (oldest == nullptr || oldest->owner == nullptr) return;
    if (auto f = oldest->owner->fault_of(*oldest)) fail(*f);
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
    settle(comm, rc, "ncclCommInitRankConfig(&comm, nranks, id, rank, &config)", "NCCL init", __FILE__, __LINE__, Deadline(options.timeout_s));
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

void NcclLane::abort_all(const NcclFault& fault) noexcept {
  const std::lock_guard<std::recursive_mutex> lock(mutex);
  for (NcclState* member : members) member->abort(fault);
}

void NcclLane::watch_once() noexcept {
  const std::lock_guard<std::recursive_mutex> lock(mutex);
  cudaSetDevice(device);  // this thread's; the events and communicators are of this device
  const Pending* oldest = pending.first_pending([](const Pending& p) { return cudaEventQuery(p.done->event) != cudaErrorNotReady; });
  if (oldest == nullptr || oldest->owner == nullptr) return;
  const auto fault = oldest->owner->fault_of(*oldest);
  if (!fault) return;
  abort_all(*fault);
  // The issuing thread throws at its next call; until then the job's log says why its step ended.
  std::fprintf(stderr, "[%s] %s (seen by the communicator's watcher thread)\n", fault->id.c_str(), fault->message.c_str());
  std::fflush(stderr);
}

}  // namespace detail

}  // namespace fsdp
