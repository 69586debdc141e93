// The Communicator concept (comm layer): collectives over typed byte buffers, independent of LibTorch.
//
// Every collective must be called by all ranks of the communicator, in the same order, with the same
// counts and dtypes. Implementations: MpiComm (CPU buffers), NcclComm (CUDA buffers; host buffers are
// staged). Counts are elements, not bytes.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "fsdp/errors.hpp"

namespace fsdp {

/// Element types the communicators move.
enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64, kUInt8 };

/// Bytes per element of `t`.
constexpr std::size_t dtype_bytes(DType t) noexcept {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "?";
}

/// Reductions. kAvg divides the sum by the communicator size. kMax is for all_reduce only.
enum class ReduceOp { kSum, kAvg, kMax };

/// Bytes this rank passed into collectives, per kind; used to check communication volume.
struct CommCounters {
  std::uint64_t all_gather_bytes = 0;
  std::uint64_t reduce_scatter_bytes = 0;
  std::uint64_t all_reduce_bytes = 0;
  std::uint64_t broadcast_bytes = 0;
  std::uint64_t calls = 0;
  // Wall time spent inside blocking collectives, per kind.
  double all_gather_seconds = 0;
  double reduce_scatter_seconds = 0;
  double all_reduce_seconds = 0;
  double broadcast_seconds = 0;
  /// With the skew probe on (MpiComm: FSDP_COMM_SKEW_PROBE=1), time spent in a barrier right before each
  /// collective: waiting for the slowest rank to arrive, which the collectives' own seconds then exclude.
  double skew_seconds = 0;
  CommCounters& operator+=(const CommCounters& o) noexcept {
    all_gather_bytes += o.all_gather_bytes;
    reduce_scatter_bytes += o.reduce_scatter_bytes;
    all_reduce_bytes += o.all_reduce_bytes;
    broadcast_bytes += o.broadcast_bytes;
    calls += o.calls;
    all_gather_seconds += o.all_gather_seconds;
    reduce_scatter_seconds += o.reduce_scatter_seconds;
    all_reduce_seconds += o.all_reduce_seconds;
    broadcast_seconds += o.broadcast_seconds;
    skew_seconds += o.skew_seconds;
    return *this;
  }
  std::uint64_t total_bytes() const noexcept { return all_gather_bytes + reduce_scatter_bytes + all_reduce_bytes + broadcast_bytes; }
};

/// A communicator's CommCounters: updated by the thread running its collectives (the engine's
/// collective worker, for its duplicates) while another reads them (the engine's comm_counters()).
class SharedCounters {
 public:
  CommCounters get() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return counters_;
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    counters_ = {};
  }
  /// One collective passing `bytes` into `field`.
  void add_call(std::uint64_t CommCounters::*field, std::uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    counters_.*field += bytes;
    ++counters_.calls;
  }
  void add_seconds(double CommCounters::*field, double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    counters_.*field += seconds;
  }

 private:
  mutable std::mutex mutex_;
  CommCounters counters_;
};

/// A pending non-blocking collective.
template <class R>
concept CommRequest = std::movable<R> && requires(R r) {
  r.wait();
  { r.test() } -> std::convertible_to<bool>;
};

/// What the engine needs from a communicator.
///  - all_gather(send, recv, n, t): recv (n * size elements) = concat over ranks of send (n elements)
///  - reduce_scatter(send, recv, n, t, op): send holds n * size elements; rank r gets reduced chunk r
///  - all_reduce(send, recv, n, t, op): send may equal recv (in place)
///  - broadcast(buf, n, t, root); barrier(); split(color, key) -> a communicator over a subset
///  - the non-blocking forms i*(...) -> a CommRequest; counters() -> the bytes and seconds so far
///
/// Optional capabilities: the engine and the checkpoints probe for these with `requires` and fall
/// back as said when a communicator lacks them (MpiComm has every one but kMovesDeviceMemory,
/// kProgressesOnItsOwn, synchronize() and set_compute_stream_order(); NcclComm has kMovesDeviceMemory,
/// split_node(), mpi(), synchronize() and set_compute_stream_order()).
///  - `static constexpr bool kMovesDeviceMemory`: true when the buffers are device (GPU) memory; the
///    engine then computes on the communicator's device and overlaps on its streams instead of a
///    worker thread. Absent: false (fsdp::comm_moves_device_memory).
///  - `static constexpr bool kProgressesOnItsOwn`: non-blocking collectives progress once issued (a
///    GPU stream): the engine overlaps by issuing them from the computing thread, without a worker.
///    Absent: kMovesDeviceMemory (fsdp::comm_progresses_on_its_own).
///  - `static bool threads_may_call_concurrently()`: whether two threads may run collectives on two
///    communicators at once; prefetching and overlapped reductions on the collective worker need it
///    and are a ConfigError when it is false. Absent: true.
///  - `set_waiting_yields_cpu(bool)`: the worker thread's communicators wait by polling and sleeping
///    instead of spinning. Absent: not called.
///  - `split_node()` -> a communicator over this node's ranks (collective): its size is the default
///    shard group of the hybrid strategies. Absent: the whole world counts as one node.
///  - `native()` convertible to MPI_Comm, else `mpi()` -> an MpiComm over the same ranks: the MPI
///    communicator parallel HDF5 writes checkpoints through (one of the two is needed to checkpoint).
///  - `barrier_within(seconds, what)`: a barrier that gives up with CommError (fsdp.comm.deadline), so
///    a checkpoint called on some ranks only fails instead of hanging. Absent: a plain barrier().
///  - `synchronize()`: the host waits until every collective issued on the communicator has completed
///    (a GPU communicator's are stream-ordered: they may still run after the call returned). Its
///    presence is what FullyShardedDataParallel::kCollectivesMayBePending means: the engine settles
///    them before the optimizer reads gradients, the checkpoints before they read the state, and a
///    failure caught there is agreed between the ranks. Absent: every collective is complete when its
///    call (or its request's wait()) returns.
///  - `set_compute_stream_order(record, wait)`: two callbacks over a device event (`void*`): `record`
///    marks the compute stream's position, `wait` makes the compute stream wait for one; the
///    communicator orders its stream after the compute stream's work and the compute stream after its
///    collectives with them. The engine passes LibTorch's current stream (torch/current_stream_order.hpp)
///    when it computes on a GPU. Absent: not called (host memory needs no stream order).
template <class C>
concept Communicator = std::copy_constructible<C> &&
    requires(C c, const C cc, const void* src, void* dst, std::int64_t n, DType t, ReduceOp op, int root) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.all_gather(src, dst, n, t);
  c.reduce_scatter(src, dst, n, t, op);
  c.all_reduce(src, dst, n, t, op);
  c.broadcast(dst, n, t, root);
  c.barrier();
  { c.split(root, root) } -> std::same_as<C>;
  { c.iall_gather(src, dst, n, t) } -> CommRequest;
  { c.ireduce_scatter(src, dst, n, t, op) } -> CommRequest;
  { c.iall_reduce(src, dst, n, t, op) } -> CommRequest;
  { c.ibroadcast(dst, n, t, root) } -> CommRequest;
  { cc.counters() } -> std::convertible_to<CommCounters>;
};

}  // namespace fsdp
