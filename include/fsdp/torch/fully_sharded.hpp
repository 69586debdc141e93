// FullyShardedDataParallel: wraps a torch::nn::Module so that each rank keeps 1/N of every unit's
// flat parameter (torch layer). See docs/design.md for the flow of one step.
//
// Per unit: the parameters are flattened into one padded buffer `full`; each rank keeps the leaf
// tensor `shard` (what the optimizer sees) and every module parameter is a view of `full`, whose
// storage is freed while resharded and refilled by an all-gather. A custom autograd Function
// (UnitGather) sits between `shard` and the parameter views: its backward packs the unit's gradients
// into a flat buffer and reduce-scatters them, so autograd accumulates the averaged shard gradient
// into `shard.grad()`.
#pragma once

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <set>
#include <future>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fsdp/comm/collective_worker.hpp"
#include "fsdp/comm/communicator.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/torch/deferred_init.hpp"
#include "fsdp/torch/flat_unit.hpp"
#include "fsdp/torch/hooks.hpp"
#include "fsdp/torch/options.hpp"
#include "fsdp/torch/overlapped_reductions.hpp"
#include "fsdp/torch/optim_state.hpp"
#include "fsdp/torch/wrap_policy.hpp"
#include "fsdp/trace.hpp"

namespace fsdp {

/// Wraps `module` (a std::shared_ptr to a torch::nn::Module subclass) for fully sharded data parallel
/// training over communicator `Comm`. Construction, forward, backward, summon_full_params() and
/// memory_stats() with an optimizer are collective: every rank calls them in the same order.
template <class ModuleImpl, Communicator Comm>
class FullyShardedDataParallel : public torch::nn::Module, private detail::ForwardHooks, private detail::GradReducer {
 public:
  FullyShardedDataParallel(std::shared_ptr<ModuleImpl> module, Comm comm, FsdpOptions options = {})
      : torch::nn::Module("FullyShardedDataParallel"), module_(std::move(module)), world_(std::move(comm)), options_(std::move(options)) {
    if (!module_) throw ConfigError("FullyShardedDataParallel: module is null");
    setup_groups();
    build_units();
    setup_overlap();
    engine_id_ = detail::next_engine_id();
    detail::reducer_registry()[engine_id_] = this;
  }

  ~FullyShardedDataParallel() override {
    for (auto& u : units_)
      if (u->in_flight.valid()) u->in_flight.wait();  // the worker writes into `full`
    reductions_.reset();                              // ... and into gradient buffers
    worker_.reset();
    detail::reducer_registry().erase(engine_id_);
    auto& hooks = detail::hook_registry();
    for (const auto& u : units_)
      if (const auto it = hooks.find(u->module); it != hooks.end() && it->second.engine == this) hooks.erase(it);
  }

  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// Runs the wrapped module's forward on this rank's local batch. Collective.
  template <class... Args>
  auto forward(Args&&... args) {
    const TraceScope traced("forward (root)", "forward");
    root_pre_forward();
    auto result = module_->forward(cast_input(std::forward<Args>(args))...);
    std::vector<at::Tensor> outputs;
    const bool complete = detail::collect_tensors(result, outputs);
    root_post_forward(outputs, complete);
    return result;
  }

  /// A floating-point tensor argument of the root forward in MixedPrecision::param_dtype.
  torch::Tensor cast_input(const torch::Tensor& t) const {
    const auto& mp = options_.mixed_precision;
    if (mp.param_dtype && mp.cast_forward_inputs && t.defined() && t.is_floating_point()) return t.to(*mp.param_dtype);
    return t;
  }
  template <class T>
  requires(!std::is_same_v<std::decay_t<T>, torch::Tensor>) T && cast_input(T&& arg)
  const { return std::forward<T>(arg); }

  /// The wrapped module. Its parameters are views of the gathered buffers: read them only inside
  /// summon_full_params().
  std::shared_ptr<ModuleImpl> module() const { return module_; }

  const FsdpOptions& options() const noexcept { return options_; }
  /// All-gathers that overlapped computation and the time the computing thread still waited. Local.
  const OverlapStats& overlap_stats() const noexcept { return overlap_; }

  /// Where the units compute (FsdpOptions::device, or where the module's parameters were).
  torch::Device compute_device() const noexcept { return compute_device_; }
  ShardingStrategy sharding_strategy() const noexcept { return options_.sharding_strategy; }
  Comm& comm() noexcept { return world_; }
  Comm& shard_comm() noexcept { return shard_comm_; }
  Comm& replica_comm() noexcept { return replica_comm_; }
  int rank() const { return world_.rank(); }
  int world_size() const { return world_.size(); }
  int shard_group_size() const { return shard_comm_.size(); }

  /// The units in creation order (index 0 is the root).
  std::vector<UnitInfo> units() const {
    std::vector<UnitInfo> out;
    for (const auto& u : units_) {
      UnitInfo i = u->info;
      const auto& owner = u->frozen ? *units_[static_cast<std::size_t>(u->info.parent)] : *u;
      i.called_through_hook = owner.hooked == detail::FlatUnit::Hooked::kYes;
      out.push_back(std::move(i));
    }
    return out;
  }

  /// Total number of (unpadded) model parameters.
  std::int64_t num_params() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n += u->layout.numel();
    return n;
  }

  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_->train(on);
  }

  /// RAII scope in which every module parameter holds its full value on every rank.
  class FullParamsScope {
   public:
    FullParamsScope(FullyShardedDataParallel* owner, bool writeback, std::vector<int> gathered_here, std::vector<torch::Tensor> saved)
        : owner_(owner), writeback_(writeback), gathered_here_(std::move(gathered_here)), saved_(std::move(saved)) {}
    FullParamsScope(FullParamsScope&& other) noexcept
        : owner_(std::exchange(other.owner_, nullptr)),
          writeback_(other.writeback_),
          gathered_here_(std::move(other.gathered_here_)),
          saved_(std::move(other.saved_)) {}
    FullParamsScope(const FullParamsScope&) = delete;
    FullParamsScope& operator=(const FullParamsScope&) = delete;
    FullParamsScope& operator=(FullParamsScope&&) = delete;
    /// Local (no communication): keeps or discards changes, then frees what the scope gathered.
    ~FullParamsScope() {
      if (!owner_) return;
      try {
        owner_->end_summon(writeback_, gathered_here_, saved_);
      } catch (const std::exception& e) {  // a destructor must not throw; this is a bug if it happens
        std::fprintf(stderr, "fsdp: summon_full_params scope end failed: %s\n", e.what());
      }
    }

   private:
    FullyShardedDataParallel* owner_;
    bool writeback_;
    std::vector<int> gathered_here_;
    std::vector<torch::Tensor> saved_;  // per unit: the shard at entry where shard and full share storage
  };

  /// Gathers every unit so module()->parameters() hold full values (hfai's summon_full_params).
  /// With `writeback`, changes made to the parameters inside the scope (under torch::NoGradGuard, the
  /// same on every rank) are kept; without it they are discarded. Collective on entry; the end is local.
  [[nodiscard]] FullParamsScope summon_full_params(bool writeback = false) {
    for (auto& u : units_) finish_prefetch(*u);  // a prefetch left by a forward that did not use it
    std::vector<int> gathered_here;
    std::vector<torch::Tensor> saved(units_.size());
    for (auto& u : units_) {
      if (u->low_precision && !u->params.empty()) {
        // Full precision inside the scope: gather the master shards and point the parameters there.
        u->summoned = gather_flat(u->info.index, u->shard);
        u->point_params_at(u->summoned);
        continue;
      }
      if (!u->gathered) {
        gather(*u);
        gathered_here.push_back(u->info.index);
      }
      // Unsharded units expose the shard itself; keep a copy to restore if changes are discarded.
      if (!writeback && u->layout.group_size() == 1 && u->shard.defined()) saved[static_cast<std::size_t>(u->info.index)] = u->shard.detach().clone();
    }
    return FullParamsScope(this, writeback, std::move(gathered_here), std::move(saved));
  }

  /// Scales the shards' gradients so that their global `norm_type`-norm is at most `max_norm` and
  /// returns the norm before clipping (PyTorch's clip_grad_norm_). Every element is counted once:
  /// the shards of a group are disjoint, replica groups hold copies, padding is zero. Collective.
  double clip_grad_norm(double max_norm, double norm_type = 2.0) {
    if (!(max_norm > 0)) throw ConfigError("clip_grad_norm: max_norm must be positive, got " + std::to_string(max_norm));
    if (!(norm_type > 0)) throw ConfigError("clip_grad_norm: norm_type must be positive, got " + std::to_string(norm_type));
    torch::NoGradGuard no_grad;
    const bool is_inf = std::isinf(norm_type);
    double local = 0;
    for (const auto& u : units_) {
      if (!u->shard.defined() || !u->shard.grad().defined()) continue;
      const auto g = u->shard.grad().to(torch::kDouble).abs();
      if (is_inf)
        local = std::max(local, g.numel() ? g.max().item<double>() : 0.0);
      else
        local += g.pow(norm_type).sum().item<double>();
    }
    shard_comm_.all_reduce(&local, &local, 1, DType::kFloat64, is_inf ? ReduceOp::kMax : ReduceOp::kSum);
    const double total = is_inf ? local : std::pow(local, 1.0 / norm_type);
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1) {
      for (auto& u : units_)
        if (u->shard.defined() && u->shard.grad().defined()) u->shard.mutable_grad().mul_(coef);
    }
    return total;
  }

  /// RAII scope for gradient accumulation without communication: backward passes inside it keep the
  /// unit gradients locally (unsharded, like PyTorch's no_sync); the first backward after it reduces
  /// them together with its own. Local.
  class NoSyncScope {
   public:
    explicit NoSyncScope(FullyShardedDataParallel* owner) : owner_(owner), previous_(std::exchange(owner->no_sync_, true)) {}
    NoSyncScope(NoSyncScope&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)), previous_(other.previous_) {}
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;
    NoSyncScope& operator=(NoSyncScope&&) = delete;
    ~NoSyncScope() {
      if (owner_) owner_->no_sync_ = previous_;
    }

   private:
    FullyShardedDataParallel* owner_;
    bool previous_;
  };
  [[nodiscard]] NoSyncScope no_sync() { return NoSyncScope(this); }

  /// Full parameters by fully qualified name, gathered one unit at a time (each rank gets all).
  /// Collective.
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    torch::NoGradGuard no_grad;
    for (auto& u : units_) {
      if (u->params.empty()) continue;
      const auto flat = gather_flat(u->info.index, u->shard);  // master precision, one unit at a time
      for (std::size_t i = 0; i < u->params.size(); ++i) out.emplace_back(u->info.param_names[i], u->param_view(flat, i).clone());
    }
    return out;
  }

  /// Bytes held for training state on this rank. Local.
  MemoryStats memory_stats(const torch::optim::Optimizer* optimizer = nullptr) const {
    MemoryStats m;
    for (const auto& u : units_) {
      const std::int64_t elem = u->shard.defined() ? static_cast<std::int64_t>(u->shard.element_size()) : 4;
      const std::int64_t padded_bytes = u->layout.padded_numel() * elem;
      m.unsharded_param_bytes += padded_bytes;
      m.largest_unit_bytes = std::max(m.largest_unit_bytes, padded_bytes);
      if (!u->shard.defined()) continue;
      m.shard_param_bytes += u->shard.numel() * elem;
      if (u->shard.grad().defined()) m.grad_bytes += u->shard.grad().numel() * elem;
      if (u->unsynced_grad.defined()) m.grad_bytes += u->unsynced_grad.numel() * elem;
      if (u->gathered && u->needs_gather()) m.gathered_param_bytes += u->layout.padded_numel() * static_cast<std::int64_t>(u->full.element_size());
    }
    if (optimizer) m.optimizer_state_bytes = optimizer_state_bytes(*optimizer);
    return m;
  }

  void pretty_print(std::ostream& stream) const override { stream << describe(); }

  /// A printable tree of the wrapped model with its units.
  std::string describe() const {
    std::ostringstream os;
    os << "FullyShardedDataParallel(strategy=" << to_string(options_.sharding_strategy) << ", world_size=" << world_.size()
       << ", shard_group_size=" << shard_comm_.size() << ", policy=" << options_.auto_wrap_policy.description() << ", units=" << units_.size()
       << ", params=" << num_params() << ")\n";
    print_module(os, *module_, "", "", 1);
    return os.str();
  }

  /// Bytes moved and time spent in collectives by this engine's world, shard and replica
  /// communicators together (see CommCounters). Local.
  CommCounters comm_counters() const {
    if constexpr (requires(const Comm& c) { c.counters(); }) {
      CommCounters total = world_.counters();
      total += shard_comm_.counters();
      total += replica_comm_.counters();
      if (worker_shard_comm_) total += worker_shard_comm_->counters();      // the collective worker's all-gathers and reduce-scatters
      if (worker_replica_comm_) total += worker_replica_comm_->counters();  // ... and all-reduces
      return total;
    } else {
      return {};
    }
  }

  // ---- access for checkpointing (fsdp/io/checkpoint.hpp) ---------------------------------------

  /// The engine's own unit records (internal; tests only). Local.
  const std::vector<std::unique_ptr<detail::FlatUnit>>& flat_units() const noexcept { return units_; }

  /// The units with their flat layouts and this rank's shards. Local.
  std::vector<ShardedUnit> sharded_units() const {
    std::vector<ShardedUnit> out;
    out.reserve(units_.size());
    for (const auto& u : units_)
      out.push_back(
          {u->info.index, u->info.module_path, u->frozen, u->info.param_names, u->shapes, u->dtype, u->layout, shard_comm_.rank(), u->shard});
    return out;
  }

  /// The dtype buffer `name` is checkpointed in: its own, from before MixedPrecision::buffer_dtype.
  c10::ScalarType checkpoint_buffer_dtype(const std::string& name, const torch::Tensor& buffer) const {
    const auto it = buffer_dtypes_.find(name);
    return it == buffer_dtypes_.end() ? buffer.scalar_type() : it->second;
  }

  /// The core's plan the units were built from (units, ownership, layouts over the shard group). Local.
  const UnitPlan& unit_plan() const noexcept { return plan_; }

  /// Tied parameters: the name a parameter is stored under -> its other names.
  const std::map<std::string, std::vector<std::string>>& tied_parameter_aliases() const noexcept { return aliases_; }

  /// The padded flat tensor of unit `unit` assembled from each shard rank's `shard_like` (the shard
  /// itself, or an optimizer state of the same shape). Collective over the shard group.
  torch::Tensor gather_flat(int unit, const torch::Tensor& shard_like) {
    const auto& u = *units_.at(static_cast<std::size_t>(unit));
    auto src = shard_like.detach().to(compute_device_).contiguous();
    if (src.numel() != u.layout.shard_numel())
      throw ConfigError("gather_flat: unit " + std::to_string(unit) + " expects " + std::to_string(u.layout.shard_numel()) + " elements, got " +
                        std::to_string(src.numel()));
    if (u.layout.group_size() == 1) return src.clone();
    auto out = torch::empty({u.layout.padded_numel()}, src.options());
    shard_comm_.all_gather(src.data_ptr(), out.data_ptr(), u.layout.shard_numel(), detail::to_comm_dtype(src.scalar_type()));
    return out;
  }

  /// Hash of everything that decides which elements each rank holds: world size, shard group size,
  /// and every unit's parameters (names, shapes, dtypes). FULL_SHARD and SHARD_GRAD_OP at the same
  /// world size shard identically and share a plan hash. Local.
  std::uint64_t plan_hash() const {
    std::ostringstream os;
    os << "world=" << world_.size() << ";group=" << shard_comm_.size() << ";";
    for (const auto& u : units_) {
      os << "unit" << u->info.index << "@" << u->info.module_path << ":";
      for (std::size_t i = 0; i < u->params.size(); ++i) {
        os << u->info.param_names[i] << "[";
        for (auto d : u->shapes[i]) os << d << ",";
        os << "]" << c10::toString(u->dtype) << ";";
      }
    }
    return fnv1a64(os.str());
  }

 private:
  // ---- construction -------------------------------------------------------------------------

  void setup_groups() {
    const int requested = options_.shard_group_size;
    const bool needs_node = is_hybrid(options_.sharding_strategy) && requested == 0;
    const int group = fsdp::shard_group_size(options_.sharding_strategy, world_.size(), requested, needs_node ? node_size() : 1);
    const int r = world_.rank();
    shard_comm_ = world_.split(r / group, r);
    replica_comm_ = world_.split(r % group, r);
  }

  static bool comm_threads_may_call_concurrently() {
    if constexpr (requires { Comm::threads_may_call_concurrently(); })
      return Comm::threads_may_call_concurrently();
    else
      return true;
  }

  void setup_overlap() {
    const bool prefetch_wanted = options_.backward_prefetch != BackwardPrefetch::NO_PREFETCH || options_.forward_prefetch;
    if (options_.limit_all_gathers < 0) throw ConfigError("limit_all_gathers must be >= 0, got " + std::to_string(options_.limit_all_gathers));
    const bool prefetch = prefetch_wanted && shard_comm_.size() > 1;  // else nothing is all-gathered: nothing to overlap
    if (prefetch && !comm_threads_may_call_concurrently())
      throw ConfigError(
          "prefetching runs all-gathers on a worker thread: initialize MPI with MPI_THREAD_MULTIPLE "
          "(fsdp::MpiEnvironment(&argc, &argv, MPI_THREAD_MULTIPLE))");
    // A GPU communicator's collectives already run on their own stream: reductions stay as they are.
    const bool overlap_reduce = options_.overlap_grad_reduce && world_.size() > 1 && !comm_moves_device_memory<Comm>();
    if (overlap_reduce && !comm_threads_may_call_concurrently())
      throw ConfigError(
          "overlap_grad_reduce runs reductions on a worker thread: initialize MPI with MPI_THREAD_MULTIPLE "
          "(fsdp::MpiEnvironment(&argc, &argv, MPI_THREAD_MULTIPLE))");
    // Duplicates of the groups: the worker's collectives form their own sequence on every rank.
    // Every collective is issued in the same order everywhere, so both groups are split on all ranks.
    if (prefetch || (overlap_reduce && shard_comm_.size() > 1)) worker_shard_comm_.emplace(shard_comm_.split(0, shard_comm_.rank()));
    if (overlap_reduce && replica_comm_.size() > 1) worker_replica_comm_.emplace(replica_comm_.split(0, replica_comm_.rank()));
    // A GPU communicator overlaps on its own stream: the prefetch is a non-blocking collective issued
    // from this thread (one issuing order on every rank). MPI needs the worker thread.
    if constexpr (!comm_moves_device_memory<Comm>()) {
      if (prefetch || overlap_reduce) worker_ = std::make_unique<detail::CollectiveWorker>();
      // The worker runs beside the computing threads: waiting for a late peer must not take their core.
      if constexpr (requires(Comm & c) { c.set_waiting_yields_cpu(true); }) {
        if (worker_shard_comm_) worker_shard_comm_->set_waiting_yields_cpu(true);
        if (worker_replica_comm_) worker_replica_comm_->set_waiting_yields_cpu(true);
      }
      if (overlap_reduce)
        reductions_ = std::make_unique<detail::OverlappedReductions<Comm>>(
            *worker_, worker_shard_comm_ ? &*worker_shard_comm_ : nullptr, worker_replica_comm_ ? &*worker_replica_comm_ : nullptr, overlap_,
            [this](int unit, const torch::Tensor& shard_grad) { return to_master(*units_[static_cast<std::size_t>(unit)], shard_grad); });
    }
  }

  // Issues unit `index`'s all-gather on the worker if prefetching is on, the unit will need one and the
  // limit allows it. Every rank makes the same decision (same order, same state).
  // `for_backward`: only a unit whose backward is still to come (the root's gradients are reduced last,
  // after every nested unit's backward).
  void prefetch(int index, bool for_backward = false) {
    if (!worker_shard_comm_ || index <= 0) return;
    auto& u = *units_[static_cast<std::size_t>(index)];
    if (u.params.empty() || u.frozen || !u.needs_gather() || u.in_flight.valid()) return;
    if (for_backward && u.pending_backward <= 0) return;
    if (u.gathered && u.gathered_version == u.shard._version()) return;
    if (options_.limit_all_gathers > 0 && prefetched_ahead() >= options_.limit_all_gathers) return;
    gather(u, /*ahead=*/true);
  }

  int prefetched_ahead() const {
    int n = 0;
    for (const auto& u : units_) n += u->in_flight.valid() ? 1 : 0;
    return n;
  }

  // Waits for a prefetched all-gather of `u` (the exposed part of its communication).
  void finish_prefetch(detail::FlatUnit& u) {
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
    overlap_.exposed_all_gather_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  }

  // The unit that runs after `index` in `order` (+1) or before it (-1); -1 if none.
  static int neighbour(const std::vector<int>& order, int index, int direction) {
    const auto it = std::find(order.begin(), order.end(), index);
    if (it == order.end()) return direction < 0 && index == 0 && !order.empty() ? order.back() : -1;
    const auto pos = (it - order.begin()) + direction;
    return pos >= 0 && pos < static_cast<std::ptrdiff_t>(order.size()) ? order[static_cast<std::size_t>(pos)] : -1;
  }

  void resolve_compute_device() {
    std::optional<torch::Device> found;
    for (const auto& p : module_->parameters(/*recurse=*/true)) {
      found = p.device();
      break;
    }
    compute_device_ = options_.device ? *options_.device : found.value_or(torch::Device(torch::kCPU));
    if constexpr (comm_moves_device_memory<Comm>()) {
      if (!compute_device_.is_cuda())
        throw ConfigError("this communicator moves GPU memory, but the compute device is " + compute_device_.str() +
                          ": set FsdpOptions::device to a CUDA device (or use MpiComm for CPU training)");
    } else if (!compute_device_.is_cpu()) {
      throw ConfigError("the compute device is " + compute_device_.str() +
                        ", but this communicator moves host memory only (MpiComm): use NcclComm for GPUs (fsdp.backend = \"nccl\")");
    }
    bool deferred = false;
    for (const auto& p : module_->parameters(/*recurse=*/true)) deferred = deferred || detail::is_deferred(p);
    for (const auto& b : module_->buffers(/*recurse=*/true)) deferred = deferred || detail::is_deferred(b);
    if (deferred && !options_.param_init_fn)
      throw ConfigError(
          "the module has parameters or buffers released by fsdp::defer_init(): set FsdpOptions::param_init_fn to "
          "initialize them unit by unit");
    if (found && *found != compute_device_) {
      if (!deferred)
        module_->to(compute_device_);
      else if (!found->is_cpu())
        throw ConfigError("a module released by fsdp::defer_init() must be built on the CPU; it is moved unit by unit");
    }
  }

  // Memory-bounded construction: materializes meta tensors that `module` holds itself on the compute
  // device and runs param_init_fn on it with a seed of its own.
  void initialize_module(torch::nn::Module& module, const std::string& path) {
    torch::NoGradGuard no_grad;
    for (auto& p : module.named_parameters(/*recurse=*/false)) detail::restore_storage(p.value());
    for (auto& b : module.named_buffers(/*recurse=*/false)) detail::restore_storage(b.value());
    torch::manual_seed(fnv1a64(path, 14695981039346656037ull ^ options_.init_seed));
    options_.param_init_fn(module, path);
    for (auto& b : module.named_buffers(/*recurse=*/false))
      if (deferred_buffer_casts_.erase(detail::join_path(path, b.key())) > 0)
        b.value().set_data(b.value().to(*options_.mixed_precision.buffer_dtype));
    if (!compute_device_.is_cpu()) {  // built and initialized on the CPU, one module at a time
      for (auto& p : module.named_parameters(/*recurse=*/false)) p.value().set_data(p.value().to(compute_device_));
      for (auto& b : module.named_buffers(/*recurse=*/false)) b.value().set_data(b.value().to(compute_device_));
    }
  }

  int node_size() {
    if constexpr (requires(Comm c) { c.split_node(); }) {
      return world_.split_node().size();
    } else {
      return world_.size();
    }
  }

  bool reshard_after_forward() const { return options_.reshard_after_forward.value_or(reshard_after_forward_default(options_.sharding_strategy)); }

  void build_units() {
    // 0. The compute device: asked for, or where the parameters are; the module moves there.
    resolve_compute_device();
    // Mixed precision: check the dtypes; buffers move to buffer_dtype (their own dtype is kept for checkpoints).
    const auto& mp = options_.mixed_precision;
    for (const auto& dt : {mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype})
      if (dt && !c10::isFloatingType(*dt)) throw ConfigError(std::string("mixed precision dtypes must be floating point, got ") + c10::toString(*dt));
    if (mp.buffer_dtype) {
      torch::NoGradGuard no_grad;
      for (const auto& b : module_->named_buffers(/*recurse=*/true)) {
        if (!b.value().defined() || !b.value().is_floating_point() || b.value().scalar_type() == *mp.buffer_dtype) continue;
        buffer_dtypes_[b.key()] = b.value().scalar_type();
        if (detail::is_deferred(b.value()))
          deferred_buffer_casts_.insert(b.key());  // cast once initialized
        else
          b.value().set_data(b.value().to(*mp.buffer_dtype));
      }
    }

    // 1. The module tree in pre-order, described for the core's planner (a tensor's id is its
    //    index in `tensors`, so tied names share it).
    ModuleTree tree;
    std::vector<torch::nn::Module*> modules;
    std::vector<torch::Tensor> tensors;
    std::unordered_map<c10::TensorImpl*, std::int64_t> tensor_ids;
    std::function<void(torch::nn::Module&, const std::string&, int)> visit = [&](torch::nn::Module& m, const std::string& key, int parent) {
      const int id = tree.add_module(parent, key, module_type_name(m), module_full_type_name(m));
      modules.push_back(&m);
      for (const auto& p : m.named_parameters(/*recurse=*/false)) {
        const auto [it, fresh] = tensor_ids.emplace(p.value().unsafeGetTensorImpl(), static_cast<std::int64_t>(tensors.size()));
        if (fresh) tensors.push_back(p.value());
        tree.add_param(id, p.key(), p.value().sizes().vec(), it->second, !p.value().requires_grad());
      }
      for (const auto& child : m.named_children()) visit(*child.value(), child.key(), id);
    };
    visit(*module_, "", -1);

    // 2. Units, parameter ownership, frozen companions and layouts: decided by the core.
    const std::vector<const torch::nn::Module*> const_modules(modules.begin(), modules.end());
    plan_ = plan_units(tree, options_.auto_wrap_policy.rule(const_modules), shard_comm_.size());
    for (const auto& planned : plan_.units) {
      auto u = std::make_unique<detail::FlatUnit>();
      u->info.index = planned.index;
      u->info.parent = planned.parent;
      u->info.module_path = planned.path;
      u->info.type_name = planned.type_name;
      u->info.frozen = planned.frozen;
      u->frozen = planned.frozen;
      u->companion = planned.companion;
      u->module = modules[static_cast<std::size_t>(planned.module)];
      for (const auto& p : planned.params) {
        const auto& tensor = tensors[static_cast<std::size_t>(p.tensor_id)];
        if (tensor.device() != compute_device_ && !(options_.param_init_fn && tensor.is_cpu()))
          throw ConfigError("parameter '" + p.name + "' is on " + tensor.device().str() + ", the module's other parameters on " +
                            compute_device_.str() + ": move the whole module to one device (or set FsdpOptions::device)");
        u->params.push_back(tensor);
        u->info.param_names.push_back(p.name);
        u->shapes.push_back(p.shape);
        if (!p.aliases.empty()) aliases_[p.name] = p.aliases;
      }
      u->layout = planned.layout;
      units_.push_back(std::move(u));
    }

    const bool sync = options_.sync_module_states && world_.size() > 1;
    auto broadcast = [this](const torch::Tensor& t) {
      on_contiguous(t, [this](const torch::Tensor& c) { world_.broadcast(c.data_ptr(), c.numel(), detail::to_comm_dtype(c.scalar_type()), 0); });
    };
    // param_init_fn: the RNG of the caller is left as it was.
    std::optional<torch::Tensor> caller_rng;
    if (options_.param_init_fn) caller_rng = at::detail::getDefaultCPUGenerator().get_state();

    // 5. Flatten, shard, alias.
    const int group = shard_comm_.size();
    const int shard_rank = shard_comm_.rank();
    for (auto& up : units_) {
      auto& u = *up;
      // Memory-bounded construction: this unit's modules (not nested units') get their values now.
      if (options_.param_init_fn && !u.frozen)
        for (std::size_t id = 0; id < modules.size(); ++id)
          if (plan_.owner[id] == u.info.index) initialize_module(*modules[id], tree.modules[id].path);
      if (sync)
        for (auto& p : u.params) broadcast(p);
      for (std::size_t i = 0; i < u.params.size(); ++i)
        if (detail::is_deferred(u.params[i]))
          throw ConfigError("parameter '" + u.info.param_names[i] + "' is still released (fsdp::defer_init) when unit '" + u.info.module_path +
                            "' is flattened: it is tied to a module of another unit, which deferred initialization does not support; "
                            "wrap the tied modules into one unit or build them normally");
      u.info.numel = u.layout.numel();
      u.info.padded_numel = u.layout.padded_numel();
      u.info.shard_numel = u.layout.shard_numel();
      if (u.params.empty()) continue;
      const auto dtype = u.params.front().scalar_type();
      for (std::size_t i = 0; i < u.params.size(); ++i)
        if (u.params[i].scalar_type() != dtype)
          throw ConfigError("unit '" + u.info.module_path + "' mixes dtypes (" + u.info.param_names[i] + " is " +
                            c10::toString(u.params[i].scalar_type()) + ", expected " + c10::toString(dtype) + ")");
      u.dtype = dtype;
      const auto& mp = options_.mixed_precision;
      u.low_precision = mp.param_dtype && *mp.param_dtype != dtype;
      torch::NoGradGuard no_grad;
      auto full = torch::empty({u.layout.padded_numel()}, u.params.front().options().requires_grad(false));
      full.narrow(0, u.layout.numel(), u.layout.padding()).zero_();
      for (std::size_t i = 0; i < u.params.size(); ++i) {
        const auto i64 = static_cast<std::int64_t>(i);
        full.narrow(0, u.layout.param_offset(i64), u.layout.param_numel(i64)).copy_(u.params[i].detach().reshape({-1}));
      }
      u.offloaded = options_.offload_params && !compute_device_.is_cpu();
      if (u.offloaded) {  // the master shard in (pinned) host memory; `full` stays on the device
        auto host = detail::narrow_flat(full, u.layout.rank_range(shard_rank)).to(torch::kCPU).pin_memory();
        u.shard = host.requires_grad_(!u.frozen);
        u.full = full;
      } else if (group == 1) {
        u.shard = full.detach().requires_grad_(!u.frozen);
        u.full = u.shard.detach();  // same storage: nothing to gather
      } else {
        u.shard = detail::narrow_flat(full, u.layout.rank_range(shard_rank)).clone().requires_grad_(!u.frozen);
        u.full = full;
      }
      if (u.low_precision) u.full = full.to(*mp.param_dtype);  // its own storage, refilled by gather()
      u.gathered = true;
      u.point_params_at(u.full);
      for (const auto& p : u.params) u.param_views.push_back(p.data());  // shares `full`'s storage, also once freed
      reshard(u);
      if (!u.frozen) register_parameter("flat_shard_" + std::to_string(u.info.index), u.shard, /*requires_grad=*/true);
    }
    if (caller_rng) {
      at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the default generator
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(*caller_rng);
    }
    if (sync)
      for (auto& b : module_->buffers(/*recurse=*/true))
        if (b.defined() && b.numel() > 0) broadcast(b);
    for (auto& up : units_) {
      if (up->info.index == 0 || up->frozen) continue;
      detail::hook_registry()[up->module] = {this, up->info.index};
      if (options_.all_units_called_through_forward) up->hooked = detail::FlatUnit::Hooked::kYes;
    }
  }

  // ---- gather / reshard -----------------------------------------------------------------------

  // Allocates and fills `full`. A unit still gathered from a forward that had no backward is filled
  // again if the optimizer changed the shard since (its version counter moved).
  // With `ahead`, the all-gather is queued on the collective worker (a prefetch) and gather() returns
  // at once; a later gather() of the unit waits for it.
  void gather(detail::FlatUnit& u, bool ahead = false) {
    if (u.companion >= 0) gather(*units_[static_cast<std::size_t>(u.companion)], ahead);
    if (u.params.empty() || !u.needs_gather()) return;
    if (!ahead) finish_prefetch(u);
    if (u.gathered && u.gathered_version == u.shard._version()) return;
    if (!u.gathered) u.allocate_full();
    u.gathered_version = u.shard._version();
    torch::Tensor source = u.shard;
    if (u.low_precision || u.offloaded) {  // cast (and copy to the device) first: the all-gather moves these bytes
      torch::NoGradGuard no_grad;
      source = u.shard.detach().to(u.full.device(), u.full.scalar_type(), /*non_blocking=*/u.offloaded);
    }
    if (u.layout.group_size() == 1) {
      torch::NoGradGuard no_grad;
      u.full.copy_(source);
    } else if (ahead && !worker_) {  // a GPU communicator: a non-blocking all-gather on its stream
      ++overlap_.prefetched;
      auto request = std::make_shared<decltype(worker_shard_comm_->iall_gather(nullptr, nullptr, 0, DType::kFloat32))>(
          worker_shard_comm_->iall_gather(source.data_ptr(), u.full.data_ptr(), u.layout.shard_numel(), detail::to_comm_dtype(u.full.scalar_type())));
      u.in_flight = std::async(std::launch::deferred, [request, source] { request->wait(); }).share();  // runs in finish_prefetch
    } else if (ahead) {
      ++overlap_.prefetched;
      u.in_flight = worker_->submit([comm = &*worker_shard_comm_, source, out = u.full.data_ptr(), n = u.layout.shard_numel(),
                                     dt = detail::to_comm_dtype(u.full.scalar_type()), unit = u.info.index] {
        CollectiveWatchdog::instance().set_unit(unit);
        comm->all_gather(source.data_ptr(), out, n, dt);
        CollectiveWatchdog::instance().set_unit(-1);
      });
    } else {
      ++overlap_.gathered_on_demand;
      const auto began = std::chrono::steady_clock::now();
      CollectiveWatchdog::instance().set_unit(u.info.index);
      shard_comm_.all_gather(source.data_ptr(), u.full.data_ptr(), u.layout.shard_numel(), detail::to_comm_dtype(u.full.scalar_type()));
      CollectiveWatchdog::instance().set_unit(-1);
      overlap_.exposed_all_gather_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    }
    u.gathered = true;
    trace_gathered_bytes();
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

  void reshard(detail::FlatUnit& u) {
    finish_prefetch(u);  // the worker may still be writing into `full`
    if (u.companion >= 0) reshard(*units_[static_cast<std::size_t>(u.companion)]);
    if (!u.gathered || !u.needs_gather() || u.params.empty()) return;
    u.free_full();
    u.gathered = false;
    trace_gathered_bytes();
  }

  // Makes the module's parameters of `u` children of a fresh UnitGather node so backward reaches it.
  void graft(detail::FlatUnit& u) {
    if (u.params.empty() || u.frozen || !torch::GradMode::is_enabled()) return;
    auto views = detail::UnitGather::apply(u.shard, engine_id_, static_cast<std::int64_t>(u.info.index), &u);
    for (std::size_t i = 0; i < u.params.size(); ++i)
      torch::autograd::impl::set_gradient_edge(u.params[i], torch::autograd::impl::gradient_edge(views[i]));
    ++u.pending_backward;
  }

  // ---- forward / backward hooks ---------------------------------------------------------------

  void root_pre_forward() {
    end_of_backward_queued_ = false;          // a backward that threw never ran its end-of-backward callback
    if (reductions_) reductions_->discard();  // ... nor waited for its overlapped reductions: they must not reach a later step
    if (!forward_order_.empty()) previous_forward_order_ = std::move(forward_order_);
    forward_order_.clear();
    for (auto& u : units_) {
      u->entered = false;
      u->grafted_by_root = false;
    }
    // The root unit and every nested unit not known to be called through fsdp::forward (frozen
    // companions follow their unit).
    for (auto& u : units_) {
      if (u->frozen) continue;
      if (u->info.index != 0 && u->hooked == detail::FlatUnit::Hooked::kYes) continue;
      gather(*u);
      graft(*u);
      u->grafted_by_root = true;
    }
  }

  void root_post_forward(const std::vector<at::Tensor>& outputs, bool complete) {
    for (auto& u : units_)
      if (u->info.index != 0 && !u->frozen && u->hooked == detail::FlatUnit::Hooked::kUnknown && !u->entered)
        u->hooked = detail::FlatUnit::Hooked::kNo;
    if (is_training() && options_.sync_buffers) sync_buffers();
    bool hooked = false;
    if (torch::GradMode::is_enabled()) {
      for (const auto& t : outputs) {
        if (!t.requires_grad()) continue;
        const_cast<at::Tensor&>(t).register_hook([id = engine_id_](const at::Tensor&) { detail::live_engine(id).pre_backward(0); });
        hooked = true;
      }
    }
    if (!hooked && (complete || !torch::GradMode::is_enabled())) {
      // Nothing will run backward through this forward: free what the root gathered.
      for (auto& u : units_)
        if (u->grafted_by_root) reshard(*u);
    }
  }

  void pre_forward(int unit) override {
    auto& u = *units_[static_cast<std::size_t>(unit)];
    u.entered = true;
    if (Tracer::instance().enabled()) u.forward_began_us = Tracer::instance().now_us();
    if (u.hooked == detail::FlatUnit::Hooked::kUnknown) u.hooked = detail::FlatUnit::Hooked::kYes;
    gather(u);  // also when the root grafted it: a second call may follow a free after the first
    if (!u.grafted_by_root) graft(u);
    if (std::find(forward_order_.begin(), forward_order_.end(), unit) == forward_order_.end()) forward_order_.push_back(unit);
    if (options_.forward_prefetch) prefetch(neighbour(previous_forward_order_, unit, +1));
  }

  at::Tensor checkpoint_anchor(int unit) override {
    if (!options_.activation_checkpointing || unit == 0 || !torch::GradMode::is_enabled()) return {};
    const auto& u = *units_[static_cast<std::size_t>(unit)];
    if (u.params.empty() || !u.shard.requires_grad()) return {};
    return u.shard;
  }

  void post_forward(int unit, const std::vector<at::Tensor>& outputs, bool complete) override {
    auto& u = *units_[static_cast<std::size_t>(unit)];
    // On the first forward the root gathered and grafted this unit before it was known to be called
    // through fsdp::forward; from here on it is handled like any hooked unit.
    bool hooked = false;
    if (torch::GradMode::is_enabled()) {
      for (const auto& t : outputs) {
        if (!t.requires_grad()) continue;
        const_cast<at::Tensor&>(t).register_hook([id = engine_id_, unit](const at::Tensor&) { detail::live_engine(id).pre_backward(unit); });
        hooked = true;
      }
    }
    // Free now only if backward can gather again (through an output hook) or will never come.
    const bool backward_needs_params = torch::GradMode::is_enabled() && u.pending_backward > 0;
    // Without a pending backward (e.g. evaluation under NoGradGuard) keeping the unit gathered helps
    // nothing, whatever the strategy.
    if (!backward_needs_params || (reshard_after_forward() && hooked && complete)) reshard(u);
    trace_unit_span(u.forward_began_us, "forward ", u);
  }

  // Records [began, now) as "<what><unit name>" when tracing is on and the span began.
  static void trace_unit_span(std::int64_t& began_us, const char* what, const detail::FlatUnit& u) {
    auto& tracer = Tracer::instance();
    if (began_us < 0 || !tracer.enabled()) return;
    tracer.complete(what + u.trace_name(), what[0] == 'f' ? "forward" : "backward", began_us, tracer.now_us(), {{"unit", u.info.index}});
    began_us = -1;
  }

  void queue_end_of_backward() {
    if (end_of_backward_queued_) return;
    end_of_backward_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([id = engine_id_] {
      if (const auto it = detail::reducer_registry().find(id); it != detail::reducer_registry().end()) it->second->end_of_backward();
    });
  }

  void pre_backward(int unit) override {
    queue_end_of_backward();
    if (Tracer::instance().enabled()) units_[static_cast<std::size_t>(unit)]->backward_began_us = Tracer::instance().now_us();
    if (unit == 0) {
      for (auto& u : units_)
        if (u->grafted_by_root && (u->info.index == 0 || u->hooked != detail::FlatUnit::Hooked::kYes)) gather(*u);
    } else {
      gather(*units_[static_cast<std::size_t>(unit)]);
    }
    // The next unit to run backward is the one that ran before this one in forward.
    if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_PRE) prefetch(neighbour(forward_order_, unit, -1), /*for_backward=*/true);
  }

  torch::Tensor reduce_unit_grads(int unit, const torch::autograd::variable_list& grads) override {
    auto& u = *units_[static_cast<std::size_t>(unit)];
    // A backward that builds a graph (create_graph) needs the shard gradient from this node itself.
    const bool overlap = reductions_ && !torch::GradMode::is_enabled();
    if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST) prefetch(neighbour(forward_order_, unit, -1), /*for_backward=*/true);
    torch::NoGradGuard no_grad;
    auto flat = u.pack_grads(grads, compute_device_);
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
    const DType dt = detail::to_comm_dtype(flat.scalar_type());
    const bool sharded = u.layout.group_size() > 1;
    torch::Tensor shard_grad = sharded ? torch::empty({u.layout.shard_numel()}, flat.options()) : flat;
    if (overlap) {
      // The worker reduces while backward goes on; the shard's grad is set in end_of_backward, so
      // autograd gets no gradient for the shard here.
      queue_end_of_backward();
      reductions_->submit(unit, sharded, flat, shard_grad, dt);
      release_after_backward(u);
      trace_unit_span(u.backward_began_us, "backward ", u);
      return torch::Tensor();
    }
    ++overlap_.reductions_synchronous;
    CollectiveWatchdog::instance().set_unit(u.info.index);
    if (sharded) shard_comm_.reduce_scatter(flat.data_ptr(), shard_grad.data_ptr(), u.layout.shard_numel(), dt, ReduceOp::kAvg);
    if (replica_comm_.size() > 1) replica_comm_.all_reduce(shard_grad.data_ptr(), shard_grad.data_ptr(), shard_grad.numel(), dt, ReduceOp::kAvg);
    CollectiveWatchdog::instance().set_unit(-1);
    release_after_backward(u);
    trace_unit_span(u.backward_began_us, "backward ", u);
    return to_master(u, shard_grad);
  }

  // A reduced gradient in the master shard's dtype and memory (host when offloaded).
  static torch::Tensor to_master(const detail::FlatUnit& u, const torch::Tensor& shard_grad) {
    return shard_grad.scalar_type() == u.dtype && !u.offloaded ? shard_grad : shard_grad.to(u.shard.device(), u.dtype);
  }

  // AccumulateGrad's arithmetic for every unit reduced on the worker in this backward: set the
  // shard's grad, or add this backward's gradient to it, in the order the units finished.
  void finish_reductions() {
    if (!reductions_) return;
    torch::NoGradGuard no_grad;
    for (auto& [unit, grad] : reductions_->finish()) {
      auto& slot = units_[static_cast<std::size_t>(unit)]->shard.mutable_grad();
      if (slot.defined())
        slot.add_(grad);
      else
        slot = grad.detach();
    }
  }

  void release_after_backward(detail::FlatUnit& u) {
    if (--u.pending_backward <= 0) {
      u.pending_backward = 0;
      reshard(u);
    }
  }

  void end_of_backward() override {
    end_of_backward_queued_ = false;
    for (auto& u : units_) {
      u->pending_backward = 0;
      reshard(*u);
    }
    finish_reductions();
  }

  // Runs `collective` on `t`'s elements in a contiguous buffer (a copy when `t` is strided, written
  // back after): the collectives take flat memory, buffers and parameters may be views.
  template <class F>
  static void on_contiguous(const torch::Tensor& t, F&& collective) {
    torch::NoGradGuard no_grad;
    auto c = t.contiguous();
    collective(c);
    if (!c.is_same(t)) t.copy_(c);
  }

  void sync_buffers() {
    if (world_.size() == 1) return;
    for (auto& b : module_->buffers(/*recurse=*/true)) {
      if (!b.defined() || b.numel() == 0) continue;
      on_contiguous(b, [this](const torch::Tensor& c) {
        const DType dt = detail::to_comm_dtype(c.scalar_type());
        if (c.is_floating_point())
          world_.all_reduce(c.data_ptr(), c.data_ptr(), c.numel(), dt, ReduceOp::kAvg);
        else
          world_.broadcast(c.data_ptr(), c.numel(), dt, 0);
      });
    }
  }

  void end_summon(bool writeback, const std::vector<int>& gathered_here, const std::vector<torch::Tensor>& saved) {
    torch::NoGradGuard no_grad;
    for (auto& u : units_) {
      if (u->params.empty()) continue;
      if (u->summoned.defined()) {
        const auto s = u->layout.shard_numel();
        if (writeback) u->shard.detach().copy_(u->summoned.narrow(0, shard_comm_.rank() * s, s));
        // Back to the low-precision views (no view can be cut from `full` while its storage is freed).
        for (std::size_t i = 0; i < u->params.size(); ++i) u->params[i].set_data(u->param_views[i]);
        u->summoned = torch::Tensor();
      } else if (u->layout.group_size() == 1) {
        const auto& copy = saved[static_cast<std::size_t>(u->info.index)];
        if (!writeback && copy.defined()) u->shard.copy_(copy);
      } else if (writeback && u->gathered) {
        u->shard.copy_(detail::narrow_flat(u->full, u->layout.rank_range(shard_comm_.rank())));
      }
    }
    for (int i : gathered_here) reshard(*units_[static_cast<std::size_t>(i)]);
  }

  // ---- printing -------------------------------------------------------------------------------

  void print_module(std::ostream& os, const torch::nn::Module& m, const std::string& key, const std::string& path, int depth) const {
    const std::string indent(static_cast<std::size_t>(depth) * 2, ' ');
    os << indent;
    if (!key.empty()) os << "(" << key << "): ";
    m.pretty_print(os);
    for (const auto& u : units_) {
      if (u->module != &m) continue;
      os << "  [unit " << u->info.index << (u->info.index == 0 ? ", root" : "") << (u->frozen ? ", frozen" : "") << ": " << u->params.size()
         << " params, numel " << u->layout.numel() << ", padded " << u->layout.padded_numel() << ", shard " << u->layout.shard_numel();
      if (u->info.index != 0 && !u->frozen && u->hooked == detail::FlatUnit::Hooked::kNo)
        os << ", gathered with root (not called through fsdp::forward)";
      os << "]";
    }
    os << "\n";
    for (const auto& child : m.named_children()) print_module(os, *child.value(), child.key(), detail::join_path(path, child.key()), depth + 1);
  }

  std::shared_ptr<ModuleImpl> module_;
  Comm world_;
  Comm shard_comm_ = world_;
  Comm replica_comm_ = world_;
  FsdpOptions options_;
  torch::Device compute_device_{torch::kCPU};
  std::optional<Comm> worker_shard_comm_;                           // the worker's duplicate of the shard group
  std::optional<Comm> worker_replica_comm_;                         // the worker's duplicate of the replica group
  std::unique_ptr<detail::CollectiveWorker> worker_;                // runs prefetched all-gathers and overlapped reductions
  std::unique_ptr<detail::OverlappedReductions<Comm>> reductions_;  // ... and wait there until the end of backward
  std::vector<int> forward_order_;                                  // nested units in the order this step's forward ran them
  std::vector<int> previous_forward_order_;                         // ... and the previous forward's (forward prefetch)
  OverlapStats overlap_;
  std::vector<std::unique_ptr<detail::FlatUnit>> units_;
  std::map<std::string, std::vector<std::string>> aliases_;  // canonical name -> other names of tied parameters
  UnitPlan plan_;                                            // the core's decisions this engine's units were built from
  std::map<std::string, c10::ScalarType> buffer_dtypes_;     // buffers cast by MixedPrecision::buffer_dtype: their own dtype
  std::set<std::string> deferred_buffer_casts_;              // ... of those, released ones, cast after param_init_fn
  std::int64_t engine_id_ = 0;
  bool end_of_backward_queued_ = false;
  bool no_sync_ = false;
};

/// Wraps a module given as a ModuleHolder (torch::nn::Linear) or a std::shared_ptr<Impl>.
template <Communicator Comm, class ModulePtr>
auto make_fsdp(ModulePtr module, Comm comm, FsdpOptions options = {}) {
  using Impl = std::remove_reference_t<decltype(*module)>;
  std::shared_ptr<Impl> ptr;
  if constexpr (requires { module.ptr(); })
    ptr = module.ptr();
  else
    ptr = std::move(module);
  return std::make_shared<FullyShardedDataParallel<Impl, Comm>>(std::move(ptr), std::move(comm), std::move(options));
}

}  // namespace fsdp
