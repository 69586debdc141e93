// The checked CUDA and NCCL calls of NcclComm, their error text, its options, deadlines and device
// guard (comm layer; CUDA runtime + NCCL + MPI, no LibTorch). Include fsdp/comm/nccl_comm.hpp, not
// this file.
//
// Every CUDA and NCCL call is checked (FSDP_CUDA_CHECK, FSDP_NCCL_CHECK) and a failure is a CommError
// naming the call, the rank, file:line and the CUDA / NCCL error text.
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
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/comm/communicator.hpp"
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

inline ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace detail

}  // namespace fsdp
