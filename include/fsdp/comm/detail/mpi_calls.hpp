// The MPI calls MpiComm is made of (comm layer; no LibTorch): errors rethrown as fsdp::CommError, the
// datatypes, waiting without holding a core, and the ring reduce-scatter with its fixed order of
// additions. MpiComm (fsdp/comm/mpi_comm.hpp) decides when each is used.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/detail/reduce.hpp"

#define FSDP_MPI_CHECK(call)                                                                                   \
  do {                                                                                                         \
    const int fsdp_mpi_rc_ = (call);                                                                           \
    if (fsdp_mpi_rc_ != MPI_SUCCESS) ::fsdp::detail::throw_mpi_error(#call, fsdp_mpi_rc_, __FILE__, __LINE__); \
  } while (0)

namespace fsdp::detail {

[[noreturn]] inline void throw_mpi_error(const char* call, int rc, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  throw CommError("rank " + std::to_string(rank) + ": " + call + " failed: " + std::string(text, len) + " (" + file + ":" + std::to_string(line) +
                  ")");
}

inline MPI_Datatype mpi_datatype(DType t) {
  switch (t) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kUInt8: return MPI_UINT8_T;
    case DType::kFloat16:
    case DType::kBFloat16: return MPI_UINT16_T;  // moved as raw bits; reductions are done by us
  }
  throw CommError("unsupported dtype");
}

/// MPI cannot reduce 16-bit floats natively; those go through the ring with our own add.
inline bool mpi_can_reduce(DType t) { return t != DType::kFloat16 && t != DType::kBFloat16; }

inline MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

inline int checked_count(std::int64_t n, const char* what) {
  if (n < 0 || n > std::int64_t{2147483647}) throw CommError(std::string(what) + ": element count " + std::to_string(n) + " outside MPI's int range");
  return static_cast<int>(n);
}
inline void copy_if_distinct(const void* send, void* recv, std::int64_t n, DType t) {
  if (send != recv && n > 0) std::memmove(recv, send, static_cast<std::size_t>(n) * dtype_bytes(t));
}

/// Completes `count` requests for a thread that should not hold a core while it waits: polls them,
/// spinning for the first kSpin (a transfer in progress needs MPI to be called to move on), then
/// sleeping kNap between polls (the peers are late; the computing threads get the core).
inline void complete_yielding(MPI_Request* requests, int count) {
  constexpr auto kSpin = std::chrono::microseconds(50);
  constexpr auto kNap = std::chrono::microseconds(20);
  const auto began = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    FSDP_MPI_CHECK(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE));
    if (done) return;
    if (std::chrono::steady_clock::now() - began > kSpin) std::this_thread::sleep_for(kNap);
  }
}

/// Ring reduce-scatter over `comm` (this rank `rank` of `world`): at step s rank r sends its running
/// sum of chunk (r-s-1) to r+1 and receives the running sum of chunk (r-s-2) from r-1, adding its own
/// contribution. After N-1 steps rank r holds the full sum of chunk r. The order of additions is
/// fixed, so results are deterministic. Long chunks go round in segments of kRingSegmentBytes: each
/// element is still added in the same order (the same bits), and `scratch` stays two segments long.
/// `yield_cpu`: wait with complete_yielding instead of a blocking MPI_Sendrecv.
inline void ring_reduce_scatter(MPI_Comm comm, int rank, int world, bool yield_cpu, std::vector<std::byte>& scratch, const void* send, void* recv,
                                std::int64_t n, DType t) {
  if (n < 0) throw CommError("reduce_scatter: element count " + std::to_string(n) + " is negative");
  if (world == 1 || n == 0) {
    if (world == 1) copy_if_distinct(send, recv, n, t);
    return;
  }
  const std::size_t eb = dtype_bytes(t), chunk_bytes = static_cast<std::size_t>(n) * eb;
  const std::int64_t segment = std::min<std::int64_t>(n, std::max<std::int64_t>(1, kRingSegmentBytes / static_cast<std::int64_t>(eb)));
  scratch.resize(2 * static_cast<std::size_t>(segment) * eb);
  const int next = (rank + 1) % world;
  const int prev = (rank - 1 + world) % world;
  const MPI_Datatype type = mpi_datatype(t);
  for (std::int64_t begin = 0; begin < n; begin += segment) {  // elements [begin, begin + count) of every chunk
    const std::int64_t count = std::min(segment, n - begin);
    const int c = checked_count(count, "reduce_scatter");
    const std::size_t offset = static_cast<std::size_t>(begin) * eb;
    const auto* src = static_cast<const std::byte*>(send) + offset;  // chunk i's segment at src + i * chunk_bytes
    std::byte* acc = scratch.data();
    std::byte* incoming = acc + static_cast<std::size_t>(count) * eb;
    for (int s = 0; s < world - 1; ++s) {
      const int send_idx = ((rank - s - 1) % world + world) % world;
      const int recv_idx = ((rank - s - 2) % world + world) % world;
      const void* out = s == 0 ? static_cast<const void*>(src + send_idx * chunk_bytes) : static_cast<const void*>(acc);
      if (yield_cpu) {
        MPI_Request pair[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
        FSDP_MPI_CHECK(MPI_Irecv(incoming, c, type, prev, 7301, comm, &pair[0]));
        FSDP_MPI_CHECK(MPI_Isend(out, c, type, next, 7301, comm, &pair[1]));
        complete_yielding(pair, 2);
      } else {
        FSDP_MPI_CHECK(MPI_Sendrecv(out, c, type, next, 7301, incoming, c, type, prev, 7301, comm, MPI_STATUS_IGNORE));
      }
      std::byte* target = (s == world - 2) ? static_cast<std::byte*>(recv) + offset : acc;
      add_buffers(src + recv_idx * chunk_bytes, incoming, target, count, t);
    }
  }
}

}  // namespace fsdp::detail
