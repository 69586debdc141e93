// MpiComm: the Communicator over MPI for CPU buffers (comm layer; no LibTorch).
//
// MpiEnvironment bootstraps MPI (MPI_Init_thread): MPI_THREAD_FUNNELED unless asked for more;
// prefetching and overlapped reductions run collectives on the engine's collective worker thread as
// well, which needs MPI_THREAD_MULTIPLE (fsdp-train and test_engine ask for it).
// Errors are returned, not fatal (MPI_ERRORS_RETURN) and rethrown as fsdp::CommError naming the call.
// Reduce-scatter is a ring of N-1 MPI_Sendrecv steps with a local add: faster than Open MPI's
// MPI_Reduce_scatter_block at the unit sizes (docs/design.md), and it supports 16-bit floats.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/detail/mpi_calls.hpp"
#include "fsdp/comm/detail/reduce.hpp"
#include "fsdp/comm/watchdog.hpp"
#include "fsdp/trace.hpp"

namespace fsdp {

/// Initializes MPI on construction (if nobody did) and finalizes on destruction (if it initialized).
class MpiEnvironment {
 public:
  MpiEnvironment(int* argc, char*** argv, int required = MPI_THREAD_FUNNELED) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      FSDP_MPI_CHECK(MPI_Init_thread(argc, argv, required, &provided));
      owns_ = true;
      if (provided < required) throw CommError("MPI provides thread level " + std::to_string(provided) + " < required " + std::to_string(required));
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  MpiEnvironment() : MpiEnvironment(nullptr, nullptr) {}
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;
  ~MpiEnvironment() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }

 private:
  bool owns_ = false;
};

/// A pending MPI collective; wait() completes it (and runs the finishing step, e.g. averaging).
class MpiRequest {
 public:
  MpiRequest() = default;
  MpiRequest(MPI_Request request, std::function<void()> finish) : request_(request), finish_(std::move(finish)) {}
  MpiRequest(MpiRequest&& other) noexcept
      : request_(std::exchange(other.request_, MPI_REQUEST_NULL)), finish_(std::exchange(other.finish_, nullptr)) {}
  /// Completes the request this one held (with its finishing step) before taking `other`'s.
  MpiRequest& operator=(MpiRequest&& other) noexcept {
    if (this != &other) {
      complete_quietly();
      request_ = std::exchange(other.request_, MPI_REQUEST_NULL);
      finish_ = std::exchange(other.finish_, nullptr);
    }
    return *this;
  }
  /// Completes a request that was never waited for, so MPI never writes into freed memory and the
  /// buffer always ends in its finished state (e.g. averaged).
  ~MpiRequest() { complete_quietly(); }
  void wait() {
    if (request_ != MPI_REQUEST_NULL) FSDP_MPI_CHECK(MPI_Wait(&request_, MPI_STATUS_IGNORE));
    finish();
  }
  bool test() {
    int done = 1;
    if (request_ != MPI_REQUEST_NULL) FSDP_MPI_CHECK(MPI_Test(&request_, &done, MPI_STATUS_IGNORE));
    if (done) finish();
    return done != 0;
  }

 private:
  void complete_quietly() noexcept {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    try {
      wait();
    } catch (...) {  // a destructor must not throw; the error surfaces in the next collective
    }
  }
  void finish() {
    if (finish_) {
      auto f = std::move(finish_);
      finish_ = nullptr;
      f();
    }
  }
  MPI_Request request_ = MPI_REQUEST_NULL;
  std::function<void()> finish_;
};

/// Adds the wall time of its scope to a counter.
class Stopwatch {
 public:
  /// Adds the scope's wall time to `total`; with tracing on, also records a "comm" trace event named
  /// `op` (a string literal) with the bytes moved and the FSDP unit being gathered or reduced.
  Stopwatch(SharedCounters& counters, double CommCounters::*total, const char* op, std::int64_t bytes) noexcept
      : counters_(counters), total_(total), op_(op), bytes_(bytes), start_(std::chrono::steady_clock::now()) {}
  ~Stopwatch() {
    const auto end = std::chrono::steady_clock::now();
    try {
      counters_.add_seconds(total_, std::chrono::duration<double>(end - start_).count());
    } catch (...) {  // a mutex that cannot lock: the time goes uncounted, the collective stands
    }
    auto& tracer = Tracer::instance();
    if (op_ && tracer.enabled()) {
      try {
        tracer.complete(op_, "comm", tracer.to_us(start_), tracer.to_us(end),
                        {{"bytes", static_cast<double>(bytes_)}, {"unit", CollectiveWatchdog::instance().unit()}});
      } catch (...) {  // tracing must never turn a finished collective into a failure
      }
    }
  }
  Stopwatch(const Stopwatch&) = delete;
  Stopwatch& operator=(const Stopwatch&) = delete;

 private:
  SharedCounters& counters_;
  double CommCounters::*total_;
  const char* op_;
  std::int64_t bytes_;
  std::chrono::steady_clock::time_point start_;
};

/// Communicator over an MPI communicator. Copies share the same MPI_Comm and counters.
class MpiComm {
 public:
  /// The world communicator (MPI must be initialized, e.g. by MpiEnvironment).
  static MpiComm world() { return MpiComm(MPI_COMM_WORLD, /*owned=*/false, "world"); }

  /// FSDP_COMM_SKEW_PROBE=1 (a measurement aid, read once): every blocking all-gather, reduce-scatter and
  /// all-reduce first waits in a timed barrier, so that the collective's seconds measure the transfer
  /// alone and CommCounters::skew_seconds the time spent waiting for the slowest rank.
  static bool skew_probe() {
    static const bool on = [] {
      const char* v = std::getenv("FSDP_COMM_SKEW_PROBE");
      return v != nullptr && std::string(v) == "1";
    }();
    return on;
  }

  /// True when MPI was initialized with MPI_THREAD_MULTIPLE, so that two threads may run collectives
  /// (on different communicators) at the same time; the engine's prefetching needs it.
  static bool threads_may_call_concurrently() {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    return provided == MPI_THREAD_MULTIPLE;
  }

  int rank() const noexcept { return state_->rank; }
  int size() const noexcept { return state_->size; }
  MPI_Comm native() const noexcept { return state_->comm; }
  CommCounters counters() const { return state_->counters.get(); }
  void reset_counters() { state_->counters.reset(); }

  /// How this communicator's blocking collectives wait for their peers. By default MPI spins, which
  /// is fastest for the thread that computes. A background thread (the engine's collective worker)
  /// that spins takes a core from computation, and on a node with as many busy threads as cores every
  /// microsecond it waits for a slower rank is a microsecond of computation lost. With
  /// `yield_cpu`, the collectives run as their non-blocking forms (the same algorithms for
  /// reduce-scatter; MPI's non-blocking all-reduce for all-reduce) and the thread polls them, spinning
  /// only briefly and then sleeping between polls. Set it on a communicator only one thread uses.
  void set_waiting_yields_cpu(bool yield_cpu) noexcept { state_->yield_cpu = yield_cpu; }
  bool waiting_yields_cpu() const noexcept { return state_->yield_cpu; }

  /// The flight recorder's name of this communicator: its lineage ("world", "world/split#0").
  const std::string& flight_name() const noexcept { return state_->name; }
  /// The members by world rank, in this communicator's rank order.
  const std::vector<int>& world_ranks() const noexcept { return state_->world_ranks; }

  /// Ranks on this node (MPI_COMM_TYPE_SHARED), and this rank's index among them. Collective.
  MpiComm split_node() const {
    MPI_Comm node = MPI_COMM_NULL;
    FSDP_MPI_CHECK(MPI_Comm_split_type(state_->comm, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL, &node));
    return MpiComm(node, /*owned=*/true, FlightRecorder::instance().child_name(state_->name, "node"));
  }
  /// Where this rank sits: rank and size of this communicator, its index among the ranks of its node
  /// (MPI_COMM_TYPE_SHARED), how many ranks share the node, and how many nodes there are. Collective.
  struct Placement {
    int rank = 0;
    int size = 1;
    int local_rank = 0;
    int local_size = 1;
    int nodes = 1;
  };
  Placement placement() const {
    const MpiComm node = split_node();
    Placement p{rank(), size(), node.rank(), node.size(), 1};
    std::int32_t leader = node.rank() == 0 ? 1 : 0;
    FSDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT32_T, MPI_SUM, state_->comm));
    p.nodes = leader;
    return p;
  }

  /// A communicator over the ranks with the same color, ordered by key. Collective.
  MpiComm split(int color, int key) const {
    MPI_Comm sub = MPI_COMM_NULL;
    FSDP_MPI_CHECK(MPI_Comm_split(state_->comm, color, key, &sub));
    return MpiComm(sub, /*owned=*/true, FlightRecorder::instance().child_name(state_->name, "split"));
  }

  /// recv (n * size elements) = concatenation over ranks of send (n elements). Collective.
  void all_gather(const void* send, void* recv, std::int64_t n, DType t) {
    count(&CommCounters::all_gather_bytes, n, t);
    probe_skew();
    const Stopwatch timed(state_->counters, &CommCounters::all_gather_seconds, "all_gather", n * static_cast<std::int64_t>(dtype_bytes(t)) * size());
    const CollectiveWatchdog::Scope watched("all_gather");
    const auto flown = flight("all_gather", n * static_cast<std::int64_t>(dtype_bytes(t)));
    const int c = detail::checked_count(n, "all_gather");
    if (size() == 1) return detail::copy_if_distinct(send, recv, n, t);
    if (state_->yield_cpu) {
      MPI_Request r = MPI_REQUEST_NULL;
      FSDP_MPI_CHECK(MPI_Iallgather(send, c, detail::mpi_datatype(t), recv, c, detail::mpi_datatype(t), state_->comm, &r));
      return detail::complete_yielding(&r, 1);
    }
    FSDP_MPI_CHECK(MPI_Allgather(send, c, detail::mpi_datatype(t), recv, c, detail::mpi_datatype(t), state_->comm));
  }

  /// send holds n * size elements; recv (n elements) = reduction over ranks of chunk `rank`. Collective.
  void reduce_scatter(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    if (op == ReduceOp::kMax) throw CommError("reduce_scatter supports sum and avg only");
    count(&CommCounters::reduce_scatter_bytes, n * size(), t);
    probe_skew();
    const Stopwatch timed(state_->counters, &CommCounters::reduce_scatter_seconds, "reduce_scatter",
                          n * static_cast<std::int64_t>(dtype_bytes(t)) * size());
    const CollectiveWatchdog::Scope watched("reduce_scatter");
    const auto flown = flight("reduce_scatter", n * size() * static_cast<std::int64_t>(dtype_bytes(t)));
    ring_reduce_scatter(send, recv, n, t);
    if (op == ReduceOp::kAvg) detail::scale_buffer(recv, n, t, 1.0 / size());
  }

  /// recv = reduction over ranks of send (n elements); send may equal recv. Collective.
  void all_reduce(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    count(&CommCounters::all_reduce_bytes, n, t);
    probe_skew();
    const Stopwatch timed(state_->counters, &CommCounters::all_reduce_seconds, "all_reduce", n * static_cast<std::int64_t>(dtype_bytes(t)));
    const CollectiveWatchdog::Scope watched("all_reduce");
    const auto flown = flight("all_reduce", n * static_cast<std::int64_t>(dtype_bytes(t)));
    if (!detail::mpi_can_reduce(t) && op == ReduceOp::kMax) throw CommError("all_reduce max of " + std::string(dtype_name(t)) + " is not supported");
    const int c = detail::checked_count(n, "all_reduce");
    if (size() == 1) {
      detail::copy_if_distinct(send, recv, n, t);
      return;
    }
    if (is_floating(t) && op != ReduceOp::kMax) {
      if (n <= kGatherAllReduceMaxBytes / (static_cast<std::int64_t>(dtype_bytes(t)) * size())) return all_reduce_by_gather(send, recv, n, t, op);
      return all_reduce_ring(send, recv, n, t, op);
    }
    if (state_->yield_cpu) {
      MPI_Request r = MPI_REQUEST_NULL;
      FSDP_MPI_CHECK(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, c, detail::mpi_datatype(t), detail::mpi_op(op), state_->comm, &r));
      detail::complete_yielding(&r, 1);
    } else {
      FSDP_MPI_CHECK(MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, c, detail::mpi_datatype(t), detail::mpi_op(op), state_->comm));
    }
    if (op == ReduceOp::kAvg) detail::scale_buffer(recv, n, t, 1.0 / size());
  }

  /// Copies root's buffer to every rank. Collective.
  void broadcast(void* buf, std::int64_t n, DType t, int root) {
    count(&CommCounters::broadcast_bytes, n, t);
    const Stopwatch timed(state_->counters, &CommCounters::broadcast_seconds, "broadcast", n * static_cast<std::int64_t>(dtype_bytes(t)));
    const CollectiveWatchdog::Scope watched("broadcast");
    const auto flown = flight("broadcast", n * static_cast<std::int64_t>(dtype_bytes(t)));
    if (size() == 1) return;
    if (state_->yield_cpu) {
      MPI_Request r = MPI_REQUEST_NULL;
      FSDP_MPI_CHECK(MPI_Ibcast(buf, detail::checked_count(n, "broadcast"), detail::mpi_datatype(t), root, state_->comm, &r));
      return detail::complete_yielding(&r, 1);
    }
    FSDP_MPI_CHECK(MPI_Bcast(buf, detail::checked_count(n, "broadcast"), detail::mpi_datatype(t), root, state_->comm));
  }

  void barrier() {
    const CollectiveWatchdog::Scope watched("barrier");
    const auto flown = flight("barrier", 0);
    FSDP_MPI_CHECK(MPI_Barrier(state_->comm));
  }

  /// The skew probe (skew_probe()): a timed barrier before a collective.
  void probe_skew() {
    if (!skew_probe() || size() == 1) return;
    const Stopwatch timed(state_->counters, &CommCounters::skew_seconds, "waiting for peers (skew probe)", 0);
    const CollectiveWatchdog::Scope watched("barrier (skew probe)");
    FSDP_MPI_CHECK(MPI_Barrier(state_->comm));
  }

  /// A barrier that gives up: throws CommError (id fsdp.comm.deadline) naming `what` if not every rank
  /// has arrived within `seconds`, e.g. because `what` was called on some ranks only. seconds <= 0
  /// waits forever. Collective. After a timeout this communicator is unusable (the barrier stays
  /// pending): the application should abort the job, which is what turns a hang into an error.
  void barrier_within(double seconds, const std::string& what) {
    if (size() == 1) return;
    if (seconds <= 0) return barrier();
    MPI_Request request = MPI_REQUEST_NULL;
    FSDP_MPI_CHECK(MPI_Ibarrier(state_->comm, &request));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    for (;;) {
      int done = 0;
      FSDP_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      if (done) return;
      if (std::chrono::steady_clock::now() > deadline) {
        // The request cannot be cancelled (MPI forbids it for collectives); it is left pending.
        throw CommError(what + ": not all " + std::to_string(size()) + " ranks arrived within " + std::to_string(static_cast<long long>(seconds)) +
                            " s (was it called on some ranks only?)",
                        "fsdp.comm.deadline");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  MpiRequest iall_gather(const void* send, void* recv, std::int64_t n, DType t) {
    count(&CommCounters::all_gather_bytes, n, t);
    flight("all_gather (non-blocking, issued)", n * static_cast<std::int64_t>(dtype_bytes(t)));
    const int c = detail::checked_count(n, "iall_gather");
    if (size() == 1) {
      detail::copy_if_distinct(send, recv, n, t);
      return {};
    }
    MPI_Request r = MPI_REQUEST_NULL;
    FSDP_MPI_CHECK(MPI_Iallgather(send, c, detail::mpi_datatype(t), recv, c, detail::mpi_datatype(t), state_->comm, &r));
    return {r, nullptr};
  }

  /// Non-blocking reduce-scatter (MPI_Ireduce_scatter_block; 16-bit floats complete eagerly via the ring).
  MpiRequest ireduce_scatter(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    if (size() == 1 || !detail::mpi_can_reduce(t) || op == ReduceOp::kMax) {
      reduce_scatter(send, recv, n, t, op);
      return {};
    }
    count(&CommCounters::reduce_scatter_bytes, n * size(), t);
    flight("reduce_scatter (non-blocking, issued)", n * size() * static_cast<std::int64_t>(dtype_bytes(t)));
    MPI_Request r = MPI_REQUEST_NULL;
    FSDP_MPI_CHECK(
        MPI_Ireduce_scatter_block(send, recv, detail::checked_count(n, "ireduce_scatter"), detail::mpi_datatype(t), MPI_SUM, state_->comm, &r));
    const double scale = 1.0 / size();
    std::function<void()> finish;
    if (op == ReduceOp::kAvg) finish = [recv, n, t, scale] { detail::scale_buffer(recv, n, t, scale); };
    return {r, std::move(finish)};
  }

  MpiRequest iall_reduce(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    if (size() == 1 || !detail::mpi_can_reduce(t)) {
      all_reduce(send, recv, n, t, op);
      return {};
    }
    count(&CommCounters::all_reduce_bytes, n, t);
    flight("all_reduce (non-blocking, issued)", n * static_cast<std::int64_t>(dtype_bytes(t)));
    MPI_Request r = MPI_REQUEST_NULL;
    FSDP_MPI_CHECK(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, detail::checked_count(n, "iall_reduce"), detail::mpi_datatype(t),
                                  detail::mpi_op(op), state_->comm, &r));
    const double scale = 1.0 / size();
    std::function<void()> finish;
    if (op == ReduceOp::kAvg) finish = [recv, n, t, scale] { detail::scale_buffer(recv, n, t, scale); };
    return {r, std::move(finish)};
  }

  MpiRequest ibroadcast(void* buf, std::int64_t n, DType t, int root) {
    count(&CommCounters::broadcast_bytes, n, t);
    if (size() == 1) return {};
    flight("broadcast (non-blocking, issued)", n * static_cast<std::int64_t>(dtype_bytes(t)));
    MPI_Request r = MPI_REQUEST_NULL;
    FSDP_MPI_CHECK(MPI_Ibcast(buf, detail::checked_count(n, "ibroadcast"), detail::mpi_datatype(t), root, state_->comm, &r));
    return {r, nullptr};
  }

 private:
  struct State {
    MPI_Comm comm = MPI_COMM_NULL;
    bool owned = false;
    int rank = 0;
    int size = 1;
    SharedCounters counters;
    bool yield_cpu = false;          // set_waiting_yields_cpu
    std::vector<std::byte> scratch;  // ring buffers, reused across calls
    std::string name;                // lineage for the flight recorder: "world", "world/split#0"
    int flight_id = -1;              // the flight recorder's index of this communicator
    std::vector<int> world_ranks;    // the members by world rank (empty if MPI could not tell)
    ~State() {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (owned && !finalized && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
    }
  };

  MpiComm(MPI_Comm comm, bool owned, std::string name) : state_(std::make_shared<State>()) {
    state_->comm = comm;
    state_->owned = owned;
    state_->name = std::move(name);
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    FSDP_MPI_CHECK(MPI_Comm_rank(comm, &state_->rank));
    FSDP_MPI_CHECK(MPI_Comm_size(comm, &state_->size));
    // The members by world rank: with the name, what identifies this communicator on every rank.
    MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
    std::vector<int> mine(static_cast<std::size_t>(state_->size)), world_ranks(mine.size());
    for (int i = 0; i < state_->size; ++i) mine[static_cast<std::size_t>(i)] = i;
    if (MPI_Comm_group(comm, &group) == MPI_SUCCESS && MPI_Comm_group(MPI_COMM_WORLD, &world_group) == MPI_SUCCESS &&
        MPI_Group_translate_ranks(group, state_->size, mine.data(), world_group, world_ranks.data()) == MPI_SUCCESS) {
      state_->world_ranks = world_ranks;
      state_->flight_id = FlightRecorder::instance().register_comm(state_->name, std::move(world_ranks));
    }
    if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
    if (world_group != MPI_GROUP_NULL) MPI_Group_free(&world_group);
  }

  /// Records a collective for the flight recorder (a no-op when it is off).
  FlightRecorder::Scope flight(const char* kind, std::int64_t bytes) const {
    auto& w = CollectiveWatchdog::instance();
    return FlightRecorder::Scope(state_->flight_id, kind, bytes, w.unit(), w.step());
  }

  void count(std::uint64_t CommCounters::*field, std::int64_t n, DType t) {
    state_->counters.add_call(field, static_cast<std::uint64_t>(n) * dtype_bytes(t));
  }

  static constexpr bool is_floating(DType t) noexcept {
    return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 || t == DType::kBFloat16;
  }

  // Below this many gathered bytes (n x element size x ranks) a floating-point all-reduce gathers every
  // rank's whole buffer and adds them in rank order: one MPI_Allgather (log N rounds in MPI) instead of
  // the ring's N-1 exchanges plus an all-gather, which matters for the scalars (the gradient norm of
  // clipping, the app's logged loss sums) at large N. The choice depends on n and N only, so every rank
  // and both waiting modes take the same path, and the additions run in a fixed order: the same bits
  // everywhere, given the same floating-point environment on every thread that adds (no rank or thread
  // may set flush-to-zero on its own; the ring's adds made the same assumption of the adding thread).
  // The cut-off is where the ring overtakes the gather (docs/performance.md, small all-reduces).
  static constexpr std::int64_t kGatherAllReduceMaxBytes = 8 * 1024;

  void all_reduce_by_gather(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    if (n == 0) return;
    const std::size_t bytes = static_cast<std::size_t>(n) * dtype_bytes(t);
    std::unique_ptr<std::byte[]> gathered(new std::byte[bytes * static_cast<std::size_t>(size())]);
    const int c = detail::checked_count(n, "all_reduce");
    if (state_->yield_cpu) {
      MPI_Request r = MPI_REQUEST_NULL;
      FSDP_MPI_CHECK(MPI_Iallgather(send, c, detail::mpi_datatype(t), gathered.get(), c, detail::mpi_datatype(t), state_->comm, &r));
      detail::complete_yielding(&r, 1);
    } else {
      FSDP_MPI_CHECK(MPI_Allgather(send, c, detail::mpi_datatype(t), gathered.get(), c, detail::mpi_datatype(t), state_->comm));
    }
    std::byte* sum = gathered.get();  // rank 0's buffer accumulates ranks 1..N-1, in that order
    for (int from = 1; from < size(); ++from) detail::add_buffers(sum, sum + bytes * static_cast<std::size_t>(from), sum, n, t);
    if (op == ReduceOp::kAvg) detail::scale_buffer(sum, n, t, 1.0 / size());
    std::memcpy(recv, sum, bytes);
  }

  // Floating-point sums: the ring reduce-scatter (our own add; MPI has none for bf16/fp16) over the
  // buffer padded to a multiple of the ranks, then an all-gather of the reduced chunks. The order of
  // additions is fixed by the ring, not by MPI's choice of algorithm, so blocking and yielding waits
  // (MPI's blocking and non-blocking all-reduce differ) give the same bits. Bandwidth: 5-15% below
  // MPI_Allreduce at 2 ranks, on par or above at 4 (docs/performance.md, raw MPI table).
  void all_reduce_ring(const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
    const std::int64_t chunk = (n + size() - 1) / size();
    const std::size_t eb = dtype_bytes(t);
    const bool pad = chunk * size() != n;
    std::unique_ptr<std::byte[]> padded;
    const void* source = send;
    void* target = recv;
    if (pad) {  // only when n is not a multiple of the ranks
      padded.reset(new std::byte[static_cast<std::size_t>(chunk * size()) * eb]);
      std::memcpy(padded.get(), send, static_cast<std::size_t>(n) * eb);
      std::memset(padded.get() + n * eb, 0, static_cast<std::size_t>(chunk * size() - n) * eb);
      source = target = padded.get();
    }
    std::unique_ptr<std::byte[]> mine(new std::byte[static_cast<std::size_t>(chunk) * eb]);
    ring_reduce_scatter(source, mine.get(), chunk, t);  // reads all of `source` before `target` is written
    if (op == ReduceOp::kAvg) detail::scale_buffer(mine.get(), chunk, t, 1.0 / size());
    const int c = detail::checked_count(chunk, "all_reduce");
    if (state_->yield_cpu) {
      MPI_Request r = MPI_REQUEST_NULL;
      FSDP_MPI_CHECK(MPI_Iallgather(mine.get(), c, detail::mpi_datatype(t), target, c, detail::mpi_datatype(t), state_->comm, &r));
      detail::complete_yielding(&r, 1);
    } else {
      FSDP_MPI_CHECK(MPI_Allgather(mine.get(), c, detail::mpi_datatype(t), target, c, detail::mpi_datatype(t), state_->comm));
    }
    if (pad) std::memcpy(recv, padded.get(), static_cast<std::size_t>(n) * eb);
  }

  void ring_reduce_scatter(const void* send, void* recv, std::int64_t n, DType t) {
    detail::ring_reduce_scatter(state_->comm, rank(), size(), state_->yield_cpu, state_->scratch, send, recv, n, t);
  }

  std::shared_ptr<State> state_;
};

static_assert(Communicator<MpiComm>);

}  // namespace fsdp
