// The runtime of a sharded model (torch layer; FSDP2 keeps the same knowledge in its param group and
// state): it owns the groups (EngineGroups), the units and the collective worker, and does what
// happens to the units in a step: gathering and freeing, the forward hooks, the backward hooks that
// reduce each unit's gradients, prefetching and the end of backward. UnitBuilder fills its units;
// FullyShardedDataParallel owns it and is the public face.
#pragma once

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <vector>

#include "fsdp/comm/collective_worker.hpp"
#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/watchdog.hpp"
#include "fsdp/core/execution_order.hpp"
#include "fsdp/core/lean_backward.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/torch/current_stream_order.hpp"
#include "fsdp/torch/engine_groups.hpp"
#include "fsdp/torch/flat_unit.hpp"
#include "fsdp/torch/gradient_collectives.hpp"
#include "fsdp/torch/hooks.hpp"
#include "fsdp/torch/options.hpp"
#include "fsdp/torch/overlapped_reductions.hpp"
#include "fsdp/trace.hpp"

namespace fsdp::detail {

template <Communicator Comm>
class ShardedRuntime final : private ForwardHooks, private GradReducer {
 public:
  /// Splits the groups (collective). `wrapper` is the public module (train()/eval() decides buffer
  /// syncing), `root` the wrapped model; both outlive the runtime.
  ShardedRuntime(Comm world, FsdpOptions options, const torch::nn::Module& wrapper, torch::nn::Module& root)
      : options_(std::move(options)), groups_(std::move(world), options_), wrapper_(&wrapper), root_module_(&root) {}

  ~ShardedRuntime() override {
    for (auto& u : units_)
      if (u->in_flight.valid()) u->in_flight.wait();  // the worker writes into `full`
    reductions_.reset();                              // ... and into gradient buffers
    worker_.reset();
    reducer_registry().erase(engine_id_);
    for (const auto& u : units_) hook_registry().erase_if(u->module, [this](const HookEntry& e) { return e.engine == this; });
  }

  ShardedRuntime(const ShardedRuntime&) = delete;
  ShardedRuntime& operator=(const ShardedRuntime&) = delete;

  const FsdpOptions& options() const noexcept { return options_; }
  EngineGroups<Comm>& groups() noexcept { return groups_; }
  const EngineGroups<Comm>& groups() const noexcept { return groups_; }
  /// The units in creation order (index 0 is the root); the engine's builder fills them.
  std::vector<std::unique_ptr<FlatUnit>>& units() noexcept { return units_; }
  const std::vector<std::unique_ptr<FlatUnit>>& units() const noexcept { return units_; }
  const OverlapStats& overlap_stats() const noexcept { return overlap_; }
  torch::Device compute_device() const noexcept { return compute_device_; }
  /// Sets where the units compute; a GPU communicator then orders its collectives with LibTorch's
  /// current stream there. Before the first collective on the units.
  void use_compute_device(torch::Device device) {
    compute_device_ = device;
    order_collectives_with_current_stream(groups_.world, compute_device_);
  }
  /// Inside no_sync: backward keeps gradients unreduced. Returns the previous setting.
  bool exchange_no_sync(bool on) noexcept { return std::exchange(no_sync_, on); }

  /// Makes the units reachable from autograd and from fsdp::forward (after they are built).
  void register_units() {
    engine_id_ = next_engine_id();
    reducer_registry().set(engine_id_, this);
    for (auto& up : units_) {
      if (up->info.index == 0 || up->frozen) continue;
      hook_registry().set(up->module, {this, up->info.index});
      if (options_.all_units_called_through_forward) up->hooked = FlatUnit::Hooked::kYes;
    }
  }

  // ---- for the engine: setup, gather and free, the root forward, the replicas' parts -------------

  void setup_overlap() {
    const bool prefetch_wanted = options_.backward_prefetch != BackwardPrefetch::NO_PREFETCH || options_.forward_prefetch;
    if (options_.limit_all_gathers < 0) throw ConfigError("limit_all_gathers must be >= 0, got " + std::to_string(options_.limit_all_gathers));
    const bool prefetch = prefetch_wanted && groups_.shard.size() > 1;  // else nothing is all-gathered: nothing to overlap
    if (prefetch && !comm_threads_may_call_concurrently<Comm>())
      throw ConfigError(
          "prefetching runs all-gathers on a worker thread: initialize MPI with MPI_THREAD_MULTIPLE "
          "(fsdp::MpiEnvironment(&argc, &argv, MPI_THREAD_MULTIPLE))");
    const bool overlap_reduce = options_.overlap_grad_reduce && groups_.world.size() > 1;
    if (overlap_reduce && !comm_progresses_on_its_own<Comm>() && !comm_threads_may_call_concurrently<Comm>())
      throw ConfigError(
          "overlap_grad_reduce runs reductions on a worker thread: initialize MPI with MPI_THREAD_MULTIPLE "
          "(fsdp::MpiEnvironment(&argc, &argv, MPI_THREAD_MULTIPLE))");
    // A communicator that progresses on its own (a GPU stream) overlaps without a worker: prefetches
    // and reductions are non-blocking collectives issued from this thread, one issuing order on every
    // rank. MPI needs the worker thread.
    groups_.add_worker_duplicates(prefetch, overlap_reduce);
    if (overlap_reduce)
      reductions_ = std::make_unique<OverlappedReductions>(
          overlap_, [this](int unit, const torch::Tensor& shard_grad) { return to_master(*units_[static_cast<std::size_t>(unit)], shard_grad); });
    if constexpr (!comm_progresses_on_its_own<Comm>()) {
      if (prefetch || overlap_reduce) worker_ = std::make_unique<CollectiveWorker>();
      if (reductions_) reductions_->use_worker(*worker_);
    }
  }

  // Waits for a prefetched all-gather of `u` (the exposed part of its communication).
  void finish_prefetch(FlatUnit& u) {
    if (!u.in_flight.valid()) return;
    const auto began = std::chrono::steady_clock::now();
    {
      const TraceScope traced("wait for prefetched all_gather", "comm", {{"unit", static_cast<double>(u.info.index)}});
      const CollectiveWatchdog::Scope watched("all_gather (prefetched, waiting for the worker)");
      auto done = std::move(u.in_flight);
      u.in_flight = {};
      try {
        done.get();  // rethrows the collective's CommError
      } catch (...) {
        u.gathered_version = -1;  // `full` holds garbage: the next gather() fills it again
        throw;
      }
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    overlap_.exposed_all_gather_seconds += waited;
    overlap_.waited_for_worker_seconds += waited;
  }

  // Allocates and fills `full`. A unit still gathered from a forward that had no backward is filled
  // again if the optimizer changed the shard since (its version counter moved).
  // With `ahead`, the all-gather is queued on the collective worker (a prefetch) and gather() returns
  // at once; a later gather() of the unit waits for it.
  void gather(FlatUnit& u, bool ahead = false) {
    if (u.companion >= 0) gather(*units_[static_cast<std::size_t>(u.companion)], ahead);
    if (u.params.empty() || !u.needs_gather()) return;
    if (!ahead) finish_prefetch(u);
    if (u.fill_is_current()) return;
    if (!u.gathered) u.allocate_full();
    u.note_fill(/*in_backward=*/end_of_backward_queued_);
    u.gathered_version = u.shard._version();
    // The slice kept after forward (reshard_after_forward_group): gathered again inside its group only.
    const bool from_kept = u.kept_slice.defined() && u.kept_version == u.shard._version();
    torch::Tensor source = from_kept ? u.kept_slice : u.shard;
    u.kept_slice = torch::Tensor();
    if (!from_kept && (u.low_precision || u.offloaded)) {  // cast (and copy to the device) first: the all-gather moves these bytes
      torch::NoGradGuard no_grad;
      source = u.shard.detach().to(u.full.device(), u.full.scalar_type(), /*non_blocking=*/u.offloaded);
    }
    Comm& comm = from_kept ? *groups_.forward_group : groups_.shard;
    auto* worker_comm = from_kept ? (groups_.worker_forward_group ? &*groups_.worker_forward_group : nullptr)
                                  : (groups_.worker_shard ? &*groups_.worker_shard : nullptr);
    const std::int64_t count = source.numel();
    if (u.layout.group_size() == 1) {
      torch::NoGradGuard no_grad;
      u.full.copy_(source);
    } else if (ahead && !worker_) {  // a GPU communicator: a non-blocking all-gather on its stream
      ++overlap_.prefetched;
      auto request = std::make_shared<decltype(worker_comm->iall_gather(nullptr, nullptr, 0, DType::kFloat32))>(
          worker_comm->iall_gather(source.data_ptr(), u.full.data_ptr(), count, to_comm_dtype(u.full.scalar_type())));
      u.in_flight = std::async(std::launch::deferred, [request, source] { request->wait(); }).share();  // runs in finish_prefetch
    } else if (ahead) {
      ++overlap_.prefetched;
      u.in_flight = worker_->submit(
          [comm = worker_comm, source, out = u.full.data_ptr(), n = count, dt = to_comm_dtype(u.full.scalar_type()), unit = u.info.index] {
            CollectiveWatchdog::instance().set_unit(unit);
            comm->all_gather(source.data_ptr(), out, n, dt);
            CollectiveWatchdog::instance().set_unit(-1);
          });
    } else {
      ++overlap_.gathered_on_demand;
      const auto began = std::chrono::steady_clock::now();
      CollectiveWatchdog::instance().set_unit(u.info.index);
      comm.all_gather(source.data_ptr(), u.full.data_ptr(), count, to_comm_dtype(u.full.scalar_type()));
      CollectiveWatchdog::instance().set_unit(-1);
      overlap_.exposed_all_gather_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    }
    u.gathered = true;
    trace_gathered_bytes();
  }

  // `after_forward`: a training forward ends and backward will gather the unit again; with
  // reshard_after_forward_group this rank then keeps its slice of `full` over its group.
  void reshard(FlatUnit& u, bool after_forward = false) {
    finish_prefetch(u);  // the worker may still be writing into `full`
    if (u.companion >= 0) reshard(*units_[static_cast<std::size_t>(u.companion)], after_forward);
    if (!u.gathered || !u.needs_gather() || u.params.empty()) return;
    if (after_forward && groups_.forward_group && u.layout.group_size() > 1 && !u.frozen) {
      torch::NoGradGuard no_grad;
      const std::int64_t length = u.layout.padded_numel() / groups_.forward_group->size();
      u.kept_slice = u.full.narrow(0, length * groups_.forward_group->rank(), length).clone();
      u.kept_version = u.gathered_version;
    }
    u.free_full();
    u.gathered = false;
    trace_gathered_bytes();
  }

  void root_pre_forward() {
    end_of_backward_queued_ = false;          // a backward that threw never ran its end-of-backward callback
    if (reductions_) reductions_->discard();  // ... nor waited for its overlapped reductions: they must not reach a later step
    synchronize_shards();
    order_.begin_forward();
    for (auto& u : units_) {
      u->entered = false;
      u->grafted_by_root = false;
      u->backward_reads_no_params = false;                   // each forward declares it again
      if (u->pending_backward == 0) u->releasing_reads = 0;  // else reads of a forward whose backward is to come
      u->kept_slice = torch::Tensor();                       // kept for a backward that never came: the shard may have changed since
      u->recomputed_grad = torch::Tensor();                  // kept by a backward that threw before the unit's own node ran
    }
    // The root unit and every nested unit not known to be called through fsdp::forward (frozen
    // companions follow their unit).
    for (auto& u : units_) {
      if (u->frozen) continue;
      if (u->info.index != 0 && u->hooked == FlatUnit::Hooked::kYes) continue;
      gather(*u);
      graft(*u);
      u->grafted_by_root = true;
    }
  }

  void root_post_forward(const std::vector<at::Tensor>& outputs, bool complete) {
    for (auto& u : units_)
      if (u->info.index != 0 && !u->frozen && u->hooked == FlatUnit::Hooked::kUnknown && !u->entered) u->hooked = FlatUnit::Hooked::kNo;
    if (wrapper_->is_training() && options_.buffer_sync == BufferSync::AVERAGE) average_buffers(groups_.world, *root_module_);
    bool hooked = false;
    if (torch::GradMode::is_enabled()) {
      for (const auto& t : outputs) {
        if (!t.requires_grad()) continue;
        const_cast<at::Tensor&>(t).register_hook([id = engine_id_](const at::Tensor&) { live_engine(id).pre_backward(0); });
        hooked = true;
      }
    }
    if (!hooked && (complete || !torch::GradMode::is_enabled())) {
      // Nothing will run backward through this forward: free what the root gathered, and the slices
      // units kept for a backward.
      for (auto& u : units_) {
        if (u->grafted_by_root) reshard(*u);
        u->kept_slice = torch::Tensor();
      }
    }
  }

  bool optimizer_sharded_over_replicas() const { return groups_.optimizer_sharded_over_replicas(options_); }

  // With the optimizer sharded over the world: all-gathers, across the replicas, the parts of every
  // unit's group shard that an optimizer may have updated (each replica updates only its own part):
  // all of them from the moment gradients reach the parts until the next backward begins (a step
  // falls in that window, and LibTorch's SGD writes through .data(), which no version counter sees),
  // and otherwise those written in place. Every rank decides alike (the same steps everywhere).
  // Collective over the replica group; a no-op otherwise.
  void synchronize_shards() {
    if (!optimizer_sharded_over_replicas()) return;
    const bool after_gradients = parts_have_gradients_;
    torch::NoGradGuard no_grad;
    for (auto& up : units_) {
      auto& u = *up;
      if (u.params.empty() || u.frozen || (!after_gradients && u.shard._version() == u.replicas_synced_version)) continue;
      finish_prefetch(u);  // the worker may be reading the shard
      CollectiveWatchdog::instance().set_unit(u.info.index);
      all_gather_parts(groups_.replica, u.optimized, u.shard);  // the shard's storage has room for every part
      CollectiveWatchdog::instance().set_unit(-1);
      // A copy of the unit still gathered from before (a forward without backward), or a slice kept
      // of it, must not be used: refilled at the next gather. The shard's version stays, so graphs of
      // forwards whose backward is still to come stay valid (a step is seen by note_fill).
      u.refill_needed = true;
      u.kept_slice = torch::Tensor();
      u.replicas_synced_version = u.shard._version();
    }
  }

 private:
  // ---- prefetching and gathering ---------------------------------------------------------------

  // Issues unit `index`'s all-gather on the worker if prefetching is on, the unit will need one and the
  // limit allows it. Every rank makes the same decision (same order, same state).
  // `for_backward`: only a unit whose backward is still to come (the root's gradients are reduced last,
  // after every nested unit's backward).
  void prefetch(int index, bool for_backward = false) {
    if (!groups_.worker_shard || index <= 0) return;
    auto& u = *units_[static_cast<std::size_t>(index)];
    if (u.params.empty() || u.frozen || !u.needs_gather() || u.in_flight.valid()) return;
    if (for_backward && (u.pending_backward <= 0 || u.backward_reads_no_params)) return;
    if (u.fill_is_current()) return;
    if (options_.limit_all_gathers > 0 && prefetched_ahead() >= options_.limit_all_gathers) return;
    gather(u, /*ahead=*/true);
  }

  int prefetched_ahead() const {
    int n = 0;
    for (const auto& u : units_) n += u->in_flight.valid() ? 1 : 0;
    return n;
  }

  // With tracing on: a counter of the bytes held in gathered unit buffers, after each gather/free.
  void trace_gathered_bytes() const {
    auto& tracer = Tracer::instance();
    if (!tracer.enabled()) return;
    std::int64_t bytes = 0;
    for (const auto& u : units_)
      if (u->gathered && u->needs_gather()) bytes += u->layout.padded_numel() * static_cast<std::int64_t>(u->full.element_size());
    tracer.counter("gathered parameters", {{"MiB", static_cast<double>(bytes) / 1048576.0}});
  }

  // Makes the module's parameters of `u` children of a fresh UnitGather node so backward reaches it.
  void graft(FlatUnit& u) {
    if (u.params.empty() || u.frozen || !torch::GradMode::is_enabled()) return;
    auto views = UnitGather::apply(u.optimized, engine_id_, static_cast<std::int64_t>(u.info.index), &u);
    for (std::size_t i = 0; i < u.params.size(); ++i)
      torch::autograd::impl::set_gradient_edge(u.params[i], torch::autograd::impl::gradient_edge(views[i]));
    ++u.pending_backward;
  }

  // ---- the hooks of nested units' forward and of backward (ForwardHooks, GradReducer) -------------

  void pre_forward(int unit) override {
    auto& u = *units_[static_cast<std::size_t>(unit)];
    u.entered = true;
    if (Tracer::instance().enabled()) u.forward_began_us = Tracer::instance().now_us();
    if (u.hooked == FlatUnit::Hooked::kUnknown) u.hooked = FlatUnit::Hooked::kYes;
    gather(u);  // also when the root grafted it: a second call may follow a free after the first
    if (!u.grafted_by_root) graft(u);
    order_.record(unit);
    if (options_.forward_prefetch) prefetch(order_.next_forward(unit));
  }

  c10::Device recompute_device() const override { return compute_device_; }

  void recomputed_backward(int unit, bool begins) override {
    if (begins)
      recomputing_.push_back(unit);
    else
      recomputing_.pop_back();
  }

  /// Whether `unit` is `ancestor` or lies inside it.
  bool within(int unit, int ancestor) const {
    for (int u = unit; u >= 0; u = units_[static_cast<std::size_t>(u)]->info.parent)
      if (u == ancestor) return true;
    return false;
  }

  void will_release_before_gradient(int unit) override { ++units_[static_cast<std::size_t>(unit)]->releasing_reads; }

  void release_before_gradient(int unit, const at::Tensor& weight) override {
    auto& u = *units_[static_cast<std::size_t>(unit)];
    if (u.releasing_reads > 0) --u.releasing_reads;
    UnitAtWeightRelease state;
    state.sole_parameter = u.params.size() == 1 && u.params.front().unsafeGetTensorImpl() == weight.unsafeGetTensorImpl();
    state.called_through_forward = u.hooked == FlatUnit::Hooked::kYes;
    state.recomputing = !recomputing_.empty();
    state.frozen_companion = u.companion >= 0;
    state.pending_backwards = u.pending_backward;
    state.releasing_reads_left = u.releasing_reads;
    if (!may_release_before_gradient(state) || !u.gathered || !u.needs_gather()) return;
    reshard(u);
    ++overlap_.released_before_gradient;
  }

  void backward_reads_no_parameter(int unit) override {
    auto& u = *units_[static_cast<std::size_t>(unit)];
    if (fsdp::backward_gathers(/*declared_reads_no_parameter=*/true, /*checkpointed=*/checkpoint_anchor(unit).defined())) return;
    u.backward_reads_no_params = true;
    u.kept_slice = torch::Tensor();  // kept after forward (reshard_after_forward_group) for a gather that will not come
  }

  at::Tensor checkpoint_anchor(int unit) override {
    if (!options_.activation_checkpointing || unit == 0 || !torch::GradMode::is_enabled()) return {};
    const auto& u = *units_[static_cast<std::size_t>(unit)];
    if (u.params.empty() || !u.optimized.requires_grad()) return {};
    return u.optimized;
  }

  void post_forward(int unit, const std::vector<at::Tensor>& outputs, bool complete) override {
    auto& u = *units_[static_cast<std::size_t>(unit)];
    // On the first forward the root gathered and grafted this unit before it was known to be called
    // through fsdp::forward; from here on it is handled like any hooked unit.
    bool hooked = false;
    if (torch::GradMode::is_enabled()) {
      for (const auto& t : outputs) {
        if (!t.requires_grad()) continue;
        const_cast<at::Tensor&>(t).register_hook([id = engine_id_, unit](const at::Tensor&) { live_engine(id).pre_backward(unit); });
        hooked = true;
      }
    }
    // Free now only if backward can gather again (through an output hook) or will never come.
    const bool backward_needs_params = torch::GradMode::is_enabled() && u.pending_backward > 0;
    // Without a pending backward (e.g. evaluation under NoGradGuard) keeping the unit gathered helps
    // nothing, whatever the strategy.
    if (!backward_needs_params || (EngineGroups<Comm>::reshard_after_forward(options_) && hooked && complete))
      reshard(u, /*after_forward=*/backward_needs_params);
    trace_unit_span(u.forward_began_us, "forward ", u);
  }

  void queue_end_of_backward() {
    if (end_of_backward_queued_) return;
    end_of_backward_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([id = engine_id_] {
      if (const auto engine = reducer_registry().find(id)) (*engine)->end_of_backward();
    });
  }

  void pre_backward(int unit) override {
    // A new backward: any step on the last one's gradients came before the forward that led here, and
    // that forward re-gathered the parts (synchronize_shards()).
    if (!end_of_backward_queued_) parts_have_gradients_ = false;
    queue_end_of_backward();
    if (Tracer::instance().enabled()) units_[static_cast<std::size_t>(unit)]->backward_began_us = Tracer::instance().now_us();
    if (unit == 0) {
      for (auto& u : units_)
        if (u->grafted_by_root && (u->info.index == 0 || u->hooked != FlatUnit::Hooked::kYes)) gather(*u);
    } else if (!units_[static_cast<std::size_t>(unit)]->backward_reads_no_params) {
      gather(*units_[static_cast<std::size_t>(unit)]);
    }
    // The next unit to run backward is the one that ran before this one in forward.
    if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_PRE) prefetch(order_.next_backward(unit), /*for_backward=*/true);
  }

  torch::Tensor reduce_unit_grads(int unit, const torch::autograd::variable_list& grads) override {
    auto& u = *units_[static_cast<std::size_t>(unit)];
    // Grad mode inside a backward node means create_graph: the packed, reduced gradient would be a
    // constant to the next differentiation, a silently wrong second derivative. Every rank reaches the
    // same first unit, before its collectives.
    if (torch::GradMode::is_enabled())
      throw ConfigError("backward with create_graph = true reached FSDP unit '" + u.trace_name() +
                            "': its gradient's reduction is not differentiable again (no double backward through a wrapped module)",
                        "fsdp.engine");
    torch::NoGradGuard no_grad;
    if (!recomputing_.empty() && !within(unit, recomputing_.back())) {
      // Reached from a checkpointed descendant's recomputation (a weight of this unit it uses): this
      // unit's own backward node runs later in the outer backward and reduces both parts at once
      // (or end_of_backward does, if it never runs); reducing here would reduce twice and free the
      // unit while the outer backward still needs it.
      auto part = u.pack_grads(grads, compute_device_);
      u.recomputed_grad = u.recomputed_grad.defined() ? u.recomputed_grad.add_(part) : part;
      return torch::Tensor();
    }
    if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST) prefetch(order_.next_backward(unit), /*for_backward=*/true);
    const bool sharded = u.layout.group_size() > 1;
    // A reduce-scatter only reads its input: a single parameter's gradient is reduced where it lies.
    const bool single_part = !u.unsynced_grad.defined() && !u.recomputed_grad.defined();
    torch::Tensor flat = sharded && !no_sync_ && single_part ? u.grad_as_flat(grads, compute_device_) : torch::Tensor();
    if (flat.defined())
      ++overlap_.reduced_in_place;
    else
      flat = u.pack_grads(grads, compute_device_);
    if (u.recomputed_grad.defined()) {
      flat.add_(u.recomputed_grad);
      u.recomputed_grad = torch::Tensor();
    }
    return reduce_flat(u, std::move(flat), /*may_overlap=*/true);
  }

  /// Reduces unit `u`'s packed flat gradient (or keeps it inside no_sync) and frees the unit; returns
  /// the gradient of its optimized shard, or nothing when it is kept or left to the worker.
  torch::Tensor reduce_flat(FlatUnit& u, torch::Tensor flat, bool may_overlap) {
    const int unit = u.info.index;
    const bool overlap = may_overlap && reductions_ != nullptr;
    const bool sharded = u.layout.group_size() > 1;
    if (no_sync_) {
      if (u.unsynced_grad.defined())
        u.unsynced_grad.add_(flat);
      else
        u.unsynced_grad = flat;
      release_after_backward(u);
      return torch::Tensor();  // no gradient reaches the shard yet
    }
    if (u.unsynced_grad.defined()) {
      flat.add_(u.unsynced_grad);
      u.unsynced_grad = torch::Tensor();
    }
    const auto& mp = options_.mixed_precision;
    const auto reduce_dtype = mp.reduce_dtype ? *mp.reduce_dtype : (mp.param_dtype ? *mp.param_dtype : u.dtype);
    if (reduce_dtype != flat.scalar_type()) flat = flat.to(reduce_dtype);  // the collectives move these bytes
    const DType dt = to_comm_dtype(flat.scalar_type());
    // With the optimizer sharded over the world the group shard's gradient is reduce-scattered across
    // the replicas into this rank's part: it needs room for all the parts (the last may run into padding).
    const bool to_part = optimizer_sharded_over_replicas() && !u.frozen;
    const std::int64_t shard_numel = u.layout.shard_numel();
    const std::int64_t part_numel = u.optimized.numel();
    const std::int64_t room = to_part ? part_numel * groups_.replica.size() : shard_numel;
    torch::Tensor shard_grad;
    if (sharded) {
      shard_grad = torch::empty({room}, flat.options());
      if (room > shard_numel) shard_grad.narrow(0, shard_numel, room - shard_numel).zero_();
    } else {
      if (room > flat.numel()) flat = torch::cat({flat, torch::zeros({room - flat.numel()}, flat.options())});
      shard_grad = flat;
    }
    const torch::Tensor part_grad = to_part ? torch::empty({part_numel}, flat.options()) : torch::Tensor();
    if (to_part) parts_have_gradients_ = true;
    const torch::Tensor result = to_part ? part_grad : shard_grad;
    if (overlap) {
      // The worker reduces while backward goes on; the shard's grad is set in end_of_backward, so
      // autograd gets no gradient for the shard here.
      queue_end_of_backward();
      Comm* shard_group = sharded && groups_.worker_shard ? &*groups_.worker_shard : nullptr;
      Comm* replica_group = groups_.worker_replica ? &*groups_.worker_replica : nullptr;
      if (worker_)
        reductions_->submit(
            unit, sharded, [=] { reduce_gradient(shard_group, replica_group, flat, shard_grad, shard_numel, part_grad, dt); }, result);
      else
        reductions_->submit_issued(unit, sharded, issue_gradient_reduction(shard_group, replica_group, flat, shard_grad, shard_numel, part_grad, dt),
                                   result);
      release_after_backward(u);
      trace_unit_span(u.backward_began_us, "backward ", u);
      return torch::Tensor();
    }
    ++overlap_.reductions_synchronous;
    CollectiveWatchdog::instance().set_unit(u.info.index);
    reduce_gradient(sharded ? &groups_.shard : nullptr, groups_.replica.size() > 1 ? &groups_.replica : nullptr, flat, shard_grad, shard_numel,
                    part_grad, dt);
    CollectiveWatchdog::instance().set_unit(-1);
    release_after_backward(u);
    trace_unit_span(u.backward_began_us, "backward ", u);
    return to_master(u, result);
  }

  // A reduced gradient in the master shard's dtype and memory (host when offloaded).
  static torch::Tensor to_master(const FlatUnit& u, const torch::Tensor& shard_grad) {
    return shard_grad.scalar_type() == u.dtype && !u.offloaded ? shard_grad : shard_grad.to(u.shard.device(), u.dtype);
  }

  // AccumulateGrad's arithmetic for every unit reduced on the worker in this backward: set the
  // shard's grad, or add this backward's gradient to it, in the order the units finished.
  void finish_reductions() {
    if (!reductions_) return;
    torch::NoGradGuard no_grad;
    for (auto& [unit, grad] : reductions_->finish()) {
      auto& slot = units_[static_cast<std::size_t>(unit)]->optimized.mutable_grad();
      if (slot.defined())
        slot.add_(grad);
      else
        slot = grad.detach();
    }
  }

  void release_after_backward(FlatUnit& u) {
    if (--u.pending_backward <= 0) {
      u.pending_backward = 0;
      u.backward_done_since_fill = true;
      reshard(u);
    }
  }

  void end_of_backward() override {
    end_of_backward_queued_ = false;
    // Gradient that reached a unit only from a checkpointed descendant's recomputation: its own node
    // never ran. Reduced here, in unit order on every rank, into the shard's gradient.
    for (auto& u : units_) {
      if (!u->recomputed_grad.defined()) continue;
      torch::NoGradGuard no_grad;
      const auto g = reduce_flat(*u, std::exchange(u->recomputed_grad, torch::Tensor()), /*may_overlap=*/false);
      if (!g.defined()) continue;
      auto& grad = u->optimized.mutable_grad();
      grad = grad.defined() ? grad.add_(g) : g.detach();
    }
    for (auto& u : units_) {
      u->pending_backward = 0;
      u->releasing_reads = 0;
      reshard(*u);
      // A slice kept for a backward that did not reach the unit: the next step's optimizer may change
      // the shard without moving its version counter (LibTorch's SGD writes through .data()).
      u->kept_slice = torch::Tensor();
    }
    // No host wait here: a GPU communicator's collectives are stream-ordered, and its lane's watcher
    // thread ends a hung or failed one (the next call then throws); the host waits where it reads.
    finish_reductions();
  }

  FsdpOptions options_;
  EngineGroups<Comm> groups_;  // after options_: built from them
  const torch::nn::Module* wrapper_;
  torch::nn::Module* root_module_;
  torch::Device compute_device_{torch::kCPU};
  std::unique_ptr<CollectiveWorker> worker_;          // runs prefetched all-gathers and overlapped reductions
  std::unique_ptr<OverlappedReductions> reductions_;  // ... and wait there until the end of backward
  ExecutionOrder order_;                              // which unit to prefetch next
  OverlapStats overlap_;
  std::vector<std::unique_ptr<FlatUnit>> units_;
  std::int64_t engine_id_ = 0;
  bool end_of_backward_queued_ = false;
  bool no_sync_ = false;
  bool parts_have_gradients_ = false;  // optimizer sharded over the world: gradients reached the parts, and no backward began since
  std::vector<int> recomputing_;       // checkpointed units whose recomputed backward is running, innermost last
};

}  // namespace fsdp::detail
