// NcclComm: the Communicator over NCCL for CUDA device buffers (comm layer; CUDA runtime + NCCL + MPI,
// no LibTorch).
//
// Streams: a bootstrapped communicator and every communicator split from it run their collectives on
// one CUDA stream (NcclLane: several communicators' collectives in flight at once can deadlock; on one
// in-order stream they run in the order issued). A collective first makes that stream wait for what
// is already queued on the compute stream (an event recorded there: the inputs are ready), and ends by
// recording a completion event. Collectives on device memory are stream-ordered: the compute stream
// waits for that event and the host goes on; the host waits only where it reads a result (host
// buffers, barrier, synchronize()). The non-blocking ones return an NcclRequest whose wait() orders
// the compute stream after the event, so the next unit's all-gather runs while the current unit
// computes. The compute stream is the default stream, set_compute_stream's, or whatever the hooks of
// set_compute_stream_order name (the engine's: LibTorch's current stream).
//
// Failures never hang: the NCCL communicator is non-blocking (ncclConfig_t::blocking = 0), and every
// wait (init, split, enqueue, completion, finalize) polls ncclCommGetAsyncError and a deadline
// (NcclOptions::timeout_s; give it the deck's comm.timeout_s). Past the deadline the communicator is
// aborted (ncclCommAbort) and CommError with id fsdp.comm.deadline is thrown. A stream-ordered
// collective nobody waits for on the host is watched by the lane's watcher thread: its deadline or
// NCCL error aborts the lane's communicators (a host blocked in a device sync elsewhere then goes on)
// and the next call throws. Every CUDA and NCCL call
// is checked (FSDP_CUDA_CHECK, FSDP_NCCL_CHECK) and a failure is a CommError naming the call, the rank,
// file:line and the CUDA / NCCL error text.
//
// Bootstraps: from_mpi (rank 0 calls ncclGetUniqueId, MPI broadcasts it) and from_slurm_file (no MPI:
// SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and an id file on a shared filesystem). See docs/gpu.md.
// Needs FSDP_WITH_NCCL (CMake: link fsdp::nccl) and NCCL >= 2.14; split uses ncclCommSplit from 2.18.
//
// This file holds the collectives (NcclComm); the pending non-blocking one (NcclRequest) is in
// nccl_request.hpp; the shared stream and its watcher (NcclLane) and one communicator's lifetime and
// abort (NcclState) in nccl_utils.hpp; the checked calls, error text, options and deadlines in
// nccl_calls.hpp; the device choice and the Slurm id file in nccl_bootstrap.hpp, as c10d keeps
// NCCLUtils.hpp apart from ProcessGroupNCCL.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/agree.hpp"
#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/mpi_comm.hpp"
#include "fsdp/comm/nccl_bootstrap.hpp"  // device choice, the Slurm id file
#include "fsdp/comm/nccl_request.hpp"    // a pending non-blocking collective
#include "fsdp/comm/nccl_utils.hpp"      // NcclState (one communicator's lifetime), the lane and its watcher; checked calls (nccl_calls.hpp)

namespace fsdp {

namespace detail {
/// The NCCL handshake over MPI: rank 0 of `group` makes the unique id and broadcasts it together with
/// whether that worked, so a failure there fails every rank alike (CommError `failure`, with NCCL's
/// reason on rank 0). Collective over `group`.
inline ncclUniqueId unique_id_over_mpi(MpiComm& group, const std::string& failure) {
  struct {
    std::int32_t ok;
    ncclUniqueId id;
  } message{};
  std::string problem;
  if (group.rank() == 0) {
    const ncclResult_t rc = ncclGetUniqueId(&message.id);
    message.ok = rc == ncclSuccess ? 1 : 0;
    if (rc != ncclSuccess) problem = nccl_error_text(rc, nullptr);
  }
  group.broadcast(&message, static_cast<std::int64_t>(sizeof message), DType::kUInt8, 0);
  if (message.ok != 1) throw CommError(failure + (problem.empty() ? std::string() : ": " + problem));
  return message.id;
}
}  // namespace detail

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
    MpiComm node = m.split_node();
    const int local_rank = node.rank();
    int device = -1;
    std::exception_ptr failure;
    std::array<char, 64> identity{};  // the device's PCI bus id; empty where none was chosen
    try {
      device = detail::pick_device(options.device, local_rank);
      FSDP_CUDA_CHECK(cudaSetDevice(device));
      FSDP_CUDA_CHECK(cudaDeviceGetPCIBusId(identity.data(), static_cast<int>(identity.size() - 1), device));
    } catch (const CommError&) {
      failure = std::current_exception();
    }
    // Two ranks of a node on one GPU (more ranks than visible devices, or every task shown the same
    // one) would fail inside NCCL's init: say so here, naming them.
    std::vector<char> all(identity.size() * static_cast<std::size_t>(node.size()));
    node.all_gather(identity.data(), all.data(), static_cast<std::int64_t>(identity.size()), DType::kUInt8);
    std::vector<std::string> identities;
    for (int r = 0; r < node.size(); ++r) identities.emplace_back(all.data() + static_cast<std::size_t>(r) * identity.size());
    if (const auto shared = first_shared_device(identities); shared && !failure && (local_rank == shared->first || local_rank == shared->second))
      failure = std::make_exception_ptr(CommError("rank " + std::to_string(detail::process_rank()) + ": node-local ranks " +
                                                  std::to_string(shared->first) + " and " + std::to_string(shared->second) +
                                                  " both chose the GPU at PCI bus " + identities[static_cast<std::size_t>(shared->first)] +
                                                  ": give each rank its own (srun --gpus-per-task=1, or as many visible devices as ranks per node)"));
    agree(m, failure, "could not select a CUDA device");

    const ncclUniqueId id = detail::unique_id_over_mpi(m, "rank " + std::to_string(detail::process_rank()) + ": ncclGetUniqueId failed on rank 0");
    auto state = std::make_shared<detail::NcclState>(device, options);
    state->mpi = m;
    state->init(id, m.size(), m.rank());
    NcclComm comm(std::move(state));
    comm.register_flight("nccl:" + m.flight_name(), m.world_ranks());
    return comm;
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
    NcclComm comm(std::move(state));
    std::vector<int> members(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) members[static_cast<std::size_t>(i)] = i;  // SLURM_PROCID is the world rank
    comm.register_flight("nccl:world", std::move(members));
    return comm;
  }

  int rank() const noexcept { return state_->rank; }
  int size() const noexcept { return state_->size; }
  /// The CUDA device of this communicator's buffers and streams.
  int device() const noexcept { return state_->device; }
  /// The NCCL handle (null once aborted); the lane's watcher may abort it at any time.
  ncclComm_t native() const noexcept {
    const std::lock_guard<std::recursive_mutex> lock(state_->lane->mutex);
    return state_->comm;
  }
  /// The MPI communicator over the same ranks in the same order (bootstrapped over MPI, or split from
  /// such a communicator): parallel HDF5 checkpoints write through it. Throws CommError otherwise.
  const MpiComm& mpi() const {
    if (!state_->mpi) throw CommError(state_->who() + ": this communicator was not bootstrapped over MPI (NcclComm::from_mpi)");
    return *state_->mpi;
  }
  /// The stream the collectives run on (created non-blocking with respect to the default stream),
  /// shared with every communicator split from the same bootstrap.
  cudaStream_t comm_stream() const noexcept { return state_->lane->stream; }
  /// The stream producing the collectives' inputs and consuming their results; 0 (the default stream)
  /// unless set. Used when no ordering hooks are set (set_compute_stream_order).
  cudaStream_t compute_stream() const noexcept { return state_->lane->compute_stream; }
  /// Sets the compute stream (of this communicator's device) for the collectives issued from now on,
  /// by this communicator and every one sharing its stream.
  void set_compute_stream(cudaStream_t stream) noexcept { state_->lane->compute_stream = stream; }
  /// Orders the collectives against a compute stream known only through these hooks (the engine's:
  /// LibTorch's current CUDA stream, without CUDA headers in the torch layer): `record(event)` records
  /// a cudaEvent_t on it, `wait(event)` makes it wait for one. Empty hooks: back to compute_stream().
  void set_compute_stream_order(std::function<void(void*)> record, std::function<void(void*)> wait) {
    state_->lane->record_on_compute = std::move(record);
    state_->lane->compute_waits_for = std::move(wait);
  }
  /// Waits on the host until every collective queued on this communicator's stream (by it or any
  /// communicator sharing the stream) has completed. Throws CommError like the collectives: where an
  /// NCCL error or a passed deadline is seen, that communicator is aborted.
  void synchronize() {
    const detail::CudaDeviceGuard on(state_->device);
    state_->drain_lane();
  }
  const NcclOptions& options() const noexcept { return state_->options; }
  /// Sets the deadline of every wait from now on (<= 0: none).
  void set_timeout_s(double seconds) noexcept { state_->options.timeout_s = seconds; }
  CommCounters counters() const { return state_->counters.get(); }
  void reset_counters() { state_->counters.reset(); }
  /// True once the communicator was aborted (a deadline or NCCL error of a collective on its stream,
  /// seen by the issuing thread or the lane's watcher thread, or abort()); every call then throws.
  bool aborted() const noexcept { return state_->aborted; }
  /// Aborts the NCCL communicator (ncclCommAbort): what it has queued ends, and it is unusable after.
  /// Local, not collective: use it when a peer failed or left. Only this communicator (a deadline or
  /// NCCL error, by contrast, aborts every communicator sharing its stream).
  void abort(const std::string& reason = "abort() called") noexcept { state_->abort({state_->who() + ": " + reason}); }

  /// A communicator over the ranks with the same color (>= 0), ordered by key, then by rank; on the
  /// same device and stream (one lane: its collectives run in issue order with this one's), with the
  /// same options and compute stream. ncclCommSplit where
  /// NCCL >= 2.18 (NcclSplit::kAuto), else a new communicator whose id is broadcast over MPI.
  /// Collective.
  NcclComm split(int color, int key) const {
    if (color < 0) throw CommError(state_->who() + ": split: color must be >= 0, got " + std::to_string(color));
    state_->check_usable("split");
    const NcclSplit method = resolve_split();
    auto sub = std::make_shared<detail::NcclState>(state_->device, state_->options, state_->lane);
    if (state_->mpi) sub->mpi = state_->mpi->split(color, key);  // same ranks, same order as NCCL's split
    if (method == NcclSplit::kMpi) {
      MpiComm group = *sub->mpi;
      const ncclUniqueId id = detail::unique_id_over_mpi(group, state_->who() + ": split: ncclGetUniqueId failed on the group's first rank");
      sub->init(id, group.size(), group.rank());
    } else {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
      const detail::CudaDeviceGuard on(state_->device);
      const char* call = "ncclCommSplit(comm, color, key, &sub, &config)";
      const detail::Deadline deadline(state_->options.timeout_s);
      ncclConfig_t config = detail::nonblocking_config();
      // A non-blocking split writes the new handle into *slot only when it completes, from NCCL's own
      // thread; until then the parent reports ncclInProgress. The slot lives on the heap and is leaked
      // when the wait fails (8 bytes), so that a late write never lands in a freed stack frame.
      auto* slot = new ncclComm_t(nullptr);
      ncclResult_t rc = ncclSuccess;
      {
        const std::lock_guard<std::recursive_mutex> lock(state_->lane->mutex);  // the lane's watcher may abort the parent
        state_->check_usable("split");
        rc = ncclCommSplit(state_->comm, color, key, slot, &config);
      }
      if (rc != ncclSuccess && rc != ncclInProgress) state_->settle(rc, call, "split", __FILE__, __LINE__, deadline);  // throws
      state_->settle(ncclInProgress, call, "split", __FILE__, __LINE__, deadline);
      const ncclComm_t c = std::atomic_ref<ncclComm_t>(*slot).load(std::memory_order_acquire);
      delete slot;
      if (c == nullptr) throw CommError(state_->who() + ": split: " + call + " completed without a communicator" + detail::where(__FILE__, __LINE__));
      sub->comm = c;
      sub->rank = rank();
      sub->size = size();
      // The new communicator may still report ncclInProgress once the parent is through.
      sub->settle(ncclInProgress, call, "split", __FILE__, __LINE__, deadline);
      FSDP_NCCL_CHECK(ncclCommCount(c, &sub->size));
      FSDP_NCCL_CHECK(ncclCommUserRank(c, &sub->rank));
      sub->add_to_lane();
#else
      throw CommError(state_->who() + ": split: ncclCommSplit needs NCCL >= 2.18");
#endif
    }
    NcclComm child(std::move(sub));
    // The members by world rank: from the MPI communicator of the same ranks, else one all-gather.
    std::vector<int> members;
    if (child.state_->mpi) {
      members = child.state_->mpi->world_ranks();
    } else {
      const std::int64_t me = detail::process_rank();
      std::vector<std::int64_t> all(static_cast<std::size_t>(child.size()));
      child.all_gather(&me, all.data(), 1, DType::kInt64);
      members.assign(all.begin(), all.end());
      child.reset_counters();  // the user's collectives only
    }
    child.register_flight(FlightRecorder::instance().child_name(state_->flight_name, "split"), std::move(members));
    return child;
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
      FSDP_CUDA_CHECK(cudaMemcpyAsync(scratch, &mine, sizeof mine, cudaMemcpyHostToDevice, state_->lane->stream));
      const HostReads reads(*state_);
      blocking(
          "split_node", nullptr, 0, [&] { return ncclAllGather(scratch, scratch + 1, 1, ncclInt64, state_->comm, state_->lane->stream); },
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
    count(&CommCounters::all_gather_bytes, n, t);
    if (c == 0) return;
    blocking(
        "all_gather", &CommCounters::all_gather_seconds, bytes(n, t) * size(),
        [&] { return ncclAllGather(send, recv, c, detail::nccl_datatype(t), state_->comm, state_->lane->stream); },
        "ncclAllGather(send, recv, n, type, comm, stream)", __FILE__, __LINE__);
  }

  /// send holds n * size elements; recv (n elements) = reduction (sum or avg) over ranks of chunk `rank`. Collective.
  void reduce_scatter(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    if (!on_device(send) || !on_device(recv))
      return staged(send, bytes(n, t) * size(), recv, bytes(n, t), [&](const void* s, void* r) { reduce_scatter(s, r, n, t, op); });
    const std::size_t c = check_reduce_scatter(n, op);
    count(&CommCounters::reduce_scatter_bytes, n * size(), t);
    if (c == 0) return;
    blocking(
        "reduce_scatter", &CommCounters::reduce_scatter_seconds, bytes(n, t) * size(),
        [&] { return ncclReduceScatter(send, recv, c, detail::nccl_datatype(t), detail::nccl_op(op), state_->comm, state_->lane->stream); },
        "ncclReduceScatter(send, recv, n, type, op, comm, stream)", __FILE__, __LINE__);
  }

  /// recv = reduction (sum, avg or max) over ranks of send (n elements); send may equal recv. Collective.
  void all_reduce(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    if (!on_device(send) || !on_device(recv))
      return staged(send, bytes(n, t), recv, bytes(n, t), [&](const void* s, void* r) { all_reduce(s, r, n, t, op); });
    const std::size_t c = detail::nccl_count(n, "all_reduce");
    count(&CommCounters::all_reduce_bytes, n, t);
    if (c == 0) return;
    blocking(
        "all_reduce", &CommCounters::all_reduce_seconds, bytes(n, t),
        [&] { return ncclAllReduce(send, recv, c, detail::nccl_datatype(t), detail::nccl_op(op), state_->comm, state_->lane->stream); },
        "ncclAllReduce(send, recv, n, type, op, comm, stream)", __FILE__, __LINE__);
  }

  /// Copies root's buffer (n elements) to every rank. Collective.
  void broadcast(void* buf, std::int64_t n, DType t, int root) {
    if (!on_device(buf))
      return staged(
          buf, bytes(n, t), buf, bytes(n, t), [&](const void*, void* r) { broadcast(r, n, t, root); }, true);
    const std::size_t c = check_broadcast(n, root);
    count(&CommCounters::broadcast_bytes, n, t);
    if (c == 0) return;
    blocking(
        "broadcast", &CommCounters::broadcast_seconds, bytes(n, t),
        [&] { return ncclBroadcast(buf, buf, c, detail::nccl_datatype(t), root, state_->comm, state_->lane->stream); },
        "ncclBroadcast(buf, buf, n, type, root, comm, stream)", __FILE__, __LINE__);
  }

  /// Returns when every rank has arrived (an all-reduce of one value on the device; the host waits,
  /// within the deadline). Collective.
  void barrier() {
    state_->check_usable("barrier");
    const detail::CudaDeviceGuard on(state_->device);
    void* one = state_->ensure_scratch(sizeof(float));
    const HostReads reads(*state_);
    blocking(
        "barrier", nullptr, 0, [&] { return ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, state_->comm, state_->lane->stream); },
        "ncclAllReduce(barrier)", __FILE__, __LINE__);
  }

  /// Non-blocking all_gather: returns once enqueued. Collective.
  NcclRequest iall_gather(const void* send, void* recv, std::int64_t n, DType t) {
    require_on_device("iall_gather", {send, recv});
    const std::size_t c = detail::nccl_count(n, "iall_gather");
    count(&CommCounters::all_gather_bytes, n, t);
    if (c == 0) return {};
    return issue(
        "iall_gather", bytes(n, t) * size(),
        [&] { return ncclAllGather(send, recv, c, detail::nccl_datatype(t), state_->comm, state_->lane->stream); },
        "ncclAllGather(send, recv, n, type, comm, stream)", __FILE__, __LINE__);
  }

  /// Non-blocking reduce_scatter (sum or avg). Collective.
  NcclRequest ireduce_scatter(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    require_on_device("ireduce_scatter", {send, recv});
    const std::size_t c = check_reduce_scatter(n, op);
    count(&CommCounters::reduce_scatter_bytes, n * size(), t);
    if (c == 0) return {};
    return issue(
        "ireduce_scatter", bytes(n, t) * size(),
        [&] { return ncclReduceScatter(send, recv, c, detail::nccl_datatype(t), detail::nccl_op(op), state_->comm, state_->lane->stream); },
        "ncclReduceScatter(send, recv, n, type, op, comm, stream)", __FILE__, __LINE__);
  }

  /// Non-blocking all_reduce. Collective.
  NcclRequest iall_reduce(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    require_on_device("iall_reduce", {send, recv});
    const std::size_t c = detail::nccl_count(n, "iall_reduce");
    count(&CommCounters::all_reduce_bytes, n, t);
    if (c == 0) return {};
    return issue(
        "iall_reduce", bytes(n, t),
        [&] { return ncclAllReduce(send, recv, c, detail::nccl_datatype(t), detail::nccl_op(op), state_->comm, state_->lane->stream); },
        "ncclAllReduce(send, recv, n, type, op, comm, stream)", __FILE__, __LINE__);
  }

  /// Non-blocking broadcast. Collective.
  NcclRequest ibroadcast(void* buf, std::int64_t n, DType t, int root) {
    require_on_device("ibroadcast", {buf});
    const std::size_t c = check_broadcast(n, root);
    count(&CommCounters::broadcast_bytes, n, t);
    if (c == 0) return {};
    return issue(
        "ibroadcast", bytes(n, t), [&] { return ncclBroadcast(buf, buf, c, detail::nccl_datatype(t), root, state_->comm, state_->lane->stream); },
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

  /// Device (or managed) memory NCCL can use directly; host memory is staged. Another GPU's memory is
  /// an error (NCCL would read it through peer access, or fault), named here.
  bool on_device(const void* p) const {
    if (p == nullptr) return true;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // plain host memory on old runtimes; clear the sticky-free error
      return false;
    }
    if (a.type == cudaMemoryTypeDevice && a.device != state_->device)
      throw CommError(state_->who() + ": a buffer in the memory of GPU " + std::to_string(a.device) + ", not of this communicator's GPU");
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }
  /// The non-blocking collectives take device memory only (nothing is staged while they run).
  void require_on_device(const char* op, std::initializer_list<const void*> buffers) const {
    for (const void* p : buffers)
      if (!on_device(p)) throw CommError(state_->who() + ": " + op + ": a non-blocking collective needs device memory of this communicator's GPU");
  }

  /// Host buffers (the checkpoint layer's and the application's small control messages: flags, sizes,
  /// names) go through this communicator's device scratch: copied in, the collective `run` on device
  /// pointers, copied out. `in_place`: the result is written over the input (broadcast).
  template <class Run>
  void staged(const void* send, std::int64_t send_bytes, void* recv, std::int64_t recv_bytes, Run&& run, bool in_place = false) {
    const detail::CudaDeviceGuard on(state_->device);
    // The host reads the result anyway: first every queued collective, within their deadlines (a
    // pageable copy below may wait for the lane, with none).
    state_->drain_lane();
    const auto in = static_cast<std::size_t>(send_bytes), out = static_cast<std::size_t>(recv_bytes);
    auto* scratch = static_cast<char*>(state_->ensure_scratch(in + (in_place ? 0 : out) + 1));
    char* result = in_place ? scratch : scratch + in;
    // Copied in on the lane's stream after the compute stream's queued work (the input may be device
    // memory it writes), so the collective after it on that stream reads it.
    if (in > 0) {
      state_->lane->order_after_compute();
      FSDP_CUDA_CHECK(cudaMemcpyAsync(scratch, send, in, cudaMemcpyDefault, state_->lane->stream));
    }
    const HostReads reads(*state_);
    run(scratch, result);  // waits for the collective on the host
    if (out > 0) FSDP_CUDA_CHECK(cudaMemcpy(recv, result, out, cudaMemcpyDefault));
  }

  void count(std::uint64_t CommCounters::*field, std::int64_t n, DType t) {
    state_->counters.add_call(field, static_cast<std::uint64_t>(n) * dtype_bytes(t));
  }

  /// Names this communicator for the flight recorder (collectives before this are not recorded).
  void register_flight(std::string name, std::vector<int> world_ranks) {
    state_->flight_name = std::move(name);
    state_->flight_id = FlightRecorder::instance().register_comm(state_->flight_name, std::move(world_ranks));
  }
  /// Records a collective for the flight recorder (a no-op when it is off).
  FlightRecorder::Scope flight(const char* kind, std::int64_t bytes) const {
    auto& w = CollectiveWatchdog::instance();
    return FlightRecorder::Scope(state_->flight_id, kind, bytes, w.unit(), w.step());
  }

  /// While alive, this communicator's collectives wait on the host for their result (it is read there).
  struct HostReads {
    detail::NcclState& state;
    explicit HostReads(detail::NcclState& s) : state(s) { ++state.host_reads; }
    ~HostReads() { --state.host_reads; }
    HostReads(const HostReads&) = delete;
    HostReads& operator=(const HostReads&) = delete;
  };

  /// Enqueues `launch`; the compute stream then waits for it (stream-ordered; the lane watches its
  /// deadline and errors), or, inside HostReads, the host waits for it. With `seconds`, the host's
  /// time in the call is added there and traced as `op` moving `bytes` (as MpiComm does).
  template <class Launch>
  void blocking(const char* op, double CommCounters::*seconds, std::int64_t bytes, Launch&& launch, const char* call, const char* file,
                int line) const {
    std::optional<Stopwatch> timed;
    if (seconds != nullptr) timed.emplace(state_->counters, seconds, op, bytes);
    const auto flown = flight(op, bytes);  // ends when the host has queued it (or, reading it, seen it complete)
    const detail::CudaDeviceGuard on(state_->device);
    const detail::Deadline deadline(state_->options.timeout_s);  // one for the whole collective: enqueue and completion
    state_->poll_lane();  // an earlier collective's error or passed deadline surfaces before this one is queued
    auto done = state_->lane->take_event();
    state_->enqueue(op, call, file, line, launch, done->event, deadline);
    if (state_->host_reads == 0) return state_->order_compute_after(std::move(done), op, deadline);
    state_->wait_event(done->event, op, deadline);
    state_->poll_lane();  // every earlier collective of the lane is complete too
  }

  /// Enqueues `launch` (moving `moved_bytes`) with its own completion event and returns the request holding it.
  template <class Launch>
  NcclRequest issue(const char* op, std::int64_t moved_bytes, Launch&& launch, const char* call, const char* file, int line) {
    flight(op, moved_bytes);  // recorded as issued (begun and ended): its completion is the request's wait
    const detail::CudaDeviceGuard on(state_->device);
    const detail::Deadline deadline(state_->options.timeout_s);  // from issue to completion, however late the host waits
    state_->poll_lane();
    auto done = state_->lane->take_event();
    state_->enqueue(op, call, file, line, launch, done->event, deadline);
    state_->watch(done, op, deadline);  // from issue, in issue order
    return NcclRequest(state_, std::move(done), op);
  }

  std::shared_ptr<detail::NcclState> state_;
};

static_assert(Communicator<NcclComm>);

}  // namespace fsdp
