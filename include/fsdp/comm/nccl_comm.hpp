// NcclComm: the Communicator over NCCL for CUDA device buffers (comm layer; CUDA runtime + NCCL + MPI,
// no LibTorch).
//
// Streams: every collective runs on the communicator's own CUDA stream. It first makes that stream
// wait for what is already queued on the caller's compute stream (an event recorded there: the
// inputs are ready), and it ends by recording a completion event. Blocking collectives return when the
// result is in device memory; the non-blocking ones return an NcclRequest whose wait() orders the
// compute stream after that event, so the next unit's all-gather runs while the current unit computes.
//
// Failures never hang: the NCCL communicator is non-blocking (ncclConfig_t::blocking = 0), and every
// wait (init, split, enqueue, completion, finalize) polls ncclCommGetAsyncError and a deadline
// (NcclOptions::timeout_s; give it the deck's comm.timeout_s). Past the deadline the communicator is
// aborted (ncclCommAbort) and CommError with id fsdp.comm.deadline is thrown. Every CUDA and NCCL call
// is checked (FSDP_CUDA_CHECK, FSDP_NCCL_CHECK) and a failure is a CommError naming the call, the rank,
// file:line and the CUDA / NCCL error text.
//
// Bootstraps: from_mpi (rank 0 calls ncclGetUniqueId, MPI broadcasts it) and from_slurm_file (no MPI:
// SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and an id file on a shared filesystem). See docs/gpu.md.
// Needs FSDP_WITH_NCCL (CMake: link fsdp::nccl) and NCCL >= 2.14; split uses ncclCommSplit from 2.18.
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

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/core/layout.hpp"  // fnv1a64
#include "fsdp/comm/agree.hpp"
#include "fsdp/comm/mpi_comm.hpp"

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

/// An integer from the environment; nullopt when unset, CommError when set but not an integer.
inline std::optional<long> env_int(const char* name) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0')
    throw CommError(std::string("environment variable ") + name + "=\"" + s + "\" is not an integer", "fsdp.comm.bootstrap");
  return v;
}

/// The node-local rank the launcher gives this process: SLURM_LOCALID, else OMPI_COMM_WORLD_LOCAL_RANK, else -1.
inline int launcher_local_rank() {
  if (auto v = env_int("SLURM_LOCALID")) return static_cast<int>(*v);
  if (auto v = env_int("OMPI_COMM_WORLD_LOCAL_RANK")) return static_cast<int>(*v);
  return -1;
}

/// The device for a rank: `requested` if >= 0, else local_rank modulo the visible device count.
inline int pick_device(int requested, int local_rank) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  const std::string who = "rank " + std::to_string(process_rank()) + ": ";
  if (rc != cudaSuccess || count == 0) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    throw CommError(who + "no CUDA device for NCCL (cudaGetDeviceCount: " +
                    (rc == cudaSuccess ? std::string("0 devices") : std::string(cudaGetErrorName(rc)) + ": " + cudaGetErrorString(rc)) +
                    (visible ? std::string(", CUDA_VISIBLE_DEVICES=") + visible : std::string()) + ")");
  }
  if (requested >= 0) {
    if (requested >= count)
      throw CommError(who + "NcclOptions::device = " + std::to_string(requested) + " but only " + std::to_string(count) + " devices are visible");
    return requested;
  }
  if (local_rank < 0) throw CommError(who + "no node-local rank to choose a CUDA device (set NcclOptions::device)");
  return local_rank % count;
}

inline ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// ---- the id file of the Slurm bootstrap -----------------------------------------------------------
// Format: one text line "fsdp-nccl-id v1 <tag>\n" followed by the NCCL_UNIQUE_ID_BYTES raw bytes.
// The tag names the job, step and task count, so a file left behind by another job is never used.

inline constexpr const char* kIdFileMagic = "fsdp-nccl-id v1 ";

/// The tag of this Slurm job step: "job=<SLURM_JOB_ID> step=<SLURM_STEP_ID> ntasks=<n>".
inline std::string id_file_tag(int ntasks) {
  auto text = [](const char* name) {
    const char* s = std::getenv(name);
    return std::string(s != nullptr && *s != '\0' ? s : "-");
  };
  return "job=" + text("SLURM_JOB_ID") + " step=" + text("SLURM_STEP_ID") + " ntasks=" + std::to_string(ntasks);
}

inline std::string errno_text() { return std::strerror(errno); }

/// Writes `id` under `path` atomically: a temporary name in the same folder, fsync, rename.
inline void write_id_file(const std::string& path, const std::string& tag, const ncclUniqueId& id) {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const std::string tmp = path + ".tmp." + host + "." + std::to_string(static_cast<long>(getpid()));
  const std::string who = "rank " + std::to_string(process_rank()) + ": NCCL id file " + path;
  const std::string header = std::string(kIdFileMagic) + tag + "\n";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw CommError(who + ": cannot create " + tmp + ": " + errno_text(), "fsdp.comm.bootstrap");
  std::string bytes = header;
  bytes.append(id.internal, sizeof id.internal);
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = errno_text();
      ::close(fd);
      ::unlink(tmp.c_str());
      throw CommError(who + ": cannot write " + tmp + ": " + why, "fsdp.comm.bootstrap");
    }
    done += static_cast<std::size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw CommError(who + ": cannot sync " + tmp + ": " + why, "fsdp.comm.bootstrap");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw CommError(who + ": cannot rename " + tmp + " to it: " + why, "fsdp.comm.bootstrap");
  }
}

/// Waits up to timeout_s for rank 0's id file with this job's tag and returns the id. A file with
/// another tag (another job's) is ignored; the error says so if nothing better arrives in time.
inline ncclUniqueId read_id_file(const std::string& path, const std::string& tag, double timeout_s) {
  const std::string header = std::string(kIdFileMagic) + tag + "\n";
  const std::size_t expect = header.size() + NCCL_UNIQUE_ID_BYTES;
  const Deadline deadline(timeout_s > 0 ? timeout_s : 1e-9);
  std::string seen;  // the header of a file that is not ours, for the error
  for (;;) {
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      std::string bytes(expect + 1, '\0');
      const std::size_t got = std::fread(bytes.data(), 1, bytes.size(), f);
      std::fclose(f);
      if (got == expect && bytes.compare(0, header.size(), header) == 0) {
        ncclUniqueId id;
        std::memcpy(id.internal, bytes.data() + header.size(), NCCL_UNIQUE_ID_BYTES);
        return id;
      }
      std::size_t len = std::min<std::size_t>(got, 200);
      const std::size_t eol = bytes.find('\n');
      if (eol != std::string::npos && eol < len) len = eol;
      seen = len > 0 ? bytes.substr(0, len) : std::string("<empty file>");
    }
    if (deadline.passed()) {
      std::string text = "rank " + std::to_string(process_rank()) + ": no NCCL id for this job in " + path + " after " + seconds_text(timeout_s) +
                         " s (expected \"" + header.substr(0, header.size() - 1) + "\"";
      text += seen.empty() ? std::string("; the file never appeared: did rank 0 start, and is the folder on a filesystem every node shares?)")
                           : "; found \"" + seen + "\": a file of another job or a partial write; use a path unique to the job step)";
      throw CommError(text, "fsdp.comm.bootstrap");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

/// FNV-1a of this host's name: the same on every rank of a node.
inline std::int64_t host_hash() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return static_cast<std::int64_t>(fnv1a64(host));
}

// ---- one NCCL communicator with its stream, events and deadline --------------------------------------

struct NcclState {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 1;
  int device = 0;
  cudaStream_t comm_stream = nullptr;
  cudaStream_t compute_stream = nullptr;  // 0: the default stream
  cudaEvent_t ready = nullptr;            // recorded on the compute stream before each collective
  cudaEvent_t done = nullptr;             // completion of blocking collectives
  void* scratch = nullptr;                // device memory for barrier and split_node
  std::size_t scratch_bytes = 0;
  NcclOptions options;
  std::optional<MpiComm> mpi;  // the same ranks in the same order, when bootstrapped over MPI
  CommCounters counters;
  bool aborted = false;
  std::string abort_reason;

  NcclState(int dev, const NcclOptions& opts) : device(dev), options(opts) {
    const CudaDeviceGuard on(device);
    try {
      FSDP_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
      FSDP_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      FSDP_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    } catch (...) {
      if (ready != nullptr) cudaEventDestroy(ready);
      if (comm_stream != nullptr) cudaStreamDestroy(comm_stream);
      throw;
    }
  }
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;

  /// Flushes and frees the communicator (ncclCommFinalize, polled within the deadline, then
  /// ncclCommDestroy); aborts it instead if that fails. Never throws.
  ~NcclState() {
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
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
    if (scratch != nullptr) cudaFree(scratch);
    if (done != nullptr) cudaEventDestroy(done);
    if (ready != nullptr) cudaEventDestroy(ready);
    if (comm_stream != nullptr) cudaStreamDestroy(comm_stream);
    if (switched) cudaSetDevice(previous);
  }

  std::string who() const { return "rank " + std::to_string(rank) + "/" + std::to_string(size) + " (device " + std::to_string(device) + ")"; }

  void check_usable(const char* op) const {
    if (aborted) throw CommError(who() + ": " + op + ": the NCCL communicator was aborted earlier (" + abort_reason + ")");
    if (comm == nullptr) throw CommError(who() + ": " + op + ": no NCCL communicator");
  }

  /// ncclCommAbort: ends what is queued on the device; the communicator is unusable afterwards.
  void abort(const std::string& reason) noexcept {
    if (aborted) return;
    aborted = true;
    abort_reason = reason;
    if (comm != nullptr) {
      int previous = -1;
      const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
      ncclCommAbort(comm);  // its result does not matter: the handle is given up either way
      comm = nullptr;
      if (switched) cudaSetDevice(previous);
    }
  }

  /// Throws (after aborting) if NCCL reports an asynchronous error on `c`; returns its state otherwise.
  ncclResult_t poll_async(ncclComm_t c, const char* op, const char* file, int line) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(c, &state);
    if (rc != ncclSuccess) {
      const std::string text = nccl_error_text(rc, c);
      abort(std::string("ncclCommGetAsyncError failed in ") + op);
      throw CommError(who() + ": " + op + ": ncclCommGetAsyncError failed: " + text + where(file, line));
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      const std::string text = nccl_error_text(state, c);
      abort(std::string("asynchronous NCCL error in ") + op);
      throw CommError(who() + ": " + op + ": asynchronous NCCL error: " + text + "; the communicator was aborted" + where(file, line));
    }
    return state;
  }

  /// Aborts and throws fsdp.comm.deadline, naming the collective, the step and the FSDP unit (as the
  /// CollectiveWatchdog does for MPI).
  [[noreturn]] void deadline_passed(const char* op, const Deadline& deadline) {
    abort(std::string(op) + " passed its deadline");
    const auto& watchdog = CollectiveWatchdog::instance();
    const int unit = watchdog.unit();
    throw CommError(who() + ": " + op + " did not complete within " + seconds_text(deadline.seconds()) + " s (step " +
                        std::to_string(watchdog.step()) + (unit >= 0 ? ", unit " + std::to_string(unit) : std::string()) +
                        "): a peer rank is missing, stuck or called another collective; the NCCL communicator was aborted "
                        "(NcclOptions::timeout_s, comm.timeout_s)",
                    "fsdp.comm.deadline");
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

  /// Waits on the host until `event` has completed, polling NCCL's asynchronous errors and the deadline.
  void wait_event(cudaEvent_t event, const char* op, const Deadline& deadline) {
    unsigned spins = 0;
    for (;;) {
      check_usable(op);  // an aborted collective's event completes too: it must not look done
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) throw_cuda_error("cudaEventQuery(completion event)", q, __FILE__, __LINE__);
      poll_async(comm, op, __FILE__, __LINE__);
      if (deadline.passed()) deadline_passed(op, deadline);
      poll_pause(spins);
    }
  }

  /// Orders the comm stream after the compute stream, enqueues `launch` (an NCCL call) on the comm
  /// stream and records `completion` after it. The caller holds a CudaDeviceGuard.
  template <class Launch>
  void enqueue(const char* op, const char* call, const char* file, int line, Launch&& launch, cudaEvent_t completion) {
    check_usable(op);
    FSDP_CUDA_CHECK(cudaEventRecord(ready, compute_stream));
    FSDP_CUDA_CHECK(cudaStreamWaitEvent(comm_stream, ready, 0));
    settle(comm, launch(), call, op, file, line, Deadline(options.timeout_s));
    FSDP_CUDA_CHECK(cudaEventRecord(completion, comm_stream));
  }

  void* ensure_scratch(std::size_t bytes) {
    if (bytes > scratch_bytes) {
      if (scratch != nullptr) FSDP_CUDA_CHECK(cudaFree(scratch));
      scratch = nullptr;
      scratch_bytes = 0;
      FSDP_CUDA_CHECK(cudaMalloc(&scratch, bytes));
      scratch_bytes = bytes;
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

}  // namespace detail

/// A pending NCCL collective. wait() blocks the host until the collective has completed (polling
/// NCCL's asynchronous errors and the deadline), then orders the compute stream it was issued from
/// after it. The GPU overlaps the collective with whatever was queued on the compute stream after it
/// was issued. A request that is never waited for is completed by its destructor, so NCCL never
/// writes into memory the caller believes free.
class NcclRequest {
 public:
  NcclRequest() = default;
  NcclRequest(std::shared_ptr<detail::NcclState> state, cudaEvent_t done, cudaStream_t consumer, const char* op)
      : state_(std::move(state)), done_(done), consumer_(consumer), op_(op) {}
  NcclRequest(NcclRequest&& other) noexcept
      : state_(std::move(other.state_)),
        done_(std::exchange(other.done_, nullptr)),
        consumer_(other.consumer_),
        op_(other.op_),
        since_(other.since_) {}
  /// Completes the request this one held before taking `other`'s.
  NcclRequest& operator=(NcclRequest&& other) noexcept {
    if (this != &other) {
      complete_quietly();
      state_ = std::move(other.state_);
      done_ = std::exchange(other.done_, nullptr);
      consumer_ = other.consumer_;
      op_ = other.op_;
      since_ = other.since_;
    }
    return *this;
  }
  NcclRequest(const NcclRequest&) = delete;
  NcclRequest& operator=(const NcclRequest&) = delete;
  ~NcclRequest() { complete_quietly(); }

  /// Blocks until the collective has completed; then the compute stream it was issued from waits on
  /// its completion event. Throws CommError on an NCCL error or past the deadline (after aborting).
  void wait() {
    if (done_ == nullptr) return;
    const detail::CudaDeviceGuard on(state_->device);
    state_->wait_event(done_, op_, detail::Deadline(state_->options.timeout_s));
    finish();
  }

  /// True when the collective has completed (then as after wait()). Never blocks; throws like wait(),
  /// the deadline counted from the first test().
  bool test() {
    if (done_ == nullptr) return true;
    const detail::CudaDeviceGuard on(state_->device);
    state_->check_usable(op_);
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaSuccess) {
      finish();
      return true;
    }
    if (q != cudaErrorNotReady) detail::throw_cuda_error("cudaEventQuery(completion event)", q, __FILE__, __LINE__);
    state_->poll_async(state_->comm, op_, __FILE__, __LINE__);
    if (!since_) since_.emplace(state_->options.timeout_s);
    if (since_->passed()) state_->deadline_passed(op_, *since_);
    return false;
  }

  /// The completion event (recorded on the communicator's stream), e.g. for another stream to wait on.
  cudaEvent_t event() const noexcept { return done_; }

 private:
  void finish() {
    const cudaEvent_t e = std::exchange(done_, nullptr);
    const cudaError_t wait_rc = cudaStreamWaitEvent(consumer_, e, 0);
    cudaEventDestroy(e);
    if (wait_rc != cudaSuccess) detail::throw_cuda_error("cudaStreamWaitEvent(compute stream, completion event)", wait_rc, __FILE__, __LINE__);
  }
  void complete_quietly() noexcept {
    if (done_ == nullptr) return;
    try {
      wait();
    } catch (...) {  // a destructor must not throw; the communicator is aborted and the next call reports it
      if (done_ != nullptr) cudaEventDestroy(std::exchange(done_, nullptr));
    }
  }

  std::shared_ptr<detail::NcclState> state_;
  cudaEvent_t done_ = nullptr;
  cudaStream_t consumer_ = nullptr;
  const char* op_ = "";
  std::optional<detail::Deadline> since_;
};

/// Communicator over NCCL for CUDA device buffers. Copies share the same NCCL communicator, streams,
/// options and counters. Use it from one host thread at a time. Every collective must be called by
/// all ranks of the communicator in the same order with the same counts and dtypes; counts are
/// elements; buffers are device memory of this communicator's device.
class NcclComm {
 public:
  /// The engine computes on CUDA devices with this communicator (see comm_moves_device_memory()).
  static constexpr bool kMovesDeviceMemory = true;

  /// Bootstrap over MPI: rank 0 calls ncclGetUniqueId and the id is broadcast over `mpi`. The device
  /// is options.device, or the rank's index on its node (MPI_COMM_TYPE_SHARED split of `mpi`) modulo
  /// the visible device count; it becomes the calling thread's current device. Every rank agrees
  /// before NCCL starts, so a rank without a device fails all ranks with CommError instead of a hang.
  /// Collective over `mpi`.
  static NcclComm from_mpi(const MpiComm& mpi, const NcclOptions& options = {}) {
    MpiComm m = mpi;
    set_process_rank_from_mpi();
    const int local_rank = m.split_node().rank();
    int device = -1;
    std::exception_ptr failure;
    try {
      device = detail::pick_device(options.device, local_rank);
      FSDP_CUDA_CHECK(cudaSetDevice(device));
    } catch (const CommError&) {
      failure = std::current_exception();
    }
    agree(m, failure, "could not select a CUDA device");

    struct {
      std::int32_t ok;
      ncclUniqueId id;
    } message{};
    std::string problem;
    if (m.rank() == 0) {
      const ncclResult_t rc = ncclGetUniqueId(&message.id);
      message.ok = rc == ncclSuccess ? 1 : 0;
      if (rc != ncclSuccess) problem = detail::nccl_error_text(rc, nullptr);
    }
    m.broadcast(&message, static_cast<std::int64_t>(sizeof message), DType::kUInt8, 0);
    if (message.ok != 1)
      throw CommError("rank " + std::to_string(detail::process_rank()) + ": ncclGetUniqueId failed on rank 0" +
                      (problem.empty() ? std::string() : ": " + problem));

    auto state = std::make_shared<detail::NcclState>(device, options);
    state->mpi = m;
    state->init(message.id, m.size(), m.rank());
    return NcclComm(std::move(state));
  }

  /// Bootstrap without MPI, for Slurm sites without PMIx: rank and size from SLURM_PROCID and
  /// SLURM_NTASKS, the device from SLURM_LOCALID (or OMPI_COMM_WORLD_LOCAL_RANK; or options.device).
  /// Rank 0 writes the NCCL id to `id_file` (a temporary name, fsync, atomic rename); the others poll
  /// for it up to options.id_file_timeout_s and fail with CommError (fsdp.comm.bootstrap) naming the
  /// file. The file carries SLURM_JOB_ID, SLURM_STEP_ID and the task count: a file of another job is
  /// never used. Put it on a filesystem every node shares, at a path unique to the job step; rank 0
  /// removes it once the communicator is up. Collective over the job step's tasks.
  static NcclComm from_slurm_file(const std::string& id_file, const NcclOptions& options = {}) {
    const auto rank = detail::env_int("SLURM_PROCID");
    const auto ntasks = detail::env_int("SLURM_NTASKS");
    if (!rank || !ntasks) throw CommError("NcclComm::from_slurm_file needs SLURM_PROCID and SLURM_NTASKS (run it under srun)", "fsdp.comm.bootstrap");
    if (*ntasks < 1 || *rank < 0 || *rank >= *ntasks)
      throw CommError("SLURM_PROCID=" + std::to_string(*rank) + " is not a rank of SLURM_NTASKS=" + std::to_string(*ntasks), "fsdp.comm.bootstrap");
    if (id_file.empty()) throw CommError("NcclComm::from_slurm_file: empty id file path", "fsdp.comm.bootstrap");
    const int r = static_cast<int>(*rank);
    const int n = static_cast<int>(*ntasks);
    detail::nccl_process_rank_slot().store(r, std::memory_order_relaxed);
    const int device = detail::pick_device(options.device, detail::launcher_local_rank());
    FSDP_CUDA_CHECK(cudaSetDevice(device));
    const std::string tag = detail::id_file_tag(n);

    ncclUniqueId id;
    if (r == 0) {
      FSDP_NCCL_CHECK(ncclGetUniqueId(&id));
      detail::write_id_file(id_file, tag, id);
    } else {
      id = detail::read_id_file(id_file, tag, options.id_file_timeout_s);
    }
    struct RemoveOnRankZero {
      const std::string& path;
      bool owner;
      ~RemoveOnRankZero() {
        if (owner) std::remove(path.c_str());  // every rank has read it once init is through (or failed)
      }
    } cleanup{id_file, r == 0};
    auto state = std::make_shared<detail::NcclState>(device, options);
    state->init(id, n, r);
    return NcclComm(std::move(state));
  }

  int rank() const noexcept { return state_->rank; }
  int size() const noexcept { return state_->size; }
  /// The CUDA device of this communicator's buffers and streams.
  int device() const noexcept { return state_->device; }
  ncclComm_t native() const noexcept { return state_->comm; }
  /// The MPI communicator over the same ranks in the same order (bootstrapped over MPI, or split from
  /// such a communicator): parallel HDF5 checkpoints write through it. Throws CommError otherwise.
  const MpiComm& mpi() const {
    if (!state_->mpi) throw CommError(state_->who() + ": this communicator was not bootstrapped over MPI (NcclComm::from_mpi)");
    return *state_->mpi;
  }
  /// The stream the collectives run on (created non-blocking with respect to the default stream).
  cudaStream_t comm_stream() const noexcept { return state_->comm_stream; }
  /// The stream producing the collectives' inputs and consuming their results; 0 (the default stream) unless set.
  cudaStream_t compute_stream() const noexcept { return state_->compute_stream; }
  /// Sets the compute stream (of this communicator's device) for the collectives issued from now on.
  void set_compute_stream(cudaStream_t stream) noexcept { state_->compute_stream = stream; }
  const NcclOptions& options() const noexcept { return state_->options; }
  /// Sets the deadline of every wait from now on (<= 0: none).
  void set_timeout_s(double seconds) noexcept { state_->options.timeout_s = seconds; }
  CommCounters counters() const noexcept { return state_->counters; }
  void reset_counters() noexcept { state_->counters = {}; }
  /// True once the communicator was aborted (deadline, NCCL error, or abort()); every call then throws.
  bool aborted() const noexcept { return state_->aborted; }
  /// Aborts the NCCL communicator (ncclCommAbort): what it has queued ends, and it is unusable after.
  /// Local, not collective: use it when a peer failed or left.
  void abort(const std::string& reason = "abort() called") noexcept { state_->abort(reason); }

  /// A communicator over the ranks with the same color (>= 0), ordered by key, then by rank; on the
  /// same device, with its own stream, the same options and compute stream. ncclCommSplit where
  /// NCCL >= 2.18 (NcclSplit::kAuto), else a new communicator whose id is broadcast over MPI.
  /// Collective.
  NcclComm split(int color, int key) const {
    if (color < 0) throw CommError(state_->who() + ": split: color must be >= 0, got " + std::to_string(color));
    state_->check_usable("split");
    const NcclSplit method = resolve_split();
    auto sub = std::make_shared<detail::NcclState>(state_->device, state_->options);
    sub->compute_stream = state_->compute_stream;
    if (state_->mpi) sub->mpi = state_->mpi->split(color, key);  // same ranks, same order as NCCL's split
    if (method == NcclSplit::kMpi) {
      MpiComm group = *sub->mpi;
      struct {
        std::int32_t ok;
        ncclUniqueId id;
      } message{};
      std::string problem;
      if (group.rank() == 0) {
        const ncclResult_t rc = ncclGetUniqueId(&message.id);
        message.ok = rc == ncclSuccess ? 1 : 0;
        if (rc != ncclSuccess) problem = detail::nccl_error_text(rc, nullptr);
      }
      group.broadcast(&message, static_cast<std::int64_t>(sizeof message), DType::kUInt8, 0);
      if (message.ok != 1)
        throw CommError(state_->who() + ": split: ncclGetUniqueId failed on the group's first rank" + (problem.empty() ? "" : ": " + problem));
      sub->init(message.id, group.size(), group.rank());
    } else {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
      const detail::CudaDeviceGuard on(state_->device);
      const char* call = "ncclCommSplit(comm, color, key, &sub, &config)";
      const detail::Deadline deadline(state_->options.timeout_s);
      ncclConfig_t config = detail::nonblocking_config();
      ncclComm_t c = nullptr;
      const ncclResult_t rc = ncclCommSplit(state_->comm, color, key, &c, &config);
      if (rc != ncclSuccess && rc != ncclInProgress) {
        if (c != nullptr) ncclCommAbort(c);
        state_->settle(state_->comm, rc, call, "split", __FILE__, __LINE__, deadline);  // throws
      }
      sub->comm = c;
      sub->rank = rank();
      sub->size = size();
      // Both the new communicator and the parent may report ncclInProgress until the split is through.
      sub->settle(c, rc, call, "split", __FILE__, __LINE__, deadline);
      state_->settle(state_->comm, ncclInProgress, call, "split", __FILE__, __LINE__, deadline);
      FSDP_NCCL_CHECK(ncclCommCount(c, &sub->size));
      FSDP_NCCL_CHECK(ncclCommUserRank(c, &sub->rank));
#else
      throw CommError(state_->who() + ": split: ncclCommSplit needs NCCL >= 2.18");
#endif
    }
    return NcclComm(std::move(sub));
  }

  /// The ranks of this communicator on this node, ordered by rank. Over MPI: MPI_COMM_TYPE_SHARED;
  /// otherwise ranks with the same host name (all-gathered through NCCL). Collective.
  NcclComm split_node() const {
    state_->check_usable("split_node");
    int color = rank();
    if (state_->mpi) {
      MpiComm node = state_->mpi->split_node();
      std::int32_t first = rank();  // this communicator's rank of the node's first member
      node.broadcast(&first, 1, DType::kInt32, 0);
      color = first;
    } else {
      const std::size_t bytes = sizeof(std::int64_t) * static_cast<std::size_t>(size() + 1);
      const detail::CudaDeviceGuard on(state_->device);
      auto* scratch = static_cast<std::int64_t*>(state_->ensure_scratch(bytes));
      const std::int64_t mine = detail::host_hash();
      FSDP_CUDA_CHECK(cudaMemcpy(scratch, &mine, sizeof mine, cudaMemcpyHostToDevice));
      blocking(
          "split_node", nullptr, 0, [&] { return ncclAllGather(scratch, scratch + 1, 1, ncclInt64, state_->comm, state_->comm_stream); },
          "ncclAllGather(host hash)", __FILE__, __LINE__);
      std::vector<std::int64_t> all(static_cast<std::size_t>(size()));
      FSDP_CUDA_CHECK(cudaMemcpy(all.data(), scratch + 1, sizeof(std::int64_t) * all.size(), cudaMemcpyDeviceToHost));
      for (int r = 0; r < size(); ++r)
        if (all[static_cast<std::size_t>(r)] == mine) {
          color = r;
          break;
        }
    }
    return split(color, rank());
  }

  /// recv (n * size elements) = concatenation over ranks of send (n elements). Collective.
  void all_gather(const void* send, void* recv, std::int64_t n, DType t) {
    if (!on_device(send) || !on_device(recv))
      return staged(send, bytes(n, t), recv, bytes(n, t) * size(), [&](const void* s, void* r) { all_gather(s, r, n, t); });
    const std::size_t c = detail::nccl_count(n, "all_gather");
    count(state_->counters.all_gather_bytes, n, t);
    if (c == 0) return;
    blocking(
        "all_gather", &state_->counters.all_gather_seconds, bytes(n, t) * size(),
        [&] { return ncclAllGather(send, recv, c, detail::nccl_datatype(t), state_->comm, state_->comm_stream); },
        "ncclAllGather(send, recv, n, type, comm, stream)", __FILE__, __LINE__);
  }

  /// send holds n * size elements; recv (n elements) = reduction (sum or avg) over ranks of chunk `rank`. Collective.
  void reduce_scatter(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    if (!on_device(send) || !on_device(recv))
      return staged(send, bytes(n, t) * size(), recv, bytes(n, t), [&](const void* s, void* r) { reduce_scatter(s, r, n, t, op); });
    const std::size_t c = check_reduce_scatter(n, op);
    count(state_->counters.reduce_scatter_bytes, n * size(), t);
    if (c == 0) return;
    blocking(
        "reduce_scatter", &state_->counters.reduce_scatter_seconds, bytes(n, t) * size(),
        [&] { return ncclReduceScatter(send, recv, c, detail::nccl_datatype(t), detail::nccl_op(op), state_->comm, state_->comm_stream); },
        "ncclReduceScatter(send, recv, n, type, op, comm, stream)", __FILE__, __LINE__);
  }

  /// recv = reduction (sum, avg or max) over ranks of send (n elements); send may equal recv. Collective.
  void all_reduce(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    if (!on_device(send) || !on_device(recv))
      return staged(send, bytes(n, t), recv, bytes(n, t), [&](const void* s, void* r) { all_reduce(s, r, n, t, op); });
    const std::size_t c = detail::nccl_count(n, "all_reduce");
    count(state_->counters.all_reduce_bytes, n, t);
    if (c == 0) return;
    blocking(
        "all_reduce", &state_->counters.all_reduce_seconds, bytes(n, t),
        [&] { return ncclAllReduce(send, recv, c, detail::nccl_datatype(t), detail::nccl_op(op), state_->comm, state_->comm_stream); },
        "ncclAllReduce(send, recv, n, type, op, comm, stream)", __FILE__, __LINE__);
  }

  /// Copies root's buffer (n elements) to every rank. Collective.
  void broadcast(void* buf, std::int64_t n, DType t, int root) {
    if (!on_device(buf))
      return staged(
          buf, bytes(n, t), buf, bytes(n, t), [&](const void*, void* r) { broadcast(r, n, t, root); }, true);
    const std::size_t c = check_broadcast(n, root);
    count(state_->counters.broadcast_bytes, n, t);
    if (c == 0) return;
    blocking(
        "broadcast", &state_->counters.broadcast_seconds, bytes(n, t),
        [&] { return ncclBroadcast(buf, buf, c, detail::nccl_datatype(t), root, state_->comm, state_->comm_stream); },
        "ncclBroadcast(buf, buf, n, type, root, comm, stream)", __FILE__, __LINE__);
  }

  /// Returns when every rank has arrived (an all-reduce of one value on the device; the host waits,
  /// within the deadline). Collective.
  void barrier() {
    state_->check_usable("barrier");
    const detail::CudaDeviceGuard on(state_->device);
    void* one = state_->ensure_scratch(sizeof(float));
    blocking(
        "barrier", nullptr, 0, [&] { return ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, state_->comm, state_->comm_stream); },
        "ncclAllReduce(barrier)", __FILE__, __LINE__);
  }

  /// Non-blocking all_gather: returns once enqueued. Collective.
  NcclRequest iall_gather(const void* send, void* recv, std::int64_t n, DType t) {
    const std::size_t c = detail::nccl_count(n, "iall_gather");
    count(state_->counters.all_gather_bytes, n, t);
    if (c == 0) return {};
    return issue(
        "iall_gather", [&] { return ncclAllGather(send, recv, c, detail::nccl_datatype(t), state_->comm, state_->comm_stream); },
        "ncclAllGather(send, recv, n, type, comm, stream)", __FILE__, __LINE__);
  }

  /// Non-blocking reduce_scatter (sum or avg). Collective.
  NcclRequest ireduce_scatter(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    const std::size_t c = check_reduce_scatter(n, op);
    count(state_->counters.reduce_scatter_bytes, n * size(), t);
    if (c == 0) return {};
    return issue(
        "ireduce_scatter",
        [&] { return ncclReduceScatter(send, recv, c, detail::nccl_datatype(t), detail::nccl_op(op), state_->comm, state_->comm_stream); },
        "ncclReduceScatter(send, recv, n, type, op, comm, stream)", __FILE__, __LINE__);
  }

  /// Non-blocking all_reduce. Collective.
  NcclRequest iall_reduce(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    const std::size_t c = detail::nccl_count(n, "iall_reduce");
    count(state_->counters.all_reduce_bytes, n, t);
    if (c == 0) return {};
    return issue(
        "iall_reduce", [&] { return ncclAllReduce(send, recv, c, detail::nccl_datatype(t), detail::nccl_op(op), state_->comm, state_->comm_stream); },
        "ncclAllReduce(send, recv, n, type, op, comm, stream)", __FILE__, __LINE__);
  }

  /// Non-blocking broadcast. Collective.
  NcclRequest ibroadcast(void* buf, std::int64_t n, DType t, int root) {
    const std::size_t c = check_broadcast(n, root);
    count(state_->counters.broadcast_bytes, n, t);
    if (c == 0) return {};
    return issue(
        "ibroadcast", [&] { return ncclBroadcast(buf, buf, c, detail::nccl_datatype(t), root, state_->comm, state_->comm_stream); },
        "ncclBroadcast(buf, buf, n, type, root, comm, stream)", __FILE__, __LINE__);
  }

 private:
  explicit NcclComm(std::shared_ptr<detail::NcclState> state) : state_(std::move(state)) {}

  static void set_process_rank_from_mpi() {
    int rank = -1;
    if (MPI_Comm_rank(MPI_COMM_WORLD, &rank) == MPI_SUCCESS && rank >= 0) detail::nccl_process_rank_slot().store(rank, std::memory_order_relaxed);
  }

  /// All ranks of `mpi` learn whether any had a problem; each then throws (its own text, or the peers').
  static void agree(MpiComm& mpi, const std::exception_ptr& failure, const char* what) {
    const auto agreed = agree_on_failure(mpi, failure ? std::optional<std::string>(what) : std::nullopt);
    if (!agreed) return;
    if (failure) std::rethrow_exception(failure);
    throw CommError("rank " + std::to_string(detail::process_rank()) + ": " + std::to_string(agreed->failed_ranks) + " other rank(s) " + what);
  }

  NcclSplit resolve_split() const {
    NcclSplit method = state_->options.split;
    constexpr bool kHasCommSplit = NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0);
    if (method == NcclSplit::kAuto) method = kHasCommSplit ? NcclSplit::kCommSplit : NcclSplit::kMpi;
    if (method == NcclSplit::kCommSplit && !kHasCommSplit)
      throw CommError(state_->who() + ": split: NcclSplit::kCommSplit needs NCCL >= 2.18 (built against " + std::to_string(NCCL_VERSION_CODE) + ")");
    if (method == NcclSplit::kMpi && !state_->mpi)
      throw CommError(state_->who() + ": split: " +
                      (kHasCommSplit ? std::string("NcclSplit::kMpi needs a communicator bootstrapped over MPI (NcclComm::from_mpi)")
                                     : std::string("NCCL < 2.18 has no ncclCommSplit; split needs a communicator bootstrapped over MPI")));
    return method;
  }

  std::size_t check_reduce_scatter(std::int64_t n, ReduceOp op) const {
    if (op == ReduceOp::kMax) throw CommError(state_->who() + ": reduce_scatter supports sum and avg only");
    return detail::nccl_count(n, "reduce_scatter");
  }

  std::size_t check_broadcast(std::int64_t n, int root) const {
    if (root < 0 || root >= size())
      throw CommError(state_->who() + ": broadcast: root " + std::to_string(root) + " is not a rank of " + std::to_string(size()));
    return detail::nccl_count(n, "broadcast");
  }

  static std::int64_t bytes(std::int64_t n, DType t) noexcept { return n * static_cast<std::int64_t>(dtype_bytes(t)); }

  /// Device (or managed) memory NCCL can use directly; host memory is staged.
  static bool on_device(const void* p) noexcept {
    if (p == nullptr) return true;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // plain host memory on old runtimes; clear the sticky-free error
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  /// Host buffers (the checkpoint layer's and the application's small control messages: flags, sizes,
  /// names) go through this communicator's device scratch: copied in, the collective `run` on device
  /// pointers, copied out. `in_place`: the result is written over the input (broadcast).
  template <class Run>
  void staged(const void* send, std::int64_t send_bytes, void* recv, std::int64_t recv_bytes, Run&& run, bool in_place = false) {
    const detail::CudaDeviceGuard on(state_->device);
    const auto in = static_cast<std::size_t>(send_bytes), out = static_cast<std::size_t>(recv_bytes);
    auto* scratch = static_cast<char*>(state_->ensure_scratch(in + (in_place ? 0 : out) + 1));
    char* result = in_place ? scratch : scratch + in;
    if (in > 0) FSDP_CUDA_CHECK(cudaMemcpy(scratch, send, in, cudaMemcpyHostToDevice));
    run(scratch, result);  // waits for the collective on the host
    if (out > 0) FSDP_CUDA_CHECK(cudaMemcpy(recv, result, out, cudaMemcpyDeviceToHost));
  }

  void count(std::uint64_t& field, std::int64_t n, DType t) noexcept {
    field += static_cast<std::uint64_t>(n) * dtype_bytes(t);
    ++state_->counters.calls;
  }

  /// Enqueues `launch` and waits on the host for its completion (deadline, asynchronous errors).
  /// With `seconds`, its wall time is added there and traced as `op` moving `bytes` (as MpiComm does).
  template <class Launch>
  void blocking(const char* op, double* seconds, std::int64_t bytes, Launch&& launch, const char* call, const char* file, int line) const {
    std::optional<Stopwatch> timed;
    if (seconds != nullptr) timed.emplace(*seconds, op, bytes);
    const detail::CudaDeviceGuard on(state_->device);
    state_->enqueue(op, call, file, line, launch, state_->done);
    state_->wait_event(state_->done, op, detail::Deadline(state_->options.timeout_s));
  }

  /// Enqueues `launch` with its own completion event and returns the request holding it.
  template <class Launch>
  NcclRequest issue(const char* op, Launch&& launch, const char* call, const char* file, int line) {
    const detail::CudaDeviceGuard on(state_->device);
    cudaEvent_t done = nullptr;
    FSDP_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    try {
      state_->enqueue(op, call, file, line, launch, done);
    } catch (...) {
      cudaEventDestroy(done);
      throw;
    }
    return NcclRequest(state_, done, state_->compute_stream, op);
  }

  std::shared_ptr<detail::NcclState> state_;
};

static_assert(Communicator<NcclComm>);
static_assert(CommRequest<NcclRequest>);

}  // namespace fsdp
